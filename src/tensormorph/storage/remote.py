"""A checkpoint under a URL: an fsspec prefix (s3://, gs://, az://, memory://, ...) or an HTTP(S) folder.

Reads are ranged requests: the runs a read needs, coalesced across small gaps (never adding more than
COALESCE_SLACK of the bytes needed), fetched concurrently, through the on-disk range cache when one is set.
HTTP has no listing: a checkpoint there is opened by the URL of the file that names the others (see
docs/remote.md). Names a checkpoint gives stay under its own prefix, so an index cannot send us to another host.
"""

from __future__ import annotations

import bisect
import builtins  # `list` names a method of the stores: their annotations say builtins.list
import os
import posixpath
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, overload
from urllib.parse import quote

from ..errors import HeaderError, MissingFileError, TruncatedFileError, UnsafePathError, UnsupportedError
from ..geometry import coalesce
from .local import parse_json
from .remote_context import FIRST_READ, MAX_CONCURRENT_REQUESTS, Remote, WouldAsk, may_ask, no_requests, version_of
from .retry import with_retries

Run = tuple[int, int]

COALESCE_GAP = 64 * 1024  # runs closer than this may share a request: a request costs more than a small gap ...
COALESCE_SLACK = 0.05  # ... as long as all the gaps fetched add at most this share of the bytes needed
PART_BYTES = 8 * 1024**2  # a longer request is fetched as parallel parts this big: one stream runs at one
# connection's pace, several share the link (and a failed part is fetched again alone, not the whole range)
HEAD_BLOCK = 4096  # small reads of a lazily parsed file (a zip directory) fetch and keep aligned blocks this big
HEAD_BLOCKS_KEPT = 256  # ... up to this many blocks per file (1 MiB)
PREFETCH_WINDOW = 256  # files whose first reads are asked for at once, so what is kept stays under the cap
# ... with this many in flight: each asks for a few KiB, so the server's cost per request sets the pace; more in flight
# only queue there (a 1,000-file hub repo at +20 ms: 8 took 5.9 s and 4.4 s of server CPU, 32 took 10-11 s and 8-11 s)
PREFETCH_CONCURRENCY = 8


def is_url(path: str | os.PathLike[str]) -> bool:
    return "://" in os.fspath(path) and not os.fspath(path).startswith("file://")


def local_path(path: str | os.PathLike[str]) -> Path:
    """A local path, given plainly or as a file:// URL."""
    return Path(os.fspath(path).removeprefix("file://"))


