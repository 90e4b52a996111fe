"""Streaming statistics of tensors: bounded memory, one pass over each chunk."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from ..core import Chunk, LogicalTensor, MappedArray
from ..errors import BudgetExceededError
from ..geometry import split_box

DEFAULT_BLOCK_BYTES = 64 * 1024**2
# The most bytes one tensor may declare for a scan (stats, verify --full, convert) to start: 1 PiB, far beyond any
# real tensor and far below the 2^63 bytes where numpy's sizes overflow; only a forged shape declares more.
MAX_SCAN_BYTES = 1 << 50


@dataclass(frozen=True)
class TensorStats:
    name: str
    dtype: str
    numel: int
    min: float | None  # over finite values; None when there are none
    max: float | None
    mean: float | None
    std: float | None  # population standard deviation
    abs_max: float | None
    zeros: int
    nans: int
    infs: int

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "zero_fraction": self.zero_fraction}


class _Accumulator:
    """Chan et al.'s pairwise merge of (count, mean, M2): stable for any number of blocks."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.zeros = self.nans = self.infs = 0

    def add(self, block: np.ndarray) -> None:
        if block.dtype == np.bool_:
            block = block.view(np.uint8)
        elif np.issubdtype(block.dtype, np.complexfloating):
            block = np.abs(block)  # complex tensors are summarised by magnitude
        self.zeros += int(block.size - np.count_nonzero(block))
        if np.issubdtype(block.dtype, np.integer):
            if block.size:
                self.min = min(self.min, int(block.min()))
                self.max = max(self.max, int(block.max()))
            values = block.astype(np.float64)
        else:
            values = block.astype(np.float64)
            finite = np.isfinite(values)
            if not finite.all():
                nan = np.isnan(values)
                self.nans += int(nan.sum())
                self.infs += int((~finite).sum()) - int(nan.sum())
                values = values[finite]
            if values.size:
                self.min = min(self.min, float(values.min()))
                self.max = max(self.max, float(values.max()))
        n = values.size
        if not n:
            return
        mean = float(values.mean())
        m2 = float(np.square(values - mean).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    def result(self, tensor: LogicalTensor) -> TensorStats:
        some = self.count > 0
        return TensorStats(
            name=tensor.name, dtype=tensor.dtype, numel=tensor.numel,
            min=self.min if some else None, max=self.max if some else None,
            mean=self.mean if some else None, std=math.sqrt(self.m2 / self.count) if some else None,
            abs_max=max(abs(self.min), abs(self.max)) if some else None,
            zeros=self.zeros, nans=self.nans, infs=self.infs,
        )


def blocks(array: np.ndarray, block_elements: int) -> Iterator[np.ndarray]:
    """Consecutive pieces of `array`, each at most about `block_elements` (views where the layout allows)."""
    if array.flags.c_contiguous:
        flat = array.reshape(-1)
        for start in range(0, flat.size, block_elements):
            yield flat[start:start + block_elements]
    elif array.ndim == 1 or array.shape[0] == 0:
        for start in range(0, array.shape[0] if array.ndim else 1, block_elements):
            yield np.ascontiguousarray(array[start:start + block_elements]).reshape(-1)
    else:
        rows = max(1, block_elements // max(1, math.prod(array.shape[1:])))
        for start in range(0, array.shape[0], rows):
            yield np.ascontiguousarray(array[start:start + rows]).reshape(-1)


def chunk_blocks(tensor: LogicalTensor, chunk: Chunk, block_elements: int) -> Iterator[np.ndarray]:
    """A chunk's values in pieces of about `block_elements`.

    Memory-mapped chunks are sliced in place; other sources (dequantised GGUF blocks, ZeRO partitions)
    are read region by region through the tensor, so no chunk is ever materialised whole.
    """
    if isinstance(chunk.source, MappedArray) and tensor.reduction is None:  # a Partial value is reduced
        yield from blocks(chunk.read(), block_elements)
        return
    box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))
    for piece in split_box(box, block_elements):
        yield tensor.read(piece, budget=max(1, block_elements * tensor.numpy_dtype.itemsize * 2)).reshape(-1)


def check_scannable(tensor: LogicalTensor) -> None:
    """BudgetExceededError naming the tensor when its declared size is beyond what any scan can read."""
    nbytes = tensor.nbytes
    if nbytes > MAX_SCAN_BYTES:
        # beyond float's range, the exponent from the bit length (log10(2) = 0.30103): str() of a huge int is slow
        size = f"{nbytes:.3g}" if nbytes.bit_length() < 1000 else f"about 1e{int(nbytes.bit_length() * 0.30103)}"
        raise BudgetExceededError(
            f"declares shape {list(tensor.shape)} of {tensor.dtype}, {size} bytes: too large to scan "
            f"(the limit is {MAX_SCAN_BYTES:,} bytes)", file=tensor.files[0] if tensor.files else None,
            tensor=tensor.name)


def tensor_stats(tensor: LogicalTensor, *, block_bytes: int = DEFAULT_BLOCK_BYTES,
                 progress: Callable[[int], None] | None = None) -> TensorStats:
    """Statistics of one logical tensor, streamed chunk by chunk in blocks of about `block_bytes`."""
    check_scannable(tensor)
    accumulator = _Accumulator()
    block_elements = max(1, block_bytes // 8)  # blocks are upcast to float64
    itemsize = tensor.numpy_dtype.itemsize
    for chunk in tensor.tiling:
        if chunk.numel == 0:
            continue
        for block in chunk_blocks(tensor, chunk, block_elements):
            accumulator.add(block)
            if progress is not None:
                progress(block.size * itemsize)
    return accumulator.result(tensor)


def checkpoint_stats(tensors: Iterable[LogicalTensor], *, threads: int = 2, block_bytes: int = DEFAULT_BLOCK_BYTES,
                     progress: Callable[[int], None] | None = None) -> list[TensorStats]:
    """Statistics of many tensors, in order, computed in parallel threads (numpy releases the GIL)."""
    items = list(tensors)
    for tensor in items:  # refused before any is read, not after hours of reading the others
        check_scannable(tensor)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return list(pool.map(lambda t: tensor_stats(t, block_bytes=block_bytes, progress=progress), items))
