"""Partial and _StridedShard in the Tensormorph format, written by the format's own writer (the same
SaveTransaction `tm.save` uses, without torch.distributed): reduced reads, local(rank), what inspect says,
and every bad manifest refused with a clear error naming the tensor."""

from __future__ import annotations

import json
import shutil

import crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tensormorph_format import _rewrite_manifest as rewrite

import tensormorph as tm
from tensormorph.errors import CheckpointError, ChunkLayoutError, HeaderError
from tensormorph.ops.stats import tensor_stats
from tensormorph.ops.summary import describe, split_description
from tensormorph.tmformat.layout import local_pieces
from tensormorph.tmformat.manifest import MANIFEST, parse
from tensormorph.tmformat.writer import Piece, SaveTransaction

DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32", np.dtype(np.int8): "I8"}


def write_layout(path, shape, mesh, placements, data_of_rank, dtype=np.float32) -> None:
    """Every rank's boxes of one tensor `w` under `placements`, written through one SaveTransaction.

    `data_of_rank(rank, box)` gives the values that rank holds for a box."""
    from tensormorph.tmformat.layout import contribution_of

    save = SaveTransaction(path)
    coordinates = [tuple(int(c) for c in np.unravel_index(r, mesh)) for r in range(int(np.prod(mesh)))]
    held = []
    for rank, coordinate in enumerate(coordinates):
        contribution = contribution_of(mesh, placements, coordinate)[0]
        for box, _ in local_pieces(shape, mesh, placements, coordinate):
            piece = Piece("w", DTYPES[np.dtype(dtype)], shape, box[0], box[1], rank, mesh,
                          tuple(range(len(coordinates))), None, tuple(placements), contribution)
            held.append((piece, np.ascontiguousarray(data_of_rank(rank, box), dtype)))
    pieces, values = [p for p, _ in held], {p.key: v for p, v in held}
    save.plan(pieces)
    save.join(save.prepare())
    results = [save.write_rank(rank, [(p, lambda v=values[p.key]: [v.reshape(-1)])
                                      for p in save.written_by(rank, [p for p in pieces if p.rank == rank])], {})
               for rank in range(len(coordinates))]
    save.commit(results, [{} for _ in results], {})


def contributions(count, shape=(6, 5), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(shape).astype(dtype) for _ in range(count)]
    return [rng.integers(-100, 100, shape).astype(dtype) for _ in range(count)]


def partial_checkpoint(path, op="sum", count=3, dtype=np.float32, values=None):
    values = contributions(count, dtype=dtype) if values is None else values
    box_of = lambda box: tuple(slice(o, o + n) for o, n in zip(*box))  # noqa: E731
    write_layout(path, values[0].shape, (count,), [f"Partial({op})"], lambda r, box: values[r][box_of(box)], dtype)
    return values


@pytest.mark.parametrize("op", ["sum", "avg", "min", "max"])
def test_partial_reads_reduce_contributions_in_index_order(tmp_path, op):
    values = partial_checkpoint(tmp_path / "ck", op)
    tensor = tm.open(tmp_path / "ck")["w"]
    a, b, c = values
    expected = {"sum": (a + b) + c, "avg": ((a + b) + c) / np.float32(3), "min": np.minimum(np.minimum(a, b), c),
                "max": np.maximum(np.maximum(a, b), c)}[op]
    assert tensor.full().tobytes() == expected.tobytes()  # the documented order, bit for bit
    assert tensor[1:5:2, -1].tobytes() == expected[1:5:2, -1].tobytes()
    assert tensor[3, 2].tobytes() == expected[3, 2].tobytes()
    assert tensor[::-2].tobytes() == np.ascontiguousarray(expected[::-2]).tobytes()
    for rank in range(3):
        assert tensor.local(rank).tobytes() == values[rank].tobytes()  # what that rank holds: its contribution
    assert split_description(tensor).endswith(f"Partial({op}) over mesh dim 0: 3 contributions")
    record = describe(tm.open(tmp_path / "ck"))["tensors"][0]
    assert record["reduction"] == {"op": op, "contributions": 3, "mesh_dims": [0]}
    assert sorted(c["contribution"] for c in record["chunks"]) == [0, 1, 2]
    stats = tensor_stats(tensor)
    assert stats.max == pytest.approx(float(expected.max())) and stats.min == pytest.approx(float(expected.min()))


