"""The Tensormorph format without ranks: offline resharding, manifest validation, hostile input,
and property tests of the placement arithmetic and the value encoding."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import shutil

import crc32c
import numpy as np
import pytest
from click.testing import CliRunner
from fixtures.builders import expected_paths, load_expected
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import (
    CheckpointError,
    ChecksumError,
    HeaderError,
    MissingFileError,
    TruncatedFileError,
    UnsafePathError,
)
from tensormorph.geometry import box_runs
from tensormorph.tmformat.layout import assign_writers, local_box, shard_range
from tensormorph.tmformat.manifest import MANIFEST, decode_value, encode_value, parse


@pytest.fixture(scope="module")
def resharded(dcp_ckpt, tmp_path_factory):
    """The 4-rank DCP fixture re-sharded offline for a 2x3 mesh [Shard(1), Shard(0)]."""
    out = tmp_path_factory.mktemp("reshard") / "tm"
    result = tm.convert(dcp_ckpt, out, to="tensormorph", mesh="2x3", placements=["Shard(1)", "Shard(0)"])
    return out, result


def test_offline_reshard_keeps_every_value_bit_exact(dcp_ckpt, resharded):
    out, result = resharded
    assert result.check is not None and result.check.identical
    expected = load_expected(expected_paths(dcp_ckpt)[0])
    ck = tm.open(out)
    assert ck.format == "tensormorph" and ck.metadata["world_size"] == 6
    assert len(ck.files) == 6 and result.files == [f"rank-{r:05d}.safetensors" for r in range(6)]
    for name, truth in expected.items():
        got = ck[name].full()
        assert got.shape == truth.shape and got.tobytes() == truth.tobytes(), name
    import torch

    for tensor in ck.values():
        if tensor.ndim >= 2:
            # Shard(1) over 2 then Shard(0) over 3: as many boxes as torch.chunk gives non-empty pieces
            pieces = (len(torch.chunk(torch.arange(tensor.shape[1]), 2))
                      * len(torch.chunk(torch.arange(tensor.shape[0]), 3)))
            assert len(tensor.chunks) == pieces, tensor.name
            assert str(tensor.placement).endswith("[Shard(1), Shard(0)]"), tensor.name


def test_offline_reshard_output_loads_through_dcp_hugging_face_reader(resharded, dcp_ckpt):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    out, _ = resharded
    expected = load_expected(expected_paths(dcp_ckpt)[0])
    ck = tm.open(out)
    state = {name: torch.zeros(t.shape, dtype=getattr(torch, _torch_name(t.dtype)))
             for name, t in ck.items() if t.numel}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(out)))
    for name, tensor in state.items():
        assert tensor.reshape(-1).view(torch.uint8).numpy().tobytes() == expected[name].tobytes(), name


def _torch_name(vocabulary: str) -> str:
    from tensormorph.dtypes import TORCH_DTYPE_NAMES

    return next(k for k, v in TORCH_DTYPE_NAMES.items() if v == vocabulary)


def test_cli_convert_to_tensormorph_reports_files_and_check(dcp_ckpt, tmp_path):
    out = tmp_path / "cli"
    run = CliRunner().invoke(main, ["convert", str(dcp_ckpt), str(out), "--to", "tensormorph", "--world", "3",
                                    "--placements", "Shard(0)", "--json"])
    assert run.exit_code == 0, run.output
    report = json.loads(run.output)
    assert report["files"] == ["rank-00000.safetensors", "rank-00001.safetensors", "rank-00002.safetensors"]
    assert report["check"]["identical"] is True
    bad = CliRunner().invoke(main, ["convert", str(dcp_ckpt), str(tmp_path / "bad"), "--to", "tensormorph",
                                    "--mesh", "2x2", "--placements", "Shard(0)"])
    assert bad.exit_code == 2 and "needs 2 placement(s)" in bad.output
    bad = CliRunner().invoke(main, ["convert", str(dcp_ckpt), str(tmp_path / "bad2"), "--to", "tensormorph",
                                    "--placements", "Diagonal(0)"])
    assert bad.exit_code == 2 and "unknown placement 'Diagonal(0)'" in bad.output


# ---- damage and hostile manifests --------------------------------------------------------------------

def _rewrite_manifest(folder, edit) -> None:
    """Apply `edit` to the manifest body and store it with a correct checksum (to reach deeper checks)."""
    body = json.loads((folder / MANIFEST).read_text())["body"]
    edit(body)
    text = json.dumps(body, separators=(",", ":"))
    (folder / MANIFEST).write_text(json.dumps({"manifest_crc32c": f"{crc32c.crc32c(text.encode()):08x}",
                                               "body": body}, separators=(",", ":")))


@pytest.fixture
def copy(resharded, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(resharded[0], folder)
    return folder


def test_a_damaged_manifest_is_named_as_such(copy):
    raw = bytearray((copy / MANIFEST).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (copy / MANIFEST).write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="manifest"):
        tm.open(copy)


def test_missing_and_truncated_rank_files_are_named(copy):
    (copy / "rank-00004.safetensors").unlink()
    with pytest.raises(MissingFileError, match="rank 4") as info:
        tm.open(copy)
    assert info.value.file.endswith("rank-00004.safetensors")
    data = (copy / "rank-00002.safetensors").read_bytes()
    (copy / "rank-00004.safetensors").write_bytes(data)  # restore a file of the wrong size
    with open(copy / "rank-00002.safetensors", "r+b") as f:
        f.truncate(len(data) - 10)
    with pytest.raises((TruncatedFileError, HeaderError)) as info:
        tm.open(copy)
    assert "rank-0000" in info.value.file


def test_a_manifest_cannot_point_outside_the_checkpoint(copy):
    def escape(body):
        body["files"]["../outside.safetensors"] = body["files"].pop("rank-00000.safetensors")
        for tensor in body["tensors"].values():
            for chunk in tensor["chunks"]:
                if chunk["file"] == "rank-00000.safetensors":
                    chunk["file"] = "../outside.safetensors"
    _rewrite_manifest(copy, escape)
    with pytest.raises(UnsafePathError):
        tm.open(copy)


def test_chunk_byte_ranges_and_tiling_are_validated(copy):
    def overlap(body):
        tensor = next(t for t in body["tensors"].values() if len(t["chunks"]) == 6)
        tensor["chunks"][1]["offsets"] = tensor["chunks"][0]["offsets"]
    _rewrite_manifest(copy, overlap)
    with pytest.raises(CheckpointError, match="overlap|cover"):
        tm.open(copy)


def test_load_refuses_a_manifest_whose_chunks_leave_a_gap(copy):
    import torch

    def drop_chunk(body):
        tensor = next(t for t in body["tensors"].values() if len(t["chunks"]) == 6)
        tensor["chunks"].pop()
    _rewrite_manifest(copy, drop_chunk)
    with pytest.raises(CheckpointError, match="missing"):
        tm.load(copy, {"x": torch.zeros(1)}, strict=False)


def test_negative_shard_dimension_counts_from_the_end(dcp_ckpt, tmp_path):
    out = tmp_path / "last"
    tm.convert(dcp_ckpt, out, to="tensormorph", mesh=2, placements=["Shard(-1)"])
    ck = tm.open(out)
    matrix = next(t for t in ck.values() if t.ndim == 2 and t.shape[1] >= 2)
    assert str(matrix.placement).endswith("[Shard(1)]") and {c.offsets[0] for c in matrix.chunks} == {0}


def test_verify_names_a_damaged_data_file_and_the_tensors_in_it(copy):
    path = copy / "rank-00003.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    report = tm.verify(copy)
    assert [p.kind for p in report.problems] == ["ChecksumError"]
    assert report.problems[0].file.endswith("rank-00003.safetensors") and report.problems[0].tensor
    assert report.checksums_checked == 6


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_manifest_parser_raises_only_checkpoint_errors(resharded, data):
    """Random edits of a real manifest's body, re-checksummed, are accepted or refused cleanly."""
    body = json.loads((resharded[0] / MANIFEST).read_text())["body"]
    junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                     st.lists(st.integers(-5, 2**40), max_size=4),
                     st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
    for _ in range(data.draw(st.integers(1, 4))):
        node, key = body, None
        path = []
        while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
            key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
            path.append((node, key))
            node = node[key]
        if path:
            parent, key = path[-1]
            parent[key] = data.draw(junk)
    text = json.dumps(body, separators=(",", ":"))
    raw = json.dumps({"manifest_crc32c": f"{crc32c.crc32c(text.encode()):08x}", "body": body}).encode()
    with contextlib.suppress(CheckpointError):
        parse(raw, "manifest.json")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_manifest_parser_on_random_bytes(raw):
    with pytest.raises(CheckpointError):
        parse(raw, "manifest.json")


