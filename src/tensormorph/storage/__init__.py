"""Where a checkpoint's bytes live, behind one interface: a `ByteStore` of named files.

Nothing here knows a format. Readers and the Tensormorph checked reader see bytes only through
`ByteStore`; `LocalFiles` (a folder: pread and memory maps) and `RemoteFiles` (an fsspec prefix:
ranged requests) implement it. Every name a checkpoint gives is checked to stay inside the store.
"""

from __future__ import annotations

import builtins  # `list` names a method of the stores: their annotations say builtins.list
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from .local import (
    MAX_JSON_VALUES,
    NEW_FILE_FLAGS,
    LocalFiles,
    create_new,
    open_regular,
    parse_json,
    read_capped,
    read_head,
    read_small,
)
from .remote import RemoteFiles, is_url, local_path

__all__ = ["MAX_JSON_VALUES", "NEW_FILE_FLAGS", "ByteStore", "LocalFiles", "MappableStore", "RemoteFiles",
           "create_new", "is_url", "local_path", "open_regular", "parse_json", "read_capped", "read_head", "read_small"]

Run = tuple[int, int]  # [begin, end) byte offsets in one file


@runtime_checkable
class ByteStore(Protocol):
    """Named read-only files: sizes, ranged reads and listing. Errors are CheckpointErrors naming the file."""

    header_bytes_read: int  # bytes read through `read` (headers, indexes, manifests), for the open benchmarks

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

    def close(self) -> None: ...


@runtime_checkable
class MappableStore(ByteStore, Protocol):
    """A store whose files can be memory-mapped: reads fault in only the pages they touch."""

    def buffer(self, name: str) -> memoryview: ...

    def advise(self, name: str, runs: list[Run], advice: str) -> None: ...
