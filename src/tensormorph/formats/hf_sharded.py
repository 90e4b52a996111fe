"""Hugging Face file-level sharding: an index.json whose weight_map names the file holding each tensor.

Works for `model.safetensors.index.json` and `pytorch_model.bin.index.json`
(and any `*.index.json` of the same shape). A folder of several safetensors
files without an index is read the same way, each tensor from the one file
that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..core import Checkpoint, LogicalTensor, ObjectEntry
from ..errors import CheckpointError, HeaderError, MissingFileError, TensorNotFoundError
from ..storage import AnyPath, ByteStore, entries, lexists, prefetched, read_head, store_at
from . import safetensors as st
from . import torch_pickle
from .contract import Detection

NAME = "hf-sharded"

MAX_INDEX_BYTES = 100_000_000  # an index naming a million tensors takes about 80 MB
MAX_INDEX_TENSORS = 1_000_000  # tensors one index may name; the largest real checkpoints name about 100,000
MAX_INDEX_FILES = 100_000  # files one index may name (each is opened and its header read); real ones name < 2,000
DETECT_BYTES = 1 << 20  # the start of an index searched for "weight_map" when detecting
PREFERRED_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
FLAX_INDEX_SUFFIX = ".msgpack.index.json"  # sharded Flax files: formats/flax_msgpack reads those


def _index_file(path: AnyPath) -> AnyPath | None:
    if path.is_file():
        return path if path.name.endswith(".index.json") and not path.name.endswith(FLAX_INDEX_SUFFIX) else None
    if not path.is_dir():
        return None
    for name in PREFERRED_INDEXES:
        if lexists(path / name):  # whatever it is: a link to a device or a folder is refused on open
            return path / name
    others = [p for p in entries(path, "*.index.json") if not p.name.endswith(FLAX_INDEX_SUFFIX)]
    return others[0] if others else None


def _unindexed_safetensors(path: AnyPath) -> list[AnyPath]:
    if not path.is_dir():
        return []
    found = entries(path, "*.safetensors")
    return found if len(found) > 1 and all(st.looks_like_safetensors(p) for p in found) else []


def detect(path: AnyPath) -> Detection | None:
    """The index file at `path` (by its Hugging Face name, or any *.index.json holding a weight_map), or else the
    folder's several safetensors files."""
    index = _index_file(path)
    if index is not None:
        return Detection(path, index) if index.name in PREFERRED_INDEXES or _is_index(index) else None
    shards = _unindexed_safetensors(path)
    return Detection(path, shards) if shards else None


def _is_index(index: AnyPath) -> bool:
    if b'"weight_map"' in read_head(index, DETECT_BYTES):
        return True
    try:  # the key may be spelt with escapes, or come after a large "metadata"
        content = store_at(index.parent).read_json(index.name, MAX_INDEX_BYTES, "index")
    except CheckpointError:
        return False
    return isinstance(content, dict) and "weight_map" in content


