"""What a model holds, from a checkpoint's metadata or from its config alone: the tensor list (name,
shape, stored dtype) read from a checkpoint, or written out from a config in its family's layout, and
handed to `modelspec.build_model`. No tensor data is ever read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core import Checkpoint
from ..errors import CheckpointError
from ..formats import detect, open_checkpoint
from ..formats.gguf import NAME as GGUF
from ..storage import AnyPath, store_at
from .gguf_model import gguf_model
from .modelspec import CONFIG_KEYS, ENCODER_TYPES, ModelSpec, build_model, config_value, is_head, text_config
from .spec import PlanError

_CONFIG_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "float": "F32",
                  "half": "F16"}
# config-only planning writes out the layout of these families (as their checkpoints name tensors)
_LAYOUTS: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True},
    "mixtral": {"moe": "block_sparse_moe"}, "qwen2_moe": {"qkv_bias": True, "moe": "mlp"},
    "qwen3_moe": {"qk_norm": True, "moe": "mlp"},
}


def load_model(source: Any, dtype: str | None = None) -> ModelSpec:
    """A ModelSpec from a checkpoint path (a GGUF file too), an open Checkpoint, a folder or file holding only
    config.json, a config dict, a transformers config object, or a ModelSpec already built (such as
    `quantize.quantized(spec, preset)`). `dtype` overrides the floating-point weights' dtype."""
    if isinstance(source, ModelSpec):
        if dtype is not None:
            raise PlanError(f"a ModelSpec is planned as built; a dtype ({dtype}) does not apply")
        return source
    if isinstance(source, Checkpoint):
        return _from_checkpoint(source, config_beside(source.path), dtype, _display_name(source.path))
    if isinstance(source, Mapping) or hasattr(source, "to_dict"):
        config = dict(source) if isinstance(source, Mapping) else source.to_dict()
        return _from_config(config, dtype, name=None, path=None)
    path = Path(source)
    if path.is_file() and path.suffix == ".json":
        return _from_config(_read_config(path), dtype, name=path.parent.name, path=path)
    if path.is_dir() and detect(path) is None and (path / "config.json").is_file():
        return _from_config(_read_config(path / "config.json"), dtype, name=path.name, path=path)
    with open_checkpoint(path) as ck:
        return _from_checkpoint(ck, config_beside(path), dtype, _display_name(path))


def _display_name(path: AnyPath) -> str:
    """A model folder's name, also when given one of its files (model.safetensors says little)."""
    path = path.resolve()
    return path.parent.name if path.is_file() and (path.parent / "config.json").is_file() else path.name


MAX_CONFIG_BYTES = 16 * 1024**2  # a model's config.json is a few KB: the most that reading one may take


def _read_config(path: AnyPath) -> dict[str, Any]:
    try:
        config = store_at(path.parent).read_json(path.name, MAX_CONFIG_BYTES, "config.json")
    except CheckpointError as exc:
        raise PlanError(f"cannot read the model config: {exc.reason}", file=str(path)) from None
    except OSError as exc:  # unreadable: a directory, no permission
        raise PlanError(f"cannot read the model config: {exc.strerror}", file=str(path)) from None
    if not isinstance(config, dict):
        raise PlanError("config.json does not hold a JSON object", file=str(path))
    return config


def config_beside(path: AnyPath) -> dict[str, Any] | None:
    """The config.json in a checkpoint's folder (beside it, for a file), or None when there is none. Read like
    every file of the folder: PlanError when it is a link out of the folder, over MAX_CONFIG_BYTES or not JSON."""
    folder = path if path.is_dir() else path.parent
    candidate = folder / "config.json"
    return _read_config(candidate) if candidate.is_file() else None


