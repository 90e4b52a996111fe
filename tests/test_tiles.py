"""LOD tiles equal numpy: exact block aggregates, strided samples, the binary encoding and histograms.

The tensors come from a real checkpoint (the `viewer_pair` fixture: MiniLM and small tensors of known
content saved by DCP on 4 gloo ranks); the reference is computed here from the ground-truth arrays with
plain numpy, one block at a time.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph.core import Chunk, LogicalTensor
from tensormorph.errors import CheckpointError
from tensormorph.ops import tiles as tiles_module
from tensormorph.ops.tiles import MAX_PIXELS, View, histogram, tile

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------
# numpy reference (shared with test_server and test_browser)
# ---------------------------------------------------------------------------


def view_of(full: np.ndarray, axes: tuple[int, int] | None = None, fixed: tuple[int, ...] = ()) -> np.ndarray:
    """The 2-D view of the viewer API as float64: 0-D -> 1x1, 1-D -> 1xn, else rows=axes[0], cols=axes[1]."""
    values = np.asarray(full).astype(np.float64)
    if values.ndim == 0:
        return values.reshape(1, 1)
    if values.ndim == 1:
        return values.reshape(1, -1)
    axes = axes if axes is not None else (values.ndim - 2, values.ndim - 1)
    fixed = tuple(fixed) if fixed else (0,) * (values.ndim - 2)
    moved = np.moveaxis(values, list(axes), [0, 1])  # the other axes keep their order after these two
    return moved[(slice(None), slice(None)) + tuple(fixed)]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def reference_flags(region: np.ndarray, sy: int, sx: int) -> np.ndarray:
    """The "nonfinite" field: per block, 1 if it holds a NaN, | 2 for a +Inf, | 4 for a -Inf."""
    out = np.zeros((ceil_div(region.shape[0], sy), ceil_div(region.shape[1], sx)), np.float32)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            block = region[i * sy:(i + 1) * sy, j * sx:(j + 1) * sx]
            out[i, j] = 1 * np.isnan(block).any() + 2 * (block == np.inf).any() + 4 * (block == -np.inf).any()
    return out


def with_flags(fields: dict[str, np.ndarray], flags: np.ndarray) -> dict[str, np.ndarray]:
    """A tile's fields end with "nonfinite" when any block holds a NaN or Inf (docs/viewer-api.md)."""
    return {**fields, "nonfinite": flags} if flags.any() else fields


def reference_tile(view: np.ndarray, r0: int, r1: int, c0: int, c1: int, h: int, w: int,
                   exact: bool, complete: bool = True) -> dict[str, Any]:
    """What a tile must hold, block by block: {"step", "fields": {name: float32 array}, "nan", "inf", "data"}.
    `complete`: an approximate tile's flags cover whole blocks (the server knows the tensor's non-finite
    positions), not only its samples."""
    sy, sx = ceil_div(r1 - r0, h), ceil_div(c1 - c0, w)
    region = view[r0:r1, c0:c1]
    if (sy, sx) == (1, 1) or not exact:
        sample = region[::sy, ::sx]
        flags = reference_flags(region, sy, sx) if complete else reference_flags(sample, 1, 1)
        return {"step": (sy, sx), "fields": with_flags({"value": sample.astype(np.float32)}, flags),
                "nan": int(np.isnan(sample).sum()), "inf": int(np.isinf(sample).sum()), "data": sample}
    rows, cols = ceil_div(r1 - r0, sy), ceil_div(c1 - c0, sx)
    out = {k: np.empty((rows, cols), np.float64) for k in ("mean", "min", "max", "absmax")}
    for i in range(rows):
        for j in range(cols):
            block = region[i * sy:(i + 1) * sy, j * sx:(j + 1) * sx]
            kept = block[~np.isnan(block)]  # NaN is skipped; +-inf counts
            if kept.size == 0:
                for k in out:
                    out[k][i, j] = np.nan
                continue
            with np.errstate(invalid="ignore"):
                out["mean"][i, j] = kept.sum() / kept.size
            out["min"][i, j], out["max"][i, j] = kept.min(), kept.max()
            out["absmax"][i, j] = np.abs(kept).max()
    return {"step": (sy, sx), "fields": with_flags({k: v.astype(np.float32) for k, v in out.items()},
                                                   reference_flags(region, sy, sx)),
            "nan": int(np.isnan(region).sum()), "inf": int(np.isinf(region).sum()), "data": region}


