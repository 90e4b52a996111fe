"""The GGUF header: magic, version, counts, key/values and tensor infos, parsed and bounded.

The header is parsed here, not by `gguf.GGUFReader`: that reader maps the whole file and walks whatever
counts a file claims, while here every count and length is checked against the bytes that remain before
anything is allocated, and the header is fetched in pieces through the byte store (what has been parsed is
dropped). What one pass (opening, or loading one long array) decodes or walks item by item is bounded too,
across all key/values and nested arrays (MAX_METADATA_ITEMS, MAX_DECODED_STRING_BYTES), so a header within its
size limit cannot expand into gigabytes of Python objects.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ...errors import CheckpointError, HeaderError, TruncatedFileError, UnsupportedError
from ...storage import ByteStore
from ...tiling import MAX_DIM

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 stored counts and lengths as u32; llama.cpp dropped it in 2023
DEFAULT_ALIGNMENT = 32
MAX_HEADER_BYTES = 256 * 1024**2  # a 256k-token vocabulary with scores takes about 8 MiB
MAX_COUNT = 1_000_000  # key/values in one file (and a bound on the tensor count claimed, checked first)
MAX_TENSORS = 100_000  # tensor infos in one file: real ones hold a few thousand; each costs about 1 KB opened
MAX_STRING_BYTES = 64 * 1024**2  # one chat template or merge list entry; whole arrays are bounded by the header
MAX_METADATA_ITEMS = 2_000_000
"""Values, array items and names that one pass over a header (opening a file, or loading one long array)
decodes or walks one by one, counted across all key/values and nested arrays; items of fixed size that are only
skipped do not count. A 256k-token vocabulary with its merges takes about 550,000; a decoded item costs Python
up to about 60 bytes, so this bounds a pass to about 120 MB of objects (and a second or two)."""
MAX_DECODED_STRING_BYTES = 64 * 1024**2
"""Bytes of strings (values, keys, names) one pass decodes: as much as the longest string allowed. A string takes
up to 4 bytes a byte once decoded (one character beyond Latin-1 makes every character 4 bytes wide)."""
FETCH_PIECE = 4 * 1024**2  # header bytes fetched at a time
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
MAX_ARRAY_DEPTH = 8
EAGER_ARRAY_ITEMS = 64
SUMMARY_ITEMS = 5

# ggml type id -> (name, values per block, bytes per block); ggml.h's table, checked against
# gguf.constants.GGML_QUANT_SIZES by the tests. Opening a file needs no gguf package; dequantizing does.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
RAW_TYPES = {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}  # same names in our dtype vocabulary

# GGUF metadata value types: id -> (name, struct format or None)
VALUE_TYPES: dict[int, tuple[str, str | None]] = {
    0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
    5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<B"), 8: ("STRING", None), 9: ("ARRAY", None),
    10: ("UINT64", "<Q"), 11: ("INT64", "<q"), 12: ("FLOAT64", "<d"),
}
STRING, ARRAY, BOOL = 8, 9, 7
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor info record, with absolute byte offsets in its file."""

    name: str
    type_id: int
    ggml_type: str
    block_size: int
    type_size: int
    shape: tuple[int, ...]  # logical (numpy) order: ne reversed
    begin: int
    end: int


@dataclass(frozen=True)
class LongArray:
    """A metadata array too long to decode on open: where it lies, and its first items."""

    key: str
    item_type: int
    count: int
    begin: int  # of the first item, after the array's type and count
    end: int
    head: list[Any]

    def summary(self) -> str:
        items = ", ".join(repr(v) for v in self.head)
        return f"{self.count} x {VALUE_TYPES[self.item_type][0]} [{items}, ...]"


@dataclass(frozen=True)
class Header:
    file: str
    version: int
    alignment: int
    metadata: dict[str, Any]  # long arrays appear as their LongArray
    tensors: list[TensorInfo]
    data_start: int


