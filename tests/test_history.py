"""`history`: a real Checkpointer run with a NaN injected at a known step and one checkpoint damaged on purpose; its
per-layer drift against torch on the kept states, the sidecar cache, --sample and the CLI."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import save_file
from torch import nn

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.core import LogicalTensor
from tensormorph.ops import history as history_module
from tensormorph.ops.convert import convert
from tensormorph.ops.history import CACHE_FILE, History, history
from tensormorph.ops.history_drift import layer_of
from tensormorph.train import Checkpointer, manager
from tensormorph.train import records as save_records

torch.set_num_threads(1)

STEPS = range(1, 7)
NAN_STEP = 4  # model.2.weight[0, 0] becomes NaN before this step's save
DAMAGED_STEP = 2  # its data file is truncated after the run
LAYERS = ("0", "2")  # the Linear layers of the Sequential


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, features: int) -> float:
    """One AdamW step on seeded random inputs of `features` (at NAN_STEP, model.2.weight[0, 0] becomes NaN after
    it); the loss."""
    torch.manual_seed(100 + step)
    loss = model(torch.randn(5, features)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step == NAN_STEP:
        with torch.no_grad():
            model[2].weight[0, 0] = float("nan")
    return loss.item()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """The run's root and the model's state at each step, as saved."""
    root = tmp_path_factory.mktemp("history") / "run"
    model, opt = _model()
    ckpt = Checkpointer(root)
    states = {}
    for step in STEPS:
        loss = train_step(model, opt, step, 4)
        ckpt.save(step, model=model, optimizer=opt, extra={"loss": loss, "lr": {"base": 0.05}})
        states[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt.close()
    data = root / f"step-{DAMAGED_STEP:08d}" / "rank-00000.safetensors"
    os.truncate(data, data.stat().st_size - 100)
    return root, states


def _reference(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], layer: str) -> float | None:
    """‖after - before‖ / ‖before‖ over the layer's tensors, where both are finite, in float64 with torch."""
    delta = weight = torch.zeros((), dtype=torch.float64)
    for name in ("weight", "bias"):
        x, y = before[f"{layer}.{name}"].double(), after[f"{layer}.{name}"].double()
        finite = torch.isfinite(x) & torch.isfinite(y)
        delta = delta + (y - x)[finite].square().sum()
        weight = weight + x[finite].square().sum()
    return math.sqrt(delta) / math.sqrt(weight) if weight > 0 else None


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def test_history_of_a_run(run, tmp_path):
    root, states = run
    result = history(_copy(root, tmp_path))
    records = result.checkpoints
    assert [r.step for r in records] == list(STEPS)
    assert [r.status for r in records] == ["committed", "damaged", *["committed"] * 4]
    damaged = records[DAMAGED_STEP - 1]
    assert "step-00000002/rank-00000.safetensors" in damaged.problem and damaged.drift is None
    assert [r.seq for r in records] == list(STEPS)
    assert records[0].metrics["lr.base"] == 0.05 and all("loss" in r.metrics for r in records)
    # the Checkpointer's record of saves: a synchronous save is durable before it returns
    assert all(r.tiers == ["disk"] and 0 < r.durable_s <= r.blocked_s for r in records if r.status == "committed")
    assert damaged.tiers == ["disk"]  # its save went well: the file was damaged afterwards
    # the drift chain skips the damaged checkpoint: step 3 is measured from step 1
    chain = [r for r in records if r.status == "committed"]
    assert [r.previous for r in chain] == [None, "step-00000001", "step-00000003", "step-00000004",
                                           "step-00000005"]
    compared = 0
    for before, after in zip(chain, chain[1:]):
        assert [d.layer for d in after.drift] == ["model.0", "model.2"]
        for drift, layer in zip(after.drift, LAYERS):
            expected = _reference(states[before.step], states[after.step], layer)
            if expected is None:
                assert drift.relative is None
            else:
                assert drift.relative == pytest.approx(expected, rel=1e-9, abs=0)
                compared += 1
    assert compared >= 5  # pairs before the NaN spread over whole layers are compared for real
    first = {f.tensor: f for f in result.first_nonfinite}
    assert first["model.2.weight"].step == NAN_STEP and first["model.2.weight"].nans == 1
    assert min(f.step for f in result.first_nonfinite) == NAN_STEP
    assert all(not r.nonfinite for r in records if r.step < NAN_STEP)
    assert result.computed == 4 and result.cache_hits == 0 and not result.estimate
    moved = result.most_moved(3)
    assert [m[2] for m in moved] == sorted((m[2] for m in moved), reverse=True) and len(moved) == 3
    assert all(not r.changes for r in records)


