"""PyTorch Distributed Checkpoint (DCP): `.metadata` plus `__{rank}_{n}.distcp` data files.

`.metadata` is a plain pickle of DCP's metadata dataclasses. dcp_metadata reads it with an allowlist of
stand-in records (in process, or by the C unpickler in a limited child process for a large one) into a
plain summary, which is validated and turned into chunks here, so no torch import and no checkpoint code
is needed. Each tensor item is a torch.save archive at (offset, length) of a data file, parsed lazily on
first read so opening stays a metadata-only operation.

Items may not share bytes, and an uncompressed item must be at least as long
as the chunk it declares, so what a checkpoint declares is bounded by its
files. A zstd-compressed item ("stream.zstd/1") is decompressed whole, in a
stream, into a buffer bounded by what it must hold: its chunk's bytes plus
ZIP_OVERHEAD_ALLOWANCE (MAX_OBJECT_BYTES for an object). A chunk over the read
budget raises BudgetExceededError before anything is decompressed; a frame
that decompresses to fewer or more bytes than that is a HeaderError. The size
a frame header claims is never used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, NamedTuple, cast

import numpy as np
import zstandard

from .. import dtypes, safe_pickle, torchzip
from ..core import DEFAULT_READ_BUDGET, Checkpoint, Chunk, LogicalTensor, MappedArray, ObjectEntry
from ..errors import (
    BudgetExceededError,
    CheckpointError,
    HeaderError,
    MissingFileError,
    TruncatedFileError,
    UnsafePickleError,
    UnsupportedError,
)
from ..pickle_work import KeyHashes
from ..shapes import MAX_DIMS, MAX_OFFSET, check_offset, check_shape, describe
from ..storage import AnyPath, ByteStore, entries, read_head, store_at
from ..tiling import validate_tiling
from ..units import human_bytes
from . import dcp_metadata
from .contract import Detection
from .dcp_summary import TENSOR_ENTRY

NAME = "dcp"

METADATA_FILE = ".metadata"
PER_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")
DATA_FILE_RANK = re.compile(r"^__(\d+)_\d+\.distcp$")
ZIP_OVERHEAD_ALLOWANCE = 1 << 20  # a chunk's archive is its data plus a few KiB of zip and pickle
MAX_OBJECT_BYTES = 1 << 30
ZSTD_MAX_WINDOW = 1 << 27  # the largest window a frame may demand (decoder memory); zstd's own default limit

def _metadata_files(path: AnyPath) -> list[AnyPath]:
    if path.is_file():
        return [path] if path.name == METADATA_FILE or PER_RANK_METADATA.match(path.name) else []
    if not path.is_dir():
        return []
    single = path / METADATA_FILE
    if single.is_file():
        return [single]
    return [p for p in entries(path) if PER_RANK_METADATA.match(p.name) and p.is_file()]


def detect(path: AnyPath) -> Detection | None:
    """The metadata file(s) at `path`, when the first is a pickle of DCP's Metadata."""
    candidates = _metadata_files(path)
    if not candidates:
        return None
    head = read_head(candidates[0], 256)
    return Detection(path, candidates) if head[:1] == b"\x80" and b"torch.distributed.checkpoint" in head else None


class _Item(NamedTuple):  # a tuple: built once per item, 20,000 times for as many tensors
    file: str
    offset: int
    length: int
    transforms: tuple[str, ...]


