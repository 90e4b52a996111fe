"""Hugging Face file-level sharding: an index.json whose weight_map names the file holding each tensor.

Works for `model.safetensors.index.json` and `pytorch_model.bin.index.json`
(and any `*.index.json` of the same shape). A folder of several safetensors
files without an index is read the same way, each tensor from the one file
that holds it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core import Checkpoint, LogicalTensor, ObjectEntry
from ..errors import HeaderError, MissingFileError, TensorNotFoundError
from ..storage import ByteStore, LocalFiles, MappableStore
from . import safetensors as st
from . import torch_pickle
from .contract import Detection

NAME = "hf-sharded"

MAX_INDEX_BYTES = 100_000_000
PREFERRED_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _index_file(path: Path) -> Path | None:
    if path.is_file():
        return path if path.name.endswith(".index.json") else None
    if not path.is_dir():
        return None
    for name in PREFERRED_INDEXES:
        if (path / name).is_file():
            return path / name
    others = sorted(path.glob("*.index.json"))
    return others[0] if others else None


def _unindexed_safetensors(path: Path) -> list[Path]:
    if not path.is_dir():
        return []
    found = sorted(path.glob("*.safetensors"))
    return found if len(found) > 1 and all(st.looks_like_safetensors(p) for p in found) else []


def detect(path: Path) -> Detection | None:
    """The index file at `path`, or else the folder's several safetensors files."""
    index = _index_file(path)
    if index is not None:
        try:
            with index.open("rb") as f:
                is_index = b'"weight_map"' in f.read(1 << 20) or _is_index(index)
        except OSError:
            return None
        return Detection(path, index) if is_index else None
    shards = _unindexed_safetensors(path)
    return Detection(path, shards) if shards else None


def _is_index(index: Path) -> bool:
    try:
        content = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(content, dict) and "weight_map" in content


def read_index(files: ByteStore, name: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(weight_map, metadata) of an index file, validated."""
    path = files.describe(name)
    index = files.read_json(name, MAX_INDEX_BYTES, "index")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise HeaderError("index must be a JSON object with a 'weight_map' object", file=path)
    weight_map = index["weight_map"]
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            raise HeaderError(f"weight_map value must be a file name, found {file!r}", file=path, tensor=tensor)
    for file in set(weight_map.values()):
        files.describe(file, referrer=path)  # refuses a file outside the folder, naming the index
    metadata = index.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise HeaderError("index 'metadata' must be an object", file=path)
    return weight_map, metadata


def open(detection: Detection) -> Checkpoint:
    path, found = detection.path, detection.found
    index = found if isinstance(found, Path) else _index_file(path) if found is None else None
    if index is None:
        shards = found if isinstance(found, list) else _unindexed_safetensors(path)
        if not shards:
            raise HeaderError("no *.index.json and not a folder of several safetensors files", file=str(path))
        root, weight_map = path, None
        metadata: dict[str, Any] = {}
        files: MappableStore = LocalFiles(root)
        shard_names = [p.name for p in shards]
    else:
        root = index.parent
        files = LocalFiles(root)
        weight_map, metadata = read_index(files, index.name)
        shard_names = list(dict.fromkeys(weight_map.values()))
    by_shard: dict[str, set[str]] = {}
    for tensor_name, shard in (weight_map or {}).items():
        by_shard.setdefault(shard, set()).add(tensor_name)
    where = str(index or path)
    tensors: dict[str, LogicalTensor] = {}
    objects: dict[str, ObjectEntry] = {}
    file_metadata: dict[str, dict[str, str]] = {}
    numbers = {name: k for k, name in enumerate(sorted(shard_names), start=1)}  # "shard k of n" follows file names
    for shard in shard_names:
        number = numbers[shard]
        if not files.exists(shard):
            held = sorted(by_shard.get(shard, ()))
            raise MissingFileError(f"shard file is missing; {where} places {len(held)} tensor(s) in it",
                                   file=files.describe(shard), tensor=held[0] if held else None)
        found, found_objects, extra = _read_shard(files, shard, (number, len(shard_names)))
        if extra:
            file_metadata[shard] = extra
        expected = None if weight_map is None else by_shard[shard]
        for name, tensor in found.items():
            if expected is not None and name not in expected:
                continue  # a tensor the index assigns elsewhere (or omits) is not part of the checkpoint
            if name in tensors:
                raise HeaderError(f"tensor appears in both {tensors[name].files[0]!r} and {shard!r}",
                                  file=where, tensor=name)
            tensors[name] = tensor
        objects.update(found_objects)
        if expected is not None:
            missing = sorted(expected - found.keys())
            if missing:
                raise TensorNotFoundError(f"the index assigns it to {shard!r}, which does not contain it",
                                          file=files.describe(shard), tensor=missing[0])
    if weight_map is not None:
        tensors = {name: tensors[name] for name in weight_map}  # the index's order
    metadata = {**metadata, "index": index.name if index else None}
    if file_metadata:
        metadata["file_metadata"] = file_metadata
    return Checkpoint(path=root, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(shard_names), storage=files)


checksum_problems = torch_pickle.checksum_problems  # .bin shards are torch.save zips; safetensors records none


def _read_shard(files: MappableStore, shard: str, file_shard: tuple[int, int]
                ) -> tuple[dict[str, LogicalTensor], dict[str, ObjectEntry], dict]:
    if shard.endswith(".safetensors") or st.holds_safetensors(files, shard):
        header = st.read_header(files, shard)
        tensors = {e.name: LogicalTensor(e.name, e.dtype, e.shape, (st.whole_chunk(files, e, shard),),
                                         file_shard=file_shard) for e in header.entries.values()}
        return tensors, {}, header.metadata
    if torch_pickle.holds_torch_save(files, shard):
        tensors, objects = torch_pickle.read_file(files, shard)
        return {n: replace(t, file_shard=file_shard) for n, t in tensors.items()}, objects, {}
    raise HeaderError("shard is neither a safetensors nor a torch.save file", file=files.describe(shard))
