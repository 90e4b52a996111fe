"""Issue 21, the viewer's Timeline API: /api/history streams what `tm.history` computes for the served run, with
the run's rollback; /api/history/open serves two steps as a and b. A client that leaves stops the computation; two
requests at once compute the pairs once.

The run is trained here: a Checkpointer saving every step to disk and memory, one NaN in the checkpoint of
NAN_STEP, a rollback to ROLLBACK_TO then step 6 saved anew, and the checkpoint of DAMAGED_STEP truncated. A layer is
named like markup (EVIL) and so is a metric: the page must show both as text.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient
from torch import nn

import tensormorph as tm
from tensormorph.ops import history as history_module
from tensormorph.ops.history import CACHE_FILE
from tensormorph.server import create_app
from tensormorph.server_history import HISTORY_ROUTES, MAX_SAMPLE, history_lines
from tensormorph.server_run import RunView
from tensormorph.train import Checkpointer
from tensormorph.train.rollback import roll_back

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)

EVIL = "<img src=x onerror=alert(1)><script>alert(2)</script>"  # a module name: no dot, so torch takes it
EVIL_METRIC = "<b>lr</b>"
NAN_STEP = 4  # model.2.weight[0, 0] is NaN in this step's checkpoint only
ROLLBACK_TO = 5  # the run is rolled back here after step 6, then step 6 is saved anew
DAMAGED_STEP = 2  # its data file is truncated at the end
CACHE_FIELDS = ("cache_file", "cache_hits", "computed", "cache_error")


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict([("0", nn.Linear(4, 8)), ("1", nn.ReLU()), ("2", nn.Linear(8, 3)),
                                       (EVIL, nn.Linear(3, 2))]))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    torch.manual_seed(seed)
    loss = model(torch.randn(5, 4)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def build_run(base: Path) -> tuple[Path, Path, dict[int, dict[str, np.ndarray]]]:
    """The run's root, its memory folder, and the model's weights as saved at each step (step 6: the new one)."""
    root, shm = base / "run", base / "shm"
    options: dict[str, Any] = {"memory_every": 1, "memory_dir": shm, "release_memory_on_close": False}
    model, opt = _model()
    ckpt = Checkpointer(root, **options)
    states = {}
    for step in range(1, 7):
        loss = _train_step(model, opt, 100 + step)
        weight = model[2].weight
        kept = weight[0, 0].item()
        if step == NAN_STEP:
            with torch.no_grad():
                weight[0, 0] = float("nan")
        ckpt.save(step, model=model, optimizer=opt, extra={"loss": loss, EVIL_METRIC: 0.05})
        ckpt.wait()
        states[step] = {f"model.{n}": p.detach().numpy().copy() for n, p in model.named_parameters()}
        with torch.no_grad():
            weight[0, 0] = kept  # the NaN was in the checkpoint only: training goes on finite
    ckpt.close()
    roll_back(root, ROLLBACK_TO, memory_dir=shm)
    model, opt = _model()
    ckpt = Checkpointer(root, **options)
    assert ckpt.resume(model=model, optimizer=opt) == ROLLBACK_TO
    loss = _train_step(model, opt, 1006)  # another batch: the new step 6 differs from the abandoned one
    ckpt.save(6, model=model, optimizer=opt, extra={"loss": loss, EVIL_METRIC: 0.05})
    ckpt.close()
    states[6] = {f"model.{n}": p.detach().numpy().copy() for n, p in model.named_parameters()}
    data = root / f"step-{DAMAGED_STEP:08d}" / "rank-00000.safetensors"
    os.truncate(data, data.stat().st_size - 100)
    return root, shm, states


def history_app(view: RunView | None, path: Path | None = None, **options: Any):
    """The viewer's app, serving a run's newest checkpoint (or `path`)."""
    app = create_app([path or view.newest()], run=view, **options)
    assert {route for route, *_ in HISTORY_ROUTES} <= {getattr(r, "path", None) for r in app.router.routes}
    return app


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return build_run(tmp_path_factory.mktemp("timeline"))


def fresh_copy(run, tmp_path: Path) -> RunView:
    """A copy of the run without the history cache, served from its own folder."""
    root, shm, _ = run
    copy = tmp_path / "run"
    shutil.copytree(root, copy, symlinks=True)
    (copy / CACHE_FILE).unlink(missing_ok=True)
    return RunView(copy, str(shm))


def stream(client: TestClient, **params: Any) -> list[dict[str, Any]]:
    answer = client.get("/api/history", params=params)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in answer.text.splitlines()]


def without_cache(data: dict[str, Any]) -> dict[str, Any]:
    """A history as JSON, less what depends on the cache's state."""
    data = {k: v for k, v in data.items() if k not in CACHE_FIELDS}
    data["checkpoints"] = [{k: v for k, v in c.items() if k != "cached"} for c in data["checkpoints"]]
    return data


