"""What the planner is told: devices (memory, speed, reserve, link) and the workload.

A device is written as `NAME=MEMORY[,tflops=T,bw=B][,reserve=R][,link=L]` or by its model's name
(`rtx3090`, `cuda:1=rtx 4060 ti 16gb`): see `devices.parse_device`. Memory with a unit (GiB/MiB
binary, GB/MB decimal), compute in TFLOP/s, memory bandwidth in GB/s, the runtime's reserve (default
1 GiB on a GPU for the CUDA context, 0 on the host) and the bandwidth in GB/s of the link to the next
device in the list. A device without tflops and bw has an unknown speed: the plan balances by memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import CheckpointError
from ..formats.gguf import GGML_TYPES
from ..units import human_bytes, parse_size

GiB = 1 << 30
DEFAULT_GPU_RESERVE = GiB
DEFAULT_LINK_GBPS = 32.0  # PCIe 4.0 x16, the common case in a home server
# the host tier (`cpu=64GiB`) when its speed is not given: two channels of DDR4-3200 peak at 51.2 GB/s, and
# desktop DDR5 reaches 60-80 GB/s in practice; a desktop CPU's bf16 matmuls run at about a TFLOP/s
DEFAULT_HOST_BANDWIDTH_GBPS = 50.0
DEFAULT_HOST_TFLOPS = 1.0

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(:\d+)?$")
_HOST_DEVICES = ("cpu", "disk", "meta")  # no CUDA context to reserve room for
HOST_TIER = "cpu"  # the system-RAM tier: given the host speed above when its own is not given
TORCH_DEVICE = re.compile(r"^(cpu|mps|disk|meta|(cuda|xpu|npu|hpu|mlu|musa)(:\d+)?)$")

# llama.cpp's KV cache types (-ctk / -ctv), sized from ggml's block table like the weights
GGML_CACHE_TYPES = ("q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# bytes per element, by the names users type; fractional for llama.cpp's block-quantised cache types
ELEMENT_BYTES: dict[str, float] = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1,
                                   **{name.lower(): size / block for name, block, size in GGML_TYPES.values()
                                      if name.lower() in GGML_CACHE_TYPES}}
DTYPE_ALIASES = {"f32": "fp32", "float32": "fp32", "float": "fp32", "f16": "fp16", "float16": "fp16",
                 "half": "fp16", "bfloat16": "bf16", "f8": "fp8", "float8": "fp8", "f8_e4m3": "fp8",
                 "float8_e4m3fn": "fp8", "f64": "fp64", "float64": "fp64", "q8": "q8_0", "q4": "q4_0",
                 "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "f8_e5m2": "fp8", "float8_e5m2": "fp8"}  # vLLM's fp8 names
WEIGHT_DTYPES = ("fp64", "fp32", "fp16", "bf16", "fp8")  # what Plan.load can cast floating tensors to
STORED_DTYPES = {"F64": "fp64", "F32": "fp32", "F16": "fp16", "BF16": "bf16", "F8_E4M3": "fp8", "F8_E5M2": "fp8"}
# a GGUF tensor's ggml type -> bytes per element (block bytes / values per block), exactly as stored
GGML_ELEMENT_BYTES: dict[str, float] = {name: size / block for name, block, size in GGML_TYPES.values()}


class PlanError(CheckpointError):
    """A device spec, workload or model the planner cannot work with; the message names the problem."""


def size_of(text: str, what: str) -> int:
    """A size in a device spec. A unit is required: a bare '24' is ambiguous. A negative size is read, so that
    the checks after it can say why it is wrong."""
    try:
        return parse_size(text, what, unit_required=True, signed=True)
    except CheckpointError as exc:
        raise PlanError(exc.reason) from None


def dtype_name(text: str, *, what: str, allowed: tuple[str, ...] = tuple(ELEMENT_BYTES)) -> str:
    """A dtype as typed by a user ('bfloat16', 'BF16', 'q8_0') in the planner's vocabulary ('bf16')."""
    key = text.strip().lower()
    name = DTYPE_ALIASES.get(key, key)
    if name not in allowed:
        raise PlanError(f"{what}: unknown dtype {text!r}; use one of {', '.join(allowed)}")
    return name


