"""A bounded walk over a Flax msgpack file that locates every array's bytes by offset and reads none of them.

msgpack's own Unpacker decodes the structure (map and array headers, keys, scalar leaves) with every size limit it
allows set, `strict_map_key`, and no hooks. It cannot say where an ext payload (a Flax array) lies in the file, so
before each value the walk looks at its first byte: for an ext it reads the ext header itself (the six msgpack ext
formats), decodes the array's small header (shape, dtype name) from the payload's first bytes with a second bounded
Unpacker, notes where the raw bytes lie, and continues after the payload with a fresh Unpacker. Array bytes are
never read here; the file is read through its byte store's buffer (a memory map locally), a few KiB at a time.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import dtypes
from ...errors import HeaderError, TruncatedFileError, UnsupportedError
from ...extras import require

MAX_DEPTH = 64  # nesting of maps and lists: a Flax state dict is a handful of levels deep
MAX_LEAVES = 1_000_000  # leaves of the whole tree (arrays and other values); the largest models have ~10^4 arrays
MAX_CONTAINER_LEN = 1_000_000  # entries of one map or list (msgpack's max_map_len / max_array_len)
MAX_VALUE_BYTES = 16 * 1024**2  # one non-array leaf (string, bytes) and the Unpacker's buffer (max_buffer_size)
MAX_KEY_BYTES = 64 * 1024  # one map key
MAX_DIMS = 64  # dimensions of an array
ARRAY_HEADER_BYTES = 4096  # an array payload's header (shape, dtype name, the data's bin header) lies in these
SMALL_EXT_BYTES = 4096  # a complex or a numpy scalar ext: 20 to 100 bytes in practice
READ_SIZE = 4096  # the Unpacker reads the structure in pieces of this size
CHUNKED_MARKER = "__msgpack_chunked_array__"  # Flax's map for an array over 2**30 bytes, split into flat chunks

NDARRAY, NATIVE_COMPLEX, NPSCALAR = 1, 2, 3  # Flax's ext codes (flax.serialization._MsgpackExtType)
DTYPE_NAMES = {d.name: name for name, d in dtypes.NUMPY_DTYPES.items()}  # numpy's dtype.name, as Flax writes it

# first byte -> (kind, bytes of the header after the first byte); ext headers carry a 1-byte code after the length
_MAPS = {0xDE: 2, 0xDF: 4, **{b: 0 for b in range(0x80, 0x90)}}
_LISTS = {0xDC: 2, 0xDD: 4, **{b: 0 for b in range(0x90, 0xA0)}}
_FIXEXT = {0xD4: 1, 0xD5: 2, 0xD6: 4, 0xD7: 8, 0xD8: 16}  # payload size
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}  # bytes of the length field
_BIN = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}  # bin 8/16/32 and str 8/16/32 (old writers)
_LENGTH = {1: ">B", 2: ">H", 4: ">I"}


def msgpack() -> Any:
    return require("msgpack", "flax", feature="reading Flax msgpack files")


@dataclass(frozen=True)
class ArrayLeaf:
    """An ndarray ext: its dtype (vocabulary), shape, and the absolute [begin, end) of its raw C-order bytes."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class ChunkedLeaf:
    """Flax's split form of an array over 2**30 bytes: `pieces` are flat 1-D arrays, in order."""

    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[ArrayLeaf, ...]


@dataclass(frozen=True)
class ValueLeaf:
    """Any other leaf, decoded: None, bool, int, float, str, bytes, complex, a numpy scalar's value, {} or []."""

    value: Any
    nbytes: int


@dataclass(frozen=True)
class UnknownExt:
    """An ext type that Flax does not define, kept by its code and size."""

    code: int
    nbytes: int


Leaf = ArrayLeaf | ChunkedLeaf | ValueLeaf | UnknownExt


class _Window:
    """The file from `position` on, as a stream for the Unpacker (which reads `READ_SIZE` at a time)."""

    def __init__(self, buffer: Any, size: int, position: int):
        self.buffer, self.size, self.position = buffer, size, position

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.size, self.position + n)
        data = bytes(self.buffer[self.position:end]) if end > self.position else b""
        self.position = max(self.position, end)
        return data


