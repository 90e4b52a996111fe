"""tensormorph.save / tensormorph.load on real gloo ranks: resharding, interop with DCP, S3, crashes.

One save on 4 ranks (a 2x2 mesh, uneven shards) feeds every load test: onto
2 ranks with [Shard(1)], 3 ranks with [Shard(0)], 2 ranks with
[Replicate()], one process without torch.distributed, from a local folder,
from a DCP checkpoint of the same state and from a real S3 endpoint (moto's
server on 127.0.0.1). Every local shard is compared bit for bit with the
same slice of the full tensor.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import dist_workers as w
import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp
from torch.multiprocessing.spawn import ProcessException

import tensormorph as tm
from tensormorph.core import DIRECT_READ_MIN
from tensormorph.errors import StateMismatchError, UncommittedCheckpointError
from tensormorph.tmformat.manifest import MANIFEST, TEMP_PREFIX

S3_OPTIONS_TEMPLATE = {"key": "testing", "secret": "testing", "client_kwargs": {"region_name": "us-east-1"}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world: int, out: Path, *args) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    tmp.spawn(fn, args=(_free_port(), str(out), world, *args), nprocs=world, join=True)
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def s3():
    """A real S3 endpoint: moto's server on a loopback port, for the duration of this module."""
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("moto's S3 server did not start") from None
            time.sleep(0.2)
    client_kwargs = {**S3_OPTIONS_TEMPLATE["client_kwargs"], "endpoint_url": endpoint}
    options = {**S3_OPTIONS_TEMPLATE, "client_kwargs": client_kwargs}
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket="ckpts")
    yield options
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, s3):
    """The 2x2-mesh state saved by 4 ranks: with tm.save locally and to S3, and with dcp.save."""
    root = tmp_path_factory.mktemp("saved")
    targets = {"local": (str(root / "tm"), None), "s3": ("s3://ckpts/step-1", s3), "dcp": (str(root / "dcp"), None),
               "local_rs": (str(root / "rs"), None, "rs(4,2)"), "s3_rs": ("s3://ckpts/rs", s3, "rs(4,2)")}
    records = _spawn(w.save_worker, 4, root / "results", targets)
    return {"root": root, "targets": targets, "records": records}


def _sources(saved) -> dict:
    return {label: saved["targets"][label] for label in ("local", "s3", "dcp")}


def _assert_all_equal(records: list[dict]) -> None:
    for rank, record in enumerate(records):
        for label, result in record.items():
            assert all(result["equal"].values()), (rank, label, result["equal"])
            assert result["objects_ok"], (rank, label)


def test_manifest_balances_replicas_and_records_placements(saved):
    ck = tm.open(saved["targets"]["local"][0])
    assert ck.format == "tensormorph" and ck.metadata["world_size"] == 4
    w_ = ck["model.w"]
    assert w_.shape == (4003, 1602) and len(w_.chunks) == 4
    assert str(w_.placement) == "mesh(d0=2, d1=2) [Shard(0), Shard(1)]"
    # Shard(0) on a 2-wide mesh dim of 4003 rows: 2002 + 2001; Shard(1) of 1602: 801 + 801
    assert sorted(c.shape for c in w_.chunks) == [(2001, 801), (2001, 801), (2002, 801), (2002, 801)]
    # model.b is replicated along the second mesh dim: 2 distinct boxes, each held by 2 ranks, written once
    b = ck["model.b"]
    assert len(b.chunks) == 2 and all(len(c.ranks) == 2 for c in b.chunks)
    # the fully replicated tensors are not all written by rank 0: writers are balanced by bytes
    manifest = json.loads((Path(saved["targets"]["local"][0]) / MANIFEST).read_text())["body"]
    writers = {chunk["rank"] for name in ("model.r", "opt.step", "model.b")
               for chunk in manifest["tensors"][name]["chunks"]}
    assert len(writers) > 1
    sizes = [r["local"] for r in saved["records"]]
    assert max(sizes) - min(sizes) < 0.1 * max(sizes)  # each rank wrote about a quarter
    for name in w.SAVE_LAYOUT:
        truth = w.full_tensor(name)
        assert ck[name].full().tobytes() == truth.reshape(-1).view(torch.uint8).numpy().tobytes(), name
    assert ck.objects["config"].value() == w.OBJECTS["config"]


