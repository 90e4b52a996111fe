"""The parsed contents of DeepSpeed's files: one model-states file, and each rank's optimizer-states file.

Only stand-ins for DeepSpeed's record classes are unpickled; nothing of DeepSpeed runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ... import safe_pickle, torchzip
from ...errors import HeaderError, UnsupportedError
from ...shapes import check_shape, describe
from ...storage import ByteStore

# model-states entries that describe the layout rather than hold state of their own
LAYOUT_KEYS = frozenset({"module", "buffer_names", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
                         "shared_params", "optimizer"})
# optimizer entries holding the flat tensors, turned into per-parameter tensors instead of objects
FLAT_KEYS = frozenset({"single_partition_of_fp32_groups", "fp32_flat_groups", "base_optimizer_state",
                       "optimizer_state_dict", "param_slice_mappings"})


class _Attributes(dict):
    """A DeepSpeed record class (LossScaler, fragment_address), rebuilt as the dict of its attributes."""

    def __setstate__(self, state: Any) -> None:
        if type(state) is not dict:
            raise HeaderError(f"a DeepSpeed record's state should be a dict, found {type(state).__name__}")
        self.update(state)


def _zero_stage(value: Any) -> int:
    """ZeroStageEnum(n), pickled as the enum called with its value: the stage number."""
    if type(value) is not int or not 0 <= value <= 3:
        raise HeaderError(f"ZeroStageEnum({value!r}) is not a ZeRO stage (0-3)")
    return value


DEEPSPEED_GLOBALS: safe_pickle.Globals = {
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): _zero_stage,
    ("deepspeed.utils.tensor_fragment", "fragment_address"): _Attributes,
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): _Attributes,
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): _Attributes,
}
"""Stand-ins for the DeepSpeed classes that appear in real checkpoint files."""


def load(files: ByteStore, name: str) -> Any:
    """The object tree of one torch.save file of a DeepSpeed checkpoint (tensors as TensorRefs)."""
    return torchzip.load(files.buffer(name), file=files.describe(name), extra_globals=DEEPSPEED_GLOBALS)


@dataclass(frozen=True)
class ModelStates:
    """One model-states file: the module's tensors and the layout of the parameters."""

    file: str
    module: dict[str, torchzip.TensorRef]
    buffers: tuple[str, ...]
    param_shapes: tuple[dict[str, tuple[int, ...]], ...]  # per group, in flattening order
    shared: dict[str, str]  # tied name -> source name
    frozen_shapes: dict[str, tuple[int, ...]]
    frozen_fragments: dict[str, torchzip.TensorRef]
    entries: dict[str, Any]  # everything else (global_steps, ds_config, lr_scheduler...)


def read_model_states(files: ByteStore, name: str) -> ModelStates:
    """Parse and check one `*_model_states.pt` file."""
    path = files.describe(name)
    state = load(files, name)
    if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
        raise HeaderError("is not a DeepSpeed model-states file (no 'module' state dict)", file=path)
    module = {}
    for key, value in state["module"].items():
        if not isinstance(value, torchzip.TensorRef):
            raise HeaderError(f"module entry holds {type(value).__name__}, not a tensor", file=path, tensor=str(key))
        module[str(key)] = value
    buffers = state.get("buffer_names") or []
    shared = state.get("shared_params") or {}
    if not isinstance(buffers, list) or not all(isinstance(b, str) for b in buffers):
        raise HeaderError(f"buffer_names should be a list of names, found {str(buffers)[:80]!r}", file=path)
    if not isinstance(shared, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in shared.items()):
        raise HeaderError(f"shared_params should map names to names, found {str(shared)[:80]!r}", file=path)
    groups = state.get("param_shapes") or []
    if isinstance(groups, dict):  # older saves: one group, not a list
        groups = [groups]
    if not isinstance(groups, list):
        raise HeaderError(f"param_shapes should be a list of name -> shape maps, found {type(groups).__name__}",
                          file=path)
    fragments = state.get("frozen_param_fragments") or {}
    if not isinstance(fragments, dict) or not all(isinstance(v, torchzip.TensorRef) for v in fragments.values()):
        raise HeaderError("frozen_param_fragments should map names to tensors", file=path)
    return ModelStates(
        file=name, module=module, buffers=tuple(buffers),
        param_shapes=tuple(_shapes(g, path) for g in groups), shared=dict(shared),
        frozen_shapes=_shapes(state.get("frozen_param_shapes") or {}, path), frozen_fragments=dict(fragments),
        entries={str(k): v for k, v in state.items() if k not in LAYOUT_KEYS})


