"""Checking that a tensor's chunks tile it exactly, in O(n log n) for n chunks.

Every reader of a placement-sharded format checks its tensors' layouts, and a tensor sharded over
thousands of ranks has thousands of chunks, so the check never compares every pair of chunks:

- every chunk must lie inside the tensor; identical boxes (replicas) are merged, their ranks kept;
- boxes inside the tensor that do not overlap cover it exactly when their volumes (Python integers:
  no overflow) add up to its volume, so what remains is finding an overlap, if any.

Overlap detection, over the non-empty boxes:

- **Grids** (what `Shard` placements, FSDP and tensor parallelism produce): when each dimension's distinct
  intervals are pairwise disjoint, two distinct boxes differ on some dimension and are disjoint there, so
  no pair overlaps. Checked by sorting each dimension's distinct intervals; a gap is then named exactly.
- **Splitting**: a dimension whose distinct intervals are pairwise disjoint splits the boxes into groups
  that cannot meet, each checked alone without that dimension. ZeRO's flat ranges cut into boxes split
  plane by plane, then row by row: linear after sorting.
- **Sweep**, for what no dimension splits (hostile files, unusual layouts): along one dimension, the boxes
  spanning the sweep position are kept in a list sorted by their start on a second dimension. Dimensions
  on which every box agrees separate nothing and are dropped; the two with the most distinct intervals are
  swept. With at most two left this is exact and O(n log n): the active boxes overlap on the sweep
  dimension, so they are disjoint on the second, and only the neighbour of a new box can reach it. With
  three or more, a new box is compared with every active box whose interval on the second dimension can
  reach its own: few in real layouts, but n^2/2 in the worst case (many active boxes sharing their
  intervals on both swept dimensions, told apart only by a third). So the comparisons are counted, and past
  SWEEP_FACTOR * n * log2(n) (at least SWEEP_FLOOR) the layout is refused as too irregular to check: the
  check stays O(n log n) whatever the file, and no layout of a few hundred boxes is ever refused.

Boxes and intervals are deduplicated and grouped by sorting, never by hashing: a file chooses its offsets
and shapes, hence the hashes of their tuples (CPython's tuple hash can be inverted), and a dict of n keys of
one hash takes O(n^2).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from .errors import ChunkLayoutError
from .shapes import MAX_DIM

if TYPE_CHECKING:
    from .core import Chunk


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


class LayoutOnly:
    """The source of a chunk made only to have its layout checked (validate_tiling): it holds no data."""

    def array(self) -> np.ndarray:
        raise TypeError("a chunk made only to check a layout holds no data")


def validate_tiling(name: str, shape: tuple[int, ...], chunks: list[Chunk], *, file: str | None = None) -> list[Chunk]:
    """Check that chunks tile `shape` exactly; return them with identical replicas merged.

    Raises ChunkLayoutError naming the tensor for chunks out of bounds, overlapping or leaving gaps.
    Empty chunks (a rank holding nothing, as torch.chunk leaves trailing ranks) are allowed.
    """
    if shape and not (min(shape) >= 0 and max(shape) < MAX_DIM):
        raise ChunkLayoutError(f"shape {shape} has a dimension outside [0, 2**62)", file=file, tensor=name)
    if len(chunks) == 1 and chunks[0].shape == shape and len(chunks[0].offsets) == len(shape) \
            and not any(chunks[0].offsets):
        return chunks  # one chunk holding the whole tensor: the common case, checked cheaply
    if _slabs_in_order(shape, chunks):
        return chunks  # what Shard(d) and FSDP save: checked in one pass (80,000 chunks: a fifth of the open)
    return _validate_general(name, shape, chunks, file)


def _slabs_in_order(shape: tuple[int, ...], chunks: list[Chunk]) -> bool:
    """Whether the chunks, in their order, are non-empty slabs that cut `shape` end to end along one dimension.
    Such chunks tile it exactly, none a replica of another, so the general check would return them as they are."""
    first = chunks[0] if chunks else None
    if first is None or len(first.shape) != len(shape):
        return False
    axes = [d for d in range(len(shape)) if first.shape[d] != shape[d]]
    if len(axes) != 1:
        return False
    d = axes[0]
    last = chunks[-1]  # most layouts that are not slabs show it at their end (trailing empty chunks): no walk
    if len(last.shape) != len(shape) or len(last.offsets) != len(shape) or last.shape[d] <= 0 \
            or last.offsets[d] + last.shape[d] != shape[d]:
        return False
    before, after = shape[:d], shape[d + 1:]
    zeros_before, zeros_after = (0,) * d, (0,) * len(after)
    position = 0
    for chunk in chunks:
        size = chunk.shape
        if (chunk.offsets != zeros_before + (position,) + zeros_after or len(size) != len(shape) or size[d] <= 0
                or size[:d] != before or size[d + 1:] != after):
            return False
        position += size[d]
    return position == shape[d]


def _validate_general(name: str, shape: tuple[int, ...], chunks: list[Chunk], file: str | None) -> list[Chunk]:
    """validate_tiling for any layout (see the module docstring)."""
    for chunk in chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.shape) != len(shape):
            raise ChunkLayoutError(
                f"chunk at offsets {chunk.offsets} with shape {chunk.shape} has a different rank than the "
                f"tensor {shape}",
                file=chunk.file or file, tensor=name)
        for o, s, n in zip(chunk.offsets, chunk.shape, shape):
            if o < 0 or s < 0 or o + s > n:
                raise ChunkLayoutError(
                    f"chunk at offsets {chunk.offsets} with shape {chunk.shape} lies outside the tensor's "
                    f"shape {shape}",
                    file=chunk.file or file, tensor=name)
    kept = _merge_replicas(chunks)
    filled = [c for c in kept if 0 not in c.shape]
    boxes = [(c.offsets, c.shape) for c in filled]
    axes = [_distinct([(o[d], s[d]) for o, s in boxes]) for d in range(len(shape))]
    grid = all(_disjoint(intervals) for intervals in axes)
    if not grid:
        try:
            pair = _overlap(boxes, len(shape))
        except _TooIrregular:
            raise ChunkLayoutError(
                f"the layout of {len(chunks)} chunks is too irregular to check: no dimension splits them and looking "
                f"for overlaps took over {_Budget(len(boxes)).total} comparisons, the limit for {len(boxes)} "
                "distinct non-empty boxes", file=file, tensor=name) from None
        if pair is not None:
            (a, b), (fa, fb) = (boxes[pair[0]], boxes[pair[1]]), (filled[pair[0]].file, filled[pair[1]].file)
            raise ChunkLayoutError(f"chunks at offsets {a[0]} (shape {a[1]}, {fa}) and {b[0]} (shape {b[1]}, {fb}) "
                                   "overlap", file=file, tensor=name)
    covered = sum(math.prod(s) for _, s in boxes)
    total = math.prod(shape)
    if covered != total:
        gap = f"; nothing covers the box at offsets {_gap(boxes, axes, shape)}" if grid else ""
        raise ChunkLayoutError(
            f"chunks cover {covered} of {total} elements of shape {shape}: {total - covered} elements are missing "
            f"(a shard file or chunk is absent){gap}", file=file, tensor=name)
    return kept


def _merge_replicas(chunks: list[Chunk]) -> list[Chunk]:
    """The chunks with identical boxes (replicas) merged into the first, holding every replica's ranks in order.

    By sorting, not hashing: a file chooses its boxes, and so their tuples' hashes (CPython's tuple hash can be
    inverted), so a dict keyed by boxes would be quadratic in a hostile file's chunks.
    """
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].offsets, chunks[i].shape))  # stable: first is kept
    merged: list[tuple[int, Chunk]] = []
    start = 0
    for end in range(1, len(order) + 1):
        first = chunks[order[start]]
        if end < len(order) and (chunks[order[end]].offsets, chunks[order[end]].shape) == (first.offsets, first.shape):
            continue
        if end - start > 1:
            first = replace(first, ranks=_first_of_each([r for i in order[start:end] for r in chunks[i].ranks]))
        merged.append((order[start], first))
        start = end
    return [chunk for _, chunk in sorted(merged, key=lambda item: item[0])]


def _first_of_each(ranks: list[int]) -> tuple[int, ...]:
    """Each rank once, in the order they first come (by sorting: a file can choose integers of one hash too)."""
    firsts = sorted(range(len(ranks)), key=lambda k: (ranks[k], k))
    kept = [k for n, k in enumerate(firsts) if n == 0 or ranks[k] != ranks[firsts[n - 1]]]
    return tuple(ranks[k] for k in sorted(kept))


def _distinct(values: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The distinct values, sorted (by sorting: hashing tuples a file chose could be quadratic)."""
    values = sorted(values)
    return [v for k, v in enumerate(values) if k == 0 or v != values[k - 1]]


