"""HF checkpoints with quantized weights are planned from their stored tensors (issue 19).

The fixtures are real: a tiny LlamaForCausalLM compressed by compressed-tensors (the library vLLM and
llm-compressor use) to FP8 (fp8 weights with per-channel scales), W4A16 (int4 packed eight to an int32, group
scales) and W4A16_ASYM (with packed zero points), saved by transformers' save_pretrained in several shards with
the config's quantization_config. The truth is the safetensors library's own reading of every header.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from fixtures.cache import cached_build

import tensormorph as tm
from tensormorph.planner import Workload
from tensormorph.planner.model import load_model
from tensormorph.planner.quantize import smaller

torch = pytest.importorskip("torch")
pytest.importorskip("compressed_tensors")

SEED = 19
# (scheme, the label the planner gives it); the widths are whole groups of 128 for the grouped schemes
SCHEMES = {"FP8_DYNAMIC": "compressed-tensors float8", "W4A16": "compressed-tensors int4",
           "W4A16_ASYM": "compressed-tensors int4"}
LAYERS, HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 2, 256, 512, 512, 4, 2
_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4, "I64": 8, "I8": 1, "U8": 1}


def _compress(out: Path, scheme: str) -> None:
    """A random tiny Llama in bf16, quantized by compressed-tensors with min/max scales, saved in shards."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=False,
                         max_position_embeddings=256)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=["lm_head"]))
    for module in model.modules():  # the calibration an observer does: scales from each group's range
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        w = module.weight.data.float()
        if args.strategy == "group":
            w = w.reshape(w.shape[0], -1, args.group_size)
        scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out, max_shard_size="400KB")
    compressor.update_config(str(out))
    (out / "truth.json").write_text(json.dumps({"params": params}))


def _build(root: Path) -> None:
    for scheme in SCHEMES:
        _compress(root / scheme, scheme)


@pytest.fixture(scope="module")
def folders() -> Path:
    return cached_build("plan_quantized", sys.modules[__name__], _build)


def _stored(folder: Path) -> dict[str, int]:
    """Every tensor's bytes as the safetensors library reads the headers."""
    from safetensors import safe_open

    out: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "np") as f:
            names = f.keys()
            for name in names:
                piece = f.get_slice(name)
                out[name] = math.prod(piece.get_shape()) * _BYTES[piece.get_dtype()]
    return out


def _under(stored: dict[str, int], prefix: str) -> int:
    return sum(n for name, n in stored.items() if name == prefix or name.startswith(prefix + "."))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weights_are_the_stored_bytes(folders: Path, scheme: str) -> None:
    folder = folders / scheme
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded: the index is followed
    stored = _stored(folder)
    spec = load_model(folder)
    assert spec.nbytes == sum(stored.values())
    assert [u.name for u in spec.layers] == [f"model.layers.{i}" for i in range(LAYERS)]
    for unit in spec.units:  # the per-layer (and per-side) split, exactly
        assert unit.nbytes == _under(stored, unit.name), unit.name
    assert {t.name for u in spec.units for t in u.tensors} == set(stored)
    # parameters count the model's values: packed int4 holds 8 per int32, scales and zero points none
    assert spec.params == json.loads((folder / "truth.json").read_text())["params"]
    assert spec.quantization == spec.dtype == SCHEMES[scheme]
    assert (spec.act_dtype, spec.default_cache) == ("bf16", "bf16")  # the config's dtype, not fp8 or int


def test_packed_tensors_play_their_module_role(folders: Path) -> None:
    spec = load_model(folders / "W4A16")
    roles = {t.name.removeprefix("model.layers.0."): (t.role, t.packing) for t in spec.layers[0].tensors}
    assert roles["self_attn.q_proj.weight_packed"] == ("q", 8)
    assert roles["self_attn.k_proj.weight_scale"] == ("kv", 0)
    assert roles["self_attn.o_proj.weight_shape"] == ("o", 0)
    assert roles["mlp.down_proj.weight_packed"] == ("row", 8)
    assert roles["input_layernorm.weight"] == ("other", 1)
    head = [(t.name, t.role) for u in spec.outputs for t in u.tensors]
    assert head == [("model.norm.weight", "other"), ("lm_head.weight", "head")]
    fp8 = load_model(folders / "FP8_DYNAMIC")
    gate = next(t for t in fp8.layers[1].tensors if t.name.endswith("gate_proj.weight"))
    assert (gate.role, gate.element_bytes, gate.packing) == ("col", 1.0, 1)


