"""The 2-D (FSDP2 + tensor parallel) training state of a real Llama through tensormorph: saved, read, loaded on
the same mesh, resharded to 1-D FSDP and to one process, diffed against DCP and converted for transformers.

The state comes from tests/fixtures/placement_builders.py (cached): torch's own parallelize_module + fully_shard
on a (dp=2, tp=2) gloo mesh after AdamW steps, with real `_StridedShard` parameters and moments, saved by
dcp.save, with every tensor's full_tensor() and every rank's to_local() as ground truth. Here 4 ranks rebuild the
same model, restore that state with dcp.load, and save it with tm.save; every check is bit-exact.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as tmp
from click.testing import CliRunner
from fixtures import placement_builders as pb
from fixtures.cache import cached_build
from safetensors.torch import load_file

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.tmformat.manifest import MANIFEST

pytestmark = pytest.mark.timeout(300)  # a cold fixture cache trains on 4 gloo ranks first (about 30 s)

LOAD_RANKS = 2  # the 1-D FSDP mesh the 2-D state is resharded onto
SLACK = 1.05  # bytes read per rank may exceed bytes needed by this factor (the bound)


# ---------------------------------------------------------------- rank processes


def _restore_save_reload_worker(rank: int, port: int, out: str, fixture: str, path: str) -> None:
    """Rebuild the 2-D model, restore the trained state (dcp.load), tm.save it, zero it, tm.load it back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    pb.init(rank, pb.WORLD_SIZE, port)
    mesh = init_device_mesh("cpu", pb.MESH, mesh_dim_names=pb.MESH_DIM_NAMES)
    model = pb.parallelize(pb.llama(), mesh)
    state = pb.training_state(model, pb.train(model, 1, mesh["dp"].get_local_rank()))  # creates AdamW's state
    dcp.load(state, checkpoint_id=Path(fixture, pb.DCP_DIR))
    saved = load_file(str(Path(fixture, pb.locals_file(rank))))
    flat = pb.flat_tensors(state)
    restored = {n: torch.equal(pb.local(t), saved[n]) for n, t in flat.items()}
    written = tm.save(state, path).bytes_written
    for tensor in flat.values():
        pb.local(tensor).zero_()
    report = tm.load(path, state)
    pb.finish(out, rank, {
        "restored_by_dcp": restored, "bytes_written": written, "tensors_loaded": report.tensors_loaded,
        "equal": {n: torch.equal(pb.local(t), saved[n]) for n, t in flat.items()},
        "strided": sorted(n for n, t in flat.items() if pb.strided(t)),
    })


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _fsdp_1d_worker(rank: int, port: int, out: str, fixture: str, path: str) -> None:
    """Load the 2-D checkpoint into the same model under plain FSDP2 on a 1-D mesh of LOAD_RANKS ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    pb.init(rank, LOAD_RANKS, port)
    model = pb.parallelize(pb.llama(), init_device_mesh("cpu", (LOAD_RANKS,)))
    state = pb.training_state(model, pb.train(model, 1, rank))
    flat = pb.flat_tensors(state)
    truth = load_file(str(Path(fixture, pb.TRUTH)))
    # the first load imports what loading needs; the measured one reads only checkpoint bytes
    tm.load(path, state)
    for tensor in flat.values():
        pb.local(tensor).zero_()
    before = _rchar()
    report = tm.load(path, state)
    read = _rchar() - before
    equal = {}
    for name, tensor in flat.items():
        expected = truth[name]
        if hasattr(tensor, "to_local"):
            (chunk,) = tensor.__create_chunk_list__()
            expected = expected[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
        equal[name] = torch.equal(pb.local(tensor), expected)
    pb.finish(out, rank, {"equal": equal, "placements": sorted({repr(t.placements) for t in flat.values()
                                                                if hasattr(t, "placements")}),
                          "tensors_loaded": report.tensors_loaded, "bytes_needed": report.bytes_needed,
                          "bytes_read": report.bytes_read, "rchar": read})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn: Any, world: int, out: Path, *args: Any) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    tmp.spawn(fn, args=(_free_port(), str(out), *args), nprocs=world, join=True)
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(world)]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fixture() -> Path:
    return cached_build("placements_2d", pb, pb.build)


@pytest.fixture(scope="module")
def truth(fixture: Path) -> dict[str, torch.Tensor]:
    return load_file(str(fixture / pb.TRUTH))


@pytest.fixture(scope="module")
def layout(fixture: Path) -> dict[str, dict]:
    return json.loads((fixture / pb.LAYOUT).read_text())


@pytest.fixture(scope="module")
def saved(fixture: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 2-D state saved by tm.save on 4 ranks (then loaded back on the same mesh by the same ranks)."""
    root = tmp_path_factory.mktemp("placements_2d")
    path = root / "tm"
    records = _spawn(_restore_save_reload_worker, pb.WORLD_SIZE, root / "results", str(fixture), str(path))
    return {"path": path, "records": records}


