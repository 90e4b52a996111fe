"""Level-of-detail tiles: a region of a tensor's 2-D view drawn into a bounded number of pixels.

A tile covers rows [r0, r1) and columns [c0, c1) of a view and has at most
h × w pixels; each pixel stands for a block of sy × sx elements. An
approximate tile samples the first element of each block (a strided read,
fast whatever the tensor's size); an exact tile aggregates every element of
each block (mean, min, max, abs-max), streaming the region in bands of
bounded size. The encoding is compact binary: the page colours it itself.
Every tile flags the pixels whose block holds a NaN or Inf: exactly in exact
tiles, and in approximate ones from the tensor's non-finite positions when a
scan found them (ops/search.py), so that no zoom level hides one.
Memory per tile is a few bytes per pixel (float32 fields, one copy to encode),
so MAX_PIXELS bounds what one request may take.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ..core import LogicalTensor
from ..errors import CheckpointError
from .search import NonFinite, flags_of
from .stats import chunk_blocks

DEFAULT_BAND_BYTES = 32 * 1024**2
MAX_PIXELS = 4096 * 4096  # pixels of one tile: a full-screen canvas at twice the density, with room to spare
AGGREGATES = ("mean", "min", "max", "absmax")
TILE_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Bands of an exact tile read and reduced at once (each holds one band, within band_bytes in all), where its
sources read regions (see _threads)."""
T = TypeVar("T")


@dataclass(frozen=True)
class View:
    """A 2-D view of a tensor: two axes chosen, every other axis fixed at an index."""

    tensor: LogicalTensor
    axes: tuple[int, int] | None = None  # (row axis, column axis); None for tensors of rank < 2
    fixed: tuple[int, ...] = ()  # indices of the other axes, in order

    @staticmethod
    def of(tensor: LogicalTensor, axes: tuple[int, int] | None = None, fixed: tuple[int, ...] = ()) -> View:
        """A validated view; by default the last two axes, the others fixed at 0."""
        ndim = tensor.ndim
        if ndim < 2:
            if axes is not None or fixed:
                raise CheckpointError(f"a tensor of rank {ndim} has no axes to choose", tensor=tensor.name)
            return View(tensor)
        axes = axes if axes is not None else (ndim - 2, ndim - 1)
        if len(set(axes)) != 2 or not all(0 <= a < ndim for a in axes):
            raise CheckpointError(f"axes {list(axes)} must be two different axes of a rank-{ndim} tensor",
                                  tensor=tensor.name)
        others = [d for d in range(ndim) if d not in axes]
        fixed = tuple(fixed) if fixed else (0,) * len(others)
        if len(fixed) != len(others) or not all(0 <= i < tensor.shape[d] for i, d in zip(fixed, others)):
            raise CheckpointError(f"fixed indices {list(fixed)} must give one in-range index for each of the "
                                  f"axes {others} (sizes {[tensor.shape[d] for d in others]})", tensor=tensor.name)
        return View(tensor, axes, fixed)

    @property
    def shape(self) -> tuple[int, int]:
        if self.axes is None:
            return (1, self.tensor.shape[0] if self.tensor.ndim == 1 else 1)
        return self.tensor.shape[self.axes[0]], self.tensor.shape[self.axes[1]]

    def read(self, rows: slice, cols: slice) -> np.ndarray:
        """The 2-D block rows × cols (slices with positive steps) of the view."""
        t = self.tensor
        if self.axes is None:
            if t.ndim == 0:
                return t.read(()).reshape(1, 1)[rows, cols]
            return t.read((cols,), budget=_unbounded(t)).reshape(1, -1)[rows]
        index: list[Any] = []
        others = iter(self.fixed)
        for d in range(t.ndim):
            index.append(rows if d == self.axes[0] else cols if d == self.axes[1] else next(others))
        block = t.read(tuple(index), budget=_unbounded(t))
        return block if self.axes[0] < self.axes[1] else block.T


def _unbounded(tensor: LogicalTensor) -> int:
    # tiles bound their own memory by reading in bands; the read budget guards whole-tensor reads
    return max(tensor.read_budget, DEFAULT_BAND_BYTES * 4)


