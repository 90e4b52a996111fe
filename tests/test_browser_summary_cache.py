"""The page's first load (issue 17): index.html asks for the checkpoint list, the run and the summary before the
modules load, and the page uses those answers, asking for nothing twice; a viewer started again serves the summary
from its disk cache (summary_cache.py), gzip-ed on the wire, and the page shows the same Architecture view.

Two one-file safetensors checkpoints made here by the safetensors library, served by a real uvicorn server.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from browser_support import write_safetensors
from test_browser import READY, TIMEOUT

from tensormorph import summary_cache
from tensormorph.server import Viewer, create_app

pytestmark = pytest.mark.timeout(120)

LAYERS = [f"model.layers.{i}.mlp.weight" for i in range(6)]


@pytest.fixture(autouse=True)
def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoints are written just before: taken as settled at once (test_summary_cache tests the rule)."""
    monkeypatch.setattr(summary_cache, "SETTLED_S", 0.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("first-load")
    a = write_safetensors(root / "a", {name: np.full((8, 4), k, dtype=np.float32) for k, name in enumerate(LAYERS)},
                          config={"model_type": "llama", "num_hidden_layers": 6})
    b = write_safetensors(root / "b", {"only.in.b": np.zeros((3, 5), dtype=np.float16)})
    return a, b, root / "tiles"


def load(browser, url: str) -> tuple[dict, list[str]]:
    """The page at `url` until ready: (window.tensormorph.state's summaries and active checkpoint, the tree's rows
    and the Content-Encoding each summary came in, by checkpoint id; the API paths asked)."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT)
        asked: list[str] = []
        errors: list[str] = []
        page.on("request", lambda r: asked.append(r.url.split("://", 1)[1].split("/", 1)[1].split("?")[0]))
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        encodings: dict[str, str | None] = {}

        def answered(response) -> None:
            path = response.url.split("?")[0]
            if path.endswith("/summary"):
                encodings[path.rsplit("/", 2)[-2]] = response.headers.get("content-encoding")

        page.on("response", answered)
        page.goto(url)
        page.wait_for_function(READY)
        state = page.evaluate("""() => { const s = window.tensormorph.state;
          const rows = [...document.querySelectorAll('#tree-list [data-testid=tree-node]')];
          return {active: s.active, summaries: s.summaries, error: s.error,
                  rows: rows.map((r) => r.dataset.path)}; }""")
        assert not errors and state["error"] is None, (errors, state["error"])
        state["encodings"] = encodings
        return state, [p for p in asked if p.startswith("api/")]
    finally:
        context.close()


def test_the_first_load_asks_once_for_the_list_and_the_summary(browser, serve, folders, monkeypatch):
    a, b, tiles = folders
    described: list[str] = []
    original = Viewer.describe
    monkeypatch.setattr(Viewer, "describe", lambda self, ck: described.append(str(ck.path)) or original(self, ck))
    base = serve(create_app([a, b], cache_dir=tiles))
    state, asked = load(browser, base + "/")
    assert state["active"] == "a" and asked.count("api/checkpoints") == asked.count("api/run") == 1
    assert asked.count("api/checkpoints/a/summary") == 1 and "api/checkpoints/b/summary" not in asked
    assert state["summaries"]["a"]["tensor_count"] == 6 and state["summaries"]["a"]["config"]["model_type"] == "llama"
    assert state["rows"] == ["model", "model.layers", "model.layers.0"]  # the six layers folded into one row
    # the hash names b: its summary is the one asked for early, and used
    state, asked = load(browser, base + "/#ck=b")
    assert state["active"] == "b" and asked.count("api/checkpoints/b/summary") == 1
    assert "api/checkpoints/a/summary" not in asked and state["summaries"]["b"]["tensors"][0]["dtype"] == "F16"
    # the diff view needs no summary: none is asked for
    state, asked = load(browser, base + "/#ck=diff")
    assert state["active"] == "diff" and not [p for p in asked if p.endswith("/summary")]
    assert len(set(described)) == len(described) == 2  # each described once, in the background


def test_a_viewer_started_again_serves_the_cached_summary(browser, serve, folders, monkeypatch):
    a, _, tiles = folders
    first = create_app([a], cache_dir=tiles).state.viewer.summary("a")  # describes (or finds) and stores it

    def refuse(self, ck):
        raise AssertionError("described again")

    monkeypatch.setattr(Viewer, "describe", refuse)
    base = serve(create_app([a], cache_dir=tiles))
    state, asked = load(browser, base + "/")
    assert asked.count("api/checkpoints/a/summary") == 1 and state["encodings"] == {"a": "gzip"}
    assert state["summaries"]["a"] == json.loads(first.raw)
