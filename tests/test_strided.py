"""read_strided: a region of a strided array read as ranged requests gives numpy's answer, fetching only the
selected elements' bytes (property-tested over shapes, storage orders and steps)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tensormorph.storage.strided import read_strided


class CountingStore:
    def __init__(self, data: bytes):
        self.data, self.fetched = data, 0

    def read_ranges(self, name: str, runs: list[tuple[int, int]]) -> list[bytes]:
        self.fetched += sum(end - begin for begin, end in runs)
        return [self.data[begin:end] for begin, end in runs]


@st.composite
def regions(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    order = draw(st.permutations(range(len(shape))))
    index = []
    for n in shape:
        start = draw(st.integers(0, n - 1))
        index.append(slice(start, draw(st.integers(start + 1, n)), draw(st.integers(1, 3))))
    return shape, list(order), tuple(index)


@settings(max_examples=300, deadline=None)
@given(regions())
def test_any_region_of_any_storage_order_reads_exactly_the_selected_elements(region):
    shape, order, index = region
    values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * 1.5
    stored = np.ascontiguousarray(values.transpose(order))  # the bytes as a transposed tensor keeps them
    view = stored.transpose(np.argsort(order))
    store = CountingStore(b"\x00" * 24 + stored.tobytes())
    got = read_strided(store, "f", 24, shape, view.strides, np.dtype(np.float32), index)
    expected = values[index]
    assert got.shape == expected.shape and got.tobytes() == np.ascontiguousarray(expected).tobytes()
    # whole rows between selected elements are fetched only where they are at most SPARSE elements apart
    assert store.fetched <= 2 * expected.size * 4 + 4


def test_a_row_of_a_transposed_tensor_and_a_large_step_fetch_only_what_they_need():
    a = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)
    store = CountingStore(a.tobytes())
    row = (slice(5, 6, 1), slice(0, 1024, 1))
    got = read_strided(store, "f", 0, (1024, 1024), a.T.strides, np.dtype(np.float32), row)
    assert np.array_equal(got, a.T[5:6]) and store.fetched == 4096
    v = np.arange(1 << 22, dtype=np.float32)
    store = CountingStore(v.tobytes())
    got = read_strided(store, "f", 0, v.shape, None, np.dtype(np.float32), (slice(0, 1 << 22, 4096),))
    assert np.array_equal(got, v[::4096]) and store.fetched == 4 * 1024