@dataclass
class Tile:
    name: str
    view_shape: tuple[int, int]
    rows: tuple[int, int]
    cols: tuple[int, int]
    step: tuple[int, int]
    approximate: bool
    fields: dict[str, np.ndarray] = field(default_factory=dict)  # each float32, shape (rows, cols) in pixels
    nan: int = 0
    inf: int = 0
    mask: np.ndarray | None = None  # uint8 non-finite flags per pixel (search.NAN_FLAG ...); None: all finite
    nonfinite_complete: bool = True  # the mask accounts for every element, not only the samples

    @property
    def shape(self) -> tuple[int, int]:
        return next(iter(self.fields.values())).shape

    def header(self) -> dict[str, Any]:
        # the range of the data itself: the value, or the block minima and maxima (not abs-max or mean)
        ranges = [r for key, v in self.fields.items() if key in ("value", "min", "max") and (r := _finite_range(v))]
        return {
            "name": self.name, "view_shape": list(self.view_shape), "rows": list(self.rows), "cols": list(self.cols),
            "step": list(self.step), "shape": list(self.shape), "approximate": self.approximate,
            "fields": list(self.fields) + (["nonfinite"] if self.flagged else []), "nan": self.nan, "inf": self.inf,
            "min": min(low for low, _ in ranges) if ranges else None,
            "max": max(high for _, high in ranges) if ranges else None,
            "nonfinite_complete": self.nonfinite_complete, "nonfinite_cells": self.flagged,
        }

    @property
    def flagged(self) -> int:
        """Pixels whose block holds a NaN or Inf."""
        return int(np.count_nonzero(self.mask)) if self.mask is not None else 0

    def encode(self, *, shuffle: bool = False) -> bytes:
        """u32 LE header length, JSON header, then each field as float32 LE, row-major (with shuffle, byte plane
        by byte plane: all first bytes, then all second bytes ...)."""
        header = self.header()
        if shuffle:
            header["shuffle"] = True
        head = json.dumps(header).encode()
        arrays = list(self.fields.values()) + ([self.mask] if self.mask is not None and self.flagged else [])
        # bytes.join takes any buffer: each field is copied once, straight into the answer
        fields = [_planes(v) if shuffle else np.ascontiguousarray(v, dtype="<f4").data for v in arrays]
        return b"".join([struct.pack("<I", len(head)), head, *fields])


def _planes(values: np.ndarray) -> memoryview:
    """float32 LE values as four byte planes: the high bytes of real weights repeat, so they compress well."""
    raw = np.ascontiguousarray(values, dtype="<f4").reshape(-1).view(np.uint8)
    return np.ascontiguousarray(raw.reshape(-1, 4).T).data


def _finite_range(values: np.ndarray) -> tuple[float, float] | None:
    """(min, max) of the finite values, without copying them; None when there is none."""
    finite = np.isfinite(values)
    if not finite.any():
        return None
    return (float(np.min(values, where=finite, initial=np.inf)),
            float(np.max(values, where=finite, initial=-np.inf)))


def steps(r0: int, r1: int, c0: int, c1: int, h: int, w: int) -> tuple[int, int]:
    return max(1, math.ceil((r1 - r0) / h)), max(1, math.ceil((c1 - c0) / w))


def tile(view: View, r0: int, r1: int, c0: int, c1: int, h: int, w: int, *, exact: bool = False,
         band_bytes: int = DEFAULT_BAND_BYTES, reader: Callable[[slice, slice], np.ndarray] | None = None,
         nonfinite: NonFinite | None = None) -> Tile:
    """The tile of `view` over rows [r0, r1) × columns [c0, c1) in at most h × w pixels.

    `reader` replaces view.read (the diff view reads a − b through it). `nonfinite`, the positions of the
    tensor's NaN and Inf (search.nonfinite), completes the flags of an approximate tile.
    """
    H, W = view.shape
    name = view.tensor.name
    if not (0 <= r0 < r1 <= H and 0 <= c0 < c1 <= W):
        raise CheckpointError(f"region rows [{r0}, {r1}) × columns [{c0}, {c1}) is empty or outside the "
                              f"{H} × {W} view", tensor=name)
    if not (h >= 1 and w >= 1 and h * w <= MAX_PIXELS):
        raise CheckpointError(f"a tile of {h} × {w} pixels is outside [1, {MAX_PIXELS}] pixels", tensor=name)
    read = reader or view.read
    sy, sx = steps(r0, r1, c0, c1, h, w)
    result = Tile(name, (H, W), (r0, r1), (c0, c1), (sy, sx), approximate=not exact and (sy, sx) != (1, 1))
    if (sy, sx) == (1, 1) or not exact:
        values = _as_working(read(slice(r0, r1, sy), slice(c0, c1, sx)))
        result.nan, result.inf = _nonfinite(values)
        result.fields["value"] = values.astype(np.float32, copy=False)
        result.mask = flags_of(values) if result.nan or result.inf else None
        if result.approximate:
            result.nonfinite_complete = nonfinite is not None and nonfinite.complete
            if nonfinite is not None and nonfinite.positions.size:
                known = nonfinite_cells(nonfinite, view, r0, r1, c0, c1, sy, sx)
                result.mask = known if result.mask is None else result.mask | known
        return result
    _aggregate(result, read, band_bytes, _threads(view, reader))
    return result


