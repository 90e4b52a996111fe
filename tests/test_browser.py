"""The viewer page in a real browser: Playwright (Python, sync API) driving Debian's chromium.

A real uvicorn server serves the `viewer_pair` fixture as examples/demo.py does (a = MiniLM by DCP on 4
ranks under "model.", b = the HF-sharded copy with one element nudged). Screenshots of each view go to
build/screenshots/. No browser is ever downloaded: without /usr/bin/chromium or the playwright package
this module is skipped, loudly.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from browser_support import SCREENSHOTS
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import expect

from tensormorph.server import create_app

pytestmark = pytest.mark.timeout(120)

RENAME = ["a:model.="]
QUERY = "encoder.layer.3.attention.self.query.weight"
EMBEDDINGS = "model.embeddings.word_embeddings.weight"
TIMEOUT = 20_000  # ms

READY = "document.body.dataset.ready === '1'"
EXACT_TILE = """() => { const h = window.tensormorph.state.heatmap;
  return !!h && h.tiles.length > 0 && h.approximate === false; }"""


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def truth(viewer_pair, fixture_builders) -> dict[str, np.ndarray]:
    return fixture_builders.load_expected(fixture_builders.expected_paths(viewer_pair[0])[0])


@pytest.fixture(scope="module")
def base_url(serve, viewer_pair, tmp_path_factory) -> str:
    cache = tmp_path_factory.mktemp("browser-tiles")
    return serve(create_app(list(viewer_pair), rename=RENAME, cache_dir=cache))


@pytest.fixture
def page(browser, base_url):
    context = browser.new_context(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(base_url + "/")
    page.wait_for_function(READY)
    yield page
    body_error = page.evaluate("document.body.dataset.error || null")
    context.close()
    assert not errors and body_error is None, (errors, body_error)


def screenshot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / name))


def search(page, query: str) -> None:
    page.get_by_test_id("search").fill(query)


def listed_names(page) -> list[str]:
    return page.eval_on_selector_all("#tree-list [data-testid=tensor-row]", "rows => rows.map(r => r.dataset.name)")


def wait_listed(page, expected: set[str]) -> None:
    page.wait_for_function(
        """(want) => { const got = [...document.querySelectorAll('#tree-list [data-testid=tensor-row]')]
             .map(r => r.dataset.name).sort();
           return JSON.stringify(got) === JSON.stringify(want); }""", arg=sorted(expected))


def open_tensor(page, name: str) -> None:
    """Find a tensor by searching its name, click its row, wait for the exact tile."""
    search(page, name)
    wait_listed(page, {name})  # the search is debounced: click the flat list's row, not the tree's
    row = page.locator(f'#tree-list [data-testid=tensor-row][data-name="{name}"]')
    row.click()
    page.wait_for_function("(n) => { const s = window.tensormorph.state; return s.selection && s.selection.name === n "
                           "&& s.record && s.record.name === n; }", arg=name)
    page.wait_for_function(EXACT_TILE)


def heatmap_state(page) -> dict:
    return page.evaluate("JSON.parse(JSON.stringify(window.tensormorph.state.heatmap))")


def hover(page, x: float, y: float) -> dict:
    """Move the mouse to canvas pixel (x, y) and return the hover readout's data."""
    box = page.get_by_test_id("heatmap").bounding_box()
    page.mouse.move(box["x"] + x, box["y"] + y)
    readout = page.get_by_test_id("hover-value")
    expect(readout).to_have_attribute("data-row", re.compile(r"\d+"))
    return {"text": readout.inner_text(), **page.eval_on_selector("[data-testid=hover-value]", "e => ({...e.dataset})")}


def canvas_size(page) -> tuple[int, int]:
    return tuple(page.eval_on_selector("[data-testid=heatmap]", "c => [c.width, c.height]"))


def pixel(page, x: int, y: int) -> tuple[int, int, int]:
    rgba = page.eval_on_selector("[data-testid=heatmap]",
                                 "(c, [x, y]) => Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data)", [x, y])
    assert rgba[3] == 255
    return tuple(rgba[:3])


def dtype_name(array: np.ndarray) -> str:
    return {"float32": "F32", "int64": "I64", "bfloat16": "BF16"}[array.dtype.name]


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


