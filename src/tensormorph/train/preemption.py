"""Preemption: a signal becomes a stop request that every rank learns at the same step boundary.

The handler only sets a flag (a signal handler must do no I/O and no collectives); `stop_requested`
turns the flags of all ranks into one answer. DataLoader workers are guarded so that a signal sent to
every process of the machine does not kill them before the last save.
"""

from __future__ import annotations

import signal
from typing import Any

from torch.utils.data import DataLoader

from ..distributed.collective import Collective
from . import workers

__all__ = ["Preemption"]


class Preemption:
    """The signals that request a stop, and whether one was requested (on `control`'s ranks)."""

    def __init__(self, control: Collective) -> None:
        self._control = control
        self._signals: tuple[int, ...] = ()
        self._signalled = False
        self.stopping = False  # a stop was requested, and every rank learnt it

    def save_on_signal(self, *signals: int) -> None:
        self._signals = tuple(signals or (signal.SIGTERM,))
        for sig in self._signals:
            signal.signal(sig, self._on_signal)

    def guard_workers(self, dataloader: Any) -> None:
        """Make the DataLoader's workers ignore the stop signals (they exit with the training process)."""
        if self._signals and isinstance(dataloader, DataLoader):
            workers.guard(dataloader, self._signals)

    def stop_requested(self) -> bool:
        """Whether any rank was signalled (collective)."""
        self.stopping = self._control.any_rank(self._signalled or self.stopping)
        return self.stopping

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signalled = True