def test_partial_over_one_mesh_dim_with_shard_on_the_other(tmp_path):
    mesh, placements, shape = (2, 3), ["Shard(0)", "Partial(sum)"], (7, 4)
    per_contribution = contributions(3, shape)
    box_of = lambda box: tuple(slice(o, o + n) for o, n in zip(*box))  # noqa: E731
    write_layout(tmp_path / "ck", shape, mesh, placements,
                 lambda rank, box: per_contribution[rank % 3][box_of(box)])
    tensor = tm.open(tmp_path / "ck")["w"]
    expected = (per_contribution[0] + per_contribution[1]) + per_contribution[2]
    assert tensor.full().tobytes() == expected.tobytes()
    assert len(tensor.chunks) == 6 and len(tensor.tiling) == 2
    assert tensor.local(4).tobytes() == per_contribution[1][4:7].tobytes()  # coordinate (1, 1)
    # the other ops' checkpoint converted and diffed: both see the reduced logical tensor
    out = tm.convert(tmp_path / "ck", tmp_path / "plain", to="safetensors")
    assert out.check is not None and out.check.identical  # convert's own check diffs the logical tensors
    assert tm.open(out.destination)["w"].full().tobytes() == expected.tobytes()
    assert tm.diff(tmp_path / "ck", out.destination).identical


def test_partial_integer_sum_is_exact_and_overflow_is_refused(tmp_path):
    values = partial_checkpoint(tmp_path / "ok", "sum", 2, np.int32)
    assert tm.open(tmp_path / "ok")["w"].full().tolist() == (values[0] + values[1]).tolist()
    big = [np.full((2, 2), 100, np.int8), np.full((2, 2), 27, np.int8)]
    big[1][1, 0] = 28
    partial_checkpoint(tmp_path / "over", "sum", 2, np.int8, big)
    with pytest.raises(CheckpointError, match=r"leaves the range of int8 at element \[1, 0\]") as caught:
        tm.open(tmp_path / "over")["w"].full()
    assert caught.value.tensor == "w"


def test_strided_shard_alone_stores_two_boxes_per_rank(tmp_path):
    shape, mesh, placements = (9, 2), (2,), ["_StridedShard(0, split_factor=2)"]
    full = np.arange(18, dtype=np.float32).reshape(shape)
    write_layout(tmp_path / "ck", shape, mesh, placements,
                 lambda rank, box: full[tuple(slice(o, o + n) for o, n in zip(*box))])
    tensor = tm.open(tmp_path / "ck")["w"]
    assert tensor.full().tobytes() == full.tobytes()
    # 9 rows: parts of 5 and 4, each split 3+2 and 2+2 between the ranks
    assert sorted((c.offsets[0], c.shape[0], c.ranks) for c in tensor.chunks) == [
        (0, 3, (0,)), (3, 2, (1,)), (5, 2, (0,)), (7, 2, (1,))]


# ---- bad manifests ---------------------------------------------------------------------------------------

@pytest.fixture
def partial_folder(tmp_path):
    partial_checkpoint(tmp_path / "ck", "sum", 2)
    return tmp_path / "ck"


def test_a_contribution_that_does_not_cover_the_tensor_is_refused(partial_folder):
    def shrink(body):
        chunk = next(c for c in body["tensors"]["w"]["chunks"] if c.get("contribution") == 1)
        chunk["shape"][0] -= 1
        chunk["byte_range"][1] -= 5 * 4
        chunk["crc32c"] = chunk["crc32c"]  # one block either way
    rewrite(partial_folder, shrink)
    with pytest.raises(ChunkLayoutError, match=r"contribution 1 of Partial\(sum\).* does not cover") as caught:
        tm.open(partial_folder)
    assert caught.value.tensor == "w"


def test_a_missing_contribution_is_refused(partial_folder):
    rewrite(partial_folder, lambda body: body["tensors"]["w"]["chunks"].pop())
    with pytest.raises(ChunkLayoutError, match="2 contributions, but only 1 chunks"):
        tm.open(partial_folder)


