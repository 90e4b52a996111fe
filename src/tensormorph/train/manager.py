"""Which training checkpoints exist under a root folder, which is newest, and which retention deletes.

Decided from manifests only: a checkpoint is a folder (or an object store's prefix) whose manifest (its commit)
carries a training record under `extra["tensormorph.train"]`. Folder names and modification times are never trusted.
No collectives here: the Checkpointer decides which rank calls what.
"""

from __future__ import annotations

import os
import re
import uuid
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, MissingFileError
from ..storage import AnyPath, RemotePath, as_path, create_new, entries, open_regular, store_at
from ..tmformat.checkpoint import read_manifest
from ..tmformat.commit import discard_folder, remove_abandoned
from ..tmformat.manifest import GENERATION_PREFIX, MANIFEST, MAX_MANIFEST_BYTES, SAVE_MARKER, parse
from ..tmformat.recovery import all_files
from .rollback import read_marker

__all__ = ["ABANDONED_PREFIX", "FOLDER_PREFIX", "TRAIN_KEY", "CheckpointInfo", "CheckpointManager"]

TRAIN_KEY = "tensormorph.train"
FOLDER_PREFIX = "step-"
ABANDONED_PREFIX = "abandoned-"  # a local checkpoint a rollback abandoned: abandoned-step-N-<commit number>
_STEP_FOLDER = re.compile(rf"{FOLDER_PREFIX}\d{{8,}}")  # the names `path` gives
RUN_ID_FILE = ".tensormorph-run"  # in a local root: the run's id, which names its memory snapshots


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed training checkpoint, as its manifest describes it."""

    step: int
    path: AnyPath  # a local folder, or a RemotePath under an object store's root
    time: float  # seconds since the epoch when the save began
    size: int  # bytes: data files and manifest
    world_size: int
    mesh: dict[str, Any] | None  # {"shape": [...], "dim_names": [...]} of the model's DTensors
    seq: int  # commit order within the root folder: newer saves have higher numbers
    components: tuple[str, ...]  # of model, optimizer, scheduler, scaler, data, extra


class CheckpointManager:
    """The committed checkpoints under `root`, and the deletion of those beyond the `keep` newest."""

    def __init__(self, root: str | os.PathLike, keep: int | None,
                 storage_options: dict[str, Any] | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest checkpoint is never deleted), got {keep}")
        # an object store's root is read without the range cache: manifests are small and change
        found = as_path(root, storage_options, cache=False)
        self.root: AnyPath = found.absolute() if isinstance(found, Path) else found
        self.keep = keep
        # parsed manifests by folder, valid while the manifest's fingerprint (size, mtime or ETag) stays the same
        self._cache: dict[str, tuple[tuple[int, int | str], CheckpointInfo | None]] = {}

    @property
    def url(self) -> str | None:
        """The root's URL when it is on an object store, else None."""
        return None if isinstance(self.root, Path) else str(self.root)

    def path(self, step: int) -> AnyPath:
        return self.root / f"{FOLDER_PREFIX}{step:08d}"

    def run_id(self, *, create: bool = False) -> str:
        """The id of the run whose checkpoints live under a local root (made once, kept in RUN_ID_FILE), so that
        a new run in a deleted and re-created folder is not taken for the old one; "" for an object store's."""
        if not isinstance(self.root, Path):
            return ""
        path = self.root / RUN_ID_FILE
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        if create and not path.exists():
            try:  # never through a link: the root is the user's folder
                with create_new(path) as handle:
                    handle.write(uuid.uuid4().hex.encode())
            except FileExistsError:
                pass
        try:
            descriptor = open_regular(path, follow=False)
        except MissingFileError:
            return ""
        with os.fdopen(descriptor, "rb") as handle:
            return handle.read(64).decode(errors="replace").strip()

    def prepare(self) -> int:
        """Create the root and remove what crashed saves left behind; the highest commit number so far.
        One process (rank 0) calls it."""
        if isinstance(self.root, Path):
            self.root.mkdir(parents=True, exist_ok=True)
            # a save in progress in another process (its marker still locked) is left alone
            remove_abandoned(self.root)
        marker = read_marker(self.root)  # commits abandoned by a rollback keep their numbers: never reused
        return max([marker.max_seq if marker else 0, *(info.seq for info in self.list())])

    def sweep_uploads(self) -> list[str]:
        """On an object store, delete what uploads killed before their commit left under the root: a step's
        generation folders its manifest does not name and its save marker, and step prefixes holding files but
        no manifest. Returns
        the keys deleted. The prefix belongs to one run, whose one copying process calls this before it copies:
        an upload in flight elsewhere would be taken for a dead one."""
        if not isinstance(self.root, RemotePath):
            return []
        fs = self.root.remote.fs
        try:
            prefixes = fs.ls(self.root.remote.path(self.root.url), detail=False, refresh=True)
        except FileNotFoundError:
            return []  # nothing was ever copied there
        doomed = []
        for prefix in prefixes:
            if not _STEP_FOLDER.fullmatch(prefix.rstrip("/").rsplit("/", 1)[-1]):
                continue
            children = {key.rstrip("/").rsplit("/", 1)[-1]: key for key in fs.ls(prefix, detail=False, refresh=True)}
            if MANIFEST not in children:
                doomed.append(prefix)
                continue
            try:
                if fs.size(children[MANIFEST]) > MAX_MANIFEST_BYTES:
                    continue
                named = {name.split("/", 1)[0] for name in all_files(parse(fs.cat_file(children[MANIFEST]), prefix))}
            except CheckpointError:
                continue  # a damaged manifest says nothing trustworthy about its files: leave them
            doomed += [key for name, key in children.items()
                       if (name.startswith(GENERATION_PREFIX) and name not in named) or name == SAVE_MARKER]
        for key in doomed:
            fs.rm(key, recursive=True)
        return doomed

    def list(self) -> list[CheckpointInfo]:
        """Committed training checkpoints under the root, oldest first (by commit order)."""
        found = []
        if isinstance(self.root, RemotePath):  # other processes save and delete under it: ask afresh each time
            self.root.remote.forget(self.root.url)
        marker = read_marker(self.root)
        for child in entries(self.root):
            if not _STEP_FOLDER.fullmatch(child.name) or not child.is_dir():
                continue
            info = self._info(child)
            if info is not None and not (marker and marker.abandons(info.step, info.seq)):
                found.append(info)
        return sorted(found, key=lambda i: (i.seq, i.time))

    def latest(self) -> CheckpointInfo | None:
        infos = self.list()
        return infos[-1] if infos else None

    def retain(self, protect: Collection[str] = ()) -> None:
        """Delete committed checkpoints beyond the `keep` newest (one process, after a commit), except those whose
        path is in `protect` (being copied to another tier). A deletion that fails is a warning: the new
        checkpoint is committed, and an old one that stays is no failure."""
        if self.keep is None:
            return
        try:
            marker = read_marker(self.root)
            target = (marker.step, marker.seq) if marker else None  # the step a rollback went back to stays
            for info in self.list()[:-self.keep]:
                if str(info.path) not in protect and (info.step, info.seq) != target:
                    self.delete(info.path)
        except (OSError, CheckpointError) as exc:
            warnings.warn(f"could not delete an old checkpoint under {self.root}: {exc}", stacklevel=2)

    def abandon(self, info: CheckpointInfo) -> AnyPath:
        """Move a local checkpoint out of the run's sight (`abandoned-step-N-<commit>`), kept whole; an object
        store's stays where it is, left out by the rollback marker. Where it is now."""
        if isinstance(info.path, RemotePath):
            return info.path
        kept = info.path.parent / f"{ABANDONED_PREFIX}{info.path.name}-{info.seq}"
        os.rename(info.path, kept)
        self._cache.pop(str(info.path), None)
        return kept

    def delete(self, folder: AnyPath) -> None:
        """Delete a checkpoint: an object store's manifest first, a local folder renamed out of sight first."""
        self._cache.pop(str(folder), None)
        if isinstance(folder, RemotePath):
            # the manifest first: from then on the prefix is no checkpoint, whatever of its files remain
            fs, key = folder.remote.fs, folder.remote.path(folder.url)
            fs.rm_file(f"{key}/{MANIFEST}")
            fs.rm(key, recursive=True)
            return
        discard_folder(folder)

    def _info(self, folder: AnyPath) -> CheckpointInfo | None:
        files = store_at(folder)
        try:
            _, manifest_size, version = files.fingerprint(MANIFEST)
        except (MissingFileError, NotADirectoryError, FileNotFoundError):
            return None  # not a checkpoint (or one being deleted right now)
        key = (manifest_size, version)
        cached = self._cache.get(str(folder))
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            manifest = read_manifest(files, str(folder))  # size-capped before it is read
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
                                      size=sum(f.size for f in manifest.files.values()) + manifest_size,
                                      world_size=manifest.world_size, mesh=meta.get("mesh"), seq=int(meta["seq"]),
                                      components=tuple(meta["components"]))
            except (KeyError, TypeError, ValueError) as exc:
                warnings.warn(f"ignoring a checkpoint whose manifest has an incomplete training record ({exc!r}): "
                              f"{folder / MANIFEST}", stacklevel=4)
        self._cache[str(folder)] = (key, info)
        return info
