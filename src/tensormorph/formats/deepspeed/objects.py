"""The checkpoint's objects: the model-states file's other entries and the optimizer's settings, as plain data."""

from __future__ import annotations

from typing import Any

from ... import safe_pickle
from ...core import ObjectEntry
from ...errors import UnsafePickleError
from ...storage import ByteStore
from .names import OPTIMIZER_PREFIX
from .states import ModelStates


def model_objects(files: ByteStore, model: ModelStates) -> dict[str, ObjectEntry]:
    """The model-states file's remaining entries (global_steps, ds_config, lr_scheduler...)."""
    return {key: _object(key, value, model.file, files.describe(model.file)) for key, value in model.entries.items()}


def optimizer_objects(files: ByteStore, file: str, settings: dict[str, Any],
                      param_groups: list[Any]) -> dict[str, ObjectEntry]:
    """optimizer.<key>: the optimizer's settings (rank 0's), and its param_groups without the parameter ids."""
    path = files.describe(file)
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
