"""Rolling a run back: the checkpoints committed after a step are abandoned, and the next resume starts there.

Nothing is deleted unless asked. A marker file in the root (and in the object store's, when there is one) names
the target and the abandoned checkpoints by step and commit number; `CheckpointManager.list` leaves those out,
so resume, retention and the listing no longer see them, and retention never deletes the target. New saves go
on numbering commits after everything ever committed, so a new checkpoint of a step that was abandoned (the
same folder name, written anew) is not taken for the abandoned one. Memory snapshots of later steps on this
machine are released; those on other machines are left out by the next resume, which then forgets them.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, MissingFileError, UnsafePathError
from ..storage import AnyPath, RemotePath, open_regular, replace_file
from .liveness import quiet_run

__all__ = ["ROLLBACK_FILE", "RollbackMarker", "read_marker", "roll_back", "write_marker"]

ROLLBACK_FILE = ".tensormorph-rollback.json"  # in a run's root: the last rollback
MAX_MARKER_BYTES = 4 << 20  # a marker naming ~50,000 abandoned checkpoints; anything larger is not ours


@dataclass
class RollbackMarker:
    step: int  # the step rolled back to
    seq: int  # its commit number
    abandoned: list[tuple[int, int]] = field(default_factory=list)  # (step, commit number), every rollback's
    max_seq: int = 0  # the highest commit number ever given: new saves number after it
    resumed: bool = False  # a resume has happened since: memory snapshots of later steps are new ones again

    def abandons(self, step: int, seq: int) -> bool:
        return (step, seq) in self._abandoned_set

    @property
    def _abandoned_set(self) -> set[tuple[int, int]]:
        return set(self.abandoned)


def read_marker(root: AnyPath) -> RollbackMarker | None:
    """The run's rollback marker, or None; a damaged one is an error naming it (it decides what resume sees)."""
    where = f"{root}/{ROLLBACK_FILE}"
    try:
        if isinstance(root, RemotePath):
            fs, key = root.remote.fs, f"{root.remote.path(root.url)}/{ROLLBACK_FILE}"
            if not fs.exists(key):
                return None
            data = fs.cat_file(key, start=0, end=MAX_MARKER_BYTES + 1)
        else:
            path = Path(root) / ROLLBACK_FILE
            if not os.path.lexists(path):
                return None
            descriptor = open_regular(path, follow=False)
            with os.fdopen(descriptor, "rb") as handle:
                data = handle.read(MAX_MARKER_BYTES + 1)
        if len(data) > MAX_MARKER_BYTES:
            raise ValueError(f"larger than {MAX_MARKER_BYTES} bytes")
        raw = json.loads(data)
        return RollbackMarker(int(raw["step"]), int(raw["seq"]),
                              [(int(s), int(q)) for s, q in raw["abandoned"]], int(raw["max_seq"]),
                              bool(raw["resumed"]))
    except UnsafePathError:
        raise CheckpointError("the rollback marker is a link, which is not followed; replace it with the file or "
                              "delete it", file=where) from None
    except MissingFileError as exc:  # a folder or a device where the marker should be
        raise CheckpointError(f"the rollback marker {exc.reason}; delete it", file=where) from None
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"the rollback marker is damaged ({type(exc).__name__}: {str(exc)[:200]}); fix or "
                              "delete it", file=where) from None


def write_marker(root: AnyPath, marker: RollbackMarker) -> None:
    """Replace the run's marker atomically (a new file renamed over it; never through a link)."""
    data = json.dumps(asdict(marker)).encode()
    if isinstance(root, RemotePath):
        root.remote.fs.pipe_file(f"{root.remote.path(root.url)}/{ROLLBACK_FILE}", data)
        return
    try:
        replace_file(Path(root) / ROLLBACK_FILE, data, durable=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write the rollback marker: {exc.strerror or exc}", file=str(root)) from None


def roll_back(root: str | os.PathLike[str], step: int, *, delete: bool = False,
              memory_dir: str | os.PathLike[str] | None = None, remote: str | None = None,
              remote_storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Abandon every checkpoint committed after the one of `step` under `root` (and on the object store `remote`),
    release this machine's memory snapshots of later steps, and (with `delete`) delete the abandoned checkpoints.
    Refused while a process of the run is alive. Returns what was done, as plain values."""
    from .manager import CheckpointManager  # the manager reads the marker this module writes
    from .memory import run_folder, survey

    managers = [CheckpointManager(root, None)]
    if remote is not None:
        managers.append(CheckpointManager(remote, None, remote_storage_options))
    local = managers[0]
    folder = run_folder(local.root, memory_dir, local.run_id())
    ranks = survey(folder) if folder.is_dir() else []
    if any(r.alive for r in ranks):
        raise CheckpointError("a process of the run is alive (its Checkpointer holds its memory snapshots); stop "
                              "the run before rolling it back", file=str(local.root))
    # held exclusively meanwhile: a Checkpointer that saved or resumed holds it shared until it closes
    with quiet_run(local.root) if isinstance(local.root, Path) else contextlib.nullcontext():
        return _abandon_after(managers, folder, root, step, delete)


def _abandon_after(managers: list[Any], folder: Path, root: str | os.PathLike[str], step: int,
                   delete: bool) -> dict[str, Any]:
    """Mark, then set aside or delete, every checkpoint committed after `step`'s (the run is quiet)."""
    from .memory import drop_later, rank_folders

    local = managers[0]
    listed = [m.list() for m in managers]
    befores = [marker for marker in (read_marker(m.root) for m in managers) if marker is not None]
    instances = [i for infos in listed for i in infos if i.step == step]
    if not instances:
        steps = sorted({i.step for infos in listed for i in infos})
        raise CheckpointError(f"has no committed checkpoint of step {step} to roll back to (steps: {steps})",
                              file=str(local.root))
    target = max(instances, key=lambda i: i.seq)
    later = [(m, i) for m, infos in zip(managers, listed, strict=True) for i in infos if i.seq > target.seq]
    # every earlier rollback's, whichever tier kept its marker (a fresh local root has none of them)
    marker = RollbackMarker(step, target.seq,
                            sorted({*(pair for b in befores for pair in b.abandoned),
                                    *((i.step, i.seq) for _, i in later)}),
                            max([*(b.max_seq for b in befores), *(i.seq for infos in listed for i in infos)]))
    for manager in managers:  # first: from here on no resume takes a later checkpoint
        write_marker(manager.root, marker)
    kept: list[str | None] = []
    for manager, info in later:
        try:
            if delete:
                manager.delete(info.path)
                kept.append(None)
            else:
                kept.append(str(manager.abandon(info)))
        except OSError as exc:  # the marker already leaves it out: say what could not be moved or deleted
            raise CheckpointError(f"rolled back, but step {info.step} could not be "
                                  f"{'deleted' if delete else 'set aside'}: {exc.strerror or exc}",
                                  file=str(info.path)) from None
    released = sum(drop_later(rank_folder, step) for rank_folder in rank_folders(folder))
    return {"run": str(root), "step": step, "seq": target.seq, "deleted": delete,
            "abandoned": [{"step": i.step, "seq": i.seq, "kept_at": path}
                          for (_, i), path in zip(later, kept, strict=True)],
            "memory_snapshots_released": released}
