"""The Tensormorph format's manifest: the global view of a sharded checkpoint, as JSON.

docs/format.md is the specification; this module writes and validates it.
A folder is a committed checkpoint exactly when `manifest.json` is present
and its own checksum matches: data files are written first, the manifest
last, so a reader never takes a half-written save for a valid one.
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

import crc32c
import numpy as np

from .. import dtypes
from ..errors import CheckpointError, ChecksumError, HeaderError, UnsupportedError
from ..gc_pause import gc_paused
from ..reduction import Reduction
from .checksums import CHECKSUM_BLOCK, pack_crcs, unpack_crcs
from .layout import checked_contributions, contribution_of, partial_mesh_dims, reduce_op
from .parity import MAX_SEGMENT, MAX_STEP_BYTES, parse_scheme

FORMAT = "tensormorph"
VERSION = 1
MANIFEST = "manifest.json"
SAVE_MARKER = ".tensormorph-save"  # inside a temporary folder: names the save it belongs to
TEMP_PREFIX = ".tmp-tensormorph-"
GENERATION_PREFIX = "gen-"  # on object stores, each save's files live in a folder of its own: gen-<id>/
INIT_PREFIX = ".init-tensormorph-"  # a save's folder while its marker is created, before it takes TEMP_PREFIX
CHECKSUM = "crc32c"
MAX_MANIFEST_BYTES = 512 * 1024**2
"""Largest manifest read. Block checksums take 85 MiB of it per TiB of data (64 KiB blocks): about 5 TiB."""
MAX_MANIFEST_VALUES = 1 << 24
"""Most JSON values a manifest may hold, counted before it is parsed by the characters that open them (`,[{:`,
an upper bound). Parsed, a value costs Python up to ~140 bytes (small dicts among the objects, decoded once
more), whatever the bytes that spell it (`[[],[],...]` takes 3 bytes a value), so this, not the size, bounds
memory: 16.8 M values, about 730,000 chunks of 2-D tensors (23 values a chunk; a 7B model and its Adam state
under FSDP on 512 ranks has ~450,000). Measured at this limit, the worst shape (small dicts among the objects)
grows memory by 2.1 GiB (1.2 GiB for empty lists; 2.6 GiB with one 465 MB string besides), beyond the bytes read.
Manifest.to_bytes refuses to write a manifest over either limit, so no save commits what no reader opens."""
MAX_MESH_DIMS = 64  # more mesh dimensions than any run has (numpy's own limit on array dimensions)
_STRUCTURE = b",[{:"  # a JSON value is the first in its container or follows a comma; each key precedes a colon
_TEXT_PIECE = 1 << 24  # characters of the canonical text encoded at a time when checksumming it
_DIM_LIMIT = 2**62  # largest dimension or offset + 1 a manifest may give


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass(frozen=True, eq=False)
class ChunkRecord:
    """One stored box of a tensor: where its bytes are and their block checksums."""

    file: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    byte_range: tuple[int, int]  # [begin, end) in `file`, absolute
    block_crc32c: np.ndarray  # uint32, one per CHECKSUM_BLOCK of the chunk's bytes
    rank: int
    holders: tuple[int, ...] = ()  # every rank that held an identical copy (replicas are stored once)
    contribution: int = 0  # under Partial placements: which contribution this box belongs to

    def to_json(self) -> dict[str, Any]:
        record = {"file": self.file, "offsets": list(self.offsets), "shape": list(self.shape),
                  "byte_range": list(self.byte_range), "crc32c": pack_crcs(self.block_crc32c),
                  "rank": self.rank, "holders": list(self.holders)}
        if self.contribution:
            record["contribution"] = self.contribution
        return record


@dataclass(frozen=True)
class TensorRecord:
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRecord, ...]
    mesh: tuple[int, ...] | None = None  # mesh shape; None for a plain (unsharded) tensor
    mesh_ranks: tuple[int, ...] | None = None  # the mesh's global ranks, row-major
    mesh_dim_names: tuple[str, ...] | None = None
    placements: tuple[str, ...] | None = None

    @property
    def reduction(self) -> Reduction | None:
        """How the contributions combine, for a tensor with Partial placements (validated when parsed)."""
        op = reduce_op(self.placements or ())
        if op is None or self.mesh is None:
            return None
        placements = self.placements or ()
        return Reduction(op, contribution_of(self.mesh, placements, (0,) * len(self.mesh))[1],
                         partial_mesh_dims(placements))

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.mesh is not None:
            record["mesh"] = {"shape": list(self.mesh), "ranks": list(self.mesh_ranks or ()),
                              "dim_names": list(self.mesh_dim_names) if self.mesh_dim_names else None}
            record["placements"] = list(self.placements or ())
        record["chunks"] = [c.to_json() for c in self.chunks]
        return record


@dataclass(frozen=True)
class FileRecord:
    size: int
    crc32c: int
    rank: int


@dataclass(frozen=True)
class Redundancy:
    """Parity or copies of the data files (see parity.py)."""

    scheme: str  # "rs(k,m)" or "replicate:n"
    segment: int
    files: dict[str, FileRecord]  # every parity file and copy
    stripes: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = ()  # (data files, parity files) per stripe

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"scheme": self.scheme, "segment": self.segment, "files": _files_json(self.files)}
        if self.stripes:
            record["stripes"] = [{"data": list(d), "parity": list(p)} for d, p in self.stripes]
        return record


def _files_json(files: dict[str, FileRecord]) -> dict[str, Any]:
    return {name: {"size": f.size, "crc32c": f"{f.crc32c:08x}", "rank": f.rank} for name, f in sorted(files.items())}


@dataclass(frozen=True)
class Manifest:
    tensors: dict[str, TensorRecord]
    objects: dict[str, Any]  # decoded values
    files: dict[str, FileRecord]
    world_size: int
    writer: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    redundancy: Redundancy | None = None

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT, "version": VERSION, "created": self.created, "world_size": self.world_size,
            "writer": self.writer, "checksum": {"algorithm": CHECKSUM, "block": CHECKSUM_BLOCK},
            "files": _files_json(self.files),
            "tensors": {name: t.to_json() for name, t in self.tensors.items()},
            "objects": {name: encode_value(v, name) for name, v in self.objects.items()},
            "extra": self.extra,
        }
        if self.redundancy is not None:
            body["redundancy"] = self.redundancy.to_json()
        text = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        # its own checksum, over the canonical text of the body, which follows verbatim (parse checksums it in place)
        raw = b'{"manifest_crc32c":"%08x","body":%b}' % (crc32c.crc32c(text), text)
        check_readable(raw, sum(len(t.chunks) for t in self.tensors.values()))
        return raw


# ---- non-tensor values as JSON, with tags for what JSON lacks --------------------------------------------

_TAG = "__tm__"


def encode_value(value: Any, where: str) -> Any:
    """A plain value (numbers, strings, bools, None, bytes, lists, tuples, dicts) as JSON-able data."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {_TAG: "float", "value": repr(value)}
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "value": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "value": [encode_value(v, where) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, where) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and k != _TAG for k in value):
            return {k: encode_value(v, where) for k, v in value.items()}
        return {_TAG: "dict", "value": [[encode_value(k, where), encode_value(v, where)] for k, v in value.items()]}
    type_name = type(value).__module__ + "." + type(value).__qualname__
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", None) == 0:
        return encode_value(value.item(), where)  # a numpy scalar
    raise TypeError(f"state entry {where!r} holds a {type_name}, which is not a tensor or plain data "
                    "(numbers, strings, bools, None, bytes, lists, tuples, dicts); convert it or call its state_dict()")


