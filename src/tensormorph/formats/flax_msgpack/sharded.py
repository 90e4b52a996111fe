"""Sharded Flax checkpoints: what transformers' `FlaxPreTrainedModel.save_pretrained(max_shard_size=...)` writes.

transformers (4.x; its Flax classes were removed in 5.0) flattens the params with `flatten_dict(sep="/")`, cuts them
in key order into blocks of at most `max_shard_size` bytes, and writes each block as `to_bytes` of the block's nested
dict to `flax_model-0000k-of-0000n.msgpack`, beside `flax_model.msgpack.index.json`:
`{"metadata": {"total_size": N}, "weight_map": {"encoder/layer/0/.../kernel": "flax_model-00002-of-00006.msgpack"}}`.
Its loader reads every shard the index names and merges their leaves. Here each shard is walked as any Flax file
(bounded, lazily: no array byte is read to open), and the index is checked against them: every name it places must be
an array of that shard, and no leaf may be in two shards. One logical checkpoint results; each tensor says which
shard holds it ("shard k of n").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ...core import Checkpoint, LogicalTensor, ObjectEntry
from ...errors import HeaderError, MissingFileError, TensorNotFoundError
from ...storage import AnyPath, ByteStore, entries, read_head, store_at
from ..hf_sharded import read_index

INDEX_SUFFIX = ".msgpack.index.json"
DETECT_BYTES = 1 << 20  # the start of an index searched for "weight_map" when detecting (as hf_sharded does)
NAME = "flax_msgpack"

ReadFile = Callable[[ByteStore, str], tuple[dict[str, LogicalTensor], dict[str, ObjectEntry]]]


def index_at(path: AnyPath) -> AnyPath | None:
    """The `*.msgpack.index.json` at `path` (the file, or the only one in a folder) when it holds a weight_map."""
    if path.is_dir():
        found: list[AnyPath] = entries(path, f"*{INDEX_SUFFIX}")
        if len(found) != 1:
            return None
        path = found[0]
    return path if path.name.endswith(INDEX_SUFFIX) and b'"weight_map"' in read_head(path, DETECT_BYTES) else None


def open_sharded(index: AnyPath, read_file: ReadFile) -> Checkpoint:
    """The shards `index` names, as one checkpoint (module docstring); `read_file` walks one msgpack file."""
    files = store_at(index.parent)
    where = files.describe(index.name)
    weight_map, metadata = read_index(files, index.name)  # bounded: size, names, files inside the folder
    placed: dict[str, list[str]] = {}  # shard file -> the dotted names the index places in it
    for key, shard in weight_map.items():
        placed.setdefault(shard, []).append(".".join(key.split("/")))
    shards = sorted(placed)  # "shard k of n" follows the file names, as transformers numbers them
    tensors: dict[str, LogicalTensor] = {}
    objects: dict[str, ObjectEntry] = {}
    holder: dict[str, str] = {}  # dotted name -> the shard holding it
    for k, shard in enumerate(shards, start=1):
        if not files.exists(shard):
            raise MissingFileError(f"shard file is missing; {where} places {len(placed[shard])} tensor(s) in it",
                                   file=files.describe(shard), tensor=placed[shard][0])
        held, others = read_file(files, shard)
        absent = [name for name in placed[shard] if name not in held]
        if absent:
            raise TensorNotFoundError(f"{where} places it in this shard, which holds no such array",
                                      file=files.describe(shard), tensor=absent[0])
        for name in [*held, *others]:
            if name in holder:
                raise HeaderError(f"is in both {holder[name]!r} and {shard!r}", file=where, tensor=name)
            holder[name] = shard
        tensors.update({name: replace(t, file_shard=(k, len(shards))) for name, t in held.items()})
        objects.update(others)
    info: dict[str, Any] = {"index": index.name, "shards": len(shards), "arrays": len(tensors),
                            "other_leaves": len(objects), **({"index_metadata": metadata} if metadata else {})}
    return Checkpoint(path=index.parent, format=NAME, tensors=tensors, objects=objects, metadata=info,
                      files=tuple(shards), storage=files)
