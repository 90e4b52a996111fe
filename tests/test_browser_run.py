"""Issue 18 in the browser: `tensormorph view RUN` shows a Run panel listing the training run's steps, newest first,
with the tiers that hold each; clicking an older step on disk opens it as B, on the tensor in view, whose values are
that step's (training moved them); a memory-only step is listed but cannot open, and says why. A live run's
panel lists the steps it saves meanwhile.

The run is trained here (test_viewer_run.train) and served by a real uvicorn server. Screenshots go to
build/screenshots/.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect
from test_browser import EXACT_TILE, TIMEOUT, canvas_size, hover, screenshot
from test_browser_view import open_page
from test_viewer_run import live_run, train

from tensormorph.server import create_app
from tensormorph.server_run import RunView

pytestmark = pytest.mark.timeout(120)

NAME = "model.weight"
SHOWN = "(n) => { const s = window.tensormorph.state; return s.selection && s.selection.name === n && s.record; }"


@pytest.fixture(scope="module")
def run_url(serve, tmp_path_factory):
    base = tmp_path_factory.mktemp("run")
    truth = train(base / "run", base / "shm")
    view = RunView(base / "run", str(base / "shm"))
    return serve(create_app([view.newest()], run=view, cache_dir=base / "tiles")), truth, view


def kib(size: int) -> str:
    """A size as the page's format.bytes writes one of 1 KiB to 1 MiB."""
    v = size / 1024
    return f"{v:.2f} KiB" if v < 10 else f"{v:.1f} KiB" if v < 100 else f"{v:.0f} KiB"


def value_at(page, x: float, y: float) -> tuple[tuple[int, int], float]:
    """The element under canvas pixel (x, y) and its exact value, as the hover readout gives them."""
    page.wait_for_function(EXACT_TILE)
    data = hover(page, x, y)
    page.wait_for_function("document.querySelector('[data-testid=hover-value]').dataset.value !== undefined")
    data = {**data, **page.eval_on_selector("[data-testid=hover-value]", "e => ({...e.dataset})")}
    assert data["exact"] == "1"
    row, col = (int(i) for i in data["index"].split(","))
    return (row, col), float(data["value"])


def test_run_panel_lists_the_steps_and_opens_an_older_one(browser, run_url):
    url, truth, view = run_url
    disk = {s.step: s.disk.size for s in view.listing().steps if s.disk}
    page, errors = open_page(browser, url + "/")
    try:
        panel = page.get_by_test_id("run-panel")
        expect(panel).to_be_visible()
        rows = panel.get_by_test_id("run-step")
        expect(rows).to_have_count(4)
        listed = rows.evaluate_all("rows => rows.map(r => [Number(r.dataset.step), r.dataset.tiers, r.dataset.open])")
        assert listed == [[7, "memory", ""], [6, "memory disk", "a"], [4, "disk", ""], [2, "disk", ""]]
        memory_only = panel.locator('[data-step="7"]')
        expect(memory_only).to_have_attribute("aria-disabled", "true")
        expect(memory_only).to_have_attribute("title", re.compile(r"^In memory only: each rank's snapshot holds that "
                                                                 r"rank's shards alone.* no checkpoint to open"))
        expect(memory_only.locator("[data-tier]")).to_have_text(["memory"])
        expect(panel.locator('[data-step="6"] [data-tier]')).to_have_text(["memory", f"disk {kib(disk[6])}"])
        expect(page.get_by_test_id("run-alive")).to_have_text("not running")

        page.evaluate("(n) => window.tensormorph.select(n)", NAME)
        page.wait_for_function(SHOWN, arg=NAME)
        width, height = canvas_size(page)
        cell, newest = value_at(page, width * 0.6, height * 0.4)
        assert newest == float(truth[6][NAME][cell])

        memory_only.click()  # nothing opens
        panel.locator('[data-step="2"]').click()
        page.wait_for_function("() => window.tensormorph.state.active === 'b'")
        page.wait_for_function(SHOWN, arg=NAME)
        expect(panel.locator('[data-step="2"]')).to_have_attribute("data-open", "b")
        expect(page.get_by_test_id("tab-b")).to_contain_text("step-00000002")
        expect(page.get_by_test_id("tab-diff")).to_be_visible()
        at, older = value_at(page, width * 0.6, height * 0.4)
        assert at == cell and older == float(truth[2][NAME][cell]) and older != newest  # training moved it
        page.get_by_test_id("search").hover()  # the hover outline leaves the canvas
        screenshot(page, "run.png")

        panel.locator('[data-step="4"]').click()  # another step replaces step 2 as B
        expect(panel.locator('[data-step="4"]')).to_have_attribute("data-open", "b")
        expect(panel.locator('[data-step="2"]')).to_have_attribute("data-open", "")
        expect(page.get_by_test_id("tab-b")).to_contain_text("step-00000004")
        page.wait_for_function(SHOWN, arg=NAME)
        _, fourth = value_at(page, width * 0.6, height * 0.4)
        assert fourth == float(truth[4][NAME][cell])
        assert page.evaluate("window.tensormorph.state.active") == "b"
    finally:
        page.context.close()
    assert not errors


def test_a_live_run_panel_lists_new_steps_by_itself(browser, serve, tmp_path):
    with live_run(tmp_path) as (view, save):
        page, errors = open_page(browser, serve(create_app([view.newest()], run=view, cache_dir=tmp_path)) + "/")
        try:
            expect(page.get_by_test_id("run-alive")).to_have_text("live")
            rows = page.get_by_test_id("run-step")
            expect(rows).to_have_count(1)
            save(3)
            expect(rows).to_have_count(2, timeout=TIMEOUT)  # the panel asks again while the run is alive
            expect(rows.first).to_have_attribute("data-step", "3")
            expect(rows.first).to_have_attribute("data-tiers", "memory")
        finally:
            page.context.close()
    assert not errors
