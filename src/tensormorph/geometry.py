"""Box and byte-run arithmetic of C-ordered tensors: which bytes of a stored chunk hold which elements.

Shared by the region reads of every format, the Tensormorph checked reader and writer, and the
DeepSpeed flat-partition mapping. Pure numpy, no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they share no element."""
    offsets, sizes = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True):
        begin, end = max(ao, bo), min(ao + as_, bo + bs)
        if begin >= end:
            return None
        offsets.append(begin)
        sizes.append(end - begin)
    return tuple(offsets), tuple(sizes)


MAX_ADVISED_RUNS = 4096


def byte_runs(offset: int, shape: tuple[int, ...], byte_strides: tuple[int, ...] | None, itemsize: int,
              index: tuple[slice, ...]) -> list[tuple[int, int]]:
    """The [begin, end) byte ranges a strided array at `offset` touches for `index` (positive-step slices).

    One range per row (adjacent ones merged), or one covering span when rows are very many.
    """
    if byte_strides is None:
        byte_strides = tuple(itemsize * math.prod(shape[d + 1:]) for d in range(len(shape)))
    ranges = [range(s.start, s.stop, s.step) for s in index]
    if any(len(r) == 0 for r in ranges):
        return []
    first = offset + sum(r[0] * st for r, st in zip(ranges, byte_strides))
    last = offset + sum(r[-1] * st for r, st in zip(ranges, byte_strides)) + itemsize
    if not ranges:
        return [(first, last)]
    rows = math.prod(len(r) for r in ranges[:-1])
    if rows > MAX_ADVISED_RUNS:
        return [(first, last)]
    # each row's span, from its first to its last selected element (every element when the step is 1)
    run = (len(ranges[-1]) - 1) * ranges[-1].step * byte_strides[-1] + itemsize
    starts = np.full(1, first, dtype=np.int64)
    for r, stride in zip(ranges[:-1], byte_strides[:-1]):  # every row's start, in C order
        starts = np.add.outer(starts, np.arange(len(r), dtype=np.int64) * (r.step * stride)).ravel()
    breaks = np.flatnonzero(np.diff(starts) != run) + 1  # where a row does not continue the previous one
    begins = starts[np.concatenate(([0], breaks))]
    ends = starts[np.concatenate((breaks - 1, [len(starts) - 1]))] + run
    return list(zip(begins.tolist(), ends.tolist()))


def box_runs(chunk_shape: Sequence[int], itemsize: int, start: Sequence[int],
             size: Sequence[int]) -> tuple[np.ndarray, int]:
    """Byte offsets (within a C-ordered chunk) of the contiguous runs that make up a sub-box, and the run length.

    The runs, concatenated in order, are the sub-box in C order: read them one after another
    into a contiguous buffer and it holds exactly the wanted elements, nothing more.
    """
    ndim = len(chunk_shape)
    if ndim == 0:
        return np.zeros(1, np.int64), itemsize
    if any(s == 0 for s in size):
        return np.zeros(0, np.int64), 0
    # trailing dimensions taken whole merge into one run with the first dimension that is cut
    k = ndim - 1
    while k > 0 and size[k] == chunk_shape[k] and start[k] == 0:
        k -= 1
    run = size[k] * math.prod(chunk_shape[k + 1:]) * itemsize
    strides = [math.prod(chunk_shape[d + 1:]) * itemsize for d in range(ndim)]
    starts = np.array([sum(s * st for s, st in zip(start, strides))], np.int64)
    for d in range(k - 1, -1, -1):  # outer dimensions, innermost first; the outer index varies slowest
        starts = (np.arange(size[d], dtype=np.int64)[:, None] * strides[d] + starts[None, :]).ravel()
    return starts, run


def split_box(box: tuple[slice, ...], limit: int) -> Iterator[tuple[slice, ...]]:
    """Cut a box into pieces of at most `limit` elements: rows of the trailing dimensions that fit."""
    sizes = [s.stop - s.start for s in box]
    if math.prod(sizes) <= limit:
        yield box
        return
    d = next(d for d in range(len(sizes)) if math.prod(sizes[d + 1:]) <= limit)
    step = max(1, limit // math.prod(sizes[d + 1:]))
    for lead in itertools.product(*(range(s.start, s.stop) for s in box[:d])):
        for start in range(box[d].start, box[d].stop, step):
            yield (tuple(slice(i, i + 1) for i in lead) + (slice(start, min(start + step, box[d].stop)),)
                   + box[d + 1:])


def shard_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[begin, end) of part `index` when `size` is split into `parts` as torch.chunk splits it."""
    step = -(-size // parts) if parts else 0
    return min(size, index * step), min(size, (index + 1) * step)


def flat_boxes(shape: tuple[int, ...], begin: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(offsets, shape, first flat index) of boxes that tile the C-order flat range [begin, end) of `shape`.

    Each box is itself contiguous in C order, so it is one run of a flat storage."""
    if begin >= end:
        return []
    if not shape:
        return [((), (), 0)]
    row = math.prod(shape[1:])
    first, skip = divmod(begin, row)
    last, tail = divmod(end, row)
    rest = len(shape) - 1

    def within(index: int, low: int, high: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        return [((index, *o), (1, *s), index * row + f) for o, s, f in flat_boxes(shape[1:], low, high)]

    if first == last:
        return within(first, skip, tail)
    boxes = []
    if skip:
        boxes.extend(within(first, skip, row))
        first += 1
    if last > first:
        boxes.append(((first,) + (0,) * rest, (last - first, *shape[1:]), first * row))
    if tail:
        boxes.extend(within(last, 0, tail))
    return boxes


def coalesce(runs: Sequence[tuple[int, int]], gap: int, slack: float) -> list[tuple[int, int]]:
    """Sorted, merged request ranges covering `runs`: overlapping or touching runs always merge; runs apart by at
    most `gap` merge smallest gap first while the gap bytes fetched stay within `slack` of the bytes needed."""
    ordered = sorted((b, e) for b, e in runs if e > b)
    merged: list[list[int]] = []
    for begin, end in ordered:
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    needed = sum(e - b for b, e in merged)
    gaps = sorted((merged[k + 1][0] - merged[k][1], k) for k in range(len(merged) - 1))
    joined, allowance = set(), slack * needed
    for size, k in gaps:
        if size > gap or size > allowance:
            break
        allowance -= size
        joined.add(k)
    out: list[tuple[int, int]] = []
    for k, (begin, end) in enumerate(merged):
        if k - 1 in joined:
            out[-1] = (out[-1][0], end)
        else:
            out.append((begin, end))
    return out
