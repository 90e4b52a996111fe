"""The module tree implied by dotted tensor names, with repeated blocks folded.

`layers.0` .. `layers.31` with identical contents fold into one node shown
as `layers.0..31 ×32`, so a 32-layer model reads like its code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..core import LogicalTensor


@dataclass
class ModuleNode:
    name: str  # this node's own segment ("0..31" for a folded run)
    path: str  # dotted path from the root ("layers.0" for the first of a folded run)
    children: dict[str, ModuleNode] = field(default_factory=dict)
    tensor: LogicalTensor | None = None
    repeat: int = 1  # how many identical siblings this node stands for
    params: int = 0  # elements, over all repeats
    nbytes: int = 0
    dtypes: Counter = field(default_factory=Counter)  # dtype -> bytes
    placement_sharded: bool = False  # some tensor below is split across ranks
    multi_file: bool = False  # tensors below live in more than one file

    def signature(self) -> tuple:
        """What must match for siblings to fold: relative names, shapes and dtypes."""
        own = (self.tensor.shape, self.tensor.dtype) if self.tensor is not None else None
        return own, tuple((k, c.signature()) for k, c in self.children.items())

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
            path = ".".join(parts[: depth + 1])
            node = node.children.setdefault(part, ModuleNode(part, path))
        node.tensor = tensor
    _totals(root)
    if fold:
        _fold(root)
    return root


def _totals(node: ModuleNode) -> None:
    files: set[str] = set()
    if node.tensor is not None:
        t = node.tensor
        node.params, node.nbytes = t.numel, t.nbytes
        node.dtypes[t.dtype] += t.nbytes
        node.placement_sharded = t.is_placement_sharded
        files.update(t.files)
    for child in node.children.values():
        _totals(child)
        node.params += child.params
        node.nbytes += child.nbytes
        node.dtypes.update(child.dtypes)
        node.placement_sharded |= child.placement_sharded
        node.multi_file |= child.multi_file
    node.multi_file |= len(files) > 1


def _fold(node: ModuleNode) -> None:
    for child in node.children.values():
        _fold(child)
    folded: dict[str, ModuleNode] = {}
    run: list[ModuleNode] = []

    def flush() -> None:
        if len(run) > 1:
            first, last = run[0], run[-1]
            first.name = f"{first.name}..{last.name}"
            first.repeat = len(run)
            for other in run[1:]:
                first.params += other.params
                first.nbytes += other.nbytes
                first.dtypes.update(other.dtypes)
                first.placement_sharded |= other.placement_sharded
                first.multi_file |= other.multi_file
            folded[first.name] = first
        elif run:
            folded[run[0].name] = run[0]
        run.clear()

    for key, child in node.children.items():
        if key.isdigit() and child.repeat == 1 and run and int(key) == int(run[-1].name) + 1 \
                and child.signature() == run[0].signature():
            run.append(child)
            continue
        flush()
        if key.isdigit() and child.repeat == 1:
            run.append(child)
        else:
            folded[key] = child
    flush()
    node.children = folded
