"""Megatron-Core torch_dist: a checkpoint saved by the real megatron-core on 2 gloo ranks (tensor parallelism 2),
opened through the DCP reader with metadata.json's backend and common.pt's state read by the safe unpickler;
values against the tensors and objects the builder saved; CLI, viewer, damaged and hostile files. Then a real
GPTModel saved on 4 ranks as TP=2 x DP=2 (fully parallel and main-replica saves), read as logical tensors
bit-exact against the live ranks' shards, each chunk naming the rank that wrote it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import torch  # a dev dependency: the fixtures and the hostile common.pt files are made by torch itself
from click.testing import CliRunner
from fixtures import megatron_builders
from fixtures.cache import cached_build
from starlette.testclient import TestClient

import tensormorph as tm
from tensormorph import safe_pickle
from tensormorph.cli import main
from tensormorph.errors import HeaderError, MissingFileError, UnsafePickleError, UnsupportedError
from tensormorph.formats import dcp
from tensormorph.server import create_app

pytestmark = pytest.mark.timeout(240)  # the first run saves the fixtures on 2 and 4 gloo ranks (about 20 + 45 s)

QKV = "decoder.layers.self_attention.linear_qkv.weight"
PROJ = "decoder.layers.self_attention.linear_proj.weight"
EMBED = "embedding.word_embeddings.weight"
NORM = "decoder.final_layernorm.weight"
BIAS = "decoder.layers.mlp.router.expert_bias"
COMMON_KEYS = ["iteration", "checkpoint_version", "args", "opt_param_scheduler", "num_floating_point_operations_so_far"]


def _cached_build() -> Path:
    return cached_build("megatron", megatron_builders, lambda folder: megatron_builders.build(folder / "ckpt"))


@pytest.fixture(scope="module")
def built() -> Path:
    return _cached_build()


@pytest.fixture(scope="module")
def ckpt(built: Path) -> Path:
    return built / "ckpt"


@pytest.fixture(scope="module")
def truth(built: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(built / megatron_builders.TRUTH_TENSORS))


@pytest.fixture(scope="module")
def truth_objects(built: Path) -> dict[str, Any]:
    return json.loads((built / megatron_builders.TRUTH_OBJECTS).read_text())


def as_json(value: Any) -> Any:
    """Our object values in the builder's JSON vocabulary (torch dtypes as 'torch.bfloat16', tuples as lists)."""
    if isinstance(value, safe_pickle.TorchDType):
        return repr(value)
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return value


def copy_of(ckpt: Path, target: Path) -> Path:
    shutil.copytree(ckpt, target)
    return target


# ---------------------------------------------------------------------------
# the real checkpoint
# ---------------------------------------------------------------------------


def test_detected_before_dcp_with_the_backend_shown(ckpt: Path) -> None:
    assert tm.detect(ckpt) == tm.detect(ckpt / "metadata.json") == tm.detect(ckpt / ".metadata") == \
        "megatron-torch-dist"
    assert tm.detect(ckpt / "__0_0.distcp") != "megatron-torch-dist"  # one data file is not the checkpoint
    with tm.open(ckpt) as ck:
        assert ck.format == "megatron-torch-dist" and ck.path == ckpt
        meta = ck.metadata
        assert (meta["sharded_backend"], meta["sharded_backend_version"]) == ("torch_dist", 1)
        common = (meta["common_backend"], meta["common_backend_version"], meta["common_file"])
        assert common == ("torch", 1, "common.pt")
        assert meta["version"] == "1.0.0" and meta["metadata_files"] == [".metadata"]  # DCP's own metadata
        assert ck.files == ("__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp")


def test_tensors_and_their_placement(ckpt: Path, truth: dict[str, np.ndarray]) -> None:
    with tm.open(ckpt) as ck:
        assert sorted(ck) == sorted(truth)
        for name, expected in truth.items():
            assert ck[name].dtype == {NORM: "BF16", BIAS: "I64"}.get(name, "F32")
            np.testing.assert_array_equal(ck[name].full(), expected)
        layout = {name: sorted((c.offsets, c.shape, c.ranks) for c in ck[name].chunks) for name in truth}
    assert layout[EMBED] == [((0, 0), (8, 8), (0,)), ((8, 0), (8, 8), (1,))]  # vocab-parallel rows
    assert layout[QKV] == [((0, 0, 0), (1, 12, 8), (0,)), ((0, 12, 0), (1, 12, 8), (1,)),
                           ((1, 0, 0), (1, 12, 8), (0,)), ((1, 12, 0), (1, 12, 8), (1,))]  # layer axis, then TP
    assert layout[PROJ] == [((0, 0, 0), (1, 8, 6), (0,)), ((0, 0, 6), (1, 8, 6), (1,)),
                            ((1, 0, 0), (1, 8, 6), (0,)), ((1, 0, 6), (1, 8, 6), (1,))]  # row-parallel columns
    assert layout[NORM] == [((0,), (8,), (0,))]  # replicated over TP: only the main replica (rank 0) wrote it
    assert layout[BIAS] == [((0, 0), (1, 6), (0,)), ((1, 0), (1, 6), (0,))]


