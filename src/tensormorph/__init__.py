"""Tensormorph: any sharded checkpoint as one logical checkpoint.

    import tensormorph as tm
    ck = tm.open("ckpts/step-1000")          # DCP, safetensors, torch .bin/.pt, DeepSpeed, GGUF ...
    w = ck["model.layers.0.attn.wq.weight"]
    w.shape, w.dtype, w.chunks               # logical view and how it is stored
    w[0:4, 100:108]                          # reads only the bytes it needs
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .core import DEFAULT_READ_BUDGET, Checkpoint, Chunk, LogicalTensor, ObjectEntry, Placement
from .errors import CheckpointError
from .extras import require
from .formats import detect, open_checkpoint
from .ops.convert import convert
from .ops.diff import diff
from .ops.history import history
from .ops.verify import verify
from .pictures import diff_heatmap, heatmap
from .storage import remote_options
from .version import __version__ as __version__

if TYPE_CHECKING:  # the range cache loads only for remote checkpoints
    from .storage.range_cache import RangeCache

__all__ = [
    "Checkpoint", "CheckpointError", "Chunk", "DEFAULT_READ_BUDGET", "LogicalTensor", "ObjectEntry", "Placement",
    "convert", "detect", "diff", "diff_heatmap", "heatmap", "history", "open", "remote_options", "verify",
]  # save, load, plan and widget load on first use (torch for the first two) and stay out of `import *`


def open(path: str | Path, format: str | None = None, *, read_budget: int = DEFAULT_READ_BUDGET,
         storage_options: dict[str, Any] | None = None,
         cache: str | Path | bool | RangeCache | None = None) -> Checkpoint:
    """Open a checkpoint file or folder of any supported format as one logical checkpoint.

    `path` is a local path or a URL: s3://, gs://, az://, memory:// (any fsspec protocol, with its
    `storage_options`: credentials, endpoint), or https:// to the file that names the others (docs/remote.md).
    Remote reads fetch only the byte ranges they need and keep them in the on-disk range cache (`cache`: its
    folder, True or None for the default one, False for none, or a `RangeCache` made with its own size or
    revalidation time).

    `format` forces a reader ("safetensors", "hf-sharded", "torch", "dcp", "dcp-safetensors",
    "tensormorph", "deepspeed", "deepspeed-universal", "megatron-torch-dist", "gguf", "orbax"); by default
    the format is detected from the content. Reads larger than `read_budget`
    bytes raise BudgetExceededError unless forced.
    """
    return open_checkpoint(path, format, read_budget=read_budget, storage_options=storage_options, cache=cache)


# entry points that load on first use: `import tensormorph` stays free of torch (save, load) and of anywidget and its
# traitlets (widget, which names the `notebook` extra itself when anywidget is missing). `tm.widget` is the module
# tensormorph.widget, which is callable: importing a submodule binds its name on the package whatever we return here.
_LAZY = {"save": ".distributed", "load": ".distributed", "plan": ".planner", "widget": ".widget"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tensormorph' has no attribute {name!r}")
    if module == ".distributed":
        require("torch", "torch", feature=f"tm.{name}")
    loaded = importlib.import_module(module, __name__)
    return loaded if module == f".{name}" else getattr(loaded, name)
