"""The viewer's HTTP server: a thin Starlette app over the library (see docs/viewer-api.md).

Only the checkpoints named at start are served; request parameters select
tensors and regions, never paths. Heavy work runs in worker threads; the guard
(server_guard.py) checks Host, Origin and token on every route and bounds how
many heavy requests run at once, so memory stays bounded under many
simultaneous requests. Exact tiles are cached and tiles compressed (tile_cache.py); summaries are described
in the background from the start and kept on disk beside the tiles, checked against the files' identity
(summary_cache.py).
The viewer remembers each tensor's statistics (the scale every tile of it shares)
and where its NaN and Inf are (flagged in approximate tiles too). Long work
(search, verify) streams from server_streams.py; parameters parse in
server_request.py. A folder holding only config.json opens for the Plan page. A training run's steps and
their tiers are listed and opened by server_run.py, its history streamed to the Timeline by server_history.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from .core import DEFAULT_READ_BUDGET, Checkpoint, LogicalTensor
from .errors import CheckpointError, TensorNotFoundError
from .formats import detect, open_checkpoint
from .ops.diff import DiffReport
from .ops.search import NonFinite, nonfinite
from .ops.stats import TensorStats, tensor_stats
from .ops.summary import describe, tensor_record
from .ops.tiles import View, histogram, tile
from .planner import Workload, plan
from .planner.model import config_beside
from .server_diff import Pairing, binary, diff_endpoint, diff_tile
from .server_guard import Guard, is_loopback
from .server_history import HISTORY_ROUTES
from .server_measure import MEASURE_ROUTES
from .server_request import (
    ApiError,
    finite,
    flag_param,
    float_param,
    int_param,
    region,
    view_of,
    viewed,
)
from .server_run import RUN_ROUTES, RunView
from .server_streams import STREAM_ROUTES
from .storage import is_url, store_at
from .summary_cache import Identity, Summary, SummaryCache, beside, top_identity
from .tile_cache import DISK_CACHE_BYTES, TileCache, compress, negotiate
from .units import human_bytes

WEB = Path(__file__).resolve().parent / "web"
ESTIMATED_READ_RATE = 1e9  # bytes/s, for the cost shown before a full read
CONFIG_KEYS = ("architectures", "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "vocab_size", "torch_dtype")
# the routes that only look up metadata, and those that bound themselves (one history computation per run, one
# measurement at a time: they may run for minutes and must not hold a slot of the tiles): every other /api route
# counts as heavy for the guard
LIGHT_ROUTES = re.compile(r"/api/(openapi\.json|checkpoints|checkpoints/[^/]+/tensor|run|history|plan/measure)")
NONFINITE_SCAN_BYTES = 16 * 1024**2  # a tensor this small is scanned for NaN/Inf on its first tile (~5 ms warm)
NONFINITE_CACHE_BYTES = 64 * 1024**2  # non-finite positions kept for approximate tiles, all tensors together
STATS_KEPT = 4096  # statistics kept per viewer (a few hundred bytes each), for the tiles' shared scale
CONFIG_ONLY = "config"  # the format shown for a folder holding only config.json (planned, not viewed)


class Viewer:
    """The state behind the API: the opened checkpoints, the diff report and the tile caches."""

    def __init__(self, paths: list[str | Path], *, rename: list[str] | None = None, cache_dir: Path | None = None,
                 cache_bytes: int = DISK_CACHE_BYTES, read_budget: int = DEFAULT_READ_BUDGET,
                 rules: list[str] | None = None, transpose: list[str] | None = None):
        self.pairing = Pairing(rename or (), rules or (), transpose or ())  # checked before anything opens
        self.checkpoints: dict[str, Checkpoint] = {}
        self._opened: dict[str, Identity | None] = {}  # each local path's identity just before it opened
        for cid, path in zip("ab", paths):
            self._opened[cid] = top_identity(path) if cache_dir is not None else None
            self.checkpoints[cid] = _open(path, read_budget)
        self.rename, self.rules, self.transpose = self.pairing.rename, self.pairing.rules, self.pairing.transpose
        self.tiles = TileCache(cache_dir, disk_bytes=cache_bytes)
        self.summaries = SummaryCache(beside(cache_dir))
        self._diff: dict[tuple[float, float], DiffReport] = {}
        self._summaries: dict[str, Summary] = {}
        self._summary_lock = threading.Lock()  # one description at a time: the background one and a request's
        self._listing: dict[str, dict[str, Any]] = {}
        self._stats: OrderedDict[tuple[str, str], TensorStats] = OrderedDict()
        self._nonfinite: OrderedDict[tuple[str, str], NonFinite] = OrderedDict()
        self._nonfinite_bytes = 0
        self._lock = threading.Lock()

    def successor(self, checkpoints: dict[str, Checkpoint]) -> Viewer:
        """A viewer of other checkpoints with this one's pairing (rename, rules, transposes), sharing its tile
        cache, whose keys name the checkpoints' files: nothing cached of these is served for those."""
        fresh = type(self)([], rename=self.rename, rules=self.rules, transpose=self.transpose)
        fresh.tiles, fresh.summaries = self.tiles, self.summaries
        fresh.checkpoints = checkpoints
        return fresh
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

    def stats(self, cid: str, tensor: LogicalTensor) -> TensorStats:
        """The tensor's statistics (its name says which local(rank) view), kept for the tiles' scale. A tensor
        with NaN or Inf is read once more for their positions, so that its approximate tiles flag them."""
        result = tensor_stats(tensor)
        with self._lock:
            self._stats[(cid, tensor.name)] = result
            while len(self._stats) > STATS_KEPT:
                self._stats.popitem(last=False)
        if result.nans or result.infs:
            self.nonfinite(cid, tensor, scan=True)
        else:
            self.remember_nonfinite(cid, tensor, NonFinite.none(tensor.shape))
        return result

    def scale(self, cid: str, tensor: LogicalTensor) -> dict[str, float | None] | None:
        """The tensor's finite range when its statistics ran, else None."""
        with self._lock:
            known = self._stats.get((cid, tensor.name))
        if known is None or known.min is None or known.max is None or known.abs_max is None:
            return None  # not computed yet, or no finite value: the header is left out, as documented
        return {"min": known.min, "max": known.max, "absmax": known.abs_max}

    def nonfinite(self, cid: str, tensor: LogicalTensor, *, scan: bool = False) -> NonFinite | None:
        """Where the tensor's NaN and Inf are: known, or scanned now when `scan` or the tensor is small."""
        with self._lock:
            known = self._nonfinite.get((cid, tensor.name))
            if known is not None:
                self._nonfinite.move_to_end((cid, tensor.name))
                return known
        if not scan and tensor.nbytes > NONFINITE_SCAN_BYTES:
            return None
        try:
            found = nonfinite(tensor)
        except CheckpointError:
            if scan:
                raise
            # a damaged block elsewhere must not fail tiles of the intact parts: they fall back to their samples,
            # and the scan is not tried again for every tile
            found = NonFinite.unknown(tensor.shape)
        self.remember_nonfinite(cid, tensor, found)
        return found

    def remember_nonfinite(self, cid: str, tensor: LogicalTensor, found: NonFinite) -> None:
        with self._lock:
            previous = self._nonfinite.pop((cid, tensor.name), None)
            self._nonfinite_bytes -= previous.nbytes if previous is not None else 0
            self._nonfinite[(cid, tensor.name)] = found
            self._nonfinite_bytes += found.nbytes
            while self._nonfinite_bytes > NONFINITE_CACHE_BYTES and len(self._nonfinite) > 1:
                _, dropped = self._nonfinite.popitem(last=False)
                self._nonfinite_bytes -= dropped.nbytes

    def aligned(self, name: str | None) -> tuple[LogicalTensor, LogicalTensor]:
        """The tensors of a and b that the diff aligns under `name` (through its rules), of one shape."""
        return self.pairing.aligned(self.checkpoint("a"), self.checkpoint("b"), name)

    def config_only(self, cid: str) -> bool:
        return self.checkpoint(cid).format == CONFIG_ONLY

    def diff_scale(self, name: str, kind: str) -> dict[str, float | None] | None:
        """The range of a − b (kind diff) or |a − b| from the largest |a − b| of a diff report computed already
        (any tolerance: it does not change that figure); None before /api/diff ran."""
        with self._lock:
            reports = list(self._diff.values())
        for report in reports:
            for entry in report.tensors:
                if entry.name == name and entry.max_abs is not None and math.isfinite(entry.max_abs):
                    top = entry.max_abs
                    return {"min": -top if kind == "diff" else 0.0, "max": top, "absmax": top}
        return None

    def summary(self, cid: str) -> Summary:
        """The encoded summary, computed once (a 20,000-tensor tree takes a second to build), or found in the disk
        cache when the checkpoint's files are those it was described from (summary_cache.py)."""
        ck = self.checkpoint(cid)
        with self._summary_lock:
            cached = self._summaries.get(cid)
            if cached is None:
                cached = self.summaries.summary(ck, lambda: self.describe(ck), opened=self._opened.get(cid))
                self._summaries[cid] = cached
        return cached

    def describe(self, ck: Checkpoint) -> bytes:
        """The summary of `ck`, described afresh and encoded."""
        described = {**describe(ck, chunks=False), "config": self.config(ck), "config_only": ck.format == CONFIG_ONLY}
        try:  # the same text as through finite() when there is no NaN or infinity to replace, in a third of the time
            return json.dumps(described, allow_nan=False).encode()
        except ValueError:
            return json.dumps(finite(described)).encode()

    def prepare(self) -> threading.Thread:
        """Describe the checkpoints in the background, from the server's start, so that the page's first /summary
        finds it ready or under way. Its errors are left for that request to raise."""
        def run() -> None:
            for cid in list(self.checkpoints):
                with contextlib.suppress(Exception):
                    self.summary(cid)

        thread = threading.Thread(target=run, name="tensormorph-summary", daemon=True)
        thread.start()
        return thread

    def listing(self, cid: str) -> dict[str, Any]:
        """What /api/checkpoints says of a checkpoint, computed once (a sum over 20,000 tensors)."""
        with self._lock:
            known = self._listing.get(cid)
        if known is None:
            ck = self.checkpoint(cid)
            known = {"id": cid, "path": str(ck.path), "format": None if ck.format == CONFIG_ONLY else ck.format,
                     "tensor_count": len(ck), "params": sum(t.numel for t in ck.values()), "nbytes": ck.nbytes,
                     "files": len(ck.files), "config_only": ck.format == CONFIG_ONLY}
            with self._lock:
                self._listing[cid] = known
        return known

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
                self._diff[key] = self.pairing.report(self.checkpoints["a"], self.checkpoints["b"], atol, rtol)
            return self._diff[key]

    def cached_tile(self, key_parts: list[Any], sources: list[tuple[Checkpoint, LogicalTensor]],
                    compute: Callable[[], bytes], encoding: str | None) -> tuple[bytes, str | None]:
        """Exact tiles, encoded for the wire: from the cache, keyed by the request, the encoding and the files'
        identity, else computed, compressed and cached. (body, Content-Encoding)."""
        identity = [key_parts, encoding] + [[t.name, [_file_identity(ck, f) for f in t.files]] for ck, t in sources]
        key = hashlib.sha256(json.dumps(identity, default=str).encode()).hexdigest()
        data = self.tiles.get(key)
        if data is None:
            body, used = compress(compute(), encoding)
            # the first byte says how it is encoded: a tile not worth compressing is kept as it is
            data = (used or "-").encode()[:1] + body
            self.tiles.put(key, data)
        return data[1:], {b"z": "zstd", b"g": "gzip"}.get(data[:1])

    def close(self) -> None:
        for ck in self.checkpoints.values():
            ck.close()


