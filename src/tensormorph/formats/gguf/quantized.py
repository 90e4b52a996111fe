"""Quantized GGUF tensors (Q4_0, Q4_K, Q8_0, ...): ggml blocks read as float32, the type llama.cpp
dequantizes to, via `gguf.quants.dequantize` over only the blocks a region touches."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ...core import byte_runs
from ...errors import UnsupportedError
from ...storage import ByteStore
from ...storage.strided import read_strided
from .header import TensorInfo

if TYPE_CHECKING:
    from gguf.constants import GGMLQuantizationType

DEQUANTIZE_BATCH = 4 * 1024**2  # float32 values dequantized at once: bounds the temporaries of a region read

# gguf.quants.dequantize: (rows of block bytes, quantization type) -> float32 (rows, values)
Dequantize = Callable[[np.ndarray, "GGMLQuantizationType"], np.ndarray]


def _dequantizer() -> Dequantize | None:
    try:
        from gguf.quants import dequantize  # numpy only; imported on first quantized read
    except ImportError:
        return None
    return dequantize


@dataclass(frozen=True, slots=True)
class QuantizedBlocks:
    """A tensor stored as ggml blocks along its last (fastest) axis, read as float32 one block range at a time."""

    files: ByteStore
    file: str
    offset: int
    info: TensorInfo

    @property
    def encoding(self) -> dict[str, Any]:
        """The block format, as the CLI and the viewer show it."""
        info = self.info
        bits = info.type_size * 8 / info.block_size
        return {"format": info.ggml_type, "block_values": info.block_size, "block_bytes": info.type_size,
                "bits_per_value": bits, "stored_bytes": info.end - info.begin,
                "description": f"{info.ggml_type} ({info.block_size}-value blocks of {info.type_size} B, "
                               f"{bits:g} bits/value)"}

    def array(self) -> np.ndarray:
        """The whole tensor, dequantized."""
        out = np.empty(self.info.shape, np.float32)
        self.read_into(tuple(slice(0, n, 1) for n in self.info.shape), out)
        return out

    def read_into(self, index: tuple[slice, ...], target: np.ndarray) -> bool:
        """Dequantize the blocks that `index` (positive-step slices) touches into `target`."""
        if target.dtype != np.float32:
            return False
        info = self.info
        lead, last = index[:-1], index[-1]
        columns = np.arange(last.start, last.stop, last.step)
        if columns.size == 0 or any(len(range(s.start, s.stop, s.step)) == 0 for s in lead):
            return True
        blocks = np.unique(columns // info.block_size)
        first, final = int(blocks[0]), int(blocks[-1])
        contiguous = final - first + 1 == blocks.size
        positions = np.searchsorted(blocks, columns // info.block_size) * info.block_size + columns % info.block_size
        identity = contiguous and last.step == 1 and columns.size == blocks.size * info.block_size
        byte_shape = info.shape[:-1] + (info.shape[-1] // info.block_size * info.type_size,)
        block_bytes = slice(first * info.type_size, (final + 1) * info.type_size, 1)
        picked = slice(None) if contiguous else blocks - first  # within the blocks first..final that are fetched

        if not lead:
            values = self._decode(self._blocks(byte_shape, (block_bytes,))[..., picked, :], positions, identity)
            target[...] = values.reshape(target.shape)
            return True
        per_position = math.prod(len(range(s.start, s.stop, s.step)) for s in lead[1:]) * blocks.size
        rows = range(lead[0].start, lead[0].stop, lead[0].step)
        batch = max(1, DEQUANTIZE_BATCH // max(1, per_position * info.block_size))
        for i in range(0, len(rows), batch):
            part = rows[i:i + batch]
            box = (slice(part.start, part[-1] + 1, part.step),) + lead[1:]
            runs = byte_runs(self.offset, byte_shape, None, 1, box + (block_bytes,))
            self.files.advise(self.file, runs, "willneed")
            values = self._decode(self._blocks(byte_shape, box + (block_bytes,))[..., picked, :], positions, identity)
            target[i:i + len(part)] = values.reshape(target[i:i + len(part)].shape)
            self.files.advise(self.file, runs, "dontneed")
        return True

    def _blocks(self, byte_shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        """The stored bytes of `index` (rows, then a run of whole blocks), as (..., blocks, block bytes): a view of
        the mapped file, or fetched as ranged reads from a remote one."""
        info = self.info
        if self.files.mappable:
            stored = np.frombuffer(cast(memoryview, self.files.buffer(self.file)), np.uint8,
                                   count=info.end - info.begin, offset=self.offset).reshape(byte_shape)
            raw = stored[index]
        else:
            raw = read_strided(self.files, self.file, self.offset, byte_shape, None, np.dtype(np.uint8), index)
        return raw.reshape(raw.shape[:-1] + (raw.shape[-1] // info.type_size, info.type_size))

    def _decode(self, quantized: np.ndarray, positions: np.ndarray, identity: bool) -> np.ndarray:
        """Dequantize (..., blocks, block bytes) to (rows, values) and keep the selected columns."""
        info = self.info
        dequantize = _dequantizer()
        path = self.files.describe(self.file)
        if dequantize is None:
            raise UnsupportedError(f"is {info.ggml_type}-quantized; reading it needs the gguf package "
                                   "(pip install 'tensormorph[gguf]')", file=path, tensor=info.name)
        from gguf.constants import GGMLQuantizationType

        rows = np.ascontiguousarray(quantized).reshape(-1, quantized.shape[-2] * info.type_size)
        try:
            values = dequantize(rows, GGMLQuantizationType(info.type_id))
        except NotImplementedError:
            raise UnsupportedError(f"the installed gguf package cannot dequantize {info.ggml_type}",
                                   file=path, tensor=info.name) from None
        return values if identity else values[:, positions]

