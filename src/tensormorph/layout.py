"""Placement arithmetic: which box of a tensor each rank holds, and which rank writes each box.

Pure Python, no torch: the offline resharder and the format reader use it as
well as the distributed save. Boxes follow DTensor's rules (FORMATS.md,
"DTensor placements"): `Shard(d)` splits the current local piece along d as
`torch.chunk` does (ceil division, trailing ranks short or empty), mesh
dimensions applied in order; `Replicate()` keeps it whole.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .errors import CheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, shape)

SHARD_PATTERN = re.compile(r"^S(?:hard)?\((-?\d+)\)$")
_REPLICATE = re.compile(r"^R(?:eplicate)?(?:\(\))?$")


def parse_placement(text: str, ndim: int) -> int | None:
    """The sharded dimension of 'Shard(d)' (or 'S(d)'), None for 'Replicate()' (or 'R')."""
    spec = text.replace(" ", "")
    if _REPLICATE.match(spec):
        return None
    match = SHARD_PATTERN.match(spec)
    if match is None:
        raise CheckpointError(f"unknown placement {text!r}: expected Shard(d) or Replicate()")
    dim = int(match.group(1))
    if not -ndim <= dim < ndim:
        raise CheckpointError(f"placement {text!r} names dimension {dim} of a {ndim}-dimensional tensor")
    return dim % ndim


def shard_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[begin, end) of part `index` when `size` is split into `parts` as torch.chunk splits it."""
    step = -(-size // parts) if parts else 0
    return min(size, index * step), min(size, (index + 1) * step)


def local_box(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[str],
              coordinate: Sequence[int]) -> Box:
    """The box held at mesh `coordinate` of a tensor of global `shape`."""
    offsets, sizes = [0] * len(shape), list(shape)
    for mesh_size, placement, index in zip(mesh_shape, placements, coordinate, strict=True):
        dim = parse_placement(placement, len(shape))
        if dim is None:
            continue
        begin, end = shard_range(sizes[dim], mesh_size, index)
        offsets[dim] += begin
        sizes[dim] = end - begin
    return tuple(offsets), tuple(sizes)


def rank_boxes(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[str]) -> list[Box]:
    """Every rank's box, for a mesh whose ranks are numbered in row-major order of their coordinates."""
    if len(mesh_shape) != len(placements):
        raise CheckpointError(f"a mesh of {len(mesh_shape)} dimensions needs as many placements, "
                              f"got {list(placements)}")
    return [local_box(shape, mesh_shape, placements, coordinate)
            for coordinate in itertools.product(*(range(n) for n in mesh_shape))]


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


def assign_writers(holders: Mapping[object, tuple[int, Iterable[int]]]) -> dict[object, int]:
    """Choose one writer for each stored box among the ranks that hold it, balancing bytes.

    `holders` maps a box key to (its bytes, the ranks holding an identical copy). Boxes held by the
    fewest ranks are placed first (they have the least choice), largest first among those; each goes
    to its least-loaded holder, the lowest rank on ties. Every rank computes the same answer.
    """
    load: dict[int, int] = {}
    chosen: dict[object, int] = {}
    order = sorted(holders.items(), key=lambda item: (len(set(item[1][1])), -item[1][0], repr(item[0])))
    for key, (nbytes, ranks) in order:
        writer = min(set(ranks), key=lambda r: (load.get(r, 0), r))
        load[writer] = load.get(writer, 0) + nbytes
        chosen[key] = writer
    return chosen


def box_runs(chunk_shape: Sequence[int], itemsize: int, start: Sequence[int], size: Sequence[int]) -> tuple[np.ndarray, int]:
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
