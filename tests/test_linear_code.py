"""zfec's Reed-Solomon code applied by the native GF(2^8) kernel (tmformat/linear_code.py, csrc/gf256/): the same
bytes as zfec for every parity block and every rebuild, whatever k, m and length, so files written with or without
the kernel read with or without it."""

from __future__ import annotations

import itertools
import shutil

import pytest
import zfec
from hypothesis import given, settings
from hypothesis import strategies as st

from tensormorph.tmformat import linear_code

pytestmark = pytest.mark.skipif(not linear_code.available() and shutil.which("cc") is None,
                                reason="GF(2^8) KERNEL NOT BUILT: no C compiler when the package was installed")


def test_the_kernel_is_built_where_a_compiler_is() -> None:
    assert linear_code.available(), "a C compiler is here, but tensormorph.tmformat._gf256 is not"


@settings(max_examples=80, deadline=None)
@given(k=st.integers(1, 12), m=st.integers(1, 6), length=st.sampled_from([1, 7, 31, 32, 33, 64, 4095, 4097, 9001]),
       data=st.data())
def test_parity_blocks_are_zfecs(k: int, m: int, length: int, data: st.DataObject) -> None:
    blocks = [data.draw(st.binary(min_size=length, max_size=length)) for _ in range(k)]
    want = [bytes(b) for b in zfec.Encoder(k, k + m).encode(blocks, tuple(range(k, k + m)))]
    primaries = tuple(range(k))
    assert [bytes(linear_code.combine(linear_code.row(k, k + m, primaries, k + j), blocks)) for j in range(m)] == want


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 8), m=st.integers(1, 4), length=st.sampled_from([1, 33, 4097]), data=st.data())
def test_every_block_is_rebuilt_from_any_k_others(k: int, m: int, length: int, data: st.DataObject) -> None:
    primaries = [data.draw(st.binary(min_size=length, max_size=length)) for _ in range(k)]
    every = primaries + [bytes(b) for b in zfec.Encoder(k, k + m).encode(primaries, tuple(range(k, k + m)))]
    chosen = tuple(sorted(data.draw(st.permutations(range(k + m)))[:k]))
    for target in range(k + m):
        row = linear_code.row(k, k + m, chosen, target)
        assert bytes(linear_code.combine(row, [every[i] for i in chosen])) == every[target]


def test_rs_4_2_over_4_mib_segments_equals_zfec() -> None:
    """The writer's own code and segment: rs(4,2) over 4 MiB (the kernel's vector loop and its chunking)."""
    import random

    rng = random.Random(7)
    blocks = [rng.randbytes(4 << 20) for _ in range(4)]
    want = zfec.Encoder(4, 6).encode(blocks, (4, 5))
    for j in range(2):
        assert bytes(linear_code.combine(linear_code.row(4, 6, (0, 1, 2, 3), 4 + j), blocks)) == bytes(want[j])
    for chosen in itertools.combinations(range(6), 4):
        every = blocks + [bytes(w) for w in want]
        lost = next(i for i in range(6) if i not in chosen)
        row = linear_code.row(4, 6, chosen, lost)
        assert bytes(linear_code.combine(row, [every[i] for i in chosen])) == every[lost]


def test_without_the_kernel_zfec_codes_the_same_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """linear_code.Code, with the kernel and without it (zfec per segment): the same parity and rebuilt blocks."""
    import random

    rng = random.Random(3)
    blocks = [rng.randbytes(9001) for _ in range(4)]
    every = blocks + [bytes(b) for b in zfec.Encoder(4, 6).encode(blocks, (4, 5))]
    cases = [((0, 1, 2, 3), 4), ((0, 1, 2, 3), 5), ((1, 2, 4, 5), 0), ((0, 2, 3, 5), 4)]
    with_kernel = [linear_code.Code(4, 6, inputs, output).apply([every[i] for i in inputs]) for inputs, output in cases]
    monkeypatch.setattr(linear_code, "_gf256", None)
    without = [linear_code.Code(4, 6, inputs, output).apply([every[i] for i in inputs]) for inputs, output in cases]
    assert with_kernel == without == [every[output] for _, output in cases]