def _file_identity(ck: Checkpoint, file: str) -> tuple[str, int, int | str]:
    """Where the file is, its size and its modification time: a rewritten file gets new tiles."""
    return ck.require_storage().fingerprint(file)


def _open(path: str | Path, read_budget: int) -> Checkpoint:
    config_only = _config_only(path)  # an empty Mapping: falsy, so not `or`
    return config_only if config_only is not None else open_checkpoint(path, read_budget=read_budget)


def _config_only(path: str | Path) -> Checkpoint | None:
    """A local folder holding config.json and no checkpoint (`plan` takes it): an empty checkpoint whose Plan
    page plans from the config; None for anything else."""
    if is_url(path):
        return None
    folder = Path(path)
    if not folder.is_dir() or not (folder / "config.json").is_file() or detect(folder) is not None:
        return None
    return Checkpoint(path=folder, format=CONFIG_ONLY, tensors={}, storage=store_at(folder))


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tensormorph" / "tiles"


# ---------------------------------------------------------------- endpoints

def list_checkpoints(request: Request) -> JSONResponse:
    """The checkpoints this viewer serves."""
    viewer: Viewer = request.app.state.viewer
    return JSONResponse([viewer.listing(cid) for cid in viewer.checkpoints])


def summary(request: Request) -> Response:
    """Tensors, totals by dtype, the folded module tree and Hugging Face config facts."""
    viewer: Viewer = request.app.state.viewer
    found = viewer.summary(request.path_params["cid"])
    # gzip, packed once: 5.8 MB of JSON for 20,000 tensors go as 130 kB (zstd is not offered to http:// pages)
    if negotiate(_without_zstd(request.headers.get("accept-encoding"))) == "gzip":
        return Response(found.packed, media_type="application/json",
                        headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
    return Response(found.raw, media_type="application/json", headers={"Vary": "Accept-Encoding"})


def _without_zstd(accept_encoding: str | None) -> str:
    return ",".join(part for part in (accept_encoding or "").split(",") if part.split(";")[0].strip().lower() != "zstd")


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
    cid = request.path_params["cid"]
    tensor = viewed(viewer.tensor(viewer.checkpoint(cid), request.query_params.get("name")), request)
    if tensor.nbytes > tensor.read_budget and not flag_param(request, "confirm"):
        raise ApiError(409, f"reading {human_bytes(tensor.nbytes)} exceeds the read budget of "
                       f"{human_bytes(tensor.read_budget)}; confirm to go on",
                       bytes=tensor.nbytes, seconds=tensor.nbytes / ESTIMATED_READ_RATE)
    bins = int_param(request, "bins", 64)
    if not 1 <= bins <= 4096:
        raise ApiError(400, "parameter 'bins' must be in [1, 4096]")
    result = viewer.stats(cid, tensor)
    low, high = result.min, result.max
    hist = None
    if low is not None and high is not None:  # both None when the tensor has no finite values
        hist = histogram(tensor, low, high, bins=bins, log=flag_param(request, "log"))
    return JSONResponse(finite({**result.to_dict(), "histogram": hist}))


def tile_endpoint(request: Request) -> Response:
    """A binary tile of one tensor's view (see docs/viewer-api.md)."""
    viewer: Viewer = request.app.state.viewer
    cid = request.path_params["cid"]
    ck = viewer.checkpoint(cid)
    tensor = viewed(viewer.tensor(ck, request.query_params.get("name")), request)
    view = view_of(tensor, request)
    area = region(request, view)
    exact, shuffle = flag_param(request, "exact"), flag_param(request, "shuffle")

    def compute() -> bytes:
        known = None if exact else viewer.nonfinite(cid, tensor)
        return tile(view, *area, exact=exact, nonfinite=known).encode(shuffle=shuffle)

    scale = viewer.scale(cid, tensor)
    encoding = negotiate(request.headers.get("accept-encoding"))
    if not exact:
        return binary(*compress(compute(), encoding), scale)
    key = ["tile", view.axes, view.fixed, area, shuffle]
    return binary(*viewer.cached_tile(key, [(ck, tensor)], compute, encoding), scale)


def plan_endpoint(request: Request) -> JSONResponse:
    """A placement plan of a served checkpoint on the given devices (see docs/plan.md)."""
    viewer: Viewer = request.app.state.viewer
    cid = request.query_params.get("ck", "a")
    ck = viewer.checkpoint(cid)
    devices = request.query_params.getlist("device")
    if not devices:
        raise ApiError(400, "parameter 'device' is required, once per device (cuda:0=24GiB,tflops=165,bw=1000)")
    chunk = request.query_params.get("prefill_chunk")
    workload = Workload(context=int_param(request, "context", 4096), batch=int_param(request, "batch", 1),
                        dtype=request.query_params.get("dtype") or None,
                        cache_dtype=request.query_params.get("cache_dtype") or None,
                        prefill_chunk=int_param(request, "prefill_chunk") if chunk else None,
                        optimize=request.query_params.get("optimize", "decode"))
    link = request.query_params.get("link")
    # a config-only folder is planned from its config.json, as `tensormorph plan FOLDER` does
    source = ck.path if viewer.config_only(cid) else ck
    result = plan(source, devices, workload, request.query_params.get("strategy", "pipeline"),
                  link=float_param(request, "link", 0.0) if link else None, uneven=flag_param(request, "uneven"))
    return JSONResponse(finite(result.to_dict()))


def openapi(request: Request) -> JSONResponse:
    return JSONResponse(OPENAPI)


def _operation(summary: str, parameters: list[str], binary: bool = False, stream: bool = False) -> dict[str, Any]:
    media = "application/octet-stream" if binary else "application/x-ndjson" if stream else "application/json"
    content: dict[str, dict[str, Any]] = {media: {}}
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": content}},
                    "parameters": [{"name": p, "in": "query", "schema": {"type": "string"}} for p in parameters]}}


