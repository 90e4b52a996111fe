"""The model-parallel ranks' parts made one logical checkpoint.

With `universal_checkpoint_info` in the model states, each parameter, its module copy (`module.<param>`) and its
optimizer state become one tensor, split as `splits` says: each chunk of a rank's shard is placed (cut where a
block edge crosses it) in the logical tensor, keeping its global rank. Tensors the info does not describe
(buffers, step counters) must have one shape on every rank and are read from model-parallel rank 0; verify
compares the other ranks' copies (`replica_problems`). Parameters the info describes but this reader does not
rebuild, and every tensor of a checkpoint without the info, are listed per rank as `mp_rank_XX.<name>`: a plain
run records nothing about how its shards join, and guessing (say, dim 0) would be a silent wrong merge.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ...core import Chunk, LogicalTensor, MappedArray, Placement
from ...errors import CheckpointError, HeaderError
from ...geometry import intersect
from ...reduction import Reduction
from ...storage import ByteStore
from ...tiling import validate_tiling
from .names import MODULE_PREFIX, STATE_PREFIX
from .part import Part
from .splits import INFO_KEY, Block, Rules, Split, Unmerged, replicated
from .tensors import add_aliases, in_model_order

UNRECORDED = ("unrecorded: the model states hold no universal_checkpoint_info, so how the model-parallel ranks' "
              "tensors join is unknown; each rank's tensors are listed as mp_rank_XX.<name>")
RANK_ORDER = "global rank = dp_rank * mp_world_size + mp_rank"
COMPARE_BYTES = 64 << 20  # replicas are compared in blocks of at most this many bytes


def prefixed(mp: int, name: str) -> str:
    """The name of model-parallel rank `mp`'s own copy or shard of a tensor that is not merged."""
    return f"mp_rank_{mp:02d}.{name}"


@dataclass(frozen=True)
class Merged:
    """The joined checkpoint's tensors, its tied aliases (alias -> source) and its model-parallel metadata."""

    tensors: dict[str, LogicalTensor]  # in the model's order, tied aliases included
    aliases: dict[str, str]
    metadata: dict[str, Any]


def merge(files: ByteStore, parts: list[Part]) -> Merged:
    """One logical checkpoint from every model-parallel rank's part."""
    first = parts[0]
    _check_same_names(files, parts)
    info = first.model.entries.get(INFO_KEY)
    metadata: dict[str, Any] = {"mp_world_size": len(parts), "rank_order": RANK_ORDER}
    if info is None:
        tensors: dict[str, LogicalTensor] = {}
        aliases: dict[str, str] = {}
        for part in parts:
            own = dict(part.tensors)
            own_aliases = add_aliases(own, part.model.shared)
            tensors.update(_renamed(in_model_order(own, part.model), part.mp))
            aliases.update({prefixed(part.mp, a): prefixed(part.mp, s) for a, s in own_aliases.items()})
        return Merged(tensors, aliases, {**metadata, "tp_layout": UNRECORDED})

    rules = Rules(info, files.describe(first.model.file))
    paths = [files.describe(part.model.file) for part in parts]
    params = {n for shapes in first.model.param_shapes for n in shapes} | set(first.model.frozen_shapes) | set(
        first.frozen)
    tensors, copies, unmerged = {}, [], {}
    for name, tensor in first.tensors.items():
        held = [part.tensors[name] for part in parts]
        _check_dtypes(held, name, paths)
        param = _parameter_of(name, params)
        split = rules.split(param, [t.shape for t in held], paths) if param is not None and tensor.shape else None
        if isinstance(split, Unmerged):
            unmerged[param] = split.reason
            tensors.update({prefixed(m, name): replace(t, name=prefixed(m, name)) for m, t in enumerate(held)})
            continue
        if split is None or split.placement.startswith("Replicate()"):
            copies.append(name)
        if split is None:
            _check_same_shape(held, name, paths)
            split = replicated(tensor.shape, len(parts))
        tensors[name] = _merged(name, split, held, len(parts))
    aliases = add_aliases(tensors, first.model.shared)
    for mp in range(len(parts)):
        shared = {prefixed(mp, prefix + a): prefixed(mp, prefix + s) for a, s in first.model.shared.items()
                  for prefix in ("", MODULE_PREFIX)}
        aliases.update(add_aliases(tensors, shared))
    return Merged(in_model_order(tensors, first.model), aliases,
                  {**metadata, "tp_layout": INFO_KEY, "tp_replicated": copies, "tp_unmerged": unmerged})


def _parameter_of(name: str, params: set[str]) -> str | None:
    """The parameter whose split a tensor follows: itself, module.<param>, optimizer.state.<param>.<key>."""
    if name in params:
        return name
    if name.startswith(MODULE_PREFIX) and name[len(MODULE_PREFIX):] in params:
        return name[len(MODULE_PREFIX):]
    if name.startswith(STATE_PREFIX):
        param = name[len(STATE_PREFIX):].rpartition(".")[0]
        return param if param in params else None
    return None


def _renamed(tensors: dict[str, LogicalTensor], mp: int) -> dict[str, LogicalTensor]:
    return {prefixed(mp, n): replace(t, name=prefixed(mp, n)) for n, t in tensors.items()}


def _check_same_names(files: ByteStore, parts: list[Part]) -> None:
    first = parts[0]
    for part in parts[1:]:
        for name in (set(first.tensors) ^ set(part.tensors)):
            where = "rank 0 holds it, this rank does not" if name in first.tensors else "rank 0 does not hold it"
            raise HeaderError(f"model-parallel rank {part.mp}'s files and rank 0's list different tensors: {where}",
                              file=files.describe(part.model.file), tensor=name)


