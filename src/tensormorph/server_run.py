"""A training run in the viewer (issue 18): `tensormorph view RUN` on a Checkpointer's root serves the run's newest
checkpoint as `a`, lists every step with the tiers that hold it (train/listing.py, afresh on each request: a live
run changes), and opens a step from the disk or the object store as `b`, beside it (docs/viewer-api.md).

A step is chosen by its number and tier, never by a path: only the folders the listing returns are opened, a local
one only when it lies inside the run's root, a remote one only under the run's object store. tensormorph.train
(and so torch) is imported only once a run is served: the viewer of a plain checkpoint needs no torch.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from .core import DEFAULT_READ_BUDGET, Checkpoint
from .errors import CheckpointError, MissingFileError, UnsafePathError
from .extras import require
from .formats import detect, open_checkpoint
from .server_request import ApiError, choice_param, int_param
from .storage import AnyPath, as_path, is_url

if TYPE_CHECKING:
    from .server import Viewer
    from .train.listing import RunListing, StepTiers

# How train/manager.py names a run's id file and its step folders (RUN_ID_FILE, FOLDER_PREFIX + 8 digits). Not
# imported from there: tensormorph.train imports torch, and telling a run from a mistyped path must not need it.
RUN_ID_FILE = ".tensormorph-run"
STEP_FOLDER = re.compile(r"step-\d{8}")
OPENABLE = ("disk", "remote")  # the tiers a step opens from: a memory snapshot holds one rank's shards only
NEWEST_ID = "a"  # the run's newest checkpoint, opened at start
STEP_ID = "b"  # the step picked in the run panel, replaced by the next pick
TIER_WORDS = {"memory": "in memory", "peer": "in a peer's memory", "disk": "on disk", "remote": "in the object store"}


def is_run(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a Checkpointer's root: a local folder holding the run's id file or step folders that is
    no checkpoint itself (a folder that is one opens as before). Reads one folder listing, and detection."""
    if is_url(path):
        return False
    folder = Path(path)
    try:
        with os.scandir(folder) as found:
            marked = any(e.name == RUN_ID_FILE or (STEP_FOLDER.fullmatch(e.name) and e.is_dir()) for e in found)
    except OSError:  # no folder, unreadable: opening it says why
        return False
    return marked and detect(folder) is None


