"""Hugging Face checkpoints with quantized weights (GPTQ, AWQ, compressed-tensors, FP8): what their tensors are.

Such a checkpoint stores a quantized linear layer as packed integers (GPTQ/AWQ `qweight`, compressed-tensors
`weight_packed`: several values per int32), or as fp8 `weight`, beside its quantization metadata (`scales`,
`qzeros`, `g_idx`, `weight_scale`, `weight_zero_point`, `weight_shape`, ...). The planner sizes every one of them
exactly as stored (the safetensors header's dtype and shape), never from the config's dtype, and keeps them as
stored when a workload dtype is given. For the parameter and FLOP counts a packed tensor holds `32 / bits` values
per int32 and the metadata none; the activations (and the default KV cache) take the config's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# the packed weights: several quantized values per stored int32
PACKED = frozenset({"qweight", "weight_packed"})
# quantization metadata: bytes to store and read, no parameters of the model
METADATA = frozenset({"qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv", "weight_zero_point",
                      "weight_global_scale", "weight_shape", "input_scale", "input_global_scale", "input_zero_point",
                      "output_scale", "k_scale", "v_scale"})
# leaves that mark a module as quantized (a plain `weight` beside them is its quantized, e.g. fp8, weight)
_MARKERS = PACKED | {"weight_scale", "weight_scale_inv", "weight_zero_point", "weight_global_scale"}
_PACKED_DTYPES = {"I32": 32, "U32": 32}  # bits per stored element of a packed weight
CONFIG_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float": "fp32", "half": "fp16"}


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint's weights are quantized: `label` names it (`gptq int4`, `compressed-tensors float8`), `bits`
    the weights' bits when the config gives one width (None otherwise), `modules` the quantized modules."""

    label: str
    bits: int | None
    modules: frozenset[str]

    def packing(self, name: str, stored: str) -> int:
        """Model values per stored element of tensor `name`: 32/bits for a packed weight, 0 for quantization
        metadata, 1 otherwise (also for a packed weight whose bits the config does not give evenly)."""
        module, _, leaf = name.rpartition(".")
        if module not in self.modules:
            return 1
        if leaf in METADATA:
            return 0
        if leaf in PACKED and self.bits and stored in _PACKED_DTYPES and _PACKED_DTYPES[stored] % self.bits == 0:
            return _PACKED_DTYPES[stored] // self.bits
        return 1


def _weights_args(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping):
        return []
    return [g["weights"] for g in groups.values() if isinstance(g, Mapping) and isinstance(g.get("weights"), Mapping)]


def _label_and_bits(config: Mapping[str, Any] | None) -> tuple[str, int | None]:
    """From `quantization_config`: GPTQ/AWQ `bits` (AWQ also `w_bit`), compressed-tensors' config groups
    (`weights.num_bits`, `weights.type`), HF's fp8 (`quant_method: fp8`)."""
    if not isinstance(config, Mapping):
        return "quantized", None
    method = str(config.get("quant_method") or "quantized")
    if method == "fp8":
        return "fp8", 8
    args = _weights_args(config)
    if args:
        widths = {(str(a.get("type") or "int"), a.get("num_bits")) for a in args}
        if len(widths) == 1:
            kind, bits = widths.pop()
            if isinstance(bits, int) and not isinstance(bits, bool) and bits > 0:
                return f"{method} {kind}{bits}", bits
        return f"{method} mixed", None
    bits = config.get("bits", config.get("w_bit"))
    if isinstance(bits, int) and not isinstance(bits, bool) and bits > 0:
        return f"{method} int{bits}", bits
    return method, None


def detect(names: Iterable[str], config: Mapping[str, Any] | None) -> Quantization | None:
    """The checkpoint's quantization from its tensor names (and the config's `quantization_config`), or None when
    no module holds quantized weights."""
    modules = frozenset(module for name in names
                        for module, _, leaf in [name.rpartition(".")] if module and leaf in _MARKERS)
    if not modules:
        return None
    label, bits = _label_and_bits(config.get("quantization_config") if config else None)
    return Quantization(label, bits, modules)


def config_activations(config: Mapping[str, Any] | None) -> str | None:
    """The activations' dtype a quantized model runs in: the config's `dtype` / `torch_dtype`, when floating."""
    if not config:
        return None
    value = config.get("dtype", config.get("torch_dtype"))
    return CONFIG_DTYPES.get(str(value).removeprefix("torch.")) if value is not None else None
