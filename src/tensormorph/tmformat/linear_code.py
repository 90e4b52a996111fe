"""zfec's Reed-Solomon code, block by block: applied by a SIMD kernel where it is built, else by zfec itself.

zfec codes at about 1 GB/s per core, so a save with `rs(k,m)` parity, a rebuild and a degraded load spend about as
much CPU as disk time. Every block zfec makes is a linear combination of the blocks it is given, so the
coefficients are read off zfec itself, by coding blocks of one byte that are 1 in one place and 0 elsewhere; the
native `_gf256.mul_add` (csrc/gf256/, built with the package where a C compiler is) applies them to whole segments
with table lookups in AVX2 registers, several times faster. Without the native module, zfec codes as before. The
bytes are the same either way (tests/test_linear_code.py), so files written either way read either way.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import lru_cache

import zfec

try:
    from . import _gf256  # type: ignore[attr-defined]  # the optional native kernel (setup.py)
except ImportError:  # built without a C compiler: zfec codes every segment
    _gf256 = None


BytesLike = bytes | bytearray | memoryview  # blocks come from reads, memory maps and buffers alike


def available() -> bool:
    return _gf256 is not None


def _unit(k: int, place: int) -> list[bytes]:
    return [b"\x01" if i == place else b"\x00" for i in range(k)]


class _Coders(threading.local):
    """zfec coders of one (k, n), one set per thread: coding calls run on several threads at once."""

    def __init__(self, k: int, n: int):
        self.encoder, self.decoder = zfec.Encoder(k, n), zfec.Decoder(k, n)


def _zfec_block(coders: _Coders, k: int, inputs: tuple[int, ...], output: int, blocks: Sequence[BytesLike]) -> bytes:
    """Block `output` of zfec's (k, n) code from the k blocks numbered `inputs`, by zfec."""
    blocks = [bytes(b) if isinstance(b, memoryview) else b for b in blocks]
    primaries = list(blocks) if inputs == tuple(range(k)) else list(coders.decoder.decode(blocks, inputs))
    return bytes(primaries[output] if output < k else coders.encoder.encode(primaries, (output,))[0])


@lru_cache(maxsize=1024)
def row(k: int, n: int, inputs: tuple[int, ...], output: int) -> bytes:
    """The coefficients that make block `output` of zfec's (k, n) code from the k blocks numbered `inputs`."""
    coders = _Coders(k, n)
    return bytes(_zfec_block(coders, k, inputs, output, _unit(k, place))[0] for place in range(k))


def combine(coefficients: bytes, blocks: Sequence[BytesLike]) -> bytearray:
    """The sum over i of coefficients[i] * blocks[i] in GF(2^8), for blocks of one length (the kernel must be built)."""
    assert _gf256 is not None
    out = bytearray(len(blocks[0]))
    _gf256.mul_add(coefficients, blocks, [out])
    return out


class Code:
    """Block `output` of zfec's (k, n) code from the k blocks numbered `inputs` (parity: the primaries 0..k-1; a
    rebuild: any k intact blocks), segment after segment, on any thread."""

    def __init__(self, k: int, n: int, inputs: Sequence[int], output: int):
        self.k, self.inputs, self.output = k, tuple(inputs), output
        self._row = row(k, n, self.inputs, output) if available() else b""
        self._coders = None if available() else _Coders(k, n)

    def apply(self, blocks: Sequence[BytesLike]) -> bytes:
        if self._coders is None:
            return bytes(combine(self._row, blocks))
        return _zfec_block(self._coders, self.k, self.inputs, self.output, blocks)

    def apply_into(self, blocks: Sequence[memoryview], out: memoryview) -> None:
        """`apply` written into `out` (as long as each block): the kernel writes there without a copy."""
        if self._coders is None:
            assert _gf256 is not None
            _gf256.mul_add(self._row, blocks, [out])
        else:
            out[:] = _zfec_block(self._coders, self.k, self.inputs, self.output, blocks)


class ParityRows:
    """All m parity blocks of zfec's (k, k + m) code from the k primary blocks at once: one pass over the inputs
    (a rank encoding its share of a stripe makes every parity file's part of it)."""

    def __init__(self, k: int, m: int):
        self.k, self.m = k, m
        self._matrix = b"".join(row(k, k + m, tuple(range(k)), k + j) for j in range(m)) if available() else b""
        self._coders = None if available() else _Coders(k, k + m)

    def apply(self, blocks: Sequence[BytesLike]) -> list[bytes | bytearray]:
        if self._coders is None:
            assert _gf256 is not None
            out: list[bytes | bytearray] = [bytearray(len(blocks[0])) for _ in range(self.m)]
            _gf256.mul_add(self._matrix, blocks, out)
            return out
        blocks = [bytes(b) if isinstance(b, memoryview) else b for b in blocks]
        return list(self._coders.encoder.encode(blocks, tuple(range(self.k, self.k + self.m))))