class DcpItemArray:
    """A tensor chunk stored as a torch.save archive at (offset, length) of a .distcp file.

    A slotted class, not a dataclass: an open makes one per chunk (20,000 for as many tensors), and the dataclass's
    frozen __init__ took a sixth of that open."""

    __slots__ = ("files", "item", "name", "dtype", "shape", "budget", "_mapped_array")

    def __init__(self, files: ByteStore, item: _Item, name: str, dtype: str, shape: tuple[int, ...],
                 budget: int = DEFAULT_READ_BUDGET) -> None:
        self.files, self.item, self.name, self.dtype, self.shape = files, item, name, dtype, shape
        self.budget = budget  # a compressed item is decompressed whole: its chunk must fit this
        self._mapped_array: MappedArray | None = None

    def __repr__(self) -> str:
        return f"DcpItemArray({self.item.file!r}, [{self.item.offset}, +{self.item.length}), {self.name!r})"

    @property
    def reads_regions(self) -> bool:
        """False for a compressed item: every read decompresses it whole (readers then read one region at a time)."""
        return not self.item.transforms

    def with_budget(self, budget: int) -> DcpItemArray:
        if not self.item.transforms:
            return self
        return DcpItemArray(self.files, self.item, self.name, self.dtype, self.shape, budget)

    def array(self) -> np.ndarray:
        if not self.item.transforms:
            return self._mapped().array()
        buffer = cast(memoryview, self.archive())  # decompressed into memory, held only for this read
        ref = self._parse(buffer)
        if math.prod(ref.shape) == 0:
            return np.empty(ref.shape, dtypes.numpy_dtype(ref.dtype))
        strides = None if ref.is_contiguous else tuple(s * dtypes.itemsize(ref.dtype) for s in ref.stride)
        return np.ndarray(ref.shape, dtypes.numpy_dtype(ref.dtype), buffer=buffer, offset=ref.offset, strides=strides)

    def advise(self, index: tuple[slice, ...], advice: str) -> None:
        if not self.item.transforms:
            self._mapped().advise(index, advice)

    def read_into(self, index: tuple[slice, ...], target: np.ndarray) -> bool:
        return not self.item.transforms and self._mapped().read_into(index, target)

    def _mapped(self) -> MappedArray:
        """The tensor inside an uncompressed item, as an array mapped straight from the data file."""
        mapped = self._mapped_array
        if mapped is None:
            ref = self._parse(self.archive())
            mapped = MappedArray(self.files, self.item.file, self.item.offset + ref.offset,
                                 dtypes.numpy_dtype(ref.dtype), ref.shape, None if ref.is_contiguous else ref.stride)
            self._mapped_array = mapped
        return mapped

    def archive(self) -> torchzip.Sliceable:
        """The item's torch.save archive: a view of the mapped data file, or decompressed when transformed."""
        nbytes = math.prod(self.shape) * dtypes.itemsize(self.dtype)
        if self.item.transforms and nbytes > self.budget:
            raise BudgetExceededError(
                f"decompressing this zstd item materialises {human_bytes(nbytes)}, over the read budget of "
                f"{human_bytes(self.budget)} (a compressed item is decompressed whole, whatever slice is read)",
                file=self._path, tensor=self.name)
        return _item_bytes(self.files, self.item, self.name, size=(nbytes, nbytes + ZIP_OVERHEAD_ALLOWANCE))

    def _parse(self, buffer: torchzip.Sliceable) -> torchzip.TensorRef:
        ref = _single_tensor(torchzip.load(buffer, file=self._path, item=self.name), self._path, self.name)
        if ref.dtype != self.dtype or ref.shape != self.shape:
            raise HeaderError(f"item holds {ref.dtype}{list(ref.shape)}, but .metadata declares "
                              f"{self.dtype}{list(self.shape)}", file=self._path, tensor=self.name)
        return ref

    @property
    def _path(self) -> str:  # for errors only
        return self.files.describe(self.item.file)


def _single_tensor(value: Any, file: str, name: str) -> torchzip.TensorRef:
    if not isinstance(value, torchzip.TensorRef):
        raise HeaderError(f"item should hold one tensor, found {type(value).__name__}", file=file, tensor=name)
    return value


