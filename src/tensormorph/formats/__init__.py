"""Format readers: one module (or package) per format, each keeping the contract in `contract.py`.

READERS is the one ordered registry: detection tries them in this order, so specific formats win over
generic ones (a Megatron folder is also a DCP folder; a folder of safetensors files with an index is
also a folder of safetensors files). Adding a format means adding its module and one line here.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import DEFAULT_READ_BUDGET, Checkpoint
from ..errors import CheckpointError, MissingFileError, UnknownFormatError, UnsupportedError
from ..gc_pause import gc_paused
from ..storage import AnyPath, RemotePath, as_path
from . import (
    dcp,
    dcp_safetensors,
    deepspeed,
    deepspeed_universal,
    flax_msgpack,
    gguf,
    hf_sharded,
    megatron,
    orbax,
    safetensors,
    tensormorph,
    torch_pickle,
)
from .contract import Detection, FormatReader

if TYPE_CHECKING:  # the range cache loads only for remote checkpoints
    from ..storage.range_cache import RangeCache

READERS: tuple[FormatReader, ...] = (
    megatron,  # before dcp: the same files, with more to show
    tensormorph,
    dcp,
    dcp_safetensors,
    deepspeed,  # before the plain torch reader, which would see only one file
    deepspeed_universal,  # a save folder holding both opens as the ZeRO checkpoint; this one by its own folder
    hf_sharded,
    safetensors,
    gguf,  # after the Hugging Face layouts: a model folder often holds a .gguf export beside them
    orbax,
    flax_msgpack,  # a *.msgpack file, or a folder holding only one (after the HF layouts: an HF Flax folder)
    torch_pickle,
)
BY_NAME: dict[str, FormatReader] = {reader.NAME: reader for reader in READERS}


def _detect(path: AnyPath) -> tuple[FormatReader, Detection] | None:
    """The first reader that recognises `path`. A reader that would need a listing the store cannot give (HTTP) is
    passed over; when no other reader recognises the path, that is the error to report."""
    unlisted: UnsupportedError | None = None
    for reader in READERS:
        try:
            found = reader.detect(path)
        except UnsupportedError as exc:
            unlisted = unlisted or exc
            continue
        if found is not None:
            return reader, found
    if unlisted is not None:
        raise unlisted
    return None


def detect(path: str | Path | RemotePath, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The format name of the checkpoint at `path` (a local path or a URL), judged by content; None when unknown."""
    found = _detect(as_path(path, storage_options))
    return found[0].NAME if found is not None else None


def reader_of(checkpoint: Checkpoint) -> FormatReader:
    """The reader that opened `checkpoint`."""
    return BY_NAME[checkpoint.format]


def open_checkpoint(path: str | Path | RemotePath, format: str | None = None, *,
                    read_budget: int = DEFAULT_READ_BUDGET, storage_options: dict[str, Any] | None = None,
                    cache: str | Path | bool | RangeCache | None = None) -> Checkpoint:
    """Open a checkpoint file or folder as one logical checkpoint (`tensormorph.open`).

    `path` is a local path or a URL (s3://, gs://, az://, memory://, https://, any fsspec protocol); fsspec's
    `storage_options` (credentials, endpoint) pass through to its client. Remote bytes are kept in the on-disk
    range cache: `cache` is its folder, True for the default one (see range_cache), False for none; None takes what
    `storage.remote_options` set (the default folder unless it says otherwise)."""
    path = as_path(path, storage_options, cache)
    if isinstance(path, Path):
        _check_local(path)
    elif not path.is_file() and (path.remote.is_http and "." in path.name or not path.exists()):
        # HTTP cannot tell a folder from a missing file: a name with a suffix was meant as a file
        raise MissingFileError("no such object or folder", file=str(path))
    if format is not None:
        if format not in BY_NAME:
            raise UnknownFormatError(f"unknown format {format!r}; known: {', '.join(BY_NAME)}", file=str(path))
        reader, detection = BY_NAME[format], Detection(path)
    else:
        found = _detect(path)
        if found is None:
            raise UnknownFormatError(
                f"not a checkpoint any reader recognises (known formats: {', '.join(BY_NAME)})", file=str(path))
        reader, detection = found
    try:
        with gc_paused():
            checkpoint = reader.open(detection)
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError("structure is nested too deeply to read", file=str(path)) from None
    if read_budget != DEFAULT_READ_BUDGET:
        checkpoint = replace(checkpoint,
                             tensors={n: t.with_budget(read_budget) for n, t in checkpoint.tensors.items()})
    return checkpoint


def _check_local(path: Path) -> None:
    if not path.exists():
        raise MissingFileError("no such file or folder", file=str(path))
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise CheckpointError("cannot be read: permission denied", file=str(path))


def opened(source: str | Path | Checkpoint, stack: ExitStack) -> Checkpoint:
    """`source` itself when already open, else opened from its path and closed when `stack` unwinds."""
    return source if isinstance(source, Checkpoint) else stack.enter_context(open_checkpoint(source))
