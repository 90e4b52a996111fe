"""`convert` writes real DCP checkpoints as safetensors folders that the reference libraries load bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from fixtures.builders import expected_paths, load_expected
from safetensors import safe_open

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import CheckpointError
from tensormorph.ops.convert import parse_size

pytestmark = pytest.mark.timeout(300)

LLAMA_OBJECTS = ["step", "schedule.lr", "schedule.warmup"]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def truth(path: Path) -> dict[str, np.ndarray]:
    return load_expected(expected_paths(path)[0])


def staging_left(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name]


def test_dcp_to_safetensors_bit_exact(dcp_ckpt, tmp_path):
    out = tmp_path / "out"
    with tm.open(dcp_ckpt) as source:
        names, objects = list(source), list(source.objects)
        result = tm.convert(source, out)
    assert result.destination == out and result.files == ["model.safetensors"] and result.tensors == 24
    assert result.skipped_objects == objects and len(objects) == 20  # safetensors holds tensors only
    assert result.bytes_written == (out / "model.safetensors").stat().st_size
    assert result.check is not None and result.check.identical and result.check.counts == {"equal": 24}
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"] and staging_left(tmp_path) == []
    # the reference reader (through torch: fp8 and bf16 included) gets the DCP ground truth bit for bit
    written, expected = load_expected(out / "model.safetensors"), truth(dcp_ckpt)
    assert set(written) == set(expected) == set(names)
    for name, value in expected.items():
        assert same_bits(written[name], value), name
    with safe_open(str(out / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}
    converted = tm.open(out)
    assert converted.format == "safetensors" and list(converted) == names  # the source's order
    assert tm.diff(dcp_ckpt, converted, objects=False, block_bytes=512).counts == {"equal": 24}


@pytest.fixture(scope="module")
def llama_from_dcp(dcp_llama_1d, hf_llama_safetensors, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama") / "converted"
    result = tm.convert(dcp_llama_1d, out)
    assert result.check.identical and result.skipped_objects == LLAMA_OBJECTS
    shutil.copyfile(hf_llama_safetensors / "config.json", out / "config.json")
    return out


def test_llama_from_dcp_loads_with_safetensors_numpy(llama_from_dcp, hf_llama_safetensors):
    written, expected = safetensors.numpy.load_file(str(llama_from_dcp / "model.safetensors")), truth(
        hf_llama_safetensors)
    assert set(written) == set(expected) and len(written) == 21
    for name, value in expected.items():
        assert same_bits(written[name], value), name


def test_llama_from_dcp_loads_with_transformers(llama_from_dcp, hf_llama_safetensors):
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(str(llama_from_dcp), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state, expected = model.state_dict(), load_file(str(expected_paths(hf_llama_safetensors)[0]))
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name].view(torch.int32),
                                                                value.view(torch.int32)), name


def test_llama_2d_converts_under_its_wrapper_names(dcp_llama_2d, hf_llama_safetensors, tmp_path):
    result = tm.convert(dcp_llama_2d, tmp_path / "out")
    assert result.check.identical and result.tensors == 21
    report = tm.diff(tmp_path / "out", hf_llama_safetensors, rename=[r"re:^model\.(model\.|lm_head\.)=\1"])
    assert report.identical and report.counts == {"equal": 21}


def test_max_shard_size_writes_an_index(dcp_llama_1d, tmp_path):
    out = tmp_path / "out"
    result = tm.convert(dcp_llama_1d, out, max_shard_size="200KB")
    count = len(result.files)
    assert count > 2 and result.files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*result.files, "model.safetensors.index.json"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    source = tm.open(dcp_llama_1d)
    assert index["metadata"]["total_size"] == source.nbytes == sum(t.nbytes for t in source.values())
    assert list(index["weight_map"]) == list(source)  # the source's order, shards filled in turn
    assert result.bytes_written == sum((out / f).stat().st_size for f in result.files)
    for file in result.files:
        with safe_open(str(out / file), "np") as f:
            held = set(f.keys())
        assert held == {n for n, f_ in index["weight_map"].items() if f_ == file}
        data = sum(source[n].nbytes for n in held)
        assert data <= 200_000 or len(held) == 1, (file, data)
    assert [index["weight_map"][n] for n in source] == sorted(index["weight_map"].values())
    converted = tm.open(out)
    assert converted.format == "hf-sharded" and {t.file_shard[1] for t in converted.values()} == {count}
    assert tm.diff(source, converted, objects=False).counts == {"equal": 21}


def test_oversized_tensor_gets_a_shard_of_its_own(dcp_llama_1d, tmp_path):
    result = tm.convert(dcp_llama_1d, tmp_path / "out", max_shard_size=1000)
    assert len(result.files) == 21 and result.check.identical


@pytest.mark.parametrize("text, size", [("200KB", 200_000), ("1.5MB", 1_500_000), ("2GiB", 2 * 1024**3),
                                        ("5GB", 5 * 10**9), ("512", 512), ("64KiB", 65536)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "12XB", "-5MB", "MB", "1e3"])
def test_bad_size_is_an_error(text):
    with pytest.raises(CheckpointError, match="cannot read size"):
        parse_size(text)


def test_dtype_bf16_casts_floats_and_keeps_ints(dcp_ckpt, tmp_path):
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "out"
    result = tm.convert(dcp_ckpt, out, dtype="bf16")
    assert result.check.identical  # the check diffs against the source cast the same way
    written, expected = load_file(str(out / "model.safetensors")), load_file(str(expected_paths(dcp_ckpt)[0]))
    assert set(written) == set(expected)
    kinds = set()
    for name, value in expected.items():
        if value.is_floating_point():
            reference = value.to(torch.bfloat16)  # torch's own rounding, from F32, BF16 and F8 alike
            assert written[name].dtype == torch.bfloat16, name
            assert torch.equal(written[name].view(torch.int16), reference.view(torch.int16)), name
        else:
            assert written[name].dtype == value.dtype and torch.equal(written[name], value), name
        kinds.add(value.dtype)
    assert {torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64} <= kinds
    assert result.bytes_written == (out / "model.safetensors").stat().st_size
    assert tm.open(out)["dtensors.w_rs"].dtype == "I64"


@pytest.mark.parametrize("dtype", ["int8", "I32", "bool", "float128"])
def test_dtype_must_be_a_float(dtype, dcp_ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="cannot convert to dtype"):
        tm.convert(dcp_ckpt, tmp_path / "out", dtype=dtype)
    assert list(tmp_path.iterdir()) == []


def test_non_empty_destination_is_an_error(dcp_ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not an empty folder") as caught:
        tm.convert(dcp_ckpt, out)
    assert caught.value.file == str(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and staging_left(tmp_path) == []
    target = tmp_path / "file.safetensors"
    target.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not an empty folder"):
        tm.convert(dcp_ckpt, target)
    assert target.read_bytes() == b"x"


def test_empty_destination_folder_is_used(dcp_safetensors_ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = tm.convert(dcp_safetensors_ckpt, out)
    assert result.check.identical and result.skipped_objects == []
    written, expected = load_expected(out / "model.safetensors"), truth(dcp_safetensors_ckpt)
    assert set(written) == set(expected)
    assert all(same_bits(written[n], v) for n, v in expected.items())


def test_cli_convert_json(dcp_llama_1d, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(dcp_llama_1d), str(out), "--max-shard-size", "200KB",
                                       "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data) == {"destination", "files", "tensors", "bytes_written", "skipped_objects", "check"}
    assert data["destination"] == str(out) and data["tensors"] == 21 and data["skipped_objects"] == LLAMA_OBJECTS
    assert data["files"] == sorted(p.name for p in out.glob("*.safetensors")) and len(data["files"]) > 2
    assert data["bytes_written"] == sum((out / f).stat().st_size for f in data["files"])
    assert data["check"]["identical"] is True and data["check"]["counts"] == {"equal": 21}
    assert data["check"]["a"] == str(dcp_llama_1d) and data["check"]["b"] == str(out)


def test_cli_convert_dtype_and_no_check(dcp_llama_1d, tmp_path):
    result = CliRunner().invoke(main, ["convert", str(dcp_llama_1d), str(tmp_path / "a"), "--dtype", "bf16",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["check"]["counts"] == {"equal": 21}
    assert {t.dtype for t in tm.open(tmp_path / "a").values()} == {"BF16"}
    result = CliRunner().invoke(main, ["convert", str(dcp_llama_1d), str(tmp_path / "b"), "--no-check", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["check"] is None


def test_cli_convert_errors_exit_two(dcp_llama_1d, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("")
    result = CliRunner().invoke(main, ["convert", str(dcp_llama_1d), str(out)])
    assert result.exit_code == 2 and "not an empty folder" in result.output and str(out) in result.output
    result = CliRunner().invoke(main, ["convert", str(dcp_llama_1d), str(tmp_path / "new"), "--max-shard-size", "lots"])
    assert result.exit_code == 2 and "cannot read size 'lots'" in result.output
    assert not (tmp_path / "new").exists()


def test_cli_convert_text_output(dcp_llama_1d, tmp_path):
    result = CliRunner().invoke(main, ["convert", str(dcp_llama_1d), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "wrote 21 tensors" in result.output and "matches the source" in result.output
    assert "step, schedule.lr, schedule.warmup" in result.output
