"""Opening a Flax msgpack file (or the one `*.msgpack` file of a folder) as a checkpoint, or the shards a
`*.msgpack.index.json` names (sharded.py)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from ... import dtypes
from ...core import Checkpoint, Chunk, LogicalTensor, MappedArray, ObjectEntry, in_memory
from ...errors import HeaderError, UnsupportedError
from ...geometry import flat_boxes
from ...storage import AnyPath, ByteStore, entries, probe, store_at
from ..contract import Detection, no_checksums
from .sharded import INDEX_SUFFIX, index_at, open_sharded
from .walk import _LISTS, _MAPS, ArrayLeaf, ChunkedLeaf, UnknownExt, ValueLeaf, Walk

NAME = "flax_msgpack"
SUFFIX = ".msgpack"
_KEYS = {0xC4, 0xC5, 0xC6, 0xD9, 0xDA, 0xDB, *range(0xA0, 0xC0)}  # str and bin headers: a map key Flax writes

checksum_problems = no_checksums  # msgpack records no checksums; opening checks structure and sizes


def _plausible(head: bytes) -> bool:
    """A map whose first key (if any) is a string: every state dict Flax writes starts so."""
    if not head or head[0] not in _MAPS:
        return False
    if head[0] == 0x80:
        return True
    key = 1 + _MAPS[head[0]]
    return len(head) > key and head[key] in _KEYS


def _candidate(path: AnyPath) -> AnyPath | None:
    if path.is_dir():
        found: list[AnyPath] = entries(path, f"*{SUFFIX}")
        path = found[0] if len(found) == 1 else path
    if not path.name.endswith(SUFFIX):
        return None
    head, size = probe(path, 8)
    return path if size > 0 and _plausible(head) else None


def detect(path: AnyPath) -> Detection | None:
    """A `*.msgpack` file starting with a map keyed by strings, or a folder holding exactly one; or a sharded
    checkpoint's `*.msgpack.index.json`, or a folder holding exactly one."""
    found = index_at(path) or _candidate(path)
    return Detection(path, found) if found is not None else None


def open(detection: Detection) -> Checkpoint:
    path = detection.found or detection.path
    index = path if path.name.endswith(INDEX_SUFFIX) else index_at(path) if path.is_dir() else None
    if index is not None:
        return open_sharded(index, read_file)
    if path.is_dir():
        found: list[AnyPath] = entries(path, f"*{SUFFIX}")
        if len(found) != 1:
            raise HeaderError(f"expected exactly one {SUFFIX} file in the folder, found {len(found)}", file=str(path))
        path = found[0]
    files = store_at(path.parent)
    tensors, objects = read_file(files, path.name)
    metadata: dict[str, Any] = {"arrays": len(tensors), "other_leaves": len(objects)}
    return Checkpoint(path=path, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=(path.name,), storage=files)


def read_file(files: ByteStore, file: str) -> tuple[dict[str, LogicalTensor], dict[str, ObjectEntry]]:
    """The tensors and objects of one msgpack file of `files`, by dotted name."""
    where = files.describe(file)
    size = files.size(file)
    head = files.read(file, 0, min(size, 8))
    if not head or head[0] not in _MAPS:
        kind = "an empty file" if not head else ("a list" if head[0] in _LISTS else f"a value (byte 0x{head[0]:02x})")
        raise HeaderError(f"starts with {kind}; a Flax state dict is a msgpack map", file=where)
    walk = Walk(files.buffer(file), size, where)
    tensors: dict[str, LogicalTensor] = {}
    objects: dict[str, ObjectEntry] = {}
    for keys, leaf in walk.leaves.items():
        name = ".".join(keys)
        if name in tensors or name in objects:
            raise HeaderError("names two leaves once their keys are joined with dots", file=where, tensor=name)
        if isinstance(leaf, ArrayLeaf):
            tensors[name] = LogicalTensor(name, leaf.dtype, leaf.shape, (_chunk(files, file, leaf),))
        elif isinstance(leaf, ChunkedLeaf):
            tensors[name] = _chunked(files, file, name, leaf)
        elif isinstance(leaf, UnknownExt):
            objects[name] = ObjectEntry(name, leaf.nbytes, file, loader=partial(_unknown, name, leaf.code, where))
        else:
            assert isinstance(leaf, ValueLeaf)
            objects[name] = ObjectEntry(name, leaf.nbytes, file, in_memory(leaf.value))
    return tensors, objects


def _chunk(files: ByteStore, file: str, leaf: ArrayLeaf) -> Chunk:
    return Chunk((0,) * len(leaf.shape), leaf.shape, file, (leaf.begin, leaf.end),
                 MappedArray(files, file, leaf.begin, dtypes.numpy_dtype(leaf.dtype), leaf.shape))


def _chunked(files: ByteStore, file: str, name: str, leaf: ChunkedLeaf) -> LogicalTensor:
    """Flax's flat chunks of one array: each cut at row edges into boxes (flat_boxes), each a view of the file."""
    numpy_dtype = dtypes.numpy_dtype(leaf.dtype)
    chunks, start = [], 0
    for piece in leaf.pieces:
        count = piece.shape[0]
        for offsets, box, flat in flat_boxes(leaf.shape, start, start + count):
            at = piece.begin + (flat - start) * numpy_dtype.itemsize
            chunks.append(Chunk(offsets, box, file, (at, at + math.prod(box) * numpy_dtype.itemsize),
                                MappedArray(files, file, at, numpy_dtype, box)))
        start += count
    return LogicalTensor(name, leaf.dtype, leaf.shape, tuple(chunks))


def _unknown(name: str, code: int, where: str) -> Any:
    raise UnsupportedError(f"is a msgpack ext of type {code}, which Flax does not define", file=where, tensor=name)
