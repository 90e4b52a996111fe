"""PyTorch pickle checkpoints (.bin, .pt, .pth in torch.save's zip format), read without torch.

What a file declares is bounded by its size, so reading it costs at most a fixed multiple of its bytes:
- Expanded views (a tensor whose strides address fewer bytes than it holds: stride 0, as
  `torch.zeros(1).expand(n)` saves it, or overlapping strides) are read bit-exactly, as torch.load returns
  them, up to torchzip.MAX_EXPANDED_BYTES (64 MiB) of such tensors per file; beyond that the file is refused
  with UnsupportedError naming the tensor, its shape and strides. Transposes, slices with steps and size-1
  dimensions of stride 0 (an `expand((1, -1))` buffer) address as many bytes as they hold: unaffected.
- Tied weights name one storage several times (T5 names its embedding three times); the tensors of a file
  may add up to torchzip.MAX_REUSE_FACTOR times its size, plus MAX_EXPANDED_BYTES, so a pickle cannot name one big
  storage millions of times.
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Iterator
from typing import IO, Any

import numpy as np

from .. import dtypes, torchzip
from ..core import Checkpoint, Chunk, LogicalTensor, MappedArray, ObjectEntry, in_memory
from ..errors import CheckpointError, ChecksumError, HeaderError
from ..storage import AnyPath, ByteStore, RemotePath, entries, open_regular, store_at
from .contract import Detection

NAME = "torch"

SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# torch.save's legacy format starts with a pickled magic number (0x1950a86a20f9469cfc6c).
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def looks_like_torch(path: AnyPath) -> bool:
    if isinstance(path, RemotePath):  # read lazily: only the zip directory's blocks are fetched
        return path.is_file() and holds_torch_save(path.parent.store(), path.name)
    try:
        fd = open_regular(path)  # a FIFO would wait for a writer for ever
    except (OSError, CheckpointError):
        return False
    with os.fdopen(fd, "rb") as f:
        try:
            return _is_torch_save(f)
        except OSError:
            return False


def holds_torch_save(files: ByteStore, name: str) -> bool:
    """`looks_like_torch` for a file of a store (read through its map: only the pages zipfile touches)."""
    try:
        return _is_torch_save(torchzip.BufferFile(files.buffer(name)))
    except (OSError, CheckpointError):
        return False


def _is_torch_save(f: IO[bytes] | io.RawIOBase) -> bool:
    head = f.read(len(LEGACY_MAGIC)) or b""
    if head.startswith(LEGACY_MAGIC):
        return True
    if not torchzip.is_torch_zip(head):
        return False
    try:
        with zipfile.ZipFile(f) as archive:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in archive.namelist())
    except Exception:  # detection must not fail: zipfile raises many types on odd input
        return False


def _single_file(path: AnyPath) -> AnyPath | None:
    if not path.is_dir():
        return path
    candidates = [p for p in entries(path) if p.suffix in SUFFIXES and p.is_file()]
    return candidates[0] if len(candidates) == 1 else None


def detect(path: AnyPath) -> Detection | None:
    """The one torch.save file at `path` (itself, or the only one in a folder)."""
    file = _single_file(path)
    return Detection(path, file) if file is not None and looks_like_torch(file) else None


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, leaf) pairs of a nested dict/list tree; tensors and plain values are leaves."""
    if isinstance(value, dict) and value:
        for key, child in value.items():
            yield from flatten(child, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)) and value and any(_has_tensor(v) for v in value):
        for i, child in enumerate(value):
            yield from flatten(child, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, value


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torchzip.TensorRef):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def tensor_chunk(files: ByteStore, file: str, ref: torchzip.TensorRef, *, base: int = 0,
                 offsets: tuple[int, ...] | None = None, ranks: tuple[int, ...] = ()) -> Chunk:
    """A memory-mapped chunk for a tensor of an archive that starts at byte `base` of `file`."""
    dtype = np.dtype(dtypes.numpy_dtype(ref.dtype))
    begin, end = ref.byte_span
    strides = None if ref.is_contiguous else ref.stride
    return Chunk(
        offsets=offsets if offsets is not None else (0,) * len(ref.shape),
        shape=ref.shape,
        file=file,
        byte_range=(base + begin, base + end),
        source=MappedArray(files, file, base + ref.offset, dtype, ref.shape, strides),
        ranks=ranks,
    )


def read_file(files: ByteStore, file: str) -> tuple[dict[str, LogicalTensor], dict[str, ObjectEntry]]:
    """The tensors and plain objects of one torch.save file, by dotted name."""
    buffer, path = files.buffer(file), files.describe(file)
    tree = torchzip.load(buffer, file=path, check_expansion=False)  # checked below, by tensor name
    expansion, reuse = torchzip.ExpansionBudget(path), torchzip.ReuseBudget(path, len(buffer))
    tensors: dict[str, LogicalTensor] = {}
    objects: dict[str, ObjectEntry] = {}
    for name, leaf in flatten(tree):
        if isinstance(leaf, torchzip.TensorRef):
            expansion.charge(leaf, name)
            reuse.charge(leaf, name)
            tensors[name] = LogicalTensor(name, leaf.dtype, leaf.shape, (tensor_chunk(files, file, leaf),))
        else:
            objects[name] = ObjectEntry(name, None, file, loader=in_memory(leaf))
    return tensors, objects


def checksum_problems(checkpoint: Checkpoint) -> Iterator[tuple[str, CheckpointError | None]]:
    """Check the CRC-32 of every record of every torch.save file of the checkpoint."""
    files = checkpoint.require_storage()
    for file in checkpoint.files:
        buffer = files.buffer(file)
        if not torchzip.is_torch_zip(bytes(buffer[:4])):
            continue
        path = files.describe(file)
        try:
            torchzip.check_crc(buffer, file=path)
        except ChecksumError as exc:
            yield file, ChecksumError(exc.reason, file=path, tensor=_tensor_on_record(buffer, path, exc.record),
                                      record=exc.record)
        except CheckpointError as exc:
            yield file, exc
        else:
            yield file, None


def _tensor_on_record(buffer: torchzip.Sliceable, path: str, record: str) -> str | None:
    """The first tensor stored in the damaged record, so the report can name it."""
    for name, leaf in flatten(torchzip.load(buffer, file=path, check_expansion=False)):
        if isinstance(leaf, torchzip.TensorRef) and record.endswith(f"data/{leaf.storage.key}"):
            return name
    return None


def open(detection: Detection) -> Checkpoint:
    path = detection.path
    file_path = detection.found or _single_file(path)
    if file_path is None:
        raise HeaderError(f"expected exactly one of {', '.join(SUFFIXES)} in the folder", file=str(path))
    files = store_at(file_path.parent)
    tensors, objects = read_file(files, file_path.name)
    return Checkpoint(path=file_path, format=NAME, tensors=tensors, objects=objects,
                      files=(file_path.name,), storage=files)
