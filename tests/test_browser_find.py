"""Finding what matters in the viewer (issue 20): "go to" NaN, Inf, max |x|, min and max by the server's
streamed search, with progress and cancel; a block holding a NaN or an Inf takes its colour at every zoom
and in every block summary; the diff view's "go to the largest |a − b|".

A 4096 × 8192 float32 tensor (128 MiB) with one NaN and one +Inf is made here and served by a real uvicorn
server. Screenshots go to build/screenshots/.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from browser_support import write_safetensors
from playwright.sync_api import expect
from test_browser import EXACT_TILE, QUERY, base_url, heatmap_state, page, screenshot
from test_browser_view import colours_at, open_page, select

__all__ = ["base_url", "page"]  # fixtures, imported for pytest

pytestmark = pytest.mark.timeout(120)

SHAPE = (4096, 8192)
NAN_AT, INF_AT = (1234, 5678), (3000, 100)
MAX_AT, MIN_AT = (4000, 8000), (17, 4242)
NAN_RGB, INF_RGB = "255,0,200", "0,232,255"  # colormaps.js
# The newest tile is exact and at the step the view has now (not an older one's answer).
EXACT_NOW = """() => { const h = window.tensormorph.state.heatmap; const t = h.tiles[h.tiles.length - 1];
  return !!t && t.exact && t.step.join() === h.step.join(); }"""


@pytest.fixture(scope="module")
def outliers_url(serve, tmp_path_factory) -> str:
    values = np.random.default_rng(7).standard_normal(SHAPE, dtype=np.float32) * np.float32(0.1)
    values[NAN_AT], values[INF_AT] = np.nan, np.inf
    values[MAX_AT], values[MIN_AT] = 7.5, -6.5
    folder = write_safetensors(tmp_path_factory.mktemp("outliers") / "ck", {"outliers": values})
    from tensormorph.server import create_app

    return serve(create_app([folder], cache_dir=tmp_path_factory.mktemp("outlier-tiles")))


@pytest.fixture
def fpage(browser, outliers_url):
    page, errors = open_page(browser, outliers_url + "/")
    yield page
    body_error = page.evaluate("document.body.dataset.error || null")
    page.context.close()
    assert not errors and body_error is None, (errors, body_error)


def non_finite_colours(page) -> tuple[str | None, str | None]:
    """The canvas colours at the NaN and at the Inf (in the view's blocks that hold them)."""
    return tuple(colours_at(page, [NAN_AT, INF_AT]))


def find(page, what: str, status: str) -> None:
    page.get_by_test_id(f"find-{what}").click()
    expect(page.get_by_test_id("find-status")).to_contain_text(status)


def test_nan_and_inf_found_and_visible_at_fit(fpage):
    page = fpage
    select(page, "outliers")
    page.wait_for_function(EXACT_TILE)
    state = heatmap_state(page)
    assert min(state["step"]) > 4  # at fit, a pixel summarises many elements
    assert non_finite_colours(page) == (NAN_RGB, INF_RGB)
    for agg in ("auto", "mean", "min", "max", "absmax"):  # whatever the block summary says
        page.get_by_test_id("aggregation").select_option(agg)
        assert non_finite_colours(page) == (NAN_RGB, INF_RGB), agg
    screenshot(page, "find-fit.png")
    # go to the NaN: the element, shown and pinned
    find(page, "nan", "NaN #1 at [1234, 5678]")
    card = page.get_by_test_id("pin-card")
    expect(card).to_have_attribute("data-index", "1234,5678")
    expect(card).to_have_attribute("data-value", "NaN")
    state = heatmap_state(page)
    assert state["step"] == [1, 1] and state["visible"]["r0"] <= 1234 < state["visible"]["r1"]
    page.wait_for_function(EXACT_TILE)
    assert colours_at(page, [NAN_AT], 0.15)[0] == NAN_RGB  # off the value written in the cell
    find(page, "nan", "no more NaN")
    find(page, "inf", "Inf #1 at [3000, 100]")
    expect(card).to_have_attribute("data-value", "Infinity")
    # zoomed out part of the way (a pixel is a block again), then to fit: still seen
    for _ in range(9):
        page.get_by_test_id("zoom-out").click()
    page.wait_for_function(f"() => window.tensormorph.state.heatmap.step[0] > 1 && ({EXACT_NOW})()")
    assert colours_at(page, [INF_AT])[0] == INF_RGB
    page.get_by_test_id("zoom-fit").click()
    page.wait_for_function(f"() => window.tensormorph.state.heatmap.atFit && ({EXACT_NOW})()")
    assert non_finite_colours(page) == (NAN_RGB, INF_RGB)
    screenshot(page, "find-inf.png")
    # the largest and the smallest values, the largest |x| (an Inf counts)
    find(page, "max", "max at [4000, 8000] = 7.5")
    assert int(page.locator("#find-controls").get_attribute("data-progress-lines")) >= 1  # 128 MiB read, with progress
    find(page, "min", "min at [17, 4242] = -6.5")
    expect(card).to_have_attribute("data-index", "17,4242")


def test_find_shows_progress_and_cancels(fpage):
    page = fpage
    held = []
    searches = re.compile(r"/api/checkpoints/a/search\?")
    page.route(searches, lambda route: held.append(route))
    select(page, "outliers")
    page.get_by_test_id("find-absmax").click()
    expect(page.get_by_test_id("find-progress")).to_be_visible()
    expect(page.get_by_test_id("find-status")).to_contain_text("looking for max |x|")
    page.wait_for_function("() => document.querySelector('#find-controls').dataset.state === 'running'")
    page.get_by_test_id("find-cancel").click()
    expect(page.get_by_test_id("find-status")).to_have_text("cancelled")
    expect(page.get_by_test_id("find-progress")).to_be_hidden()
    assert len(held) == 1 and "find=absmax" in held[0].request.url
    page.unroute(searches)
    # once the statistics say there is no NaN, none is looked for (here there is one: the button stays)
    expect(page.get_by_test_id("stats")).to_have_attribute("data-state", "ready")
    expect(page.get_by_test_id("find-nan")).to_be_enabled()
    expect(page.get_by_test_id("find-nan")).to_have_attribute("title", re.compile(": 1$"))


def test_diff_goes_to_the_largest_difference(page):
    page.get_by_test_id("tab-diff").click()
    page.locator(f'[data-testid=diff-row][data-name="{QUERY}"]').click()
    page.wait_for_function(EXACT_TILE)
    find(page, "absdiff", "max |a − b| at [7, 11] = 0.25")
    card = page.get_by_test_id("pin-card")
    expect(card).to_have_attribute("data-index", "7,11")
    expect(card).to_have_attribute("data-value", re.compile(r"^-0\.25"))
    expect(card).to_contain_text("a")
    screenshot(page, "find-diff.png")
