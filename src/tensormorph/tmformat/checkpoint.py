"""A committed Tensormorph folder as a logical Checkpoint, its reads checked block by block.

Only a folder whose manifest is present and intact is a checkpoint. A folder
holding the save marker but no manifest is a save that never committed (a
crash, or a rank that died): it is detected, and opening it says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

import numpy as np

from .. import dtypes
from ..core import (
    Checkpoint,
    LogicalTensor,
    MappedArray,
    ObjectEntry,
    Placement,
    in_memory,
)
from ..errors import CheckpointError, ChecksumError, HeaderError, MissingFileError, UncommittedCheckpointError
from ..geometry import byte_runs
from ..storage import AnyPath, ByteStore, read_head, store_at
from .checksums import verify_blocks
from .integrity import file_problem, size_problem
from .manifest import FORMAT, MANIFEST, MAX_MANIFEST_BYTES, SAVE_MARKER, ChunkRecord, Manifest, TensorRecord, parse
from .placement_check import checked_chunks
from .recovery import all_files, check_recoverable


@overload
def root_of(path: Path) -> Path: ...


@overload
def root_of(path: AnyPath) -> AnyPath: ...


def root_of(path: AnyPath) -> AnyPath:
    """The checkpoint folder of a path naming the folder or its manifest."""
    return path.parent if path.is_file() and path.name == MANIFEST else path


def is_checkpoint_folder(path: AnyPath) -> bool:
    """A folder (or its manifest) holding a Tensormorph manifest, or the marker of a save that never committed."""
    root = root_of(path)
    if not root.is_dir():
        return False
    if (root / SAVE_MARKER).is_file() and not (root / MANIFEST).exists():
        return True
    return b'"format":"tensormorph"' in read_head(root / MANIFEST, 256)


def read_manifest(files: ByteStore, where: str) -> Manifest:
    """The validated manifest of a checkpoint's store, or the error that says why it is not a checkpoint."""
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
    return parse(files.read(MANIFEST, 0, size), files.describe(MANIFEST))


def placement_of(record: TensorRecord) -> Placement | None:
    if record.mesh is None:
        return None
    return Placement(record.mesh, record.placements or (), record.mesh_dim_names)


def open_folder(path: AnyPath) -> Checkpoint:
    """The committed checkpoint in the folder `path` (or at its manifest) as a logical Checkpoint."""
    root = root_of(path)
    files = store_at(root)
    manifest = read_manifest(files, str(root))
    damaged = {}
    for name, file_record in manifest.files.items():
        problem = size_problem(files, name, file_record)
        if problem is None:
            continue
        if manifest.redundancy is None:
            raise problem
        # with parity the checkpoint still opens; reads of this file fail until `tensormorph repair`
        damaged[name] = problem.reason
    tensors = {}
    for name, record in manifest.tensors.items():
        dtype = dtypes.numpy_dtype(record.dtype)

        def source(c: ChunkRecord, name: str = name, dtype: np.dtype = dtype) -> CheckedArray:
            return CheckedArray(files, c.file, c.byte_range[0], dtype, c.shape, crcs=c.block_crc32c, tensor=name)

        chunks = checked_chunks(name, record, str(root / MANIFEST), source)
        tensors[name] = LogicalTensor(name, record.dtype, record.shape, tuple(chunks), placement_of(record),
                                      reduction=record.reduction)
    objects = {name: ObjectEntry(name, None, MANIFEST, in_memory(value)) for name, value in manifest.objects.items()}
    metadata = {"format_version": 1, "world_size": manifest.world_size, "writer": manifest.writer,
                "created": manifest.created, "extra": manifest.extra}
    if manifest.redundancy is not None:
        metadata["redundancy"] = manifest.redundancy.scheme
    if damaged:
        metadata["damaged_files"] = damaged
    return Checkpoint(path=root, format=FORMAT, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(sorted(manifest.files)), storage=files)


