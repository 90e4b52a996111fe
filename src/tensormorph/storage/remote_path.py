"""A file or folder URL with the few pathlib methods format detection uses (`AnyPath` = Path | RemotePath)."""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Iterator
from typing import Any

from .remote import RemoteFiles
from .remote_context import Remote


class RemotePath:
    """A file or folder URL with the few pathlib methods format detection uses, every request made through the
    Remote context its checkpoint shares."""

    def __init__(self, url: str, remote: Remote):
        self.url, self.remote = url.rstrip("/"), remote

    @classmethod
    def parse(cls, url: str, storage_options: dict[str, Any] | None = None, cache: Any = None) -> RemotePath:
        return cls(url, Remote.for_url(url, storage_options, cache))

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(RemoteFiles(self.url, remote=self.remote).describe(name), self.remote)

    @property
    def name(self) -> str:
        return posixpath.basename(self.url)

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def parent(self) -> RemotePath:
        scheme, rest = self.url.split("://", 1)
        head = posixpath.dirname(rest)
        return RemotePath(f"{scheme}://{head}" if head else self.url, self.remote)

    def store(self) -> RemoteFiles:
        """The store rooted at this folder."""
        return RemoteFiles(self.url, remote=self.remote)

    def resolve(self) -> RemotePath:
        return self  # object stores have no links

    def __lt__(self, other: RemotePath) -> bool:
        return self.url < other.url

    def is_file(self) -> bool:
        return self.remote.info(self.url) is not None

    def size(self) -> int:
        """The file's size, or -1 when there is no file at this URL."""
        info = self.remote.info(self.url)
        return -1 if info is None else int(info["size"])

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_dir(self) -> bool:
        return RemoteFiles(self.url, remote=self.remote).is_dir()

    def iterdir(self) -> Iterator[RemotePath]:
        store = RemoteFiles(self.url, remote=self.remote)
        return (self / name for name in store.listdir())

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """The entries directly in this folder whose names match `pattern` (no recursion: detection needs none)."""
        return (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    def head(self, length: int) -> bytes:
        return self.parent.store().head(self.name, length)
