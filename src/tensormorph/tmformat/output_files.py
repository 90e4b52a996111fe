"""The files a save writes in its own folder: written with writeback started as they go, and shared ones that
several ranks write parts of at once."""

from __future__ import annotations

import ctypes
import io
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..storage import NEW_FILE_FLAGS


class EarlyWriteback(io.RawIOBase):
    """A write-only file that asks the kernel to start writing back every WRITEBACK_PIECE bytes.

    Linux starts background writeback only when dirty pages pass a share of RAM, so a save smaller
    than that would sit in the page cache until the final fsync and then wait for the whole disk
    write. Starting writeback as we go lets the disk work while the rest is written, and fsync waits
    only for the tail. sync_file_range(WRITE) does this and keeps the pages cached (parity is computed
    from them next); where it is unavailable, posix_fadvise(DONTNEED) starts writeback too.
    """

    def __init__(self, path: Path):
        super().__init__()
        self._fd = os.open(path, NEW_FILE_FLAGS, 0o644)
        self._position = self._flushed = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        self._position += done
        if self._position - self._flushed >= WRITEBACK_PIECE:
            _start_writeback(self._fd, self._flushed, self._position - self._flushed)
            self._flushed = self._position
        return done

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


class SharedOutput:
    """A file of the save's own folder that several ranks write at once, each its own byte ranges (pwrite), with
    writeback started as it goes (as EarlyWriteback). Whichever rank comes first creates it: never through a
    link (O_NOFOLLOW), and a file found there that is not a plain file of one name is refused."""

    def __init__(self, path: Path):
        # O_NONBLOCK: a FIFO planted at the name fails at once (ENXIO) instead of blocking; plain files ignore it
        self._fd = os.open(path, (NEW_FILE_FLAGS & ~os.O_EXCL) | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        self._path = path
        self._unflushed: list[tuple[int, int]] = []
        try:
            found = os.fstat(self._fd)
            if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
                raise CheckpointError("is not a plain file of this save (a link or another kind of file was "
                                      "there before it)", file=str(path))
        except BaseException:
            os.close(self._fd)
            raise

    def write_at(self, offset: int, data: bytes | bytearray) -> None:
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        self._unflushed.append((offset, len(view)))
        if sum(length for _, length in self._unflushed) >= WRITEBACK_PIECE:
            for begin, length in self._unflushed:
                _start_writeback(self._fd, begin, length)
            self._unflushed.clear()

    def finish(self) -> None:
        os.fsync(self._fd)  # also what other ranks wrote by then: harmless, each syncs before it reports

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _sync_file_range() -> Any:
    function = getattr(LIBC, "sync_file_range", None) if LIBC is not None else None
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


LIBC = _libc()
_SYNC_FILE_RANGE = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2  # from <fcntl.h>: start writeback of the range's dirty pages, do not wait


def _start_writeback(fd: int, offset: int, length: int) -> None:
    if _SYNC_FILE_RANGE is not None and _SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE) == 0:
        return
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


WRITEBACK_PIECE = 64 * 1024**2
