"""A local on-disk cache of exact byte ranges of remote objects, bounded in size and shared safely by processes.

Layout: `RangeCache(folder)` keeps everything in `folder/ranges-v1/`, flat, one entry per object version:

    <h>.data               the object's bytes at their own offsets, in a sparse file: only cached ranges use disk
    <h>.index              the pieces of <h>.data that hold the object's bytes, each with its crc32c (format below)
    <h>.lock               flock'ed: shared to read the entry, exclusive to change or remove it; its mtime is the
                           entry's last use, for least-recently-used eviction
    <h>.index.<random>.tmp an index being written; renamed over <h>.index to publish it
    <v>.version            what was last learnt of one URL's size and version, or of a folder's listing, and
                           when (known_versions.py): its own entry, evicted with the others, least recently
                           written first

<h> is the sha256 of the key (URL, size, version), so no file name comes from a URL, and a changed object (another
ETag or mtime, another size) is another entry. Pieces are sorted, disjoint, and never cross a multiple of
CRC_BLOCK of the object, so checking a small cached read costs at most a block of disk reads; pieces of one block
are merged as they are written. Index file: b"TMRANGE1", the piece count n (u64), n begins (i64), n ends (i64),
n crc32c (u32), and the crc32c of all that (u32); all little-endian.

Protocol: a read takes the shared lock, serves what the index holds (every piece checked against its crc32c) and
lets go; it fetches what is missing without a lock; then, under the exclusive lock, it reloads the index, writes
the new bytes into the data file and only then publishes the new index (a new file, then os.replace). A piece that
fails its check (a damaged or truncated file) drops the whole entry and its bytes are fetched again. Files are
created with O_CREAT|O_EXCL|O_NOFOLLOW and opened with O_NOFOLLOW: a link planted in the folder is removed, never
followed. Eviction takes each victim's lock without waiting (one in use is skipped: it is being used), so it never
unlinks files a reader is between; it unlinks the index first, so a crash leaves data without an index, never an
index without its data. A lock file unlinked while a process waited for it is noticed (another inode) and retaken.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
import struct
import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import crc32c
import numpy as np

from ..errors import CheckpointError, MissingFileError, TruncatedFileError, UnsafePathError
from ..geometry import coalesce
from .known_versions import SUFFIX as VERSION_SUFFIX
from .known_versions import KnownVersions, default_revalidate_after_s
from .local import NEW_FILE_FLAGS, create_new, open_regular, read_capped, replace_file

DEFAULT_MAX_BYTES = 10 * 1024**3  # room for the headers of many checkpoints and the regions a viewer looks at
CRC_BLOCK = 64 * 1024  # pieces never cross a multiple of this: checking a cached read costs at most this per piece
MAX_PIECES = 1 << 18  # pieces in one entry (20 bytes each in its index: 5 MiB); ranges beyond it are not cached
FETCH_GAP = 4096  # missing ranges closer than this may be fetched as one: a request costs more than such a gap...
GAP_SHARE = 16  # ...but the gaps fetched never add more than 1/GAP_SHARE of the missing bytes (transferred ≤ 1.0625×)
SCAN_SHARE = 64  # a process rescans the folder after storing this share of max_bytes, whatever it last saw there
LOCK_ATTEMPTS = 100  # a lock file replaced this many times while we wait for it: someone is tampering with the folder

_LAYOUT = "ranges-v1"
_MAGIC = b"TMRANGE1"
_HEAD = struct.Struct("<8sQ")
_CRC = struct.Struct("<I")

Run = tuple[int, int]  # [begin, end) byte offsets in one object


@dataclass(frozen=True)
class ObjectKey:
    """One version of a remote object: another version (ETag, or mtime) or size is another cache entry."""

    url: str
    size: int
    version: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps([self.url, self.size, self.version]).encode()).hexdigest()


@dataclass
class CacheStats:
    hits_bytes: int = 0  # requested bytes served from the cache
    fetched_bytes: int = 0  # bytes asked of `fetch`, merged gaps included
    fetches: int = 0  # calls of `fetch`


@dataclass
class _Pieces:
    """An entry's index: sorted, disjoint [begin, end) pieces and the crc32c of each."""

    begins: list[int]
    ends: list[int]
    crcs: list[int]