def decode_value(data: Any) -> Any:
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if isinstance(data, dict):
        tag = data.get(_TAG)
        if tag is None:
            return {k: decode_value(v) for k, v in data.items()}
        value = data.get("value")
        if tag == "float" and value in ("nan", "inf", "-inf"):
            return float(value)
        if tag == "bytes" and isinstance(value, str):
            return base64.b64decode(value, validate=True)
        if tag == "tuple" and isinstance(value, list):
            return tuple(decode_value(v) for v in value)
        if tag == "dict" and isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
            return {_hashable(decode_value(k)): decode_value(v) for k, v in value}
        raise ValueError(f"malformed tagged value {_brief(data)}")
    return data


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        raise ValueError("a dict key cannot be a list")
    return key


# ---- reading ------------------------------------------------------------------------------------------

class _NonFinite(ValueError):
    """A NaN or infinite number in a manifest: no saver writes one."""


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise _NonFinite(text)
    return value


def _constant(text: str) -> float:
    raise _NonFinite(text)  # NaN, Infinity, -Infinity


def _body_checksum(raw: bytes, outer: dict, body: Any) -> str:
    """CRC-32C of the body's canonical text. A saver writes the manifest as `{"manifest_crc32c":"...","body":`,
    the canonical body, then `}`: that slice of the bytes read is checksummed in place; any other spelling is
    serialised again, and checksummed a piece at a time rather than copied whole."""
    head = b'{"manifest_crc32c":' + json.dumps(outer.get("manifest_crc32c")).encode() + b',"body":'
    if raw.startswith(head) and raw.endswith(b"}"):
        found = f"{crc32c.crc32c(memoryview(raw)[len(head):-1]):08x}"
        if found == outer.get("manifest_crc32c"):
            return found
    text = json.dumps(body, separators=(",", ":"), allow_nan=False)  # no deeper than json.loads went: it parsed
    value = 0
    for begin in range(0, len(text), _TEXT_PIECE):
        value = crc32c.crc32c(text[begin:begin + _TEXT_PIECE].encode(), value)
    return f"{value:08x}"


