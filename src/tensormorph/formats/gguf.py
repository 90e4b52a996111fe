"""GGUF (llama.cpp): one `.gguf` file, or a split set `<stem>-00001-of-0000N.gguf` ... shown as file shards.

Layout: magic `GGUF`, u32 version, u64 tensor count, u64 key/value count, the key/values, the tensor
infos (name, dims with ne[0] the fastest axis, ggml type, offset into the data section), padding to
`general.alignment` (default 32), then the data. The logical shape is the dims reversed, as numpy and
gguf's own reader see it.

The header is parsed here, not by `gguf.GGUFReader`: that reader maps the whole file and walks whatever
counts a file claims, while here every count and length is checked against the bytes that remain before
anything is allocated, and the header is fetched in growing pieces through LocalFiles.

Float and integer tensors (F32, F16, BF16, F64, I8..I64) are memory-mapped chunks. Quantized tensors
(Q4_0, Q4_K, Q8_0, ...) read as float32, the type llama.cpp dequantizes to, via `gguf.quants.dequantize`
over only the blocks a region touches; their block format is the chunk source's `encoding`.
Metadata arrays longer than EAGER_ARRAY_ITEMS (the tokenizer's vocabulary) are summarised in
Checkpoint.metadata and decoded in full on demand as objects under the same key.
"""

from __future__ import annotations

import math
import re
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .. import dtypes
from ..core import MAX_DIM, Checkpoint, Chunk, LogicalTensor, MappedArray, ObjectEntry, byte_runs
from ..errors import CheckpointError, HeaderError, MissingFileError, TruncatedFileError, UnsupportedError
from ..storage import LocalFiles

NAME = "gguf"
PRIORITY = 45  # after the Hugging Face layouts: a model folder often holds a .gguf export beside them

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 stored counts and lengths as u32; llama.cpp dropped it in 2023
DEFAULT_ALIGNMENT = 32
MAX_HEADER_BYTES = 256 * 1024**2  # a 256k-token vocabulary with scores takes about 8 MiB
MAX_COUNT = 1_000_000  # tensors or key/values in one file
MAX_STRING_BYTES = 64 * 1024**2  # one chat template or merge list entry; whole arrays are bounded by the header
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses more
MAX_ARRAY_DEPTH = 8
EAGER_ARRAY_ITEMS = 64
SUMMARY_ITEMS = 5
DEQUANTIZE_BATCH = 4 * 1024**2  # float32 values dequantized at once: bounds the temporaries of a region read
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})\.gguf$")

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
    """Reads a header front to back, fetching more of the file as it goes, never past MAX_HEADER_BYTES."""

    def __init__(self, fetch: Callable[[int, int], bytes] | None, size: int, path: str, data: bytes = b"",
                 base: int = 0):
        self.fetch, self.size, self.path = fetch, size, path
        self.data = bytearray(data)
        self.base = base  # file offset of data[0]
        self.pos = base
        self.tensor: str | None = None  # named in errors while its info is parsed

    @property
    def remaining(self) -> int:
        return min(self.size, MAX_HEADER_BYTES) - self.pos

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        self._ensure(end, what)
        start = self.pos - self.base
        self.pos = end
        return bytes(self.data[start:start + n])

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
        return self.take(length, what)

    def strings(self, count: int, what: str, *, keep: bool) -> list[str]:
        """`count` length-prefixed strings, decoded when `keep`, else only walked past (a vocabulary's hot loop)."""
        out: list[str] = []
        data, base, unpack = self.data, self.base, _U64.unpack_from  # _ensure extends `data` in place
        pos = self.pos
        for _ in range(count):
            if pos + 8 - base > len(data):
                self.pos = pos
                self._ensure(pos + 8, f"the length of {what}")
            (length,) = unpack(data, pos - base)
            start, pos = pos + 8, pos + 8 + length
            if length > MAX_STRING_BYTES:
                self.pos = start
                self.fail(HeaderError, f"{what} claims {length} bytes, over the {MAX_STRING_BYTES}-byte limit")
            if pos - base > len(data) and (keep or pos > min(self.size, MAX_HEADER_BYTES)):
                self.pos = start
                self._ensure(pos, what)
            if keep:
                out.append(data[start - base:pos - base].decode("utf-8", "backslashreplace"))
        self.pos = pos
        return out

    def fail(self, kind: type[CheckpointError], message: str) -> NoReturn:
        raise kind(message, file=self.path, tensor=self.tensor)

    def _ensure(self, end: int, what: str) -> None:
        if end - self.base <= len(self.data):
            return
        if end > self.size:
            self.fail(TruncatedFileError, f"{what} at byte {self.pos} needs {end - self.pos} bytes, but the "
                                          f"{'file' if self.fetch else 'record'} ends at byte {self.size}")
        if end > MAX_HEADER_BYTES:
            self.fail(HeaderError, f"the header runs past the {MAX_HEADER_BYTES}-byte limit (reading {what})")
        assert self.fetch is not None  # a cursor over a record holds all of it: size bounds every read
        have = self.base + len(self.data)
        target = min(self.size, MAX_HEADER_BYTES, max(end, 2 * have, 1 << 16))
        self.data += self.fetch(have, target - have)