def default_cache_folder() -> Path:
    """$TENSORMORPH_CACHE, else $XDG_CACHE_HOME/tensormorph, else ~/.cache/tensormorph."""
    if os.environ.get("TENSORMORPH_CACHE"):
        return Path(os.environ["TENSORMORPH_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tensormorph"


class RangeCache:
    """Exact byte ranges of remote objects, cached on disk (see the module docstring for the layout)."""

    def __init__(self, folder: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, *,
                 revalidate_after_s: float | None = None):
        """`revalidate_after_s`: how long a mutable URL's cached version is trusted without asking (None:
        $TENSORMORPH_REVALIDATE_S, else known_versions.REVALIDATE_AFTER_S)."""
        self.folder = Path(folder)
        self.dir = self.folder / _LAYOUT
        self.max_bytes = max_bytes
        self.versions = KnownVersions(self.dir, default_revalidate_after_s() if revalidate_after_s is None
                                      else revalidate_after_s)
        # bytes stored since the folder was last scanned, over what it held then: eviction scans the folder when the
        # two together could pass max_bytes, or when this process stored 1/SCAN_SHARE of it since (other processes
        # sharing the folder add to it unseen), not after every miss
        self._held_at_scan: int | None = None
        self._stored_since_scan = 0
        self.stats = CacheStats()
        self._stats_lock = threading.Lock()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            is_link = stat.S_ISLNK(os.lstat(self.dir).st_mode)
        except OSError as exc:
            raise CheckpointError(f"cannot create the cache folder: {exc.strerror}", file=str(self.dir)) from None
        if is_link:
            raise UnsafePathError("is a link; the cache does not follow links", file=str(self.dir))

    def read(self, key: ObjectKey, runs: Sequence[Run], fetch: Callable[[list[Run]], list[bytes]]) -> list[bytes]:
        """The bytes of each [begin, end) run of the object. What the cache lacks is fetched in one call of
        `fetch` (given sorted, disjoint ranges; it returns their bytes), stored, and the rest read from disk."""
        runs = [(int(begin), int(end)) for begin, end in runs]
        for begin, end in runs:
            if not 0 <= begin <= end <= key.size:
                raise TruncatedFileError(f"bytes [{begin}, {end}) were asked of an object of {key.size} bytes",
                                         file=key.url)
        name = key.digest()
        if key.size > self.max_bytes:  # it could fill the cache alone: read it past the cache
            parts: list[list[memoryview | Run]] = _all_missing(runs)
            corrupt = False
        else:
            lock = self._lock(name, fcntl.LOCK_SH)
            try:
                now = time.time_ns()
                os.utime(lock, ns=(now, now))
                parts, corrupt = self._serve(name, key, runs)
            finally:
                os.close(lock)
        missing = [part for run_parts in parts for part in run_parts if isinstance(part, tuple)]
        starts: list[int] = []
        views: list[memoryview] = []
        if missing:
            # missing ranges joined across the smallest gaps of at most FETCH_GAP bytes, while the gaps fetched
            # stay within 1/GAP_SHARE of the missing bytes
            wanted = coalesce(missing, FETCH_GAP, 1 / GAP_SHARE)
            fetched = fetch(wanted)
            _check_fetched(key, wanted, fetched)
            with self._stats_lock:
                self.stats.fetches += 1
                self.stats.fetched_bytes += sum(len(data) for data in fetched)
            starts, views = [begin for begin, _ in wanted], [memoryview(data) for data in fetched]
            if key.size <= self.max_bytes:
                self._store(name, key, list(zip(starts, views)), corrupt)
                self._stored_since_scan += sum(len(v) for v in views)
                if (self._held_at_scan is None or self._held_at_scan + self._stored_since_scan > self.max_bytes
                        or self._stored_since_scan * SCAN_SHARE >= self.max_bytes):
                    self._evict()

        def resolved(part: memoryview | Run) -> memoryview:
            if not isinstance(part, tuple):
                return part
            j = bisect_right(starts, part[0]) - 1  # the fetched range that holds this missing part
            return views[j][part[0] - starts[j]:part[1] - starts[j]]

        return [b"".join([resolved(part) for part in run_parts]) for run_parts in parts]

    def held_bytes(self) -> int:
        """Disk space the cache's files take (allocated blocks, so sparse holes do not count)."""
        return sum(held for held, _, _ in self._scan().values())

    def clear(self) -> None:
        """Remove every entry (waiting for its readers and writers)."""
        for name, (_, _, files) in self._scan().items():
            if _is_version_record(files):
                self._remove(name, files)
                continue
            lock = self._lock(name, fcntl.LOCK_EX)
            try:
                self._remove(name, files)
            finally:
                os.close(lock)

    def _path(self, name: str, kind: str) -> Path:
        return self.dir / f"{name}.{kind}"

    def _serve(self, name: str, key: ObjectKey, runs: list[Run]) -> tuple[list[list[memoryview | Run]], bool]:
        """Each run as its parts in order: the cached bytes, and a (begin, end) for each range to fetch. When a
        piece fails its check, the whole entry counts as missing (True: it is dropped when the new bytes come)."""
        pieces = self._load(name, key)
        if pieces is None or not pieces.begins:
            return _all_missing(runs), pieces is None
        try:
            fd = open_regular(self._path(name, "data"), follow=False)
        except CheckpointError:  # missing, a link, not a file: the index describes nothing real
            return _all_missing(runs), True
        checked: dict[int, memoryview] = {}
        parts: list[list[memoryview | Run]] = []
        hits = 0
        try:
            for begin, end in runs:
                run_parts: list[memoryview | Run] = []
                position = begin
                for k in range(bisect_right(pieces.ends, begin), bisect_left(pieces.begins, end)):
                    if k not in checked:
                        data = _read_checked(fd, pieces, k)
                        if data is None:
                            return _all_missing(runs), True
                        checked[k] = memoryview(data)
                    piece_begin, piece_end = pieces.begins[k], pieces.ends[k]
                    low, high = piece_begin if piece_begin > position else position, min(piece_end, end)
                    if low > position:
                        run_parts.append((position, low))
                    run_parts.append(checked[k][low - piece_begin:high - piece_begin])
                    hits += high - low
                    position = high
                if position < end:
                    run_parts.append((position, end))
                parts.append(run_parts)
        finally:
            os.close(fd)
        with self._stats_lock:
            self.stats.hits_bytes += hits
        return parts, False

    def _store(self, name: str, key: ObjectKey, ranges: list[tuple[int, memoryview]], corrupt: bool) -> None:
        """Write fetched bytes into the entry and publish its new index, under the entry's exclusive lock."""
        lock = self._lock(name, fcntl.LOCK_EX)
        try:
            pieces = None if corrupt else self._load(name, key)
            data = self._open_data(name, fresh=pieces is None or not pieces.begins)
            merged = None if pieces is None else _merge(data.fileno(), pieces, ranges)
            if merged is None:  # damaged: the entry starts again
                data.close()
                _unlink(self._path(name, "index"))
                data = self._open_data(name, fresh=True)
                merged = _merge(data.fileno(), _Pieces([], [], []), ranges)
                assert merged is not None  # an empty entry has nothing to check
            with data:
                held = sum(merged.ends) - sum(merged.begins)
                if len(merged.begins) > MAX_PIECES or held > self.max_bytes:
                    return  # too scattered or too big to cache: the bytes were served, they are just not kept
                for begin, view in ranges:
                    _pwrite_all(data.fileno(), view, begin)
            self._publish(name, merged)
        finally:
            os.close(lock)

    def _load(self, name: str, key: ObjectKey) -> _Pieces | None:
        """The entry's index: empty when there is none, None when it is damaged (or not a regular file)."""
        path = self._path(name, "index")
        cap = _HEAD.size + 20 * MAX_PIECES + _CRC.size
        try:
            fd = open_regular(path, follow=False)
        except MissingFileError:
            return _Pieces([], [], []) if not os.path.lexists(path) else None
        except CheckpointError:
            return None
        try:
            raw = read_capped(fd, cap)
        finally:
            os.close(fd)
        if raw is None or len(raw) < _HEAD.size + _CRC.size:
            return None
        magic, count = _HEAD.unpack_from(raw)
        body = _HEAD.size + 20 * count
        if magic != _MAGIC or len(raw) != body + _CRC.size or _CRC.unpack_from(raw, body)[0] != crc32c.crc32c(
                memoryview(raw)[:body]):
            return None
        begins = np.frombuffer(raw, "<i8", count, _HEAD.size)
        ends = np.frombuffer(raw, "<i8", count, _HEAD.size + 8 * count)
        crcs = np.frombuffer(raw, "<u4", count, _HEAD.size + 16 * count)
        valid = count == 0 or bool(begins[0] >= 0 and ends[-1] <= key.size and (ends > begins).all()
                                   and (begins[1:] >= ends[:-1]).all()
                                   and (begins // CRC_BLOCK == (ends - 1) // CRC_BLOCK).all())
        return _Pieces(begins.tolist(), ends.tolist(), crcs.tolist()) if valid else None

    def _publish(self, name: str, pieces: _Pieces) -> None:
        count = len(pieces.begins)
        body = b"".join([_HEAD.pack(_MAGIC, count), np.asarray(pieces.begins, "<i8").tobytes(),
                         np.asarray(pieces.ends, "<i8").tobytes(), np.asarray(pieces.crcs, "<u4").tobytes()])
        replace_file(self._path(name, "index"), body + _CRC.pack(crc32c.crc32c(body)))

    def _open_data(self, name: str, *, fresh: bool) -> BinaryIO:
        """The entry's data file for reading and writing; a new, empty one when `fresh` or when what is there is
        not a regular file (a planted link is removed, not followed)."""
        path = self._path(name, "data")
        if not fresh:
            with contextlib.suppress(OSError):  # missing, or a link (ELOOP): made anew below
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    return os.fdopen(fd, "r+b")
                os.close(fd)
        _unlink(path)
        # read and write: a store checks the pieces the index lists against it, even in a file just made (when
        # another process removed the data under an index, the check finds them missing and the entry restarts)
        return os.fdopen(os.open(path, (NEW_FILE_FLAGS & ~os.O_WRONLY) | os.O_RDWR, 0o644), "r+b")

    def _lock(self, name: str, mode: int) -> int:
        """A descriptor of the entry's lock file, flock'ed in `mode` (BlockingIOError for a busy LOCK_NB)."""
        path = self._path(name, "lock")
        for _ in range(LOCK_ATTEMPTS):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    create_new(path).close()
                continue
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                _unlink(path)  # a planted link
                continue
            try:
                fcntl.flock(fd, mode)
                held = os.fstat(fd)
                with contextlib.suppress(FileNotFoundError):
                    now = os.lstat(path)
                    if stat.S_ISREG(held.st_mode) and (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev):
                        fd, locked = -1, fd
                        return locked
                if not stat.S_ISREG(held.st_mode):
                    _unlink(path)
                # else: the entry was removed while we waited for its lock; lock the new one
            finally:
                if fd >= 0:
                    os.close(fd)
        raise CheckpointError(f"the lock file was replaced {LOCK_ATTEMPTS} times while waiting for it",
                              file=str(path))

    def _scan(self) -> dict[str, tuple[int, int, list[str]]]:
        """Each entry's (disk space, last use in ns, file names), from one pass over the folder."""
        entries: dict[str, tuple[int, int, list[str]]] = {}
        for item in os.scandir(self.dir):
            name, _, kind = item.name.partition(".")
            if len(name) != 64:
                continue
            with contextlib.suppress(FileNotFoundError):
                st = item.stat(follow_symlinks=False)
                held, used, files = entries.get(name, (0, 0, []))
                files.append(item.name)
                last_use = kind == "lock" or kind == VERSION_SUFFIX  # a record's last use is its last write
                entries[name] = (held + st.st_blocks * 512, st.st_mtime_ns if last_use else used, files)
        return entries

    def _evict(self) -> None:
        """Remove the least recently used entries until the cache holds at most max_bytes."""
        entries = self._scan()
        total = sum(held for held, _, _ in entries.values())
        self._stored_since_scan = 0
        self._held_at_scan = total  # other processes may add to it meanwhile: the next scan sees their bytes
        for name, (held, _, files) in sorted(entries.items(), key=lambda item: (item[1][1], item[0])):
            if total <= self.max_bytes:
                self._held_at_scan = total
                return
            if _is_version_record(files):  # replaced by rename, never locked: unlinked as it is
                self._remove(name, files)
                total -= held
                continue
            try:
                lock = self._lock(name, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use by a reader or a writer right now
            try:
                self._remove(name, files)
            finally:
                os.close(lock)
            total -= held
        self._held_at_scan = total

    def _remove(self, name: str, files: list[str]) -> None:
        """Unlink an entry's files, the index before the data; its lock file last, while the caller holds it."""
        order = {"index": 0, "data": 1, "lock": 3}
        for file in sorted(files, key=lambda file: order.get(file.partition(".")[2], 2)):
            _unlink(self.dir / file)


def _is_version_record(files: list[str]) -> bool:
    """Whether an entry's files are a URL's version record (and perhaps one being written), not cached bytes."""
    return all(file.partition(".")[2].startswith(VERSION_SUFFIX) for file in files)


def _read_checked(fd: int, pieces: _Pieces, k: int) -> bytes | None:
    """Piece k's bytes from the data file, or None when they are short or fail their crc32c."""
    begin, end = pieces.begins[k], pieces.ends[k]
    data = os.pread(fd, end - begin, begin)
    return data if len(data) == end - begin and crc32c.crc32c(data) == pieces.crcs[k] else None


def _merge(fd: int, pieces: _Pieces, ranges: list[tuple[int, memoryview]]) -> _Pieces | None:
    """The index once `ranges` (begin, bytes) are added: the pieces of each block they touch are remade from the
    cached pieces there (checked: None when one fails) and the new bytes. Costs O(pieces log pieces)."""
    new: dict[int, list[tuple[int, memoryview]]] = {}
    for begin, view in ranges:
        position, end = begin, begin + len(view)
        while position < end:
            stop = min((position // CRC_BLOCK + 1) * CRC_BLOCK, end)
            new.setdefault(position // CRC_BLOCK, []).append((position, view[position - begin:stop - begin]))
            position = stop
    keep = np.ones(len(pieces.begins), bool)
    begins, ends, crcs = [], [], []
    for block, segments in new.items():
        first = bisect_left(pieces.begins, block * CRC_BLOCK)
        last = bisect_left(pieces.begins, (block + 1) * CRC_BLOCK)
        keep[first:last] = False
        spans = [(pieces.begins[k], pieces.ends[k]) for k in range(first, last)]
        spans += [(begin, begin + len(view)) for begin, view in segments]
        low = min(begin for begin, _ in spans)
        buffer = bytearray(max(end for _, end in spans) - low)
        for k in range(first, last):
            data = _read_checked(fd, pieces, k)
            if data is None:
                return None
            buffer[pieces.begins[k] - low:pieces.ends[k] - low] = data
        for begin, view in segments:
            buffer[begin - low:begin - low + len(view)] = view
        for begin, end in _union(spans):
            begins.append(begin)
            ends.append(end)
            crcs.append(crc32c.crc32c(memoryview(buffer)[begin - low:end - low]))

    def joined(old: list[int], added: list[int]) -> np.ndarray:
        return np.concatenate([np.asarray(old, np.int64)[keep], np.asarray(added, np.int64)])

    order = np.argsort(joined(pieces.begins, begins))
    return _Pieces(*(joined(old, added)[order].tolist()
                     for old, added in ((pieces.begins, begins), (pieces.ends, ends), (pieces.crcs, crcs))))


def _all_missing(runs: list[Run]) -> list[list[memoryview | Run]]:
    return [[run] if run[1] > run[0] else [] for run in runs]


def _union(runs: list[Run]) -> list[Run]:
    """Sorted, disjoint runs covering the same bytes (touching runs joined)."""
    merged: list[Run] = []
    for begin, end in sorted(runs):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def _check_fetched(key: ObjectKey, wanted: list[Run], fetched: list[bytes]) -> None:
    if len(fetched) != len(wanted):
        raise TruncatedFileError(f"asked for {len(wanted)} ranges, got {len(fetched)}", file=key.url)
    for (begin, end), data in zip(wanted, fetched):
        if len(data) != end - begin:
            raise TruncatedFileError(f"expected {end - begin} bytes at offset {begin}, got {len(data)}", file=key.url)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # removes a link itself, never what it points to
