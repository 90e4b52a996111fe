"""A training run's Timeline in the viewer (issue 21): the run's history (ops/history.py: each checkpoint's status,
metrics, save costs and per-layer drift from the one before) streamed as NDJSON with progress, and two steps of
the run opened as a and b, for the Diff view of a layer between them (docs/viewer-api.md).

History work is bounded: one computation per run at a time (a second request waits, then finds the pairs in the
library's cache, RUN/.tensormorph-history.json, which `tensormorph history` shares), a sample of at most
MAX_SAMPLE blocks per tensor, and a client that goes away stops it after the pair in hand.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .core import Checkpoint
from .errors import CheckpointError, MissingFileError, UnsafePathError
from .extras import require
from .ops.history import history
from .server_request import ApiError, int_param, ndjson
from .server_run import NEWEST_ID, STEP_ID, RunView

if TYPE_CHECKING:
    from .server import Viewer

MAX_SAMPLE = 4096  # blocks per tensor a request may sample (1 MiB each as float64); more is nearly a full read
WAIT_POLL_S = 0.5  # how often a request waiting for another's computation says so, and looks whether its client left
ERROR_STATUS = ((UnsafePathError, 403), (MissingFileError, 404))  # the other CheckpointErrors are 400

_locks: dict[Path, threading.Lock] = {}  # one computation per run folder at a time
_locks_guard = threading.Lock()


class _Stopped(Exception):
    """The client went away: the computation ends after the pair in hand."""


def _run(request: Request) -> RunView:
    run: RunView | None = getattr(request.app.state, "run", None)
    if run is None:
        raise ApiError(404, "this viewer serves no training run: start it with `tensormorph view RUN`")
    return run


def _sample(request: Request) -> int | None:
    if not request.query_params.get("sample"):
        return None
    sample = int_param(request, "sample")
    if not 1 <= sample <= MAX_SAMPLE:
        raise ApiError(400, f"parameter 'sample' must be 1 to {MAX_SAMPLE} blocks per tensor, got {sample}")
    return sample


def _lock(root: Path) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(root, threading.Lock())


def _rollback(root: Path) -> dict[str, Any]:
    """The run's last rollback: the step it went back to, its commit number, and every (step, commit number) a
    rollback abandoned; a damaged marker is named, and the history stands without it."""
    require("torch", "torch", feature="a training run's timeline")
    from .train.rollback import read_marker

    try:
        marker = read_marker(root)
    except CheckpointError as exc:
        return {"rollback": None, "rollback_error": str(exc)}
    if marker is None:
        return {"rollback": None, "rollback_error": None}
    return {"rollback": {"step": marker.step, "seq": marker.seq, "abandoned": [list(p) for p in marker.abandoned]},
            "rollback_error": None}


def history_lines(root: Path, sample: int | None) -> Iterator[dict[str, Any]]:
    """The NDJSON lines of a run's history: {"progress": {"done", "total"}} (the library's: checkpoints compared
    with the one before, of all; "waiting": true while another request computes it), then
    {"done": true, "history": History.to_dict(), "rollback", "rollback_error"}. The history is computed in a
    thread of its own; closing the iterator (the client left) stops it after the pair in hand, and returns once
    it has stopped."""
    lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
    stop = threading.Event()
    failed: list[BaseException] = []

    def progress(done: int, total: int) -> None:
        if stop.is_set():
            raise _Stopped
        lines.put({"progress": {"done": done, "total": total}})

    def work() -> None:
        lock = _lock(root)
        try:
            while not lock.acquire(timeout=WAIT_POLL_S):  # another request computes it: its pairs are cached next
                if stop.is_set():
                    return
                lines.put({"progress": {"done": 0, "total": None, "waiting": True}})  # a step: the stream may end
            try:
                result = history(root, sample=sample, progress=progress)
                lines.put({"done": True, "history": result.to_dict(), **_rollback(root)})
            finally:
                lock.release()
        except _Stopped:
            pass
        except BaseException as exc:  # carried to the stream, whose last line then says what went wrong
            failed.append(exc)
        finally:
            lines.put(None)

    worker = threading.Thread(target=work, name="tensormorph-history", daemon=True)
    worker.start()
    try:
        yield {"progress": {"done": 0, "total": None}}
        while (line := lines.get()) is not None:
            yield line
        if failed:
            raise failed[0]
    finally:
        stop.set()
        worker.join()


def history_endpoint(request: Request) -> Response:
    """The served run's history, streamed (NDJSON): progress over the checkpoints compared, then the history
    (History.to_dict()) with the run's last rollback. sample=N reads N blocks of each tensor for an estimate."""
    run = _run(request)
    return ndjson(history_lines(run.root, _sample(request)))


def open_pair_endpoint(request: Request) -> JSONResponse:
    """Open step a and step b of the run (each from the disk, else the object store) as checkpoints a and b, for
    the Diff view between them; their steps and paths."""
    run = _run(request)
    steps = int_param(request, "a"), int_param(request, "b")
    if steps[0] == steps[1]:
        raise ApiError(400, f"parameters 'a' and 'b' must be two steps, got {steps[0]} twice")
    try:
        listing = run.listing()
        paths = [run.folder(step, None, listing) for step in steps]
        opened = _serve_pair(request.app.state, run, paths)
    except CheckpointError as exc:
        status = next((code for kind, code in ERROR_STATUS if isinstance(exc, kind)), 400)
        raise ApiError(status, str(exc)) from None
    return JSONResponse({cid: {"step": step, "path": str(ck.path)}
                         for cid, step, ck in zip((NEWEST_ID, STEP_ID), steps, opened, strict=True)})


def _serve_pair(state: Any, run: RunView, paths: list[Any]) -> list[Checkpoint]:
    """Serve the folders `paths` as a and b: a new viewer (sharing the tile cache) replaces the app's, so that
    nothing cached of the checkpoints it served before is taken for these; those no longer served are closed."""
    with run.opening:  # the Run panel's lock: one opening at a time, whichever page asked
        viewer: Viewer = state.viewer
        served = {str(ck.path): ck for ck in viewer.checkpoints.values()}
        opened: list[Checkpoint] = []
        try:
            for path in paths:
                ck = served.get(str(path))  # an empty checkpoint is a falsy Mapping: compared with None
                if ck is None:
                    ck = run.open_folder(path)
                opened.append(ck)
        except BaseException:
            for ck in opened:
                if ck not in viewer.checkpoints.values():
                    ck.close()
            raise
        state.viewer = viewer.successor({NEWEST_ID: opened[0], STEP_ID: opened[1]})
        for ck in viewer.checkpoints.values():
            if all(ck is not kept for kept in opened):
                ck.close()  # its maps close once the requests still reading it let go
        return opened


# (path, endpoint, method, query parameters): server.py registers them and describes them in its OpenAPI
HISTORY_ROUTES = [("/api/history", history_endpoint, "GET", ["sample"]),
                  ("/api/history/open", open_pair_endpoint, "POST", ["a", "b"])]