@dataclass
class RunView:
    """The run a viewer serves: list_run's arguments (the object store's options: None takes those
    `storage.remote_options` set), and the read budget of the checkpoints opened from it."""

    root: Path
    memory_dir: str | None = None
    remote: str | None = None
    read_budget: int = DEFAULT_READ_BUDGET
    remote_storage_options: dict[str, Any] | None = None
    opening: threading.Lock = field(default_factory=threading.Lock, repr=False)  # one step opened at a time

    def __post_init__(self) -> None:
        self.root = Path(self.root).absolute()

    def listing(self) -> RunListing:
        require("torch", "torch", feature="a training run in the viewer")
        from .train.listing import list_run

        return list_run(self.root, memory_dir=self.memory_dir, remote=self.remote,
                        remote_storage_options=self.remote_storage_options)

    def newest(self) -> AnyPath:
        """The folder the viewer opens first: the newest step on disk, else the newest in the object store."""
        listing = self.listing()
        for tier in OPENABLE:
            held = [s for s in listing.steps if _info(s, tier) is not None]
            if held:
                return self.folder(held[-1].step, tier, listing)
        where = "on disk" + (f" or in {self.remote}" if self.remote else "")
        memory = [s.step for s in listing.steps]
        only = f"; steps {memory} are in memory only (`tensormorph list` shows them)" if memory else ""
        raise MissingFileError(f"a training run with no checkpoint {where} to view{only}", file=str(self.root))

    def folder(self, step: int, tier: str | None, listing: RunListing | None = None) -> AnyPath:
        """The folder of `step` on `tier` (None: the disk, else the object store) as the listing returns it;
        MissingFileError when no such tier holds it, UnsafePathError when the folder lies outside the run."""
        listing = listing or self.listing()
        found = next((s for s in listing.steps if s.step == step), None)
        if found is None:
            raise MissingFileError(f"no step {step} in the run; its steps: {[s.step for s in listing.steps]}",
                                   file=str(self.root))
        tier = tier or next((t for t in OPENABLE if _info(found, t) is not None), None)
        info = _info(found, tier) if tier else None
        if info is None:
            wanted = TIER_WORDS[tier] if tier else "on disk or in the object store"
            held = ", ".join(TIER_WORDS[t] for t in found.tiers) or "memory on some ranks only"
            why = "" if tier else ": a memory snapshot holds one rank's shards, not a checkpoint to view"
            raise MissingFileError(f"step {step} is not {wanted} (it is {held}){why}", file=str(self.root))
        path = info.path
        if isinstance(path, Path):
            real, inside = path.resolve(), self.root.resolve()
            if real.parent != inside:
                raise UnsafePathError(f"step {step} is at {real}, outside the run's folder {inside}: not opened",
                                      file=str(path))
        elif self.remote is None or not str(path).startswith(f"{self._remote_root().rstrip('/')}/"):
            raise UnsafePathError(f"step {step} is not under the run's object store {self.remote}: not opened",
                                  file=str(path))
        return path

    def _remote_root(self) -> str:
        return str(as_path(self.remote or "", self.remote_storage_options, cache=False))

    def open(self, state: Any, step: int, tier: str | None) -> tuple[str, Checkpoint]:
        """The id and checkpoint that serve `step`: those already served from its folder, else STEP_ID opened by a
        new viewer put in `state` (the app's), which shares the tile cache, beside the run's newest checkpoint as a
        (reopened when the Timeline put another step there), so that nothing cached of the step it replaces
        (summary, statistics, diff) is taken for this one."""
        path = self.folder(step, tier)
        with self.opening:
            viewer: Viewer = state.viewer
            for cid, ck in viewer.checkpoints.items():
                if str(ck.path) == str(path):
                    return cid, ck
            newest, current = self.newest(), viewer.checkpoints[NEWEST_ID]
            first = current if str(current.path) == str(newest) else self.open_folder(newest)
            try:
                opened = self.open_folder(path)
            except BaseException:
                if first is not current:
                    first.close()
                raise
            state.viewer = viewer.successor({NEWEST_ID: first, STEP_ID: opened})
            for old in viewer.checkpoints.values():
                if old is not first:
                    old.close()  # its maps close once the requests still reading it let go
            return STEP_ID, opened

    def open_folder(self, path: AnyPath) -> Checkpoint:
        """A step's folder (from `folder`), opened as the Tensormorph checkpoint it is."""
        options = None if isinstance(path, Path) else self.remote_storage_options
        return open_checkpoint(str(path), "tensormorph", read_budget=self.read_budget, storage_options=options)


def _info(step: StepTiers, tier: str) -> Any:
    return step.disk if tier == "disk" else step.remote if tier == "remote" else None


def _run(request: Request) -> RunView | None:
    return getattr(request.app.state, "run", None)


def run_endpoint(request: Request) -> JSONResponse:
    """The served training run's steps and the tiers that hold each (list_run(...).to_json()), listed afresh;
    null when the viewer serves no run."""
    run = _run(request)
    return JSONResponse(run.listing().to_json() if run is not None else None)


ERROR_STATUS = ((UnsafePathError, 403), (MissingFileError, 404))  # the other CheckpointErrors are 400


def open_endpoint(request: Request) -> JSONResponse:
    """Open a step of the run (from tier disk or remote; by default the disk, else the object store) as checkpoint
    b; its id, step, tier and path. A memory-only step, or one whose folder lies outside the run, is refused."""
    run = _run(request)
    if run is None:
        raise ApiError(404, "this viewer serves no training run: start it with `tensormorph view RUN`")
    step = int_param(request, "step")
    tier = choice_param(request, "tier", OPENABLE) if request.query_params.get("tier") else None
    try:
        cid, ck = run.open(request.app.state, step, tier)
    except CheckpointError as exc:
        status = next((code for kind, code in ERROR_STATUS if isinstance(exc, kind)), 400)
        raise ApiError(status, str(exc)) from None
    return JSONResponse({"id": cid, "step": step, "tier": "remote" if is_url(str(ck.path)) else "disk",
                         "path": str(ck.path)})


# (path, endpoint, method, query parameters): server.py registers them and describes them in its OpenAPI
RUN_ROUTES = [("/api/run", run_endpoint, "GET", []), ("/api/run/open", open_endpoint, "POST", ["step", "tier"])]
