"""The viewer's HTTP API (docs/viewer-api.md) against numpy ground truth.

The app serves the `viewer_pair` fixture as examples/demo.py does: a = the real MiniLM saved by DCP on
4 gloo ranks under "model.", b = an HF-sharded copy with one element of
encoder.layer.3.attention.self.query.weight nudged by +0.25, aligned with the rename rule "a:model.=".
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import safetensors.numpy
from starlette.testclient import TestClient
from test_tiles import assert_fields_equal, decode_tile, reference_tile, view_of

import tensormorph.server as server_module
from tensormorph.core import DEFAULT_READ_BUDGET
from tensormorph.server import create_app

pytestmark = pytest.mark.timeout(180)

RENAME = ["a:model.="]
QUERY = "encoder.layer.3.attention.self.query.weight"
CONFIG_FACTS = {"architectures": ["BertModel"], "model_type": "bert", "num_hidden_layers": 6, "hidden_size": 384,
                "num_attention_heads": 12, "intermediate_size": 1536, "vocab_size": 30522}


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def truth(viewer_pair, fixture_builders) -> dict[str, np.ndarray]:
    return fixture_builders.load_expected(fixture_builders.expected_paths(viewer_pair[0])[0])


@pytest.fixture(scope="module")
def truth_b(truth, fixture_builders) -> dict[str, np.ndarray]:
    """b's tensors: a's under bare names, with the one nudged element (float32 arithmetic, as torch did)."""
    name, index, delta = fixture_builders.VIEWER_ALTERED
    b = {k[len("model."):]: v for k, v in truth.items()}
    b[name] = b[name].copy()
    b[name][index] += np.float32(delta)
    return b


@pytest.fixture(scope="module")
def tile_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tile-cache")


@pytest.fixture(scope="module")
def client(viewer_pair, tile_cache):
    with TestClient(create_app(list(viewer_pair), rename=RENAME, cache_dir=tile_cache)) as c:
        yield c


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory) -> Path:
    """One safetensors file (no config.json beside it) written by the safetensors library."""
    folder = tmp_path_factory.mktemp("small")
    path = folder / "small.safetensors"
    safetensors.numpy.save_file({"w": np.arange(120, dtype=np.float32).reshape(12, 10) - 60.0,
                                 "v": np.linspace(-1, 1, 7, dtype=np.float32)}, str(path))
    return path


def api(client, path: str, **params):
    return client.get(path, params={k: str(v) for k, v in params.items()})


def _no_constants(name: str):
    raise AssertionError(f"JSON answer holds {name}, which JSON does not have")


def ok_json(response):
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return json.loads(response.text, parse_constant=_no_constants)  # strict: no NaN or Infinity


def ok_tile(response):
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    return decode_tile(response.content)


def check_against_reference(header, fields, view: np.ndarray, region: tuple[int, ...], exact: bool) -> None:
    r0, r1, c0, c1, h, w = region
    expected = reference_tile(view, r0, r1, c0, c1, h, w, exact)
    assert header["view_shape"] == list(view.shape)
    assert header["rows"] == [r0, r1] and header["cols"] == [c0, c1]
    assert header["step"] == list(expected["step"])
    assert header["approximate"] is (not exact and tuple(expected["step"]) != (1, 1))
    assert (header["nan"], header["inf"]) == (expected["nan"], expected["inf"])
    assert header["nonfinite_complete"] is True  # a small tensor is scanned for NaN/Inf on its first tile
    assert_fields_equal(fields, expected)


# ---------------------------------------------------------------------------
# JSON endpoints
# ---------------------------------------------------------------------------


def test_checkpoints_list(client, viewer_pair, truth):
    listed = ok_json(client.get("/api/checkpoints"))
    assert [c["id"] for c in listed] == ["a", "b"]
    a, b = listed
    assert a["path"] == str(viewer_pair[0]) and b["path"] == str(viewer_pair[1])
    assert (a["format"], b["format"]) == ("dcp", "hf-sharded")
    params, nbytes = sum(v.size for v in truth.values()), sum(v.nbytes for v in truth.values())
    for entry in listed:
        assert (entry["tensor_count"], entry["params"], entry["nbytes"]) == (len(truth), params, nbytes)
    assert a["files"] == 4  # one .distcp per rank
    weight_map = json.loads((viewer_pair[1] / "model.safetensors.index.json").read_text())["weight_map"]
    assert b["files"] == len(set(weight_map.values())) == 4


def test_summary_with_config_facts(client, truth):
    summary = ok_json(client.get("/api/checkpoints/a/summary"))
    assert summary["format"] == "dcp" and summary["tensor_count"] == len(truth)
    assert summary["config"] == CONFIG_FACTS
    assert [t["name"] for t in summary["tensors"]] and {t["name"] for t in summary["tensors"]} == set(truth)
    assert all("chunks" not in t for t in summary["tensors"])  # describe(ck, chunks=False)
    record = next(t for t in summary["tensors"] if t["name"] == "model." + QUERY)
    assert record["shape"] == [384, 384] and record["dtype"] == "F32" and record["chunk_count"] == 4
    assert summary["totals_by_dtype"]["I64"] == {"tensors": 2, "params": 512 + 600, "nbytes": 8 * 1112}
    assert summary["totals_by_dtype"]["BF16"] == {"tensors": 1, "params": 960, "nbytes": 1920}
    assert [o["name"] for o in summary["objects"]] == ["step"]
    model = next(c for c in summary["tree"]["children"] if c["name"] == "model")
    assert model["params"] == sum(v.size for v in truth.values())
    assert {c["name"] for c in model["children"]} >= {"embeddings", "encoder", "pooler", "pattern", "extra"}


def _layer_node(tree: dict) -> dict:
    stack = [tree]
    while stack:
        node = stack.pop()
        if node["name"] == "layer":
            return node
        stack.extend(node["children"])
    raise AssertionError("no 'layer' node")


def test_summary_tree_folds_the_six_layers_of_the_hf_copy(client, truth_b):
    summary = ok_json(client.get("/api/checkpoints/b/summary"))
    assert summary["config"] == CONFIG_FACTS
    (folded,) = _layer_node(summary["tree"])["children"]
    assert (folded["name"], folded["path"], folded["repeat"]) == ("0..5", "encoder.layer.0", 6)
    assert folded["params"] == sum(v.size for k, v in truth_b.items() if k.startswith("encoder.layer."))


def test_summary_tree_folds_the_six_layers_of_the_dcp_checkpoint(client, truth):
    # DCP lists each layer's replicated 1-D tensors in another order (whichever rank saved them): still one fold
    summary = ok_json(client.get("/api/checkpoints/a/summary"))
    (folded,) = _layer_node(summary["tree"])["children"]
    assert (folded["name"], folded["path"], folded["repeat"]) == ("0..5", "model.encoder.layer.0", 6)
    assert folded["params"] == sum(v.size for k, v in truth.items() if k.startswith("model.encoder.layer."))
    assert folded["placement_sharded"] is True


def test_summary_config_is_null_without_config_json(small_ckpt):
    with TestClient(create_app([small_ckpt])) as c:
        summary = ok_json(c.get("/api/checkpoints/a/summary"))
    assert summary["config"] is None and summary["tensor_count"] == 2


def test_tensor_info_chunks_ranks_and_cost(client):
    info = ok_json(api(client, "/api/checkpoints/a/tensor", name="model." + QUERY))
    assert info["name"] == "model." + QUERY and info["dtype"] == "F32" and info["shape"] == [384, 384]
    assert [c["offsets"] for c in info["chunks"]] == [[0, 0], [96, 0], [192, 0], [288, 0]]
    assert [c["shape"] for c in info["chunks"]] == [[96, 384]] * 4
    assert [c["ranks"] for c in info["chunks"]] == [[0], [1], [2], [3]]
    assert info["ranks"] == [0, 1, 2, 3] and info["split"] == "4 chunks, ranks 0-3"
    assert info["read_budget"] == DEFAULT_READ_BUDGET
    assert info["full_cost"] == {"bytes": 384 * 384 * 4, "seconds": 384 * 384 * 4 / 1e9}
    assert info["view"] == {"axes": [0, 1], "shape": [384, 384]}

    info = ok_json(api(client, "/api/checkpoints/b/tensor", name=QUERY))
    assert info["ranks"] == [] and info["chunk_count"] == 1 and info["file_shard"][1] == 4
    assert info["split"] == f"shard {info['file_shard'][0]} of 4"

    cube = ok_json(api(client, "/api/checkpoints/a/tensor", name="model.extra.cube"))
    assert cube["view"] == {"axes": [1, 2], "shape": [10, 14]}
    assert [c["shape"] for c in cube["chunks"]] == [[6, 3, 14]] * 3 + [[6, 1, 14]]
    strip = ok_json(api(client, "/api/checkpoints/a/tensor", name="model.extra.strip"))
    assert strip["view"] == {"axes": None, "shape": [1, 1000]}
    scalar = ok_json(api(client, "/api/checkpoints/a/tensor", name="model.extra.scalar"))
    assert scalar["view"] == {"axes": None, "shape": [1, 1]} and scalar["shape"] == []


def _numpy_stats(values: np.ndarray) -> dict:
    flat = values.astype(np.float64).ravel()
    finite = flat[np.isfinite(flat)]
    return {"numel": flat.size, "min": finite.min(), "max": finite.max(), "mean": finite.mean(), "std": finite.std(),
            "abs_max": np.abs(finite).max(), "zeros": int((flat == 0).sum()), "nans": int(np.isnan(flat).sum()),
            "infs": int(np.isinf(flat).sum()), "finite": finite}


def _check_stats(got: dict, values: np.ndarray, bins: int) -> None:
    want = _numpy_stats(values)
    assert got["numel"] == want["numel"]
    assert (got["min"], got["max"], got["abs_max"]) == (want["min"], want["max"], want["abs_max"])
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-9, abs=1e-12)
    assert got["std"] == pytest.approx(want["std"], rel=1e-9)
    assert (got["zeros"], got["nans"], got["infs"]) == (want["zeros"], want["nans"], want["infs"])
    assert got["zero_fraction"] == want["zeros"] / want["numel"]
    edges = np.linspace(want["min"], want["max"], bins + 1)
    np.testing.assert_array_equal(got["histogram"]["edges"], edges)
    assert got["histogram"]["counts"] == np.histogram(want["finite"], bins=edges)[0].tolist()


@pytest.mark.parametrize("name,bins", [("model." + QUERY, 64), ("model.extra.nonfinite", 16),
                                       ("model.extra.ids", 10), ("model.extra.bf16", 5),
                                       ("model.embeddings.word_embeddings.weight", 64)])
def test_stats_and_histogram_equal_numpy(client, truth, name, bins):
    params = {"name": name} if bins == 64 else {"name": name, "bins": bins}
    got = ok_json(api(client, "/api/checkpoints/a/stats", **params))
    assert got["name"] == name
    _check_stats(got, truth[name], bins)


def test_stats_log_histogram(client, truth):
    got = ok_json(api(client, "/api/checkpoints/a/stats", name="model." + QUERY, bins=20, log=1))
    finite = truth["model." + QUERY].astype(np.float64).ravel()
    edges = np.asarray(got["histogram"]["edges"])
    assert len(edges) == 21 and edges[-1] == pytest.approx(np.abs(finite).max())
    assert np.allclose(np.diff(np.log(edges)), np.log(edges[1] / edges[0]))
    assert got["histogram"]["counts"] == np.histogram(np.clip(np.abs(finite), edges[0], edges[-1]), edges)[0].tolist()


def test_stats_of_one_rank(client, truth):
    for rank in range(4):
        got = ok_json(api(client, "/api/checkpoints/a/stats", name="model.pattern", rank=rank))
        _check_stats(got, truth["model.pattern"][16 * rank:16 * (rank + 1)], 64)
        assert got["max"] == 1000.0 + 16 * rank + 15
    got = ok_json(api(client, "/api/checkpoints/a/stats", name="model.extra.ids", rank=3))
    _check_stats(got, truth["model.extra.ids"][:, 24:30], 64)  # Shard(1): rank 3 holds the last 6 columns


def test_diff_report_finds_the_nudged_element(client, truth, truth_b):
    report = ok_json(client.get("/api/diff"))
    assert report["renames"] == RENAME and report["identical"] is False
    assert report["counts"] == {"different": 1, "equal": len(truth) - 1}
    first = report["tensors"][0]  # worst first
    assert first["name"] == QUERY and first["status"] == "different"
    assert first["name_a"] == "model." + QUERY and first["name_b"] == QUERY
    assert first["worst_index"] == [7, 11] and first["mismatches"] == 1
    a, b = float(truth["model." + QUERY][7, 11]), float(truth_b[QUERY][7, 11])
    assert (first["worst_a"], first["worst_b"]) == (a, b)
    assert first["max_abs"] == abs(a - b) and first["max_abs"] == pytest.approx(0.25, abs=1e-6)
    assert all(t["status"] == "equal" for t in report["tensors"][1:])
    assert report["objects"] == [{"name": "step", "status": "only_a", "detail": ""}]

    loose = ok_json(api(client, "/api/diff", atol=0.3))
    assert loose["counts"] == {"close": 1, "equal": len(truth) - 1} and loose["identical"] is False  # step: only_a


def test_diff_needs_two_checkpoints(small_ckpt):
    with TestClient(create_app([small_ckpt])) as c:
        response = c.get("/api/diff")
        assert response.status_code == 404 and "two checkpoints" in response.json()["error"]
        response = c.get("/api/diff/tile", params={"name": "w"})
        assert response.status_code == 404 and "'b'" in response.json()["error"]


def test_openapi_lists_every_endpoint(client):
    spec = ok_json(client.get("/api/openapi.json"))
    assert spec["openapi"].startswith("3.")
    assert set(spec["paths"]) == {"/api/checkpoints", "/api/checkpoints/{cid}/summary",
                                  "/api/checkpoints/{cid}/tensor", "/api/checkpoints/{cid}/stats",
                                  "/api/checkpoints/{cid}/tile", "/api/diff", "/api/diff/tile", "/api/plan",
                                  "/api/checkpoints/{cid}/search", "/api/diff/search",
                                  "/api/checkpoints/{cid}/nonfinite", "/api/checkpoints/{cid}/verify",
                                  "/api/checkpoints/{cid}/integrity", "/api/run", "/api/run/open",
                                  "/api/history", "/api/history/open", "/api/plan/measure"}
    assert "application/x-ndjson" in spec["paths"]["/api/history"]["get"]["responses"]["200"]["content"]
    assert set(spec["paths"]["/api/history/open"]) == {"post"}
    tile_parameters = {p["name"] for p in spec["paths"]["/api/checkpoints/{cid}/tile"]["get"]["parameters"]}
    assert tile_parameters >= {"name", "r0", "r1", "c0", "c1", "h", "w", "axes", "fixed", "rank", "exact"}
    assert "application/octet-stream" in spec["paths"]["/api/diff/tile"]["get"]["responses"]["200"]["content"]


# ---------------------------------------------------------------------------
# tiles
# ---------------------------------------------------------------------------

TILE_CASES = [
    # name, extra params, region (r0, r1, c0, c1, h, w), axes, fixed
    ("model.embeddings.word_embeddings.weight", {}, (0, 30522, 0, 384, 200, 96), None, ()),
    ("model.embeddings.word_embeddings.weight", {}, (7000, 7100, 100, 140, 256, 256), None, ()),
    ("model." + QUERY, {}, (90, 200, 3, 384, 17, 19), None, ()),
    ("model.extra.nonfinite", {}, (0, 33, 0, 47, 9, 8), None, ()),
    ("model.extra.bf16", {}, (0, 24, 0, 40, 5, 5), None, ()),
    ("model.extra.ids", {}, (2, 20, 1, 30, 4, 4), None, ()),
    ("model.extra.strip", {}, (0, 1, 0, 1000, 1, 64), None, ()),
    ("model.extra.scalar", {}, (0, 1, 0, 1, 1, 1), None, ()),
    ("model.extra.cube", {"axes": "2,0", "fixed": "7"}, (0, 14, 0, 6, 4, 4), (2, 0), (7,)),
    ("model.extra.cube", {"fixed": "5"}, (0, 10, 0, 14, 3, 5), None, (5,)),
]


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("case", range(len(TILE_CASES)))
def test_tiles_equal_numpy(client, truth, case, exact):
    name, extra, region, axes, fixed = TILE_CASES[case]
    r0, r1, c0, c1, h, w = region
    header, fields = ok_tile(api(client, "/api/checkpoints/a/tile", name=name, r0=r0, r1=r1, c0=c0, c1=c1, h=h, w=w,
                                 exact=int(exact), **extra))
    assert header["name"] == name
    check_against_reference(header, fields, view_of(truth[name], axes, fixed), region, exact)


def test_tile_defaults_cover_the_whole_view(client, truth):
    header, fields = ok_tile(api(client, "/api/checkpoints/a/tile", name="model.pattern"))
    assert header["rows"] == [0, 64] and header["cols"] == [0, 128] and header["step"] == [1, 1]
    assert header["fields"] == ["value"] and header["approximate"] is False
    np.testing.assert_array_equal(fields["value"], truth["model.pattern"])
    assert (header["min"], header["max"]) == (0.0, 1063.0)


def test_tile_of_one_rank(client, truth):
    for rank in range(4):
        header, fields = ok_tile(api(client, "/api/checkpoints/a/tile", name="model.pattern", rank=rank, exact=1))
        assert header["view_shape"] == [16, 128]
        np.testing.assert_array_equal(fields["value"], truth["model.pattern"][16 * rank:16 * (rank + 1)])
    header, fields = ok_tile(api(client, "/api/checkpoints/a/tile", name="model.extra.cube", rank=3, fixed=2))
    assert header["view_shape"] == [1, 14]  # rank 3 holds cube[:, 9:10, :]
    np.testing.assert_array_equal(fields["value"], truth["model.extra.cube"][2, 9:10, :])


@pytest.mark.parametrize("kind", ["diff", "absdiff"])
def test_diff_tiles_equal_numpy(client, truth, truth_b, kind):
    a = truth["model." + QUERY].astype(np.float64)
    delta = a - truth_b[QUERY].astype(np.float64)
    delta = np.abs(delta) if kind == "absdiff" else delta
    for region, exact in [((0, 16, 0, 16, 16, 16), True), ((0, 384, 0, 384, 5, 7), True),
                          ((0, 384, 0, 384, 5, 7), False), ((5, 300, 9, 13, 40, 2), True)]:
        r0, r1, c0, c1, h, w = region
        header, fields = ok_tile(api(client, "/api/diff/tile", name=QUERY, kind=kind, r0=r0, r1=r1, c0=c0, c1=c1,
                                     h=h, w=w, exact=int(exact)))
        check_against_reference(header, fields, delta, region, exact)
    header, fields = ok_tile(api(client, "/api/diff/tile", name=QUERY, kind=kind, r0=0, r1=16, c0=0, c1=16))
    nonzero = np.argwhere(fields["value"] != 0).tolist()
    assert nonzero == [[7, 11]] and abs(fields["value"][7, 11]) == pytest.approx(0.25, abs=1e-6)
    # an unchanged tensor differs nowhere
    header, fields = ok_tile(api(client, "/api/diff/tile", name="pattern", kind=kind, exact=1, h=8, w=8))
    assert all(not np.any(v) for v in fields.values()) and header["step"] == [8, 16]


# ---------------------------------------------------------------------------
# bad requests
# ---------------------------------------------------------------------------

TILE = "/api/checkpoints/a/tile?name=model.pattern"
CUBE = "/api/checkpoints/a/tile?name=model.extra.cube"
BAD = [
    ("/api/checkpoints/z/summary", 404),
    ("/api/checkpoints/z/tile?name=model.pattern", 404),
    ("/api/checkpoints/a/tensor?name=nope", 404),
    ("/api/checkpoints/a/stats?name=nope", 404),
    ("/api/checkpoints/a/tile?name=nope", 404),
    ("/api/checkpoints/a/tensor", 400),
    ("/api/checkpoints/a/tile", 400),
    ("/api/diff/tile?name=nope", 404),
    ("/api/diff/tile?name=model.pattern", 404),  # a's raw name is not an aligned name
    (TILE + "&r1=65", 400),
    (TILE + "&c1=129", 400),
    (TILE + "&r0=-1", 400),
    (TILE + "&r0=10&r1=10", 400),
    (TILE + "&r0=20&r1=10", 400),
    (TILE + "&h=0", 400),
    (TILE + "&w=-5", 400),
    (TILE + "&h=abc", 400),
    (TILE + "&r0=1.5", 400),
    (TILE + "&c1=", 400),
    (TILE + "&exact=1&r1=1e3", 400),
    (TILE + "&rank=x", 400),
    (TILE + "&rank=7", 400),
    (TILE + "&rank=-1", 400),
    (TILE + "&axes=0", 400),
    (TILE + "&axes=0,0", 400),
    (TILE + "&axes=a,b", 400),
    (TILE + "&fixed=1", 400),  # a 2-D tensor has no other axis to fix
    (CUBE + "&axes=0,3", 400),
    (CUBE + "&axes=0,1,2", 400),
    (CUBE + "&fixed=14", 400),
    (CUBE + "&fixed=1,2", 400),
    (CUBE + "&fixed=x", 400),
    (CUBE + "&axes=2,0&fixed=10", 400),
    ("/api/checkpoints/a/tile?name=model.extra.scalar&axes=0,1", 400),
    ("/api/checkpoints/a/tile?name=model.extra.strip&fixed=0", 400),
    ("/api/checkpoints/a/stats?name=model.pattern&bins=0", 400),
    ("/api/checkpoints/a/stats?name=model.pattern&bins=5000", 400),
    ("/api/checkpoints/a/stats?name=model.pattern&bins=x", 400),
    ("/api/checkpoints/a/stats?name=model.pattern&rank=9", 400),
    ("/api/diff?atol=abc", 400),
    ("/api/diff/tile?name=pattern&kind=bogus", 400),
    ("/api/diff/tile?name=pattern&r1=999", 400),
]


@pytest.mark.parametrize("url,status", BAD)
def test_bad_requests_answer_json_errors(client, url, status):
    response = client.get(url)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error, str) and error


def test_absurd_zoom_is_refused(client):
    response = client.get(TILE + "&h=100000&w=100000")
    assert 400 <= response.status_code < 500 and response.json()["error"]


def test_absurd_zoom_answers_413_as_documented(client):
    assert client.get(TILE + "&h=100000&w=100000").status_code == 413


def test_read_budget_needs_confirm(viewer_pair, truth):
    budget = 100_000
    with TestClient(create_app([viewer_pair[0]], read_budget=budget)) as c:
        name = "model." + QUERY
        info = ok_json(api(c, "/api/checkpoints/a/tensor", name=name))
        assert info["read_budget"] == budget
        refused = api(c, "/api/checkpoints/a/stats", name=name)
        assert refused.status_code == 409
        body = refused.json()
        assert body["error"] and body["bytes"] == 384 * 384 * 4 and body["seconds"] == 384 * 384 * 4 / 1e9
        _check_stats(ok_json(api(c, "/api/checkpoints/a/stats", name=name, confirm=1)), truth[name], 64)
        # what fits the budget needs no confirmation: a small tensor, or one rank's chunk of a big one
        ok_json(api(c, "/api/checkpoints/a/stats", name="model.extra.cube"))
        assert api(c, "/api/checkpoints/a/stats", name="model.embeddings.word_embeddings.weight",
                   rank=0).status_code == 409
        _check_stats(ok_json(api(c, "/api/checkpoints/a/stats", name="model.pattern", rank=1)),
                     truth["model.pattern"][16:32], 64)
        # tiles bound their own memory: a big exact tile is not refused
        header, fields = ok_tile(api(c, "/api/checkpoints/a/tile", name="model.embeddings.word_embeddings.weight",
                                     exact=1, h=64, w=64))
        check_against_reference(header, fields, view_of(truth["model.embeddings.word_embeddings.weight"]),
                                (0, 30522, 0, 384, 64, 64), True)


def test_token_is_required_when_set(small_ckpt):
    with TestClient(create_app([small_ckpt], token="t")) as c:
        for path in ("/api/checkpoints", "/api/checkpoints/a/summary", "/api/checkpoints/a/tile?name=w",
                     "/api/openapi.json", "/api/nowhere"):
            for headers, params in [({}, {}), ({}, {"token": "wrong"}), ({"X-Tensormorph-Token": "x"}, {})]:
                response = c.get(path, headers=headers, params=params)
                assert response.status_code == 401 and response.json()["error"], (path, headers, params)
        assert ok_json(c.get("/api/checkpoints", params={"token": "t"}))[0]["tensor_count"] == 2
        assert ok_json(c.get("/api/checkpoints", headers={"X-Tensormorph-Token": "t"}))[0]["tensor_count"] == 2
        header, fields = ok_tile(c.get("/api/checkpoints/a/tile", params={"name": "w", "token": "t"}))
        np.testing.assert_array_equal(fields["value"], np.arange(120, dtype=np.float32).reshape(12, 10) - 60)
    with TestClient(create_app([small_ckpt])) as c:  # no token: open
        assert c.get("/api/checkpoints").status_code == 200


class _OpenedFiles:
    """Records every path the process opens while active (an audit hook; hooks cannot be removed)."""

    active = False
    paths: list[str] = []
    installed = False

    @classmethod
    def hook(cls, event: str, args: tuple) -> None:
        if cls.active and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            cls.paths.append(os.fsdecode(args[0]))


def test_no_request_parameter_reaches_the_file_system(client):
    if not _OpenedFiles.installed:
        sys.addaudithook(_OpenedFiles.hook)
        _OpenedFiles.installed = True
    hostile = ["../../etc/passwd", "/etc/passwd", "..", "model/../../../../etc/passwd", "x\x00y",
               "%2e%2e/%2e%2e/etc/passwd"]
    _OpenedFiles.paths.clear()
    _OpenedFiles.active = True
    try:
        for name in hostile:
            for path in ("/api/checkpoints/a/tensor", "/api/checkpoints/a/stats", "/api/checkpoints/a/tile",
                         "/api/diff/tile"):
                response = client.get(path, params={"name": name})
                assert response.status_code == 404, (path, name, response.text)
                assert "root:" not in response.text
        for raw in ("/api/checkpoints/%2E%2E/summary", "/api/checkpoints/..%2F..%2Fetc%2Fpasswd/summary",
                    "/api/checkpoints/..%2Fx/tile?name=model.pattern", "/api/checkpoints/%2Fetc%2Fpasswd/tensor?name=x",
                    "/%2e%2e/%2e%2e/%2e%2e/etc/passwd", "/..%2f..%2f..%2fetc%2fpasswd", "/static/..%2F..%2Fserver.py"):
            response = client.get(raw)
            assert response.status_code == 404, (raw, response.status_code, response.text[:200])
            assert "root:" not in response.text and "create_app" not in response.text
    finally:
        _OpenedFiles.active = False
    assert not [p for p in _OpenedFiles.paths if "passwd" in p or p.endswith(("/x", "server.py"))], _OpenedFiles.paths


# ---------------------------------------------------------------------------
# the exact-tile cache
# ---------------------------------------------------------------------------


def _cache_files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


def test_exact_tiles_are_cached_in_memory_and_on_disk(viewer_pair, tmp_path, monkeypatch, truth):
    cache = tmp_path / "cache"
    params = {"name": "model.encoder.layer.1.output.dense.weight", "exact": "1", "h": "32", "w": "48"}
    with TestClient(create_app(list(viewer_pair), rename=RENAME, cache_dir=cache)) as c:
        first = c.get("/api/checkpoints/a/tile", params=params)
        header, fields = ok_tile(first)
        check_against_reference(header, fields, view_of(truth["model.encoder.layer.1.output.dense.weight"]),
                                (0, 384, 0, 1536, 32, 48), True)
        (written,) = _cache_files(cache)
        # kept as sent: a byte naming the Content-Encoding, then the body (issue 20: compressed tiles); fp32
        # weights gain too little from gzip: sent as they are
        stored = written.read_bytes()
        assert "content-encoding" not in first.headers and stored[:1] == b"-"
        assert stored[1:] == first.content and written.parent.name == written.name[:2]
        ok_tile(c.get("/api/checkpoints/a/tile", params={**params, "exact": "0"}))
        assert _cache_files(cache) == {written}  # approximate tiles are not cached

        def refuse(*args, **kwargs):
            raise AssertionError("recomputed a cached tile")

        monkeypatch.setattr(server_module, "tile", refuse)
        assert c.get("/api/checkpoints/a/tile", params=params).content == first.content  # memory
    with TestClient(create_app(list(viewer_pair), rename=RENAME, cache_dir=cache)) as c:
        assert c.get("/api/checkpoints/a/tile", params=params).content == first.content  # disk, in a new app
        with pytest.raises(AssertionError, match="recomputed"):  # another region is another key: computed
            c.get("/api/checkpoints/a/tile", params={**params, "h": "31"})


def test_cache_key_follows_the_files_identity(small_ckpt, tmp_path, monkeypatch):
    path = tmp_path / "copy.safetensors"
    shutil.copyfile(small_ckpt, path)
    calls = []
    real_tile = server_module.tile

    def counting(*args, **kwargs):
        calls.append(args[1:])
        return real_tile(*args, **kwargs)

    monkeypatch.setattr(server_module, "tile", counting)
    params = {"name": "w", "exact": "1", "h": "3", "w": "4"}
    with TestClient(create_app([path], cache_dir=tmp_path / "cache")) as c:
        first = c.get("/api/checkpoints/a/tile", params=params).content
        assert c.get("/api/checkpoints/a/tile", params=params).content == first and len(calls) == 1
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes, a newer file
        assert c.get("/api/checkpoints/a/tile", params=params).content == first and len(calls) == 2
    assert len(_cache_files(tmp_path / "cache")) == 2


# ---------------------------------------------------------------------------
# a real server
# ---------------------------------------------------------------------------


def test_real_uvicorn_server(serve, viewer_pair, truth):
    base = serve(create_app(list(viewer_pair), rename=RENAME))
    with httpx.Client(base_url=base, timeout=30) as http:
        listed = http.get("/api/checkpoints").json()
        assert [c["format"] for c in listed] == ["dcp", "hf-sharded"]
        region = (0, 1536, 0, 384, 100, 100)
        response = http.get("/api/checkpoints/a/tile", params={
            "name": "model.encoder.layer.4.intermediate.dense.weight", "exact": "1", "h": "100", "w": "100"})
        header, fields = ok_tile(response)
        check_against_reference(header, fields, view_of(truth["model.encoder.layer.4.intermediate.dense.weight"]),
                                region, True)
        error = http.get("/api/checkpoints/a/tile", params={"name": "model.pattern", "r1": "65"})
        assert error.status_code == 400 and error.json()["error"]


def test_fifty_simultaneous_exact_tiles_with_bounded_memory(serve, viewer_pair, truth):
    base = serve(create_app(list(viewer_pair), rename=RENAME))
    requests = []
    for i in range(40):  # distinct regions of every big MiniLM matrix
        layer, part = i % 6, ("intermediate.dense.weight", "output.dense.weight", "attention.self.key.weight")[i % 3]
        name = f"model.encoder.layer.{layer}.{part}"
        height, width = truth[name].shape
        r0 = (i * 37) % (height // 2)
        requests.append((name, (r0, height, i % 7, width, 16 + i, 24 + i)))
    for i in range(10):  # the 47 MB embedding matrix, whole or half, each a different zoom
        rows = 30522 if i < 4 else 15000
        requests.append(("model.embeddings.word_embeddings.weight", (0, rows, 0, 384, 100 + i, 96)))

    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = [baseline]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.01)

    def fetch(request):
        name, (r0, r1, c0, c1, h, w) = request
        with httpx.Client(base_url=base, timeout=120) as http:
            response = http.get("/api/checkpoints/a/tile", params={
                "name": name, "r0": r0, "r1": r1, "c0": c0, "c1": c1, "h": h, "w": w, "exact": 1})
        return request, response.status_code, response.content

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    barrier = threading.Barrier(len(requests))

    def together(request):
        barrier.wait(30)
        return fetch(request)

    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(together, requests))
    finally:
        done.set()
        watcher.join()
    assert [status for _, status, _ in results] == [200] * len(requests)
    for (name, region), _, content in results[::7] + results[-2:]:
        header, fields = decode_tile(content)
        check_against_reference(header, fields, view_of(truth[name]), region, True)
    growth = peak[0] - baseline
    assert growth < 1024**3, f"RSS grew by {growth / 2**20:.0f} MiB"


def test_routes_that_bound_themselves_hold_no_heavy_slot():
    """The Timeline's history stream and a measurement may run for minutes under their own limits (one per run, one
    at a time): the four heavy slots stay for tiles, statistics and opens."""
    from tensormorph.server import _heavy

    assert not _heavy("/api/history") and not _heavy("/api/plan/measure") and not _heavy("/api/run")
    assert all(_heavy(p) for p in ("/api/history/open", "/api/run/open", "/api/checkpoints/a/tile", "/api/diff",
                                   "/api/plan", "/api/checkpoints/a/search"))
