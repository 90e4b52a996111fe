"""A model as the planner sees it: tensors grouped into placement units, with roles and an architecture.

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
from dataclasses import dataclass, replace
from typing import Any

from .. import dtypes
from ..storage import AnyPath
from .hf_quant import METADATA, PACKED, Quantization, config_activations, detect
from .spec import ELEMENT_BYTES, GGML_ELEMENT_BYTES, STORED_DTYPES, PlanError

# Config keys vary by family; the first present wins.
CONFIG_KEYS = {
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

# the GGUF names (token_embd, output_norm, attn_q, ffn_up_exps...) are llama.cpp's, from its tensor table
_EMBED = re.compile(r"(embed|wte|wpe|word_embeddings|tok_embeddings|position_embeddings|token_embd)", re.IGNORECASE)
_HEAD = re.compile(r"^(lm_head|embed_out|output|head)$")
_FINAL_NORM = re.compile(r"^(norm|ln_f|final_layer_norm|final_layernorm|norm_f|final_norm|output_norm)$")
_ROLES = [  # on the module that owns the tensor (the fused v5 expert parameters own themselves)
    (re.compile(r"^(q_proj|wq|query|attn_q)$"), "q"),
    (re.compile(r"^(k_proj|v_proj|wk|wv|key|value|attn_k|attn_v)$"), "kv"),
    (re.compile(r"^(qkv_proj|c_attn|query_key_value|wqkv|Wqkv|attn_qkv)$"), "qkv"),
    (re.compile(r"^(o_proj|wo|out_proj|attn_output)$"), "o"),
    (re.compile(r"^(gate_proj|up_proj|w1|w3|fc1|c_fc|gate_up_proj|dense_h_to_4h|fc_in"
                r"|ffn_(gate|up|gate_up)(_exps|_shexp)?)$"), "col"),
    (re.compile(r"^(down_proj|w2|fc2|dense_4h_to_h|fc_out|ffn_down(_exps|_shexp)?)$"), "row"),
]
_EXPERT = re.compile(r"(^|\.)experts\.|_exps\.(weight|bias)$")  # routed experts: HF's numbered ones, GGUF's fused
_ATTENTION = re.compile(r"(attn|attention)", re.IGNORECASE)
# encoder-only families (BERT and its kin): one forward pass over the input, no KV cache, no LM head to decode
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
                           "mpnet", "camembert", "ernie", "modernbert", "nomic_bert", "megatron-bert", "rembert",
                           "xlm", "flaubert", "luke", "esm", "data2vec-text", "xmod", "nezha", "roformer"})


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as planned: its bytes at the planned dtype and what role it plays."""

    name: str
    shape: tuple[int, ...]
    element_bytes: float
    role: str  # embed, head, q, kv, qkv, o, col, row, other
    expert: bool = False  # one of a mixture's routed experts: read only when a token picks it
    tied_to: str | None = None  # shares the storage of this tensor: its bytes are counted there
    # model values per stored element: 32/bits for a packed quantized weight (GPTQ qweight), 0 for quantization
    # metadata (scales, zero points: bytes, but no parameters or FLOPs)
    packing: int = 1

    @property
    def numel(self) -> int:
        """The model values it holds (parameters, for the FLOPs)."""
        return math.prod(self.shape) * self.packing

    @property
    def size(self) -> int:
        """Bytes of the tensor itself, tied or not: stored elements × bytes per element."""
        return math.ceil(math.prod(self.shape) * self.element_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes it adds to its device: nothing when it is tied to a tensor counted elsewhere."""
        return 0 if self.tied_to else self.size


@dataclass(frozen=True)
class Unit:
    """A module placed whole: one key of the device map."""

    name: str
    kind: str  # input, layer, output; "experts" for a layer's routed experts placed apart from it (the host tier)
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
    encoder: bool = False  # encoder-only: one forward pass over the input, no decoding


@dataclass(frozen=True)
class ModelSpec:
    """A model for planning: its units in execution order and its architecture."""

    name: str
    source: str  # "checkpoint", "config" or "gguf"
    arch: Arch
    dtype: str  # planned dtype of the floating-point weights
    act_dtype: str  # dtype of activations (and of the KV cache unless the workload says otherwise)
    inputs: tuple[Unit, ...]
    layers: tuple[Unit, ...]
    outputs: tuple[Unit, ...]
    path: AnyPath | None = None
    notes: tuple[str, ...] = ()
    cache_dtype: str | None = None  # the runtime's default KV cache dtype when not act_dtype (llama.cpp: fp16)
    quantization: str | None = None  # a HF checkpoint's own (gptq int4, compressed-tensors float8): sized as stored

    @property
    def default_cache(self) -> str:
        """The KV cache dtype when the workload names none."""
        return self.cache_dtype or self.act_dtype

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
                "kind": "encoder" if a.encoder else "decoder",
                "params": self.params, "weight_bytes": self.nbytes, "dtype": self.dtype, "layers": a.layers,
                "hidden": a.hidden, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                "vocab": a.vocab, "experts": a.experts, "experts_per_token": a.experts_per_token,
                "tied_embeddings": a.tied, "model_type": a.model_type, "quantization": self.quantization}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the language model's facts in `text_config`."""
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def config_value(config: dict[str, Any] | None, key: str) -> Any:
    if config is None:
        return None
    for name in CONFIG_KEYS[key]:
        if config.get(name) is not None:
            return config[name]
    return None


def _element_bytes(stored: str, dtype: str | None) -> float:
    """Bytes per element of a stored tensor once loaded: floating tensors take the planned dtype."""
    if dtype is not None and stored in STORED_DTYPES:
        return ELEMENT_BYTES[dtype]
    if stored in GGML_ELEMENT_BYTES and stored not in STORED_DTYPES:  # a GGUF block type: exactly as stored
        return GGML_ELEMENT_BYTES[stored]
    return float(dtypes.numpy_dtype(stored).itemsize)


def _planned_dtypes(stored: list[tuple[str, int]], dtype: str | None, quant: Quantization | None,
                    config: dict[str, Any] | None) -> tuple[str, str]:
    """(weights dtype, activations dtype): the override, else the floating dtype holding the most elements. A
    quantized checkpoint's weights are named by its quantization, and its activations take the override, else the
    config's dtype, else the most common of its 16/32-bit floating tensors (`stored` holds only the unquantized)."""
    if dtype is not None and quant is None:
        return dtype, dtype
    counts: dict[str, int] = {}
    for name, numel in stored:
        if name in STORED_DTYPES and (quant is None or STORED_DTYPES[name] != "fp8"):
            counts[STORED_DTYPES[name]] = counts.get(STORED_DTYPES[name], 0) + numel
    main = max(counts, key=counts.__getitem__) if counts else ("bf16" if quant else "fp32")
    if quant is None:
        return main, main
    return quant.label, dtype or config_activations(config) or main


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
    leaf = parts[-1]
    # a quantized layer's packed weight and metadata (q_proj.qweight, q_proj.weight_scale) play its module's role
    owner = parts[-2] if len(parts) > 1 and (leaf in ("weight", "bias") or leaf in PACKED or leaf in METADATA) \
        else leaf
    if kind == "input":
        return "embed" if ndim == 2 and _EMBED.search(name) else "other"
    if kind == "output":  # the head's matrix; its quantization metadata is no head
        return "head" if ndim == 2 and _HEAD.match(owner) and leaf not in METADATA else "other"
    if owner in ("c_proj", "dense"):  # GPT-2 / NeoX reuse these names in attention and MLP
        return "o" if _ATTENTION.search(name) else "row"
    for pattern, role in _ROLES:
        if pattern.match(owner):
            return role
    return "other"


def is_head(name: str) -> bool:
    """Whether the tensor `name` belongs to an LM head module (lm_head.weight, embed_out.weight, ...)."""
    return bool(_HEAD.match(name.rsplit(".", 2)[-2] if name.count(".") else name))


def is_encoder(config: dict[str, Any] | None, container: str) -> bool:
    """Encoder-only: a known encoder family by the config, or without config BERT's layer container
    (`encoder.layer.N`, `bert.encoder.layer.N`)."""
    if config is not None and (config.get("is_decoder") or config.get("is_encoder_decoder")):
        return False
    if config is not None and config.get("model_type"):
        return config["model_type"] in ENCODER_TYPES
    return container == "encoder.layer" or container.endswith(".encoder.layer")


def build_model(tensors: list[tuple[str, tuple[int, ...], str]], shared: dict[str, str],
                config: dict[str, Any] | None, dtype: str | None, *, name: str, source: str,
                path: AnyPath | None) -> ModelSpec:
    """The ModelSpec of `tensors` (name, shape, stored dtype); `shared` maps a tied tensor to its owner."""
    config = text_config(config) if config is not None else None
    notes: list[str] = []
    quant = detect((n for n, _, _ in tensors), config)
    plain = [t for t in tensors if quant is None or t[0].rpartition(".")[0] not in quant.modules]
    weights_dtype, act_dtype = _planned_dtypes([(d, math.prod(s)) for _, s, d in plain], dtype, quant, config)
    container = _layer_container([n for n, _, _ in tensors], config_value(config, "layers"))
    if container is None:
        raise PlanError("no numbered layers in the tensor names (like model.layers.N...): the planner places "
                        "transformer layers", file=str(path) if path else None)
    prefix = f"{container}." if container else ""
    layer_of: dict[str, int] = {}
    by_module: dict[str, list[tuple[str, tuple[int, ...], str]]] = {}
    for tensor in tensors:
        tname = tensor[0]
        number, _, rest = tname[len(prefix):].partition(".") if tname.startswith(prefix) else ("", "", "")
        if number.isdigit() and rest:
            module = f"{prefix}{number}"
            layer_of[module] = int(number)
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
        as_stored = quant is not None and tname.rpartition(".")[0] in quant.modules  # never cast quantized tensors
        return TensorSpec(tname, tuple(shape), _element_bytes(stored, None if as_stored else dtype),
                          _role(tname, kind, len(shape)), expert=bool(_EXPERT.search(tname)) and kind == "layer",
                          tied_to=shared.get(tname), packing=quant.packing(tname, stored) if quant else 1)

    units: dict[str, list[Unit]] = {kind: [] for kind in ("input", "layer", "output")}
    for module, members in by_module.items():
        kind = kind_of(module)
        units[kind].append(Unit(module, kind, tuple(spec(t, kind) for t in members)))
    units["layer"].sort(key=lambda u: layer_of[u.name])
    units["output"].sort(key=lambda u: bool(_HEAD.match(u.name.rsplit(".", 1)[-1])))  # final norm, then head

    embed = _main_embedding(units["input"], config_value(config, "vocab"))
    head = next((t for u in units["output"] for t in u.tensors if t.role == "head"), None)
    tie_config = config.get("tie_word_embeddings") if config else None
    encoder = is_encoder(config, container)
    if head is None and embed is not None and tie_config is not False and not encoder:
        # save_pretrained drops a tied head; the model reads the embedding matrix as its head
        units["output"].append(Unit("lm_head", "output", (
            TensorSpec("lm_head.weight", embed.shape, embed.element_bytes, "head", tied_to=embed.name),)))
        if tie_config is None:
            notes.append("no LM head tensor, and " + ("the config does not say tie_word_embeddings" if config
                                                      else "no config.json") + ": the head is assumed tied to the "
                         "input embedding")
        head = units["output"][-1].tensors[0]
    elif head is not None and embed is not None and tie_config and head.tied_to is None and head.shape == embed.shape:
        # stored twice, but the runtime ties them at load time: one copy is resident
        units["output"] = [Unit(u.name, u.kind, tuple(replace(t, tied_to=embed.name) if t is head else t
                                                      for t in u.tensors)) for u in units["output"]]
        head = replace(head, tied_to=embed.name)
    tied = head is not None and head.tied_to is not None
    _check_ties(units, shared)

    layers = tuple(units["layer"])
    if config is not None and config_value(config, "layers") not in (None, len(layers)):
        notes.append(f"the config says {config_value(config, 'layers')} layers, the tensors hold {len(layers)}")
    arch = replace(_arch(config, layers, embed, tied), encoder=encoder)
    if quant is not None and quant.bits is None and any(n.rpartition(".")[2] in PACKED for n, _, _ in tensors):
        notes.append(f"the quantization config does not give one weight width ({quant.label}): packed weights are "
                     "sized as stored but counted as one parameter per stored element")
    return ModelSpec(name=name, source=source, arch=arch, dtype=weights_dtype, act_dtype=act_dtype,
                     inputs=tuple(units["input"]), layers=layers, outputs=tuple(units["output"]), path=path,
                     notes=tuple(notes), quantization=quant.label if quant else None)


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
    hidden = config_value(config, "hidden") or (embed.shape[1] if embed is not None else None)
    if hidden is None:
        raise PlanError("cannot tell the hidden size: no config.json and no input embedding")
    heads = config_value(config, "heads")
    kv_heads = config_value(config, "kv_heads") or heads
    head_dim = config_value(config, "head_dim") or (hidden // heads if heads else None)
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
    experts = config_value(config, "experts") or _count_experts(layers)
    per_token = config_value(config, "experts_per_token") or 0
    if experts and not per_token:
        raise PlanError(f"the checkpoint holds {experts} experts per layer but no config.json says how many a "
                        "token uses (num_experts_per_tok); put config.json beside the checkpoint")
    intermediate = config_value(config, "intermediate") or next(
        (t.shape[0] for t in first if t.role == "col" and not t.expert and len(t.shape) == 2), 4 * hidden)
    if experts:
        routed = per_token * (config_value(config, "moe_intermediate") or intermediate)
        ffn = routed + (config_value(config, "shared_intermediate") or 0)
    else:
        ffn = intermediate
    vocab = config_value(config, "vocab") or (embed.shape[0] if embed is not None else None)
    window = config.get("sliding_window") if config else None
    return Arch(layers=len(layers), hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, q_dim=q_dim,
                kv_dim=kv_dim, vocab=vocab, ffn=ffn, experts=experts, experts_per_token=per_token, tied=tied,
                model_type=config.get("model_type") if config else None, sliding_window=window or None)


def _count_experts(layers: tuple[Unit, ...]) -> int:
    """Routed experts per layer from the names (experts.N...) or a fused [experts, ...] parameter."""
    most = 0
    for layer in layers:
        numbered = {t.name.split(".experts.")[1].split(".")[0] for t in layer.tensors
                    if t.expert and ".experts." in t.name}
        ids = {n for n in numbered if n.isdigit()}
        fused = [t.shape[0] for t in layer.tensors if t.expert and len(t.shape) == 3]
        most = max(most, len(ids), *fused)
    return most