def test_load_on_two_ranks_sharded_on_the_other_dim_and_replicated(saved, tmp_path):
    _assert_all_equal(_spawn(w.load_worker, 2, tmp_path / "s1", (2,), ("Shard(1)",), _sources(saved)))
    _assert_all_equal(_spawn(w.load_worker, 2, tmp_path / "rep", (2,), ("Replicate()",), _sources(saved)))


def test_reshard_4_to_3_reads_only_the_bytes_each_rank_needs(saved, tmp_path):
    records = _spawn(w.load_worker, 3, tmp_path / "s0", (3,), ("Shard(0)",), _sources(saved))
    _assert_all_equal(records)
    for rank, record in enumerate(records):
        for label in ("local", "s3"):
            result = record[label]
            # what the shards hold, plus the rest of the checksum blocks their edges cut (verified loads)
            assert result["bytes_needed"] <= result["bytes_read"] <= 1.05 * result["bytes_needed"], (rank, label)
        # measured by the kernel: everything the process read through system calls during the load,
        # manifest included, is within 5% of the bytes its shards hold
        local = record["local"]
        assert local["bytes_needed"] <= local["rchar"] <= 1.05 * local["bytes_needed"], (rank, local)


def test_load_a_hugging_face_checkpoint_straight_into_tensor_parallel_dtensors(hf_llama_safetensors, tmp_path):
    records = _spawn(w.hf_load_worker, 2, tmp_path / "hf", str(hf_llama_safetensors))
    for record in records:
        assert record["format"] == "hf-sharded" and record["tensors"] == len(record["equal"]) > 5
        assert all(record["equal"].values()), record["equal"]


def test_load_in_one_process_without_torch_distributed(saved):
    for label, (path, options) in _sources(saved).items():
        state = {"model": {}, "opt": {}, "step": None, "config": None}
        for name, (shape, dtype, _, _) in w.SAVE_LAYOUT.items():
            group, key = name.split(".", 1)
            state[group][key] = torch.full(shape, -1, dtype=getattr(torch, dtype))
        report = tm.load(path, state, storage_options=options)
        assert report.tensors_loaded == len(w.SAVE_LAYOUT), label
        if label != "dcp":  # whole chunks are read: every 64 KiB checksum block of every chunk is checked
            blocks = sum(-(-c.numel * t.numpy_dtype.itemsize // 65536)
                         for t in tm.open(saved["targets"]["local"][0]).values() for c in t.chunks)
            assert report.blocks_verified == blocks, label
        for name in w.SAVE_LAYOUT:
            group, key = name.split(".", 1)
            assert torch.equal(state[group][key], w.full_tensor(name)), (label, name)
        config = w.OBJECTS["config"] if label != "dcp" else {str(k): v for k, v in w.OBJECTS["config"].items()}
        assert state["step"] == 1000 and w._plain(state["config"]) == w._plain(config), label


def test_dcp_hugging_face_reader_loads_a_tensormorph_checkpoint(saved):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = {name: torch.zeros(shape, dtype=getattr(torch, dtype))
             for name, (shape, dtype, _, _) in w.SAVE_LAYOUT.items() if math_numel(shape)}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(saved["targets"]["local"][0]))
    for name, tensor in state.items():
        assert torch.equal(tensor, w.full_tensor(name)), name


def math_numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_strict_load_lists_every_offender_at_once(saved):
    state = {"model": {"w": torch.zeros(4003, 161), "v": torch.zeros(9, 6, dtype=torch.float64),
                       "new": torch.zeros(2)}, "step": 0}
    with pytest.raises(StateMismatchError) as info:
        tm.load(saved["targets"]["local"][0], state)
    error = info.value
    assert error.missing == ["model.new"]
    assert set(error.unexpected) == {"model.b", "model.r", "model.e", "model.i", "opt.step", "config"}
    assert [m.split(":")[0] for m in error.mismatched] == ["model.w", "model.v"]
    assert "shape [4003, 1602] in the checkpoint, [4003, 161]" in str(error)
    assert "dtype F32 in the checkpoint, F64" in str(error)
    assert not state["model"]["v"].any()  # nothing was loaded

    report = tm.load(saved["targets"]["local"][0], state, strict=False)
    assert report.missing == ["model.new"] and len(report.mismatched) == 2 and state["step"] == 1000

    cast = {"model": {"v": torch.zeros(9, 6, dtype=torch.float64)}}
    tm.load(saved["targets"]["local"][0], cast, strict=False, cast=True)
    assert torch.equal(cast["model"]["v"], w.full_tensor("model.v").double())


