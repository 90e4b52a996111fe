"""Comparing the non-tensor entries of two checkpoints, whatever nesting each format kept.

Formats flatten plain values differently: DCP names every leaf (`optim.param_groups.0.lr`), the Tensormorph
format keeps a container without tensors whole (`optim.param_groups`). A whole value on one side is compared
with the leaves under its name on the other, so a change of format alone is never a difference.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from ..core import Checkpoint
from ..errors import CheckpointError


@dataclass(frozen=True)
class ObjectDiff:
    name: str
    status: str  # equal, different, only_a, only_b, undecodable
    detail: str = ""


def compare_objects(a: Checkpoint, b: Checkpoint, map_a: dict[str, str], map_b: dict[str, str]) -> list[ObjectDiff]:
    """Each aligned name's values compared (`map_x`: aligned name -> the name in checkpoint x)."""
    nested_a, nested_b = _nested(map_a, map_b), _nested(map_b, map_a)
    folded = {leaf for leaves in (*nested_a.values(), *nested_b.values()) for leaf in leaves}
    results = []
    for name in dict.fromkeys([*map_a, *map_b]):
        if name in folded:
            continue  # compared as part of a whole value on the other side
        try:
            if name in map_a and name in map_b:
                value_a, value_b = a.objects[map_a[name]].value(), b.objects[map_b[name]].value()
            elif name in nested_a:  # whole in a, leaves in b
                value_a = _normal(a.objects[map_a[name]].value())
                value_b = _regrouped(name, {n: b.objects[map_b[n]].value() for n in nested_a[name]})
            elif name in nested_b:
                value_a = _regrouped(name, {n: a.objects[map_a[n]].value() for n in nested_b[name]})
                value_b = _normal(b.objects[map_b[name]].value())
            else:
                results.append(ObjectDiff(name, "only_a" if name in map_a else "only_b"))
                continue
        except CheckpointError as exc:
            results.append(ObjectDiff(name, "undecodable", str(exc)))
            continue
        equal = plain_equal(value_a, value_b)
        results.append(ObjectDiff(name, "equal" if equal else "different",
                                  "" if equal else _first_difference(_normal(value_a), _normal(value_b))))
    return results


def _first_difference(x: Any, y: Any, path: str = "") -> str:
    """Where two normalised values first differ, and how: "param_groups.0.lr: 0.1 != 0.2"."""
    if isinstance(x, dict) and isinstance(y, dict):
        for key in sorted(x.keys() | y.keys()):
            where = f"{path}.{key}" if path else key
            if key not in y or key not in x:
                return f"{where}: only in {'a' if key in x else 'b'}"
            if not plain_equal(x[key], y[key]):
                return _first_difference(x[key], y[key], where)
    return f"{path + ': ' if path else ''}{short(x)} != {short(y)}"


def _nested(mine: dict[str, str], other: dict[str, str]) -> dict[str, list[str]]:
    """Names only on this side under which the other side holds only leaves (`name.x.y`), with those leaves."""
    ordered = sorted(n for n in other if n not in mine)
    found = {}
    for name in mine:
        if name in other:
            continue
        prefix = name + "."
        at = bisect_left(ordered, prefix)
        leaves = []
        while at < len(ordered) and ordered[at].startswith(prefix):
            leaves.append(ordered[at])
            at += 1
        if leaves:
            found[name] = leaves
    return found


def _normal(value: Any) -> Any:
    """A value with every list and tuple as a dict keyed by index text, as dotted names spell them."""
    if isinstance(value, dict):
        return {str(k): _normal(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return {str(i): _normal(v) for i, v in enumerate(value)}
    return value


def _regrouped(name: str, leaves: dict[str, Any]) -> dict[str, Any]:
    """Leaves `name.x.y` gathered into one nested value {x: {y: ...}}, in the spelling of `_normal`."""
    out: dict[str, Any] = {}
    for path, value in leaves.items():
        *outer, last = path[len(name) + 1:].split(".")
        node = out
        for key in outer:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):  # `x` and `x.y` both named: not one nesting, so they differ
                return {"": leaves}
            node = child
        node[last] = _normal(value)
    return out


def plain_equal(x: Any, y: Any) -> bool:
    """Equality where a tuple equals a list with the same items (formats differ in which they keep)."""
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(plain_equal(p, q) for p, q in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(plain_equal(x[k], y[k]) for k in x)
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if isinstance(x, bool) or isinstance(y, bool):
        return type(x) is type(y) and x == y
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return x == y
    return type(x) is type(y) and x == y


def short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
