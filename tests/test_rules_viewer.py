"""The viewer's diff through rules (`tensormorph view A B --rules flax-torch`, `--transpose`): the report, the a − b
tiles and the diff search pair a Flax checkpoint's transposed kernels with transformers' torch weights.

The Flax side is written by the real flax, the torch side by transformers' BertModel holding the same values, moved
by hand with numpy transposes (tests/fixtures/flax_builders), never by Tensormorph."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from fixtures import flax_builders
from fixtures.cache import cached_build
from starlette.testclient import TestClient
from test_tiles import decode_tile

from tensormorph.cli import main
from tensormorph.errors import CheckpointError
from tensormorph.server import create_app

CHANGED = "encoder.layer.1.output.dense.weight"  # (32, 48) in torch, the (48, 32) kernel transposed in Flax
KERNEL = "params.encoder.layer.1.output.dense.kernel"


@pytest.fixture(scope="module")
def built() -> Path:
    return cached_build("flax", flax_builders, flax_builders.build)


@pytest.fixture(scope="module")
def perturbed(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The torch side with one element of one transposed weight moved by 0.25."""
    tensors = safetensors.numpy.load_file(str(built / "torch" / "model.safetensors"))
    tensors[CHANGED] = tensors[CHANGED].copy()
    tensors[CHANGED][5, 40] += 0.25
    folder = tmp_path_factory.mktemp("perturbed")
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"))
    return folder


def get(client: TestClient, path: str, **params: Any) -> Any:
    response = client.get(path, params={k: str(v) for k, v in params.items()})
    assert response.status_code == 200, response.text
    return response


def test_the_viewer_diff_pairs_flax_and_torch_through_the_rules(built: Path, perturbed: Path, tmp_path: Path) -> None:
    truth = safetensors.numpy.load_file(str(built / "truth.safetensors"))
    torch_side = safetensors.numpy.load_file(str(perturbed / "model.safetensors"))
    with TestClient(create_app([built / "bert.msgpack", perturbed], rules=["flax-torch"], cache_dir=tmp_path)) as c:
        report = get(c, "/api/diff").json()
        assert report["renames"][0] == FLAX_FIRST_RULE and len(report["tensors"]) == 39
        statuses = {t["name"]: t["status"] for t in report["tensors"]}
        assert statuses.pop(CHANGED) == "different" and set(statuses.values()) == {"equal"}
        entry = next(t for t in report["tensors"] if t["name"] == CHANGED)
        assert (entry["name_a"], entry["name_b"], entry["worst_index"]) == (KERNEL, CHANGED, [5, 40])
        expected = truth[KERNEL].T.astype(np.float64) - torch_side[CHANGED].astype(np.float64)
        header, fields = decode_tile(get(c, "/api/diff/tile", name=CHANGED, exact=1, r0=0, r1=32, c0=0, c1=48,
                                         h=32, w=48).content)
        assert header["view_shape"] == [32, 48]
        np.testing.assert_array_equal(fields["value"], expected.astype(np.float32))
        assert np.argwhere(fields["value"]).tolist() == [[5, 40]]
        header, fields = decode_tile(get(c, "/api/diff/tile", name="encoder.layer.0.attention.self.query.weight",
                                         kind="absdiff", exact=1, h=8, w=8).content)
        assert header["view_shape"] == [32, 32] and not any(np.any(v) for v in fields.values())
        found = get(c, "/api/diff/search", name=CHANGED, find="absdiff").text
        lines = [json.loads(line) for line in found.splitlines()]
        assert lines[-1]["index"] == [5, 40] and lines[-1]["value"] == pytest.approx(0.25, rel=1e-6)
        # an approximate diff tile remembers the transposed view's NaN/Inf scan apart from a's own tensor, whose
        # plain tiles keep its (48, 32) layout
        get(c, "/api/diff/tile", name=CHANGED, h=4, w=4)
        header, fields = decode_tile(get(c, "/api/checkpoints/a/tile", name=KERNEL, h=4, w=4).content)
        assert header["view_shape"] == [48, 32] and header["nonfinite_complete"] is True
        header, fields = decode_tile(get(c, "/api/checkpoints/a/tile", name=KERNEL, exact=1, r0=0, r1=48, c0=0,
                                         c1=32, h=48, w=32).content)
        np.testing.assert_array_equal(fields["value"], truth[KERNEL])


def test_exact_diff_tiles_are_cached_apart_from_a_viewer_without_the_transpose(tmp_path: Path) -> None:
    square = np.arange(16, dtype=np.float32).reshape(4, 4)
    safetensors.numpy.save_file({"w": square}, str(tmp_path / "a.safetensors"))
    safetensors.numpy.save_file({"w": np.zeros((4, 4), np.float32)}, str(tmp_path / "b.safetensors"))
    pair, cache = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"], tmp_path / "cache"
    for transpose, expected in (([], square), (["w"], square.T), ([], square)):
        with TestClient(create_app(pair, transpose=transpose, cache_dir=cache)) as c:
            _, fields = decode_tile(get(c, "/api/diff/tile", name="w", exact=1, h=4, w=4).content)
            np.testing.assert_array_equal(fields["value"], expected)


def test_a_transposed_sides_nan_positions_are_kept_apart_from_its_tensors(tmp_path: Path) -> None:
    wide = np.zeros((6, 8), np.float32)
    wide[0, 7] = np.nan
    safetensors.numpy.save_file({"w": wide}, str(tmp_path / "a.safetensors"))
    safetensors.numpy.save_file({"w": np.zeros((8, 6), np.float32)}, str(tmp_path / "b.safetensors"))
    pair = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    with TestClient(create_app(pair, transpose=["w"], cache_dir=tmp_path / "cache")) as c:
        header, fields = decode_tile(get(c, "/api/diff/tile", name="w", h=2, w=2).content)
        assert header["view_shape"] == [8, 6] and header["approximate"] and header["nonfinite_complete"]
        assert np.argwhere(fields["nonfinite"]).tolist() == [[1, 0]]  # row 7 of 8, column 0 of 6
        header, fields = decode_tile(get(c, "/api/checkpoints/a/tile", name="w", h=2, w=2).content)
        assert header["view_shape"] == [6, 8] and np.argwhere(fields["nonfinite"]).tolist() == [[0, 1]]


def test_view_command_passes_rules_and_transposes_to_the_server(built: Path, perturbed: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_: served.append(app))
    result = CliRunner().invoke(main, ["view", "--no-browser", "--rules", "flax-torch", "--transpose", "b:re:^$",
                                       str(built / "bert.msgpack"), str(perturbed)])
    assert result.exit_code == 0, result.output
    with TestClient(served[0]) as c:
        report = get(c, "/api/diff").json()
    assert report["renames"][-1] == "b:re:^$" and report["counts"] == {"different": 1, "equal": 38}
    result = CliRunner().invoke(main, ["view", "--no-browser", "--rules", "torch-flax", str(built / "bert.msgpack")])
    assert result.exit_code == 2 and "neither a built-in rule set" in result.output


def test_bad_rules_fail_before_the_server_starts(built: Path) -> None:
    with pytest.raises(CheckpointError, match="bad regular expression"):
        create_app([built / "bert.msgpack", built / "torch"], transpose=["re:(["])
    with pytest.raises(CheckpointError, match="needs '='"):
        create_app([built / "bert.msgpack", built / "torch"], rename=["re:x"])


FLAX_FIRST_RULE = r"a:re:^batch_stats\.(.+)\.mean$=\1.running_mean"
