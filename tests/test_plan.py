"""The placement planner on transformers configs of real model families and tiny random checkpoints.

Expected values are computed here from first principles (transformers' own parameter counts, the KV
cache formula 2 × layers × KV heads × head dim × context × batch × bytes), never read back from the
planner. Real-size models are planned from their configs (no weights); the tensor side uses tiny
checkpoints written by `save_pretrained`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from accelerate import infer_auto_device_map, init_empty_weights
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
)

import tensormorph as tm
from tensormorph.planner import Device, Plan, PlanError, Workload, parse_device
from tensormorph.planner.model import load_model

pytestmark = pytest.mark.timeout(300)

GiB, MiB = 1 << 30, 1 << 20
FAST = "cuda:0=24GiB,tflops=165,bw=1000"
SLOW = "cuda:1=16GiB,tflops=70,bw=360"

# real model families at full size, as transformers configs (planned from the config alone)
REAL = {
    "Llama-3-8B": LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, dtype="bfloat16"),
    "Mistral-7B": MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, sliding_window=None,
                                dtype="bfloat16"),
    "Qwen2-7B": Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                            num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, dtype="bfloat16"),
    "Qwen1.5-MoE-A2.7B": Qwen2MoeConfig(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                                        shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                                        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                                        vocab_size=151936, tie_word_embeddings=False, dtype="bfloat16"),
}
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)
TINY_CONFIGS = {
    "llama": LlamaConfig(**TINY),
    "mistral": MistralConfig(**TINY),
    "qwen2": Qwen2Config(**TINY),
    "mixtral": MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48),
    "llama_tied": LlamaConfig(**TINY, tie_word_embeddings=True),
}


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def kv_per_layer(config, context: int, batch: int, nbytes: float) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return math.ceil(2 * config.num_key_value_heads * head_dim * context * batch * nbytes)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints of each family, written by save_pretrained, plus a torch .bin whose head
    shares the embedding's storage."""
    root = tmp_path_factory.mktemp("plan-tiny")
    paths = {}
    for name, config in TINY_CONFIGS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(root / name)
        paths[name] = root / name
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, tie_word_embeddings=True))
    shared = root / "shared-bin"
    shared.mkdir()
    state = model.state_dict()  # lm_head.weight and model.embed_tokens.weight are one tensor
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    torch.save(state, shared / "pytorch_model.bin")
    model.config.save_pretrained(shared)
    paths["shared-bin"] = shared
    return paths


def tiny_devices(path: Path, fractions: tuple[float, ...], workload: Workload) -> list[str]:
    """Devices that each hold `fraction` of what the whole model needs on one device."""
    whole = tm.plan(path, ["cuda:0=1GiB,tflops=10,bw=100,reserve=0B"], workload).devices[0].used
    return [f"cuda:{i}={int(whole * f)}B,tflops={10 * (i + 1)},bw={100 * (i + 1)},reserve=0B"
            for i, f in enumerate(fractions)]


# ---------------------------------------------------------------- model sizes

@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_sizes_from_a_checkpoint_and_from_its_config_agree_with_transformers(tiny, family):
    config = TINY_CONFIGS[family]
    model = AutoModelForCausalLM.from_pretrained(tiny[family])
    params = param_count(model)
    from_checkpoint = load_model(tiny[family])
    from_config = load_model(config)
    assert from_checkpoint.params == from_config.params == params
    assert from_checkpoint.nbytes == params * 4  # float32
    assert {u.name: u.nbytes for u in from_checkpoint.units} == {u.name: u.nbytes for u in from_config.units}
    for unit in from_checkpoint.units:  # every device map key is a real module of the model
        model.get_submodule(unit.name)


