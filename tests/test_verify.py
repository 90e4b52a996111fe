"""`verify` finds hand-made damage in copies of real checkpoints, and names the file and the tensor."""

from __future__ import annotations

import io
import json
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from safetensors import safe_open

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.ops.verify import Problem, verify

pytestmark = pytest.mark.timeout(300)


def copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def zip_data_offset(blob: bytes, record_suffix: str) -> int:
    """Where the data of the zip record ending in `record_suffix` starts inside `blob` (read with zipfile)."""
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record_suffix))
    name_length, extra_length = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_length + extra_length


def rewrite_safetensors(path: Path, change) -> None:
    """Load one safetensors file with the safetensors library, let `change` edit (tensors, metadata), save it back."""
    with safe_open(str(path), "np") as f:
        metadata = dict(f.metadata() or {})
    tensors = safetensors.numpy.load_file(str(path))
    change(tensors, metadata)
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)


def only_problem(report) -> Problem:
    assert not report.ok and len(report.problems) == 1, report.problems
    return report.problems[0]


# ---------------------------------------------------------------------------
# undamaged checkpoints
# ---------------------------------------------------------------------------


def test_dcp_checks_every_item_crc(dcp_ckpt):
    from torch.distributed.checkpoint import FileSystemReader

    items = FileSystemReader(str(dcp_ckpt)).read_metadata().storage_data
    report = verify(dcp_ckpt, full=True)
    assert report.ok and report.problems == []
    assert (report.format, report.tensors, report.files) == ("dcp", 24, 4)
    assert report.checksums_checked == len(items) > 24  # tensor chunks and objects alike
    assert report.bytes_read == tm.open(dcp_ckpt).nbytes
    assert report.to_dict()["ok"] is True


@pytest.mark.parametrize("fixture, fmt, checksums", [
    ("dcp_zstd_ckpt", "dcp", None), ("hf_llama_bin", "hf-sharded", 3), ("hf_llama_safetensors", "hf-sharded", 0),
    ("dcp_safetensors_ckpt", "dcp-safetensors", 0), ("dcp_llama_2d", "dcp", None),
])
def test_undamaged_checkpoints_are_ok(fixture, fmt, checksums, request):
    path = request.getfixturevalue(fixture)
    report = verify(path, full=True)
    assert report.ok and report.format == fmt and report.tensors == len(tm.open(path))
    if checksums is not None:
        assert report.checksums_checked == checksums  # one zip per .bin shard; safetensors records none
    else:
        assert report.checksums_checked > report.tensors


# ---------------------------------------------------------------------------
# damage
# ---------------------------------------------------------------------------


def test_deleted_dcp_data_file(dcp_ckpt, tmp_path):
    ckpt = copy(dcp_ckpt, tmp_path)
    (ckpt / "__2_0.distcp").unlink()
    problem = only_problem(verify(ckpt))
    assert problem.kind == "MissingFileError"
    assert problem.file == str(ckpt / "__2_0.distcp") and ".metadata" in problem.message


def test_deleted_hf_shard(hf_llama_safetensors, tmp_path):
    ckpt = copy(hf_llama_safetensors, tmp_path)
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    problem = only_problem(verify(ckpt))
    assert problem.kind == "MissingFileError" and problem.file == str(ckpt / "model-00002-of-00003.safetensors")
    assert "model.safetensors.index.json" in problem.message  # the index that names the absent shard


@pytest.mark.parametrize("fixture, victim", [("dcp_ckpt", "__2_0.distcp"),
                                             ("hf_llama_safetensors", "model-00002-of-00003.safetensors")])
def test_deleted_file_names_a_tensor_it_held(fixture, victim, request, tmp_path):
    source = request.getfixturevalue(fixture)
    held = {t.name for t in tm.open(source).values() if victim in t.files}
    ckpt = copy(source, tmp_path)
    (ckpt / victim).unlink()
    assert only_problem(verify(ckpt)).tensor in held