def read_index(files: ByteStore, name: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(weight_map, metadata) of an index file, validated."""
    path = files.describe(name)
    index = files.read_json(name, MAX_INDEX_BYTES, "index")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise HeaderError("index must be a JSON object with a 'weight_map' object", file=path)
    weight_map = index["weight_map"]
    if len(weight_map) > MAX_INDEX_TENSORS:
        raise HeaderError(f"weight_map names {len(weight_map)} tensors, over the limit of {MAX_INDEX_TENSORS}",
                          file=path)
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            raise HeaderError(f"weight_map value must be a file name, found {file!r}", file=path, tensor=tensor)
    shard_files = dict.fromkeys(weight_map.values())
    if len(shard_files) > MAX_INDEX_FILES:
        raise HeaderError(f"weight_map names {len(shard_files)} files, over the limit of {MAX_INDEX_FILES}",
                          file=path)
    for file in shard_files:
        files.describe(file, referrer=path)  # refuses a file outside the folder, naming the index
    metadata = index.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise HeaderError("index 'metadata' must be an object", file=path)
    return weight_map, metadata


@dataclass(frozen=True)
class _Shard:
    """What one shard file holds. A safetensors shard keeps its header: its tensors are made only for the names
    the index takes from it, so an index taking one tensor each from many links to a large file stays cheap."""

    header: st.Header | None
    tensors: dict[str, LogicalTensor]  # a torch.save shard's, read whole
    objects: dict[str, ObjectEntry]

    def holds(self) -> dict[str, Any]:
        return self.header.entries if self.header is not None else self.tensors

    def tensor(self, files: ByteStore, shard: str, name: str, file_shard: tuple[int, int]) -> LogicalTensor:
        if self.header is None:
            return replace(self.tensors[name], file_shard=file_shard)
        entry = self.header.entries[name]
        return LogicalTensor(name, entry.dtype, entry.shape, (st.whole_chunk(files, entry, shard),),
                             file_shard=file_shard)


def open(detection: Detection) -> Checkpoint:
    path, found = detection.path, detection.found
    index = None if isinstance(found, list) else found if found is not None else _index_file(path)
    if index is None:
        shards = found if isinstance(found, list) else _unindexed_safetensors(path)
        if not shards:
            raise HeaderError("no *.index.json and not a folder of several safetensors files", file=str(path))
        root, weight_map = path, None
        metadata: dict[str, Any] = {}
        files = store_at(root)
        shard_names = [p.name for p in shards]
    else:
        root = index.parent
        files = store_at(root)
        weight_map, metadata = read_index(files, index.name)
        shard_names = list(dict.fromkeys(weight_map.values()))
    by_shard: dict[str, list[str]] = {}
    for tensor_name, shard in (weight_map or {}).items():
        by_shard.setdefault(shard, []).append(tensor_name)
    where = str(index or path)
    tensors: dict[str, LogicalTensor] = {}
    objects: dict[str, ObjectEntry] = {}
    file_metadata: dict[str, dict[str, str]] = {}
    numbers = {name: k for k, name in enumerate(sorted(shard_names), start=1)}  # "shard k of n" follows file names
    read: dict[str, _Shard] = {}  # by resolved path: a file behind many names is read once
    for shard in prefetched(files, shard_names):
        file_shard = (numbers[shard], len(shard_names))
        if not files.exists(shard):
            held = sorted(by_shard.get(shard, ()))
            raise MissingFileError(f"shard file is missing; {where} places {len(held)} tensor(s) in it",
                                   file=files.describe(shard), tensor=held[0] if held else None)
        content = _read_shard(files, shard, read)
        if content.header is not None and content.header.metadata:
            file_metadata[shard] = content.header.metadata
        objects.update(content.objects)
        if weight_map is None:
            for name in content.holds():
                if name in tensors:
                    raise HeaderError(f"tensor appears in both {tensors[name].files[0]!r} and {shard!r}",
                                      file=where, tensor=name)
                tensors[name] = content.tensor(files, shard, name, file_shard)
            continue
        held_here = content.holds()
        missing = sorted(name for name in by_shard[shard] if name not in held_here)
        if missing:
            raise TensorNotFoundError(f"the index assigns it to {shard!r}, which does not contain it",
                                      file=files.describe(shard), tensor=missing[0])
        for name in by_shard[shard]:  # a tensor the index assigns elsewhere (or omits) is not part of the checkpoint
            tensors[name] = content.tensor(files, shard, name, file_shard)
    if weight_map is not None:
        tensors = {name: tensors[name] for name in weight_map}  # the index's order
    metadata = {**metadata, "index": index.name if index else None}
    if file_metadata:
        metadata["file_metadata"] = file_metadata
    return Checkpoint(path=root, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(shard_names), storage=files)


checksum_problems = torch_pickle.checksum_problems  # .bin shards are torch.save zips; safetensors records none


def _read_shard(files: ByteStore, shard: str, read: dict[str, _Shard]) -> _Shard:
    key = files.describe(shard)  # the resolved path (or URL): links to one file share it
    if key not in read:
        if shard.endswith(".safetensors") or st.holds_safetensors(files, shard):
            read[key] = _Shard(st.read_header(files, shard), {}, {})
        elif torch_pickle.holds_torch_save(files, shard):
            read[key] = _Shard(None, *torch_pickle.read_file(files, shard))
        else:
            raise HeaderError("shard is neither a safetensors nor a torch.save file", file=files.describe(shard))
    return read[key]
