"""DeepSpeed ZeRO (stages 1-3, fp32 and bf16) and universal checkpoints, saved by the real DeepSpeed on 2 gloo
ranks (tests/fixtures/deepspeed_builders.py): values bit-exact against DeepSpeed's own zero_to_fp32 and its live
engine, which rank holds which range, region reads that touch only the overlapping partitions, tied aliases,
optimizer moments, the universal conversion, CLI, viewer, verify, and damaged or hostile files.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from fixtures import builders, deepspeed_builders
from fixtures.cache import cached_build
from fixtures.deepspeed_builders import CONFIGS, TAG
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from test_tiles import assert_fields_equal, decode_tile, reference_tile

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.core import Checkpoint
from tensormorph.errors import (
    CheckpointError,
    HeaderError,
    MissingFileError,
    UnknownFormatError,
    UnsafePathError,
    UnsafePickleError,
)
from tensormorph.formats import deepspeed
from tensormorph.server import create_app

pytestmark = pytest.mark.timeout(300)  # a cold cache trains and saves six configurations (about 20 s)

PARAMS = ["embed.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
FROZEN = ["norm.weight", "norm.bias"]
MOMENTS = ["exp_avg", "exp_avg_sq"]


def _cached_build() -> Path:
    return cached_build("deepspeed", deepspeed_builders, deepspeed_builders.build_all)


@pytest.fixture(scope="module")
def built() -> Path:
    return _cached_build()


@pytest.fixture(scope="module", params=list(CONFIGS))
def config(request: pytest.FixtureRequest, built: Path) -> str:
    return request.param


def load_truth(built: Path, config: str, which: str) -> dict[str, np.ndarray]:
    return builders.load_expected(built / config / f"{which}.safetensors")


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact: same dtype, shape and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()
            == np.ascontiguousarray(b).reshape(-1).view(np.uint8).tobytes())


def stage_of(config: str) -> int:
    return CONFIGS[config][0]


def optim_file(config: str, rank: int) -> str:
    return f"{'bf16_' if CONFIGS[config][1] == 'bf16' else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


# ---------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------


def test_detected_by_save_folder_and_tag_folder(built: Path) -> None:
    save = built / "zero2_bf16" / "ckpt"
    assert tm.detect(save) == "deepspeed" and tm.detect(save / TAG) == "deepspeed"
    assert tm.detect(save / f"{TAG}_universal") == "deepspeed-universal"
    with tm.open(save) as a, tm.open(save / TAG) as b:
        assert a.path == b.path == save / TAG and list(a) == list(b)
    # the save folder holds both `latest` and `latest_universal`: each reader follows its own pointer
    with tm.open(save, format="deepspeed-universal") as universal:
        assert universal.path == save / f"{TAG}_universal"


def test_every_tensor_bit_exact_against_deepspeed(built: Path, config: str) -> None:
    """zero_to_fp32's reconstruction and the live engine's full fp32 params, moments, module weights, buffers."""
    stage, dtype = CONFIGS[config]
    reconstructed = load_truth(built, config, "zero_to_fp32")
    live = load_truth(built, config, "live")
    with tm.open(built / config / "ckpt") as ck:
        for name, value in {**reconstructed, **live}.items():
            assert same(ck[name].full(), value), name
        # nothing more than DeepSpeed's own view, plus the step counters, the tied module weight and,
        # where ZeRO-1 records no frozen parameters, the module's own copy of them
        steps = {f"optimizer.state.{p}.step" for p in PARAMS}
        extra = set() if stage == 3 else {"module.head.weight"} | (set(FROZEN) if stage == 1 else set())
        assert set(ck) == set(reconstructed) | set(live) | steps | extra
        for name in steps:
            assert ck[name].full() == np.float32(deepspeed_builders.STEPS)
        if stage == 1:
            for name in FROZEN:
                assert same(ck[name].full(), live[f"module.{name}"])
        assert ck["module.embed.weight" if stage < 3 else "scale"].dtype == ("BF16" if dtype == "bf16" and
                                                                             stage < 3 else "F32")
        assert ck.metadata["zero_stage"] == stage and ck.metadata["dp_world_size"] == 2
        assert sorted(ck.metadata["frozen"]) == sorted(FROZEN)
        objects = {name: entry.value() for name, entry in ck.objects.items()}
        assert objects["global_steps"] == deepspeed_builders.STEPS and objects["ds_version"].startswith("0.19")
        assert objects["ds_config"]["zero_optimization"] == {"stage": stage}
        assert objects["optimizer.zero_stage"] == stage
        assert objects["optimizer.loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}
        assert objects["optimizer.param_groups"][0]["lr"] == 0.01 and "params" not in objects[
            "optimizer.param_groups"][0]


def test_tied_parameters_are_aliases(built: Path, config: str) -> None:
    with tm.open(built / config / "ckpt") as ck:
        expected = {"head.weight": "embed.weight"}
        if stage_of(config) < 3:
            expected["module.head.weight"] = "module.embed.weight"
        assert ck.metadata["aliases"] == expected
        for alias, source in expected.items():
            assert ck[alias].chunks == ck[source].chunks and ck[alias].shape == ck[source].shape


def test_chunks_say_which_rank_holds_which_range(built: Path) -> None:
    """ZeRO-2: the group's flat elements 0-79 on rank 0, 80-156 on rank 1; fc1.weight (7×6) spans them at
    element 20 of its 42, mid-row. ZeRO-3: every parameter split on its own, ceil(n/2) elements per rank."""
    def table(ck: Checkpoint, name: str) -> list[tuple]:
        return [(c.offsets, c.shape, c.file, c.ranks) for c in ck[name].chunks]

    with tm.open(built / "zero2_fp32" / "ckpt") as ck:
        rank0, rank1 = optim_file("zero2_fp32", 0), optim_file("zero2_fp32", 1)
        assert table(ck, "fc1.weight") == [
            ((0, 0), (3, 6), rank0, (0,)), ((3, 0), (1, 2), rank0, (0,)),
            ((3, 2), (1, 4), rank1, (1,)), ((4, 0), (3, 6), rank1, (1,))]
        assert table(ck, "embed.weight") == [((0, 0), (10, 6), rank0, (0,))]
        assert table(ck, "fc2.weight") == [((0, 0), (6, 7), rank1, (1,))]
        assert ck.metadata["partition_sizes"] == [[80], [77]]  # 157 elements, padded to 160, split in two
        assert [c.offsets for c in ck["optimizer.state.fc1.weight.exp_avg"].chunks] == [
            (0, 0), (3, 0), (3, 2), (4, 0)]
        assert str(ck["fc1.weight"].placement) == "mesh(dp=2) [ZeRO-2 flat partition]"
        # byte ranges: rank 1's piece starts at its partition's first element, right after the storage header
        assert ck["fc1.weight"].chunks[2].byte_range[1] - ck["fc1.weight"].chunks[2].byte_range[0] == 4 * 4
    with tm.open(built / "zero3_bf16" / "ckpt") as ck:
        rank0, rank1 = optim_file("zero3_bf16", 0), optim_file("zero3_bf16", 1)
        assert table(ck, "fc1.weight") == [
            ((0, 0), (3, 6), rank0, (0,)), ((3, 0), (1, 3), rank0, (0,)),
            ((3, 3), (1, 3), rank1, (1,)), ((4, 0), (3, 6), rank1, (1,))]
        assert table(ck, "embed.weight") == [((0, 0), (5, 6), rank0, (0,)), ((5, 0), (5, 6), rank1, (1,))]
        assert table(ck, "fc1.bias") == [((0,), (4,), rank0, (0,)), ((4,), (3,), rank1, (1,))]
        models = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)]
        assert table(ck, "norm.weight") == [((0,), (3,), models[0], (0,)), ((3,), (3,), models[1], (1,))]
        assert ck.metadata["partition_sizes"] == [[79], [79]]  # 30 + 21 + 4 + 21 + 3 per rank
        assert "module.embed.weight" not in ck  # ZeRO-3 saves only empty placeholders in the module


@contextmanager
def touched(ck: Checkpoint) -> Iterator[list[tuple[str, Any]]]:
    """Record every file a read maps or advises (with the byte runs it asks for)."""
    files, log = ck.storage, []
    assert files is not None
    buffer, advise = files.buffer, files.advise

    def logged_buffer(name: str) -> memoryview:
        log.append((name, None))
        return buffer(name)

    def logged_advise(name: str, runs: list[tuple[int, int]], advice: str) -> None:
        log.append((name, tuple(runs)))
        advise(name, runs, advice)

    files.buffer, files.advise = logged_buffer, logged_advise
    try:
        yield log
    finally:
        del files.buffer, files.advise


@pytest.mark.parametrize("name, index, ranks", [
    ("embed.weight", np.s_[:5], {0}),
    ("embed.weight", np.s_[5:, 2], {1}),
    ("fc1.weight", np.s_[3, :3], {0}),
    ("fc1.weight", np.s_[3, 3:], {1}),
    ("fc1.weight", np.s_[2:5], {0, 1}),
    ("optimizer.state.fc1.weight.exp_avg", np.s_[6], {1}),
    ("norm.bias", np.s_[4:], {1}),
])
def test_region_reads_touch_only_overlapping_partitions(built: Path, name: str, index: Any, ranks: set[int]) -> None:
    live = {**load_truth(built, "zero3_fp32", "live"), **load_truth(built, "zero3_fp32", "zero_to_fp32")}
    with tm.open(built / "zero3_fp32" / "ckpt") as ck:
        tensor = ck[name]
        with touched(ck) as log:
            assert same(tensor[index], live[name][index])
        files = {file for file, _ in log}
        assert files == {c.file for c in tensor.chunks if c.ranks[0] in ranks}
        for file, runs in log:  # and within those files only the bytes of the overlapping pieces
            spans = [c.byte_range for c in tensor.chunks if c.file == file]
            for begin, end in runs or ():
                assert any(b <= begin and end <= e for b, e in spans), (file, (begin, end), spans)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_slices_equal_numpy(built: Path, data: st.DataObject) -> None:
    config = data.draw(st.sampled_from(["zero2_bf16", "zero3_bf16"]))
    name = data.draw(st.sampled_from(PARAMS + [f"optimizer.state.{p}.exp_avg_sq" for p in PARAMS]))
    truth = load_truth(built, config, "live")[name]
    index = tuple(slice(data.draw(st.integers(-n - 1, n + 1)), data.draw(st.integers(-n - 1, n + 1)),
                        data.draw(st.sampled_from([1, 2, 3, -1, -2]))) for n in truth.shape)
    with tm.open(built / config / "ckpt") as ck:
        assert same(ck[name][index], truth[index])


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 5), max_size=4).map(tuple), data=st.data())
def test_flat_boxes_tile_the_range_in_order(shape: tuple[int, ...], data: st.DataObject) -> None:
    total = math.prod(shape)
    begin = data.draw(st.integers(0, total))
    end = data.draw(st.integers(begin, total))
    grid = np.arange(total).reshape(shape)
    seen = []
    for offsets, box, first in deepspeed.flat_boxes(shape, begin, end):
        values = grid[tuple(slice(o, o + s) for o, s in zip(offsets, box))].reshape(-1)
        assert values.size == math.prod(box) > 0
        assert values.tolist() == list(range(first, first + values.size))  # one contiguous run of the flat storage
        seen.extend(values.tolist())
    assert seen == list(range(begin, end))
    assert len(deepspeed.flat_boxes(shape, begin, end)) <= max(1, 2 * len(shape) - 1)


def test_reading_needs_neither_torch_nor_deepspeed(built: Path) -> None:
    code = ("import sys, tensormorph as tm; ck = tm.open(sys.argv[1]); [ck[n].full() for n in ck]; "
            "[e.value() for e in ck.objects.values()]; "
            "assert not {'torch', 'deepspeed'} & set(sys.modules), sorted(m for m in sys.modules if 'torch' in m)")
    for folder in (built / "zero3_bf16" / "ckpt", built / "zero2_fp32" / "ckpt" / f"{TAG}_universal"):
        subprocess.run([sys.executable, "-c", code, str(folder)], check=True, timeout=120)


# ---------------------------------------------------------------------------
# the universal checkpoint
# ---------------------------------------------------------------------------

# What DeepSpeed's own ds_to_universal changes, seen through both readers: with bf16 it writes the tied head
# from the module's bf16 copy and the frozen parameters cast to fp32; at stage 3 it drops the frozen parameters
# and the step counters.
UNIVERSAL_DIFFERENCES = {
    1: {"fp32": {}, "bf16": {"head.weight": "different", "norm.weight": "dtype_mismatch",
                             "norm.bias": "dtype_mismatch"}},
    3: {"fp32": {**dict.fromkeys(FROZEN, "only_a"), **{f"optimizer.state.{p}.step": "only_a" for p in PARAMS}}},
}
UNIVERSAL_DIFFERENCES[2] = UNIVERSAL_DIFFERENCES[1]
UNIVERSAL_DIFFERENCES[3]["bf16"] = UNIVERSAL_DIFFERENCES[3]["fp32"]


def test_universal_checkpoint(built: Path, config: str) -> None:
    stage, dtype = CONFIGS[config]
    live = load_truth(built, config, "live")
    folder = built / config / "ckpt" / f"{TAG}_universal"
    with tm.open(folder) as universal:
        assert universal.format == "deepspeed-universal" and universal.metadata["zero_stage"] == stage
        for name in PARAMS + [f"optimizer.state.{p}.{m}" for p in PARAMS for m in MOMENTS]:
            assert same(universal[name].full(), live[name]), name  # stage 3's flat files shown in the param's shape
        assert same(universal["scale"].full(), live["scale"])
        report = tm.diff(built / config / "ckpt", universal)
        assert {t.name: t.status for t in report.tensors if t.status != "equal"} == \
            UNIVERSAL_DIFFERENCES[stage][dtype]
        assert all(o.status == "equal" for o in report.objects) and report.objects
        if dtype == "bf16" and stage < 3:
            assert same(universal["head.weight"].full(), live["module.embed.weight"].astype(np.float32))


# ---------------------------------------------------------------------------
# CLI, diff, viewer, verify
# ---------------------------------------------------------------------------


def cli(*args: Any, code: int = 0) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.exception)
    return result.output


def test_cli(built: Path) -> None:
    ckpt = built / "zero3_bf16" / "ckpt"
    truth = load_truth(built, "zero3_bf16", "live")
    text = cli("inspect", "--chunks", ckpt)
    assert "format deepspeed" in text and "zero_stage: 3" in text and "4 chunks, ranks 0-1" in text
    assert f"{optim_file('zero3_bf16', 1)} ranks [1]" in text
    data = json.loads(cli("inspect", "--json", ckpt))
    assert data["format"] == "deepspeed" and data["metadata"]["aliases"] == {"head.weight": "embed.weight"}
    record = next(t for t in data["tensors"] if t["name"] == "fc1.weight")
    assert [(c["offsets"], c["shape"], c["ranks"]) for c in record["chunks"]] == [
        ([0, 0], [3, 6], [0]), ([3, 0], [1, 3], [0]), ([3, 3], [1, 3], [1]), ([4, 0], [3, 6], [1])]
    shown = json.loads(cli("show", "--json", ckpt, "fc1.weight", "--slice", "3, 1:5"))
    assert shown["values"] == truth["fc1.weight"][3, 1:5].astype(np.float64).tolist()
    local = json.loads(cli("show", "--json", ckpt, "embed.weight", "--rank", "1"))
    assert local["values"] == truth["embed.weight"][5:].astype(np.float64).tolist()
    stats = json.loads(cli("stats", "--json", ckpt, "optimizer.state.fc2.weight.exp_avg"))[0]
    moment = truth["optimizer.state.fc2.weight.exp_avg"]
    assert (stats["min"], stats["max"]) == (float(moment.min()), float(moment.max()))


def test_diff_against_an_hf_export(built: Path, tmp_path: Path) -> None:
    """The fp32 weights equal a Hugging Face style export of DeepSpeed's own reconstruction, name for name."""
    ckpt = built / "zero2_fp32" / "ckpt"
    export = tmp_path / "hf"
    export.mkdir()
    weights = load_truth(built, "zero2_fp32", "zero_to_fp32")
    safetensors.numpy.save_file(weights, str(export / "model.safetensors"))
    report = tm.diff(ckpt, export, names=list(weights))
    assert report.identical and len(report.tensors) == len(weights), report.to_dict()
    # by default the CLI compares everything: the weights are equal, the training state is only on one side
    common = json.loads(cli("diff", "--json", "--common-only", ckpt, export))
    assert {t["name"]: t["status"] for t in common["tensors"]} == dict.fromkeys(weights, "equal")
    result = json.loads(cli("diff", "--json", ckpt, export, code=1))
    statuses = {t["name"]: t["status"] for t in result["tensors"]}
    assert {n: s for n, s in statuses.items() if n in weights} == dict.fromkeys(weights, "equal")
    assert {s for n, s in statuses.items() if n not in weights} == {"only_a"}
    assert all(n.startswith(("module.", "optimizer.")) for n in statuses if n not in weights)


