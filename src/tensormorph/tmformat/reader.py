"""Read boxes of a Tensormorph checkpoint straight into their destination, byte run by byte run.

A rank that needs a box of a tensor intersects it with the stored chunks and
reads, for each overlap, only the contiguous runs of bytes that hold it,
through the store's `read_runs`: pread from a local file (into the
destination's own memory when it is contiguous), or coalesced ranged requests
from an object store. With verification on, every checksum block a read
touches is checked: the parts of the block the read did not cover are read
too (at most a block's worth per edge), so no byte is used unverified.
"""

from __future__ import annotations

import threading
import warnings

import crc32c
import numpy as np

from .. import dtypes
from ..core import PARTIAL_BLOCK_BYTES
from ..errors import CheckpointError, ChecksumError, MissingFileError, TruncatedFileError
from ..geometry import Box, box_runs, intersect
from ..reduction import combine, finish
from ..storage import ByteStore
from ..tiling import LayoutOnly
from .checksums import verify_blocks
from .integrity import file_crc32c
from .manifest import ChunkRecord, FileRecord, Manifest
from .placement_check import checked_chunks
from .recovery import all_files, group_of, recover


class BoxReader:
    """Reads boxes of the tensors of one manifest from any byte store."""

    def __init__(self, manifest: Manifest, files: ByteStore, where: str, *, verify: bool = True):
        for name, record in manifest.tensors.items():  # a gap would leave part of a destination unwritten
            checked_chunks(name, record, where, lambda _: LayoutOnly())
        self.manifest, self.files, self.where, self.verify = manifest, files, where, verify
        self.bytes_read = 0
        self.blocks_verified = 0
        self._rebuilt: dict[str, memoryview] = {}  # damaged data files rebuilt from parity, in memory
        self._grouped: dict[str, dict[int, list[ChunkRecord]]] = {}  # by tensor: its chunks by contribution
        self._lock = threading.Lock()
        self._restore_lock = threading.Lock()

    def close(self) -> None:
        self.files.close()

    def __enter__(self) -> BoxReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_box(self, name: str, box: Box, out: np.ndarray, contribution: int | None = None) -> None:
        """Fill `out` (shaped like the box, the tensor's dtype) with the box of tensor `name`.

        A Partial tensor's box is the reduction of its contributions (reduction.py), folded in row blocks of
        PARTIAL_BLOCK_BYTES; with `contribution`, only that contribution as stored.
        """
        record = self.manifest.tensors[name]
        reduction = record.reduction
        if reduction is None or contribution is not None:
            self._read_contribution(name, box, out, contribution or 0)
            return
        self._read_contribution(name, box, out, 0)
        row_bytes = out[:1].nbytes if out.ndim else out.nbytes
        rows = max(1, PARTIAL_BLOCK_BYTES // max(1, row_bytes))
        for other in range(1, reduction.contributions):
            for first in range(0, box[1][0] if box[1] else 1, rows):
                part = out[first:first + rows] if out.ndim else out[...]
                piece = np.empty_like(part)
                within = ((box[0][0] + first,) + box[0][1:], part.shape) if out.ndim else box
                self._read_contribution(name, within, piece, other)
                combine(reduction.op, part, piece, name)
        finish(reduction.op, out, reduction.contributions)

    def _read_contribution(self, name: str, box: Box, out: np.ndarray, contribution: int) -> None:
        record = self.manifest.tensors[name]
        itemsize = dtypes.itemsize(record.dtype)
        for chunk in self._contributions(name).get(contribution, ()):
            overlap = intersect(box, (chunk.offsets, chunk.shape))
            if overlap is None:
                continue
            start = tuple(o - c for o, c in zip(overlap[0], chunk.offsets))
            within = tuple(slice(o - b, o - b + n) for o, b, n in zip(overlap[0], box[0], overlap[1]))
            target = out[within + (Ellipsis,)]
            buffer = target if target.flags.c_contiguous else np.empty(overlap[1], out.dtype)
            starts, run = box_runs(chunk.shape, itemsize, start, overlap[1])
            runs = [(s, s + run) for s in starts.tolist()]
            into = buffer.reshape(-1).view(np.uint8).data
            try:
                self._read_runs(name, chunk, runs, into)
            except (MissingFileError, TruncatedFileError, ChecksumError) as damage:
                if self.manifest.redundancy is None:
                    raise
                self._restore(chunk.file, damage)
                self._read_runs(name, chunk, runs, into)
            if buffer is not target:
                target[...] = buffer

    def _contributions(self, name: str) -> dict[int, list[ChunkRecord]]:
        """A tensor's chunks grouped by contribution, made once: a box of a Partial tensor over many ranks reads
        each contribution's chunks only."""
        grouped = self._grouped.get(name)
        if grouped is None:
            grouped = {}
            for chunk in self.manifest.tensors[name].chunks:
                grouped.setdefault(chunk.contribution, []).append(chunk)
            self._grouped[name] = grouped
        return grouped

    def _read_runs(self, name: str, chunk: ChunkRecord, runs: list[tuple[int, int]], into: memoryview) -> None:
        """Runs relative to the chunk's first byte, read one after another into `into`, then checked."""
        base = chunk.byte_range[0]
        rebuilt = self._rebuilt.get(chunk.file)
        if rebuilt is not None:
            position = 0
            for begin, end in runs:
                into[position:position + end - begin] = rebuilt[base + begin:base + end]
                position += end - begin
        else:
            self.files.read_runs(chunk.file, [(base + begin, base + end) for begin, end in runs], into)
        extra = 0
        if self.verify:
            def mismatch(begin: int, end: int, found: int, recorded: int) -> CheckpointError:
                return ChecksumError(
                    f"bytes [{base + begin}, {base + end}) of the chunk at offsets {list(chunk.offsets)} have CRC-32C "
                    f"{found:08x}, the manifest records {recorded:08x}: the file is damaged",
                    file=self.files.describe(chunk.file), tensor=name)

            checked, extra = verify_blocks(chunk.block_crc32c, chunk.byte_range[1] - base, runs, into,
                                           lambda gaps: self._read_ranges(chunk, gaps), mismatch)
            with self._lock:
                self.blocks_verified += len(checked)
        with self._lock:
            self.bytes_read += len(into) + extra

    def _read_ranges(self, chunk: ChunkRecord, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Bytes of [begin, end) ranges of a chunk (relative to its start)."""
        base = chunk.byte_range[0]
        rebuilt = self._rebuilt.get(chunk.file)
        if rebuilt is not None:
            return [bytes(rebuilt[base + b:base + e]) for b, e in ranges]
        return self.files.read_ranges(chunk.file, [(base + b, base + e) for b, e in ranges])

    def _read_range(self, file: str, begin: int, end: int) -> bytes:
        return self.files.read_ranges(file, [(begin, end)])[0]

    def _restore(self, file: str, damage: CheckpointError) -> None:
        """Rebuild a damaged data file from its stripe (once, under the lock), checked against its CRC-32C."""
        plan = self.manifest.redundancy
        assert plan is not None, "only called with redundancy"
        with self._restore_lock:
            if file in self._rebuilt:
                return
            records = all_files(self.manifest)
            record = records[file]
            group = [name for name in group_of(self.manifest, file) if name != file]
            data = bytearray(record.size)

            def attempt(intact: set[str]) -> None:
                position = 0
                for piece in recover(self.manifest, file, intact, self._read_range):
                    data[position:position + len(piece)] = piece
                    position += len(piece)
                if (position, crc32c.crc32c(data)) != (record.size, record.crc32c):
                    raise CheckpointError("the rebuilt bytes do not match its recorded CRC-32C")

            try:
                try:  # usually only this file is damaged: rebuild from the others without checking them first
                    attempt(set(group))
                except (CheckpointError, OSError):
                    attempt({name for name in group if self._intact(name, records[name])})
            except CheckpointError as exc:
                lost = sorted({n for n, t in self.manifest.tensors.items() for c in t.chunks if c.file == file})
                raise CheckpointError(
                    f"{damage.reason}, and it cannot be rebuilt from {plan.scheme}: {exc.reason}. "
                    f"Unrecoverable tensors ({len(lost)}): {', '.join(lost)}", file=self.files.describe(file),
                    tensor=lost[0] if lost else None) from None
            warnings.warn(f"{self.files.describe(file)}: {damage.reason}; rebuilt from {plan.scheme} "
                          "redundancy for this load (run `tensormorph repair` to fix the file)", stacklevel=2)
            self._rebuilt[file] = memoryview(data)

    def _intact(self, name: str, record: FileRecord) -> bool:
        try:
            return self.files.size(name) == record.size and file_crc32c(self.files, name) == record.crc32c
        except (MissingFileError, TruncatedFileError, FileNotFoundError):
            return False