def library(root: Path, **options: Any) -> dict[str, Any]:
    """tm.history's answer as the endpoint sends it (JSON: NaN becomes null)."""
    from tensormorph.server_request import finite

    return json.loads(json.dumps(finite(tm.history(root, cache=False, **options).to_dict())))


def test_history_streams_what_the_library_computes(run, tmp_path):
    view = fresh_copy(run, tmp_path)
    with TestClient(history_app(view)) as client:
        lines = stream(client)
        again = stream(client)
    assert lines[0] == {"progress": {"done": 0, "total": None}}
    assert all("progress" in line for line in lines[:-1]) and lines[-1]["done"] is True
    done = lines[-1]
    expected = library(view.root)
    assert without_cache(done["history"]) == without_cache(expected)
    records = done["history"]["checkpoints"]
    assert [(r["step"], r["status"]) for r in records] == [
        (1, "committed"), (2, "damaged"), (3, "committed"), (4, "committed"), (5, "committed"), (6, "abandoned"),
        (6, "committed")]
    assert f"step-{DAMAGED_STEP:08d}/rank-00000.safetensors" in records[1]["problem"]
    assert records[5]["name"] == "abandoned-step-00000006-6" and records[6]["seq"] == 7
    assert [r["previous"] for r in records] == [None, None, "step-00000001", "step-00000003", "step-00000004", None,
                                                "step-00000005"]
    assert [d["layer"] for d in records[2]["drift"]] == ["model.0", "model.2", f"model.{EVIL}"]
    assert records[0]["metrics"] == {"loss": pytest.approx(records[0]["metrics"]["loss"]), EVIL_METRIC: 0.05}
    assert records[3]["nonfinite"] == {"model.2.weight": [1, 0]} and records[4]["nonfinite"] == {}
    assert [(f["tensor"], f["step"]) for f in done["history"]["first_nonfinite"]] == [("model.2.weight", NAN_STEP)]
    assert all(r["tiers"] == ["memory", "disk"] for r in records if r["status"] == "committed")
    assert done["rollback"] == {"step": ROLLBACK_TO, "seq": ROLLBACK_TO, "abandoned": [[6, 6]]}
    assert done["rollback_error"] is None
    assert done["history"]["computed"] == 4 and done["history"]["cache_hits"] == 0
    assert done["history"]["cache_file"] == str(view.root / CACHE_FILE)
    # the second request reads no tensor: every pair is in the library's cache (shared with `tensormorph history`)
    assert again[-1]["history"]["computed"] == 0 and again[-1]["history"]["cache_hits"] == 4
    assert without_cache(again[-1]["history"]) == without_cache(expected)


def test_sampled_history_and_refused_parameters(run, tmp_path):
    view = fresh_copy(run, tmp_path)
    with TestClient(history_app(view)) as client:
        done = stream(client, sample=1)[-1]
        assert done["history"]["estimate"] is True and done["history"]["sample"] == 1
        assert without_cache(done["history"]) == without_cache(library(view.root, sample=1))
        for bad, why in ((0, "must be 1 to"), (MAX_SAMPLE + 1, "must be 1 to"), ("x", "must be an integer")):
            refused = client.get("/api/history", params={"sample": bad})
            assert refused.status_code == 400 and why in refused.json()["error"], refused.text
    root, _, _ = run
    with TestClient(history_app(None, root / "step-00000001")) as plain:  # a viewer of one checkpoint: no run
        assert plain.get("/api/history").status_code == 404
        assert "serves no training run" in plain.post("/api/history/open", params={"a": 1, "b": 3}).json()["error"]


def test_a_damaged_rollback_marker_is_named_and_the_history_stands(run, tmp_path):
    view = fresh_copy(run, tmp_path)
    (view.root / ".tensormorph-rollback.json").write_text("{not json")
    with TestClient(history_app(view, view.root / "step-00000005")) as client:  # the listing needs the marker
        done = stream(client)[-1]
    assert done["rollback"] is None and "rollback marker is damaged" in done["rollback_error"]
    assert len(done["history"]["checkpoints"]) == 7


def slow_pairs(monkeypatch, delay: float = 0.3) -> list[int]:
    """Each pair read by the library takes `delay` seconds longer; the list counts them."""
    calls: list[int] = []
    original = history_module.pair_drift

    def slow(*args: Any, **kwargs: Any):
        calls.append(1)
        time.sleep(delay)
        return original(*args, **kwargs)

    monkeypatch.setattr(history_module, "pair_drift", slow)
    return calls