def assert_fields_equal(fields: dict[str, np.ndarray], expected: dict[str, Any]) -> None:
    """min/max/absmax/value bit-exact (NaN where NaN); the mean within float32 rounding of a float64 sum."""
    want = expected["fields"]
    assert list(fields) == list(want)
    for key, values in fields.items():
        assert values.dtype == np.float32 and values.shape == want[key].shape, key
        if key == "mean":
            scale = float(np.nanmax(np.abs(want[key]), initial=0.0, where=np.isfinite(want[key])))
            np.testing.assert_allclose(values, want[key], rtol=1e-6, atol=1e-7 * max(scale, 1e-30), err_msg=key)
            assert np.array_equal(np.isnan(values), np.isnan(want[key])), key
        else:
            np.testing.assert_array_equal(values, want[key], err_msg=key)


def decode_tile(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Decode the binary tile format of docs/viewer-api.md, checking that nothing is left over."""
    (n,) = struct.unpack_from("<I", data, 0)
    header = json.loads(data[4:4 + n])
    rows, cols = header["shape"]
    body = data[4 + n:]
    size = rows * cols * 4
    assert len(body) == size * len(header["fields"]), (len(body), header)
    fields = {name: np.frombuffer(body[k * size:(k + 1) * size], dtype="<f4").reshape(rows, cols)
              for k, name in enumerate(header["fields"])}
    return header, fields


def check_tile(t: Any, view: np.ndarray, region: tuple[int, ...], exact: bool) -> dict[str, Any]:
    """Assert a Tile (object) equals the numpy reference; returns the reference."""
    r0, r1, c0, c1, h, w = region
    expected = reference_tile(view, r0, r1, c0, c1, h, w, exact, complete=False)  # no non-finite positions given
    sy, sx = expected["step"]
    assert t.step == (sy, sx)
    assert t.rows == (r0, r1) and t.cols == (c0, c1) and t.view_shape == view.shape
    assert t.shape == (ceil_div(r1 - r0, sy), ceil_div(c1 - c0, sx))
    assert t.approximate == (not exact and (sy, sx) != (1, 1))
    assert (t.nan, t.inf) == (expected["nan"], expected["inf"])
    assert t.nonfinite_complete is (not t.approximate)
    assert_fields_equal(with_flags(t.fields, t.mask.astype(np.float32) if t.mask is not None else np.zeros(1)),
                        expected)
    return expected


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ck(viewer_pair):
    with tm.open(viewer_pair[0]) as checkpoint:
        yield checkpoint


@pytest.fixture(scope="module")
def truth(viewer_pair, fixture_builders) -> dict[str, np.ndarray]:
    return fixture_builders.load_expected(fixture_builders.expected_paths(viewer_pair[0])[0])


# name, axes, fixed, region (r0, r1, c0, c1, h, w); None for r1/c1 = the view's edge
CASES = {
    "f32-pattern-ragged": ("model.pattern", None, (), (0, None, 0, None, 5, 7)),
    "f32-minilm-across-chunks": ("model.encoder.layer.0.intermediate.dense.weight", None, (),
                                 (0, None, 0, None, 90, 50)),
    "f32-minilm-embeddings": ("model.embeddings.word_embeddings.weight", None, (), (1000, 3001, 10, 300, 64, 61)),
    "bf16": ("model.extra.bf16", None, (), (3, 24, 5, 37, 4, 6)),
    "i64": ("model.extra.ids", None, (), (0, None, 0, None, 6, 7)),
    "nan-inf-all-nan-block": ("model.extra.nonfinite", None, (), (0, None, 0, None, 9, 8)),
    "1d-strip": ("model.extra.strip", None, (), (0, 1, 0, None, 1, 33)),
    "1d-strip-inner": ("model.extra.strip", None, (), (0, 1, 245, 777, 4, 50)),
    "3d-default-axes": ("model.extra.cube", None, (4,), (0, None, 0, None, 3, 4)),
    "3d-transposed-axes": ("model.extra.cube", (2, 0), (7,), (1, None, 0, None, 5, 4)),
    "3d-axes-0-1": ("model.extra.cube", (0, 1), (13,), (0, None, 2, None, 4, 3)),
    "3d-axes-1-0": ("model.extra.cube", (1, 0), (5,), (0, None, 0, None, 4, 5)),
    "0d": ("model.extra.scalar", None, (), (0, None, 0, None, 1, 1)),
}


def _case(ck, truth, case: str) -> tuple[View, np.ndarray, tuple[int, ...]]:
    name, axes, fixed, (r0, r1, c0, c1, h, w) = CASES[case]
    view = View.of(ck[name], axes, fixed)
    reference = view_of(truth[name], axes, fixed)
    assert view.shape == reference.shape
    height, width = view.shape
    return view, reference, (r0, height if r1 is None else r1, c0, width if c1 is None else c1, h, w)


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_exact_tile_aggregates_equal_numpy(ck, truth, case):
    view, reference, region = _case(ck, truth, case)
    t = tile(view, *region, exact=True)
    expected = check_tile(t, reference, region, exact=True)
    if expected["step"] != (1, 1):
        assert list(t.fields) == ["mean", "min", "max", "absmax"] and not t.approximate


@pytest.mark.parametrize("case", CASES)
def test_approximate_tile_is_the_strided_sample(ck, truth, case):
    view, reference, region = _case(ck, truth, case)
    t = tile(view, *region, exact=False)
    expected = check_tile(t, reference, region, exact=False)
    assert list(t.fields) == ["value"]
    r0, r1, c0, c1, _, _ = region
    sy, sx = expected["step"]
    # the first element of each block, bit for bit
    np.testing.assert_array_equal(t.fields["value"], reference[r0:r1:sy, c0:c1:sx].astype(np.float32))


@pytest.mark.parametrize("case", ["bf16", "i64", "nan-inf-all-nan-block", "3d-transposed-axes", "0d", "1d-strip"])
def test_step_one_gives_exact_values_only(ck, truth, case):
    view, reference, (r0, r1, c0, c1, _, _) = _case(ck, truth, case)
    for exact in (True, False):
        t = tile(view, r0, r1, c0, c1, r1 - r0 + 3, c1 - c0, exact=exact)
        assert t.step == (1, 1) and list(t.fields) == ["value"] and not t.approximate
        np.testing.assert_array_equal(t.fields["value"], reference[r0:r1, c0:c1].astype(np.float32))


def test_nonfinite_counts_and_known_cells(ck, truth):
    view = View.of(ck["model.extra.nonfinite"])
    t = tile(view, 0, 33, 0, 47, 9, 8, exact=True)
    assert (t.nan, t.inf) == (4 * 6 + 1, 3)  # the NaN corner and one NaN; +inf twice, -inf once
    assert t.step == (4, 6)
    assert all(np.isnan(t.fields[k][0, 0]) for k in t.fields)  # an all-NaN block stays NaN
    assert t.fields["max"][5, 5] == np.inf and t.fields["mean"][5, 5] == np.inf  # [20, 30] is +inf
    assert t.fields["min"][7, 7] == -np.inf and t.fields["absmax"][7, 7] == np.inf  # [31, 46] is -inf
    # the block holding the single NaN at [10, 5]: aggregates over its other 23 values
    block = truth["model.extra.nonfinite"][8:12, 0:6].astype(np.float64)
    assert t.fields["min"][2, 0] == np.float32(np.nanmin(block))
    assert t.fields["mean"][2, 0] == pytest.approx(np.nanmean(block), rel=1e-6)


def test_rank_view_tiles_that_ranks_chunk(ck, truth):
    pattern = ck["model.pattern"]
    for rank in range(4):
        local = View.of(pattern.local_tensor(rank))
        assert local.shape == (16, 128)
        t = tile(local, 0, 16, 0, 128, 16, 128, exact=True)
        np.testing.assert_array_equal(t.fields["value"], truth["model.pattern"][16 * rank:16 * (rank + 1)])


def test_header_counts_and_encoding_round_trip(ck, truth):
    view, reference, region = _case(ck, truth, "nan-inf-all-nan-block")
    for exact in (True, False):
        t = tile(view, *region, exact=exact)
        header, fields = decode_tile(t.encode())
        assert header == t.header()
        assert header["name"] == "model.extra.nonfinite" and header["view_shape"] == [33, 47]
        assert header["rows"] == [0, 33] and header["cols"] == [0, 47] and header["step"] == [4, 6]
        assert header["shape"] == [9, 8] and header["approximate"] is (not exact)
        flagged = ["nonfinite"] if header["nonfinite_cells"] else []  # blocks holding a NaN or Inf (issue 20)
        assert header["fields"] == (["mean", "min", "max", "absmax"] if exact else ["value"]) + flagged
        assert (header["nan"], header["inf"]) == (t.nan, t.inf)
        for key in t.fields:  # the same float32 bits, NaN included
            assert fields[key].tobytes() == t.fields[key].astype("<f4").tobytes()


def test_header_min_max_of_step_one_tile_are_finite_extremes(ck, truth):
    view = View.of(ck["model.extra.nonfinite"])
    header = tile(view, 0, 33, 0, 47, 33, 47, exact=True).header()
    finite = truth["model.extra.nonfinite"][np.isfinite(truth["model.extra.nonfinite"])].astype(np.float32)
    assert (header["min"], header["max"]) == (float(finite.min()), float(finite.max()))


def test_header_min_max_of_exact_tile_are_the_regions_extremes(ck, truth):
    view = View.of(ck["model.extra.cube"], None, (0,))
    region = truth["model.extra.cube"][0].astype(np.float32)
    assert -region.min() > region.max()  # the case that matters: |min| > max
    header = tile(view, 0, 10, 0, 14, 3, 3, exact=True).header()
    assert (header["min"], header["max"]) == (float(region.min()), float(region.max()))


def test_bad_regions_and_views_raise(ck):
    view = View.of(ck["model.pattern"])
    for region in [(0, 0, 0, 10, 4, 4), (5, 4, 0, 10, 4, 4), (0, 65, 0, 10, 4, 4), (-1, 4, 0, 10, 4, 4),
                   (0, 4, 0, 129, 4, 4), (0, 4, 0, 10, 0, 4), (0, 4, 0, 10, 4, -1),
                   (0, 4, 0, 10, MAX_PIXELS, 2)]:
        with pytest.raises(CheckpointError):
            tile(view, *region)
    cube, scalar = ck["model.extra.cube"], ck["model.extra.scalar"]
    for axes, fixed in [((0, 0), ()), ((0, 3), ()), ((-1, 0), ()), (None, (6,)), (None, (0, 0)), ((2, 0), (10,))]:
        with pytest.raises(CheckpointError):
            View.of(cube, axes, fixed)
    with pytest.raises(CheckpointError):
        View.of(scalar, (0, 1))


def test_histogram_counts_equal_numpy(ck, truth):
    for name in ("model.encoder.layer.2.output.dense.weight", "model.extra.nonfinite", "model.extra.ids",
                 "model.extra.bf16"):
        values = truth[name].astype(np.float64).ravel()
        finite = values[np.isfinite(values)]
        low, high = float(finite.min()), float(finite.max())
        for bins in (1, 7, 64):
            got = histogram(ck[name], low, high, bins=bins, band_bytes=4096)
            edges = np.linspace(low, high, bins + 1)
            np.testing.assert_array_equal(got["edges"], edges)
            assert got["counts"] == np.histogram(finite, bins=edges)[0].tolist()
            assert sum(got["counts"]) == finite.size
        got = histogram(ck[name], low, high, bins=32, log=True)
        edges = np.asarray(got["edges"])
        top = max(abs(low), abs(high))
        assert edges[-1] == pytest.approx(top) and edges[0] == pytest.approx(top * 1e-8)
        assert np.all(np.diff(np.log(edges)) == pytest.approx(np.log(edges[1] / edges[0])))  # log-spaced
        magnitudes = np.clip(np.abs(finite), edges[0], edges[-1])  # zeros fall in the first bin
        assert got["counts"] == np.histogram(magnitudes, bins=edges)[0].tolist()
        assert sum(got["counts"]) == finite.size


def test_histogram_of_a_constant_tensor(ck):
    got = histogram(ck["model.extra.scalar"], 3.25, 3.25, bins=4)
    assert got["edges"] == np.linspace(3.25, 4.25, 5).tolist() and got["counts"] == [1, 0, 0, 0]


# ---------------------------------------------------------------------------
# property tests
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _InMemory:
    """A chunk's data held in memory (the ChunkSource protocol)."""

    data: np.ndarray

    def array(self) -> np.ndarray:
        return self.data


@st.composite
def chunked_tensors(draw) -> tuple[LogicalTensor, np.ndarray]:
    """A 2-D or 3-D float tensor (NaN/inf sprinkled) split into a random grid of chunks, some empty."""
    ndim = draw(st.integers(2, 3))
    shape = tuple(draw(st.lists(st.integers(1, 24), min_size=ndim, max_size=ndim)))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    full = rng.standard_normal(shape).astype(np.float32) * 10
    specials = draw(st.lists(st.sampled_from([np.nan, np.inf, -np.inf]), max_size=6))
    for value in specials:
        full[tuple(int(rng.integers(0, n)) for n in shape)] = value
    cuts = [sorted(draw(st.lists(st.integers(0, n), max_size=3)) + [0, n]) for n in shape]
    chunks = []
    for box in np.ndindex(*[len(c) - 1 for c in cuts]):
        lo = tuple(c[i] for c, i in zip(cuts, box))
        hi = tuple(c[i + 1] for c, i in zip(cuts, box))
        part = full[tuple(slice(a, b) for a, b in zip(lo, hi))].copy()
        chunks.append(Chunk(lo, part.shape, None, None, _InMemory(part), ranks=(len(chunks),)))
    return LogicalTensor("prop", "F32", shape, tuple(chunks)), full


@st.composite
def regions(draw, height: int, width: int) -> tuple[int, ...]:
    r0 = draw(st.integers(0, height - 1))
    r1 = draw(st.integers(r0 + 1, height))
    c0 = draw(st.integers(0, width - 1))
    c1 = draw(st.integers(c0 + 1, width))
    return r0, r1, c0, c1, draw(st.integers(1, r1 - r0 + 2)), draw(st.integers(1, c1 - c0 + 2))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_property_tiles_over_random_chunkings(data):
    tensor, full = data.draw(chunked_tensors())
    axes = tuple(data.draw(st.permutations(range(tensor.ndim)))[:2])
    others = [d for d in range(tensor.ndim) if d not in axes]
    fixed = tuple(data.draw(st.integers(0, tensor.shape[d] - 1)) for d in others)
    view = View.of(tensor, axes, fixed)
    reference = view_of(full, axes, fixed)
    region = data.draw(regions(*view.shape))
    exact = data.draw(st.booleans())
    band_bytes = data.draw(st.integers(8, 4096))  # tiny bands: many partial reads across chunk edges
    check_tile(tile(view, *region, exact=exact, band_bytes=band_bytes), reference, region, exact)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_tiles_of_the_real_checkpoint(ck, truth, data):
    name = data.draw(st.sampled_from(["model.extra.nonfinite", "model.extra.ids", "model.extra.bf16",
                                      "model.extra.cube", "model.extra.strip",
                                      "model.encoder.layer.5.attention.self.value.weight"]))
    tensor = ck[name]
    axes, fixed = None, ()
    if tensor.ndim == 3:
        axes = tuple(data.draw(st.permutations(range(3)))[:2])
        other = next(d for d in range(3) if d not in axes)
        fixed = (data.draw(st.integers(0, tensor.shape[other] - 1)),)
    view = View.of(tensor, axes, fixed)
    region = data.draw(regions(*view.shape))
    exact = data.draw(st.booleans())
    t = tile(view, *region, exact=exact, band_bytes=data.draw(st.sampled_from([64, 1000, 2**20])))
    check_tile(t, view_of(truth[name], axes, fixed), region, exact)
    header, fields = decode_tile(t.encode())
    assert header["shape"] == list(t.shape)
    sent = {**t.fields, **({"nonfinite": t.mask.astype(np.float32)} if t.mask is not None and t.flagged else {})}
    assert list(fields) == list(sent)
    for key, values in fields.items():
        assert values.tobytes() == sent[key].tobytes()


@pytest.mark.parametrize("threads", [1, 4])
def test_exact_tiles_are_the_same_read_band_by_band_or_in_parallel(ck, monkeypatch, threads):
    """Bands reduced in threads give the very tile one thread gives: each band's blocks are its own."""
    view = View.of(ck["model.encoder.layer.0.intermediate.dense.weight"])
    h, w = view.shape
    monkeypatch.setattr(tiles_module, "TILE_THREADS", 1)
    serial = tile(view, 0, h, 0, w, 37, 29, exact=True, band_bytes=64 * 1024)
    monkeypatch.setattr(tiles_module, "TILE_THREADS", threads)
    again = tile(view, 0, h, 0, w, 37, 29, exact=True, band_bytes=64 * 1024)
    assert serial.encode() == again.encode()


def test_a_compressed_chunk_is_tiled_one_band_at_a_time(dcp_zstd_ckpt, dcp_ckpt):
    """A zstd DCP item is decompressed whole on every read: bands in flight at once would each hold one."""
    with tm.open(dcp_zstd_ckpt) as compressed, tm.open(dcp_ckpt) as plain:
        name = next(n for n, t in plain.items() if t.ndim == 2)
        assert tiles_module._threads(View.of(compressed[name]), None) == 1
        assert tiles_module._threads(View.of(plain[name]), None) == tiles_module.TILE_THREADS
        assert tiles_module._threads(View.of(plain[name]), lambda rows, cols: np.zeros(1)) == 1  # the diff's own reader
