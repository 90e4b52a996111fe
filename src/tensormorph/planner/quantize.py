"""What a model's weights would take quantized as llama.cpp quantizes them (Q8_0, Q6_K, Q5_K_M, Q4_K_M), sized
from ggml's block table like a GGUF file's tensors.

llama.cpp's `llama_tensor_get_type` picks a type per tensor; the rules counted here are the ones that move the
size of these presets: every matrix in the preset's type; in the _M mixes attn_v and ffn_down in Q6_K on the
layers `use_more_bits` picks (the first and last eighth, and every third between); the output head (or the
embedding it is tied to) in Q6_K (Q8_0 in Q8_0); norms, biases and MoE routers in F32; a matrix whose rows are
not whole blocks in the fallback type llama.cpp uses, else F16. Other rules of llama.cpp (fused QKV, 70B-class
attn_v, 8-expert models) are not modelled: the sizes are estimates, within a few percent of its files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..formats.gguf import GGML_TYPES
from .gguf_model import LLAMA_CPP_ACTIVATIONS, LLAMA_CPP_CACHE
from .modelspec import ModelSpec, TensorSpec, Unit

_BLOCKS = {name: (block, size) for name, block, size in GGML_TYPES.values()}
# llama.cpp's fallback for rows that are not whole K-quant blocks (llama_tensor_get_type's second switch)
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_MORE_BITS = re.compile(r"(^|\.)(v_proj|wv|value|attn_v|down_proj|w2|ffn_down(_exps|_shexp)?)\.weight$")
_ROUTER = re.compile(r"(^|\.)(gate|router|ffn_gate_inp)\.weight$")


@dataclass(frozen=True)
class Preset:
    """One llama.cpp file type: the main type, the type of the more-bits tensors and of the output head."""

    name: str
    main: str
    more: str  # attn_v and ffn_down on the layers use_more_bits picks
    head: str


PRESETS = (Preset("Q8_0", "Q8_0", "Q8_0", "Q8_0"), Preset("Q6_K", "Q6_K", "Q6_K", "Q6_K"),
           Preset("Q5_K_M", "Q5_K", "Q6_K", "Q6_K"), Preset("Q4_K_M", "Q4_K", "Q6_K", "Q6_K"))


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _type(t: TensorSpec, unit: Unit, layer: int | None, layers: int, preset: Preset, heads: set[str]) -> str:
    if len(t.shape) < 2 or _ROUTER.search(t.name):
        return "F32"
    if (unit.kind == "output" and t.role == "head") or t.name in heads:  # a tied embedding is the head too
        wanted = preset.head
    elif layer is not None and _MORE_BITS.search(t.name) and use_more_bits(layer, layers):
        wanted = preset.more
    else:
        wanted = preset.main
    for kind in (wanted, _FALLBACK.get(wanted, "F16")):
        if t.shape[-1] % _BLOCKS[kind][0] == 0:
            return kind
    return "F16"


def quantized(spec: ModelSpec, preset: Preset) -> ModelSpec:
    """`spec` with every tensor at the type llama.cpp's `preset` gives it (tied tensors stay tied), run as
    llama.cpp runs it (f32 activations, f16 KV cache unless the workload says otherwise)."""
    layer_of = {u.name: k for k, u in enumerate(spec.layers)}
    layers = len(spec.layers)
    heads = {t.tied_to for u in spec.outputs for t in u.tensors if t.role == "head" and t.tied_to}

    def convert(unit: Unit) -> Unit:
        def one(t: TensorSpec) -> TensorSpec:
            block, size = _BLOCKS[_type(t, unit, layer_of.get(unit.name), layers, preset, heads)]
            return replace(t, element_bytes=size / block)

        return replace(unit, tensors=tuple(one(t) for t in unit.tensors))

    return replace(spec, inputs=tuple(map(convert, spec.inputs)), layers=tuple(map(convert, spec.layers)),
                   outputs=tuple(map(convert, spec.outputs)), dtype=preset.name, act_dtype=LLAMA_CPP_ACTIVATIONS,
                   cache_dtype=LLAMA_CPP_CACHE)


def smaller(spec: ModelSpec) -> list[tuple[Preset, ModelSpec]]:
    """The presets whose weights are smaller than the model's now, largest (best quality) first; none for a checkpoint
    already quantized its own way (GPTQ, AWQ, compressed-tensors: llama.cpp's converter does not take those)."""
    if spec.quantization is not None:
        return []
    out = [(p, quantized(spec, p)) for p in PRESETS]
    return [(p, q) for p, q in out if q.nbytes < spec.nbytes]
