"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3, any dtype), read without torch or deepspeed.

Files, in the tag folder (`<save_dir>/latest` names the tag; the tag folder itself opens too):
- `mp_rank_00_model_states.pt` (stage 3: `zero_pp_rank_<r>_mp_rank_00_model_states.pt` per rank): the
  module's state dict, `param_shapes` (trainable parameters, per group, in flattening order),
  `shared_params` (tied name -> source), frozen parameters, step counters and the config.
- `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`, one per data-parallel rank: rank r's flat fp32
  partitions and the optimizer state of those flat tensors.

Names in the logical checkpoint:
- `<param>`: the fp32 master weight, rebuilt as DeepSpeed's zero_to_fp32 does. Stages 1/2: each group's
  partitions concatenated over ranks, parameters taken in `param_shapes` order (plus any
  `param_alignment_paddings`). Stage 3: each parameter split on its own into ceil(n / ranks) elements per
  rank, at the same running offset in every rank's flat groups, padding at the end. Frozen parameters
  come from `frozen_param_fragments` (stage 3: one fragment per rank); ZeRO-1 records none, so there
  they are the module's own weights (metadata["frozen"] lists them).
- `<buffer>`: the module's buffers, as stored.
- `<tied>`: a tied parameter (`shared_params`): the same chunks as its source; metadata["aliases"].
- `optimizer.state.<param>.<key>`: the optimizer state per parameter. Flat state (AdamW's exp_avg and
  exp_avg_sq) is laid out like the masters; scalars (step) are those of the flat tensor holding the
  parameter's first element.
- `module.<param>`: stages 1-2, the module's own (bf16/fp16/fp32) weights; stage 3 saves only
  placeholders, which are left out.
- Objects: the model-states file's other entries (global_steps, ds_config, lr_scheduler...) and
  `optimizer.<key>` for the optimizer's settings (param_groups, loss_scaler...).

A parameter is a contiguous range of flat elements, and each rank holds one contiguous piece of it.
Chunks must be boxes, so each piece is cut at row edges into at most 2·ndim − 1 boxes (a partial
first row, whole rows, a partial last row, recursively), each a memory-mapped view of that rank's
file with `ranks=(r,)`. A region read therefore touches only the partitions, and bytes, that overlap
it, and the chunk table says which rank holds which part. metadata["partition_sizes"] lists the
elements of each rank's flat tensors (without DeepSpeed's trailing padding).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import dtypes, safe_pickle, torchzip
from ..core import Checkpoint, Chunk, LogicalTensor, MappedArray, ObjectEntry, Placement, validate_tiling
from ..errors import (CheckpointError, HeaderError, MissingFileError, UnsafePickleError,
                      UnsupportedError)
from ..storage import LocalFiles
from .torch_pickle import tensor_chunk

NAME = "deepspeed"
PRIORITY = 20  # before the plain torch reader, which would see only one file

LATEST = "latest"
MAX_TAG_BYTES = 4096
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
OPTIMIZER_PREFIX = "optimizer."
MODULE_PREFIX = "module."
STATE_PREFIX = "optimizer.state."
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
"""Stand-ins for the DeepSpeed classes that appear in real checkpoint files; nothing of DeepSpeed runs."""


def load(files: LocalFiles, name: str) -> Any:
    """The object tree of one torch.save file of a DeepSpeed checkpoint (tensors as TensorRefs)."""
    return torchzip.load(files.buffer(name), file=str(files.resolve(name)), extra_globals=DEEPSPEED_GLOBALS)


# ---------------------------------------------------------------- finding the files

def read_tag(latest: Path) -> str:
    """The tag a `latest` file names (one line of text)."""
    real = latest.resolve()
    if latest.parent.resolve() not in real.parents:
        raise HeaderError(f"is a link to {real}, outside the checkpoint folder", file=str(latest))
    size = real.stat().st_size
    if size > MAX_TAG_BYTES:
        raise HeaderError(f"is {size} bytes; a tag file holds one short line", file=str(latest))
    try:
        tag = real.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise HeaderError("is not UTF-8 text naming a tag", file=str(latest)) from None
    if not tag or "\n" in tag or "\x00" in tag:
        raise HeaderError(f"should name one tag folder, found {tag[:80]!r}", file=str(latest))
    return tag


