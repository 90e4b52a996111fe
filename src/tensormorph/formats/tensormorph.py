"""The Tensormorph format (docs/format.md): per-rank safetensors files and a JSON manifest.

Only a folder whose manifest is present and intact is a checkpoint. A folder
holding the save marker but no manifest is a save that never committed (a
crash, or a rank that died): it is detected, and opening it says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import crc32c
import numpy as np

from ..core import Checkpoint, Chunk, LogicalTensor, MappedArray, ObjectEntry, Placement, byte_runs, validate_tiling
from ..errors import ChecksumError, CheckpointError, HeaderError, MissingFileError, TruncatedFileError, \
    UncommittedCheckpointError
from ..manifest import CHECKSUM_BLOCK, MANIFEST, MAX_MANIFEST_BYTES, SAVE_MARKER, FileRecord, Manifest, TensorRecord, parse
from ..redundancy import Stripe, parse_scheme, rebuild, replica_file
from ..storage import LocalFiles
from .. import dtypes

NAME = "tensormorph"
PRIORITY = 5


def root_of(path: Path) -> Path:
    """The checkpoint folder of a path naming the folder or its manifest."""
    return path.parent if path.is_file() and path.name == MANIFEST else path


def detect(path: Path) -> bool:
    root = root_of(path)
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


def size_problem(files: LocalFiles, name: str, record: FileRecord) -> CheckpointError | None:
    """Why a file cannot be what the manifest records, judged by its presence and size alone."""
    try:
        size = files.size(name)
    except MissingFileError:
        return MissingFileError(f"file of rank {record.rank} is missing", file=str(files.resolve(name)))
    if size != record.size:
        error = TruncatedFileError if size < record.size else HeaderError
        return error(f"is {size} bytes, the manifest records {record.size}", file=str(files.resolve(name)))
    return None


def file_problem(files: LocalFiles, name: str, record: FileRecord) -> CheckpointError | None:
    """Presence, size, then the CRC-32C of the whole file."""
    problem = size_problem(files, name, record)
    if problem is not None:
        return problem
    found = file_crc32c(files, name)
    if found != record.crc32c:
        return ChecksumError(f"CRC-32C is {found:08x}, the manifest records {record.crc32c:08x}: the file is damaged",
                             file=str(files.resolve(name)))
    return None


def all_files(manifest: Manifest) -> dict[str, FileRecord]:
    """Data files, then parity files and copies."""
    return {**manifest.files, **(manifest.redundancy.files if manifest.redundancy else {})}


def group_of(manifest: Manifest, name: str) -> tuple[str, ...]:
    """The files that can rebuild `name`: its stripe (data and parity), or its copies; () without redundancy."""
    plan = manifest.redundancy
    if plan is None:
        return ()
    scheme = parse_scheme(plan.scheme)
    if scheme.kind == "replicate":
        for data in manifest.files:
            copies = (data, *(replica_file(data, c) for c in range(1, scheme.copies)))
            if name in copies:
                return copies
        return ()
    return next((data + parity for data, parity in plan.stripes if name in data or name in parity), ())


def recover(manifest: Manifest, lost: str, intact: set[str], read: Callable[[str, int, int], bytes]) -> Iterator[bytes]:
    """The bytes of file `lost`, rebuilt from parity or a copy; CheckpointError when beyond the redundancy."""
    plan = manifest.redundancy
    if plan is None:
        raise CheckpointError(f"cannot rebuild {lost}: the checkpoint was saved without redundancy")
    scheme = parse_scheme(plan.scheme)
    if scheme.kind == "replicate":
        data = next((d for d in manifest.files for c in range(1, scheme.copies) if lost in (d, replica_file(d, c))), None)
        if data is None:
            raise CheckpointError(f"cannot rebuild {lost}: it is not a data file or copy of this checkpoint")
        sources = [n for n in [data] + [replica_file(data, c) for c in range(1, scheme.copies)] if n != lost and n in intact]
        if not sources:
            raise CheckpointError(f"cannot rebuild {lost}: every copy of {data} is damaged or missing")
        size = all_files(manifest)[lost].size
        return (read(sources[0], b, min(b + plan.segment, size)) for b in range(0, size, plan.segment))
    for data, parity in plan.stripes:
        if lost in data or lost in parity:
            stripe = Stripe(data, tuple(manifest.files[d].size for d in data), parity)
            return rebuild(stripe, scheme.k, scheme.m, lost, intact, read, plan.segment)
    raise CheckpointError(f"cannot rebuild {lost}: no stripe holds it")


def open(path: Path) -> Checkpoint:
    root = root_of(path)
    files = LocalFiles(root)
    manifest = read_manifest(files, str(root))
    damaged = {}
    for name, record in manifest.files.items():
        problem = size_problem(files, name, record)
        if problem is None:
            continue
        if manifest.redundancy is None:
            raise problem
        # with parity the checkpoint still opens; reads of this file fail until `tensormorph repair`
        damaged[name] = problem.reason
    tensors = {}
    for name, record in manifest.tensors.items():
        dtype = dtypes.numpy_dtype(record.dtype)
        chunks = [Chunk(c.offsets, c.shape, c.file, c.byte_range,
                        CheckedArray(files, c.file, c.byte_range[0], dtype, c.shape, crcs=c.block_crc32c, tensor=name),
                        c.holders or (c.rank,))
                  for c in record.chunks]
        chunks = validate_tiling(name, record.shape, chunks, file=str(root / MANIFEST))
        tensors[name] = LogicalTensor(name, record.dtype, record.shape, tuple(chunks), placement_of(record))
    objects = {name: ObjectEntry(name, None, MANIFEST, (lambda v=value: v)) for name, value in manifest.objects.items()}
    metadata = {"format_version": 1, "world_size": manifest.world_size, "writer": manifest.writer,
                "created": manifest.created, "extra": manifest.extra}
    if manifest.redundancy is not None:
        metadata["redundancy"] = manifest.redundancy.scheme
    if damaged:
        metadata["damaged_files"] = damaged
    return Checkpoint(path=root, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(sorted(manifest.files)), storage=files)


@dataclass(frozen=True, slots=True)
class CheckedArray(MappedArray):
    """A chunk of a rank file whose reads check the CRC-32C of every block they touch (once each)."""

    crcs: np.ndarray = field(default=None, repr=False)  # uint32 per CHECKSUM_BLOCK
    tensor: str = ""
    checked_blocks: set[int] = field(default_factory=set, repr=False, compare=False)

    def verify(self, index: tuple[slice, ...]) -> None:
        runs = byte_runs(self.offset, self.shape, None, self.dtype.itemsize, index)
        blocks: set[int] = set()
        for begin, end in runs:
            blocks.update(range((begin - self.offset) // CHECKSUM_BLOCK, (end - 1 - self.offset) // CHECKSUM_BLOCK + 1))
        self._check(blocks)

    def checked(self) -> np.ndarray:
        """The whole chunk, every block checked."""
        self._check(set(range(len(self.crcs))))
        return self.array()

    def _check(self, blocks: set[int]) -> None:
        todo = sorted(blocks - self.checked_blocks)
        if not todo:
            return
        buffer = self.files.buffer(self.file)
        nbytes = math.prod(self.shape) * self.dtype.itemsize
        for block in todo:
            begin = self.offset + block * CHECKSUM_BLOCK
            end = self.offset + min(nbytes, (block + 1) * CHECKSUM_BLOCK)
            found = crc32c.crc32c(buffer[begin:end])
            if found != self.crcs[block]:
                raise ChecksumError(f"bytes [{begin}, {end}) have CRC-32C {found:08x}, the manifest records "
                                    f"{int(self.crcs[block]):08x}: the file is damaged",
                                    file=str(self.files.resolve(self.file)), tensor=self.tensor)
            self.checked_blocks.add(block)


def checksum_problems(checkpoint: Checkpoint) -> Iterator[tuple[str, CheckpointError | None]]:
    """Check every data, parity and copy file against the manifest, saying whether damage is recoverable."""
    files = checkpoint.storage
    manifest = read_manifest(files, str(checkpoint.path))
    held: dict[str, set[str]] = {}
    for name, record in manifest.tensors.items():
        for chunk in record.chunks:
            held.setdefault(chunk.file, set()).add(name)
    problems = {name: file_problem(files, name, record) for name, record in sorted(all_files(manifest).items())}
    intact = {name for name, problem in problems.items() if problem is None}
    for name, problem in problems.items():
        if problem is None:
            yield name, None
            continue
        tensors = sorted(held.get(name, ()))
        holds = f"; it holds {len(tensors)} chunk(s): {', '.join(tensors[:5])}{' ...' if len(tensors) > 5 else ''}" \
            if tensors else ""
        try:
            _recoverable(manifest, name, intact)
            verdict = f"; recoverable from {manifest.redundancy.scheme} (tensormorph repair)"
        except CheckpointError as exc:
            verdict = f"; not recoverable: {exc.reason}" if manifest.redundancy else ""
        yield name, type(problem)(problem.reason + holds + verdict, file=problem.file, tensor=tensors[0] if tensors else None)


def _recoverable(manifest: Manifest, name: str, intact: set[str]) -> None:
    """Raise CheckpointError unless `name` can be rebuilt from the intact files."""
    plan = manifest.redundancy
    if plan is None:
        raise CheckpointError("the checkpoint was saved without redundancy")
    scheme = parse_scheme(plan.scheme)
    if scheme.kind == "replicate":
        recover(manifest, name, intact, lambda *_: b"")  # lazy: only checks that an intact copy exists
        return
    for data, parity in plan.stripes:
        if name in data or name in parity:
            alive = sum(1 for f in data + parity if f in intact and f != name) + (scheme.k - len(data))
            if alive < scheme.k:
                raise CheckpointError(f"only {alive} of its stripe's {scheme.k + scheme.m} files are intact, "
                                      f"{scheme.k} are needed")
            return
    raise CheckpointError(f"no stripe holds {name}")


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
