"""Honest states of the viewer page (issue 20): an empty local(rank) view says so, a failed request leaves
no stale image, the axes selector gives the sizes drawn, and long names are cut in the middle.

Same server, page and helpers as test_browser.py (the viewer_pair fixture: MiniLM by DCP on 4 ranks under
"model."); screenshots go to build/screenshots/.
"""

from __future__ import annotations

import contextlib
import re

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import expect
from test_browser import EMBEDDINGS, QUERY, base_url, open_tensor, page, screenshot, search, wait_listed

__all__ = ["base_url", "page"]  # fixtures, imported for pytest

pytestmark = pytest.mark.timeout(120)

POSITION_IDS = "model.embeddings.position_ids"  # 1×512 I64 saved Shard(0) on 4 ranks: rank 3 holds a 0×512 chunk
INTERMEDIATE = "model.encoder.layer.0.intermediate.dense.weight"  # 1536×384, Shard(0): 384 rows per rank
BACKGROUND = [232, 235, 240]  # render.js: the canvas colour outside any tensor

# Every pixel of the heatmap canvas, as the distinct colours found (a cleared canvas has one).
CANVAS_COLOURS = """c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  const seen = new Set();
  for (let i = 0; i < d.length; i += 4) { seen.add(`${d[i]},${d[i + 1]},${d[i + 2]}`); if (seen.size > 8) break; }
  return [...seen]; }"""


def canvas_colours(page) -> list[str]:
    return page.eval_on_selector("[data-testid=heatmap]", CANVAS_COLOURS)


def cleared(page) -> None:
    """The canvas shows nothing but its background: no earlier tensor's image."""
    page.wait_for_function(f"""() => {{ const f = {CANVAS_COLOURS}; const got = f(document.getElementById('heatmap'));
      return got.length === 1 && got[0] === '{",".join(map(str, BACKGROUND))}'; }}""")


def test_empty_rank_says_how_many_elements_it_holds(page):
    open_tensor(page, EMBEDDINGS)  # an image on the canvas first: it must not stay under the message
    assert len(canvas_colours(page)) > 1
    page.evaluate("(n) => window.tensormorph.select(n, {rank: 3})", POSITION_IDS)
    page.wait_for_function("(n) => { const s = window.tensormorph.state; return s.record && s.record.name === n "
                           "&& s.rank === 3; }", arg=POSITION_IDS)
    message = page.locator("#canvas-message")
    expect(message).to_have_text("rank 3 holds 0 of 512 elements")
    expect(message).not_to_have_class(re.compile(r"\berror\b"))
    expect(page.get_by_test_id("rank-select")).to_have_value("3")
    cleared(page)
    assert page.evaluate("window.tensormorph.state.heatmap.tiles.length") == 0
    expect(page.locator("#legend-hi")).to_be_empty()  # nor the previous tensor's colour scale
    screenshot(page, "honest-empty-rank.png")
    # rank 0 holds the whole tensor: it draws again
    page.get_by_test_id("rank-select").select_option("0")
    page.wait_for_function("() => { const h = window.tensormorph.state.heatmap; return h.viewShape.join() === '1,512' "
                           "&& h.approximate === false; }")
    expect(message).to_be_empty()


def test_failed_requests_leave_no_stale_image(page):
    open_tensor(page, EMBEDDINGS)
    assert len(canvas_colours(page)) > 1
    tiles = re.compile(r"/api/checkpoints/a/tile\?")
    page.route(tiles, lambda route: route.fulfill(status=500, json={"error": "the disk is on fire"}))
    page.get_by_test_id("zoom-in").click()  # a region not loaded yet: its tiles fail
    message = page.locator("#canvas-message")
    expect(message).to_contain_text("the disk is on fire")
    expect(message).to_have_class(re.compile(r"\berror\b"))
    cleared(page)
    expect(page.get_by_test_id("approximate-badge")).to_be_hidden()
    screenshot(page, "honest-tile-error.png")
    page.unroute(tiles)
    page.get_by_test_id("zoom-out").click()  # the next tiles draw again and the error goes
    page.wait_for_function("() => window.tensormorph.state.heatmap.tiles.some(t => t.exact)")
    expect(message).to_be_empty()
    assert len(canvas_colours(page)) > 1
    # a tensor that cannot be opened: the previous one's image goes too
    tensor = re.compile(r"/api/checkpoints/a/tensor\?")
    page.route(tensor, lambda route: route.fulfill(status=500, json={"error": "no such luck"}))
    page.evaluate("(n) => window.tensormorph.select(n)", INTERMEDIATE)
    expect(message).to_contain_text("no such luck")
    cleared(page)
    page.unroute(tensor)


