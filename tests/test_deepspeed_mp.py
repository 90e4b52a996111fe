"""DeepSpeed ZeRO checkpoints with a model-parallel degree of 2, written by the real DeepSpeed on 4 gloo ranks
(2 tensor-parallel x 2 data-parallel, tests/fixtures/deepspeed_builders.py build_mp): DeepSpeed's AutoTP
(ZeRO-1, ZeRO-2 bf16, ZeRO-3), which records the split as affine maps, and a Megatron-style model run with an
`mpu`, which records it as Megatron-DeepSpeed does (category patterns), also saved without that record. Every
value is bit-exact against the tensors gathered from the live ranks.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from fixtures import builders, deepspeed_builders
from fixtures.cache import cached_build
from fixtures.deepspeed_builders import MP_CONFIGS, TAG
from test_deepspeed import edit_pickle, same, touched

import tensormorph as tm
from tensormorph.errors import CheckpointError, HeaderError, MissingFileError
from tensormorph.formats.deepspeed import splits
from tensormorph.formats.deepspeed.reader import read_parts
from tensormorph.storage import store_at

pytestmark = pytest.mark.timeout(300)  # a cold cache trains and saves four configurations on 4 ranks (about 30 s)

MOMENTS = ["exp_avg", "exp_avg_sq"]
# ZeRO-1/2 cut each rank's piece of down_proj's shard mid-row, so a rank's share of the row-parallel weight is
# several boxes that are one run of its shard but not of the logical tensor: LogicalTensor.local (core.py) takes
# only runs of the logical tensor
NOT_ONE_RUN = {("autotp_zero1", "down_proj.weight"), ("autotp_zero2_bf16", "down_proj.weight")}


@pytest.fixture(scope="module")
def built() -> Path:
    return cached_build("deepspeed_mp", deepspeed_builders, deepspeed_builders.build_mp)


def truth(built: Path, config: str, which: str) -> dict[str, np.ndarray]:
    return builders.load_expected(built / config / f"{which}.safetensors")


def info(built: Path, config: str) -> dict[str, Any]:
    return json.loads((built / config / "info.json").read_text())


def param_of(name: str) -> str:
    """The parameter a tensor name belongs to: <param>, module.<param>, optimizer.state.<param>.<key>."""
    if name.startswith("optimizer.state."):
        return name[len("optimizer.state."):].rpartition(".")[0]
    return name.removeprefix("module.")


def optim_file(config: str, dp: int, mp: int) -> str:
    return f"{'bf16_' if MP_CONFIGS[config][2] == 'bf16' else ''}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"


@pytest.mark.parametrize("config", list(MP_CONFIGS))
def test_every_tensor_bit_exact_against_the_live_ranks(built: Path, config: str) -> None:
    """Masters, moments, module weights and buffers, each one logical tensor; an averaged parameter per rank."""
    kind, stage, _ = MP_CONFIGS[config]
    live, shards, split = truth(built, config, "live"), truth(built, config, "shards"), info(built, config)["split"]
    with tm.open(built / config / "ckpt") as ck:
        for name, value in live.items():
            assert same(ck[name].full(), value), name
        averaged = [p for p, kind in split.items() if kind == "avg"]
        per_rank = {n for n in shards if any(re.fullmatch(rf"mp_rank_0\d\.(module\.|optimizer\.state\.)?{re.escape(p)}"
                                                          rf"(\.exp_avg|\.exp_avg_sq)?", n) for p in averaged)}
        means = {n.split(".", 1)[1] for n in per_rank}
        for name in means:  # Partial(avg): the mean of the two copies, as DeepSpeed's universal checkpoint takes it
            copies = [shards[f"mp_rank_0{m}.{name}"] for m in range(2)]
            assert same(ck[name].full(), (copies[0] + copies[1]) / np.float32(2)), name
            assert ck[name].reduction is not None and ck[name].placement.placements[0] == "Partial(avg)"
            for chunk in ck[name].chunks:  # contribution m: model-parallel rank m's copy, held by its ranks
                box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))
                assert same(chunk.read(), copies[chunk.contribution][box]), name
                assert all(r % 2 == chunk.contribution for r in chunk.ranks), name
        steps = {f"optimizer.state.{p}.step" for p in split}
        assert set(ck) == set(live) | means | steps
        for name in steps:
            assert ck[name].full() == np.float32(deepspeed_builders.STEPS)
        assert {k: ck.metadata[k] for k in ("zero_stage", "dp_world_size", "mp_world_size", "tp_layout")} == {
            "zero_stage": stage, "dp_world_size": 2, "mp_world_size": 2, "tp_layout": "universal_checkpoint_info"}
        assert ck.metadata["tp_unmerged"] == {}
        assert ck.metadata["rank_order"] == "global rank = dp_rank * mp_world_size + mp_rank"
        assert {int(r): tuple(c) for r, c in info(built, config)["coordinates"].items()} == {
            r: (r // 2, r % 2) for r in range(4)}  # the live ranks' (dp, tp) coordinates follow that order
        copies = {n for n in live if split.get(param_of(n)) == "rep"} | set(info(built, config)["buffers"]) | steps
        assert sorted(ck.metadata["tp_replicated"]) == sorted(copies)  # read from model-parallel rank 0
        assert len(ck.files) == (8 if stage == 3 else 6)


def test_placements_and_which_rank_holds_which_box(built: Path) -> None:
    """AutoTP ZeRO-1: down_proj's (6, 5) shards side by side (Shard(1)); each shard's 83-element group padded
    to 84 and split in two, so data-parallel rank 0 holds its first 7 elements (a row and 2 of the next)."""
    with tm.open(built / "autotp_zero1" / "ckpt") as ck:
        def table(name: str) -> list[tuple]:
            return sorted((c.offsets, c.shape, c.file, c.ranks) for c in ck[name].chunks)

        assert table("down_proj.weight") == sorted([
            ((0, 0), (1, 5), optim_file("autotp_zero1", 0, 0), (0,)),
            ((1, 0), (1, 2), optim_file("autotp_zero1", 0, 0), (0,)),
            ((1, 2), (1, 3), optim_file("autotp_zero1", 1, 0), (2,)),
            ((2, 0), (4, 5), optim_file("autotp_zero1", 1, 0), (2,)),
            ((0, 5), (1, 5), optim_file("autotp_zero1", 0, 1), (1,)),
            ((1, 5), (1, 2), optim_file("autotp_zero1", 0, 1), (1,)),
            ((1, 7), (1, 3), optim_file("autotp_zero1", 1, 1), (3,)),
            ((2, 5), (4, 5), optim_file("autotp_zero1", 1, 1), (3,))])
        assert table("up_proj.bias") == [((0,), (5,), optim_file("autotp_zero1", 0, 0), (0,)),
                                         ((5,), (5,), optim_file("autotp_zero1", 0, 1), (1,))]
        assert table("norm.weight") == [((0,), (6,), optim_file("autotp_zero1", 1, 0), (2,))]  # read once
        assert table("module.down_proj.weight") == [((0, 0), (6, 5), "mp_rank_00_model_states.pt", ()),
                                                    ((0, 5), (6, 5), "mp_rank_01_model_states.pt", ())]
        assert str(ck["down_proj.weight"].placement) == "mesh(mp=2, dp=2) [Shard(1), ZeRO-1 flat partition]"
        assert str(ck["up_proj.weight"].placement) == "mesh(mp=2, dp=2) [Shard(0), ZeRO-1 flat partition]"
        assert str(ck["norm.weight"].placement) == "mesh(mp=2, dp=2) [Replicate(), ZeRO-1 flat partition]"
        assert str(ck["module.norm.bias"].placement) == "mesh(mp=2) [Replicate()]"
        assert ck.metadata["partition_sizes"] == [[[42], [41]], [[42], [41]]]  # [mp][dp][group]
    with tm.open(built / "megatron_zero2" / "ckpt") as ck:
        # the vocabulary-parallel embedding: 6 rows per rank, the padding rows 10-11 (rank 1's last two) cut
        assert str(ck["embed.weight"].placement) == "mesh(mp=2, dp=2) [Shard(0), cut to 10 rows, ZeRO-2 flat " \
                                                    "partition]"
        assert sorted((c.offsets, c.shape, c.ranks) for c in ck["embed.weight"].chunks) == [
            ((0, 0), (6, 6), (0,)), ((6, 0), (4, 6), (1,))]


@pytest.mark.parametrize("config", list(MP_CONFIGS))
def test_local_is_what_each_live_rank_held(built: Path, config: str) -> None:
    """local(rank) is the rank's own flat ZeRO fragment of its shard; a replicated parameter is read from
    model-parallel rank 0, so the other ranks' copies are not chunks (verify compares them)."""
    held = truth(built, config, "locals")
    split = info(built, config)["split"]
    checked = 0
    with tm.open(built / config / "ckpt") as ck:
        for key, value in held.items():
            rank, param = int(key.split(".", 1)[0]), key.split(".", 1)[1]
            name = param  # an averaged parameter: local(rank) is that rank's contribution
            if split[param] == "rep" and rank % 2:
                with pytest.raises(CheckpointError, match="holds no stored chunk"):
                    ck[name].local(rank)
            elif (config, name) not in NOT_ONE_RUN:
                got = ck[name].local(rank).reshape(-1)
                if split[param] == "vocab":  # the padding rows past the vocabulary are no part of the tensor
                    assert got.size == (24 if rank == 1 else value.size)  # rank 1: rows 6-9 of 6-11
                    value = value[:got.size]
                assert same(got, value), key
                checked += 1
    assert checked >= 7  # every rank of every config holds pieces of several split parameters


