"""Issue 18, the viewer's side: `tensormorph view RUN` on a Checkpointer's root. /api/run answers what list_run
answers; a step on disk (or in the object store) opens as checkpoint b with its own values, replacing the step
opened before; a memory-only step, or a step folder that leads outside the run, is refused.

The runs are trained here (a tiny nn.Linear and AdamW, a memory snapshot every step, a disk checkpoint every
second) and served through Starlette's TestClient; the object store is moto's S3 server.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from starlette.testclient import TestClient
from torch import nn

from tensormorph.cli import main
from tensormorph.server import create_app
from tensormorph.server_run import RUN_ID_FILE, STEP_FOLDER, RunView, is_run
from tensormorph.storage import remote_options
from tensormorph.train import Checkpointer
from tensormorph.train.listing import list_run
from tensormorph.train.manager import FOLDER_PREFIX
from tensormorph.train.manager import RUN_ID_FILE as TRAIN_RUN_ID_FILE

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

STEPS = range(1, 8)  # disk checkpoints at 2, 4, 6; memory snapshots of 6 and 7 (memory_keep=2)


def train(root, memory_dir, steps=STEPS, seed=0, **tiers) -> dict[int, dict[str, np.ndarray]]:
    """Train and checkpoint; the parameters after each step."""
    torch.manual_seed(seed)
    model = nn.Linear(6, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ckpt = Checkpointer(root, memory_every=1, disk_every=2, memory_dir=memory_dir, release_memory_on_close=False,
                        **tiers)
    at = {}
    for step in steps:
        torch.manual_seed(100 + step)
        model(torch.randn(3, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(step, model=model, optimizer=opt, extra={"step": step})
        at[step] = {f"model.{n}": p.detach().numpy().copy() for n, p in model.named_parameters()}
    ckpt.wait()
    ckpt.close()
    return at


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    base = tmp_path_factory.mktemp("run")
    truth = train(base / "run", base / "shm")
    return base / "run", str(base / "shm"), truth


def served(run, **options) -> TestClient:
    root, memory, _ = run
    view = RunView(root, memory, **options)
    return TestClient(create_app([view.newest()], run=view))


def stats(client: TestClient, cid: str, name: str) -> tuple[float, float]:
    answer = client.get(f"/api/checkpoints/{cid}/stats", params={"name": name})
    assert answer.status_code == 200, answer.text
    return answer.json()["min"], answer.json()["max"]


def test_run_is_told_apart_from_a_checkpoint_and_other_folders(run, tmp_path):
    root, _, _ = run
    assert (RUN_ID_FILE, STEP_FOLDER.pattern) == (TRAIN_RUN_ID_FILE, FOLDER_PREFIX + r"\d{8}")  # train's own names
    assert is_run(root)
    assert not is_run(root / "step-00000002")  # a checkpoint itself: opened as before
    assert not is_run(tmp_path) and not is_run(tmp_path / "missing") and not is_run("s3://bucket/run")
    (tmp_path / "step-00000001").mkdir()  # step folders without a run id file: a disk-only run
    assert is_run(tmp_path)


def test_the_run_endpoint_answers_what_list_run_answers(run):
    root, memory, _ = run
    with served(run) as client:
        listing = client.get("/api/run")
        checkpoints = client.get("/api/checkpoints").json()
    assert listing.status_code == 200
    assert listing.json() == json.loads(json.dumps(list_run(root.absolute(), memory_dir=memory).to_json()))
    steps = {s["step"]: s for s in listing.json()["steps"]}
    assert [(s, r["tiers"]) for s, r in steps.items()] == [
        (2, ["disk"]), (4, ["disk"]), (6, ["memory", "disk"]), (7, ["memory"])]
    assert steps[7]["memory"] == {"ranks": [0], "copies": [], "complete": True} and steps[7]["disk"] is None
    assert listing.json()["world_size"] == 1 and not listing.json()["alive"]
    # the newest step on disk is checkpoint a, at the path the listing gives
    assert [(c["id"], c["path"]) for c in checkpoints] == [("a", steps[6]["disk"]["path"])]
    with TestClient(create_app([root / "step-00000002"])) as plain:  # a plain viewer serves no run
        assert plain.get("/api/run").json() is None
        assert plain.post("/api/run/open", params={"step": 2}).status_code == 404
    with served(run) as client:
        api = client.get("/api/openapi.json").json()["paths"]
    assert "get" in api["/api/run"] and "post" in api["/api/run/open"]


def test_opening_steps_serves_each_as_b_with_its_own_values(run):
    _, _, truth = run
    name = "model.weight"
    with served(run) as client:
        assert client.post("/api/run/open", params={"step": 6}).json()["id"] == "a"  # served already
        assert stats(client, "a", name) == (truth[6][name].min(), truth[6][name].max())
        opened = client.post("/api/run/open", params={"step": 2})
        assert opened.status_code == 200, opened.text
        assert opened.json()["id"] == "b" and opened.json()["tier"] == "disk"
        assert opened.json()["path"].endswith("step-00000002")
        assert stats(client, "b", name) == (truth[2][name].min(), truth[2][name].max())
        diff = {t["name"]: t for t in client.get("/api/diff").json()["tensors"]}
        assert diff[name]["status"] == "different"
        assert diff[name]["max_abs"] == float(np.abs(truth[6][name].astype(np.float64) - truth[2][name]).max())
        # step 4 replaces step 2 as b: nothing cached of step 2 (statistics, summary, diff) is served for it
        assert client.post("/api/run/open", params={"step": 4, "tier": "disk"}).json()["id"] == "b"
        assert [c["path"][-13:] for c in client.get("/api/checkpoints").json()] == ["step-00000006", "step-00000004"]
        assert stats(client, "b", name) == (truth[4][name].min(), truth[4][name].max())
        diff = {t["name"]: t for t in client.get("/api/diff").json()["tensors"]}
        assert diff[name]["max_abs"] == float(np.abs(truth[6][name].astype(np.float64) - truth[4][name]).max())
        assert client.get("/api/checkpoints/b/summary").json()["path"].endswith("step-00000004")


def test_memory_only_unknown_and_wrong_tier_steps_are_refused(run):
    with served(run) as client:
        memory = client.post("/api/run/open", params={"step": 7})
        assert memory.status_code == 404 and "memory snapshot holds one rank's shards" in memory.json()["error"]
        assert "in memory" in memory.json()["error"]
        unknown = client.post("/api/run/open", params={"step": 5})
        assert unknown.status_code == 404 and "no step 5" in unknown.json()["error"]
        assert "[2, 4, 6, 7]" in unknown.json()["error"]
        remote = client.post("/api/run/open", params={"step": 2, "tier": "remote"})
        assert remote.status_code == 404 and "not in the object store" in remote.json()["error"]
        assert client.post("/api/run/open", params={"step": 2, "tier": "memory"}).status_code == 400
        assert client.post("/api/run/open", params={"step": "x"}).status_code == 400
        assert client.get("/api/run/open", params={"step": 2}).status_code == 404  # opening is a POST only
        assert [c["id"] for c in client.get("/api/checkpoints").json()] == ["a"]  # nothing was opened


def test_a_step_folder_leading_outside_the_run_is_refused(tmp_path):
    train(tmp_path / "run", tmp_path / "shm", steps=range(1, 3))
    train(tmp_path / "elsewhere", tmp_path / "shm", steps=range(1, 5), seed=1)  # another run's step 4
    (tmp_path / "run" / "step-00000004").symlink_to(tmp_path / "elsewhere" / "step-00000004")
    view = RunView(tmp_path / "run", str(tmp_path / "shm"))
    assert [(s.step, s.tiers) for s in view.listing().steps] == [(1, ("memory",)), (2, ("memory", "disk")),
                                                                 (4, ("disk",))]
    with TestClient(create_app([tmp_path / "run" / "step-00000002"], run=view)) as client:
        refused = client.post("/api/run/open", params={"step": 4})
        assert refused.status_code == 403, refused.text
        assert "outside the run's folder" in refused.json()["error"]
        assert str(tmp_path / "elsewhere" / "step-00000004") in refused.json()["error"]
        assert [c["id"] for c in client.get("/api/checkpoints").json()] == ["a"]


def test_view_serves_a_run_root_with_its_memory_folder(run, monkeypatch):
    root, memory, _ = run
    started = []
    monkeypatch.setattr("uvicorn.run", lambda app, **options: started.append(app))
    result = CliRunner().invoke(main, ["view", str(root), "--memory-dir", memory, "--no-browser"])
    assert result.exit_code == 0, result.output
    assert f"opened {root.absolute() / 'step-00000006'}" in " ".join(result.output.split())
    with TestClient(started[0]) as client:
        assert [s["step"] for s in client.get("/api/run").json()["steps"]] == [2, 4, 6, 7]  # 7: in --memory-dir
        assert client.get("/api/checkpoints").json()[0]["path"] == str(root.absolute() / "step-00000006")


@contextlib.contextmanager
def live_run(tmp_path) -> Iterator[tuple[RunView, Callable[[int], None]]]:
    """A run whose Checkpointer lives (step 2 on disk and in memory): its RunView, and a function that saves a
    further step."""
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    ckpt = Checkpointer(tmp_path / "run", memory_every=1, disk_every=2, memory_dir=tmp_path / "shm")

    def save(step: int) -> None:
        ckpt.save(step, model=model)
        ckpt.wait()

    try:
        save(2)
        yield RunView(tmp_path / "run", str(tmp_path / "shm")), save
    finally:
        ckpt.close()


def test_a_live_run_is_listed_afresh_on_each_request(tmp_path):
    with live_run(tmp_path) as (view, save), TestClient(create_app([view.newest()], run=view)) as client:
        first = client.get("/api/run").json()
        save(3)
        second = client.get("/api/run").json()
    assert first["alive"] and second["alive"]  # the Checkpointer holds its snapshots
    assert [s["step"] for s in first["steps"]] == [2] and [s["step"] for s in second["steps"]] == [2, 3]


def test_view_refuses_a_run_with_nothing_to_open_and_tier_options_without_a_run(run, tmp_path):
    train(tmp_path / "run", tmp_path / "shm", steps=range(1, 2))  # step 1: in memory only
    result = CliRunner().invoke(main, ["view", str(tmp_path / "run"), "--memory-dir", str(tmp_path / "shm"),
                                       "--no-browser"])
    assert result.exit_code == 2
    assert "no checkpoint on disk to view; steps [1] are in memory only" in result.output
    plain = CliRunner().invoke(main, ["view", str(run[0] / "step-00000002"), "--remote", "s3://b/x", "--no-browser"])
    assert plain.exit_code == 2 and "--memory-dir and --remote are for a training run's root" in plain.output


def test_a_run_lost_from_disk_opens_its_newest_step_in_the_object_store(tmp_path):
    from remote_support import S3Endpoint

    url = "s3://runs/exp"
    with S3Endpoint() as s3:
        s3.make_bucket("runs")
        truth = train(tmp_path / "run", tmp_path / "shm", steps=range(1, 5), remote=url, remote_every=2,
                      remote_storage_options=s3.storage_options)
        for folder in (tmp_path / "run").glob("step-*"):  # the disk is lost
            for file in folder.iterdir():
                file.unlink()
            folder.rmdir()
        view = RunView(tmp_path / "run", str(tmp_path / "shm"), url, remote_storage_options=s3.storage_options)
        newest = view.newest()
        assert str(newest) == f"{url}/step-00000004"
        with remote_options(s3.storage_options, False):  # checkpoint a opens with them
            app = create_app([str(newest)], run=view)
        with TestClient(app) as client:
            steps = {s["step"]: s["tiers"] for s in client.get("/api/run").json()["steps"]}
            assert steps == {2: ["remote"], 3: ["memory"], 4: ["memory", "remote"]}
            opened = client.post("/api/run/open", params={"step": 2}).json()
            assert (opened["id"], opened["tier"], opened["path"]) == ("b", "remote", f"{url}/step-00000002")
            name = "model.bias"
            assert stats(client, "a", name) == (truth[4][name].min(), truth[4][name].max())
            assert stats(client, "b", name) == (truth[2][name].min(), truth[2][name].max())
