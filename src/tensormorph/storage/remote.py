"""A checkpoint under an fsspec prefix (s3://, gs://, memory://, ...): ranged requests, nothing mapped."""

from __future__ import annotations

import builtins  # `list` names a method of the stores: their annotations say builtins.list
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import HeaderError, MissingFileError, TruncatedFileError, UnsafePathError
from ..extras import require_for_url
from .local import parse_json

REMOTE_GAP = 4096  # runs closer than this are fetched in one request: a request costs more than the gap


def is_url(path: str | os.PathLike[str]) -> bool:
    return "://" in os.fspath(path) and not os.fspath(path).startswith("file://")


def local_path(path: str | os.PathLike[str]) -> Path:
    """A local path, given plainly or as a file:// URL."""
    return Path(os.fspath(path).removeprefix("file://"))


class RemoteFiles:
    """Read-only files under an fsspec prefix, read in coalesced, concurrent ranged requests."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        # an optional dependency (the `s3` extra): only remote checkpoints need it
        fsspec = require_for_url(url, feature=f"reading {url}")
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.header_bytes_read = 0

    def _key(self, name: str, referrer: str | None = None) -> str:
        if not name or name.startswith("/") or ".." in name.split("/") or "\x00" in name:
            raise UnsafePathError(f"names file {name!r}, which is outside the checkpoint", file=referrer or self.url)
        return f"{self.root}/{name}"

    def describe(self, name: str, *, referrer: str | None = None) -> str:
        self._key(name, referrer)
        return f"{self.url}/{name}"

    def fingerprint(self, name: str) -> tuple[str, int, int | str]:
        try:
            info = self.fs.info(self._key(name))
        except FileNotFoundError:
            raise MissingFileError("file is missing", file=self.describe(name)) from None
        # object stores give an ETag; other fsspec file systems a modification or creation time
        version = next((info[k] for k in ("ETag", "etag", "mtime", "LastModified", "created") if info.get(k)), "")
        return self.describe(name), int(info["size"]), str(version)

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self._key(name)))

    def size(self, name: str) -> int:
        try:
            return int(self.fs.size(self._key(name)))
        except FileNotFoundError:
            raise MissingFileError("file is missing", file=self.describe(name)) from None

    def list(self) -> list[str]:
        prefix = f"{self.root}/"
        return sorted(path[len(prefix):] for path in self.fs.find(self.root) if path.startswith(prefix))

    def read(self, name: str, offset: int, length: int) -> bytes:
        data = self.read_ranges(name, [(offset, offset + length)])[0]
        self.header_bytes_read += length
        return data

    def read_prefixed(self, name: str, max_length: int) -> tuple[int, int, bytes]:
        """(file size, length, the `length` bytes after an 8-byte little-endian length), in two ranged reads."""
        size = self.size(name)
        if size < 8:
            return size, -1, b""
        length = int.from_bytes(self.read(name, 0, 8), "little")
        if length > min(max_length, size - 8):
            return size, length, b""
        return size, length, self.read(name, 8, length)

    def read_json(self, name: str, max_bytes: int, what: str = "file") -> Any:
        size = self.size(name)
        if size > max_bytes:
            raise HeaderError(f"{what} is {size} bytes, over the {max_bytes}-byte limit", file=self.describe(name))
        return parse_json(self.read(name, 0, size), what, self.describe(name))

    def read_into(self, name: str, offset: int, target: memoryview) -> None:
        target[:] = self.read_ranges(name, [(offset, offset + len(target))])[0]

    def read_runs(self, name: str, runs: Sequence[tuple[int, int]], target: memoryview) -> None:
        groups: list[list[tuple[int, int]]] = []
        for begin, end in runs:
            if groups and 0 <= begin - groups[-1][-1][1] <= REMOTE_GAP:
                groups[-1].append((begin, end))
            else:
                groups.append([(begin, end)])
        parts = self.read_ranges(name, [(g[0][0], g[-1][1]) for g in groups])
        position = 0
        for group, part in zip(groups, parts):
            first = group[0][0]
            for begin, end in group:
                target[position:position + end - begin] = part[begin - first:end - first]
                position += end - begin

    def read_ranges(self, name: str, runs: Sequence[tuple[int, int]]) -> builtins.list[bytes]:
        """The bytes of each [begin, end) range of one file, fetched concurrently."""
        if not runs:
            return []
        key = self._key(name)
        try:
            parts = self.fs.cat_ranges([key] * len(runs), [b for b, _ in runs], [e for _, e in runs], on_error="raise")
        except FileNotFoundError:
            raise MissingFileError("file is missing", file=self.describe(name)) from None
        for (begin, end), part in zip(runs, parts):
            if len(part) != end - begin:
                raise TruncatedFileError(f"expected {end - begin} bytes at offset {begin}, got {len(part)}",
                                         file=self.describe(name))
        return list(parts)

    def close(self) -> None:
        return None