def check_readable(raw: bytes, chunks: int) -> None:
    """Refuse to write a manifest that readers would refuse (MAX_MANIFEST_BYTES, MAX_MANIFEST_VALUES): committed,
    it would be a checkpoint no one can open, and resume would pass over it as damaged."""
    values = _count_values(raw)
    if len(raw) > MAX_MANIFEST_BYTES or values > MAX_MANIFEST_VALUES:
        raise UnsupportedError(
            f"the checkpoint has too many chunks for one manifest: {chunks} chunks make {len(raw)} bytes and about "
            f"{values} JSON values, over the limits of {MAX_MANIFEST_BYTES} bytes and {MAX_MANIFEST_VALUES} values "
            "(save fewer, larger shards)", file=MANIFEST)


def _count_values(raw: bytes) -> int:
    return sum(raw.count(c) for c in _STRUCTURE)


def parse(raw: bytes, where: str) -> Manifest:
    """Validate and decode a manifest; every problem is a HeaderError (ChecksumError when damaged).

    Its size and its number of JSON values are bounded (MAX_MANIFEST_BYTES, MAX_MANIFEST_VALUES) before it is
    parsed, so a hostile manifest cannot make the parser build gigabytes of small objects.
    """
    with gc_paused():  # the largest manifest allowed parses 5-8x slower with the collector on
        return _parse(raw, where)


def _parse(raw: bytes, where: str) -> Manifest:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise HeaderError(f"manifest is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit", file=where)
    values = _count_values(raw)
    if values > MAX_MANIFEST_VALUES:
        raise HeaderError(f"manifest holds about {values} JSON values, over the limit of {MAX_MANIFEST_VALUES} "
                          "(about 730,000 chunks)", file=where)
    try:
        outer = json.loads(raw, parse_float=_finite, parse_constant=_constant)
    except _NonFinite:
        raise HeaderError("manifest holds non-finite numbers, which no saver writes", file=where) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ChecksumError(f"manifest is not valid JSON ({_brief(exc)}); it is damaged", file=where) from None
    if not isinstance(outer, dict) or not isinstance(outer.get("body"), dict):
        raise HeaderError("manifest must be an object with 'manifest_crc32c' and 'body'", file=where)
    body = outer["body"]
    found = _body_checksum(raw, outer, body)
    if outer.get("manifest_crc32c") != found:
        raise ChecksumError(f"manifest checksum is {found}, the manifest records "
                            f"{_brief(outer.get('manifest_crc32c'))}: the manifest is damaged", file=where)
    if body.get("format") != FORMAT:
        raise HeaderError(f"manifest format is {_brief(body.get('format'))}, expected {FORMAT!r}", file=where)
    if body.get("version") != VERSION:
        raise HeaderError(f"manifest version {_brief(body.get('version'))} is not supported (this reader knows "
                          f"{VERSION})", file=where)
    checksum = _dict(body.get("checksum"), "checksum", where)
    if checksum.get("algorithm") != CHECKSUM or checksum.get("block") != CHECKSUM_BLOCK:
        raise HeaderError(f"unsupported checksum scheme {_brief(checksum)}", file=where)
    world = _int(body.get("world_size"), "world_size", where, minimum=1)
    files = _file_records(body.get("files"), where)
    tensors = {name: _tensor(name, info, files, where)
               for name, info in _dict(body.get("tensors"), "tensors", where).items()}
    objects = {}
    for name, value in _dict(body.get("objects"), "objects", where).items():
        try:
            objects[name] = decode_value(value)
        except (ValueError, TypeError, RecursionError) as exc:
            raise HeaderError(f"object value cannot be decoded: {_brief(exc)}", file=where, tensor=name) from None
    redundancy = _redundancy(body["redundancy"], files, where) if "redundancy" in body else None
    return Manifest(tensors, objects, files, world, _dict(body.get("writer", {}), "writer", where),
                    str(body.get("created", "")), _dict(body.get("extra", {}), "extra", where), redundancy)


