"""Read boxes of a Tensormorph checkpoint straight into their destination, byte run by byte run.

A rank that needs a box of a tensor intersects it with the stored chunks and
reads, for each overlap, only the contiguous runs of bytes that hold it:
with pread from a local file (into the destination's own memory when it is
contiguous), or in coalesced ranged requests from an object store. With
verification on, every checksum block a read touches is checked: the parts
of the block the read did not cover are read too (at most a block's worth
per edge), so no byte is used unverified.
"""

from __future__ import annotations

import os
import threading
import warnings

import crc32c
import numpy as np

from . import dtypes
from .core import Chunk, validate_tiling
from .errors import CheckpointError, ChecksumError, MissingFileError, TruncatedFileError
from .layout import Box, box_runs, intersect
from .locations import RemoteFiles
from .manifest import CHECKSUM_BLOCK, ChunkRecord, Manifest
from .storage import LocalFiles

REMOTE_GAP = 4096  # remote runs closer than this are fetched in one request: a request costs more than the gap


class BoxReader:
    """Reads boxes of the tensors of one manifest, from local files or an fsspec prefix."""

    def __init__(self, manifest: Manifest, files: LocalFiles | RemoteFiles, where: str, *, verify: bool = True):
        for name, record in manifest.tensors.items():  # a gap would leave part of a destination unwritten
            validate_tiling(name, record.shape, [Chunk(c.offsets, c.shape, c.file, c.byte_range, None)  # type: ignore[arg-type]
                                                 for c in record.chunks], file=where)
        self.manifest, self.files, self.where, self.verify = manifest, files, where, verify
        self.bytes_read = 0
        self.blocks_verified = 0
        self._fds: dict[str, int] = {}
        self._rebuilt: dict[str, memoryview] = {}  # damaged data files rebuilt from parity, in memory
        self._lock = threading.Lock()
        self._restore_lock = threading.Lock()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> BoxReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_box(self, name: str, box: Box, out: np.ndarray) -> None:
        """Fill `out` (shaped like the box, the tensor's dtype) with the box of tensor `name`."""
        record = self.manifest.tensors[name]
        itemsize = dtypes.itemsize(record.dtype)
        for chunk in record.chunks:
            overlap = intersect(box, (chunk.offsets, chunk.shape))
            if overlap is None:
                continue
            start = tuple(o - c for o, c in zip(overlap[0], chunk.offsets))
            target = out[tuple(slice(o - b, o - b + n) for o, b, n in zip(overlap[0], box[0], overlap[1])) + (Ellipsis,)]
            buffer = target if target.flags.c_contiguous else np.empty(overlap[1], out.dtype)
            starts, run = box_runs(chunk.shape, itemsize, start, overlap[1])
            into = memoryview(buffer.reshape(-1).view(np.uint8))
            try:
                self._read_runs(name, chunk, starts, run, into)
            except (MissingFileError, TruncatedFileError, ChecksumError) as damage:
                if self.manifest.redundancy is None:
                    raise
                self._restore(chunk.file, damage)
                self._read_runs(name, chunk, starts, run, into)
            if buffer is not target:
                target[...] = buffer

    def _read_runs(self, name: str, chunk: ChunkRecord, starts: np.ndarray, run: int, into: memoryview) -> None:
        base = chunk.byte_range[0]
        rebuilt = self._rebuilt.get(chunk.file)
        if rebuilt is not None:
            for i, s in enumerate(starts.tolist()):
                into[i * run:(i + 1) * run] = rebuilt[base + s:base + s + run]
        elif isinstance(self.files, RemoteFiles):
            self._fetch_remote(chunk.file, [(base + int(s), base + int(s) + run) for s in starts], into)
        else:
            fd = self._fd(chunk.file)
            for i, s in enumerate(starts.tolist()):
                self._pread(fd, chunk.file, base + s, into[i * run:(i + 1) * run])
        extra = 0
        if self.verify:
            checked, extra = self._check(name, chunk, starts, run, into)
            with self._lock:
                self.blocks_verified += checked
        with self._lock:
            self.bytes_read += len(starts) * run + extra

    def _check(self, name: str, chunk: ChunkRecord, starts: np.ndarray, run: int, into: memoryview) -> tuple[int, int]:
        """Verify every checksum block the runs touch; returns (blocks checked, bytes read to complete them).

        A block's bytes are the covered parts (already in `into`) and the gaps between them, which are
        read from the file; the CRC-32C runs over them in order.
        """
        nbytes = chunk.byte_range[1] - chunk.byte_range[0]
        pieces: dict[int, list[tuple[int, int, int]]] = {}  # block -> (begin, end, position in `into`)
        for i, start in enumerate(starts.tolist()):
            position, end = start, start + run
            while position < end:
                block = position // CHECKSUM_BLOCK
                stop = min(end, (block + 1) * CHECKSUM_BLOCK)
                pieces.setdefault(block, []).append((position, stop, i * run + position - start))
                position = stop
        gaps = []
        for block, parts in pieces.items():
            position = block * CHECKSUM_BLOCK
            for begin, end, _ in parts:
                if begin > position:
                    gaps.append((position, begin))
                position = end
            block_end = min((block + 1) * CHECKSUM_BLOCK, nbytes)
            if position < block_end:
                gaps.append((position, block_end))
        fetched = dict(zip(gaps, self._read_ranges(chunk, gaps)))
        for block, parts in pieces.items():
            value, position = 0, block * CHECKSUM_BLOCK
            for begin, end, offset in parts:
                if begin > position:
                    value = crc32c.crc32c(fetched[(position, begin)], value)
                value = crc32c.crc32c(into[offset:offset + end - begin], value)
                position = end
            block_end = min((block + 1) * CHECKSUM_BLOCK, nbytes)
            if position < block_end:
                value = crc32c.crc32c(fetched[(position, block_end)], value)
            if value != chunk.block_crc32c[block]:
                begin = chunk.byte_range[0] + block * CHECKSUM_BLOCK
                raise ChecksumError(
                    f"bytes [{begin}, {chunk.byte_range[0] + block_end}) of the chunk at offsets {list(chunk.offsets)} "
                    f"have CRC-32C {value:08x}, the manifest records {int(chunk.block_crc32c[block]):08x}: the file is "
                    "damaged", file=self._name(chunk.file), tensor=name)
        return len(pieces), sum(end - begin for begin, end in gaps)

    def _read_ranges(self, chunk: ChunkRecord, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Bytes of [begin, end) ranges of a chunk (relative to its start)."""
        base = chunk.byte_range[0]
        rebuilt = self._rebuilt.get(chunk.file)
        if rebuilt is not None:
            return [bytes(rebuilt[base + b:base + e]) for b, e in ranges]
        if isinstance(self.files, RemoteFiles):
            return self.files.read_ranges(chunk.file, [(base + b, base + e) for b, e in ranges])
        fd = self._fd(chunk.file)
        out = []
        for begin, end in ranges:
            buffer = bytearray(end - begin)
            self._pread(fd, chunk.file, base + begin, memoryview(buffer))
            out.append(bytes(buffer))
        return out

    def _read_range(self, file: str, begin: int, end: int) -> bytes:
        if isinstance(self.files, RemoteFiles):
            return self.files.read_ranges(file, [(begin, end)])[0]
        return self.files.read(file, begin, end - begin)

    def _restore(self, file: str, damage: CheckpointError) -> None:
        """Rebuild a damaged data file from its stripe (once, under the lock), checked against its CRC-32C."""
        from .formats.tensormorph import all_files, group_of, recover

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
                    f"{damage.reason}, and it cannot be rebuilt from {self.manifest.redundancy.scheme}: {exc.reason}. "
                    f"Unrecoverable tensors ({len(lost)}): {', '.join(lost)}", file=self._name(file),
                    tensor=lost[0] if lost else None) from None
            warnings.warn(f"{self._name(file)}: {damage.reason}; rebuilt from {self.manifest.redundancy.scheme} "
                          "redundancy for this load (run `tensormorph repair` to fix the file)", stacklevel=2)
            self._rebuilt[file] = memoryview(data)

    def _intact(self, name: str, record) -> bool:
        try:
            value = 0
            for begin in range(0, record.size, 64 * 1024**2):
                value = crc32c.crc32c(self._read_range(name, begin, min(record.size, begin + 64 * 1024**2)), value)
        except (MissingFileError, TruncatedFileError, FileNotFoundError):
            return False
        return value == record.crc32c

    def _fetch_remote(self, file: str, ranges: list[tuple[int, int]], into: memoryview) -> None:
        groups: list[list[tuple[int, int]]] = []
        for begin, end in ranges:
            if groups and begin - groups[-1][-1][1] <= REMOTE_GAP:
                groups[-1].append((begin, end))
            else:
                groups.append([(begin, end)])
        parts = self.files.read_ranges(file, [(g[0][0], g[-1][1]) for g in groups])
        position = 0
        for group, part in zip(groups, parts):
            first = group[0][0]
            for begin, end in group:
                into[position:position + end - begin] = part[begin - first:end - first]
                position += end - begin

    def _fd(self, file: str) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                path = self.files.resolve(file)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise MissingFileError("data file is missing", file=str(path)) from None
                self._fds[file] = fd
            return fd

    def _pread(self, fd: int, file: str, offset: int, target: memoryview) -> None:
        done = 0
        while done < len(target):
            count = os.preadv(fd, [target[done:]], offset + done)
            if count == 0:
                raise TruncatedFileError(f"expected {len(target)} bytes at offset {offset}, the file ends after "
                                         f"{done}", file=str(self.files.resolve(file)))
            done += count

    def _name(self, file: str) -> str:
        return f"{self.files.url}/{file}" if isinstance(self.files, RemoteFiles) else str(self.files.resolve(file))

