"""The viewer's HTTP server: a thin Starlette app over the library (see docs/viewer-api.md).

Only the checkpoints named at start are served; request parameters select
tensors and regions, never paths. Heavy work runs in worker threads; the guard
(server_guard.py) checks Host, Origin and token on every route and bounds how
many heavy requests run at once, so memory stays bounded under many
simultaneous requests. Exact tiles are cached (tile_cache.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .core import DEFAULT_READ_BUDGET, Checkpoint, LogicalTensor
from .errors import CheckpointError, TensorNotFoundError
from .formats import open_checkpoint
from .ops.diff import DiffReport, aligned_names, diff, parse_rename
from .ops.stats import tensor_stats
from .ops.summary import describe, tensor_record
from .ops.tiles import MAX_PIXELS, View, histogram, tile
from .planner import Workload, plan
from .planner.model import config_beside
from .server_guard import Guard, is_loopback
from .tile_cache import DISK_CACHE_BYTES, TileCache

WEB = Path(__file__).resolve().parent / "web"
ESTIMATED_READ_RATE = 1e9  # bytes/s, for the cost shown before a full read
CONFIG_KEYS = ("architectures", "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "vocab_size", "torch_dtype")
# the routes that only look up metadata: every other /api route counts as heavy for the guard
LIGHT_ROUTES = re.compile(r"/api/(openapi\.json|checkpoints|checkpoints/[^/]+/tensor)")


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.extra = status, extra


class Viewer:
    """The state behind the API: the opened checkpoints, the diff report and the tile caches."""

    def __init__(self, paths: list[str | Path], *, rename: list[str] | None = None, cache_dir: Path | None = None,
                 cache_bytes: int = DISK_CACHE_BYTES, read_budget: int = DEFAULT_READ_BUDGET):
        self.checkpoints: dict[str, Checkpoint] = {
            cid: open_checkpoint(p, read_budget=read_budget) for cid, p in zip("ab", paths)}
        self.rename = list(rename or [])
        self.tiles = TileCache(cache_dir, disk_bytes=cache_bytes)
        self._diff: dict[tuple[float, float], DiffReport] = {}
        self._summaries: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def checkpoint(self, cid: str) -> Checkpoint:
        if cid not in self.checkpoints:
            raise ApiError(404, f"no checkpoint {cid!r}; this viewer serves {sorted(self.checkpoints)}")
        return self.checkpoints[cid]

    def tensor(self, ck: Checkpoint, name: str | None) -> LogicalTensor:
        if not name:
            raise ApiError(400, "parameter 'name' is required")
        try:
            return ck[name]
        except TensorNotFoundError as exc:
            raise ApiError(404, str(exc)) from None

    def summary(self, cid: str) -> bytes:
        """The encoded summary, computed once: a 20,000-tensor tree takes a second to build."""
        ck = self.checkpoint(cid)
        with self._lock:
            cached = self._summaries.get(cid)
        if cached is None:
            cached = json.dumps(_finite({**describe(ck, chunks=False), "config": self.config(ck)})).encode()
            with self._lock:
                self._summaries[cid] = cached
        return cached

    def config(self, ck: Checkpoint) -> dict[str, Any] | None:
        """Facts of the config.json beside the checkpoint; None when there is none or it cannot be read (a link
        out of the folder, too large, not JSON): the summary stands without it."""
        try:
            config = config_beside(ck.path)
        except CheckpointError:
            return None
        return {k: config[k] for k in CONFIG_KEYS if k in config} if config is not None else None

    def diff_report(self, atol: float, rtol: float) -> DiffReport:
        if "b" not in self.checkpoints:
            raise ApiError(404, "diff needs two checkpoints: start the viewer with two paths")
        key = (atol, rtol)
        with self._lock:
            if key not in self._diff:
                self._diff[key] = diff(self.checkpoints["a"], self.checkpoints["b"], atol=atol, rtol=rtol,
                                       rename=self.rename)
            return self._diff[key]

    def cached_tile(self, key_parts: list[Any], sources: list[tuple[Checkpoint, LogicalTensor]],
                    compute: Callable[[], bytes]) -> bytes:
        """Exact tiles: from the cache, keyed by the request and the files' identity, else computed and cached."""
        identity = [key_parts] + [[t.name, [_file_identity(ck, f) for f in t.files]] for ck, t in sources]
        key = hashlib.sha256(json.dumps(identity, default=str).encode()).hexdigest()
        data = self.tiles.get(key)
        if data is None:
            data = compute()
            self.tiles.put(key, data)
        return data

    def close(self) -> None:
        for ck in self.checkpoints.values():
            ck.close()


