"""What a model holds, from a checkpoint's metadata or from its config alone.

Tensors are grouped into placement units, the keys of a device map: the
numbered layers (`model.layers.N`, `transformer.h.N`, ...), the input side
(embeddings and anything else outside the layers) and the output side (final
norm and LM head). Each tensor gets a role (q/kv/o projections, MLP column or
row halves, expert, embedding lookup, head) that says how it is read per token
and how tensor parallelism splits it. No tensor data is ever read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import dtypes
from ..core import Checkpoint
from ..errors import CheckpointError
from ..storage import LocalFiles
from .spec import ELEMENT_BYTES, STORED_DTYPES, PlanError

# Config keys vary by family; the first present wins.
_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "heads": ("num_attention_heads", "n_head", "n_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads"),
    "head_dim": ("head_dim",),
    "vocab": ("vocab_size", "padded_vocab_size"),
    "intermediate": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "experts_per_token": ("num_experts_per_tok", "moe_topk", "top_k"),
    "moe_intermediate": ("moe_intermediate_size",),
    "shared_intermediate": ("shared_expert_intermediate_size",),
    "dtype": ("dtype", "torch_dtype"),
}
_CONFIG_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "float": "F32",
                  "half": "F16"}
# config-only planning writes out the layout of these families (as their checkpoints name tensors)
_LAYOUTS: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True},
    "mixtral": {"moe": "block_sparse_moe"}, "qwen2_moe": {"qkv_bias": True, "moe": "mlp"},
    "qwen3_moe": {"qk_norm": True, "moe": "mlp"},
}

_EMBED = re.compile(r"(embed|wte|wpe|word_embeddings|tok_embeddings|position_embeddings)", re.IGNORECASE)
_HEAD = re.compile(r"^(lm_head|embed_out|output|head)$")
_FINAL_NORM = re.compile(r"^(norm|ln_f|final_layer_norm|final_layernorm|norm_f|final_norm)$")
_ROLES = [  # on the module that owns the tensor (the fused v5 expert parameters own themselves)
    (re.compile(r"^(q_proj|wq|query)$"), "q"),
    (re.compile(r"^(k_proj|v_proj|wk|wv|key|value)$"), "kv"),
    (re.compile(r"^(qkv_proj|c_attn|query_key_value|wqkv|Wqkv)$"), "qkv"),
    (re.compile(r"^(o_proj|wo|out_proj)$"), "o"),
    (re.compile(r"^(gate_proj|up_proj|w1|w3|fc1|c_fc|gate_up_proj|dense_h_to_4h|fc_in)$"), "col"),
    (re.compile(r"^(down_proj|w2|fc2|dense_4h_to_h|fc_out)$"), "row"),
]
_ATTENTION = re.compile(r"(attn|attention)", re.IGNORECASE)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as planned: its bytes at the planned dtype and what role it plays."""

    name: str
    shape: tuple[int, ...]
    element_bytes: float
    role: str  # embed, head, q, kv, qkv, o, col, row, other
    expert: bool = False  # one of a mixture's routed experts: read only when a token picks it
    tied_to: str | None = None  # shares the storage of this tensor: its bytes are counted there

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def size(self) -> int:
        """Bytes of the tensor itself, tied or not."""
        return math.ceil(self.numel * self.element_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes it adds to its device: nothing when it is tied to a tensor counted elsewhere."""
        return 0 if self.tied_to else self.size


@dataclass(frozen=True)
class Unit:
    """A module placed whole: one key of the device map."""

    name: str
    kind: str  # input, layer, output
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors if not t.tied_to)


@dataclass(frozen=True)
class Arch:
    """The architecture facts the costs need (from config.json, else inferred from tensor shapes)."""

    layers: int
    hidden: int
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    q_dim: int  # query width per token (heads × head_dim)
    kv_dim: int  # K (and V) width per token per layer (KV heads × head_dim)
    vocab: int | None
    ffn: int  # MLP width a token passes through (routed experts × their width + shared experts)
    experts: int  # routed experts per MoE layer, 0 for dense models
    experts_per_token: int
    tied: bool  # input embedding and LM head share one tensor
    model_type: str | None = None
    sliding_window: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    """A model for planning: its units in execution order and its architecture."""

    name: str
    source: str  # "checkpoint" or "config"
    arch: Arch
    dtype: str  # planned dtype of the floating-point weights
    act_dtype: str  # dtype of activations (and of the KV cache unless the workload says otherwise)
    inputs: tuple[Unit, ...]
    layers: tuple[Unit, ...]
    outputs: tuple[Unit, ...]
    path: Path | None = None
    notes: tuple[str, ...] = ()

    @property
    def units(self) -> tuple[Unit, ...]:
        return self.inputs + self.layers + self.outputs

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def params(self) -> int:
        return sum(u.params for u in self.units)

    def summary(self) -> dict[str, Any]:
        a = self.arch
        return {"name": self.name, "source": self.source, "path": str(self.path) if self.path else None,
                "params": self.params, "weight_bytes": self.nbytes, "dtype": self.dtype, "layers": a.layers,
                "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                "vocab": a.vocab, "experts": a.experts, "experts_per_token": a.experts_per_token,
                "tied_embeddings": a.tied, "model_type": a.model_type}


def load_model(source: Any, dtype: str | None = None) -> ModelSpec:
    """A ModelSpec from a checkpoint path, an open Checkpoint, a folder or file holding only config.json,
    a config dict, or a transformers config object. `dtype` overrides the floating-point weights' dtype."""
    if isinstance(source, Checkpoint):
        return _from_checkpoint(source, _config_beside(source.path), dtype, _display_name(source.path))
    if isinstance(source, Mapping) or hasattr(source, "to_dict"):
        config = dict(source) if isinstance(source, Mapping) else source.to_dict()
        return _from_config(config, dtype, name=None, path=None)
    path = Path(source)
    if path.is_file() and path.suffix == ".json":
        return _from_config(_read_config(path), dtype, name=path.parent.name, path=path)
    from .. import detect, open as open_checkpoint

    if path.is_dir() and detect(path) is None and (path / "config.json").is_file():
        return _from_config(_read_config(path / "config.json"), dtype, name=path.name, path=path)
    with open_checkpoint(path) as ck:
        return _from_checkpoint(ck, _config_beside(path), dtype, _display_name(path))


def _display_name(path: Path) -> str:
    """A model folder's name, also when given one of its files (model.safetensors says little)."""
    path = path.resolve()
    return path.parent.name if path.is_file() and (path.parent / "config.json").is_file() else path.name


MAX_CONFIG_BYTES = 16 * 1024**2


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = LocalFiles(path.parent).read_json(path.name, MAX_CONFIG_BYTES, "config.json")
    except CheckpointError as exc:
        raise PlanError(f"cannot read the model config: {exc.reason}", file=str(path)) from None
    if not isinstance(config, dict):
        raise PlanError("config.json does not hold a JSON object", file=str(path))
    return config


def _config_beside(path: Path) -> dict[str, Any] | None:
    folder = path if path.is_dir() else path.parent
    candidate = folder / "config.json"
    return _read_config(candidate) if candidate.is_file() else None


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the language model's facts in `text_config`."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def _get(config: dict[str, Any] | None, key: str) -> Any:
    if config is None:
        return None
    for name in _KEYS[key]:
        if config.get(name) is not None:
            return config[name]
    return None


def _positive(config: dict[str, Any], key: str, *, required: bool = False) -> int | None:
    value = _get(config, key)
    if value is None:
        if required:
            raise PlanError(f"the model config has no {' / '.join(_KEYS[key])}")
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PlanError(f"the model config's {_KEYS[key][0]} is {value!r}, expected a non-negative integer")
    return value


def _element_bytes(stored: str, dtype: str | None) -> float:
    """Bytes per element of a stored tensor once loaded: floating tensors take the planned dtype."""
    if dtype is not None and stored in STORED_DTYPES:
        return ELEMENT_BYTES[dtype]
    return float(dtypes.numpy_dtype(stored).itemsize)


def _planned_dtypes(stored: list[tuple[str, int]], dtype: str | None) -> tuple[str, str]:
    """(weights dtype, activations dtype): the override, else the floating dtype holding the most elements."""
    if dtype is not None:
        return dtype, dtype
    counts: dict[str, int] = {}
    for name, numel in stored:
        if name in STORED_DTYPES:
            counts[STORED_DTYPES[name]] = counts.get(STORED_DTYPES[name], 0) + numel
    main = max(counts, key=counts.__getitem__) if counts else "fp32"
    return main, main


def _from_checkpoint(ck: Checkpoint, config: dict[str, Any] | None, dtype: str | None, name: str) -> ModelSpec:
    tensors = [(t.name, t.shape, t.dtype) for t in ck.values()]
    groups: dict[tuple[str, tuple[int, int]], list[str]] = {}
    for t in ck.values():  # tied weights in torch pickles share one storage: same file, same bytes
        if len(t.chunks) == 1 and t.chunks[0].file is not None and t.chunks[0].byte_range is not None and t.nbytes:
            groups.setdefault((t.chunks[0].file, t.chunks[0].byte_range), []).append(t.name)
    shared: dict[str, str] = {}
    for names in groups.values():
        # the embedding owns the bytes and the head is the alias, as the runtime ties them
        owner = min(names, key=lambda n: bool(_HEAD.match(n.rsplit(".", 2)[-2] if n.count(".") else n)))
        shared.update({n: owner for n in names if n != owner})
    return _build(tensors, shared, config, dtype, name=name, source="checkpoint", path=ck.path)


def _from_config(config: dict[str, Any], dtype: str | None, *, name: str | None, path: Path | None) -> ModelSpec:
    config = _text_config(config)
    model_type = config.get("model_type")
    notes = []
    layout = _LAYOUTS.get(model_type or "llama")
    if layout is None:
        notes.append(f"model_type {model_type!r} is planned with the Llama tensor layout "
                     f"(known layouts: {', '.join(_LAYOUTS)}); give a checkpoint for exact sizes")
        layout = {}
    stored = _CONFIG_DTYPES.get(str(_get(config, "dtype")).removeprefix("torch."))
    if stored is None:
        stored = "BF16"
        if dtype is None:
            notes.append("the config names no dtype: weights assumed bf16")
    tensors = [(n, shape, stored) for n, shape in _layout_tensors(config, layout)]
    display = name or config.get("_name_or_path") or model_type or "model"
    spec = _build(tensors, {}, config, dtype, name=display, source="config", path=path)
    return replace(spec, notes=tuple(notes) + spec.notes)


def _layout_tensors(config: dict[str, Any], layout: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors (name, shape) a checkpoint of this config holds, in the family's naming."""
    layers = _positive(config, "layers", required=True)
    hidden = _positive(config, "hidden", required=True)
    heads = _positive(config, "heads", required=True)
    if not heads:
        raise PlanError("the model config's num_attention_heads is 0; a transformer has at least one head")
    vocab = _positive(config, "vocab", required=True)
    intermediate = _positive(config, "intermediate", required=True)
    kv_heads = _positive(config, "kv_heads") or heads
    head_dim = _positive(config, "head_dim") or hidden // heads
    experts = _positive(config, "experts") or 0
    moe_width = _positive(config, "moe_intermediate") or intermediate
    shared_width = _positive(config, "shared_intermediate") or 0
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


def _layer_container(names: list[str], expected: int | None) -> str | None:
    """The dotted prefix whose numbered children are the layers: the one with `expected` children,
    else the one with the most (a vision tower's blocks lose to the language model's layers)."""
    counts: dict[str, set[int]] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if part.isdigit():
                counts.setdefault(".".join(parts[:i]), set()).add(int(part))
                break
    if not counts:
        return None
    matching = [c for c, ids in counts.items() if len(ids) == expected]
    return matching[0] if matching else max(counts, key=lambda c: len(counts[c]))


def _role(name: str, kind: str, ndim: int) -> str:
    parts = name.split(".")
    owner = parts[-2] if len(parts) > 1 and parts[-1] in ("weight", "bias") else parts[-1]
    if kind == "input":
        return "embed" if ndim == 2 and _EMBED.search(name) else "other"
    if kind == "output":
        return "head" if ndim == 2 and _HEAD.match(owner) else "other"
    if owner in ("c_proj", "dense"):  # GPT-2 / NeoX reuse these names in attention and MLP
        return "o" if _ATTENTION.search(name) else "row"
    for pattern, role in _ROLES:
        if pattern.match(owner):
            return role
    return "other"


def _build(tensors: list[tuple[str, tuple[int, ...], str]], shared: dict[str, str], config: dict[str, Any] | None,
           dtype: str | None, *, name: str, source: str, path: Path | None) -> ModelSpec:
    config = _text_config(config) if config is not None else None
    notes: list[str] = []
    weights_dtype, act_dtype = _planned_dtypes([(d, math.prod(s)) for _, s, d in tensors], dtype)
    container = _layer_container([n for n, _, _ in tensors], _get(config, "layers"))
    if container is None:
        raise PlanError("no numbered layers in the tensor names (like model.layers.N...): the planner places "
                        "transformer layers", file=str(path) if path else None)
    prefix = f"{container}." if container else ""
    layer_of: dict[str, int] = {}
    by_module: dict[str, list[tuple[str, tuple[int, ...], str]]] = {}
    for tensor in tensors:
        tname = tensor[0]
        head, _, rest = tname[len(prefix):].partition(".") if tname.startswith(prefix) else ("", "", "")
        if head.isdigit() and rest:
            module = f"{prefix}{head}"
            layer_of[module] = int(head)
        else:
            module = tname.rsplit(".", 1)[0] if "." in tname else tname
        by_module.setdefault(module, []).append(tensor)

    def kind_of(module: str) -> str:
        if module in layer_of:
            return "layer"
        leaf = module.rsplit(".", 1)[-1]
        return "output" if _HEAD.match(leaf) or _FINAL_NORM.match(leaf) else "input"

    def spec(t: tuple[str, tuple[int, ...], str], kind: str) -> TensorSpec:
        tname, shape, stored = t
        return TensorSpec(tname, tuple(shape), _element_bytes(stored, dtype), _role(tname, kind, len(shape)),
                          expert=".experts." in f".{tname}" and kind == "layer", tied_to=shared.get(tname))

    units = {kind: [] for kind in ("input", "layer", "output")}
    for module, members in by_module.items():
        kind = kind_of(module)
        units[kind].append(Unit(module, kind, tuple(spec(t, kind) for t in members)))
    units["layer"].sort(key=lambda u: layer_of[u.name])
    units["output"].sort(key=lambda u: bool(_HEAD.match(u.name.rsplit(".", 1)[-1])))  # final norm, then head

    embed = _main_embedding(units["input"], _get(config, "vocab"))
    head = next((t for u in units["output"] for t in u.tensors if t.role == "head"), None)
    tie_config = config.get("tie_word_embeddings") if config else None
    if head is None and embed is not None and tie_config is not False:
        # save_pretrained drops a tied head; the model reads the embedding matrix as its head
        units["output"].append(Unit("lm_head", "output", (
            TensorSpec("lm_head.weight", embed.shape, embed.element_bytes, "head", tied_to=embed.name),)))
        if tie_config is None:
            notes.append("no LM head tensor and no config: the head is assumed tied to the input embedding")
        head = units["output"][-1].tensors[0]
    elif head is not None and embed is not None and tie_config and head.tied_to is None and head.shape == embed.shape:
        # stored twice, but the runtime ties them at load time: one copy is resident
        units["output"] = [Unit(u.name, u.kind, tuple(replace(t, tied_to=embed.name) if t is head else t
                                                      for t in u.tensors)) for u in units["output"]]
        head = replace(head, tied_to=embed.name)
    tied = head is not None and head.tied_to is not None
    _check_ties(units, shared)

    layers = tuple(units["layer"])
    if config is not None and _get(config, "layers") not in (None, len(layers)):
        notes.append(f"the config says {_get(config, 'layers')} layers, the tensors hold {len(layers)}")
    arch = _arch(config, layers, embed, tied)
    return ModelSpec(name=name, source=source, arch=arch, dtype=weights_dtype, act_dtype=act_dtype,
                     inputs=tuple(units["input"]), layers=layers, outputs=tuple(units["output"]), path=path,
                     notes=tuple(notes))


def _main_embedding(inputs: list[Unit], vocab: int | None) -> TensorSpec | None:
    candidates = [t for u in inputs for t in u.tensors if t.role == "embed" and len(t.shape) == 2]
    if vocab is not None:
        candidates = [t for t in candidates if t.shape[0] == vocab] or candidates
    return max(candidates, key=lambda t: t.numel, default=None)


def _check_ties(units: dict[str, list[Unit]], shared: dict[str, str]) -> None:
    """Tied tensors must live on one device: the planner keeps input and output sides together,
    and cannot honour ties between different layers."""
    unit_of = {t.name: (u.kind, u.name) for kind in units.values() for u in kind for t in u.tensors}
    for name, target in shared.items():
        a, b = unit_of[name], unit_of[target]
        if a[1] != b[1] and {a[0], b[0]} != {"input", "output"}:
            raise PlanError(f"{name} shares storage with {target} in another layer; the planner keeps only "
                            "input/output ties together", tensor=name)


def _arch(config: dict[str, Any] | None, layers: tuple[Unit, ...], embed: TensorSpec | None, tied: bool) -> Arch:
    first = layers[0].tensors
    hidden = _get(config, "hidden") or (embed.shape[1] if embed is not None else None)
    if hidden is None:
        raise PlanError("cannot tell the hidden size: no config.json and no input embedding")
    heads = _get(config, "heads")
    kv_heads = _get(config, "kv_heads") or heads
    head_dim = _get(config, "head_dim") or (hidden // heads if heads else None)
    if kv_heads and head_dim:
        kv_dim = kv_heads * head_dim
    else:  # no config: the K projection's output width is what the cache stores per token
        k_rows = [t.shape[0] for t in first if t.role == "kv" and re.search(r"(k_proj|wk|key)", t.name)]
        if not k_rows:
            raise PlanError("cannot tell the KV cache size: no config.json with num_key_value_heads/head_dim "
                            "and no k_proj tensor in the first layer; put config.json beside the checkpoint")
        kv_dim = k_rows[0]
    q_dim = heads * head_dim if heads and head_dim else next(
        (t.shape[0] for t in first if t.role == "q"), hidden)
    experts = _get(config, "experts") or _count_experts(layers)
    per_token = _get(config, "experts_per_token") or 0
    if experts and not per_token:
        raise PlanError(f"the checkpoint holds {experts} experts per layer but no config.json says how many a "
                        "token uses (num_experts_per_tok); put config.json beside the checkpoint")
    intermediate = _get(config, "intermediate") or next(
        (t.shape[0] for t in first if t.role == "col" and not t.expert and len(t.shape) == 2), 4 * hidden)
    if experts:
        ffn = per_token * (_get(config, "moe_intermediate") or intermediate) + (_get(config, "shared_intermediate")
                                                                               or 0)
    else:
        ffn = intermediate
    vocab = _get(config, "vocab") or (embed.shape[0] if embed is not None else None)
    window = config.get("sliding_window") if config else None
    return Arch(layers=len(layers), hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, q_dim=q_dim,
                kv_dim=kv_dim, vocab=vocab, ffn=ffn, experts=experts, experts_per_token=per_token, tied=tied,
                model_type=config.get("model_type") if config else None, sliding_window=window or None)


def _count_experts(layers: tuple[Unit, ...]) -> int:
    """Routed experts per layer from the names (experts.N...) or a fused [experts, ...] parameter."""
    most = 0
    for layer in layers:
        numbered = {t.name.split(".experts.")[1].split(".")[0] for t in layer.tensors if t.expert}
        ids = {n for n in numbered if n.isdigit()}
        fused = [t.shape[0] for t in layer.tensors if t.expert and len(t.shape) == 3]
        most = max(most, len(ids), *fused)
    return most
