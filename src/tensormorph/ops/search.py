"""Find what matters in a tensor: the first NaN or Inf, the largest |x|, the smallest or largest finite value,
in a diff the largest |a − b|; and the positions of every non-finite value, by which tiles flag the blocks
holding one at any zoom.

Every search streams the tensor in blocks: boxes cut from each chunk of the tiling (as the statistics do),
read through the tensor so that Partial values are reduced. The next block is read in a thread while this
one is searched, so a search costs about one sequential read, and holds two blocks. `search_steps` yields
its progress between blocks: a caller cancels it by closing the generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..core import LogicalTensor
from ..errors import CheckpointError
from ..geometry import split_box
from .stats import check_scannable

# bytes of a block: two are held (one searched, one being read). Under glibc's 32 MiB mmap threshold, freed
# blocks are reused from the heap instead of faulted in afresh (measured: 64 MiB blocks scan ~25% slower)
DEFAULT_BLOCK_BYTES = 16 * 1024**2
FINDS = ("nan", "inf", "absmax", "min", "max")
DIFF_FINDS = ("absdiff", "nan", "inf")
MAX_NONFINITE_POSITIONS = 1 << 20  # positions kept per tensor (9 bytes each): beyond, tiles fall back to samples
NAN_FLAG, POSINF_FLAG, NEGINF_FLAG = 1, 2, 4  # bits of a non-finite flag (docs/viewer-api.md)

Box = tuple[slice, ...]
T = TypeVar("T")


@dataclass(frozen=True)
class Progress:
    bytes: int  # read so far
    total: int  # bytes the search reads at most


@dataclass(frozen=True)
class SearchResult:
    find: str
    found: bool
    index: tuple[int, ...] | None  # in the coordinates of the tensor searched
    value: float | None  # the element found (for absdiff: |a − b|)
    bytes_read: int
    a: float | None = None  # a diff's two sides at `index`
    b: float | None = None

    def to_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {"find": self.find, "found": self.found,
                                  "index": list(self.index) if self.index is not None else None,
                                  "value": self.value, "bytes_read": self.bytes_read}
        if self.find == "absdiff" or self.a is not None:
            record.update(a=self.a, b=self.b)
        return record


@dataclass(frozen=True)
class NonFinite:
    """Where a tensor's NaN and Inf values are: flat C-order positions (sorted) and their flags."""

    shape: tuple[int, ...]
    nan: int
    inf: int
    positions: np.ndarray  # int64
    flags: np.ndarray  # uint8, NAN_FLAG | POSINF_FLAG | NEGINF_FLAG
    complete: bool  # every non-finite element is listed

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.flags.nbytes

    def to_dict(self) -> dict[str, Any]:
        return {"nan": self.nan, "inf": self.inf, "positions": int(self.positions.size), "complete": self.complete}

    @staticmethod
    def none(shape: tuple[int, ...]) -> NonFinite:
        """A tensor known to hold only finite values."""
        return NonFinite(shape, 0, 0, np.empty(0, np.int64), np.empty(0, np.uint8), True)

    @staticmethod
    def unknown(shape: tuple[int, ...]) -> NonFinite:
        """A tensor whose scan could not finish (a damaged block): nothing listed, nothing promised."""
        return NonFinite(shape, 0, 0, np.empty(0, np.int64), np.empty(0, np.uint8), False)

    def difference(self, other: NonFinite, *, absolute: bool = False) -> NonFinite:
        """Where a − b (|a − b| with absolute) is not finite, for a = self and b = other of one shape: a position
        is non-finite on either side; its flag is the class of the difference of the two classes."""
        positions = np.union1d(self.positions, other.positions)
        with np.errstate(invalid="ignore"):  # inf - inf is NaN, as it should be
            delta = _class_values(self, positions) - _class_values(other, positions)
        if absolute:
            delta = np.abs(delta)
        flags = flags_of(delta)
        keep = flags > 0
        nan = int((flags == NAN_FLAG).sum())
        return NonFinite(self.shape, nan, int(keep.sum()) - nan, positions[keep], flags[keep],
                         self.complete and other.complete)


