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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, overload
from urllib.parse import quote

from ..errors import HeaderError, MissingFileError, TruncatedFileError, UnsafePathError, UnsupportedError
from ..extras import require_for_url
from ..geometry import coalesce
from .first_read import first_read
from .local import parse_json
from .retry import MAX_ATTEMPTS, is_passing, status_of, with_retries

Run = tuple[int, int]

COALESCE_GAP = 64 * 1024  # runs closer than this may share a request: a request costs more than a small gap ...
COALESCE_SLACK = 0.05  # ... as long as all the gaps fetched add at most this share of the bytes needed
MAX_CONCURRENT_REQUESTS = 32  # ranged requests in flight at once, per read
HEAD_BLOCK = 4096  # small reads of a lazily parsed file (a zip directory) fetch and keep aligned blocks this big
HEAD_BLOCKS_KEPT = 256  # ... up to this many blocks per file (1 MiB)
FIRST_READ = 64 * 1024  # a file's header is read with its first this many bytes: one request for most headers
HEADS_KEPT_BYTES = 32 * 1024**2  # first reads kept (least recently used dropped first): 512 files' at most
PREFETCH_WINDOW = 256  # files whose first reads are asked for at once, so what is kept stays under the cap
HTTP_PROTOCOLS = ("http", "https")
CONNECT_TIMEOUT_S = 30  # a connection not made in this long fails (and is retried)
READ_TIMEOUT_S = 60  # a response that sends nothing for this long fails (and is retried)


def is_url(path: str | os.PathLike[str]) -> bool:
    return "://" in os.fspath(path) and not os.fspath(path).startswith("file://")


def local_path(path: str | os.PathLike[str]) -> Path:
    """A local path, given plainly or as a file:// URL."""
    return Path(os.fspath(path).removeprefix("file://"))


