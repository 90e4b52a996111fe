"""Where a checkpoint's bytes live, behind one interface: a `ByteStore` of named files.

Nothing here knows a format. Readers and the Tensormorph checked reader see bytes only through
`ByteStore`; `LocalFiles` (a folder: pread and memory maps) and `RemoteFiles` (an fsspec prefix:
ranged requests) implement it. Every name a checkpoint gives is checked to stay inside the store.
"""

from __future__ import annotations

import builtins  # `list` names a method of the stores: their annotations say builtins.list
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import CheckpointError
from .local import (
    MAX_JSON_VALUES,
    NEW_FILE_FLAGS,
    LocalFiles,
    closed_in_children,
    create_new,
    open_regular,
    parse_json,
    read_capped,
    read_small,
    replace_file,
)
from .local import read_head as _read_local_head
from .remote import PREFETCH_WINDOW, RangedBuffer, Remote, RemoteFiles, is_url, local_path
from .remote_path import RemotePath

if TYPE_CHECKING:  # loaded only for remote checkpoints
    from .range_cache import RangeCache

__all__ = ["MAX_JSON_VALUES", "NEW_FILE_FLAGS", "AnyPath", "Buffer", "ByteStore", "LocalFiles", "Remote",
           "RemoteFiles", "RemotePath", "as_path", "closed_in_children", "create_new", "entries", "is_url", "lexists",
           "local_path", "open_regular", "parse_json", "prefetched", "probe", "read_capped", "read_head",
           "read_small", "remote_cache", "replace_file", "remote_defaults", "remote_options", "store_at"]

Run = tuple[int, int]  # [begin, end) byte offsets in one file
AnyPath = Path | RemotePath  # a checkpoint's file or folder: local, or under a URL
Buffer = memoryview | RangedBuffer  # a whole file to index and slice: mapped when local, fetched lazily when remote


@dataclass(frozen=True)
class RemoteOptions:
    """How URLs are opened where a call does not say: fsspec's storage options, and the range cache's folder (True
    for the default folder, False for no cache)."""

    storage_options: dict[str, Any] | None = None
    cache: str | os.PathLike[str] | bool = True


_REMOTE_OPTIONS: ContextVar[RemoteOptions | None] = ContextVar("remote_options", default=None)


@contextmanager
def remote_options(storage_options: dict[str, Any] | None = None,
                   cache: str | os.PathLike[str] | bool = True) -> Iterator[None]:
    """Within the block, URLs opened without options of their own use these (the CLI sets them from its flags)."""
    token = _REMOTE_OPTIONS.set(RemoteOptions(storage_options, cache))
    try:
        yield
    finally:
        _REMOTE_OPTIONS.reset(token)


def remote_defaults() -> RemoteOptions:
    """The options `remote_options` set for URLs opened without their own."""
    return _REMOTE_OPTIONS.get() or RemoteOptions()


def as_path(path: str | os.PathLike[str] | RemotePath, storage_options: dict[str, Any] | None = None,
            cache: str | os.PathLike[str] | bool | RangeCache | None = None) -> AnyPath:
    """A local Path, or a RemotePath for a URL: fsspec's `storage_options` pass through to its client, and its reads
    go through the range cache `cache` (a folder, True for the default one, False for none, or a RangeCache); either
    left None takes the value `remote_options` set."""
    if isinstance(path, RemotePath):
        return path
    if not is_url(path):
        return local_path(path)
    defaults = remote_defaults()
    options = defaults.storage_options if storage_options is None else storage_options
    return RemotePath.parse(os.fspath(path), options, remote_cache(defaults.cache if cache is None else cache))


def remote_cache(option: str | os.PathLike[str] | bool | Any) -> Any:
    """The range cache a remote checkpoint's reads go through: in folder `option`, in the default folder for True,
    none for False; a RangeCache is used as it is (one made with its own `max_bytes` or `revalidate_after_s`)."""
    if option is False:
        return None
    from .range_cache import RangeCache, default_cache_folder  # needed only for remote checkpoints

    if isinstance(option, RangeCache):
        return option
    return RangeCache(default_cache_folder() if option is True else Path(option))


def prefetched(files: ByteStore, names: Sequence[str]) -> Iterator[str]:
    """`names`, in order, each window of PREFETCH_WINDOW of them after the store fetched their sizes and first bytes
    at once: a remote checkpoint of many files opens in overlapped round trips, holding a bounded amount."""
    for start in range(0, len(names), PREFETCH_WINDOW):
        window = names[start:start + PREFETCH_WINDOW]
        files.prefetch(window)
        yield from window


def store_at(folder: AnyPath) -> ByteStore:
    """The byte store of the folder `folder`: the one place that asks whether a checkpoint is local or remote."""
    return folder.store() if isinstance(folder, RemotePath) else LocalFiles(folder)