# ---- placement arithmetic ------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, mesh=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple), data=st.data())
def test_rank_boxes_tile_the_tensor_and_follow_torch_chunk(shape, mesh, data):
    placements = [data.draw(st.sampled_from(["Replicate()"] + [f"Shard({d})" for d in range(len(shape))]))
                  for _ in mesh]
    boxes = [local_box(shape, mesh, placements, c) for c in itertools.product(*(range(n) for n in mesh))]
    assert len(boxes) == math.prod(mesh)
    covered = np.zeros(shape, dtype=np.int64)
    for offsets, size in {b for b in boxes}:
        covered[tuple(slice(o, o + s) for o, s in zip(offsets, size))] += 1
    assert (covered == 1).all()  # distinct boxes tile the tensor exactly once
    if len(mesh) == 1 and placements[0] != "Replicate()":
        import torch

        dim = int(placements[0][6:-1])
        pieces = torch.chunk(torch.arange(shape[dim]), mesh[0]) if shape[dim] else ()
        for rank, (offsets, size) in enumerate(boxes):
            if rank < len(pieces):
                assert (offsets[dim], size[dim]) == (int(pieces[rank][0]), len(pieces[rank]))
            else:
                assert size[dim] == 0


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple), data=st.data())
def test_box_runs_concatenate_to_the_sub_box(shape, data):
    start = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    size = tuple(data.draw(st.integers(1, n - s)) for n, s in zip(shape, start))
    array = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    starts, run = box_runs(shape, 4, start, size)
    raw = array.tobytes()
    got = b"".join(raw[s:s + run] for s in starts.tolist())
    assert got == array[tuple(slice(s, s + n) for s, n in zip(start, size))].tobytes()


