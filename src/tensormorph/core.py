"""The logical checkpoint: tensors made of chunks, and reads that touch only needed bytes.

A `Checkpoint` maps logical tensor names to `LogicalTensor`s. Each tensor is
tiled by `Chunk`s, each a box of the global tensor (offsets + shape) whose
bytes live in one file. A file-level shard is one chunk covering the whole
tensor; placement sharding gives several chunks. Reads intersect the request
with each chunk and copy only the overlap, so a slice of a huge tensor reads
only the pages it needs.
"""

from __future__ import annotations

import difflib
import math
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol, cast

import numpy as np

from . import dtypes
from .errors import BudgetExceededError, CheckpointError, TensorNotFoundError
from .geometry import byte_runs
from .indexing import IndexPlan
from .reduction import Reduction
from .reduction import combine as fold_contribution
from .reduction import finish as finish_reduction
from .storage import AnyPath, ByteStore
from .storage.strided import read_strided
from .units import human_bytes

DEFAULT_READ_BUDGET = 2 * 1024**3
"""Reads that would materialise more bytes than this raise BudgetExceededError."""

SUGGESTION_POOL = 32
"""Names taken from either side of a mistyped name, in sorted order and in sorted reversed order, for difflib
to rank: difflib over every name of a 100,000-tensor checkpoint takes seconds, this takes milliseconds."""


class ChunkSource(Protocol):
    """Produces a chunk's local data as a numpy array (ideally a lazy memory-mapped view).

    A source backed by a memory map may also offer `advise(index, advice)`, which reads use to
    prefetch exactly the bytes of a region and to release them once copied, and `read_into(index,
    target)` to read a contiguous region straight into the result (a source with checksums checks the bytes it
    read there). A source with checksums offers `verify(index)`, called before a region is read through
    `array()`, which then returns data unchecked, while
    `Chunk.read()` (the whole chunk) goes through `checked()` when the source has it. A source that decodes its
    whole chunk on every read (a compressed item) says so with `reads_regions` False.
    """

    def array(self) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class MappedArray:
    """A chunk stored raw at a byte offset of a file (safetensors, torch storages)."""

    files: ByteStore
    file: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None  # in elements; None means C-contiguous

    def array(self) -> np.ndarray:
        if math.prod(self.shape) == 0:
            return np.empty(self.shape, self.dtype)
        if not self.files.mappable:  # remote: the whole chunk, fetched
            return self._fetch(tuple(slice(0, n, 1) for n in self.shape))
        buffer = cast(memoryview, self.files.buffer(self.file))  # a mappable store's buffer is a memory map
        return np.ndarray(self.shape, self.dtype, buffer=buffer, offset=self.offset, strides=self._byte_strides())

    def _fetch(self, index: tuple[slice, ...]) -> np.ndarray:
        return read_strided(self.files, self.file, self.offset, self.shape, self._byte_strides(), self.dtype, index)

    def advise(self, index: tuple[slice, ...], advice: str) -> None:
        """Tell the kernel which bytes a read of `index` needs ("willneed") or no longer needs ("dontneed")."""
        runs = byte_runs(self.offset, self.shape, self._byte_strides(), self.dtype.itemsize, index)
        self.files.advise(self.file, runs, advice)

    def read_into(self, index: tuple[slice, ...], target: np.ndarray) -> bool:
        """Read `index` straight from the file into `target` when it is one contiguous run of bytes, or whole
        rows of a C-ordered array (their reads queued at once, storage.scattered).

        Large sequential reads run at the disk's rate this way, without faulting pages in through the
        memory map. Returns False (and does nothing) when the layout does not allow it. From a remote store it
        always reads: exactly the bytes of each row of the region.
        """
        if not self.files.mappable:
            if not isinstance(target, np.ndarray):  # a 0-d result's element: the caller assigns the array read
                return False
            target[...] = self._fetch(index)
            return True
        if target.dtype != self.dtype or not target.flags.c_contiguous or target.nbytes < DIRECT_READ_MIN:
            return False
        runs = byte_runs(self.offset, self.shape, self._byte_strides(), self.dtype.itemsize, index)
        flat = target.reshape(-1).view(np.uint8).data
        if len(runs) == 1 and runs[0][1] - runs[0][0] == target.nbytes:
            self.files.read_into(self.file, runs[0][0], flat)
            return True
        # Whole rows of a C-ordered array, in order, are the region's bytes: read them with their reads queued
        # at once (a cold disk serves them in parallel) rather than fault them in through the map one by one.
        if (self.strides is None and target.nbytes // len(runs) >= SCATTERED_ROW_MIN
                and sum(end - begin for begin, end in runs) == target.nbytes):
            self.files.read_runs(self.file, runs, flat)
            return True
        return False

    def _byte_strides(self) -> tuple[int, ...] | None:
        return None if self.strides is None else tuple(s * self.dtype.itemsize for s in self.strides)