def test_viewer(built: Path) -> None:
    ckpt = built / "zero3_fp32" / "ckpt"
    truth = load_truth(built, "zero3_fp32", "live")
    with TestClient(create_app([ckpt])) as client:
        summary = client.get("/api/checkpoints/a/summary").json()
        assert summary["format"] == "deepspeed" and summary["metadata"]["zero_stage"] == 3
        info = client.get("/api/checkpoints/a/tensor", params={"name": "fc1.weight"}).json()
        assert info["ranks"] == [0, 1] and info["split"] == "4 chunks, ranks 0-1"
        assert [(c["offsets"], c["shape"], c["ranks"]) for c in info["chunks"]][1:3] == [
            ([3, 0], [1, 3], [0]), ([3, 3], [1, 3], [1])]
        response = client.get("/api/checkpoints/a/tile", params={"name": "fc1.weight", "exact": "1"})
        assert response.status_code == 200, response.text
        _header, fields = decode_tile(response.content)
        assert_fields_equal(fields, reference_tile(truth["fc1.weight"].astype(np.float64), 0, 7, 0, 6, 256, 256,
                                                   True))
        stats = client.get("/api/checkpoints/a/stats", params={"name": "embed.weight", "rank": "1"}).json()
        assert stats["max"] == float(truth["embed.weight"][5:].max())
        # a rank's share of fc1.weight is two boxes forming one run of the flattened tensor: shown as that run
        flat = truth["fc1.weight"].reshape(-1)
        share = client.get("/api/checkpoints/a/stats", params={"name": "fc1.weight", "rank": "0"}).json()
        assert (share["min"], share["max"]) == (float(flat[:21].min()), float(flat[:21].max()))
        with tm.open(ckpt) as ck:
            assert ck["fc1.weight"].local(1).tobytes() == flat[21:].tobytes()
            assert ck["fc1.weight"].local_tensor(0).shape == (21,)