def tag_folder(path: Path, latest: str = LATEST) -> Path:
    """The tag folder: the one `path/latest` names (kept inside `path`), else `path` itself."""
    pointer = path / latest
    if not pointer.is_file():
        return path
    tag = read_tag(pointer)
    folder = LocalFiles(path).resolve(tag, referrer=str(pointer))
    if not folder.is_dir():
        raise MissingFileError(f"names tag {tag!r}, but there is no such folder", file=str(pointer))
    return folder


def detect(path: Path) -> bool:
    try:
        if not path.is_dir():
            return False
        names = [p.name for p in tag_folder(path).iterdir()]
    except (OSError, CheckpointError):
        return False
    return any(MODEL_FILE.match(n) for n in names) and any(OPTIM_FILE.match(n) for n in names)


def _optim_files(folder: Path) -> list[str]:
    """The optimizer-state files, indexed by data-parallel rank, checked to be complete and unambiguous."""
    by_rank: dict[int, str] = {}
    for entry in sorted(folder.iterdir()):
        match = OPTIM_FILE.match(entry.name)
        if not match:
            continue
        rank, mp = int(match.group(2)), int(match.group(3))
        if mp != 0:
            raise UnsupportedError("holds model-parallel (tensor/pipeline) partitions; convert it with DeepSpeed's "
                                   "ds_to_universal first, whose output this library reads", file=str(entry))
        if rank in by_rank:
            raise HeaderError(f"{by_rank[rank]} and {entry.name} both hold data-parallel rank {rank}'s optimizer "
                              "states (a bf16 and a non-bf16 save mixed in one folder)", file=str(folder))
        by_rank[rank] = entry.name
    # ranks must be 0..n-1 for n files; comparing against the count keeps a forged rank number cheap
    missing = [r for r in range(len(by_rank)) if r not in by_rank] if by_rank else [0]
    if not missing and max(by_rank) >= len(by_rank):
        missing = [len(by_rank)]
    if missing:
        raise MissingFileError(f"the optimizer states of data-parallel ranks {missing} are missing "
                               f"(found {len(by_rank)} *_optim_states.pt files)", file=str(folder))
    return [by_rank[r] for r in range(len(by_rank))]


# ---------------------------------------------------------------- the files' contents

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


def read_model_states(files: LocalFiles, name: str) -> ModelStates:
    """Parse and check one `*_model_states.pt` file."""
    path = str(files.resolve(name))
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
        if (not isinstance(name, str) or not isinstance(shape, (tuple, list))
                or not all(type(n) is int and 0 <= n < 2**62 for n in shape)):
            raise HeaderError(f"shape {shape!r} is not a tuple of sizes", file=path, tensor=str(name))
        shapes[name] = tuple(shape)
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


def read_rank_states(files: LocalFiles, name: str, rank: int) -> RankStates:
    """Parse and check one `*_optim_states.pt` file."""
    path = str(files.resolve(name))
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
    if isinstance(base, list):
        states, groups = base, []
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


# ---------------------------------------------------------------- the layout of each parameter

@dataclass(frozen=True)
class Piece:
    """A parameter's flat elements [begin, begin + count), held by `rank` from element `start` of its flat
    tensor number `slot`."""

    rank: int
    slot: int
    start: int
    begin: int
    count: int


Layout = dict[str, list[Piece]]