def _disjoint(intervals: list[tuple[int, int]]) -> bool:
    """Whether sorted (start, size) intervals are pairwise disjoint."""
    return all(b >= a + n for (a, n), (b, _) in zip(intervals, intervals[1:]))


SWEEP_FLOOR = 1 << 16
"""Comparisons the sweeps of any number of boxes may make (~20 ms): a layout of up to 362 boxes, which makes at
most n(n-1)/2, is never refused."""
SWEEP_FACTOR = 2
"""The sweeps of a tensor's n boxes may make SWEEP_FACTOR * n * log2(n) comparisons (or SWEEP_FLOOR, if more)
between them; past that the layout is refused as too irregular to check (100,000 boxes: ~1 s). Grids, ZeRO's flat
ranges and whatever splits down to two dimensions make at most one comparison a box."""


class _TooIrregular(Exception):
    """The sweeps ran past their comparison budget (three or more dimensions, many boxes sharing two of them)."""


class _Budget:
    """The comparisons the sweeps of one tensor's boxes may still make."""

    def __init__(self, boxes: int):
        self.total = max(SWEEP_FLOOR, SWEEP_FACTOR * boxes * math.ceil(math.log2(max(boxes, 2))))
        self.left = self.total


def _overlap(boxes: list[Box], ndim: int) -> tuple[int, int] | None:
    """The indices of two overlapping boxes among distinct non-empty `boxes`, or None.

    A dimension whose distinct intervals are pairwise disjoint splits the boxes into groups that cannot
    overlap one another (ZeRO's flat ranges cut into boxes split this way, plane by plane, then row by
    row); within a group that dimension, like any on which the group agrees, separates nothing. What no
    dimension splits is swept. Raises _TooIrregular where a sweep runs past its budget.
    """
    budget = _Budget(len(boxes))  # shared: many small groups must not each get the floor
    work = [(list(range(len(boxes))), list(range(ndim)))]  # (boxes, the dimensions they may differ on): a stack
    while work:
        group, dims = work.pop()
        axes = {d: _distinct([(boxes[i][0][d], boxes[i][1][d]) for i in group]) for d in dims}
        dims = [d for d in dims if len(axes[d]) > 1]  # distinct boxes differ on one of these
        split = next((d for d in dims if _disjoint(axes[d])), None)
        if split is None:
            pair = _sweep(boxes, group, sorted(dims, key=lambda d: -len(axes[d])), budget)
            if pair is not None:
                return pair
            continue
        rest = [d for d in dims if d != split]
        group.sort(key=lambda i: boxes[i][0][split])  # the intervals are disjoint: their starts tell them apart
        begin = 0
        for end in range(1, len(group) + 1):
            if end == len(group) or boxes[group[end]][0][split] != boxes[group[begin]][0][split]:
                if end - begin > 1:
                    work.append((group[begin:end], rest))
                begin = end
    return None


