"""`plan()`: read the model, place it, and explain the result (bottleneck, shortfall and what would fit)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from ..core import Checkpoint
from ..units import human_bytes, number_ranges
from .costs import activation_bytes, evaluate_pipeline, evaluate_tensor, unit_cost
from .devices import parse_devices
from .model import load_model
from .modelspec import ModelSpec
from .offload import HOST_LINK_GBPS, HostSolver, HostSplit, host_index
from .pipeline import PipelineSolver, Split
from .quantize import smaller
from .result import Bottleneck, DeviceUsage, Plan, QuantizedFit, Shortfall
from .spec import DEFAULT_LINK_GBPS, ELEMENT_BYTES, HOST_TIER, Device, PlanError, Workload
from .tensor import tensor_shares

MiB = 1 << 20
SMALLER_CACHES = ("fp8", "q4_0")  # tried, in this order, when the cache does not fit
PREFILL_CHUNKS = (2048, 512)  # vLLM's and llama.cpp's usual prefill batch sizes, tried largest first
Fits = Callable[[Workload, Sequence[int]], bool]
Evaluate = Callable[[Workload], tuple[DeviceUsage, ...]]


def plan(source: str | Path | Checkpoint | Mapping[str, Any] | Any, devices: Sequence[Device | str],
         workload: Workload | None = None, strategy: str = "pipeline", *, link: float | None = None,
         uneven: bool = False, device_map: Mapping[str, int | str] | None = None) -> Plan:
    """Place a model on uneven devices and predict memory, speed and the bottleneck.

    `source`: a checkpoint path or open Checkpoint (sizes from its tensors, config.json beside it for the
    architecture), a GGUF file (sizes and architecture from its header), a folder or file with only config.json,
    a config dict, a transformers config object, or a ModelSpec (`planner.quantize.quantized(...)`).
    `devices`: Device objects or specs like "cuda:0=24GiB,tflops=165,bw=1000", "rtx3090" or "auto" (see
    `parse_device`) in pipeline order. When a device's speed is unknown ("cuda:0=24GiB"), layers are balanced
    by memory and the plan predicts no times (`Plan.speed_known` False).
    `strategy`: "pipeline" (contiguous layer ranges) or "tensor" (every layer split across all devices;
    `uneven=True` for runtimes that accept splits proportional to device speed).
    `link`: GB/s between neighbouring devices where a device does not give its own link= (default 32).
    `device_map`: evaluate this map (accelerate's shape: module -> device name or CUDA index) instead of
    planning one.
    A plan that does not fit says by how much and what would fit; a model whose weights cannot fit on
    these devices at any context raises PlanError.
    """
    workload = workload or Workload()
    devs = _devices(devices)
    if link is not None and not (math.isfinite(link) and link > 0):
        raise PlanError(f"link bandwidth must be a positive number of GB/s, got {link}")
    links = [d.link or link or DEFAULT_LINK_GBPS for d in devs[:-1]]
    spec = load_model(source, workload.dtype)
    notes = list(spec.notes) + [n for d in devs for n in d.notes]
    speed_known = all(d.speed_known for d in devs)
    if not speed_known:
        unknown = ", ".join(d.name for d in devs if not d.speed_known)
        notes.append(f"speed unknown for {unknown}: the plan places by memory alone (layers balanced by memory, "
                     "uneven tensor splits by memory) and predicts no times; give tflops= and bw= or a model name "
                     "(e.g. rtx3090) for a speed estimate")
    solving = devs if speed_known else [replace(d, tflops=1.0, bandwidth=1.0) for d in devs]  # times unused
    if spec.arch.encoder:  # one forward pass is all it runs: the plan minimises that
        workload = replace(workload, optimize="prefill")
    chain = [d for d in devs if d.name != HOST_TIER] if strategy == "pipeline" and host_index(devs) is not None \
        else devs  # the host tier is no pipeline stage: its link is noted where it holds anything
    if len(chain) > 1 and link is None and any(d.link is None for d in chain[:-1]):
        notes.append(f"link bandwidth not given: {DEFAULT_LINK_GBPS:g} GB/s assumed (PCIe 4.0 x16)")
    window = spec.arch.sliding_window
    if window and workload.context > window:
        notes.append(f"the model attends over a sliding window of {window:,} tokens; runtimes that trim the "
                     "cache to it need less KV cache than counted here")
    if strategy not in ("pipeline", "tensor"):
        raise PlanError(f"unknown strategy {strategy!r}: use 'pipeline' or 'tensor'")
    if device_map is not None and strategy != "pipeline":
        raise PlanError("a device_map places whole modules: evaluate it with strategy='pipeline'")

    memory = [d.memory for d in devs]
    offloaded: dict[str, str] = {}
    host_link: float | None = None
    chain_links = links
    evaluate: Evaluate | None = None  # a fixed placement's rows for any workload
    if strategy == "tensor":
        shares, heads, share_notes = tensor_shares(spec, devs, workload, uneven)
        notes += share_notes

        def evaluate(w: Workload) -> tuple[DeviceUsage, ...]:
            return evaluate_tensor(spec, devs, w, shares, heads, links)

        mapping = None
    elif device_map is not None:
        placement = _placement_from_map(spec, devs, device_map)

        def evaluate(w: Workload) -> tuple[DeviceUsage, ...]:
            return evaluate_pipeline(spec, devs, w, placement, links)

        mapping = {u.name: devs[d].name for u, d in zip(spec.units, placement)}
    if evaluate is not None:
        def fits(w: Workload, m: Sequence[int]) -> bool:
            return all(r.used <= limit for r, limit in zip(evaluate(w), m))

        if device_map is None:  # an evaluated map may be over by any amount: show it
            _require_some_fit(spec, devs, workload, fits, evaluate)
        rows = evaluate(workload)
    else:
        host = host_index(devs)
        host_link = (devs[host].link or link or HOST_LINK_GBPS) if host is not None else None

        def make(model: ModelSpec, w: Workload) -> PipelineSolver | HostSolver:
            if host is not None and host_link is not None:  # what the accelerators cannot hold goes to the host
                return HostSolver(model, solving, host, w, links, host_link)
            return PipelineSolver(model, solving, w, links)

        solvers: dict[Workload, PipelineSolver | HostSolver] = {}

        def solver(w: Workload) -> PipelineSolver | HostSolver:
            if w not in solvers:
                solvers[w] = make(spec, w)
            return solvers[w]

        def choose(m: Sequence[int]) -> Split | HostSplit | None:
            return solver(workload).best(m) if speed_known else solver(workload).balanced(m)

        def fits(w: Workload, m: Sequence[int]) -> bool:
            return solver(w).feasible(m)

        quantized = partial(_quantized_fits, spec, solving, workload, make)
        _require_some_fit(spec, devs, workload, fits, None, quantized)
        split = choose(memory)
        if split is None:  # place it as close as it gets: the least memory added to every device
            extra = _least(lambda x: fits(workload, [m + x for m in memory]), _upper_bound(spec, devs, workload))
            split = choose([m + extra for m in memory])
            assert split is not None, "_least found memory with which a split fits"
        placed = solver(workload)
        if isinstance(placed, HostSolver) and isinstance(split, HostSplit):
            rows, mapping, offloaded = placed.rows(split), placed.device_map(split), placed.offloaded(split)
            chain_links = placed.gpu_links  # the host is no stage of the chain: its link is host_link
            notes += _host_notes(rows[placed.host], placed.crossings(split.steps), placed.host_link,
                                 devs[placed.host].link or link)
        else:
            assert isinstance(placed, PipelineSolver) and isinstance(split, Split)
            placement = placed.placement(split)
            rows = evaluate_pipeline(spec, devs, workload, placement, links)
            mapping = {u.name: devs[d].name for u, d in zip(spec.units, placement)}
    shortfall = None
    if not all(r.fits for r in rows):
        shortfall = _shortfall(spec, devs, workload, rows, fits, evaluate)
        if evaluate is None:  # a split that can change: what quantized weights would fit
            shortfall = replace(shortfall, quantized=quantized())
    active = [r for r in rows if r.units or r.share or r.tensors]
    decode_stages = [r.decode_stage_s for r in active]
    chunks = workload.prefill_passes
    prefill_stages = [r.prefill_stage_s / chunks for r in active]  # per prefill chunk
    decode_step: float | None
    prefill_time: float | None
    if not speed_known:
        decode_step = prefill_time = None
        bottleneck = _fullest(active, workload)
    elif strategy == "pipeline":  # the first item passes every stage, the rest follow behind the slowest
        decode_step = sum(decode_stages)
        prefill_time = sum(prefill_stages) + (chunks - 1) * max(prefill_stages)
    else:  # tensor-parallel devices work on every layer together
        decode_step = max(decode_stages)
        prefill_time = chunks * max(prefill_stages)
    if speed_known:
        bottleneck = _bottleneck(active, workload, strategy, links, spec.arch.encoder)
    return Plan(strategy=strategy, model=spec, workload=workload, devices=rows, device_map=mapping,
                decode_step_s=decode_step, prefill_time_s=prefill_time, bottleneck=bottleneck, shortfall=shortfall,
                links=tuple(chain_links), notes=tuple(notes), speed_known=speed_known, offloaded=offloaded,
                host_link=host_link if any(r.tensors or r.units for r in rows if r.device.name == HOST_TIER) else None)


def _devices(devices: Sequence[Device | str]) -> list[Device]:
    if isinstance(devices, (str, Device)):
        devices = [devices]
    devs = parse_devices(devices)
    if not devs:
        raise PlanError("no devices: give at least one, e.g. cuda:0=24GiB,tflops=165,bw=1000")
    names = [d.name for d in devs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise PlanError(f"device {repeated[0]} is listed more than once")
    return devs


def _placement_from_map(spec: ModelSpec, devices: list[Device], device_map: Mapping[str, int | str]) -> list[int]:
    """Device index of every unit under a module -> device map (the longest matching module name wins)."""
    index = {d.name: i for i, d in enumerate(devices)}

    def resolve(value: int | str) -> int:
        name = f"cuda:{value}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
        if name not in index and str(value) in index:
            name = str(value)
        if name not in index:
            raise PlanError(f"the device map puts modules on {value!r}, which is not one of the devices "
                            f"({', '.join(index)})")
        return index[name]

    keys = sorted(device_map, key=len, reverse=True)
    placement = []
    for unit in spec.units:
        found = set()
        for t in unit.tensors:
            key = next((k for k in keys if k == "" or t.name == k or t.name.startswith(k + ".")), None)
            if key is None:
                raise PlanError("the device map gives no device for this tensor", tensor=t.name)
            found.add(resolve(device_map[key]))
        if len(found) > 1:
            raise PlanError(f"the device map splits {unit.name} across {', '.join(devices[i].name for i in found)}; "
                            "the planner evaluates whole layers (give accelerate no_split_module_classes)")
        placement.append(found.pop())
    return placement


def _upper_bound(spec: ModelSpec, devices: list[Device], workload: Workload) -> int:
    """Memory that would hold the whole model and its cache on any single device."""
    costs = [unit_cost(u, spec, workload) for u in spec.units]
    return (sum(c.weights + c.kv for c in costs) + activation_bytes(costs, spec, workload)
            + max(d.reserve_bytes for d in devices))


def _least(ok: Callable[[int], bool], high: int) -> int:
    """The least x in [0, high], to 1 MiB, for which ok(x) holds (ok is monotone and ok(high) holds)."""
    low = 0
    while high - low > MiB:
        middle = (low + high) // 2
        if ok(middle):
            high = middle
        else:
            low = middle
    return high


def _require_some_fit(spec: ModelSpec, devices: list[Device], workload: Workload, fits: Fits,
                      evaluate: Evaluate | None,
                      quantized: Callable[[], tuple[QuantizedFit, ...]] = tuple) -> None:
    """Refuse a model that cannot fit at any context, even with the smallest cache (saying which quantized
    weights would fit, where the split can change)."""
    least = replace(workload, context=1, cache_dtype=SMALLER_CACHES[-1], prefill_chunk=None)
    if fits(least, [d.memory for d in devices]):
        return
    more = _more_memory(spec, devices, least, fits, evaluate)
    usable = sum(d.memory - d.reserve_bytes for d in devices)
    split = " (a tensor-parallel split fixes each device's share)" if evaluate is not None else ""
    raise PlanError(f"{spec.name} cannot fit on {', '.join(d.name for d in devices)} at any context: its weights "
                    f"take {human_bytes(spec.nbytes)} in {spec.dtype} and the devices offer {human_bytes(usable)} "
                    f"after reserves{split}; it needs at least "
                    + " and ".join(f"{human_bytes(n)} more on {name}" for name, n in more.items())
                    + ", more devices, or smaller weights"
                    + "".join(f"; quantized, {fit}" for fit in quantized()))


def _quantized_fits(spec: ModelSpec, devices: list[Device], workload: Workload,
                    make: Callable[[ModelSpec, Workload], PipelineSolver | HostSolver]) -> tuple[QuantizedFit, ...]:
    """The largest llama.cpp quantization of the weights that fits on the devices (`make` builds the plan's
    solver), and the largest that fits on one device alone when that is another (`devices` of known speed)."""
    across = None
    for preset, model in smaller(spec):
        if across is None and make(model, workload).feasible([d.memory for d in devices]):
            across = QuantizedFit(preset.name, model.nbytes)
        alone = next((d for d in devices if PipelineSolver(model, [d], workload, []).feasible([d.memory])), None)
        if alone is not None:
            fit = QuantizedFit(preset.name, model.nbytes, alone.name)
            return (fit,) if across is not None and across.preset == fit.preset else \
                tuple(f for f in (across, fit) if f is not None)
    return (across,) if across is not None else ()


def _host_notes(row: DeviceUsage, crossings: int, host_link: float, given: float | None) -> list[str]:
    """What the host tier holds and what it costs, when it holds anything."""
    if not (row.units or row.tensors):
        return []
    held = [f"layers {row.layer_ranges}"] if row.layers else []
    held += [u for u in row.units if not u.split(".")[-1].isdigit()]
    if row.expert_layers:
        held.append(f"the routed experts of layers {number_ranges(row.expert_layers)}")
    notes = [f"{row.name} (system RAM) holds {', '.join(held)}, {human_bytes(row.weights + row.kv_cache)}: the "
             f"accelerators cannot; the hidden state crosses to and from it {crossings} times per forward pass "
             f"over {host_link:g} GB/s"]
    if given is None:
        notes.append(f"host link not given: {host_link:g} GB/s assumed (PCIe 4.0 x16); give {row.name}=...,link=GBPS")
    return notes


def _more_memory(spec: ModelSpec, devices: list[Device], workload: Workload, fits: Fits,
                 evaluate: Evaluate | None) -> dict[str, int]:
    """Memory to add for `workload` to fit: for a fixed placement, what each device is over by; when the
    split can change, the least added to any one device."""
    if evaluate is not None:
        return {r.name: -r.free for r in evaluate(workload) if r.free < 0}
    memory = [d.memory for d in devices]
    high = _upper_bound(spec, devices, workload)

    def fits_with_more(device: int, extra: int) -> bool:
        return fits(workload, [m + extra * (i == device) for i, m in enumerate(memory)])

    needs = {devices[k].name: _least(partial(fits_with_more, k), high) for k in range(len(devices))}
    name = min(needs, key=needs.__getitem__)
    return {name: needs[name]}


def _shortfall(spec: ModelSpec, devices: list[Device], workload: Workload, rows: Sequence[DeviceUsage],
               fits: Fits, evaluate: Evaluate | None) -> Shortfall:
    """How much a placement is over, and what would fit: a shorter context, a smaller cache, a chunked
    prefill, more memory."""
    memory = [d.memory for d in devices]
    over = {r.name: -r.free for r in rows if r.free < 0}
    max_context = None
    if workload.context > 1 and fits(replace(workload, context=1), memory):
        low, high = 1, workload.context  # low fits, high does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(replace(workload, context=middle), memory) else (low, middle)
        max_context = low
    current = ELEMENT_BYTES[workload.cache_dtype or spec.default_cache]
    cache = next((c for c in SMALLER_CACHES if ELEMENT_BYTES[c] < current
                  and fits(replace(workload, cache_dtype=c), memory)), None)
    chunk = next((c for c in PREFILL_CHUNKS if c < min(workload.context, workload.prefill_chunk or workload.context)
                  and fits(replace(workload, prefill_chunk=c), memory)), None)
    return Shortfall(over=over, max_context=max_context, cache_dtype=cache, prefill_chunk=chunk,
                     more_memory=_more_memory(spec, devices, workload, fits, evaluate))


def _fullest(active: Sequence[DeviceUsage], workload: Workload) -> Bottleneck:
    """With speeds unknown, no stage time can be told: name the fullest device instead."""
    row = max(active, key=lambda r: r.used / r.device.memory)
    return Bottleneck(row.name, "decode" if workload.optimize == "decode" else "prefill", None, "unknown",
                      f"speed unknown: placed by memory alone; the fullest device is {row.name} at "
                      f"{row.used / row.device.memory:.0%} of its {human_bytes(row.device.memory)}")


def _bottleneck(active: Sequence[DeviceUsage], workload: Workload, strategy: str, links: Sequence[float],
                encoder: bool = False) -> Bottleneck:
    decode = workload.optimize == "decode"
    worst = max(active, key=lambda r: r.decode_stage_s if decode else r.prefill_stage_s)
    compute, handoff = (worst.decode_s, worst.decode_handoff_s) if decode else (worst.prefill_s,
                                                                                 worst.prefill_handoff_s)
    nbytes, flops = (worst.decode_bytes, worst.decode_flops) if decode else (worst.prefill_bytes, worst.prefill_flops)
    device = worst.device
    assert device.bandwidth is not None and device.tflops is not None, "a plan with a device of unknown speed " \
        "has no time-based bottleneck"
    per = "per decode step" if decode else \
        f"to {'encode' if encoder else 'prefill'} {workload.batch}×{workload.context:,} tokens"
    if len(active) == 1:
        of = "the only stage"
    else:
        of = f"slowest of {len(active)} " + ("stages" if strategy == "pipeline" else "tensor-parallel devices")
    waiting = "hand-off" if strategy == "pipeline" else "all-reduce"
    if handoff > compute:
        what = "the hidden state from the previous stage" if strategy == "pipeline" else \
            f"all-reduces over the {min(links):g} GB/s links"
        reason = (f"{device.name} waits {_time(handoff)} {per} for {what}, longer than its {_time(compute)} of "
                  f"compute ({of})")
        return Bottleneck(device.name, "decode" if decode else "prefill", compute + handoff, "link", reason)
    memory_bound = nbytes / (device.bandwidth * 1e9) >= flops / (device.tflops * 1e12)
    if memory_bound:
        detail = f"reads {human_bytes(nbytes)} {per}"
        if decode:
            detail += f" (weights {human_bytes(nbytes - worst.kv_cache)}, KV cache {human_bytes(worst.kv_cache)})"
        detail += f" at {device.bandwidth:g} GB/s"
    else:
        tera = flops / 1e12
        detail = f"computes {tera:,.0f} TFLOP {per}" if tera >= 100 else f"computes {tera:.3g} TFLOP {per}"
        detail += f" at {device.tflops:g} TFLOP/s"
    reason = f"{device.name} {detail}: {_time(compute)}" + (f" + {_time(handoff)} {waiting}" if handoff else "") \
        + f" ({of})"
    return Bottleneck(device.name, "decode" if decode else "prefill", compute + handoff,
                      "memory bandwidth" if memory_bound else "compute", reason)


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"

