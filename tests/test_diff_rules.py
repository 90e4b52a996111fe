"""Cross-framework diff: rename and transpose rules, the built-in `flax-torch` rule set, rule files.

The Flax side is written by the real flax (and orbax), the torch side by transformers' BertModel from the same values
moved by hand with numpy transposes (tests/fixtures/flax_builders), never by Tensormorph."""

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

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import CheckpointError
from tensormorph.ops.rules import parse_transpose, rule_list, transposed


@pytest.fixture(scope="module")
def built() -> Path:
    return cached_build("flax", flax_builders, flax_builders.build)


def cli(*args: Any, code: int = 0) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.exception)
    return result.output


def save(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    safetensors.numpy.save_file(tensors, str(path))
    return path


def test_flax_msgpack_against_transformers_torch_is_equal_with_the_built_in_rules(built: Path) -> None:
    report = tm.diff(built / "bert.msgpack", built / "torch", rules="flax-torch")
    assert report.identical and len(report.tensors) == 39
    assert {t.status for t in report.tensors} == {"equal"}
    pairs = {t.name_a: t.name_b for t in report.tensors}
    assert pairs["params.encoder.layer.0.attention.self.query.kernel"] == "encoder.layer.0.attention.self.query.weight"
    assert pairs["params.embeddings.LayerNorm.scale"] == "embeddings.LayerNorm.weight"
    assert pairs["params.embeddings.word_embeddings.embedding"] == "embeddings.word_embeddings.weight"
    assert pairs["params.pooler.dense.bias"] == "pooler.dense.bias"
    intermediate = next(t for t in report.tensors if t.name == "encoder.layer.1.intermediate.dense.weight")
    assert intermediate.shape_a == intermediate.shape_b == (48, 32)  # the (32, 48) kernel, transposed
    bare = tm.diff(built / "bert.msgpack", built / "torch")  # without the rules nothing lines up
    assert {t.status for t in bare.tensors} == {"only_a", "only_b"}


def test_a_perturbed_torch_tensor_is_reported_different(built: Path, tmp_path: Path) -> None:
    tensors = safetensors.numpy.load_file(str(built / "torch" / "model.safetensors"))
    name = "encoder.layer.1.output.dense.weight"  # (32, 48) in torch, a (48, 32) kernel in Flax
    tensors[name] = tensors[name].copy()
    tensors[name][5, 40] += 0.25
    report = tm.diff(built / "bert.msgpack", save(tmp_path / "model.safetensors", tensors), rules=["flax-torch"])
    changed = report.changed()
    assert [t.name for t in changed] == [name] and changed[0].status == "different"
    assert changed[0].mismatches == 1 and changed[0].worst_index == (5, 40)  # in torch's coordinates
    assert changed[0].max_abs == pytest.approx(0.25, rel=1e-6)
    result = json.loads(cli("diff", "--json", "--rules", "flax-torch", built / "bert.msgpack", tmp_path, code=1))
    assert {t["name"] for t in result["tensors"] if t["status"] != "equal"} == {name}


def test_orbax_checkpoint_of_the_same_params_against_torch(built: Path) -> None:
    text = cli("diff", "--rules", "flax-torch", built / "orbax", built / "torch")
    assert "same: 39 tensors compared (39 equal)" in text and "rules: flax-torch" in text


def test_transpose_rules_with_small_blocks_and_chunked_sources(built: Path, tmp_path: Path) -> None:
    table = flax_builders.chunked_tree()["big"]["table"]  # 7x5, stored as flat pieces cut into many boxes
    other = save(tmp_path / "t.safetensors", {"big.table": np.ascontiguousarray(table.T),
                                              "small": np.ones(3, np.float32)})
    report = tm.diff(built / "chunked.msgpack", other, transpose=["re:.*table$"], block_bytes=64)
    assert report.identical and report.renames == ["re:.*table$"]
    assert tm.diff(built / "chunked.msgpack", other).counts == {"shape_mismatch": 1, "equal": 1}
    with tm.open(built / "chunked.msgpack") as ck:
        view = transposed(ck["big.table"], (1, 0))
        assert view.name == "big.table" and view.shape == (5, 7)
        np.testing.assert_array_equal(view.full(), table.T)
        np.testing.assert_array_equal(view[1:4, 2:7:2], table.T[1:4, 2:7:2])
        np.testing.assert_array_equal(view[3], table.T[3])


def test_a_transposed_read_takes_the_callers_budget_not_the_original_tensors(tmp_path: Path) -> None:
    """tm.load reads a Flax kernel through its transposed view with a budget of the box it fills: the inner read
    of the original tensor must not fall back to that tensor's own, smaller, budget."""
    values = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    path = save(tmp_path / "w.safetensors", {"w": values})
    with tm.open(path, read_budget=4096) as ck:
        view = transposed(ck["w"], (1, 0))
        with pytest.raises(CheckpointError, match="read budget"):
            view.read((slice(0, 64), slice(0, 64)))  # over 4 KiB: refused by the outer read
        np.testing.assert_array_equal(view.read((slice(0, 64), slice(0, 64)), budget=1 << 20), values.T)
        np.testing.assert_array_equal(view.read((slice(0, 64), slice(3, 40)), budget=1 << 20), values.T[:, 3:40])


def test_permutations_sides_globs_and_rule_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    conv = rng.standard_normal((3, 3, 4, 8)).astype(np.float32)  # Flax HWIO
    cube = rng.standard_normal((2, 3, 4)).astype(np.float32)
    a = save(tmp_path / "a.safetensors", {"conv.kernel": conv, "cube.w": cube, "norm.kernel": np.ones(4, np.float32)})
    b = save(tmp_path / "b.safetensors", {"conv.kernel": conv.transpose(3, 2, 0, 1).copy(),  # torch OIHW
                                          "cube.w": cube.transpose(2, 0, 1).copy(),
                                          "norm.kernel": np.ones(4, np.float32)})
    report = tm.diff(a, b, transpose=["re:kernel$=3,2,0,1", "*.w=2,0,1"])
    assert report.identical, report.to_dict()  # the 1-D norm.kernel matches no rule of its rank: left as it is
    assert tm.diff(b, a, transpose=["b:re:kernel$=3,2,0,1", "b:cube.*=2,0,1"]).identical
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"rename": "a:cube.=box."}, {"transpose": "box.*=2,0,1"},
                                           {"rename": "a:box.=cube."}, {"transpose": "re:conv=3,2,0,1"}]}))
    assert "same" in cli("diff", a, b, "--rules", rules)
    assert tm.diff(a, b, rules=str(rules)).renames[:2] == ["a:cube.=box.", "box.*=2,0,1"]