@pytest.mark.parametrize("name", list(REAL))
def test_real_families_fit_within_every_budget_at_8k(name):
    config = REAL[name]
    context = 8192
    p = tm.plan(config, [FAST, SLOW], Workload(context=context), link=32)
    model = meta_model(config)
    assert p.fits and all(d.used <= d.device.memory for d in p.devices)
    assert sum(d.weights for d in p.devices) == param_count(model) * 2  # bf16
    per_layer = kv_per_layer(config, context, 1, 2)
    assert sum(d.kv_cache for d in p.devices) == 2 * config.num_hidden_layers * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * context * 1 * 2
    for d in p.devices:
        assert d.kv_cache == len(d.layers) * per_layer
        assert d.reserve == (GiB if d.units else 0)
    # the map covers every module once, with real module names
    layers = sorted(n for d in p.devices for n in d.layers)
    assert layers == list(range(config.num_hidden_layers))
    assert set(p.device_map.values()) <= {"cuda:0", "cuda:1"}
    for module in p.device_map:
        model.get_submodule(module)
    assert p.to_accelerate() == {m: int(d.split(":")[1]) for m, d in p.device_map.items()}


def test_llama3_8b_on_one_card_in_numbers():
    """Every column of one device's row, from the formulas in docs/plan.md."""
    config = REAL["Llama-3-8B"]
    p = tm.plan(config, ["cuda:0=24GiB,tflops=165,bw=1000"], Workload(context=8192))
    row = p.devices[0]
    h, q, kv, ffn, vocab = 4096, 4096, 1024, 14336, 128256
    weights = param_count(meta_model(config)) * 2
    kv_cache = 2 * 32 * 8 * 128 * 8192 * 2
    activations = 8192 * 2 * max(2 * h + 2 * q + 2 * kv, 2 * h + 3 * ffn) + vocab * 4
    assert (row.weights, row.kv_cache, row.activations, row.reserve) == (weights, kv_cache, activations, GiB)
    assert row.free == 24 * GiB - weights - kv_cache - activations - GiB
    embedding = vocab * h * 2
    read = weights - embedding + h * 2 + kv_cache  # one embedding row per token, every other byte, the cache
    assert row.decode_bytes == pytest.approx(read, rel=1e-12)
    assert p.decode_step_s == pytest.approx(read / 1000e9, rel=1e-12)  # memory-bound at batch 1
    assert p.bottleneck.limit == "memory bandwidth" and p.bottleneck.device == "cuda:0"


def test_moe_decode_reads_only_the_experts_its_tokens_touch(tiny):
    path = tiny["mixtral"]
    batch, context = 3, 64
    p = tm.plan(path, ["cuda:0=1GiB,tflops=10,bw=100,reserve=0B"], Workload(context=context, batch=batch))
    experts, per_token = 4, 2
    touched = 1 - (1 - per_token / experts) ** batch
    ck = tm.open(path)
    expected = 0.0
    for name, t in ck.items():
        if ".experts." in name:
            expected += t.nbytes * touched
        elif name == "model.embed_tokens.weight":
            expected += batch * t.shape[1] * 4
        else:
            expected += t.nbytes
    expected += 4 * kv_per_layer(TINY_CONFIGS["mixtral"], context, batch, 4)
    assert p.devices[0].decode_bytes == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------- the map and tied weights

@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "llama_tied", "shared-bin"])
def test_every_tensor_goes_to_exactly_one_device_and_loads_there(tiny, family):
    path = tiny[family]
    workload = Workload(context=256)
    p = tm.plan(path, tiny_devices(path, (0.75, 0.75), workload), workload)
    assert p.fits and len({d for d in p.device_map.values()}) == 2  # really split
    names = list(tm.open(path))
    for name in names:
        owners = [m for m in p.device_map if name == m or name.startswith(m + ".")]
        assert len(owners) == 1, (name, owners)
    # the second device becomes the meta device: every tensor must land where the map says
    loaded = p.load(path, devices={"cuda:0": "cpu", "cuda:1": "meta"})
    tied = {"lm_head.weight"} if family in ("llama_tied", "shared-bin") else set()
    assert set(loaded) == set(names) - tied
    for name, tensor in loaded.items():
        module = next(m for m in p.device_map if name.startswith(m + "."))
        assert tensor.device.type == {"cuda:0": "cpu", "cuda:1": "meta"}[p.device_map[module]], name


