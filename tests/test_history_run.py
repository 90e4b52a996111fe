"""`history` over the issue's real run: examples/train_resumable.py on 2 gloo ranks (FSDP2, asynchronous saves)
for 40 steps, checkpointing every 4, with a NaN written into one weight just before the save of NAN_STEP and one
checkpoint damaged on purpose afterwards.

The run is built once by the fixture cache (tests/fixtures/cache.py, keyed by this file's source): each rank runs
the example's own `main()` unchanged, with `Checkpointer.save` wrapped to inject the NaN and to record, at every
save, the model's full weights as torch gathers them (`full_tensor()`), the reference the drift is checked against.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from fixtures.cache import cached_build
from safetensors import safe_open

from tensormorph.cli import main
from tensormorph.ops.history import CACHE_FILE, History, history
from tensormorph.ops.history_drift import layer_of

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_resumable.py"
WORLD, STEPS, EVERY = 2, 40, 4
SAVED = list(range(EVERY, STEPS + 1, EVERY))
NAN_STEP = 28  # blocks.2.mlp.0.weight[0, 0] becomes NaN on rank 0 just before this step's save
NAN_PARAM = "blocks.2.mlp.0.weight"
DAMAGED_STEP = 12  # rank 1's data file of this checkpoint is cut short after the run
TOKENS_PER_STEP = 16 * 32 * WORLD  # the example's batch of 16 sequences of 32 tokens, per rank
# float64 sums in another order (blocks of 64 MiB, numpy's pairwise dot) than torch's over whole tensors
RELATIVE_TOLERANCE = 1e-9


def _rank(rank: int, port: int, root: str, out: str) -> None:
    """One rank of the example (torch.multiprocessing.spawn), set up as torchrun would."""
    import multiprocessing

    multiprocessing.set_start_method("fork", force=True)  # the DataLoader's workers, as under torchrun
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    spec = importlib.util.spec_from_file_location("train_resumable", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    original = example.Checkpointer.save

    def save(self, step, **state):
        model = state["model"]
        if step == NAN_STEP:
            with torch.no_grad():
                local = model.get_parameter(NAN_PARAM).to_local()
                if rank == 0:
                    local[0, 0] = float("nan")
        weights = {name: p.full_tensor() for name, p in model.named_parameters()}  # collective: every rank
        if rank == 0:
            torch.save(weights, Path(out) / f"weights-{step}.pt")
        return original(self, step, **state)

    example.Checkpointer.save = save
    sys.argv = ["train_resumable.py", "--root", root, "--steps", str(STEPS), "--save-every", str(EVERY),
                "--keep", str(len(SAVED))]
    example.main()


def _build(folder: Path) -> None:
    import torch.multiprocessing as mp
    from remote_support import free_port

    (folder / "weights").mkdir()
    mp.spawn(_rank, args=(free_port(), str(folder / "run"), str(folder / "weights")), nprocs=WORLD, join=True)
    data = folder / "run" / f"step-{DAMAGED_STEP:08d}" / "rank-00001.safetensors"
    os.truncate(data, data.stat().st_size - 1000)


@pytest.fixture(scope="module")
def built() -> Path:
    return cached_build("history_run", sys.modules[__name__], _build)


@pytest.fixture(scope="module")
def computed(built, tmp_path_factory) -> tuple[History, Path]:
    """The run's history, computed once, and the cache folder it filled (beside: the cached run is not written)."""
    cache = tmp_path_factory.mktemp("history-cache")
    return history(built / "run", cache_dir=cache), cache