def test_a_client_that_leaves_stops_the_computation(run, tmp_path, monkeypatch):
    view = fresh_copy(run, tmp_path)
    calls = slow_pairs(monkeypatch)
    lines = history_lines(view.root, None)
    assert next(lines) == {"progress": {"done": 0, "total": None}}
    assert next(lines) == {"progress": {"done": 2, "total": 5}}  # step 2 is found damaged at its opening
    lines.close()  # what the stream does when its client disconnects: returns once the computation stopped
    assert not any(t.name == "tensormorph-history" for t in threading.enumerate())
    assert len(calls) < 4  # the pair in hand when it left, not every pair of the run
    assert not (view.root / CACHE_FILE).exists()  # stopped before the end: nothing written


def test_two_requests_at_once_compute_the_pairs_once(run, tmp_path, monkeypatch):
    view = fresh_copy(run, tmp_path)
    calls = slow_pairs(monkeypatch)
    streams: list[list[dict[str, Any]]] = []

    def read() -> None:
        streams.append(list(history_lines(view.root, None)))

    readers = [threading.Thread(target=read) for _ in range(2)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(60)
    assert len(calls) == 4  # the second waited for the first, then found every pair cached
    results = [lines[-1]["history"] for lines in streams]
    assert sorted((r["computed"], r["cache_hits"]) for r in results) == [(0, 4), (4, 0)]
    waited = [any(line.get("progress", {}).get("waiting") for line in lines) for lines in streams]
    assert waited == [r["computed"] == 0 for r in results]  # and said so meanwhile


def test_opening_two_steps_serves_them_as_a_and_b(run):
    root, shm, states = run
    view = RunView(root, str(shm))
    name = "model.0.weight"
    with TestClient(history_app(view)) as client:
        opened = client.post("/api/history/open", params={"a": 5, "b": 3})
        assert opened.status_code == 200, opened.text
        assert opened.json() == {"a": {"step": 5, "path": str(root.absolute() / "step-00000005")},
                                 "b": {"step": 3, "path": str(root.absolute() / "step-00000003")}}
        assert [(c["id"], c["path"]) for c in client.get("/api/checkpoints").json()] == [
            ("a", str(root.absolute() / "step-00000005")), ("b", str(root.absolute() / "step-00000003"))]
        for cid, step in (("a", 5), ("b", 3)):
            answer = client.get(f"/api/checkpoints/{cid}/stats", params={"name": name}).json()
            assert (answer["min"], answer["max"]) == (states[step][name].min(), states[step][name].max())
        diff = {t["name"]: t for t in client.get("/api/diff").json()["tensors"]}
        assert diff[name]["max_abs"] == float(np.abs(states[5][name].astype(np.float64) - states[3][name]).max())
        # the new step 6 (not the abandoned one) as a, step 5 kept as b: the pair of its drift
        assert client.post("/api/history/open", params={"a": 6, "b": 5}).json()["b"]["step"] == 5
        diff = {t["name"]: t for t in client.get("/api/diff").json()["tensors"]}
        assert diff[name]["max_abs"] == float(np.abs(states[6][name].astype(np.float64) - states[5][name]).max())
        same = client.post("/api/history/open", params={"a": 4, "b": 4})
        assert same.status_code == 400 and "two steps" in same.json()["error"]
        unknown = client.post("/api/history/open", params={"a": 9, "b": 4})
        assert unknown.status_code == 404 and "no step 9" in unknown.json()["error"]
        damaged = client.post("/api/history/open", params={"a": 3, "b": DAMAGED_STEP})
        assert damaged.status_code == 400 and "step-00000002" in damaged.json()["error"]
        assert client.post("/api/history/open", params={"a": "x", "b": 1}).status_code == 400
        # nothing opened by the refused requests
        assert [c["path"][-13:] for c in client.get("/api/checkpoints").json()] == ["step-00000006", "step-00000005"]
        # after the Timeline put another step in a, the Run panel's open serves the run's newest as a again
        assert client.post("/api/history/open", params={"a": 4, "b": 3}).status_code == 200
        assert client.post("/api/run/open", params={"step": 1}).json()["id"] == "b"
        assert [c["path"][-13:] for c in client.get("/api/checkpoints").json()] == ["step-00000006", "step-00000001"]
        diff = {t["name"]: t for t in client.get("/api/diff").json()["tensors"]}
        assert diff[name]["max_abs"] == float(np.abs(states[6][name].astype(np.float64) - states[1][name]).max())
