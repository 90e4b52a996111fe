"""A region of a strided array stored in a file, read as ranged requests: one run of bytes per row, no more.

Memory-mapped stores let numpy index the file; a remote store cannot, so the region's rows are fetched (coalesced
by the store) and laid out by numpy from the fetched bytes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from . import ByteStore

MAX_ROWS = 1 << 24  # more rows than this are fetched as the one span covering them, to bound the run list


def read_strided(files: ByteStore, name: str, offset: int, shape: tuple[int, ...],
                 byte_strides: tuple[int, ...] | None, dtype: np.dtype, index: tuple[slice, ...]) -> np.ndarray:
    """`array[index]` of the array of `shape` and `dtype` stored at `offset` of file `name` (C order when
    `byte_strides` is None), fetching each selected row's run of bytes (positive-step slices only)."""
    itemsize = dtype.itemsize
    if byte_strides is None:
        byte_strides = tuple(itemsize * math.prod(shape[d + 1:]) for d in range(len(shape)))
    ranges = [range(*s.indices(n)) for s, n in zip(index, shape)]
    out_shape = tuple(len(r) for r in ranges)
    if math.prod(out_shape) == 0:
        return np.empty(out_shape, dtype)
    if not ranges:
        raw = files.read_ranges(name, [(offset, offset + itemsize)])[0]
        return np.frombuffer(raw, dtype).reshape(())
    first = offset + sum(r[0] * st for r, st in zip(ranges, byte_strides))
    last_range, last_stride = ranges[-1], byte_strides[-1]
    run = (len(last_range) - 1) * last_range.step * last_stride + itemsize  # one row, first to last element
    rows = math.prod(out_shape[:-1])
    if rows > MAX_ROWS:
        span_end = offset + sum(r[-1] * st for r, st in zip(ranges, byte_strides)) + itemsize
        raw = files.read_ranges(name, [(first, span_end)])[0]
        relative = tuple(r.step * st for r, st in zip(ranges, byte_strides))
        return np.ndarray(out_shape, dtype, buffer=raw, strides=relative).copy()
    starts = np.full(1, first, dtype=np.int64)
    for r, stride in zip(ranges[:-1], byte_strides[:-1]):  # every row's first byte, in C order
        starts = np.add.outer(starts, np.arange(len(r), dtype=np.int64) * (r.step * stride)).ravel()
    pieces = files.read_ranges(name, [(s, s + run) for s in starts.tolist()])
    joined = b"".join(pieces)
    rows_view = np.ndarray((rows, len(last_range)), dtype, buffer=joined, strides=(run, last_range.step * last_stride))
    return rows_view.reshape(out_shape)
