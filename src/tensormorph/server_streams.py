"""The viewer's long-running endpoints, streamed as NDJSON (server_request.ndjson): search a tensor or a diff,
find a tensor's non-finite positions, verify a checkpoint; and the integrity panel (docs/viewer-api.md,
"Issue 20 additions"). Each is thin over ops/search.py, ops/verify.py and ops/integrity.py."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .core import Checkpoint, LogicalTensor
from .errors import CheckpointError
from .ops.integrity import integrity
from .ops.search import DIFF_FINDS, FINDS, NonFinite, Progress, SearchResult, nonfinite_steps, search_diff_steps
from .ops.search import search_steps as tensor_search_steps
from .ops.tiles import View
from .ops.verify import verify_steps
from .server_request import ApiError, axes_param, choice_param, finite, flag_param, int_param, ndjson, viewed

if TYPE_CHECKING:
    from .server import Viewer


def _viewer(request: Request) -> Viewer:
    return request.app.state.viewer


def _tensor(request: Request) -> tuple[str, LogicalTensor]:
    viewer = _viewer(request)
    cid = request.path_params["cid"]
    return cid, viewed(viewer.tensor(viewer.checkpoint(cid), request.query_params.get("name")), request)


def _axes(request: Request, tensor: LogicalTensor) -> tuple[int, int] | None:
    """The requested axes of the 2-D view where a found element is shown, checked against the tensor."""
    axes = axes_param(request)
    try:
        return View.of(tensor, axes).axes
    except CheckpointError as exc:
        raise ApiError(400, str(exc)) from None


def where(tensor: LogicalTensor, axes: tuple[int, int] | None, index: tuple[int, ...] | None) -> dict[str, Any] | None:
    """The 2-D view that shows the element at `index`: its axes, the other axes fixed at `index`, the cell."""
    if index is None:
        return None
    if axes is None:
        return {"axes": None, "fixed": [], "row": 0, "col": index[0] if tensor.ndim == 1 else 0}
    fixed = [i for d, i in enumerate(index) if d not in axes]
    return {"axes": list(axes), "fixed": fixed, "row": index[axes[0]], "col": index[axes[1]]}


def _search_lines(steps: Generator[Progress | SearchResult, None, None], tensor: LogicalTensor,
                  axes: tuple[int, int] | None) -> Iterator[dict[str, Any]]:
    try:
        for step in steps:
            if isinstance(step, Progress):
                yield {"progress": {"bytes": step.bytes, "total": step.total}}
            else:
                yield {"done": True, **step.to_dict(), "view": where(tensor, axes, step.index)}
    finally:
        steps.close()  # a client that left: the read in flight ends, nothing more is read


def search_endpoint(request: Request) -> Response:
    """Find the first NaN or Inf, or the largest |x|, smallest or largest value of a tensor (NDJSON)."""
    _, tensor = _tensor(request)
    find = choice_param(request, "find", FINDS)
    skip = _skip(request)
    axes = _axes(request, tensor)
    return ndjson(_search_lines(tensor_search_steps(tensor, find, skip=skip), tensor, axes))


def _skip(request: Request) -> int:
    skip = int_param(request, "skip", 0)
    if skip < 0:
        raise ApiError(400, "parameter 'skip' must be at least 0")
    return skip


def diff_search_endpoint(request: Request) -> Response:
    """Find the largest |a − b|, or the first NaN or Inf of a − b, of one aligned tensor (NDJSON)."""
    a, b = _viewer(request).aligned(request.query_params.get("name"))
    find = choice_param(request, "find", DIFF_FINDS, "absdiff")
    axes = _axes(request, a)
    return ndjson(_search_lines(search_diff_steps(a, b, find, skip=_skip(request)), a, axes))


def nonfinite_endpoint(request: Request) -> Response:
    """Find every NaN and Inf of a tensor, so that its approximate tiles flag them (NDJSON)."""
    viewer = _viewer(request)
    cid, tensor = _tensor(request)
    steps = nonfinite_steps(tensor)

    def lines() -> Iterator[dict[str, Any]]:
        try:
            for step in steps:
                if isinstance(step, NonFinite):
                    viewer.remember_nonfinite(cid, tensor, step)
                    yield {"done": True, **step.to_dict()}
                else:
                    yield {"progress": {"bytes": step.bytes, "total": step.total}}
        finally:
            steps.close()

    return ndjson(lines())


def _checkpoint(request: Request) -> Checkpoint:
    viewer = _viewer(request)
    cid = request.path_params["cid"]
    if viewer.config_only(cid):
        raise ApiError(400, f"{viewer.checkpoint(cid).path} holds only config.json: no files to check")
    return viewer.checkpoint(cid)


def verify_endpoint(request: Request) -> Response:
    """Verify a checkpoint's checksums (and with full=1 every value): progress, then each problem (NDJSON)."""
    ck = _checkpoint(request)
    full = flag_param(request, "full")
    read = [0]
    steps = verify_steps(ck, full=full, progress=lambda n: read.__setitem__(0, read[0] + n))

    def lines() -> Iterator[dict[str, Any]]:
        checked = checksums = problems = 0
        try:
            for step in steps:
                checked += 1
                checksums += step.checksum
                yield {"progress": {"checked": checked, "item": step.item, "bytes": read[0],
                                    "total_bytes": ck.nbytes if full else None}}
                for problem in step.problems:
                    problems += 1
                    yield {"problem": {"kind": problem.kind, "message": problem.message, "file": problem.file,
                                       "tensor": problem.tensor}}
            yield {"done": True, "ok": problems == 0, "problems": problems, "checksums_checked": checksums,
                   "bytes_read": read[0], "checked": checked}
        finally:
            steps.close()

    return ndjson(lines())


def integrity_endpoint(request: Request) -> JSONResponse:
    """Files with their sizes and checksums, parity stripes or replicas, and objects with their values."""
    return JSONResponse(finite(integrity(_checkpoint(request))))


# (path, endpoint, query parameters): server.py routes them and lists them in its OpenAPI description
STREAM_ROUTES: list[tuple[str, Callable[[Request], Response], list[str]]] = [
    ("/api/checkpoints/{cid}/search", search_endpoint, ["name", "find", "rank", "axes", "skip"]),
    ("/api/diff/search", diff_search_endpoint, ["name", "find", "axes", "skip"]),
    ("/api/checkpoints/{cid}/nonfinite", nonfinite_endpoint, ["name", "rank"]),
    ("/api/checkpoints/{cid}/verify", verify_endpoint, ["full"]),
    ("/api/checkpoints/{cid}/integrity", integrity_endpoint, []),
]
