"""Issue 21 in the browser: the Timeline page of `tensormorph view RUN` draws what `tm.history` computes for the run
(drift per layer and checkpoint, the metric chart, damaged, abandoned, rolled-back-to and NaN markers, the tiers that
hold each step), shows names from the checkpoints as text, opens a step as B on a click, and the Diff view of a
layer between two checkpoints on a click of its cell.

The run (test_server_history.build_run) is trained here and served by a real uvicorn server. The screenshot goes to
build/screenshots/timeline.png (docs/screenshots/timeline.png is a copy of it).
"""

from __future__ import annotations

import threading
import time

import pytest
from playwright.sync_api import expect
from test_browser import screenshot
from test_browser_view import open_page
from test_server_history import (
    DAMAGED_STEP,
    EVIL,
    EVIL_METRIC,
    NAN_STEP,
    ROLLBACK_TO,
    build_run,
    fresh_copy,
    history_app,
    library,
    slow_pairs,
)

from tensormorph.server_run import RunView

pytestmark = pytest.mark.timeout(120)

DONE = "document.querySelector('[data-testid=timeline]').dataset.state === 'done'"
SLOW_FACTOR, SLOW_MIN_S = 3, 0.5  # timeline.js: a save held training up 3 × the run's median, and 0.5 s more
CELLS = "cells => cells.map(c => [c.dataset.layer, Number(c.dataset.col), c.dataset.value])"


@pytest.fixture(scope="module")
def timeline_url(serve, tmp_path_factory):
    base = tmp_path_factory.mktemp("timeline-page")
    root, shm, states = build_run(base)
    view = RunView(root, str(shm))
    return serve(history_app(view, cache_dir=base / "tiles")), view, library(root), (root, shm, states)


