"""Orbax's JSON metadata, parsed and bounded without tensorstore: the PyTree (`_METADATA`), the recorded shardings
(`_sharding`) and each array's zarr metadata (`.zarray` for zarr v2, `zarr.json` for zarr v3).

Every function takes the raw bytes and the file they came from, and raises HeaderError naming that file (and the
leaf) for anything it cannot take: this is the part of the format a forged checkpoint controls.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import dtypes
from ...errors import HeaderError, UnsafePathError
from ...storage import parse_json

MAX_METADATA_BYTES = 256 * 1024**2  # `_METADATA` of a 100,000-leaf tree takes about 40 MB
MAX_LEAVES = 1_000_000  # leaves in one PyTree; each becomes a tensor or an object (about 1 KB opened)
MAX_KEY_DEPTH = 256  # keys on one leaf's path: real trees nest a dozen deep
MAX_NAME_CHARS = 4096  # a leaf's dotted name, which is also its folder in the key/value store
MAX_ARRAY_METADATA_BYTES = 1 << 20  # one `.zarray` / `zarr.json`: a few hundred bytes in practice
MAX_DIMS = 32  # tensorstore's own limit on an array's rank (kMaxRank)
MAX_NUMEL = 2**63  # elements of one array: numpy's index type
MAX_CHUNKS = 1_000_000  # chunks of one checkpoint (each a Chunk record); real ones hold tens of thousands
MAX_MESH_DEVICES = 1_000_000  # devices of a recorded mesh; the largest TPU pods have tens of thousands

ARRAY_TYPES = frozenset({"jax.Array", "np.ndarray"})  # value_type of the leaves stored as zarr arrays

# zarr v3 data_type names, and zarr v2 dtype strings that are not numpy type strings, in the dtypes vocabulary
ZARR3_DTYPES = {"bool": "BOOL", "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8",
                "uint16": "U16", "uint32": "U32", "uint64": "U64", "float16": "F16", "float32": "F32",
                "float64": "F64", "bfloat16": "BF16", "complex64": "C64", "complex128": "C128",
                "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
                "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0"}
_BY_NUMPY = {np_dtype: name for name, np_dtype in dtypes.NUMPY_DTYPES.items()}


@dataclass(frozen=True)
class Leaf:
    """One leaf of the saved PyTree."""

    name: str  # the keys of its path joined with dots: Orbax's own parameter name and the array's folder
    value_type: str  # "jax.Array", "np.ndarray", "scalar", "string", ...

    @property
    def is_array(self) -> bool:
        return self.value_type in ARRAY_TYPES


@dataclass(frozen=True)
class TreeMetadata:
    leaves: tuple[Leaf, ...]
    use_ocdbt: bool | None
    use_zarr3: bool | None
    custom: Any


@dataclass(frozen=True)
class Sharding:
    """A NamedSharding as Orbax recorded it: the mesh, its axis names, the partition spec and the device ids."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    spec: tuple[tuple[str, ...], ...]  # per array dimension, the mesh axes it is split over (major first)
    device_ids: tuple[int, ...]  # in mesh order (row-major over mesh_shape)


@dataclass(frozen=True)
class ArrayLayout:
    """An array's zarr metadata: what the reader needs and what the Inspector shows."""

    zarr_format: int
    dtype: str  # the dtypes vocabulary
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]  # the chunk grid: one write per chunk (a zarr3 shard when sharding is used)
    read_chunk_shape: tuple[int, ...]  # the smallest piece a read decodes (a zarr3 shard's inner chunk)
    codecs: tuple[str, ...]
    key_prefix: str  # chunk keys are `<name>/<prefix><i><sep><j>...`: "" for zarr v2, "c/" for zarr v3's default
    separator: str

    def chunk_key(self, name: str, index: tuple[int, ...]) -> str:
        if not index:  # a 0-d array has one chunk: "0" in zarr v2, "c" in zarr v3
            return f"{name}/{self.key_prefix[:-1] or '0'}"
        return f"{name}/{self.key_prefix}{self.separator.join(map(str, index))}"

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunk_shape))

    @property
    def chunk_count(self) -> int:
        return math.prod(self.grid)


def _object(value: Any, what: str, where: str) -> dict:
    if not isinstance(value, dict):
        raise HeaderError(f"{what} is {type(value).__name__}, expected a JSON object", file=where)
    return value


