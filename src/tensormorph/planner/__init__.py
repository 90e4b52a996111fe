"""Placement planner: fit a model across uneven devices, counting weights, KV cache, activations and reserve.

    import tensormorph as tm
    p = tm.plan("Llama-3-8B", ["cuda:0=24GiB,tflops=165,bw=1000", "cuda:1=12GiB,tflops=70,bw=360"],
                tm.planner.Workload(context=8192))
    p.fits, p.bottleneck.reason, p.to_accelerate()
    tm.plan("model-Q4_K_M.gguf", ["rtx3090", "rtx 4060 ti 16gb", "cpu=64GiB"])   # devices by name, GGUF
    tm.plan("Llama-3-8B", ["cuda:0=24GiB", "cuda:1=12GiB"])     # speeds unknown: by memory, no times
    p = tm.plan("Mixtral-8x7B", ["rtx3090", "cpu=128GiB"])     # what the GPU cannot hold: experts to RAM first
    p.to_llama_cpp().args, str(p.to_vllm()), p.accelerate_settings()   # the runtimes' own settings
    p.load("Llama-3-8B")                       # each tensor straight to its device (torch)
    tm.plan.resident(model)                    # bytes a loaded model holds per device (torch)
    tm.planner.measure("tiny-llama", devices)  # run the plan on one process per stage: measured vs predicted

Planning reads only metadata and needs numpy alone; `Plan.load` and `resident` import torch.
"""

from __future__ import annotations

from .devices import local_devices, parse_device, parse_devices
from .export import RuntimeCommand
from .measure_result import Measurement, PhaseTimes, StageMeasurement
from .measure_run import measure
from .result import Bottleneck, DeviceUsage, Plan, Shortfall
from .runtime import resident
from .solve import plan
from .spec import Device, PlanError, Workload

plan.resident = resident  # type: ignore[attr-defined]  # tensormorph.plan.resident(model)

__all__ = ["Bottleneck", "Device", "DeviceUsage", "Measurement", "PhaseTimes", "Plan", "PlanError", "RuntimeCommand",
           "Shortfall", "StageMeasurement", "Workload", "local_devices", "parse_device", "parse_devices", "plan",
           "measure", "resident"]
