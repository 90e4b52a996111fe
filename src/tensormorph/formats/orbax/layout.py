"""Where an Orbax checkpoint's items are: an item folder, a step folder of items, or a CheckpointManager root of step
folders (of which the latest complete one opens, as Orbax's own restore of the latest step does)."""

from __future__ import annotations

from dataclasses import dataclass

from ...storage import AnyPath, entries, read_head

TREE = "_METADATA"  # an item folder's PyTree
CHECKPOINT = "_CHECKPOINT_METADATA"  # a step folder's (item handlers, commit time, custom metadata)
JSON_ITEM = "metadata"  # the one file of an item saved with JsonSave (JsonCheckpointHandler)
DETECT_HEAD = 4096  # bytes of `_METADATA` read to recognise it: Orbax writes "tree_metadata" as its first key
MAX_STEP_PROBES = 64  # newest step folders of a manager root tried before giving up (skips unfinished saves)


@dataclass(frozen=True)
class Layout:
    """What detection found: the folder to open and its items."""

    folder: AnyPath  # the item folder or step folder that opens
    items: tuple[tuple[str, str], ...]  # (item folder, "pytree" or "json"); "" is `folder` itself
    steps: tuple[int, ...] = ()  # a CheckpointManager root's steps, when the root was named


def is_item(folder: AnyPath) -> bool:
    head = read_head(folder / TREE, DETECT_HEAD)
    return head.lstrip().startswith(b"{") and b'"tree_metadata"' in head


def step_items(folder: AnyPath) -> tuple[tuple[str, str], ...] | None:
    """The items of an item or step folder, or None when it is neither (a step needs one PyTree item)."""
    if not folder.is_dir():
        return None
    if is_item(folder):
        return (("", "pytree"),)
    if read_head(folder / CHECKPOINT, 1) != b"{":
        return None
    items = []
    for entry in entries(folder):
        if entry.is_dir():
            if is_item(entry):
                items.append((entry.name, "pytree"))
            elif read_head(entry / JSON_ITEM, 1) in (b"{", b"["):
                items.append((entry.name, "json"))
    return tuple(items) if any(kind == "pytree" for _, kind in items) else None


def find(path: AnyPath) -> Layout | None:
    """The layout at `path` (a folder, or the `_METADATA` file of an item folder), or None."""
    folder = path.parent if path.name == TREE else path
    items = step_items(folder)
    if items is not None:
        return Layout(folder, items)
    if not folder.is_dir() or read_head(folder / CHECKPOINT, 1):
        return None
    steps = sorted((int(e.name), e) for e in entries(folder) if e.name.isdigit() and e.is_dir())
    for _, step in reversed(steps[-MAX_STEP_PROBES:]):
        items = step_items(step)
        if items is not None:
            return Layout(step, items, tuple(s for s, _ in steps))
    return None
