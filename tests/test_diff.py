"""`tensormorph.diff` on real checkpoints: logical values only, exact error figures, names aligned by rules.

The same tiny Llama is saved three ways (DCP on 4 ranks with Shard(0), DCP on
2 ranks over 2-D meshes under a "model." wrapper, transformers save_pretrained);
damaged copies are written with the safetensors library, and every figure the
report gives is checked against a direct float64 numpy computation.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from fixtures.builders import expected_paths, load_expected
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import CheckpointError

pytestmark = pytest.mark.timeout(300)

# the 2-D DCP save wraps the model as {"model": state_dict}: strip that wrapper, leave HF's own "model." alone
LLAMA_RENAME = r"re:^model\.(model\.|lm_head\.)=\1"
LLAMA_OBJECTS = {"step", "schedule.lr", "schedule.warmup"}
PERTURBED = "model.layers.1.self_attn.q_proj.weight"
PERTURBED_AT = (37, 21)  # row 37 lies in the third Shard(0) chunk (rows 32..47) of the 4-rank save
RENAMED = ("model.norm.weight", "model.final_norm.weight")
DROPPED = "model.layers.0.mlp.up_proj.weight"
CAST = "lm_head.weight"


def hf_truth(hf_llama_safetensors: Path) -> dict[str, np.ndarray]:
    return load_expected(expected_paths(hf_llama_safetensors)[0])


def save(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path),
                                metadata=metadata)
    return path


def reference_figures(a: np.ndarray, b: np.ndarray, atol: float = 0.0, rtol: float = 0.0) -> dict:
    """The error figures of two whole arrays, computed directly in float64 (the specification)."""
    x, y = a.astype(np.float64).reshape(-1), b.astype(np.float64).reshape(-1)
    nan_x, nan_y = np.isnan(x), np.isnan(y)
    one_nan = nan_x != nan_y
    with np.errstate(invalid="ignore"):
        delta = np.abs(x - y)
    delta[(nan_x & nan_y) | (np.isinf(x) & (x == y))] = 0.0
    delta[one_nan] = np.inf
    magnitude = np.where(np.isfinite(y), np.abs(y), 0.0)
    finite = np.isfinite(x) & np.isfinite(y)
    fx, fy, fd = x[finite], y[finite], delta[finite]
    norm_a, norm_b = math.sqrt(float(np.sum(fx * fx))), math.sqrt(float(np.sum(fy * fy)))
    diff_sq = float(np.sum(fd * fd))
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.where(fd == 0, 0.0, fd / np.abs(fy))
    mismatches = int(np.sum(delta > atol + rtol * magnitude))
    return {
        "delta": delta.reshape(a.shape),
        "max_abs": float(delta.max()) if delta.size else 0.0,
        "max_rel": float(relative.max()) if relative.size else 0.0,
        "rel_l2": math.sqrt(diff_sq) / norm_b if norm_b else (0.0 if diff_sq == 0 else math.inf),
        "cosine": float(np.sum(fx * fy)) / (norm_a * norm_b) if norm_a and norm_b else None,
        "mismatches": mismatches,
        "nan_mismatches": int(one_nan.sum()),
    }


def by_name(report) -> dict:
    return {t.name: t for t in report.tensors}


# ---------------------------------------------------------------------------
# the same weights, three shardings
# ---------------------------------------------------------------------------


def test_fixtures_really_are_sharded_differently(dcp_llama_1d, dcp_llama_2d, hf_llama_safetensors):
    one, two, hf = tm.open(dcp_llama_1d), tm.open(dcp_llama_2d), tm.open(hf_llama_safetensors)
    assert (one.format, two.format, hf.format) == ("dcp", "dcp", "hf-sharded")
    assert set(one) == set(hf) and set(two) == {"model." + n for n in hf}
    assert all(len(t.chunks) == 4 and {c.shape[0] for c in t.chunks} == {t.shape[0] // 4} for t in one.values())
    assert [(c.offsets, c.shape) for c in two["model.model.embed_tokens.weight"].chunks] == [
        ((0, 0), (512, 32)), ((0, 32), (512, 32))]  # columns over the (1,2) mesh
    assert [(c.offsets, c.shape) for c in two["model.model.layers.0.self_attn.k_proj.weight"].chunks] == [
        ((0, 0), (16, 64)), ((16, 0), (16, 64))]  # rows over the (2,1) mesh
    assert len(two["model.model.norm.weight"].chunks) == 1  # replicated on both mesh dims: stored once
    assert {c.ranks for c in two["model.model.layers.1.input_layernorm.weight"].chunks} == {(0,), (1,)}
    assert len(hf.files) == 3 and all(len(t.chunks) == 1 for t in hf.values())


@pytest.mark.parametrize("pair", ["1d-2d", "1d-hf", "2d-hf", "hf-1d"])
def test_same_weights_saved_three_ways_are_equal(pair, dcp_llama_1d, dcp_llama_2d, hf_llama_safetensors):
    paths = {"1d": dcp_llama_1d, "2d": dcp_llama_2d, "hf": hf_llama_safetensors}
    left, right = pair.split("-")
    a, b = tm.open(paths[left]), tm.open(paths[right])
    seen: list[int] = []
    report = tm.diff(a, b, rename=[LLAMA_RENAME], block_bytes=4096, progress=seen.append)
    assert report.counts == {"equal": 21}
    assert len(report.tensors) == 21
    for t in report.tensors:
        assert (t.max_abs, t.max_rel, t.rel_l2, t.cosine, t.mismatches) == (0.0, 0.0, 0.0, 1.0, 0), t.name
        assert t.shape_a == t.shape_b and t.dtype_a == t.dtype_b == "F32"
    assert sum(seen) == b.nbytes  # every byte of side b was compared, once
    assert max(seen) <= 4096  # in blocks no larger than the budget
    objects = {o.name: o.status for o in report.objects}
    if "hf" not in pair:
        assert objects == dict.fromkeys(LLAMA_OBJECTS, "equal") and report.identical
    else:
        # transformers keeps no training state: the DCP objects are reported, never silently dropped
        side = "only_a" if left != "hf" else "only_b"
        assert objects == dict.fromkeys(LLAMA_OBJECTS, side) and not report.identical
        assert tm.diff(a, b, rename=[LLAMA_RENAME], objects=False).identical


def test_wrapper_prefix_needs_a_rule(dcp_llama_2d, hf_llama_safetensors):
    report = tm.diff(dcp_llama_2d, hf_llama_safetensors, objects=False)
    assert report.counts == {"only_a": 21, "only_b": 21}
    only_a = next(t for t in report.tensors if t.name == "model.lm_head.weight")
    assert (only_a.status, only_a.name_a, only_a.name_b, only_a.dtype_a, only_a.shape_a, only_a.dtype_b) == (
        "only_a", "model.lm_head.weight", None, "F32", (512, 64), None)


def test_same_weights_cli_exit_zero(dcp_llama_2d, hf_llama_safetensors):
    result = CliRunner().invoke(main, ["diff", str(dcp_llama_2d), str(hf_llama_safetensors),
                                       "--rename", LLAMA_RENAME, "--json"])
    assert result.exit_code == 1, result.output  # the DCP objects have no counterpart in the HF folder
    data = json.loads(result.output)
    assert data["counts"] == {"equal": 21} and data["renames"] == [LLAMA_RENAME]
    assert {o["name"]: o["status"] for o in data["objects"]} == dict.fromkeys(LLAMA_OBJECTS, "only_a")
    result = CliRunner().invoke(main, ["diff", str(dcp_llama_2d), str(dcp_llama_2d)])
    assert result.exit_code == 0, result.output
    assert "same" in result.output and "21 equal" in result.output


# ---------------------------------------------------------------------------
# damaged copies: one perturbed element, a renamed, a dropped and a bf16 tensor
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def damaged(hf_llama_safetensors, tmp_path_factory) -> tuple[Path, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(folder, original tensors, damaged tensors) of a one-file safetensors copy with four kinds of damage."""
    original = hf_truth(hf_llama_safetensors)
    changed = {k: v.copy() for k, v in original.items()}
    changed[PERTURBED][PERTURBED_AT] += np.float32(0.5)
    changed[RENAMED[1]] = changed.pop(RENAMED[0])
    del changed[DROPPED]
    changed[CAST] = changed[CAST].astype(ml_dtypes.bfloat16)
    folder = tmp_path_factory.mktemp("damaged")
    save(folder / "model.safetensors", changed, {"format": "pt"})
    return folder, original, changed