@pytest.mark.parametrize("placement, message", [
    ("Partial(prod)", "unknown reduce op 'prod'"),
    ("Partial(avg)", None),
    ("Diagonal(0)", "unknown placement 'Diagonal"),
])
def test_bad_partial_placements_are_refused_by_name(partial_folder, placement, message):
    rewrite(partial_folder, lambda body: body["tensors"]["w"].update(placements=[placement]))
    if message is None:  # avg of the same float contributions is a fine checkpoint
        assert tm.open(partial_folder)["w"].reduction.op == "avg"
        return
    with pytest.raises(HeaderError, match=message) as caught:
        tm.open(partial_folder)
    assert caught.value.tensor == "w"


def test_partial_avg_of_integers_and_stray_contributions_are_refused(tmp_path):
    partial_checkpoint(tmp_path / "int", "sum", 2, np.int32)
    rewrite(tmp_path / "int", lambda body: body["tensors"]["w"].update(placements=["Partial(avg)"]))
    with pytest.raises(HeaderError, match="integer tensor is undefined"):
        tm.open(tmp_path / "int")
    partial_checkpoint(tmp_path / "stray", "sum", 2)
    rewrite(tmp_path / "stray", lambda body: body["tensors"]["w"]["chunks"][1].update(contribution=7))
    with pytest.raises(HeaderError, match="is contribution 7, but the placements"):
        tm.open(tmp_path / "stray")
    partial_checkpoint(tmp_path / "swapped", "sum", 2)

    def swap(body):
        first, second = body["tensors"]["w"]["chunks"]
        first["contribution"], second["contribution"] = 1, 0
    rewrite(tmp_path / "swapped", swap)
    with pytest.raises(ChunkLayoutError, match=r"held by rank 0 is not where the placements"):
        tm.open(tmp_path / "swapped")


def test_a_strided_shard_with_an_inconsistent_split_factor_is_refused(tmp_path):
    shape, placements = (8, 2), ["_StridedShard(0, split_factor=2)"]
    write_layout(tmp_path / "ck", shape, (2,), placements, lambda rank, box: np.zeros(box[1], np.float32))
    shutil.copytree(tmp_path / "ck", tmp_path / "five")
    rewrite(tmp_path / "ck", lambda body: body["tensors"]["w"].update(placements=["_StridedShard(0, split_factor=4)"]))
    with pytest.raises(ChunkLayoutError, match="split factors are inconsistent") as caught:
        tm.open(tmp_path / "ck")
    assert caught.value.tensor == "w"
    rewrite(tmp_path / "five", lambda body: body["tensors"]["w"].update(placements=["_StridedShard(0, sf=9)"]))
    with pytest.raises(ChunkLayoutError, match="split factors are inconsistent"):
        tm.open(tmp_path / "five")


def _max_contributions_manifest(count: int, placement: str = "Partial(max)") -> bytes:
    """A manifest of one 1-element tensor with `count` contributions, one 4-byte chunk each in one file."""
    body = {"format": "tensormorph", "version": 1, "created": "", "world_size": count, "writer": {},
            "checksum": {"algorithm": "crc32c", "block": 65536},
            "files": {"rank-00000.safetensors": {"size": 4 * count, "crc32c": "00000000", "rank": 0}},
            "tensors": {"w": {"dtype": "F32", "shape": [1],
                              "mesh": {"shape": [count], "ranks": list(range(count)), "dim_names": None},
                              "placements": [placement],
                              "chunks": [{"file": "rank-00000.safetensors", "offsets": [0], "shape": [1],
                                          "byte_range": [4 * i, 4 * i + 4], "crc32c": "AAAAAA==", "rank": i,
                                          "holders": [i], "contribution": i} for i in range(count)]}},
            "objects": {}, "extra": {}}
    text = json.dumps(body, separators=(",", ":"))
    return json.dumps({"manifest_crc32c": f"{crc32c.crc32c(text.encode()):08x}", "body": body},
                      separators=(",", ":")).encode()


