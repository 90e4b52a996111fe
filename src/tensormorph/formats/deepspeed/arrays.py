"""The lazily read arrays of a parameter: memory-mapped boxes of the ranks' flat tensors.

A parameter's piece on one rank is a contiguous flat range; chunks must be boxes, so each piece is cut at
row edges into at most 2·ndim − 1 boxes, each a view of that rank's file with `ranks=(rank,)`."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ... import dtypes, torchzip
from ...core import Chunk, LogicalTensor, MappedArray
from ...errors import HeaderError
from ...geometry import flat_boxes
from ...storage import ByteStore
from ...tiling import validate_tiling
from .pieces import Piece


def flat_chunks(files: ByteStore, name: str, shape: tuple[int, ...], pieces: list[Piece],
                source: Callable[[Piece], tuple[str, torchzip.TensorRef]]) -> tuple[str, list[Chunk]]:
    """(dtype, chunks) of a tensor whose flat elements are the given pieces of 1-D tensors."""
    dtype: str | None = None
    chunks = []
    for piece in pieces:
        file, ref = source(piece)
        if len(ref.shape) != 1 or not ref.is_contiguous:
            raise HeaderError(f"rank {piece.rank}'s flat tensor {piece.slot} has shape {ref.shape} and stride "
                              f"{ref.stride}; expected a contiguous 1-D tensor", file=files.describe(file), tensor=name)
        if dtype is None:
            dtype = ref.dtype
        elif ref.dtype != dtype:
            raise HeaderError(f"rank {piece.rank} holds it as {ref.dtype}, another rank as {dtype}",
                              file=files.describe(file), tensor=name)
        if piece.start + piece.count > ref.shape[0]:
            raise HeaderError(f"needs elements [{piece.start}, {piece.start + piece.count}) of rank {piece.rank}'s "
                              f"flat tensor {piece.slot}, which holds {ref.shape[0]}", file=files.describe(file),
                              tensor=name)
        itemsize = dtypes.itemsize(ref.dtype)
        numpy_dtype = np.dtype(dtypes.numpy_dtype(ref.dtype))
        for offsets, box, flat in flat_boxes(shape, piece.begin, piece.begin + piece.count):
            at = ref.offset + (piece.start + flat - piece.begin) * itemsize
            chunks.append(Chunk(offsets, box, file, (at, at + math.prod(box) * itemsize),
                                MappedArray(files, file, at, numpy_dtype, box), ranks=(piece.rank,)))
    return dtype or "F32", validate_tiling(name, shape, chunks)


def reshaped(tensor: LogicalTensor, shape: tuple[int, ...]) -> LogicalTensor:
    """A one-chunk tensor saved flattened, as `shape`: the same elements in the same order."""
    if tensor.shape == shape:
        return tensor
    (chunk,) = tensor.chunks
    source = chunk.source
    if not isinstance(source, MappedArray) or source.strides is not None or math.prod(shape) != tensor.numel:
        raise HeaderError(f"holds shape {tensor.shape}, which cannot be viewed as the parameter's shape {shape}",
                          file=chunk.file, tensor=tensor.name)
    view = MappedArray(source.files, source.file, source.offset, source.dtype, shape)
    return LogicalTensor(tensor.name, tensor.dtype, shape, (Chunk((0,) * len(shape), shape, chunk.file,
                                                                   chunk.byte_range, view, chunk.ranks),))

