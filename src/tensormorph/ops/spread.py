"""Offline operations (convert, verify, diff) spread over processes: who handles what, and the one collective step
the ops need, as a protocol they call.

One process alone (`ALONE`) is the default, and then an op runs exactly as it always did. Under torchrun,
`tensormorph.distributed.offline` gives a `Team` of the launch's processes (torch, CPU gloo: results move, never
tensors). Every process opens the checkpoints (metadata only) and works out the same split of the work with no
communication: `share` is a deterministic greedy balance of bytes. This module never imports torch.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable, Hashable, Mapping
from typing import Protocol, TypeVar

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

# set by torchrun (and torch.distributed.run) in every process it starts: all of them mean a launch
TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")


class Team(Protocol):
    """The processes an offline operation is spread over."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def each(self, step: Callable[[], T]) -> list[T]:
        """Run `step` in this process and return every process's value, in rank order, on every process. An
        exception in any process is raised in all of them, naming the rank (every process calls `each` the same
        number of times, in the same order, so none is left waiting)."""
        ...


class Alone:
    """A single process: `each` runs the step and lets its exception through unchanged."""

    rank = 0
    world = 1

    def each(self, step: Callable[[], T]) -> list[T]:
        return [step()]


ALONE = Alone()


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by torchrun (its variables are all set)."""
    environ = os.environ if environ is None else environ
    return all(environ.get(name) for name in TORCHRUN_VARIABLES)


def balance(sizes: Mapping[K, int], world: int) -> list[list[K]]:
    """`sizes`' keys split over `world` processes: largest first (ties in the mapping's order), each to the least
    loaded process (ties: the one holding fewest keys, so empty units spread too, then the lowest rank). The same
    mapping gives the same split in every process."""
    keys = list(sizes)
    order = sorted(range(len(keys)), key=lambda i: (-sizes[keys[i]], i))
    loads = [(0, 0, rank) for rank in range(world)]  # (bytes, keys, rank)
    shares: list[list[K]] = [[] for _ in range(world)]
    for i in order:
        load, count, rank = heapq.heappop(loads)
        shares[rank].append(keys[i])
        heapq.heappush(loads, (load + sizes[keys[i]], count + 1, rank))
    return shares


def share(team: Team, sizes: Mapping[K, int]) -> set[K]:
    """The keys of `sizes` (units of work and their bytes) that this process handles."""
    if team.world == 1:
        return set(sizes)
    return set(balance(sizes, team.world)[team.rank])
