"""What `inspect` shows: a checkpoint's tensors, how each is split, and totals, as plain data."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ..core import Checkpoint, Chunk, LogicalTensor
from ..dtypes import itemsize
from .tree import module_tree


def split_description(tensor: LogicalTensor, encoding: dict[str, Any] | None = None) -> str:
    """How a tensor is stored, in words: file-level shard, placement chunks, or one piece (and its encoding,
    `stored_encoding(tensor)`, when the caller has it already)."""
    encoding = encoding or stored_encoding(tensor)
    detail = f", {encoding['description']}" if encoding else ""
    if tensor.reduction is not None:
        detail = f", {tensor.reduction.describe()}{detail}"
    if tensor.is_placement_sharded:
        ranks = sorted({r for c in tensor.chunks for r in c.ranks})
        who = f", ranks {_ranges(ranks)}" if ranks else ""
        return f"{len(tensor.chunks)} chunks{who}{detail}"
    if tensor.file_shard is not None:
        k, n = tensor.file_shard
        return f"shard {k} of {n}{detail}"
    return f"whole{detail}"


def stored_encoding(tensor: LogicalTensor) -> dict[str, Any] | None:
    """How the stored bytes encode the values when that is not plain `dtype` (GGUF quantized blocks), else None.

    A chunk source that decodes says so through an `encoding` attribute.
    """
    return getattr(tensor.chunks[0].source, "encoding", None) if tensor.chunks else None


def _ranges(numbers: list[int]) -> str:
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(parts)


def chunk_record(chunk: Chunk) -> dict[str, Any]:
    return {"offsets": list(chunk.offsets), "shape": list(chunk.shape), "file": chunk.file,
            "byte_range": list(chunk.byte_range) if chunk.byte_range else None, "ranks": list(chunk.ranks),
            "contribution": chunk.contribution}


def tensor_record(tensor: LogicalTensor, *, chunks: bool = True) -> dict[str, Any]:
    numel = math.prod(tensor.shape)
    return _record(tensor, numel, numel * itemsize(tensor.dtype), chunks)


def _record(tensor: LogicalTensor, numel: int, nbytes: int, chunks: bool) -> dict[str, Any]:
    encoding = stored_encoding(tensor)
    record: dict[str, Any] = {
        "name": tensor.name, "dtype": tensor.dtype, "shape": list(tensor.shape), "numel": numel,
        "nbytes": nbytes, "split": split_description(tensor, encoding),
        "files": list(tensor.files),
        "file_shard": list(tensor.file_shard) if tensor.file_shard else None,
        "placement": None if tensor.placement is None else {
            "mesh_shape": list(tensor.placement.mesh_shape), "placements": list(tensor.placement.placements),
            "mesh_dim_names": list(tensor.placement.mesh_dim_names or [])},
        "reduction": None if tensor.reduction is None else {
            "op": tensor.reduction.op, "contributions": tensor.reduction.contributions,
            "mesh_dims": list(tensor.reduction.mesh_dims)},
        "chunk_count": len(tensor.chunks),
        "encoding": encoding,
    }
    if chunks:
        record["chunks"] = [chunk_record(c) for c in tensor.chunks]
    return record


def totals_by_dtype(checkpoint: Checkpoint) -> dict[str, dict[str, int]]:
    return _Totals(checkpoint.values()).by_dtype()


class _Totals:
    """Tensors, elements and bytes by dtype, and each tensor's own (numel, nbytes), counted in one pass: the
    properties of LogicalTensor recompute them on every use, which for 20,000 tensors costs a quarter second."""

    def __init__(self, tensors: Iterable[LogicalTensor]):
        self.counts: Counter = Counter()
        self.sizes: Counter = Counter()
        self.elements: Counter = Counter()
        self.each: list[tuple[LogicalTensor, int, int]] = []
        for tensor in tensors:
            numel = math.prod(tensor.shape)
            nbytes = numel * itemsize(tensor.dtype)
            self.each.append((tensor, numel, nbytes))
            self.counts[tensor.dtype] += 1
            self.sizes[tensor.dtype] += nbytes
            self.elements[tensor.dtype] += numel

    def by_dtype(self) -> dict[str, dict[str, int]]:
        return {d: {"tensors": self.counts[d], "params": self.elements[d], "nbytes": self.sizes[d]}
                for d in sorted(self.sizes, key=self.sizes.__getitem__, reverse=True)}


def describe(checkpoint: Checkpoint, *, chunks: bool = True) -> dict[str, Any]:
    """Everything `tensormorph inspect` prints, as JSON-able data."""
    objects = [{"name": o.name, "nbytes": o.nbytes, "file": o.file} for o in checkpoint.objects.values()]
    totals = _Totals(checkpoint.values())
    return {
        "path": str(checkpoint.path), "format": checkpoint.format, "files": list(checkpoint.files),
        "tensor_count": len(checkpoint), "params": sum(totals.elements.values()),
        "nbytes": sum(totals.sizes.values()), "totals_by_dtype": totals.by_dtype(),
        "metadata": dict(checkpoint.metadata), "objects": objects,
        "tensors": [_record(t, numel, nbytes, chunks) for t, numel, nbytes in totals.each],
        "tree": module_tree(checkpoint.values()).to_dict(),
    }
