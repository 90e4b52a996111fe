"""Where each parameter's flat elements live: the pieces of the ranks' flat tensors, whatever the ZeRO stage."""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import HeaderError
from ...storage import ByteStore
from .states import RankStates


@dataclass(frozen=True)
class Piece:
    """A parameter's flat elements [begin, begin + count), held by `rank` from element `start` of its flat
    tensor number `slot`."""

    rank: int
    slot: int
    start: int
    begin: int
    count: int


Layout = dict[str, list[Piece]]


def check_mappings(layout: Layout, ranks: list[RankStates], files: ByteStore) -> None:
    """DeepSpeed also records each rank's share of each parameter (param_slice_mappings): it must agree."""
    for rank in ranks:
        groups = rank.slice_mappings
        if groups is None:
            continue
        if not isinstance(groups, list):
            raise HeaderError("param_slice_mappings should be a list per group", file=files.describe(rank.file))
        recorded = {}
        for group, mapping in enumerate(groups):
            if not isinstance(mapping, dict):
                raise HeaderError(f"param_slice_mappings[{group}] should map names to fragments",
                                  file=files.describe(rank.file))
            for name, fragment in mapping.items():
                if not isinstance(fragment, dict):
                    raise HeaderError("a param_slice_mappings entry is not a fragment address",
                                      file=files.describe(rank.file), tensor=str(name))
                recorded[name] = (group, fragment.get("start"), fragment.get("numel"))
        computed = {name: (p.slot, p.start, p.count) for name, pieces in layout.items() for p in pieces
                    if p.rank == rank.rank}
        for name in sorted(set(recorded) | set(computed)):
            if recorded.get(name) != computed.get(name):
                raise HeaderError(f"rank {rank.rank}'s param_slice_mappings place it at (group, start, numel) = "
                                  f"{recorded.get(name)}, the partition sizes and param_shapes at "
                                  f"{computed.get(name)}", file=files.describe(rank.file), tensor=name)