def test_second_run_reads_no_tensor_data(run, tmp_path, monkeypatch):
    root, _ = run
    copy = _copy(root, tmp_path)
    first = history(copy)
    assert (copy / CACHE_FILE).is_file()
    reads = []
    original = LogicalTensor.read
    monkeypatch.setattr(LogicalTensor, "read", lambda self, *a, **k: reads.append(self.name) or original(self, *a,
                                                                                                         **k))
    second = history(copy)
    assert reads == [] and second.cache_hits == 4 and second.computed == 0
    assert all(r.cached for r in second.checkpoints if r.drift is not None)
    assert [r.drift for r in second.checkpoints] == [r.drift for r in first.checkpoints]
    assert second.first_nonfinite == first.first_nonfinite
    # a checkpoint saved anew under the same name has another identity: only its pair is read again
    model, opt = _model()
    with torch.no_grad():
        model[0].weight.mul_(3)
    checkpointer = Checkpointer(copy)
    checkpointer.save(6, model=model, optimizer=opt)
    checkpointer.close()
    third = history(copy)
    assert third.cache_hits == 3 and third.computed == 1 and reads
    assert third.checkpoints[-1].drift != first.checkpoints[-1].drift
    # --no-cache reads everything and leaves the file alone
    before = (copy / CACHE_FILE).read_bytes()
    assert history(copy, cache=False).computed == 4 and (copy / CACHE_FILE).read_bytes() == before


def test_abandoned_and_incomplete_checkpoints_are_listed_not_compared(run, tmp_path):
    root, _ = run
    copy = _copy(root, tmp_path)
    assert history_module.ABANDONED_PREFIX == manager.ABANDONED_PREFIX and history_module.TRAIN_KEY == \
        manager.TRAIN_KEY  # ops may not import train: the names are repeated, and must agree
    assert history_module.SAVES_FILE == save_records.SAVES_FILE
    (copy / "step-00000006").rename(copy / f"{manager.ABANDONED_PREFIX}step-00000006-6")
    (copy / "step-00000007").mkdir()
    shutil.copy(copy / "step-00000005" / "rank-00000.safetensors", copy / "step-00000007")
    (copy / "notes.txt").write_text("not a checkpoint")
    records = history(copy, cache=False).checkpoints
    assert [(r.step, r.status) for r in records] == [(1, "committed"), (2, "damaged"), (3, "committed"),
                                                     (4, "committed"), (5, "committed"), (6, "abandoned"),
                                                     (7, "incomplete")]
    assert records[5].drift is None and records[5].metrics and records[6].drift is None
    assert "manifest.json" in records[6].problem


def test_damage_found_while_reading(run, tmp_path):
    """A flipped byte passes the quick verify (every file whole) and fails its block checksum when read: the
    checkpoint is named damaged, and the next one is measured from the last readable one before it."""
    root, states = run
    copy = _copy(root, tmp_path)
    with tm.open(copy / "step-00000005") as ck:
        source = ck["model.0.weight"].chunks[0].source
        data, offset = copy / "step-00000005" / source.file, source.offset
    raw = bytearray(data.read_bytes())
    raw[offset + 2] ^= 0x40
    data.write_bytes(bytes(raw))
    result = history(copy)
    records = {r.step: r for r in result.checkpoints}
    assert records[5].status == "damaged" and "crc" in records[5].problem.lower()
    assert "step-00000005" in records[5].problem and records[5].drift is None
    assert records[6].previous == "step-00000004"
    expected = _reference(states[4], states[6], "0")
    assert records[6].drift[0].relative == (None if expected is None else pytest.approx(expected, rel=1e-9))
    assert result.computed == 3  # 1-3, 3-4, 4-6: the failed pair is not cached
    again = history(copy)  # damage is never cached: the damaged checkpoint is read again, and found again
    assert again.cache_hits == 3 and again.checkpoints[4].status == "damaged"


