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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import dtypes
from ..core import PARTIAL_BLOCK_BYTES
from ..errors import CheckpointError, ChecksumError, MissingFileError, TruncatedFileError
from ..geometry import Box, box_runs, intersect
from ..reduction import combine, finish
from ..storage import ByteStore
from ..tiling import LayoutOnly
from .checksums import verify_blocks
from .integrity import file_crc32c, size_problem
from .manifest import ChunkRecord, FileRecord, Manifest, TensorRecord
from .placement_check import checked_chunks
from .recovery import RebuiltRanges, all_files, decode_slots, group_of, rebuilt_ranges

SMALL_CHUNK = 1 << 20  # chunks up to this size are read in coalesced runs; larger ones straight into place
COALESCE_BYTES = 8 << 20  # most bytes one coalesced read gathers: each reading thread stages this much
EXACT_SCAN = 8  # a contribution of up to this many chunks is scanned for a box; more are looked up by their box

BoxRequest = tuple[str, Box, np.ndarray, int | None]  # (tensor, box, destination, contribution) as for read_box


@dataclass(frozen=True)
class WholeChunk:
    """A box that is one stored chunk exactly, and the bytes of its (C-contiguous) destination."""

    name: str
    chunk: ChunkRecord
    out: memoryview


def _geometry(record: TensorRecord) -> str:
    """What checked_chunks decides on, as text (a str hash is randomised; a file chooses its tuples' hashes)."""
    return repr((record.shape, record.mesh, record.mesh_ranks, record.placements,
                 [(c.offsets, c.shape, c.contribution, c.holders, c.rank) for c in record.chunks]))


def _no_gaps(gaps: list[tuple[int, int]]) -> list[bytes]:
    assert not gaps, "a whole chunk's blocks are all held"
    return []


def _damaged(begin: int, end: int, found: int, recorded: int) -> CheckpointError:
    return ChecksumError(f"bytes [{begin}, {end}) have CRC-32C {found:08x}, not {recorded:08x}")