def parse_tree(raw: bytes, where: str) -> TreeMetadata:
    """The leaves of a `_METADATA` file, in the order it lists them (Orbax writes them sorted by path)."""
    if len(raw) > MAX_METADATA_BYTES:
        raise HeaderError(f"is {len(raw)} bytes, over the limit of {MAX_METADATA_BYTES}", file=where)
    top = _object(parse_json(raw, "_METADATA", where), "_METADATA", where)
    tree: dict = _object(top.get("tree_metadata"), "tree_metadata", where)
    if len(tree) > MAX_LEAVES:
        raise HeaderError(f"lists {len(tree)} leaves, over the limit of {MAX_LEAVES}", file=where)
    leaves, seen = [], set()
    for key, item in tree.items():
        entry = _object(item, f"leaf {key!r}", where)
        name = _leaf_name(entry.get("key_metadata"), key, where)
        value = _object(entry.get("value_metadata"), f"value_metadata of {name!r}", where)
        value_type = value.get("value_type")
        if not isinstance(value_type, str) or len(value_type) > MAX_NAME_CHARS:
            raise HeaderError(f"value_type is {value_type!r}, expected a type name", file=where, tensor=name)
        if name in seen:
            raise HeaderError("is named by two leaves", file=where, tensor=name)
        seen.add(name)
        leaves.append(Leaf(name, value_type))
    flags = {k: top.get(k) for k in ("use_ocdbt", "use_zarr3")}
    for flag, setting in flags.items():
        if setting is not None and not isinstance(setting, bool):
            raise HeaderError(f"{flag} is {setting!r}, expected true or false", file=where)
    return TreeMetadata(tuple(leaves), flags["use_ocdbt"], flags["use_zarr3"], top.get("custom_metadata"))


def _leaf_name(keys: Any, tree_key: str, where: str) -> str:
    if not isinstance(keys, list) or not 1 <= len(keys) <= MAX_KEY_DEPTH:
        raise HeaderError(f"leaf {tree_key!r} has key_metadata {str(keys)[:80]!r}, expected a list of 1 to "
                          f"{MAX_KEY_DEPTH} keys", file=where)
    parts = []
    for item in keys:
        key = item.get("key") if isinstance(item, dict) else None
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise HeaderError(f"leaf {tree_key!r} has a key {str(item)[:80]!r}, expected a string or an integer",
                              file=where)
        parts.append(str(key))
    name = ".".join(parts)
    if len(name) > MAX_NAME_CHARS:
        raise HeaderError(f"leaf name of {len(name)} characters, over the limit of {MAX_NAME_CHARS}", file=where)
    # the name is also the array's folder in the store: it must stay one folder inside the checkpoint
    if name in ("", ".", "..") or any(c in name for c in "/\\\x00"):
        raise UnsafePathError("names a folder outside the checkpoint (or none)", file=where, tensor=name)
    _text(name, "a leaf name", where)
    return name