def test_a_plain_folder_of_checkpoints_sampled(tmp_path):
    """Any format and any sharding, ordered by the number in the names (10 after 9); the drift compares logical
    tensors; --sample reads a few blocks and says so."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((512, 1024)).astype(np.float32)  # 4 MiB as float64: several 1 MiB sample blocks
    run = tmp_path / "plain"
    run.mkdir()
    states = {}
    layouts = {9: None, 10: ("Shard(1)", 3), 11: ("Shard(0)", 2)}  # a safetensors file, then resharded folders
    for step, layout in layouts.items():
        weights = base + np.float32(0.01 * step) * rng.standard_normal(base.shape).astype(np.float32)
        states[step] = weights.astype(np.float64)
        flat = tmp_path / f"flat-{step}.safetensors"
        save_file({"encoder.layers.0.w": weights, "head.w": weights[:4] * 2}, str(flat))
        if layout is None:
            shutil.copy(flat, run / f"ckpt-{step}.safetensors")
        else:
            convert(flat, run / f"ckpt-{step}", to="tensormorph", mesh=layout[1], placements=[layout[0]])
    (run / "README").write_text("notes")
    exact = history(run, cache=False)
    assert [(r.step, r.format) for r in exact.checkpoints] == [(9, "safetensors"), (10, "tensormorph"),
                                                               (11, "tensormorph")]
    for before, after in ((9, 10), (10, 11)):
        drift = exact.checkpoints[after - 9].drift
        assert [d.layer for d in drift] == ["encoder.layers.0", "head"]
        expected = np.linalg.norm(states[after] - states[before]) / np.linalg.norm(states[before])
        assert drift[0].relative == pytest.approx(expected, rel=1e-9)
        head = np.linalg.norm(states[after][:4] - states[before][:4]) / np.linalg.norm(states[before][:4])
        assert drift[1].relative == pytest.approx(head, rel=1e-9)
    cache_dir = tmp_path / "cache"
    sampled = history(run, sample=2, cache_dir=cache_dir)
    assert sampled.estimate and sampled.sample == 2 and sampled.to_dict()["estimate"] is True
    assert not (run / CACHE_FILE).exists() and len(list(cache_dir.iterdir())) == 1
    estimate = sampled.checkpoints[1].drift[0].relative
    assert estimate != exact.checkpoints[1].drift[0].relative  # 2 of 6 blocks: an estimate, not the figure
    assert estimate == pytest.approx(exact.checkpoints[1].drift[0].relative, rel=0.1)
    assert history(run, cache_dir=cache_dir).computed == 2  # the full figures are cached apart from the estimates
    again = history(run, sample=2, cache_dir=cache_dir)
    assert again.cache_hits == 2 and again.checkpoints[1].drift[0].relative == estimate


def test_cache_is_never_written_through_a_link(run, tmp_path):
    root, _ = run
    copy = _copy(root, tmp_path)
    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    (copy / CACHE_FILE).symlink_to(outside)
    result = history(copy)
    assert outside.read_text() == "keep" and not (copy / CACHE_FILE).is_symlink()
    assert result.computed == 4 and history(copy).cache_hits == 4


def test_cli_table_and_json(run, tmp_path):
    root, _ = run
    copy = _copy(root, tmp_path)
    runner = CliRunner()
    out = runner.invoke(main, ["history", str(copy), "--json", "--top", "2", "--no-cache"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert len(data["most_moved"]) == 2
    restored, direct = History.from_dict(data), history(copy, cache=False)
    assert restored.checkpoints[:NAN_STEP] == direct.checkpoints[:NAN_STEP]  # later losses are NaN: NaN != NaN
    assert json.dumps(restored.to_dict(), sort_keys=True) == json.dumps(direct.to_dict(), sort_keys=True)
    assert math.isnan(restored.checkpoints[-1].metrics["loss"])
    assert json.dumps(restored.to_dict() | {"most_moved": data["most_moved"]}) == json.dumps(data)
    assert [c["status"] for c in data["checkpoints"]][:2] == ["committed", "damaged"]
    table = runner.invoke(main, ["history", str(copy)])
    assert table.exit_code == 0, table.output
    assert "first NaN/Inf: model.2.weight at step 4" in table.output
    assert "damaged:" in table.output and "rank-00000.safetensors" in table.output
    assert "most-moved layers" in table.output and "loss" in table.output and "blocked" in table.output
    assert any(c in table.output for c in "▁▂▃▄▅▆▇█")
    sampled = runner.invoke(main, ["history", str(copy), "--sample", "1", "--no-cache"])
    assert sampled.exit_code == 0 and "estimate: 1 block(s) per tensor" in sampled.output
    missing = runner.invoke(main, ["history", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "is not a folder of checkpoints" in missing.output
    one = runner.invoke(main, ["history", str(copy / "step-00000001")])
    assert one.exit_code == 2 and "is one checkpoint, not a run" in one.output


def test_layer_of():
    assert layer_of("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert layer_of("model.0.weight") == "model.0"
    assert layer_of("lm_head.weight") == "lm_head"
    assert layer_of("scale") == "scale"


def test_names_without_numbers_are_ordered_by_time(tmp_path):
    for name, when, value in (("alpha.safetensors", 300, 3.0), ("beta.safetensors", 100, 1.0),
                              ("gamma.safetensors", 200, 2.0)):
        save_file({"w": np.full((3, 3), value, dtype=np.float32)}, str(tmp_path / name))
        os.utime(tmp_path / name, (when, when))
    seen = []
    result = history(tmp_path, cache=False, progress=lambda done, total: seen.append((done, total)))
    assert [(r.name, r.step) for r in result.checkpoints] == [("beta.safetensors", None),
                                                             ("gamma.safetensors", None), ("alpha.safetensors", None)]
    assert [r.total_drift for r in result.checkpoints] == [None, 1.0, 0.5]  # |2-1|/1, |3-2|/2
    assert [d.layer for d in result.checkpoints[1].drift] == ["w"] and seen == [(1, 2), (2, 2)]
