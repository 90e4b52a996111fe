"""The cost model: what a placement takes on each device and how long each stage runs.

Memory on a device = weights placed there + the KV cache of its layers
(2 × KV heads × head dim × context × batch × cache bytes per layer) + activation
headroom for one prefill pass + the runtime's reserve. A stage's time is a
roofline, max(bytes read / memory bandwidth, FLOPs / compute), plus the time to
receive the hidden state over the link. See docs/plan.md for every formula.
An encoder-only model (BERT) runs one forward pass: no KV cache, no decode
step, and attention over every pair of tokens (not the causal half).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .modelspec import ModelSpec, TensorSpec, Unit
from .result import DeviceUsage
from .spec import ELEMENT_BYTES, Device, Workload

LOGIT_BYTES = 4  # runtimes upcast logits to fp32


@dataclass(frozen=True)
class Share:
    """The fraction of each kind of work one device holds: 1 everywhere in a pipeline stage."""

    q: float = 1.0  # query heads (and the attention output projection)
    kv: float = 1.0  # KV heads (more than an even share when they are replicated)
    mlp: float = 1.0  # MLP / expert columns
    vocab: float = 1.0  # rows of the embedding and the LM head


FULL = Share()


@dataclass(frozen=True)
class UnitCost:
    """One unit's figures at one share: resident bytes, KV cache, and work per decode step and per prefill."""

    weights: int
    kv: int
    decode_bytes: float
    decode_flops: float
    prefill_bytes: float
    prefill_flops: float
    width: int  # activation elements per token while it runs
    logits: int  # bytes of logits it produces (the LM head)


def element_bytes(name: str) -> float:
    return ELEMENT_BYTES[name]


def kv_bytes_per_layer(spec: ModelSpec, workload: Workload, kv_share: float = 1.0) -> int:
    """2 (K and V) × KV width × context × batch × cache bytes per element."""
    cache = element_bytes(workload.cache_dtype or spec.default_cache)
    return math.ceil(2 * spec.arch.kv_dim * kv_share * workload.context * workload.batch * cache)


def _touched(fraction: float, tokens: int) -> float:
    """Expected share of routed experts that `tokens` tokens touch, each picking `fraction` of them."""
    return 1.0 - (1.0 - fraction) ** tokens


def _fraction(t: TensorSpec, spec: ModelSpec, share: Share) -> float:
    """The share of a tensor one device holds under tensor parallelism (1 for replicated tensors)."""
    bias = t.name.endswith(".bias")
    if t.role == "q":
        return share.q
    if t.role == "kv":
        return share.kv
    if t.role == "qkv":
        a = spec.arch
        return (a.q_dim * share.q + 2 * a.kv_dim * share.kv) / (a.q_dim + 2 * a.kv_dim)
    if t.role == "o":
        return 1.0 if bias else share.q  # a row-parallel layer's bias is added once, after the all-reduce
    if t.role == "col":
        return share.mlp
    if t.role == "row":
        return 1.0 if bias else share.mlp
    if t.role in ("embed", "head") and t.shape[0] == spec.arch.vocab:
        return share.vocab
    return 1.0


