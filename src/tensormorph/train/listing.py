"""A run's steps and the tiers that hold each: this machine's shared memory (own snapshots and peer copies), the
local disk and the object store. What `tensormorph list` prints and the viewer's run panel shows.

It reads only folder listings, lock files and manifests: no data file is opened, and nothing is changed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .manager import CheckpointInfo, CheckpointManager
from .memory import RankSnapshots, run_folder, survey

__all__ = ["RunListing", "StepTiers", "list_run"]


@dataclass(frozen=True)
class StepTiers:
    """Where one step of a run lives."""

    step: int
    memory: tuple[int, ...]  # ranks holding their own snapshot of it on this machine
    copies: tuple[int, ...]  # ranks whose snapshot of it survives only as a peer's copy on this machine
    memory_complete: bool  # every rank of the run can resume it from memory (its own or a copy)
    disk: CheckpointInfo | None
    remote: CheckpointInfo | None

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers a resume could read it from, fastest first."""
        memory = ("peer" if self.copies else "memory",) if self.memory_complete else ()
        return (*memory, *(("disk",) if self.disk else ()), *(("remote",) if self.remote else ()))


@dataclass(frozen=True)
class RunListing:
    root: str
    memory_folder: Path
    ranks: list[RankSnapshots]  # what this machine's shared memory holds, by node and rank
    world_size: int  # the run's ranks: its newest checkpoint's, or more when memory shows more
    steps: list[StepTiers]  # oldest first
    remote: str | None
    remote_error: str | None  # why the object store could not be listed

    @property
    def alive(self) -> bool:
        return any(r.alive for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.root, "memory_folder": str(self.memory_folder), "world_size": self.world_size,
                "alive": self.alive, "remote": self.remote, "remote_error": self.remote_error,
                "steps": [{"step": s.step, "tiers": list(s.tiers),
                           "memory": {"ranks": list(s.memory), "copies": list(s.copies),
                                      "complete": s.memory_complete},
                           "disk": _info(s.disk), "remote": _info(s.remote)} for s in self.steps],
                "ranks": [{"node": r.node, "rank": r.rank, "steps": list(r.steps), "bytes": r.nbytes,
                           "alive": r.alive, "holds": {str(o): list(steps) for o, steps in r.held.items()}}
                          for r in self.ranks]}


def list_run(root: str | os.PathLike[str], *, memory_dir: str | os.PathLike[str] | None = None,
             remote: str | None = None, storage_options: dict[str, Any] | None = None,
             remote_storage_options: dict[str, Any] | None = None) -> RunListing:
    """The steps of the run under `root` (a Checkpointer's root) with the tiers that hold each. An object store
    that cannot be listed is reported in `remote_error`, never raised: the other tiers still answer."""
    manager = CheckpointManager(root, None, storage_options)
    folder = run_folder(manager.root, memory_dir, manager.run_id())
    ranks = survey(folder) if folder.is_dir() else []
    disk = {i.step: i for i in manager.list()}
    stored: dict[int, CheckpointInfo] = {}
    remote_error = None
    if remote is not None:
        try:
            stored = {i.step: i for i in CheckpointManager(remote, None, remote_storage_options).list()}
        except CheckpointError as exc:
            remote_error = str(exc)
    newest = max([*disk.values(), *stored.values()], key=lambda i: i.time, default=None)
    seen = [r.rank for r in ranks] + [origin for r in ranks for origin in r.held]  # a lost node's ranks by copies
    world = max(newest.world_size if newest is not None else 0, max(seen, default=-1) + 1)
    own: dict[int, set[int]] = {}
    copied: dict[int, set[int]] = {}
    for rank in ranks:
        for step in rank.steps:
            own.setdefault(step, set()).add(rank.rank)
        for origin, held in rank.held.items():
            for step in held:
                copied.setdefault(step, set()).add(origin)
    steps = []
    for step in sorted({*own, *copied, *disk, *stored}):
        mine, copies = own.get(step, set()), copied.get(step, set()) - own.get(step, set())
        complete = world > 0 and mine | copies >= set(range(world))
        steps.append(StepTiers(step, tuple(sorted(mine)), tuple(sorted(copies)), complete, disk.get(step),
                               stored.get(step)))
    return RunListing(str(root), folder, ranks, world, steps, remote, remote_error)


def _info(info: CheckpointInfo | None) -> dict[str, Any] | None:
    if info is None:
        return None
    return {"path": str(info.path), "time": info.time, "bytes": info.size, "seq": info.seq,
            "world_size": info.world_size}
