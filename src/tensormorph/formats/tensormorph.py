"""The Tensormorph format (docs/format.md): per-rank safetensors files and a JSON manifest.

Only a folder whose manifest is present and intact is a checkpoint. A folder
holding the save marker but no manifest is a save that never committed (a
crash, or a rank that died): it is detected, and opening it says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import crc32c

from ..core import Checkpoint, Chunk, LogicalTensor, MappedArray, ObjectEntry, Placement, validate_tiling
from ..errors import ChecksumError, CheckpointError, HeaderError, MissingFileError, TruncatedFileError, \
    UncommittedCheckpointError
from ..manifest import MANIFEST, MAX_MANIFEST_BYTES, SAVE_MARKER, Manifest, TensorRecord, parse
from ..storage import LocalFiles
from .. import dtypes

NAME = "tensormorph"
PRIORITY = 5


def _root(path: Path) -> Path:
    return path.parent if path.is_file() and path.name == MANIFEST else path


def detect(path: Path) -> bool:
    root = _root(path)
    if not root.is_dir():
        return False
    if (root / SAVE_MARKER).is_file() and not (root / MANIFEST).exists():
        return True
    try:
        with (root / MANIFEST).open("rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return b'"format":"tensormorph"' in head


def read_manifest(files: LocalFiles, where: str) -> Manifest:
    """The validated manifest of a local folder, or the error that says why it is not a checkpoint."""
    if not files.exists(MANIFEST):
        if files.exists(SAVE_MARKER):
            marker = files.read(SAVE_MARKER, 0, min(files.size(SAVE_MARKER), 4096))
            try:
                target = json.loads(marker).get("target")
            except (ValueError, AttributeError):
                target = None
            raise UncommittedCheckpointError(
                f"is the temporary folder of a save{f' into {target!r}' if target else ''} that never committed "
                "(no manifest: a rank failed or the process died before the commit); it holds no valid checkpoint "
                "and can be deleted", file=where)
        raise MissingFileError(f"has no {MANIFEST}", file=where)
    size = files.size(MANIFEST)
    if size > MAX_MANIFEST_BYTES:
        raise HeaderError(f"{MANIFEST} is {size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit", file=where)
    return parse(files.read(MANIFEST, 0, size), str(files.resolve(MANIFEST)))


def placement_of(record: TensorRecord) -> Placement | None:
    if record.mesh is None:
        return None
    return Placement(record.mesh, record.placements or (), record.mesh_dim_names)


def open(path: Path) -> Checkpoint:
    root = _root(path)
    files = LocalFiles(root)
    manifest = read_manifest(files, str(root))
    for name, record in manifest.files.items():
        try:
            size = files.size(name)
        except MissingFileError:
            raise MissingFileError(f"data file of rank {record.rank} is missing", file=str(files.resolve(name))) from None
        if size != record.size:
            error = TruncatedFileError if size < record.size else HeaderError
            raise error(f"is {size} bytes, the manifest records {record.size}", file=str(files.resolve(name)))
    tensors = {}
    for name, record in manifest.tensors.items():
        dtype = dtypes.numpy_dtype(record.dtype)
        chunks = [Chunk(c.offsets, c.shape, c.file, c.byte_range,
                        MappedArray(files, c.file, c.byte_range[0], dtype, c.shape), c.holders or (c.rank,))
                  for c in record.chunks]
        chunks = validate_tiling(name, record.shape, chunks, file=str(root / MANIFEST))
        tensors[name] = LogicalTensor(name, record.dtype, record.shape, tuple(chunks), placement_of(record))
    objects = {name: ObjectEntry(name, None, MANIFEST, (lambda v=value: v)) for name, value in manifest.objects.items()}
    metadata = {"format_version": 1, "world_size": manifest.world_size, "writer": manifest.writer,
                "created": manifest.created, "extra": manifest.extra}
    return Checkpoint(path=root, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(sorted(manifest.files)), storage=files)


def checksum_problems(checkpoint: Checkpoint) -> Iterator[tuple[str, CheckpointError | None]]:
    """Check every data file against the CRC-32C the manifest records for it, naming the tensors it holds."""
    files = checkpoint.storage
    manifest = read_manifest(files, str(checkpoint.path))
    held: dict[str, list[str]] = {}
    for name, record in manifest.tensors.items():
        for chunk in record.chunks:
            held.setdefault(chunk.file, []).append(name)
    for name, record in sorted(manifest.files.items()):
        found = file_crc32c(files, name)
        if found == record.crc32c:
            yield name, None
            continue
        tensors = sorted(set(held.get(name, [])))
        yield name, ChecksumError(
            f"CRC-32C is {found:08x}, the manifest records {record.crc32c:08x}: the file is damaged "
            f"(it holds {len(tensors)} chunk(s){': ' + ', '.join(tensors[:5]) if tensors else ''}"
            f"{' ...' if len(tensors) > 5 else ''})", file=str(files.resolve(name)), tensor=tensors[0] if tensors else None)


def file_crc32c(files: LocalFiles, name: str, piece: int = 64 * 1024**2) -> int:
    size, value, offset = files.size(name), 0, 0
    buffer = bytearray(min(piece, max(size, 1)))
    view = memoryview(buffer)
    while offset < size:
        count = min(piece, size - offset)
        files.read_into(name, offset, view[:count])
        value = crc32c.crc32c(view[:count], value)
        offset += count
    return value
