"""Issue 20: find what matters (search, streamed and cancellable), non-finite cells flagged in every tile, the
shared colour scale, and compressed tiles; against numpy on the real `viewer_pair` (MiniLM by DCP on 4 ranks)
and on safetensors files written here."""

from __future__ import annotations

import gzip
import json
import threading
import time
from pathlib import Path

import httpx
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import zstandard
from starlette.testclient import TestClient
from test_tiles import assert_fields_equal, decode_tile, reference_flags, reference_tile, view_of

import tensormorph as tm
import tensormorph.server as server_module
import tensormorph.server_streams as streams_module
from tensormorph.ops.search import nonfinite, search, search_diff, search_steps
from tensormorph.ops.tiles import Tile
from tensormorph.server import create_app
from tensormorph.tile_cache import compress, negotiate

pytestmark = pytest.mark.timeout(120)

RENAME = ["a:model.="]
NONFINITE = "model.extra.nonfinite"  # 33 × 47, Shard(0) over 4 ranks: an all-NaN corner, one NaN, ±Inf


@pytest.fixture(scope="module")
def truth(viewer_pair, fixture_builders) -> dict[str, np.ndarray]:
    return fixture_builders.load_expected(fixture_builders.expected_paths(viewer_pair[0])[0])


@pytest.fixture(scope="module")
def client(viewer_pair, tmp_path_factory):
    with TestClient(create_app(list(viewer_pair), rename=RENAME, cache_dir=tmp_path_factory.mktemp("tiles"))) as c:
        yield c


