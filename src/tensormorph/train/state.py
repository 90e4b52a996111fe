"""What a training state is made of: the components' state dicts, the data loader's parts, nested walks.

Shared by the save side (capture, staging) and the resume side, which read and fill the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from .sampler import ResumableSampler

__all__ = ["component_states", "find_mesh", "generator_state", "loader_parts", "optimizers", "walk"]


def optimizers(optimizer: Any) -> tuple[Any, ...]:
    """What was passed as `optimizer=` (none, one, or several) as a tuple."""
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    return tuple(optimizer)


def find_mesh(state: Any) -> dict[str, Any] | None:
    """The device mesh of the first DTensor in `state`, as plain values; None without DTensors."""
    from torch.distributed.tensor import DTensor

    for value in state.values():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            return {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None}
    return None


def component_states(model: Any, optimizers: tuple[Any, ...], scheduler: Any, scaler: Any) -> dict[str, Any]:
    """The state dicts of the training components given (model and optimizer FSDP2/DTensor aware)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizers and model is None:
        raise ValueError("optimizer state is keyed by the model's parameter names: pass model= as well")
    states: dict[str, Any] = {}
    if model is not None:
        if optimizers:
            states["model"], states["optimizer"] = get_state_dict(model, optimizers)
        else:
            states["model"] = get_model_state_dict(model)
    if scheduler is not None:
        states["scheduler"] = scheduler.state_dict()
    if scaler is not None:
        states["scaler"] = scaler.state_dict()
    return states


def _has_state(obj: Any) -> bool:
    """Duck typing of a loader that keeps its own position (torchdata's StatefulDataLoader)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def loader_parts(dataloader: Any) -> tuple[str, ResumableSampler | None, Any]:
    """(kind, sampler, loader) for what was passed as `dataloader=`; kind is 'sampler' or 'stateful'."""
    if isinstance(dataloader, ResumableSampler):
        return "sampler", dataloader, None
    if isinstance(dataloader, DataLoader):
        candidates = [dataloader.sampler, getattr(dataloader.batch_sampler, "sampler", None)]
        sampler = next((s for s in candidates if isinstance(s, ResumableSampler)), None)
        stateful = _has_state(dataloader)
        if stateful and sampler is not None:
            raise TypeError(f"{type(dataloader).__name__} keeps its own position; give it its own sampler, or use "
                            "a ResumableSampler with a plain torch DataLoader")
        if stateful:
            return "stateful", None, dataloader
        if sampler is None:
            raise TypeError(f"the DataLoader's sampler is a {type(dataloader.sampler).__name__}, which cannot say "
                            "how far training got; use tensormorph.train.ResumableSampler (a drop-in for "
                            "DistributedSampler) or torchdata's StatefulDataLoader")
        return "sampler", sampler, dataloader
    if _has_state(dataloader):
        return "stateful", None, dataloader
    raise TypeError(f"dataloader= takes a DataLoader with a ResumableSampler, a ResumableSampler, or an object with "
                    f"state_dict/load_state_dict (torchdata's StatefulDataLoader); got {type(dataloader).__name__}")


def generator_state(loader: Any) -> bytes | None:
    """The state of the loader's own generator (`DataLoader(generator=...)`), None when it has none."""
    generator = getattr(loader, "generator", None)
    return generator.get_state().numpy().tobytes() if isinstance(generator, torch.Generator) else None


def walk(state: dict[str, Any], on_tensor: Callable[[str, torch.Tensor], Any],
         on_value: Callable[[str, Any], Any]) -> dict[str, Any]:
    """`state` rebuilt with each tensor and each other leaf replaced by the callbacks' results."""
    def visit(value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            return on_tensor(name, value)
        if isinstance(value, dict):
            return {k: visit(v, f"{name}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [visit(v, f"{name}.{i}") for i, v in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        return on_value(name, value)

    return {k: visit(v, k) for k, v in state.items()}
