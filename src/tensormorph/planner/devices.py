"""Device specs as users write them, and the devices of this machine (`auto`).

    cuda:0=24GiB,tflops=165,bw=1000      memory and speed
    cuda:0=24GiB                         memory alone: speed unknown, the plan balances by memory
    rtx3090 / "rtx 4060 ti 16gb"         a model from the device table (catalog), named cuda:N in list order
    cuda:1=rtx3090,reserve=2GiB          a model on a named device, options overriding the table
    mps=m2-max,64GiB                     an Apple chip with the memory of this machine
    cpu=64GiB                            the host tier, at DEFAULT_HOST_BANDWIDTH_GBPS unless bw= says otherwise
    auto                                 this machine: GPUs from torch.cuda or nvidia-smi, the host from /proc/meminfo
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from ..units import human_bytes
from . import catalog
from .spec import DEFAULT_HOST_BANDWIDTH_GBPS, DEFAULT_HOST_TFLOPS, HOST_TIER, TORCH_DEVICE, Device, PlanError, size_of

_OPTIONS = ("tflops", "bw", "reserve", "link")
NVIDIA_SMI = ("nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits")
NVIDIA_SMI_TIMEOUT_S = 20  # nvidia-smi answers in about a second; a hung driver must not hang planning
MEMINFO = Path("/proc/meminfo")
AUTO = "auto"


def _number(text: str, device: str, key: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise PlanError(f"device {device}: {key}={text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise PlanError(f"device {device}: {key} must be a positive number, got {text}")
    return value


def _explicit_name(spec: str) -> str | None:
    """The NAME of `NAME=...`; None for a bare model name (`rtx3090`, `rtx3090,reserve=2GiB`)."""
    head, eq, _ = spec.strip().partition("=")
    return head.strip() if eq and "," not in head else None


def parse_device(spec: str, *, gpu_name: str = "cuda:0") -> Device:
    """One device spec (see the module docstring). `gpu_name` names a GPU given by its model alone."""
    text = spec.strip()
    name = _explicit_name(text)
    body = text.partition("=")[2] if name is not None else text
    label = name or text
    if name == "":
        raise PlanError(f"device {spec!r}: expected NAME=MEMORY, e.g. cuda:0=24GiB,tflops=165,bw=1000")
    memory_text: str | None = None
    model: str | None = None
    fields: dict[str, str] = {}
    for part in (p.strip() for p in body.split(",")):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        if eq:
            if key not in _OPTIONS:
                raise PlanError(f"device {label}: unknown option {part!r}; known: tflops=, bw=, reserve=, link=")
            if key in fields:
                raise PlanError(f"device {label}: {key}= given twice")
            fields[key] = value.strip()
        elif not part:
            raise PlanError(f"device {spec!r}: an empty item; expected NAME=MEMORY[,tflops=T,bw=B]")
        elif (part[0].isdigit() or part[0] in "-+.") and not (part.isdigit() and catalog.find(part)):  # 3090
            if memory_text is not None:
                raise PlanError(f"device {label}: two memory sizes, {memory_text} and {part}")
            memory_text = part
        else:
            if model is not None:
                raise PlanError(f"device {label}: two model names, {model!r} and {part!r}")
            model = part
    if name is None and model is not None and TORCH_DEVICE.match(model) and memory_text is None:
        raise PlanError(f"device {model}: give its memory or its model, e.g. {model}=24GiB or {model}=rtx3090")
    memory = size_of(memory_text, f"device {label} memory") if memory_text is not None else None
    if memory is not None and memory <= 0:
        raise PlanError(f"device {label}: memory must be positive, got {memory_text}")
    if ("tflops" in fields) != ("bw" in fields) and model is None and name != HOST_TIER:
        meaning = {"tflops": "tflops= (compute, TFLOP/s)", "bw": "bw= (memory bandwidth, GB/s)"}
        missing = "bw" if "tflops" in fields else "tflops"
        raise PlanError(f"device {label}: missing {meaning[missing]}, e.g. {label}=24GiB,tflops=165,bw=1000 "
                        "(or neither, planning by memory alone)")
    tflops = _number(fields["tflops"], label, "tflops") if "tflops" in fields else None
    bandwidth = _number(fields["bw"], label, "bw") if "bw" in fields else None
    notes: tuple[str, ...] = ()
    product = None
    if model is not None:
        found = catalog.lookup(model, memory)
        name = name or ("mps" if found.kind == "apple" else gpu_name)
        product = found.name
        tflops = tflops if tflops is not None else found.tflops
        bandwidth = bandwidth if bandwidth is not None else found.bandwidth
        memory = memory if memory is not None else found.memory
        speed = (f"{found.tflops:g} TFLOP/s bf16" if found.tflops is not None else "TFLOP/s unknown") + \
            f", {found.bandwidth:g} GB/s"
        notes = (f"{name} is the {found.name} of the device table: {human_bytes(found.memory)}, {speed} "
                 f"({found.source}){'; ' + found.note if found.kind == 'apple' else ''}",)
    elif memory is None:
        raise PlanError(f"device {label}: give its memory, e.g. {label}=24GiB, or a model name, e.g. rtx3090")
    if name is None:
        raise PlanError(f"device {spec!r}: give it a name, e.g. cuda:0={body}")
    assert memory is not None
    if name == HOST_TIER and tflops is None and bandwidth is None:
        tflops, bandwidth = DEFAULT_HOST_TFLOPS, DEFAULT_HOST_BANDWIDTH_GBPS
        notes += (f"{name}: host speed assumed, {bandwidth:g} GB/s and {tflops:g} TFLOP/s (give bw= and tflops=)",)
    elif name == HOST_TIER and (tflops is None or bandwidth is None):  # the host's one missing figure is assumed
        if tflops is None:
            tflops = DEFAULT_HOST_TFLOPS
            notes += (f"{name}: host compute assumed, {tflops:g} TFLOP/s (give tflops=)",)
        else:
            bandwidth = DEFAULT_HOST_BANDWIDTH_GBPS
            notes += (f"{name}: host bandwidth assumed, {bandwidth:g} GB/s (give bw=)",)
    return Device(name=name, memory=memory, tflops=tflops, bandwidth=bandwidth,
                  reserve=size_of(fields["reserve"], f"device {label} reserve") if "reserve" in fields else None,
                  link=_number(fields["link"], label, "link") if "link" in fields else None,
                  product=product, notes=notes)


def parse_devices(specs: Sequence[Device | str]) -> list[Device]:
    """Devices from specs in pipeline order: `auto` becomes this machine's devices, and GPUs given by model
    alone take the first cuda:N that no spec names."""
    taken = {n for s in specs if isinstance(s, str) and (n := _explicit_name(s))}
    out: list[Device] = []
    for spec in specs:
        if isinstance(spec, Device):
            out.append(spec)
        elif spec.strip().lower() == AUTO:
            out.extend(local_devices())
        else:
            used = taken | {d.name for d in out}
            free = next(f"cuda:{k}" for k in range(len(used) + 1) if f"cuda:{k}" not in used)
            out.append(parse_device(spec, gpu_name=free))
    return out


def parse_nvidia_smi(text: str) -> list[tuple[str, int]]:
    """(name, bytes) per GPU from `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        name, _, mib = line.rpartition(",")
        try:
            gpus.append((name.strip(), int(mib.strip()) << 20))
        except ValueError:
            raise PlanError(f"nvidia-smi printed {line!r}, not 'NAME, MiB'") from None
    return gpus


def host_memory(meminfo: str) -> int:
    """Bytes the host can give now (MemAvailable; MemTotal on kernels without it) from /proc/meminfo's text."""
    values = {}
    for line in meminfo.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0]) * 1024  # the kernel's "kB" are KiB
    for key in ("MemAvailable", "MemTotal"):
        if key in values:
            return values[key]
    raise PlanError(f"{MEMINFO} holds neither MemAvailable nor MemTotal")


def _torch_gpus() -> list[tuple[str, int]]:
    try:
        import torch  # only `auto` asks torch: planning itself never imports it
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]


def _nvidia_smi_gpus() -> list[tuple[str, int]]:
    if shutil.which(NVIDIA_SMI[0]) is None:
        return []
    try:
        done = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_nvidia_smi(done.stdout)


def local_devices(gpus: Callable[[], list[tuple[str, int]]] | None = None, meminfo: Path = MEMINFO) -> list[Device]:
    """This machine's GPUs (torch.cuda, else nvidia-smi), with speeds where the device table knows their name,
    then the host tier from /proc/meminfo. `gpus` replaces the detection (tests)."""
    found = gpus() if gpus is not None else (_torch_gpus() or _nvidia_smi_gpus())
    out = []
    for index, (model, memory) in enumerate(found):
        name = f"cuda:{index}"
        products = catalog.find(model, memory)
        if len(products) == 1:
            p = products[0]
            out.append(Device(name, memory, p.tflops, p.bandwidth, product=p.name,
                              notes=(f"{name}: {model}, found here; speed from the device table ({p.source})",)))
        else:
            out.append(Device(name, memory, product=model,
                              notes=(f"{name}: {model}, found here, is not in the device table: speed unknown",)))
    try:
        text = meminfo.read_text()
    except OSError:
        return out
    available = host_memory(text)
    out.append(Device(HOST_TIER, available, DEFAULT_HOST_TFLOPS, DEFAULT_HOST_BANDWIDTH_GBPS,
                      notes=(f"{HOST_TIER}: {human_bytes(available)} available in {meminfo}; host speed assumed, "
                             f"{DEFAULT_HOST_BANDWIDTH_GBPS:g} GB/s and {DEFAULT_HOST_TFLOPS:g} TFLOP/s",)))
    return out
