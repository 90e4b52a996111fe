"""The viewer's cache of exact tiles: a memory LRU and a disk LRU, each bounded by bytes; and the compression
of tiles for the wire (Content-Encoding negotiated from Accept-Encoding).

Keys name the request and the identity of the files read (path, size, mtime), so a rewritten checkpoint
gets new tiles. The disk folder (by default ~/.cache/tensormorph/tiles) is shared by every viewer a user
runs: each process counts what it found there and what it wrote since, and when that count passes the cap
it lists the folder again and deletes the least recently used files (a hit refreshes a file's mtime)
until the folder is under DISK_CACHE_SLACK of the cap. A cache that cannot be read or written only makes
the viewer slower: its errors never reach a request.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import threading
from collections import OrderedDict
from pathlib import Path

import zstandard

from .errors import CheckpointError
from .storage import read_small, replace_file

DISK_CACHE_BYTES = 256 * 1024**2  # default cap of the disk cache folder (`view --cache-size`)
MEMORY_CACHE_BYTES = 64 * 1024**2  # tiles one viewer keeps in memory
DISK_CACHE_SLACK = 0.75  # eviction goes down to this share of the cap, so that few writes list the folder
ZSTD_LEVEL = 1  # ~700 MB/s on float tiles, within a few % of the ratio of higher levels
GZIP_LEVEL = 1  # gzip is ~15x slower than zstd at any level; browsers on http:// accept only gzip
# a tile is sent compressed only when that keeps at most this share of its bytes: gzip must save more to pay for
# its time (fp32 weights save ~10%, bf16 values ~50%, shuffled ~60%)
WORTH_COMPRESSING = {"zstd": 0.95, "gzip": 0.8}
PROBE_BYTES = 256 * 1024  # a larger tile is judged on this much of it before it is compressed whole
PROBE_PIECES = 16  # ... taken in pieces spread over it: a shuffled tile's byte planes differ


def negotiate(accept_encoding: str | None) -> str | None:
    """The encoding to answer in: zstd when accepted, else gzip, else None (identity)."""
    accepted = set()
    for part in (accept_encoding or "").lower().split(","):
        name, _, params = part.strip().partition(";")
        quality = params.strip().removeprefix("q=")
        if name and not (params and quality.replace(".", "", 1).isdigit() and float(quality) == 0):
            accepted.add(name.strip())
    for encoding in ("zstd", "gzip"):
        if encoding in accepted or "*" in accepted:
            return encoding
    return None


def compress(data: bytes, encoding: str | None) -> tuple[bytes, str | None]:
    """(body, Content-Encoding): `data` in `encoding`, or as it is when that would not save enough."""
    if encoding is None:
        return data, None
    worth = WORTH_COMPRESSING[encoding]
    if len(data) > 2 * PROBE_BYTES:
        piece, stride = PROBE_BYTES // PROBE_PIECES, len(data) // PROBE_PIECES
        sample = b"".join(data[k * stride:k * stride + piece] for k in range(PROBE_PIECES))
        if len(_pack(sample, encoding)) > len(sample) * worth:
            return data, None
    packed = _pack(data, encoding)
    return (packed, encoding) if len(packed) <= len(data) * worth else (data, None)


def _pack(data: bytes, encoding: str) -> bytes:
    if encoding == "zstd":
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
    return gzip.compress(data, GZIP_LEVEL, mtime=0)


class TileCache:
    """Encoded tiles by key: in memory, then in `folder` (None: memory only)."""

    def __init__(self, folder: Path | None, *, disk_bytes: int = DISK_CACHE_BYTES,
                 memory_bytes: int = MEMORY_CACHE_BYTES):
        self.folder = folder
        self.disk_bytes = disk_bytes
        self.memory_bytes = memory_bytes
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._held = 0  # bytes in _memory
        self._disk_used: int | None = None  # unknown until the folder is first listed
        self._lock = threading.Lock()
        self._evicting = threading.Lock()

    @property
    def memory_used(self) -> int:
        return self._held

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._memory.get(key)
            if data is not None:
                self._memory.move_to_end(key)
        path = self._path(key)
        if path is None:
            return data
        try:
            if data is None:
                # never a FIFO or device planted in the cache folder, never unbounded
                data = read_small(path, self.disk_bytes)
                if data is None:
                    return None
                self._remember(key, data)
            os.utime(path)  # the mtime is the recency the disk eviction goes by, also for tiles served from memory
        except (OSError, CheckpointError):  # evicted from disk, never written there, or not a file
            pass
        return data

    def put(self, key: str, data: bytes) -> None:
        self._remember(key, data)
        path = self._path(key)
        if path is None or len(data) > self.disk_bytes * DISK_CACHE_SLACK:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(path, data)
        except OSError:  # a full or read-only disk: the tile stays in memory only
            return
        with self._lock:
            over = self._disk_used is None or self._disk_used + len(data) > self.disk_bytes
            if self._disk_used is not None:
                self._disk_used += len(data)
        if over:
            self.evict()

    def evict(self) -> None:
        """List the folder and delete the least recently used files until it is under the slack share of the cap."""
        if self.folder is None:
            return
        with self._evicting:
            entries = sorted(_cache_files(self.folder))
            total = sum(size for _, size, _ in entries)
            target = self.disk_bytes * DISK_CACHE_SLACK if total > self.disk_bytes else total
            for _, size, path in entries:
                if total <= target:
                    break
                with contextlib.suppress(FileNotFoundError):  # another viewer deleted it first
                    os.unlink(path)
                total -= size
            with self._lock:
                self._disk_used = total

    def _path(self, key: str) -> Path | None:
        return self.folder / key[:2] / key if self.folder is not None else None

    def _remember(self, key: str, data: bytes) -> None:
        if len(data) > self.memory_bytes:
            return
        with self._lock:
            previous = self._memory.pop(key, None)
            self._held -= len(previous) if previous is not None else 0
            self._memory[key] = data
            self._held += len(data)
            while self._held > self.memory_bytes:
                _, dropped = self._memory.popitem(last=False)
                self._held -= len(dropped)


def _cache_files(folder: Path) -> list[tuple[int, int, str]]:
    """(mtime in ns, size, path) of every regular file in the folder's subfolders; links are not followed."""
    found = []
    try:
        groups = [entry.path for entry in os.scandir(folder) if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    for group in groups:
        with contextlib.suppress(OSError):
            for entry in os.scandir(group):
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        stat = entry.stat(follow_symlinks=False)
                        found.append((stat.st_mtime_ns, stat.st_size, entry.path))
    return found