def _value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
    if vtype not in VALUE_TYPES:
        cur.fail(HeaderError, f"key {key!r} has value type {vtype}; expected one of {sorted(VALUE_TYPES)}")
    name, fmt = VALUE_TYPES[vtype]
    if fmt is not None:
        value = cur.unpack(fmt, f"the {name} value of {key!r}")
        return bool(value) if vtype == BOOL else value
    if vtype == STRING:
        return cur.string(f"the string value of {key!r}").decode("utf-8", "backslashreplace")
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
    if depth == 0 and count > EAGER_ARRAY_ITEMS:
        begin = cur.pos
        head = _items(cur, item_type, SUMMARY_ITEMS, key, depth)
        _skip(cur, item_type, count - SUMMARY_ITEMS, key)
        return LongArray(key, item_type, count, begin, cur.pos, head)
    return _items(cur, item_type, count, key, depth)


def _item_bytes(item_type: int) -> int:
    """The fewest bytes one item of this type takes (strings: their length; arrays: type and length)."""
    fmt = VALUE_TYPES[item_type][1]
    return struct.calcsize(fmt) if fmt else {STRING: 8, ARRAY: 12}[item_type]


def _items(cur: _Cursor, item_type: int, count: int, key: str, depth: int) -> list[Any]:
    fmt = VALUE_TYPES[item_type][1]
    if fmt is not None:
        raw = cur.take(count * struct.calcsize(fmt), f"the items of array {key!r}")
        values = np.frombuffer(raw, np.dtype(fmt)).tolist()
        return [bool(v) for v in values] if item_type == BOOL else values
    if item_type == STRING:
        return cur.strings(count, f"an item of array {key!r}", keep=True)
    return [_value(cur, ARRAY, key, depth + 1) for _ in range(count)]


def _skip(cur: _Cursor, item_type: int, count: int, key: str) -> None:
    fmt = VALUE_TYPES[item_type][1]
    if fmt is not None:
        cur.take(count * struct.calcsize(fmt), f"the items of array {key!r}")
    elif item_type == STRING:
        cur.strings(count, f"an item of array {key!r}", keep=False)
    else:
        for _ in range(count):
            _value(cur, ARRAY, key, 1)


def read_header(files: LocalFiles, name: str) -> Header:
    """Parse and validate one file's header; every problem is a CheckpointError naming the file (and tensor)."""
    path = str(files.resolve(name))
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


def read_long_array(files: LocalFiles, name: str, array: LongArray) -> list[Any]:
    """Every item of a long metadata array, read from its bytes in the file."""
    data = files.read(name, array.begin, array.end - array.begin)
    cur = _Cursor(None, array.end, str(files.resolve(name)), data, base=array.begin)
    return _items(cur, array.item_type, array.count, array.key, 0)


# ---------------------------------------------------------------- quantized tensors

def _dequantizer() -> Any:
    try:
        from gguf.quants import dequantize  # numpy only; imported on first quantized read
    except ImportError:
        return None
    return dequantize