def test_each_damage_is_reported_with_its_status(damaged, dcp_llama_1d):
    folder, _, _ = damaged
    report = tm.diff(dcp_llama_1d, folder, objects=False)
    assert report.counts == {"different": 1, "dtype_mismatch": 1, "only_a": 2, "only_b": 1, "equal": 17}
    assert [t.name for t in report.tensors[:5]] == [PERTURBED, CAST, *sorted([RENAMED[0], DROPPED]), RENAMED[1]]
    tensors = by_name(report)
    renamed_a, renamed_b = tensors[RENAMED[0]], tensors[RENAMED[1]]
    assert (renamed_a.status, renamed_a.name_a, renamed_a.name_b) == ("only_a", RENAMED[0], None)
    assert (renamed_b.status, renamed_b.name_a, renamed_b.name_b, renamed_b.dtype_b, renamed_b.shape_b) == (
        "only_b", None, RENAMED[1], "F32", (64,))
    assert (tensors[DROPPED].status, tensors[DROPPED].shape_a, tensors[DROPPED].shape_b) == (
        "only_a", (128, 64), None)
    assert not report.identical and {t.name for t in report.changed()} == {
        PERTURBED, CAST, DROPPED, *RENAMED}


def test_perturbed_element_figures_are_exact(damaged, dcp_llama_1d):
    folder, original, changed = damaged
    a, b = original[PERTURBED], changed[PERTURBED]
    t = by_name(tm.diff(dcp_llama_1d, folder, objects=False, block_bytes=1024))[PERTURBED]
    expected = reference_figures(a, b)
    step = float(np.float64(b[PERTURBED_AT]) - np.float64(a[PERTURBED_AT]))
    assert step == pytest.approx(0.5, abs=1e-6)
    assert t.status == "different"
    assert t.max_abs == abs(step) == expected["max_abs"]
    assert t.worst_index == PERTURBED_AT  # the global index, not one inside the rank's chunk
    assert (t.worst_a, t.worst_b) == (float(a[PERTURBED_AT]), float(b[PERTURBED_AT]))
    assert t.mismatches == 1 and t.nan_mismatches == 0
    assert t.mismatch_fraction == 1 / a.size
    assert t.max_rel == abs(step) / abs(float(b[PERTURBED_AT])) == expected["max_rel"]
    assert t.rel_l2 == pytest.approx(expected["rel_l2"], rel=1e-12)
    assert t.cosine == pytest.approx(expected["cosine"], rel=1e-12)
    assert 0 < t.rel_l2 < 1 and 0.9 < t.cosine < 1