def _text(value: str, what: str, where: str) -> None:
    """Refuse a string JSON allowed that is no text (a lone surrogate escape): it could not name a file or print."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise HeaderError(f"has {what} that is not valid text", file=where) from None


def parse_strings(raw: bytes, where: str) -> dict[str, str]:
    """`_strings.json`: the string leaves, by dotted name."""
    value = _object(parse_json(raw, "_strings.json", where), "_strings.json", where)
    if not all(isinstance(v, str) for v in value.values()):
        raise HeaderError("holds a value that is not a string", file=where)
    for text in (*value, *value.values()):
        _text(text, "a string leaf", where)
    return value


def parse_shardings(raw: bytes, where: str) -> dict[str, Sharding]:
    """`_sharding`: each NamedSharding recorded, by dotted name (other kinds, single-device ones, are skipped)."""
    top = _object(parse_json(raw, "_sharding", where), "_sharding", where)
    found: dict[str, Sharding] = {}
    for key, text in top.items():
        try:
            name = base64.b64decode(key, validate=True).decode("utf-8")
        except (binascii.Error, ValueError):  # ValueError: non-ASCII text (UnicodeDecodeError is one)
            raise HeaderError(f"has a key {key[:80]!r} that is not base64 of a leaf name", file=where) from None
        if not isinstance(text, str):
            raise HeaderError(f"records {type(text).__name__}, expected a JSON string", file=where, tensor=name)
        _text(text, "a sharding", where)
        entry = _object(parse_json(text.encode("utf-8"), "a sharding", where), "a sharding", where)
        if entry.get("sharding_type") == "NamedSharding":
            found[name] = _named_sharding(entry, where, name)
    return found


def _int_list(value: Any, what: str, where: str, name: str, low: int = 0) -> tuple[int, ...]:
    if (not isinstance(value, list) or len(value) > MAX_DIMS
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value)):
        raise HeaderError(f"{what} is {str(value)[:80]!r}, expected up to {MAX_DIMS} integers >= {low}",
                          file=where, tensor=name)
    return tuple(value)


def _named_sharding(entry: dict, where: str, name: str) -> Sharding:
    mesh = _int_list(entry.get("shape"), "the mesh shape", where, name, low=1)
    if math.prod(mesh) > MAX_MESH_DEVICES:
        raise HeaderError(f"has a mesh of {math.prod(mesh)} devices, over the limit of {MAX_MESH_DEVICES}",
                          file=where, tensor=name)
    axes = entry.get("axis_names")
    if not isinstance(axes, list) or len(axes) != len(mesh) or not all(isinstance(a, str) for a in axes):
        raise HeaderError(f"axis_names {str(axes)[:80]!r} do not name the {len(mesh)} mesh axes",
                          file=where, tensor=name)
    spec_in = entry.get("partition_spec")
    if not isinstance(spec_in, list) or len(spec_in) > MAX_DIMS:
        raise HeaderError(f"partition_spec is {str(spec_in)[:80]!r}, expected a list", file=where, tensor=name)
    spec = []
    for item in spec_in:
        names = [] if item is None else [item] if isinstance(item, str) else item
        if not isinstance(names, list) or not all(isinstance(a, str) and a in axes for a in names):
            raise HeaderError(f"partition_spec entry {str(item)[:80]!r} names no mesh axis of {axes}",
                              file=where, tensor=name)
        spec.append(tuple(names))
    used = [a for names in spec for a in names]
    if len(used) != len(set(used)):
        raise HeaderError(f"partition_spec {spec_in} uses a mesh axis twice", file=where, tensor=name)
    devices = entry.get("device_mesh", {}).get("mesh") if isinstance(entry.get("device_mesh"), dict) else None
    return Sharding(mesh, tuple(axes), tuple(spec), _device_ids(devices, mesh, where, name))


def _device_ids(mesh: Any, shape: tuple[int, ...], where: str, name: str) -> tuple[int, ...]:
    """The device ids of a nested-list mesh, row-major; () when Orbax recorded none."""
    if mesh is None:
        return ()
    level = [mesh]
    for size in shape:
        if not all(isinstance(row, list) and len(row) == size for row in level):
            raise HeaderError(f"device_mesh does not have the mesh shape {list(shape)}", file=where, tensor=name)
        level = [item for row in level for item in row]
    ids = [d.get("id") if isinstance(d, dict) else None for d in level]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise HeaderError("device_mesh holds a device without an id", file=where, tensor=name)
    return tuple(ids)  # type: ignore[arg-type]  # checked just above


def parse_zarr(raw: bytes, where: str, name: str) -> ArrayLayout:
    """An array's `.zarray` (zarr v2) or `zarr.json` (zarr v3), with its chunk grid bounded."""
    if len(raw) > MAX_ARRAY_METADATA_BYTES:
        raise HeaderError(f"is over {MAX_ARRAY_METADATA_BYTES} bytes", file=where, tensor=name)
    meta = _object(parse_json(raw, "zarr metadata", where), "zarr metadata", where)
    version = meta.get("zarr_format")
    if version == 2:
        shape = _int_list(meta.get("shape"), "shape", where, name)
        chunks = _int_list(meta.get("chunks"), "chunks", where, name, low=1)
        dtype = _zarr2_dtype(meta.get("dtype"), where, name)
        if meta.get("order", "C") not in ("C", "F"):
            raise HeaderError(f"order is {meta.get('order')!r}, expected 'C' or 'F'", file=where, tensor=name)
        compressor = meta.get("compressor")
        codecs: tuple[str, ...] = (str(compressor.get("id")),) if isinstance(compressor, dict) else ()
        inner = chunks
        prefix, separator = "", meta.get("dimension_separator", ".")
    elif version == 3:
        shape = _int_list(meta.get("shape"), "shape", where, name)
        grid = meta.get("chunk_grid")
        config = grid.get("configuration") if isinstance(grid, dict) and grid.get("name") == "regular" else None
        if not isinstance(config, dict):
            raise HeaderError(f"chunk_grid is {str(grid)[:80]!r}, expected a regular grid", file=where, tensor=name)
        chunks = _int_list(config.get("chunk_shape"), "chunk_shape", where, name, low=1)
        data_type = meta.get("data_type")
        if not isinstance(data_type, str) or data_type not in ZARR3_DTYPES:
            raise HeaderError(f"data_type {str(data_type)[:40]!r} is not one this reader knows",
                              file=where, tensor=name)
        dtype = ZARR3_DTYPES[data_type]
        codecs, inner = _zarr3_codecs(meta.get("codecs"), chunks, where, name)
        prefix, separator = _zarr3_keys(meta.get("chunk_key_encoding"), where, name)
    else:
        raise HeaderError(f"zarr_format is {str(version)[:20]!r}, expected 2 or 3", file=where, tensor=name)
    if separator not in (".", "/"):
        raise HeaderError(f"chunk key separator {str(separator)[:20]!r} is not '.' or '/'", file=where, tensor=name)
    if len(chunks) != len(shape) or len(inner) != len(shape):
        raise HeaderError(f"chunks {list(chunks)} do not match the shape {list(shape)}", file=where, tensor=name)
    if math.prod(shape) > MAX_NUMEL:
        raise HeaderError(f"shape {list(shape)} holds over {MAX_NUMEL} elements", file=where, tensor=name)
    layout = ArrayLayout(version, dtype, shape, chunks, inner, codecs, prefix, separator)
    if layout.chunk_count > MAX_CHUNKS:
        raise HeaderError(f"shape {list(shape)} in chunks of {list(chunks)} makes {layout.chunk_count} chunks, over "
                          f"the limit of {MAX_CHUNKS}", file=where, tensor=name)
    return layout