@dataclass(frozen=True)
class Device:
    """One device: memory in bytes, compute in TFLOP/s, memory bandwidth and link to the next device in GB/s.

    `tflops` and `bandwidth` None: the speed is unknown (the plan balances by memory and predicts no times).
    `product` names the model from the device table; `notes` say where assumed figures came from."""

    name: str
    memory: int
    tflops: float | None = None
    bandwidth: float | None = None
    reserve: int | None = None  # None: 1 GiB on a GPU, 0 on the host
    link: float | None = None  # GB/s to the next device in the list; None: the plan's default link
    product: str | None = field(default=None, compare=False)
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise PlanError(f"device name {self.name!r} is not a name like cuda:0, cpu or gpu1")
        if self.memory <= 0:
            raise PlanError(f"device {self.name}: memory must be positive, got {human_bytes(self.memory)}")
        for label, value in (("tflops", self.tflops), ("bw", self.bandwidth), ("link", self.link)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise PlanError(f"device {self.name}: {label} must be a positive number, got {value}")
        if self.reserve is not None and self.reserve < 0:
            raise PlanError(f"device {self.name}: reserve must not be negative, got {human_bytes(self.reserve)}")
        if self.reserve_bytes >= self.memory:
            raise PlanError(f"device {self.name}: the reserve ({human_bytes(self.reserve_bytes)}) leaves nothing of "
                            f"its {human_bytes(self.memory)} of memory")

    @property
    def speed_known(self) -> bool:
        return self.tflops is not None and self.bandwidth is not None

    @property
    def is_host(self) -> bool:
        """System memory rather than an accelerator's: no CUDA context, and filled only when the others are full."""
        return self.name.split(":")[0] in _HOST_DEVICES

    @property
    def reserve_bytes(self) -> int:
        if self.reserve is not None:
            return self.reserve
        return 0 if self.is_host else DEFAULT_GPU_RESERVE

    @property
    def is_torch_device(self) -> bool:
        """Whether the name is one torch and accelerate understand as it stands (cuda:0, cpu, mps...)."""
        return bool(TORCH_DEVICE.match(self.name))

    def __str__(self) -> str:
        text = f"{self.name}={self.memory}B"
        if self.tflops is not None:
            text += f",tflops={self.tflops!r}"
        if self.bandwidth is not None:
            text += f",bw={self.bandwidth!r}"
        if self.reserve is not None:
            text += f",reserve={self.reserve}B"
        if self.link is not None:
            text += f",link={self.link!r}"
        return text


def accelerate_device(device: Device, devices: Mapping[str, int | str] | None) -> int | str:
    """How accelerate names a plan's device: cuda:N as N, other torch names as they are, others via `devices`."""
    if devices and device.name in devices:
        return devices[device.name]
    if device.name.startswith("cuda:"):
        return int(device.name.split(":")[1])
    if device.is_torch_device:
        return device.name
    raise PlanError(f"device {device.name!r} is not a torch device name; map it, e.g. "
                    f"to_accelerate({{'{device.name}': 0}})")


@dataclass(frozen=True)
class Workload:
    """What runs: `batch` sequences of `context` tokens, weights in `dtype`, the KV cache in `cache_dtype`.

    `dtype` None keeps the stored (or config) dtype; `cache_dtype` None is the model's default: the
    activations' dtype, or f16 for a GGUF model (llama.cpp's default). Cache types: fp32, bf16, fp16, fp8
    (vLLM's, also spelled fp8_e4m3 / fp8_e5m2) and llama.cpp's q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl.
    `prefill_chunk` caps the tokens per prefill pass (llama.cpp's ubatch, vLLM's chunked prefill); None
    prefills the whole context at once. `optimize` is the phase whose slowest stage the plan minimises.
    """

    context: int = 4096
    batch: int = 1
    dtype: str | None = None
    cache_dtype: str | None = None
    prefill_chunk: int | None = None
    optimize: str = "decode"

    def __post_init__(self) -> None:
        for label, value in (("context", self.context), ("batch", self.batch), ("prefill_chunk", self.prefill_chunk)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise PlanError(f"workload: {label} must be a positive integer, got {value!r}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtype_name(self.dtype, what="workload dtype", allowed=WEIGHT_DTYPES))
        if self.cache_dtype is not None:
            object.__setattr__(self, "cache_dtype", dtype_name(self.cache_dtype, what="workload cache_dtype"))
        if self.optimize not in ("decode", "prefill"):
            raise PlanError(f"workload: optimize must be 'decode' or 'prefill', got {self.optimize!r}")

    @property
    def prefill_tokens(self) -> int:
        """Tokens in one prefill pass (over the whole batch)."""
        return self.batch * min(self.context, self.prefill_chunk or self.context)

    @property
    def prefill_passes(self) -> int:
        return -(-self.context // (self.prefill_chunk or self.context))