def test_layout_checks_stay_linear_at_100000_chunks():
    """A Partial tensor of 100,000 one-row contributions: parsed and checked in well under a second each way."""
    import time

    from tensormorph.tiling import LayoutOnly
    from tensormorph.tmformat.placement_check import checked_chunks

    count = 100_000
    raw = _max_contributions_manifest(count)
    started = time.perf_counter()
    manifest = parse(raw, "manifest.json")
    chunks = checked_chunks("w", manifest.tensors["w"], "manifest.json", lambda _: LayoutOnly())
    assert len(chunks) == count and time.perf_counter() - started < 30  # quadratic would take hours


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_partial_manifest_mutations_raise_only_checkpoint_errors(partial_folder, data):
    body = json.loads((partial_folder / MANIFEST).read_text())["body"]
    record = body["tensors"]["w"]
    field = data.draw(st.sampled_from(["placements", "contribution", "mesh", "ranks"]))
    junk = st.one_of(st.integers(-3, 2**63), st.text(max_size=12), st.none(), st.lists(st.integers(-2, 5), max_size=3))
    if field == "placements":
        record["placements"] = [data.draw(st.one_of(junk, st.sampled_from(
            ["Partial(sum)", "Partial()", "P", "_S(0,2)", "_StridedShard(dim=0, sf=0)", "Partial(min)", "S(0)"])))]
    elif field == "contribution":
        data.draw(st.sampled_from(record["chunks"]))["contribution"] = data.draw(junk)
    elif field == "mesh":
        record["mesh"]["shape"] = data.draw(junk)
    else:
        record["mesh"]["ranks"] = data.draw(junk)
    text = json.dumps(body, separators=(",", ":"))
    raw = json.dumps({"manifest_crc32c": f"{crc32c.crc32c(text.encode()):08x}", "body": body}).encode()
    try:
        manifest = parse(raw, "manifest.json")
        from tensormorph.tiling import LayoutOnly
        from tensormorph.tmformat.placement_check import checked_chunks

        checked_chunks("w", manifest.tensors["w"], "manifest.json", lambda _: LayoutOnly())
    except CheckpointError:
        pass


@pytest.mark.parametrize("exact", [True, False])
def test_the_viewer_shows_the_reduction_and_tiles_the_reduced_value(tmp_path, exact):
    from starlette.testclient import TestClient
    from test_server import api, check_against_reference, ok_json, ok_tile
    from test_tiles import view_of

    from tensormorph.server import create_app

    values = partial_checkpoint(tmp_path / "ck", "max", 3)
    expected = np.maximum(np.maximum(values[0], values[1]), values[2])
    with TestClient(create_app([tmp_path / "ck"], cache_dir=tmp_path / "cache")) as client:
        info = ok_json(api(client, "/api/checkpoints/a/tensor", name="w"))
        assert info["reduction"] == {"op": "max", "contributions": 3, "mesh_dims": [0]}
        assert [c["contribution"] for c in info["chunks"]] == [0, 1, 2] and info["ranks"] == [0, 1, 2]
        assert info["split"].endswith("Partial(max) over mesh dim 0: 3 contributions")
        region = (0, 6, 0, 5, 3, 2)
        header, fields = ok_tile(api(client, "/api/checkpoints/a/tile", name="w", r0=0, r1=6, c0=0, c1=5, h=3, w=2,
                                     exact=int(exact)))
        check_against_reference(header, fields, view_of(expected), region, exact)
        # local(1) is rank 1's contribution as stored
        header, fields = ok_tile(api(client, "/api/checkpoints/a/tile", name="w", r0=0, r1=6, c0=0, c1=5, h=6, w=5,
                                     exact=1, rank=1))
        check_against_reference(header, fields, view_of(values[1]), (0, 6, 0, 5, 6, 5), True)


def test_inspect_says_how_a_partial_tensor_is_stored(tmp_path):
    from click.testing import CliRunner

    from tensormorph.cli import main

    partial_checkpoint(tmp_path / "ck", "avg", 2)
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "ck"), "--chunks", "--no-tree"])
    assert shown.exit_code == 0, shown.output
    assert "Partial(avg) over mesh dim 0: 2 contributions" in shown.output
    assert "ranks [0] contribution 0" in shown.output and "ranks [1] contribution 1" in shown.output
    as_json = json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path / "ck"), "--json"]).output)
    assert as_json["tensors"][0]["reduction"] == {"op": "avg", "contributions": 2, "mesh_dims": [0]}