def _sweep(boxes: list[Box], group: list[int], dims: list[int], budget: _Budget) -> tuple[int, int] | None:
    """Two overlapping boxes of `group`, or None, by a sweep; `dims` are the dimensions that tell them apart, best
    first. Raises _TooIrregular when the comparisons beyond one a box exhaust `budget` (only with three or more
    dimensions: with two, the nearest active box is the only candidate)."""
    sweep, key, others = dims[0], (dims[1] if len(dims) > 1 else None), dims[2:]
    reach = max((boxes[i][1][key] for i in group), default=0) if key is not None else 0
    ending: list[tuple[int, int]] = []  # heap of (end on the sweep dimension, box) of the active boxes
    active: list[tuple[int, int]] = []  # the active boxes as (start on `key`, box), sorted
    for i in sorted(group, key=lambda i: boxes[i][0][sweep]):
        offsets, sizes = boxes[i]
        while ending and ending[0][0] <= offsets[sweep]:
            j = heapq.heappop(ending)[1]
            if key is not None:
                del active[bisect_left(active, (boxes[j][0][key], j))]
        if key is None:
            if ending:  # one dimension: every active box spans this one's start
                return ending[0][1], i
        else:
            low, high = offsets[key], offsets[key] + sizes[key]
            position = bisect_left(active, (high, -1))  # active boxes starting before this one ends on `key`
            while position:
                position -= 1
                start, j = active[position]
                if start + reach <= low:
                    break  # this one and every one before it end before this box starts on `key`
                other = boxes[j]
                if start + other[1][key] > low and all(
                        other[0][d] < offsets[d] + sizes[d] and offsets[d] < other[0][d] + other[1][d] for d in others):
                    return j, i
                if not others:
                    break  # two dimensions: active boxes are disjoint on `key`, the nearest is the only candidate
                budget.left -= 1
                if not budget.left:
                    raise _TooIrregular
            insort(active, (low, i))
        heapq.heappush(ending, (offsets[sweep] + sizes[sweep], i))
    return None


def _gap(boxes: list[Box], axes: list[list[tuple[int, int]]], shape: tuple[int, ...]) -> str:
    """A box no chunk covers, in a grid whose boxes do not cover the tensor."""
    for d, intervals in enumerate(axes):  # a dimension whose intervals leave a gap: that slab is uncovered
        position = 0
        for start, size in [*intervals, (shape[d], 0)]:
            if start > position:
                offsets = tuple(position if k == d else 0 for k in range(len(shape)))
                sizes = tuple(start - position if k == d else n for k, n in enumerate(shape))
                return f"{offsets} with shape {sizes}"
            position = start + size
    # every dimension is partitioned: a cell of the grid is absent; find the first in row-major order
    expected = [0] * len(shape)  # cells by bisection, not a dict of intervals: a file chooses their hashes
    for cell in sorted(tuple(bisect_left(axes[d], (o[d], s[d])) for d in range(len(shape))) for o, s in boxes):
        if list(cell) != expected:
            break
        for d in reversed(range(len(shape))):  # the next cell: an odometer over the grid
            expected[d] += 1
            if expected[d] < len(axes[d]):
                break
            expected[d] = 0
    cell_box = [axes[d][k] for d, k in enumerate(expected)]
    return f"{tuple(o for o, _ in cell_box)} with shape {tuple(s for _, s in cell_box)}"