@pytest.mark.parametrize("family", ["llama_tied", "shared-bin"])
def test_tied_weights_count_once_and_share_a_device(tiny, family):
    path = tiny[family]
    spec = load_model(path)
    assert spec.arch.tied
    params = param_count(AutoModelForCausalLM.from_config(TINY_CONFIGS["llama_tied"]))
    assert spec.nbytes == params * 4
    # no device holds the whole model: splitting is forced, and the tie must hold
    workload = Workload(context=32)  # weights dominate: activations are per device
    for fractions in ((0.75, 0.75), (0.75, 0.5, 0.5)):
        p = tm.plan(path, tiny_devices(path, fractions, workload), workload)
        assert p.fits
        assert p.device_map["lm_head"] == p.device_map["model.embed_tokens"]
        assert sum(d.weights for d in p.devices) == params * 4


def test_tied_real_config_keeps_embedding_and_head_together():
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, dtype="bfloat16")
    p = tm.plan(config, ["cuda:0=1GiB,tflops=10,bw=100,reserve=0B", "cuda:1=1GiB,tflops=10,bw=100,reserve=0B"],
                Workload(context=2048))
    assert p.fits
    assert p.device_map["lm_head"] == p.device_map["model.embed_tokens"]
    assert sum(d.weights for d in p.devices) == param_count(meta_model(config)) * 2


# ---------------------------------------------------------------- against accelerate

def accelerate_map(config, max_memory: dict[int, int]) -> dict:
    model = meta_model(config)
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=list(model._no_split_modules),
                                 dtype=torch.bfloat16)


def test_accelerate_fits_the_weights_but_not_the_cache_at_long_context_and_we_fit():
    config = REAL["Llama-3-8B"]
    devices = ["cuda:0=16GiB,tflops=165,bw=1000", "cuda:1=16GiB,tflops=165,bw=1000"]
    workload = Workload(context=32768, prefill_chunk=2048)
    # accelerate gets the same memory less the same 1 GiB CUDA reserve
    theirs = tm.plan(config, devices, workload, link=32, device_map=accelerate_map(config, {0: 15 * GiB, 1: 15 * GiB}))
    assert all(d.weights + d.reserve <= d.device.memory for d in theirs.devices)  # accelerate's own test passes
    assert not theirs.fits
    for name in theirs.shortfall.over:  # the KV cache alone takes it over
        row = theirs.usage(name)
        assert row.weights + row.reserve + row.kv_cache > row.device.memory
    ours = tm.plan(config, devices, workload, link=32)
    assert ours.fits and all(d.free >= 0 for d in ours.devices)


def test_on_a_heterogeneous_pair_our_bottleneck_stage_is_faster_than_accelerates():
    config = REAL["Llama-3-8B"]
    devices = ["cuda:0=16GiB,tflops=70,bw=360", "cuda:1=24GiB,tflops=165,bw=1000"]  # the slow card first
    workload = Workload(context=8192)
    theirs = tm.plan(config, devices, workload, link=32, device_map=accelerate_map(config, {0: 15 * GiB, 1: 23 * GiB}))
    ours = tm.plan(config, devices, workload, link=32)
    assert ours.fits
    assert ours.bottleneck.seconds < theirs.bottleneck.seconds
    assert ours.decode_tokens_per_s > theirs.decode_tokens_per_s
    # the stage times are the roofline of what each device reads, plus its hand-off
    for row in ours.devices:
        if row.units:
            assert row.decode_s == pytest.approx(max(row.decode_bytes / 1e9 / row.device.bandwidth,
                                                     row.decode_flops / 1e12 / row.device.tflops))


def test_a_given_map_must_place_whole_layers_on_known_devices():
    config = REAL["Mistral-7B"]
    devices = [FAST, SLOW]
    good = {"model.embed_tokens": 0, "model.layers": 0, "model.norm": 1, "lm_head": 1}
    assert tm.plan(config, devices, device_map=good).device_map["model.layers.31"] == "cuda:0"
    with pytest.raises(PlanError, match=r"splits model\.layers\.3 across cuda:0, cuda:1"):
        tm.plan(config, devices, device_map={**good, "model.layers.3.mlp": 1})
    with pytest.raises(PlanError, match="'disk', which is not one of the devices"):
        tm.plan(config, devices, device_map={**good, "lm_head": "disk"})
    with pytest.raises(PlanError, match="'lm_head.weight': the device map gives no device for this tensor"):
        tm.plan(config, devices, device_map={k: v for k, v in good.items() if k != "lm_head"})


