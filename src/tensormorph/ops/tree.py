"""The module tree implied by dotted tensor names, with repeated blocks folded.

`layers.0` .. `layers.31` with identical contents fold into one node shown
as `layers.0..31 ×32`, so a 32-layer model reads like its code.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..core import LogicalTensor
from ..dtypes import itemsize


@dataclass(eq=False, slots=True)  # slotted: a 20,000-tensor checkpoint makes about 40,000 nodes
class ModuleNode:
    name: str  # this node's own segment ("0..31" for a folded run)
    path: str  # dotted path from the root ("layers.0" for the first of a folded run)
    children: dict[str, ModuleNode] = field(default_factory=dict)
    tensor: LogicalTensor | None = None
    repeat: int = 1  # how many identical siblings this node stands for
    params: int = 0  # elements, over all repeats
    nbytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> bytes
    placement_sharded: bool = False  # some tensor below is split across ranks
    multi_file: bool = False  # tensors below live in more than one file
    shape_id: int = 0  # equal for subtrees with the same names, shapes and dtypes

    def to_dict(self) -> dict:
        return {
            "name": self.name, "path": self.path, "repeat": self.repeat, "params": self.params,
            "nbytes": self.nbytes, "dtypes": dict(self.dtypes), "placement_sharded": self.placement_sharded,
            "multi_file": self.multi_file,
            "tensor": None if self.tensor is None else {"dtype": self.tensor.dtype, "shape": list(self.tensor.shape)},
            "children": [c.to_dict() for c in self.children.values()],
        }


def module_tree(tensors: Iterable[LogicalTensor], *, fold: bool = True) -> ModuleNode:
    """Build the tree of dotted names; fold runs of identical numbered siblings."""
    root = ModuleNode("", "")
    for tensor in tensors:
        node = root
        parts = tensor.name.split(".")
        for depth, part in enumerate(parts):
            child = node.children.get(part)
            if child is None:
                child = node.children[part] = ModuleNode(part, ".".join(parts[: depth + 1]))
            node = child
        node.tensor = tensor
    _summarise(root, {})
    if fold:
        _fold(root)
    return root


def _summarise(node: ModuleNode, shapes: dict[tuple, int]) -> None:
    """Totals per node, and an interned id of its structure so that folding compares integers."""
    own = None
    if node.tensor is not None:
        t = node.tensor
        node.params = math.prod(t.shape)
        node.nbytes = node.params * itemsize(t.dtype)
        node.dtypes[t.dtype] = node.nbytes
        node.placement_sharded = len(t.chunks) > 1
        # one chunk is one file: the set is built only for the tensors split over several
        node.multi_file = node.placement_sharded and len({c.file for c in t.chunks if c.file is not None}) > 1
        own = (t.shape, t.dtype)
    children = node.children
    for child in children.values():
        _summarise(child, shapes)
        _absorb(node, child)
    # sorted: formats list tensors in different orders (DCP sorts its fqns as text), and the order of a
    # layer's parameters must not decide whether two layers look alike (one child or none: nothing to sort)
    if len(children) > 1:
        key = (own, tuple(sorted((name, child.shape_id) for name, child in children.items())))
    else:
        key = (own, tuple((name, child.shape_id) for name, child in children.items()))
    node.shape_id = shapes.setdefault(key, len(shapes))


def _absorb(node: ModuleNode, other: ModuleNode) -> None:
    node.params += other.params
    node.nbytes += other.nbytes
    for dtype, size in other.dtypes.items():
        node.dtypes[dtype] = node.dtypes.get(dtype, 0) + size
    node.placement_sharded |= other.placement_sharded
    node.multi_file |= other.multi_file


def _numbers_in_order(children: dict[str, ModuleNode]) -> list[tuple[str, ModuleNode]]:
    """Children with numbered ones sorted numerically (stored names sort as text: 0, 1, 10, 100, 2...),
    placed where the first numbered one was."""
    numbered = sorted(((k, c) for k, c in children.items() if k.isdigit()), key=lambda item: int(item[0]))
    ordered: list[tuple[str, ModuleNode]] = []
    for key, child in children.items():
        if not key.isdigit():
            ordered.append((key, child))
        elif numbered:
            ordered.extend(numbered)
            numbered = []
    return ordered


def _fold(node: ModuleNode) -> None:
    for child in node.children.values():
        _fold(child)
    numbered = sum(1 for key in node.children if key.isdigit())
    if numbered < 2:  # a run is two or more numbered siblings: nothing here folds (most nodes)
        return
    folded: dict[str, ModuleNode] = {}
    run: list[ModuleNode] = []

    def flush() -> None:
        if len(run) > 1:
            first = run[0]
            first.name = f"{first.name}..{run[-1].name}"
            first.repeat = len(run)
            for other in run[1:]:
                _absorb(first, other)
        if run:
            folded[run[0].name] = run[0]
        run.clear()

    for key, child in _numbers_in_order(node.children):
        if key.isdigit() and run and int(key) == int(run[-1].name) + 1 and child.shape_id == run[0].shape_id:
            run.append(child)
            continue
        flush()
        if key.isdigit():
            run.append(child)
        else:
            folded[key] = child
    flush()
    node.children = folded
