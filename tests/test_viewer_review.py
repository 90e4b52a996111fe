"""Viewer answers found wrong in review: the diff search's "next", the scale header when nothing is finite,
and approximate tiles of a tensor damaged elsewhere."""

from __future__ import annotations

import json

import numpy as np
import safetensors.numpy
from starlette.testclient import TestClient
from test_server import api, ok_tile

import tensormorph as tm
from tensormorph.server import create_app


def _lines(response) -> list[dict]:
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line]


def test_the_diff_search_passes_over_skip_hits(tmp_path):
    a = np.zeros((4, 6), np.float32)
    a[0, 1] = a[2, 3] = a[3, 5] = np.nan
    safetensors.numpy.save_file({"w": a}, str(tmp_path / "a.safetensors"))
    safetensors.numpy.save_file({"w": np.zeros((4, 6), np.float32)}, str(tmp_path / "b.safetensors"))
    with TestClient(create_app([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])) as client:
        found = [_lines(api(client, "/api/diff/search", name="w", find="nan", skip=k))[-1] for k in range(4)]
    assert [f["index"] for f in found[:3]] == [[0, 1], [2, 3], [3, 5]] and not found[3]["found"]


def test_no_scale_header_without_a_finite_value(tmp_path):
    safetensors.numpy.save_file({"w": np.full((8, 8), np.nan, np.float32)}, str(tmp_path / "nan.safetensors"))
    b = np.ones((8, 8), np.float32)
    safetensors.numpy.save_file({"w": b}, str(tmp_path / "one.safetensors"))
    with TestClient(create_app([tmp_path / "nan.safetensors", tmp_path / "one.safetensors"])) as client:
        assert api(client, "/api/checkpoints/a/stats", name="w").status_code == 200
        tile = api(client, "/api/checkpoints/a/tile", name="w", r0=0, r1=8, c0=0, c1=8, h=8, w=8, exact=1)
        assert tile.status_code == 200 and "x-tensormorph-scale" not in tile.headers
        assert api(client, "/api/diff", name="w").status_code == 200  # its report: max |a - b| is NaN
        diff = api(client, "/api/diff/tile", name="w", r0=0, r1=8, c0=0, c1=8, h=8, w=8, exact=1)
        assert diff.status_code == 200 and "x-tensormorph-scale" not in diff.headers


def test_approximate_tiles_of_intact_rows_survive_damage_elsewhere(tmp_path):
    values = np.arange(300 * 64, dtype=np.float32).reshape(300, 64)
    safetensors.numpy.save_file({"w": values}, str(tmp_path / "src.safetensors"))
    tm.convert(tmp_path / "src.safetensors", tmp_path / "ck", to="tensormorph", mesh="3", placements=["Shard(0)"])
    damaged = tmp_path / "ck" / "rank-00002.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-8] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with TestClient(create_app([tmp_path / "ck"])) as client:
        for _ in range(2):  # and again: the failed scan is remembered, not repeated for every tile
            header, fields = ok_tile(api(client, "/api/checkpoints/a/tile", name="w", r0=0, r1=100, c0=0, c1=64,
                                         h=25, w=16, exact=0))
            assert header["approximate"] and not header["nonfinite_complete"]
        broken = api(client, "/api/checkpoints/a/tile", name="w", r0=200, r1=300, c0=0, c1=64, h=100, w=64, exact=1)
        assert broken.status_code == 400 and "CRC-32C" in broken.text  # the damaged rows still say so


def test_the_integrity_panel_does_not_decode_large_objects(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from tensormorph.ops.integrity import MAX_OBJECT_BYTES, objects

    dcp.save({"w": torch.ones(2), "blob": "x" * (2 * MAX_OBJECT_BYTES), "step": 7}, checkpoint_id=str(tmp_path / "ck"))
    listed = {o["name"]: o for o in objects(tm.open(tmp_path / "ck"))}
    assert listed["step"]["value"] == 7
    assert listed["blob"]["value"] is None and "not decoded" in listed["blob"]["preview"]


def test_verify_reports_each_intact_file_as_soon_as_it_is_checked(tmp_path, monkeypatch):
    from tensormorph.tmformat import checkpoint as tm_checkpoint

    values = np.arange(4 * 64, dtype=np.float32).reshape(4, 64)
    safetensors.numpy.save_file({"w": values}, str(tmp_path / "src.safetensors"))
    tm.convert(tmp_path / "src.safetensors", tmp_path / "ck", to="tensormorph", mesh="4", placements=["Shard(0)"])
    checked = []
    real = tm_checkpoint.file_problem
    monkeypatch.setattr(tm_checkpoint, "file_problem", lambda *a: checked.append(a[1]) or real(*a))
    problems = tm_checkpoint.checksum_problems(tm.open(tmp_path / "ck"))
    first = next(problems)
    assert first == ("rank-00000.safetensors", None) and checked == ["rank-00000.safetensors"]
    assert [name for name, problem in problems] == [f"rank-{r:05d}.safetensors" for r in range(1, 4)]
