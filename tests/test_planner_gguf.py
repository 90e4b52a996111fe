"""GGUF models as plan sources: tiny llama-layout files written by the `gguf` package (llama.cpp's gguf-py).

Expected sizes come from gguf's own tables (GGML_QUANT_SIZES) and its reader (GGUFReader's n_bytes), and the
KV cache from the formula 2 × layers × KV heads × head dim × context × bytes per element; never from the
planner. The weights are zero bytes: planning reads no tensor data, only the header.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import tensormorph as tm
from tensormorph.cli.plan import plan_command
from tensormorph.planner import PlanError, Workload
from tensormorph.planner.costs import unit_cost
from tensormorph.planner.model import load_model

gguf = pytest.importorskip("gguf")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType  # noqa: E402

pytestmark = pytest.mark.timeout(120)

Q = GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FF, VOCAB, LAYERS, TRAINED = 256, 4, 2, 64, 512, 320, 2, 4096
FAST = "cuda:0=1GiB,tflops=10,bw=100,reserve=0B"


def _data(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> np.ndarray:
    """Zero blocks of `qtype` for a tensor of logical `shape`, as GGUFWriter takes raw ggml data (uint8 rows)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return np.zeros((*shape[:-1], shape[-1] // block * size), np.uint8)


def model_tensors(*, experts: int = 0, tied: bool = False) -> list[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """A Q4_K_M-style mix (Q4_K with Q6_K for attn_v, ffn_down and the head), as llama.cpp quantizes."""
    out = [("token_embd.weight", (VOCAB, HIDDEN), Q.Q4_K)]
    for i in range(LAYERS):
        p = f"blk.{i}"
        out += [(f"{p}.attn_norm.weight", (HIDDEN,), Q.F32),
                (f"{p}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), Q.Q4_K),
                (f"{p}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_K),
                (f"{p}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q6_K),
                (f"{p}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), Q.Q4_K),
                (f"{p}.ffn_norm.weight", (HIDDEN,), Q.F32)]
        if experts:
            out += [(f"{p}.ffn_gate_inp.weight", (experts, HIDDEN), Q.F32),
                    (f"{p}.ffn_gate_exps.weight", (experts, FF, HIDDEN), Q.Q4_K),
                    (f"{p}.ffn_up_exps.weight", (experts, FF, HIDDEN), Q.Q4_K),
                    (f"{p}.ffn_down_exps.weight", (experts, HIDDEN, FF), Q.Q6_K)]
        else:
            out += [(f"{p}.ffn_gate.weight", (FF, HIDDEN), Q.Q4_K), (f"{p}.ffn_up.weight", (FF, HIDDEN), Q.Q4_K),
                    (f"{p}.ffn_down.weight", (HIDDEN, FF), Q.Q6_K)]
    out.append(("output_norm.weight", (HIDDEN,), Q.F32))
    if not tied:
        out.append(("output.weight", (VOCAB, HIDDEN), Q.Q6_K))
    return out


def write_model(path: Path, *, arch: str = "llama", block_count: int | str = LAYERS, heads: int | None = HEADS,
                kv_heads: int = KV_HEADS, experts: int = 0, tied: bool = False,
                extra: list[tuple[str, tuple[int, ...], GGMLQuantizationType]] = (), split: int = 0) -> Path:
    """A tiny model; with `split`, a split set of files holding at most `split` tensors each (the first is
    returned), as llama-gguf-split writes them."""
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split)
    writer.add_name("tiny-llama")
    if isinstance(block_count, str):  # forged: a string where llama.cpp reads a u32
        writer.add_string(f"{arch}.block_count", block_count)
    else:
        writer.add_block_count(block_count)
    writer.add_context_length(TRAINED)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FF)
    if heads is not None:
        writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
    for name, shape, qtype in [*model_tensors(experts=experts, tied=tied), *extra]:
        writer.add_tensor(name, _data(shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split:
        return next(iter(sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))))
    return path


def stored_bytes(path: Path) -> dict[str, int]:
    """Each tensor's bytes as gguf's own reader counts them."""
    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("gguf") / "tiny-llama-Q4_K_M.gguf")


def kv_bytes(context: int, per_element: float) -> int:
    return math.ceil(2 * KV_HEADS * HEAD_DIM * context * per_element) * LAYERS


def test_every_ggml_type_is_sized_as_the_gguf_table(tmp_path):
    extra = [(f"blk.0.t_{qtype.name.lower()}.weight", (3, 4 * block), qtype)
             for qtype, (block, _) in GGML_QUANT_SIZES.items()]
    path = write_model(tmp_path / "all-types.gguf", extra=extra)
    spec = load_model(path)
    planned = {t.name: t for u in spec.units for t in u.tensors}
    for qtype, (block, size) in GGML_QUANT_SIZES.items():
        t = planned[f"blk.0.t_{qtype.name.lower()}.weight"]
        assert t.shape == (3, 4 * block) and t.size == 3 * 4 * size, qtype.name
    assert {n: planned[n].size for n in stored_bytes(path)} == stored_bytes(path)
    assert spec.nbytes == sum(stored_bytes(path).values())


def test_a_gguf_model_is_planned_from_its_header(model):
    workload = Workload(context=1024)
    p = tm.plan(model, [FAST], workload)
    m = p.model
    assert (m.name, m.source, m.dtype) == ("tiny-llama", "gguf", "Q4_K_M")
    a = m.arch
    assert (a.layers, a.hidden, a.heads, a.kv_heads, a.head_dim, a.vocab, a.ffn, a.tied) == \
        (LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, FF, False)
    row = p.devices[0]
    assert row.weights == m.nbytes == sum(stored_bytes(model).values())
    assert row.kv_cache == kv_bytes(1024, 2)  # llama.cpp's default cache: f16
    assert p.to_dict()["workload"]["cache_dtype"] == "fp16"
    assert f"trained context: {TRAINED:,} tokens (llama.context_length)" in p.notes
    assert p.device_map["blk.0"] == "cuda:0" and p.device_map["output"] == "cuda:0"


@pytest.mark.parametrize("cache, per_element", [("q8_0", 34 / 32), ("q4_0", 18 / 32), ("q4_1", 20 / 32),
                                                ("q5_0", 22 / 32), ("q5_1", 24 / 32), ("iq4_nl", 18 / 32),
                                                ("f32", 4), ("bf16", 2), ("fp8", 1), ("fp8_e5m2", 1)])
def test_cache_types_of_llama_cpp_and_vllm(model, cache, per_element):
    p = tm.plan(model, [FAST], Workload(context=2048, cache_dtype=cache))
    assert p.devices[0].kv_cache == kv_bytes(2048, per_element)


def test_gguf_layers_split_across_devices_by_memory(model):
    whole = tm.plan(model, [FAST], Workload(context=1024)).devices[0]
    each = whole.activations + (whole.weights + whole.kv_cache) * 6 // 10  # each device runs a whole prefill pass
    devices = [f"cuda:0={each}B,reserve=0B", f"cuda:1={each}B,reserve=0B"]
    p = tm.plan(model, devices, Workload(context=1024))
    assert p.fits and not p.speed_known
    assert [r.layer_ranges for r in p.devices] == ["0", "1"]
    assert sum(r.weights for r in p.devices) == sum(stored_bytes(model).values())
    assert [r.kv_cache for r in p.devices] == [kv_bytes(1024, 2) // LAYERS] * 2


def test_a_tied_gguf_reads_the_embedding_as_its_head(tmp_path):
    path = write_model(tmp_path / "tied.gguf", tied=True)
    p = tm.plan(path, [FAST])
    assert p.model.arch.tied and p.devices[0].weights == sum(stored_bytes(path).values())


def test_moe_experts_are_fused_tensors_read_by_the_tokens_that_pick_them(tmp_path):
    path = write_model(tmp_path / "moe.gguf", experts=4)
    spec = load_model(path)
    assert (spec.arch.experts, spec.arch.experts_per_token) == (4, 2)
    layer = spec.layers[0]
    experts = {t.name for t in layer.tensors if t.expert}
    assert experts == {f"blk.0.ffn_{k}_exps.weight" for k in ("gate", "up", "down")}
    cost = unit_cost(layer, spec, Workload(context=16))
    expert_bytes = sum(t.size for t in layer.tensors if t.expert)
    dense = sum(t.size for t in layer.tensors if not t.expert)
    assert cost.weights == layer.nbytes == expert_bytes + dense
    cache = 2 * KV_HEADS * HEAD_DIM * 16 * 2  # K and V of 16 tokens in f16, llama.cpp's default
    assert cost.kv == cache
    assert cost.decode_bytes == pytest.approx(dense + expert_bytes * 2 / 4 + cache)  # a token picks 2 of 4 experts


@pytest.mark.parametrize("kwargs, message", [
    ({"block_count": 3}, "llama.block_count is 3, the tensors hold blocks 0-1"),
    ({"block_count": "2"}, "llama.block_count is '2', expected a positive integer"),
    ({"kv_heads": 3}, "4 attention heads cannot share 3 KV heads evenly"),
    ({"kv_heads": 1}, r"1 KV heads × key length 64 = 64, blk.0.attn_k.weight is \[128, 256\]"),
    ({"heads": None}, "the GGUF metadata has no llama.attention.head_count, which a llama model needs"),
    ({"arch": " "}, "general.architecture is ' '; expected the architecture's name"),
])
def test_a_forged_architecture_is_a_clear_error(tmp_path, kwargs, message):
    path = write_model(tmp_path / "forged.gguf", **kwargs)
    with pytest.raises(PlanError, match=message) as caught:
        tm.plan(path, [FAST])
    assert caught.value.file == str(path)


def test_the_cli_plans_a_gguf_and_refuses_a_dtype(model):
    result = CliRunner().invoke(plan_command, [str(model), "--device", FAST, "--context", "1024"])
    assert result.exit_code == 0, result.output
    assert "tiny-llama" in result.output and "in Q4_K_M" in result.output and "KV cache fp16" in result.output
    result = CliRunner().invoke(plan_command, [str(model), "--device", FAST, "--dtype", "bf16"])
    assert result.exit_code == 2
    assert "a GGUF model is planned as stored (its ggml types); a dtype (bf16) does not apply" in result.output


def test_a_gguf_plan_is_for_llama_cpp_not_torch(model):
    p = tm.plan(model, [FAST])
    with pytest.raises(PlanError, match="a GGUF model's modules \\(blk.N\\) are llama.cpp's"):
        p.to_accelerate()
    with pytest.raises(PlanError, match="a GGUF model runs in llama.cpp, which loads it itself"):
        p.load(model)
