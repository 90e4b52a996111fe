"""What the range cache last learnt of each remote object's size and version, so that a second open within a short
time (or of a revision that cannot change) makes no request at all.

A record per URL, `<cache>/ranges-v1/<sha256("version", url)>.version`, holds JSON {"url", "size", "version",
"checked"} (or {"url", "missing": true, "checked"}), written to a new file then renamed over the old one, so a
reader sees a whole record or none. Its mtime is its last write: the range cache's eviction counts and removes
records with its entries, least recently written first.

Trust, with a record at hand:
  * a hub URL at a commit (`https://host/<repo>/resolve/<40 hex digits>/<file>`) names bytes that never change:
    its record is trusted for ever, a missing file's too;
  * any other URL's record is trusted for `revalidate_after_s` (REVALIDATE_AFTER_S, or $TENSORMORPH_REVALIDATE_S)
    after it was checked; later the object's version is asked again, and its cached bytes serve if it is the same.
A record trusted without asking is confirmed with the server before any byte of that object is fetched (the store
does so): bytes of a newer version are never cached under an older one, and a checkpoint opened from cached
headers never reads data of another version.

A folder's listing has its own record, `<sha256("listing", url)>.version`: {"url", "checked", "files": [[name,
size, version], ...], "folders": [name, ...]}. It is trusted for `revalidate_after_s` like an object's, whole:
a name it lacks is taken as absent, as fsspec's own listing cache takes it within one process (there for good).
A "missing" record of a mutable URL is trusted only beside such a listing of the same URL (a checkpoint's folder,
which was no object as recently): a new command then opens a checkpoint seen a moment ago with no request at all.
The objects of a trusted listing are confirmed before their bytes are fetched, as above.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .local import open_regular, read_capped, replace_file

REVALIDATE_AFTER_S = 60.0  # a mutable URL's version is trusted this long after it was checked: repeated commands
# and the viewer's reopenings cost no request, and a changed object is seen at most this late
REVALIDATE_ENV = "TENSORMORPH_REVALIDATE_S"  # overrides REVALIDATE_AFTER_S (seconds; 0 asks every time)
MAX_RECORD_BYTES = 16 * 1024  # a record is a URL and three numbers: anything larger is not one of ours
MAX_LISTING_BYTES = 8 * 1024**2  # a listing record (about 60,000 objects): a larger folder is listed every time
SUFFIX = "version"  # a record's file name: <64 hex digits>.version, beside the range cache's entries
# a hub's resolve URL at a full commit hash: the files of a commit never change
IMMUTABLE_URL = re.compile(r"^https?://[^?#]*/resolve/[0-9a-f]{40}/[^?#]+$")


def default_revalidate_after_s() -> float:
    """$TENSORMORPH_REVALIDATE_S when set (a number of seconds), else REVALIDATE_AFTER_S."""
    value = os.environ.get(REVALIDATE_ENV)
    if not value:
        return REVALIDATE_AFTER_S
    try:
        seconds = float(value)
    except ValueError:
        raise CheckpointError(f"{REVALIDATE_ENV}={value!r} is no number of seconds", file=REVALIDATE_ENV) from None
    if not seconds >= 0:  # also refuses NaN
        raise CheckpointError(f"{REVALIDATE_ENV}={value!r} is negative", file=REVALIDATE_ENV)
    return seconds


def _plain_name(name: object) -> bool:
    """Whether `name` could be an entry of a listed folder: one non-empty name, no path."""
    return (isinstance(name, str) and bool(name) and name not in (".", "..")
            and not any(c in name for c in "/\\\x00"))


def _time(value: object) -> float | None:
    """A record's "checked" time, None unless it is a finite number."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        else None


def _info(url: str, size: object, version: object) -> dict[str, Any] | None:
    """An object's info from a record's fields, None unless the size is a byte count and the version a string."""
    if type(size) is not int or not 0 <= size < 2**63 or not isinstance(version, str) or not version:
        return None
    return {"name": url, "type": "file", "size": size, "ETag": version}


def is_immutable(url: str) -> bool:
    """Whether `url` names bytes that never change: a hub file at a commit hash."""
    return IMMUTABLE_URL.match(url) is not None


@dataclass(frozen=True)
class Known:
    """What a record says of a URL: its info (None: no object there) and when that was last checked."""

    info: dict[str, Any] | None
    checked: float  # seconds since the epoch
    immutable: bool


@dataclass(frozen=True)
class Listing:
    """What a listing record says of a folder: its objects' infos and its folders, by name, as last listed."""

    files: dict[str, dict[str, Any]]
    folders: list[str]


