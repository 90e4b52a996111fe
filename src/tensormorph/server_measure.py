"""The Plan page's "Measure" button (issue 19): run the plan of a served checkpoint on one process per stage and
answer measured beside predicted (`tensormorph.planner.measure`, docs/plan.md "Measuring a plan").

It runs the model, so it is bounded: the weights, the prompt, the decode steps and the batch have limits here, and
one measurement runs at a time. torch and transformers are imported only once a measurement is asked for.
"""

from __future__ import annotations

import threading

from starlette.requests import Request
from starlette.responses import JSONResponse

from .planner import Workload
from .planner.measure_run import DEFAULT_NEW_TOKENS, DEFAULT_PROMPT_TOKENS, measure
from .server_request import ApiError, finite, float_param, int_param
from .storage import is_url
from .units import human_bytes

MEASURE_MAX_BYTES = 2 << 30  # weights the viewer may run: each stage process holds its share in this machine's RAM
MEASURE_MAX_PROMPT_TOKENS = 2048  # a prefill of this many tokens takes seconds on a CPU for a small model
MEASURE_MAX_NEW_TOKENS = 256
MEASURE_MAX_BATCH = 8
MEASURE_TIMEOUT_S = 300.0  # a stage waiting longer than this for its neighbour gives up
_running = threading.Lock()  # one measurement at a time: each one takes the machine's cores


def _bounded(request: Request, name: str, default: int, limit: int) -> int:
    value = int_param(request, name, default)
    if value > limit:
        raise ApiError(400, f"parameter {name!r}: {value} is over the viewer's limit of {limit} (run `tensormorph "
                            "measure` for more)")
    return value


def measure_endpoint(request: Request) -> JSONResponse:
    """Run the plan of a served Hugging Face checkpoint (the same parameters as /api/plan, pipeline only) on one
    process per stage with a random prompt of prompt_tokens, then new_tokens decode steps: Measurement.to_dict()."""
    cid = request.query_params.get("ck", "a")
    ck = request.app.state.viewer.checkpoint(cid)
    if is_url(str(ck.path)):
        raise ApiError(400, f"{ck.path}: measure runs a model from a local folder, not a remote checkpoint")
    devices = request.query_params.getlist("device")
    if not devices:
        raise ApiError(400, "parameter 'device' is required, once per device (cuda:0=24GiB,tflops=165,bw=1000)")
    if request.query_params.get("strategy", "pipeline") != "pipeline":
        raise ApiError(400, "measure runs pipeline plans: a tensor-parallel split needs a tensor-parallel runtime")
    prompt = _bounded(request, "prompt_tokens", DEFAULT_PROMPT_TOKENS, MEASURE_MAX_PROMPT_TOKENS)
    new = _bounded(request, "new_tokens", DEFAULT_NEW_TOKENS, MEASURE_MAX_NEW_TOKENS)
    chunk = request.query_params.get("prefill_chunk")
    context = request.query_params.get("context")
    workload = Workload(context=int_param(request, "context") if context else prompt + new,
                        batch=_bounded(request, "batch", 1, MEASURE_MAX_BATCH),
                        dtype=request.query_params.get("dtype") or None,
                        cache_dtype=request.query_params.get("cache_dtype") or None,
                        prefill_chunk=int_param(request, "prefill_chunk") if chunk else None,
                        optimize=request.query_params.get("optimize", "decode"))
    link = request.query_params.get("link")
    if not _running.acquire(blocking=False):
        raise ApiError(409, "a measurement is already running; try again when it has finished")
    try:
        result = measure(ck.path, devices, workload, link=float_param(request, "link", 0.0) if link else None,
                         prompt_tokens=prompt, new_tokens=new, max_bytes=MEASURE_MAX_BYTES,
                         timeout_s=MEASURE_TIMEOUT_S)
    finally:
        _running.release()
    body = result.to_dict()
    body["limits"] = {"max_bytes": MEASURE_MAX_BYTES, "max_bytes_text": human_bytes(MEASURE_MAX_BYTES),
                      "max_prompt_tokens": MEASURE_MAX_PROMPT_TOKENS, "max_new_tokens": MEASURE_MAX_NEW_TOKENS}
    return JSONResponse(finite(body))


# (path, endpoint, method, query parameters): server.py registers them and describes them in its OpenAPI
MEASURE_ROUTES = [("/api/plan/measure", measure_endpoint, "POST",
                   ["ck", "device", "context", "batch", "dtype", "cache_dtype", "prefill_chunk", "optimize", "link",
                    "prompt_tokens", "new_tokens"])]