def test_writers_are_balanced_by_bytes_and_prefer_the_least_replicated():
    # eight replicated tensors of equal size over four ranks: two each
    chosen = assign_writers({f"t{i}": (100, range(4)) for i in range(8)})
    assert sorted(list(chosen.values()).count(r) for r in range(4)) == [2, 2, 2, 2]
    # a box only rank 3 holds is placed first; replicated ones then avoid the loaded rank
    chosen = assign_writers({"big": (1000, [3]), "a": (400, [2, 3]), "b": (400, [2, 3])})
    assert chosen == {"big": 3, "a": 2, "b": 2}
    assert shard_range(5, 4, 3) == (5, 5) and shard_range(5, 4, 1) == (2, 4)


plain = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**80, 2**80), st.floats(), st.text(max_size=10),
              st.binary(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.one_of(st.text(max_size=5), st.integers(-9, 9)), inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(plain)
def test_plain_values_survive_the_manifest_exactly(value):
    back = decode_value(json.loads(json.dumps(encode_value(value, "x"), allow_nan=False)))
    assert _same(back, value)


def _same(a, b) -> bool:
    if isinstance(b, float) and math.isnan(b):
        return isinstance(a, float) and math.isnan(a)
    if type(a) is not type(b):
        return False
    if isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in b)
    return a == b


def test_values_that_are_not_plain_data_are_refused_with_their_name():
    with pytest.raises(TypeError, match="'opt.sched'.*set"):
        encode_value({1, 2}, "opt.sched")