def _zarr2_dtype(value: Any, where: str, name: str) -> str:
    if isinstance(value, str) and value in ZARR3_DTYPES:  # tensorstore writes "bfloat16" and the float8 names
        return ZARR3_DTYPES[value]
    try:
        np_dtype = np.dtype(value) if isinstance(value, str) and len(value) <= 8 else None
    except TypeError:
        np_dtype = None
    found = _BY_NUMPY.get(np_dtype) if np_dtype is not None and np_dtype.byteorder in "<|=" else None
    if found is None:
        raise HeaderError(f"dtype {str(value)[:40]!r} is not one this reader knows", file=where, tensor=name)
    return found


def _zarr3_codecs(value: Any, chunks: tuple[int, ...], where: str,
                  name: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(codec names, the chunk a read decodes): a sharding codec's inner chunks, else the grid's chunks."""
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise HeaderError(f"codecs is {str(value)[:80]!r}, expected a list of codecs", file=where, tensor=name)
    names = [str(c.get("name"))[:40] for c in value]
    if names[:1] == ["sharding_indexed"]:
        config = value[0].get("configuration")
        inner_codecs = config.get("codecs") if isinstance(config, dict) else None
        if not isinstance(inner_codecs, list) or not all(isinstance(c, dict) for c in inner_codecs):
            raise HeaderError("has a sharding codec without codecs", file=where, tensor=name)
        inner = _int_list(config.get("chunk_shape"), "the shard's chunk_shape", where, name, low=1)
        return ("sharding_indexed", *(str(c.get("name"))[:40] for c in inner_codecs)), inner
    return tuple(names), chunks


def _zarr3_keys(value: Any, where: str, name: str) -> tuple[str, Any]:
    """(key prefix, separator) of a zarr v3 chunk_key_encoding: "default" is `c/0/1`, "v2" is `0.1`."""
    if not isinstance(value, dict) or value.get("name") not in ("default", "v2"):
        raise HeaderError(f"chunk_key_encoding is {str(value)[:80]!r}, expected 'default' or 'v2'",
                          file=where, tensor=name)
    config = value.get("configuration")
    default = "/" if value["name"] == "default" else "."
    separator = config.get("separator", default) if isinstance(config, dict) else default
    return ("c/" if value["name"] == "default" else ""), separator


def dumps_short(value: Any, limit: int = 2000) -> Any:
    """`value` as Checkpoint.metadata shows it: as it is when small, else a note of its size."""
    text = json.dumps(value, default=str)
    return value if len(text) <= limit else f"<{len(text)} characters of JSON>"
