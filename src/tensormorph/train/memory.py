"""The host-memory tier: each rank's own training state in node-local shared memory, outliving the process.

A snapshot is a Tensormorph checkpoint written by one rank alone, of what that rank holds: its DTensors' local
shards as plain tensors, its plain values, and their layouts (global shape, mesh, placements) in the manifest.
It lives on tmpfs (`/dev/shm` by default: POSIX shared memory), under a name made from the run's root and the
node, so a process that is SIGKILLed and restarted on the same node finds it, and nothing else does:

    <memory_dir>/<run id>/<node>/rank-00003/step-00000120/   manifest.json, rank-00000.safetensors

Writing takes no collective: each rank commits its own snapshot (the same atomic commit as a disk save) and a
step is complete when every rank has committed it, which `Resumer` decides by asking every rank. A snapshot
resumes only the same world size, mesh and placements; anything else resumes from disk. A lock file held
while a Checkpointer lives tells `tensormorph tiers clean` that the run is alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from .. import dtypes
from ..distributed.state import dtensor_types, flatten, placement_text
from ..errors import CheckpointError, StateMismatchError
from ..storage import AnyPath, LocalFiles
from ..tmformat.checkpoint import read_manifest
from ..tmformat.commit import discard_folder, remove_abandoned
from ..tmformat.manifest import MANIFEST, decode_value, encode_value
from ..tmformat.reader import BoxReader
from ..tmformat.writer import Piece, SaveTransaction
from ..torch_arrays import as_numpy, cpu_contiguous, to_torch, vocabulary

__all__ = ["DEFAULT_MEMORY_DIR", "MemoryTier", "RankSnapshots", "drop_later", "node_name", "rank_folders", "run_folder",
           "survey"]

DEFAULT_MEMORY_DIR = f"/dev/shm/tensormorph-{os.getuid()}"  # one per user: others can neither read nor plant
NODE_VARIABLE = "TENSORMORPH_NODE"  # names this process's node (tests simulate several nodes on one machine)
LAYOUT_KEY = "tensormorph.layout"  # in a snapshot's manifest: each DTensor's global shape, mesh and placements
LOCK_FILE = ".alive"
_STEP = re.compile(r"^step-(\d{8,})$")
HELD = re.compile(r"^peer-(\d{5})$")  # a rank folder's copies of another rank's snapshots (peers.py)


def node_name() -> str:
    return os.environ.get(NODE_VARIABLE) or socket.gethostname()


def run_folder(root: AnyPath, memory_dir: str | os.PathLike[str] | None = None, run_id: str = "") -> Path:
    """Where the memory snapshots of the run under `root` (of id `run_id`) live on this machine."""
    text = str(root) + run_id
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", text.rstrip("/").rsplit("/", 1)[-1])[:40] or "run"
    return Path(memory_dir or DEFAULT_MEMORY_DIR) / f"{label}-{hashlib.sha1(text.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class Snapshot:
    step: int
    path: Path


class MemoryTier:
    """This rank's snapshots: written, listed, loaded back and released."""

    def __init__(self, root: AnyPath, rank: int, *, keep: int = 2, memory_dir: str | os.PathLike[str] | None = None,
                 node: str | None = None, run_id: str = "") -> None:
        if keep < 1:
            raise ValueError(f"memory_keep must be at least 1, got {keep}")
        self.keep = keep
        self.node = node or node_name()
        self.folder = run_folder(root, memory_dir, run_id) / self.node / f"rank-{rank:05d}"
        _private_folder(self.folder)
        remove_abandoned(self.folder)  # a snapshot whose writer was killed mid-way
        descriptor = os.open(self.folder / LOCK_FILE, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        self._lock: IO[bytes] | None = os.fdopen(descriptor, "ab")  # held while the run is alive
        fcntl.flock(self._lock.fileno(), fcntl.LOCK_SH)

    def snapshots(self) -> list[Snapshot]:
        """This rank's committed snapshots, oldest first."""
        return committed(self.folder)

    def nbytes(self) -> int:
        """Shared memory this rank's snapshots take."""
        return sum(_bytes_of(s.path) for s in self.snapshots())

    def save(self, step: int, state: dict[str, Any], extra: dict[str, Any],
             versions: Mapping[str, int] | None = None) -> Path:
        """Write this rank's part of `state` (DTensors as their local shards) as the snapshot of `step`, then
        release the snapshots beyond the `keep` newest. `versions`: tensors of training's own, written in place
        of a copy, each with its version counter when the save began; one changed before its bytes were all
        written fails the save (the snapshot would mix two steps)."""
        path = self.folder / f"step-{step:08d}"
        leaves = flatten(state)
        dtensor = dtensor_types()
        layouts, pieces, data = {}, [], {}
        for name, tensor in leaves.tensors.items():
            local = tensor
            if dtensor and isinstance(tensor, dtensor[0]):
                local = tensor.to_local()
                layouts[name] = _layout(tensor)
            piece = Piece(name, vocabulary(local.dtype), tuple(local.shape), (0,) * local.dim(), tuple(local.shape), 0)
            pieces.append(piece)
            data[name] = local
        save = SaveTransaction(path, overwrite=True, extra={**extra, LAYOUT_KEY: layouts})
        save.plan(pieces)
        save.join(save.prepare())
        try:
            objects = {name: encode_value(value, name) for name, value in leaves.objects.items()}
            written = save.write_rank(0, [(p, _blocks(p.name, data[p.name], p.dtype, (versions or {}).get(p.name)))
                                          for p in save.written_by(0, pieces)],
                                      objects)
            save.commit([written], [{}], {name: decode_value(v) for name, v in objects.items()})
        except BaseException:
            save.remove()
            raise
        for old in self.snapshots()[:-self.keep]:
            with contextlib.suppress(OSError):  # the new snapshot is committed: an old one that stays is no failure
                discard_folder(old.path)
        return path

    def load(self, snapshot: Path, target: dict[str, Any], *, strict: bool = True) -> dict[str, Any]:
        """Fill `target` in place from a snapshot (its DTensors' local shards, checked against their saved
        layout; every block checksum verified); returns the snapshot's `extra`. Strict: what the snapshot holds
        and `target` does not is a mismatch too, as a disk checkpoint's load would say."""
        files = LocalFiles(snapshot)
        manifest = read_manifest(files, str(snapshot))
        layouts = manifest.extra.get(LAYOUT_KEY, {})
        leaves = flatten(target)
        dtensor = dtensor_types()
        problems = [f"{name}: not in the snapshot" for name in leaves.tensors if name not in manifest.tensors]
        problems += [f"{name}: not in the snapshot" for name in leaves.objects if name not in manifest.objects]
        if strict:
            given = {*leaves.tensors, *leaves.objects}
            problems += [f"{name}: in the snapshot, not in the state given"
                         for name in (*manifest.tensors, *manifest.objects) if name not in given]
        with BoxReader(manifest, files, str(snapshot)) as reader:
            for name, tensor in leaves.tensors.items():
                record = manifest.tensors.get(name)
                if record is None:
                    continue
                local = tensor
                if dtensor and isinstance(tensor, dtensor[0]):
                    local = tensor.to_local()
                    if layouts.get(name) != _layout(tensor):
                        problems.append(f"{name}: laid out as {_layout(tensor)}, the snapshot as {layouts.get(name)}")
                        continue
                if (record.dtype, record.shape) != (vocabulary(local.dtype), tuple(local.shape)):
                    problems.append(f"{name}: {record.dtype} {list(record.shape)} in the snapshot, "
                                    f"{vocabulary(local.dtype)} {list(local.shape)} here")
                    continue
                _fill(reader, name, local, record.dtype)
        if problems:
            raise StateMismatchError(f"the memory snapshot does not fit this run: {'; '.join(problems[:5])}",
                                     file=str(snapshot))
        for name, (container, key) in leaves.slots.items():
            container[key] = manifest.objects[name]
        return manifest.extra

    def forget_after(self, step: int) -> None:
        """Drop this rank's snapshots and held copies of steps after `step`: a run resumed at `step` abandoned
        them, and its own next saves must not rank below them."""
        drop_later(self.folder, step)

    def release(self) -> None:
        """Delete every snapshot of this rank (a finished run's memory goes back to the system)."""
        self.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        for empty in (self.folder.parent, self.folder.parent.parent):  # the node's and the run's, once unused
            try:
                empty.rmdir()
            except OSError:
                break

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def drop_later(rank_folder: Path, step: int) -> int:
    """Delete a rank folder's snapshots and held copies of steps after `step`; how many. A folder that is a link
    or another user's is never entered (anyone can plant one in /dev/shm); one that will not go stays, unharmed."""
    dropped = 0
    for folder in [rank_folder, *(p for p in sorted(rank_folder.glob("peer-*")) if _owned(p))]:
        for child in folder.glob("step-*"):
            match = _STEP.match(child.name)
            if match and int(match.group(1)) > step:
                with contextlib.suppress(OSError):
                    discard_folder(child)
                    dropped += 1
    return dropped


def rank_folders(folder: Path) -> list[Path]:
    """The rank folders of a run's memory folder (`run_folder`), every level a real folder of this user's: a link
    or another user's folder planted in the shared memory folder is never listed, entered or deleted through."""
    if not (_owned(folder.parent) and _owned(folder)):
        return []
    return [rank for node in sorted(folder.iterdir()) if _owned(node)
            for rank in sorted(node.glob("rank-*")) if _owned(rank)]


def _owned(path: Path) -> bool:
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def _private_folder(folder: Path) -> None:
    """Make `folder` (and its parents under the memory folder) for this user alone; refuse one that is a link or
    belongs to someone else, who could otherwise read the snapshots or plant one."""
    levels = [*reversed([folder, *folder.parents][:4])]  # the memory folder itself, then run, node and rank
    levels[0].parent.mkdir(parents=True, exist_ok=True)
    for level in levels:  # each checked before anything is made inside it: never through a link
        with contextlib.suppress(FileExistsError):
            level.mkdir(mode=0o700)
        info = level.lstat()
        if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid():
            raise CheckpointError(f"the memory folder {level} is a link or belongs to another user: snapshots are "
                                  "kept only in a folder of this user's own")


def _layout(tensor: Any) -> dict[str, Any]:
    """What a local shard's meaning depends on: the global shape, the mesh (its shape and which rank sits where
    in it) and the placements."""
    mesh = tensor.device_mesh
    return {"shape": list(tensor.shape), "mesh": list(mesh.shape), "ranks": mesh.mesh.flatten().tolist(),
            "placements": [placement_text(p) for p in tensor.placements]}


def _blocks(name: str, tensor: torch.Tensor, dtype: str, version: int | None) -> Any:
    def blocks() -> Any:
        yield as_numpy(cpu_contiguous(tensor), dtype).reshape(-1)
        if version is not None and tensor._version != version:  # asked for once the bytes went out
            raise CheckpointError("was changed in place while its memory snapshot was written (only the optimizer's "
                                  "step may change it then, and it waits for the snapshot); the snapshot was not kept",
                                  tensor=name)
    return blocks


def _fill(reader: BoxReader, name: str, local: torch.Tensor, dtype: str) -> None:
    box = ((0,) * local.dim(), tuple(local.shape))
    if local.device.type == "cpu" and local.is_contiguous():
        reader.read_box(name, box, as_numpy(local.detach(), dtype))
        return
    data = np.empty(box[1], dtypes.numpy_dtype(dtype))
    reader.read_box(name, box, data)
    with torch.no_grad():
        local.copy_(to_torch(data, dtype))


@dataclass(frozen=True)
class RankSnapshots:
    """What one rank of a run left in this machine's shared memory."""

    node: str
    rank: int
    steps: tuple[int, ...]
    nbytes: int  # its own snapshots and the copies it holds
    alive: bool  # its Checkpointer still holds the lock: the run is running
    held: dict[int, tuple[int, ...]] = field(default_factory=dict)  # peer copies it holds: steps by origin rank


def survey(folder: Path) -> list[RankSnapshots]:
    """Every rank's snapshots under a run's memory folder (`run_folder`), by node and rank."""
    found = []
    for rank_folder in rank_folders(folder):
        snapshots = committed(rank_folder)
        copies = {int(held.name[5:]): committed(held) for held in sorted(rank_folder.glob("peer-*"))
                  if HELD.match(held.name) and _owned(held)}
        nbytes = sum(_bytes_of(s.path) for s in [*snapshots, *(c for steps in copies.values() for c in steps)])
        found.append(RankSnapshots(rank_folder.parent.name, int(rank_folder.name[5:]),
                                   tuple(s.step for s in snapshots), nbytes, _locked(rank_folder / LOCK_FILE),
                                   {origin: tuple(c.step for c in steps) for origin, steps in copies.items()}))
    return found


def committed(folder: Path) -> list[Snapshot]:
    """The committed snapshots (a `step-N` folder holding its manifest) in `folder`, oldest first."""
    found = []
    for child in folder.iterdir():
        match = _STEP.match(child.name)
        if match and (child / MANIFEST).is_file():
            found.append(Snapshot(int(match.group(1)), child))
    return sorted(found, key=lambda s: s.step)


def _bytes_of(snapshot: Path) -> int:
    return sum(f.stat().st_size for f in snapshot.iterdir() if f.is_file())


def _locked(lock: Path) -> bool:
    try:
        with os.fdopen(os.open(lock, os.O_RDONLY | os.O_NOFOLLOW), "rb") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
    except FileNotFoundError:
        pass
    return False
