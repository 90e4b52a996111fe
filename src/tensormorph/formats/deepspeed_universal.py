"""DeepSpeed universal checkpoints (`ds_to_universal` output), read without torch or deepspeed.

Layout: `<save_dir>/latest_universal` names the folder (the folder itself opens too), which holds
`zero/<param>/fp32.pt` (the whole fp32 parameter: a tensor, or a dict whose 'param' is one) beside
that parameter's optimizer state (`exp_avg.pt`, `exp_avg_sq.pt`, `step.pt`), `zero/optimizer_state.pt`
(the optimizer's settings) and a copy of the model-states files.

Names match the ZeRO reader's (formats/deepspeed/), so the two compare directly: `<param>` from
fp32.pt, `optimizer.state.<param>.<key>` from `<key>.pt`, buffers, tied aliases and `module.<name>`
from the model-states copy, objects from the model states and `optimizer.<key>`.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from .. import torchzip
from ..core import Checkpoint, LogicalTensor, ObjectEntry
from ..errors import CheckpointError, HeaderError
from ..storage import AnyPath, ByteStore, entries, store_at
from . import deepspeed
from .contract import Detection
from .torch_pickle import tensor_chunk

NAME = "deepspeed-universal"

LATEST = "latest_universal"
ZERO = "zero"
MASTER = "fp32"
OPTIMIZER_FILE = "optimizer_state.pt"


def _folder(path: AnyPath) -> AnyPath:
    return deepspeed.tag_folder(path, LATEST)


def detect(path: AnyPath) -> Detection | None:
    """The converted folder, when its zero/ folder holds a parameter's fp32.pt."""
    try:
        if not path.is_dir():
            return None
        folder = _folder(path)
        zero = folder / ZERO
        found = zero.is_dir() and any((p / f"{MASTER}.pt").is_file() for p in entries(zero))
    except (OSError, CheckpointError):
        return None
    return Detection(path, folder) if found else None


def _tensor(files: ByteStore, name: str, file: str) -> LogicalTensor:
    """One parameter's file: a tensor, or {'param': tensor, 'cat_dim': ...} as DeepSpeed writes for stages 1-2."""
    value = deepspeed.load(files, file)
    if isinstance(value, dict):
        value = value.get("param")
    if not isinstance(value, torchzip.TensorRef):
        raise HeaderError("should hold a tensor (or a dict whose 'param' is one)", file=files.describe(file),
                          tensor=name)
    return LogicalTensor(name, value.dtype, value.shape, (tensor_chunk(files, file, value),))


def open(detection: Detection) -> Checkpoint:
    folder = detection.found or _folder(detection.path)
    files = store_at(folder)
    zero = folder / ZERO
    if not zero.is_dir():
        raise HeaderError(f"has no {ZERO}/ folder of per-parameter files", file=str(folder))
    model_file = next((n for n in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt")
                       if files.exists(n)), None)
    model = deepspeed.read_model_states(files, model_file) if model_file is not None else None
    shapes = {} if model is None else {n: s for group in model.param_shapes for n, s in group.items()}
    if model is not None:
        shapes.update(model.frozen_shapes)

    tensors: dict[str, LogicalTensor] = {}
    data_files = []
    for param in (p for p in entries(zero) if p.is_dir()):
        for item in entries(param, "*.pt"):
            file = str(PurePosixPath(ZERO, param.name, item.name))
            name = param.name if item.stem == MASTER else f"{deepspeed.STATE_PREFIX}{param.name}.{item.stem}"
            tensor = _tensor(files, name, file)
            if tensor.shape and param.name in shapes:  # ZeRO-3's conversion saves parameters flattened
                tensor = deepspeed.reshaped(tensor, shapes[param.name])
            tensors[name] = tensor
            data_files.append(file)

    objects: dict[str, ObjectEntry] = {}
    metadata: dict[str, Any] = {"tag": folder.name, "aliases": {}}
    if model is not None:
        for name, tensor in deepspeed.module_tensors(files, model).items():
            tensors.setdefault(name, tensor)  # stages 1-2 convert the buffers into zero/ too
        metadata["aliases"] = deepspeed.add_aliases(tensors, model.shared)
        metadata["ds_version"] = model.entries.get("ds_version")
        tensors = deepspeed.in_model_order(tensors, model)
        objects.update(deepspeed.model_objects(files, model))
        data_files.append(model.file)
    optimizer_file = str(PurePosixPath(ZERO, OPTIMIZER_FILE))
    if files.exists(optimizer_file):
        settings = deepspeed.load(files, optimizer_file)
        if not isinstance(settings, dict):
            raise HeaderError("should hold the optimizer's settings as a dict", file=files.describe(optimizer_file))
        groups = settings.get("param_groups")
        rest = {k: v for k, v in settings.items() if k not in deepspeed.FLAT_KEYS and k != "param_groups"}
        objects.update(deepspeed.optimizer_objects(files, optimizer_file, rest,
                                                   groups if isinstance(groups, list) else []))
        metadata["zero_stage"] = rest.get("zero_stage")
        data_files.append(optimizer_file)
    return Checkpoint(path=folder, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(data_files), storage=files)


checksum_problems = deepspeed.checksum_problems