class KnownVersions:
    """The version records in a range cache's folder `folder` (see the module docstring)."""

    def __init__(self, folder: Path, revalidate_after_s: float):
        self.folder, self.revalidate_after_s = folder, revalidate_after_s

    def _path(self, url: str, kind: str = "version") -> Path:
        digest = hashlib.sha256(json.dumps([kind, url]).encode()).hexdigest()
        return self.folder / f"{digest}.{SUFFIX}"

    def _fresh(self, checked: float) -> bool:
        return 0 <= time.time() - checked < self.revalidate_after_s

    def trusted(self, url: str, is_listed_folder: Callable[[], bool] = lambda: False) -> Known | None:
        """The record of `url` when it may be used without asking the server: at an immutable URL, or checked less
        than `revalidate_after_s` ago (a missing object only at an immutable URL, or where `is_listed_folder()`
        says a trusted listing of this URL is at hand: elsewhere one may appear any time)."""
        known = self.lookup(url)
        if known is None:
            return None
        if known.immutable:
            return known
        if not self._fresh(known.checked):
            return None
        return known if known.info is not None or is_listed_folder() else None

    def _record(self, url: str, kind: str, cap: int) -> dict[str, Any] | None:
        """The JSON record of `kind` for `url` (None when there is none, or it is damaged or not a regular file)."""
        try:
            fd = open_regular(self._path(url, kind), follow=False)
        except CheckpointError:
            return None
        try:
            raw = read_capped(fd, cap)
        finally:
            os.close(fd)
        try:
            record = json.loads(raw or b"")
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            return None
        return record if isinstance(record, dict) and record.get("url") == url else None

    def lookup(self, url: str) -> Known | None:
        """The record of `url`, however old; None when there is none (or it is damaged, or not a regular file)."""
        record = self._record(url, "version", MAX_RECORD_BYTES)
        if record is None:
            return None
        checked = _time(record.get("checked"))
        if checked is None:
            return None
        if record.get("missing") is True:
            return Known(None, checked, is_immutable(url))
        info = _info(url, record.get("size"), record.get("version"))
        return Known(info, checked, is_immutable(url)) if info is not None else None

    def listing(self, url: str) -> Listing | None:
        """The listing record of folder `url` when it may be used without asking: listed less than
        `revalidate_after_s` ago. None otherwise, or when it is damaged."""
        record = self._record(url, "listing", MAX_LISTING_BYTES)
        checked = _time(record.get("checked")) if record is not None else None
        if record is None or checked is None or not self._fresh(checked):
            return None
        entries, folders = record.get("files"), record.get("folders")
        if not isinstance(entries, list) or not isinstance(folders, list):
            return None
        files = {}
        for entry in entries:
            info = _info(f"{url}/{entry[0]}", entry[1], entry[2]) if isinstance(entry, list) and len(entry) == 3 \
                else None
            if info is None or not _plain_name(entry[0]):
                return None
            files[entry[0]] = info
        # a record is a file on disk: one that names anything but entries of this folder is no record of ours
        return Listing(files, folders) if all(map(_plain_name, folders)) else None

    def remember_listing(self, url: str, files: dict[str, tuple[int, str]], folders: list[str]) -> None:
        """Record what listing folder `url` just found: its objects' (size, version) by name, and its folders.
        Nothing is recorded where an object has no version (it could not be told changed) or the record would be
        over MAX_LISTING_BYTES."""
        if any(not version for _, version in files.values()):
            return
        record = {"url": url, "checked": time.time(), "files": [[name, size, version]
                                                                 for name, (size, version) in files.items()],
                  "folders": folders}
        raw = json.dumps(record).encode()
        if len(raw) <= MAX_LISTING_BYTES:
            with contextlib.suppress(OSError, CheckpointError):  # as in `remember`
                replace_file(self._path(url, "listing"), raw)

    def remember(self, url: str, info: dict[str, Any] | None, version: str) -> None:
        """Record what the server just said of `url`: `info` with its `version`, or None for no object."""
        if info is not None and not version:
            return  # without a version the cache is bypassed: nothing to trust
        before = self.lookup(url)
        if before is not None and (None if before.info is None else (before.info["size"], before.info["ETag"])) != (
                None if info is None else (int(info["size"]), version)):
            self._forget_listing(url)  # the object changed: its folder's listing record is stale too
        record: dict[str, Any] = {"url": url, "checked": time.time()}
        record.update({"missing": True} if info is None else {"size": int(info["size"]), "version": version})
        # a full or read-only disk costs a request next time, nothing more
        with contextlib.suppress(OSError, CheckpointError):
            replace_file(self._path(url), json.dumps(record).encode())

    def forget(self, url: str) -> None:
        """Drop the record of `url` (it was found changed), and any listing record of its folder."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(url))
        self._forget_listing(url)

    def _forget_listing(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(url.rpartition("/")[0], "listing"))
