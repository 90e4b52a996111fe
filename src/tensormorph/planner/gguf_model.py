"""A GGUF model (llama.cpp, Ollama) for the planner: every tensor at the exact size of its stored ggml type
(block bytes / values per block, ggml's table), and the architecture from the GGUF metadata
(`{arch}.block_count`, `.embedding_length`, `.attention.head_count`, `.attention.head_count_kv`,
`.attention.key_length`, `.context_length`, `.expert_count`, ...), checked against the tensors.

llama.cpp keeps the KV cache in f16 unless told otherwise (-ctk/-ctv) and computes activations in f32:
the plan does the same. No tensor data is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

from ..core import Checkpoint
from ..formats.gguf.quantized import QuantizedBlocks
from ..units import number_ranges
from .modelspec import ModelSpec, build_model
from .spec import PlanError

LLAMA_CPP_CACHE = "fp16"  # llama.cpp's default -ctk / -ctv
LLAMA_CPP_ACTIVATIONS = "fp32"  # ggml computes and hands off activations in f32
_LAYER = re.compile(r"^blk\.(\d+)\.")


def stored_type(ck: Checkpoint, name: str) -> str:
    """The ggml type a GGUF tensor is stored in (Q4_K, F16, ...); the reader shows quantized ones as F32."""
    tensor = ck[name]
    source = tensor.chunks[0].source
    return source.info.ggml_type if isinstance(source, QuantizedBlocks) else tensor.dtype


class _Metadata:
    """The `{arch}.*` keys of one file, each checked as it is read."""

    def __init__(self, ck: Checkpoint):
        self.file = str(ck.path)
        arch = ck.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch.strip():
            raise PlanError(f"general.architecture is {arch!r}; expected the architecture's name (llama, qwen2, ...)",
                            file=self.file)
        self.arch, self.metadata = arch, ck.metadata

    def integer(self, key: str, *, required: bool = False, positive: bool = False) -> int | None:
        """`{arch}.{key}`: an integer, or the largest of a per-layer array of them; None when absent."""
        full = f"{self.arch}.{key}"
        value = self.metadata.get(full)
        if value is None:
            if required:
                raise PlanError(f"the GGUF metadata has no {full}, which a {self.arch} model needs", file=self.file)
            return None
        values = value if isinstance(value, list) else [value]
        if not values or not all(type(v) is int and v >= (1 if positive else 0) for v in values):
            expected = "a positive integer" if positive else "a non-negative integer"
            raise PlanError(f"{full} is {value!r}, expected {expected}", file=self.file)
        return max(values)

    def fail(self, message: str) -> PlanError:
        return PlanError(f"the GGUF metadata does not match the tensors ({self.arch}): {message}", file=self.file)


def gguf_model(ck: Checkpoint, dtype: str | None, name: str) -> ModelSpec:
    """The ModelSpec of an open GGUF checkpoint; PlanError when its metadata is missing, malformed or forged
    (it contradicts the tensors' shapes)."""
    meta = _Metadata(ck)
    if dtype is not None:
        raise PlanError(f"a GGUF model is planned as stored (its ggml types); a dtype ({dtype}) does not apply",
                        file=meta.file)
    shapes = {t.name: t.shape for t in ck.values()}
    layers = meta.integer("block_count", required=True, positive=True)
    hidden = meta.integer("embedding_length", required=True, positive=True)
    heads = meta.integer("attention.head_count", required=True, positive=True)
    assert layers is not None and hidden is not None and heads is not None
    kv_heads = meta.integer("attention.head_count_kv", positive=True) or heads
    key_length = meta.integer("attention.key_length", positive=True) or hidden // heads
    value_length = meta.integer("attention.value_length", positive=True) or key_length
    experts = meta.integer("expert_count") or 0
    per_token = meta.integer("expert_used_count") or 0
    context = meta.integer("context_length", positive=True)

    held = sorted({int(m.group(1)) for n in shapes if (m := _LAYER.match(n))})
    if held != list(range(layers)):
        raise meta.fail(f"{meta.arch}.block_count is {layers}, the tensors hold blocks "
                        f"{number_ranges(tuple(held)) or 'none'}")
    if kv_heads > heads or heads % kv_heads:
        raise meta.fail(f"{heads} attention heads cannot share {kv_heads} KV heads evenly")
    embedding = shapes.get("token_embd.weight")
    if embedding is not None and (len(embedding) != 2 or embedding[1] != hidden):
        raise meta.fail(f"{meta.arch}.embedding_length is {hidden}, token_embd.weight is {list(embedding)}")
    k_rows = shapes.get("blk.0.attn_k.weight")
    if k_rows is not None and len(k_rows) == 2 and k_rows[0] != kv_heads * key_length:
        raise meta.fail(f"{kv_heads} KV heads × key length {key_length} = {kv_heads * key_length}, "
                        f"blk.0.attn_k.weight is {list(k_rows)}")
    if experts and not per_token:
        raise meta.fail(f"{meta.arch}.expert_count is {experts} but no {meta.arch}.expert_used_count says how "
                        "many a token uses")

    config: dict[str, Any] = {
        "model_type": meta.arch, "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": key_length,
        "vocab_size": embedding[0] if embedding is not None else None,
        "intermediate_size": meta.integer("feed_forward_length"),
        "num_local_experts": experts or None, "num_experts_per_tok": per_token or None,
        "moe_intermediate_size": meta.integer("expert_feed_forward_length"),
        "tie_word_embeddings": "output.weight" not in shapes,
        "sliding_window": meta.integer("attention.sliding_window"), "max_position_embeddings": context,
    }
    tensors = [(t, tuple(shape), stored_type(ck, t)) for t, shape in shapes.items()]
    title = ck.metadata.get("general.name")
    spec = build_model(tensors, {}, {k: v for k, v in config.items() if v is not None}, None,
                       name=title if isinstance(title, str) and title else name, source="gguf", path=ck.path)
    notes = list(spec.notes)
    if context is not None:
        notes.append(f"trained context: {context:,} tokens ({meta.arch}.context_length)")
    # the cache holds K (key_length wide) and V (value_length wide) per KV head; kv_dim is their mean width
    arch = replace(spec.arch, kv_dim=math.ceil(kv_heads * (key_length + value_length) / 2))
    return replace(spec, arch=arch, dtype=_file_type(ck, tensors), act_dtype=LLAMA_CPP_ACTIVATIONS,
                   cache_dtype=LLAMA_CPP_CACHE, notes=tuple(notes))


def _file_type(ck: Checkpoint, tensors: list[tuple[str, tuple[int, ...], str]]) -> str:
    """The file's quantization as llama.cpp names it (Q4_K_M, from general.file_type), else the ggml type that
    holds the most elements."""
    code = ck.metadata.get("general.file_type")
    if type(code) is int:
        try:
            from gguf.constants import LlamaFileType  # optional: only names the mix
        except ImportError:
            pass
        else:
            try:
                return LlamaFileType(code).name.removeprefix("MOSTLY_")
            except ValueError:
                pass
    counts: dict[str, int] = {}
    for _, shape, stored in tensors:
        counts[stored] = counts.get(stored, 0) + math.prod(shape)
    return max(counts, key=counts.__getitem__)