def _check_dtypes(held: list[LogicalTensor], name: str, paths: list[str]) -> None:
    for mp, tensor in enumerate(held[1:], 1):
        if tensor.dtype != held[0].dtype:
            raise HeaderError(f"model-parallel rank {mp} holds it as {tensor.dtype}, rank 0 as {held[0].dtype}",
                              file=paths[mp], tensor=name)


def _check_same_shape(held: list[LogicalTensor], name: str, paths: list[str]) -> None:
    for mp, tensor in enumerate(held[1:], 1):
        if tensor.shape != held[0].shape:
            raise HeaderError(f"model-parallel rank {mp} holds it with shape {tensor.shape}, rank 0 with "
                              f"{held[0].shape}; a tensor the split info does not describe must be the same on "
                              "every rank", file=paths[mp], tensor=name)


def _merged(name: str, split: Split, held: list[LogicalTensor], mp_ranks: int) -> LogicalTensor:
    """The logical tensor: each rank's chunks placed by its blocks."""
    partial = split.placement.startswith("Partial(avg)")  # each rank's copy is a contribution (maybe cut)
    chunks: list[list[Chunk]] = [[] for _ in held] if partial else [[]]
    for mp, (tensor, blocks) in enumerate(zip(held, split.blocks)):
        for block in blocks:
            for chunk in tensor.chunks:
                hit = intersect((chunk.offsets, chunk.shape), (block.shard, block.shape))
                if hit is not None:
                    placed = _placed(chunk, hit, block, name)
                    chunks[mp if partial else 0].append(replace(placed, contribution=mp) if partial else placed)
    inner = held[0].placement
    if inner is None:  # the module's own weights: written whole by each model-parallel rank
        placement = Placement((mp_ranks,), (split.placement,), ("mp",))
    else:
        placement = Placement((mp_ranks, *inner.mesh_shape), (split.placement, *inner.placements),
                              ("mp", *(inner.mesh_dim_names or ())))
    tiled = tuple(c for group in chunks for c in validate_tiling(name, split.shape, group))
    return LogicalTensor(name, held[0].dtype, split.shape, tiled, placement,
                         reduction=Reduction("avg", mp_ranks, (0,)) if partial else None)


def _placed(chunk: Chunk, hit: tuple[tuple[int, ...], tuple[int, ...]], block: Block, name: str) -> Chunk:
    """The part `hit` (shard coordinates) of a chunk, at its place in the logical tensor."""
    full = tuple(f + h - s for f, h, s in zip(block.full, hit[0], block.shard))
    if hit == (chunk.offsets, chunk.shape):
        return replace(chunk, offsets=full)
    source = chunk.source
    if not isinstance(source, MappedArray):
        raise HeaderError("a chunk that is not a plain stored array cannot be cut at a tensor-parallel block edge",
                          file=chunk.file, tensor=name)
    strides = source.strides or tuple(math.prod(source.shape[d + 1:]) for d in range(len(source.shape)))
    itemsize = source.dtype.itemsize
    start = source.offset + sum((h - o) * s for h, o, s in zip(hit[0], chunk.offsets, strides)) * itemsize
    end = start + (sum((n - 1) * s for n, s in zip(hit[1], strides)) + 1) * itemsize
    contiguous = all(n == 1 or s == math.prod(hit[1][d + 1:]) for d, (n, s) in enumerate(zip(hit[1], strides)))
    view = MappedArray(source.files, source.file, start, source.dtype, hit[1], None if contiguous else strides)
    return Chunk(full, hit[1], chunk.file, (start, end), view, chunk.ranks)


def replica_problems(parts: list[Part], names: list[str]) -> Iterator[tuple[str, CheckpointError | None]]:
    """Each replicated tensor's copy on every model-parallel rank but 0, compared with rank 0's, in blocks of
    rows: (what was compared, the difference found or None)."""
    for name in names:
        reference = parts[0].tensors[name]
        for part in parts[1:]:
            copy = part.tensors[name]
            yield f"{name} on model-parallel rank {part.mp}", _difference(reference, copy, part, name)


def _difference(reference: LogicalTensor, copy: LogicalTensor, part: Part, name: str) -> CheckpointError | None:
    file = copy.files[0] if copy.files else None
    if copy.shape != reference.shape or copy.dtype != reference.dtype:
        return HeaderError(f"model-parallel rank {part.mp} holds {copy.dtype} {copy.shape}, rank 0 "
                           f"{reference.dtype} {reference.shape}", file=file, tensor=name)
    if not reference.shape:
        same = reference.read().tobytes() == copy.read().tobytes()
        return None if same else CheckpointError(f"rank {part.mp}'s copy differs from rank 0's", file=file,
                                                 tensor=name)
    row = max(1, reference.nbytes // max(1, reference.shape[0]))
    rows = max(1, COMPARE_BYTES // row)
    for begin in range(0, reference.shape[0], rows):
        index = np.s_[begin:begin + rows]
        if reference.read(index, budget=rows * row).tobytes() != copy.read(index, budget=rows * row).tobytes():
            return CheckpointError(f"is replicated over the model-parallel ranks, but rank {part.mp}'s copy differs "
                                   f"from rank 0's (in rows {begin}-{min(begin + rows, reference.shape[0]) - 1})",
                                   file=file, tensor=name)
    return None