def test_tolerances_make_the_perturbation_close(damaged, dcp_llama_1d):
    folder, original, changed = damaged
    step = abs(float(np.float64(changed[PERTURBED][PERTURBED_AT]) - np.float64(original[PERTURBED][PERTURBED_AT])))
    magnitude = abs(float(changed[PERTURBED][PERTURBED_AT]))

    def figures(**tolerance):
        return by_name(tm.diff(dcp_llama_1d, folder, names=[PERTURBED], **tolerance))[PERTURBED]

    at_bound = figures(atol=step)  # the bound is inclusive: |a - b| <= atol + rtol * |b|
    assert (at_bound.status, at_bound.mismatches, at_bound.max_abs) == ("close", 0, step)
    assert at_bound.worst_index == PERTURBED_AT  # the figures stay, only the verdict changes
    below = figures(atol=math.nextafter(step, 0.0))
    assert (below.status, below.mismatches) == ("different", 1)
    assert figures(rtol=step / magnitude * (1 + 1e-9)).status == "close"
    assert figures(rtol=step / magnitude * (1 - 1e-9)).status == "different"
    report = tm.diff(dcp_llama_1d, folder, names=[PERTURBED], atol=step)
    assert report.identical and report.objects == []  # names= limits the comparison to tensors


def test_bf16_cast_is_a_dtype_mismatch_with_exact_figures(damaged, dcp_llama_1d):
    folder, original, changed = damaged
    a, b = original[CAST], changed[CAST]
    t = by_name(tm.diff(dcp_llama_1d, folder, objects=False))[CAST]
    expected = reference_figures(a, b)
    assert (t.status, t.dtype_a, t.dtype_b) == ("dtype_mismatch", "F32", "BF16")
    assert t.max_abs == expected["max_abs"] > 0
    assert expected["delta"][t.worst_index] == t.max_abs
    assert (t.worst_a, t.worst_b) == (float(a[t.worst_index]), float(b[t.worst_index]))
    assert t.mismatches == expected["mismatches"] == int(np.count_nonzero(expected["delta"]))
    assert t.mismatch_fraction == t.mismatches / a.size
    assert t.rel_l2 == pytest.approx(expected["rel_l2"], rel=1e-12)
    assert t.cosine == pytest.approx(expected["cosine"], rel=1e-12)
    # bf16 keeps 8 significant bits: round-to-nearest is within 2^-8 of |b|
    loose = by_name(tm.diff(dcp_llama_1d, folder, names=[CAST], rtol=2.0**-8))[CAST]
    assert (loose.status, loose.mismatches) == ("dtype_mismatch", 0)