def test_hostile_split_factors_and_meshes_are_refused_at_once(tmp_path):
    shape, placements = (8, 2), ["_StridedShard(0, split_factor=2)"]
    write_layout(tmp_path / "ck", shape, (2,), placements, lambda rank, box: np.zeros(box[1], np.float32))
    for name, edit, error, message in [
        ("huge", lambda record: record.update(placements=[f"_StridedShard(0, split_factor={10**12})"]),
         ChunkLayoutError, "split factors are inconsistent"),
        ("dims", lambda record: record.update(mesh={"shape": [2] + [1] * 70, "ranks": [0, 1], "dim_names": None},
                                              placements=["_StridedShard(0, split_factor=2)"] + ["Replicate()"] * 70),
         HeaderError, "1 to 64 dimensions"),
        ("noranks", lambda record: record["mesh"].update(ranks=[]), HeaderError, "lists 0 ranks"),
        ("badcontribution", lambda record: record["chunks"][0].update(contribution="1"), HeaderError,
         "contribution must be an integer"),
    ]:
        shutil.copytree(tmp_path / "ck", tmp_path / name)
        rewrite(tmp_path / name, lambda body, edit=edit: edit(body["tensors"]["w"]))
        with pytest.raises(error, match=message) as caught:
            tm.open(tmp_path / name)
        assert caught.value.tensor == "w", name


def test_a_rank_file_never_repeats_a_name(tmp_path):
    """Rank 0 holds two boxes of `w` (_StridedShard alone); its second is stored as `w@5,0`, and a tensor of that
    very name must not collide with it: the rank file stays a valid safetensors file."""
    import safetensors

    shape = (9, 2)
    full = np.arange(18, dtype=np.float32).reshape(shape)
    other = np.full((3,), 7, np.float32)
    save = SaveTransaction(tmp_path / "ck")
    pieces, values = [], {}
    for rank in range(2):
        for box, _ in local_pieces(shape, (2,), ["_StridedShard(0, split_factor=2)"], (rank,)):
            piece = Piece("w", "F32", shape, box[0], box[1], rank, (2,), (0, 1), None,
                          ("_StridedShard(0, split_factor=2)",))
            pieces.append(piece)
            values[piece.key] = full[tuple(slice(o, o + n) for o, n in zip(*box))]
    clash = Piece("w@5,0", "F32", (3,), (0,), (3,), 0)
    pieces.append(clash)
    values[clash.key] = other
    save.plan(pieces)
    save.join(save.prepare())
    results = [save.write_rank(rank, [(p, lambda v=values[p.key]: [np.ascontiguousarray(v).reshape(-1)])
                                      for p in save.written_by(rank, [p for p in pieces if p.rank == rank])], {})
               for rank in range(2)]
    save.commit(results, [{}, {}], {})
    with safetensors.safe_open(str(tmp_path / "ck" / "rank-00000.safetensors"), "np") as f:
        assert sorted(f.keys()) == ["w", "w@5,0", "w@5,0~1"]
    ck = tm.open(tmp_path / "ck")
    assert ck["w"].full().tobytes() == full.tobytes() and ck["w@5,0"].full().tobytes() == other.tobytes()


def test_a_box_of_a_partial_tensor_over_100000_ranks_reads_in_linear_time(tmp_path):
    from tensormorph.storage import LocalFiles
    from tensormorph.tmformat.reader import BoxReader

    count = 100_000
    values = np.arange(count, dtype=np.float32)[::-1].copy()
    (tmp_path / "rank-00000.safetensors").write_bytes(values.tobytes())
    raw = _max_contributions_manifest(count, "Partial(min)")
    out = np.empty(1, np.float32)
    with BoxReader(parse(raw, "manifest.json"), LocalFiles(tmp_path), str(tmp_path), verify=False) as reader:
        reader.read_box("w", ((0,), (1,)), out)  # each contribution's chunks found once: not 100,000 scans each
        assert out[0] == 0.0
        one = np.empty(1, np.float32)
        reader.read_box("w", ((0,), (1,)), one, contribution=7)
        assert one[0] == values[7]
