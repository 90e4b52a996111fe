"""Tensor-parallel splits: every layer divided across all devices, by attention heads and MLP columns.

Attention splits by KV-head groups (each device keeps whole groups of query heads
with their KV head); with fewer KV heads than devices each KV head is replicated,
as vLLM does. Evenly split runtimes (vLLM, torch TP) need the heads to divide;
runtimes that allow uneven splits (llama.cpp's --tensor-split) get shares
proportional to device speed: memory bandwidth when optimising decode, compute
when optimising prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .costs import Share
from .modelspec import ModelSpec
from .spec import Device, PlanError, Workload


def _proportional(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in integers proportional to `weights`, at least 1 each (largest remainders)."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [max(1, math.floor(x)) for x in exact]
    while sum(counts) > total:  # the minimum of 1 took too many: give back from the most over-served
        counts[max(range(len(counts)), key=lambda i: counts[i] - exact[i])] -= 1
    order = sorted(range(len(counts)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    return counts


def _even_counts(heads: int, kv_heads: int) -> list[int]:
    return [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]


def tensor_shares(spec: ModelSpec, devices: Sequence[Device], workload: Workload,
                  uneven: bool) -> tuple[list[Share], list[tuple[int, int]], list[str]]:
    """(share per device, (query heads, KV heads) per device, notes)."""
    a = spec.arch
    n = len(devices)
    if a.heads is None or a.kv_heads is None:
        raise PlanError("tensor parallelism splits attention heads: put config.json (num_attention_heads, "
                        "num_key_value_heads) beside the checkpoint", file=str(spec.path) if spec.path else None)
    notes: list[str] = []
    if all(d.speed_known for d in devices):
        speed = [float((d.bandwidth if workload.optimize == "decode" else d.tflops) or 0) for d in devices]
    else:  # llama.cpp's default --tensor-split: by each device's free memory
        speed = [float(d.memory - d.reserve_bytes) for d in devices]
    group = a.heads // a.kv_heads
    if uneven and a.kv_heads >= n:
        kv = _proportional(a.kv_heads, speed)
        fractions = [s / sum(speed) for s in speed]
        return ([Share(q=k / a.kv_heads, kv=k / a.kv_heads, mlp=f, vocab=f) for k, f in zip(kv, fractions)],
                [(k * group, k) for k in kv], notes)
    if uneven:
        notes.append(f"{a.kv_heads} KV heads cannot go unevenly to {n} devices: split evenly")
    if a.heads % n or (a.kv_heads % n and n % a.kv_heads):
        fits = ", ".join(map(str, _even_counts(a.heads, a.kv_heads)))
        hint = " or an uneven split" if a.kv_heads >= n else ""
        raise PlanError(f"tensor parallelism over {n} devices needs the {a.heads} attention heads and {a.kv_heads} "
                        f"KV heads to split evenly, and they do not; use {fits} devices, the pipeline "
                        f"strategy{hint}")
    if a.kv_heads < n:
        notes.append(f"{a.kv_heads} KV heads over {n} devices: each KV head is replicated on {n // a.kv_heads}")
    kv_each = max(1, a.kv_heads // n)
    share = Share(q=1 / n, kv=kv_each / a.kv_heads, mlp=1 / n, vocab=1 / n)
    return [share] * n, [(a.heads // n, kv_each)] * n, notes