# ---------------------------------------------------------------- pipeline quality

def _phase_time(p: Plan) -> float:
    return p.decode_step_s if p.workload.optimize == "decode" else p.prefill_time_s


def test_the_split_matches_an_exhaustive_search_on_small_cases():
    import itertools
    import random

    from tensormorph.planner.costs import evaluate_pipeline

    rng = random.Random(7)
    checked = 0
    while checked < 12:
        layers, n = rng.choice([4, 6]), rng.choice([2, 3])
        config = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": layers,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": rng.choice([1000, 32000]),
                  "tie_word_embeddings": rng.random() < 0.3, "torch_dtype": "bfloat16"}
        devices = [parse_device(f"cuda:{i}={rng.randint(30, 120)}MiB,tflops={rng.choice([1, 5, 20])},"
                                f"bw={rng.choice([50, 200, 1000])},reserve=1MiB") for i in range(n)]
        workload = Workload(context=rng.choice([256, 1024]), optimize=rng.choice(["decode", "prefill"]),
                            prefill_chunk=rng.choice([None, 128]))
        try:
            p = tm.plan(config, devices, workload, link=rng.choice([1, 32]))
        except PlanError:
            continue
        spec, links, best = p.model, list(p.links), math.inf
        for cuts in itertools.combinations_with_replacement(range(layers + 1), n - 1):
            bounds = (0, *cuts, layers)
            layer_devices = [d for d in range(n) for _ in range(bounds[d], bounds[d + 1])]
            for e in range(n):
                for h in [e] if spec.arch.tied else range(n):
                    placement = [e] * len(spec.inputs) + layer_devices + [h] * len(spec.outputs)
                    rows = evaluate_pipeline(spec, devices, workload, placement, links)
                    if all(r.fits for r in rows):
                        stages = [r for r in rows if r.units]
                        if workload.optimize == "decode":
                            best = min(best, sum(r.decode_stage_s for r in stages))
                        else:
                            k = workload.prefill_passes
                            per = [r.prefill_stage_s / k for r in stages]
                            best = min(best, sum(per) + (k - 1) * max(per))
        if best == math.inf:
            assert not p.fits
            continue
        assert p.fits and _phase_time(p) <= best * (1 + 1e-9)
        checked += 1


def test_chunked_prefill_balances_the_slowest_stage():
    """Many prefill chunks flow through the stages at the pace of the slowest one."""
    config = REAL["Llama-3-8B"]
    devices = ["cuda:0=24GiB,tflops=165,bw=1000", "cuda:1=24GiB,tflops=70,bw=360"]
    p = tm.plan(config, devices, Workload(context=8192, prefill_chunk=256, optimize="prefill"), link=32)
    stages = sorted(d.prefill_stage_s for d in p.devices)
    assert stages[0] > 0 and stages[1] / stages[0] < 1.15  # both cards busy, close to equal
    single = tm.plan(config, devices[:1], Workload(context=8192, prefill_chunk=256, optimize="prefill"))
    assert p.prefill_time_s < single.prefill_time_s
    decode = tm.plan(config, devices, Workload(context=8192), link=32)
    assert decode.devices[1].units == ()  # for decode the fast card alone is quickest (a sum, not a max)


# ---------------------------------------------------------------- tensor parallel

def test_even_tensor_parallel_splits_matrices_and_cache_and_replicates_norms(tiny):
    path = tiny["llama"]
    context, link = 128, 16.0
    p = tm.plan(path, ["cuda:0=1GiB,tflops=10,bw=100,reserve=0B", "cuda:1=1GiB,tflops=10,bw=100,reserve=0B"],
                Workload(context=context), "tensor", link=link)
    ck = tm.open(path)
    matrices = sum(t.nbytes for t in ck.values() if t.ndim == 2)
    vectors = sum(t.nbytes for t in ck.values() if t.ndim == 1)
    total_kv = 4 * kv_per_layer(TINY_CONFIGS["llama"], context, 1, 4)
    hidden, vocab, layers = 64, 128, 4
    allreduce = (2 * layers + 1) * 2 * (2 - 1) / 2 * hidden * 4 / (link * 1e9)
    gather = (2 - 1) / 2 * vocab * 4 / (link * 1e9)
    for row in p.devices:
        assert row.weights == matrices // 2 + vectors
        assert row.kv_cache == total_kv // 2
        assert row.share == {"heads": 2, "kv_heads": 1, "mlp": 0.5, "vocab": 0.5}
        assert row.decode_handoff_s == pytest.approx(allreduce + gather, rel=1e-12)
    assert p.device_map is None
    with pytest.raises(PlanError, match="tensor-parallel"):
        p.to_accelerate()
    with pytest.raises(PlanError, match="tensor-parallel"):
        p.load(path)