def test_cast_option_checks_a_conversion_exactly(damaged, dcp_llama_1d):
    folder, _, _ = damaged
    t = by_name(tm.diff(dcp_llama_1d, folder, cast="BF16", objects=False))
    # side a rounded to bf16 by numpy equals what torch/safetensors wrote, bit for bit
    assert t[CAST].status == "equal" and t[CAST].max_abs == 0.0
    assert t[PERTURBED].status == "dtype_mismatch"  # a's F32 became BF16, b's stayed F32


def test_rename_rule_realigns_the_renamed_tensor(damaged, dcp_llama_1d):
    folder, _, _ = damaged
    report = tm.diff(dcp_llama_1d, folder, objects=False, rename=[r"re:^model\.final_norm\.=model.norm."])
    tensors = by_name(report)
    assert RENAMED[1] not in tensors
    norm = tensors[RENAMED[0]]
    assert (norm.status, norm.name_a, norm.name_b) == ("equal", RENAMED[0], RENAMED[1])
    assert report.counts == {"different": 1, "dtype_mismatch": 1, "only_a": 1, "equal": 18}


def test_damage_cli_exit_one_and_json(damaged, dcp_llama_1d):
    folder, _, _ = damaged
    result = CliRunner().invoke(main, ["diff", str(dcp_llama_1d), str(folder)])
    assert result.exit_code == 1, result.output
    assert PERTURBED in result.output and "different" in result.output and "[37, 21]" in result.output
    result = CliRunner().invoke(main, ["diff", str(dcp_llama_1d), str(folder), "--json", "--atol", "0.6"])
    data = json.loads(result.output)
    assert result.exit_code == 1 and not data["identical"] and data["atol"] == 0.6
    perturbed = next(t for t in data["tensors"] if t["name"] == PERTURBED)
    assert perturbed["status"] == "close" and perturbed["worst_index"] == list(PERTURBED_AT)