def _with_timeouts(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with connect and read timeouts where the user set none: a stalled server fails the request (then
    retried) instead of holding it for the client's default of minutes."""
    if protocol in HTTP_PROTOCOLS and "timeout" not in options.get("client_kwargs", {}):
        import aiohttp  # fsspec's HTTP client

        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
        return {**options, "client_kwargs": {**options.get("client_kwargs", {}), "timeout": timeout}}
    if protocol in ("s3", "s3a") and "config_kwargs" not in options:
        return {**options, "config_kwargs": {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S}}
    return options


@dataclass
class Remote:
    """What every store and path of one remote checkpoint shares: the file system client, what is known of each
    object (size, version) and the range cache."""

    fs: Any
    protocol: str
    cache: Any = None  # a RangeCache, or None to read straight from the server
    infos: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    # the first FIRST_READ bytes of files, by URL: detection, headers and indexes read them once
    heads: OrderedDict[str, bytes] = field(default_factory=OrderedDict)
    listed: set[str] = field(default_factory=set)  # folder URLs listed whole: what is not in `infos` is absent
    folders: set[str] = field(default_factory=set)  # folder URLs seen in listings
    head_bytes: int = 0  # the bytes `heads` holds
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def for_url(cls, url: str, storage_options: dict[str, Any] | None = None, cache: Any = None) -> Remote:
        fsspec = require_for_url(url, feature=f"reading {url}")
        protocol = url.split("://", 1)[0].lower()
        try:
            fs, _ = fsspec.core.url_to_fs(url, **_with_timeouts(protocol, storage_options or {}))
        except (ValueError, ImportError) as exc:  # an unknown protocol, or one whose package is missing
            raise UnsupportedError(f"cannot open this URL: {exc}", file=url) from None
        return cls(fs, protocol, cache)

    @property
    def is_http(self) -> bool:
        return self.protocol in HTTP_PROTOCOLS

    @property
    def attempts(self) -> int:
        """Tries per request: fsspec's HTTP client never retries; object-store clients (botocore, gcsfs) retry
        passing failures themselves, so one more try of ours covers what they give up on, without multiplying."""
        return MAX_ATTEMPTS if self.is_http else 2

    def keep_head(self, url: str, data: bytes) -> None:
        """Keep a file's first bytes, or all of a small one (HEADS_KEPT_BYTES in all, least recently used dropped
        first)."""
        with self.lock:
            kept = self.heads.get(url)
            if kept is None or len(kept) < len(data):  # a longer first read replaces a shorter one
                self.heads[url] = data
                self.head_bytes += len(data) - (len(kept) if kept is not None else 0)
            while self.head_bytes > HEADS_KEPT_BYTES and len(self.heads) > 1:
                self.head_bytes -= len(self.heads.popitem(last=False)[1])

    def forget(self, prefix: str) -> None:
        """Drop what is known of the objects under URL `prefix` (sizes, versions, first bytes, the client's listing
        cache): for what changes while we watch, such as a training run's checkpoints."""
        with self.lock:
            for url in [u for u in self.infos if u.startswith(prefix)]:
                del self.infos[url]
            for url in [u for u in self.heads if u.startswith(prefix)]:
                self.head_bytes -= len(self.heads.pop(url))
            self.listed -= {u for u in self.listed if u.startswith(prefix)}
            self.folders -= {u for u in self.folders if u.startswith(prefix)}
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate(self.path(prefix))

    def path(self, url: str) -> str:
        """What the fs calls the object at `url` (object stores drop the scheme; HTTP keeps the URL)."""
        return str(self.fs._strip_protocol(url))  # fsspec's own spelling (memory:// keeps a leading "/")

    def info(self, url: str, *, first: bool = True) -> dict[str, Any] | None:
        """The object's size and version (None when there is no object there), asked once per URL. With `first`
        (and a client that can), its first bytes come in the same request and are kept."""
        if url in self.infos:
            return self.infos[url]
        if url.rpartition("/")[0] in self.listed:
            return None  # its folder was listed whole, and it was not there

        def ask() -> dict[str, Any] | None:
            # with a range cache, the bytes come through it (keyed by the version a HEAD gives first)
            wanted = first and self.cache is None
            found_first = first_read(self.fs, self.protocol, self.path(url), FIRST_READ) if wanted else False
            if found_first is None:
                return None
            if found_first is not False:  # the size and version came with the first bytes: no HEAD needed
                body, info = found_first
                self.keep_head(url, body)
                return info
            try:
                found = self.fs.info(self.path(url))
            except FileNotFoundError as exc:
                # fsspec's HTTP client reports every failed HEAD as FileNotFoundError: only a 404 (or 410) is one
                cause = exc.__cause__
                if cause is not None and (status_of(cause) not in (None, 404, 410) or is_passing(cause)
                                          or "Redirect" in type(cause).__name__):
                    raise cause from None
                return None
            if found.get("type", "file") != "file":
                return None
            if found.get("size") is None:
                raise UnsupportedError("the server does not say how large the object is (no Content-Length); "
                                       "ranged reads need its size", file=url)
            return found

        found = with_retries(ask, url, attempts=self.attempts)
        with self.lock:
            self.infos[url] = found
        return found


def _version(info: dict[str, Any]) -> str:
    # object stores give an ETag; other fsspec file systems a modification or creation time
    return str(next((info[k] for k in ("ETag", "etag", "mtime", "LastModified", "Last-Modified", "created")
                     if info.get(k)), ""))


class RemoteFiles:
    """Read-only files under a URL prefix, read in coalesced, concurrent ranged requests."""

    mappable = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, remote: Remote | None = None,
                 cache: Any = None):
        self.url = url.rstrip("/")
        self.remote = remote or Remote.for_url(self.url, storage_options, cache)
        self.header_bytes_read = 0
        self._blocks: dict[str, OrderedDict[int, bytes]] = {}
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
        return self._url(name), int(info["size"]), _version(info)

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
        path = self.remote.path(url)
        try:
            entries = with_retries(lambda: self.fs.ls(path, detail=True), url, attempts=self.remote.attempts)
        except MissingFileError:
            raise MissingFileError("is no folder (no objects under this prefix)", file=url) from None
        if [str(e["name"]).rstrip("/") for e in entries] == [path] and entries[0].get("type") == "file":
            with self.remote.lock:
                self.remote.infos[url] = entries[0]
            raise MissingFileError("is a file, not a folder", file=url)
        names = []
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
            names.append(base)
        with self.remote.lock:
            self.remote.listed.add(url)
        return sorted(set(names))

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
        """Ask for many files' sizes (and, with `head`, first bytes) at once, MAX_CONCURRENT_REQUESTS in flight:
        opening a checkpoint of many files then costs about two round trips per file, overlapped. Give at most
        PREFETCH_WINDOW names at a time for first bytes (see `prefetched`), so that they stay kept until read."""

        def one(name: str) -> None:
            info = self.remote.info(self._url(name), first=bool(head))
            if info is not None and head:
                self._first(name, int(info["size"]))

        with ThreadPoolExecutor(MAX_CONCURRENT_REQUESTS) as pool:
            list(pool.map(one, dict.fromkeys(names)))

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
        version = _version(self._info(name))
        if self.remote.cache is not None and version:  # without a version a changed object could not be told
            from .range_cache import ObjectKey  # the cache module is optional at run time: only used when set

            # the cache asks for its missing ranges already merged (within its own gap budget): fetched as they are
            return list(self.remote.cache.read(ObjectKey(url, size, version), list(runs),
                                               lambda missing: self._fetch(url, missing, merge=False)))
        return self._fetch(url, runs)

    def _fetch(self, url: str, runs: Sequence[Run], *, merge: bool = True) -> builtins.list[bytes]:
        """Each run's bytes, from the server: one request per coalesced range (`merge=False`: per run, overlapping
        ones joined), MAX_CONCURRENT_REQUESTS at once; a range that fails is retried alone."""
        requests = coalesce(runs, COALESCE_GAP if merge else 0, COALESCE_SLACK)
        if not requests:
            return [b"" for _ in runs]
        path = self.remote.path(url)
        parts: list[Any] = with_retries(
            lambda: self.fs.cat_ranges([path] * len(requests), [b for b, _ in requests], [e for _, e in requests],
                                       on_error="return", batch_size=MAX_CONCURRENT_REQUESTS),
            url, attempts=self.remote.attempts)
        def one(begin: int, end: int) -> bytes:
            return bytes(self.fs.cat_file(path, start=begin, end=end))

        for k, ((begin, end), part) in enumerate(zip(requests, parts)):
            if isinstance(part, BaseException):
                parts[k] = with_retries(partial(one, begin, end), url, attempts=self.remote.attempts, failed=part)
            if len(parts[k]) != end - begin:
                raise TruncatedFileError(f"asked for bytes [{begin}, {end}), the server sent {len(parts[k])} bytes",
                                         file=url)
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

    def block(self, name: str, index: int) -> bytes:
        """Aligned block `index` (HEAD_BLOCK bytes) of a file, kept for the small reads of a lazy parse."""
        with self._blocks_lock:  # the viewer reads one store from several threads
            kept = self._blocks.setdefault(name, OrderedDict())
            data = kept.get(index)
            if data is not None:
                kept.move_to_end(index)
                return data
        begin = index * HEAD_BLOCK
        data = self.read(name, begin, min(HEAD_BLOCK, self.size(name) - begin))
        with self._blocks_lock:
            kept[index] = data
            while len(kept) > HEAD_BLOCKS_KEPT:
                kept.popitem(last=False)
        return data


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
        data = b"".join(self.files.block(self.name, k) for k in range(first, last + 1))
        return data[begin - first * HEAD_BLOCK:end - first * HEAD_BLOCK]