def _saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The model's tensors as the checkpoint's rank files hold them, read with the safetensors library alone and put
    together as FSDP2 split them (Shard(0): rank 0's rows, then rank 1's)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for rank in range(WORLD):
        with safe_open(str(folder / f"rank-{rank:05d}.safetensors"), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                if name.startswith("model."):
                    parts.setdefault(name, []).append(f.get_tensor(name))
    return {name: torch.cat(pieces) for name, pieces in parts.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # compares NaNs too


def _reference(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float | None]:
    """‖after − before‖ / ‖before‖ per layer, over the positions where both are finite, in float64 with torch."""
    sums: dict[str, list[torch.Tensor]] = {}
    for name, x in before.items():
        x, y = x.double(), after[name].double()
        finite = torch.isfinite(x) & torch.isfinite(y)
        delta, weight = sums.setdefault(layer_of(name), [torch.zeros((), dtype=torch.float64)] * 2)
        sums[layer_of(name)] = [delta + (y - x)[finite].square().sum(), weight + x[finite].square().sum()]
    return {layer: math.sqrt(d) / math.sqrt(w) if w > 0 else None for layer, (d, w) in sums.items()}


LAYERS = {"model", "model.embed", "model.head", *(f"model.blocks.{i}" for i in range(4))}  # model.pos is "model"


def test_history_of_the_two_rank_run(built, computed):
    run, (result, cache) = built / "run", computed
    records = {r.step: r for r in result.checkpoints}
    assert list(records) == SAVED
    assert [r.seq for r in result.checkpoints] == list(range(1, len(SAVED) + 1))
    assert {s for s, r in records.items() if r.status != "committed"} == {DAMAGED_STEP}
    damaged = records[DAMAGED_STEP]
    assert damaged.status == "damaged" and f"step-{DAMAGED_STEP:08d}/rank-00001.safetensors" in damaged.problem
    assert damaged.drift is None and records[DAMAGED_STEP + EVERY].previous == f"step-{DAMAGED_STEP - EVERY:08d}"
    for step, record in records.items():
        assert record.metrics == {"tokens_seen": float(step * TOKENS_PER_STEP)}
        if record.status == "committed":  # the example's saves are asynchronous: durable after they return
            assert record.format == "tensormorph" and record.tiers == ["disk"]
            assert 0 < record.blocked_s < record.durable_s
    # the drift of every pair against torch over the tensors the rank files hold
    chain = [r for r in result.checkpoints if r.status == "committed"]
    saved = {r.step: _saved_weights(run / r.name) for r in chain}
    for step, weights in saved.items():  # the rank files hold what training held at the save, bit for bit
        gathered = torch.load(built / "weights" / f"weights-{step}.pt")
        assert sorted(weights) == sorted(f"model.{n}" for n in gathered)
        assert all(torch.equal(_bits(weights[f"model.{n}"]), _bits(t)) for n, t in gathered.items())
    compared = 0
    for before, after in zip(chain, chain[1:], strict=False):
        assert after.previous == before.name
        expected = _reference(saved[before.step], saved[after.step])
        got = {d.layer: d.relative for d in after.drift}
        assert set(got) == set(expected) == LAYERS
        for layer, value in expected.items():
            if value is None:
                assert got[layer] is None, (after.step, layer)
            else:
                assert got[layer] == pytest.approx(value, rel=RELATIVE_TOLERANCE, abs=0), (after.step, layer)
                compared += 1
        assert not after.changes
    # every layer of the 5 pairs up to the NaN's step; once AdamW has spread it, only the embedding row of token 0
    # (the data never draws it) and the position of the last token (never an input) stay finite, and move
    assert compared == 5 * len(LAYERS) + 3 * 2
    assert all(d.relative is not None for d in records[STEPS].drift if d.layer in ("model", "model.embed"))
    # the NaN: one value of one tensor at its step, everything NaN from the next step on (AdamW spreads it)
    first = {f.tensor: f for f in result.first_nonfinite}
    nan_tensor = f"model.{NAN_PARAM}"
    assert (first[nan_tensor].step, first[nan_tensor].nans, first[nan_tensor].infs) == (NAN_STEP, 1, 0)
    assert records[NAN_STEP].nonfinite == {nan_tensor: (1, 0)}
    assert {f.step for n, f in first.items() if n != nan_tensor} == {NAN_STEP + EVERY}
    assert (first["model.pos"].nans, first["model.embed.weight"].nans) == (31 * 128, 255 * 128)
    assert all(not records[s].nonfinite for s in SAVED if s < NAN_STEP)
    assert set(first) == set(saved[SAVED[0]])  # every tensor of the model, none of the optimizer's
    assert result.computed == len(chain) - 1 and result.cache_hits == 0
    again = history(run, cache_dir=cache)
    assert again.cache_hits == len(chain) - 1 and again.computed == 0 and not (run / CACHE_FILE).exists()
    assert [r.drift for r in again.checkpoints] == [r.drift for r in result.checkpoints]


def test_the_cli_agrees(built, computed):
    run, (result, cache) = built / "run", computed
    out = CliRunner().invoke(main, ["history", str(run), "--json", "--no-cache", "--top", "3"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    fresh, cached = History.from_dict(data).to_dict(), result.to_dict()
    for report in (fresh, cached):  # how the figures were got: the CLI read every pair, the library's were cached
        report.update(cache_file=None, cache_hits=None, computed=None, most_moved=None)
        for record in report["checkpoints"]:
            record["cached"] = None
    assert json.dumps(fresh, sort_keys=True) == json.dumps(cached, sort_keys=True)
    assert data["computed"] == result.computed and data["most_moved"] == [list(m) for m in result.most_moved(3)]
    table = CliRunner().invoke(main, ["history", str(run), "--cache-dir", str(cache)])
    assert table.exit_code == 0, table.output
    assert f"first NaN/Inf: model.{NAN_PARAM} at step {NAN_STEP} (step-{NAN_STEP:08d}: 1 NaN, 0 infinite)" in \
        table.output
    assert f"damaged: {run}/step-{DAMAGED_STEP:08d}/rank-00001.safetensors" in table.output.replace("\n", "")
    assert "tokens_seen" in table.output and "blocked" in table.output and "durable" in table.output
    assert table.output.count("committed") == len(SAVED) - 1
