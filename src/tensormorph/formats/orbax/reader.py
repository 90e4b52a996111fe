"""Opening an Orbax checkpoint (an item folder, a step folder of items, or a manager root's latest step)."""

from __future__ import annotations

import itertools
import math
from functools import partial
from pathlib import Path
from typing import Any

from ... import dtypes
from ...core import Checkpoint, Chunk, LogicalTensor, ObjectEntry, Placement, in_memory
from ...errors import CheckpointError, HeaderError, MissingFileError, UnsupportedError
from ...storage import AnyPath, ByteStore, store_at
from ..contract import Detection, Problems
from .arrays import ItemStore, ZarrArray, ZarrBox
from .kvstores import check_protocol
from .layout import CHECKPOINT, JSON_ITEM, TREE, Layout, find
from .metadata import (
    MAX_CHUNKS,
    MAX_METADATA_BYTES,
    ArrayLayout,
    Leaf,
    Sharding,
    dumps_short,
    parse_shardings,
    parse_strings,
    parse_tree,
    parse_zarr,
)

NAME = "orbax"
MAX_SIDE_FILE_BYTES = 256 * 1024**2  # `_sharding`, `_strings.json`, `_CHECKPOINT_METADATA`, JSON items: KB to MB
VERIFY_BAND_BYTES = 64 * 1024**2  # verification reads each chunk in row bands of about this size (whole read chunks)


def detect(path: AnyPath) -> Detection | None:
    """An item folder, a step folder of items, or a CheckpointManager root (its latest step); `found` is the Layout."""
    found = find(path)
    return Detection(found.folder, found) if found is not None else None


def _read(files: ByteStore, name: str, cap: int) -> bytes:
    size = files.size(name)
    if size > cap:
        raise HeaderError(f"is {size} bytes, over the limit of {cap}", file=files.describe(name))
    return files.read(name, 0, size)


def open(detection: Detection) -> Checkpoint:
    found = detection.found if isinstance(detection.found, Layout) else find(detection.path)
    if found is None:
        raise HeaderError(f"is not an Orbax checkpoint: no {TREE} holding a tree_metadata here or in a subfolder",
                          file=str(detection.path))
    path, items = found.folder, found.items
    check_protocol(path)  # a protocol tensorstore cannot read fails before anything is read
    files = store_at(path)
    if isinstance(path, Path):
        _check_links(files, path)
    metadata: dict[str, Any] = {"items": [item for item, _ in items]}
    if found.steps:
        metadata.update(steps=list(found.steps), step=int(path.name))
    if files.exists(CHECKPOINT):
        step = files.read_json(CHECKPOINT, MAX_SIDE_FILE_BYTES, CHECKPOINT)
        if isinstance(step, dict):
            metadata.update({f"checkpoint.{k}": dumps_short(v) for k, v in step.items()})
    tensors: dict[str, LogicalTensor] = {}
    objects: dict[str, ObjectEntry] = {}
    budget = [MAX_CHUNKS]
    for item, kind in items:
        if kind == "json":  # a JsonSave item: one JSON document, shown as one object
            where = f"{item}/{JSON_ITEM}"
            objects[item] = ObjectEntry(item, files.size(where), where,
                                        loader=partial(files.read_json, where, MAX_SIDE_FILE_BYTES, "JSON item"))
            continue
        prefix = f"{item}." if len(items) > 1 else ""
        _open_item(files, path, item, prefix, tensors, objects, metadata, budget)
    return Checkpoint(path=path, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=_files(files, items), storage=files)


