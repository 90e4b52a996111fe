"""A plan: which device holds what, how full each one is, how fast each stage runs, and what limits it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import Checkpoint
from ..units import human_bytes, number_ranges
from .export import RuntimeCommand, accelerate_map, accelerate_settings, to_llama_cpp, to_vllm
from .modelspec import ModelSpec
from .runtime import load_plan
from .spec import Device, PlanError, Workload, accelerate_device


@dataclass(frozen=True)
class DeviceUsage:
    """One device's row: bytes by kind, and its stage's work and time per decode step and per prefill."""

    device: Device
    weights: int
    kv_cache: int
    activations: int
    reserve: int
    decode_bytes: float  # read per decode step (weights touched + the whole KV cache)
    decode_flops: float
    prefill_bytes: float  # read while prefilling the whole prompt of every sequence
    prefill_flops: float
    decode_s: float  # compute time per decode step (roofline)
    prefill_s: float  # compute time for the prefill
    decode_handoff_s: float  # waiting for activations over links, per decode step
    prefill_handoff_s: float
    units: tuple[str, ...] = ()  # modules placed here (pipeline)
    layers: tuple[int, ...] = ()  # layer numbers placed here (pipeline)
    share: dict[str, Any] | None = None  # tensor parallel: heads, KV heads and fractions held here
    tensors: tuple[str, ...] = ()  # tensors held here apart from their unit (routed experts on the host)
    expert_layers: tuple[int, ...] = ()  # the layers those experts belong to

    @property
    def name(self) -> str:
        return self.device.name

    @property
    def used(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.reserve

    @property
    def free(self) -> int:
        return self.device.memory - self.used

    @property
    def fits(self) -> bool:
        return self.free >= 0

    @property
    def decode_stage_s(self) -> float:
        return self.decode_s + self.decode_handoff_s

    @property
    def prefill_stage_s(self) -> float:
        return self.prefill_s + self.prefill_handoff_s

    @property
    def layer_ranges(self) -> str:
        """'0-23' or '0-3, 9' for the layers held; '' when none."""
        return number_ranges(self.layers)

    def to_dict(self, workload: Workload, speed_known: bool = True) -> dict[str, Any]:
        """Plain JSON types; with `speed_known` False every time is None (the work in bytes and FLOPs stays)."""
        def phase(compute: float, handoff: float, nbytes: float, flops: float, tokens: int) -> dict[str, Any]:
            if not speed_known:
                return {"compute_s": None, "handoff_s": None, "stage_s": None, "bytes": nbytes, "flops": flops,
                        "tokens_per_s": None}
            stage = compute + handoff
            return {"compute_s": compute, "handoff_s": handoff, "stage_s": stage, "bytes": nbytes, "flops": flops,
                    "tokens_per_s": tokens / stage if stage > 0 else None}

        return {
            "device": self.name, "product": self.device.product, "memory": self.device.memory,
            "tflops": self.device.tflops,
            "bandwidth_gbps": self.device.bandwidth, "weights": self.weights, "kv_cache": self.kv_cache,
            "activations": self.activations, "reserve": self.reserve, "used": self.used, "free": self.free,
            "fits": self.fits, "layers": self.layer_ranges, "modules": list(self.units), "share": self.share,
            "tensors": list(self.tensors), "expert_layers": number_ranges(self.expert_layers),
            "decode": phase(self.decode_s, self.decode_handoff_s, self.decode_bytes, self.decode_flops,
                            workload.batch),
            "prefill": phase(self.prefill_s, self.prefill_handoff_s, self.prefill_bytes, self.prefill_flops,
                             workload.batch * workload.context),
        }


@dataclass(frozen=True)
class Bottleneck:
    """The stage that limits the optimised phase, and why."""

    device: str
    phase: str  # decode or prefill
    seconds: float | None  # None when the speed of a device is unknown
    limit: str  # memory bandwidth, compute, link; "unknown" when a device's speed is
    reason: str


@dataclass(frozen=True)
class QuantizedFit:
    """A llama.cpp quantization of the weights that would fit: on all the devices, or on `device` alone."""

    preset: str  # Q8_0, Q6_K, Q5_K_M, Q4_K_M
    weights: int  # bytes of the weights so quantized (an estimate: see planner.quantize)
    device: str | None = None

    def __str__(self) -> str:
        where = f"fits on {self.device} alone" if self.device else "fits"
        return f"{self.preset}: {human_bytes(self.weights)}, {where}"


@dataclass(frozen=True)
class Shortfall:
    """How far a plan is from fitting, and what would make it fit."""

    over: dict[str, int]  # device -> bytes beyond its memory, in the closest placement
    max_context: int | None  # the longest context that fits, all else unchanged
    cache_dtype: str | None  # a smaller KV cache dtype that fits at the requested context
    prefill_chunk: int | None  # a prefill chunk whose smaller activations make it fit
    more_memory: dict[str, int]  # device -> bytes to add: to one device when the split can change
    quantized: tuple[QuantizedFit, ...] = ()  # the best quantization that fits, then the best on one device

    @property
    def total(self) -> int:
        return sum(self.over.values())

    def suggestions(self) -> list[str]:
        out = []
        if self.max_context is not None:
            out.append(f"a context of at most {self.max_context:,} tokens")
        if self.cache_dtype is not None:
            out.append(f"the KV cache in {self.cache_dtype}")
        if self.prefill_chunk is not None:
            out.append(f"prefill in chunks of {self.prefill_chunk:,} tokens")
        if self.more_memory:
            out.append(" and ".join(f"{human_bytes(extra)} more memory on {device}"
                                    for device, extra in self.more_memory.items()))
        out.extend(f"the weights quantized to {fit}" for fit in self.quantized)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"over": dict(self.over), "total": self.total, "max_context": self.max_context,
                "cache_dtype": self.cache_dtype, "prefill_chunk": self.prefill_chunk,
                "more_memory": dict(self.more_memory),
                "quantized": [{"preset": q.preset, "weights": q.weights, "device": q.device} for q in self.quantized],
                "suggestions": self.suggestions()}


@dataclass(frozen=True)
class Plan:
    """Where every module goes, what each device holds, and the predicted speed.

    `device_map` (pipeline plans) maps module names to device names, the shape accelerate's
    `device_map` takes; tensor-parallel plans split every layer instead and have none.
    With `speed_known` False (a device given by memory alone) the layers are balanced by memory, and the times
    (decode_step_s, prefill_time_s, the rates, the bottleneck's seconds) are None; rows' times are 0.
    """

    strategy: str  # pipeline or tensor
    model: ModelSpec = field(repr=False)
    workload: Workload
    devices: tuple[DeviceUsage, ...]
    device_map: dict[str, str] | None
    decode_step_s: float | None  # one decode step of the whole batch through every stage
    prefill_time_s: float | None  # prefilling the whole prompt of every sequence, chunks pipelined
    bottleneck: Bottleneck
    shortfall: Shortfall | None
    links: tuple[float, ...]
    notes: tuple[str, ...] = ()
    speed_known: bool = True
    offloaded: dict[str, str] = field(default_factory=dict)  # tensor -> device, apart from its unit's device
    host_link: float | None = None  # GB/s between the host tier and the accelerators, when one is planned

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """0 for an encoder-only model, which decodes nothing; None when the speed is unknown."""
        if self.decode_step_s is None:
            return None
        return self.workload.batch / self.decode_step_s if self.decode_step_s > 0 else 0.0

    @property
    def plans(self) -> str:
        """What is planned, in one sentence."""
        w, a = self.workload, self.model.arch
        tokens = f"{w.batch}×{w.context:,} tokens"
        if a.encoder:
            return (f"encoder-only ({a.model_type or 'encoder'}): one forward pass over {tokens}; "
                    "no KV cache, no decoding, no LM head")
        return (f"decoder ({a.model_type or 'decoder'}): prefill of {tokens}, then decoding with a KV cache of "
                f"{w.context:,} tokens per sequence")

    @property
    def prefill_tokens_per_s(self) -> float | None:
        if self.prefill_time_s is None:
            return None
        return self.workload.batch * self.workload.context / self.prefill_time_s

    def usage(self, device: str) -> DeviceUsage:
        """The row of one device, by name."""
        for row in self.devices:
            if row.name == device:
                return row
        raise PlanError(f"no device {device!r} in this plan; it has {', '.join(d.name for d in self.devices)}")

    def to_dict(self) -> dict[str, Any]:
        """Everything in plain JSON types (`tensormorph plan --json` prints this)."""
        w = self.workload
        encoder = self.model.arch.encoder
        devices = [d.to_dict(w, self.speed_known) for d in self.devices]
        if encoder:  # nothing is decoded: no decode figures
            for row in devices:
                row["decode"] = {key: None for key in row["decode"]}
        return {
            "strategy": self.strategy, "fits": self.fits, "speed_known": self.speed_known,
            "model": self.model.summary(),
            "model_kind": "encoder" if encoder else "decoder", "plans": self.plans,
            "workload": {"context": w.context, "batch": w.batch, "dtype": self.model.dtype,
                         "cache_dtype": w.cache_dtype or self.model.default_cache, "prefill_chunk": w.prefill_chunk,
                         "optimize": w.optimize},
            "devices": devices,
            "links_gbps": list(self.links),
            "host_link_gbps": self.host_link,
            "device_map": self.device_map,
            "offloaded": dict(self.offloaded),
            "overall": {"decode_step_s": None if encoder else self.decode_step_s,
                        "decode_tokens_per_s": None if encoder else self.decode_tokens_per_s,
                        "prefill_s": self.prefill_time_s, "prefill_tokens_per_s": self.prefill_tokens_per_s},
            "bottleneck": {"device": self.bottleneck.device, "phase": self.bottleneck.phase,
                           "seconds": self.bottleneck.seconds, "limit": self.bottleneck.limit,
                           "reason": self.bottleneck.reason},
            "shortfall": self.shortfall.to_dict() if self.shortfall else None,
            "notes": list(self.notes),
        }

    def to_accelerate(self, devices: Mapping[str, int | str] | None = None) -> dict[str, int | str]:
        """The device map for accelerate / `from_pretrained(device_map=...)`: cuda:N becomes N.

        `devices` maps plan device names that are not torch devices ("3090") to torch ones (0, "cuda:1").
        """
        if self.model.source == "gguf":
            raise PlanError("a GGUF model's modules (blk.N) are llama.cpp's: accelerate cannot place them")
        if self.device_map is None:
            raise PlanError("a tensor-parallel plan splits every layer across devices; accelerate's device_map "
                            "places whole modules (plan with strategy='pipeline' for one)")
        resolved = {d.name: accelerate_device(d.device, devices) for d in self.devices}
        return {module: resolved[name] for module, name in accelerate_map(self).items()}

    def accelerate_settings(self, devices: Mapping[str, int | str] | None = None) -> dict[str, Any]:
        """`{"device_map": to_accelerate(), "max_memory": {device: bytes}}` for `from_pretrained`; max_memory is
        each used device's room for weights after the plan's KV cache, activations and reserve (0 elsewhere)."""
        return accelerate_settings(self, devices)

    def to_llama_cpp(self) -> RuntimeCommand:
        """llama-server's flags (-dev, -ngl, -ts, -ot, -c, -np, -ctk/-ctv, -b/-ub): `.args`, `str()` for the line."""
        return to_llama_cpp(self)

    def to_vllm(self) -> RuntimeCommand:
        """vLLM's engine arguments and environment; PlanError when vLLM cannot run the plan (uneven tensor
        parallel, a split GGUF, devices of different kinds, KV cache on the host)."""
        return to_vllm(self)

    def load(self, checkpoint: str | Path | Checkpoint, model: Any = None, *,
             devices: Mapping[str, int | str] | None = None) -> Any:
        """Stream every tensor of `checkpoint` straight to its planned device (torch needed).

        Without `model`, returns {name: tensor on its device}, a tied head left to share the embedding.
        With a model built without weights
        (`accelerate.init_empty_weights()` or `torch.device("meta")`), fills it in place, ties its
        weights, adds accelerate's device hooks so it runs across devices, and returns it.
        `devices` maps plan device names to torch devices, as for `to_accelerate`.
        """
        return load_plan(self, checkpoint, model, devices)

    def _repr_html_(self) -> str:  # notebooks: a layer above (pyproject's ignore_imports says why)
        from ..notebook import plan_html
        return plan_html(self)
