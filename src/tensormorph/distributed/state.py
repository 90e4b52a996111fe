"""A state dict seen as named leaves: tensors (with the box each rank holds) and plain values.

Shared by save and load: both flatten the same way, so every name a save writes is the name a load
looks for, whatever the mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .. import dtypes
from ..errors import CheckpointError, UnsupportedError
from ..geometry import Box
from ..reduction import check_reducible
from ..tmformat.layout import contribution_of, local_pieces, reduce_op
from ..torch_arrays import vocabulary

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass
class Leaves:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # object name -> (container, key)


def holds_tensor(value: Any, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > 64:
        return False
    if isinstance(value, dict):
        return any(holds_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_tensor(v, depth + 1) for v in value)
    return False


def flatten(state: Any) -> Leaves:
    """Tensors by dotted path; containers without tensors are kept whole as plain values."""
    if not isinstance(state, dict):
        raise TypeError(f"a state dict must be a dict, got {type(state).__name__}")
    leaves = Leaves()

    def visit(container: Any, key: Any, value: Any, name: str) -> None:
        if isinstance(value, torch.Tensor):
            leaves.tensors[name] = value
        elif isinstance(value, dict) and holds_tensor(value):
            for k, v in value.items():
                visit(value, k, v, f"{name}.{k}")
        elif isinstance(value, (list, tuple)) and holds_tensor(value):
            for i, v in enumerate(value):
                visit(value, i, v, f"{name}.{i}")
        else:
            leaves.objects[name] = value
            leaves.slots[name] = (container, key)
        if name in leaves.tensors and name in leaves.objects:
            raise ValueError(f"two entries of the state dict flatten to the same name {name!r}")

    for key, value in state.items():
        visit(state, key, value, str(key))
    return leaves


def dtensor_types() -> tuple[type[DTensor], ...]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return ()
    return (DTensor,)


@dataclass(frozen=True)
class Held:
    """One box of a tensor that this rank holds: where it lies in the global tensor, and its data (a view of
    the local tensor)."""

    box: Box
    data: torch.Tensor
    contribution: int = 0  # under Partial placements: which contribution this rank holds


@dataclass(frozen=True)
class Layout:
    """How a tensor is spread over its mesh (nothing for a plain tensor), and the reduce op under Partial."""

    mesh: tuple[int, ...] | None = None
    mesh_ranks: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None
    placements: tuple[str, ...] | None = None
    reduce_op: str | None = None
    contributions: int = 1


def placement_text(placement: Any) -> str:
    """A torch placement in the manifest's spelling; UnsupportedError for a kind the format cannot hold."""
    from torch.distributed.tensor import Partial, Replicate, Shard  # importable whenever DTensor is

    kind = type(placement).__name__
    if kind == "_StridedShard":
        return f"_StridedShard({placement.dim}, split_factor={int(placement.split_factor)})"
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "Replicate()"
    if isinstance(placement, Partial) and kind == "Partial":  # MaskPartial's local values need its mask first
        return f"Partial({placement.reduce_op})"
    raise UnsupportedError(f"placement {placement} ({kind}) has no stored form; redistribute it to Shard, "
                           "Replicate or Partial first")


@dataclass(frozen=True)
class _Placed:
    """What a DTensor's mesh, placements, global shape and dtype decide, whatever its data: the same for every tensor of
    a state that shares them (an optimizer state of 20,000 small DTensors has a handful of such kinds)."""

    mesh: Any  # the DeviceMesh, kept alive so that the memo's key (its id) stays its own
    texts: tuple[str, ...]
    layout: Layout
    coordinate: tuple[int, ...] | None
    pieces: list[tuple[Box, tuple[int, ...]]]
    contribution: int
    torch_offsets: tuple[int, ...] | None


Memo = dict[tuple[Any, ...], _Placed]  # one save's or load's layouts, by (mesh id, placements, shape, dtype)


