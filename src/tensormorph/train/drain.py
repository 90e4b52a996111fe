"""The object-store tier: committed disk checkpoints copied to an object store by a thread of their own.

Training never waits for it: a save hands the drain the committed local folder and goes on. Only the newest
checkpoint handed over and not yet copied is kept waiting (a slow store skips steps rather than falling
behind), and a failed copy is kept as `errors` and warned about, never raised into training. Each copy is
committed on the object store by its manifest's PUT (tmformat/transfer.py), and the store's own retention
keeps its `keep` newest. Rank 0 alone copies, from the shared disk.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..tmformat.transfer import copy_checkpoint
from .manager import CheckpointManager

__all__ = ["Drain", "Drained"]


@dataclass(frozen=True)
class Drained:
    step: int
    seconds: float  # from the hand-over to the copy's commit


class Drain:
    """Copies committed checkpoints from the local disk to `url` in the background, newest first."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None, keep: int | None) -> None:
        self.manager = CheckpointManager(url, keep, storage_options)
        self.storage_options = storage_options
        self.drained: list[Drained] = []
        self.errors: list[str] = []
        self._pending: tuple[int, Path, float] | None = None
        self._condition = threading.Condition()
        self._busy = False
        self._copying: Path | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tensormorph-drain", daemon=True)
        self._thread.start()

    def submit(self, step: int, folder: Path) -> None:
        """Copy the committed checkpoint in `folder` (of `step`) when the thread is free; replaces one waiting."""
        with self._condition:
            self._pending = (step, folder, time.perf_counter())
            self._condition.notify_all()

    def in_use(self) -> set[str]:
        """The local folders waiting to be copied or being copied: retention must leave them."""
        with self._condition:
            return {str(p) for p in (self._pending[1] if self._pending else None, self._copying) if p is not None}

    def wait(self) -> None:
        """Block until everything handed over is copied (or failed)."""
        with self._condition:
            self._condition.wait_for(lambda: (self._pending is None and not self._busy) or not self._thread.is_alive(),
                                     timeout=None)

    def close(self) -> None:
        self.wait()
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join()

    def _run(self) -> None:
        swept = False  # what killed uploads left is swept once, after the first copy (training's come first)
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    break
                (step, folder, handed), self._pending = self._pending, None
                self._busy, self._copying = True, folder
            try:
                copy_checkpoint(folder, str(self.manager.path(step)), self.storage_options)
                self.manager.retain()
                self.drained.append(Drained(step, time.perf_counter() - handed))
            except Exception as exc:  # the disk tier still holds the step; training goes on, the error is kept
                self.errors.append(f"step {step}: {exc}")
                warnings.warn(f"copying the checkpoint of step {step} to {self.manager.root} failed: {exc}",
                              stacklevel=1)
            finally:
                if not swept:
                    swept = self._sweep()
                with self._condition:
                    self._busy, self._copying = False, None
                    self._condition.notify_all()
        if not swept:
            self._sweep()

    def _sweep(self) -> bool:
        """Delete what uploads killed before their commit left on the store. Only this thread copies there, and
        it is between copies: anything uncommitted is a dead upload's."""
        try:
            self.manager.sweep_uploads()
        except Exception as exc:  # garbage left is no failure of training
            warnings.warn(f"could not sweep unfinished uploads under {self.manager.root}: {exc}", stacklevel=1)
        return True
