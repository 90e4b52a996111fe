"""Rules that align two checkpoints for diff: renames, transposes, and named rule sets (`flax-torch`).

A rule list is applied in order to each name of a side: a rename rule (diff's 'OLD=NEW', 're:PATTERN=REPL') rewrites
the name, a transpose rule permutes the dimensions of a tensor whose name, as renamed so far, it matches. Transposes
compose. The result is a view of each side: its tensors under their aligned names, a transposed one read through
its original chunks (a region read touches only the chunks it needs), so diff compares them as it compares any two.

Transpose rules: 'SELECTOR' swaps the dimensions of the 2-D tensors it matches, 'SELECTOR=3,2,0,1' permutes those of
that many dimensions (the result's dimension i is the original's dimension perm[i], as numpy's transpose); other
tensors that match are left as they are. SELECTOR is 're:PATTERN' (a regular expression searched in the name) or a
glob ('*.kernel'). They apply to side a unless prefixed 'b:' ('a:' is accepted too).

Rule sets: a built-in name (RULE_SETS) or a JSON file: a list of {"rename": RULE} and {"transpose": RULE} objects,
applied in order (or an object holding that list under "rules").
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..core import Checkpoint, Chunk, LogicalTensor
from ..errors import CheckpointError
from .diff import NameRule, parse_rename

MAX_RULE_FILE_BYTES = 1024**2  # a rule file is a few KB of JSON
MAX_RULES = 10_000  # rules in one file

# Flax (transformers' Flax models, or a Flax module's variables) against transformers' torch naming, as transformers'
# own Flax -> PyTorch loading renames and reshapes (modeling_flax_pytorch_utils): a `kernel` becomes `weight`,
# transposed (2-D: swapped; 4-D convolutions: (3, 2, 0, 1)); `scale` (LayerNorm) and `embedding` become `weight`;
# batch statistics' `mean` and `var` become `running_mean` and `running_var`. Besides: the `params.` root of a
# module's variables is dropped, a list of submodules that Flax named `layer_0` is torch's `layer.0`, and old torch
# LayerNorm names (`gamma`, `beta`, which transformers also reads) are `weight` and `bias`.
FLAX_TORCH: tuple[tuple[str, str], ...] = (
    ("rename", r"a:re:^batch_stats\.(.+)\.mean$=\1.running_mean"),
    ("rename", r"a:re:^batch_stats\.(.+)\.var$=\1.running_var"),
    ("rename", r"a:re:^params\.="),
    ("rename", r"a:re:(?<=[A-Za-z])_(\d+)(?=\.|$)=.\1"),
    ("transpose", r"a:re:\.kernel$"),
    ("transpose", r"a:re:\.kernel$=3,2,0,1"),
    ("rename", r"a:re:\.(kernel|scale|embedding)$=.weight"),
    ("rename", r"b:re:\.gamma$=.weight"),
    ("rename", r"b:re:\.beta$=.bias"),
)
RULE_SETS: dict[str, tuple[tuple[str, str], ...]] = {"flax-torch": FLAX_TORCH}


@dataclass(frozen=True)
class TransposeRule:
    """Permute the dimensions of the tensors whose name it matches, on one side."""

    text: str
    matches: Callable[[str], bool]
    permutation: tuple[int, ...] | None  # None: swap the two dimensions of a 2-D tensor
    sides: str  # "a" or "b"

    def applies(self, name: str, ndim: int) -> tuple[int, ...] | None:
        """The permutation for a tensor of `ndim` dimensions named `name`, or None when the rule leaves it."""
        if not self.matches(name):
            return None
        if self.permutation is None:
            return (1, 0) if ndim == 2 else None
        return self.permutation if len(self.permutation) == ndim else None


Rule = NameRule | TransposeRule


def parse_transpose(rule: str) -> TransposeRule:
    """A transpose rule: '[a:|b:]SELECTOR[=PERMUTATION]' (module docstring)."""
    sides, body = (rule[0], rule[2:]) if rule[:2] in ("a:", "b:") else ("a", rule)
    permutation = None
    head, sep, tail = body.rpartition("=")
    if sep and re.fullmatch(r"\d+(,\d+)*", tail):
        body, permutation = head, tuple(int(p) for p in tail.split(","))
        if sorted(permutation) != list(range(len(permutation))):
            raise CheckpointError(f"transpose rule {rule!r}: {tail} is not a permutation of 0..{len(permutation) - 1}")
    if not body:
        raise CheckpointError(f"transpose rule {rule!r} names no tensors: 're:PATTERN' or a glob such as '*.kernel'")
    if body.startswith("re:"):
        try:
            compiled = re.compile(body[3:])
        except re.error as exc:
            raise CheckpointError(f"transpose rule {rule!r}: bad regular expression: {exc}") from None
        return TransposeRule(rule, lambda name: compiled.search(name) is not None, permutation, sides)
    return TransposeRule(rule, lambda name: fnmatch.fnmatchcase(name, body), permutation, sides)


def rule_set(spec: str) -> list[Rule]:
    """The rules of a built-in set (RULE_SETS) or of a JSON rule file."""
    if spec in RULE_SETS:
        return [_rule(kind, text) for kind, text in RULE_SETS[spec]]
    path = Path(spec)
    if not path.is_file():
        raise CheckpointError(f"rules {spec!r}: neither a built-in rule set ({', '.join(RULE_SETS)}) nor a file")
    if path.stat().st_size > MAX_RULE_FILE_BYTES:
        raise CheckpointError(f"is over {MAX_RULE_FILE_BYTES} bytes; a rule file is a short JSON list", file=spec)
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"is not JSON: {str(exc)[:200]}", file=spec) from None
    items = data.get("rules") if isinstance(data, dict) else data
    if not isinstance(items, list) or len(items) > MAX_RULES:
        raise CheckpointError(f"should hold a list of at most {MAX_RULES} rules (or {{\"rules\": [...]}})", file=spec)
    rules = []
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and len(item) == 1 and next(iter(item)) in ("rename", "transpose")
                and isinstance(next(iter(item.values())), str)):
            raise CheckpointError(f"rule {i} should be {{\"rename\": RULE}} or {{\"transpose\": RULE}}", file=spec)
        ((kind, text),) = item.items()
        rules.append(_rule(kind, text))
    return rules


def _rule(kind: str, text: str) -> Rule:
    return parse_rename(text) if kind == "rename" else parse_transpose(text)


def rule_list(rules: str | Sequence[str | Rule] | None, rename: Sequence[str] | None,
              transpose: Sequence[str] | None) -> list[Rule]:
    """`rules` (a rule set's name or file, or rules), then the `rename` rules, then the `transpose` rules."""
    steps: list[Rule] = []
    for item in [rules] if isinstance(rules, str) else rules or ():
        steps.extend(rule_set(item) if isinstance(item, str) else [item])
    return [*steps, *(parse_rename(r) for r in rename or ()), *(parse_transpose(t) for t in transpose or ())]


def align(name: str, ndim: int | None, rules: Sequence[Rule], side: str) -> tuple[str, tuple[int, ...]]:
    """The aligned name of one name of `side`, and the permutation the rules apply to its `ndim` dimensions (None:
    an object, which only renames reach)."""
    aligned, permutation = name, tuple(range(ndim or 0))
    for rule in rules:
        if side not in rule.sides:
            continue
        if isinstance(rule, NameRule):
            aligned = rule.apply(aligned)
        elif ndim is not None and (step := rule.applies(aligned, ndim)) is not None:
            permutation = tuple(permutation[p] for p in step)
    return aligned, permutation


def aligned_view(checkpoint: Checkpoint, rules: Sequence[Rule], side: str) -> Checkpoint:
    """`checkpoint` with its tensors and objects under their aligned names, tensors transposed where rules say."""
    tensors: dict[str, LogicalTensor] = {}
    for name, tensor in checkpoint.tensors.items():
        aligned, permutation = align(name, tensor.ndim, rules, side)
        _claim(tensors, aligned, name, side)
        tensors[aligned] = tensor if permutation == tuple(range(tensor.ndim)) else transposed(tensor, permutation)
    objects: dict[str, Any] = {}
    for name, entry in checkpoint.objects.items():
        aligned, _ = align(name, None, rules, side)
        _claim(objects, aligned, name, side)
        objects[aligned] = entry
    return replace(checkpoint, tensors=tensors, objects=objects)


@dataclass(frozen=True)
class TargetView:
    """A checkpoint (side a) as a state dict (side b) sees it through the rules (`as_targets`)."""

    checkpoint: Checkpoint  # tensors and objects under the state dict's own names, in its layout
    unmatched: list[str]  # the checkpoint's names no state dict name aligns with: 'name' or 'name (as aligned)'


def as_targets(checkpoint: Checkpoint, rules: Sequence[Rule], tensors: dict[str, int],
               objects: Sequence[str]) -> TargetView:
    """`checkpoint` under the names of a state dict holding `tensors` (name -> number of dimensions) and `objects`:
    side a's rules align the checkpoint's names and layouts, side b's the state dict's, and each state dict name
    whose aligned name the checkpoint holds gets that tensor, permuted back into the state dict's own layout (a
    lazy view: a region read reads only the chunks it needs)."""
    view = aligned_view(checkpoint, rules, "a")
    by_target: dict[str, LogicalTensor] = {}
    claimed: dict[str, str] = {}  # aligned name -> the state dict name that takes it
    used: set[str] = set()
    for name, ndim in tensors.items():
        aligned, permutation = align(name, ndim, rules, "b")
        if aligned in claimed:
            raise CheckpointError(f"rules map both {claimed[aligned]!r} and {name!r} of the state dict to {aligned!r}")
        claimed[aligned] = name
        tensor = view.tensors.get(aligned)
        if tensor is not None:
            back = tuple(sorted(range(len(permutation)), key=permutation.__getitem__))  # the inverse permutation
            fits = len(permutation) == tensor.ndim and back != tuple(range(tensor.ndim))
            by_target[name] = transposed(tensor, back) if fits else tensor
            used.add(aligned)
    entries: dict[str, Any] = {}
    for name in objects:
        aligned, _ = align(name, None, rules, "b")
        if aligned in claimed:
            raise CheckpointError(f"rules map both {claimed[aligned]!r} and {name!r} of the state dict to {aligned!r}")
        claimed[aligned] = name
        if aligned in view.objects:
            entries[name] = view.objects[aligned]
    # a tensor or object keeps its name in the checkpoint when the view renames it
    unmatched = [_as(t.name, a) for a, t in view.tensors.items() if a not in used]
    unmatched += [_as(o.name, a) for a, o in view.objects.items() if claimed.get(a) not in entries]
    return TargetView(replace(view, tensors=by_target, objects=entries), unmatched)


def _as(original: str, aligned: str) -> str:
    return original if original == aligned else f"{original} (as {aligned})"


def _claim(taken: dict[str, Any], aligned: str, name: str, side: str) -> None:
    if aligned in taken:
        raise CheckpointError(f"rules map both {getattr(taken[aligned], 'name', aligned)!r} and {name!r} of "
                              f"checkpoint {side} to {aligned!r}")


def transposed(tensor: LogicalTensor, permutation: tuple[int, ...]) -> LogicalTensor:
    """`tensor` with its dimensions permuted (numpy's transpose), read lazily through its own chunks."""
    chunks = tuple(Chunk(tuple(c.offsets[p] for p in permutation), tuple(c.shape[p] for p in permutation), c.file,
                         None, _TransposedBox(tensor, permutation, c.offsets, c.shape), c.ranks)
                   for c in tensor.tiling)
    return LogicalTensor(tensor.name, tensor.dtype, tuple(tensor.shape[p] for p in permutation), chunks,
                         read_budget=tensor.read_budget)


@dataclass(frozen=True)
class _TransposedBox:
    """One chunk of the original tensor, seen transposed: reads go to the original tensor's matching region."""

    tensor: LogicalTensor
    permutation: tuple[int, ...]
    offsets: tuple[int, ...]  # the chunk's box in the original tensor
    shape: tuple[int, ...]

    def array(self) -> np.ndarray:
        # the outer read (of the transposed tensor) enforced the caller's budget: this inner one reads no more
        box = tuple(slice(o, o + n) for o, n in zip(self.offsets, self.shape))
        nbytes = math.prod(self.shape) * self.tensor.numpy_dtype.itemsize
        return self.tensor.read(box, budget=max(1, nbytes)).transpose(self.permutation)

    def read_into(self, index: tuple[slice, ...], target: np.ndarray) -> bool:
        """Read `index` (of the transposed chunk) from the original tensor's region into `target`."""
        if not isinstance(target, np.ndarray) or len(index) != len(self.permutation):
            return False
        original: list[slice] = [slice(None)] * len(index)
        for i, p in enumerate(self.permutation):
            s = index[i]
            original[p] = slice(s.start + self.offsets[p], s.stop + self.offsets[p], s.step)
        target[...] = self.tensor.read(tuple(original), budget=max(1, target.nbytes)).transpose(self.permutation)
        return True
