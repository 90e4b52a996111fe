"""The viewer's summary cache: a checkpoint's encoded /summary kept on disk, so that a viewer started again on the
same files answers it without describing 20,000 tensors again (~0.7 s of Python).

An entry is served only when everything it came from is unchanged: the identity (path, size, mtime_ns, inode,
ctime_ns) of the checkpoint's folder, of every entry directly in it, of every file the checkpoint reads (and of
what a link points to) and of the folders holding them is stat-ed again on every use and must equal the one
recorded with the entry; so must the code this process runs (`CODE`). Entries are signed with HMAC-SHA256 under a
per-cache key (created once, mode 0600): a file altered, swapped or planted in the cache folder is refused, and
the summary described afresh. Entries are read and written without following links, written whole (replace_file).
They live in a `summaries` folder beside the tile cache's (~/.cache/tensormorph/summaries), outside the tiles' cap,
bounded on their own (MAX_ENTRIES, MAX_FOLDER_BYTES, least recently used first). Like the tile cache, a cache that
cannot be read or written only makes the viewer slower: its errors never reach a request.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import hmac
import json
import os
import secrets
import stat
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core import Checkpoint
from .errors import CheckpointError
from .storage import NEW_FILE_FLAGS, LocalFiles, is_url, read_small, replace_file
from .version import __version__

SUMMARY_FOLDER = "summaries"  # beside the tile cache's folder (~/.cache/tensormorph/summaries), not inside its cap
KEY_FILE = "key"  # in that folder
MAX_ENTRIES = 64  # summaries kept, the least recently used deleted first ...
MAX_FOLDER_BYTES = 256 * 1024**2  # ... and at most this many bytes of them (20,000 tensors: ~130 kB)
KEY_BYTES = 32
MAGIC = b"TMSUMMARY1\n"
MAX_ENTRY_BYTES = 256 * 1024**2  # a cached entry larger than this is not read
MAX_SUMMARY_BYTES = 2 * 1024**3  # the decoded summary an entry may claim (~5.8 MB of JSON per 20,000 tensors)
MAX_SOURCES = 200_000  # a checkpoint of more files than this is not cached: checking them would cost as much
SETTLED_S = 2.0  # files changed more recently than this are not cached: a change within one tick keeps mtime
GZIP_LEVEL = 1  # the 5.8 MB summary of 20,000 tensors packs to 130 kB in ~22 ms, and unpacks in ~20 ms

Identity = list[list[Any]]  # [[path, size, mtime_ns, inode, ctime_ns], ...], sorted by path
LINK = -2  # the size recorded for a link (its target follows); a folder's is -1


@dataclass(frozen=True)
class Summary:
    """An encoded summary: the JSON, and its gzip as sent to a browser (which accepts gzip on http://)."""

    raw: bytes
    packed: bytes

    @classmethod
    def pack(cls, raw: bytes) -> Summary:
        return cls(raw, gzip.compress(raw, GZIP_LEVEL, mtime=0))


def _unpack(packed: bytes, length: int) -> bytes | None:
    """The `length` bytes gzip-ed in `packed`, or None when it holds something else (never more than length + 1)."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        raw = inflate.decompress(packed, length + 1)
    except zlib.error:
        return None
    return raw if len(raw) == length and inflate.eof and not inflate.unused_data else None


def code_identity(package: Path, version: str) -> str:
    """A digest of the package's version and of the size and mtime of each of its source files: an entry made by
    other code (another install, an edited checkout) is not served. Stat-ed, not read: ~200 files take ~2 ms."""
    digest = hashlib.sha256(version.encode())
    for source in sorted(package.rglob("*.py")):
        st = source.stat()
        digest.update(f"{source.relative_to(package)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return digest.hexdigest()


# the code this process runs, taken at import (as the modules were loaded; the stats are warm then)
CODE = code_identity(Path(__file__).resolve().parent, __version__)


def top_identity(path: str | Path) -> Identity | None:
    """The identity of a local checkpoint's path and, for a folder, of every entry directly in it (taken before it
    is opened, so that a checkpoint rewritten while it opened is never cached under its new identity); None for a
    URL, what cannot be listed, or a folder of more than MAX_SOURCES entries."""
    if is_url(path):
        return None
    try:
        paths = _listed(os.path.realpath(path))
        return _stat_all(paths) if len(paths) <= MAX_SOURCES else None
    except OSError:
        return None


def source_identity(ck: Checkpoint) -> Identity | None:
    """The identity of everything `ck`'s summary came from: its folder and the entries in it, the config.json beside
    a single file, and each file the checkpoint reads with the folder holding it. None when it cannot be taken (a
    remote checkpoint, more than MAX_SOURCES)."""
    storage = ck.storage
    if not isinstance(ck.path, Path) or not isinstance(storage, LocalFiles) or len(ck.files) > MAX_SOURCES:
        return None
    try:
        root = os.path.realpath(ck.path)
        paths = _listed(root)
        if not os.path.isdir(root):
            paths.add(os.path.join(os.path.dirname(root), "config.json"))
        base = str(storage.root)
        for name in ck.files:  # names the reader checked already: inside the folder
            file = os.path.join(base, name)
            paths.add(file)
            paths.add(os.path.dirname(file))
        return _stat_all(paths) if len(paths) <= MAX_SOURCES else None
    except OSError:
        return None


def _listed(root: str) -> set[str]:
    """`root` and, for a folder, the entries directly in it."""
    paths = {root}
    if os.path.isdir(root):
        with os.scandir(root) as entries:
            paths.update(entry.path for entry in entries)
    return paths


def _stat_all(paths: Iterable[str]) -> Identity:
    """[path, size, mtime_ns, inode, ctime_ns] of each path, links not followed, and for a link also of what it
    points to (as "path ->": a Hugging Face snapshot links to its blobs); a missing path is recorded as such (a
    config.json that appears later changes the identity)."""
    out: Identity = []
    for path in sorted(set(paths)):
        out.append(_stat(path, os.lstat))
        if out[-1][1] == LINK:
            out.append(_stat(path, os.stat, f"{path} ->"))
    return out


def _stat(path: str, how: Callable[[str], os.stat_result], label: str | None = None) -> list[Any]:
    try:
        st = how(path)
    except FileNotFoundError:
        return [label or path, None, None, None, None]
    size = st.st_size if stat.S_ISREG(st.st_mode) else LINK if stat.S_ISLNK(st.st_mode) else -1
    return [label or path, size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def _settled(identity: Identity) -> bool:
    """No file or folder of `identity` was modified or changed within SETTLED_S of now."""
    recent = time.time_ns() - int(SETTLED_S * 1e9)
    return all((mtime is None or mtime < recent) and (ctime is None or ctime < recent)
               for _, _, mtime, _, ctime in identity)


def beside(tile_folder: Path | None) -> Path | None:
    """The summary folder of a viewer whose tiles are cached in `tile_folder` (None: none either)."""
    return tile_folder.parent / SUMMARY_FOLDER if tile_folder is not None else None


class SummaryCache:
    """Encoded summaries by checkpoint, in `folder` (None: no disk cache, every summary described)."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.key_path = folder / KEY_FILE if folder is not None else None
        self.code = CODE
        self._key: bytes | None = None

    def summary(self, ck: Checkpoint, compute: Callable[[], bytes], *, opened: Identity | None = None) -> Summary:
        """`ck`'s summary: the cached one when its recorded identity is the files' identity now, else `compute()`,
        stored when the files did not change while `ck` was opened (`opened`: top_identity before it was) nor
        while it was described."""
        identity = source_identity(ck) if self.folder is not None else None
        if identity is None:
            return Summary.pack(compute())
        entry = self._entry_path(ck)
        found = self._read(entry, ck, identity)
        if found is not None:
            return found
        summary = Summary.pack(compute())
        # stored only when the identity taken before the open covers it (a viewer that opened a checkpoint without
        # taking one, such as a run's next step, describes it each time) and no file changed just now: a rewrite
        # within the same clock tick, of the same size, would keep its identity (git's "racy" files)
        unchanged = opened is not None and _covers(identity, opened) and _settled(identity)
        if unchanged and source_identity(ck) == identity:
            self._write(entry, ck, identity, summary)
        return summary

    def _entry_path(self, ck: Checkpoint) -> Path:
        assert self.folder is not None
        # the path as given too: the summary names it, so a viewer opened on another spelling describes its own
        named = [os.path.realpath(str(ck.path)), str(ck.path), ck.format]
        return self.folder / hashlib.sha256(json.dumps(named).encode()).hexdigest()

    def _header(self, ck: Checkpoint, identity: Identity, length: int) -> bytes:
        return json.dumps({"path": os.path.realpath(str(ck.path)), "given": str(ck.path), "format": ck.format,
                           "code": self.code, "identity": identity, "length": length}, separators=(",", ":")).encode()

    def _read(self, entry: Path, ck: Checkpoint, identity: Identity) -> Summary | None:
        """The entry's summary when its signature holds and it was made of these files by this code, else None."""
        key = self._signing_key(create=False)
        if key is None:
            return None
        try:
            raw = read_small(entry, MAX_ENTRY_BYTES, follow=False)
        except (OSError, CheckpointError):  # never written, evicted, or not a regular file
            return None
        if raw is None or len(raw) < len(MAGIC) + 32 + 8 or not raw.startswith(MAGIC):
            return None
        mac, body = raw[len(MAGIC):len(MAGIC) + 32], raw[len(MAGIC) + 32:]
        if not hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()):
            return None  # altered or planted: described afresh (and overwritten)
        header_length = int.from_bytes(body[:8], "little")
        header = body[8:8 + header_length]
        try:
            length = json.loads(header)["length"]
        except (ValueError, KeyError, TypeError):
            return None
        # made of other files, for another checkpoint or by other code: the header says so
        if not isinstance(length, int) or header != self._header(ck, identity, length) or length > MAX_SUMMARY_BYTES:
            return None
        packed = body[8 + header_length:]
        data = _unpack(packed, length)
        if data is None:
            return None
        with contextlib.suppress(OSError):
            os.utime(entry)  # recency, for _evict
        return Summary(data, packed)

    def _write(self, entry: Path, ck: Checkpoint, identity: Identity, summary: Summary) -> None:
        key = self._signing_key(create=True)
        if key is None:
            return
        header = self._header(ck, identity, len(summary.raw))
        body = len(header).to_bytes(8, "little") + header + summary.packed
        with contextlib.suppress(OSError):  # a full or read-only disk: the next viewer describes it again
            entry.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            replace_file(entry, MAGIC + hmac.new(key, body, hashlib.sha256).digest() + body)
            self._evict()

    def _evict(self) -> None:
        """Delete the least recently used entries (a hit refreshes an entry's mtime) until at most MAX_ENTRIES of
        at most MAX_FOLDER_BYTES remain. Only entries' names are listed: the key and others' temporary files stay."""
        assert self.folder is not None
        found = []
        with os.scandir(self.folder) as listing:
            for item in listing:
                with contextlib.suppress(OSError):
                    if len(item.name) == 64 and item.is_file(follow_symlinks=False):
                        st = item.stat(follow_symlinks=False)
                        found.append((st.st_mtime_ns, st.st_size, item.path))
        found.sort(reverse=True)
        total = 0
        for count, (_, size, path) in enumerate(found):
            total += size
            if count >= MAX_ENTRIES or total > MAX_FOLDER_BYTES:
                with contextlib.suppress(FileNotFoundError):  # another viewer deleted it first
                    os.unlink(path)

    def _signing_key(self, *, create: bool) -> bytes | None:
        """The cache's HMAC key, made on first write: a random file of mode 0600, linked into place whole so
        that two viewers starting at once agree on one key."""
        if self._key is not None or self.key_path is None:
            return self._key
        try:
            key = read_small(self.key_path, KEY_BYTES, follow=False)
        except (OSError, CheckpointError):
            key = None
        if key is not None and len(key) == KEY_BYTES:
            self._key = key
            return key
        if not create:
            return None
        fresh = secrets.token_bytes(KEY_BYTES)
        temporary = self.key_path.with_name(f"{KEY_FILE}.{secrets.token_hex(8)}.tmp")
        try:
            self.key_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(temporary, NEW_FILE_FLAGS, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(fresh)
            with contextlib.suppress(FileExistsError):  # another viewer made one first: theirs is read below
                os.link(temporary, self.key_path, follow_symlinks=False)
        except OSError:
            return None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        return self._signing_key(create=False)


def _covers(identity: Identity, before: Identity) -> bool:
    """Whether every path of `before` has the same identity in `identity`."""
    now = {entry[0]: entry for entry in identity}
    return all(now.get(entry[0]) == entry for entry in before)