def test_shape_mismatch(hf_llama_safetensors, tmp_path):
    original = hf_truth(hf_llama_safetensors)
    name = "model.layers.0.self_attn.k_proj.weight"
    b = save(tmp_path / "b.safetensors", {name: original[name].reshape(64, 32)})
    t = tm.diff(hf_llama_safetensors, b, names=[name]).tensors[0]
    assert (t.status, t.shape_a, t.shape_b, t.max_abs) == ("shape_mismatch", (32, 64), (64, 32), None)


# ---------------------------------------------------------------------------
# NaN and infinity
# ---------------------------------------------------------------------------


def nan_with_bits(bits: int) -> np.float32:
    return np.array([bits], np.uint32).view(np.float32)[0]


def pair(tmp_path: Path, a: np.ndarray, b: np.ndarray) -> tuple[Path, Path]:
    return save(tmp_path / "a.safetensors", {"x": a}), save(tmp_path / "b.safetensors", {"x": b})


def grid() -> np.ndarray:
    return (np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5) / 4


def test_nan_at_the_same_positions_counts_equal(tmp_path):
    a = grid()
    a[0, 1] = a[2, 2] = np.nan
    t = tm.diff(*pair(tmp_path, a, a.copy())).tensors[0]
    assert (t.status, t.nan_mismatches, t.mismatches) == ("equal", 0, 0)
    b = a.copy()
    b[0, 1] = nan_with_bits(0xFFC00001)  # another NaN payload: the bytes differ, the values do not
    b[1, 3] += np.float32(0.25)
    t = tm.diff(*pair(tmp_path, a, b)).tensors[0]
    expected = reference_figures(a, b)
    assert (t.status, t.nan_mismatches, t.mismatches, t.worst_index) == ("different", 0, 1, (1, 3))
    assert t.max_abs == expected["max_abs"] == 0.25
    assert t.rel_l2 == pytest.approx(expected["rel_l2"], rel=1e-12)  # over the finite positions
    assert t.cosine == pytest.approx(expected["cosine"], rel=1e-12)
    b[1, 3] = a[1, 3]
    report = tm.diff(*pair(tmp_path, a, b))
    assert report.tensors[0].mismatches == 0 and report.identical


def test_nan_at_different_positions(tmp_path):
    a, b = grid(), grid()
    a[0, 1] = np.nan
    b[2, 2] = np.nan
    t = tm.diff(*pair(tmp_path, a, b), atol=1.0).tensors[0]
    assert t.status == "different" and t.nan_mismatches == 2
    assert t.max_abs == math.inf and t.worst_index == (0, 1)
    assert math.isnan(t.worst_a) and t.worst_b == float(b[0, 1])


def test_nan_in_a_only_is_a_mismatch(tmp_path):
    a, b = grid(), grid()
    a[1, 1] = np.nan
    t = tm.diff(*pair(tmp_path, a, b), atol=1.0).tensors[0]
    assert (t.status, t.mismatches, t.nan_mismatches, t.worst_index) == ("different", 1, 1, (1, 1))


@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_nonfinite_in_b_only_is_a_mismatch(tmp_path, special):
    a, b = grid(), grid()
    b[1, 1] = special
    report = tm.diff(*pair(tmp_path, a, b))
    t = report.tensors[0]
    assert (t.status, t.mismatches, t.worst_index) == ("different", 1, (1, 1))
    assert not report.identical


def test_infinities(tmp_path):
    a, b = grid(), grid()
    a[0, 0] = b[0, 0] = np.inf  # the same infinity on both sides matches
    b[2, 3] += np.float32(0.5)
    t = tm.diff(*pair(tmp_path, a, b)).tensors[0]
    assert (t.status, t.mismatches, t.max_abs, t.worst_index) == ("different", 1, 0.5, (2, 3))
    a[1, 0] = -np.inf  # -inf against a number
    t = tm.diff(*pair(tmp_path, a, b), atol=1.0).tensors[0]
    assert (t.status, t.mismatches, t.max_abs, t.worst_index, t.nan_mismatches) == (
        "different", 1, math.inf, (1, 0), 0)


# ---------------------------------------------------------------------------
# non-tensor entries
# ---------------------------------------------------------------------------