def test_verify(built: Path, tmp_path: Path) -> None:
    report = tm.verify(built / "zero2_bf16" / "ckpt", full=True)
    assert report.ok and report.checksums_checked == 3 and report.format == "deepspeed", report.to_dict()
    ckpt = copy_config(built, "zero2_bf16", tmp_path)
    with tm.open(ckpt) as ck:
        chunk = ck["fc2.weight"].chunks[0]
    path = ckpt / TAG / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.byte_range[0] + 5] ^= 0x40
    path.write_bytes(bytes(data))
    damaged = tm.verify(ckpt)
    assert [(p.kind, Path(p.file).name) for p in damaged.problems] == [("ChecksumError", chunk.file)]


# ---------------------------------------------------------------------------
# damaged and hostile files
# ---------------------------------------------------------------------------


def copy_config(built: Path, config: str, tmp_path: Path) -> Path:
    target = tmp_path / config
    shutil.copytree(built / config / "ckpt", target, ignore=shutil.ignore_patterns(f"{TAG}_universal"))
    return target


def edit_pickle(path: Path, edit: Callable[[bytes], bytes]) -> None:
    """Rewrite a torch.save file with its data.pkl edited (the other records kept as they are)."""
    with zipfile.ZipFile(path) as source:
        records = [(info.filename, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as target:
        for name, data in records:
            target.writestr(name, edit(data) if name.endswith("/data.pkl") else data)


def replace_once(old: bytes, new: bytes) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        assert data.count(old) >= 1, old
        return data.replace(old, new)
    return edit


def test_code_in_a_pickle_is_refused(built: Path, tmp_path: Path) -> None:
    ckpt = copy_config(built, "zero2_fp32", tmp_path)
    victim = ckpt / TAG / optim_file("zero2_fp32", 1)
    edit_pickle(victim, replace_once(b"deepspeed.runtime.fp16.loss_scaler\nLossScaler\n", b"os\nsystem\n"))
    with pytest.raises(UnsafePickleError, match=r"refuses global os\.system") as caught:
        tm.open(ckpt)
    assert caught.value.file == str(victim.resolve()) and caught.value.tensor == "fc1.weight"
    assert "rank 1's share" in str(caught.value)


def test_truncated_partition_file_names_file_and_tensor(built: Path, tmp_path: Path) -> None:
    ckpt = copy_config(built, "zero2_fp32", tmp_path)
    victim = ckpt / TAG / optim_file("zero2_fp32", 1)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CheckpointError) as caught:
        tm.open(ckpt)
    assert caught.value.file == str(victim.resolve()) and caught.value.tensor == "fc1.weight"
    assert "fc1.weight, fc1.bias, fc2.weight, fc2.bias" in str(caught.value)


def test_inconsistent_partition_sizes(built: Path, tmp_path: Path) -> None:
    ckpt = copy_config(built, "zero2_fp32", tmp_path)
    # rank 0's partition and moments claim 70 elements instead of 80: size tuples (80,) become (70,)
    edit_pickle(ckpt / TAG / optim_file("zero2_fp32", 0), replace_once(b"K\x50\x85", b"K\x46\x85"))
    with pytest.raises(HeaderError, match=r"rank 1's partition of group 0 holds 77 elements \(80 with padding\), "
                                          r"rank 0's 70 \(70\)") as caught:
        tm.open(ckpt)
    assert Path(caught.value.file).name == optim_file("zero2_fp32", 1)


def test_param_shapes_that_do_not_fit_the_partitions(built: Path, tmp_path: Path) -> None:
    ckpt = copy_config(built, "zero2_fp32", tmp_path)
    # fc2.bias (6,) becomes (9,): three more elements than the partitions hold
    edit_pickle(ckpt / TAG / "mp_rank_00_model_states.pt", _resize_fc2_bias)
    with pytest.raises(HeaderError, match=r"needs flat elements \[151, 160\) of group 0") as caught:
        tm.open(ckpt)
    assert caught.value.tensor == "fc2.bias"


def _resize_fc2_bias(data: bytes) -> bytes:
    """In param_shapes (written after the module), fc2.bias's torch.Size([6]) becomes torch.Size([9])."""
    start = data.index(b"param_shapes")
    match = re.compile(rb"fc2\.bias(.{0,12}?)K\x06\x85", re.S).search(data, start)
    assert match is not None
    return data[:match.end() - 2] + b"\x09\x85" + data[match.end():]


def test_slice_mappings_that_disagree(built: Path, tmp_path: Path) -> None:
    ckpt = copy_config(built, "zero2_fp32", tmp_path)
    # rank 1's record of fc1.weight: numel 22 becomes 21
    edit_pickle(ckpt / TAG / optim_file("zero2_fp32", 1),
                replace_once(b"K\x16X\x05\x00\x00\x00start", b"K\x15X\x05\x00\x00\x00start"))
    with pytest.raises(HeaderError, match=r"\(group, start, numel\) = \(0, 0, 21\), .* at \(0, 0, 22\)") as caught:
        tm.open(ckpt)
    assert caught.value.tensor == "fc1.weight"


def test_missing_and_misnamed_files(built: Path, tmp_path: Path) -> None:
    ckpt = copy_config(built, "zero3_fp32", tmp_path)
    (ckpt / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(MissingFileError, match="ZeRO-3 saves every rank's model states"):
        tm.open(ckpt)
    ckpt = copy_config(built, "zero2_fp32", tmp_path / "b")
    (ckpt / TAG / optim_file("zero2_fp32", 1)).unlink()
    with pytest.raises(MissingFileError, match="partitioned over 2 data-parallel ranks, but 1 optimizer-state"):
        tm.open(ckpt)
    (ckpt / TAG / optim_file("zero2_fp32", 0)).rename(ckpt / TAG / optim_file("zero2_fp32", 1))
    with pytest.raises(MissingFileError, match=r"ranks \[0\] are missing"):
        tm.open(ckpt)
    # a forged rank number in a file name costs nothing: no table of three billion ranks is built
    (ckpt / TAG / optim_file("zero2_fp32", 1)).rename(ckpt / TAG / optim_file("zero2_fp32", 0))
    (ckpt / TAG / optim_file("zero2_fp32", 0)).with_name(optim_file("zero2_fp32", 3_000_000_000)).write_bytes(b"")
    with pytest.raises(MissingFileError, match=r"ranks \[1\] are missing"):
        tm.open(ckpt)


def test_latest_cannot_point_outside(built: Path, tmp_path: Path) -> None:
    ckpt = copy_config(built, "zero1_fp32", tmp_path)
    (ckpt / "latest").write_text("../../elsewhere")
    assert tm.detect(ckpt) is None
    with pytest.raises(UnknownFormatError):
        tm.open(ckpt)
    with pytest.raises(UnsafePathError, match="outside the checkpoint folder"):
        tm.open(ckpt, format="deepspeed")
    (ckpt / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(HeaderError, match="not UTF-8"):
        tm.open(ckpt, format="deepspeed")


def _rank1_template() -> dict[str, Any]:
    """zero2_fp32's rank-1 optimizer states, rebuilt from plain data with the real sizes."""
    import torch

    return {"optimizer_state_dict": {
        "zero_stage": 2, "partition_count": [2], "single_partition_of_fp32_groups": [torch.zeros(77)],
        "group_paddings": [3], "param_alignment_paddings": [[0] * 5],
        "base_optimizer_state": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(80),
                                               "exp_avg_sq": torch.zeros(80)}},
                                 "param_groups": [{"lr": 0.01, "params": [0]}]}}}