def test_truncated_dcp_data_file(dcp_ckpt, tmp_path):
    ckpt = copy(dcp_ckpt, tmp_path)
    held = {t.name for t in tm.open(dcp_ckpt).values() if "__1_0.distcp" in t.files}
    data = ckpt / "__1_0.distcp"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:-100])
    problem = only_problem(verify(ckpt))
    assert problem.kind == "TruncatedFileError" and problem.file == str(data)
    assert problem.tensor in held and f"past the end of the {size - 100}-byte file" in problem.message


def test_truncated_hf_shard(hf_llama_safetensors, tmp_path):
    ckpt = copy(hf_llama_safetensors, tmp_path)
    shard = ckpt / "model-00003-of-00003.safetensors"
    length = int.from_bytes(shard.read_bytes()[:8], "little")
    header = json.loads(shard.read_bytes()[8:8 + length])
    header.pop("__metadata__", None)
    last = max(header, key=lambda name: header[name]["data_offsets"][1])
    shard.write_bytes(shard.read_bytes()[:-100])
    problem = only_problem(verify(ckpt))
    assert (problem.kind, problem.file, problem.tensor) == ("TruncatedFileError", str(shard), last)


def test_gap_when_a_middle_rank_is_missing(dcp_safetensors_ckpt, tmp_path):
    ckpt = copy(dcp_safetensors_ckpt, tmp_path)
    removed = sorted(ckpt.glob("shard-00002-*.safetensors"))
    assert len(removed) == 2
    for path in removed:
        path.unlink()
    problem = only_problem(verify(ckpt))
    # rank 1 held rows 3..5 of the 10x4 embedding (Shard(0) over 4 ranks: 3,3,3,1)
    assert (problem.kind, problem.tensor, problem.file) == ("ChunkLayoutError", "model.embed.weight", str(ckpt))
    assert "cover 28 of 40 elements" in problem.message and "12 elements are missing" in problem.message


def test_overlap_from_rewritten_saved_offsets(dcp_safetensors_ckpt, tmp_path):
    ckpt = copy(dcp_safetensors_ckpt, tmp_path)
    victim = ckpt / "shard-00002-model-00001-of-00002.safetensors"

    def shift(tensors, metadata):
        info = json.loads(metadata["DCP_SHARDING_INFO"])
        assert info["model.embed.weight"]["saved_offsets"] == [3, 0]
        info["model.embed.weight"]["saved_offsets"] = [2, 0]  # rows 2..4 now overlap rank 0's rows 0..2
        metadata["DCP_SHARDING_INFO"] = json.dumps(info)

    rewrite_safetensors(victim, shift)
    problem = only_problem(verify(ckpt))
    assert (problem.kind, problem.tensor) == ("ChunkLayoutError", "model.embed.weight")
    assert "overlap" in problem.message and "(2, 0)" in problem.message
    assert "shard-00001-model-00001-of-00002.safetensors" in problem.message and victim.name in problem.message


def test_flipped_byte_in_a_dcp_item(dcp_ckpt, tmp_path):
    ckpt = copy(dcp_ckpt, tmp_path)
    with tm.open(dcp_ckpt) as original:
        chunk = next(c for c in original["dtensors.uneven"].chunks if c.ranks == (1,))
        before = chunk.read().copy()
    begin, end = chunk.byte_range
    data = ckpt / chunk.file
    flip(data, begin + zip_data_offset(data.read_bytes()[begin:end], "/data/0") + 5)
    with tm.open(ckpt) as damaged:
        after = next(c for c in damaged["dtensors.uneven"].chunks if c.ranks == (1,)).read()
        assert np.count_nonzero(after != before) == 1  # the flip hit the tensor's data, nothing else
    problem = only_problem(verify(ckpt))
    assert (problem.kind, problem.file, problem.tensor) == ("ChecksumError", str(data), "dtensors.uneven")
    assert "CRC-32" in problem.message