def test_plan_places_the_stored_bytes(folders: Path) -> None:
    """A pipeline over two devices: each holds exactly the stored bytes of its modules, and the KV cache is the
    config's bf16."""
    folder = folders / "W4A16_ASYM"
    stored = _stored(folder)
    device_map = {"model.embed_tokens": "cuda:0", "model.layers.0": "cuda:0", "model.layers.1": "cuda:1",
                  "model.norm": "cuda:1", "lm_head": "cuda:1"}
    context = 96
    plan = tm.plan(folder, ["cuda:0=2GiB", "cuda:1=2GiB"], Workload(context=context), device_map=device_map)
    first, second = plan.devices
    assert first.weights == _under(stored, "model.embed_tokens") + _under(stored, "model.layers.0")
    assert second.weights == sum(stored.values()) - first.weights
    per_layer = 2 * KV_HEADS * (HIDDEN // HEADS) * context * 2  # K and V, bf16
    assert (first.kv_cache, second.kv_cache) == (per_layer, per_layer)


def test_tensor_parallel_splits_the_packed_weights(folders: Path) -> None:
    """Two even tensor-parallel devices each hold half of every split tensor, packed or not, and all norms."""
    folder = folders / "W4A16"
    stored = _stored(folder)
    norms = sum(n for name, n in stored.items() if name.endswith("norm.weight"))
    plan = tm.plan(folder, ["cuda:0=2GiB", "cuda:1=2GiB"], Workload(context=64), strategy="tensor")
    units = len(load_model(folder).units)
    for row in plan.devices:  # each unit's share is rounded up to whole bytes
        assert 0 <= row.weights - (norms + (sum(stored.values()) - norms) / 2) < units


def test_dtype_override_keeps_quantized_tensors_as_stored(folders: Path) -> None:
    folder = folders / "FP8_DYNAMIC"
    stored = _stored(folder)
    spec = load_model(folder, "fp32")
    quantized = {t.name for u in spec.units for t in u.tensors if ".mlp." in t.name or ".self_attn." in t.name}
    assert quantized and all(name.rsplit(".", 1)[-1] in ("weight", "weight_scale") for name in quantized)
    as_stored = sum(stored[n] for n in quantized)
    cast = 2 * sum(n for name, n in stored.items() if name not in quantized)  # bf16 -> fp32
    assert spec.nbytes == as_stored + cast
    assert (spec.dtype, spec.act_dtype) == ("compressed-tensors float8", "fp32")


def test_no_llama_cpp_requantization_suggested(folders: Path) -> None:
    assert smaller(load_model(folders / "W4A16")) == []


def test_config_alone_says_the_quantization_is_not_applied(folders: Path, tmp_path: Path) -> None:
    shutil.copy(folders / "W4A16" / "config.json", tmp_path / "config.json")
    spec = load_model(tmp_path)
    truth = json.loads((folders / "W4A16" / "truth.json").read_text())["params"]
    assert spec.nbytes == 2 * truth and spec.quantization is None
    assert any("quantization_config is not applied" in note for note in spec.notes)


def test_unquantized_checkpoint_is_unchanged(tmp_path: Path) -> None:
    """No quantized module: no quantization, the floating dtype as before (fp16 tensors give fp16 activations)."""
    from safetensors.numpy import save_file

    tensors = {"model.embed_tokens.weight": np.zeros((32, 16), np.float16),
               "model.layers.0.self_attn.q_proj.weight": np.zeros((16, 16), np.float16),
               "model.layers.0.self_attn.k_proj.weight": np.zeros((8, 16), np.float16),
               "model.layers.0.scales": np.zeros((4,), np.float32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    spec = load_model(tmp_path / "model.safetensors")
    assert spec.quantization is None and (spec.dtype, spec.act_dtype) == ("fp16", "fp16")
    assert spec.nbytes == sum(a.nbytes for a in tensors.values())
    assert all(t.packing == 1 for u in spec.units for t in u.tensors)


@pytest.mark.parametrize("bits", [-4, 0, True, "4"])
def test_a_forged_bit_width_is_no_width(bits):
    """A config's width that is not a positive integer packs nothing: the stored elements are counted as they are."""
    from tensormorph.planner.hf_quant import _label_and_bits

    groups = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": bits}}}}
    assert _label_and_bits(groups) == ("compressed-tensors mixed", None)
    assert _label_and_bits({"quant_method": "gptq", "bits": bits}) == ("gptq", None)