class Walk:
    """The leaves of one file, by path: `Walk(buffer, size, where).leaves` (path tuple -> Leaf), in file order."""

    def __init__(self, buffer: Any, size: int, where: str):
        self.mp = msgpack()
        self.buffer, self.size, self.where = buffer, size, where
        self.leaves: dict[tuple[str, ...], Leaf] = {}
        self._start(0)
        self._value((), 0)
        end = self._position()
        if end != size:
            raise HeaderError(f"holds {size - end} bytes after the msgpack object that ends at byte {end}; a Flax "
                              "file is exactly one object", file=where)

    def _start(self, position: int) -> None:
        self.base = position
        self.unpacker = self.mp.Unpacker(
            _Window(self.buffer, self.size, position), read_size=READ_SIZE, max_buffer_size=MAX_VALUE_BYTES,
            max_str_len=MAX_VALUE_BYTES, max_bin_len=MAX_VALUE_BYTES, max_array_len=MAX_CONTAINER_LEN,
            max_map_len=MAX_CONTAINER_LEN, max_ext_len=SMALL_EXT_BYTES, strict_map_key=True, raw=False)

    def _position(self) -> int:
        return self.base + self.unpacker.tell()

    def _peek(self, position: int, length: int) -> bytes:
        return bytes(self.buffer[position:min(self.size, position + length)])

    def _fail(self, message: str, path: tuple[str, ...], at: int | None = None) -> HeaderError:
        where = f" at byte {at}" if at is not None else ""
        return HeaderError(message + where, file=self.where, tensor=".".join(path) or None)

    def _call(self, step: Callable[[], Any], path: tuple[str, ...], what: str) -> Any:
        """One Unpacker step; its errors (limits, bad bytes, the end of the file) as a HeaderError naming `path`."""
        at = self._position()
        try:
            return step()
        except self.mp.OutOfData:
            raise TruncatedFileError(f"ends inside {what} that starts at byte {at}", file=self.where,
                                     tensor=".".join(path) or None) from None
        except (ValueError, TypeError, OverflowError, self.mp.UnpackException) as exc:
            detail = str(exc).split("\n")[0][:200] or type(exc).__name__
            raise self._fail(f"{what} is not valid msgpack within the limits ({detail})", path, at) from None

    def _add(self, path: tuple[str, ...], leaf: Leaf) -> None:
        if len(self.leaves) >= MAX_LEAVES:
            raise self._fail(f"holds over {MAX_LEAVES} leaves", path)
        self.leaves[path] = leaf

    def _value(self, path: tuple[str, ...], depth: int) -> None:
        at = self._position()
        head = self._peek(at, 1)
        if not head:
            raise TruncatedFileError(f"ends at byte {at}, where a value was expected", file=self.where,
                                     tensor=".".join(path) or None)
        first = head[0]
        if first in _MAPS or first in _LISTS:
            if depth >= MAX_DEPTH:
                raise self._fail(f"is nested over {MAX_DEPTH} levels deep", path, at)
            self._container(path, depth, first in _MAPS)
        elif first in _FIXEXT or first in _EXT:
            self._ext(path, at, first)
        else:
            value = self._call(self.unpacker.unpack, path, "a value")
            self._add(path, ValueLeaf(value, self._position() - at))

    def _container(self, path: tuple[str, ...], depth: int, is_map: bool) -> None:
        step = self.unpacker.read_map_header if is_map else self.unpacker.read_array_header
        what = "a map" if is_map else "a list"
        count = self._call(step, path, f"{what} header")
        if count > MAX_CONTAINER_LEN:  # the Unpacker's max_map_len / max_array_len bound unpack(), not headers
            raise self._fail(f"is {what} of {count} entries, over the limit of {MAX_CONTAINER_LEN}", path)
        if count * (2 if is_map else 1) > self.size - self._position():  # each key and value takes a byte at least
            raise TruncatedFileError(f"is {what} of {count} entries, but the file has only "
                                     f"{self.size - self._position()} bytes left", file=self.where,
                                     tensor=".".join(path) or None)
        start = len(self.leaves)
        keys: set[str] = set()
        for index in range(count):
            if is_map:
                key = self._call(self.unpacker.unpack, path, "a map key")
                if isinstance(key, bytes):
                    key = key.decode("utf-8", "replace")
                if not isinstance(key, str):  # strict_map_key's rule: the walk decodes keys one by one
                    raise self._fail(f"has a map key of type {type(key).__name__}; a state dict's keys are strings",
                                     path)
                if len(key) > MAX_KEY_BYTES:
                    raise self._fail(f"has a key of {len(key)} characters, over the limit of {MAX_KEY_BYTES}", path)
            else:
                key = str(index)
            if key in keys:
                raise self._fail(f"repeats the key {key[:200]!r}", path)
            keys.add(key)
            self._value((*path, key), depth + 1)
        if not count:
            self._add(path, ValueLeaf({} if is_map else [], 1))
        elif is_map and CHUNKED_MARKER in keys:
            self._chunked(path, start)

    def _ext(self, path: tuple[str, ...], at: int, first: int) -> None:
        if first in _FIXEXT:
            length, header = _FIXEXT[first], 2
        else:
            size = _EXT[first]
            raw = self._peek(at + 1, size)
            if len(raw) < size:
                raise TruncatedFileError(f"ends inside the ext header at byte {at}", file=self.where,
                                         tensor=".".join(path) or None)
            (length,) = struct.unpack(_LENGTH[size], raw)
            header = 2 + size
        code_byte = self._peek(at + header - 1, 1)
        begin, end = at + header, at + header + length
        if not code_byte or end > self.size:
            raise TruncatedFileError(f"ends inside an ext of {length} bytes that starts at byte {at} (the file has "
                                     f"{self.size})", file=self.where, tensor=".".join(path) or None)
        code = struct.unpack(">b", code_byte)[0]
        if code == NDARRAY:
            self._add(path, self._array(path, begin, end))
        elif code in (NATIVE_COMPLEX, NPSCALAR):
            if length > SMALL_EXT_BYTES:
                raise self._fail(f"is a scalar ext of {length} bytes, over the limit of {SMALL_EXT_BYTES}", path, at)
            value = self._small_ext(path, code, begin, end)
            self._add(path, ValueLeaf(value, length))
        else:
            self._add(path, UnknownExt(code, length))
        self._start(end)  # the Unpacker never reads the payload: a fresh one starts after it

    def _array(self, path: tuple[str, ...], begin: int, end: int) -> ArrayLeaf:
        """The array of an ndarray ext payload [begin, end): msgpack of (shape, dtype name, raw bytes)."""
        head = self._peek(begin, min(end - begin, ARRAY_HEADER_BYTES))
        unpacker = self.mp.Unpacker(max_buffer_size=ARRAY_HEADER_BYTES, max_str_len=64, max_bin_len=0,
                                    max_array_len=MAX_DIMS, max_map_len=0, max_ext_len=0, strict_map_key=True,
                                    raw=False)
        unpacker.feed(head)
        try:
            fields = unpacker.read_array_header()
            shape, name = unpacker.unpack(), unpacker.unpack()
        except self.mp.OutOfData:
            raise self._fail(f"has an array header (shape, dtype) that does not fit in {len(head)} bytes", path,
                             begin) from None
        except (ValueError, TypeError, OverflowError, self.mp.UnpackException) as exc:
            raise self._fail(f"has an array header that is not (shape, dtype, bytes): {str(exc)[:200]}", path,
                             begin) from None
        if isinstance(name, bytes):  # older writers packed the dtype name as raw bytes
            name = name.decode("ascii", "replace")
        if fields != 3 or not isinstance(shape, list) or not isinstance(name, str):
            raise self._fail("has an array header that is not (shape, dtype name, bytes)", path, begin)
        if not all(type(d) is int and 0 <= d < 2**62 for d in shape):
            raise self._fail(f"has shape {str(shape)[:200]}; expected non-negative integers", path, begin)
        if name not in DTYPE_NAMES:
            raise UnsupportedError(f"has dtype {name[:64]!r}, which this reader does not map; known: "
                                   f"{', '.join(DTYPE_NAMES)}", file=self.where, tensor=".".join(path))
        dtype = DTYPE_NAMES[name]
        at = unpacker.tell()
        kind = head[at] if at < len(head) else None
        if kind not in _BIN:
            raise self._fail("has no bytes field after its shape and dtype", path, begin + at)
        size = _BIN[kind]
        raw = head[at + 1:at + 1 + size]
        if len(raw) < size:
            raise self._fail("ends inside the header of its bytes field", path, begin + at)
        (length,) = struct.unpack(_LENGTH[size], raw)
        data = begin + at + 1 + size
        expected = math.prod(shape) * dtypes.itemsize(dtype)
        if length != expected:
            raise self._fail(f"holds {length} bytes, but shape {shape} of {name} needs {expected}", path, data)
        if data + length != end:
            raise self._fail(f"has {end - data - length} bytes in its ext payload besides the array's "
                             f"{length}", path, data)
        return ArrayLeaf(dtype, tuple(shape), data, data + length)

    def _small_ext(self, path: tuple[str, ...], code: int, begin: int, end: int) -> Any:
        """A native complex (msgpack of (real, imag)) or a numpy scalar (an ndarray payload of shape ())."""
        if code == NPSCALAR:
            leaf = self._array(path, begin, end)
            if leaf.shape:
                raise self._fail(f"is a numpy scalar ext of shape {list(leaf.shape)}", path, begin)
            return np.frombuffer(self._peek(leaf.begin, leaf.end - leaf.begin),
                                 dtypes.numpy_dtype(leaf.dtype))[0].item()
        try:
            pair = self.mp.unpackb(self._peek(begin, end - begin), max_str_len=0,
                                   max_bin_len=0, max_array_len=2, max_map_len=0, max_ext_len=0)
        except (ValueError, TypeError, OverflowError, self.mp.UnpackException) as exc:
            raise self._fail(f"is a complex ext that is not msgpack (real, imag): {str(exc)[:200]}", path,
                             begin) from None
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, (int, float)) for x in pair)):
            raise self._fail("is a complex ext that is not (real, imag)", path, begin)
        return complex(pair[0], pair[1])

    def _chunked(self, path: tuple[str, ...], start: int) -> None:
        """Replace the leaves of Flax's chunked-array map at `path` (added from index `start`) by one ChunkedLeaf."""
        names = list(self.leaves)[start:]
        found = {name[len(path):]: self.leaves.pop(name) for name in names}
        marker = found.pop((CHUNKED_MARKER,), None)
        if not isinstance(marker, ValueLeaf) or marker.value is not True:
            raise self._fail(f"has {CHUNKED_MARKER} but not true", path)
        dims = {k[1]: v for k, v in found.items() if k[0] == "shape" and len(k) == 2}
        pieces = {k[1]: v for k, v in found.items() if k[0] == "chunks" and len(k) == 2}
        if len(dims) + len(pieces) != len(found) or not pieces:
            raise self._fail("is a chunked array that is not {shape: {i: n}, chunks: {i: 1-D array}}", path)
        shape = []
        for i in range(len(dims)):
            dim = dims.get(str(i))
            if not isinstance(dim, ValueLeaf) or type(dim.value) is not int or not 0 <= dim.value < 2**62:
                raise self._fail(f"is a chunked array whose shape has no dimension {i}", path)
            shape.append(dim.value)
        ordered = [pieces.get(str(i)) for i in range(len(pieces))]
        arrays = [p for p in ordered if isinstance(p, ArrayLeaf) and len(p.shape) == 1]
        if len(arrays) != len(ordered) or len({p.dtype for p in arrays}) != 1:
            raise self._fail("is a chunked array whose chunks are not 1-D arrays of one dtype, numbered from 0",
                             path)
        if sum(p.shape[0] for p in arrays) != math.prod(shape):
            raise self._fail(f"is a chunked array of shape {shape} whose chunks hold "
                             f"{sum(p.shape[0] for p in arrays)} elements", path)
        self.leaves[path] = ChunkedLeaf(arrays[0].dtype, tuple(shape), tuple(arrays))
