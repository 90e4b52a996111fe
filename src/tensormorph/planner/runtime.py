"""The torch side of a plan: stream a checkpoint onto the planned devices, and measure what a model holds.

torch (and accelerate, to run a model split across devices) is imported only inside the functions: planning
needs numpy alone, and `import tensormorph.planner` must not pull torch in.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import Checkpoint
from ..extras import require
from ..formats import opened
from .spec import STORED_DTYPES, PlanError, accelerate_device

if TYPE_CHECKING:  # for annotations only: result imports this module for Plan.load
    from .result import Plan

# a plan's dtype -> the vocabulary's name of it (fp8 -> F8_E4M3, the first of the two fp8 spellings)
_PLAN_VOCABULARY = {planned: stored for stored, planned in reversed(STORED_DTYPES.items())}


def resident(model: Any) -> dict[str, int]:
    """Bytes of parameters and buffers a torch model holds per device ("cuda:0", "cpu"), each storage once.

    Tied weights share a storage and count once; tensors on the meta device hold nothing and are left out.
    """
    seen: set[tuple[str, int]] = set()
    held: dict[str, int] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            held[key[0]] = held.get(key[0], 0) + storage.nbytes()
    return held


def load_plan(plan: Plan, checkpoint: str | Path | Checkpoint, model: Any = None,
              devices: Mapping[str, int | str] | None = None) -> Any:
    """See `Plan.load`: each tensor is read, cast when the plan set a dtype, and moved to its device alone,
    so host memory holds one tensor at a time."""
    require("torch", "torch", feature="Plan.load")
    from ..torch_arrays import to_torch, torch_dtype  # import torch: only loading a plan needs them

    if plan.model.source == "gguf":
        raise PlanError("a GGUF model runs in llama.cpp, which loads it itself; Plan.load streams a torch "
                        "checkpoint onto the planned devices")
    if plan.device_map is None:
        raise PlanError("a tensor-parallel plan is loaded by a tensor-parallel runtime (vLLM, llama.cpp "
                        "--split-mode row); Plan.load places whole modules from a pipeline plan")
    target = {d.name: _as_torch_device(accelerate_device(d.device, devices)) for d in plan.devices}
    unit_of = {t.name: u.name for u in plan.model.units for t in u.tensors}
    tied = {t.name for u in plan.model.units for t in u.tensors if t.tied_to}
    cast = torch_dtype(_PLAN_VOCABULARY[plan.workload.dtype]) if plan.workload.dtype else None
    loaded: dict[str, Any] = {}
    with ExitStack() as stack:
        ck = opened(checkpoint, stack)
        for name, tensor in ck.items():
            if name not in unit_of:
                raise PlanError("the checkpoint holds a tensor this plan does not place (was the plan made for "
                                "another model?)", file=str(ck.path), tensor=name)
            if name in tied:
                continue  # the model ties it to the tensor it shares storage with
            value = to_torch(tensor.full(force=True), tensor.dtype)
            if cast is not None and value.is_floating_point():
                value = value.to(cast)
            value = value.to(target[plan.offloaded.get(name) or plan.device_map[unit_of[name]]])
            if model is None:
                loaded[name] = value
            else:
                _assign(model, name, value)
    if model is None:
        return loaded
    _finish(model, plan, plan.device_map, target, devices)
    return model


def _as_torch_device(device: int | str) -> Any:
    import torch

    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _assign(model: Any, name: str, value: Any) -> None:
    import torch

    module_name, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise PlanError(f"the model has no module {module_name!r}", tensor=name) from None
    if leaf in module._parameters:
        old = module._parameters[leaf]
        if old is not None and tuple(old.shape) != tuple(value.shape):
            raise PlanError(f"the model expects shape {tuple(old.shape)}, the checkpoint holds {tuple(value.shape)}",
                            tensor=name)
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=bool(old is not None and old.requires_grad
                                                                                 and value.is_floating_point()))
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise PlanError(f"the model has no parameter or buffer {leaf!r} in {module_name!r}", tensor=name)


def _finish(model: Any, plan: Plan, device_map: dict[str, str], target: dict[str, Any],
            devices: Mapping[str, int | str] | None) -> None:
    """Tie weights, place buffers the checkpoint lacks (rotary tables), and add accelerate's device hooks.
    `device_map` is the plan's (a pipeline plan always has one)."""
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise PlanError(f"{len(missing)} parameters are not in the checkpoint, e.g. {missing[0]}")
    first_layer = target[device_map[plan.model.layers[0].name]]
    keys = sorted(device_map, key=len, reverse=True)
    for name, buffer in list(model.named_buffers()):
        module_name, _, leaf = name.rpartition(".")
        key = next((k for k in keys if module_name == k or module_name.startswith(k + ".")), None)
        device = target[device_map[key]] if key is not None else first_layer
        if buffer.is_meta:
            raise PlanError(f"buffer {name} is on the meta device and not in the checkpoint: build the model "
                            "with accelerate.init_empty_weights(), which keeps buffers real")
        if buffer.device != device:
            model.get_submodule(module_name)._buffers[leaf] = buffer.to(device)
    if len(set(target.values())) > 1:
        from accelerate import dispatch_model

        dispatch_model(model, device_map=plan.to_accelerate(dict(devices or {})))