@dataclass(frozen=True, slots=True)
class QuantizedBlocks:
    """A tensor stored as ggml blocks along its last (fastest) axis, read as float32 one block range at a time."""

    files: LocalFiles
    file: str
    offset: int
    info: TensorInfo

    @property
    def encoding(self) -> dict[str, Any]:
        """The block format, as the CLI and the viewer show it."""
        info = self.info
        bits = info.type_size * 8 / info.block_size
        return {"format": info.ggml_type, "block_values": info.block_size, "block_bytes": info.type_size,
                "bits_per_value": bits, "stored_bytes": info.end - info.begin,
                "description": f"{info.ggml_type} ({info.block_size}-value blocks of {info.type_size} B, "
                               f"{bits:g} bits/value)"}

    def array(self) -> np.ndarray:
        """The whole tensor, dequantized."""
        out = np.empty(self.info.shape, np.float32)
        self.read_into(tuple(slice(0, n, 1) for n in self.info.shape), out)
        return out

    def read_into(self, index: tuple[slice, ...], target: np.ndarray) -> bool:
        """Dequantize the blocks that `index` (positive-step slices) touches into `target`."""
        if target.dtype != np.float32:
            return False
        info = self.info
        lead, last = index[:-1], index[-1]
        columns = np.arange(last.start, last.stop, last.step)
        if columns.size == 0 or any(len(range(s.start, s.stop, s.step)) == 0 for s in lead):
            return True
        blocks = np.unique(columns // info.block_size)
        first, final = int(blocks[0]), int(blocks[-1])
        contiguous = final - first + 1 == blocks.size
        picked = slice(first, final + 1) if contiguous else blocks
        positions = np.searchsorted(blocks, columns // info.block_size) * info.block_size + columns % info.block_size
        identity = contiguous and last.step == 1 and columns.size == blocks.size * info.block_size
        per_block = info.shape[:-1] + (info.shape[-1] // info.block_size, info.type_size)
        stored = np.frombuffer(self.files.buffer(self.file), np.uint8, count=info.end - info.begin,
                               offset=self.offset).reshape(per_block)
        byte_shape = info.shape[:-1] + (per_block[-2] * info.type_size,)
        block_bytes = slice(first * info.type_size, (final + 1) * info.type_size, 1)

        if not lead:
            target[...] = self._decode(stored[picked], positions, identity).reshape(target.shape)
            return True
        per_position = math.prod(len(range(s.start, s.stop, s.step)) for s in lead[1:]) * blocks.size
        rows = range(lead[0].start, lead[0].stop, lead[0].step)
        batch = max(1, DEQUANTIZE_BATCH // max(1, per_position * info.block_size))
        for i in range(0, len(rows), batch):
            part = rows[i:i + batch]
            box = (slice(part.start, part[-1] + 1, part.step),) + lead[1:]
            runs = byte_runs(self.offset, byte_shape, None, 1, box + (block_bytes,))
            self.files.advise(self.file, runs, "willneed")
            values = self._decode(stored[box][..., picked, :], positions, identity)
            target[i:i + len(part)] = values.reshape(target[i:i + len(part)].shape)
            self.files.advise(self.file, runs, "dontneed")
        return True

    def _decode(self, quantized: np.ndarray, positions: np.ndarray, identity: bool) -> np.ndarray:
        """Dequantize (..., blocks, block bytes) to (rows, values) and keep the selected columns."""
        info = self.info
        dequantize = _dequantizer()
        path = str(self.files.resolve(self.file))
        if dequantize is None:
            raise UnsupportedError(f"is {info.ggml_type}-quantized; reading it needs the gguf package "
                                   "(pip install 'tensormorph[gguf]')", file=path, tensor=info.name)
        from gguf.constants import GGMLQuantizationType

        rows = np.ascontiguousarray(quantized).reshape(-1, quantized.shape[-2] * info.type_size)
        try:
            values = dequantize(rows, GGMLQuantizationType(info.type_id))
        except NotImplementedError:
            raise UnsupportedError(f"the installed gguf package cannot dequantize {info.ggml_type}",
                                   file=path, tensor=info.name) from None
        return values if identity else values[:, positions]


# ---------------------------------------------------------------- files and checkpoint

def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def detect(path: Path) -> bool:
    if path.is_dir():
        return any(_is_gguf(p) for p in sorted(path.glob("*.gguf")))
    return _is_gguf(path)


def _members(path: Path) -> tuple[Path, list[str]]:
    """(folder, file names in split order) of the model at `path`: one file, a split set, or a folder of either."""
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.gguf") if _is_gguf(p))
        sets = {m.group("stem", "n") for m in map(SPLIT_NAME.match, found) if m}
        singles = [f for f in found if not SPLIT_NAME.match(f)]
        if len(sets) + len(singles) != 1:
            raise HeaderError(f"holds {len(sets) + len(singles)} GGUF models ({', '.join(found[:6])}); "
                              "open one file (the first split of a split set)", file=str(path))
        if singles:
            return path, singles
        stem, n = sets.pop()
        return path, _split_names(stem, int(n))
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return path.parent, [path.name]
    if not 1 <= int(match.group("k")) <= int(match.group("n")):
        raise HeaderError(f"is split {int(match.group('k'))} of {int(match.group('n'))}, which cannot be",
                          file=str(path))
    return path.parent, _split_names(match.group("stem"), int(match.group("n")))


def _split_names(stem: str, n: int) -> list[str]:
    if n < 1:
        raise HeaderError(f"names a split set of {n} files ({stem}-00001-of-{n:05d}.gguf); a set has at least one")
    return [f"{stem}-{k:05d}-of-{n:05d}.gguf" for k in range(1, n + 1)]


def open(path: Path) -> Checkpoint:
    root, names = _members(path)
    files = LocalFiles(root)
    for k, name in enumerate(names, start=1):
        if not files.exists(name):
            raise MissingFileError(f"split {k} of {len(names)} is missing; the split set of {names[0]!r} needs "
                                   f"all {len(names)} files", file=str(files.resolve(name)))
    headers = [read_header(files, name) for name in names]
    _check_splits(files, headers)
    first = headers[0]
    tensors: dict[str, LogicalTensor] = {}
    for k, header in enumerate(headers, start=1):
        for info in header.tensors:
            if info.name in tensors:
                raise HeaderError(f"appears in both {tensors[info.name].files[0]!r} and {header.file!r}",
                                  file=str(files.resolve(header.file)), tensor=info.name)
            tensors[info.name] = LogicalTensor(info.name, _dtype(info), info.shape,
                                               (_chunk(files, header.file, info),),
                                               file_shard=(k, len(headers)) if len(headers) > 1 else None)
    objects = {key: ObjectEntry(key, value.end - value.begin, first.file,
                                loader=lambda v=value: read_long_array(files, first.file, v))
               for key, value in first.metadata.items() if isinstance(value, LongArray)}
    metadata = {
        "gguf_version": first.version,
        "alignment": first.alignment,
        "tensor_types": dict(Counter(info.ggml_type for h in headers for info in h.tensors).most_common()),
        **{key: value.summary() if isinstance(value, LongArray) else value for key, value in first.metadata.items()},
    }
    return Checkpoint(path=root / names[0], format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(names), storage=files)


def _dtype(info: TensorInfo) -> str:
    return info.ggml_type if info.ggml_type in RAW_TYPES else "F32"


def _chunk(files: LocalFiles, file: str, info: TensorInfo) -> Chunk:
    if info.ggml_type in RAW_TYPES:
        source: Any = MappedArray(files, file, info.begin, dtypes.numpy_dtype(info.ggml_type), info.shape)
    else:
        source = QuantizedBlocks(files, file, info.begin, info)
    return Chunk((0,) * len(info.shape), info.shape, file, (info.begin, info.end), source)


def _check_splits(files: LocalFiles, headers: list[Header]) -> None:
    """The split keys of every file agree with the file names (llama.cpp's split.no / split.count)."""
    n = len(headers)
    total = sum(len(h.tensors) for h in headers)
    for k, header in enumerate(headers):
        path = str(files.resolve(header.file))
        number, count = header.metadata.get("split.no"), header.metadata.get("split.count")
        if n == 1:
            if count not in (None, 0, 1):
                raise HeaderError(f"says it is split {number} (0-based) of {count}, but its name does not follow "
                                  "<name>-00001-of-0000N.gguf; restore the split file names", file=path)
            continue
        if count is not None and count != n:
            raise HeaderError(f"split.count is {count}, but the file names say {n} splits", file=path)
        if number is not None and number != k:
            raise HeaderError(f"split.no is {number}, but the file name makes it split {k} (0-based)", file=path)
    expected = headers[0].metadata.get("split.tensors.count")
    if expected is not None and expected != total:
        raise HeaderError(f"split.tensors.count is {expected}, but the {n} file(s) hold {total} tensors",
                          file=str(files.resolve(headers[0].file)))