def _threads(view: View, reader: Callable[[slice, slice], np.ndarray] | None) -> int:
    """Bands read at once: TILE_THREADS, or one band at a time for a custom reader (the diff's a − b, whose
    sources are not known here) and for a source that decodes its whole chunk on every read (a compressed DCP
    item, `reads_regions` False): there each band in flight would hold a whole chunk."""
    if reader is not None or not all(getattr(c.source, "reads_regions", True) for c in view.tensor.chunks):
        return 1
    return TILE_THREADS


def nonfinite_cells(nonfinite: NonFinite, view: View, r0: int, r1: int, c0: int, c1: int, sy: int,
                    sx: int) -> np.ndarray:
    """The flags (OR-ed) of the listed non-finite elements that fall in each pixel of a tile of `view`."""
    out = np.zeros((math.ceil((r1 - r0) / sy), math.ceil((c1 - c0) / sx)), np.uint8)
    flat, flags = nonfinite.positions, nonfinite.flags
    if view.axes is None:
        rows, cols = np.zeros_like(flat), flat if view.tensor.ndim == 1 else np.zeros_like(flat)
    else:
        coords = np.unravel_index(flat, nonfinite.shape)
        keep = np.ones(flat.shape, bool)
        others = [d for d in range(len(nonfinite.shape)) if d not in view.axes]
        for d, index in zip(others, view.fixed):
            keep &= coords[d] == index
        rows, cols, flags = coords[view.axes[0]][keep], coords[view.axes[1]][keep], flags[keep]
    inside = (rows >= r0) & (rows < r1) & (cols >= c0) & (cols < c1)
    np.bitwise_or.at(out, ((rows[inside] - r0) // sy, (cols[inside] - c0) // sx), flags[inside])
    return out


def _aggregate(result: Tile, read: Callable[[slice, slice], np.ndarray], band_bytes: int, threads: int) -> None:
    """Exact block aggregates, reading bands of whole block rows and block columns under band_bytes. Only the
    float32 fields span the whole tile: sums and counts live as long as one band."""
    (r0, r1), (c0, c1), (sy, sx) = result.rows, result.cols, result.step
    out_rows, out_cols = math.ceil((r1 - r0) / sy), math.ceil((c1 - c0) / sx)
    mean, low, high, peak = (np.empty((out_rows, out_cols), np.float32) for _ in AGGREGATES)
    elements = max(1, band_bytes // (8 * threads))  # float64 at most, one band per thread
    block_cols = max(1, min(out_cols, elements // (sy * sx)))
    block_rows = max(1, elements // (block_cols * sy * sx))
    bands = [(i, j) for i in range(0, out_rows, block_rows) for j in range(0, out_cols, block_cols)]

    def one(i: int, j: int) -> _Band:
        rows = slice(r0 + i * sy, min(r1, r0 + (i + block_rows) * sy))
        cols = slice(c0 + j * sx, min(c1, c0 + (j + block_cols) * sx))
        return _band(_as_working(read(rows, cols)), sy, sx)

    for (i, j), band in _in_parallel(one, bands, threads):
        target = (slice(i, i + band.mean.shape[0]), slice(j, j + band.mean.shape[1]))
        result.nan += band.nan
        result.inf += band.inf
        if band.flags is not None:
            if result.mask is None:
                result.mask = np.zeros((out_rows, out_cols), np.uint8)
            result.mask[target] = band.flags
        mean[target], low[target], high[target] = band.mean, band.low, band.high
        # a block's largest magnitude is that of its least or its greatest value (NaN only where all are)
        peak[target] = np.fmax(np.abs(band.low), np.abs(band.high))
    result.fields.update(zip(AGGREGATES, (mean, low, high, peak)))


@dataclass
class _Band:
    """The block aggregates of one band, and its count of NaN and Inf values."""

    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    flags: np.ndarray | None
    nan: int
    inf: int


def _band(band: np.ndarray, sy: int, sx: int) -> _Band:
    with np.errstate(invalid="ignore", divide="ignore"):  # +inf and -inf in one block sum to NaN, as they should
        sums = _blocks(np.add, band, sy, sx)
        # float64 sums of float32 values cannot overflow: finite sums of every block vouch for the whole band
        # without a pass of isfinite over it
        nan, inf = (0, 0) if band.dtype == np.float32 and np.isfinite(sums).all() else _nonfinite(band)
        flags = _blocks(np.bitwise_or, flags_of(band), sy, sx) if nan or inf else None
        if nan:
            valid = ~np.isnan(band)
            sums = _blocks(np.add, np.where(valid, band, 0), sy, sx)
            counts = _blocks(np.add, valid.astype(np.int64), sy, sx)
        else:
            counts = _block_sizes(band.shape, sy, sx)
        mean = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return _Band(mean, _blocks(np.fmin, band, sy, sx), _blocks(np.fmax, band, sy, sx), flags, nan, inf)


def _in_parallel(work: Callable[[int, int], T], items: list[tuple[int, int]],
                 threads: int) -> Iterator[tuple[tuple[int, int], T]]:
    """(item, work(*item)) in order, up to `threads` items worked on at once (reading one overlaps reducing
    another: pread and numpy release the GIL)."""
    if threads <= 1:
        yield from ((item, work(*item)) for item in items)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="tensormorph-tile") as pool:
        pending: deque[tuple[tuple[int, int], Future[T]]] = deque()
        for item in items:
            if len(pending) == threads:
                done, future = pending.popleft()
                yield done, future.result()
            pending.append((item, pool.submit(work, *item)))
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


def _blocks(op: np.ufunc, values: np.ndarray, sy: int, sx: int) -> np.ndarray:
    """Reduce every sy × sx block with a ufunc (sums in float64). Whole blocks go through a reshape, several
    times faster than reduceat: first the sy rows of each block row element-wise (long contiguous runs,
    vectorised), then each block's sx columns of that. The ragged last row and column of blocks go apart."""
    rows, cols = values.shape
    whole_r, whole_c = rows // sy, cols // sx
    dtype = np.float64 if op is np.add and values.dtype.kind == "f" else None
    out = np.empty((math.ceil(rows / sy), math.ceil(cols / sx)), np.float64 if dtype else values.dtype)
    if whole_r and whole_c:
        grid = values[:whole_r * sy, :whole_c * sx].reshape(whole_r, sy, whole_c * sx)
        per_block_row = op.reduce(grid, axis=1, dtype=dtype)
        out[:whole_r, :whole_c] = op.reduce(per_block_row.reshape(whole_r, whole_c, sx), axis=2)
    if whole_c < out.shape[1]:  # the ragged last column of blocks, in every block row
        strip = op.reduce(values[:, whole_c * sx:], axis=1, dtype=dtype)
        out[:, whole_c] = op.reduceat(strip, np.arange(0, rows, sy))
    if whole_r < out.shape[0] and whole_c:  # the ragged last row of blocks
        strip = op.reduce(values[whole_r * sy:, :whole_c * sx], axis=0, dtype=dtype)
        out[whole_r, :whole_c] = op.reduce(strip.reshape(whole_c, sx), axis=1)
    return out


def _block_sizes(shape: tuple[int, int], sy: int, sx: int) -> np.ndarray:
    """Elements per block, ragged edges included."""
    heights = np.minimum(sy, shape[0] - np.arange(0, shape[0], sy))
    widths = np.minimum(sx, shape[1] - np.arange(0, shape[1], sx))
    return np.outer(heights, widths)


def _as_working(values: np.ndarray) -> np.ndarray:
    """float32 for floats up to 4 bytes (bf16 and fp8 included), float64 otherwise."""
    if values.dtype == np.float32 or values.dtype == np.float64:
        return values
    if values.dtype.itemsize <= 4 and values.dtype.kind not in "biuc":
        return values.astype(np.float32)
    return _as_float(values)


def _as_float(values: np.ndarray) -> np.ndarray:
    if values.dtype == np.float64:
        return values
    if values.dtype == np.bool_:
        return values.astype(np.float64)
    if np.issubdtype(values.dtype, np.complexfloating):
        return np.abs(values).astype(np.float64)  # complex tensors are drawn by magnitude
    return values.astype(np.float64)


def _nonfinite(values: np.ndarray) -> tuple[int, int]:
    if np.isfinite(values).all():
        return 0, 0
    nan = int(np.isnan(values).sum())
    return nan, int((~np.isfinite(values)).sum()) - nan


def histogram(tensor: LogicalTensor, low: float, high: float, *, bins: int = 64, log: bool = False,
              band_bytes: int = DEFAULT_BAND_BYTES) -> dict[str, list[float]]:
    """Counts of the finite values in `bins` bins over [low, high], streamed chunk by chunk.

    With log=True the bins are log-spaced over |x| (zeros fall in the first bin).
    """
    if log:
        top = max(abs(low), abs(high))
        floor = top * 1e-8 if top > 0 else 1e-12
        edges = np.geomspace(floor, max(top, floor * 10), bins + 1)
    else:
        edges = np.linspace(low, high if high > low else low + 1.0, bins + 1)
    counts = np.zeros(bins, np.int64)
    for chunk in tensor.tiling:
        if chunk.numel == 0:
            continue
        for block in chunk_blocks(tensor, chunk, max(1, band_bytes // 8)):
            values = _as_float(block)
            values = values[np.isfinite(values)]
            if log:
                values = np.clip(np.abs(values), edges[0], edges[-1])
            counts += np.histogram(values, bins=edges)[0]
    return {"edges": edges.tolist(), "counts": counts.tolist()}