def test_the_timeline_draws_the_run_as_the_library_sees_it(browser, timeline_url):
    url, view, expected, _ = timeline_url
    records = expected["checkpoints"]
    page, errors = open_page(browser, url + "/#ck=timeline")
    try:
        page.wait_for_function(DONE)
        expect(page.get_by_test_id("timeline-link")).to_be_visible()
        # every drift cell holds the library's figure; a cell without one is empty
        layers = list(dict.fromkeys(d["layer"] for r in records for d in r["drift"] or ()))
        assert layers == ["model.0", "model.2", f"model.{EVIL}"]
        want = []
        for layer in layers:
            for j, r in enumerate(records):
                figure = next((d["relative"] for d in r["drift"] or () if d["layer"] == layer), None)
                want.append([layer, j, "" if figure is None else figure])
        drawn = page.get_by_test_id("tl-cell").evaluate_all(CELLS)
        assert [[layer, j, float(v) if v else ""] for layer, j, v in drawn] == want
        assert sum(1 for *_, v in want if v != "") == 4 * len(layers)  # four pairs compared
        # the steps, their status, and which may open
        steps = page.get_by_test_id("tl-step").evaluate_all(
            "bs => bs.map(b => [Number(b.dataset.step), b.dataset.status, b.disabled])")
        assert steps == [[r["step"], r["status"], r["status"] == "abandoned"] for r in records]
        # markers: damaged (and why), abandoned, the step rolled back to, the first NaN
        markers = page.get_by_test_id("tl-marker").evaluate_all(
            "ms => ms.map(m => [Number(m.dataset.col), m.dataset.kind])")
        blocked = sorted(r["blocked_s"] for r in records if r["blocked_s"] is not None)
        typical = blocked[(len(blocked) - 1) // 2]  # a save is slow by timeline.js's rule: it depends on the machine
        slow = [[j, "slow"] for j, r in enumerate(records) if r["blocked_s"] is not None
                and r["blocked_s"] > SLOW_FACTOR * typical and r["blocked_s"] - typical > SLOW_MIN_S]
        assert markers == sorted([[1, "damaged"], [3, "nonfinite"], [4, "rollback"], [5, "abandoned"], *slow])
        assert [records[j]["step"] for j in (1, 3, 4)] == [DAMAGED_STEP, NAN_STEP, ROLLBACK_TO]
        damaged = page.locator('[data-kind=damaged]')
        expect(damaged).to_have_attribute("title", f"damaged: {records[1]['problem']}")
        expect(page.locator('[data-kind=nonfinite]')).to_have_attribute(
            "title", "holds NaN or Inf\nfirst appearance of model.2.weight\nmodel.2.weight: 1 NaN, 0 Inf")
        expect(page.get_by_test_id("tl-first-nonfinite")).to_have_text(
            f"first NaN/Inf: model.2.weight at step {NAN_STEP}")
        expect(page.get_by_test_id("tl-rollback")).to_have_text(f"rolled back to step {ROLLBACK_TO}")
        # the tiers that hold each checkpoint now: the listing's, for this very checkpoint (not the abandoned 6)
        listed = {s.step: s for s in view.listing().steps}
        tiers = page.get_by_test_id("tl-tiers").evaluate_all("ts => ts.map(t => t.dataset.tiers)")
        assert tiers == ["" if r["status"] == "abandoned" else " ".join(listed[r["step"]].tiers) for r in records]
        assert tiers[-1] == "memory disk" and tiers[0] == "disk"
        # the chart: total drift, then the loss, point by point
        points = "ps => ps.map(p => [Number(p.dataset.col), Number(p.dataset.value)])"
        assert page.get_by_test_id("tl-point").evaluate_all(points) == [
            [j, r["total_drift"]] for j, r in enumerate(records) if r["total_drift"] is not None]
        page.get_by_test_id("tl-metric").select_option("metric:loss")
        assert page.get_by_test_id("tl-point").evaluate_all(points) == [
            [j, r["metrics"]["loss"]] for j, r in enumerate(records)]
        # names from the checkpoints are text, never markup
        assert page.get_by_test_id("tl-metric").locator("option").all_text_contents()[1:3] == [EVIL_METRIC, "loss"]
        expect(page.locator(f'tr[data-layer="model.{EVIL}"] th')).to_have_text(f"model.{EVIL}")
        assert page.evaluate("document.querySelectorAll('#timeline img, #timeline script, #timeline b').length") == 0
        page.get_by_test_id("tl-metric").select_option("save:blocked_s")  # the Checkpointer's record of saves
        assert page.get_by_test_id("tl-point").evaluate_all(points) == [
            [j, r["blocked_s"]] for j, r in enumerate(records) if r["blocked_s"] is not None]
        page.get_by_test_id("tl-metric").select_option("metric:loss")
        screenshot(page, "timeline.png")
    finally:
        page.context.close()
    assert not errors


def test_clicks_open_a_step_and_the_diff_of_a_layer(browser, timeline_url):
    url, _, expected, _ = timeline_url
    records = expected["checkpoints"]
    page, errors = open_page(browser, url + "/#ck=timeline")
    try:
        page.wait_for_function(DONE)
        # a cell: both checkpoints of the pair open, and the Diff view shows the layer's most-moved tensor
        last = len(records) - 1
        assert (records[last]["step"], records[last]["previous"]) == (6, "step-00000005")
        page.locator(f'[data-testid=tl-cell][data-layer="model.0"][data-col="{last}"]').click()
        page.wait_for_function(
            "() => { const s = window.tensormorph.state; return s.active === 'diff' && s.diffSelection; }")
        expect(page.get_by_test_id("timeline")).to_be_hidden()
        paths = page.evaluate("window.tensormorph.state.checkpoints.map(c => [c.id, c.path.split('/').pop()])")
        assert paths == [["a", "step-00000006"], ["b", "step-00000005"]]
        moved = page.evaluate("""() => { const s = window.tensormorph.state;
            const rel = (n) => s.diff.tensors.find(t => t.name === n).rel_l2;
            return [s.diffSelection.name, rel('model.0.weight'), rel('model.0.bias')]; }""")
        assert moved[0] == ("model.0.weight" if moved[1] >= moved[2] else "model.0.bias")
        # back to the timeline, as it was, and a step opens as B
        page.get_by_test_id("timeline-link").click()
        page.wait_for_function(DONE)
        page.locator('[data-testid=tl-step][data-col="2"]').click()
        page.wait_for_function("() => window.tensormorph.state.active === 'b'")
        expect(page.get_by_test_id("tab-b")).to_contain_text("step-00000003")
        expect(page.get_by_test_id("timeline")).to_be_hidden()
        # a damaged step does not open: the timeline says why
        page.get_by_test_id("timeline-link").click()
        page.wait_for_function(DONE)
        page.locator('[data-testid=tl-step][data-col="1"]').click()
        expect(page.get_by_test_id("tl-error")).to_contain_text(f"Could not open step {DAMAGED_STEP}")
        expect(page.get_by_test_id("tl-error")).to_contain_text("step-00000002")
        # an estimate says it is one
        page.get_by_test_id("tl-sample").select_option("8")
        page.wait_for_function(DONE)
        expect(page.get_by_test_id("tl-estimate")).to_have_text("estimate: 8 blocks per tensor")
    finally:
        page.context.close()
    assert not errors


def test_cancel_stops_the_computation_on_the_server(browser, serve, timeline_url, tmp_path, monkeypatch):
    view = fresh_copy(timeline_url[3], tmp_path)  # no cache: every pair is read, each slowly
    calls = slow_pairs(monkeypatch, 1.0)
    page, errors = open_page(browser, serve(history_app(view)) + "/#ck=timeline")
    try:
        expect(page.get_by_test_id("tl-progress")).to_contain_text("Comparing checkpoints: 2 of 5")
        page.get_by_test_id("tl-cancel").click()
        expect(page.get_by_test_id("tl-error")).to_contain_text("Cancelled")
        assert page.evaluate("document.querySelector('[data-testid=timeline]').dataset.state") == "cancelled"
        deadline = time.monotonic() + 10  # the pair in hand when the connection closed is finished first
        while any(t.name == "tensormorph-history" for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(t.name == "tensormorph-history" for t in threading.enumerate())
        assert len(calls) < 4 and not (view.root / ".tensormorph-history.json").exists()
    finally:
        page.context.close()
    assert not errors