def test_page_becomes_ready(page, truth):
    assert page.evaluate("window.tensormorph.ready.then(s => s.active)") == "a"
    state = page.evaluate("({ids: window.tensormorph.state.checkpoints.map(c => c.id), "
                          "formats: window.tensormorph.state.checkpoints.map(c => c.format)})")
    assert state == {"ids": ["a", "b"], "formats": ["dcp", "hf-sharded"]}
    for tab in ("tab-a", "tab-b", "tab-diff"):
        expect(page.get_by_test_id(tab)).to_be_visible()
    expect(page.locator("#config")).to_contain_text("BertModel")
    expect(page.locator("[data-config=num_hidden_layers]")).to_have_text("6")
    expect(page.get_by_test_id("checkpoint-format")).to_have_text("dcp")
    expect(page.locator("#ckinfo")).to_contain_text(f"{len(truth)} tensors")


def test_tree_folds_the_layers_and_expands(page):
    page.get_by_test_id("tab-b").click()
    page.wait_for_function("window.tensormorph.state.active === 'b'")
    folded = page.locator('[data-testid=tree-node][data-path="encoder.layer.0"]')
    expect(folded).to_contain_text("0..5")
    expect(folded).to_contain_text("×6")
    expect(page.locator('[data-testid=tree-node][data-path="encoder.layer.1"]')).to_have_count(0)
    # the folded node stands for one instance: expanding it shows that instance's modules and tensors
    attention = page.locator('[data-testid=tree-node][data-path="encoder.layer.0.attention"]')
    expect(attention).to_have_count(0)
    for module in ("embeddings", "extra"):  # room on screen for the layers (the list draws visible rows only)
        page.locator(f'[data-testid=tree-node][data-path="{module}"]').get_by_test_id("expand").click()
    folded.get_by_test_id("expand").click()
    expect(attention).to_have_count(1)
    self_node = page.locator('[data-testid=tree-node][data-path="encoder.layer.0.attention.self"]')
    expect(self_node).to_have_count(0)
    attention.get_by_test_id("expand").click()
    self_node.get_by_test_id("expand").click()
    page.locator('[data-testid=tree-node][data-path="encoder.layer.0.attention.self.query"]').get_by_test_id(
        "expand").click()
    query = page.locator('#tree-list [data-testid=tensor-row][data-name="encoder.layer.0.attention.self.query.weight"]')
    expect(query).to_have_count(1)
    # the instance picker rewrites the children to the chosen layer
    folded.get_by_test_id("instance").select_option("3")
    expect(page.locator(f'#tree-list [data-testid=tensor-row][data-name="{QUERY}"]')).to_have_count(1)
    expect(query).to_have_count(0)
    screenshot(page, "architecture.png")
    # collapsing the folded node hides everything below it; expanding shows it again
    attention = page.locator('[data-testid=tree-node][data-path="encoder.layer.3.attention"]')
    expect(attention).to_have_count(1)
    folded.get_by_test_id("expand").click()
    expect(attention).to_have_count(0)
    folded.get_by_test_id("expand").click()
    expect(attention).to_have_count(1)


def test_tree_of_the_dcp_checkpoint_folds_the_six_layers(page):
    folded = page.locator('[data-testid=tree-node][data-path="model.encoder.layer.0"]')
    expect(folded).to_contain_text("0..5")
    expect(folded).to_contain_text("×6")
    expect(page.locator('[data-testid=tree-node][data-path="model.encoder.layer.1"]')).to_have_count(0)


def test_search_by_name_shape_and_dtype(page, truth):
    names = {"query.weight": {n for n in truth if n.endswith("attention.self.query.weight")},
             "384x1536": {n for n, v in truth.items() if v.shape == (384, 1536)},
             "1536x*": {n for n, v in truth.items() if v.ndim == 2 and v.shape[0] == 1536},
             "bf16": {n for n, v in truth.items() if dtype_name(v) == "BF16"},
             "i64": {n for n, v in truth.items() if dtype_name(v) == "I64"},
             "layer.2 *x1536": {n for n, v in truth.items() if "layer.2" in n and v.ndim == 2 and v.shape[1] == 1536}}
    assert [len(v) for v in names.values()] == [6, 6, 6, 1, 2, 1]
    for query, expected in names.items():
        search(page, query)
        wait_listed(page, expected)
        expect(page.get_by_test_id("match-count")).to_contain_text(f"{len(expected)} of {len(truth)} tensors match")
    page.get_by_test_id("search").press("Escape")
    expect(page.locator("#tree-list [data-testid=tree-node]").first).to_be_visible()


