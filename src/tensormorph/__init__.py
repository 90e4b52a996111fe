"""Tensormorph: any sharded checkpoint as one logical checkpoint.

    import tensormorph as tm
    ck = tm.open("ckpts/step-1000")          # DCP, safetensors, torch .bin/.pt, DeepSpeed, GGUF ...
    w = ck["model.layers.0.attn.wq.weight"]
    w.shape, w.dtype, w.chunks               # logical view and how it is stored
    w[0:4, 100:108]                          # reads only the bytes it needs
"""

from __future__ import annotations

from pathlib import Path

from .core import DEFAULT_READ_BUDGET, Checkpoint, Chunk, LogicalTensor, ObjectEntry, Placement
from .errors import CheckpointError
from .formats import detect
from .formats import open_checkpoint as _open
from .ops.convert import convert
from .ops.diff import diff
from .ops.verify import verify

__all__ = [
    "Checkpoint", "CheckpointError", "Chunk", "DEFAULT_READ_BUDGET", "LogicalTensor", "ObjectEntry", "Placement",
    "convert", "detect", "diff", "open", "verify",
]  # save, load and plan load on first use (torch for the first two) and stay out of `import *`
__version__ = "0.1.0"


def open(path: str | Path, format: str | None = None, *, read_budget: int = DEFAULT_READ_BUDGET) -> Checkpoint:
    """Open a checkpoint file or folder of any supported format as one logical checkpoint.

    `format` forces a reader ("safetensors", "hf-sharded", "torch", "dcp", "dcp-safetensors",
    "tensormorph", "deepspeed", "deepspeed-universal", "megatron-torch-dist", "gguf"); by default
    the format is detected from the content. Reads larger than `read_budget`
    bytes raise BudgetExceededError unless forced.
    """
    checkpoint = _open(path, format)
    if read_budget != DEFAULT_READ_BUDGET:
        from dataclasses import replace

        checkpoint = replace(checkpoint, tensors={n: t.with_budget(read_budget) for n, t in checkpoint.tensors.items()})
    return checkpoint


# torch-dependent entry points load on first use, so `import tensormorph` stays torch-free.
_LAZY = {"save": ".distributed", "load": ".distributed", "plan": ".planner"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tensormorph' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)
