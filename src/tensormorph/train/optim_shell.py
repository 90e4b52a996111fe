"""Empty optimizer state shaped as a checkpoint says, so that resuming skips torch's state-making step.

A fresh optimizer has no state, and torch's `get_state_dict` makes it by running one optimizer step on zero
gradients (`_init_optim_state`): gradients and moments allocated and zeroed, and a full pass of arithmetic over
the parameters, only to be overwritten by the load that follows. For 1 GiB of AdamW state on 2 CPU ranks that
step is most of a resume from memory. When the checkpoint was saved by optimizers of the same classes, the same
entries are made here without initialising them (`torch.empty_like` of each parameter, laid out as it is), and
the load fills them. Anything this cannot shape exactly leaves the optimizers untouched: torch's step then runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..torch_arrays import torch_dtype, vocabulary

__all__ = ["OPTIMIZERS_KEY", "optimizer_classes", "prefill"]

OPTIMIZERS_KEY = "optimizers"  # in the training record: the optimizers' classes, in the order given
_STATE_PREFIX = "optimizer.state."


def optimizer_classes(optimizers: tuple[Any, ...]) -> list[str]:
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in optimizers]


def prefill(model: Any, optimizers: tuple[Any, ...], saved: Mapping[str, tuple[str, tuple[int, ...]]],
            classes: list[str] | None) -> bool:
    """Give each parameter of `optimizers` the state entries `saved` holds for it (name -> dtype and global
    shape, as `optimizer.state.<fqn>.<key>`), uninitialised; whether it was done. Only for optimizers without
    state, of the classes the checkpoint recorded, and only when every entry can be shaped exactly."""
    if model is None or not optimizers or classes != optimizer_classes(optimizers) or any(o.state for o in optimizers):
        return False
    wanted: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name, spec in saved.items():
        if name.startswith(_STATE_PREFIX):
            fqn, _, key = name[len(_STATE_PREFIX):].rpartition(".")
            wanted.setdefault(fqn, {})[key] = spec
    names = _names_of(model)
    made: list[tuple[Any, Any, dict[str, torch.Tensor]]] = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                entries = wanted.pop(names.get(param, ""), None)
                if entries is None:
                    continue  # no state saved for it (it never had a gradient): none is made
                state = _shaped(param, entries)
                if state is None:
                    return False
                made.append((optimizer, param, state))
    if wanted:  # state saved for parameters these optimizers do not have: torch's own path reports it
        return False
    for optimizer, param, state in made:
        optimizer.state[param] = state
    return True


def _names_of(model: Any) -> dict[Any, str]:
    """Each parameter's name as the state-dict API writes it (wrappers' prefixes dropped)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns  # the naming the saved keys came from

    names = {}
    for name, param in model.named_parameters():
        fqns = _get_fqns(model, name)
        if len(fqns) == 1:
            names[param] = next(iter(fqns))
    return names


def _shaped(param: torch.Tensor, entries: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor] | None:
    """Uninitialised tensors for one parameter's state: laid out like it when the saved shape is its shape, plain
    0-d tensors for saved scalars (a step count); None for anything else."""
    state = {}
    for key, (dtype, shape) in entries.items():
        if tuple(shape) == tuple(param.shape) and dtype == vocabulary(param.dtype):
            state[key] = torch.empty_like(param.detach())
        elif shape == ():
            state[key] = torch.empty((), dtype=torch_dtype(dtype))
        else:
            return None
    return state
