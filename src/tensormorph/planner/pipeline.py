"""Pipeline placement: contiguous layer ranges, within every device's memory, that run the phase fastest.

A pipeline of stages handling n items takes the sum of the stage times (the first
item passes every stage) plus (n - 1) times the slowest stage (the rest follow it
through). Decode steps one batch through the stages (n = 1: the sum counts), and a
chunked prefill pushes n = context / chunk chunks (the slowest stage counts).
Memory-bound decode gains nothing from micro-batches at a fixed batch: each one
reads the stage's weights again.

For each choice of device for the input side (embeddings) and the output side
(final norm and head; one device when they are tied) two splits are built: the
one with the least total (layers go to the fastest devices first, as many as
their memory holds) and the one with the least slowest stage (bisection on the
stage time T: devices take layers in order, each the longest run that keeps its
memory within budget and its stage within T; taking the longest run never hurts
later devices, and prefix sums make each check a few `searchsorted` calls). The
split with the least phase time wins.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .costs import activation_bytes, handoff_bytes, path_bandwidth, unit_cost
from .modelspec import ModelSpec
from .spec import Device, Workload

_RELATIVE_TOLERANCE = 1e-6
_POLISHED = 4  # candidates refined by local search
_BALANCE_TOLERANCE = 1e-4  # of a device's memory: how evenly a memory-only split fills them


@dataclass(frozen=True)
class Split:
    """One candidate: input side on `first`, output side on `last`, layers [ranges[d][0], ranges[d][1]) on d."""

    first: int
    last: int
    ranges: tuple[tuple[int, int], ...]
    slowest: float  # the slowest stage's time for one item
    total: float  # the sum of the stage times for one item
    items: int

    @property
    def time(self) -> float:
        """The phase's time: the first item through every stage, the others behind the slowest."""
        return self.total + (self.items - 1) * self.slowest


