"""The host tier: what goes to system RAM (`cpu=SIZE`) when the accelerators are full, and what it costs.

Pieces move to the host one step at a time, each only while the accelerators cannot hold the rest:
1. the input side (the embedding: decode reads one row of it per token, and llama.cpp keeps it on the CPU
   anyway), unless it is tied to the head;
2. the routed experts of each MoE layer, first layer first (llama.cpp users' `-ot exps=CPU`, `--n-cpu-moe N`):
   each token reads only the experts it picks, so they cost the least time per byte moved;
3. whole layers with their KV cache, first layer first (llama.cpp's `-ngl` keeps the last layers on the GPUs);
   the last step puts everything on the host.
The least number of steps that fits is taken; the accelerators hold what is left as a pipeline of contiguous
layers (`PipelineSolver` on the model less the offloaded pieces), wherever the host is listed.

Time: the host's share runs at its own bandwidth and compute (roofline), and every time the hidden state crosses
between an accelerator and the host (twice per layer whose experts sit there) it travels over the host link
(PCIe: the host's `link=`, else `--link`, else HOST_LINK_GBPS). A decode step is the sum of every stage's time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cache

from .costs import evaluate_pipeline, handoff_bytes, path_bandwidth, unit_cost, usage
from .modelspec import ModelSpec, Unit
from .pipeline import PipelineSolver, Split
from .result import DeviceUsage
from .spec import DEFAULT_LINK_GBPS, HOST_TIER, Device, Workload

HOST_LINK_GBPS = DEFAULT_LINK_GBPS  # host <-> GPU copies over PCIe 4.0 x16 when no link is given


def host_index(devices: Sequence[Device]) -> int | None:
    """The position of the host tier among `devices`, when there is one beside at least one accelerator."""
    index = next((i for i, d in enumerate(devices) if d.name == HOST_TIER), None)
    return index if index is not None and len(devices) > 1 else None


@dataclass(frozen=True)
class Offload:
    """What sits on the host after some steps: the input side, the experts of some layers, the first layers."""

    inputs: bool
    experts: frozenset[int]  # layers whose routed experts are on the host while the rest of the layer is not
    layers: int  # the first `layers` layers are wholly on the host
    everything: bool


@dataclass(frozen=True)
class HostSplit:
    """A placement with a host tier: `steps` offload steps taken, the accelerators' pipeline split (None when
    everything is on the host)."""

    steps: int
    gpu: Split | None


def experts_of(layer: Unit) -> Unit:
    """A layer's routed experts as a unit of their own (kind "experts": no KV cache)."""
    return Unit(layer.name, "experts", tuple(t for t in layer.tensors if t.expert))


