"""torch <-> numpy without copies, in the library's dtype vocabulary (bf16 and fp8 through ml_dtypes).

The only place that maps torch dtypes onto the vocabulary; torch is imported here, so only torch-using
layers (distributed, train, the planner's load path) import this module.
"""

from __future__ import annotations

import numpy as np
import torch

from . import dtypes
from .errors import UnsupportedError


def vocabulary(dtype: torch.dtype) -> str:
    """The vocabulary name of a torch dtype ("F32", "BF16", ...); UnsupportedError for others."""
    name = str(dtype).removeprefix("torch.")
    try:
        return dtypes.TORCH_DTYPE_NAMES[name]
    except KeyError:
        raise UnsupportedError(f"tensors of dtype {dtype} cannot be stored") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a vocabulary name."""
    dtype = getattr(torch, dtypes.TORCH_DTYPE_OF[name])
    assert isinstance(dtype, torch.dtype)
    return dtype


def as_numpy(tensor: torch.Tensor, name: str) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's memory with the matching (ml_dtypes) dtype."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8).numpy().view(dtypes.numpy_dtype(name)).reshape(tuple(tensor.shape))


def to_torch(array: np.ndarray, name: str) -> torch.Tensor:
    """A torch tensor over the array's bytes (copied when read-only or strided: torch wants writable memory)."""
    flat = array.reshape(-1)
    if not flat.flags.writeable or not flat.flags.c_contiguous:
        flat = flat.copy()
    return torch.from_numpy(flat.view(np.uint8)).view(torch_dtype(name)).reshape(array.shape)


def cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()