def test_uneven_tensor_parallel_follows_device_speed():
    p = tm.plan(REAL["Llama-3-8B"], [FAST, SLOW], Workload(context=4096), "tensor", uneven=True, link=32)
    shares = [d.share for d in p.devices]
    assert [s["kv_heads"] for s in shares] == [6, 2]  # 8 KV heads by 1000 : 360 GB/s, largest remainders
    assert [s["heads"] for s in shares] == [24, 8]
    assert shares[0]["mlp"] == pytest.approx(1000 / 1360)
    assert [d.kv_cache for d in p.devices] == [2 * 32 * k * 128 * 4096 * 2 for k in (6, 2)]


def test_tensor_parallel_replicates_kv_heads_beyond_their_count():
    devices = [f"cuda:{i}=24GiB,tflops=165,bw=1000" for i in range(16)]
    p = tm.plan(REAL["Llama-3-8B"], devices, Workload(context=4096), "tensor")
    assert all(d.share["kv_heads"] == 1 and d.share["heads"] == 2 for d in p.devices)
    assert all(d.kv_cache == 2 * 32 * 1 * 128 * 4096 * 2 for d in p.devices)  # each holds one whole KV head
    assert any("replicated on 2" in n for n in p.notes)


def test_tensor_parallel_refuses_heads_that_do_not_divide():
    devices = [FAST, SLOW, "cuda:2=24GiB,tflops=165,bw=1000"]
    with pytest.raises(PlanError, match=r"over 3 devices needs the 32 attention heads and 8 KV heads.*use 1, 2, 4, "
                                        r"8, 16, 32 devices"):
        tm.plan(REAL["Llama-3-8B"], devices, Workload(), "tensor")


# ---------------------------------------------------------------- when it does not fit

def test_a_plan_that_does_not_fit_says_by_how_much_and_what_would():
    config = REAL["Llama-3-8B"]
    devices = ["cuda:0=12GiB,tflops=165,bw=1000", "cuda:1=12GiB,tflops=70,bw=360"]
    workload = Workload(context=32768)
    p = tm.plan(config, devices, workload, link=32)
    assert not p.fits
    s = p.shortfall
    assert s.over == {d.name: -d.free for d in p.devices if d.free < 0} and s.total > 0
    assert tm.plan(config, devices, Workload(context=s.max_context), link=32).fits
    assert not tm.plan(config, devices, Workload(context=s.max_context + 1), link=32).fits
    assert s.prefill_chunk == 2048 and tm.plan(config, devices, Workload(context=32768, prefill_chunk=2048)).fits
    (device, extra), = s.more_memory.items()
    bigger = [d.replace("=12GiB", f"={12 * GiB + extra}B") if d.startswith(device) else d for d in devices]
    assert tm.plan(config, bigger, workload, link=32).fits
    smaller = [d.replace("=12GiB", f"={12 * GiB + extra - 2 * MiB}B") if d.startswith(device) else d for d in devices]
    assert not tm.plan(config, smaller, workload, link=32).fits
    text = " · ".join(s.suggestions())
    assert f"at most {s.max_context:,} tokens" in text and f"more memory on {device}" in text


def test_a_smaller_cache_is_suggested_when_it_fits():
    config = REAL["Llama-3-8B"]
    devices = ["cuda:0=12GiB,tflops=165,bw=1000", "cuda:1=12GiB,tflops=70,bw=360"]
    p = tm.plan(config, devices, Workload(context=65536, prefill_chunk=512), link=32)
    assert not p.fits and p.shortfall.cache_dtype == "fp8"
    assert tm.plan(config, devices, Workload(context=65536, prefill_chunk=512, cache_dtype="fp8")).fits


