"""The host tier (`cpu=SIZE`): what goes to system RAM when the GPUs are full, MoE experts first, and what it costs.

Sizes are computed here from the config (experts × 3 matrices × hidden × expert width × 2 bytes in bf16) or read
by the gguf package's own reader, never from the planner; times from the roofline and link formulas of
docs/plan.md. The MoE models are a Mixtral-style config.json and a GGUF file written by the gguf package.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_planner_gguf import write_model

import tensormorph as tm
from tensormorph.planner import PlanError, Workload
from tensormorph.planner.offload import HOST_LINK_GBPS

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.timeout(120)

HIDDEN, FF, LAYERS, EXPERTS, PICKED, VOCAB, CONTEXT = 256, 512, 4, 4, 2, 1024, 256
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": HIDDEN,
           "intermediate_size": FF, "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": VOCAB, "num_local_experts": EXPERTS, "num_experts_per_tok": PICKED,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False}
EXPERT_LAYER_BYTES = EXPERTS * 3 * HIDDEN * FF * 2  # w1, w2, w3 of every expert, bf16
EMBED_BYTES = VOCAB * HIDDEN * 2
GPU = "cuda:0={}B,tflops=10,bw=100,reserve=0B"
HOST = "cpu=1GiB,tflops=1,bw=50,link=16"  # listed first: the host tier is found wherever it is listed


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("offload") / "tiny-mixtral"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MIXTRAL))
    return folder


@pytest.fixture(scope="module")
def alone(mixtral) -> int:
    """Bytes the whole model takes on one GPU at CONTEXT."""
    return tm.plan(mixtral, [GPU.format(1 << 30)], Workload(context=CONTEXT)).devices[0].used


def expert_names(layer: int) -> set[str]:
    return {f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight" for e in range(EXPERTS)
            for w in ("w1", "w2", "w3")}


def test_experts_go_to_the_host_before_any_dense_layer_and_only_as_many_as_needed(mixtral, alone):
    memory = alone - EMBED_BYTES - 2 * EXPERT_LAYER_BYTES + 1024  # the embedding and two layers' experts must go
    p = tm.plan(mixtral, [HOST, GPU.format(memory)], Workload(context=CONTEXT))
    host, gpu = p.devices
    assert p.fits and all(r.used <= r.device.memory for r in p.devices)
    assert host.units == ("model.embed_tokens",) and host.layers == ()  # no dense layer on the host
    assert host.expert_layers == (0, 1) and gpu.layer_ranges == "0-3"
    assert set(p.offloaded) == expert_names(0) | expert_names(1) and set(p.offloaded.values()) == {"cpu"}
    assert set(host.tensors) == set(p.offloaded)
    assert host.weights == EMBED_BYTES + 2 * EXPERT_LAYER_BYTES and host.kv_cache == 0
    assert gpu.used + EXPERT_LAYER_BYTES > memory  # one layer's experts fewer would not fit: the least offload
    assert p.device_map["model.layers.0"] == "cuda:0" and p.host_link == 16
    held = "cpu (system RAM) holds model.embed_tokens, the routed experts of layers 0-1"
    assert any(n.startswith(held) for n in p.notes)


def test_the_host_stage_counts_its_bandwidth_and_the_pcie_crossings(mixtral, alone):
    memory = alone - EMBED_BYTES - EXPERT_LAYER_BYTES + 1024
    w = Workload(context=CONTEXT)
    host = tm.plan(mixtral, [GPU.format(memory), HOST], w).devices[1]
    assert host.expert_layers == (0,)
    touched = 1 - (1 - PICKED / EXPERTS) ** w.batch  # the share of experts one token's step reads
    read = HIDDEN * 2 + EXPERT_LAYER_BYTES * touched  # one embedding row, the experts it picks
    assert host.decode_bytes == pytest.approx(read)
    assert host.decode_s == pytest.approx(max(read / 50e9, host.decode_flops / 1e12))
    crossings = 3  # embedding -> layer 0 on the GPU -> its experts on the host -> back
    assert host.decode_handoff_s == pytest.approx(crossings * HIDDEN * 2 / 16e9)


def test_whole_layers_follow_the_experts_first_layers_first_with_their_cache(mixtral, alone):
    memory = alone * 2 // 10
    p = tm.plan(mixtral, [GPU.format(memory), "cpu=1GiB"], Workload(context=CONTEXT))
    gpu, host = p.devices
    assert p.fits and all(r.used <= r.device.memory for r in p.devices)
    assert host.layers == tuple(range(len(host.layers))) and host.layers  # layers 0..k-1
    assert gpu.layers == tuple(range(len(host.layers), LAYERS))
    assert host.expert_layers == gpu.layers  # every remaining layer's experts already sit on the host
    kv_layer = 2 * 2 * 64 * CONTEXT * 2
    assert host.kv_cache == len(host.layers) * kv_layer and gpu.kv_cache == len(gpu.layers) * kv_layer
    assert p.host_link == HOST_LINK_GBPS
    assert "host link not given: 32 GB/s assumed (PCIe 4.0 x16); give cpu=...,link=GBPS" in p.notes


def test_speed_falls_as_more_goes_to_the_host(mixtral, alone):
    rates, held = [], []
    for fraction in (1.0, 0.8, 0.6, 0.4, 0.2, 0.1):
        p = tm.plan(mixtral, [HOST, GPU.format(int(alone * fraction))], Workload(context=CONTEXT))
        assert p.fits and all(r.used <= r.device.memory for r in p.devices)
        rates.append(p.decode_tokens_per_s)
        held.append(p.devices[0].weights)
    assert held[0] == 0 and held == sorted(held) and held[-1] == p.model.nbytes  # at last, everything
    assert all(a > b for a, b in zip(rates, rates[1:])), rates


def test_a_host_too_small_does_not_fit_and_says_what_would(mixtral, alone):
    # two GPUs with the host between them: the GPUs' pipeline joins them over the links around it
    devices = [GPU.format(alone * 2 // 10), "cpu=1GiB,link=8", GPU.replace("cuda:0", "cuda:1").format(alone * 2 // 10)]
    p = tm.plan(mixtral, devices, Workload(context=CONTEXT))
    assert p.fits and p.links == (8.0,) and p.host_link == 8.0  # the slowest link between the GPUs
    needed = p.devices[1].used
    devices[1] = f"cpu={needed - 256 * 1024}B"  # short of what the experts' activations take at CONTEXT
    p = tm.plan(mixtral, devices, Workload(context=CONTEXT))
    assert not p.fits and p.shortfall is not None and p.shortfall.over == {"cpu": 256 * 1024}
    assert p.shortfall.max_context is not None and p.shortfall.max_context < CONTEXT
    assert tm.plan(mixtral, devices, Workload(context=p.shortfall.max_context)).fits
    ((name, extra),) = p.shortfall.more_memory.items()
    grown = [f"{d}={p.usage(d).device.memory + extra * (d == name)}B,reserve=0B" for d in ("cuda:0", "cpu", "cuda:1")]
    assert tm.plan(mixtral, grown, Workload(context=CONTEXT)).fits


def test_gguf_experts_go_to_the_host_and_llama_cpp_gets_the_override(tmp_path):
    path = write_model(tmp_path / "moe.gguf", experts=4)
    stored = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    whole = tm.plan(path, [GPU.format(1 << 30)], Workload(context=1024)).devices[0]
    experts0 = sum(n for name, n in stored.items() if name.startswith("blk.0.") and "_exps." in name)
    memory = whole.used - stored["token_embd.weight"] - experts0 + 1024
    p = tm.plan(path, [GPU.format(memory), "cpu=1GiB"], Workload(context=1024))
    host = p.devices[1]
    assert p.fits and host.expert_layers == (0,) and host.units == ("token_embd",)
    assert set(p.offloaded) == {f"blk.0.ffn_{k}_exps.weight" for k in ("gate", "up", "down")}
    assert host.weights == stored["token_embd.weight"] + experts0
    assert p.to_llama_cpp().args == ("-dev", "CUDA0", "-ngl", "3", "-ot", r"blk\.(0)\.ffn_.*_exps\.=CPU",
                                     "-c", "1024", "-ctk", "f16", "-ctv", "f16")


def test_plan_load_puts_offloaded_experts_on_the_host(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    whole = tm.plan(tmp_path, [GPU.format(1 << 30)], Workload(context=64)).devices[0]
    p = tm.plan(tmp_path, [GPU.format(whole.used - 128 * 64 * 4 - 4 * 3 * 64 * 96 * 4 + 1024), "cpu=1GiB"],
                Workload(context=64))
    assert p.devices[1].expert_layers == (0,)
    loaded = p.load(tmp_path, devices={"cuda:0": "cpu", "cpu": "meta"})  # the host as meta: placement alone
    on_host = {name for name, tensor in loaded.items() if tensor.device.type == "meta"}
    assert on_host == {"model.embed_tokens.weight"} | {
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2", "w3")}


@settings(max_examples=40, deadline=None)
@given(gpu=st.floats(0.05, 1.2), host=st.floats(0.05, 1.2), where=st.integers(0, 1), speed=st.booleans())
def test_any_plan_with_a_host_is_within_every_budget_and_offloads_experts_first(mixtral, alone, gpu, host, where,
                                                                               speed):
    rate = ",tflops=10,bw=100" if speed else ""
    devices = [f"cuda:0={int(alone * gpu)}B,reserve=0B{rate}"]
    devices.insert(where, f"cpu={int(alone * host)}B{rate}")
    try:
        p = tm.plan(mixtral, devices, Workload(context=CONTEXT))
    except PlanError as exc:  # cannot fit at any context: the two together are too small
        assert "cannot fit on" in str(exc)
        return
    assert p.fits == all(r.used <= r.device.memory for r in p.devices)
    host_row = p.usage("cpu")
    if p.fits:
        assert sum(r.weights for r in p.devices) == p.model.nbytes
    if host_row.layers:  # whole layers go only once every layer left on the GPU has its experts on the host
        assert set(host_row.expert_layers) == set(range(len(host_row.layers), LAYERS)) or \
            len(host_row.layers) == LAYERS
    if host_row.expert_layers:
        assert host_row.expert_layers == tuple(range(host_row.expert_layers[0], host_row.expert_layers[-1] + 1))