def _file_identity(ck: Checkpoint, file: str) -> tuple[str, int, int | str]:
    """Where the file is, its size and its modification time: a rewritten file gets new tiles."""
    return ck.require_storage().fingerprint(file)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tensormorph" / "tiles"


# ---------------------------------------------------------------- request parsing

def _int(request: Request, name: str, default: int | None = None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        if default is None:
            raise ApiError(400, f"parameter {name!r} is required")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, f"parameter {name!r} must be an integer, got {raw!r}") from None


def _float(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name)
    try:
        return default if raw is None else float(raw)
    except ValueError:
        raise ApiError(400, f"parameter {name!r} must be a number, got {raw!r}") from None


def _ints(request: Request, name: str) -> tuple[int, ...] | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise ApiError(400, f"parameter {name!r} must be comma-separated integers, got {raw!r}") from None


def _flag(request: Request, name: str) -> bool:
    return request.query_params.get(name, "0") in ("1", "true", "yes")


def _viewed(tensor: LogicalTensor, request: Request) -> LogicalTensor:
    """The tensor, or with &rank=R only what rank R holds."""
    rank = request.query_params.get("rank")
    if rank in (None, ""):
        return tensor
    try:
        return tensor.local_tensor(_int(request, "rank"))
    except CheckpointError as exc:
        raise ApiError(400, str(exc)) from None


def _region(request: Request, view: View) -> tuple[int, int, int, int, int, int]:
    height, width = view.shape
    h, w = _int(request, "h", 256), _int(request, "w", 256)
    if h * w > MAX_PIXELS:
        raise ApiError(413, f"a tile of {h} × {w} pixels is over the limit of {MAX_PIXELS}")
    return _int(request, "r0", 0), _int(request, "r1", height), _int(request, "c0", 0), _int(request, "c1", width), h, w


def _view(tensor: LogicalTensor, request: Request) -> View:
    axes = _ints(request, "axes")
    if axes is not None and len(axes) != 2:
        raise ApiError(400, "parameter 'axes' takes two axes: ROW,COL")
    try:
        return View.of(tensor, axes, _ints(request, "fixed") or ())
    except CheckpointError as exc:
        raise ApiError(400, str(exc)) from None


# ---------------------------------------------------------------- endpoints

def list_checkpoints(request: Request) -> JSONResponse:
    """The checkpoints this viewer serves."""
    viewer: Viewer = request.app.state.viewer
    return JSONResponse([
        {"id": cid, "path": str(ck.path), "format": ck.format, "tensor_count": len(ck),
         "params": sum(t.numel for t in ck.values()), "nbytes": ck.nbytes, "files": len(ck.files)}
        for cid, ck in viewer.checkpoints.items()])


def summary(request: Request) -> Response:
    """Tensors, totals by dtype, the folded module tree and Hugging Face config facts."""
    viewer: Viewer = request.app.state.viewer
    cid = request.path_params["cid"]
    return Response(viewer.summary(cid), media_type="application/json")


def tensor_info(request: Request) -> JSONResponse:
    """One tensor: dtype, shape, chunks, ranks, full-read cost and default view."""
    viewer: Viewer = request.app.state.viewer
    tensor = viewer.tensor(viewer.checkpoint(request.path_params["cid"]), request.query_params.get("name"))
    view = View.of(tensor)
    return JSONResponse({
        **tensor_record(tensor), "ranks": sorted({r for c in tensor.chunks for r in c.ranks}),
        "read_budget": tensor.read_budget,
        "full_cost": {"bytes": tensor.nbytes, "seconds": tensor.nbytes / ESTIMATED_READ_RATE},
        "view": {"axes": list(view.axes) if view.axes else None, "shape": list(view.shape)},
    })


