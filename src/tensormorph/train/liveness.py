"""Whether a training run is alive: every process of a Checkpointer that saved or resumed holds a shared lock.

Rollback must not run while training goes on (it would abandon checkpoints a live run is still writing after).
Memory-tier locks say so only for runs with a memory tier, on this machine. This lock covers every local run:
each process holds a shared flock on `RUN/.tensormorph-live` from its first save or resume until `close()` (or
its exit, when the kernel drops it), and `run_is_alive` asks for the exclusive lock without waiting. flock works
across the machines of an NFSv4 mount too. A process forked while it holds the lock (a DataLoader worker) closes
its copy, so only the training processes count.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import CheckpointError
from ..storage import closed_in_children

LIVE_FILE = ".tensormorph-live"

_HELD: set[int] = set()  # the run locks this process holds: children it forks close their copies
closed_in_children(_HELD)


def _open(root: Path, *, create: bool) -> int | None:
    """The lock file's descriptor: made new if asked (O_EXCL), else the one there; never through a link (O_NOFOLLOW
    refuses one planted at its name); None when it is absent."""
    path, flags = root / LIVE_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                return _regular(os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), root)
        return _regular(os.open(path, flags), root)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a link planted at its name (ELOOP), a folder, no permission
        raise CheckpointError(f"cannot use the run's liveness lock {LIVE_FILE}: {exc.strerror or exc}",
                              file=str(path)) from None


def _regular(descriptor: int, root: Path) -> int:
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise CheckpointError(f"the run's liveness lock {LIVE_FILE} is not a regular file", file=str(root / LIVE_FILE))
    return descriptor


class LiveLock:
    """This process's shared lock on a local run: held until `release()`."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        descriptor = _open(root, create=True)
        assert descriptor is not None
        fcntl.flock(descriptor, fcntl.LOCK_SH)  # waits only while a rollback holds it exclusively
        _HELD.add(descriptor)
        self._descriptor: int | None = descriptor

    def release(self) -> None:
        if self._descriptor is not None:
            _HELD.discard(self._descriptor)
            os.close(self._descriptor)
            self._descriptor = None


@contextlib.contextmanager
def quiet_run(root: Path) -> Iterator[None]:
    """Hold the run exclusively while the block runs (no Checkpointer can save or resume meanwhile); a
    CheckpointError when a process of the run holds its lock."""
    descriptor = _open(root, create=root.is_dir())
    if descriptor is None:
        yield
        return
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError("a process of the run is alive (its Checkpointer holds the run's lock); stop the "
                                  "run before rolling it back", file=str(root)) from None
        yield
    finally:
        os.close(descriptor)
