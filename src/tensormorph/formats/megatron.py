"""Megatron-Core `torch_dist` checkpoints: a DCP checkpoint plus `metadata.json` and `common.pt`.

`metadata.json` names the backend (`{"sharded_backend": "torch_dist", "sharded_backend_version": 1, ...}`)
and is written last, so its presence marks a finished save. The sharded tensors and ShardedObjects are
ordinary DCP items, read by the DCP reader. `common.pt` is rank 0's torch.save of the non-sharded state
(iteration, `args`, scheduler state...); each of its top-level keys becomes an object, read with the
allowlist unpickler: `args` (an argparse.Namespace) comes back as the dict of its attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

from .. import safe_pickle, torchzip
from ..core import Checkpoint, ObjectEntry
from ..errors import CheckpointError, HeaderError, MissingFileError, UnsafePickleError, UnsupportedError
from ..storage import AnyPath, ByteStore, store_at
from . import dcp
from .contract import Detection

NAME = "megatron-torch-dist"

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
MAX_CONFIG_BYTES = 1 << 20
SUPPORTED_BACKEND = "torch_dist"


class _Namespace(dict):
    """argparse.Namespace, rebuilt as the plain dict of its attributes."""

    def __setstate__(self, state: Any) -> None:
        if type(state) is not dict:
            raise HeaderError(f"argparse.Namespace state should be a dict, found {type(state).__name__}")
        self.update(state)


def _enum(name: str) -> Callable[[Any], str]:
    """An enum member pickled as `Class(value)`, shown as that text (its class is never imported)."""
    return lambda value: f"{name}({value!r})"


# What Megatron-LM's common.pt holds beyond plain data: `args` and the enums among its values.
COMMON_GLOBALS: safe_pickle.Globals = {
    ("argparse", "Namespace"): _Namespace,
    ("megatron.core.transformer.enums", "AttnBackend"): _enum("AttnBackend"),
}


def _folder(path: AnyPath) -> AnyPath:
    return path if path.is_dir() else path.parent


def detect(path: AnyPath) -> Detection | None:
    """The checkpoint folder, when its metadata.json names a sharded backend."""
    if not path.is_dir() and path.name not in (CONFIG_FILE, COMMON_FILE, dcp.METADATA_FILE):
        return None
    if not (_folder(path) / CONFIG_FILE).is_file():
        return None
    try:  # confined to the folder and capped, like every file a reader opens
        content = store_at(_folder(path)).read_json(CONFIG_FILE, MAX_CONFIG_BYTES, CONFIG_FILE)
    except CheckpointError:
        return None
    return Detection(path, _folder(path)) if isinstance(content, dict) and "sharded_backend" in content else None


def read_config(files: ByteStore) -> dict[str, Any]:
    """metadata.json, validated: the backend names and versions."""
    path = files.describe(CONFIG_FILE)
    config = files.read_json(CONFIG_FILE, MAX_CONFIG_BYTES, CONFIG_FILE)
    if not isinstance(config, dict) or not isinstance(config.get("sharded_backend"), str):
        raise HeaderError(f"should be an object with a string 'sharded_backend', found {str(config)[:80]!r}",
                          file=path)
    version = config.get("sharded_backend_version")
    if version is not None and (type(version) is not int or version < 0):
        raise HeaderError(f"sharded_backend_version should be a non-negative integer, found {version!r}", file=path)
    return config


def open(detection: Detection) -> Checkpoint:
    folder = detection.found or _folder(detection.path)
    config_files = store_at(folder)  # the DCP reader opens the checkpoint's own store below
    config = read_config(config_files)
    backend = config["sharded_backend"]
    if backend != SUPPORTED_BACKEND:
        raise UnsupportedError(f"the checkpoint uses Megatron-Core's {backend!r} backend; only "
                               f"{SUPPORTED_BACKEND!r} (a DCP checkpoint) is supported",
                               file=config_files.describe(CONFIG_FILE))
    checkpoint = dcp.open(Detection(folder))
    files = checkpoint.require_storage()
    common = _common_objects(files)
    for name in common:
        if name in checkpoint.objects or name in checkpoint.tensors:
            raise HeaderError(f"{COMMON_FILE} and the DCP items both hold {name!r}",
                              file=files.describe(COMMON_FILE), tensor=name)
    # megatron-core stores each ShardedObject as a DCP item holding the list of this rank's pieces of it
    sharded = {name: replace(entry, loader=partial(_one_piece, entry))
               for name, entry in checkpoint.objects.items()}
    metadata = {**config, **checkpoint.metadata, "common_file": COMMON_FILE}
    return replace(checkpoint, format=NAME, objects={**sharded, **common}, metadata=metadata)


def _one_piece(entry: ObjectEntry) -> Any:
    value = entry.value()
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _common_objects(files: ByteStore) -> dict[str, ObjectEntry]:
    """One object per top-level key of common.pt; when it cannot be read, one object whose value raises why."""
    path = files.describe(COMMON_FILE)
    if not files.exists(COMMON_FILE):
        raise MissingFileError("is missing; Megatron-Core writes the non-sharded state (iteration, args) there",
                               file=path)
    try:
        state = torchzip.load(files.buffer(COMMON_FILE), file=path, extra_globals=COMMON_GLOBALS)
    except CheckpointError as exc:
        return {COMMON_FILE: ObjectEntry(COMMON_FILE, files.size(COMMON_FILE), COMMON_FILE, loader=_raises(exc))}
    if not isinstance(state, dict):
        return {COMMON_FILE: ObjectEntry(COMMON_FILE, files.size(COMMON_FILE), COMMON_FILE,
                                         loader=lambda: _plain(state, COMMON_FILE, path))}
    return {str(key): ObjectEntry(str(key), None, COMMON_FILE, loader=partial(_plain, value, str(key), path))
            for key, value in state.items()}


def _raises(exc: CheckpointError) -> Callable[[], Any]:
    def load() -> Any:
        raise exc

    return load


def _plain(value: Any, name: str, path: str) -> Any:
    if not safe_pickle.is_plain(value):
        raise UnsafePickleError(f"holds a {type(value).__name__}, which is not plain data", file=path, tensor=name)
    return value


def checksum_problems(checkpoint: Checkpoint) -> Iterator[tuple[str, CheckpointError | None]]:
    """The CRC-32s of every DCP item's zip records, then of common.pt's."""
    yield from dcp.checksum_problems(checkpoint)
    files = checkpoint.require_storage()
    try:
        torchzip.check_crc(files.buffer(COMMON_FILE), file=files.describe(COMMON_FILE))
    except CheckpointError as exc:
        yield COMMON_FILE, exc
    else:
        yield COMMON_FILE, None