_REGION = ["name", "r0", "r1", "c0", "c1", "h", "w", "axes", "fixed", "exact", "shuffle"]
# a training run's routes (server_run.py, server_history.py) and a plan's measurement (server_measure.py):
# (path, endpoint, method, query parameters)
_METHOD_ROUTES = [*RUN_ROUTES, *HISTORY_ROUTES, *MEASURE_ROUTES]
_STREAMED = {"/api/history"}  # answered in NDJSON lines
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
        **{path: _operation(endpoint.__doc__ or "", parameters, stream=True)
           for path, endpoint, parameters in STREAM_ROUTES},
        **{path: {method.lower(): _operation(endpoint.__doc__ or "", parameters, stream=path in _STREAMED)["get"]}
           for path, endpoint, method, parameters in _METHOD_ROUTES},
    },
}


def _api_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, ApiError):
        return JSONResponse({"error": str(exc), **exc.extra}, status_code=exc.status)
    return JSONResponse({"error": str(exc)}, status_code=400)


def create_app(paths: list[str | Path], *, host: str = "127.0.0.1", token: str | None = None,
               rename: list[str] | None = None, cache_dir: Path | None = None, cache_bytes: int = DISK_CACHE_BYTES,
               read_budget: int = DEFAULT_READ_BUDGET, run: RunView | None = None, rules: list[str] | None = None,
               transpose: list[str] | None = None) -> Starlette:
    """The viewer app for one or two checkpoints, to serve on `host` (with `run`: its newest checkpoint, and its steps
    listed and opened by server_run.py). Requests must name the viewer in their Host header (server_guard.py);
    `token`, required when `host` is not loopback, guards every route; statistics of a tensor above `read_budget`
    bytes need confirm=1; exact tiles are cached in `cache_dir`, up to `cache_bytes`. The diff pairs tensors through
    `rename`, `rules` and `transpose` as `tensormorph diff` does (server_diff.py)."""
    if token is None and not is_loopback(host):
        raise ValueError(f"a viewer served on {host!r}, beyond this machine, needs a token")
    viewer = Viewer(list(paths), rename=rename, cache_dir=cache_dir, cache_bytes=cache_bytes,
                    read_budget=read_budget, rules=rules, transpose=transpose)
    viewer.prepare()
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
        *(Route(path, endpoint) for path, endpoint, _ in STREAM_ROUTES),
        *(Route(path, endpoint, methods=[method]) for path, endpoint, method, _ in _METHOD_ROUTES),
        Mount("/", StaticFiles(directory=WEB, html=True), name="page"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        app.state.viewer.close()  # the viewer serving now: server_run may have replaced the first

    guard = Middleware(Guard, host=host, token=token, heavy=_heavy)
    app = Starlette(routes=routes, middleware=[guard], exception_handlers={ApiError: _api_error,
                                                                           CheckpointError: _api_error},
                    lifespan=lifespan)
    app.state.viewer = viewer  # server_run replaces it when a step of the run is opened as b
    app.state.run = run
    return app


def _heavy(path: str) -> bool:
    return path.startswith("/api/") and LIGHT_ROUTES.fullmatch(path) is None