def _shapes(value: Any, path: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, dict):
        raise HeaderError(f"expected a name -> shape map, found {type(value).__name__}", file=path)
    shapes = {}
    for name, shape in value.items():
        if not isinstance(name, str):
            raise HeaderError(f"parameter name {describe(name)} is not a string", file=path)
        shapes[name] = check_shape(shape, file=path, tensor=name)
    return shapes


@dataclass(frozen=True)
class RankStates:
    """One rank's optimizer-states file: its flat fp32 tensors ("slots") and their optimizer state."""

    rank: int
    file: str
    stage: int
    partition_count: int
    flats: tuple[torchzip.TensorRef, ...]
    state: tuple[dict[str, torchzip.TensorRef], ...]  # per slot: exp_avg, exp_avg_sq, step...
    settings: dict[str, Any]  # the rest of optimizer_state_dict (group_paddings, loss_scaler...)
    param_groups: list[Any]
    slice_mappings: Any  # stages 1-2: per group, name -> fragment_address(start, numel) on this rank


def read_rank_states(files: ByteStore, name: str, rank: int) -> RankStates:
    """Parse and check one `*_optim_states.pt` file."""
    path = files.describe(name)
    state = load(files, name)
    settings = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    if not isinstance(settings, dict) or "zero_stage" not in settings:
        raise HeaderError("is not a DeepSpeed ZeRO optimizer-states file (no optimizer_state_dict.zero_stage)",
                          file=path)
    stage = settings["zero_stage"]
    if type(stage) is not int or not 0 <= stage <= 3:
        raise HeaderError(f"zero_stage is {stage!r}, not a ZeRO stage", file=path)
    counts = settings.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts]
    if not counts or any(type(c) is not int or c < 1 for c in counts) or len(set(counts)) != 1:
        raise UnsupportedError(f"partition_count is {settings.get('partition_count')!r}; only groups partitioned "
                               "over all data-parallel ranks are supported (no expert parallelism)", file=path)
    flats = settings.get("fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups")
    if isinstance(flats, torchzip.TensorRef):
        flats = [flats]
    if not isinstance(flats, list) or not all(isinstance(f, torchzip.TensorRef) for f in flats):
        raise HeaderError("the flat fp32 partitions should be a list of tensors", file=path)
    for slot, flat in enumerate(flats):
        if len(flat.shape) != 1 or not flat.is_contiguous:
            raise HeaderError(f"flat fp32 partition {slot} has shape {flat.shape} and stride {flat.stride}; "
                              "expected a contiguous 1-D tensor", file=path)
    base = settings.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state")
    per_slot, groups = _slot_states(base, len(flats), path)
    return RankStates(rank, name, stage, counts[0], tuple(flats), per_slot,
                      {k: v for k, v in settings.items() if k not in FLAT_KEYS}, groups,
                      settings.get("param_slice_mappings"))


def _slot_states(base: Any, slots: int, path: str) -> tuple[tuple[dict[str, torchzip.TensorRef], ...], list[Any]]:
    """The base optimizer's state of each flat tensor, and its param_groups.

    The base optimizer sees one parameter per flat tensor, numbered in order; elastic saves store a list
    with one state dict per group instead."""
    if base is None:
        return tuple({} for _ in range(slots)), []
    groups: list[Any] = []
    if isinstance(base, list):
        states = base
    elif isinstance(base, dict) and isinstance(base.get("state"), dict):
        groups = base.get("param_groups") or []
        if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                   for g in groups):
            raise HeaderError("the base optimizer's param_groups should be a list of dicts with a 'params' list",
                              file=path)
        ids = [i for g in groups for i in g["params"]]
        if not all(type(i) is int for i in ids):
            raise HeaderError(f"the base optimizer's parameter ids should be integers, found {ids[:8]!r}", file=path)
        states = [base["state"].get(i, {}) for i in ids] if ids else list(base["state"].values())
    else:
        raise HeaderError(f"the base optimizer state should be a state dict, found {type(base).__name__}", file=path)
    if len(states) != slots or not all(isinstance(s, dict) for s in states):
        raise HeaderError(f"the base optimizer holds state for {len(states)} flat tensors, the file has {slots}",
                          file=path)
    per_slot = []
    for slot, entries in enumerate(states):
        tensors = {}
        for key, value in entries.items():
            if isinstance(value, torchzip.TensorRef):
                if len(value.shape) > 1 or not value.is_contiguous:
                    raise UnsupportedError(f"optimizer state {key!r} of flat tensor {slot} has shape {value.shape}; "
                                           "only flat and scalar state can be mapped to parameters", file=path)
                tensors[str(key)] = value
        per_slot.append(tensors)
    return tuple(per_slot), groups

