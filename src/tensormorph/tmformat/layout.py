"""Placement arithmetic: which boxes of a tensor each rank holds, and which rank writes each box.

Pure Python, no torch: the offline resharder, the format reader and the distributed save all use it.
Boxes follow DTensor's rules (docs/formats.md, "DTensor placements"), mesh dimensions applied in order
to the rank's current local piece:

- `Shard(d)` splits the local piece along d as `torch.chunk` does (ceil division, trailing ranks short
  or empty).
- `_StridedShard(d, sf=s)` (FSDP2 over tensor parallelism) first cuts the local piece along d into s
  parts as `torch.chunk` does, splits each part as `Shard(d)` would, and keeps this rank's share of every
  part, concatenated in order. A rank's local tensor may thus be several boxes; with the later `Shard(d)`
  of FSDP2 + TP (sf = that dimension's mesh size) it is one again.
- `Replicate()` and `Partial(op)` keep the local piece whole; under `Partial` the ranks along that mesh
  dimension hold different contributions (see reduction.py).
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from bisect import bisect_right
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .. import dtypes
from ..errors import CheckpointError
from ..geometry import Box, shard_range
from ..reduction import REDUCE_OPS, check_reducible

SHARD_PATTERN = re.compile(r"^S(?:hard)?\((-?\d+)\)$")
_STRIDED = re.compile(r"^_S(?:tridedShard)?\((?:dim=)?(-?\d+),(?:sf=|split_factor=)?(\d+)\)$")
_REPLICATE = re.compile(r"^R(?:eplicate)?(?:\(\))?$")
_PARTIAL = re.compile(r"^P(?:artial)?(?:\((?:reduce_op=)?['\"]?(\w*)['\"]?\))?$")
MAX_LOCAL_PIECES = 4096
"""Most boxes one rank's local tensor may be made of. Nested `_StridedShard`s multiply their split factors,
and a manifest chooses them: without a bound, one tensor could ask for billions of boxes."""
BoxKey = TypeVar("BoxKey", bound=Hashable)  # whatever names a stored box
_NOT_PARTIAL = frozenset({"Shard(0)", "Shard(1)", "Replicate()"})  # the usual spellings that hold no reduce op


@dataclass(frozen=True)
class Spec:
    """One placement, parsed: kind "shard", "strided", "replicate" or "partial"."""

    kind: str
    dim: int | None = None
    split_factor: int = 1
    op: str | None = None

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"Shard({self.dim})"
        if self.kind == "strided":
            return f"_StridedShard({self.dim}, split_factor={self.split_factor})"
        return f"Partial({self.op})" if self.kind == "partial" else "Replicate()"


LAYOUT_CACHE = 1024  # distinct (placements, mesh, ndim, dtype) whose check checked_contributions remembers
SPEC_CACHE = 4096  # distinct (placement text, ndim) pairs remembered: a state has a handful, a manifest may spell
# millions (each parse is then merely not remembered)


@functools.lru_cache(maxsize=SPEC_CACHE)
def parse_spec(text: str, ndim: int | None = None) -> Spec:
    """A placement's text ('Shard(0)', 'S(0)', 'Replicate()', 'Partial(sum)', '_StridedShard(0, sf=2)'), its
    dimension checked against a tensor of `ndim` dimensions when given."""
    spec = text.replace(" ", "")
    if _REPLICATE.match(spec):
        return Spec("replicate")
    partial = _PARTIAL.match(spec)
    if partial is not None:
        op = partial.group(1) or "sum"
        if op not in REDUCE_OPS:
            raise CheckpointError(f"placement {text!r} has an unknown reduce op {op!r}: expected one of "
                                  f"{', '.join(REDUCE_OPS)}")
        return Spec("partial", op=op)
    strided = _STRIDED.match(spec)
    match = strided or SHARD_PATTERN.match(spec)
    if match is None:
        raise CheckpointError(f"unknown placement {text!r}: expected Shard(d), Replicate(), Partial(op) or "
                              "_StridedShard(d, sf=s)")
    dim = int(match.group(1))
    if ndim is not None:
        if not -ndim <= dim < ndim:
            raise CheckpointError(f"placement {text!r} names dimension {dim} of a {ndim}-dimensional tensor")
        dim %= ndim
    if strided is None:
        return Spec("shard", dim)
    factor = int(strided.group(2))
    if factor < 1:
        raise CheckpointError(f"placement {text!r} has split factor {factor}: it must be at least 1")
    return Spec("strided", dim, factor)


Segments = list[tuple[int, int]]  # (global start, length) along one dimension, in the local tensor's order


def _take(segments: Segments, starts: list[int], begin: int, end: int) -> Segments:
    """The part [begin, end) of the concatenation of `segments` (`starts`: where each begins in it)."""
    out = []
    at = max(0, bisect_right(starts, begin) - 1)
    while at < len(segments) and starts[at] < end:
        start, length = segments[at]
        low, high = max(begin, starts[at]), min(end, starts[at] + length)
        if low < high:
            out.append((start + low - starts[at], high - low))
        at += 1
    return out


def _share(length: int, split: int, mesh_size: int, index: int, budget: int,
           placements: Sequence[str]) -> tuple[list[tuple[int, int]], int]:
    """The local ranges [begin, end) that rank `index` of `mesh_size` keeps of a piece of `length` under a split
    factor `split` (1 for Shard), and where an empty share begins. In closed form: `torch.chunk` gives parts of
    ceil(length / split) elements (the last one shorter, later ones empty), and each part is split alike, so a
    factor chosen by a file costs nothing; more than `budget` ranges is refused before any is made."""
    if length == 0:
        return [], 0
    step = -(-length // split)
    parts = -(-length // step)
    begin, end = shard_range(step, mesh_size, index)  # within a whole part
    last = (parts - 1) * step
    last_begin, last_end = shard_range(length - last, mesh_size, index)
    count = (parts - 1) * (end > begin) + (last_end > last_begin)
    if count > budget:
        raise CheckpointError(f"placements {list(placements)} give a rank more than {MAX_LOCAL_PIECES} boxes of "
                              "a tensor")
    ranges = [(p * step + begin, p * step + end) for p in range(parts - 1)] if end > begin else []
    if last_end > last_begin:
        ranges.append((last + last_begin, last + last_end))
    return ranges, begin if parts > 1 else last_begin


def local_pieces(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[str],
                 coordinate: Sequence[int]) -> list[tuple[Box, tuple[int, ...]]]:
    """The boxes held at mesh `coordinate`: (global box, its offsets within the rank's local tensor) each,
    in C order of the local tensor. One box for Shard/Replicate/Partial; `_StridedShard` may give several."""
    ndim = len(shape)
    along: list[Segments] = [[(0, n)] for n in shape]
    for mesh_size, placement, index in zip(mesh_shape, placements, coordinate, strict=True):
        spec = parse_spec(placement, ndim)
        if spec.dim is None:
            continue
        segments = along[spec.dim]
        starts = list(itertools.accumulate((n for _, n in segments), initial=0))
        others = math.prod(max(1, len(s)) for d, s in enumerate(along) if d != spec.dim)
        ranges, first = _share(starts[-1], spec.split_factor, mesh_size, index, MAX_LOCAL_PIECES // others,
                               placements)
        taken = [piece for low, high in ranges for piece in _take(segments, starts, low, high)]
        # an empty share is an empty box where it would begin, as torch and DCP place it
        along[spec.dim] = _merged(taken) or [(_position(segments, first), 0)]
        if math.prod(max(1, len(s)) for s in along) > MAX_LOCAL_PIECES:
            raise CheckpointError(f"placements {list(placements)} give a rank more than {MAX_LOCAL_PIECES} boxes "
                                  f"of a tensor of shape {list(shape)}")
    pieces = []
    for parts in itertools.product(*(_with_local_offsets(s) for s in along)):
        box = (tuple(p[0] for p in parts), tuple(p[1] for p in parts))
        pieces.append((box, tuple(p[2] for p in parts)))
    return pieces


def _position(segments: Segments, local: int) -> int:
    """The global index of local index `local` (the end of the last segment when it is the length)."""
    for start, length in segments:
        if local < length:
            return start + local
        local -= length
    return segments[-1][0] + segments[-1][1] if segments else 0


def _merged(segments: Segments) -> Segments:
    out: Segments = []
    for start, length in segments:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def _with_local_offsets(segments: Segments) -> list[tuple[int, int, int]]:
    """(global start, length, start within the local tensor) of each segment."""
    out, position = [], 0
    for start, length in segments:
        out.append((start, length, position))
        position += length
    return out


def local_box(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[str],
              coordinate: Sequence[int]) -> Box:
    """The one box held at mesh `coordinate`; CheckpointError when the placements give that rank several."""
    pieces = local_pieces(shape, mesh_shape, placements, coordinate)
    if len(pieces) != 1:
        raise CheckpointError(f"placements {list(placements)} give the rank at {list(coordinate)} {len(pieces)} "
                              "boxes, not one")
    return pieces[0][0]


def contribution_of(mesh_shape: Sequence[int], placements: Sequence[str],
                    coordinate: Sequence[int]) -> tuple[int, int]:
    """(which contribution the rank at `coordinate` holds, how many there are) under its Partial placements:
    the row-major index of its coordinate along the Partial mesh dimensions; (0, 1) without any."""
    index, count = 0, 1
    for mesh_size, placement, position in zip(mesh_shape, placements, coordinate, strict=True):
        if parse_spec(placement).kind == "partial":
            index, count = index * mesh_size + position, count * mesh_size
    return index, count


def reduce_op(placements: Sequence[str], tensor: str | None = None) -> str | None:
    """The reduce op of the Partial placements (None without any); one op for all of them."""
    placements = tuple(placements)
    if all(p in _NOT_PARTIAL for p in placements):  # asked for every chunk of every tensor: the common answer, fast
        return None
    ops = {spec.op for spec in (parse_spec(p) for p in placements) if spec.kind == "partial"}
    if len(ops) > 1:
        raise CheckpointError(f"placements {list(placements)} mix reduce ops {sorted(o or '' for o in ops)}: the "
                              "order of such a reduction is not defined", tensor=tensor)
    return ops.pop() if ops else None


@functools.lru_cache(maxsize=LAYOUT_CACHE)
def checked_contributions(placements: tuple[str, ...], mesh: tuple[int, ...], ndim: int, dtype: str) -> int:
    """How many contributions `placements` on `mesh` make, each placement checked against a tensor of `ndim`
    dimensions and the reduce op against `dtype` (CheckpointError when they do not fit). Remembered: the tensors
    of a manifest share a few layouts."""
    for placement in placements:
        parse_spec(placement, ndim)
    op = reduce_op(placements)
    if op is None:
        return 1
    check_reducible(op, dtypes.numpy_dtype(dtype))
    return contribution_of(mesh, placements, (0,) * len(mesh))[1]


def partial_mesh_dims(placements: Sequence[str]) -> tuple[int, ...]:
    return tuple(i for i, p in enumerate(placements) if parse_spec(p).kind == "partial")


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