def test_a_model_that_cannot_fit_anywhere_is_an_error_naming_the_gap():
    with pytest.raises(PlanError, match=r"Llama-3-8B cannot fit on cuda:0, cuda:1 at any context: its weights take "
                                        r"15\.0 GiB in bf16 .* needs at least [\d.]+ GiB more on cuda:"):
        tm.plan({**REAL["Llama-3-8B"].to_dict(), "_name_or_path": "Llama-3-8B"},
                ["cuda:0=8GiB,tflops=165,bw=1000", "cuda:1=6GiB,tflops=70,bw=360"])


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("spec, message", [
    ("cuda:0", r"device cuda:0: give its memory or its model, e.g. cuda:0=24GiB or cuda:0=rtx3090"),
    ("=24GiB", "expected NAME=MEMORY"),
    ("cuda:0=", "an empty item"),
    ("cuda:0=24GiB,12GiB", "two memory sizes"),
    ("cuda:0=rtx3090,rtx4090", "two model names"),
    ("cuda:0=24,tflops=1,bw=1", "cannot read size '24'.*unit"),
    ("cuda:0=-24GiB,tflops=1,bw=1", "cuda:0: memory must be positive, got -24GiB"),
    ("cuda:0=0GiB,tflops=1,bw=1", "cuda:0: memory must be positive"),
    ("cuda:0=24GiB,tflops=fast,bw=1", "cuda:0: tflops='fast' is not a number"),
    ("cuda:0=24GiB,tflops=-3,bw=1", "cuda:0: tflops must be a positive number"),
    ("cuda:0=24GiB,tflops=1", r"cuda:0: missing bw= \(memory bandwidth"),
    ("cuda:0=24GiB,tflops=1,bw=1,speed=3", "cuda:0: unknown option 'speed=3'"),
    ("cuda:0=24GiB,tflops=1,bw=1,bw=2", "cuda:0: bw= given twice"),
    ("cuda:0=1GiB,tflops=1,bw=1,reserve=2GiB", "cuda:0: the reserve"),
    ("my gpu=1GiB,tflops=1,bw=1", "device name 'my gpu'"),
])
def test_bad_device_specs_are_clear_errors(spec, message):
    with pytest.raises(PlanError, match=message):
        parse_device(spec)


def test_bad_plans_are_clear_errors(tiny):
    config = REAL["Llama-3-8B"]
    with pytest.raises(PlanError, match="cuda:0 is listed more than once"):
        tm.plan(config, [FAST, FAST])
    with pytest.raises(PlanError, match="no devices"):
        tm.plan(config, [])
    with pytest.raises(PlanError, match="unknown strategy 'data'"):
        tm.plan(config, [FAST], strategy="data")
    with pytest.raises(PlanError, match="context must be a positive integer, got 0"):
        Workload(context=0)
    with pytest.raises(PlanError, match="unknown dtype 'int3'"):
        Workload(cache_dtype="int3")
    with pytest.raises(PlanError, match="has no hidden_size"):
        tm.plan({"model_type": "llama", "num_hidden_layers": 2}, [FAST])
    with pytest.raises(PlanError, match="not a torch device name"):
        tm.plan(tiny["llama"], ["big=2GiB,tflops=1,bw=1"]).to_accelerate()
    assert tm.plan(tiny["llama"], ["big=2GiB,tflops=1,bw=1"]).to_accelerate({"big": 0})["lm_head"] == 0


# hypothesis: any spec the grammar allows parses back to the same device; any text is a Device or a PlanError

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1000, "MB": 1000**2, "GB": 1000**3}
_names = st.from_regex(r"cuda:[0-9]{1,2}|[a-z][a-z0-9_]{0,5}", fullmatch=True).filter(lambda n: n != "cpu")
_speeds = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(name=_names, amount=st.integers(1, 4096), unit=st.sampled_from(list(_UNITS)), tflops=_speeds, bw=_speeds,
       reserve=st.one_of(st.none(), st.integers(0, 2**20)), link=st.one_of(st.none(), _speeds),
       order=st.permutations(["tflops", "bw", "reserve", "link"]), spaces=st.booleans())
