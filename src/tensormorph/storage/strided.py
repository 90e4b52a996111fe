"""A region of a strided array stored in a file, read as ranged requests: one run of bytes per row (rows that abut
as one run), no more.

Memory-mapped stores let numpy index the file; a remote store cannot, so the region's rows are fetched (coalesced
by the store) and laid out by numpy from the fetched bytes. A row runs along the axis whose selected elements lie
closest together in the file (the last axis of a C-ordered array, the first of a transposed one); when even those
lie far apart (a large step), each element is its own run.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from . import ByteStore

MAX_RUNS = 1 << 24  # more runs than this are fetched as the one span covering them, to bound the run list
SPARSE = 2  # a row whose selected elements are more than this many element sizes apart is read element by element


def read_strided(files: ByteStore, name: str, offset: int, shape: tuple[int, ...],
                 byte_strides: tuple[int, ...] | None, dtype: np.dtype, index: tuple[slice, ...]) -> np.ndarray:
    """`array[index]` of the array of `shape` and `dtype` stored at `offset` of file `name` (C order when
    `byte_strides` is None), fetching only the selected elements' bytes (positive-step slices only)."""
    itemsize = dtype.itemsize
    if byte_strides is None:
        byte_strides = tuple(itemsize * math.prod(shape[d + 1:]) for d in range(len(shape)))
    ranges = [range(*s.indices(n)) for s, n in zip(index, shape)]
    out_shape = tuple(len(r) for r in ranges)
    if math.prod(out_shape) == 0:
        return np.empty(out_shape, dtype)
    if not ranges:
        return np.frombuffer(files.read_ranges(name, [(offset, offset + itemsize)])[0], dtype).reshape(())
    steps = [r.step * st for r, st in zip(ranges, byte_strides)]  # bytes between selected neighbours, per axis
    first = offset + sum(r[0] * st for r, st in zip(ranges, byte_strides))
    # the run axis last: the axis (of more than one element) whose selected elements lie closest together
    along = min((d for d in range(len(ranges)) if len(ranges[d]) > 1), key=lambda d: steps[d],
                default=len(ranges) - 1)
    order = [d for d in range(len(ranges)) if d != along] + [along]
    lengths, gaps = [out_shape[d] for d in order], [steps[d] for d in order]
    per_element = gaps[-1] > SPARSE * itemsize
    row_axes = len(order) if per_element else len(order) - 1
    run = itemsize if per_element else (lengths[-1] - 1) * gaps[-1] + itemsize
    count = math.prod(lengths[:row_axes])
    if count > MAX_RUNS:
        span_end = offset + sum(r[-1] * st for r, st in zip(ranges, byte_strides)) + itemsize
        raw = files.read_ranges(name, [(first, span_end)])[0]
        return np.ndarray(out_shape, dtype, buffer=raw, strides=tuple(steps)).copy()
    starts = np.full(1, first, dtype=np.int64)
    for length, gap in zip(lengths[:row_axes], gaps[:row_axes]):  # every run's first byte, in the new axis order
        starts = np.add.outer(starts, np.arange(length, dtype=np.int64) * gap).ravel()
    # runs that abut (the rows of a block that spans whole rows) are asked for as one: one buffer comes back, which
    # the result views without the copies that cutting it into rows and joining them again would cost
    breaks = np.flatnonzero(np.diff(starts) != run) + 1
    begins, ends = starts[np.r_[0, breaks]], starts[np.r_[breaks - 1, len(starts) - 1]] + run
    joined = b"".join(files.read_ranges(name, list(zip(begins.tolist(), ends.tolist()))))
    if per_element:
        values = np.frombuffer(joined, dtype).reshape(lengths)
    else:
        values = np.ndarray((count, lengths[-1]), dtype, buffer=joined, strides=(run, gaps[-1])).reshape(lengths)
    return values.transpose(np.argsort(order))