def _file_records(value: Any, where: str) -> dict[str, FileRecord]:
    files: dict[str, FileRecord] = {}
    for name, info in _dict(value, "files", where).items():
        info = _dict(info, f"files[{_brief(name)}]", where)
        files[name] = FileRecord(_int(info.get("size"), "size", where), _hex(info.get("crc32c"), name, where),
                                 _int(info.get("rank"), "rank", where))
    return files


def _redundancy(value: Any, data_files: dict[str, FileRecord], where: str) -> Redundancy:
    value = _dict(value, "redundancy", where)
    text = value.get("scheme")
    try:
        scheme = parse_scheme(text if isinstance(text, str) else repr(text))
    except CheckpointError as exc:
        raise HeaderError(exc.reason, file=where) from None
    segment = _int(value.get("segment"), "segment", where, minimum=1)
    if segment > MAX_SEGMENT or segment * max(scheme.k, 1) > MAX_STEP_BYTES:
        raise HeaderError(f"redundancy segment of {segment} bytes for {scheme} exceeds {MAX_SEGMENT} bytes, or "
                          f"{MAX_STEP_BYTES} bytes over a stripe's k files", file=where)
    files = _file_records(value.get("files"), where)
    stripes = []
    if scheme.kind == "rs":
        raw = value.get("stripes")
        if not isinstance(raw, list):
            raise HeaderError("redundancy stripes must be a list", file=where)
        for stripe in raw:
            stripe = _dict(stripe, "stripe", where)
            data, parity = stripe.get("data"), stripe.get("parity")
            if (not isinstance(data, list) or not isinstance(parity, list) or not 1 <= len(data) <= scheme.k
                    or len(parity) != scheme.m or not all(isinstance(d, str) and d in data_files for d in data)
                    or not all(isinstance(p, str) and p in files for p in parity)):
                raise HeaderError(f"a stripe of {str(scheme)} must list 1..{scheme.k} known data files and "
                                  f"{scheme.m} known parity files, found {_brief(stripe)}", file=where)
            stripes.append((tuple(data), tuple(parity)))
    return Redundancy(str(scheme), segment, files, tuple(stripes))


