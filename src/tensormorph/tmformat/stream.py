"""Write a safetensors file tensor by tensor, block by block, in bounded memory.

The safetensors library's `save_file` needs every tensor in memory at once;
a checkpoint larger than RAM cannot go through it. The format is simple
enough to stream: the header (names, dtypes, shapes, offsets) is known
before any data, so we write it first and then each tensor's bytes as they
are read. Files written here are read back by the safetensors library in the
tests.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from .. import dtypes
from ..storage import create_new
from .checksums import CHECKSUM_BLOCK, BlockCrcs, RunningCrc


class OutputFile(Protocol):
    """A binary file open for writing: a local file, a save's early-writeback file or an fsspec upload."""

    def write(self, data: bytes | bytearray | memoryview, /) -> int: ...

    def flush(self) -> None: ...

    def fileno(self) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


def header_bytes(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for tensors laid out in order, padded to 8 bytes."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(text)) + text


WRITE_PIECE = 4 * 1024**2  # bytes checksummed then written at a time: small enough to stay in cache
SMALL_WRITE = 1024**2  # pieces smaller than this are copied into a staging buffer and written WRITE_PIECE at a time


@dataclass
class Written:
    """What a streamed file holds: its size, its CRC-32C, and each tensor's byte range and block CRCs."""

    size: int
    crc32c: int
    ranges: list[tuple[int, int]]
    block_crc32c: list[list[int]]


def write_stream(f: OutputFile, tensors: Iterable[tuple[TensorSpec, Iterable[np.ndarray]]],
                 metadata: dict[str, str] | None = None, *, checksum_block: int = CHECKSUM_BLOCK) -> Written:
    """Write tensors to an open binary file, each as its spec and its data in C-order blocks.

    Checksums are computed on the bytes as they go out, not in a second pass: one CRC-32C for the
    whole file and one per `checksum_block` bytes of each tensor (so partial reads can be verified).
    """
    items = list(tensors)
    head = header_bytes([spec for spec, _ in items], metadata)
    f.write(head)
    whole = RunningCrc()
    whole.update(head)
    result = Written(0, 0, [], [])
    stage = bytearray()  # small pieces, gathered into one write: 20,000 small tensors are ~160 writes, not 20,000
    for spec, blocks in items:
        begin, crcs = whole.size, BlockCrcs(checksum_block)
        numpy_dtype = dtypes.numpy_dtype(spec.dtype)
        for block in blocks:
            view = np.ascontiguousarray(block, dtype=numpy_dtype).reshape(-1).view(np.uint8).data
            for start in range(0, len(view), WRITE_PIECE):
                piece = view[start:start + WRITE_PIECE]
                crcs.update(piece)  # checksums first: the write then finds the piece in cache
                whole.update(piece)
                if len(piece) < SMALL_WRITE:
                    stage += piece
                    if len(stage) < WRITE_PIECE:
                        continue
                    piece, stage = memoryview(stage), bytearray()  # a fresh stage: the file may keep the old one
                elif stage:
                    f.write(memoryview(stage))
                    stage = bytearray()
                f.write(piece)
        if whole.size - begin != spec.nbytes:
            raise ValueError(f"tensor {spec.name!r}: its blocks hold {whole.size - begin} bytes, "
                             f"expected {spec.nbytes}")
        result.ranges.append((begin, whole.size))
        result.block_crc32c.append(crcs.finish())
    if stage:
        f.write(memoryview(stage))
    result.size, result.crc32c = whole.size, whole.value
    return result


def write_file(path: Path, tensors: Iterable[tuple[TensorSpec, Iterable[np.ndarray]]],
               metadata: dict[str, str] | None = None) -> int:
    """Write and fsync a safetensors file (see write_stream); returns the bytes written."""
    with create_new(path) as f:
        written = write_stream(f, tensors, metadata)
        f.flush()
        os.fsync(f.fileno())
    return written.size
