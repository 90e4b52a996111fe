"""A checkpoint folder on a local file system: pread for exact reads, memory maps for lazy ones.

Every path a format names goes through `resolve`, which refuses absolute paths, `..` and symlinks
that leave the checkpoint's folder, so no checkpoint can make us read another file.
"""

from __future__ import annotations

import builtins  # `list` names a method of the stores: their annotations say builtins.list
import contextlib
import errno
import json
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from ..errors import CheckpointError, HeaderError, MissingFileError, TruncatedFileError, UnsafePathError
from .scattered import read_pieces

_EMPTY = memoryview(b"")
ADVICE_PIECE = 8 * 1024**2
READ_PIECE = 64 * 1024**2

MAX_JSON_VALUES = 4_000_000
"""Most JSON values a small JSON file (an index, a config, a safetensors header) may hold, counted before it is
parsed by the characters that open them (`,[{:`, strings included: an upper bound). Parsed, a value costs Python
up to about 100 bytes whatever the bytes that spell it (`[[],[],...]` takes 3 bytes a value), so this, not the
file's size, bounds what a parse builds: about 400 MB at the limit. A tensor of a safetensors header takes about
12, an entry of an index's weight_map 2."""
_JSON_STRUCTURE = b",[{:"  # a value is the first in its container or follows a comma; each key precedes a colon
_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


# Every file we create inside a folder a user gave us (a save, a repair, a conversion, a cache) is a new file:
# an existing file or a planted link at its name is refused, never followed or truncated.
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


def closed_in_children(held: set[int]) -> None:
    """Close the descriptors in `held` in every child this process forks. A flock belongs to the open file, which
    a forked child (a DataLoader worker) shares: without this, a lock would outlive its holder for as long as
    the children run. Each set lists the locks of one kind this process holds."""

    def close_inherited() -> None:
        for fd in held:
            with contextlib.suppress(OSError):
                os.close(fd)
        held.clear()

    os.register_at_fork(after_in_child=close_inherited)


def create_new(path: Path) -> BinaryIO:
    """A new file at `path`, open for writing (see NEW_FILE_FLAGS)."""
    return os.fdopen(os.open(path, NEW_FILE_FLAGS, 0o644), "wb")