DIRECT_READ_MIN = 1 << 20  # below this, copying from the memory map costs less than a system call
SCATTERED_ROW_MIN = 1024  # rows shorter than this on average are copied from the map: a call each would cost more


@dataclass(frozen=True)
class Placement:
    """How a tensor was distributed: a device mesh and one placement per mesh dimension."""

    mesh_shape: tuple[int, ...]
    placements: tuple[str, ...]  # e.g. ("Shard(0)", "Replicate()")
    mesh_dim_names: tuple[str, ...] | None = None

    def __str__(self) -> str:
        names = self.mesh_dim_names or tuple(f"d{i}" for i in range(len(self.mesh_shape)))
        mesh = ", ".join(f"{n}={s}" for n, s in zip(names, self.mesh_shape))
        return f"mesh({mesh}) [{', '.join(self.placements)}]"


@dataclass(frozen=True, slots=True)
class Chunk:
    """One stored box of a logical tensor."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    file: str | None
    byte_range: tuple[int, int] | None  # [begin, end) of the data in `file`, when stored raw
    source: ChunkSource = field(repr=False, compare=False)
    ranks: tuple[int, ...] = ()  # ranks that wrote (or hold) this chunk, when the format records it
    contribution: int = 0  # under a Partial placement: which of the tensor's contributions this box is part of

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self) -> np.ndarray:
        """This chunk's data (a read-only memory-mapped view where possible), checked when the format can."""
        checked = getattr(self.source, "checked", None)
        return checked() if checked is not None else self.source.array()