def test_clicking_a_tensor_opens_the_heatmap(page, truth):
    open_tensor(page, "model.pattern")
    expect(page.get_by_test_id("inspector-name")).to_have_text("model.pattern")
    expect(page.get_by_test_id("inspector-shape")).to_have_text("64×128")
    expect(page.locator("#view-title")).to_contain_text("model.pattern")
    state = heatmap_state(page)
    assert state["viewShape"] == [64, 128] and state["step"] == [1, 1]
    expect(page.get_by_test_id("zoom-level")).to_have_text("1:1")
    assert "t=model.pattern" in page.evaluate("location.hash")
    stats = page.get_by_test_id("stats")
    expect(stats).to_have_attribute("data-state", "ready")
    expect(stats.locator("[data-stat=max]")).to_have_text("1063")
    expect(stats.locator("[data-stat=min]")).to_have_text("0")


def test_canvas_pixels_follow_the_data(page, truth):
    open_tensor(page, "model.pattern")
    width, height = canvas_size(page)
    points = [(fx * width, fy * height) for fx in (0.1, 0.3, 0.45, 0.55, 0.7, 0.9) for fy in (0.2, 0.45, 0.7, 0.95)]
    elements = []
    for x, y in points:
        data = hover(page, x, y)
        elements.append((int(data["row"]), int(data["col"])))
    page.get_by_test_id("search").hover()  # the hover outline leaves the canvas
    page.wait_for_timeout(100)
    colours = {}
    for (x, y), (r, c) in zip(points, elements):
        value = float(truth["model.pattern"][r, c])
        colours.setdefault(value == 0.0, []).append(pixel(page, int(x), int(y)))
    zeros, large = colours[True], colours[False]
    assert len(zeros) == 12 and len(large) == 12  # left half zeros, right half >= 1000
    assert len(set(zeros)) == 1, zeros  # one value, one colour
    assert not set(zeros) & set(large)

    def luminance(rgb):
        return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]

    assert luminance(zeros[0]) + 100 < min(luminance(c) for c in large)  # viridis: dark low end, bright high end


def test_zoom_to_one_to_one_and_hover_the_exact_value(page, truth):
    open_tensor(page, EMBEDDINGS)
    level = page.get_by_test_id("zoom-level")
    first = level.inner_text()
    assert re.fullmatch(r"1:\d+", first) and first != "1:1"
    for _ in range(16):
        if level.inner_text() == "1:1":
            break
        page.get_by_test_id("zoom-in").click()
    expect(level).to_have_text("1:1")
    page.wait_for_function("""() => { const h = window.tensormorph.state.heatmap;
      return h.approximate === false && h.tiles.some(t => t.exact && t.step[0] === 1 && t.step[1] === 1); }""")
    width, height = canvas_size(page)
    for fx, fy in ((0.5, 0.5), (0.25, 0.6), (0.8, 0.3)):
        data = hover(page, width * fx, height * fy)
        page.wait_for_function("document.querySelector('[data-testid=hover-value]').dataset.value !== undefined")
        data = {**data, **page.eval_on_selector("[data-testid=hover-value]", "e => ({...e.dataset})")}
        r, c = (int(i) for i in data["index"].split(","))
        assert data["exact"] == "1"
        assert float(data["value"]) == float(truth[EMBEDDINGS][r, c]), (r, c, data)
        assert f"[{r}, {c}] =" in page.get_by_test_id("hover-value").inner_text()
    screenshot(page, "heatmap.png")


def test_approximate_badge_until_the_exact_tile_lands(page, truth):
    held = []
    pattern = re.compile(r"/api/checkpoints/a/tile\?")

    def hold_exact(route):
        if "exact=1" in route.request.url:
            held.append(route)
        else:
            route.continue_()

    page.route(pattern, hold_exact)
    search(page, EMBEDDINGS)
    wait_listed(page, {EMBEDDINGS})
    page.locator(f'#tree-list [data-testid=tensor-row][data-name="{EMBEDDINGS}"]').click()
    badge = page.get_by_test_id("approximate-badge")
    expect(badge).to_be_visible()
    assert heatmap_state(page)["approximate"] is True
    width, height = canvas_size(page)
    data = hover(page, width / 2, height / 2)
    assert "≈" in data["text"] and data["exact"] == "0"
    assert held, "the exact tile was never requested"
    page.unroute(pattern)
    for route in held:
        try:
            route.continue_()
        except PlaywrightError as exc:  # the page aborted this request itself (a newer one replaced it)
            if "already handled" not in str(exc):
                raise
    expect(badge).to_be_hidden()
    page.wait_for_function(EXACT_TILE)
    hover(page, width / 2 + 1, height / 2 + 1)
    readout = page.get_by_test_id("hover-value")
    expect(readout).to_have_attribute("data-exact", "1")
    expect(readout).to_contain_text("max")  # a block's exact aggregates, not a sample


