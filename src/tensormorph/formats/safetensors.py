"""One safetensors file: `u64 header length`, a JSON header, then raw data.

The header is validated as the reference library (safetensors' `Metadata::validate`) validates it: the
tensors' byte ranges, sorted, are contiguous from 0 to the end of the file, each exactly its dtype and shape's
size; `__metadata__` is absent, null or an object of strings; a field of an entry may not repeat, nor may
`__metadata__`; NaN, Infinity and numbers out of a double's range are not JSON. Stricter than the library:
a tensor name may not repeat either (the library keeps the last), an entry is an object (not its fields in a
list), and dimensions stay below 2**62 (numpy's limit).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from .. import dtypes
from ..core import Checkpoint, Chunk, LogicalTensor, MappedArray
from ..errors import CheckpointError, HeaderError, TruncatedFileError
from ..shapes import check_shape, describe
from ..storage import AnyPath, ByteStore, entries, parse_json, probe, store_at
from .contract import Detection, no_checksums

NAME = "safetensors"

MAX_HEADER_BYTES = 100_000_000  # the reference library's MAX_HEADER_SIZE (its JSON values: storage.MAX_JSON_VALUES)
MAX_NUMEL = 2**64  # elements of a tensor and its data offsets: the reference reads them as usize (checked_mul)
FIELDS = ("dtype", "shape", "data_offsets")  # of a tensor entry: the reference refuses one given twice


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


def looks_like_safetensors(path: AnyPath) -> bool:
    """True when `path` is a regular file that starts with a plausible header length followed by '{'."""
    return _plausible(*probe(path, 9))


def holds_safetensors(files: ByteStore, name: str) -> bool:
    """`looks_like_safetensors` for a file of a store (its first page, mapped)."""
    try:
        buffer = files.buffer(name)
    except (OSError, CheckpointError):
        return False
    return _plausible(bytes(buffer[:9]), len(buffer))


def _plausible(head: bytes, size: int) -> bool:
    if len(head) < 9 or head[8:9] != b"{":
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return length <= min(MAX_HEADER_BYTES, size - 8)


class _Repeating(dict):
    """A JSON object that repeats keys: json keeps the last value of each; `repeated` lists them in file order."""

    __slots__ = ("repeated",)
    repeated: list[str]


def _object(pairs: list[tuple[str, Any]]) -> dict:
    """object_pairs_hook: the object, marked when it repeats a key (where that is an error depends on where it is)."""
    found = dict(pairs)
    if len(found) == len(pairs):
        return found
    marked, seen = _Repeating(found), set()
    marked.repeated = []
    for key, _ in pairs:
        if key in seen:
            marked.repeated.append(key)
        seen.add(key)
    return marked


def _int(text: str) -> int | float:
    """parse_int as serde_json reads a number: beyond 64 bits it is a double (not an integer), and "-0" too."""
    value = int(text)
    if -2**63 <= value < 2**64 and text != "-0":
        return value
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"number {text[:20]}... is out of range") from None


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: Python reads infinity, the reference refuses it
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _not_json(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def _text(value: str) -> bool:
    """Whether a decoded string is text (no lone surrogate from a \\ud800-style escape, which the reference refuses)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_header(files: ByteStore, name: str) -> Header:
    """Parse and validate one file's header; every problem is a HeaderError naming the file, except data that the
    file is too short to hold (TruncatedFileError)."""
    path = files.describe(name)
    size, length, raw = files.read_prefixed(name, MAX_HEADER_BYTES)
    if size < 8:
        raise TruncatedFileError(f"is {size} bytes long; a safetensors file starts with an 8-byte header length",
                                 file=path)
    if length > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {length} exceeds the limit of {MAX_HEADER_BYTES} bytes", file=path)
    if length > size - 8:
        raise TruncatedFileError(f"header length {length} runs past the end of the {size}-byte file", file=path)
    header = parse_json(raw, "header", path, object_pairs_hook=_object, parse_int=_int, parse_float=_float,
                        parse_constant=_not_json)
    if not isinstance(header, dict):
        raise HeaderError(f"header must be a JSON object, found {type(header).__name__}", file=path)
    if isinstance(header, _Repeating):
        key = header.repeated[0]
        raise HeaderError("header repeats __metadata__" if key == "__metadata__" else
                          "header names the tensor twice", file=path, tensor=None if key == "__metadata__" else key)
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(type(k) is str and type(v) is str and _text(k) and _text(v)
                                                 for k, v in metadata.items()):
        raise HeaderError("__metadata__ must map strings to strings", file=path)
    data_start = 8 + length
    entries = {tensor: _entry(path, tensor, info, data_start) for tensor, info in header.items()}
    del header  # the parsed JSON: the entries hold what is needed of it
    _check_layout(path, entries, data_start, size)
    return Header(name, entries, dict(metadata), data_start)