def test_layer_lists_and_old_layer_norm_names(tmp_path: Path) -> None:
    kernel = np.arange(6, dtype=np.float32).reshape(2, 3)
    a = save(tmp_path / "a.safetensors", {"params.encoder.layer_0.attention.self.query.kernel": kernel,
                                          "params.encoder.layer_10.output.LayerNorm.scale": np.ones(3, np.float32),
                                          "params.encoder.layer_10.output.LayerNorm.bias": np.zeros(3, np.float32)})
    b = save(tmp_path / "b.safetensors", {"encoder.layer.0.attention.self.query.weight": kernel.T.copy(),
                                          "encoder.layer.10.output.LayerNorm.gamma": np.ones(3, np.float32),
                                          "encoder.layer.10.output.LayerNorm.beta": np.zeros(3, np.float32)})
    report = tm.diff(a, b, rules="flax-torch")
    assert report.identical and len(report.tensors) == 3


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"transpose": ["re:x=1,1"]}, "not a permutation"),
    ({"transpose": ["re:(["]}, "bad regular expression"),
    ({"transpose": ["=1,0"]}, "names no tensors"),
    ({"rules": "torch-flax"}, "neither a built-in rule set"),
    ({"rules": "flax-torch", "rename": ["a:re:^.*$=same"]}, "map both"),
])
def test_bad_rules_are_one_clear_error(tmp_path: Path, kwargs: dict, match: str) -> None:
    a = save(tmp_path / "a.safetensors", {"x.kernel": np.ones((2, 3), np.float32), "y": np.ones(1, np.float32)})
    with pytest.raises(CheckpointError, match=match):
        tm.diff(a, a, **kwargs)


def test_rule_files_are_bounded_and_checked(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    for content, match in (("[{\"rename\": 1}]", "rule 0 should be"), ("{\"rules\": 3}", "list of at most"),
                           ("nope", "not JSON")):
        bad.write_text(content)
        with pytest.raises(CheckpointError, match=match):
            rule_list(str(bad), None, None)
    assert parse_transpose("b:re:k$=1,0").sides == "b" and parse_transpose("re:a=b").permutation is None