def _item_bytes(files: ByteStore, item: _Item, name: str, *, size: tuple[int, int]) -> torchzip.Sliceable:
    """The item's archive bytes: a view of the mapped file (or a lazily fetched window of a remote one), or, when
    transformed, decompressed into a buffer of `size` = (fewest, most) bytes: HeaderError when the item
    decompresses to fewer or more."""
    whole = files.buffer(item.file)
    end = item.offset + item.length
    if not item.transforms:
        return whole[item.offset:end] if isinstance(whole, memoryview) else whole.view(item.offset, end)
    raw = memoryview(whole[item.offset:end])  # a compressed frame is read whole
    path = files.describe(item.file)
    if not all(t.startswith("stream.zstd/") for t in item.transforms):
        raise UnsupportedError(f"item uses transforms {list(item.transforms)}; only zstd ('stream.zstd/1') is "
                               "supported", file=path, tensor=name)
    for position in range(len(item.transforms)):
        fewest = size[0] if position == len(item.transforms) - 1 else 0  # an inner frame is smaller than the archive
        raw = _decompress(raw, (fewest, size[1]), path, name)
    return raw


def _decompress(frame: memoryview, size: tuple[int, int], path: str, name: str) -> memoryview:
    """One zstd frame streamed into a buffer of at most size[1] + 1 bytes (the frame header's size is ignored)."""
    fewest, most = size
    try:
        out = np.empty(most + 1, np.uint8)  # pages are committed only as the stream writes them
    except MemoryError:
        raise BudgetExceededError(f"cannot allocate {human_bytes(most)} to decompress this item", file=path,
                                  tensor=name) from None
    target, written = out.data, 0
    try:
        with zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).stream_reader(frame, closefd=False) as reader:
            while written <= most:
                count = reader.readinto(target[written:])
                if not count:
                    break
                written += count
    except zstandard.ZstdError as exc:
        raise HeaderError(f"zstd-compressed item is corrupt: {exc}", file=path, tensor=name) from None
    if written > most:
        raise HeaderError(f"zstd item decompresses to more than the {most} bytes its chunk allows", file=path,
                          tensor=name)
    if written < fewest:
        raise HeaderError(f"zstd item decompresses to {written} bytes, fewer than the {fewest} bytes of its chunk",
                          file=path, tensor=name)
    return target[:written]


def _decode_object(files: ByteStore, item: _Item, name: str) -> Any:
    path = files.describe(item.file)
    value = torchzip.load(_item_bytes(files, item, name, size=(0, MAX_OBJECT_BYTES)), file=path, item=name)
    if not safe_pickle.is_plain(value):
        raise UnsafePickleError(f"holds a {type(value).__name__}, which is not plain data", file=path, tensor=name)
    return value


def _dtype_of(dtype: Any, file: str, name: str) -> str:
    if dtype not in dtypes.TORCH_DTYPE_NAMES:
        raise HeaderError(f"unsupported or missing dtype {dtype!r}", file=file, tensor=name)
    return dtypes.TORCH_DTYPE_NAMES[dtype]


@dataclass
class _Parsed:
    summaries: list[dict[str, Any]]
    state: dict[str, list[Any]]  # fqn -> [fqn, kind, dtype, size, chunks] (see dcp_summary)
    storage: dict[tuple[str, tuple[int, ...] | None], _Item]


def _parse(files: ByteStore, metadata_names: list[str], where: str) -> _Parsed:
    """Read and merge the metadata file(s): the entries and where each item is stored."""
    summaries = [dcp_metadata.read_summary(files, name) for name in metadata_names]
    state: dict[str, list[Any]] = {}
    storage: dict[tuple[str, tuple[int, ...] | None], _Item] = {}
    hashes = KeyHashes(file=where)  # offsets tuples can be made to share one hash: counted before the dict hashes them
    more_chunks: dict[str, list[Any]] = {}  # per-rank metadata files' chunks, joined once: linear in the files
    for summary in summaries:
        if not state:  # the first file's names are distinct: a summary lists a dict's keys
            state = {entry[0]: entry for entry in summary["entries"]}
        else:
            _merge_entries(state, summary["entries"], more_chunks, where)
        keys, items = [], []
        for fqn, offset, relative, begin, length, transforms in summary["storage"]:
            keys.append((fqn, None) if offset is None else _storage_key(fqn, offset, where))
            items.append(_item(relative, begin, length, transforms, where, fqn))
        hashes.admit(keys, into=storage)
        for relative in {item.file for item in items}:
            files.describe(relative, referrer=where)  # refuses a file outside the folder, naming the metadata file
        storage.update(zip(keys, items))
    for fqn, chunks in more_chunks.items():
        state[fqn][4] = state[fqn][4] + chunks
    return _Parsed(summaries, state, storage)