class _Cursor:
    """Reads a header front to back, fetching the file in pieces as it goes (never past MAX_HEADER_BYTES) and
    dropping what it has parsed; it counts what it decodes against the budget of one pass."""

    def __init__(self, fetch: Callable[[int, int], bytes], size: int, path: str, *, base: int = 0,
                 ends: str = "file"):
        self.fetch, self.size, self.path, self.ends = fetch, size, path, ends
        self.data = bytearray()  # the file's bytes from `base`; changed only in place
        self.base = base  # file offset of data[0]
        self.pos = base
        self.tensor: str | None = None  # named in errors while its info is parsed
        self.items_left = MAX_METADATA_ITEMS
        self.string_bytes_left = MAX_DECODED_STRING_BYTES

    @property
    def remaining(self) -> int:
        return min(self.size, MAX_HEADER_BYTES) - self.pos

    def spend(self, items: int, what: str, string_bytes: int = 0) -> None:
        """Count `items` (and `string_bytes`) about to be decoded or walked against the budget of this pass."""
        self.items_left -= items
        self.string_bytes_left -= string_bytes
        if self.items_left < 0:
            self.fail(HeaderError, f"{what}: the metadata holds more than {MAX_METADATA_ITEMS} values and array "
                                   "items, over the limit")
        if self.string_bytes_left < 0:
            self.fail(HeaderError, f"{what}: the metadata holds more than {MAX_DECODED_STRING_BYTES} bytes of "
                                   "strings, over the limit")

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        self._ensure(end, what)
        start = self.pos - self.base
        self.pos = end
        return bytes(self.data[start:start + n])

    def skip(self, n: int, what: str) -> None:
        """Move past `n` bytes without reading them."""
        end = self.pos + n
        if end - self.base > len(self.data):
            self._check_end(end, what)
        self.pos = end

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self._ensure(self.pos + size, what)
        value = struct.unpack_from(fmt, self.data, self.pos - self.base)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self, what: str) -> bytes:
        length = self.unpack("<Q", f"the length of {what}")
        if length > MAX_STRING_BYTES:
            self.fail(HeaderError, f"{what} claims {length} bytes, over the {MAX_STRING_BYTES}-byte limit")
        self.spend(1, what, length)
        return self.take(length, what)

    def strings(self, count: int, what: str, *, keep: bool) -> list[str]:
        """`count` length-prefixed strings, decoded when `keep`, else only walked past (a vocabulary's hot loop)."""
        self.spend(count, what)
        out: list[str] = []
        unpack, limit = _U64.unpack_from, min(self.size, MAX_HEADER_BYTES)
        data, base, pos = self.data, self.base, self.pos
        for _ in range(count):
            if pos + 8 - base > len(data):
                self.pos = pos
                self._ensure(pos + 8, f"the length of {what}")
                base = self.base
            (length,) = unpack(data, pos - base)
            start, pos = pos + 8, pos + 8 + length
            if length > MAX_STRING_BYTES:
                self.pos = start
                self.fail(HeaderError, f"{what} claims {length} bytes, over the {MAX_STRING_BYTES}-byte limit")
            if keep:
                self.pos = start
                self.spend(0, what, length)
                if pos - base > len(data):
                    self._ensure(pos, what)
                    base = self.base
                out.append(data[start - base:pos - base].decode("utf-8", "backslashreplace"))
            elif pos > limit:
                self.pos = start
                self._check_end(pos, what)
        self.pos = pos
        return out

    def fail(self, kind: type[CheckpointError], message: str) -> NoReturn:
        raise kind(message, file=self.path, tensor=self.tensor)

    def _check_end(self, end: int, what: str) -> None:
        if end > self.size:
            self.fail(TruncatedFileError, f"{what} at byte {self.pos} needs {end - self.pos} bytes, but the "
                                          f"{self.ends} ends at byte {self.size}")
        if end > MAX_HEADER_BYTES:
            self.fail(HeaderError, f"the header runs past the {MAX_HEADER_BYTES}-byte limit (reading {what})")

    def _ensure(self, end: int, what: str) -> None:
        if end - self.base <= len(self.data):
            return
        self._check_end(end, what)
        # the bytes before the cursor are never read again: the buffer holds only what is being parsed
        if self.pos >= self.base + len(self.data):
            self.data.clear()
        else:
            del self.data[:self.pos - self.base]
        self.base = self.pos
        have = self.base + len(self.data)
        self.data += self.fetch(have, min(self.size, MAX_HEADER_BYTES, max(end, have + FETCH_PIECE)) - have)