class RemoteFiles:
    """Read-only files under a URL prefix, read in coalesced, concurrent ranged requests."""

    mappable = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, remote: Remote | None = None,
                 cache: Any = None):
        self.url = url.rstrip("/")
        self.remote = remote or Remote.for_url(self.url, storage_options, cache)
        self.header_bytes_read = 0
        self._blocks: dict[str, OrderedDict[int, bytes]] = {}
        self._blocks_fetching: dict[tuple[str, int], Future[bytes]] = {}  # a block asked for by two threads: once
        self._blocks_lock = threading.Lock()

    @property
    def fs(self) -> Any:
        return self.remote.fs

    def _url(self, name: str, referrer: str | None = None) -> str:
        """The URL of `name`, which must stay under this store's prefix (on the same host)."""
        parts = name.split("/")
        if (not name or name.startswith("/") or "\\" in name or "\x00" in name or "://" in name
                or ".." in parts or "." in parts or "" in parts[:-1]):
            raise UnsafePathError(f"names file {name!r}, which is outside the checkpoint", file=referrer or self.url)
        # an HTTP client decodes %2e%2e into ".." and reads "?" and "#" as a query and a fragment: quoted, a name
        # is only ever a path below the prefix
        return f"{self.url}/{quote(name, safe='/') if self.remote.is_http else name}"

    def describe(self, name: str, *, referrer: str | None = None) -> str:
        return self._url(name, referrer)

    def _info(self, name: str) -> dict[str, Any]:
        url = self._url(name)
        info = self.remote.info(url)
        if info is None:
            raise MissingFileError("is missing (no such object)", file=url)
        return info

    def fingerprint(self, name: str) -> tuple[str, int, int | str]:
        info = self._info(name)
        return self._url(name), int(info["size"]), version_of(info)

    def exists(self, name: str) -> bool:
        return self.remote.info(self._url(name)) is not None

    def size(self, name: str) -> int:
        return int(self._info(name)["size"])

    def is_dir(self, name: str = "") -> bool:
        """Whether `name` ("" for the root) is a folder: a prefix holding objects. HTTP has no folders to ask about:
        there a URL that is not a file is taken for one, and its files are found by name."""
        url = self._url(name) if name else self.url
        if self.remote.is_http:
            return self.remote.info(url) is None
        if url in self.remote.listed or url in self.remote.folders:
            return True
        if self.remote.infos.get(url) is not None or url.rpartition("/")[0] in self.remote.listed:
            return False  # a file, or no folder of its listed parent
        try:  # listed at once: the one request answers this and every later question about its files
            self.listdir(name)
        except MissingFileError:
            return False
        return True

    def listdir(self, name: str = "") -> builtins.list[str]:
        """The names directly under folder `name` ("" for the root), sorted; their sizes are kept for later."""
        url = self._url(name) if name else self.url
        if self.remote.is_http:
            raise UnsupportedError("HTTP has no listing: open the checkpoint by the URL of its index or metadata "
                                   "file (see docs/remote.md)", file=url)
        known = self.remote.recorded_listing(url)
        if known is not None:  # detection lists a folder once per format it tries (and a new process reuses it)
            return list(known)
        path, fast = self.remote.path(url), self.remote.fast_metadata
        unasked = self.remote.from_client_cache(path)  # an fsspec client's listing, perhaps old: not recorded
        try:  # obstore where it can (no s3fs client to build); s3fs tells an empty listing from a file
            entries = (fast.listing(path) if fast is not None else None) or with_retries(
                lambda: self.fs.ls(path, detail=True), url, attempts=self.remote.attempts)
        except MissingFileError:
            raise MissingFileError("is no folder (no objects under this prefix)", file=url) from None
        if [str(e["name"]).rstrip("/") for e in entries] == [path] and entries[0].get("type") == "file":
            with self.remote.lock:
                self.remote.infos[url] = entries[0]
            raise MissingFileError("is a file, not a folder", file=url)
        kept, bases = [], []
        for entry in entries:
            base = posixpath.basename(str(entry["name"]).rstrip("/"))
            try:
                child = self._url(f"{name}/{base}" if name else base)
            except UnsafePathError:
                continue  # an object no checkpoint could name (a backslash, say) is no file of ours
            with self.remote.lock:
                if entry.get("type") == "file" and entry.get("size") is not None:
                    self.remote.infos[child] = entry  # a listing is as fresh as a HEAD
                elif entry.get("type") == "directory":
                    self.remote.folders.add(child)
            kept.append(entry)
            bases.append(base)
        names = sorted(set(bases))
        with self.remote.lock:
            self.remote.listed.add(url)
            self.remote.listings[url] = names
        if not unasked:
            self.remote.remember_listing(url, kept, bases)
        return list(names)

    def list(self) -> builtins.list[str]:
        if self.remote.is_http:
            raise UnsupportedError("HTTP has no listing: the checkpoint's index names its files", file=self.url)
        prefix = f"{self.remote.path(self.url)}/"
        found = with_retries(lambda: self.fs.find(self.remote.path(self.url)), self.url,
                             attempts=self.remote.attempts)
        return sorted(path[len(prefix):] for path in found if path.startswith(prefix))

    def head(self, name: str, length: int) -> bytes:
        """Up to `length` bytes from the start of file `name`, for detection: b"" when there is none."""
        info = self.remote.info(self._url(name))
        if info is None:
            return b""
        size = int(info["size"])
        if length <= FIRST_READ:
            return self._first(name, size)[:length]
        data = self.read(name, 0, min(length, size)) if size else b""
        if len(data) == size:  # the whole file (an index looked into while detecting): kept for the open to parse
            self.remote.keep_head(self._url(name), data)
        return data

    def _first(self, name: str, size: int) -> bytes:
        """The file's first min(size, FIRST_READ) bytes, fetched once and kept in the shared Remote."""
        url, heads = self._url(name), self.remote.heads
        with self.remote.lock:
            data = heads.get(url)
            if data is not None:
                heads.move_to_end(url)
                return data
        data = self.read_ranges(name, [(0, min(size, FIRST_READ))])[0] if size else b""
        self.remote.keep_head(url, data)
        return data

    def read(self, name: str, offset: int, length: int) -> bytes:
        head = self.remote.heads.get(self._url(name))
        if head is not None and offset + length <= len(head):
            data = head[offset:offset + length]
        else:
            data = self.read_ranges(name, [(offset, offset + length)])[0]
        self.header_bytes_read += length
        return data

    def prefetch(self, names: Sequence[str], head: int = FIRST_READ) -> None:
        """Ask for many files' sizes (and, with `head`, first bytes) at once, PREFETCH_CONCURRENCY in flight:
        opening a checkpoint of many files then costs about two round trips per file, overlapped. Give at most
        PREFETCH_WINDOW names at a time for first bytes (see `prefetched`), so that they stay kept until read."""

        def one(name: str) -> None:
            info = self.remote.info(self._url(name), first=bool(head))
            if info is not None and head:
                self._first(name, int(info["size"]))

        asking = []
        for name in dict.fromkeys(names):  # what is known or cached already is served at once, without threads
            try:
                with no_requests():
                    one(name)
            except WouldAsk:
                asking.append(name)
        if asking:
            with ThreadPoolExecutor(PREFETCH_CONCURRENCY) as pool:
                list(pool.map(one, asking))

    def read_prefixed(self, name: str, max_length: int) -> tuple[int, int, bytes]:
        """(file size, length, the `length` bytes after an 8-byte little-endian length at offset 0), in one
        request when the whole header fits in the first FIRST_READ bytes, else two."""
        size = self.size(name)
        if size < 8:
            return size, -1, b""
        first = self._first(name, size)
        self.header_bytes_read += len(first)
        length = int.from_bytes(first[:8], "little")
        if length > min(max_length, size - 8):
            return size, length, b""
        if 8 + length <= len(first):
            return size, length, first[8:8 + length]
        return size, length, first[8:] + self.read(name, len(first), 8 + length - len(first))

    def read_json(self, name: str, max_bytes: int, what: str = "file") -> Any:
        size = self.size(name)
        if size > max_bytes:
            raise HeaderError(f"{what} is {size} bytes, over the {max_bytes}-byte limit", file=self.describe(name))
        return parse_json(self.read(name, 0, size), what, self.describe(name))

    def read_into(self, name: str, offset: int, target: memoryview) -> None:
        target[:] = self.read_ranges(name, [(offset, offset + len(target))])[0]

    def read_runs(self, name: str, runs: Sequence[Run], target: memoryview) -> None:
        position = 0
        for (begin, end), part in zip(runs, self.read_ranges(name, runs)):
            target[position:position + end - begin] = part
            position += end - begin

    def read_ranges(self, name: str, runs: Sequence[Run]) -> builtins.list[bytes]:
        """The bytes of each [begin, end) range of one file: coalesced requests, fetched concurrently."""
        if not runs:
            return []
        url = self._url(name)
        size = self.size(name)
        for begin, end in runs:
            if not 0 <= begin <= end <= size:
                raise TruncatedFileError(f"expected bytes [{begin}, {end}), but the object holds {size}", file=url)
        version = version_of(self._info(name))
        if self.remote.cache is not None and version:  # without a version a changed object could not be told
            from .range_cache import ObjectKey  # the cache module is optional at run time: only used when set

            # the cache asks for its missing ranges already merged (within its own gap budget): fetched as they are
            def fetch(missing: builtins.list[Run]) -> builtins.list[bytes]:
                self.remote.confirm(url, size, version)
                return self._fetch(url, missing, merge=False)

            return list(self.remote.cache.read(ObjectKey(url, size, version), list(runs), fetch))
        return self._fetch(url, runs)

    def _fetch(self, url: str, runs: Sequence[Run], *, merge: bool = True) -> builtins.list[bytes]:
        """Each run's bytes, from the server: one request per coalesced range (`merge=False`: per run, overlapping
        ones joined), a long one split into parts of PART_BYTES, MAX_CONCURRENT_REQUESTS at once (through obstore
        where the store has it, else fsspec); a request that fails is retried alone, through fsspec."""
        may_ask()
        requests = coalesce(runs, COALESCE_GAP if merge else 0, COALESCE_SLACK)
        if not requests:
            return [b"" for _ in runs]
        pieces = [(p, min(p + PART_BYTES, end)) for begin, end in requests for p in range(begin, end, PART_BYTES)]
        path, fast = self.remote.path(url), self.remote.fast
        got: list[Any] = fast.fetch(path, pieces) if fast is not None and fast.usable() else with_retries(
            lambda: self.fs.cat_ranges([path] * len(pieces), [b for b, _ in pieces], [e for _, e in pieces],
                                       on_error="return", batch_size=MAX_CONCURRENT_REQUESTS),
            url, attempts=self.remote.attempts)

        def one(begin: int, end: int) -> bytes:
            return bytes(self.fs.cat_file(path, start=begin, end=end))

        for k, ((begin, end), part) in enumerate(zip(pieces, got)):
            if isinstance(part, BaseException):
                got[k] = with_retries(partial(one, begin, end), url, attempts=self.remote.attempts, failed=part)
            if len(got[k]) != end - begin:
                raise TruncatedFileError(f"asked for bytes [{begin}, {end}), the server sent {len(got[k])} bytes",
                                         file=url)
        parts: list[bytes] = []
        position = 0
        for begin, end in requests:
            count = -(-(end - begin) // PART_BYTES)
            parts.append(got[position] if count == 1 else b"".join(got[position:position + count]))
            position += count
        starts = [b for b, _ in requests]
        out = []
        for begin, end in runs:
            k = bisect.bisect_right(starts, begin) - 1
            first = requests[k][0]
            out.append(bytes(parts[k][begin - first:end - first]) if end > begin else b"")
        return out

    def buffer(self, name: str) -> RangedBuffer:
        """The file as a lazily fetched buffer: slicing it fetches the bytes (small reads in cached blocks)."""
        return RangedBuffer(self, name, self.size(name))

    def advise(self, name: str, runs: builtins.list[Run], advice: str) -> None:
        return None  # nothing is mapped: reads fetch exactly their runs

    def close(self) -> None:
        with self._blocks_lock:
            self._blocks.clear()

    def blocks(self, name: str, indexes: Sequence[int]) -> builtins.list[bytes]:
        """Aligned blocks of a file (HEAD_BLOCK bytes each), kept for the small reads of a lazy parse: those not kept
        are asked for at once (concurrent requests), each once when several threads want it (the viewer, a diff)."""
        mine: dict[int, Future[bytes]] = {}
        found: dict[int, bytes | Future[bytes]] = {}
        with self._blocks_lock:
            kept = self._blocks.setdefault(name, OrderedDict())
            for k in dict.fromkeys(indexes):
                if k in kept:
                    kept.move_to_end(k)
                    found[k] = kept[k]
                elif (name, k) in self._blocks_fetching:
                    found[k] = self._blocks_fetching[(name, k)]  # another thread's request for it
                else:
                    found[k] = mine[k] = self._blocks_fetching[(name, k)] = Future()
        if mine:
            try:  # (a block within the file's first read is there already)
                size, head = self.size(name), self.remote.heads.get(self._url(name)) or b""
                runs = [(k * HEAD_BLOCK, min((k + 1) * HEAD_BLOCK, size)) for k in mine]
                asked = iter(self.read_ranges(name, [r for r in runs if r[1] > len(head)]))
                got = [head[b:e] if e <= len(head) else next(asked) for b, e in runs]
            except BaseException as exc:
                with self._blocks_lock:
                    for k in mine:
                        del self._blocks_fetching[(name, k)]
                for future in mine.values():
                    future.set_exception(exc)
                raise
            self.header_bytes_read += sum(e - b for b, e in runs)
            with self._blocks_lock:
                for k, data in zip(mine, got):
                    kept[k] = data
                    del self._blocks_fetching[(name, k)]
                while len(kept) > HEAD_BLOCKS_KEPT:
                    kept.popitem(last=False)
            for future, data in zip(mine.values(), got):
                future.set_result(data)
        return [d if isinstance(d, bytes) else d.result() for d in (found[k] for k in indexes)]


class RangedBuffer:
    """A remote file (or a window of one) that parsers index and slice like a memoryview; only the slices asked
    for are fetched, small ones in blocks kept by the store."""

    def __init__(self, files: RemoteFiles, name: str, size: int, base: int = 0):
        self.files, self.name, self.size, self.base = files, name, size, base

    def __len__(self) -> int:
        return self.size

    def view(self, begin: int, end: int) -> RangedBuffer:
        """The window [begin, end) of this buffer, fetched as lazily (memoryview slicing does the same locally)."""
        begin, end = max(0, min(begin, self.size)), max(0, min(end, self.size))
        return RangedBuffer(self.files, self.name, max(0, end - begin), self.base + begin)

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> bytes: ...

    def __getitem__(self, key: int | slice) -> int | bytes:
        if isinstance(key, int):
            position = key + self.size if key < 0 else key
            if not 0 <= position < self.size:
                raise IndexError("index out of range")
            return self[position:position + 1][0]
        begin, end, step = key.indices(self.size)
        if step != 1:
            raise ValueError("a remote file is sliced with step 1 only")
        if end <= begin:
            return b""
        begin, end = begin + self.base, end + self.base
        if end - begin >= HEAD_BLOCK:
            return self.files.read(self.name, begin, end - begin)
        first, last = begin // HEAD_BLOCK, (end - 1) // HEAD_BLOCK
        data = b"".join(self.files.blocks(self.name, range(first, last + 1)))
        return data[begin - first * HEAD_BLOCK:end - first * HEAD_BLOCK]
