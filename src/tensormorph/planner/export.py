"""A plan as the settings of the runtime that runs it: llama.cpp's flags, vLLM's engine arguments, and accelerate's
`device_map` with `max_memory`.

llama.cpp (common/arg.cpp, src/llama-model.cpp): `-ngl N` puts the last N of its n_layer + 1 slots (the layers,
then the output layer) on the GPUs and the rest on the CPU; `-ts` gives each GPU, in `--device` order, its
proportion of those slots (whole counts here, so the split is exact); `-ot PATTERN=CPU` keeps the tensors whose
names match (a regex search) in system RAM; the input embedding always stays on the CPU. vLLM (its engine
arguments): tensor and pipeline parallel sizes over the GPUs in CUDA_VISIBLE_DEVICES order, the pipeline's layer
counts in VLLM_PP_LAYER_PARTITION, `--gpu-memory-utilization` the fraction of each GPU it may take (the plan's
fullest GPU), `--cpu-offload-gb` the GiB of weights each GPU keeps in system RAM.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..units import human_bytes
from .spec import HOST_TIER, PlanError, accelerate_device

if TYPE_CHECKING:  # for annotations only: result imports this module
    from .result import DeviceUsage, Plan

GiB = 1 << 30
# the planner's cache dtypes -> llama.cpp's -ctk/-ctv names (common/arg.cpp's kv_cache_types)
LLAMA_CPP_CACHE_TYPES = {"fp32": "f32", "fp16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0",
                         "q4_1": "q4_1", "iq4_nl": "iq4_nl", "q5_0": "q5_0", "q5_1": "q5_1"}
VLLM_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}  # --dtype
UTILIZATION_STEP = 100  # --gpu-memory-utilization is rounded up to hundredths
OFFLOAD_STEP = 10  # --cpu-offload-gb is rounded up to tenths of a GiB
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$")  # llama.cpp's split files: model-00001-of-00003.gguf
_EXPERTS = re.compile(r"^(.*?\.experts)(\.|$)")  # the module holding a layer's routed experts
_CUDA = re.compile(r"^cuda:(\d+)$")


@dataclass(frozen=True)
class RuntimeCommand:
    """A runtime's command line: `program` (with the model), `args` (the plan's settings), `env`, and notes on
    where the runtime will differ from the plan."""

    program: tuple[str, ...]
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        words = [shlex.quote(a) for a in self.program + self.args]
        return " ".join([f"{k}={shlex.quote(v)}" for k, v in self.env] + words)

    def to_dict(self) -> dict[str, Any]:
        return {"program": list(self.program), "args": list(self.args), "env": dict(self.env),
                "command": str(self), "notes": list(self.notes)}


def _model_path(plan: Plan, fallback: str) -> str:
    return str(plan.model.path) if plan.model.path is not None else fallback


def _held(plan: Plan) -> tuple[list[DeviceUsage], DeviceUsage | None]:
    """(accelerators holding something, in plan order; the host tier's row when it holds anything)."""
    active = [r for r in plan.devices if r.units or r.share or r.tensors]
    host = next((r for r in active if r.name == HOST_TIER), None)
    others = [r for r in active if r.device.is_host and r.name != HOST_TIER]
    if others:
        raise PlanError(f"the plan puts modules on {others[0].name}, which no runtime runs: keep the host tier as "
                        f"{HOST_TIER}")
    return [r for r in active if not r.device.is_host], host


def _device_flag(gpus: list[DeviceUsage]) -> tuple[list[str], list[str]]:
    """llama.cpp's --device list for cuda:N devices (CUDA0, CUDA1 ...), in plan order."""
    numbers = [m.group(1) for r in gpus if (m := _CUDA.match(r.name))]
    if len(numbers) == len(gpus) and gpus:
        return ["-dev", ",".join(f"CUDA{n}" for n in numbers)], []
    return [], ["llama.cpp names its devices itself (llama-server --list-devices): pass them with -dev in the "
                f"plan's order ({', '.join(r.name for r in gpus)})"] if gpus else []


def _experts_pattern(layers: list[int], moe_layers: list[int]) -> str:
    """-ot's regex for the routed experts of `layers` (all MoE layers on the GPUs: no block numbers)."""
    if layers == moe_layers:
        return r"\.ffn_.*_exps\.=CPU"
    return r"blk\.(" + "|".join(map(str, layers)) + r")\.ffn_.*_exps\.=CPU"


def to_llama_cpp(plan: Plan) -> RuntimeCommand:
    """llama-server's flags for the plan; PlanError when llama.cpp cannot run it as planned."""
    spec, w = plan.model, plan.workload
    cache = w.cache_dtype or spec.default_cache
    if cache not in LLAMA_CPP_CACHE_TYPES:
        raise PlanError(f"llama.cpp has no {cache} KV cache; -ctk/-ctv take {', '.join(LLAMA_CPP_CACHE_TYPES.values())}"
                        " (plan with --cache-dtype q8_0, for one)")
    gpus, host = _held(plan)
    layers = spec.arch.layers
    notes: list[str] = []
    args, device_notes = _device_flag(gpus)
    notes += device_notes
    if plan.strategy == "tensor":
        if host is not None:
            raise PlanError("llama.cpp splits rows across GPUs only (-sm row): plan the tensor split without "
                            f"{HOST_TIER}")
        args += ["-ngl", str(layers + 1), "-sm", "row"]
        if len(gpus) > 1:
            args += ["-ts", ",".join(str(r.share["heads"] if r.share else 0) for r in gpus)]
    else:
        assert plan.device_map is not None, "a pipeline plan maps every module"
        on_host = host.layers if host is not None else ()
        if on_host != tuple(range(len(on_host))):
            raise PlanError(f"llama.cpp keeps the first layers on the CPU (-ngl); this plan's {HOST_TIER} holds layers "
                            f"{host.layer_ranges if host else ''}")
        heads = [u.name for u in spec.outputs]
        output = plan.device_map[heads[-1]] if heads else None
        if output == HOST_TIER and len(on_host) < layers:
            raise PlanError(f"llama.cpp keeps the output layer on the GPU of the last layer; this plan puts it on "
                            f"{HOST_TIER} and layers on the GPUs")
        slots: list[int] = [len(r.layers) for r in gpus]
        holders = [k for k, r in enumerate(gpus) if r.layers]
        if output is not None and output != HOST_TIER and holders:
            slots[holders[-1]] += 1  # llama.cpp's output slot follows the last layer
            if gpus[holders[-1]].name != output:
                notes.append(f"llama.cpp puts the output layer with the last layer on {gpus[holders[-1]].name}; the "
                             f"plan put it on {output}")
        args += ["-ngl", str(sum(slots))]
        if len(gpus) > 1 and sum(slots) > 0:
            args += ["-ts", ",".join(map(str, slots))]
        if host is not None and host.expert_layers:
            moe = [i for i, u in enumerate(spec.layers) if i >= len(on_host) and any(t.expert for t in u.tensors)]
            args += ["-ot", _experts_pattern(list(host.expert_layers), moe)]
        inputs = [u.name for u in spec.inputs]
        placed = {plan.device_map[u] for u in inputs} - {HOST_TIER}
        if placed:
            notes.append(f"llama.cpp keeps the input embedding on the CPU; the plan counts "
                         f"{human_bytes(sum(u.nbytes for u in spec.inputs))} of it on {', '.join(sorted(placed))}")
    args += ["-c", str(w.context * w.batch)]
    if w.batch > 1:
        args += ["-np", str(w.batch)]  # llama-server shares -c among its slots
    args += ["-ctk", LLAMA_CPP_CACHE_TYPES[cache], "-ctv", LLAMA_CPP_CACHE_TYPES[cache]]
    if w.prefill_chunk is not None:
        args += ["-b", str(w.prefill_chunk), "-ub", str(w.prefill_chunk)]
    if cache not in ("fp32", "fp16", "bf16"):
        notes.append("a quantized V cache needs flash attention (-fa; llama.cpp enables it where it can)")
    if spec.source != "gguf":
        notes.append("llama.cpp runs GGUF files: convert the checkpoint first (convert_hf_to_gguf.py); -ot names "
                     "llama.cpp's tensors (blk.N.ffn_*_exps)")
    return RuntimeCommand(("llama-server", "-m", _model_path(plan, "MODEL.gguf")), tuple(args), (), tuple(notes))


def to_vllm(plan: Plan) -> RuntimeCommand:
    """vLLM's engine arguments for the plan; PlanError saying why when vLLM cannot run it as planned."""
    spec, w = plan.model, plan.workload
    gpus, host = _held(plan)
    kinds = sorted({r.name.split(":")[0] for r in gpus})
    if len(kinds) > 1:
        raise PlanError(f"vLLM runs one kind of accelerator; this plan mixes {', '.join(kinds)}")
    if gpus and not all(_CUDA.match(r.name) for r in gpus):
        raise PlanError(f"vLLM runs on cuda:N GPUs; this plan uses {', '.join(r.name for r in gpus)}")
    if not gpus:
        raise PlanError("vLLM runs on GPUs; this plan puts everything on the host")
    path = str(spec.path) if spec.path is not None else ""
    if spec.source == "gguf" and _SPLIT_GGUF.search(path):
        raise PlanError("vLLM loads a single GGUF file, not a split one; merge it first (llama-gguf-split --merge)",
                        file=path)
    if host is not None and host.kv_cache:
        raise PlanError(f"vLLM keeps the whole KV cache on the GPUs; this plan puts layers "
                        f"{host.layer_ranges} with {human_bytes(host.kv_cache)} of cache on {HOST_TIER}")
    cache = w.cache_dtype or spec.default_cache
    if cache == "fp8":
        kv = "fp8"
    elif cache == spec.act_dtype:
        kv = "auto"
    else:
        raise PlanError(f"vLLM's KV cache is the model's dtype ({spec.act_dtype}, 'auto') or fp8, not {cache}")
    env: list[tuple[str, str]] = []
    notes: list[str] = []
    if plan.strategy == "tensor":
        shares = {(r.share or {}).get("heads") for r in gpus}
        if len(shares) > 1:
            raise PlanError("vLLM splits every layer evenly across its tensor-parallel GPUs; this plan splits them "
                            f"unevenly ({' / '.join(str((r.share or {}).get('heads')) for r in gpus)} heads): plan "
                            "strategy tensor without --uneven, or a pipeline")
        stages = gpus
        args = ["--tensor-parallel-size", str(len(gpus)), "--pipeline-parallel-size", "1"]
    else:
        stages = [r for r in gpus if r.layers]
        args = ["--tensor-parallel-size", "1", "--pipeline-parallel-size", str(len(stages))]
        if len(stages) > 1:
            env.append(("VLLM_PP_LAYER_PARTITION", ",".join(str(len(r.layers)) for r in stages)))
        assert plan.device_map is not None, "a pipeline plan maps every module"
        embed = {plan.device_map[u.name] for u in spec.inputs} - {stages[0].name, HOST_TIER}
        head = {plan.device_map[u.name] for u in spec.outputs} - {stages[-1].name}
        if embed or head:
            notes.append(f"vLLM puts the embedding on the first stage ({stages[0].name}) and the head on the last "
                         f"({stages[-1].name}); the plan put "
                         + " and ".join(f"{what} on {', '.join(sorted(where))}"
                                        for what, where in (("the input side", embed), ("the output side", head))
                                        if where))
    env.insert(0, ("CUDA_VISIBLE_DEVICES", ",".join(r.name.split(":")[1] for r in stages)))
    fullest = max(r.used / r.device.memory for r in stages)
    args += ["--gpu-memory-utilization", f"{math.ceil(fullest * UTILIZATION_STEP) / UTILIZATION_STEP:g}",
             "--max-model-len", str(w.context), "--kv-cache-dtype", kv]
    if w.batch > 1:
        args += ["--max-num-seqs", str(w.batch)]
    if w.prefill_chunk is not None:
        args += ["--max-num-batched-tokens", str(w.prefill_chunk)]
    if w.dtype is not None and spec.source != "gguf":
        args += ["--dtype", VLLM_DTYPES[w.dtype]] if w.dtype in VLLM_DTYPES else ["--quantization", "fp8"]
    if host is not None and host.weights:
        per_gpu = host.weights / len(stages) / GiB
        args += ["--cpu-offload-gb", f"{math.ceil(per_gpu * OFFLOAD_STEP) / OFFLOAD_STEP:g}"]
        notes.append("vLLM streams the offloaded weights over PCIe in every forward pass, where the plan counts them "
                     "read by the CPU; its --cpu-offload-gb takes any weights, not the plan's choice of them")
    notes.append("vLLM fills the rest of --gpu-memory-utilization with KV cache blocks: at least the plan's cache")
    if spec.source == "gguf":
        notes.append("vLLM reads a GGUF file with the tokenizer of the model it came from: add --tokenizer")
    return RuntimeCommand(("vllm", "serve", _model_path(plan, "MODEL")), tuple(args), tuple(env), tuple(notes))


def accelerate_map(plan: Plan) -> dict[str, str]:
    """Module -> plan device for accelerate. A layer whose routed experts sit apart is given as its parts: the
    experts module on the host, each other child on the layer's device (accelerate places a listed module whole)."""
    assert plan.device_map is not None, "callers check for a tensor-parallel plan"
    units = {u.name: u for u in plan.model.units}
    out: dict[str, str] = {}
    for module, device in plan.device_map.items():
        moved = {m.group(1) for t in units[module].tensors
                 if t.name in plan.offloaded and (m := _EXPERTS.match(t.name))}
        if not moved:
            out[module] = device
            continue
        for t in units[module].tensors:
            expert = _EXPERTS.match(t.name)
            if t.name in plan.offloaded and expert:
                out[expert.group(1)] = plan.offloaded[t.name]
                continue
            parts = t.name.split(".")
            depth = next(k for k in range(module.count(".") + 2, len(parts) + 1)
                         if not any(m == ".".join(parts[:k]) or m.startswith(".".join(parts[:k]) + ".")
                                    for m in moved))
            out[".".join(parts[:depth])] = device
    return out


def accelerate_settings(plan: Plan, devices: Mapping[str, int | str] | None = None) -> dict[str, Any]:
    """`{"device_map": ..., "max_memory": ...}` for `from_pretrained`: max_memory gives each device that holds
    anything the room left for weights after the plan's KV cache, activations and reserve (0 for the others), so
    that accelerate's own placement within it leaves the cache its room too."""
    device_map = plan.to_accelerate(devices)
    max_memory: dict[int | str, int] = {}
    for row in plan.devices:
        held = bool(row.units or row.tensors)
        room = row.device.memory - row.kv_cache - row.activations - row.reserve
        max_memory[accelerate_device(row.device, devices)] = max(0, room) if held else 0
    return {"device_map": device_map, "max_memory": max_memory}