def test_region_and_local_reads(ckpt: Path, truth: dict[str, np.ndarray]) -> None:
    with tm.open(ckpt) as ck:
        np.testing.assert_array_equal(ck[QKV][1, 10:14, ::3], truth[QKV][1, 10:14, ::3])
        np.testing.assert_array_equal(ck[PROJ][:, -1, 4:8], truth[PROJ][:, -1, 4:8])
        np.testing.assert_array_equal(ck[EMBED].local(1), truth[EMBED][8:])


def test_common_state_and_sharded_objects(ckpt: Path, truth_objects: dict[str, Any]) -> None:
    with tm.open(ckpt) as ck:
        assert list(ck.objects) == ["rng_state/shard_0_2", "rng_state/shard_1_2", *COMMON_KEYS]
        values = {name: entry.value() for name, entry in ck.objects.items()}
        assert ck.objects["args"].file == "common.pt"
    assert {name: as_json(v) for name, v in values.items()} == truth_objects
    args = values["args"]
    assert type(args) is not dict and isinstance(args, dict) and safe_pickle.is_plain(args)
    assert args["params_dtype"] == safe_pickle.TorchDType("bfloat16") and args["attention_backend"] == "AttnBackend(5)"
    assert values["iteration"] == 7 and values["rng_state/shard_1_2"]["rank"] == 1


def test_the_plain_dcp_reader_reads_it_too(ckpt: Path, truth: dict[str, np.ndarray]) -> None:
    with tm.open(ckpt, format="dcp") as ck:
        assert ck.format == "dcp" and "sharded_backend" not in ck.metadata
        np.testing.assert_array_equal(ck[QKV].full(), truth[QKV])
        assert ck.objects["rng_state/shard_0_2"].value()[0]["rank"] == 0  # DCP shows the stored list as it is


def test_verify_checks_common_pt_too(ckpt: Path, tmp_path: Path) -> None:
    report = tm.verify(ckpt, full=True)
    assert report.ok and report.format == "megatron-torch-dist", report.problems
    with tm.open(ckpt, format="dcp") as ck:
        items = len(list(dcp.checksum_problems(ck)))
    assert items == 15 and report.checksums_checked == items + 1  # every DCP item, then common.pt
    damaged = copy_of(ckpt, tmp_path / "damaged")
    with zipfile.ZipFile(damaged / "common.pt") as archive:
        record = next(i for i in archive.infolist() if i.filename.endswith("/version"))
    blob = bytearray((damaged / "common.pt").read_bytes())
    name_length, extra_length = struct.unpack("<HH", blob[record.header_offset + 26:record.header_offset + 30])
    blob[record.header_offset + 30 + name_length + extra_length] ^= 0x01
    (damaged / "common.pt").write_bytes(bytes(blob))
    problems = tm.verify(damaged).problems
    assert [(p.kind, Path(p.file).name) for p in problems] == [("ChecksumError", "common.pt")]


# ---------------------------------------------------------------------------
# damaged and hostile files
# ---------------------------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_common_pt_code_is_refused_and_never_run(ckpt: Path, tmp_path: Path, truth: dict[str, np.ndarray]) -> None:
    hostile = copy_of(ckpt, tmp_path / "hostile")
    marker = tmp_path / "ran"
    torch.save({"iteration": 1, "args": _Payload(marker)}, hostile / "common.pt")
    with tm.open(hostile) as ck:
        assert list(ck.objects)[-1] == "common.pt"  # the whole file, since its keys cannot be read safely
        with pytest.raises(UnsafePickleError, match="posix.system") as caught:
            ck.objects["common.pt"].value()
        np.testing.assert_array_equal(ck[EMBED].full(), truth[EMBED])  # the tensors are still there
    assert caught.value.file == str(hostile / "common.pt")
    assert not marker.exists()


def test_common_pt_tensors_are_not_plain_data(ckpt: Path, tmp_path: Path) -> None:
    odd = copy_of(ckpt, tmp_path / "odd")
    torch.save({"iteration": 3, "loss_scale": torch.ones(2)}, odd / "common.pt")
    with tm.open(odd) as ck:
        assert ck.objects["iteration"].value() == 3
        with pytest.raises(UnsafePickleError, match="holds a TensorRef, which is not plain data") as caught:
            ck.objects["loss_scale"].value()
    assert caught.value.tensor == "loss_scale"