def _optional(config: dict[str, Any], key: str) -> int | None:
    value = config_value(config, key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PlanError(f"the model config's {CONFIG_KEYS[key][0]} is {value!r}, expected a non-negative integer")
    return value


def _required(config: dict[str, Any], key: str) -> int:
    value = _optional(config, key)
    if value is None:
        raise PlanError(f"the model config has no {' / '.join(CONFIG_KEYS[key])}")
    return value


def _from_checkpoint(ck: Checkpoint, config: dict[str, Any] | None, dtype: str | None, name: str) -> ModelSpec:
    if ck.format == GGUF:  # sizes and architecture from the file itself
        return gguf_model(ck, dtype, Path(str(ck.path)).name.removesuffix(".gguf"))
    tensors = [(t.name, t.shape, t.dtype) for t in ck.values()]
    groups: dict[tuple[str, tuple[int, int]], list[str]] = {}
    for t in ck.values():  # tied weights in torch pickles share one storage: same file, same bytes
        if len(t.chunks) == 1 and t.chunks[0].file is not None and t.chunks[0].byte_range is not None and t.nbytes:
            groups.setdefault((t.chunks[0].file, t.chunks[0].byte_range), []).append(t.name)
    shared: dict[str, str] = {}
    for names in groups.values():
        # the embedding owns the bytes and the head is the alias, as the runtime ties them
        owner = min(names, key=is_head)
        shared.update({n: owner for n in names if n != owner})
    return build_model(tensors, shared, config, dtype, name=name, source="checkpoint", path=ck.path)


def _from_config(config: dict[str, Any], dtype: str | None, *, name: str | None, path: Path | None) -> ModelSpec:
    config = text_config(config)
    model_type = config.get("model_type")
    notes = []
    layout = _LAYOUTS.get(model_type or "llama")
    if model_type in ENCODER_TYPES:
        layout = {"encoder": True}
    elif layout is None:
        notes.append(f"model_type {model_type!r} is planned with the Llama tensor layout "
                     f"(known layouts: {', '.join(_LAYOUTS)}); give a checkpoint for exact sizes")
        layout = {}
    stored = _CONFIG_DTYPES.get(str(config_value(config, "dtype")).removeprefix("torch."))
    if isinstance(config.get("quantization_config"), dict):
        notes.append("the config's quantization_config is not applied when planning from the config alone: the "
                     f"weights are sized in {(stored or 'BF16').lower()}; give the checkpoint (its safetensors "
                     "headers suffice) for the stored sizes")
    if stored is None:
        stored = "BF16"
        if dtype is None:
            notes.append("the config names no dtype: weights assumed bf16")
    written = _encoder_tensors(config) if layout.get("encoder") else _layout_tensors(config, layout)
    tensors = [(n, shape, stored) for n, shape in written]
    display = name or config.get("_name_or_path") or model_type or "model"
    spec = build_model(tensors, {}, config, dtype, name=display, source="config", path=path)
    return replace(spec, notes=tuple(notes) + spec.notes)


def _layout_tensors(config: dict[str, Any], layout: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors (name, shape) a checkpoint of this config holds, in the family's naming."""
    layers = _required(config, "layers")
    hidden = _required(config, "hidden")
    heads = _required(config, "heads")
    if not heads:
        raise PlanError("the model config's num_attention_heads is 0; a transformer has at least one head")
    vocab = _required(config, "vocab")
    intermediate = _required(config, "intermediate")
    kv_heads = _optional(config, "kv_heads") or heads
    head_dim = _optional(config, "head_dim") or hidden // heads
    experts = _optional(config, "experts") or 0
    moe_width = _optional(config, "moe_intermediate") or intermediate
    shared_width = _optional(config, "shared_intermediate") or 0
    qkv_bias = bool(config.get("qkv_bias", layout.get("qkv_bias", False)) or config.get("attention_bias"))
    o_bias = bool(config.get("attention_bias"))
    mlp_bias = bool(config.get("mlp_bias"))
    sparse_step = config.get("decoder_sparse_step") or 1
    dense_layers = set(config.get("mlp_only_layers") or ())

    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]

    def linear(prefix: str, rows: int, cols: int, bias: bool) -> None:
        out.append((f"{prefix}.weight", (rows, cols)))
        if bias:
            out.append((f"{prefix}.bias", (rows,)))

    def mlp(prefix: str, width: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        gate, up, down = names
        linear(f"{prefix}.{gate}", width, hidden, mlp_bias)
        linear(f"{prefix}.{up}", width, hidden, mlp_bias)
        linear(f"{prefix}.{down}", hidden, width, mlp_bias)

    for i in range(layers):
        p = f"model.layers.{i}"
        linear(f"{p}.self_attn.q_proj", heads * head_dim, hidden, qkv_bias)
        linear(f"{p}.self_attn.k_proj", kv_heads * head_dim, hidden, qkv_bias)
        linear(f"{p}.self_attn.v_proj", kv_heads * head_dim, hidden, qkv_bias)
        linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim, o_bias)
        if layout.get("qk_norm"):
            out += [(f"{p}.self_attn.q_norm.weight", (head_dim,)), (f"{p}.self_attn.k_norm.weight", (head_dim,))]
        sparse = experts > 0 and i not in dense_layers and (i + 1) % sparse_step == 0
        if sparse and layout.get("moe") == "block_sparse_moe":
            out.append((f"{p}.block_sparse_moe.gate.weight", (experts, hidden)))
            for e in range(experts):
                mlp(f"{p}.block_sparse_moe.experts.{e}", moe_width, ("w1", "w3", "w2"))
        elif sparse:
            out.append((f"{p}.mlp.gate.weight", (experts, hidden)))
            for e in range(experts):
                mlp(f"{p}.mlp.experts.{e}", moe_width)
            if shared_width:
                mlp(f"{p}.mlp.shared_expert", shared_width)
                out.append((f"{p}.mlp.shared_expert_gate.weight", (1, hidden)))
        else:
            mlp(f"{p}.mlp", intermediate)
        out += [(f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.post_attention_layernorm.weight", (hidden,))]
    out.append(("model.norm.weight", (hidden,)))
    out.append(("lm_head.weight", (vocab, hidden)))
    return out


def _encoder_tensors(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors (name, shape) of a BERT-layout encoder: embeddings, layers of self-attention and MLP with
    biases and LayerNorms, and the pooler; no LM head."""
    layers, hidden = _required(config, "layers"), _required(config, "hidden")
    vocab, intermediate = _required(config, "vocab"), _required(config, "intermediate")
    out: list[tuple[str, tuple[int, ...]]] = []

    def linear(prefix: str, rows: int, cols: int) -> None:
        out.extend([(f"{prefix}.weight", (rows, cols)), (f"{prefix}.bias", (rows,))])

    def norm(prefix: str) -> None:
        out.extend([(f"{prefix}.weight", (hidden,)), (f"{prefix}.bias", (hidden,))])

    out.append(("embeddings.word_embeddings.weight", (vocab, hidden)))
    out.append(("embeddings.position_embeddings.weight", (int(config.get("max_position_embeddings") or 512), hidden)))
    out.append(("embeddings.token_type_embeddings.weight", (int(config.get("type_vocab_size") or 2), hidden)))
    norm("embeddings.LayerNorm")
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for part in ("query", "key", "value"):
            linear(f"{p}.attention.self.{part}", hidden, hidden)
        linear(f"{p}.attention.output.dense", hidden, hidden)
        norm(f"{p}.attention.output.LayerNorm")
        linear(f"{p}.intermediate.dense", intermediate, hidden)
        linear(f"{p}.output.dense", hidden, intermediate)
        norm(f"{p}.output.LayerNorm")
    linear("pooler.dense", hidden, hidden)
    return out
