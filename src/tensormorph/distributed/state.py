"""A state dict seen as named leaves: tensors (with the box each rank holds) and plain values.

Shared by save and load: both flatten the same way, so every name a save writes is the name a load
looks for, whatever the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import UnsupportedError
from ..geometry import Box

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


def local_box(name: str, tensor: torch.Tensor,
              dtensor: tuple[type[DTensor], ...]) -> tuple[Box, torch.Tensor, dict]:
    """(the box this rank holds, its local data, mesh facts) of a tensor or DTensor."""
    if dtensor and isinstance(tensor, dtensor[0]):
        from torch.distributed.tensor import Shard  # importable whenever DTensor is (see dtensor_types)

        for p in tensor.placements:
            kind = type(p).__name__
            if kind == "_StridedShard":
                raise UnsupportedError(
                    f"has placement {p} (_StridedShard, from FSDP2 combined with tensor parallelism), whose local "
                    "shard is not one box of the tensor; redistribute it to Shard/Replicate before saving", tensor=name)
            if p.is_partial():
                raise UnsupportedError(f"has placement {p} (Partial): it awaits a reduction and holds no value of "
                                       "its own; reduce it (redistribute to Replicate or Shard) first", tensor=name)
        placements = tuple(f"Shard({p.dim})" if isinstance(p, Shard) else "Replicate()" for p in tensor.placements)
        chunk = tensor.__create_chunk_list__()
        if len(chunk) != 1:
            raise UnsupportedError(f"its local shard is {len(chunk)} boxes; only one box per rank is supported",
                                   tensor=name)
        mesh = tensor.device_mesh
        facts = {"mesh": tuple(mesh.shape), "mesh_ranks": tuple(int(r) for r in mesh.mesh.flatten().tolist()),
                 "mesh_dim_names": tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                 "placements": placements}
        return (tuple(chunk[0].offsets), tuple(chunk[0].sizes)), tensor.to_local(), facts
    return ((0,) * tensor.dim(), tuple(tensor.shape)), tensor, {}