def _value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    if vtype not in VALUE_TYPES:
        cur.fail(HeaderError, f"key {key!r} has value type {vtype}; expected one of {sorted(VALUE_TYPES)}")
    name, fmt = VALUE_TYPES[vtype]
    if fmt is not None:
        cur.spend(1, f"the {name} value of {key!r}")
        value = cur.unpack(fmt, f"the {name} value of {key!r}")
        return bool(value) if vtype == BOOL else value
    if vtype == STRING:
        return cur.string(f"the string value of {key!r}").decode("utf-8", "backslashreplace")
    item_type, count = _array_header(cur, key, depth)
    if depth == 0 and count > EAGER_ARRAY_ITEMS:
        begin = cur.pos
        head = _items(cur, item_type, SUMMARY_ITEMS, key, depth)
        _skip(cur, item_type, count - SUMMARY_ITEMS, key, depth)
        return LongArray(key, item_type, count, begin, cur.pos, head)
    return _items(cur, item_type, count, key, depth)


def _array_header(cur: _Cursor, key: str, depth: int) -> tuple[int, int]:
    """(item type, count) of an array, checked: a known type, nested at most MAX_ARRAY_DEPTH deep, and a count
    whose smallest items fit in the header that remains."""
    item_type = cur.unpack("<I", f"the item type of array {key!r}")
    count = cur.unpack("<Q", f"the length of array {key!r}")
    if item_type not in VALUE_TYPES:
        cur.fail(HeaderError, f"array {key!r} has item type {item_type}; expected one of {sorted(VALUE_TYPES)}")
    if depth >= MAX_ARRAY_DEPTH:
        cur.fail(HeaderError, f"array {key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep")
    smallest = _item_bytes(item_type)
    if count * smallest > cur.remaining:
        cur.fail(TruncatedFileError, f"array {key!r} claims {count} items of at least {smallest} bytes, but only "
                                     f"{max(cur.remaining, 0)} bytes of header can follow")
    return item_type, count


def _item_bytes(item_type: int) -> int:
    """The fewest bytes one item of this type takes (strings: their length; arrays: type and length)."""
    fmt = VALUE_TYPES[item_type][1]
    return struct.calcsize(fmt) if fmt else {STRING: 8, ARRAY: 12}[item_type]


def _items(cur: _Cursor, item_type: int, count: int, key: str, depth: int) -> list[Any]:
    fmt = VALUE_TYPES[item_type][1]
    if fmt is not None:
        cur.spend(count, f"the items of array {key!r}")
        raw = cur.take(count * struct.calcsize(fmt), f"the items of array {key!r}")
        values = np.frombuffer(raw, np.dtype(fmt))
        return (values != 0 if item_type == BOOL else values).tolist()
    if item_type == STRING:
        return cur.strings(count, f"an item of array {key!r}", keep=True)
    cur.spend(count, f"the items of array {key!r}")
    return [_value(cur, ARRAY, key, depth + 1) for _ in range(count)]


def _skip(cur: _Cursor, item_type: int, count: int, key: str, depth: int) -> None:
    """Walk past `count` items without decoding them: fixed-size ones in one step, strings and arrays one by one
    (their lengths say where the next begins)."""
    fmt = VALUE_TYPES[item_type][1]
    if fmt is not None:
        cur.skip(count * struct.calcsize(fmt), f"the items of array {key!r}")
    elif item_type == STRING:
        cur.strings(count, f"an item of array {key!r}", keep=False)
    else:
        cur.spend(count, f"the items of array {key!r}")
        for _ in range(count):
            _skip(cur, *_array_header(cur, key, depth + 1), key, depth + 1)