class PipelineSolver:
    """Precomputed prefix sums of one model's layers for one workload, to test and search splits quickly."""

    def __init__(self, spec: ModelSpec, devices: Sequence[Device], workload: Workload, links: Sequence[float]):
        self.spec, self.devices, self.links = spec, list(devices), list(links)
        if not all(d.speed_known for d in self.devices):
            raise ValueError("the pipeline solver times stages: give it devices of known speed")
        self.bytes_per_s = [float(d.bandwidth or 0) * 1e9 for d in self.devices]
        self.flops_per_s = [float(d.tflops or 0) * 1e12 for d in self.devices]
        costs = [unit_cost(u, spec, workload) for u in spec.units]
        n_in, n_layers = len(spec.inputs), len(spec.layers)
        inputs, layers, outputs = costs[:n_in], costs[n_in:n_in + n_layers], costs[n_in + n_layers:]
        decode = workload.optimize == "decode"

        def work(group: Sequence) -> tuple[float, float]:
            return (sum(c.decode_bytes if decode else c.prefill_bytes for c in group),
                    sum(c.decode_flops if decode else c.prefill_flops for c in group))

        self.layers = n_layers
        self.prefix_memory = np.concatenate(([0.0], np.cumsum([c.weights + c.kv for c in layers], dtype=np.float64)))
        self.prefix_bytes = np.concatenate(([0.0], np.cumsum([c.decode_bytes if decode else c.prefill_bytes
                                                               for c in layers], dtype=np.float64)))
        self.prefix_flops = np.concatenate(([0.0], np.cumsum([c.decode_flops if decode else c.prefill_flops
                                                               for c in layers], dtype=np.float64)))
        self.in_weights, self.out_weights = sum(c.weights for c in inputs), sum(c.weights for c in outputs)
        self.in_work, self.out_work = work(inputs), work(outputs)
        # activation headroom for each mix of input side / layers / output side on one device
        self.activations = {
            (has_in, has_layer, has_out): activation_bytes(
                (inputs if has_in else []) + (layers[:1] if has_layer else []) + (outputs if has_out else []),
                spec, workload)
            for has_in in (False, True) for has_layer in (False, True) for has_out in (False, True)}
        self.items = 1 if decode else workload.prefill_passes
        # per item: one decode step, or one prefill chunk
        self.handoff = handoff_bytes(spec, workload)[0 if decode else 1] / self.items
        self.tied = spec.arch.tied

    def _recv(self, source: int, target: int) -> float:
        return 0.0 if source == target else self.handoff / (path_bandwidth(self.links, source, target) * 1e9)

    def split(self, limit: float, first: int, last: int, memory: Sequence[int]) -> Split | None:
        """Layer ranges with every stage within `limit` seconds and every device within `memory`, or None."""
        ranges = [(0, 0)] * len(self.devices)
        start, previous = 0, first
        for d, device in enumerate(self.devices):
            if start == self.layers:
                break
            budget = (limit - self._recv(previous, d)) * self.items  # the stage's work over all items
            if budget <= 0:
                continue
            nbytes = self.in_work[0] * (d == first) + self.out_work[0] * (d == last)
            flops = self.in_work[1] * (d == first) + self.out_work[1] * (d == last)
            fixed = (device.reserve_bytes + self.in_weights * (d == first) + self.out_weights * (d == last)
                     + self.activations[(d == first, True, d == last)])
            end = min(
                np.searchsorted(self.prefix_bytes, self.prefix_bytes[start] + budget * self.bytes_per_s[d] - nbytes,
                                "right"),
                np.searchsorted(self.prefix_flops, self.prefix_flops[start] + budget * self.flops_per_s[d] - flops,
                                "right"),
                np.searchsorted(self.prefix_memory, self.prefix_memory[start] + memory[d] - fixed, "right"),
            ) - 1
            end = min(int(end), self.layers)
            if end > start:
                ranges[d] = (start, end)
                start, previous = end, d
        if start < self.layers:
            return None
        return self._check(first, last, tuple(ranges), limit, memory)

    def _check(self, first: int, last: int, ranges: tuple[tuple[int, int], ...], limit: float,
               memory: Sequence[int]) -> Split | None:
        """Every device's memory and stage time, the output hand-off included; None when over."""
        slowest = total = 0.0
        holders = [d for d, (a, b) in enumerate(ranges) if b > a]
        for d, device in enumerate(self.devices):
            a, b = ranges[d]
            held = (d == first, b > a, d == last)
            if not any(held):
                continue
            used = (device.reserve_bytes + self.in_weights * held[0] + self.out_weights * held[2]
                    + self.prefix_memory[b] - self.prefix_memory[a] + self.activations[held])
            if used > memory[d]:
                return None
            nbytes = (self.prefix_bytes[b] - self.prefix_bytes[a]
                      + self.in_work[0] * held[0] + self.out_work[0] * held[2])
            flops = (self.prefix_flops[b] - self.prefix_flops[a]
                     + self.in_work[1] * held[0] + self.out_work[1] * held[2])
            stage = max(nbytes / self.bytes_per_s[d], flops / self.flops_per_s[d]) / self.items
            if held[1]:
                stage += self._recv(first if d == holders[0] else holders[holders.index(d) - 1], d)
            if d == last:
                stage += self._recv(holders[-1], d)
            if stage > limit:
                return None
            slowest, total = max(slowest, stage), total + stage
        return Split(first, last, ranges, slowest, total, self.items)

    def _sides(self) -> list[tuple[int, int]]:
        n = len(self.devices)
        return [(e, e) for e in range(n)] if self.tied else [(e, h) for e in range(n) for h in range(n)]

    def feasible(self, memory: Sequence[int]) -> bool:
        """Whether any split fits in `memory`, whatever its speed."""
        return any(self.split(math.inf, e, h, memory) is not None for e, h in self._sides())

    def fastest_first(self, first: int, last: int, memory: Sequence[int]) -> Split | None:
        """The least total: each device, fastest per layer first, takes as many layers as its memory holds
        (counting every layer at the largest layer's size), then the counts become ranges in device order."""
        n = self.layers
        layer_memory = float(np.max(np.diff(self.prefix_memory)))
        per_layer = [max(self.prefix_bytes[n] / n / self.bytes_per_s[d], self.prefix_flops[n] / n / self.flops_per_s[d])
                     for d in range(len(self.devices))]
        counts = [0] * len(self.devices)
        remaining = n
        for d in sorted(range(len(self.devices)), key=per_layer.__getitem__):
            device = self.devices[d]
            room = (memory[d] - device.reserve_bytes - self.in_weights * (d == first)
                    - self.out_weights * (d == last) - self.activations[(d == first, True, d == last)])
            counts[d] = min(remaining, max(0, int(room // layer_memory)) if layer_memory > 0 else remaining)
            remaining -= counts[d]
        if remaining:
            return None
        ends = np.cumsum(counts)
        return self._check(first, last, tuple((int(e - c), int(e)) for c, e in zip(counts, ends)), math.inf, memory)

    def least_slowest(self, first: int, last: int, memory: Sequence[int], beat: float = math.inf) -> Split | None:
        """The split with the least slowest stage (by bisection), or None when it cannot get below `beat`."""
        found = self.split(beat, first, last, memory)
        if found is None:
            return None
        low, high = 0.0, found.slowest
        while high - low > _RELATIVE_TOLERANCE * high:
            trial = self.split((low + high) / 2, first, last, memory)
            if trial is None:
                low = (low + high) / 2
            else:
                found, high = trial, trial.slowest
        return found

    def best(self, memory: Sequence[int]) -> Split | None:
        """The split with the least phase time that fits `memory`; None when none fits."""
        candidates = [s for e, h in self._sides() if (s := self.fastest_first(e, h, memory)) is not None]
        if self.items > 1 or not candidates:  # the slowest stage matters, or only exact memory checks fit
            beat = math.inf
            for e, h in self._sides():
                found = self.least_slowest(e, h, memory, beat)
                if found is not None:
                    candidates.append(found)
                    beat = min(beat, found.slowest * (1 + _RELATIVE_TOLERANCE))
        candidates.sort(key=lambda s: (s.time, s.slowest))
        return min((self.improve(s, memory) for s in candidates[:_POLISHED]), key=lambda s: (s.time, s.slowest),
                   default=None)

    def balanced(self, memory: Sequence[int]) -> Split | None:
        """Memory alone (speeds unknown): the split that fills the accelerators most evenly, each to the least
        common fraction of its memory after the reserve (llama.cpp splits by free memory too); host devices take
        only what the accelerators cannot hold. None when nothing fits."""
        host = [d.is_host for d in self.devices]

        def at(fraction: float, with_host: bool) -> Split | None:
            scaled = [(m if with_host else 0) if h else int(d.reserve_bytes + fraction * (m - d.reserve_bytes))
                      for m, h, d in zip(memory, host, self.devices)]
            return next((s for e, t in self._sides() if (s := self.split(math.inf, e, t, scaled)) is not None), None)

        found = at(1.0, False)
        if found is None:
            return at(1.0, True) if any(host) else None
        low, high = 0.0, 1.0  # found fits at high
        while high - low > _BALANCE_TOLERANCE:
            trial = at((low + high) / 2, False)
            low, high, found = (low, (low + high) / 2, trial) if trial is not None else ((low + high) / 2, high, found)
        return found

    def improve(self, split: Split, memory: Sequence[int]) -> Split:
        """Move a layer, all of a device's layers, or the input or output side to another device while the
        phase gets faster: the constructions above ignore hand-offs and the roofline of the two sides."""
        improved = True
        while improved:
            improved = False
            counts = [b - a for a, b in split.ranges]
            for source, target in itertools.permutations(range(len(counts)), 2):
                moves = [(split.first, split.last, counts)]
                for moved in {1, counts[source]} if counts[source] else ():  # one layer, or all (saves a hand-off)
                    trial = counts.copy()
                    trial[source] -= moved
                    trial[target] += moved
                    moves.append((split.first, split.last, trial))
                if split.first == source:  # the input side (and a tied output side) to target
                    moves.append((target, target if self.tied else split.last, counts))
                if split.last == source and not self.tied:
                    moves.append((split.first, target, counts))
                for first, last, trial in moves[1:]:
                    ends = np.cumsum(trial)
                    found = self._check(first, last, tuple((int(e - c), int(e)) for c, e in zip(trial, ends)),
                                        math.inf, memory)
                    if found is not None and found.time < split.time * (1 - 1e-9):
                        split, improved = found, True
                        break
                if improved:
                    break
        return split

    def placement(self, split: Split) -> list[int]:
        """Device index for every unit of the model, in `spec.units` order."""
        layer_device = [d for d, (a, b) in enumerate(split.ranges) for _ in range(a, b)]
        return [split.first] * len(self.spec.inputs) + layer_device + [split.last] * len(self.spec.outputs)