@dataclass(frozen=True, eq=False, slots=True)
class LogicalTensor:
    """A tensor as the model sees it, whatever the files and ranks it was split over."""

    name: str
    dtype: str  # safetensors vocabulary: "F32", "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    placement: Placement | None = None
    file_shard: tuple[int, int] | None = None  # (k, n): file-level sharding, "shard k of n"
    read_budget: int = DEFAULT_READ_BUDGET
    reduction: Reduction | None = None  # Partial placements: the value is this reduction of the contributions

    @property
    def numpy_dtype(self) -> np.dtype:
        return dtypes.numpy_dtype(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.numpy_dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def files(self) -> tuple[str, ...]:
        if len(self.chunks) == 1:  # most tensors: no generator, no dict
            file = self.chunks[0].file
            return () if file is None else (file,)
        return tuple(dict.fromkeys(c.file for c in self.chunks if c.file is not None))

    @property
    def is_placement_sharded(self) -> bool:
        return len(self.chunks) > 1

    @property
    def tiling(self) -> tuple[Chunk, ...]:
        """Chunks that cover the tensor once: all of them, or under Partial those of the first contribution
        (reads through the tensor still reduce every contribution)."""
        return self.chunks if self.reduction is None else tuple(c for c in self.chunks if c.contribution == 0)

    def __getitem__(self, index: Any) -> np.ndarray:
        return self.read(index)

    def read(self, index: Any = Ellipsis, *, budget: int | None = None) -> np.ndarray:
        """Read a region (ints, slices with steps, Ellipsis), touching only overlapping chunks."""
        plan = IndexPlan.build(index, self.shape, self.name)
        limit = self.read_budget if budget is None else budget
        nbytes = math.prod(plan.out_shape) * self.numpy_dtype.itemsize
        if nbytes > limit:
            raise BudgetExceededError(
                f"reading {human_bytes(nbytes)} exceeds the read budget of {human_bytes(limit)}; "
                "read a smaller slice, raise the budget, or call full(force=True)",
                tensor=self.name,
                file=self.files[0] if self.files else None,
            )
        try:
            out = np.empty(plan.out_shape, self.numpy_dtype)
        except (ValueError, OverflowError, MemoryError) as exc:
            raise CheckpointError(f"cannot allocate a result of shape {plan.out_shape}: {exc}",
                                  tensor=self.name) from None
        for chunk in self.tiling:
            selection = plan.intersect(chunk.offsets, chunk.shape)
            if selection is not None:
                self._copy(chunk, selection[0], out, selection[1])
        if self.reduction is not None:  # fold in the other contributions, one chunk's overlap at a time
            for chunk in sorted((c for c in self.chunks if c.contribution), key=lambda c: c.contribution):
                selection = plan.intersect(chunk.offsets, chunk.shape)
                for source_index, target_index in _row_blocks(selection, out, PARTIAL_BLOCK_BYTES):
                    target = out[target_index + (Ellipsis,)]  # a view, also of a 0-d result
                    piece = np.empty(target.shape, self.numpy_dtype)
                    self._copy(chunk, source_index, piece, (Ellipsis,))
                    fold_contribution(self.reduction.op, target, piece, self.name)
            finish_reduction(self.reduction.op, out, self.reduction.contributions)
        return plan.finish(out)

    def _copy(self, chunk: Chunk, source_index: tuple[slice, ...], out: np.ndarray, target_index: tuple) -> None:
        """Copy `source_index` of a chunk into `target_index` of `out`."""
        advise = getattr(chunk.source, "advise", None)
        read_into = getattr(chunk.source, "read_into", None)
        verify = getattr(chunk.source, "verify", None)
        try:
            if read_into is not None and read_into(source_index, out[target_index]):
                return  # a source with checksums checks what it read
            if verify is not None:
                verify(source_index)  # formats with block checksums check what this read touches
            if advise is not None:
                advise(source_index, "willneed")  # the kernel fetches exactly these bytes, in parallel
            out[target_index] = chunk.source.array()[source_index] if verify else chunk.read()[source_index]
            if advise is not None:
                advise(source_index, "dontneed")  # copied: the mapped pages need not count in our memory
        except CheckpointError:
            raise
        except (ValueError, OSError, TypeError) as exc:
            raise CheckpointError(f"cannot read chunk at offsets {chunk.offsets}: {exc}",
                                  file=chunk.file, tensor=self.name) from exc

    def full(self, *, force: bool = False) -> np.ndarray:
        """The whole logical tensor; refuses above the read budget unless force=True."""
        return self.read(Ellipsis, budget=None if not force else max(self.nbytes, 1))

    def local(self, rank: int) -> np.ndarray:
        """The data that one rank holds: its chunk as a read-only mapped view, or, when its share is
        several boxes forming one run of the flattened tensor (ZeRO partitions), that run in 1-D."""
        held = self._held_by(rank)
        if len(held) == 1:
            return held[0].read()
        return self.local_tensor(rank).read()

    def local_tensor(self, rank: int) -> LogicalTensor:
        """What one rank holds, as a tensor of its own for lazy region reads: shaped like its chunk,
        or 1-D when its share is several boxes forming one run of the flattened tensor."""
        held = self._held_by(rank)
        if len(held) == 1:
            chunk = held[0]
            return replace(self, name=f"{self.name}@rank{rank}", shape=chunk.shape, placement=None, reduction=None,
                           chunks=(replace(chunk, offsets=(0,) * len(chunk.shape), contribution=0),))
        # one run of the box that bounds them (a ZeRO partition of a tensor-parallel shard is a run of the
        # shard, not of the whole tensor), or else of the whole tensor
        low = tuple(min(c.offsets[d] for c in held) for d in range(self.ndim))
        frame = tuple(max(c.offsets[d] + c.shape[d] for c in held) - low[d] for d in range(self.ndim))
        ordered = _one_run(held, low, frame) or _one_run(held, (0,) * self.ndim, self.shape)
        if ordered is None:
            raise CheckpointError(
                f"rank {rank} holds {len(held)} chunks at offsets {[c.offsets for c in held]} that are not one "
                "run of the flattened tensor; read them with chunk.read()", tensor=self.name)
        base, end = ordered[0][0], ordered[-1][0] + ordered[-1][1].numel
        flat = tuple(Chunk((start - base,), (chunk.numel,), chunk.file, chunk.byte_range, _FlatSource(chunk.source),
                           chunk.ranks) for start, chunk in ordered)
        return replace(self, name=f"{self.name}@rank{rank}", shape=(end - base,), chunks=flat, placement=None,
                       reduction=None)

    def _held_by(self, rank: int) -> list[Chunk]:
        held = [c for c in self.chunks if rank in c.ranks]
        if held:
            return [c for c in held if c.numel] or held[:1]
        writers = sorted({r for c in self.chunks for r in c.ranks})
        detail = f"chunks were written by ranks {writers}" if writers else "this format records no ranks"
        raise CheckpointError(
            f"rank {rank} holds no stored chunk ({detail}; replicated copies are stored once)", tensor=self.name
        )

    def with_budget(self, budget: int) -> LogicalTensor:
        """This tensor with another read budget; sources that materialise a whole chunk (a compressed item)
        take it too."""
        chunks = [c if not hasattr(c.source, "with_budget") else replace(c, source=c.source.with_budget(budget))
                  for c in self.chunks]
        return replace(self, read_budget=budget, chunks=tuple(chunks))

    def _repr_html_(self) -> str:  # notebooks: a layer above (pyproject's ignore_imports says why)
        from .notebook import tensor_html
        return tensor_html(self)


PARTIAL_BLOCK_BYTES = 16 << 20
"""A Partial tensor's contributions are folded into a read's result in row blocks of about this size, so the
reduction needs this much memory besides the result, however large the region."""


def _row_blocks(selection: tuple[tuple[slice, ...], tuple[slice, ...]] | None, out: np.ndarray,
                limit: int) -> Iterator[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """A chunk's (source, target) selection cut along the first axis into blocks of about `limit` bytes."""
    if selection is None:
        return
    source, target = selection
    if not target:
        yield source, target
        return
    rows = target[0].stop - target[0].start
    row_bytes = max(1, out[target + (Ellipsis,)].nbytes // max(1, rows))
    step = max(1, limit // row_bytes)
    for first in range(0, rows, step):
        last = min(rows, first + step)
        stride = source[0].step or 1
        yield ((slice(source[0].start + first * stride, source[0].start + (last - 1) * stride + 1, stride),)
               + source[1:], (slice(target[0].start + first, target[0].start + last),) + target[1:])


def _one_run(chunks: list[Chunk], origin: tuple[int, ...], frame: tuple[int, ...]) -> list[tuple[int, Chunk]] | None:
    """The chunks with their flat starts in the box at `origin` of shape `frame`, in order, when each is one
    contiguous run there and each starts where the one before it ends; else None."""
    starts = [_flat_start(tuple(o - b for o, b in zip(c.offsets, origin)), c.shape, frame) for c in chunks]
    if any(start is None for start in starts):
        return None
    ordered = sorted(((cast(int, start), c) for start, c in zip(starts, chunks)), key=lambda item: item[0])
    ends = [start + chunk.numel for start, chunk in ordered]
    if any(start != end for (start, _), end in zip(ordered[1:], ends)):
        return None
    return ordered


def _flat_start(offsets: tuple[int, ...], shape: tuple[int, ...], frame: tuple[int, ...]) -> int | None:
    """Where a box starts in the flattened `frame`, when its elements are one contiguous run there."""
    dims = len(frame)
    # contiguous when the dimensions before the first one longer than 1 are single indices and all
    # dimensions after it are whole
    first = next((d for d in range(dims) if shape[d] != 1), dims - 1)
    if any(shape[d] != frame[d] for d in range(first + 1, dims)):
        return None
    return sum(o * math.prod(frame[d + 1:]) for d, o in enumerate(offsets))


@dataclass(frozen=True, slots=True)
class _FlatSource:
    """A chunk's data flattened to 1-D (its array is C-contiguous, so this is a view)."""

    inner: ChunkSource

    def array(self) -> np.ndarray:
        return self.inner.array().reshape(-1)


@dataclass(frozen=True)
class ObjectEntry:
    """A non-tensor entry (step counters, config, RNG state...)."""

    name: str
    nbytes: int | None
    file: str | None
    loader: Callable[[], Any] = field(repr=False, compare=False)

    def value(self) -> Any:
        """The decoded value; raises UnsafePickleError when it is not plain data."""
        return self.loader()


def in_memory(value: Any) -> Callable[[], Any]:
    """The loader of an object decoded already, with the index that lists it (a manifest, a pickle)."""
    return lambda: value


@dataclass(frozen=True, eq=False)
class Checkpoint(Mapping[str, LogicalTensor]):
    """One logical checkpoint, whatever the files and ranks it is stored in."""

    path: AnyPath  # a local Path, or a RemotePath for a checkpoint under a URL
    format: str
    tensors: Mapping[str, LogicalTensor]
    objects: Mapping[str, ObjectEntry] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    files: tuple[str, ...] = ()  # data files, relative to the checkpoint folder
    storage: ByteStore | None = field(default=None, repr=False)  # every reader opens a checkpoint on one

    @cached_property
    def _name_orders(self) -> tuple[list[str], list[str]]:
        """The tensor names sorted, and their reversals sorted: built on the first miss, for suggestions."""
        return sorted(self.tensors), sorted(n[::-1] for n in self.tensors)

    def __getitem__(self, name: str) -> LogicalTensor:
        try:
            return self.tensors[name]
        except KeyError:
            near = near_names(name, *self._name_orders) if isinstance(name, str) else []
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise TensorNotFoundError(f"no such tensor in the checkpoint{hint}", file=str(self.path),
                                      tensor=name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return self.tensors.get(name, default)  # a miss is an answer here: no suggestions to compute

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def require_storage(self) -> ByteStore:
        """The byte store its reader opened it on; CheckpointError for a Checkpoint built without one."""
        if self.storage is None:
            raise CheckpointError("has no byte store: it was not opened by a format reader", file=str(self.path))
        return self.storage

    @property
    def header_bytes_read(self) -> int:
        return self.storage.header_bytes_read if self.storage else 0

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Checkpoint {self.format} {str(self.path)!r}: {len(self.tensors)} tensors, {human_bytes(self.nbytes)}>"

    def _repr_html_(self) -> str:  # notebooks: a layer above (pyproject's ignore_imports says why)
        from .notebook import checkpoint_html
        return checkpoint_html(self)


def near_names(name: str, forward: list[str], backward: list[str], count: int = 3) -> list[str]:
    """The names most like a mistyped `name` (difflib's best ratio, at least 0.6, and any tied with it), as git
    suggests, among the names `forward` (sorted) whose reversals are `backward` (sorted).

    A typo leaves the text before it or after it intact, so the candidates are the names next to `name` in
    sorted order and next to it in the sorted order of reversed names: SUGGESTION_POOL of each, on either side.
    """
    pool = forward
    if len(pool) > 4 * SUGGESTION_POOL:
        pool = _around(name, forward) + [n[::-1] for n in _around(name[::-1], backward)]
    matches = difflib.get_close_matches(name, list(dict.fromkeys(pool)), n=count, cutoff=0.6)
    score = [difflib.SequenceMatcher(None, name, match).ratio() for match in matches]
    return [match for match, s in zip(matches, score) if s == score[0]]  # only the best, or those tied with it


def _around(key: str, ordered: list[str]) -> list[str]:
    at = bisect_left(ordered, key)
    return ordered[max(0, at - SUGGESTION_POOL):at + SUGGESTION_POOL]
