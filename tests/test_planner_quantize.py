"""The quantization suggestions: llama.cpp's Q8_0 / Q6_K / Q5_K_M / Q4_K_M sized from ggml's block table.

Expected sizes are counted here tensor by tensor from gguf's own GGML_QUANT_SIZES and llama.cpp's rules
(use_more_bits for attn_v and ffn_down in the _M mixes, a Q6_K head), for Llama-3-8B from its config.
"""

from __future__ import annotations

import pytest

import tensormorph as tm
from tensormorph.planner import PlanError, Workload
from tensormorph.planner.model import load_model
from tensormorph.planner.quantize import PRESETS, quantized, use_more_bits

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

pytestmark = pytest.mark.timeout(120)

GiB = 1 << 30
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}
H, FF, KV, V, N = 4096, 14336, 1024, 128256, 32


def nbytes(kind: str, rows: int, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return rows * cols // block * size


def expected(main: str, more: str, head: str) -> int:
    """Llama-3-8B as llama.cpp quantizes it: the main type, `more` for attn_v and ffn_down on use_more_bits layers,
    `head` for the output, F32 norms."""
    total = nbytes(main, V, H) + nbytes(head, V, H) + H * 4
    for i in range(N):
        up = more if use_more_bits(i, N) else main
        total += (nbytes(main, H, H) + nbytes(main, KV, H) + nbytes(up, KV, H) + nbytes(main, H, H)
                  + 2 * nbytes(main, FF, H) + nbytes(up, H, FF) + 2 * H * 4)
    return total


def test_use_more_bits_is_llama_cpps():
    # llama.cpp: i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2; for 32 layers: 0-3, 6, 9, ..., 27, 28-31
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


def test_llama3_8b_in_each_preset():
    spec = load_model(LLAMA3_8B)
    sizes = {p.name: quantized(spec, p).nbytes for p in PRESETS}
    assert sizes == {"Q8_0": expected("Q8_0", "Q8_0", "Q8_0"), "Q6_K": expected("Q6_K", "Q6_K", "Q6_K"),
                     "Q5_K_M": expected("Q5_K", "Q6_K", "Q6_K"), "Q4_K_M": expected("Q4_K", "Q6_K", "Q6_K")}
    # llama.cpp's published Meta-Llama-3-8B files: Q8_0 8.54 GB, Q6_K 6.60 GB, Q5_K_M 5.73 GB, Q4_K_M 4.92 GB
    # (the files also hold a few MB of tokenizer)
    for name, published in (("Q8_0", 8.54e9), ("Q6_K", 6.60e9), ("Q5_K_M", 5.73e9), ("Q4_K_M", 4.92e9)):
        assert abs(sizes[name] - published) / published < 0.01, name


def test_a_model_that_fits_nowhere_is_told_which_quantization_would():
    devices = ["cuda:0=8GiB,tflops=100,bw=500", "cuda:1=6GiB,tflops=100,bw=500"]
    with pytest.raises(PlanError, match=r"or smaller weights; quantized, Q6_K: 6\.1 GiB, fits$"):
        tm.plan(LLAMA3_8B, devices, Workload(context=8192))
    spec = load_model(LLAMA3_8B)
    q6, q8 = (quantized(spec, p) for p in PRESETS[1::-1])
    assert tm.plan(q6, devices, Workload(context=8192)).fits
    assert not tm.plan(q8, devices, Workload(context=8192)).fits


def test_the_shortfall_names_the_best_quantization_across_the_devices_and_alone():
    devices = ["cuda:0=12GiB,tflops=100,bw=500", "cuda:1=6GiB,tflops=100,bw=500"]
    workload = Workload(context=16384)
    p = tm.plan(LLAMA3_8B, devices, workload)
    assert not p.fits
    assert p.shortfall.suggestions()[-2:] == ["the weights quantized to Q6_K: 6.1 GiB, fits",
                                              "the weights quantized to Q5_K_M: 5.3 GiB, fits on cuda:0 alone"]
    assert p.to_dict()["shortfall"]["quantized"] == [
        {"preset": "Q6_K", "weights": p.shortfall.quantized[0].weights, "device": None},
        {"preset": "Q5_K_M", "weights": p.shortfall.quantized[1].weights, "device": "cuda:0"}]
    spec = load_model(LLAMA3_8B)
    q8, q6, q5 = (quantized(spec, p) for p in PRESETS[:3])
    assert not tm.plan(q8, devices, workload).fits and tm.plan(q6, devices, workload).fits
    assert tm.plan(q5, devices[:1], workload).fits and not tm.plan(q6, devices[:1], workload).fits
    with pytest.raises(PlanError, match="cannot fit on cuda:1 at any context: its weights take 5.3 GiB in Q5_K_M"):
        tm.plan(q5, devices[1:], workload)
    assert tm.plan(q5, devices[:1], workload).model.default_cache == "fp16"  # run as llama.cpp runs it


def test_a_tied_embedding_takes_the_heads_type_and_odd_rows_fall_back():
    config = {**LLAMA3_8B, "tie_word_embeddings": True, "hidden_size": 4096 + 32, "num_hidden_layers": 2}
    spec = quantized(load_model(config), PRESETS[3])  # Q4_K_M
    sizes = {t.name: t.size for u in spec.units for t in u.tensors}
    h = 4096 + 32  # rows of 4128 values: not whole 256-value K-quant blocks, whole 32-value ones
    assert sizes["model.embed_tokens.weight"] == nbytes("Q8_0", V, h)  # Q6_K's fallback, as the tied head's type
    assert sizes["model.layers.0.self_attn.q_proj.weight"] == nbytes("Q5_0", h, h)  # Q4_K's fallback
    # rows of 14336 values are whole blocks; use_more_bits(i, 2) picks layer 1 only
    assert sizes["model.layers.0.mlp.down_proj.weight"] == nbytes("Q4_K", h, FF)
    assert sizes["model.layers.1.mlp.down_proj.weight"] == nbytes("Q6_K", h, FF)
    assert sizes["model.layers.0.input_layernorm.weight"] == h * 4
