"""CRC-32C of the Tensormorph format, computed while bytes go out and verified as they come in.

Writing: `RunningCrc` follows a whole file, `BlockCrcs` the CHECKSUM_BLOCK-sized blocks of one chunk.
Reading: `verify_blocks` is the one verifier of chunk blocks, used by `tm.open` region reads and by
`tm.load` alike.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import crc32c
import numpy as np

from ..errors import CheckpointError

CHECKSUM_BLOCK = 64 * 1024  # checksums cover 64 KiB blocks of each chunk: a partial read is verified by
# reading at most the rest of the blocks it touches


class RunningCrc:
    """Size and CRC-32C of a byte stream, updated as it is written."""

    def __init__(self) -> None:
        self.size = 0
        self.value = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self.value = crc32c.crc32c(data, self.value)
        self.size += len(data)

    def passing(self, chunks: Iterable[bytes | bytearray | memoryview]) -> Iterator[bytes | bytearray | memoryview]:
        """`chunks` unchanged, counted on their way through."""
        for chunk in chunks:
            self.update(chunk)
            yield chunk


_CASTAGNOLI = 0x82F63B78  # CRC-32C's polynomial, bit-reflected as the CRC computes it


def _times(a: int, b: int) -> int:
    """a * b modulo the polynomial, both bit-reflected (x^0 is the top bit)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _CASTAGNOLI if b & 1 else b >> 1
    return product


def _powers_of_x() -> list[int]:
    """x^(2^n) modulo the polynomial, n = 0..63 (the shift by 2^n bits; lengths below 2^61 bytes). Unlike zlib's
    CRC-32 polynomial, CRC-32C's x has no period 2^32 - 1 (x^(2^32) is x^2), so the table cannot wrap at 32."""
    powers = [1 << 30]  # x^1
    for _ in range(63):
        powers.append(_times(powers[-1], powers[-1]))
    return powers


_X_TO_2N = _powers_of_x()


def crc32c_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32C of A + B from A's CRC `first`, B's CRC `second` and B's length: parts of one file written by
    several processes are checksummed whole without reading them again (the method of zlib's crc32_combine:
    A's CRC shifted by 8 * len(B) zero bits, multiplied in as x^(8 * len(B)) by squaring, then B's added)."""
    if not 0 <= second_length < 1 << 61:
        raise ValueError(f"a part of {second_length} bytes: crc32c_combine takes lengths from 0 to 2^61 - 1")
    shift, n, exponent = 1 << 31, second_length, 3  # x^0; the length counts bytes: 2^3 bits each
    while n:
        if n & 1:
            shift = _times(_X_TO_2N[exponent], shift)
        n >>= 1
        exponent += 1
    return _times(shift, first) ^ second


class BlockCrcs:
    """The CRC-32C of every `block`-byte block of one chunk, fed in pieces of any size."""

    def __init__(self, block: int = CHECKSUM_BLOCK):
        self.block = block
        self.values: list[int] = []
        self._current = 0
        self._filled = 0

    def update(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            take = min(len(data) - done, self.block - self._filled)
            self._current = crc32c.crc32c(data[done:done + take], self._current)
            done += take
            self._filled += take
            if self._filled == self.block:
                self.values.append(self._current)
                self._current, self._filled = 0, 0

    def finish(self) -> list[int]:
        if self._filled:
            self.values.append(self._current)
            self._current, self._filled = 0, 0
        return self.values


Run = tuple[int, int]


def verify_blocks(crcs: np.ndarray, nbytes: int, runs: Sequence[Run], held: memoryview | None,
                  read_gaps: Callable[[list[Run]], Sequence[bytes | memoryview]],
                  mismatch: Callable[[int, int, int, int], CheckpointError],
                  skip: set[int] | None = None) -> tuple[list[int], int]:
    """Check the CRC-32C of every block of a chunk that `runs` touch; returns (blocks checked, gap bytes read).

    `runs` are [begin, end) offsets within the chunk's `nbytes`, increasing. `held` holds their bytes one
    after another when the caller has read them already (only the gaps around them are then read through
    `read_gaps`), or is None (whole blocks are read). Blocks in `skip` were checked before and are passed
    over. `mismatch(begin, end, found, recorded)` builds the error for a damaged block.
    """
    pieces: dict[int, list[tuple[int, int, int]]] = {}  # block -> (begin, end, position in `held`)
    position_in_held = 0
    for begin, end in runs:
        position = begin
        while position < end:
            block = position // CHECKSUM_BLOCK
            stop = min(end, (block + 1) * CHECKSUM_BLOCK)
            if skip is None or block not in skip:
                pieces.setdefault(block, []).append((position, stop, position_in_held + position - begin))
            position = stop
        position_in_held += end - begin
    gaps: list[Run] = []
    for block, parts in pieces.items():
        position = block * CHECKSUM_BLOCK
        block_end = min((block + 1) * CHECKSUM_BLOCK, nbytes)
        if held is None:
            gaps.append((position, block_end))
            continue
        for begin, end, _ in parts:
            if begin > position:
                gaps.append((position, begin))
            position = end
        if position < block_end:
            gaps.append((position, block_end))
    fetched: dict[Run, bytes | memoryview] = dict(zip(gaps, read_gaps(gaps)))
    for block, parts in pieces.items():
        value, position = 0, block * CHECKSUM_BLOCK
        block_end = min((block + 1) * CHECKSUM_BLOCK, nbytes)
        if held is not None:
            for begin, end, offset in parts:
                if begin > position:
                    value = crc32c.crc32c(fetched[(position, begin)], value)
                value = crc32c.crc32c(held[offset:offset + end - begin], value)
                position = end
        if position < block_end:
            value = crc32c.crc32c(fetched[(position, block_end)], value)
        if value != crcs[block]:
            raise mismatch(block * CHECKSUM_BLOCK, block_end, value, int(crcs[block]))
        if skip is not None:
            skip.add(block)
    return list(pieces), sum(end - begin for begin, end in gaps)


FEW_CRCS = 64  # up to this many block checksums are packed by struct (a small chunk's): numpy's setup costs more


def pack_crcs(values: Any) -> str:
    """Block checksums as base64 of big-endian uint32s (compact: a 1 TiB checkpoint has 16 M blocks)."""
    if isinstance(values, np.ndarray) and values.dtype == np.uint32 and values.ndim == 1 and len(values) <= FEW_CRCS:
        return base64.b64encode(struct.pack(f">{len(values)}I", *values.tolist())).decode()
    return base64.b64encode(np.asarray(values, dtype=">u4").tobytes()).decode()


def unpack_crcs(text: str) -> np.ndarray:
    """The manifest's block checksums (pack_crcs) as uint32s; ValueError when not base64 of whole uint32s."""
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=">u4").astype(np.uint32)
