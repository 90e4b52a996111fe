"""One safetensors file: `u64 header length`, a JSON header, then raw data."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from .. import dtypes
from ..core import MAX_DIM, Checkpoint, Chunk, LogicalTensor, MappedArray
from ..errors import HeaderError, TruncatedFileError
from ..storage import ByteStore, LocalFiles, MappableStore
from .contract import Detection, no_checksums

NAME = "safetensors"

MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor record of a safetensors header, with absolute byte offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    file: str
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int


def looks_like_safetensors(path: Path) -> bool:
    """True when the file starts with a plausible header length followed by '{'."""
    try:
        with path.open("rb") as f:
            head = f.read(9)
            size = f.seek(0, 2)
    except OSError:
        return False
    return _plausible(head, size)


def holds_safetensors(files: MappableStore, name: str) -> bool:
    """`looks_like_safetensors` for a file of a store (its first page, mapped)."""
    try:
        buffer = files.buffer(name)
    except OSError:
        return False
    return _plausible(bytes(buffer[:9]), len(buffer))


def _plausible(head: bytes, size: int) -> bool:
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return length <= min(MAX_HEADER_BYTES, size - 8)


def read_header(files: ByteStore, name: str) -> Header:
    """Parse and validate one file's header; every problem is a HeaderError naming the file."""
    path = files.describe(name)
    size, length, raw = files.read_prefixed(name, MAX_HEADER_BYTES)
    if size < 8:
        raise TruncatedFileError(f"is {size} bytes long; a safetensors file starts with an 8-byte header length",
                                 file=path)
    if length > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {length} exceeds the limit of {MAX_HEADER_BYTES} bytes", file=path)
    if length > size - 8:
        raise TruncatedFileError(f"header length {length} runs past the end of the {size}-byte file", file=path)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: e.g. a 5000-digit integer
        raise HeaderError(f"header is not valid UTF-8 JSON: {exc}", file=path) from None
    if not isinstance(header, dict):
        raise HeaderError(f"header must be a JSON object, found {type(header).__name__}", file=path)
    data_start = 8 + length
    data_len = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise HeaderError("__metadata__ must map strings to strings", file=path)
    entries: dict[str, Entry] = {}
    for tensor, info in header.items():
        entries[tensor] = _entry(path, tensor, info, data_start, data_len)
    spans = sorted((e.begin, e.end, e.name) for e in entries.values() if e.end > e.begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise HeaderError(f"the data of {n0!r} [{b0 - data_start}, {e0 - data_start}) and "
                              f"{n1!r} [{b1 - data_start}, {e1 - data_start}) overlap", file=path)
    return Header(name, entries, metadata, data_start)


def _entry(path: str, tensor: str, info: object, data_start: int, data_len: int) -> Entry:
    # Plain loops and `type(...) is int` (which also excludes bool): this runs once per tensor on open.
    if type(info) is not dict:
        raise HeaderError("header entry must be an object with dtype, shape, data_offsets", file=path, tensor=tensor)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(dtype) is not str or dtype not in dtypes.NUMPY_DTYPES:
        raise HeaderError(f"unknown dtype {dtype!r}; expected one of {', '.join(dtypes.NUMPY_DTYPES)}",
                          file=path, tensor=tensor)
    numpy_dtype = dtypes.NUMPY_DTYPES[dtype]
    numel = 1
    if type(shape) is list:
        for d in shape:
            if type(d) is not int or not 0 <= d < MAX_DIM:
                numel = -1
                break
            numel *= d
    if type(shape) is not list or numel < 0:
        raise HeaderError(f"shape must be a list of integers in [0, 2**62), found {shape!r}", file=path, tensor=tensor)
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
            or type(offsets[1]) is not int or not 0 <= offsets[0] <= offsets[1]):
        raise HeaderError(f"data_offsets must be [begin, end] with 0 <= begin <= end, found {offsets!r}",
                          file=path, tensor=tensor)
    begin, end = offsets
    expected = numel * numpy_dtype.itemsize
    if end - begin != expected:
        raise HeaderError(f"holds {end - begin} bytes, but shape {shape} of {dtype} needs {expected}",
                          file=path, tensor=tensor)
    if end > data_len:
        raise TruncatedFileError(f"data ends at byte {end} of the data section, but the file holds only {data_len}",
                                 file=path, tensor=tensor)
    return Entry(tensor, dtype, tuple(shape), data_start + begin, data_start + end)


def whole_chunk(files: MappableStore, entry: Entry, file: str, *, offsets: tuple[int, ...] | None = None,
                ranks: tuple[int, ...] = ()) -> Chunk:
    """A chunk for one header entry, placed at `offsets` of its logical tensor (origin by default)."""
    return Chunk(
        offsets=offsets if offsets is not None else (0,) * len(entry.shape),
        shape=entry.shape,
        file=file,
        byte_range=(entry.begin, entry.end),
        source=MappedArray(files, file, entry.begin, dtypes.numpy_dtype(entry.dtype), entry.shape),
        ranks=ranks,
    )


def detect(path: Path) -> Detection | None:
    """The one .safetensors file at `path` (itself, or the only one in a folder)."""
    if path.is_dir():
        candidates = list(path.glob("*.safetensors"))
        found = candidates[0] if len(candidates) == 1 and looks_like_safetensors(candidates[0]) else None
    else:
        found = path if looks_like_safetensors(path) else None
    return Detection(path, found) if found is not None else None


checksum_problems = no_checksums  # safetensors records no checksums


def open(detection: Detection) -> Checkpoint:
    path = file_path = detection.found or detection.path
    if path.is_dir():
        candidates = sorted(path.glob("*.safetensors"))
        if len(candidates) != 1:
            raise HeaderError(f"expected exactly one .safetensors file in the folder, found {len(candidates)}",
                              file=str(path))
        file_path = candidates[0]
    files: MappableStore = LocalFiles(file_path.parent)
    header = read_header(files, file_path.name)
    tensors = {
        e.name: LogicalTensor(e.name, e.dtype, e.shape, (whole_chunk(files, e, file_path.name),))
        for e in header.entries.values()
    }
    return Checkpoint(path=file_path, format=NAME, tensors=tensors, metadata=dict(header.metadata),
                      files=(file_path.name,), storage=files)