def test_device_specs_round_trip(name, amount, unit, tflops, bw, reserve, link, order, spaces):
    memory = amount * _UNITS[unit]
    assume(memory > (GiB if reserve is None else reserve))  # a GPU's default reserve is 1 GiB
    text = {"tflops": f"tflops={tflops!r}", "bw": f"bw={bw!r}",
            "reserve": None if reserve is None else f"reserve={reserve}B",
            "link": None if link is None else f"link={link!r}"}
    sep = " , " if spaces else ","
    spec = f"{name}={amount}{unit}" + "".join(sep + text[k] for k in order if text[k] is not None)
    device = parse_device(spec)
    assert device == Device(name, memory, tflops, bw, reserve, link)
    assert parse_device(str(device)) == device


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("cuda:01=2GiBMtflopsbwreservlink,.-+ e9")), max_size=40))
def test_any_text_is_a_device_or_a_plan_error(text):
    try:
        device = parse_device(text)
    except PlanError as exc:
        assert str(exc)
    else:
        assert device.memory > 0
        assert device.speed_known or (device.tflops is None and device.bandwidth is None) or device.product
        assert re.match(r"^[A-Za-z0-9_]", device.name)


# ---------------------------------------------------------------- loading and resident bytes

@pytest.mark.parametrize("family, dtype", [("llama", None), ("llama_tied", None), ("llama", "bf16")])
def test_load_streams_into_an_empty_model_that_then_matches_the_reference(tiny, family, dtype):
    path = tiny[family]
    workload = Workload(context=256, dtype=dtype)
    p = tm.plan(path, tiny_devices(path, (0.75, 0.75), workload), workload)
    assert len(set(p.device_map.values())) == 2
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if dtype else torch.float32)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(reference.config)
    model = p.load(path, empty, devices={"cuda:0": "cpu", "cuda:1": "cpu"})
    tokens = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)
    buffers = sum(b.nbytes for b in reference.buffers())
    assert tm.plan.resident(model) == {"cpu": sum(d.weights for d in p.devices) + buffers}
    assert tm.plan.resident(reference) == {"cpu": sum(d.weights for d in p.devices) + buffers}


def test_resident_counts_shared_storage_once_and_skips_meta():
    linear = torch.nn.Linear(8, 4)
    model = torch.nn.Sequential(linear, torch.nn.Linear(4, 8))
    model[1].weight = torch.nn.Parameter(linear.weight.detach().t())  # a view of the same storage
    model.register_buffer("table", torch.zeros(3, dtype=torch.float64))
    with torch.device("meta"):
        model.add_module("ghost", torch.nn.Linear(100, 100))
    assert tm.plan.resident(model) == {"cpu": (8 * 4 + 4 + 8) * 4 + 3 * 8}


def test_the_viewer_api_plans_a_served_checkpoint(tiny):
    from starlette.testclient import TestClient

    from tensormorph.server import create_app

    workload = Workload(context=256)
    devices = tiny_devices(tiny["llama"], (0.75, 0.75), workload)
    expected = tm.plan(tiny["llama"], devices, workload, link=16).to_dict()
    with TestClient(create_app([tiny["llama"]])) as client:
        answer = client.get("/api/plan", params=[("device", d) for d in devices] + [("context", "256"), ("link", "16")])
        assert answer.status_code == 200 and answer.json() == json.loads(json.dumps(expected))
        bad = client.get("/api/plan", params={"device": "cuda:0=24GiB,tflops=1"})
        assert bad.status_code == 400 and bad.json()["error"].startswith("device cuda:0: missing bw=")
        assert client.get("/api/plan").json()["error"].startswith("parameter 'device' is required")
        assert "/api/plan" in client.get("/api/openapi.json").json()["paths"]


def test_plan_is_importable_without_torch_at_module_level():
    import subprocess
    import sys

    code = ("import sys, tensormorph as tm\n"
            "p = tm.plan({'model_type': 'llama', 'hidden_size': 64, 'intermediate_size': 96, 'num_hidden_layers': 2,"
            " 'num_attention_heads': 4, 'vocab_size': 100}, ['cuda:0=2GiB,tflops=1,bw=1'])\n"
            "assert p.fits and callable(tm.plan.resident)\n"
            "assert 'torch' not in sys.modules, 'planning imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