def test_load_names_file_and_tensor_on_a_damaged_block(saved, tmp_path):
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(saved["targets"]["local"][0], copy)
    ck = tm.open(copy)
    chunk = max(ck["model.w"].chunks, key=lambda c: c.byte_range[0])
    with open(copy / chunk.file, "r+b") as f:
        f.seek(chunk.byte_range[0] + 10)
        byte = f.read(1)
        f.seek(chunk.byte_range[0] + 10)
        f.write(bytes([byte[0] ^ 0x40]))
    state = {"model": {"w": torch.zeros(4003, 1602)}}
    with pytest.raises(tm.CheckpointError) as info:
        tm.load(copy, state, strict=False)
    assert "model.w" in str(info.value) and chunk.file in str(info.value) and "CRC-32C" in str(info.value)
    tm.load(copy, state, strict=False, verify=False)  # the caller may skip verification
    report = tm.verify(copy)
    assert [p.kind for p in report.problems] == ["ChecksumError"] and chunk.file in report.problems[0].file
    # the flipped byte is element (2002, 803); reads that touch its 64 KiB block without covering the
    # byte still find it: the block's other bytes are read to complete its checksum
    with pytest.raises(tm.CheckpointError, match="CRC-32C"):
        tm.open(copy)["model.w"][2002:2003, 801:802]
    # the whole chunk: one contiguous run of over 1 MiB, read straight into the result and checked against the
    # bytes read there; the same read of an intact chunk gives its values
    whole = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))
    assert math.prod(chunk.shape) * 4 >= DIRECT_READ_MIN
    with pytest.raises(tm.CheckpointError, match="CRC-32C") as info:
        tm.open(copy)["model.w"][whole]
    assert chunk.file in str(info.value)
    intact = min(ck["model.w"].chunks, key=lambda c: c.byte_range[0])
    box = tuple(slice(o, o + n) for o, n in zip(intact.offsets, intact.shape))
    assert tm.open(copy)["model.w"][box].tobytes() == w.full_tensor("model.w")[box].numpy().tobytes()
    from tensormorph.storage import LocalFiles
    from tensormorph.tmformat.checkpoint import read_manifest
    from tensormorph.tmformat.reader import BoxReader

    with BoxReader(read_manifest(LocalFiles(copy), str(copy)), LocalFiles(copy), str(copy)) as reader:
        out = np.zeros((3, 1), np.float32)
        with pytest.raises(tm.CheckpointError, match="CRC-32C"):
            reader.read_box("model.w", ((2002, 801), (3, 1)), out)
        reader.read_box("model.w", ((0, 0), (3, 1)), out)  # an intact block: its values, read exactly
        assert out.tobytes() == w.full_tensor("model.w")[0:3, 0:1].numpy().tobytes()
        assert reader.bytes_read == 65536  # 12 bytes wanted, the rest of their one block read to check it


def test_partial_and_strided_shard_alone_save_read_and_load_exactly(tmp_path):
    records = _spawn(w.placements_alone_worker, 2, tmp_path / "r", str(tmp_path / "ck"))
    for label in ("partial", "strided"):
        ck = tm.open(tmp_path / f"ck-{label}")
        full = np.asarray(records[0][label]["full"], np.float32)
        # two contributions: a + b has the same bits in either order, so torch's full_tensor() is matched exactly
        assert ck["t"].full().tobytes() == full.tobytes(), label
        for rank, record in enumerate(records):
            mine = record[label]
            assert mine["restored"] == mine["local"], (label, rank)  # a same-mesh load restores each local
            assert np.asarray(mine["into_replicate"], np.float32).tobytes() == full.tobytes()
            for op in ("sum", "max"):
                other = mine[f"into_partial_{op}"]
                assert np.asarray(other["full"], np.float32).tobytes() == full.tobytes(), (label, op)
                share = np.asarray(other["local"], np.float32)
                if label == "partial" and op == "sum":  # the layout it was saved with: its own contribution back
                    assert share.tobytes() == np.asarray(mine["local"], np.float32).tobytes()
                elif op == "sum" and rank:  # the first contribution holds the value, the others -0.0
                    assert share.tobytes() == np.full_like(share, -0.0).tobytes()
                else:  # max: every contribution holds the value
                    assert share.tobytes() == full.tobytes()
    partial = tm.open(tmp_path / "ck-partial")["t"]
    assert partial.placement.placements == ("Partial(sum)",) and partial.reduction.contributions == 2
    assert [partial.local(r).tolist() for r in range(2)] == [np.float32(records[r]["partial"]["local"]).tolist()
                                                             for r in range(2)]
    strided = tm.open(tmp_path / "ck-strided")["t"]
    assert strided.placement.placements == ("_StridedShard(0, split_factor=2)",)
    # rank r holds rows [2r, 2r+2) and [4+2r, 6+2r): two boxes each
    assert sorted((c.offsets, c.ranks) for c in strided.chunks) == [((0, 0), (0,)), ((2, 0), (1,)), ((4, 0), (0,)),
                                                                    ((6, 0), (1,))]