def test_rank_selector_shows_that_ranks_chunk(page, truth):
    open_tensor(page, "model.pattern")
    select = page.get_by_test_id("rank-select")
    options = select.locator("option").evaluate_all("os => os.map(o => o.value)")
    assert options == ["", "0", "1", "2", "3"]
    select.select_option("2")
    page.wait_for_function("window.tensormorph.state.rank === 2")
    page.wait_for_function("""() => { const h = window.tensormorph.state.heatmap;
      return h.viewShape[0] === 16 && h.viewShape[1] === 128 && h.approximate === false; }""")
    assert "rank=2" in page.evaluate("location.hash")
    expect(page.locator("#view-title")).to_contain_text("local(2)")
    expect(page.locator("[data-testid=chunks] tr.mine")).to_have_attribute("data-chunk", "2")
    width, height = canvas_size(page)
    for fx, fy in ((0.1, 0.1), (0.6, 0.5), (0.95, 0.9)):
        data = hover(page, width * fx, height * fy)
        page.wait_for_function("document.querySelector('[data-testid=hover-value]').dataset.value !== undefined")
        data = page.eval_on_selector("[data-testid=hover-value]", "e => ({...e.dataset})")
        r, c = int(data["row"]), int(data["col"])
        assert float(data["value"]) == float(truth["model.pattern"][32 + r, c]), (r, c, data)
    stats = page.get_by_test_id("stats")
    expect(stats).to_have_attribute("data-state", "ready")
    expect(stats.locator("[data-stat=max]")).to_have_text(str(1000 + 47))
    screenshot(page, "inspector.png")
    select.select_option("")
    page.wait_for_function("""() => { const s = window.tensormorph.state; const h = s.heatmap;
      return s.rank === null && h.viewShape[0] === 64 && h.approximate === false; }""")


def test_diff_tab_lists_the_perturbed_tensor(page, truth, fixture_builders):
    page.get_by_test_id("tab-diff").click()
    row = page.locator("[data-testid=diff-row][data-status=different]")
    expect(row).to_have_count(1)
    expect(row).to_have_attribute("data-name", QUERY)
    expect(page.get_by_test_id("diff-chip-different")).to_contain_text("1")
    expect(page.get_by_test_id("diff-chip-equal")).to_contain_text(str(len(truth) - 1))
    row.click()
    page.wait_for_function("(n) => { const s = window.tensormorph.state; return s.diffSelection && "
                           "s.diffSelection.name === n; }", arg=QUERY)
    page.wait_for_function(EXACT_TILE)
    expect(page.get_by_test_id("diff-figures").locator("[data-stat=mismatches]")).to_contain_text("1")
    page.get_by_test_id("goto-worst").click()
    page.wait_for_function("""() => { const h = window.tensormorph.state.heatmap;
      return h.step[0] === 1 && h.step[1] === 1 && h.approximate === false; }""")
    state = heatmap_state(page)
    r, c = 7, 11
    x, y = (c + 0.5 - state["x0"]) * state["zoom"], (r + 0.5 - state["y0"]) * state["zoom"]
    hover(page, x, y)
    page.wait_for_function("document.querySelector('[data-testid=hover-value]').dataset.value !== undefined")
    data = page.eval_on_selector("[data-testid=hover-value]", "e => ({...e.dataset})")
    assert data["index"] == "7,11"
    a = float(truth["model." + QUERY][7, 11])
    _, index, delta = fixture_builders.VIEWER_ALTERED
    b = float(truth["model." + QUERY][index] + np.float32(delta))
    assert float(data["value"]) == float(np.float32(a - b)) and float(data["value"]) == pytest.approx(-0.25, abs=1e-6)
    screenshot(page, "diff.png")
    assert page.evaluate("location.hash").startswith("#ck=diff&t=" + QUERY)
