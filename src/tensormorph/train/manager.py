"""Which training checkpoints exist under a root folder, which is newest, and which retention deletes.

Decided from manifests only: a checkpoint is a folder whose manifest (its commit) carries a training
record under `extra["tensormorph.train"]`. Folder names and modification times are never trusted.
No collectives here: the Checkpointer decides which rank calls what.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, MissingFileError
from ..storage import LocalFiles
from ..tmformat.checkpoint import read_manifest
from ..tmformat.commit import remove_abandoned
from ..tmformat.manifest import MANIFEST, TEMP_PREFIX

__all__ = ["FOLDER_PREFIX", "TRAIN_KEY", "CheckpointInfo", "CheckpointManager"]

TRAIN_KEY = "tensormorph.train"
FOLDER_PREFIX = "step-"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed training checkpoint, as its manifest describes it."""

    step: int
    path: Path
    time: float  # seconds since the epoch when the save began
    size: int  # bytes: data files and manifest
    world_size: int
    mesh: dict[str, Any] | None  # {"shape": [...], "dim_names": [...]} of the model's DTensors
    seq: int  # commit order within the root folder: newer saves have higher numbers
    components: tuple[str, ...]  # of model, optimizer, scheduler, scaler, data, extra


class CheckpointManager:
    """The committed checkpoints under `root`, and the deletion of those beyond the `keep` newest."""

    def __init__(self, root: str | os.PathLike, keep: int | None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest checkpoint is never deleted), got {keep}")
        if "://" in os.fspath(root):
            raise ValueError(f"{os.fspath(root)!r}: the Checkpointer needs a local (or shared) folder, whose renames "
                             "commit checkpoints; tensormorph.save writes single checkpoints to object stores")
        self.root = Path(root).absolute()
        self.keep = keep
        # parsed manifests by folder, valid while the manifest's (inode, mtime, size) stay the same
        self._cache: dict[Path, tuple[tuple[int, int, int], CheckpointInfo | None]] = {}

    def path(self, step: int) -> Path:
        return self.root / f"{FOLDER_PREFIX}{step:08d}"

    def prepare(self) -> int:
        """Create the root and remove what crashed saves left behind; the highest commit number so far.
        One process (rank 0) calls it."""
        self.root.mkdir(parents=True, exist_ok=True)
        # a save in progress in another process (its marker still locked) is left alone
        remove_abandoned(self.root)
        return max((info.seq for info in self.list()), default=0)

    def list(self) -> list[CheckpointInfo]:
        """Committed training checkpoints under the root, oldest first (by commit order)."""
        found = []
        try:
            children = list(self.root.iterdir())
        except FileNotFoundError:
            return []
        for child in children:
            if child.name.startswith(TEMP_PREFIX) or not child.is_dir():
                continue
            info = self._info(child)
            if info is not None:
                found.append(info)
        return sorted(found, key=lambda i: (i.seq, i.time))

    def latest(self) -> CheckpointInfo | None:
        infos = self.list()
        return infos[-1] if infos else None

    def retain(self) -> None:
        """Delete committed checkpoints beyond the `keep` newest (one process, after a commit). A deletion
        that fails is a warning: the new checkpoint is committed, and an old one that stays is no failure."""
        if self.keep is None:
            return
        try:
            for info in self.list()[:-self.keep]:
                self._delete(info.path)
        except OSError as exc:
            warnings.warn(f"could not delete an old checkpoint under {self.root}: {exc}", stacklevel=2)

    def _delete(self, folder: Path) -> None:
        # renamed out of sight first: a crash mid-delete leaves a temporary folder, never a broken checkpoint
        doomed = self.root / f"{TEMP_PREFIX}deleting-{folder.name}-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(folder, doomed)
        except FileNotFoundError:
            return
        self._cache.pop(folder, None)
        shutil.rmtree(doomed, ignore_errors=True)

    def _info(self, folder: Path) -> CheckpointInfo | None:
        manifest_path = folder / MANIFEST
        try:
            stat = manifest_path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None  # not a checkpoint (or one being deleted right now)
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        cached = self._cache.get(folder)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            manifest = read_manifest(LocalFiles(folder), str(folder))  # size-capped before it is read
        except MissingFileError:
            return None
        except CheckpointError as exc:
            warnings.warn(f"ignoring a checkpoint whose manifest is damaged: {exc}", stacklevel=4)
            return None
        meta = manifest.extra.get(TRAIN_KEY)
        info = None
        if meta is not None:  # other Tensormorph checkpoints in the folder are not training checkpoints
            try:
                info = CheckpointInfo(step=int(meta["step"]), path=folder, time=float(meta["time"]),
                                      size=sum(f.size for f in manifest.files.values()) + stat.st_size,
                                      world_size=manifest.world_size, mesh=meta.get("mesh"), seq=int(meta["seq"]),
                                      components=tuple(meta["components"]))
            except (KeyError, TypeError, ValueError) as exc:
                warnings.warn(f"ignoring a checkpoint whose manifest has an incomplete training record ({exc!r}): "
                              f"{manifest_path}", stacklevel=4)
        self._cache[folder] = (key, info)
        return info
