"""`measure()`: run a plan on real processes and set what they did beside what the plan predicted.

    m = tm.planner.measure("./tiny-llama", ["cuda:0=2GiB,tflops=0.2,bw=10", "cuda:1=2GiB,tflops=0.2,bw=10"],
                           prompt_tokens=32, new_tokens=8)
    m.stages[0].prefill.ratio, m.decode_step_s, m.predicted_decode_step_s, m.to_dict()

The model is planned as `plan()` plans it; then one process per device that holds anything runs that device's
units of the real transformers model (its own tensors only, read from the checkpoint), the activations go from stage
to stage over torch.distributed (gloo), and one prompt is prefilled and decoded greedily. A stage runs on its GPU
when the device is cuda:N and this machine has it, else on the CPU (the usual case: the plan's devices stand in as
processes). See measure_stage.py for a stage and measure_result.py for what is reported.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MissingDependencyError
from ..extras import require
from ..units import human_bytes
from .measure_result import Measurement, StageMeasurement, phase_spans, phase_times
from .measure_stage import EMBED, HEAD, NORM, StageTask, run_stage, segments
from .result import Plan
from .solve import plan
from .spec import Device, PlanError, Workload

DEFAULT_PROMPT_TOKENS = 32
DEFAULT_NEW_TOKENS = 8
MEASURE_TIMEOUT_S = 600.0  # a stage waiting longer than this for a neighbour (or to start) gives up
_POLL_S = 0.2  # how often the parent looks for a stage that died without a word
_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}
_OUTPUT_UNITS = {"model.norm": NORM, "lm_head": HEAD}


def measure(source: str | Path, devices: Sequence[Device | str], workload: Workload | None = None,
            strategy: str = "pipeline", *, link: float | None = None, device_map: Mapping[str, int | str] | None = None,
            prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
            new_tokens: int = DEFAULT_NEW_TOKENS, seed: int = 0, threads: int | None = None, warmup: bool = True,
            max_bytes: int | None = None, timeout_s: float = MEASURE_TIMEOUT_S) -> Measurement:
    """Plan `source` on `devices` (as `plan()` does), run the plan on one process per stage, and measure.

    `source`: a Hugging Face folder (config.json and *.safetensors) of a Llama-style decoder transformers runs.
    `workload`: the plan's (default: a context of prompt_tokens + new_tokens); the run uses its batch, dtype and
    prefill chunk, with `prompt_tokens` random tokens per sequence (from `seed`) and `new_tokens` greedy decode
    steps after the prefill. `device_map` runs that map (module -> device, as `plan()` evaluates one) instead of
    the planned split. `threads`: torch threads per stage (default: this machine's cores shared out).
    `warmup`: run everything once untimed first. `max_bytes`: refuse a model whose weights are larger.
    Raises PlanError for a source that is no such folder, a plan that does not fit, and what it cannot run
    (tensor parallel, experts on the host, a KV cache dtype other than the activations').
    """
    require("torch", "torch", feature="tensormorph measure")
    for module in ("transformers", "accelerate"):  # no extra of ours installs them: the user's runtime
        if importlib.util.find_spec(module) is None:
            raise MissingDependencyError(f"tensormorph measure runs the model with {module}: pip install {module}")
    folder = hf_folder(source)
    for label, value, least in (("prompt_tokens", prompt_tokens, 1), ("new_tokens", new_tokens, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise PlanError(f"measure: {label} must be an integer of at least {least}, got {value!r}")
    if strategy != "pipeline":
        raise PlanError("measure runs pipeline plans (each stage a process holding whole layers); a tensor-parallel "
                        "split needs a tensor-parallel runtime")
    workload = workload or Workload(context=prompt_tokens + new_tokens)
    planned = plan(folder, devices, workload, strategy, link=link, device_map=device_map)
    _check_runnable(planned, max_bytes)
    chunk = min(workload.prefill_chunk or prompt_tokens, prompt_tokens)
    at_prompt = replace(workload, context=prompt_tokens, prefill_chunk=chunk)
    at_end = replace(workload, context=prompt_tokens + new_tokens)
    predicted_prefill = plan(folder, devices, at_prompt, link=link, device_map=planned.device_map)
    predicted_decode = plan(folder, devices, at_end, link=link, device_map=planned.device_map)

    rows = [r for r in planned.devices if r.units]
    ops = _ops(planned, {r.name: rank for rank, r in enumerate(rows)})
    ran_on, notes = _torch_devices([r.device for r in rows])
    rng = np.random.default_rng(seed)
    prompt = tuple(tuple(int(t) for t in row)
                   for row in rng.integers(0, planned.model.arch.vocab or 1, (workload.batch, prompt_tokens)))
    threads = threads or max(1, (os.cpu_count() or 1) // len(rows))
    tensors = {r.name: _tensors(planned, r.units) for r in rows}
    port = _free_port()
    tasks = [StageTask(rank=rank, world=len(rows), port=port, folder=str(folder), device=ran_on[rank], ops=ops,
                       tensors=tensors[r.name], prompt=prompt, chunk=chunk, new_tokens=new_tokens,
                       dtype=_TORCH_DTYPES[planned.model.dtype], threads=threads, timeout_s=timeout_s, warmup=warmup)
             for rank, r in enumerate(rows)]
    records = _run_stages(tasks, [r.name for r in rows], timeout_s, planned.model.arch.model_type)
    return _measurement(planned, predicted_prefill, predicted_decode, records, prompt, new_tokens, chunk,
                        tuple(notes))


def hf_folder(source: str | Path) -> Path:
    """The Hugging Face folder `source` names (the folder, or a file in it) with config.json and safetensors."""
    if not isinstance(source, (str, Path)):
        raise PlanError(f"measure runs a model from its folder: give a path, not a {type(source).__name__}")
    path = Path(source)
    folder = path.parent if path.is_file() else path
    if not folder.is_dir() or not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise PlanError(f"{source}: measure runs the real model, from a Hugging Face folder with config.json and "
                        "*.safetensors (save_pretrained's layout); this is not one")
    return folder


def _check_runnable(p: Plan, max_bytes: int | None) -> None:
    """Refuse what measure cannot run, before any process starts."""
    if not p.fits and p.shortfall is not None:
        over = ", ".join(f"{name} over by {human_bytes(n)}" for name, n in p.shortfall.over.items())
        fixes = "; it would fit with " + " · ".join(p.shortfall.suggestions()) if p.shortfall.suggestions() else ""
        raise PlanError(f"{p.model.name}: the plan does not fit ({over}); measure runs only a plan that fits{fixes}")
    if p.offloaded:
        raise PlanError(f"{p.model.name}: the plan puts routed experts on the host apart from their layers; measure "
                        "runs whole layers per stage")
    if max_bytes is not None and p.model.nbytes > max_bytes:
        raise PlanError(f"{p.model.name}: its weights take {human_bytes(p.model.nbytes)}, over the "
                        f"{human_bytes(max_bytes)} measure may run here")
    if p.model.dtype not in _TORCH_DTYPES:
        raise PlanError(f"{p.model.name}: measure runs weights in {', '.join(_TORCH_DTYPES)}, not {p.model.dtype}")
    cache = p.workload.cache_dtype
    if cache is not None and cache != p.model.act_dtype:
        raise PlanError(f"{p.model.name}: measure keeps the KV cache in the activations' dtype ({p.model.act_dtype}); "
                        f"a {cache} cache is not run")


def _ops(p: Plan, rank_of: dict[str, int]) -> tuple[tuple[str | int, int], ...]:
    """(op, rank) in pipeline order from the plan's units, refusing a layout the stage runner does not know."""
    assert p.device_map is not None, "a pipeline plan has a device map"
    m = p.model
    inputs = [u.name for u in m.inputs]
    outputs = [u.name for u in m.outputs]
    if inputs != ["model.embed_tokens"] or sorted(outputs) != sorted(_OUTPUT_UNITS):
        raise PlanError(f"{m.name}: measure runs Llama-style decoders (model.embed_tokens, model.layers.N, "
                        f"model.norm, lm_head); this model's sides are {', '.join(inputs + outputs)}")
    ops: list[tuple[str | int, int]] = [(EMBED, rank_of[p.device_map[inputs[0]]])]
    for k, unit in enumerate(m.layers):
        if unit.name != f"model.layers.{k}":
            raise PlanError(f"{m.name}: measure runs Llama-style decoders; layer {k} is {unit.name}, not "
                            f"model.layers.{k}")
        ops.append((k, rank_of[p.device_map[unit.name]]))
    ops += [(_OUTPUT_UNITS[name], rank_of[p.device_map[name]]) for name in _OUTPUT_UNITS]
    return tuple(ops)


def _tensors(p: Plan, units: Sequence[str]) -> tuple[str, ...]:
    """The checkpoint tensors of the units; a tied head is left to share the embedding."""
    held = set(units)
    return tuple(t.name for u in p.model.units if u.name in held for t in u.tensors if not t.tied_to)


def _torch_devices(devices: Sequence[Device]) -> tuple[list[str], list[str]]:
    """Each plan device's torch device: cuda:N when this machine has it, else the CPU (with a note)."""
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out, absent = [], []
    for d in devices:
        kind, _, number = d.name.partition(":")
        if kind == "cuda" and int(number or 0) < available:
            out.append(f"cuda:{int(number or 0)}")
        else:
            out.append("cpu")
            absent.append(d.name)
    notes = [f"{', '.join(absent)} ran as processes on this machine's CPU"] if absent and len(absent) < len(devices) \
        else ["every stage ran as a process on this machine's CPU"] if absent else []
    return out, notes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _context(mp: Any, model_type: str | None) -> Any:
    """A fork server that has imported torch and transformers once, when the platform has one: its stage processes
    start without importing them again (seconds each on a small machine). Else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    modeling = [f"transformers.models.{model_type}.modeling_{model_type}"] if model_type else []
    context.set_forkserver_preload(["torch", "torch.distributed", "transformers", "accelerate", *modeling,
                                    "tensormorph.planner.measure_stage"])
    return context


def _run_stages(tasks: Sequence[StageTask], names: Sequence[str], timeout_s: float,
                model_type: str | None) -> list[dict[str, Any]]:
    """Start one process per stage and collect their records; PlanError naming the stage when one fails."""
    import multiprocessing as mp

    context = _context(mp, model_type)
    results = context.Queue()
    processes = [context.Process(target=run_stage, args=(task, results), daemon=True) for task in tasks]
    for process in processes:
        process.start()
    records: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 2 * timeout_s  # startup, warm-up and the run: each within timeout_s
    try:
        while len(records) < len(tasks):
            try:
                rank, record = results.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [k for k, p in enumerate(processes) if k not in records and p.exitcode not in (None, 0)]
                if dead:
                    raise PlanError(f"measure: the stage on {names[dead[0]]} died (exit code "
                                    f"{processes[dead[0]].exitcode})") from None
                if time.monotonic() > deadline:
                    raise PlanError(f"measure: the stages did not finish within {2 * timeout_s:g} s") from None
                continue
            if "error" in record:
                raise PlanError(f"measure: the stage on {names[rank]} failed: {record['error']}")
            records[rank] = record
        for process in processes:
            process.join(timeout_s)
    finally:
        for process in processes:
            if process.is_alive():  # its neighbour failed: it would wait for gloo's timeout
                process.terminate()
                process.join()
        results.close()  # its pipe, now, not when a long-lived viewer's collector gets to it
    return [records[k] for k in range(len(tasks))]


def _measurement(planned: Plan, predicted_prefill: Plan, predicted_decode: Plan, records: list[dict[str, Any]],
                 prompt: tuple[tuple[int, ...], ...], new_tokens: int, chunk: int,
                 notes: tuple[str, ...]) -> Measurement:
    rows = [r for r in planned.devices if r.units]
    segs = segments(_ops(planned, {r.name: k for k, r in enumerate(rows)}))
    events = [e for r in records for e in r["events"]]
    sends = {(e["item"], e["segment"]): e["send"][0] for e in events if "send" in e}
    last = len(segs) - 1
    stages = []
    for row, record in zip(rows, records):
        before_prefill = predicted_prefill.usage(row.name)
        before_decode = predicted_decode.usage(row.name)
        memory_row = replace(before_decode, activations=before_prefill.activations)
        stages.append(StageMeasurement(
            device=row.name, ran_on=record["device"], modules=row.units, tensors=len(record["tensors"]),
            tensor_bytes=record["tensor_bytes"], kv_cache_bytes=record["kv_cache_bytes"],
            rss_before=record["rss_before"], rss_growth=max(0, record["rss_peak"] - record["rss_before"]),
            accelerator_peak=record["accelerator_peak"], predicted=memory_row,
            prefill=phase_times(record["events"], sends, last, "prefill", 1, before_prefill),
            decode=phase_times(record["events"], sends, last, "decode", max(new_tokens, 1), before_decode)))
    spans = phase_spans(events)
    prefill_span = spans["prefill"]
    decode_end = spans["decode"][1] if "decode" in spans else prefill_span[1]
    head = records[segs[-1].rank]
    prompt_tokens = len(prompt[0])
    return Measurement(
        plan=planned, predicted_prefill=predicted_prefill, predicted_decode=predicted_decode,
        prompt=prompt, new_tokens=new_tokens, prefill_chunk=chunk, stages=tuple(stages),
        prefill_s=prefill_span[1] - prefill_span[0],
        decode_step_s=(decode_end - prefill_span[1]) / new_tokens if new_tokens else 0.0,
        phase_wall_s={phase: end - begin for phase, (begin, end) in spans.items()},
        tokens=tuple(zip(*head["tokens"])), logits=np.stack(head["logits"]),
        notes=notes + (f"decode is predicted at the final cache length ({prompt_tokens + new_tokens} tokens, as the "
                       "planner counts a step); the measured steps attend over "
                       f"{prompt_tokens + 1} to {prompt_tokens + new_tokens}",))