def bin_flip(hf_llama_bin: Path, tmp_path: Path) -> tuple[Path, Path, str]:
    name = "model.layers.0.mlp.gate_proj.weight"
    with tm.open(hf_llama_bin) as original:
        tensor = original[name]
        (file,), (begin, _) = tensor.files, tensor.chunks[0].byte_range
    ckpt = copy(hf_llama_bin, tmp_path)
    flip(ckpt / file, begin + 7)
    return ckpt, ckpt / file, name


def test_flipped_byte_in_a_bin_shard(hf_llama_bin, tmp_path):
    ckpt, shard, _ = bin_flip(hf_llama_bin, tmp_path)
    report = verify(ckpt)
    problem = only_problem(report)
    assert (problem.kind, problem.file) == ("ChecksumError", str(shard)) and report.checksums_checked == 3
    assert "CRC-32" in problem.message and "pytorch_model-00002-of-00003/data/" in problem.message


def test_flipped_byte_in_a_bin_shard_names_the_tensor(hf_llama_bin, tmp_path):
    ckpt, _, name = bin_flip(hf_llama_bin, tmp_path)
    assert only_problem(verify(ckpt)).tensor == name


def test_nan_and_inf_only_with_full(hf_llama_safetensors, tmp_path):
    ckpt = copy(hf_llama_safetensors, tmp_path)
    shard = "model-00002-of-00003.safetensors"
    nan_in, inf_in = "model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.q_proj.weight"

    def spoil(tensors, metadata):
        tensors[nan_in][3, 4] = np.nan
        tensors[inf_in][0, 0] = np.inf
        tensors[inf_in][5, 6] = -np.inf

    rewrite_safetensors(ckpt / shard, spoil)
    assert verify(ckpt).ok  # nothing but the values is wrong, and safetensors records no checksums
    report = verify(ckpt, full=True)
    assert sorted(report.problems, key=lambda p: p.kind) == [
        Problem("inf", "holds 2 infinite values", shard, inf_in),
        Problem("nan", "holds 1 NaN values", shard, nan_in),
    ]
    assert report.bytes_read == tm.open(ckpt).nbytes


# ---------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------


def test_cli_exit_zero_when_fine(dcp_ckpt):
    result = CliRunner().invoke(main, ["verify", str(dcp_ckpt), "--full"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: ") and "(dcp; 24 tensors, 4 files" in result.output


def test_cli_exit_one_names_file_and_tensor(dcp_ckpt, tmp_path):
    ckpt = copy(dcp_ckpt, tmp_path)
    data = ckpt / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    result = CliRunner().invoke(main, ["verify", str(ckpt)])
    assert result.exit_code == 1
    first = result.output.splitlines()[0]
    assert first.startswith("TruncatedFileError ") and str(data) in first and "tensor '" in first
    assert "1 problem(s)" in result.output


def test_cli_json(hf_llama_safetensors, tmp_path):
    ckpt = copy(hf_llama_safetensors, tmp_path)
    rewrite_safetensors(ckpt / "model-00001-of-00003.safetensors",
                        lambda tensors, _: tensors["model.embed_tokens.weight"].__setitem__((0, 0), np.nan))
    result = CliRunner().invoke(main, ["verify", str(ckpt), "--full", "--json"])
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert (data["ok"], data["full"], data["format"], data["tensors"], data["files"]) == (
        False, True, "hf-sharded", 21, 3)
    assert data["problems"] == [{"kind": "nan", "message": "holds 1 NaN values",
                                 "file": "model-00001-of-00003.safetensors", "tensor": "model.embed_tokens.weight"}]
    result = CliRunner().invoke(main, ["verify", str(ckpt), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["ok"] is True


def test_cli_exit_two_when_it_cannot_run(tmp_path):
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "absent")])
    assert result.exit_code == 2 and "absent" in result.output