def _tm_placement(torch_repr: str) -> str:
    """torch's repr of a placement in tensormorph's spelling: _StridedShard(dim=0, sf=2) ->
    _StridedShard(0, split_factor=2), Shard(dim=1) -> Shard(1)."""
    return re.sub(r"\(dim=(\d+)", r"(\1", torch_repr).replace("sf=", "split_factor=")


def _bits(array: Any) -> bytes:
    return array.tobytes() if not isinstance(array, torch.Tensor) else array.contiguous().view(-1).view(
        torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------- tests


def test_the_fixture_holds_real_strided_shards(layout: dict[str, dict], truth: dict[str, torch.Tensor]) -> None:
    strided = {n for n, entry in layout.items() if entry["placements"][0].startswith("_StridedShard")}
    # q/k/v/gate/up of both layers and lm_head, each as a parameter and as AdamW's two moments
    assert len(strided) == 3 * (2 * 5 + 1)
    assert layout["model.model.layers.0.mlp.gate_proj.weight"]["placements"] == [
        "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    assert layout["optim.state.model.layers.1.mlp.up_proj.weight.exp_avg_sq"]["placements"] == [
        "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    assert layout["model.model.layers.0.self_attn.o_proj.weight"]["placements"] == ["Shard(dim=0)", "Shard(dim=1)"]
    assert layout["model.model.embed_tokens.weight"] == {"placements": ["Shard(dim=0)"], "mesh_shape": [2],
                                                        "mesh_dim_names": ["dp"]}
    assert len(truth) == 21 * 4  # 21 parameters; each has exp_avg, exp_avg_sq and step


def test_same_mesh_load_restores_every_local_shard_exactly(saved: dict[str, Any], layout: dict[str, dict]) -> None:
    strided = sorted(n for n, entry in layout.items() if entry["placements"][0].startswith("_StridedShard"))
    for rank, record in enumerate(saved["records"]):
        assert all(record["restored_by_dcp"].values()), (rank, record["restored_by_dcp"])  # the state under test
        assert record["strided"] == strided, rank
        assert record["tensors_loaded"] == len(record["equal"]) == 84, rank
        assert all(record["equal"].values()), (rank, [n for n, ok in record["equal"].items() if not ok])
    written = [r["bytes_written"] for r in saved["records"]]
    assert min(written) > 0


def test_every_tensor_reads_back_bit_exact_with_its_placements(saved: dict[str, Any], fixture: Path,
                                                               truth: dict[str, torch.Tensor],
                                                               layout: dict[str, dict]) -> None:
    ck = tm.open(saved["path"])
    assert set(ck) == set(truth)
    locals_ = [load_file(str(fixture / pb.locals_file(rank))) for rank in range(pb.WORLD_SIZE)]
    for name, expected in truth.items():
        tensor = ck[name]
        assert tensor.shape == tuple(expected.shape), name
        assert _bits(tensor.full()) == _bits(expected), name
        if name not in layout:
            continue
        entry = layout[name]
        assert tensor.placement is not None, name
        assert list(tensor.placement.placements) == [_tm_placement(p) for p in entry["placements"]], name
        assert list(tensor.placement.mesh_shape) == entry["mesh_shape"], name
        for rank in range(pb.WORLD_SIZE):  # each rank's box, wherever _StridedShard put it
            assert _bits(tensor.local(rank)) == _bits(locals_[rank][name]), (name, rank)
    # a region across the tp boundary of a strided tensor: rows 40..50 come from 3 ranks' chunks
    gate = "model.model.layers.0.mlp.gate_proj.weight"
    assert _bits(ck[gate][40:50, 3:7]) == _bits(truth[gate][40:50, 3:7])


def test_the_dcp_checkpoint_of_the_same_state_reads_bit_exact(fixture: Path, truth: dict[str, torch.Tensor]) -> None:
    ck = tm.open(fixture / pb.DCP_DIR)
    assert ck.format == "dcp" and set(ck) == set(truth)
    for name, expected in truth.items():
        assert _bits(ck[name].full()) == _bits(expected), name


def test_tensormorph_and_dcp_checkpoints_diff_as_equal(saved: dict[str, Any], fixture: Path,
                                                       truth: dict[str, torch.Tensor]) -> None:
    dcp_path = fixture / pb.DCP_DIR
    # DCP flattens the optimizer's param_groups into param_groups.0.lr ..., tm.save keeps a list without
    # tensors whole: the diff compares the whole value with the leaves, so they are equal, none only on one side
    report = tm.diff(saved["path"], dcp_path)
    assert report.identical and report.counts == {"equal": len(truth)}, [o for o in report.objects
                                                                           if o.status != "equal"]
    assert sorted(t.name for t in report.tensors) == sorted(truth)
    assert report.objects and all(o.status == "equal" for o in report.objects)
    result = CliRunner().invoke(main, ["diff", str(saved["path"]), str(dcp_path), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(result.stdout)
    assert data["identical"] and data["counts"] == {"equal": len(truth)}


def test_inspect_json_shows_the_strided_placements(saved: dict[str, Any], layout: dict[str, dict]) -> None:
    result = CliRunner().invoke(main, ["inspect", str(saved["path"]), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    records = {t["name"]: t for t in json.loads(result.stdout)["tensors"]}
    gate = records["model.model.layers.1.mlp.gate_proj.weight"]
    assert gate["placement"]["placements"] == ["_StridedShard(0, split_factor=2)", "Shard(0)"]
    assert gate["placement"]["mesh_shape"] == [2, 2]
    # rows 0-22 on rank 0 (dp 0, tp 0), 45-67 on rank 1 (dp 0, tp 1): the tp split first, dp inside it
    assert sorted((c["offsets"], c["shape"], c["ranks"]) for c in gate["chunks"]) == [
        ([0, 0], [23, 64], [0]), ([23, 0], [22, 64], [2]), ([45, 0], [23, 64], [1]), ([68, 0], [22, 64], [3])]
    for name, entry in layout.items():
        assert records[name]["placement"]["placements"] == [_tm_placement(p) for p in entry["placements"]], name


def test_reshard_to_1d_fsdp_on_two_ranks_reads_only_what_each_rank_needs(saved: dict[str, Any], fixture: Path,
                                                                        tmp_path: Path) -> None:
    records = _spawn(_fsdp_1d_worker, LOAD_RANKS, tmp_path / "fsdp1d", str(fixture), str(saved["path"]))
    manifest = (saved["path"] / MANIFEST).stat().st_size
    for rank, record in enumerate(records):
        assert record["placements"] == ["(Shard(dim=0),)"], rank  # plain FSDP2: no tensor parallelism left
        assert record["tensors_loaded"] == len(record["equal"]) == 84, rank
        assert all(record["equal"].values()), (rank, [n for n, ok in record["equal"].items() if not ok])
        # what the shards hold, plus the rest of any checksum block a box edge cuts (verified loads)
        assert record["bytes_needed"] <= record["bytes_read"] <= SLACK * record["bytes_needed"], (rank, record)
        # measured by the kernel: everything the process read during the load is those bytes plus the manifest
        # (a tenth of this tiny state; benchmarks/bench_placements.py measures the ratio on ~450 MB)
        assert record["bytes_needed"] <= record["rchar"] <= SLACK * record["bytes_needed"] + manifest, (rank, record)


def test_load_into_plain_tensors_in_one_process(saved: dict[str, Any], fixture: Path,
                                                truth: dict[str, torch.Tensor]) -> None:
    for path in (saved["path"], fixture / pb.DCP_DIR):
        # a flat dict flattens to the same dotted names as the nested state that was saved
        state = {name: torch.full_like(tensor, -1) for name, tensor in truth.items()}
        report = tm.load(path, state, strict=False)  # the checkpoint also holds the optimizer's param_groups
        assert report.missing == [] and report.mismatched == [], path
        assert report.tensors_loaded == len(truth), path
        for name, expected in truth.items():
            assert torch.equal(state[name], expected), (path, name)


def test_convert_to_a_hugging_face_folder_that_transformers_loads(saved: dict[str, Any], fixture: Path,
                                                                  truth: dict[str, torch.Tensor],
                                                                  tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    result = CliRunner().invoke(main, ["convert", str(saved["path"]), str(out), "--to", "safetensors",
                                       "--rename", "model.=", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    shutil.copy(fixture / pb.HF_CONFIG / "config.json", out / "config.json")
    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert sorted(info["unexpected_keys"]) == sorted(n for n in truth if n.startswith("optim."))
    weights = model.state_dict()
    assert len(weights) == 21
    for name, value in weights.items():
        assert _bits(value) == _bits(truth[f"model.{name}"]), name
