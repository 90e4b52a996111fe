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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import dtypes


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
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(text)) + text


def write_file(path: Path, tensors: Iterable[tuple[TensorSpec, Iterator[np.ndarray]]],
               metadata: dict[str, str] | None = None) -> int:
    """Write tensors, each given as its spec and its data in C-order blocks; returns bytes written.

    The caller supplies the specs up front (through a list) so the header can be written first.
    """
    items = list(tensors)
    written = 0
    with open(path, "wb") as f:
        head = header_bytes([spec for spec, _ in items], metadata)
        f.write(head)
        written += len(head)
        for spec, blocks in items:
            expected = spec.nbytes
            for block in blocks:
                data = np.ascontiguousarray(block, dtype=dtypes.numpy_dtype(spec.dtype))
                f.write(memoryview(data.reshape(-1).view(np.uint8)))
                expected -= data.nbytes
            if expected != 0:
                raise ValueError(f"tensor {spec.name!r}: its blocks hold {spec.nbytes - expected} bytes, "
                                 f"expected {spec.nbytes}")
            written += spec.nbytes
        f.flush()
        os.fsync(f.fileno())
    return written