def _merge_entries(state: dict[str, list[Any]], entries: list[list[Any]], more_chunks: dict[str, list[Any]],
                   where: str) -> None:
    """Another (per-rank) metadata file's entries: new names added, a tensor's chunks gathered into more_chunks."""
    for entry in entries:
        known = state.get(entry[0])
        if known is None:
            state[entry[0]] = entry
        elif known[1] != entry[1]:
            raise HeaderError(f"the metadata files declare it both as {known[1]} and as {entry[1]}", file=where,
                              tensor=entry[0])
        elif entry[1] == TENSOR_ENTRY:
            more_chunks.setdefault(entry[0], []).extend(entry[4])


def checksum_problems(checkpoint: Checkpoint) -> Iterator[tuple[str, CheckpointError | None]]:
    """Check the CRC-32 that every item's zip records for each of its records."""
    files = checkpoint.require_storage()
    names = checkpoint.metadata["metadata_files"]  # the ones open read
    chunks: dict[tuple[str, tuple[int, ...] | None], Any] = {
        (t.name, c.offsets): c.source for t in checkpoint.tensors.values() for c in t.chunks}
    for (fqn, offsets), item in _parse(files, names, files.describe(names[0])).storage.items():
        source = chunks.get((fqn, offsets))
        try:
            buffer = (source.archive() if isinstance(source, DcpItemArray)
                      else _item_bytes(files, item, fqn, size=(0, MAX_OBJECT_BYTES)))
            torchzip.check_crc(buffer, file=files.describe(item.file), item=fqn)
        except CheckpointError as exc:
            yield fqn, exc
        else:
            yield fqn, None


def open(detection: Detection) -> Checkpoint:
    metadata_paths = detection.found or _metadata_files(detection.path)
    if not metadata_paths:
        raise HeaderError("no .metadata file: not a finished DCP checkpoint", file=str(detection.path))
    root, where = metadata_paths[0].parent, str(metadata_paths[0])
    files = store_at(root)
    parsed = _parse(files, [p.name for p in metadata_paths], where)
    state, storage = parsed.state, parsed.storage

    data_files = sorted({item.file for item in storage.values()})
    files.prefetch(data_files, head=0)  # their sizes, asked all at once
    sizes = {}
    for file in data_files:
        try:
            sizes[file] = files.size(file)
        except MissingFileError:
            held = sorted(fqn for (fqn, _), item in storage.items() if item.file == file)
            raise MissingFileError(f"data file is missing; {where} places {len(held)} item(s) in it",
                                   file=files.describe(file), tensor=held[0]) from None
    for key, item in storage.items():
        if item.offset < 0 or item.length < 0 or item.offset + item.length > sizes[item.file]:
            raise TruncatedFileError(f"item [{item.offset}, {item.offset + item.length}) lies past the end of the "
                                     f"{sizes[item.file]}-byte file", file=files.describe(item.file), tensor=key[0])
    _check_disjoint(storage, files)

    tensors: dict[str, LogicalTensor] = {}
    objects: dict[str, ObjectEntry] = {}
    for fqn, entry in state.items():
        kind = entry[1]
        if kind == "BytesStorageMetadata":
            stored = storage.get((fqn, None))
            if stored is None:
                raise HeaderError("no storage entry for this object", file=where, tensor=fqn)
            objects[fqn] = ObjectEntry(fqn, stored.length, stored.file,
                                       loader=partial(_decode_object, files, stored, fqn))
        elif kind == TENSOR_ENTRY:
            tensors[fqn] = _tensor(fqn, entry, storage, files, where)
        else:
            raise HeaderError(f"unknown storage metadata {kind}", file=where, tensor=fqn)

    first = parsed.summaries[0]
    metadata = {
        "version": first["version"],
        "storage_meta": first["storage_meta"],
        "planner_data": first["planner_data"],
        "metadata_files": [p.name for p in metadata_paths],
    }
    return Checkpoint(path=root, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(data_files), storage=files)