def test_objects_of_two_dcp_saves(dcp_ckpt, dcp_zstd_ckpt, dcp_llama_1d):
    same = tm.diff(dcp_ckpt, dcp_zstd_ckpt)
    assert same.identical and len(same.objects) == 20
    assert all(o.status == "equal" for o in same.objects)
    other = tm.diff(dcp_ckpt, dcp_llama_1d)
    objects = {o.name: o for o in other.objects}
    assert (objects["step"].status, objects["step"].detail) == ("different", "42 != 7")
    assert objects["schedule.lr"].status == "only_b" and objects["name"].status == "only_a"
    assert objects["config.betas"].status == "only_a"
    assert sum(o.status == "only_a" for o in other.objects) == 19
    assert tm.diff(dcp_ckpt, dcp_llama_1d, objects=False).objects == []


def test_objects_follow_rename_rules(dcp_llama_1d):
    report = tm.diff(dcp_llama_1d, dcp_llama_1d, rename=["schedule.=sched."])
    assert {o.name for o in report.objects} == {"step", "sched.lr", "sched.warmup"} and report.identical


# ---------------------------------------------------------------------------
# rename rules
# ---------------------------------------------------------------------------


def test_prefix_rules(tmp_path):
    x, y = np.arange(6, dtype=np.float32), np.ones((2, 2), np.int32)
    a = save(tmp_path / "a.safetensors", {"model.x": x, "model.y": y, "head": x})
    b = save(tmp_path / "b.safetensors", {"x": x, "y": y, "head": x})
    assert tm.diff(a, b).counts == {"only_a": 2, "only_b": 2, "equal": 1}
    report = tm.diff(a, b, rename=["model.="])
    assert report.identical and report.counts == {"equal": 3}
    assert {(t.name, t.name_a, t.name_b) for t in report.tensors} == {
        ("x", "model.x", "x"), ("y", "model.y", "y"), ("head", "head", "head")}
    c = save(tmp_path / "c.safetensors", {"transformer.x": x, "transformer.y": y, "head": x})
    assert tm.diff(a, c, rename=["model.=transformer."]).identical
    # rules apply in order, to both sides
    assert tm.diff(a, c, rename=["model.=", "transformer.="]).identical


def test_regex_rules(tmp_path):
    x = np.arange(4, dtype=np.float32)
    a = save(tmp_path / "a.safetensors", {"layers.0.attn.wq": x, "layers.1.attn.wq": x + 1})
    b = save(tmp_path / "b.safetensors", {"h.0.q_proj": x, "h.1.q_proj": x + 1})
    rules = [r"re:^layers\.(\d+)\.attn\.wq$=h.\1.q_proj"]
    report = tm.diff(a, b, rename=rules)
    assert report.identical and {t.name for t in report.tensors} == {"h.0.q_proj", "h.1.q_proj"}
    assert by_name(report)["h.1.q_proj"].name_a == "layers.1.attn.wq"


@pytest.mark.parametrize("rule, message", [
    ("no-equals-sign", "PREFIX=REPLACEMENT"),
    ("=model.", "PREFIX=REPLACEMENT"),
    ("re:no-equals", "needs '='"),
    ("re:(unclosed=x", "bad regular expression"),
])
def test_invalid_rules_are_errors(rule, message, hf_llama_safetensors):
    with pytest.raises(CheckpointError, match=message) as caught:
        tm.diff(hf_llama_safetensors, hf_llama_safetensors, rename=[rule])
    assert repr(rule) in str(caught.value)


def test_rule_collision_is_an_error(hf_llama_safetensors):
    with pytest.raises(CheckpointError) as caught:
        tm.diff(hf_llama_safetensors, hf_llama_safetensors, rename=[r"re:layers\.\d+\.=layers."])
    assert str(caught.value) == ("rename rules map both 'model.layers.0.input_layernorm.weight' and "
                                 "'model.layers.1.input_layernorm.weight' of checkpoint a to "
                                 "'model.layers.input_layernorm.weight'")


