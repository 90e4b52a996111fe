"""The viewer's layout at small windows (issue 20): at 1024×700 nothing overlaps and the heatmap is not the
squeezed pane; at 800×600 the inspector steps aside; the diff table's name column resizes; the FILES badge
shows on tensors inside folded layers; the search box leads into its results by keyboard.

Same server and page as test_browser.py (the viewer_pair: MiniLM by DCP on 4 ranks under "model.").
Screenshots go to build/screenshots/.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect
from test_browser import (
    EMBEDDINGS,
    EXACT_TILE,
    QUERY,
    base_url,
    open_tensor,
    page,
    screenshot,
    search,
    truth,
    wait_listed,
)

__all__ = ["base_url", "page", "truth"]  # fixtures, imported for pytest

pytestmark = pytest.mark.timeout(120)

INTERMEDIATE = "model.encoder.layer.0.intermediate.dense.weight"  # inside the folded layers, on 4 ranks' files

# Boxes of the elements matching each selector (visible ones), and pairs of them that overlap.
OVERLAPS = """(selectors) => {
  const boxes = [];
  for (const sel of selectors) for (const e of document.querySelectorAll(sel)) {
    const r = e.getBoundingClientRect();
    if (r.width > 0 && r.height > 0 && e.checkVisibility()) boxes.push({sel, r, e});
  }
  const out = [];
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const a = boxes[i].r, b = boxes[j].r;
    if (boxes[i].e.contains(boxes[j].e) || boxes[j].e.contains(boxes[i].e)) continue;
    const w = Math.min(a.right, b.right) - Math.max(a.left, b.left);
    const h = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
    if (w > 0.5 && h > 0.5) out.push(`${boxes[i].sel} × ${boxes[j].sel}`);
  }
  return out; }"""

# For each visible tree/list row: whether its tags overlap its name, and its size bar its byte count.
ROW_TEXT = """() => [...document.querySelectorAll('#tree-list .row')].map(row => {
  const text = (el) => { const r = document.createRange(); r.selectNodeContents(el);
    return r.getBoundingClientRect(); };
  const cross = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 0.5
    && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 0.5;
  const label = row.querySelector('.label'); const tags = row.querySelector('.tags');
  const bytes = row.querySelector('.bytes'); const bar = row.querySelector('.sizebar');
  const figure = bytes && [...bytes.childNodes].find(n => n.nodeType === 3);
  let figureBox = null;
  if (figure) { const r = document.createRange(); r.selectNodeContents(figure); figureBox = r.getBoundingClientRect(); }
  return {name: row.dataset.path || row.dataset.name,
          tagsOverName: !!(label && tags && tags.children.length && cross(text(label), tags.getBoundingClientRect())),
          barOverBytes: !!(figureBox && bar && bar.getBoundingClientRect().width > 0
                           && cross(figureBox, bar.getBoundingClientRect()))};
  })"""


def pane_widths(page) -> dict[str, float]:
    return page.evaluate("""() => Object.fromEntries(['left', 'heatmap', 'inspector'].map(id => {
      const e = document.getElementById(id);
      return [id, e.checkVisibility() ? e.getBoundingClientRect().width : 0]; }))""")


def test_layout_at_1024_by_700(page):
    page.set_viewport_size({"width": 1024, "height": 700})
    open_tensor(page, EMBEDDINGS)
    widths = pane_widths(page)
    assert widths["heatmap"] >= max(400, widths["left"], widths["inspector"]), widths
    assert page.get_by_test_id("heatmap").bounding_box()["height"] >= 380
    overlaps = page.evaluate(OVERLAPS, [".toolbar-row > *", ".controls > label", ".controls > .axes > label",
                                        ".zoom-box", "#approximate-badge", ".statusbar > *", ".top > *"])
    overlaps += page.evaluate(OVERLAPS, ["#heatmap", "#ruler-top", "#ruler-left", "#left", "#centre > *", "#inspector"])
    assert not overlaps, overlaps
    rows = page.evaluate(ROW_TEXT)
    assert rows and not [r for r in rows if r["tagsOverName"] or r["barOverBytes"]], rows
    # tree mode: the tensors of a folded layer carry their FILES badge
    page.get_by_test_id("search").press("Escape")
    page.evaluate("(n) => window.tensormorph.select(n)", INTERMEDIATE)
    row = page.locator(f'[data-testid=tree-node][data-path="{INTERMEDIATE}"]')
    expect(row).to_have_count(1)
    for badge in ("badge-multi-file", "badge-sharded"):  # whole, on the row's one line of badges
        shown = row.get_by_test_id(badge).evaluate("""t => { const box = t.parentElement.getBoundingClientRect();
          const r = t.getBoundingClientRect();
          return r.width > 0 && r.top === box.top && r.right <= box.right + 0.5; }""")
        assert shown, badge
    page.wait_for_function(EXACT_TILE)
    rows = page.evaluate(ROW_TEXT)
    assert len(rows) > 10 and not [r for r in rows if r["tagsOverName"] or r["barOverBytes"]], rows
    screenshot(page, "layout-1024.png")


def test_layout_at_800_by_600(page):
    page.set_viewport_size({"width": 800, "height": 600})
    open_tensor(page, EMBEDDINGS)
    expect(page.locator("#inspector")).to_be_hidden()  # it steps aside for the heatmap
    widths = pane_widths(page)
    assert widths["heatmap"] >= 300 and widths["left"] >= 220, widths
    name = page.locator(f'#tree-list [data-testid=tensor-row][data-name="{EMBEDDINGS}"]')
    assert name.bounding_box()["width"] >= 80
    assert page.evaluate("document.documentElement.scrollWidth") <= 800
    screenshot(page, "layout-800.png")
    page.get_by_test_id("toggle-right").click()
    inspector = page.locator("#inspector")
    expect(inspector).to_be_visible()
    box = inspector.bounding_box()
    assert box["x"] + box["width"] <= 800 and box["width"] >= 240
    expect(page.get_by_test_id("inspector-name")).to_have_text(EMBEDDINGS)
    screenshot(page, "layout-800-inspector.png")
    page.keyboard.press("]")  # hidden again, and the list with [
    expect(inspector).to_be_hidden()
    page.get_by_test_id("heatmap").focus()
    page.keyboard.press("[")
    expect(page.locator("#left")).to_be_hidden()
    assert pane_widths(page)["heatmap"] >= 700


# The diff row of a name: its name cell's width, whether its end is cut, and the row's and the header's widths.
# One evaluation: the list redraws its rows (new elements) when the table's width changes.
DIFF_ROW = """(name) => { const row = document.querySelector(`[data-testid=diff-row][data-name="${name}"]`);
  if (!row) return null; const m = row.querySelector('.midname'); const tail = m.querySelector('.mid-tail');
  return {width: m.getBoundingClientRect().width, cut: tail.scrollWidth > tail.clientWidth,
          row: row.getBoundingClientRect().width,
          header: document.querySelector('.diff-table .drow.header').getBoundingClientRect().width}; }"""


def diff_row(page, width: float | None = None) -> dict:
    if width is not None:  # until the redrawn rows have it
        page.wait_for_function(f"(n) => {{ const r = ({DIFF_ROW})(n); return r && Math.abs(r.width - {width}) < 3; }}",
                               arg=QUERY)
    return page.evaluate(DIFF_ROW, QUERY)


def test_diff_name_column_resizes(page):
    page.set_viewport_size({"width": 1024, "height": 700})
    page.get_by_test_id("tab-diff").click()
    expect(page.locator(f'[data-testid=diff-row][data-name="{QUERY}"]')).to_have_count(1)
    before = diff_row(page)
    assert before["cut"]  # the name does not fit at first
    handle = page.get_by_test_id("diff-name-resize")
    box = handle.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] / 2 + 250, box["y"] + box["height"] / 2, steps=5)
    page.mouse.up()
    after = diff_row(page, before["width"] + 250)
    assert not after["cut"]  # the whole name shows now
    assert after["row"] == pytest.approx(after["header"], abs=1)  # the rows follow the header
    assert after["row"] > before["row"]
    screenshot(page, "layout-diff-column.png")
    handle.dispatch_event("dblclick")  # back to the room the pane leaves
    assert diff_row(page, before["width"])["cut"]


def test_search_box_leads_into_its_results(page, truth):
    with_384 = {n for n, v in truth.items() if 384 in v.shape}
    search(page, "384")  # a bare number: a dimension of that size (the list draws only the rows in view)
    expect(page.get_by_test_id("match-count")).to_contain_text(f"{len(with_384)} of {len(truth)} tensors match")
    assert len(with_384) > 50
    search(page, "layer.4 output.dense.weight 384x384")
    wait_listed(page, {"model.encoder.layer.4.attention.output.dense.weight"})
    page.get_by_test_id("search").press("Enter")
    page.wait_for_function("() => { const s = window.tensormorph.state; return s.record && "
                           "s.record.name === 'model.encoder.layer.4.attention.output.dense.weight'; }")
    search(page, "layer.5 dense.weight")
    layer5 = [f"model.encoder.layer.5.{m}.dense.weight" for m in ("attention.output", "intermediate", "output")]
    wait_listed(page, set(layer5))
    opened = "(n) => window.tensormorph.state.record && window.tensormorph.state.record.name === n"
    page.get_by_test_id("search").press("ArrowDown")
    page.wait_for_function(opened, arg=layer5[0])
    page.keyboard.press("ArrowDown")  # the list has the focus now
    page.wait_for_function(opened, arg=layer5[1])