@pytest.fixture(scope="module")
def spiky(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """One safetensors tensor of 300 × 257 normal values with NaN and ±Inf planted, and a bf16 copy."""
    values = np.random.default_rng(7).standard_normal((300, 257)).astype(np.float32)
    for index, value in [((10, 10), np.nan), ((123, 45), np.nan), ((200, 3), np.inf), ((250, 250), -np.inf),
                         ((77, 7), 99.0), ((5, 5), -120.0)]:
        values[index] = value
    path = tmp_path_factory.mktemp("spiky") / "m.safetensors"
    safetensors.numpy.save_file({"x": values, "h": values.astype(ml_dtypes.bfloat16)}, str(path))
    return path, values


def lines(response) -> list[dict]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


# ---------------------------------------------------------------------------
# the library search
# ---------------------------------------------------------------------------


def test_search_finds_the_true_elements_across_blocks(spiky):
    path, values = spiky
    finite = np.where(np.isfinite(values), values, np.nan)
    with tm.open(path) as ck:
        for block in (4096, 1 << 26):  # many blocks read ahead, and one
            x = ck["x"]
            assert search(x, "nan", block_bytes=block).index == (10, 10)
            assert search(x, "nan", skip=1, block_bytes=block).index == (123, 45)
            assert not search(x, "nan", skip=2, block_bytes=block).found
            found = search(x, "inf", block_bytes=block)
            assert (found.index, found.value) == ((200, 3), np.inf)
            assert search(x, "inf", skip=1, block_bytes=block).value == -np.inf
            for find, index in [("absmax", np.nanargmax(np.abs(finite))), ("min", np.nanargmin(finite)),
                                ("max", np.nanargmax(finite))]:
                result = search(x, find, block_bytes=block)
                want = np.unravel_index(index, values.shape)
                assert result.index == want and result.value == float(values[want]), find
            assert search(x, "max", block_bytes=block).bytes_read == values.nbytes
        bf16 = search(ck["h"], "absmax", block_bytes=512)  # bf16 searched as float32
        assert bf16.index == (5, 5) and bf16.value == -120.0


def test_nonfinite_positions_are_numpys(spiky, viewer_pair, truth):
    path, values = spiky
    with tm.open(path) as ck:
        found = nonfinite(ck["x"], block_bytes=4096)
    assert found.positions.tolist() == np.flatnonzero(~np.isfinite(values)).tolist()
    assert found.flags.tolist() == [1, 1, 2, 4] and (found.nan, found.inf, found.complete) == (2, 2, True)
    with tm.open(viewer_pair[0]) as ck:  # four chunks, one per rank
        capped = nonfinite(ck[NONFINITE], block_bytes=64, limit=5)
        whole = nonfinite(ck[NONFINITE], block_bytes=64)
    want = np.flatnonzero(~np.isfinite(truth[NONFINITE]))
    assert whole.positions.tolist() == want.tolist() and whole.complete
    assert capped.positions.size == 5 and not capped.complete and capped.nan + capped.inf == want.size


def test_search_steps_stop_reading_when_closed(spiky):
    path, values = spiky
    with tm.open(path) as ck:
        steps = search_steps(ck["x"], "max", block_bytes=1024)
        first = next(steps)
        assert first.bytes == 1024 and first.total == values.nbytes
        steps.close()  # waits for the one read in flight, then stops
        with pytest.raises(StopIteration):
            next(steps)


def test_search_diff_finds_the_nudged_element(viewer_pair, truth, fixture_builders):
    name, index, delta = fixture_builders.VIEWER_ALTERED
    with tm.open(viewer_pair[0]) as a, tm.open(viewer_pair[1]) as b:
        found = search_diff(a[f"model.{name}"], b[name], block_bytes=4096)
        same = search_diff(a[NONFINITE], b[NONFINITE[len("model."):]], "absdiff")  # equal sides, NaN skipped
        assert same.found and same.value == 0.0 and same.index == (0, 6)
    original = truth[f"model.{name}"][index]
    nudged = original + np.float32(delta)
    assert found.index == index and (found.a, found.b) == (float(original), float(nudged))
    assert found.value == abs(float(original) - float(nudged))


# ---------------------------------------------------------------------------
# the search endpoints
# ---------------------------------------------------------------------------


def test_search_endpoint_streams_the_true_index_and_where_to_look(client, truth):
    nan = np.argwhere(np.isnan(truth[NONFINITE]))  # row-major: the scan order of Shard(0) chunks
    for skip in (0, 5, len(nan) - 1):
        *_, done = lines(client.get("/api/checkpoints/a/search", params={"name": NONFINITE, "find": "nan",
                                                                         "skip": skip}))
        assert done["done"] and done["found"] and done["index"] == nan[skip].tolist() and done["value"] is None
        assert done["view"] == {"axes": [0, 1], "fixed": [], "row": int(nan[skip][0]), "col": int(nan[skip][1])}
    name = "model.encoder.layer.2.intermediate.dense.weight"
    values = truth[name]
    *progress, done = lines(client.get("/api/checkpoints/a/search", params={"name": name, "find": "absmax"}))
    want = np.unravel_index(np.argmax(np.abs(values)), values.shape)
    assert done["index"] == list(want) and done["value"] == float(values[want])
    assert all(p["progress"]["total"] == values.nbytes for p in progress)
    # the local(2) view: rank 2's rows of a Shard(0) tensor, in its own coordinates
    local = lines(client.get("/api/checkpoints/a/search", params={"name": name, "find": "min", "rank": 2}))[-1]
    rows = values.shape[0] // 4
    mine = values[2 * rows:3 * rows]
    assert local["index"] == list(np.unravel_index(np.argmin(mine), mine.shape))


def test_search_endpoint_places_a_3d_hit_in_the_requested_view(tmp_path):
    cube = np.zeros((4, 5, 6), np.float32)
    cube[2, 3, 1] = np.nan
    path = tmp_path / "c.safetensors"
    safetensors.numpy.save_file({"c": cube}, str(path))
    with TestClient(create_app([path])) as c:
        done = lines(c.get("/api/checkpoints/a/search", params={"name": "c", "find": "nan", "axes": "0,2"}))[-1]
        assert done["index"] == [2, 3, 1] and done["view"] == {"axes": [0, 2], "fixed": [3], "row": 2, "col": 1}
        for params, status in [({"find": "nope"}, 400), ({"find": "nan", "axes": "0,0"}, 400),
                               ({"find": "nan", "skip": "-1"}, 400), ({"find": "nan", "name": "zz"}, 404)]:
            response = c.get("/api/checkpoints/a/search", params={"name": "c", **params})
            assert response.status_code == status and "error" in response.json()


def test_diff_search_endpoint(client, truth, fixture_builders):
    name, index, delta = fixture_builders.VIEWER_ALTERED
    done = lines(client.get("/api/diff/search", params={"name": name, "find": "absdiff"}))[-1]
    assert done["index"] == list(index) and done["a"] == float(truth[f"model.{name}"][index])
    assert done["b"] == float(truth[f"model.{name}"][index] + np.float32(delta))
    both_nan = lines(client.get("/api/diff/search", params={"name": NONFINITE[len("model."):], "find": "nan"}))[-1]
    assert both_nan["index"] == [0, 0] and both_nan["a"] is None and both_nan["b"] is None


def test_a_client_that_leaves_stops_the_search(serve, spiky, monkeypatch):
    path, values = spiky
    taken, closed = [], threading.Event()
    real = streams_module.tensor_search_steps

    def slow(tensor, find, **kwargs):
        steps = real(tensor, find, block_bytes=1024)  # 302 blocks, 20 ms each: 6 s unless stopped
        try:
            for step in steps:
                taken.append(step)
                time.sleep(0.02)
                yield step
        finally:
            closed.set()

    monkeypatch.setattr(streams_module, "tensor_search_steps", slow)
    base = serve(create_app([path]))
    with httpx.Client(base_url=base, timeout=30) as http, http.stream(
            "GET", "/api/checkpoints/a/search", params={"name": "x", "find": "max"}) as response:
        first = json.loads(next(response.iter_lines()))
        assert first["progress"]["total"] == values.nbytes
    assert closed.wait(5), "the search went on after its client left"
    stopped_at = len(taken)
    time.sleep(0.3)
    assert len(taken) == stopped_at < 100


# ---------------------------------------------------------------------------
# non-finite flags in tiles, and the shared scale
# ---------------------------------------------------------------------------


def test_every_tile_flags_the_blocks_holding_nan_or_inf(client, truth):
    view = view_of(truth[NONFINITE])
    for exact in ("0", "1"):
        response = client.get("/api/checkpoints/a/tile", params={"name": NONFINITE, "h": 5, "w": 4, "exact": exact})
        header, fields = decode_tile(response.content)
        flags = reference_flags(view, 7, 12)
        assert header["nonfinite_complete"] is True and header["nonfinite_cells"] == np.count_nonzero(flags)
        np.testing.assert_array_equal(fields["nonfinite"], flags)
        assert fields["nonfinite"][2, 2] == 2 and fields["nonfinite"][4, 3] == 4  # [20, 30] +inf, [31, 46] -inf
    diff = decode_tile(client.get("/api/diff/tile", params={"name": NONFINITE[len("model."):], "h": 5, "w": 4,
                                                            "kind": "absdiff"}).content)
    with np.errstate(invalid="ignore"):
        delta = np.abs(view.astype(np.float64) - view.astype(np.float64))  # b holds the same values
    np.testing.assert_array_equal(diff[1]["nonfinite"], reference_flags(delta, 7, 12))
    assert diff[0]["nonfinite_complete"] is True


def test_large_tensors_are_flagged_once_their_statistics_ran(viewer_pair, truth, monkeypatch):
    monkeypatch.setattr(server_module, "NONFINITE_SCAN_BYTES", 0)  # as if every tensor were large
    view = view_of(truth[NONFINITE])
    params = {"name": NONFINITE, "h": 5, "w": 4}
    with TestClient(create_app(list(viewer_pair), rename=RENAME)) as c:
        before = c.get("/api/checkpoints/a/tile", params=params)
        header, fields = decode_tile(before.content)
        assert header["nonfinite_complete"] is False and "x-tensormorph-scale" not in before.headers
        sampled = reference_flags(view[::7, ::12], 1, 1)  # what the samples alone show
        np.testing.assert_array_equal(fields["nonfinite"], sampled)
        assert np.count_nonzero(sampled) < np.count_nonzero(reference_flags(view, 7, 12))

        stats = c.get("/api/checkpoints/a/stats", params=params).json()
        after = c.get("/api/checkpoints/a/tile", params=params)
        header, fields = decode_tile(after.content)
        assert header["nonfinite_complete"] is True
        np.testing.assert_array_equal(fields["nonfinite"], reference_flags(view, 7, 12))
        scale = json.loads(after.headers["x-tensormorph-scale"])
        finite = view[np.isfinite(view)]
        assert scale == {"min": float(finite.min()), "max": float(finite.max()), "absmax": stats["abs_max"]}
        exact = c.get("/api/checkpoints/a/tile", params={**params, "exact": 1})
        assert json.loads(exact.headers["x-tensormorph-scale"]) == scale  # one scale for both kinds of tile

        other = {"name": "model.encoder.layer.0.attention.self.key.weight", "h": 8, "w": 8}
        assert "x-tensormorph-scale" not in c.get("/api/checkpoints/a/tile", params=other).headers
        lines(c.get("/api/checkpoints/a/nonfinite", params=other))  # found none: known complete
        assert decode_tile(c.get("/api/checkpoints/a/tile", params=other).content)[0]["nonfinite_complete"]


def test_diff_tiles_carry_the_diff_reports_scale(client, fixture_builders):
    name, _index, delta = fixture_builders.VIEWER_ALTERED
    client.get("/api/diff")
    for kind, low in (("diff", -1), ("absdiff", 0)):
        response = client.get("/api/diff/tile", params={"name": name, "kind": kind, "h": 4, "w": 4})
        scale = json.loads(response.headers["x-tensormorph-scale"])
        assert scale["max"] == scale["absmax"] == pytest.approx(delta, rel=1e-3)
        assert scale["min"] == low * scale["max"]


# ---------------------------------------------------------------------------
# compression
# ---------------------------------------------------------------------------


def test_negotiation_and_when_a_tile_is_worth_compressing():
    assert negotiate("gzip, deflate, br, zstd") == "zstd"
    assert negotiate("gzip, zstd;q=0") == "gzip"
    assert negotiate("identity") is None and negotiate(None) is None and negotiate("*") == "zstd"
    values = np.random.default_rng(3).standard_normal((700, 700)).astype(np.float32)  # 1.9 MB: judged on a sample
    rounded = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    for data, shuffle, gzipped in ((values, False, False), (rounded, False, True), (rounded, True, True)):
        tile = Tile("t", data.shape, (0, 700), (0, 700), (1, 1), False, {"value": data})
        raw = tile.encode(shuffle=shuffle)
        body, used = compress(raw, "gzip")
        assert used == ("gzip" if gzipped else None) and (gzip.decompress(body) if gzipped else body) == raw
        assert compress(raw, "zstd")[1] == "zstd"  # zstd is cheap: its ~8% on fp32 is worth it


def _raw(base: str, path: str, params: dict, encoding: str) -> httpx.Response:
    with httpx.Client(base_url=base, timeout=30) as http, http.stream(
            "GET", path, params=params, headers={"accept-encoding": encoding}) as response:
        response.raw_bytes = b"".join(response.iter_raw())  # type: ignore[attr-defined]
    return response


def test_compressed_tiles_decode_to_the_same_bytes(serve, spiky, viewer_pair, truth):
    path, _ = spiky
    base = serve(create_app([path]))
    for exact in ("0", "1"):
        params = {"name": "h", "h": 150, "w": 128, "exact": exact}
        plain = _raw(base, "/api/checkpoints/a/tile", params, "identity")
        assert "content-encoding" not in plain.headers
        for encoding, unpack in (("gzip", gzip.decompress), ("zstd", zstandard.ZstdDecompressor().decompressobj()
                                                                     .decompress)):
            packed = _raw(base, "/api/checkpoints/a/tile", params, encoding)
            assert packed.headers["content-encoding"] == encoding and packed.headers["vary"] == "Accept-Encoding"
            assert unpack(packed.raw_bytes) == plain.raw_bytes
    # shuffled byte planes: bf16 values in float32 have two zero planes, so they compress well
    params = {"name": "h", "h": 300, "w": 257, "shuffle": 1}
    shuffled = _raw(base, "/api/checkpoints/a/tile", params, "gzip")
    flat = _raw(base, "/api/checkpoints/a/tile", {**params, "shuffle": 0}, "gzip")
    body = gzip.decompress(shuffled.raw_bytes)
    assert len(shuffled.raw_bytes) < 0.4 * len(body) and len(shuffled.raw_bytes) < 0.8 * len(flat.raw_bytes)
    (n,) = np.frombuffer(body[:4], "<u4")
    header = json.loads(body[4:4 + n])
    assert header["shuffle"] is True
    planes = np.frombuffer(body[4 + n:4 + n + 300 * 257 * 4], np.uint8).reshape(4, -1)
    values = planes.T.copy().view("<f4").reshape(300, 257)
    np.testing.assert_array_equal(values, decode_tile(gzip.decompress(flat.raw_bytes))[1]["value"])
    # and the exact tiles of the real checkpoint, through the cache, as the reference says
    base = serve(create_app(list(viewer_pair), rename=RENAME))
    name = "model.encoder.layer.1.output.dense.weight"
    params = {"name": name, "h": 32, "w": 48, "exact": 1}
    for _ in range(2):  # computed, then from the cache
        packed = _raw(base, "/api/checkpoints/a/tile", params, "zstd")
        body = zstandard.ZstdDecompressor().decompressobj().decompress(packed.raw_bytes)
        assert packed.headers["content-encoding"] == "zstd" and len(packed.raw_bytes) < 0.95 * len(body)
        header, fields = decode_tile(body)
        assert_fields_equal(fields, reference_tile(view_of(truth[name]), 0, 384, 0, 1536, 32, 48, True))
    # fp32 weights gain too little from gzip to pay for its time: sent as they are
    assert "content-encoding" not in _raw(base, "/api/checkpoints/a/tile", {**params, "h": 33}, "gzip").headers
