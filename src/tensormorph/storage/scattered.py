"""Many pieces of one file read at once: threads over pread, each piece straight into its target.

A region of a large tensor is often many short runs far apart (1,024 rows of 4 KiB, 128 KiB apart, for a
1024x1024 block of a 32768-wide fp32 tensor). Read one after another from a cold disk, each waits for the one
before; queued together, a cloud volume or an NVMe drive serves them in parallel. The descriptor is told to
read no further than asked (POSIX_FADV_RANDOM), so the bytes read stay those of the pieces, rounded to pages.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

READERS = 16
"""Threads reading the pieces of one call: enough requests in flight for a cloud volume or an NVMe drive, whose
latency per request far exceeds the time to issue one."""

MIN_PIECES = 16
"""Fewer pieces than this are read one after another: starting the others costs more than it saves."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    # a forked child has none of its parent's threads, and the lock may have been held by one of them
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _readers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READERS, thread_name_prefix="tensormorph-pread")
        return _pool


def _gaps(pieces: Sequence[tuple[int, memoryview]]) -> int:
    """How many places the pieces, in file order, leave bytes unread between them."""
    spans = sorted((offset, offset + len(target)) for offset, target in pieces)
    return sum(1 for (_, end), (begin, _) in zip(spans, spans[1:]) if begin != end)


def read_pieces(fd: int, pieces: Sequence[tuple[int, memoryview]],
                read_one: Callable[[int, int, memoryview], None]) -> None:
    """Fill each (offset, target) piece with `read_one(fd, offset, target)`: at once when there are many, then
    one after another. Returns once every piece is read; raises the first error after all have stopped."""
    if len(pieces) < MIN_PIECES or _gaps(pieces) < MIN_PIECES:  # few, or one sequential stretch: readahead serves it
        for offset, target in pieces:
            read_one(fd, offset, target)
        return
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead around each piece: only their pages

    def read_share(share: Sequence[tuple[int, memoryview]]) -> None:
        for offset, target in share:
            read_one(fd, offset, target)

    shares = [pieces[i::READERS] for i in range(min(READERS, len(pieces)))]
    futures = [_readers().submit(read_share, share) for share in shares]
    wait(futures)  # every reader has stopped before the caller closes the descriptor
    for future in futures:
        future.result()