def _class_values(nonfinite: NonFinite, positions: np.ndarray) -> np.ndarray:
    """NaN, +Inf or −Inf where `nonfinite` lists a position, 0 (a finite stand-in) elsewhere."""
    out = np.zeros(positions.size, np.float64)
    if nonfinite.positions.size:
        at = np.minimum(np.searchsorted(nonfinite.positions, positions), nonfinite.positions.size - 1)
        listed = nonfinite.positions[at] == positions
        table = np.array([0.0, np.nan, np.inf, 0.0, -np.inf, 0.0, 0.0, 0.0])
        out[listed] = table[nonfinite.flags[at[listed]]]
    return out


def flags_of(values: np.ndarray) -> np.ndarray:
    """The non-finite flag of each value (0 where finite)."""
    flags = np.zeros(values.shape, np.uint8)
    flags[np.isnan(values)] = NAN_FLAG
    flags[values == np.inf] = POSINF_FLAG
    flags[values == -np.inf] = NEGINF_FLAG
    return flags


# ---------------------------------------------------------------- streaming

def pieces(tensor: LogicalTensor, block_elements: int) -> Iterator[Box]:
    """Boxes of at most `block_elements` covering the tensor once: each chunk of the tiling cut in row order."""
    for chunk in tensor.tiling:
        if chunk.numel:
            yield from split_box(tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape)), block_elements)


def read_ahead(boxes: Iterator[Box], read: Callable[[Box], T]) -> Iterator[tuple[Box, T]]:
    """(box, read(box)) in order, the next box read in a thread while the caller works on this one. Closing the
    generator waits for the one read in flight, then returns."""
    with ThreadPoolExecutor(1, thread_name_prefix="tensormorph-read-ahead") as pool:
        box = next(boxes, None)
        pending: Future[T] | None = pool.submit(read, box) if box is not None else None
        while pending is not None and box is not None:
            data = pending.result()
            following = next(boxes, None)
            pending = pool.submit(read, following) if following is not None else None
            yield box, data
            box = following