def zero12_layout(model: ModelStates, ranks: list[RankStates], files: LocalFiles) -> Layout:
    """Stages 1-2: each group's partitions, concatenated over ranks, hold its parameters in order."""
    world = len(ranks)
    layout: Layout = {}
    for rank in ranks:
        if len(rank.flats) != len(model.param_shapes):
            raise HeaderError(f"holds {len(rank.flats)} flat partitions but param_shapes lists "
                              f"{len(model.param_shapes)} groups", file=_path(files, rank.file))
    paddings = ranks[0].settings.get("param_alignment_paddings")
    for group, shapes in enumerate(model.param_shapes):
        sizes = [r.flats[group].shape[0] for r in ranks]
        _check_partition_sizes(group, sizes, ranks, files)
        starts = [sum(sizes[:r]) for r in range(world)]
        extra = paddings[group] if isinstance(paddings, list) and group < len(paddings) else None
        if extra is not None and (not isinstance(extra, list) or len(extra) != len(shapes)
                                  or not all(type(n) is int and n >= 0 for n in extra)):
            raise HeaderError(f"param_alignment_paddings of group {group} should list {len(shapes)} paddings, "
                              f"found {str(extra)[:80]}", file=_path(files, ranks[0].file))
        offset = 0
        for index, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            pieces = []
            for r in range(world):
                low, high = max(offset, starts[r]), min(offset + numel, starts[r] + sizes[r])
                if low < high:
                    pieces.append(Piece(r, group, low - starts[r], low - offset, high - low))
            if sum(p.count for p in pieces) != numel:
                raise HeaderError(f"needs flat elements [{offset}, {offset + numel}) of group {group}, but the "
                                  f"partitions of all ranks hold {sum(sizes)}", file=_path(files, ranks[-1].file),
                                  tensor=name)
            layout[name] = pieces
            offset += numel + (extra[index] if extra is not None else 0)
        # DeepSpeed pads each group to a multiple of 2 × ranks: what is left over must be that padding
        align = 2 * world
        if -(-offset // align) != -(-sum(sizes) // align):
            raise HeaderError(f"param_shapes account for {offset} elements of group {group}, but the partitions "
                              f"hold {sum(sizes)}", file=_path(files, ranks[0].file))
    return layout


def _check_partition_sizes(group: int, sizes: list[int], ranks: list[RankStates], files: LocalFiles) -> None:
    """Every rank's partition of a group is the same size once its padding (group_paddings) is counted back in;
    without that record, only the last partition, which holds the padding, may be shorter."""
    pads = [r.settings.get("group_paddings") for r in ranks]
    recorded = all(isinstance(p, list) and group < len(p) and type(p[group]) is int for p in pads)
    padded = [size + (pad[group] if recorded else 0) for size, pad in zip(sizes, pads)]
    for r in range(1, len(ranks)):
        shorter_last = not recorded and r == len(ranks) - 1 and padded[r] < padded[0]
        if padded[r] != padded[0] and not shorter_last:
            raise HeaderError(f"rank {r}'s partition of group {group} holds {sizes[r]} elements "
                              f"({padded[r]} with padding), rank 0's {sizes[0]} ({padded[0]}): partitions of one "
                              "group must be the same size", file=_path(files, ranks[r].file))


def zero3_layout(model: ModelStates, ranks: list[RankStates], files: LocalFiles) -> Layout:
    """Stage 3: every parameter split on its own, ceil(n / ranks) elements per rank, padding at the end."""
    world = len(ranks)
    sizes = [f.shape[0] for f in ranks[0].flats]
    for rank in ranks[1:]:
        theirs = [f.shape[0] for f in rank.flats]
        if theirs != sizes:
            raise HeaderError(f"rank {rank.rank}'s flat fp32 groups hold {theirs} elements, rank 0's {sizes}: "
                              "every rank holds an equal share", file=_path(files, rank.file))
    slot_starts = [sum(sizes[:s]) for s in range(len(sizes) + 1)]
    layout: Layout = {}
    offset = 0
    for shapes in model.param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            share = -(-numel // world)
            if offset + share > slot_starts[-1]:
                raise HeaderError(f"needs elements [{offset}, {offset + share}) of every rank's flat groups, which "
                                  f"hold {slot_starts[-1]}", file=_path(files, ranks[0].file), tensor=name)
            pieces = []
            for r in range(world):
                begin, end = r * share, min(numel, (r + 1) * share)
                pieces.extend(_split_slots(r, offset, begin, end - begin, slot_starts))
            layout[name] = pieces
            offset += share
    if offset != slot_starts[-1]:
        raise HeaderError(f"param_shapes account for {offset} elements per rank, but the flat groups hold "
                          f"{slot_starts[-1]}", file=_path(files, ranks[0].file))
    return layout


def _split_slots(rank: int, at: int, begin: int, count: int, slot_starts: list[int]) -> Iterator[Piece]:
    """Pieces for `count` elements from position `at` of one rank's concatenated flat tensors."""
    for slot in range(len(slot_starts) - 1):
        low, high = max(at, slot_starts[slot]), min(at + count, slot_starts[slot + 1])
        if low < high:
            yield Piece(rank, slot, low - slot_starts[slot], begin + low - at, high - low)


def flat_boxes(shape: tuple[int, ...], begin: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(offsets, shape, first flat index) of boxes that tile the C-order flat range [begin, end) of `shape`.

    Each box is itself contiguous in C order, so it is one run of a flat storage."""
    if begin >= end:
        return []
    if not shape:
        return [((), (), 0)]
    row = math.prod(shape[1:])
    first, skip = divmod(begin, row)
    last, tail = divmod(end, row)
    rest = len(shape) - 1

    def within(index: int, low: int, high: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        return [((index, *o), (1, *s), index * row + f) for o, s, f in flat_boxes(shape[1:], low, high)]

    if first == last:
        return within(first, skip, tail)
    boxes = []
    if skip:
        boxes.extend(within(first, skip, row))
        first += 1
    if last > first:
        boxes.append(((first,) + (0,) * rest, (last - first, *shape[1:]), first * row))
    if tail:
        boxes.extend(within(last, 0, tail))
    return boxes


def flat_chunks(files: LocalFiles, name: str, shape: tuple[int, ...], pieces: list[Piece],
                source: Callable[[Piece], tuple[str, torchzip.TensorRef]]) -> tuple[str, list[Chunk]]:
    """(dtype, chunks) of a tensor whose flat elements are the given pieces of 1-D tensors."""
    dtype: str | None = None
    chunks = []
    for piece in pieces:
        file, ref = source(piece)
        if len(ref.shape) != 1 or not ref.is_contiguous:
            raise HeaderError(f"rank {piece.rank}'s flat tensor {piece.slot} has shape {ref.shape} and stride "
                              f"{ref.stride}; expected a contiguous 1-D tensor", file=_path(files, file), tensor=name)
        if dtype is None:
            dtype = ref.dtype
        elif ref.dtype != dtype:
            raise HeaderError(f"rank {piece.rank} holds it as {ref.dtype}, another rank as {dtype}",
                              file=_path(files, file), tensor=name)
        if piece.start + piece.count > ref.shape[0]:
            raise HeaderError(f"needs elements [{piece.start}, {piece.start + piece.count}) of rank {piece.rank}'s "
                              f"flat tensor {piece.slot}, which holds {ref.shape[0]}", file=_path(files, file),
                              tensor=name)
        itemsize = dtypes.itemsize(ref.dtype)
        numpy_dtype = np.dtype(dtypes.numpy_dtype(ref.dtype))
        for offsets, box, flat in flat_boxes(shape, piece.begin, piece.begin + piece.count):
            at = ref.offset + (piece.start + flat - piece.begin) * itemsize
            chunks.append(Chunk(offsets, box, file, (at, at + math.prod(box) * itemsize),
                                MappedArray(files, file, at, numpy_dtype, box), ranks=(piece.rank,)))
    return dtype or "F32", validate_tiling(name, shape, chunks)


def _path(files: LocalFiles, name: str) -> str:
    return str(files.resolve(name))


# ---------------------------------------------------------------- the checkpoint

def open(path: Path) -> Checkpoint:
    folder = tag_folder(path)
    files = LocalFiles(folder)
    names = _optim_files(folder)
    model_name = _model_file(folder)
    model = read_model_states(files, model_name)
    partitioned = model_name.startswith("zero_pp_rank_")  # stage 3 saves the module once per rank
    ranks = [_read_rank(files, name, r, model, partitioned, len(names)) for r, name in enumerate(names)]
    stage = ranks[0].stage
    for rank in ranks:
        if rank.partition_count != len(ranks):
            # fewer files: some rank's save is missing; more: files left over from a save with more ranks
            error = MissingFileError if rank.partition_count > len(ranks) else HeaderError
            raise error(f"says the states are partitioned over {rank.partition_count} data-parallel ranks, but "
                        f"{len(ranks)} optimizer-state files are present", file=_path(files, rank.file))
        if rank.stage != stage:
            raise HeaderError(f"says ZeRO stage {rank.stage}, rank 0's file stage {stage}",
                              file=_path(files, rank.file))
    if (stage == 3) != partitioned:
        raise HeaderError(f"the optimizer states are ZeRO stage {stage}, but the model states are saved as for "
                          f"stage {'3' if partitioned else '1-2'}", file=_path(files, model_name))
    model_names = [model_name]
    if stage == 3:
        model_names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(len(ranks))]
        for name in model_names:
            if not files.exists(name):
                raise MissingFileError("is missing; ZeRO-3 saves every rank's model states", file=_path(files, name))
    layout = zero3_layout(model, ranks, files) if stage == 3 else zero12_layout(model, ranks, files)
    _check_mappings(layout, ranks, files)

    tensors: dict[str, LogicalTensor] = {}
    placement = Placement((len(ranks),), (f"ZeRO-{stage} flat partition",), ("dp",))
    for name, pieces in layout.items():
        shape = _shape_of(model, name)
        dtype, chunks = flat_chunks(files, name, shape, pieces,
                                    lambda p: (ranks[p.rank].file, ranks[p.rank].flats[p.slot]))
        tensors[name] = LogicalTensor(name, dtype, shape, tuple(chunks), placement)
    tensors.update(_optimizer_state(files, layout, model, ranks, placement))
    frozen = _frozen(files, model, model_names, placement, stage)
    tensors.update(frozen)
    for name, tensor in module_tensors(files, model).items():
        tensors.setdefault(name, tensor)
    aliases = add_aliases(tensors, model.shared)
    tensors = in_model_order(tensors, model)

    objects = {**model_objects(files, model),
               **optimizer_objects(files, ranks[0].file, ranks[0].settings, ranks[0].param_groups)}
    metadata = {
        "zero_stage": stage, "dp_world_size": len(ranks), "tag": folder.name,
        "ds_version": model.entries.get("ds_version"), "aliases": aliases, "frozen": sorted(frozen),
        "partition_sizes": [[flat.shape[0] for flat in rank.flats] for rank in ranks],
    }
    return Checkpoint(path=folder, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(dict.fromkeys([*model_names, *names])), storage=files)


def _model_file(folder: Path) -> str:
    """Rank 0's model-states file (stage 3 names it per rank)."""
    found = sorted(e.name for e in folder.iterdir() if MODEL_FILE.match(e.name))
    for name in found:
        if int(MODEL_FILE.match(name).group(2)) != 0:
            raise UnsupportedError("holds a model-parallel (tensor/pipeline) partition; convert the checkpoint with "
                                   "DeepSpeed's ds_to_universal first, whose output this library reads",
                                   file=str(folder / name))
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt"):
        if name in found:
            return name
    raise MissingFileError("holds no rank-0 model states (mp_rank_00_model_states.pt, or for ZeRO-3 "
                           "zero_pp_rank_0_mp_rank_00_model_states.pt)", file=str(folder))


def _read_rank(files: LocalFiles, name: str, rank: int, model: ModelStates, partitioned: bool,
               world: int) -> RankStates:
    try:
        return read_rank_states(files, name, rank)
    except CheckpointError as exc:
        if exc.tensor is not None:
            raise
        held = _expected_on(model, rank, world, partitioned)
        listed = ", ".join(held[:8]) + (" ..." if len(held) > 8 else "")
        raise type(exc)(f"{exc.reason}; this file holds data-parallel rank {rank}'s share of the fp32 master "
                        f"weights and optimizer state of {len(held)} parameters: {listed}",
                        file=exc.file or _path(files, name), tensor=held[0] if held else None) from None


def _expected_on(model: ModelStates, rank: int, world: int, partitioned: bool) -> list[str]:
    """The parameters a rank's partition should hold part of, from param_shapes alone (for error messages)."""
    held = []
    for shapes in model.param_shapes:
        total = sum(math.prod(s) for s in shapes.values())
        share = -(-total // (2 * world)) * 2  # DeepSpeed's group padding, split evenly
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            if partitioned:
                if rank * -(-numel // world) < numel:
                    held.append(name)
            elif offset < (rank + 1) * share and rank * share < offset + numel:
                held.append(name)
            offset += numel
    return held


def _check_mappings(layout: Layout, ranks: list[RankStates], files: LocalFiles) -> None:
    """DeepSpeed also records each rank's share of each parameter (param_slice_mappings): it must agree."""
    for rank in ranks:
        groups = rank.slice_mappings
        if groups is None:
            continue
        if not isinstance(groups, list):
            raise HeaderError("param_slice_mappings should be a list per group", file=_path(files, rank.file))
        recorded = {}
        for group, mapping in enumerate(groups):
            if not isinstance(mapping, dict):
                raise HeaderError(f"param_slice_mappings[{group}] should map names to fragments",
                                  file=_path(files, rank.file))
            for name, fragment in mapping.items():
                if not isinstance(fragment, dict):
                    raise HeaderError("a param_slice_mappings entry is not a fragment address",
                                      file=_path(files, rank.file), tensor=str(name))
                recorded[name] = (group, fragment.get("start"), fragment.get("numel"))
        computed = {name: (p.slot, p.start, p.count) for name, pieces in layout.items() for p in pieces
                    if p.rank == rank.rank}
        for name in sorted(set(recorded) | set(computed)):
            if recorded.get(name) != computed.get(name):
                raise HeaderError(f"rank {rank.rank}'s param_slice_mappings place it at (group, start, numel) = "
                                  f"{recorded.get(name)}, the partition sizes and param_shapes at "
                                  f"{computed.get(name)}", file=_path(files, rank.file), tensor=name)


def _shape_of(model: ModelStates, name: str) -> tuple[int, ...]:
    for shapes in model.param_shapes:
        if name in shapes:
            return shapes[name]
    return model.frozen_shapes[name]


def _optimizer_state(files: LocalFiles, layout: Layout, model: ModelStates, ranks: list[RankStates],
                     placement: Placement) -> dict[str, LogicalTensor]:
    """optimizer.state.<param>.<key>: flat state laid out like the masters, scalars from the first piece."""
    tensors: dict[str, LogicalTensor] = {}
    for name, pieces in layout.items():
        if not pieces:
            continue
        shape = _shape_of(model, name)
        first = pieces[0]
        for key in ranks[first.rank].state[first.slot]:
            full = f"{STATE_PREFIX}{name}.{key}"
            ref = ranks[first.rank].state[first.slot][key]
            if not ref.shape:
                file = ranks[first.rank].file
                tensors[full] = LogicalTensor(full, ref.dtype, (), (tensor_chunk(files, file, ref,
                                                                                 ranks=(first.rank,)),))
                continue

            def source(p: Piece, key: str = key, full: str = full) -> tuple[str, torchzip.TensorRef]:
                held = ranks[p.rank].state[p.slot].get(key)
                if held is None or not held.shape:
                    raise HeaderError(f"rank {p.rank} has no flat {key!r} state for flat tensor {p.slot}",
                                      file=_path(files, ranks[p.rank].file), tensor=full)
                return ranks[p.rank].file, held

            dtype, chunks = flat_chunks(files, full, shape, pieces, source)
            tensors[full] = LogicalTensor(full, dtype, shape, tuple(chunks), placement)
    return tensors


def _frozen(files: LocalFiles, model: ModelStates, model_names: list[str], placement: Placement,
            stage: int) -> dict[str, LogicalTensor]:
    """Frozen parameters: whole fragments (stages 1-2), or one flat fragment per rank (stage 3)."""
    tensors = {}
    if stage == 3 and model.frozen_shapes:
        per_rank = [model] + [read_model_states(files, n) for n in model_names[1:]]
        for name, shape in model.frozen_shapes.items():
            numel, pieces, begin = math.prod(shape), [], 0
            for rank, states in enumerate(per_rank):
                fragment = states.frozen_fragments.get(name)
                if fragment is None or len(fragment.shape) != 1:
                    raise HeaderError("is frozen, but this rank holds no flat fragment of it",
                                      file=_path(files, states.file), tensor=name)
                count = min(fragment.shape[0], numel - begin)
                if count > 0:
                    pieces.append(Piece(rank, 0, 0, begin, count))
                    begin += count
            if begin != numel:
                raise HeaderError(f"the ranks' fragments hold {begin} of its {numel} elements",
                                  file=_path(files, per_rank[-1].file), tensor=name)
            dtype, chunks = flat_chunks(files, name, shape, pieces, lambda p, n=name: (
                per_rank[p.rank].file, per_rank[p.rank].frozen_fragments[n]))
            tensors[name] = LogicalTensor(name, dtype, shape, tuple(chunks), placement)
        return tensors
    for name, shape in model.frozen_shapes.items():
        fragment = model.frozen_fragments.get(name)
        if fragment is None or math.prod(fragment.shape) != math.prod(shape):
            raise HeaderError(f"is frozen with shape {shape}, but its fragment is "
                              f"{None if fragment is None else fragment.shape}", file=_path(files, model.file),
                              tensor=name)
        tensors[name] = reshaped(LogicalTensor(name, fragment.dtype, fragment.shape,
                                               (tensor_chunk(files, model.file, fragment),)), shape)
    if stage <= 1:
        # ZeRO-1 does not record frozen parameters: whatever the module holds beyond the trainable
        # parameters, buffers and tied names is one, and the module's own copy is its value
        trainable = {n for shapes in model.param_shapes for n in shapes}
        for name, ref in model.module.items():
            if name not in trainable and name not in model.buffers and name not in model.shared:
                tensors[name] = LogicalTensor(name, ref.dtype, ref.shape, (tensor_chunk(files, model.file, ref),))
    return tensors


def reshaped(tensor: LogicalTensor, shape: tuple[int, ...]) -> LogicalTensor:
    """A one-chunk tensor saved flattened, as `shape`: the same elements in the same order."""
    if tensor.shape == shape:
        return tensor
    (chunk,) = tensor.chunks
    source = chunk.source
    if not isinstance(source, MappedArray) or source.strides is not None or math.prod(shape) != tensor.numel:
        raise HeaderError(f"holds shape {tensor.shape}, which cannot be viewed as the parameter's shape {shape}",
                          file=chunk.file, tensor=tensor.name)
    view = MappedArray(source.files, source.file, source.offset, source.dtype, shape)
    return LogicalTensor(tensor.name, tensor.dtype, shape, (Chunk((0,) * len(shape), shape, chunk.file,
                                                                   chunk.byte_range, view, chunk.ranks),))


def module_tensors(files: LocalFiles, model: ModelStates) -> dict[str, LogicalTensor]:
    """Buffers under their own names; the module's weights as module.<name> (stage-3 placeholders left out)."""
    tensors = {}
    expected = {n: s for shapes in model.param_shapes for n, s in shapes.items()} | model.frozen_shapes
    for name, ref in model.module.items():
        if name in model.shared:
            continue  # an alias of its source, added with the others
        if name in model.buffers:
            tensors[name] = LogicalTensor(name, ref.dtype, ref.shape, (tensor_chunk(files, model.file, ref),))
            continue
        if name in expected and ref.shape != expected[name]:
            continue  # ZeRO-3 keeps only an empty placeholder in the module
        full = MODULE_PREFIX + name
        tensors[full] = LogicalTensor(full, ref.dtype, ref.shape, (tensor_chunk(files, model.file, ref),))
    return tensors


def add_aliases(tensors: dict[str, LogicalTensor], shared: dict[str, str]) -> dict[str, str]:
    """Add each tied name (and its module.<name>) as an alias of its source; alias -> source."""
    aliases = {}
    for alias, source in shared.items():
        for prefix in ("", MODULE_PREFIX):
            if prefix + source in tensors and prefix + alias not in tensors:
                original = tensors[prefix + source]
                tensors[prefix + alias] = LogicalTensor(prefix + alias, original.dtype, original.shape,
                                                        original.chunks, original.placement)
                aliases[prefix + alias] = prefix + source
    return aliases


def in_model_order(tensors: dict[str, LogicalTensor], model: ModelStates) -> dict[str, LogicalTensor]:
    """The model's own tensors in the module's order, then module.<name>, then the optimizer state."""
    rank = {name: i for i, name in enumerate(model.module)}

    def key(name: str) -> tuple[int, int]:
        kind = 2 if name.startswith(OPTIMIZER_PREFIX) else 1 if name.startswith(MODULE_PREFIX) else 0
        return kind, rank.get(name, len(rank))

    return {name: tensors[name] for name in sorted(tensors, key=key)}  # stable: ties keep their order


def model_objects(files: LocalFiles, model: ModelStates) -> dict[str, ObjectEntry]:
    """The model-states file's remaining entries (global_steps, ds_config, lr_scheduler...)."""
    return {key: _object(key, value, model.file, _path(files, model.file)) for key, value in model.entries.items()}


def optimizer_objects(files: LocalFiles, file: str, settings: dict[str, Any],
                      param_groups: list[Any]) -> dict[str, ObjectEntry]:
    """optimizer.<key>: the optimizer's settings (rank 0's), and its param_groups without the parameter ids."""
    path = _path(files, file)
    objects = {OPTIMIZER_PREFIX + k: _object(OPTIMIZER_PREFIX + k, v, file, path) for k, v in settings.items()}
    if param_groups:
        groups = [{k: v for k, v in g.items() if k != "params"} if isinstance(g, dict) else g for g in param_groups]
        objects[OPTIMIZER_PREFIX + "param_groups"] = _object(OPTIMIZER_PREFIX + "param_groups", groups, file, path)
    return objects


def _object(name: str, value: Any, file: str, path: str) -> ObjectEntry:
    def loader() -> Any:
        plain = _plainly(value)
        if not safe_pickle.is_plain(plain):
            raise UnsafePickleError(f"holds a {type(value).__name__}, which is not plain data", file=path, tensor=name)
        return plain

    return ObjectEntry(name, None, file, loader=loader)


def _plainly(value: Any) -> Any:
    """Record stand-ins as plain dicts, so objects compare and print as data."""
    if isinstance(value, dict):
        return {k: _plainly(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plainly(v) for v in value)
    return value


def checksum_problems(checkpoint: Checkpoint) -> Iterator[tuple[str, CheckpointError | None]]:
    """Check the CRC-32 of every record of every file of the checkpoint."""
    assert checkpoint.storage is not None
    for file in checkpoint.files:
        path = _path(checkpoint.storage, file)
        try:
            torchzip.check_crc(checkpoint.storage.buffer(file), file=path)
        except CheckpointError as exc:
            yield file, exc
        else:
            yield file, None