def unit_cost(unit: Unit, spec: ModelSpec, workload: Workload, share: Share = FULL) -> UnitCost:
    """Memory and work of one unit on a device holding `share` of it."""
    a = spec.arch
    batch, context = workload.batch, workload.context
    tokens = batch * context
    routed = a.experts_per_token / a.experts if a.experts else 0.0
    weights = decode_bytes = decode_flops = prefill_bytes = prefill_flops = 0.0
    logits = 0
    for t in unit.tensors:
        frac = _fraction(t, spec, share)
        weights += t.nbytes * frac
        size, numel = t.size * frac, t.numel * frac
        if t.role == "embed":  # a lookup reads one row per token
            row = size / t.shape[0]
            decode_bytes += min(size, batch * row)
            prefill_bytes += min(size, tokens * row)
        elif t.role == "head":  # logits only for the last position of each sequence
            decode_bytes += size
            decode_flops += 2 * numel * batch
            prefill_bytes += size
            prefill_flops += 2 * numel * batch
            logits += math.ceil(batch * t.shape[0] * frac * LOGIT_BYTES)
        elif t.expert:
            decode_bytes += size * _touched(routed, batch)
            decode_flops += 2 * numel * routed * batch
            prefill_bytes += size * _touched(routed, workload.prefill_tokens) * workload.prefill_passes
            prefill_flops += 2 * numel * routed * tokens
        else:
            decode_bytes += size
            decode_flops += 2 * numel * batch
            prefill_bytes += size * workload.prefill_passes
            prefill_flops += 2 * numel * tokens
    kv = 0
    width = a.hidden
    if a.encoder:  # nothing is decoded
        decode_bytes = decode_flops = 0.0
    if unit.kind == "layer":
        q = a.q_dim * share.q
        if a.encoder:
            prefill_flops += 4 * batch * context * context * q  # every token attends to every token
        else:
            kv = kv_bytes_per_layer(spec, workload, share.kv)
            decode_bytes += kv  # every step reads the whole cache of the layer
            decode_flops += 4 * batch * context * q  # q·K over the context, then weights·V
            prefill_bytes += kv
            prefill_flops += 2 * batch * context * context * q  # causal: half of the 4·c²·q of full attention
        # the residual stream and its normed copy, plus the wider of attention (q, k, v, output) and MLP
        # (gate, up and their product); one layer runs at a time, so this is the peak
        width = max(2 * a.hidden + 2 * round(q) + 2 * round(a.kv_dim * share.kv),
                    2 * a.hidden + 3 * round(a.ffn * share.mlp))
    elif unit.kind == "experts":  # a layer's routed experts run apart (on the host): the MLP's activations
        width = 2 * a.hidden + 3 * round(a.ffn * share.mlp)
    return UnitCost(weights=math.ceil(weights), kv=kv, decode_bytes=decode_bytes, decode_flops=decode_flops,
                    prefill_bytes=prefill_bytes, prefill_flops=prefill_flops, width=width, logits=logits)


def activation_bytes(costs: Sequence[UnitCost], spec: ModelSpec, workload: Workload) -> int:
    """Headroom for one prefill pass on a device running these units: the widest unit's live activations
    for every token of the pass, plus the logits when it holds the head.

    llama.cpp (which runs GGUF models) sizes its compute buffer for a pass whose every token is an output: the
    head's fp32 logits for each token of the pass, beside the normed hidden state, when that is wider than a layer
    (`make validate-plan` measures it: docs/plan.md)."""
    if not costs:
        return 0
    tokens = workload.prefill_tokens
    peak = tokens * element_bytes(spec.act_dtype) * max(c.width for c in costs)
    logits = sum(c.logits for c in costs)
    if spec.source == "gguf" and logits:
        vocab_share = logits / (workload.batch * LOGIT_BYTES)  # this device's rows of the head
        return math.ceil(max(peak, tokens * LOGIT_BYTES * (vocab_share + 2 * spec.arch.hidden)))
    return math.ceil(peak) + logits


def handoff_bytes(spec: ModelSpec, workload: Workload) -> tuple[float, float]:
    """(decode, prefill) bytes of hidden state passed from one stage to the next."""
    one = workload.batch * spec.arch.hidden * element_bytes(spec.act_dtype)
    return one, one * workload.context


def seconds(nbytes: float, flops: float, device: Device) -> float:
    """Roofline: the slower of reading the bytes and doing the FLOPs; 0 for a device of unknown speed (a plan
    with one predicts no times)."""
    if device.tflops is None or device.bandwidth is None:
        return 0.0
    return max(nbytes / (device.bandwidth * 1e9), flops / (device.tflops * 1e12))


def path_bandwidth(links: Sequence[float], a: int, b: int) -> float:
    """GB/s between devices a and b of the list: the slowest link between them."""
    lo, hi = min(a, b), max(a, b)
    return min(links[lo:hi])