class BoxReader:
    """Reads boxes of the tensors of one manifest from any byte store."""

    def __init__(self, manifest: Manifest, files: ByteStore, where: str, *, verify: bool = True):
        checked: set[str] = set()
        for name, record in manifest.tensors.items():  # a gap would leave part of a destination unwritten
            kind = _geometry(record)
            if kind not in checked:  # 20,000 tensors of a few shapes on one mesh are a few checks, not 20,000
                checked_chunks(name, record, where, lambda _: LayoutOnly())
                checked.add(kind)
        self.manifest, self.files, self.where, self.verify = manifest, files, where, verify
        self.bytes_read = 0
        self.blocks_verified = 0
        # damaged data files, read by rebuilding each range from redundancy; _checked: those whose sources were
        # checked whole (after a rebuild from unchecked ones failed its block checksums)
        self._rebuilt: dict[str, RebuiltRanges] = {}
        self._checked: set[str] = set()
        self._announced: set[str] = set()  # the rebuilt files a warning has named
        self._damage: dict[str, CheckpointError] = {}  # what was first found wrong with each rebuilt file
        self._decode_slots = decode_slots()  # shared by every file rebuilt: the load's decoding memory is bounded
        self._grouped: dict[str, dict[int, list[ChunkRecord]]] = {}  # by tensor: its chunks by contribution
        self._exact: dict[tuple[str, int], dict[str, ChunkRecord]] = {}  # by tensor and contribution: chunks by box
        self._stage = threading.local()  # each reading thread's staging buffer for coalesced reads
        self._lock = threading.Lock()
        self._restore_lock = threading.Lock()

    def close(self) -> None:
        self._rebuilt.clear()
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
            self._read_checked(name, chunk, runs, buffer.reshape(-1).view(np.uint8).data)
            if buffer is not target:
                target[...] = buffer

    def _read_checked(self, name: str, chunk: ChunkRecord, runs: list[tuple[int, int]], into: memoryview) -> None:
        """Runs of a chunk into `into`, verified; a damaged file is then read by rebuilding the runs from
        redundancy: first from the other files of its group unchecked (usually only this file is damaged), and
        when those bytes fail their checksums, from the files found intact by their whole-file CRC-32C."""
        try:
            self._read_runs(name, chunk, runs, into)
            return
        except (MissingFileError, TruncatedFileError, ChecksumError) as found:
            if self.manifest.redundancy is None:
                raise
            damage = self._damage.setdefault(chunk.file, found)  # messages name what was first wrong with it
        except (CheckpointError, OSError):  # a source of a file already rebuilt failed: fall back as below
            if chunk.file not in self._rebuilt:
                raise
            damage = self._damage[chunk.file]
        scheme = self.manifest.redundancy.scheme if self.manifest.redundancy is not None else ""
        for checked in (False, True):
            self._restore(chunk.file, damage, checked=checked)
            try:
                self._read_runs(name, chunk, runs, into)
            except (CheckpointError, OSError) as exc:
                if checked:
                    raise self._unrecoverable(chunk.file, damage, exc) from None
                continue
            with self._restore_lock:
                if chunk.file not in self._announced:  # once per file, and only once its bytes were rebuilt
                    self._announced.add(chunk.file)
                    warnings.warn(f"{self.files.describe(chunk.file)}: {damage.reason}; rebuilt from {scheme} "
                                  "redundancy for this load (run `tensormorph repair` to fix the file)", stacklevel=2)
            return

    def whole_chunk_reads(self, requests: Sequence[BoxRequest]) -> tuple[list[list[WholeChunk]], list[int]]:
        """The requests whose box is one small stored chunk exactly, grouped into coalesced reads (`read_whole`):
        runs of chunks adjacent in one file, up to COALESCE_BYTES each; and the indexes of the other requests,
        for `read_box`. A state of 20,000 small tensors thus takes a few dozen reads, not 20,000."""
        whole: list[WholeChunk] = []
        others = []
        for index, (name, box, out, contribution) in enumerate(requests):
            chunk = self._exact_chunk(name, box, contribution)
            if (chunk is None or out.nbytes != chunk.byte_range[1] - chunk.byte_range[0]
                    or out.nbytes > SMALL_CHUNK or not out.flags.c_contiguous):
                others.append(index)
            else:
                whole.append(WholeChunk(name, chunk, out.reshape(-1).view(np.uint8).data))
        whole.sort(key=lambda w: (w.chunk.file, w.chunk.byte_range[0]))
        batches: list[list[WholeChunk]] = []
        for item in whole:
            last = batches[-1][-1].chunk if batches else None
            if (last is None or last.file != item.chunk.file or last.byte_range[1] != item.chunk.byte_range[0]
                    or item.chunk.byte_range[1] - batches[-1][0].chunk.byte_range[0] > COALESCE_BYTES):
                batches.append([item])
            else:
                batches[-1].append(item)
        return batches, others

    def read_whole(self, batch: Sequence[WholeChunk]) -> None:
        """Read a batch of `whole_chunk_reads` with one ranged read into a staging buffer, each chunk's blocks
        verified before its bytes are copied out; a chunk that fails (or any, when the read does) is read again on
        its own, the way read_box would, which names the damage or rebuilds the file from redundancy."""
        begin = batch[0].chunk.byte_range[0]
        stage = self._coalesced(batch) if len(batch) > 1 else None
        done = 0
        checked = 0
        for item in batch:
            chunk = item.chunk
            size = chunk.byte_range[1] - chunk.byte_range[0]
            if stage is not None:
                part = stage[chunk.byte_range[0] - begin:chunk.byte_range[1] - begin]
                try:
                    if self._verifies(chunk.file):
                        checked += len(verify_blocks(chunk.block_crc32c, size, [(0, size)], part, _no_gaps,
                                                     _damaged)[0])
                    item.out[:] = part
                    done += size
                    continue
                except ChecksumError:
                    pass
            self._read_checked(item.name, chunk, [(0, size)], item.out)
        if done > 0:
            with self._lock:
                self.bytes_read += done
                self.blocks_verified += checked

    def _coalesced(self, batch: Sequence[WholeChunk]) -> memoryview | None:
        """A batch's bytes, in this thread's staging buffer (rebuilt where its file is); None when the read fails
        (every chunk is then read on its own, and the slow path says what is wrong, or rebuilds the file)."""
        file, (begin, end) = batch[0].chunk.file, (batch[0].chunk.byte_range[0], batch[-1].chunk.byte_range[1])
        stage: memoryview | None = getattr(self._stage, "buffer", None)
        if stage is None or len(stage) < end - begin:
            stage = self._stage.buffer = memoryview(bytearray(max(end - begin, COALESCE_BYTES)))
        rebuilt = self._rebuilt.get(file)
        try:
            if rebuilt is not None:
                rebuilt.read_runs([(begin, end)], stage[:end - begin])
            else:
                self.files.read_runs(file, [(begin, end)], stage[:end - begin])
        except (CheckpointError, OSError):
            return None
        return stage

    def _exact_chunk(self, name: str, box: Box, contribution: int | None) -> ChunkRecord | None:
        """The stored chunk of `name` whose box is `box` exactly, when reading it is all a box read takes."""
        record = self.manifest.tensors.get(name)
        if record is None or (record.reduction is not None and contribution is None):
            return None
        chunks = self._contributions(name).get(contribution or 0, ())
        if len(chunks) <= EXACT_SCAN:
            return next((c for c in chunks if c.offsets == box[0] and c.shape == box[1]), None)
        exact = self._exact.get((name, contribution or 0))
        if exact is None:  # keyed by text: str hashes are randomised, tuples of a file's integers are not
            exact = self._exact[(name, contribution or 0)] = {repr((c.offsets, c.shape)): c for c in chunks}
        return exact.get(repr((tuple(box[0]), tuple(box[1]))))

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
            rebuilt.read_runs([(base + begin, base + end) for begin, end in runs], into)
        else:
            self.files.read_runs(chunk.file, [(base + begin, base + end) for begin, end in runs], into)
        extra = 0
        if self._verifies(chunk.file):
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
            return rebuilt.read_ranges([(base + b, base + e) for b, e in ranges])
        return self.files.read_ranges(chunk.file, [(base + b, base + e) for b, e in ranges])

    def _verifies(self, file: str) -> bool:
        """Whether reads of `file` are checked: always where it is rebuilt, since that is how a damaged source
        of the rebuild shows."""
        return self.verify or file in self._rebuilt

    def _restore(self, file: str, damage: CheckpointError, *, checked: bool) -> None:
        """Read the damaged data file `file` by rebuilding ranges from the other files of its group that are there
        at their recorded size (once, under the lock); with `checked`, from those whose whole-file CRC-32C is right
        (read FILE_PIECE at a time)."""
        with self._restore_lock:
            if file in self._checked or (file in self._rebuilt and not checked):
                return
            records = all_files(self.manifest)
            group = [name for name in group_of(self.manifest, file) if name != file]
            try:  # unchecked: those there at their size (a stat each); checked: those whose CRC-32C is right
                intact = self._intact if checked else (lambda n, r: size_problem(self.files, n, r) is None)
                group = [name for name in group if intact(name, records[name])]
                rebuilt = rebuilt_ranges(self.manifest, file, set(group), self._read_into, self._decode_slots)
            except (CheckpointError, OSError) as exc:  # OSError: a file of the group could not be read whole
                raise self._unrecoverable(file, damage, exc) from None
            self._rebuilt[file] = rebuilt
            if checked:
                self._checked.add(file)

    def _unrecoverable(self, file: str, damage: CheckpointError, exc: Exception) -> CheckpointError:
        assert self.manifest.redundancy is not None, "only called with redundancy"
        lost = sorted({n for n, t in self.manifest.tensors.items() for c in t.chunks if c.file == file})
        reason = exc.reason if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        return CheckpointError(f"{damage.reason}, and it cannot be rebuilt from {self.manifest.redundancy.scheme}: "
                               f"{reason}. Unrecoverable tensors ({len(lost)}): {', '.join(lost)}",
                               file=self.files.describe(file), tensor=lost[0] if lost else None)

    def _read_into(self, file: str, offset: int, target: memoryview) -> None:
        self.files.read_runs(file, [(offset, offset + len(target))], target)

    def _intact(self, name: str, record: FileRecord) -> bool:
        try:
            return self.files.size(name) == record.size and file_crc32c(self.files, name) == record.crc32c
        except (MissingFileError, TruncatedFileError, FileNotFoundError):
            return False