def test_invalid_rule_cli_exit_two(hf_llama_safetensors):
    result = CliRunner().invoke(main, ["diff", str(hf_llama_safetensors), str(hf_llama_safetensors),
                                       "--rename", "re:(x=y"])
    assert result.exit_code == 2 and "bad regular expression" in result.output


def test_regex_rule_with_lookahead(dcp_llama_2d, hf_llama_safetensors):
    report = tm.diff(dcp_llama_2d, hf_llama_safetensors, rename=[r"re:^model\.(?=model\.|lm_head\.)="],
                     objects=False)
    assert report.identical and report.counts == {"equal": 21}


# ---------------------------------------------------------------------------
# property: any two chunkings, any block size, the figures of the whole arrays
# ---------------------------------------------------------------------------

DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
          "I32": np.dtype(np.int32)}


def write_dcp_safetensors(folder: Path, name: str, array: np.ndarray, cuts: list[list[int]],
                          empty_rank: bool) -> None:
    """One file per chunk of the grid `cuts` makes, as DCP's HuggingFaceStorageWriter names and annotates them."""
    folder.mkdir(parents=True)
    edges = [[0, *c, n] for c, n in zip(cuts, array.shape)]
    boxes = [()]
    for e in edges:
        boxes = [box + ((lo, hi),) for box in boxes for lo, hi in zip(e, e[1:])]
    pieces = [(tuple(lo for lo, _ in box), array[tuple(slice(lo, hi) for lo, hi in box)]) for box in boxes]
    if empty_rank:  # a rank past the end of dim 0 holds an empty chunk at offset = size, as DCP writes it
        pieces.append(((array.shape[0],) + (0,) * (array.ndim - 1), array[array.shape[0]:]))
    for rank, (offsets, piece) in enumerate(pieces):
        info = json.dumps({name: {"saved_offsets": list(offsets)}})
        save(folder / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors", {name: piece},
             {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": info})


@st.composite
def cases(draw, specials: bool):
    dtype = draw(st.sampled_from(["F32", "F16", "BF16"] if specials else sorted(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))

    def chunking():
        return [sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else [] for n in shape]

    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if dtype == "I32":
        a = rng.integers(-1000, 1000, shape).astype(np.int32)
    else:
        a = (rng.standard_normal(shape) * draw(st.sampled_from([1e-3, 1.0, 100.0]))).astype(DTYPES[dtype])
    change = draw(st.sampled_from(["none", "one", "some", "all"]))
    b = a.copy()
    flat = b.reshape(-1)
    if change == "one":
        flat[draw(st.integers(0, a.size - 1))] += 3 if dtype == "I32" else 0.75
    elif change == "some":
        mask = rng.random(a.size) < 0.3
        flat[mask] = (flat[mask].astype(np.float64) + rng.integers(1, 50, mask.sum())).astype(b.dtype)
    elif change == "all":
        b = rng.permutation(a.reshape(-1)).reshape(shape)
    if specials:
        for array in (a, b):
            positions = rng.choice(a.size, size=min(a.size, 2), replace=False)
            array.reshape(-1)[positions] = rng.choice([np.nan, np.inf, -np.inf], size=positions.size)
    return {"dtype": dtype, "a": a, "b": b, "cuts_a": chunking(), "cuts_b": chunking(),
            "empty_a": draw(st.booleans()), "empty_b": draw(st.booleans()),
            "block_bytes": draw(st.integers(64, 4096)),
            "atol": draw(st.sampled_from([0.0, 0.0, 1e-2, 10.0])), "rtol": draw(st.sampled_from([0.0, 0.0, 0.1]))}


def check_case(case: dict) -> None:
    a, b = case["a"], case["b"]
    with tempfile.TemporaryDirectory() as tmp:
        write_dcp_safetensors(Path(tmp, "a"), "t", a, case["cuts_a"], case["empty_a"])
        write_dcp_safetensors(Path(tmp, "b"), "t", b, case["cuts_b"], case["empty_b"])
        with tm.open(Path(tmp, "a")) as ck_a, tm.open(Path(tmp, "b")) as ck_b:
            assert ck_a.format == ck_b.format == "dcp-safetensors"
            seen: list[int] = []
            report = tm.diff(ck_a, ck_b, atol=case["atol"], rtol=case["rtol"], block_bytes=case["block_bytes"],
                             progress=seen.append)
    t = report.tensors[0]
    assert len(report.tensors) == 1 and sum(seen) == b.nbytes
    expected = reference_figures(a, b, case["atol"], case["rtol"])
    if a.tobytes() == b.tobytes():
        assert (t.status, t.max_abs, t.max_rel, t.rel_l2, t.cosine, t.mismatches, t.worst_index) == (
            "equal", 0.0, 0.0, 0.0, 1.0, 0, None)
        return
    assert t.status == ("different" if expected["mismatches"] else "close")
    assert t.mismatches == expected["mismatches"]
    assert t.nan_mismatches == expected["nan_mismatches"]
    assert t.mismatch_fraction == expected["mismatches"] / a.size
    assert t.max_abs == expected["max_abs"]
    assert t.max_rel == expected["max_rel"]
    assert t.rel_l2 == pytest.approx(expected["rel_l2"], rel=1e-12, abs=0)
    if expected["cosine"] is None:
        assert t.cosine is None
    else:
        assert t.cosine == pytest.approx(expected["cosine"], abs=1e-12)
    if expected["max_abs"] == 0:
        assert t.worst_index is None
    else:
        assert expected["delta"][t.worst_index] == t.max_abs  # a position where the largest difference is
        if np.count_nonzero(expected["delta"] == t.max_abs) == 1:
            assert t.worst_index == np.unravel_index(int(np.argmax(expected["delta"])), a.shape)
        for reported, value in ((t.worst_a, a[t.worst_index]), (t.worst_b, b[t.worst_index])):
            assert reported == float(value) or (math.isnan(reported) and np.isnan(value))


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(cases(specials=False))
def test_figures_equal_whole_array_numpy_for_any_chunking(case):
    check_case(case)


@settings(PROPERTY, max_examples=30, phases=[Phase.generate], derandomize=True)
@given(cases(specials=True))
def test_figures_with_nan_and_inf_for_any_chunking(case):
    check_case(case)


def test_plain_values_nested_differently_by_two_formats_diff_equal(tmp_path):
    """DCP names every leaf of an optimizer's param_groups; the Tensormorph format keeps the list whole."""
    import torch
    import torch.distributed.checkpoint as dcp

    def state(lr: float) -> dict:
        return {"w": torch.arange(6.0).reshape(2, 3),
                "optim": {"param_groups": [{"lr": lr, "betas": (0.9, 0.95), "params": ["w"]}], "step": 7}}

    tm.save(state(0.1), tmp_path / "tm")
    dcp.save(state(0.1), checkpoint_id=str(tmp_path / "dcp"))
    dcp.save(state(0.2), checkpoint_id=str(tmp_path / "dcp-other"))
    assert "optim" in tm.open(tmp_path / "tm").objects  # no tensor inside: kept whole
    assert "optim.param_groups.0.lr" in tm.open(tmp_path / "dcp").objects
    same = tm.diff(tmp_path / "tm", tmp_path / "dcp")
    assert same.identical, same.to_dict()
    assert [(o.name, o.status) for o in same.objects] == [("optim", "equal")]
    changed = tm.diff(tmp_path / "tm", tmp_path / "dcp-other")
    assert [(o.name, o.status) for o in changed.objects] == [("optim", "different")]
    assert changed.objects[0].detail == "param_groups.0.lr: 0.1 != 0.2"
    reverse = tm.diff(tmp_path / "dcp-other", tmp_path / "tm")  # leaves on side a, the whole value on side b
    assert [(o.name, o.status) for o in reverse.objects] == [("optim", "different")]
