"""A manifest tensor's chunks checked against its layout: each contribution tiles the tensor, and under
`_StridedShard` or `Partial` every chunk lies where the placements put the ranks that hold it.

Reads use the chunks' own boxes, so for Shard and Replicate the placements only describe them. A `Partial`
chunk's contribution decides which rank a same-mesh load gives it, and a `_StridedShard` box that its
placements do not produce means the split factor recorded is not the one that was used: both are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..core import Chunk, ChunkSource
from ..errors import CheckpointError, ChunkLayoutError, HeaderError
from ..geometry import Box
from ..tiling import validate_tiling
from .layout import contribution_of, local_pieces, parse_spec
from .manifest import ChunkRecord, TensorRecord


def checked_chunks(name: str, record: TensorRecord, where: str,
                   source: Callable[[ChunkRecord], ChunkSource]) -> list[Chunk]:
    """The record's chunks as Chunks (replicas merged), each contribution checked to tile the tensor."""
    reduction = record.reduction
    count = reduction.contributions if reduction else 1
    groups: dict[int, list[Chunk]] = {}
    for c in record.chunks:
        groups.setdefault(c.contribution, []).append(
            Chunk(c.offsets, c.shape, c.file, c.byte_range, source(c), c.holders or (c.rank,), c.contribution))
    if math.prod(record.shape) == 0:
        count = 0  # nothing to cover: no contribution needs a chunk
    elif count > len(record.chunks):
        raise ChunkLayoutError(f"its placements {list(record.placements or ())} give {count} contributions, but "
                               f"only {len(record.chunks)} chunks are stored", file=where, tensor=name)
    chunks = []
    for contribution in sorted(set(range(count)) | set(groups)):
        try:
            chunks += validate_tiling(name, record.shape, groups.get(contribution, []), file=where)
        except ChunkLayoutError as exc:
            if reduction is None:
                raise
            raise ChunkLayoutError(f"contribution {contribution} of {reduction.describe()} does not cover the "
                                   f"tensor: {exc.reason}", file=where, tensor=name) from None
    if _needs_layout_check(record):
        _check_holders(name, record, where)
    return chunks


def _needs_layout_check(record: TensorRecord) -> bool:
    """Under _StridedShard or Partial, for a tensor with elements (an empty one stores no chunk to misplace)."""
    if record.mesh is None or math.prod(record.shape) == 0:
        return False
    kinds = {parse_spec(p, len(record.shape)).kind for p in record.placements or ()}
    return bool(kinds & {"strided", "partial"})


def _check_holders(name: str, record: TensorRecord, where: str) -> None:
    """Every chunk is one of the boxes, and the contribution, that the placements give each of its holders."""
    mesh = record.mesh or ()
    placements = record.placements or ()
    ranks = np.asarray(record.mesh_ranks, dtype=np.int64)
    if len(ranks) != math.prod(mesh):  # none listed included: who holds a contribution decides how it loads
        raise HeaderError(f"its mesh {list(mesh)} lists {len(ranks)} ranks", file=where, tensor=name)
    order = np.argsort(ranks, kind="stable")  # looked up by bisection: a file chooses the ranks, hence hashes
    expected: dict[int, tuple[set[Box], int]] = {}  # by position in the mesh, computed once each
    for chunk in record.chunks:
        for holder in chunk.holders or (chunk.rank,):
            at = int(np.searchsorted(ranks, holder, sorter=order))
            if at >= len(ranks) or ranks[order[at]] != holder:
                raise ChunkLayoutError(f"chunk at offsets {list(chunk.offsets)} is held by rank {holder}, which is "
                                       f"not in the tensor's mesh", file=where, tensor=name)
            position = int(order[at])
            if position not in expected:
                coordinate = _unravel(position, mesh)
                try:
                    pieces = local_pieces(record.shape, mesh, placements, coordinate)
                    contribution = contribution_of(mesh, placements, coordinate)[0]
                except CheckpointError as exc:
                    raise HeaderError(exc.reason, file=where, tensor=name) from None
                expected[position] = ({box for box, _ in pieces}, contribution)
            boxes, contribution = expected[position]
            if (chunk.offsets, chunk.shape) not in boxes or chunk.contribution != contribution:
                raise ChunkLayoutError(
                    f"chunk at offsets {list(chunk.offsets)} with shape {list(chunk.shape)} (contribution "
                    f"{chunk.contribution}) held by rank {holder} is not where the placements {list(placements)} on "
                    f"mesh {list(mesh)} put that rank (boxes {sorted(boxes)[:4]}, contribution {contribution}): "
                    "the placements or their split factors are inconsistent with the stored chunks",
                    file=where, tensor=name)


def _unravel(position: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh coordinate of a row-major position (any number of mesh dimensions; sizes are at least 1)."""
    coordinate = []
    for size in reversed(mesh):
        position, index = divmod(position, size)
        coordinate.append(index)
    return tuple(reversed(coordinate))
