"""The commit protocol: where a Tensormorph save is written, and how it becomes visible at once or not at all.

Local saves go to a temporary sibling folder and are renamed into place after
the manifest is durable, so the final name only ever holds a committed
checkpoint. Object stores have no atomic folder rename: there the data files
go straight to their final keys and the manifest, a single PUT written last,
is the commit. Either way a folder without a manifest is not a checkpoint,
and a marker file says which save it was part of.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import CheckpointError
from ..extras import require_for_url
from ..storage import closed_in_children, create_new, is_url, local_path
from .manifest import GENERATION_PREFIX, INIT_PREFIX, MANIFEST, MAX_MANIFEST_BYTES, SAVE_MARKER, TEMP_PREFIX, parse
from .output_files import LIBC, EarlyWriteback, SharedOutput
from .recovery import all_files
from .stream import OutputFile


def store(target: Destination, name: str, chunks: Iterable[bytes | bytearray | memoryview]) -> None:
    """Write one file of a save from a stream of byte strings, durably."""
    f = target.open(name)
    try:
        for chunk in chunks:
            f.write(chunk)
    finally:
        target.finish_file(f)


class LocalDestination:
    """A folder on a local file system, committed by an atomic rename."""

    file_prefix = ""  # files keep their plain names: the folder itself is replaced at the commit

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False):
        self.final = local_path(path).absolute()
        self.overwrite = overwrite
        self.work: Path | None = None
        self._marker: BinaryIO | None = None  # held open (and locked) by the preparing process
        self._maps: dict[str, mmap.mmap | bytes] = {}  # read_range's maps of finished files
        self._maps_lock = threading.Lock()

    def describe(self) -> str:
        return str(self.final)

    def prepare(self) -> str:
        """Create the temporary folder (one process only); returns its name for the other ranks."""
        if self.final.exists() and not self.overwrite:
            raise CheckpointError("already exists; pass overwrite=True to replace it", file=str(self.final))
        name = f"{TEMP_PREFIX}{self.final.name}-{uuid.uuid4().hex[:12]}"
        work = self.final.parent / name
        # the marker stays locked until the commit: a cleaner (remove_abandoned) leaves locked saves alone.
        # The folder gets its temporary name only once the marker is in it, so a folder under that name
        # without a marker is never a live save.
        init = self.final.parent / f"{INIT_PREFIX}{_creator_tag()}-{uuid.uuid4().hex[:12]}"
        try:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            init.mkdir()
        except OSError as exc:  # a read-only or foreign folder, a file on the way
            raise CheckpointError(f"cannot create the save's folder: {exc.strerror or exc}", file=str(self.final)) \
                from None
        # held open, and locked, past this call until the commit or abort: _release_marker closes it
        self._marker = create_new(init / SAVE_MARKER)
        _HELD_MARKERS.add(self._marker.fileno())
        try:
            fcntl.flock(self._marker.fileno(), fcntl.LOCK_EX)
            record = {"target": self.final.name, "started": time.time(), "pid": os.getpid()}
            self._marker.write(json.dumps(record).encode())
            self._marker.flush()
            os.fsync(self._marker.fileno())
            os.rename(init, work)
        except BaseException:
            self._release_marker()
            raise
        self.work = work
        return name

    def join(self, token: str) -> None:
        self.work = self.final.parent / token

    def open(self, name: str) -> OutputFile:
        assert self.work is not None, "prepare() or join() first"
        return EarlyWriteback(self.work / name)

    @staticmethod
    def finish_file(f: OutputFile) -> None:
        f.flush()
        os.fsync(f.fileno())
        f.close()

    def copy_file(self, source: str, name: str) -> None:
        """A durable copy of a file this save wrote, made by the kernel (copy_file_range: no bytes pass through
        this process; reflinked where the file system shares blocks), as a new file never through a link."""
        assert self.work is not None, "prepare() or join() first"
        with open(self.work / source, "rb") as original, create_new(self.work / name) as copy:
            left = os.fstat(original.fileno()).st_size
            try:
                while left > 0:
                    done = os.copy_file_range(original.fileno(), copy.fileno(), left)
                    if done == 0:
                        raise CheckpointError(f"ended {left} bytes early while being copied", file=source)
                    left -= done
            except OSError:  # no copy_file_range across these file systems (or at all): through this process
                original.seek(os.lseek(copy.fileno(), 0, os.SEEK_CUR))
                shutil.copyfileobj(original, copy, COPY_PIECE)
            copy.flush()
            os.fsync(copy.fileno())

    def open_shared(self, name: str) -> SharedOutput:
        """A file of this save that every rank writes parts of in place (the parity files)."""
        assert self.work is not None, "prepare() or join() first"
        return SharedOutput(self.work / name)

    def read_range(self, name: str, begin: int, end: int) -> memoryview:
        """Bytes of a file this save wrote and finished (parity is computed from the data files before the
        commit), read from its memory map: the coder reads the page cache itself, with no copy."""
        assert self.work is not None
        with self._maps_lock:
            mapped = self._maps.get(name)
            if mapped is None:
                with open(self.work / name, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    mapped = self._maps[name] = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) if size else b""
            return memoryview(mapped)[begin:end]  # under the lock: release_maps cannot close it before

    def release_maps(self) -> None:
        """Unmap the files read_range mapped (a map still viewed closes once its views are gone)."""
        with self._maps_lock:
            for mapped in self._maps.values():
                if isinstance(mapped, mmap.mmap):
                    with contextlib.suppress(BufferError):
                        mapped.close()
            self._maps.clear()

    def abort(self) -> None:
        """Give up the save: release its marker, so that a cleaner (remove_abandoned) may delete the folder."""
        self._release_marker()

    def remove(self) -> None:
        """Give up the save and delete what it wrote (a single-process save: no other rank writes here)."""
        self._release_marker()
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)

    def _release_marker(self) -> None:
        if self._marker is not None:
            _HELD_MARKERS.discard(self._marker.fileno())
            self._marker.close()
            self._marker = None

    def commit(self, manifest: bytes) -> None:
        """Make the save visible: manifest durable, then the folder renamed to its final name."""
        assert self.work is not None
        _write_durably(self.work / MANIFEST, manifest)
        (self.work / SAVE_MARKER).unlink()
        self._release_marker()
        _fsync_dir(self.work)
        if not self.final.exists():
            os.rename(self.work, self.final)
            _fsync_dir(self.final.parent)
            return
        replaced = self.final.parent / f"{TEMP_PREFIX}replaced-{self.final.name}-{uuid.uuid4().hex[:12]}"
        if _exchange(self.work, self.final):  # one atomic step: the old checkpoint now sits at the work name
            # renamed again so that a cleaner knows it for garbage even once its manifest is deleted
            os.rename(self.work, replaced)
        else:  # no renameat2 here: a short window where neither name holds a checkpoint
            os.rename(self.final, replaced)
            os.rename(self.work, self.final)
        _fsync_dir(self.final.parent)
        # freeing a large checkpoint's blocks takes a while and nothing waits for it
        threading.Thread(target=shutil.rmtree, args=(replaced,), kwargs={"ignore_errors": True}).start()


class FsspecDestination:
    """A prefix in an fsspec file system (s3://, gs://, memory://...); the manifest PUT is the commit.

    Each save writes its files under a generation folder of its own (`GENERATION_PREFIX<id>/`), which the manifest
    names. So overwriting a checkpoint never touches the files of the one it replaces: until the new manifest's
    PUT, the old manifest and all its files stay valid; after it, the old generation's files are deleted."""

    file_prefix = ""  # set by prepare or join: this save's generation folder

    def __init__(self, url: str, *, overwrite: bool = False, storage_options: dict[str, Any] | None = None):
        fsspec = require_for_url(url, feature=f"saving to {url}")
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.overwrite = overwrite
        self._replaced: list[str] = []  # the files of the checkpoint this save replaces, deleted after the commit
        self._committed = False

    def describe(self) -> str:
        return self.url

    def prepare(self) -> str:
        if self.fs.exists(f"{self.root}/{MANIFEST}"):
            if not self.overwrite:
                raise CheckpointError("already holds a checkpoint; pass overwrite=True to replace it", file=self.url)
            self._replaced = self._files_of_committed()
        self.fs.pipe_file(f"{self.root}/{SAVE_MARKER}",
                          json.dumps({"target": self.url, "started": time.time()}).encode())
        token = f"{GENERATION_PREFIX}{uuid.uuid4().hex[:12]}"
        self.join(token)
        return token

    def join(self, token: str) -> None:
        self.file_prefix = f"{token}/"
        self.fs.makedirs(f"{self.root}/{token}", exist_ok=True)  # object stores have no folders: a no-op there

    def _files_of_committed(self) -> list[str]:
        """The files the committed manifest names: data, parity and copies (a damaged manifest names none)."""
        key = f"{self.root}/{MANIFEST}"
        if self.fs.size(key) > MAX_MANIFEST_BYTES:
            return []
        try:
            return sorted(all_files(parse(self.fs.cat_file(key), self.url)))
        except CheckpointError:
            return []  # nothing trustworthy to delete; the new save still commits

    def open(self, name: str) -> OutputFile:
        # s3fs uploads a file written this way in multipart pieces as its buffer fills
        return self.fs.open(f"{self.root}/{name}", "wb", block_size=64 * 1024**2)

    @staticmethod
    def finish_file(f: OutputFile) -> None:
        f.close()  # completes the upload; an object store has no separate fsync

    def read_range(self, name: str, begin: int, end: int) -> bytes:
        return self.fs.cat_file(f"{self.root}/{name}", start=begin, end=end)

    def commit(self, manifest: bytes) -> None:
        try:
            self.fs.pipe_file(f"{self.root}/{MANIFEST}", manifest)
        except Exception:
            if not self._landed(manifest):  # the PUT may have landed though its answer was lost: then it stands
                raise
        self._committed = True  # from here on nothing may undo the save: what follows is tidying up
        named = set(all_files(parse(manifest, self.url)))
        doomed = [f"{self.root}/{name}" for name in self._replaced
                  if name not in named and name not in (MANIFEST, SAVE_MARKER) and _plain_name(name)]
        try:
            self.fs.rm_file(f"{self.root}/{SAVE_MARKER}")
            if doomed:
                self.fs.rm(doomed)
        except Exception as exc:  # committed already: a leftover marker or old file is no failure of the save
            warnings.warn(f"the save to {self.url} committed, but tidying up after it failed: {exc}", stacklevel=2)

    def _landed(self, manifest: bytes) -> bool:
        try:
            return bool(self.fs.cat_file(f"{self.root}/{MANIFEST}") == manifest)
        except Exception:
            return False

    def abort(self) -> None:
        """A failed save's own generation folder goes (never after its commit); the marker stays, saying a save
        never committed here."""
        if self._committed or not self.file_prefix:
            return
        with contextlib.suppress(FileNotFoundError, OSError):
            if self.fs.exists(f"{self.root}/{self.file_prefix}"):
                self.fs.rm(f"{self.root}/{self.file_prefix}", recursive=True)

    def remove(self) -> None:
        self.abort()


def _plain_name(name: str) -> bool:
    """A name a manifest may give its files: relative, below the prefix (an old manifest is not trusted further)."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "://" not in name and ".." not in parts and "" not in parts


Destination = LocalDestination | FsspecDestination


def destination(path: str | os.PathLike[str], *, overwrite: bool = False,
                storage_options: dict[str, Any] | None = None) -> Destination:
    if is_url(path):
        return FsspecDestination(os.fspath(path), overwrite=overwrite, storage_options=storage_options)
    return LocalDestination(path, overwrite=overwrite)


COPY_PIECE = 8 * 1024**2  # bytes per read and write of a copy the kernel could not make itself


# the save markers this process holds locked: children it forks while a save is in flight close their copies
_HELD_MARKERS: set[int] = set()
closed_in_children(_HELD_MARKERS)


def discard_folder(folder: Path) -> None:
    """Delete a committed folder, renamed out of sight first: a crash mid-delete leaves a temporary folder (which
    `remove_abandoned` sweeps), never a checkpoint with its manifest but not all its files."""
    doomed = folder.parent / f"{TEMP_PREFIX}deleting-{folder.name}-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(folder, doomed)
    except FileNotFoundError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def remove_abandoned(folder: Path, *, grace_s: float = 60.0) -> list[Path]:
    """Delete the temporary folders under `folder` that no live save owns; returns what was deleted.

    A save's folder holds a marker its preparing process keeps locked until the commit, so a folder
    whose marker can be locked belongs to a save that died. A temporary folder without a marker is a
    deletion, a replaced checkpoint or a committed save on its way to its name: garbage. A folder still
    being set up (INIT_PREFIX) without its marker yet is left alone until it is `grace_s` old, unless its
    name says it was made on this host by a process that has since died.
    """
    removed = []
    for child in folder.iterdir():
        if not child.name.startswith((TEMP_PREFIX, INIT_PREFIX)) or not child.is_dir():
            continue
        try:
            with open(child / SAVE_MARKER, "rb") as handle:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live save
        except FileNotFoundError:
            try:
                young = time.time() - child.stat().st_mtime < grace_s
                if child.name.startswith(INIT_PREFIX) and young and not _creator_died(child.name):
                    continue
            except FileNotFoundError:
                continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


def _creator_tag() -> str:
    """This host and process, as a folder-name part: `<host, boot and PID namespace hash>-<pid>`."""
    return f"{_HOST}-{os.getpid()}"


def _creator_died(init_name: str) -> bool:
    """Whether an INIT_PREFIX folder was made on this host by a process that no longer runs."""
    host, _, rest = init_name[len(INIT_PREFIX):].partition("-")
    pid = rest.partition("-")[0]
    if host != _HOST or not pid.isdigit():
        return False  # another host's (a shared file system) or an older name: only the grace period says
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _pid_space() -> str:
    """This machine's boot and this process's PID namespace: containers sharing a host name (and a volume) but not
    their process ids get different tags, so one never takes another's living process for a dead one."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


_HOST = _pid_space()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where that is unavailable."""
    renameat2 = getattr(LIBC, "renameat2", None) if LIBC is not None else None
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _write_durably(path: Path, data: bytes) -> None:
    """Write a small file under a temporary name, fsync it and rename it into place."""
    part = path.with_name(path.name + ".part")
    with create_new(part) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(part, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
