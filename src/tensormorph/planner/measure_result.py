"""What `planner.measure` (measure_run.py) found: per stage, measured times and memory beside the prediction.

The stage processes time every receive, compute and send on CLOCK_MONOTONIC (shared by the processes of one
machine). A receive is split at the moment its sender had the data ready: before it the stage was idle (waiting for
the previous stage), after it the activations were in transfer. Prefill figures are for the whole prompt, decode
figures per decode step (the mean over the steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .result import DeviceUsage, Plan

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class PhaseTimes:
    """One stage's seconds in one phase, measured, and the plan's prediction (None when its speed is unknown)."""

    compute_s: float
    transfer_s: float  # receiving activations (or the next token) once the sender had them ready
    idle_s: float  # waiting for the previous stage to produce them
    send_s: float  # handing its own output off (a copy to host memory, then an asynchronous send)
    predicted_compute_s: float | None
    predicted_transfer_s: float | None

    @property
    def stage_s(self) -> float:
        """Compute and transfer: what the plan's stage time predicts."""
        return self.compute_s + self.transfer_s

    @property
    def predicted_stage_s(self) -> float | None:
        if self.predicted_compute_s is None or self.predicted_transfer_s is None:
            return None
        return self.predicted_compute_s + self.predicted_transfer_s

    @property
    def ratio(self) -> float | None:
        """Measured over predicted stage time; None without a prediction."""
        predicted = self.predicted_stage_s
        return self.stage_s / predicted if predicted else None

    def to_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "transfer_s": self.transfer_s, "idle_s": self.idle_s,
                "send_s": self.send_s, "stage_s": self.stage_s, "predicted_compute_s": self.predicted_compute_s,
                "predicted_transfer_s": self.predicted_transfer_s, "predicted_stage_s": self.predicted_stage_s,
                "ratio": self.ratio}


@dataclass(frozen=True)
class StageMeasurement:
    """One stage process: what it held and ran, its times per phase, and its memory beside the plan's."""

    device: str  # the plan's device name
    ran_on: str  # the torch device the process ran on ("cpu" when the plan's cuda:N is absent here)
    modules: tuple[str, ...]  # the plan's units this stage held
    tensors: int  # tensors it read from the checkpoint
    tensor_bytes: int  # bytes of those tensors as held (each storage once)
    kv_cache_bytes: int  # the KV cache it held at the end
    rss_before: int  # resident memory once torch and the empty model were set up, before any weight
    rss_growth: int  # peak resident memory beyond rss_before (weights, cache, activations, allocator)
    accelerator_peak: int | None  # torch.cuda.max_memory_allocated on a GPU; None on the CPU
    predicted: DeviceUsage  # the plan's row for this device at the measured workload
    prefill: PhaseTimes  # the whole prompt
    decode: PhaseTimes  # per decode step

    def phase(self, name: str) -> PhaseTimes:
        return self.prefill if name == "prefill" else self.decode

    def to_dict(self) -> dict[str, Any]:
        p = self.predicted
        return {"device": self.device, "ran_on": self.ran_on, "modules": list(self.modules), "tensors": self.tensors,
                "tensor_bytes": self.tensor_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                "rss_before": self.rss_before, "rss_growth": self.rss_growth,
                "accelerator_peak": self.accelerator_peak,
                "predicted_memory": {"weights": p.weights, "kv_cache": p.kv_cache, "activations": p.activations},
                "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()}


@dataclass(frozen=True)
class Measurement:
    """A plan run on real processes, one per stage, with one prompt: prefill, then `new_tokens` decode steps.

    `plan` is the plan as made (its split is the one run); `predicted_prefill` and `predicted_decode` evaluate that
    split at the measured workload (the prompt's length; the full cache, prompt + new tokens, for decode), which
    is what the stage rows compare with. `logits` are the last position's logits of every step (prefill first),
    shape (new_tokens + 1, batch, vocab); `tokens` the greedy tokens they give, one row per sequence.
    """

    plan: Plan
    predicted_prefill: Plan
    predicted_decode: Plan
    prompt: tuple[tuple[int, ...], ...]  # the prompt's token ids, one row per sequence
    new_tokens: int
    prefill_chunk: int
    stages: tuple[StageMeasurement, ...]
    prefill_s: float  # the prompt through every stage, first compute to the last stage's logits
    decode_step_s: float  # per decode step, from the prefill's end to the last step's logits
    phase_wall_s: dict[str, float]  # the span of each phase across all stages
    tokens: tuple[tuple[int, ...], ...]
    logits: np.ndarray = field(repr=False, compare=False)
    notes: tuple[str, ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt[0])

    @property
    def predicted_prefill_s(self) -> float | None:
        return self.predicted_prefill.prefill_time_s

    @property
    def predicted_decode_step_s(self) -> float | None:
        return self.predicted_decode.decode_step_s

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types (`tensormorph measure --json`); the logits are left out, the tokens kept."""
        def ratio(measured: float, predicted: float | None) -> float | None:
            return measured / predicted if predicted else None

        return {"plan": self.plan.to_dict(), "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "batch": self.plan.workload.batch, "prefill_chunk": self.prefill_chunk,
                "stages": [s.to_dict() for s in self.stages],
                "overall": {"prefill_s": self.prefill_s, "predicted_prefill_s": self.predicted_prefill_s,
                            "prefill_ratio": ratio(self.prefill_s, self.predicted_prefill_s),
                            "decode_step_s": self.decode_step_s,
                            "predicted_decode_step_s": self.predicted_decode_step_s,
                            "decode_ratio": ratio(self.decode_step_s, self.predicted_decode_step_s)},
                "phase_wall_s": dict(self.phase_wall_s), "tokens": [list(t) for t in self.tokens],
                "notes": list(self.notes)}


def phase_times(records: Sequence[dict[str, Any]], sends: dict[tuple[int, int], float], last_segment: int,
                phase: str, steps: int, predicted: DeviceUsage | None) -> PhaseTimes:
    """Sum one stage's event records of `phase` (divided by `steps`: 1 for the prefill, the decode steps for
    decode). `sends` maps (item, segment) to when that segment began handing its output on."""
    compute = transfer = idle = send = 0.0
    for r in records:
        if r["phase"] != phase:
            continue
        begin, end = r["compute"]
        compute += end - begin
        if "send" in r:
            send += r["send"][1] - r["send"][0]
        if "recv" in r:
            begin, end = r["recv"]
            sender = (r["item"], r["segment"] - 1) if r["segment"] else (r["item"] - 1, last_segment)
            ready = sends.get(sender, begin)
            waited = min(max(ready - begin, 0.0), end - begin)
            idle += waited
            transfer += end - begin - waited
    known = predicted is not None and predicted.device.speed_known
    if phase == "prefill":
        pc, pt = (predicted.prefill_s, predicted.prefill_handoff_s) if known and predicted else (None, None)
    else:
        pc, pt = (predicted.decode_s, predicted.decode_handoff_s) if known and predicted else (None, None)
    return PhaseTimes(compute / steps, transfer / steps, idle / steps, send / steps, pc, pt)


def phase_spans(records: Sequence[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """The first begin and last end of any event of each phase, over all stages."""
    spans: dict[str, tuple[float, float]] = {}
    for r in records:
        times = [t for key in ("recv", "compute", "send") if key in r for t in r[key]]
        low, high = spans.get(r["phase"], (min(times), max(times)))
        spans[r["phase"]] = (min(low, *times), max(high, *times))
    return spans