def _tensor(name: str, info: Any, files: dict[str, FileRecord], where: str) -> TensorRecord:
    info = _dict(info, "tensor record", where, name)
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in dtypes.NUMPY_DTYPES:
        raise HeaderError(f"unknown dtype {_brief(dtype)}", file=where, tensor=name)
    shape = _shape(info.get("shape"), where, name)
    itemsize = dtypes.itemsize(dtype)
    chunks = []
    listed = info.get("chunks")
    if not isinstance(listed, list):
        _fail("chunks must be a list", where, name)
    for raw in listed:
        raw = _dict(raw, "chunk", where, name)
        file = raw.get("file")
        if not isinstance(file, str) or file not in files:
            raise HeaderError(f"chunk names file {_brief(file)}, which the manifest does not list", file=where,
                              tensor=name)
        offsets, chunk_shape = _shape(raw.get("offsets"), where, name), _shape(raw.get("shape"), where, name)
        begin, end = (_int(v, "byte_range", where) for v in _pair(raw.get("byte_range"), where, name))
        nbytes = math.prod(chunk_shape) * itemsize
        if end - begin != nbytes or end > files[file].size:
            raise HeaderError(f"chunk at offsets {list(offsets)} has byte range [{begin}, {end}) but needs {nbytes} "
                              f"bytes inside a {files[file].size}-byte file", file=where, tensor=name)
        if len(offsets) != len(shape) or len(chunk_shape) != len(shape):
            raise HeaderError(f"chunk at offsets {list(offsets)} with shape {list(chunk_shape)} does not have the "
                              f"tensor's {len(shape)} dimensions", file=where, tensor=name)
        blocks = -(-nbytes // CHECKSUM_BLOCK)
        text = raw.get("crc32c")
        try:
            crcs = unpack_crcs(text) if isinstance(text, str) else None
        except ValueError:  # not base64, or not whole uint32s
            crcs = None
        if crcs is None or len(crcs) != blocks:
            raise HeaderError(f"chunk at offsets {list(offsets)} needs {blocks} block checksums (base64 of "
                              "big-endian uint32)", file=where, tensor=name)
        holders = raw.get("holders", [])
        if not isinstance(holders, list) or not all(isinstance(h, int) for h in holders):
            raise HeaderError("chunk holders must be a list of ranks", file=where, tensor=name)
        contribution = raw.get("contribution", 0)
        if not isinstance(contribution, int) or isinstance(contribution, bool) or contribution < 0:
            _fail(f"chunk contribution must be an integer >= 0, found {_brief(contribution)}", where, name)
        chunks.append(ChunkRecord(file, offsets, chunk_shape, (begin, end), crcs,
                                  _int(raw.get("rank"), "rank", where), tuple(holders), contribution))
    mesh = info.get("mesh")
    if mesh is None:
        if any(c.contribution for c in chunks):
            _fail("chunks name contributions, but the tensor has no Partial placement", where, name)
        return TensorRecord(dtype, shape, tuple(chunks))
    mesh = _dict(mesh, "mesh", where, name)
    placements = info.get("placements")
    mesh_shape = _shape(mesh.get("shape"), where, name)
    if len(mesh_shape) > MAX_MESH_DIMS or not all(mesh_shape):
        _fail(f"mesh shape {_brief(list(mesh_shape))} must have 1 to {MAX_MESH_DIMS} dimensions, each of at least "
              "one rank", where, name)
    if (not isinstance(placements, list) or len(placements) != len(mesh_shape)
            or not all(isinstance(p, str) for p in placements)):
        raise HeaderError(f"placements {_brief(placements)} do not match the mesh {_brief(list(mesh_shape))}",
                          file=where, tensor=name)
    names = mesh.get("dim_names")
    record = TensorRecord(dtype, shape, tuple(chunks), mesh_shape, _shape(mesh.get("ranks", []), where, name),
                          tuple(names) if isinstance(names, list) else None, tuple(placements))
    try:
        count = checked_contributions(record.placements or (), mesh_shape, len(shape), dtype)
    except CheckpointError as exc:
        raise HeaderError(exc.reason, file=where, tensor=name) from None
    stray = next((c for c in chunks if c.contribution >= count), None)
    if stray is not None:
        _fail(f"chunk at offsets {list(stray.offsets)} is contribution {stray.contribution}, but the placements "
              f"{placements} give {count}", where, name)
    return record


def _fail(reason: str, where: str, name: str | None = None) -> NoReturn:
    raise HeaderError(reason, file=where, tensor=name)


def _dict(value: Any, what: str, where: str, name: str | None = None) -> dict:
    if not isinstance(value, dict):
        raise HeaderError(f"{what} must be a JSON object, found {type(value).__name__}", file=where, tensor=name)
    return value


def _int(value: Any, what: str, where: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:  # JSON makes no int subclasses but bool, which is refused
        raise HeaderError(f"{what} must be an integer >= {minimum}, found {_brief(value)}", file=where)
    return value


def _hex(value: Any, what: str, where: str) -> int:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{8}", value):
        raise HeaderError(f"checksum of {_brief(what)} must be 8 hex digits, found {_brief(value)}", file=where)
    return int(value, 16)


def _shape(value: Any, where: str, name: str) -> tuple[int, ...]:
    if not _dims(value):
        raise HeaderError(f"expected a list of non-negative integers, found {_brief(value)}", file=where,
                          tensor=name)
    return tuple(value)


def _dims(value: Any) -> bool:
    """A list of integers in [0, 2**62), bools refused: a loop, 2x all() over a generator (3 fields a chunk)."""
    if type(value) is not list:
        return False
    for v in value:  # noqa: SIM110 (a loop: all() over a generator takes twice as long)
        if type(v) is not int or not 0 <= v < _DIM_LIMIT:
            return False
    return True


def _pair(value: Any, where: str, name: str) -> tuple[Any, Any]:
    if not isinstance(value, list) or len(value) != 2:
        raise HeaderError(f"byte_range must be [begin, end], found {_brief(value)}", file=where, tensor=name)
    return value[0], value[1]


def _brief(value: Any, limit: int = 80) -> str:
    """A value from the manifest as it appears in a one-line message: its repr, cut short."""
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