def read_header(files: ByteStore, name: str) -> Header:
    """Parse and validate one file's header; every problem is a CheckpointError naming the file (and tensor)."""
    path = files.describe(name)
    size = files.size(name)
    cur = _Cursor(lambda offset, length: files.read(name, offset, length), size, path)
    magic = cur.take(4, "the magic")
    if magic != MAGIC:
        cur.fail(HeaderError, f"starts with {magic!r}, not the GGUF magic {MAGIC!r}")
    version = cur.unpack("<I", "the version")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in VERSIONS:
            cur.fail(UnsupportedError, "is a big-endian GGUF file, which this reader does not support")
        if version == 1:
            cur.fail(UnsupportedError, "is GGUF version 1 (u32 counts), which llama.cpp no longer reads either; "
                                       "convert it with a current llama.cpp")
        cur.fail(HeaderError, f"has GGUF version {version}; expected one of {list(VERSIONS)}")
    tensor_count, kv_count = cur.unpack("<QQ", "the tensor and key/value counts")
    for count, what in ((tensor_count, "tensor"), (kv_count, "key/value")):
        if count > MAX_COUNT:
            cur.fail(HeaderError, f"claims {count} {what} records, over the limit of {MAX_COUNT}")
    if tensor_count > MAX_TENSORS:
        cur.fail(HeaderError, f"claims {tensor_count} tensor records, over the limit of {MAX_TENSORS}")

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = _name(cur, "a metadata key")
        if key in metadata:
            cur.fail(HeaderError, f"repeats the metadata key {key!r}")
        metadata[key] = _value(cur, cur.unpack("<I", f"the value type of {key!r}"), key)
    alignment = _alignment(cur, metadata)

    infos = []
    names: set[str] = set()
    for _ in range(tensor_count):
        name_ = _name(cur, "a tensor name")
        cur.tensor = name_
        if name_ in names:
            cur.fail(HeaderError, "appears twice in the tensor infos")
        names.add(name_)
        n_dims = cur.unpack("<I", "the dimension count")
        if n_dims > MAX_DIMS:
            cur.fail(HeaderError, f"has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
        ne = struct.unpack(f"<{n_dims}Q", cur.take(8 * n_dims, "the dimensions"))
        type_id, offset = cur.unpack("<IQ", "the type and offset")
        infos.append((name_, ne, type_id, offset))
        cur.tensor = None
    data_start = _align(cur.pos, alignment)
    tensors = [_tensor_info(path, size, alignment, data_start, *info) for info in infos]
    spans = sorted((t.begin, t.end, t.name) for t in tensors if t.end > t.begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise HeaderError(f"the data of {n0!r} [{b0}, {e0}) and {n1!r} [{b1}, {e1}) overlap", file=path)
    return Header(name, version, alignment, metadata, tensors, data_start)


def _name(cur: _Cursor, what: str) -> str:
    raw = cur.string(what)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        cur.fail(HeaderError, f"{what} is not valid UTF-8: {raw[:60]!r}")


def _alignment(cur: _Cursor, metadata: dict[str, Any]) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        cur.fail(HeaderError, f"general.alignment must be a power of two, found {alignment!r}")
    return alignment


def _align(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


def _tensor_info(path: str, size: int, alignment: int, data_start: int, name: str, ne: tuple[int, ...],
                 type_id: int, offset: int) -> TensorInfo:
    known = GGML_TYPES.get(type_id)
    if known is None:
        raise UnsupportedError(f"has ggml type {type_id}, unknown to this reader", file=path, tensor=name)
    ggml_type, block_size, type_size = known
    if any(n >= MAX_DIM for n in ne):
        raise HeaderError(f"dimensions {list(ne)} include one at or above 2**62", file=path, tensor=name)
    row = ne[0] if ne else 1
    if row % block_size:
        raise HeaderError(f"rows of {row} values are not a whole number of {block_size}-value {ggml_type} blocks",
                          file=path, tensor=name)
    if offset % alignment:
        raise HeaderError(f"data offset {offset} is not a multiple of the alignment {alignment}",
                          file=path, tensor=name)
    begin = data_start + offset
    end = begin + math.prod(ne) // block_size * type_size
    if end > size:
        raise TruncatedFileError(f"data [{begin}, {end}) of {ggml_type}{list(reversed(ne))} runs past the end of "
                                 f"the {size}-byte file", file=path, tensor=name)
    return TensorInfo(name, type_id, ggml_type, block_size, type_size, tuple(reversed(ne)), begin, end)


def read_long_array(files: ByteStore, name: str, array: LongArray) -> list[Any]:
    """Every item of a long metadata array, read from its bytes in the file (a pass of its own: bounded as one)."""
    cur = _Cursor(lambda offset, length: files.read(name, offset, length), array.end, files.describe(name),
                  base=array.begin, ends="array")
    return _items(cur, array.item_type, array.count, array.key, 0)