def _paths(tree: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _paths(value, prefix + (i,))


JUNK = st.recursive(st.none() | st.booleans() | st.integers(-3, 200) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.integers(0, 2) | st.text(max_size=5),
                                                                                 inner, max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def mangle_target(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    ckpt = copy_config(built, "zero2_fp32", tmp_path_factory.mktemp("mangled"))
    torch.save(_rank1_template(), ckpt / TAG / optim_file("zero2_fp32", 1))
    with tm.open(ckpt) as ck:  # the template itself is a valid rank-1 file
        assert ck["fc1.bias"].shape == (7,)
    return ckpt


# Records of rank 1's optimizer states that its partition layout rests on: the tree down to the moments, the
# stage, the flat fp32 partition and the parameter list. Any other value there is a damaged file.
LAYOUT_RECORDS = [("optimizer_state_dict",), ("optimizer_state_dict", "zero_stage"),
                  ("optimizer_state_dict", "single_partition_of_fp32_groups"),
                  ("optimizer_state_dict", "single_partition_of_fp32_groups", 0),
                  ("optimizer_state_dict", "base_optimizer_state"),
                  ("optimizer_state_dict", "base_optimizer_state", "state"),
                  ("optimizer_state_dict", "base_optimizer_state", "state", 0),
                  ("optimizer_state_dict", "base_optimizer_state", "param_groups", 0, "params")]
# Records no tensor is read from: whatever they hold, every tensor reads as before.
UNREAD_RECORDS = [("optimizer_state_dict", "param_alignment_paddings"),
                  ("optimizer_state_dict", "param_alignment_paddings", 0),
                  *[("optimizer_state_dict", "param_alignment_paddings", 0, i) for i in range(5)],
                  ("optimizer_state_dict", "base_optimizer_state", "param_groups", 0, "lr")]
NOTHING = object()  # a deleted record


def mangle(data: st.DataObject, path: tuple) -> tuple[dict[str, Any], Any, Any]:
    """rank 1's template with the record at `path` replaced by junk, a tensor of any shape, or deleted:
    (template, the original value, its replacement)."""
    import torch

    template = _rank1_template()
    parent = template
    for key in path[:-1]:
        parent = parent[key]
    shapes = st.lists(st.integers(0, 90), max_size=2).map(lambda s: torch.zeros(tuple(s)))
    replacement = data.draw(st.one_of(JUNK, shapes, st.just(NOTHING)))
    original = parent[path[-1]]
    if replacement is NOTHING:
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return template, original, replacement


def same_value(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):  # lists of tensors (fp32 partitions): compared item by item
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def read_all(ckpt: Path) -> dict[str, np.ndarray]:
    with tm.open(ckpt) as ck:
        return {name: ck[name].full() for name in ck}


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_mangled_layout_records_are_refused(mangle_target: Path, data: st.DataObject) -> None:
    """Any other value (junk, a tensor of another shape) in a record the partition layout rests on, or the
    record deleted, is a HeaderError naming rank 1's file."""
    import torch

    path = data.draw(st.sampled_from(LAYOUT_RECORDS))
    template, original, replacement = mangle(data, path)
    assume(not same_value(original, replacement))
    # an empty `params` list is no damage: the reader then takes the state in its stored order, which is this
    # file's order (test_mangled_unread_records_change_no_tensor's kind of record)
    assume(not (path[-1] == "params" and isinstance(replacement, list) and not replacement))
    victim = mangle_target / TAG / optim_file("zero2_fp32", 1)
    torch.save(template, victim)
    with pytest.raises(HeaderError) as caught:
        read_all(mangle_target)
    assert optim_file("zero2_fp32", 1) in str(caught.value)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_mangled_unread_records_change_no_tensor(mangle_target: Path, data: st.DataObject) -> None:
    """Whatever replaces (or deletes) a record no tensor is read from, every tensor reads as before."""
    import torch

    victim = mangle_target / TAG / optim_file("zero2_fp32", 1)
    torch.save(_rank1_template(), victim)
    before = read_all(mangle_target)
    template, _, _ = mangle(data, data.draw(st.sampled_from(UNREAD_RECORDS)))
    torch.save(template, victim)
    after = read_all(mangle_target)
    assert after.keys() == before.keys() and all(same(after[name], before[name]) for name in before)
