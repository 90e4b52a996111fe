"""ZeRO stage 3: every parameter split on its own over the ranks, at the same offset in each rank's flat groups."""

from __future__ import annotations

import math
from collections.abc import Iterator

from ...errors import HeaderError
from ...geometry import shard_range
from ...storage import ByteStore
from .pieces import Layout, Piece
from .states import ModelStates, RankStates


def zero3_layout(model: ModelStates, ranks: list[RankStates], files: ByteStore) -> Layout:
    """Stage 3: every parameter split on its own, ceil(n / ranks) elements per rank, padding at the end."""
    world = len(ranks)
    sizes = [f.shape[0] for f in ranks[0].flats]
    for rank in ranks[1:]:
        theirs = [f.shape[0] for f in rank.flats]
        if theirs != sizes:
            raise HeaderError(f"rank {rank.rank}'s flat fp32 groups hold {theirs} elements, rank 0's {sizes}: "
                              "every rank holds an equal share", file=files.describe(rank.file))
    slot_starts = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
    layout: Layout = {}
    offset = 0
    for shapes in model.param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            share = -(-numel // world)
            if offset + share > slot_starts[-1]:
                raise HeaderError(f"needs elements [{offset}, {offset + share}) of every rank's flat groups, which "
                                  f"hold {slot_starts[-1]}", file=files.describe(ranks[0].file), tensor=name)
            pieces: list[Piece] = []
            for r in range(world):
                begin, end = shard_range(numel, world, r)  # torch.chunk's split, as DeepSpeed's
                pieces.extend(_split_slots(r, offset, begin, end - begin, slot_starts))
            layout[name] = pieces
            offset += share
    if offset != slot_starts[-1]:
        raise HeaderError(f"param_shapes account for {offset} elements per rank, but the flat groups hold "
                          f"{slot_starts[-1]}", file=files.describe(ranks[0].file))
    return layout


def _split_slots(rank: int, at: int, begin: int, count: int, slot_starts: list[int]) -> Iterator[Piece]:
    """Pieces for `count` elements from position `at` of one rank's concatenated flat tensors."""
    for slot in range(len(slot_starts) - 1):
        low, high = max(at, slot_starts[slot]), min(at + count, slot_starts[slot + 1])
        if low < high:
            yield Piece(rank, slot, low - slot_starts[slot], begin + low - at, high - low)