def test_a_rank_dying_before_commit_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "ck"
    _spawn(w.plain_save_worker, 2, tmp_path / "first", str(path), (2,))
    before = (path / MANIFEST).read_bytes()
    with pytest.raises(ProcessException):  # rank 1 exits mid-write; the spawner then stops rank 0
        _spawn(w.crash_worker, 2, tmp_path / "crash", str(path))
    assert (path / MANIFEST).read_bytes() == before
    state = {"model": {k.split(".", 1)[1]: torch.zeros(s, dtype=getattr(torch, d))
                       for k, (s, d, _, _) in w.SAVE_LAYOUT.items() if k.startswith("model.")}}
    tm.load(path, state, strict=False)
    assert torch.equal(state["model"]["w"], w.full_tensor("model.w"))
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]
    assert len(leftovers) == 1
    with pytest.raises(UncommittedCheckpointError, match="never committed"):
        tm.open(leftovers[0])
    report = tm.verify(leftovers[0])
    assert [p.kind for p in report.problems] == ["UncommittedCheckpointError"]
    assert "'ck'" in report.problems[0].message


def test_parity_written_by_four_ranks_rebuilds_two_lost_files_locally_and_on_s3(saved):
    import warnings

    import s3fs

    for label in ("local_rs", "s3_rs"):
        path, options, _ = saved["targets"][label]
        if options is None:
            manifest = json.loads((Path(path) / MANIFEST).read_text())["body"]
            lost = sorted(manifest["files"])[1:3]
            assert lost == ["rank-00001.safetensors", "rank-00002.safetensors"]
            for name in lost:
                (Path(path) / name).unlink()
        else:
            fs = s3fs.S3FileSystem(**options)
            manifest = json.loads(fs.cat_file(f"{path[5:]}/{MANIFEST}"))["body"]
            lost = sorted(manifest["files"])[1:3]  # on an object store, under the save's generation folder
            assert [name.split("/")[-1] for name in lost] == ["rank-00001.safetensors", "rank-00002.safetensors"]
            assert lost[0].startswith("gen-") and lost[0].count("/") == 1
            for name in lost:
                fs.rm_file(f"{path[5:]}/{name}")
        plan = manifest["redundancy"]
        assert plan["scheme"] == "rs(4,2)" and len({f["rank"] for f in plan["files"].values()}) == 2
        state = {"model": {}, "opt": {}}
        for name, (shape, dtype, _, _) in w.SAVE_LAYOUT.items():
            group, key = name.split(".", 1)
            state[group][key] = torch.zeros(shape, dtype=getattr(torch, dtype))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tm.load(path, state, strict=False, storage_options=options)
        assert sum("rebuilt from rs(4,2)" in str(c.message) for c in caught) == 2, label
        for name in w.SAVE_LAYOUT:
            group, key = name.split(".", 1)
            assert torch.equal(state[group][key], w.full_tensor(name)), (label, name)


def test_save_refuses_to_replace_a_checkpoint_unless_asked(saved, tmp_path):
    path = tmp_path / "once"
    tm.save({"a": torch.ones(2)}, path)
    with pytest.raises(tm.CheckpointError, match="already exists"):
        tm.save({"a": torch.zeros(2)}, path)
    tm.save({"a": torch.zeros(2)}, path, overwrite=True)
    assert tm.open(path)["a"].full().tolist() == [0.0, 0.0]
    # the replaced checkpoint was swapped out atomically and is freed in the background
    deadline = time.monotonic() + 30
    while [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]
    assert sorted(os.listdir(path)) == [MANIFEST, "rank-00000.safetensors"]