def test_local_of_a_row_parallel_piece_cut_mid_row(built: Path) -> None:
    held = truth(built, "autotp_zero1", "locals")
    with tm.open(built / "autotp_zero1" / "ckpt") as ck:
        assert same(ck["down_proj.weight"].local(2).reshape(-1), held["2.down_proj.weight"])


def test_region_reads_touch_only_the_ranks_holding_the_region(built: Path) -> None:
    live = truth(built, "autotp_zero3", "live")
    with tm.open(built / "autotp_zero3" / "ckpt") as ck:
        tensor = ck["down_proj.weight"]
        with touched(ck) as log:
            assert same(tensor[:3, 5:], live["down_proj.weight"][:3, 5:])  # tensor-parallel rank 1, dp rank 0
        assert {file for file, _ in log} == {optim_file("autotp_zero3", 0, 1)}


def test_logical_tensors_diff_equal_to_an_export(built: Path, tmp_path: Path) -> None:
    live = truth(built, "autotp_zero2_bf16", "live")
    masters = {n: v for n, v in live.items() if not n.startswith(("module.", "optimizer."))}
    safetensors.numpy.save_file(masters, str(tmp_path / "model.safetensors"))
    report = tm.diff(built / "autotp_zero2_bf16" / "ckpt", tmp_path, names=list(masters))
    assert report.identical and len(report.tensors) == len(masters), report.to_dict()


