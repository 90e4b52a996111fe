"""Opaque per-rank states (a StatefulDataLoader's) as plain values, and back.

A checkpoint's plain values are numbers, strings, bools, None, bytes, lists,
tuples and dicts. Tensors and NumPy arrays inside such a state become a
tagged dict holding their dtype, shape and bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["from_plain", "to_plain"]

_TENSOR = "__tensormorph_tensor__"
_ARRAY = "__tensormorph_ndarray__"


def to_plain(value: Any, where: str) -> Any:
    """`value` with every tensor and array replaced by a tagged dict; anything else non-plain is refused."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return {_TENSOR: {"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape), "data": raw}}
    if isinstance(value, np.ndarray):
        return {_ARRAY: {"dtype": value.dtype.str, "shape": list(value.shape),
                         "data": np.ascontiguousarray(value).tobytes()}}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: to_plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [to_plain(v, f"{where}.{i}") for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    raise TypeError(f"state entry {where!r} holds a {type(value).__module__}.{type(value).__qualname__}, which is "
                    "not a tensor, an array or plain data")


def from_plain(value: Any) -> Any:
    """The inverse of `to_plain`."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            info = value[_TENSOR]
            dtype = getattr(torch, info["dtype"])
            flat = torch.frombuffer(bytearray(info["data"]), dtype=torch.uint8) if info["data"] else \
                torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(info["shape"])
        if set(value) == {_ARRAY}:
            info = value[_ARRAY]
            return np.frombuffer(info["data"], dtype=np.dtype(info["dtype"])).reshape(info["shape"]).copy()
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(from_plain(v) for v in value)
    return value
