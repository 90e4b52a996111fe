"""DataLoader workers that outlive a preemption signal.

A preempted machine signals every process, DataLoader workers included. torch's
workers install a SIGTERM handler that kills them (unless the signal comes from
their parent), and the training process then fails at its next batch. Guarded,
a worker starts with the preemption signals blocked (held, not lost), its
`worker_init_fn` ignores them and unblocks them, and it lives until the training
process shuts it down or is gone. Starting blocked matters: a signal between
the worker's start and its `worker_init_fn` would otherwise still kill it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context as mpc
import signal
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["guard"]

_SIGNALS: set[int] = set()  # every signal a Checkpointer turned into a save request, process-wide like handlers


@contextlib.contextmanager
def _blocked() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# a process inherits the signal mask of the thread that starts it, through fork and exec alike

class _ForkProcess(mpc.ForkProcess):
    def start(self) -> None:
        with _blocked():
            super().start()


class _SpawnProcess(mpc.SpawnProcess):
    def start(self) -> None:
        with _blocked():
            super().start()


class _ForkServerProcess(mpc.ForkServerProcess):
    def start(self) -> None:
        with _blocked():
            super().start()


class _ForkContext(mpc.ForkContext):
    Process = _ForkProcess


class _SpawnContext(mpc.SpawnContext):
    Process = _SpawnProcess


class _ForkServerContext(mpc.ForkServerContext):
    Process = _ForkServerProcess


_CONTEXTS = {"fork": _ForkContext, "spawn": _SpawnContext, "forkserver": _ForkServerContext}


class _IgnoreSignals:
    """A DataLoader `worker_init_fn`: ignore the preemption signals, unblock them, then run the loader's own.
    A class at module level, so that loaders whose workers are spawned can pickle it."""

    def __init__(self, signals: tuple[int, ...], inner: Callable[[int], None] | None):
        self.signals, self.inner = signals, inner

    def __call__(self, worker_id: int) -> None:
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)  # one held since the start is dropped now
        if self.inner is not None:
            self.inner(worker_id)


def guard(loader: Any, signals: tuple[int, ...]) -> None:
    """Make the workers `loader` starts from now on survive `signals` (a torch DataLoader with workers)."""
    _SIGNALS.update(signals)
    init = loader.worker_init_fn
    if not isinstance(init, _IgnoreSignals):
        loader.worker_init_fn = _IgnoreSignals(signals, init)
    context = loader.multiprocessing_context
    if loader.num_workers > 0 and not isinstance(context, tuple(_CONTEXTS.values())):
        if context is not None:
            method = context.get_start_method()
        else:
            method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
        if method in _CONTEXTS:
            loader.multiprocessing_context = _CONTEXTS[method]()