def test_axes_selector_gives_the_local_sizes(page):
    open_tensor(page, INTERMEDIATE)
    rows = page.get_by_test_id("axis-rows")
    expect(rows.locator("option")).to_have_text(["d0 (1536)", "d1 (384)"])
    page.get_by_test_id("rank-select").select_option("1")
    page.wait_for_function("() => { const s = window.tensormorph.state; const h = s.heatmap; return s.rank === 1 "
                           "&& h.viewShape.join() === '384,384' && h.approximate === false; }")
    expect(rows.locator("option")).to_have_text(["d0 (384)", "d1 (384)"])
    expect(page.get_by_test_id("axis-cols").locator("option")).to_have_text(["d0 (384)", "d1 (384)"])
    screenshot(page, "honest-local-axes.png")


# The first cut name in `selector`: its parts, whether the end part is clipped, and whether the text `headShows`
# (at the end of the start part) and `tailShows` (at the end of the name) are drawn inside their boxes.
MIDNAME = """([selector, headShows, tailShows]) => {
  const m = document.querySelector(selector).querySelector('.midname');
  const head = m.querySelector('.mid-head'); const tail = m.querySelector('.mid-tail');
  const shown = (part, text) => {
    const node = part.querySelector('bdi').firstChild; const at = node.data.lastIndexOf(text);
    if (at < 0) return false;
    const range = document.createRange(); range.setStart(node, at); range.setEnd(node, at + text.length);
    const r = range.getBoundingClientRect(); const box = part.getBoundingClientRect();
    return r.width > 0 && r.left >= box.left - 0.5 && r.right <= box.right + 0.5; };
  return {title: m.title, text: m.textContent, head: head.textContent, tail: tail.textContent,
          tailCut: tail.scrollWidth > tail.clientWidth,
          headShows: shown(head, headShows), tailShows: shown(tail, tailShows),
          apart: head.getBoundingClientRect().right <= tail.getBoundingClientRect().left + 0.5}; }"""


def cut_name(page, selector: str, head_shows: str, tail_shows: str) -> dict:
    """MIDNAME's answer once the layout has settled (both texts shown), or as it is after a second."""
    check = f"(args) => {{ const c = ({MIDNAME})(args); return c.headShows && c.tailShows; }}"
    with contextlib.suppress(PlaywrightTimeout):  # the assertions say what is wrong
        page.wait_for_function(check, arg=[selector, head_shows, tail_shows], timeout=1000)
    return page.evaluate(MIDNAME, [selector, head_shows, tail_shows])


def test_long_names_are_cut_in_the_middle(page):
    page.set_viewport_size({"width": 1024, "height": 700})
    name = "model." + QUERY.replace("layer.3", "layer.5")
    search(page, "query.weight")
    wait_listed(page, {f"model.encoder.layer.{i}.attention.self.query.weight" for i in range(6)})
    cut = cut_name(page, f'#tree-list [data-testid=tensor-row][data-name="{name}"]', "layer.5", "query.weight")
    screenshot(page, "honest-names-search.png")
    assert cut["title"] == cut["text"] == name
    assert (cut["head"], cut["tail"]) == ("model.encoder.layer.5", ".attention.self.query.weight"), cut
    assert cut["tailCut"] and cut["headShows"] and cut["tailShows"] and cut["apart"], str(cut)
    # the diff table (whose name column has no room at all at 1024 px: another part of issue 20)
    page.set_viewport_size({"width": 1440, "height": 900})
    page.get_by_test_id("tab-diff").click()
    expect(page.locator(f'[data-testid=diff-row][data-name="{QUERY}"]')).to_have_count(1)
    cut = cut_name(page, f'[data-testid=diff-row][data-name="{QUERY}"]', "layer.3", "weight")
    screenshot(page, "honest-names-diff.png")
    assert cut["title"] == cut["text"] == QUERY
    assert cut["head"] == "encoder.layer.3" and cut["tailCut"] and cut["headShows"] and cut["tailShows"], str(cut)