def replace_file(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Write `data` as the file `path` all at once: into a new file of a fresh name beside it (never through a
    link), then renamed over `path`, which replaces a link planted at that name itself, never its target. A reader
    never sees half of it; the temporary file goes when anything fails, and the OSError is raised."""
    temporary = path.with_name(f"{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        with create_new(temporary) as handle:
            handle.write(data)
            if durable:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def open_regular(path: Path, *, follow: bool = True) -> int:
    """A read-only descriptor of the regular file at `path`. Anything else is refused, naming it: opening a FIFO
    would wait for a writer (O_NONBLOCK opens it at once, to be refused), a device such as /dev/zero reads
    without end, and a folder has no bytes. `follow=False` refuses a link at `path`: for a path already resolved,
    where a link can only be one swapped in since."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except FileNotFoundError:
        raise MissingFileError("file is missing", file=str(path)) from None
    except OSError as exc:
        if not follow and exc.errno == errno.ELOOP:
            raise UnsafePathError("became a link after the checkpoint was opened; it is not followed",
                                  file=str(path)) from None
        raise CheckpointError(f"cannot be read: {exc.strerror or exc}", file=str(path)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a file")
        raise MissingFileError(f"is {kind}, not a regular file", file=str(path))
    return fd


def read_capped(fd: int, cap: int) -> bytes | None:
    """An open file's bytes from its start, or None when it holds more than `cap`. It never reads more than
    cap + 1 bytes, whatever size the file reports: the size is only a hint (a file may grow while it is read)."""
    hint = os.fstat(fd).st_size
    if hint > cap:
        return None
    pieces, total = [], 0
    while total <= cap:
        piece = os.pread(fd, min(cap + 1 - total, max(hint + 1 - total, 1 << 16), READ_PIECE), total)
        if not piece:
            break
        pieces.append(piece)
        total += len(piece)
    return None if total > cap else b"".join(pieces)


def read_small(path: Path, cap: int, *, follow: bool = True) -> bytes | None:
    """The regular file at `path` (see open_regular), or None when it holds more than `cap` bytes."""
    fd = open_regular(path, follow=follow)
    try:
        return read_capped(fd, cap)
    finally:
        os.close(fd)


def parse_json(raw: bytes, what: str, where: str, **options: Any) -> Any:
    """`raw` parsed as UTF-8 JSON (json.loads `options`: hooks), after bounding what the parse builds by counting
    its values (see MAX_JSON_VALUES); problems are HeaderErrors naming `where`."""
    values = sum(raw.count(c) for c in _JSON_STRUCTURE) + 1
    if values > MAX_JSON_VALUES:
        raise HeaderError(f"{what} holds about {values} JSON values, over the limit of {MAX_JSON_VALUES}",
                          file=where)
    try:
        return json.loads(raw.decode("utf-8"), **options)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: e.g. a 5000-digit integer
        raise HeaderError(f"{what} is not valid UTF-8 JSON: {exc}", file=where) from None


def read_head(path: Path, length: int) -> bytes:
    """Up to `length` bytes from the start of the regular file at `path`, for detection by content: b"" when
    there is no regular file there or it cannot be read, so a FIFO, a device or a folder is not recognised."""
    try:
        fd = open_regular(path)
    except (OSError, CheckpointError):  # unreadable, a loop of links, not a regular file: not this format
        return b""
    try:
        return os.pread(fd, length, 0)
    except OSError:
        return b""
    finally:
        os.close(fd)


def pread_into(fd: int, offset: int, target: memoryview, where: str) -> None:
    """Fill `target` from an open file at `offset`, in large pieces; TruncatedFileError when it ends first."""
    done = 0
    while done < len(target):
        count = os.preadv(fd, [target[done:done + READ_PIECE]], offset + done)
        if count == 0:
            raise TruncatedFileError(f"expected {len(target)} bytes at offset {offset}, the file ends after {done}",
                                     file=where)
        done += count


HUB_REPO_KINDS = ("models", "datasets", "spaces")


def hub_blobs(root: Path) -> str | None:
    """The blobs folder (ending in "/") when `root` is a revision of the Hugging Face hub cache, whose files are
    links into `<repo>/blobs/`: there they are the checkpoint's own files. None for any other folder."""
    snapshots, repo = root.parent, root.parent.parent
    kind, _, rest = repo.name.partition("--")
    if snapshots.name != "snapshots" or kind not in HUB_REPO_KINDS or not rest:
        return None
    blobs = repo / "blobs"
    return f"{blobs}/" if blobs.is_dir() and not blobs.is_symlink() else None


class LocalFiles:
    """The files of one checkpoint folder, opened read-only and mapped on demand."""

    mappable = True

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self._blobs = hub_blobs(self.root)
        self._maps: dict[Path, mmap.mmap | None] = {}
        self._resolved: dict[str, Path] = {}
        self._lock = threading.Lock()
        self.header_bytes_read = 0

    def resolve(self, name: str | os.PathLike, *, referrer: str | None = None) -> Path:
        """The absolute path of `name`, which must stay inside the root folder."""
        text = os.fspath(name)
        known = self._resolved.get(text)
        if known is not None:
            return known
        # a plain file name (the usual case, thousands of them in an index) needs no path parsing
        parts = (text,) if "/" not in text and "\\" not in text else PurePosixPath(text.replace("\\", "/")).parts
        who = referrer or str(self.root)
        if not text or "\x00" in text or text[0] in "/\\~" or ".." in parts:
            raise UnsafePathError(f"names file {text!r}, which is outside the checkpoint folder", file=who)
        real = self._real(parts)
        root = str(self.root)
        inside = real == root or real.startswith(root.rstrip("/") + "/")
        if not inside and not (self._blobs and real.startswith(self._blobs)):
            raise UnsafePathError(
                f"names file {text!r}, a link that resolves outside the checkpoint folder to {real}", file=who
            )
        self._resolved[text] = Path(real)
        return self._resolved[text]

    def _real(self, parts: tuple[str, ...]) -> str:
        """os.path.realpath of root/parts, but lstat-ing only the components below the root (which is resolved
        already): an index naming thousands of files costs one lstat a component of each, not one for every
        component of the root's own path as well."""
        path = str(self.root)
        for k, part in enumerate(parts):
            path = os.path.join(path, part)
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                return os.path.join(path, *parts[k + 1:])  # absent: nothing below it can be a link either
            if stat.S_ISLNK(mode):
                return os.path.realpath(os.path.join(path, *parts[k + 1:]))
        return path

    def describe(self, name: str, *, referrer: str | None = None) -> str:
        return str(self.resolve(name, referrer=referrer))

    def fingerprint(self, name: str) -> tuple[str, int, int]:
        path = self.resolve(name)
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise MissingFileError("file is missing", file=str(path)) from None
        return str(path), stat.st_size, stat.st_mtime_ns

    def exists(self, name: str) -> bool:
        return self.resolve(name).is_file()

    def list(self) -> list[str]:
        """Every regular file under the root (links included only when they stay inside it)."""
        names = []
        for path in self.root.rglob("*"):
            name = path.relative_to(self.root).as_posix()
            try:
                if self.resolve(name).is_file():
                    names.append(name)
            except UnsafePathError:
                continue
        return sorted(names)

    def is_dir(self, name: str = "") -> bool:
        return (self.resolve(name) if name else self.root).is_dir()

    def listdir(self, name: str = "") -> builtins.list[str]:
        folder = self.resolve(name) if name else self.root
        try:
            return sorted(entry.name for entry in os.scandir(folder))
        except OSError:
            return []

    def head(self, name: str, length: int) -> bytes:
        return read_head(self.resolve(name), length)

    def prefetch(self, names: Sequence[str], head: int = 0) -> None:
        return None  # a local open and read costs microseconds: nothing to overlap

    def size(self, name: str) -> int:
        path = self.resolve(name)
        try:
            return path.stat().st_size
        except FileNotFoundError:
            raise MissingFileError("file is missing", file=str(path)) from None

    def read(self, name: str, offset: int, length: int) -> bytes:
        """Read exactly `length` bytes (headers, indexes): counted in header_bytes_read."""
        path = self.resolve(name)
        with os.fdopen(open_regular(path, follow=False), "rb") as f:
            f.seek(offset)
            data = f.read(length)
        return self._counted(data, length, offset, path)

    def read_prefixed(self, name: str, max_length: int) -> tuple[int, int, bytes]:
        """(file size, length, the `length` bytes after an 8-byte little-endian length) in one open."""
        path = self.resolve(name)
        with os.fdopen(open_regular(path, follow=False), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = self._counted(f.read(8), 8, 0, path) if size >= 8 else b""
            length = int.from_bytes(prefix, "little") if prefix else -1
            if prefix and length <= min(max_length, size - 8):
                return size, length, self._counted(f.read(length), length, 8, path)
            return size, length, b""

    def read_json(self, name: str, max_bytes: int, what: str = "file") -> Any:
        """A small JSON file (an index, a config), size-capped and parsed; problems are HeaderErrors."""
        path = self.resolve(name)
        raw = read_small(path, max_bytes, follow=False)
        if raw is None:
            raise HeaderError(f"{what} is over the {max_bytes}-byte limit", file=str(path))
        self.header_bytes_read += len(raw)
        return parse_json(raw, what, str(path))

    def read_into(self, name: str, offset: int, target: memoryview) -> None:
        """Fill `target` with the file's bytes from `offset` (pread in large pieces, no page mapping)."""
        self._pread(name, [(offset, target)])

    def read_runs(self, name: str, runs: Sequence[tuple[int, int]], target: memoryview) -> None:
        pieces, position = [], 0
        for begin, end in runs:
            pieces.append((begin, target[position:position + end - begin]))
            position += end - begin
        self._pread(name, pieces)

    def read_ranges(self, name: str, runs: Sequence[tuple[int, int]]) -> builtins.list[bytes]:
        buffers = [bytearray(end - begin) for begin, end in runs]
        self._pread(name, [(begin, memoryview(buffer)) for (begin, _), buffer in zip(runs, buffers)])
        return [bytes(buffer) for buffer in buffers]

    def _pread(self, name: str, pieces: Sequence[tuple[int, memoryview]]) -> None:
        """Fill each (offset, target) piece, through one descriptor opened for this call only: a store holds no
        descriptors between calls that a caller could run out of, and none is shared between threads."""
        fd, where = self._open(name), self.describe(name)
        try:
            read_pieces(fd, pieces, lambda fd, offset, target: pread_into(fd, offset, target, where))
        finally:
            os.close(fd)

    def _open(self, name: str) -> int:
        return open_regular(self.resolve(name), follow=False)

    def _counted(self, data: bytes, length: int, offset: int, path: Path) -> bytes:
        if len(data) != length:
            raise TruncatedFileError(
                f"expected {length} bytes at offset {offset}, the file ends after {len(data)}", file=str(path)
            )
        self.header_bytes_read += length
        return data

    def buffer(self, name: str) -> memoryview:
        """A read-only memory map of the whole file (pages are read only when touched)."""
        path = self.resolve(name)
        with self._lock:
            if path not in self._maps:
                fd = open_regular(path, follow=False)
                try:
                    size = os.fstat(fd).st_size
                    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
                    if mapped is not None:
                        # no readahead around each fault: region reads then touch only what they need,
                        # and reads say what they need through advise()
                        mapped.madvise(mmap.MADV_RANDOM)
                    self._maps[path] = mapped
                finally:
                    os.close(fd)
            mapped = self._maps[path]
        return memoryview(mapped) if mapped is not None else _EMPTY

    def advise(self, name: str, runs: builtins.list[tuple[int, int]], advice: str) -> None:
        """madvise byte ranges of a mapped file: "willneed" prefetches them, "dontneed" drops them from our RSS."""
        if not runs:
            return
        self.buffer(name)  # map it now: advice given before the first read must not be lost
        mapped = self._maps.get(self.resolve(name))
        if mapped is None:
            return
        flag = {"willneed": mmap.MADV_WILLNEED, "dontneed": mmap.MADV_DONTNEED}[advice]
        # the kernel acts on at most about one readahead window per WILLNEED call: ask in pieces
        piece = ADVICE_PIECE if advice == "willneed" else None
        size = len(mapped)
        for begin, end in runs:
            start = begin - begin % mmap.PAGESIZE
            end = min(end, size)
            while end > start:
                length = end - start if piece is None else min(piece, end - start)
                mapped.madvise(flag, start, length)
                start += length

    def close(self) -> None:
        with self._lock:
            for mapped in self._maps.values():
                if mapped is not None:
                    # numpy views still point into the map (BufferError); it closes when they are freed.
                    with contextlib.suppress(BufferError):
                        mapped.close()
            self._maps.clear()