def test_missing_common_pt(ckpt: Path, tmp_path: Path) -> None:
    missing = copy_of(ckpt, tmp_path / "missing")
    (missing / "common.pt").unlink()
    with pytest.raises(MissingFileError, match="Megatron-Core writes the non-sharded state") as caught:
        tm.open(missing)
    assert caught.value.file == str(missing / "common.pt")


@pytest.mark.parametrize("config, error, fragment", [
    ({"sharded_backend": "zarr", "sharded_backend_version": 1}, UnsupportedError, "'zarr' backend"),
    ({"sharded_backend": "torch_dist", "sharded_backend_version": -1}, HeaderError, "non-negative integer"),
    ({"sharded_backend": 3}, HeaderError, "string 'sharded_backend'"),
    ("{not json", HeaderError, "not valid UTF-8 JSON"),
])
def test_bad_metadata_json(ckpt: Path, tmp_path: Path, config: Any, error: type, fragment: str) -> None:
    bad = copy_of(ckpt, tmp_path / "bad")
    (bad / "metadata.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(error, match=fragment) as caught:
        tm.open(bad, format="megatron-torch-dist")
    assert caught.value.file == str(bad / "metadata.json")


# ---------------------------------------------------------------------------
# CLI and viewer
# ---------------------------------------------------------------------------


def cli(*args: Any) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_cli(ckpt: Path, truth: dict[str, np.ndarray], tmp_path: Path) -> None:
    text = cli("inspect", ckpt)
    assert "format megatron-torch-dist" in text and "sharded_backend: \"torch_dist\"" in text
    assert "4 chunks, ranks 0-1" in text and "7 non-tensor entries" in text
    data = json.loads(cli("inspect", "--json", ckpt))
    assert data["metadata"]["sharded_backend"] == "torch_dist"
    assert [o["name"] for o in data["objects"]][2:] == COMMON_KEYS
    shown = json.loads(cli("show", "--json", ckpt, QKV, "--slice", "1, 10:14"))
    assert shown["values"] == truth[QKV][1, 10:14].astype(np.float64).tolist()
    local = json.loads(cli("show", "--json", ckpt, EMBED, "--rank", "1"))
    assert local["values"] == truth[EMBED][8:].astype(np.float64).tolist()
    stats = json.loads(cli("stats", "--json", ckpt, PROJ))[0]
    assert (stats["min"], stats["max"]) == (float(truth[PROJ].min()), float(truth[PROJ].max()))
    copy = tmp_path / "truth.safetensors"
    safetensors.numpy.save_file(truth, str(copy))
    report = tm.diff(ckpt, copy, objects=False)
    assert report.identical and len(report.tensors) == len(truth), report.to_dict()


def test_viewer(ckpt: Path, truth: dict[str, np.ndarray]) -> None:
    with TestClient(create_app([ckpt])) as client:
        summary = client.get("/api/checkpoints/a/summary").json()
        assert summary["format"] == "megatron-torch-dist" and summary["metadata"]["sharded_backend"] == "torch_dist"
        assert [o["name"] for o in summary["objects"]][2:] == COMMON_KEYS
        info = client.get("/api/checkpoints/a/tensor", params={"name": QKV}).json()
        assert info["ranks"] == [0, 1] and info["split"] == "4 chunks, ranks 0-1" and info["encoding"] is None
        stats = client.get("/api/checkpoints/a/stats", params={"name": EMBED, "rank": "1"}).json()
        assert stats["max"] == float(truth[EMBED][8:].max())


# ---------------------------------------------------------------------------
# TP=2 x DP=2: a real GPTModel on 4 ranks
# ---------------------------------------------------------------------------

FULLY_PARALLEL, MAIN_REPLICAS = megatron_builders.FULLY_PARALLEL, megatron_builders.MAIN_REPLICAS
GPT_QKV = "decoder.layers.self_attention.linear_qkv.weight"  # column-parallel: rows split over TP
GPT_PROJ = "decoder.layers.self_attention.linear_proj.weight"  # row-parallel: columns split over TP
GPT_LN = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"  # replicated over TP and DP


@pytest.fixture(scope="module")
def tp_dp() -> Path:
    return cached_build("megatron-tp-dp", megatron_builders, megatron_builders.build_tp_dp)


@pytest.fixture(scope="module")
def tp_dp_truth(tp_dp: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(tp_dp / megatron_builders.TP_DP_TRUTH))


@pytest.fixture(scope="module")
def tp_dp_writers(tp_dp: Path) -> dict[str, dict[str, list[Any]]]:
    return json.loads((tp_dp / megatron_builders.TP_DP_WRITERS).read_text())


@pytest.mark.parametrize("save", [FULLY_PARALLEL, MAIN_REPLICAS])
def test_tp_dp_tensors_are_logical_and_bit_exact(tp_dp: Path, tp_dp_truth: dict[str, np.ndarray],
                                                 tp_dp_writers: dict[str, Any], save: str) -> None:
    writers = tp_dp_writers[save]
    with tm.open(tp_dp / save) as ck:
        assert ck.format == "megatron-torch-dist" and sorted(ck) == sorted(tp_dp_truth) == sorted(writers)
        for name, expected in tp_dp_truth.items():
            got = ck[name].full()
            assert (got.dtype, got.shape) == (expected.dtype, expected.shape), name
            assert got.tobytes() == expected.tobytes(), name  # bit-exact, bf16 included
            assert sorted([list(c.offsets), list(c.shape), *c.ranks] for c in ck[name].chunks) == writers[name], name
        assert {ck[name].dtype for name in ck} == {"BF16", "F32"}  # bf16 linear weights, fp32 norms
        ranks = sorted({rank for chunks in writers.values() for *_, rank in chunks})
        assert ck.files == tuple(f"__{rank}_{thread}.distcp" for rank in ranks for thread in (0, 1))
    # the fully parallel save spreads the writes over the data-parallel replicas; the plain one leaves them to dp 0
    assert ranks == ([0, 1, 2, 3] if save == FULLY_PARALLEL else [0, 1])


def test_tp_dp_chunks_follow_megatrons_splits(tp_dp: Path) -> None:
    with tm.open(tp_dp / FULLY_PARALLEL) as ck:
        assert (ck[GPT_QKV].shape, ck[GPT_PROJ].shape, ck[EMBED].shape) == ((2, 48, 16), (2, 16, 16), (64, 16))
        qkv = sorted((c.offsets, c.shape) for c in ck[GPT_QKV].chunks)
        assert qkv == [((layer, row, 0), (1, 24, 16)) for layer in (0, 1) for row in (0, 24)]
        proj = sorted((c.offsets, c.shape) for c in ck[GPT_PROJ].chunks)
        assert proj == [((layer, 0, column), (1, 16, 8)) for layer in (0, 1) for column in (0, 8)]
        assert sorted((c.offsets, c.shape) for c in ck[GPT_LN].chunks) == [((0, 0), (1, 16)), ((1, 0), (1, 16))]
        # a TP shard is written by a rank of its own tensor-parallel index (rank r is tp r % 2, dp r // 2)
        for name, axis, size in ((GPT_QKV, 1, 24), (GPT_PROJ, 2, 8), (EMBED, 0, 32)):
            for chunk in ck[name].chunks:
                assert chunk.ranks[0] % megatron_builders.TP == chunk.offsets[axis] // size, (name, chunk.offsets)


def test_tp_dp_region_local_and_objects(tp_dp: Path, tp_dp_truth: dict[str, np.ndarray],
                                        tp_dp_writers: dict[str, Any]) -> None:
    with tm.open(tp_dp / FULLY_PARALLEL) as ck:
        np.testing.assert_array_equal(ck[GPT_QKV][:, 20:28, ::5], tp_dp_truth[GPT_QKV][:, 20:28, ::5])
        np.testing.assert_array_equal(ck[GPT_PROJ][1, 3:5, 6:10], tp_dp_truth[GPT_PROJ][1, 3:5, 6:10])
        for offsets, shape, rank in tp_dp_writers[FULLY_PARALLEL][EMBED]:
            np.testing.assert_array_equal(ck[EMBED].local(rank), tp_dp_truth[EMBED][offsets[0]:offsets[0] + shape[0]])
        values = {name: entry.value() for name, entry in ck.objects.items()}
    assert values.pop("iteration") == megatron_builders.TP_DP_ITERATION and values.pop("checkpoint_version") == 3.0
    extra = {f"decoder.layers.{m}._extra_state/shard_{layer}_2": None for layer in (0, 1)
             for m in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")}
    assert values == extra  # the local spec's modules keep no extra state


def test_tp_dp_saves_diff_equal(tp_dp: Path) -> None:
    report = tm.diff(tp_dp / FULLY_PARALLEL, tp_dp / MAIN_REPLICAS)
    assert report.identical and len(report.tensors) == 17, report.to_dict()
    report = tm.diff(tp_dp / FULLY_PARALLEL, tp_dp / megatron_builders.TP_DP_TRUTH, objects=False)
    assert report.identical and len(report.tensors) == 17, report.to_dict()
