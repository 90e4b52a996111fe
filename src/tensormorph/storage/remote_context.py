"""What every store and path of one remote checkpoint shares: the fsspec client, what is known of each object
(size, version, first bytes, listings) and the range cache, with the one place that asks a server for an object's
size and version (or takes it from the cache's records of them, known_versions.py)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import CheckpointError, UnsupportedError
from ..extras import require_for_url
from .first_read import first_read
from .obstore_ranges import obstore_ranges
from .retry import MAX_ATTEMPTS, is_passing, status_of, with_retries

MAX_CONCURRENT_REQUESTS = 32  # ranged requests in flight at once, per read
FIRST_READ = 64 * 1024  # a file's header is read with its first this many bytes: one request for most headers
HEADS_KEPT_BYTES = 32 * 1024**2  # first reads kept (least recently used dropped first): 512 files' at most
HTTP_PROTOCOLS = ("http", "https")
CONNECT_TIMEOUT_S = 30  # a connection not made in this long fails (and is retried)
READ_TIMEOUT_S = 60  # a response that sends nothing for this long fails (and is retried)


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


_no_requests = threading.local()  # `no_requests` in force in this thread


class WouldAsk(Exception):
    """A request was about to be made within `no_requests()`."""


@contextmanager
def no_requests() -> Iterator[None]:
    """Within it, this thread answers from what is known and cached, and raises WouldAsk where it would ask the
    server instead: work served locally is done at once, and only the rest goes to a pool of threads (which, for
    what needs no request, would only contend for the GIL: a 1,000-file open from the cache took 1.0 s through the
    pool, 0.6 s inline)."""
    before = getattr(_no_requests, "on", False)
    _no_requests.on = True
    try:
        yield
    finally:
        _no_requests.on = before


def may_ask() -> None:
    """Called before every request: raises WouldAsk within `no_requests()`."""
    if getattr(_no_requests, "on", False):
        raise WouldAsk


@dataclass
class Remote:
    """What every store and path of one remote checkpoint shares: the file system client, what is known of each
    object (size, version) and the range cache. The client is fsspec's, which keeps one instance per process for
    each protocol and options (unless `skip_instance_cache`): later opens reuse its connections and sessions."""

    make_fs: Callable[[], Any]  # builds `fs` at its first use: a reopening answered from the cache needs none
    fs_class: Any  # its class, which names objects (`path`) without an instance
    protocol: str
    cache: Any = None  # a RangeCache, or None to read straight from the server
    fast: Any = None  # an ObstoreRanges where obstore can fetch this store's ranges (obstore_ranges.py), else None
    infos: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    # the first FIRST_READ bytes of files, by URL: detection, headers and indexes read them once
    heads: OrderedDict[str, bytes] = field(default_factory=OrderedDict)
    listed: set[str] = field(default_factory=set)  # folder URLs listed whole: what is not in `infos` is absent
    listings: dict[str, list[str]] = field(default_factory=dict)  # the names in each folder listed, by URL
    folders: set[str] = field(default_factory=set)  # folder URLs seen in listings
    head_bytes: int = 0  # the bytes `heads` holds
    # URLs whose info came from the cache's version records, not yet confirmed by the server in this process
    unconfirmed: set[str] = field(default_factory=set)
    untrusted: set[str] = field(default_factory=set)  # URL prefixes `forget` was called for: always asked afresh
    lock: threading.Lock = field(default_factory=threading.Lock)
    _fs: Any = None
    _fs_lock: threading.Lock = field(default_factory=threading.Lock)  # making a client may ask for credentials

    @property
    def fs(self) -> Any:
        """fsspec's client: made at first use (a new one, with `skip_instance_cache`, costs a millisecond)."""
        if self._fs is None:
            with self._fs_lock:
                if self._fs is None:
                    self._fs = self.make_fs()
        return self._fs

    @classmethod
    def for_url(cls, url: str, storage_options: dict[str, Any] | None = None, cache: Any = None) -> Remote:
        fsspec = require_for_url(url, feature=f"reading {url}")
        protocol = url.split("://", 1)[0].lower()
        options = _with_timeouts(protocol, storage_options or {})

        def make_fs() -> Any:
            try:
                return fsspec.core.url_to_fs(url, **options)[0]
            except (ValueError, ImportError) as exc:  # an unknown protocol, or one whose package is missing
                raise UnsupportedError(f"cannot open this URL: {exc}", file=url) from None

        try:
            fs_class = fsspec.get_filesystem_class(protocol)
        except (ValueError, ImportError) as exc:
            raise UnsupportedError(f"cannot open this URL: {exc}", file=url) from None
        return cls(make_fs, fs_class, protocol, cache, fast=obstore_ranges(protocol, options, MAX_CONCURRENT_REQUESTS))

    @property
    def fast_metadata(self) -> Any:
        """The obstore client for first reads and listings while s3fs's own client is not built yet (a new process:
        building it costs a fifth of a second of CPU); None once it is, in this open or an earlier one (fsspec
        reuses it across opens), so that one open asks through one client."""
        if self.fast is None or not self.fast.usable() or getattr(self.fs, "_s3", None) is not None:
            return None
        return self.fast

    def from_client_cache(self, folder_path: str) -> bool:
        """Whether fsspec's client may answer about folder `folder_path` (its own spelling) from its listing cache,
        which never expires by itself: what it says then is not recorded as just checked (known_versions.py)."""
        return self._fs is not None and folder_path.rstrip("/") in getattr(self._fs, "dircache", {})

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
            for url in [u for u in self.listings if u.startswith(prefix)]:
                del self.listings[url]
            self.folders -= {u for u in self.folders if u.startswith(prefix)}
            self.unconfirmed -= {u for u in self.unconfirmed if u.startswith(prefix)}
            self.untrusted.add(prefix)
        # the client fsspec shares across opens may hold listings from an earlier open, so it is made here if need be
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate(self.path(prefix))
        # invalidate_cache drops the listings of a folder and its parents, not of the folders under it
        folder = self.path(prefix).rstrip("/")
        listings = getattr(self.fs, "dircache", {})
        for key in [k for k in listings if k == folder or k.startswith(f"{folder}/")]:
            listings.pop(key, None)

    def path(self, url: str) -> str:
        """What the fs calls the object at `url` (object stores drop the scheme; HTTP keeps the URL)."""
        return str(self.fs_class._strip_protocol(url))  # fsspec's own spelling (memory:// keeps a leading "/")

    def info(self, url: str, *, first: bool = True) -> dict[str, Any] | None:
        """The object's size and version (None when there is no object there), asked once per URL, or taken from
        the range cache's record of it where that is trusted (known_versions.py). With `first` (and a client that
        can), its first bytes come in the same request and are kept (and cached)."""
        if url in self.infos:
            return self.infos[url]
        if url.rpartition("/")[0] in self.listed:
            return None  # its folder was listed whole, and it was not there
        versions = self.cache.versions if self.cache is not None else None
        if versions is not None and not any(url.startswith(prefix) for prefix in self.untrusted):
            known = versions.trusted(url, lambda: self.recorded_listing(url) is not None)
            if known is not None:
                with self.lock:
                    self.infos[url] = known.info
                    if not known.immutable:
                        self.unconfirmed.add(url)
                return known.info
        # with a cache that holds a record of this URL, its first bytes are likely cached: a HEAD asks the version
        recorded = versions is not None and versions.lookup(url) is not None

        def ask() -> dict[str, Any] | None:
            found_first = first_read(self.fs, self.protocol, self.path(url), FIRST_READ, self.fast_metadata) \
                if first and not recorded else False
            if found_first is None:
                return None
            if found_first is False:  # no first bytes in the same request: a HEAD for the size and version
                return self._head(url)
            body, info = found_first  # the size and version came with the first bytes: no HEAD needed
            self.keep_head(url, body)
            version = version_of(info)
            if self.cache is not None and version:
                from .range_cache import ObjectKey  # only with a cache

                self.cache.read(ObjectKey(url, int(info["size"]), version), [(0, len(body))],
                                lambda missing: [body[begin:end] for begin, end in missing])
            return info

        may_ask()
        unasked = self.from_client_cache(self.path(url).rpartition("/")[0])  # s3fs may answer from its listings
        found = with_retries(ask, url, attempts=self.attempts)
        if versions is not None and not unasked:
            versions.remember(url, found, version_of(found) if found is not None else "")
        with self.lock:
            self.infos[url] = found
        return found

    def recorded_listing(self, url: str) -> list[str] | None:
        """The names in folder `url` from the range cache's listing record of it, where that is trusted (see
        known_versions.py), taken in as if listed now (its objects to be confirmed before their bytes are fetched);
        None where there is no such record."""
        if url in self.listings:
            return self.listings[url]
        if self.cache is None or self.is_http or any(url.startswith(prefix) for prefix in self.untrusted):
            return None  # (HTTP has no listing: a record of one was planted)
        listing = self.cache.versions.listing(url)
        if listing is None:
            return None
        with self.lock:
            for name, info in listing.files.items():
                if f"{url}/{name}" not in self.infos:  # what this open learnt already is newer
                    self.infos[f"{url}/{name}"] = info
                    self.unconfirmed.add(f"{url}/{name}")
            self.folders.update(f"{url}/{name}" for name in listing.folders)
            self.listed.add(url)
            self.listings[url] = sorted({*listing.files, *listing.folders})
        return self.listings[url]

    def remember_listing(self, url: str, entries: list[dict[str, Any]], names: list[str]) -> None:
        """Record the listing of folder `url` just made (fsspec-style `entries`, `names` their base names), for
        the next process to trust for a while (known_versions.py)."""
        if self.cache is None:
            return
        files, folders = {}, []
        for entry, name in zip(entries, names):
            if entry.get("type") == "directory":
                folders.append(name)
            elif entry.get("size") is not None:
                files[name] = (int(entry["size"]), version_of(entry))
        self.cache.versions.remember_listing(url, files, folders)

    def _head(self, url: str) -> dict[str, Any] | None:
        """The object's fsspec info from a HEAD (None when there is none): through obstore while s3fs's client is
        not built (see `fast_metadata`), else fsspec."""
        fast = self.fast_metadata
        found_fast: dict[str, Any] | None | Literal[False] = fast.head(self.path(url)) if fast is not None else False
        if found_fast is not False:
            return found_fast
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
        return dict(found)

    def confirm(self, url: str, size: int, version: str) -> None:
        """Before fetching bytes of an object whose version came from the cache's records unasked: check with the
        server that it is still that version, so the bytes fetched are of the version the checkpoint was opened
        at (and cached under it). A changed object is an error: what was parsed from it no longer holds."""
        if url not in self.unconfirmed:
            return
        may_ask()
        found = with_retries(lambda: self._head(url), url, attempts=self.attempts)
        now = (int(found["size"]), version_of(found)) if found is not None else None
        assert self.cache is not None  # only cached infos are unconfirmed
        if now != (size, version):
            self.cache.versions.forget(url)
            with self.lock:
                self.infos.pop(url, None)
                self.unconfirmed.discard(url)
            said = "is gone" if now is None else f"is now version {now[1]!r} of {now[0]} bytes"
            raise CheckpointError(f"changed on the server since it was opened from the cache (version {version!r} "
                                  f"of {size} bytes {said}); open it again", file=url)
        self.cache.versions.remember(url, found, version)
        with self.lock:
            self.unconfirmed.discard(url)


def version_of(info: dict[str, Any]) -> str:
    # object stores give an ETag; other fsspec file systems a modification or creation time
    return str(next((info[k] for k in ("ETag", "etag", "mtime", "LastModified", "Last-Modified", "created")
                     if info.get(k)), ""))
