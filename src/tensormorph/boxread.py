"""Read boxes of a Tensormorph checkpoint straight into their destination, byte run by byte run.

A rank that needs a box of a tensor intersects it with the stored chunks and
reads, for each overlap, only the contiguous runs of bytes that hold it:
with pread from a local file (into the destination's own memory when it is
contiguous), or in coalesced ranged requests from an object store. Every
checksum block that a run covers entirely is verified on the way.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence

import crc32c
import numpy as np

from . import dtypes
from .errors import CheckpointError, ChecksumError, MissingFileError, TruncatedFileError
from .layout import Box, box_runs, intersect
from .locations import RemoteFiles
from .manifest import CHECKSUM_BLOCK, ChunkRecord, Manifest
from .storage import LocalFiles

REMOTE_GAP = 4096  # remote runs closer than this are fetched in one request: a request costs more than the gap


class BoxReader:
    """Reads boxes of the tensors of one manifest, from local files or an fsspec prefix."""

    def __init__(self, manifest: Manifest, files: LocalFiles | RemoteFiles, where: str, *, verify: bool = True):
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
        with self._lock:
            self.bytes_read += len(starts) * run
        if self.verify:
            checked = sum(self._verify(name, chunk, s, into[i * run:(i + 1) * run]) for i, s in enumerate(starts.tolist()))
            with self._lock:
                self.blocks_verified += checked

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
            intact = {name for name in group_of(self.manifest, file)
                      if name != file and self._intact(name, records[name])}
            record = records[file]
            data = bytearray(record.size)
            try:
                position = 0
                for piece in recover(self.manifest, file, intact, self._read_range):
                    data[position:position + len(piece)] = piece
                    position += len(piece)
                if (position, crc32c.crc32c(data)) != (record.size, record.crc32c):
                    raise CheckpointError("the rebuilt bytes do not match its recorded CRC-32C")
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

    def _verify(self, name: str, chunk: ChunkRecord, start: int, data: memoryview) -> int:
        """Check every checksum block lying wholly inside the run [start, start + len(data)) of the chunk;
        returns how many were checked."""
        nbytes = chunk.byte_range[1] - chunk.byte_range[0]
        block = first = -(-start // CHECKSUM_BLOCK)
        while block * CHECKSUM_BLOCK < start + len(data):
            begin, end = block * CHECKSUM_BLOCK, min((block + 1) * CHECKSUM_BLOCK, nbytes)
            if end > start + len(data):
                break
            found = crc32c.crc32c(data[begin - start:end - start])
            if found != chunk.block_crc32c[block]:
                raise ChecksumError(
                    f"bytes [{chunk.byte_range[0] + begin}, {chunk.byte_range[0] + end}) of the chunk at offsets "
                    f"{list(chunk.offsets)} have CRC-32C {found:08x}, the manifest records "
                    f"{chunk.block_crc32c[block]:08x}: the file is damaged", file=self._name(chunk.file), tensor=name)
            block += 1
        return block - first

    def _name(self, file: str) -> str:
        return f"{self.files.url}/{file}" if isinstance(self.files, RemoteFiles) else str(self.files.resolve(file))


def needed_bytes(boxes: Sequence[tuple[str, Box]], manifest: Manifest) -> int:
    """The bytes the given boxes hold: what an exact reader must read for them."""
    return sum(int(np.prod(box[1])) * dtypes.itemsize(manifest.tensors[name].dtype) for name, box in boxes)