def test_without_split_info_each_rank_is_listed_apart(built: Path) -> None:
    """The same state saved without universal_checkpoint_info: no merge is guessed."""
    shards = truth(built, "megatron_zero2", "shards")
    with tm.open(built / "megatron_zero2" / "plain") as ck:
        assert ck.metadata["tp_layout"].startswith("unrecorded: the model states hold no universal_checkpoint_info")
        steps = {f"mp_rank_0{m}.optimizer.state.{p}.step" for m in range(2) for p in deepspeed_builders.MEGATRON_SPLIT}
        assert set(ck) == set(shards) | steps | {"mp_rank_00.scale", "mp_rank_01.scale"}
        for name, value in shards.items():
            assert same(ck[name].full(), value), name
        assert str(ck["mp_rank_01.fc2.weight"].placement) == "mesh(dp=2) [ZeRO-2 flat partition]"
        assert {c.ranks for c in ck["mp_rank_01.fc2.weight"].chunks} == {(3,)}


def test_verify_compares_the_replicas(built: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(built / "autotp_zero1" / "ckpt", folder)
    report = tm.verify(folder)
    # 6 files; 18 replicated tensors: 6 step counters, and 3 parameters' masters, moments and module copies
    assert report.ok and report.checksums_checked == 6 + 18, report.to_dict()
    files = store_at(folder / TAG)
    copy = read_parts(files, folder / TAG)[1].tensors["norm.weight"].chunks[0]  # model-parallel rank 1's copy
    path = folder / TAG / copy.file
    data = bytearray(path.read_bytes())
    data[copy.byte_range[0] + 1] ^= 0x40
    path.write_bytes(bytes(data))
    with tm.open(folder) as ck:  # the copy read (rank 0's) is intact
        assert same(ck["norm.weight"].full(), truth(built, "autotp_zero1", "live")["norm.weight"])
    damaged = tm.verify(folder)
    assert sorted((p.kind, p.tensor) for p in damaged.problems) == [("CheckpointError", "norm.weight"),
                                                                    ("ChecksumError", None)]
    assert "rank 1's copy differs from rank 0's" in next(p.message for p in damaged.problems if p.tensor)


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------


def copy_config(built: Path, config: str, tmp_path: Path, which: str = "ckpt") -> Path:
    target = tmp_path / config
    shutil.copytree(built / config / which, target)
    return target


def test_missing_model_parallel_files(built: Path, tmp_path: Path) -> None:
    ckpt = copy_config(built, "autotp_zero1", tmp_path)
    (ckpt / TAG / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(MissingFileError, match=r"holds no model states of model-parallel rank 1 "
                                               r"\(mp_rank_01_model_states\.pt"):
        tm.open(ckpt)
    ckpt = copy_config(built, "autotp_zero1", tmp_path / "b")
    (ckpt / TAG / optim_file("autotp_zero1", 1, 1)).unlink()
    with pytest.raises(MissingFileError, match="model-parallel rank 1 has optimizer states of 1 data-parallel ranks, "
                                               "model-parallel rank 0 of 2"):
        tm.open(ckpt)
    for dp in range(2):
        (ckpt / TAG / optim_file("autotp_zero1", dp, 0)).unlink()
    with pytest.raises(MissingFileError, match=r"optimizer states of model-parallel ranks \[0\] are missing"):
        tm.open(ckpt)
    ckpt = copy_config(built, "autotp_zero1", tmp_path / "c")
    for name in ("mp_rank_01_model_states.pt", optim_file("autotp_zero1", 0, 1), optim_file("autotp_zero1", 1, 1)):
        (ckpt / TAG / name).unlink()
    with pytest.raises(MissingFileError, match=r"says mp_world_size 2, but only the files of model-parallel ranks "
                                               r"0-0 are present") as caught:
        tm.open(ckpt)
    assert Path(caught.value.file).name == "mp_rank_00_model_states.pt"


def test_shapes_that_differ_across_model_parallel_ranks(built: Path, tmp_path: Path) -> None:
    ckpt = copy_config(built, "megatron_zero2", tmp_path)
    # model-parallel rank 1's param_shapes say fc1.weight is (6, 4), not (4, 6): the same elements, so its own
    # partitions still fit, but a split along dim 0 needs the other dims equal
    edit_pickle(ckpt / TAG / "mp_rank_01_model_states.pt", _transpose_fc1_weight)
    with pytest.raises(HeaderError, match=r"model-parallel rank 1 holds it with shape \(6, 4\), rank 0 with \(4, 6\); "
                                          "its split needs the same sizes on every dimension but 0") as caught:
        tm.open(ckpt)
    assert caught.value.tensor == "fc1.weight"
    assert caught.value.file == str((ckpt / TAG / "mp_rank_01_model_states.pt").resolve())


def _transpose_fc1_weight(data: bytes) -> bytes:
    """fc1.weight's size (4, 6) and stride (6, 1) in the module, and its param_shapes entry, become (6, 4)."""
    module = re.compile(rb"fc1\.weight.{0,40}?K\x04K\x06\x86(q.)K\x06K\x01\x86", re.S).search(data)
    assert module is not None
    data = data[:module.start(1) - 5] + b"K\x06K\x04\x86" + module.group(1) + b"K\x04K\x01\x86" + data[module.end():]
    match = re.compile(rb"fc1\.weight(.{0,12}?)K\x04K\x06\x86", re.S).search(data, data.index(b"param_shapes"))
    assert match is not None
    return data[:match.end() - 5] + b"K\x06K\x04\x86" + data[match.end():]


# ---------------------------------------------------------------------------
# the split rules (DeepSpeed's universal_checkpoint_info, as plain data)
# ---------------------------------------------------------------------------


def test_split_rules() -> None:
    paths = ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    rules = splits.Rules({"tp_replicated_parameter_patterns": [r"norm", r"norm\.w"],
                          "parameter_with_2_sub_params_cat_dim_0": [r"mlp\.fused"],
                          "parameter_with_row_parallelism_patterns": [r"out"]}, paths[0])
    assert rules.split("out.weight", [(3, 2), (3, 4)], paths) == splits.Split("Shard(1)", (3, 6), (
        (splits.Block((0, 0), (0, 0), (3, 2)),), (splits.Block((0, 0), (0, 2), (3, 4)),)))
    assert rules.split("in.weight", [(2, 3), (1, 3)], paths).shape == (3, 3)  # uneven: concatenated as saved
    assert isinstance(rules.split("mlp.fused.weight", [(4, 3), (4, 3)], paths), splits.Unmerged)
    with pytest.raises(HeaderError, match="matches 2 patterns of universal_checkpoint_info"):
        rules.split("norm.weight", [(3,), (3,)], paths)
    with pytest.raises(HeaderError, match="not a regular expression"):
        splits.Rules({"vocabulary_parameter_patterns": ["("]}, paths[0])
    piece = {"shape": [2], "source": [0, [1]], "dest": [0, [1]], "locations": [0, 1]}
    entry = {"logical_shape": [2], "ranks": {0: {"shard_shape": [2], "pieces": [piece]},
                                             1: {"shard_shape": [2], "pieces": [piece]}}}
    newer = splits.Rules({"affine_map": {"version": 2, "params": {"b": entry}}}, paths[0])
    assert "encoding version 2" in newer.split("b", [(2,), (2,)], paths).reason  # type: ignore[union-attr]
    scaled = {**entry, "ranks": {r: {"shard_shape": [2], "pieces": [{**piece, "scale": 0.5}]} for r in range(2)}}
    assert isinstance(splits.Rules({"affine_map": {"params": {"b": scaled}}}, paths[0]).split(
        "b", [(2,), (2,)], paths), splits.Unmerged)
    assert splits.Rules({"affine_map": {"params": {"b": entry}}}, paths[0]).split(
        "b", [(2,), (2,)], paths) == splits.replicated((2,), 2)
    with pytest.raises(HeaderError, match="gives model-parallel rank 1 a shard of shape \\(2,\\), this file records "
                                          "\\(3,\\)") as caught:
        splits.Rules({"affine_map": {"params": {"b": entry}}}, paths[0]).split("b", [(2,), (3,)], paths)
    assert caught.value.file == paths[1]


def test_inspect_and_the_viewer_describe_an_averaged_parameter(built: Path) -> None:
    """A Partial(avg) placement beside DeepSpeed's own placement text (not a torch placement) is described."""
    from click.testing import CliRunner
    from starlette.testclient import TestClient

    from tensormorph.cli import main
    from tensormorph.server import create_app

    folder = built / "megatron_zero2" / "ckpt"
    shown = CliRunner().invoke(main, ["inspect", str(folder), "--json"])
    assert shown.exit_code == 0, shown.output
    records = {t["name"]: t for t in json.loads(shown.output)["tensors"]}
    assert records["norm.bias"]["reduction"] == {"op": "avg", "contributions": 2, "mesh_dims": [0]}
    assert "Partial(avg) over mesh dim 0: 2 contributions" in records["norm.bias"]["split"]
    with TestClient(create_app([folder])) as client:
        info = client.get("/api/checkpoints/a/tensor", params={"name": "norm.bias"})
        assert info.status_code == 200 and info.json()["reduction"]["op"] == "avg"


def test_a_backtracking_pattern_is_refused_not_run_for_hours() -> None:
    from tensormorph.formats.deepspeed.splits import MATCH_TIMEOUT_S, Rules

    rules = Rules({"tp_replicated_parameter_patterns": ["(a|aa)+$"]}, "mp_rank_00_model_states.pt")
    with pytest.raises(HeaderError, match=f"takes over {MATCH_TIMEOUT_S} s") as caught:
        rules.split("a" * 60 + "!", [(2,), (2,)], ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"])
    assert caught.value.tensor == "a" * 60 + "!"