def usage(device: Device, spec: ModelSpec, workload: Workload, costs: Sequence[UnitCost], *,
          units: tuple[str, ...] = (), layers: tuple[int, ...] = (), decode_recv: float = 0.0,
          prefill_recv: float = 0.0, share: dict | None = None) -> DeviceUsage:
    """A device's row of the plan from the costs of what it holds."""
    decode_bytes = sum(c.decode_bytes for c in costs)
    decode_flops = sum(c.decode_flops for c in costs)
    prefill_bytes = sum(c.prefill_bytes for c in costs)
    prefill_flops = sum(c.prefill_flops for c in costs)
    return DeviceUsage(
        device=device, units=units, layers=layers, share=share,
        weights=sum(c.weights for c in costs), kv_cache=sum(c.kv for c in costs),
        activations=activation_bytes(costs, spec, workload), reserve=device.reserve_bytes if costs else 0,
        decode_bytes=decode_bytes, decode_flops=decode_flops, prefill_bytes=prefill_bytes,
        prefill_flops=prefill_flops,
        decode_s=seconds(decode_bytes, decode_flops, device) if costs else 0.0,
        prefill_s=seconds(prefill_bytes, prefill_flops, device) if costs else 0.0,
        decode_handoff_s=decode_recv, prefill_handoff_s=prefill_recv)


def evaluate_pipeline(spec: ModelSpec, devices: Sequence[Device], workload: Workload, placement: Sequence[int],
                      links: Sequence[float]) -> tuple[DeviceUsage, ...]:
    """Each device's row for a placement of whole units (placement[i] = device index of spec.units[i])."""
    costs = [unit_cost(u, spec, workload) for u in spec.units]
    decode_one, prefill_one = handoff_bytes(spec, workload)
    recv = [[0.0, 0.0] for _ in devices]
    previous = None
    for d in placement:  # the hidden state moves whenever the next unit runs elsewhere
        if previous is not None and d != previous:
            bandwidth = path_bandwidth(links, previous, d) * 1e9
            recv[d][0] += decode_one / bandwidth
            recv[d][1] += prefill_one / bandwidth
        previous = d
    units = spec.units
    layer_number = {u.name: k for k, u in enumerate(spec.layers)}
    rows = []
    for index, device in enumerate(devices):
        mine = [i for i, d in enumerate(placement) if d == index]
        rows.append(usage(device, spec, workload, [costs[i] for i in mine],
                          units=tuple(units[i].name for i in mine),
                          layers=tuple(layer_number[units[i].name] for i in mine if units[i].kind == "layer"),
                          decode_recv=recv[index][0], prefill_recv=recv[index][1]))
    return tuple(rows)


def allreduce_seconds(nbytes: float, n: int, links: Sequence[float]) -> float:
    """A ring all-reduce over n devices moves 2(n-1)/n of the data over the slowest link."""
    return 0.0 if n < 2 else 2 * (n - 1) / n * nbytes / (min(links) * 1e9)


def gather_seconds(nbytes: float, n: int, links: Sequence[float]) -> float:
    """An all-gather of n equal shards moves (n-1)/n of the whole over the slowest link."""
    return 0.0 if n < 2 else (n - 1) / n * nbytes / (min(links) * 1e9)


def evaluate_tensor(spec: ModelSpec, devices: Sequence[Device], workload: Workload, shares: Sequence[Share],
                    heads: Sequence[tuple[int, int]], links: Sequence[float]) -> tuple[DeviceUsage, ...]:
    """Each device's row when every layer is split across all devices by `shares`.

    Per step every device waits for two all-reduces per layer (after attention and after the MLP) and one
    for the vocab-parallel embedding, and the logits are gathered from the vocabulary shards."""
    decode_one, prefill_one = handoff_bytes(spec, workload)
    reduces = 2 * spec.arch.layers + 1
    n = len(devices)
    logits = 0 if spec.arch.encoder else workload.batch * (spec.arch.vocab or 0) * LOGIT_BYTES
    decode_comm = allreduce_seconds(decode_one, n, links) * reduces + gather_seconds(logits, n, links)
    prefill_comm = allreduce_seconds(prefill_one, n, links) * reduces + gather_seconds(logits, n, links)
    rows = []
    for device, share, (q_heads, kv_heads) in zip(devices, shares, heads):
        costs = [unit_cost(u, spec, workload, share) for u in spec.units]
        rows.append(usage(device, spec, workload, costs, decode_recv=decode_comm, prefill_recv=prefill_comm,
                          share={"heads": q_heads, "kv_heads": kv_heads, "mlp": share.mlp, "vocab": share.vocab}))
    return tuple(rows)
