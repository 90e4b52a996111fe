"""zfec's Reed-Solomon codes as rows of GF(2^8) coefficients, applied to whole segments by a SIMD kernel.

zfec codes at about 1 GB/s per core, so a save with `rs(k,m)` parity, a rebuild and a degraded load spend about as
much CPU as disk time. Every block zfec makes is a linear combination of the blocks it is given, so the
coefficients are read off zfec itself, by coding blocks of one byte that are 1 in one place and 0 elsewhere; the
native `_gf256.mul_add` (csrc/gf256/, built with the package where a C compiler is) applies them to whole segments
with table lookups in AVX2 registers, several times faster. Without the native module, zfec codes as before. The
bytes are the same either way (tests/test_linear_code.py), so files written either way read either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import zfec

try:
    from . import _gf256  # type: ignore[attr-defined]  # the optional native kernel (setup.py)
except ImportError:  # built without a C compiler: zfec codes every segment
    _gf256 = None


def available() -> bool:
    return _gf256 is not None


def _unit(k: int, place: int) -> list[bytes]:
    return [b"\x01" if i == place else b"\x00" for i in range(k)]


@lru_cache(maxsize=1024)
def encode_row(k: int, n: int, index: int) -> bytes:
    """The coefficients that make block `index` (k <= index < n) of zfec's code from the k primary blocks."""
    encoder = zfec.Encoder(k, n)
    return bytes(encoder.encode(_unit(k, i), (index,))[0][0] for i in range(k))


@lru_cache(maxsize=1024)
def rebuild_row(k: int, n: int, chosen: tuple[int, ...], target: int) -> bytes:
    """The coefficients that make block `target` of zfec's code from the k blocks numbered `chosen`."""
    decoder, encoder = zfec.Decoder(k, n), zfec.Encoder(k, n)
    row = []
    for place in range(k):
        primaries = list(decoder.decode(_unit(k, place), chosen))
        block = primaries[target] if target < k else encoder.encode(primaries, (target,))[0]
        row.append(block[0])
    return bytes(row)


def combine(row: bytes, blocks: Sequence[bytes]) -> bytearray:
    """The sum over i of row[i] * blocks[i] in GF(2^8), for blocks of one length (the native kernel must be built)."""
    assert _gf256 is not None
    out = bytearray(len(blocks[0]))
    _gf256.mul_add(row, blocks, [out])
    return out