@dataclass(frozen=True, slots=True)
class CheckedArray(MappedArray):
    """A chunk of a rank file whose reads check the CRC-32C of every block they touch (once each)."""

    crcs: np.ndarray = field(repr=False, kw_only=True)  # uint32 per CHECKSUM_BLOCK
    tensor: str = ""
    checked_blocks: set[int] = field(default_factory=set, repr=False, compare=False)

    def verify(self, index: tuple[slice, ...]) -> None:
        runs = byte_runs(self.offset, self.shape, None, self.dtype.itemsize, index)
        self._check([(begin - self.offset, end - self.offset) for begin, end in runs])

    def read_into(self, index: tuple[slice, ...], target: np.ndarray) -> bool:
        """Read a contiguous region straight into `target`, then check its blocks against the bytes read: only the
        parts of its first and last blocks outside the region are read again (through the map). A cold read thus
        reads each byte once, not once by page faults for the check and once more for the copy."""
        if not self.files.mappable:  # remote: checked first, as reads through the map would be
            self.verify(index)
            return MappedArray.read_into(self, index, target)
        if not MappedArray.read_into(self, index, target):
            return False  # the caller checks, then copies through the map
        (begin, end), = byte_runs(self.offset, self.shape, None, self.dtype.itemsize, index)
        self._check([(begin - self.offset, end - self.offset)], held=target.reshape(-1).view(np.uint8).data)
        return True

    def checked(self) -> np.ndarray:
        """The whole chunk, every block checked."""
        self._check([(0, self._nbytes())])
        return self.array()

    def _nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def _check(self, runs: list[tuple[int, int]], held: memoryview | None = None) -> None:
        buffer = self.files.buffer(self.file)

        def mismatch(begin: int, end: int, found: int, recorded: int) -> CheckpointError:
            return ChecksumError(f"bytes [{self.offset + begin}, {self.offset + end}) have CRC-32C {found:08x}, the "
                                 f"manifest records {recorded:08x}: the file is damaged",
                                 file=self.files.describe(self.file), tensor=self.tensor)

        verify_blocks(self.crcs, self._nbytes(), runs, held,
                      lambda gaps: [buffer[self.offset + b:self.offset + e] for b, e in gaps], mismatch,
                      skip=self.checked_blocks)


def checksum_problems(checkpoint: Checkpoint) -> Iterator[tuple[str, CheckpointError | None]]:
    """Check every data, parity and copy file against the manifest, saying whether damage is recoverable.

    Each intact file is reported as soon as it is checked (so a caller shows progress and can stop between files);
    the damaged ones come last, once every file is known, since whether one can be rebuilt depends on the others.
    """
    files = checkpoint.require_storage()
    manifest = read_manifest(files, str(checkpoint.path))
    held: dict[str, set[str]] = {}
    for name, record in manifest.tensors.items():
        for chunk in record.chunks:
            held.setdefault(chunk.file, set()).add(name)
    every = sorted(all_files(manifest).items())
    damaged: dict[str, CheckpointError] = {}
    for name, file_record in every:
        problem = file_problem(files, name, file_record)
        if problem is None:
            yield name, None
        else:
            damaged[name] = problem
    intact = {name for name, _ in every if name not in damaged}
    for name, problem in damaged.items():
        tensors = sorted(held.get(name, ()))
        holds = f"; it holds {len(tensors)} chunk(s): {', '.join(tensors[:5])}{' ...' if len(tensors) > 5 else ''}" \
            if tensors else ""
        if manifest.redundancy is None:
            verdict = ""
        else:
            try:
                check_recoverable(manifest, name, intact)
                verdict = f"; recoverable from {manifest.redundancy.scheme} (tensormorph repair)"
            except CheckpointError as exc:
                verdict = f"; not recoverable: {exc.reason}"
        yield name, type(problem)(problem.reason + holds + verdict, file=problem.file,
                                  tensor=tensors[0] if tensors else None)
