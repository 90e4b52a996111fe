"""ZeRO stages 1 and 2: each group's partitions, concatenated over ranks, hold its parameters in order."""

from __future__ import annotations

import math
from typing import Any

from ...errors import HeaderError
from ...storage import ByteStore
from .pieces import Layout, Piece
from .states import ModelStates, RankStates


def zero12_layout(model: ModelStates, ranks: list[RankStates], files: ByteStore) -> Layout:
    """Stages 1-2: each group's partitions, concatenated over ranks, hold its parameters in order."""
    world = len(ranks)
    layout: Layout = {}
    for rank in ranks:
        if len(rank.flats) != len(model.param_shapes):
            raise HeaderError(f"holds {len(rank.flats)} flat partitions but param_shapes lists "
                              f"{len(model.param_shapes)} groups", file=files.describe(rank.file))
    paddings = ranks[0].settings.get("param_alignment_paddings")
    for group, shapes in enumerate(model.param_shapes):
        sizes = [r.flats[group].shape[0] for r in ranks]
        _check_partition_sizes(group, sizes, ranks, files)
        starts = [sum(sizes[:r]) for r in range(world)]
        extra = paddings[group] if isinstance(paddings, list) and group < len(paddings) else None
        if extra is not None and (not isinstance(extra, list) or len(extra) != len(shapes)
                                  or not all(type(n) is int and n >= 0 for n in extra)):
            raise HeaderError(f"param_alignment_paddings of group {group} should list {len(shapes)} paddings, "
                              f"found {str(extra)[:80]}", file=files.describe(ranks[0].file))
        offset = 0
        for index, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            pieces = []
            for r in range(world):
                low, high = max(offset, starts[r]), min(offset + numel, starts[r] + sizes[r])
                if low < high:
                    pieces.append(Piece(r, group, low - starts[r], low - offset, high - low))
            if sum(p.count for p in pieces) != numel:
                raise HeaderError(f"needs flat elements [{offset}, {offset + numel}) of group {group}, but the "
                                  f"partitions of all ranks hold {sum(sizes)}", file=files.describe(ranks[-1].file),
                                  tensor=name)
            layout[name] = pieces
            offset += numel + (extra[index] if extra is not None else 0)
        # DeepSpeed pads each group to a multiple of 2 × ranks: what is left over must be that padding
        align = 2 * world
        if -(-offset // align) != -(-sum(sizes) // align):
            raise HeaderError(f"param_shapes account for {offset} elements of group {group}, but the partitions "
                              f"hold {sum(sizes)}", file=files.describe(ranks[0].file))
    return layout


def _check_partition_sizes(group: int, sizes: list[int], ranks: list[RankStates], files: ByteStore) -> None:
    """Every rank's partition of a group is the same size once its padding (group_paddings) is counted back in;
    without that record, only the last partition, which holds the padding, may be shorter."""
    pads: list[Any] = [r.settings.get("group_paddings") for r in ranks]
    recorded = all(isinstance(p, list) and group < len(p) and type(p[group]) is int for p in pads)
    padded = [size + (pad[group] if recorded else 0) for size, pad in zip(sizes, pads)]
    for r in range(1, len(ranks)):
        shorter_last = not recorded and r == len(ranks) - 1 and padded[r] < padded[0]
        if padded[r] != padded[0] and not shorter_last:
            raise HeaderError(f"rank {r}'s partition of group {group} holds {sizes[r]} elements "
                              f"({padded[r]} with padding), rank 0's {sizes[0]} ({padded[0]}): partitions of one "
                              "group must be the same size", file=files.describe(ranks[r].file))