def stats(request: Request) -> JSONResponse:
    """Statistics and a histogram; above the read budget only with confirm=1."""
    viewer: Viewer = request.app.state.viewer
    tensor = _viewed(viewer.tensor(viewer.checkpoint(request.path_params["cid"]), request.query_params.get("name")),
                     request)
    if tensor.nbytes > tensor.read_budget and not _flag(request, "confirm"):
        raise ApiError(409, f"reading {tensor.nbytes} bytes exceeds the read budget; confirm to go on",
                       bytes=tensor.nbytes, seconds=tensor.nbytes / ESTIMATED_READ_RATE)
    bins = _int(request, "bins", 64)
    if not 1 <= bins <= 4096:
        raise ApiError(400, "parameter 'bins' must be in [1, 4096]")
    result = tensor_stats(tensor)
    low, high = result.min, result.max
    hist = None
    if low is not None and high is not None:  # both None when the tensor has no finite values
        hist = histogram(tensor, low, high, bins=bins, log=_flag(request, "log"))
    return JSONResponse(_finite({**result.to_dict(), "histogram": hist}))


def tile_endpoint(request: Request) -> Response:
    """A binary tile of one tensor's view (see docs/viewer-api.md)."""
    viewer: Viewer = request.app.state.viewer
    ck = viewer.checkpoint(request.path_params["cid"])
    tensor = _viewed(viewer.tensor(ck, request.query_params.get("name")), request)
    view = _view(tensor, request)
    region = _region(request, view)
    exact = _flag(request, "exact")

    def compute() -> bytes:
        return tile(view, *region, exact=exact).encode()

    if not exact:
        return _binary(compute())
    key = ["tile", view.axes, view.fixed, region]
    return _binary(viewer.cached_tile(key, [(ck, tensor)], compute))


def diff_endpoint(request: Request) -> JSONResponse:
    """The diff report of the two checkpoints."""
    viewer: Viewer = request.app.state.viewer
    report = viewer.diff_report(_float(request, "atol", 0.0), _float(request, "rtol", 0.0))
    return JSONResponse(_finite(report.to_dict()))


def diff_tile(request: Request) -> Response:
    """A binary tile of a − b (kind=diff) or |a − b| (kind=absdiff) for one aligned tensor name."""
    viewer: Viewer = request.app.state.viewer
    a_ck, b_ck = viewer.checkpoint("a"), viewer.checkpoint("b")
    name = request.query_params.get("name")
    rules = [parse_rename(r) for r in viewer.rename]
    a_names, b_names = aligned_names(list(a_ck), rules, "a"), aligned_names(list(b_ck), rules, "b")
    if not name or name not in a_names or name not in b_names:
        raise ApiError(404, f"tensor {name!r} is not in both checkpoints")
    a, b = a_ck[a_names[name]], b_ck[b_names[name]]
    if a.shape != b.shape:
        raise ApiError(400, f"shapes differ: {list(a.shape)} vs {list(b.shape)}")
    kind = request.query_params.get("kind", "diff")
    if kind not in ("diff", "absdiff"):
        raise ApiError(400, "parameter 'kind' must be 'diff' or 'absdiff'")
    view_a, view_b = _view(a, request), _view(b, request)
    region = _region(request, view_a)
    exact = _flag(request, "exact")

    def difference(rows: slice, cols: slice) -> np.ndarray:
        delta = view_a.read(rows, cols).astype(np.float64) - view_b.read(rows, cols).astype(np.float64)
        return np.abs(delta) if kind == "absdiff" else delta

    def compute() -> bytes:
        return tile(view_a, *region, exact=exact, reader=difference).encode()

    if not exact:
        return _binary(compute())
    return _binary(viewer.cached_tile(["diff", kind, view_a.axes, view_a.fixed, region], [(a_ck, a), (b_ck, b)],
                                      compute))


def plan_endpoint(request: Request) -> JSONResponse:
    """A placement plan of a served checkpoint on the given devices (see docs/plan.md)."""
    viewer: Viewer = request.app.state.viewer
    ck = viewer.checkpoint(request.query_params.get("ck", "a"))
    devices = request.query_params.getlist("device")
    if not devices:
        raise ApiError(400, "parameter 'device' is required, once per device (cuda:0=24GiB,tflops=165,bw=1000)")
    chunk = request.query_params.get("prefill_chunk")
    workload = Workload(context=_int(request, "context", 4096), batch=_int(request, "batch", 1),
                        dtype=request.query_params.get("dtype") or None,
                        cache_dtype=request.query_params.get("cache_dtype") or None,
                        prefill_chunk=_int(request, "prefill_chunk") if chunk else None,
                        optimize=request.query_params.get("optimize", "decode"))
    link = request.query_params.get("link")
    result = plan(ck, devices, workload, request.query_params.get("strategy", "pipeline"),
                  link=_float(request, "link", 0.0) if link else None, uneven=_flag(request, "uneven"))
    return JSONResponse(_finite(result.to_dict()))