def _check_disjoint(storage: dict[tuple[str, tuple[int, ...] | None], _Item], files: ByteStore) -> None:
    """No two items share bytes (dcp.save writes each once), so the tensors declared cannot outgrow the files."""
    spans = sorted((item.file, item.offset, item.offset + item.length, fqn)
                   for (fqn, _), item in storage.items() if item.length)
    for (file, _, end, first), (other, begin, _, second) in zip(spans, spans[1:]):
        if file == other and begin < end:
            raise HeaderError(f"its item at byte {begin} overlaps the item of {first!r}, which ends at byte {end}",
                              file=files.describe(file), tensor=second)


def _storage_key(fqn: str, offset: Any, where: str) -> tuple[str, tuple[int, ...] | None]:
    # only looked up, never computed with: any int64 passes (a negative one matches no chunk and is left unread)
    if offset is None:
        return fqn, None
    if type(offset) is list and len(offset) <= MAX_DIMS:
        for v in offset:
            if type(v) is not int or not -MAX_OFFSET <= v < MAX_OFFSET:
                break
        else:
            return fqn, tuple(offset)
    raise HeaderError(f"MetadataIndex.offset must be at most {MAX_DIMS} 64-bit integers, found {describe(offset)}",
                      file=where, tensor=fqn)


def _item(relative: str, begin: Any, length: Any, transforms: list[str], where: str, fqn: str) -> _Item:
    begin = check_offset(begin, file=where, tensor=fqn, what="storage offset")
    length = check_offset(length, file=where, tensor=fqn, what="storage length")
    return _Item(relative, begin, length, tuple(transforms) if transforms else ())


@lru_cache(maxsize=4096)
def _ranks_of(file: str) -> tuple[int, ...]:
    """The rank that wrote a data file, from its name `__{rank}_{n}.distcp`."""
    match = DATA_FILE_RANK.match(file)
    return (int(match.group(1)),) if match else ()


def _tensor(fqn: str, entry: list[Any], storage: dict, files: ByteStore, where: str) -> LogicalTensor:
    _, _, dtype_name, size, chunk_entries = entry
    dtype = _dtype_of(dtype_name, where, fqn)
    shape = check_shape(size, file=where, tensor=fqn, what="size")
    itemsize = dtypes.itemsize(dtype)
    chunks = []
    for chunk_offsets, chunk_sizes in chunk_entries:
        offsets = check_shape(chunk_offsets, file=where, tensor=fqn, what="chunk offsets")
        sizes = check_shape(chunk_sizes, file=where, tensor=fqn, what="chunk sizes")
        item = storage.get((fqn, offsets))
        if item is None:
            raise HeaderError(f"chunk at offsets {list(offsets)} has no storage entry", file=where, tensor=fqn)
        nbytes = math.prod(sizes) * itemsize
        if not item.transforms and nbytes > item.length:
            raise TruncatedFileError(f"chunk at offsets {list(offsets)} declares {describe(nbytes)} bytes, but its "
                                     f"item is only {item.length} bytes long",
                                     file=files.describe(item.file), tensor=fqn)
        source = DcpItemArray(files, item, fqn, dtype, sizes)
        chunks.append(Chunk(offsets, sizes, item.file, (item.offset, item.offset + item.length), source,
                            _ranks_of(item.file)))
    return LogicalTensor(fqn, dtype, shape, tuple(validate_tiling(fqn, shape, chunks, file=where)))