def _entry(path: str, tensor: str, info: object, data_start: int) -> Entry:
    # Plain loops and `type(...) is int` (which also excludes bool): this runs once per tensor on open.
    if not isinstance(info, dict):
        raise HeaderError("header entry must be an object with dtype, shape, data_offsets", file=path, tensor=tensor)
    if isinstance(info, _Repeating) and any(key in FIELDS for key in info.repeated):
        raise HeaderError(f"header entry repeats the field {next(k for k in info.repeated if k in FIELDS)!r}",
                          file=path, tensor=tensor)
    if not _text(tensor):
        raise HeaderError("tensor name is not valid Unicode (a lone surrogate escape)", file=path, tensor=tensor)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(dtype) is not str or dtype not in dtypes.NUMPY_DTYPES:
        raise HeaderError(f"unknown dtype {dtype!r}; expected one of {', '.join(dtypes.NUMPY_DTYPES)}",
                          file=path, tensor=tensor)
    numpy_dtype = dtypes.NUMPY_DTYPES[dtype]
    dims = check_shape(shape, file=path, tensor=tensor)
    numel = 1
    for d in dims:
        numel *= d
        if numel >= MAX_NUMEL:
            raise HeaderError(f"shape {shape} holds 2**64 or more elements (the reference library refuses it too)",
                              file=path, tensor=tensor)
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
            or type(offsets[1]) is not int or not 0 <= offsets[0] <= offsets[1] < MAX_NUMEL):
        found = f"[{', '.join(map(describe, offsets))}]" if type(offsets) is list else describe(offsets)
        raise HeaderError(f"data_offsets must be [begin, end] with 0 <= begin <= end < 2**64, found {found}",
                          file=path, tensor=tensor)
    begin, end = offsets
    expected = numel * numpy_dtype.itemsize
    if end - begin != expected:
        raise HeaderError(f"holds {end - begin} bytes, but shape {shape} of {dtype} needs {expected}",
                          file=path, tensor=tensor)
    return Entry(tensor, dtype, dims, data_start + begin, data_start + end)


def _check_layout(path: str, entries: dict[str, Entry], data_start: int, size: int) -> None:
    """The tensors' data, in order of offsets, covers the data section exactly: from its start, without gaps or
    overlaps, to the end of the file (the reference's rule: no byte of the file is unaccounted for)."""
    position, previous = data_start, None
    for begin, end, tensor in sorted((e.begin, e.end, e.name) for e in entries.values()):
        if begin != position:
            found = f"its data [{begin - data_start}, {end - data_start})"
            raise HeaderError(f"{found} overlaps the data of {previous!r}, which ends at {position - data_start}"
                              if begin < position else
                              f"{found} leaves a gap after byte {position - data_start}: the tensors' data must be "
                              "contiguous from byte 0", file=path, tensor=tensor)
        position, previous = end, tensor
    if position > size:
        raise TruncatedFileError(f"data ends at byte {position - data_start} of the data section, but the file "
                                 f"holds only {size - data_start}", file=path, tensor=previous)
    if position < size:
        raise HeaderError(f"the tensors' data ends at byte {position - data_start} of the data section, but the file "
                          f"holds {size - position} more bytes, which no tensor covers (the safetensors library "
                          "refuses such a file)", file=path)


def whole_chunk(files: ByteStore, entry: Entry, file: str, *, offsets: tuple[int, ...] | None = None,
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


def detect(path: AnyPath) -> Detection | None:
    """The one .safetensors file at `path` (itself, or the only one in a folder)."""
    if path.is_dir():
        candidates: list[AnyPath] = entries(path, "*.safetensors")
        found = candidates[0] if len(candidates) == 1 and looks_like_safetensors(candidates[0]) else None
    else:
        found = path if looks_like_safetensors(path) else None
    return Detection(path, found) if found is not None else None


checksum_problems = no_checksums  # safetensors records no checksums


def open(detection: Detection) -> Checkpoint:
    path = file_path = detection.found or detection.path
    if path.is_dir():
        candidates: list[AnyPath] = entries(path, "*.safetensors")
        if len(candidates) != 1:
            raise HeaderError(f"expected exactly one .safetensors file in the folder, found {len(candidates)}",
                              file=str(path))
        file_path = candidates[0]
    files = store_at(file_path.parent)
    header = read_header(files, file_path.name)
    tensors = {
        e.name: LogicalTensor(e.name, e.dtype, e.shape, (whole_chunk(files, e, file_path.name),))
        for e in header.entries.values()
    }
    return Checkpoint(path=file_path, format=NAME, tensors=tensors, metadata=dict(header.metadata),
                      files=(file_path.name,), storage=files)