def _files(files: ByteStore, items: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """Every file of the checkpoint; over HTTP, which lists nothing, the metadata files it was opened from and each
    item's OCDBT manifest (the data files the manifest names are tensorstore's to find)."""
    try:
        return tuple(files.list())
    except UnsupportedError:
        known = [CHECKPOINT, *(f"{item}/{name}" if item else name for item, kind in items
                               for name in ((JSON_ITEM,) if kind == "json" else (TREE, "manifest.ocdbt", "_sharding")))]
        return tuple(name for name in known if files.exists(name))


def _check_links(files: ByteStore, folder: Path) -> None:
    """tensorstore reads the files itself, without the store's checks: a link anywhere under the folder that leads
    out of it is refused up front (UnsafePathError naming it)."""
    for entry in folder.rglob("*"):
        if entry.is_symlink():
            files.describe(entry.relative_to(folder).as_posix())


def _open_item(files: ByteStore, root: AnyPath, item: str, prefix: str, tensors: dict[str, LogicalTensor],
               objects: dict[str, ObjectEntry], metadata: dict[str, Any], budget: list[int]) -> None:
    """Add the leaves of item folder `item` ("" for the root), their names after `prefix`."""
    at = f"{item}/" if item else ""
    tree = parse_tree(_read(files, at + TREE, MAX_METADATA_BYTES), files.describe(at + TREE))
    ocdbt = files.exists(at + "manifest.ocdbt")
    if tree.use_ocdbt and not ocdbt:
        if any(name.startswith("ocdbt.process_") for name in files.listdir(item)):
            # Orbax merges them into the root at the end of a save, and its restore reads only that root
            raise UnsupportedError("holds per-process OCDBT databases that Orbax never merged (no manifest.ocdbt: the "
                                   "save did not finish, and Orbax cannot restore it either); reading those is not "
                                   "supported", file=files.describe(at + "manifest.ocdbt"))
        raise MissingFileError(f"is missing, but {TREE} says the arrays are in an OCDBT database",
                               file=files.describe(at + "manifest.ocdbt"))
    for key, value in (("use_ocdbt", ocdbt), ("use_zarr3", tree.use_zarr3), ("leaves", len(tree.leaves)),
                       ("custom_metadata", dumps_short(tree.custom))):
        metadata[f"{prefix}{key}"] = value
    shardings = (parse_shardings(_read(files, at + "_sharding", MAX_SIDE_FILE_BYTES), files.describe(at + "_sharding"))
                 if files.exists(at + "_sharding") else {})
    strings = (parse_strings(_read(files, at + "_strings.json", MAX_SIDE_FILE_BYTES),
                             files.describe(at + "_strings.json")) if files.exists(at + "_strings.json") else {})
    stored = [leaf for leaf in tree.leaves if leaf.is_array or leaf.value_type == "scalar"]
    store = ItemStore(root / item if item else root, ocdbt) if stored else None
    layouts = _layouts(store, stored, tree.use_zarr3) if store is not None else {}
    if store is not None:
        store.fit_cache(layouts.values())
    for leaf in tree.leaves:
        name = prefix + leaf.name
        if leaf.is_array:
            assert store is not None
            budget[0] -= layouts[leaf.name].chunk_count
            if budget[0] < 0:
                raise HeaderError(f"holds over {MAX_CHUNKS} chunks", file=files.describe(at + TREE), tensor=name)
            tensors[name] = _tensor(name, store.open_array(leaf.name, layouts[leaf.name]), shardings.get(leaf.name),
                                    store, at)
        else:
            objects[name] = _object(name, leaf, at, store, layouts.get(leaf.name), strings, files)


def _layouts(store: ItemStore, leaves: list[Leaf], zarr3: bool | None) -> dict[str, ArrayLayout]:
    """Each stored leaf's zarr metadata, read concurrently from the store."""
    names = [".zarray", "zarr.json"] if zarr3 is None else ["zarr.json" if zarr3 else ".zarray"]
    keys = [f"{leaf.name}/{n}" for leaf in leaves for n in names]
    values = dict(zip(keys, store.read_many(keys)))
    layouts = {}
    for leaf in leaves:
        found = [(key, raw) for key in (f"{leaf.name}/{n}" for n in names) if (raw := values[key]) is not None]
        if not found:
            raise MissingFileError(f"has no zarr metadata ({' or '.join(names)})",
                                   file=store.describe(f"{leaf.name}/"), tensor=leaf.name)
        key, raw = found[0]
        layouts[leaf.name] = parse_zarr(raw, store.describe(key), leaf.name)
    return layouts


def _tensor(name: str, zarr: ZarrArray, sharding: Sharding | None, store: ItemStore, at: str) -> LogicalTensor:
    """The tensor of one array leaf: a chunk per cell of its zarr grid, with the devices whose shard holds it as
    its ranks; `at` is the item folder (keys and files are relative to the step folder opened)."""
    layout = zarr.layout
    placement, boxes = _placement(name, layout.shape, sharding, store)
    chunks = []
    for index in itertools.product(*(range(n) for n in layout.grid)):
        offsets = tuple(i * c for i, c in zip(index, layout.chunk_shape))
        shape = tuple(min(c, n - o) for c, n, o in zip(layout.chunk_shape, layout.shape, offsets))
        key = layout.chunk_key(zarr.name, index)
        ranks = tuple(device for device, box in boxes
                      if all(b0 <= o and o + s <= b1 for (b0, b1), o, s in zip(box, offsets, shape)))
        # the file whose change means the chunk changed (caches fingerprint it): the chunk's own file, or with OCDBT
        # the database's manifest, which every write replaces
        file = at + ("manifest.ocdbt" if store.ocdbt else key)
        chunks.append(Chunk(offsets, shape, file, None, ZarrBox(zarr, key, offsets, shape, at + key), ranks))
    return LogicalTensor(name, layout.dtype, layout.shape, tuple(chunks), placement=placement)


def _placement(name: str, shape: tuple[int, ...], sharding: Sharding | None,
               store: ItemStore) -> tuple[Placement | None, list[tuple[int, tuple[tuple[int, int], ...]]]]:
    """The recorded NamedSharding as a Placement (a mesh axis that splits dimension d is Shard(d), the others
    Replicate()), and each device's box of the array, as JAX splits it (ceil division, major axis first)."""
    if sharding is None:
        return None, []
    if len(sharding.spec) > len(shape):
        raise HeaderError(f"is sharded over {len(sharding.spec)} dimensions, but has {len(shape)}",
                          file=str(store.folder / "_sharding"), tensor=name)
    split = {axis: d for d, axes in enumerate(sharding.spec) for axis in axes}
    placement = Placement(sharding.mesh_shape,
                          tuple(f"Shard({split[a]})" if a in split else "Replicate()" for a in sharding.axis_names),
                          sharding.axis_names)
    sizes = dict(zip(sharding.axis_names, sharding.mesh_shape))
    boxes = []
    for device, coords in zip(sharding.device_ids, itertools.product(*(range(n) for n in sharding.mesh_shape))):
        at = dict(zip(sharding.axis_names, coords))
        box = []
        for d, n in enumerate(shape):
            axes = sharding.spec[d] if d < len(sharding.spec) else ()
            parts, part = math.prod(sizes[a] for a in axes), 0
            for axis in axes:
                part = part * sizes[axis] + at[axis]
            step = -(-n // parts)
            box.append((min(n, part * step), min(n, (part + 1) * step)))
        boxes.append((device, tuple(box)))
    return placement, boxes


def _object(name: str, leaf: Leaf, at: str, store: ItemStore | None, layout: ArrayLayout | None,
            strings: dict[str, str], files: ByteStore) -> ObjectEntry:
    if leaf.value_type == "scalar":
        assert store is not None and layout is not None
        if layout.shape:
            raise HeaderError(f"is a scalar, but its array has shape {list(layout.shape)}",
                              file=store.describe(f"{leaf.name}/"), tensor=name)
        zarr = store.open_array(leaf.name, layout)
        key = layout.chunk_key(leaf.name, ())
        file = at + ("manifest.ocdbt" if store.ocdbt else key)
        return ObjectEntry(name, dtypes.itemsize(layout.dtype), file, loader=partial(_scalar, zarr, key))
    if leaf.value_type == "string":
        if leaf.name not in strings:
            raise MissingFileError("is a string leaf missing from _strings.json",
                                   file=files.describe(at + "_strings.json"), tensor=name)
        text = strings[leaf.name]
        return ObjectEntry(name, len(text.encode("utf-8")), at + "_strings.json", in_memory(text))
    if leaf.value_type == "None":
        return ObjectEntry(name, 0, at + TREE, in_memory(None))
    return ObjectEntry(name, None, at + TREE, loader=partial(_unsupported, name, leaf.value_type,
                                                              files.describe(at + TREE)))


def _scalar(zarr: ZarrArray, key: str) -> Any:
    return zarr.read((), key).item()


def _unsupported(name: str, value_type: str, where: str) -> Any:
    raise UnsupportedError(f"is an Orbax leaf of type {value_type!r}, which this reader does not decode",
                           file=where, tensor=name)


def checksum_problems(checkpoint: Checkpoint) -> Problems:
    """zarr records no checksums (zarr3 shard indexes carry a CRC-32C, which decoding checks): every chunk is decoded
    whole, in row bands, which finds a missing, truncated or corrupt chunk, and names it."""
    for tensor in checkpoint.values():
        for chunk in tensor.chunks:
            source = chunk.source
            assert isinstance(source, ZarrBox)
            try:
                _decode_chunk(source)
            except CheckpointError as exc:
                yield source.where, exc
                continue
            yield source.where, None


def _decode_chunk(source: ZarrBox) -> None:
    """Decode one chunk in row bands of whole read chunks (a band never decodes a stored chunk twice)."""
    shape = source.shape
    if not shape:
        source.zarr.read((), source.key)
        return
    row_bytes = max(1, math.prod(shape[1:]) * dtypes.itemsize(source.zarr.layout.dtype))
    unit = source.zarr.layout.read_chunk_shape[0]
    step = max(unit, VERIFY_BAND_BYTES // row_bytes // unit * unit)
    for first in range(0, shape[0], step):
        rows = slice(source.offsets[0] + first, source.offsets[0] + min(shape[0], first + step), 1)
        source.zarr.read((rows, *(slice(o, o + n, 1) for o, n in zip(source.offsets[1:], shape[1:]))), source.key)
