"""Placement arithmetic: which box of a tensor each rank holds, and which rank writes each box.

Pure Python, no torch: the offline resharder and the format reader use it as
well as the distributed save. Boxes follow DTensor's rules (docs/formats.md,
"DTensor placements"): `Shard(d)` splits the current local piece along d as
`torch.chunk` does (ceil division, trailing ranks short or empty), mesh
dimensions applied in order; `Replicate()` keeps it whole.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

from ..errors import CheckpointError
from ..geometry import Box, shard_range

SHARD_PATTERN = re.compile(r"^S(?:hard)?\((-?\d+)\)$")
_REPLICATE = re.compile(r"^R(?:eplicate)?(?:\(\))?$")
BoxKey = TypeVar("BoxKey", bound=Hashable)  # whatever names a stored box


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


def assign_writers(holders: Mapping[BoxKey, tuple[int, Iterable[int]]]) -> dict[BoxKey, int]:
    """Choose one writer for each stored box among the ranks that hold it, balancing bytes.

    `holders` maps a box key to (its bytes, the ranks holding an identical copy). Boxes held by the
    fewest ranks are placed first (they have the least choice), largest first among those; each goes
    to its least-loaded holder, the lowest rank on ties. Every rank computes the same answer.
    """
    load: dict[int, int] = {}
    chosen: dict[BoxKey, int] = {}
    order = sorted(holders.items(), key=lambda item: (len(set(item[1][1])), -item[1][0], repr(item[0])))
    for key, (nbytes, ranks) in order:
        writer = min(set(ranks), key=lambda r: (load.get(r, 0), r))
        load[writer] = load.get(writer, 0) + nbytes
        chosen[key] = writer
    return chosen
