"""What the viewer's endpoints share: their error, the parsing of query parameters, JSON without NaN, and
NDJSON streams that stop when the client goes away (see docs/viewer-api.md)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

from .core import LogicalTensor
from .errors import CheckpointError
from .ops.tiles import MAX_PIXELS, View

PROGRESS_INTERVAL = 0.1  # seconds between two progress lines of a stream: enough for a smooth bar


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.extra = status, extra


def int_param(request: Request, name: str, default: int | None = None) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        if default is None:
            raise ApiError(400, f"parameter {name!r} is required")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, f"parameter {name!r} must be an integer, got {raw!r}") from None


def float_param(request: Request, name: str, default: float) -> float:
    raw = request.query_params.get(name)
    try:
        return default if raw is None else float(raw)
    except ValueError:
        raise ApiError(400, f"parameter {name!r} must be a number, got {raw!r}") from None


def ints_param(request: Request, name: str) -> tuple[int, ...] | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return tuple(int(part) for part in raw.split(","))
    except ValueError:
        raise ApiError(400, f"parameter {name!r} must be comma-separated integers, got {raw!r}") from None


def flag_param(request: Request, name: str) -> bool:
    return request.query_params.get(name, "0") in ("1", "true", "yes")


def choice_param(request: Request, name: str, choices: tuple[str, ...], default: str | None = None) -> str:
    value = request.query_params.get(name, default)
    if value not in choices:
        raise ApiError(400, f"parameter {name!r} must be one of {', '.join(choices)}, got {value!r}")
    return value


def viewed(tensor: LogicalTensor, request: Request) -> LogicalTensor:
    """The tensor, or with &rank=R only what rank R holds."""
    rank = request.query_params.get("rank")
    if rank in (None, ""):
        return tensor
    try:
        return tensor.local_tensor(int_param(request, "rank"))
    except CheckpointError as exc:
        raise ApiError(400, str(exc)) from None


def axes_param(request: Request) -> tuple[int, int] | None:
    axes = ints_param(request, "axes")
    if axes is not None and len(axes) != 2:
        raise ApiError(400, "parameter 'axes' takes two axes: ROW,COL")
    return (axes[0], axes[1]) if axes is not None else None


def view_of(tensor: LogicalTensor, request: Request) -> View:
    try:
        return View.of(tensor, axes_param(request), ints_param(request, "fixed") or ())
    except CheckpointError as exc:
        raise ApiError(400, str(exc)) from None


def region(request: Request, view: View) -> tuple[int, int, int, int, int, int]:
    height, width = view.shape
    h, w = int_param(request, "h", 256), int_param(request, "w", 256)
    if h * w > MAX_PIXELS:
        raise ApiError(413, f"a tile of {h} × {w} pixels is over the limit of {MAX_PIXELS}")
    return (int_param(request, "r0", 0), int_param(request, "r1", height), int_param(request, "c0", 0),
            int_param(request, "c1", width), h, w)


def finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null (the page shows them as such)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def ndjson(lines: Iterator[dict[str, Any]]) -> StreamingResponse:
    """A stream of JSON lines from a blocking iterator, run step by step in a worker thread; progress lines
    (those with a "progress" key) at most every PROGRESS_INTERVAL. When the client disconnects, Starlette
    cancels the stream between two steps and the iterator is closed (its `finally` runs), so the work stops
    after the block in hand. An error raised by a step ends the stream with an {"error": ...} line: the
    status is sent already."""

    async def body() -> AsyncIterator[bytes]:
        last = 0.0
        try:
            while True:
                try:
                    line = await anyio.to_thread.run_sync(next, lines, None)
                except Exception as exc:  # the status is sent: the last line says what went wrong
                    line = {"error": str(exc)}
                if line is None:
                    return
                if "progress" in line:
                    if time.monotonic() - last < PROGRESS_INTERVAL:
                        continue
                    last = time.monotonic()
                yield json.dumps(finite(line)).encode() + b"\n"
                if "error" in line:
                    return
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(getattr(lines, "close", lambda: None))

    return StreamingResponse(body(), media_type="application/x-ndjson")