def _blocks(tensor: LogicalTensor, block_bytes: int) -> Iterator[tuple[Box, np.ndarray]]:
    itemsize = tensor.numpy_dtype.itemsize
    elements = max(1, block_bytes // itemsize)
    budget = max(1, elements * itemsize * 2)
    return read_ahead(pieces(tensor, elements), lambda box: tensor.read(box, budget=budget).reshape(-1))


def _working(block: np.ndarray) -> np.ndarray:
    """A 1-D block in a dtype numpy searches fast: float32/64 as they are, other floats as float32, integers as
    int64 (|x| of int8's -128 stays right), booleans as 0/1, complex values by magnitude."""
    if block.dtype in (np.float32, np.float64):
        return block
    kind = block.dtype.kind
    if kind == "b":
        return block.view(np.uint8)
    if kind == "u" and block.dtype.itemsize == 8:
        return block
    if kind in "iu":
        return block.astype(np.int64)
    if kind == "c":
        return np.abs(block)
    return block.astype(np.float32)  # float16, bfloat16, fp8


def _is_float(array: np.ndarray) -> bool:
    return array.dtype.kind == "f"


def _locate(box: Box, k: int) -> tuple[int, ...]:
    """The tensor index of element k (C order) of a box."""
    local = np.unravel_index(k, tuple(s.stop - s.start for s in box)) if box else ()
    return tuple(int(s.start + i) for s, i in zip(box, local))


def _finite_range(values: np.ndarray) -> tuple[Any, Any, bool] | None:
    """(min, max, all finite) of the finite values; None when there is none."""
    low, high = values.min().item(), values.max().item()  # Python numbers: -low of a uint64 does not wrap
    if not _is_float(values) or (math.isfinite(low) and math.isfinite(high)):
        return low, high, True
    finite = np.isfinite(values)
    if not finite.any():
        return None
    return (np.min(values, where=finite, initial=np.inf).item(), np.max(values, where=finite, initial=-np.inf).item(),
            False)


class _Extreme:
    """The running extreme of a search over finite values; the first in scan order on ties."""

    def __init__(self, find: str):
        self.find = find
        self.best: Any = None
        self.index: tuple[int, ...] | None = None
        self.value: Any = None

    def add(self, box: Box, values: np.ndarray) -> int | None:
        """Search `values` (the block `box`); the position in the block of a new extreme, else None."""
        found = _finite_range(values) if values.size else None
        if found is None:
            return None
        low, high, finite = found
        score = {"min": -low, "max": high, "absmax": max(-low, high)}[self.find]
        if self.best is not None and not score > self.best:
            return None
        if self.find == "absmax":
            hits = (values == high) | (values == low) if high == -low else (values == (high if score == high else low))
            k = int(np.flatnonzero(hits)[0])
        elif finite:
            k = int(np.argmin(values) if self.find == "min" else np.argmax(values))
        else:
            k = int(np.flatnonzero(values == (low if self.find == "min" else high))[0])
        self.best, self.index, self.value = score, _locate(box, k), values[k].item()
        return k


def search_steps(tensor: LogicalTensor, find: str, *, skip: int = 0,
                 block_bytes: int = DEFAULT_BLOCK_BYTES) -> Generator[Progress | SearchResult, None, None]:
    """Progress after every block, then the SearchResult (see `search`)."""
    if find not in FINDS:
        raise CheckpointError(f"unknown search {find!r}: use one of {', '.join(FINDS)}", tensor=tensor.name)
    check_scannable(tensor)
    total, done = tensor.nbytes, 0
    if find in ("nan", "inf") and tensor.numpy_dtype.kind in "biu":  # no such values: nothing to read
        yield SearchResult(find, False, None, None, 0)
        return
    itemsize = tensor.numpy_dtype.itemsize
    extreme = _Extreme(find)
    for box, raw in _blocks(tensor, block_bytes):
        done += raw.size * itemsize
        values = _working(raw)
        if find in ("nan", "inf"):
            if _is_float(values) and values.size and not (math.isfinite(values.min()) and math.isfinite(values.max())):
                hits = np.flatnonzero(np.isnan(values) if find == "nan" else np.isinf(values))
                if skip < hits.size:
                    k = int(hits[skip])
                    yield SearchResult(find, True, _locate(box, k), float(values[k]), done)
                    return
                skip -= hits.size
        else:
            extreme.add(box, values)
        yield Progress(done, total)
    found = extreme.index is not None
    yield SearchResult(find, found, extreme.index, float(extreme.value) if found else None, done)


def search(tensor: LogicalTensor, find: str, *, skip: int = 0, block_bytes: int = DEFAULT_BLOCK_BYTES,
           progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Find in `tensor` (a LogicalTensor, or the local(rank) view `t.local_tensor(rank)`):

    - "nan" / "inf": the first NaN / ±Inf in scan order (chunk by chunk, row-major inside a chunk), after
      passing over `skip` of them; stops reading when found;
    - "absmax", "min", "max": the finite element with the largest |x|, the smallest, the largest value
      (the first in scan order on ties); reads the whole tensor.
    """
    return _run(search_steps(tensor, find, skip=skip, block_bytes=block_bytes), progress)


def search_diff_steps(a: LogicalTensor, b: LogicalTensor, find: str, *, skip: int = 0,
                      block_bytes: int = DEFAULT_BLOCK_BYTES) -> Generator[Progress | SearchResult, None, None]:
    """Progress after every block, then the SearchResult (see `search_diff`); "nan" and "inf" pass over `skip`
    hits (the page's "next")."""
    if find not in DIFF_FINDS:
        raise CheckpointError(f"unknown diff search {find!r}: use one of {', '.join(DIFF_FINDS)}", tensor=a.name)
    if a.shape != b.shape:
        raise CheckpointError(f"shapes differ: {list(a.shape)} vs {list(b.shape)}", tensor=a.name)
    check_scannable(a)
    check_scannable(b)
    sizes = a.numpy_dtype.itemsize + b.numpy_dtype.itemsize
    elements = max(1, block_bytes // 8)  # the difference is computed in float64
    total, done = a.numel * sizes, 0

    def read(box: Box) -> tuple[np.ndarray, np.ndarray]:
        budget = max(1, elements * 16)
        return a.read(box, budget=budget).reshape(-1), b.read(box, budget=budget).reshape(-1)

    extreme = _Extreme("max")
    pair = (math.nan, math.nan)
    for box, (left, right) in read_ahead(pieces(a, elements), read):
        done += left.size * sizes
        left64, right64 = _working(left).astype(np.float64), _working(right).astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            delta = left64 - right64
        if find == "absdiff":
            at = extreme.add(box, np.abs(delta))
            if at is not None:
                pair = (float(left64[at]), float(right64[at]))
        elif delta.size and not np.isfinite(delta).all():
            hits = np.flatnonzero(np.isnan(delta) if find == "nan" else np.isinf(delta))
            if skip < hits.size:
                k = int(hits[skip])
                yield SearchResult(find, True, _locate(box, k), float(delta[k]), done, float(left64[k]),
                                   float(right64[k]))
                return
            skip -= hits.size
        yield Progress(done, total)
    if find == "absdiff" and extreme.index is not None:
        yield SearchResult(find, True, extreme.index, float(extreme.value), done, *pair)
    else:
        yield SearchResult(find, False, None, None, done)


def search_diff(a: LogicalTensor, b: LogicalTensor, find: str = "absdiff", *, skip: int = 0,
                block_bytes: int = DEFAULT_BLOCK_BYTES,
                progress: Callable[[Progress], None] | None = None) -> SearchResult:
    """Find in a − b of two tensors of one shape: "absdiff", the largest finite |a − b| (value |a − b|, with
    both sides), or the first "nan" / "inf" of a − b past `skip` of them; read block by block from both sides."""
    return _run(search_diff_steps(a, b, find, skip=skip, block_bytes=block_bytes), progress)


def _run(steps: Iterator[Progress | SearchResult], progress: Callable[[Progress], None] | None) -> SearchResult:
    for step in steps:
        if isinstance(step, SearchResult):
            return step
        if progress is not None:
            progress(step)
    raise AssertionError("a search ends with its result")


# ---------------------------------------------------------------- non-finite positions

def nonfinite_steps(tensor: LogicalTensor, *, block_bytes: int = DEFAULT_BLOCK_BYTES,
                    limit: int = MAX_NONFINITE_POSITIONS) -> Generator[Progress | NonFinite, None, None]:
    """Progress after every block, then the NonFinite (see `nonfinite`)."""
    check_scannable(tensor)
    if tensor.numpy_dtype.kind in "biu":
        yield NonFinite.none(tensor.shape)
        return
    total, done, itemsize = tensor.nbytes, 0, tensor.numpy_dtype.itemsize
    nan = inf = kept = 0
    positions: list[np.ndarray] = []
    flags: list[np.ndarray] = []
    for box, raw in _blocks(tensor, block_bytes):
        done += raw.size * itemsize
        values = _working(raw)
        if values.size and not (math.isfinite(values.min()) and math.isfinite(values.max())):
            hits = np.flatnonzero(~np.isfinite(values))
            found = flags_of(values[hits])
            nan += int((found == NAN_FLAG).sum())
            inf += int(found.size - (found == NAN_FLAG).sum())
            room = max(0, limit - kept)
            if room:
                local = np.unravel_index(hits[:room], tuple(s.stop - s.start for s in box)) if box else ()
                coords = tuple(i + s.start for i, s in zip(local, box))
                positions.append(np.ravel_multi_index(coords, tensor.shape).astype(np.int64) if box
                                 else np.zeros(min(room, hits.size), np.int64))
                flags.append(found[:room])
                kept += min(room, hits.size)
        yield Progress(done, total)
    flat = np.concatenate(positions) if positions else np.empty(0, np.int64)
    marks = np.concatenate(flags) if flags else np.empty(0, np.uint8)
    order = np.argsort(flat, kind="stable")
    yield NonFinite(tensor.shape, nan, inf, flat[order], marks[order], complete=kept == nan + inf)


def nonfinite(tensor: LogicalTensor, *, block_bytes: int = DEFAULT_BLOCK_BYTES, limit: int = MAX_NONFINITE_POSITIONS,
              progress: Callable[[Progress], None] | None = None) -> NonFinite:
    """Every NaN and ±Inf of `tensor`: their counts and (up to `limit`) their flat positions, in one
    streamed read."""
    for step in nonfinite_steps(tensor, block_bytes=block_bytes, limit=limit):
        if isinstance(step, NonFinite):
            return step
        if progress is not None:
            progress(step)
    raise AssertionError("a scan ends with its result")