class HostSolver:
    """Plans one model for one workload on accelerators plus the host tier (same questions as PipelineSolver)."""

    def __init__(self, spec: ModelSpec, devices: Sequence[Device], host: int, workload: Workload,
                 links: Sequence[float], host_link: float):
        self.spec, self.devices, self.host, self.workload = spec, list(devices), host, workload
        self.host_link = host_link
        self.gpus = [i for i in range(len(devices)) if i != host]
        self.gpu_devices = [devices[i] for i in self.gpus]
        self.gpu_links = [path_bandwidth(links, a, b) for a, b in zip(self.gpus, self.gpus[1:])]
        self.moe = [i for i, layer in enumerate(spec.layers) if any(t.expert for t in layer.tensors)]
        self.steps: list[tuple[str, int]] = [("inputs", 0)] if spec.inputs and not spec.arch.tied else []
        self.steps += [("experts", i) for i in self.moe] + [("layer", i) for i in range(len(spec.layers))]
        self._gpu_solver = cache(self._solver)
        self._host_rows: dict[int, DeviceUsage] = {}  # by steps: asked again in every bisection

    def offload(self, steps: int) -> Offload:
        taken = self.steps[:steps]
        layers = sum(kind == "layer" for kind, _ in taken)
        return Offload(inputs=("inputs", 0) in taken, experts=frozenset(i for k, i in taken if k == "experts"),
                       layers=layers, everything=layers == len(self.spec.layers))

    def gpu_spec(self, steps: int) -> ModelSpec:
        """The model less what the host holds after `steps` (at least one layer is left)."""
        off = self.offload(steps)

        def kept(i: int, layer: Unit) -> Unit:
            return replace(layer, tensors=tuple(t for t in layer.tensors if not t.expert)) if i in off.experts \
                else layer

        layers = tuple(kept(i, u) for i, u in enumerate(self.spec.layers) if i >= off.layers)
        return replace(self.spec, inputs=() if off.inputs else self.spec.inputs, layers=layers)

    def _solver(self, steps: int) -> PipelineSolver | None:
        if self.offload(steps).everything:
            return None
        return PipelineSolver(self.gpu_spec(steps), self.gpu_devices, self.workload, self.gpu_links)

    def host_units(self, steps: int) -> tuple[list[Unit], list[Unit]]:
        """(whole units on the host, expert pieces on the host) after `steps`."""
        off = self.offload(steps)
        s = self.spec
        if off.everything:
            return list(s.units), []
        whole = (list(s.inputs) if off.inputs else []) + list(s.layers[:off.layers])
        return whole, [experts_of(s.layers[i]) for i in sorted(off.experts) if i >= off.layers]

    def crossings(self, steps: int) -> int:
        """How often the hidden state passes between the host and an accelerator in one forward pass."""
        off = self.offload(steps)
        on_host: list[bool] = [off.inputs or off.everything] if self.spec.inputs else []
        for i in range(len(self.spec.layers)):
            whole = off.everything or i < off.layers
            on_host.append(whole)
            if i in self.moe:
                on_host.append(whole or i in off.experts)
        if self.spec.outputs:
            on_host.append(off.everything)
        return sum(a != b for a, b in zip(on_host, on_host[1:]))

    def host_row(self, steps: int) -> DeviceUsage:
        """The host's row after `steps`."""
        if steps not in self._host_rows:
            self._host_rows[steps] = self._host_row(steps)
        return self._host_rows[steps]

    def _host_row(self, steps: int) -> DeviceUsage:
        whole, pieces = self.host_units(steps)
        s, w = self.spec, self.workload
        costs = [unit_cost(u, s, w) for u in whole + pieces]
        decode_one, prefill_one = handoff_bytes(s, w)
        crossings = self.crossings(steps) / (self.host_link * 1e9)
        number = {u.name: k for k, u in enumerate(s.layers)}
        row = usage(self.devices[self.host], s, w, costs, units=tuple(u.name for u in whole),
                    layers=tuple(number[u.name] for u in whole if u.kind == "layer"),
                    decode_recv=decode_one * crossings, prefill_recv=prefill_one * crossings)
        return replace(row, tensors=tuple(t.name for p in pieces for t in p.tensors),
                       expert_layers=tuple(number[p.name] for p in pieces))

    def _host_fits(self, steps: int, memory: int) -> bool:
        return self.host_row(steps).used <= memory

    def _gpu_fits(self, steps: int, memory: Sequence[int]) -> bool:
        solver = self._gpu_solver(steps)
        return solver is None or solver.feasible(memory)

    def least_steps(self, memory: Sequence[int]) -> int:
        """The fewest steps after which the accelerators hold the rest (bisection: fewer steps only add to them)."""
        gpu_memory = [memory[i] for i in self.gpus]
        low, high = -1, len(self.steps)  # high fits (everything on the host), low does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if self._gpu_fits(middle, gpu_memory) else (middle, high)
        return high

    def feasible(self, memory: Sequence[int]) -> bool:
        return self._host_fits(self.least_steps(memory), memory[self.host])

    def _place(self, memory: Sequence[int], balanced: bool) -> HostSplit | None:
        steps = self.least_steps(memory)
        if not self._host_fits(steps, memory[self.host]):
            return None
        solver = self._gpu_solver(steps)
        if solver is None:
            return HostSplit(steps, None)
        gpu_memory = [memory[i] for i in self.gpus]
        split = solver.balanced(gpu_memory) if balanced else solver.best(gpu_memory)
        return HostSplit(steps, split) if split is not None else None

    def best(self, memory: Sequence[int]) -> HostSplit | None:
        """The fastest placement with the least on the host; None when nothing fits."""
        return self._place(memory, balanced=False)

    def balanced(self, memory: Sequence[int]) -> HostSplit | None:
        """Speeds unknown: the accelerators filled evenly, the host holding only what they cannot."""
        return self._place(memory, balanced=True)

    def rows(self, split: HostSplit) -> tuple[DeviceUsage, ...]:
        """Every device's row, in the order given."""
        host = self.host_row(split.steps)
        solver = self._gpu_solver(split.steps)
        if solver is None or split.gpu is None:
            gpu_rows = [usage(d, self.spec, self.workload, []) for d in self.gpu_devices]
        else:
            first = self.offload(split.steps).layers  # the accelerators' layers are numbered from here
            gpu_rows = [replace(r, layers=tuple(n + first for n in r.layers)) for r in evaluate_pipeline(
                solver.spec, self.gpu_devices, self.workload, solver.placement(split.gpu), self.gpu_links)]
        rows = iter(gpu_rows)
        return tuple(host if i == self.host else next(rows) for i in range(len(self.devices)))

    def device_map(self, split: HostSplit) -> dict[str, str]:
        """Module -> device for every unit (a layer whose experts are on the host maps to its accelerator)."""
        placed = {name: row.name for row in self.rows(split) for name in row.units}
        return {u.name: placed[u.name] for u in self.spec.units}

    def offloaded(self, split: HostSplit) -> dict[str, str]:
        """Tensor -> device for the tensors placed apart from their unit (routed experts on the host)."""
        return {name: self.devices[self.host].name for name in self.host_row(split.steps).tensors}
