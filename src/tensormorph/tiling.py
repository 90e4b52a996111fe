"""Checking that a tensor's chunks tile it exactly, in O(n log n) for n chunks (linear for grids).

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
  reach its own: O(n log n) when few do, O(n^2) in the worst case (many active boxes sharing their
  intervals on both swept dimensions, told apart only by a third).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from .errors import ChunkLayoutError

if TYPE_CHECKING:
    from .core import Chunk

MAX_DIM = 2**62
"""Dimensions at or above this are rejected as corrupt: no real tensor is that large, and numpy cannot index it."""

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
    if any(not 0 <= n < MAX_DIM for n in shape):
        raise ChunkLayoutError(f"shape {shape} has a dimension outside [0, 2**62)", file=file, tensor=name)
    if len(chunks) == 1 and chunks[0].shape == shape and not any(chunks[0].offsets):
        return chunks  # one chunk holding the whole tensor: the common case, checked cheaply
    unique: dict[Box, Chunk] = {}
    merged_ranks: dict[Box, dict[int, None]] = {}  # replicas' ranks, joined once at the end: linear in replicas
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
        key = (chunk.offsets, chunk.shape)
        kept = unique.setdefault(key, chunk)
        if kept is not chunk:
            merged_ranks.setdefault(key, dict.fromkeys(kept.ranks)).update(dict.fromkeys(chunk.ranks))
    boxes = [key for key in unique if 0 not in key[1]]
    axes = [sorted({(o[d], s[d]) for o, s in boxes}) for d in range(len(shape))]
    grid = all(_disjoint(intervals) for intervals in axes)
    if not grid:
        pair = _overlap(boxes, len(shape))
        if pair is not None:
            (a, b), (fa, fb) = pair, (unique[pair[0]].file, unique[pair[1]].file)
            raise ChunkLayoutError(f"chunks at offsets {a[0]} (shape {a[1]}, {fa}) and {b[0]} (shape {b[1]}, {fb}) "
                                   "overlap", file=file, tensor=name)
    covered = sum(math.prod(s) for _, s in boxes)
    total = math.prod(shape)
    if covered != total:
        gap = f"; nothing covers the box at offsets {_gap(boxes, axes, shape)}" if grid else ""
        raise ChunkLayoutError(
            f"chunks cover {covered} of {total} elements of shape {shape}: {total - covered} elements are missing "
            f"(a shard file or chunk is absent){gap}", file=file, tensor=name)
    return [replace(c, ranks=tuple(merged_ranks[k])) if k in merged_ranks else c for k, c in unique.items()]


def _disjoint(intervals: list[tuple[int, int]]) -> bool:
    """Whether sorted (start, size) intervals are pairwise disjoint."""
    return all(b >= a + n for (a, n), (b, _) in zip(intervals, intervals[1:]))


def _overlap(boxes: list[Box], ndim: int) -> tuple[Box, Box] | None:
    """Two overlapping boxes among distinct non-empty `boxes`, or None.

    A dimension whose distinct intervals are pairwise disjoint splits the boxes into groups that cannot
    overlap one another (ZeRO's flat ranges cut into boxes split this way, plane by plane, then row by
    row); within a group that dimension, like any on which the group agrees, separates nothing. What no
    dimension splits is swept.
    """
    work = [(boxes, list(range(ndim)))]  # (boxes, the dimensions they may differ on): a stack, not recursion
    while work:
        group, dims = work.pop()
        axes = {d: sorted({(o[d], s[d]) for o, s in group}) for d in dims}
        dims = [d for d in dims if len(axes[d]) > 1]  # distinct boxes differ on one of these
        split = next((d for d in dims if _disjoint(axes[d])), None)
        if split is None:
            pair = _sweep(group, sorted(dims, key=lambda d: -len(axes[d])))
            if pair is not None:
                return pair
            continue
        parts: dict[tuple[int, int], list[Box]] = {}
        for box in group:
            parts.setdefault((box[0][split], box[1][split]), []).append(box)
        rest = [d for d in dims if d != split]
        work.extend((part, rest) for part in parts.values() if len(part) > 1)
    return None


def _sweep(boxes: list[Box], dims: list[int]) -> tuple[Box, Box] | None:
    """Two overlapping boxes, or None, by a sweep; `dims` are the dimensions that tell boxes apart, best first."""
    sweep, key, others = dims[0], (dims[1] if len(dims) > 1 else None), dims[2:]
    reach = max((s[key] for _, s in boxes), default=0) if key is not None else 0
    ending: list[tuple[int, int]] = []  # heap of (end on the sweep dimension, box) of the active boxes
    active: list[tuple[int, int]] = []  # the active boxes as (start on `key`, box), sorted
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i][0][sweep]):
        offsets, sizes = boxes[i]
        while ending and ending[0][0] <= offsets[sweep]:
            j = heapq.heappop(ending)[1]
            if key is not None:
                del active[bisect_left(active, (boxes[j][0][key], j))]
        if key is None:
            if ending:  # one dimension: every active box spans this one's start
                return boxes[ending[0][1]], boxes[i]
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
                    return other, boxes[i]
                if not others:
                    break  # two dimensions: active boxes are disjoint on `key`, the nearest is the only candidate
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
    index = [{interval: i for i, interval in enumerate(intervals)} for intervals in axes]
    expected = [0] * len(shape)
    for cell in sorted(tuple(index[d][(o[d], s[d])] for d in range(len(shape))) for o, s in boxes):
        if list(cell) != expected:
            break
        for d in reversed(range(len(shape))):  # the next cell: an odometer over the grid
            expected[d] += 1
            if expected[d] < len(axes[d]):
                break
            expected[d] = 0
    cell_box = [axes[d][k] for d, k in enumerate(expected)]
    return f"{tuple(o for o, _ in cell_box)} with shape {tuple(s for _, s in cell_box)}"
