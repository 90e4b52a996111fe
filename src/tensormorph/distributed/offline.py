"""The processes of a torchrun launch as a `Team` for the offline operations (ops/spread.py): convert, verify and
diff spread over `torchrun --nproc_per_node N` (and `--nnodes` hosts sharing the checkpoint's file system).

The group is gloo on CPU whatever the machine has: only results move between processes (a list of tensor
comparisons, a file's sizes and checksums), never tensor data, which each process reads and writes itself.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch.distributed as dist

from ..errors import CheckpointError
from .collective import Collective, Outcome

T = TypeVar("T")

# how long a process waits in a collective for the others: a share of a multi-terabyte conversion can take hours
# longer on one process than on another, and a process that fails still reaches the collective (to report), so
# this bounds only a process that hangs or dies without torchrun noticing
OFFLINE_TIMEOUT = datetime.timedelta(hours=12)


class ProcessTeam:
    """Every process of a torch.distributed group (the default one when `group` is None)."""

    def __init__(self, group: object = None):
        self.collective = Collective(group)

    @property
    def rank(self) -> int:
        return self.collective.rank

    @property
    def world(self) -> int:
        return self.collective.world

    def each(self, step: Callable[[], T]) -> list[T]:
        """Run `step` here, gather every process's outcome; any failure is raised in every process, naming the
        rank(s) that failed and what they raised (chained to the exception itself in the process that raised)."""
        error: Exception | None = None
        try:
            outcome: Outcome[T] = Outcome(self.rank, step())
        except Exception as exc:  # carried to the others, which must not wait for this process forever
            error = exc
            outcome = Outcome(self.rank, error=f"{type(exc).__name__}: {exc}")
        outcomes = self.collective.gather(outcome)
        failed = [o for o in outcomes if not o.ok]
        if failed:
            message = "; ".join(f"rank {o.rank} of {self.world}: {o.error}" for o in failed)
            raise CheckpointError(message) from error
        return [o.unwrap() for o in outcomes]


@contextmanager
def launched_team() -> Iterator[ProcessTeam]:
    """The team of this torchrun launch: a gloo group made from torchrun's environment (and destroyed after), or
    the default group when the process has one already."""
    if dist.is_initialized():
        yield ProcessTeam()
        return
    dist.init_process_group("gloo", timeout=OFFLINE_TIMEOUT)
    try:
        yield ProcessTeam()
    finally:
        dist.destroy_process_group()