def held_pieces(name: str, tensor: torch.Tensor, dtensor: tuple[type[DTensor], ...],
                memo: Memo | None = None) -> tuple[list[Held], Layout]:
    """The boxes this rank holds of a tensor or DTensor (several under some _StridedShard layouts; none for a rank
    outside the DTensor's mesh), and how the tensor is laid out.

    With `memo` (a dict kept for one save or load), the layout of each distinct (mesh, placements, shape, dtype) is
    computed once: torch's mesh and chunk-list calls cost ~0.5 ms a tensor, most of a 20,000-tensor save's time.
    """
    if not (dtensor and isinstance(tensor, dtensor[0])):
        return [Held(((0,) * tensor.dim(), tuple(tensor.shape)), tensor)], Layout()
    mesh, shape = tensor.device_mesh, tuple(tensor.shape)
    key = (id(mesh), tuple(tensor.placements), shape, tensor.dtype)  # the dtype decides if a Partial op is exact
    try:
        placed = memo.get(key) if memo is not None else None
    except TypeError:  # a placement type of torch's that does not hash: computed for this tensor alone
        memo = None
        placed = None
    if placed is None:
        placed = _place(name, tensor, mesh, shape)
        if memo is not None:
            memo[key] = placed
    layout, pieces, coordinate = placed.layout, placed.pieces, placed.coordinate
    if coordinate is None:
        return [], layout
    local = tensor.to_local()
    local_shape = tuple(max(within[d] + box[1][d] for box, within in pieces) for d in range(len(shape)))
    torch_offsets = placed.torch_offsets
    if local_shape != tuple(local.shape) or torch_offsets not in (None, pieces[0][0][0]):
        texts = placed.texts
        raise UnsupportedError(
            f"placements {list(texts)} on mesh {list(mesh.shape)} put the rank at {list(coordinate)} at boxes "
            f"{[box for box, _ in pieces][:4]}, but torch holds a local tensor of shape {list(local.shape)}"
            f"{f' at offsets {list(torch_offsets)}' if torch_offsets else ''}: the placements are inconsistent with "
            "the data"
            + ("; FSDP2 over tensor parallelism stores an unevenly divided dimension in a layout its "
               "_StridedShard placement does not describe (torch's own full_tensor() is unreliable there): pad the "
               "dimension to a multiple of the mesh sizes, or redistribute before saving"
               if any("_StridedShard" in t for t in texts) else ""), tensor=name)
    if len(pieces) == 1 and pieces[0][0][1] == local_shape:  # the whole local tensor: no view to make
        return [Held(pieces[0][0], local, placed.contribution)], layout
    held = [Held(box, local[tuple(slice(w, w + n) for w, n in zip(within, box[1]))], placed.contribution)
            for box, within in pieces]
    return held, layout


def _place(name: str, tensor: DTensor, mesh: Any, shape: tuple[int, ...]) -> _Placed:
    """The layout of a DTensor's kind (see _Placed), computed from torch's mesh and placements."""
    try:
        texts = tuple(placement_text(p) for p in tensor.placements)
    except UnsupportedError as exc:
        raise UnsupportedError(exc.reason, tensor=name) from None
    coordinate = mesh.get_coordinate()
    try:
        op = reduce_op(texts, name)
        if op is not None:
            check_reducible(op, dtypes.numpy_dtype(vocabulary(tensor.dtype)), name)
        layout = Layout(tuple(mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist()),
                        tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None, texts, op,
                        contribution_of(tuple(mesh.shape), texts, (0,) * mesh.ndim)[1])
        if coordinate is None:
            return _Placed(mesh, texts, layout, None, [], 0, None)
        coordinate = tuple(coordinate)
        pieces = local_pieces(shape, tuple(mesh.shape), texts, coordinate)
        contribution = contribution_of(tuple(mesh.shape), texts, coordinate)[0]
    except CheckpointError as exc:
        raise UnsupportedError(exc.reason, tensor=name) from None
    # torch's own answer, where it gives one box (it refuses Partial): an empty box may sit anywhere
    single = len(pieces) == 1 and op is None and math.prod(pieces[0][0][1]) > 0
    return _Placed(mesh, texts, layout, coordinate, pieces, contribution, _torch_offsets(tensor) if single else None)


def _torch_offsets(tensor: DTensor) -> tuple[int, ...] | None:
    """Where torch places this rank's local tensor, when it says so as one box."""
    chunks = tensor.__create_chunk_list__()
    return tuple(chunks[0].offsets) if len(chunks) == 1 else None
