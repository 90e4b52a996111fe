"""DCP's sharded safetensors (`HuggingFaceStorageWriter(save_distributed=True)`).

Each rank writes plain safetensors files whose `__metadata__` carries
`DCP_SHARDING_INFO`: a JSON string mapping each tensor to its `saved_offsets`
in the global tensor. The global shape is not stored; like DCP we infer it
as the furthest extent of the chunks, and then check that they tile it, so a
missing trailing shard that leaves a hole is reported.
"""

from __future__ import annotations

import json
import re

from ..core import Checkpoint, Chunk, LogicalTensor
from ..errors import HeaderError
from ..storage import AnyPath, entries, prefetched, probe, read_head, store_at
from ..tiling import validate_tiling
from . import safetensors as st
from .contract import Detection, no_checksums

NAME = "dcp-safetensors"

SHARDING_KEY = "DCP_SHARDING_INFO"
DETECT_BYTES = 64 * 1024  # the first read of a candidate file: most headers fit in it
RANK_FILE = re.compile(r"^shard-(\d+)-model-\d+-of-\d+\.safetensors$")


def _files(path: AnyPath) -> list[AnyPath]:
    if path.is_file():
        return [path]
    return entries(path, "*.safetensors") if path.is_dir() else []


def _has_sharding_info(path: AnyPath) -> bool:
    head, size = probe(path, DETECT_BYTES)
    if not st.looks_like_safetensors(path):
        return False
    length = min(int.from_bytes(head[:8], "little"), st.MAX_HEADER_BYTES)
    if 8 + length > len(head) < size:  # a header longer than the first read: read it whole
        head = read_head(path, 8 + length)
    return SHARDING_KEY.encode() in head[8:8 + length]


def detect(path: AnyPath) -> Detection | None:
    """The safetensors files at `path`, when the first carries DCP's sharding info."""
    candidates = _files(path)
    return Detection(path, candidates) if candidates and _has_sharding_info(candidates[0]) else None


checksum_problems = no_checksums  # safetensors records no checksums


def open(detection: Detection) -> Checkpoint:
    path = detection.path
    candidates = detection.found or _files(path)
    root = path if path.is_dir() else path.parent
    files = store_at(root)
    windows = prefetched(files, [candidate.name for candidate in candidates])
    pieces: dict[str, list[Chunk]] = {}
    dtypes: dict[str, tuple[str, str]] = {}
    file_metadata = {}
    for candidate, name in zip(candidates, windows):
        header = st.read_header(files, name)
        where = str(candidate)
        raw = header.metadata.get(SHARDING_KEY)
        if raw is None:
            raise HeaderError(f"__metadata__ lacks {SHARDING_KEY}; every file of a DCP sharded save carries it",
                              file=where)
        try:
            info = json.loads(raw)
        except ValueError as exc:
            raise HeaderError(f"{SHARDING_KEY} is not valid JSON: {exc}", file=where) from None
        if not isinstance(info, dict):
            raise HeaderError(f"{SHARDING_KEY} must be a JSON object", file=where)
        match = RANK_FILE.match(name)
        ranks = (int(match.group(1)) - 1,) if match else ()
        for tensor, entry in header.entries.items():
            offsets = info.get(tensor, {}).get("saved_offsets") if isinstance(info.get(tensor), dict) else None
            if (not isinstance(offsets, list) or len(offsets) != len(entry.shape)
                    or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
                raise HeaderError(f"{SHARDING_KEY} gives no valid saved_offsets for a tensor of shape "
                                  f"{list(entry.shape)} (found {offsets!r})", file=where, tensor=tensor)
            known = dtypes.setdefault(tensor, (entry.dtype, name))
            if known[0] != entry.dtype:
                raise HeaderError(f"is {entry.dtype} here but {known[0]} in {known[1]}", file=where, tensor=tensor)
            chunk = st.whole_chunk(files, entry, name, offsets=tuple(offsets), ranks=ranks)
            pieces.setdefault(tensor, []).append(chunk)
        file_metadata[name] = {k: v for k, v in header.metadata.items() if k != SHARDING_KEY}
    tensors = {}
    for tensor, chunks in pieces.items():
        shape = tuple(max(c.offsets[d] + c.shape[d] for c in chunks) for d in range(len(chunks[0].shape)))
        chunks = validate_tiling(tensor, shape, chunks, file=str(root))
        tensors[tensor] = LogicalTensor(tensor, dtypes[tensor][0], shape, tuple(chunks))
    return Checkpoint(path=root, format=NAME, tensors=tensors,
                      metadata={"file_metadata": file_metadata, "shape_inferred": True},
                      files=tuple(c.name for c in candidates), storage=files)
