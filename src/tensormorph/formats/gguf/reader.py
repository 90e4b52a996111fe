"""Finding a GGUF model (one file, a split set or a folder of either) and opening it as a Checkpoint."""

from __future__ import annotations

import re
from collections import Counter
from functools import partial

from ... import dtypes
from ...core import Checkpoint, Chunk, ChunkSource, LogicalTensor, MappedArray, ObjectEntry
from ...errors import HeaderError, MissingFileError
from ...storage import AnyPath, ByteStore, entries, read_head, store_at
from ..contract import Detection, no_checksums
from .header import MAGIC, RAW_TYPES, Header, LongArray, TensorInfo, read_header, read_long_array
from .quantized import QuantizedBlocks

NAME = "gguf"
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})\.gguf$")


def _is_gguf(path: AnyPath) -> bool:
    return read_head(path, 4) == MAGIC


def detect(path: AnyPath) -> Detection | None:
    """The .gguf files of a folder (names, sorted), or the one file `path` names."""
    if path.is_dir():
        found = [p.name for p in entries(path, "*.gguf") if _is_gguf(p)]
        return Detection(path, found) if found else None
    return Detection(path) if _is_gguf(path) else None


checksum_problems = no_checksums  # GGUF records no checksums


def _members(path: AnyPath, found: list[str] | None = None) -> tuple[AnyPath, list[str]]:
    """(folder, file names in split order) of the model at `path`: one file, a split set, or a folder of either
    (whose GGUF files detection may have `found` already)."""
    if path.is_dir():
        found = found if found is not None else [p.name for p in entries(path, "*.gguf") if _is_gguf(p)]
        sets = {m.group("stem", "n") for m in map(SPLIT_NAME.match, found) if m}
        singles = [f for f in found if not SPLIT_NAME.match(f)]
        if len(sets) + len(singles) != 1:
            raise HeaderError(f"holds {len(sets) + len(singles)} GGUF models ({', '.join(found[:6])}); "
                              "open one file (the first split of a split set)", file=str(path))
        if singles:
            return path, singles
        stem, n = sets.pop()
        return path, _split_names(stem, int(n))
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return path.parent, [path.name]
    if not 1 <= int(match.group("k")) <= int(match.group("n")):
        raise HeaderError(f"is split {int(match.group('k'))} of {int(match.group('n'))}, which cannot be",
                          file=str(path))
    return path.parent, _split_names(match.group("stem"), int(match.group("n")))


def _split_names(stem: str, n: int) -> list[str]:
    if n < 1:
        raise HeaderError(f"names a split set of {n} files ({stem}-00001-of-{n:05d}.gguf); a set has at least one")
    return [f"{stem}-{k:05d}-of-{n:05d}.gguf" for k in range(1, n + 1)]


def open(detection: Detection) -> Checkpoint:
    root, names = _members(detection.path, detection.found)
    files = store_at(root)
    files.prefetch(names)
    for k, name in enumerate(names, start=1):
        if not files.exists(name):
            raise MissingFileError(f"split {k} of {len(names)} is missing; the split set of {names[0]!r} needs "
                                   f"all {len(names)} files", file=files.describe(name))
    headers = [read_header(files, name) for name in names]
    _check_splits(files, headers)
    first = headers[0]
    tensors: dict[str, LogicalTensor] = {}
    for k, header in enumerate(headers, start=1):
        for info in header.tensors:
            if info.name in tensors:
                raise HeaderError(f"appears in both {tensors[info.name].files[0]!r} and {header.file!r}",
                                  file=files.describe(header.file), tensor=info.name)
            tensors[info.name] = LogicalTensor(info.name, _dtype(info), info.shape,
                                               (_chunk(files, header.file, info),),
                                               file_shard=(k, len(headers)) if len(headers) > 1 else None)
    objects = {key: ObjectEntry(key, value.end - value.begin, first.file,
                                loader=partial(read_long_array, files, first.file, value))
               for key, value in first.metadata.items() if isinstance(value, LongArray)}
    metadata = {
        "gguf_version": first.version,
        "alignment": first.alignment,
        "tensor_types": dict(Counter(info.ggml_type for h in headers for info in h.tensors).most_common()),
        **{key: value.summary() if isinstance(value, LongArray) else value for key, value in first.metadata.items()},
    }
    return Checkpoint(path=root / names[0], format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(names), storage=files)


def _dtype(info: TensorInfo) -> str:
    return info.ggml_type if info.ggml_type in RAW_TYPES else "F32"


def _chunk(files: ByteStore, file: str, info: TensorInfo) -> Chunk:
    if info.ggml_type in RAW_TYPES:
        source: ChunkSource = MappedArray(files, file, info.begin, dtypes.numpy_dtype(info.ggml_type), info.shape)
    else:
        source = QuantizedBlocks(files, file, info.begin, info)
    return Chunk((0,) * len(info.shape), info.shape, file, (info.begin, info.end), source)


def _check_splits(files: ByteStore, headers: list[Header]) -> None:
    """The split keys of every file agree with the file names (llama.cpp's split.no / split.count)."""
    n = len(headers)
    total = sum(len(h.tensors) for h in headers)
    for k, header in enumerate(headers):
        path = files.describe(header.file)
        number, count = header.metadata.get("split.no"), header.metadata.get("split.count")
        if n == 1:
            if count not in (None, 0, 1):
                raise HeaderError(f"says it is split {number} (0-based) of {count}, but its name does not follow "
                                  "<name>-00001-of-0000N.gguf; restore the split file names", file=path)
            continue
        if count is not None and count != n:
            raise HeaderError(f"split.count is {count}, but the file names say {n} splits", file=path)
        if number is not None and number != k:
            raise HeaderError(f"split.no is {number}, but the file name makes it split {k} (0-based)", file=path)
    expected = headers[0].metadata.get("split.tensors.count")
    if expected is not None and expected != total:
        raise HeaderError(f"split.tensors.count is {expected}, but the {n} file(s) hold {total} tensors",
                          file=files.describe(headers[0].file))
