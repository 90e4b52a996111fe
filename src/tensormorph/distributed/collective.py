"""Collective steps on a torch.distributed group, or in one process when none is initialised.

The rule every caller relies on: no rank is ever left waiting in a collective. A step that runs on one rank
(or on every rank) is caught whole, and its outcome, value or error message, is carried to every rank,
which then all raise together or all go on together (the shape of DCP's `_DistWrapper`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..storage import RemotePath

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """What one rank's step gave: its value, or the message of the exception it raised."""

    rank: int
    value: T | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> T:
        assert self.error is None, self.error
        return self.value  # type: ignore[return-value]  # a successful step's value, None only if it returned None


def failures(outcomes: Sequence[Outcome[Any]]) -> list[str]:
    return [o.error for o in outcomes if o.error is not None]


class Collective:
    """One process group (the default one when `group` is None), or a single process."""

    def __init__(self, group: Any = None):
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1

    def run(self, step: Callable[[], T], *, label: str = "") -> Outcome[T]:
        """This rank's outcome of `step`; an exception becomes its message, prefixed with `label`."""
        try:
            return Outcome(self.rank, step())
        except Exception as exc:  # carried to the other ranks, which must not wait for this one forever
            return Outcome(self.rank, error=f"{label}{type(exc).__name__}: {exc}")

    def gather(self, value: T) -> list[T]:
        """Every rank's value, in rank order, on every rank."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def broadcast(self, value: T) -> T:
        """Rank 0's value on every rank."""
        if not self.distributed:
            return value
        box = [value]
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=source, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank: one small all-reduce, cheap enough to ask at every step."""
        if not self.distributed:
            return flag
        vote = torch.tensor([int(flag)])
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self.group)
        return bool(vote.item())

    def decide(self, step: Callable[[], T], failure: str, path: str | os.PathLike[str] | RemotePath) -> T:
        """Rank 0 runs `step`; every rank returns its value, or every rank raises CheckpointError with its error."""
        outcome: Outcome[T] = self.run(step) if self.rank == 0 else Outcome(self.rank)
        shared = self.broadcast(outcome)
        if shared.error is not None:
            raise CheckpointError(f"{failure}: {shared.error}", file=str(path))
        return shared.unwrap()

    def everyone(self, step: Callable[[], T], *, label: str = "") -> list[Outcome[T]]:
        """Every rank runs `step`; every rank gets all the outcomes, failed ones included, in rank order."""
        return self.gather(self.run(step, label=label))