def probe(path: AnyPath, length: int) -> tuple[bytes, int]:
    """(up to `length` bytes from the start, the size) of the regular file at `path`; (b"", -1) when there is none
    or it cannot be read, so detection by content never waits on a FIFO or reads a device."""
    if isinstance(path, RemotePath):
        size = path.size()
        return (path.head(length), size) if size >= 0 else (b"", -1)
    try:
        fd = open_regular(path)
    except (OSError, CheckpointError):
        return b"", -1
    try:
        return os.pread(fd, length, 0), os.fstat(fd).st_size
    except OSError:
        return b"", -1
    finally:
        os.close(fd)


def entries(folder: AnyPath, pattern: str = "*") -> list[AnyPath]:
    """The entries directly in `folder` whose names match `pattern`, sorted by name; none when it is no folder."""
    found: list[AnyPath] = list(folder.glob(pattern)) if folder.is_dir() else []
    return sorted(found, key=lambda p: p.name)


def lexists(path: AnyPath) -> bool:
    """Whether anything is at `path`, a dangling link included (object stores have no links)."""
    return path.is_file() if isinstance(path, RemotePath) else os.path.lexists(path)


def read_head(path: AnyPath, length: int) -> bytes:
    """Up to `length` bytes from the start of the file at `path`, for detection by content: b"" when there is no
    regular file there or it cannot be read."""
    return path.head(length) if isinstance(path, RemotePath) else _read_local_head(path, length)


@runtime_checkable
class ByteStore(Protocol):
    """Named read-only files: sizes, ranged reads and listing. Errors are CheckpointErrors naming the file."""

    header_bytes_read: int  # bytes read through `read` (headers, indexes, manifests), for the open benchmarks
    mappable: bool  # True when `buffer` is a memory map (numpy can view it), False when it fetches on slicing

    def describe(self, name: str, *, referrer: str | None = None) -> str:
        """The file's full path or URL, for messages; UnsafePathError naming `referrer` (the file that gave the
        name, else the store) when the name leaves the store, so it also checks names a checkpoint gives."""
        ...

    def fingerprint(self, name: str) -> tuple[str, int, int | str]:
        """(full path or URL, size, modification time in ns or ETag): changes when the file does, for caches."""
        ...

    def exists(self, name: str) -> bool: ...

    def size(self, name: str) -> int: ...

    def list(self) -> list[str]:
        """Every file name in the store, relative to its root, sorted."""
        ...

    def read(self, name: str, offset: int, length: int) -> bytes:
        """Exactly `length` bytes from `offset` (TruncatedFileError when the file is shorter)."""
        ...

    def read_prefixed(self, name: str, max_length: int) -> tuple[int, int, bytes]:
        """(file size, length, the `length` bytes after an 8-byte little-endian length at offset 0).

        length is -1 for a file under 8 bytes; a length over `max_length` or past the end comes back unread.
        """
        ...

    def read_json(self, name: str, max_bytes: int, what: str = "file") -> Any:
        """A small JSON file, size-capped (never more than `max_bytes` + 1 bytes read) and parsed with its values
        bounded (parse_json); HeaderError when it is too large or not JSON, MissingFileError when it is missing
        or not a regular file."""
        ...

    def read_into(self, name: str, offset: int, target: memoryview) -> None:
        """Fill `target` with the file's bytes from `offset`."""
        ...

    def read_runs(self, name: str, runs: Sequence[Run], target: memoryview) -> None:
        """The bytes of every run, one after another, into `target` (the runs' total length)."""
        ...

    def read_ranges(self, name: str, runs: Sequence[Run]) -> builtins.list[bytes]:
        """The bytes of every run, each on its own."""
        ...

    def is_dir(self, name: str = "") -> bool:
        """Whether `name` ("" for the root) is a folder."""
        ...

    def listdir(self, name: str = "") -> builtins.list[str]:
        """The names directly under folder `name` ("" for the root), sorted."""
        ...

    def head(self, name: str, length: int) -> bytes:
        """Up to `length` bytes from the start of file `name`, for detection: b"" when there is no regular file."""
        ...

    def prefetch(self, names: Sequence[str], head: int = ...) -> None:
        """Fetch many files' sizes and first `head` bytes at once, before they are read one by one (remote stores
        overlap the round trips; local ones do nothing)."""
        ...

    def buffer(self, name: str) -> Buffer:
        """The whole file to index and slice: a read-only memory map (pages read when touched) when `mappable`,
        else a RangedBuffer that fetches the slices asked for."""
        ...

    def advise(self, name: str, runs: builtins.list[Run], advice: str) -> None:
        """Say which byte runs reads will need ("willneed") or no longer need ("dontneed"); a no-op when unmapped."""
        ...

    def close(self) -> None: ...