def openapi(request: Request) -> JSONResponse:
    return JSONResponse(OPENAPI)


def _binary(data: bytes) -> Response:
    return Response(data, media_type="application/octet-stream")


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null (the page shows them as such)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _operation(summary: str, parameters: list[str], binary: bool = False) -> dict[str, Any]:
    content: dict[str, dict[str, Any]] = {"application/octet-stream": {}} if binary else {"application/json": {}}
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": content}},
                    "parameters": [{"name": p, "in": "query", "schema": {"type": "string"}} for p in parameters]}}


_REGION = ["name", "r0", "r1", "c0", "c1", "h", "w", "axes", "fixed", "exact"]
OPENAPI: dict[str, Any] = {
    "openapi": "3.0.0",
    "info": {"title": "Tensormorph viewer", "version": "1", "description": "See docs/viewer-api.md."},
    "paths": {
        "/api/checkpoints": _operation(list_checkpoints.__doc__ or "", []),
        "/api/checkpoints/{cid}/summary": _operation(summary.__doc__ or "", []),
        "/api/checkpoints/{cid}/tensor": _operation(tensor_info.__doc__ or "", ["name"]),
        "/api/checkpoints/{cid}/stats": _operation(stats.__doc__ or "", ["name", "rank", "confirm", "bins", "log"]),
        "/api/checkpoints/{cid}/tile": _operation(tile_endpoint.__doc__ or "", _REGION + ["rank"], binary=True),
        "/api/diff": _operation(diff_endpoint.__doc__ or "", ["atol", "rtol"]),
        "/api/diff/tile": _operation(diff_tile.__doc__ or "", _REGION + ["kind"], binary=True),
        "/api/plan": _operation(plan_endpoint.__doc__ or "", ["ck", "device", "context", "batch", "strategy",
                                                               "uneven", "dtype", "cache_dtype", "prefill_chunk",
                                                               "optimize", "link"]),
    },
}


def _api_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, ApiError):
        return JSONResponse({"error": str(exc), **exc.extra}, status_code=exc.status)
    return JSONResponse({"error": str(exc)}, status_code=400)


def create_app(paths: list[str | Path], *, host: str = "127.0.0.1", token: str | None = None,
               rename: list[str] | None = None, cache_dir: Path | None = None, cache_bytes: int = DISK_CACHE_BYTES,
               read_budget: int = DEFAULT_READ_BUDGET) -> Starlette:
    """The viewer app for one or two checkpoints, to serve on `host`. Requests must name the viewer in their Host
    header (server_guard.py); `token`, required when `host` is not loopback, guards every route; statistics of a
    tensor above `read_budget` bytes need confirm=1; exact tiles are cached in `cache_dir`, up to `cache_bytes`."""
    if token is None and not is_loopback(host):
        raise ValueError(f"a viewer served on {host!r}, beyond this machine, needs a token")
    viewer = Viewer(list(paths), rename=rename, cache_dir=cache_dir, cache_bytes=cache_bytes,
                    read_budget=read_budget)
    routes = [
        Route("/api/openapi.json", openapi),
        Route("/api/checkpoints", list_checkpoints),
        Route("/api/checkpoints/{cid}/summary", summary),
        Route("/api/checkpoints/{cid}/tensor", tensor_info),
        Route("/api/checkpoints/{cid}/stats", stats),
        Route("/api/checkpoints/{cid}/tile", tile_endpoint),
        Route("/api/diff", diff_endpoint),
        Route("/api/diff/tile", diff_tile),
        Route("/api/plan", plan_endpoint),
        Mount("/", StaticFiles(directory=WEB, html=True), name="page"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        viewer.close()

    guard = Middleware(Guard, host=host, token=token, heavy=_heavy)
    app = Starlette(routes=routes, middleware=[guard], exception_handlers={ApiError: _api_error,
                                                                           CheckpointError: _api_error},
                    lifespan=lifespan)
    app.state.viewer = viewer
    return app


def _heavy(path: str) -> bool:
    return path.startswith("/api/") and LIGHT_ROUTES.fullmatch(path) is None
