"""The viewer's view state (issue 20): one colour scale for the approximate and the exact tile, the view in the
URL (deep links, Back/Forward through what the user opened), pinning with rulers, and "copy as show".

A one-file safetensors checkpoint made here (blocks of constant values, three small layers, a 3-D tensor) is
served by a real uvicorn server; the DCP pair of test_browser.py gives chunks, ranks and files to pin.
Screenshots go to build/screenshots/.
"""

from __future__ import annotations

import contextlib
import re
import shlex

import numpy as np
import pytest
from browser_support import write_safetensors
from click.testing import CliRunner
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import expect
from test_browser import (
    EMBEDDINGS,
    EXACT_TILE,
    READY,
    TIMEOUT,
    base_url,
    heatmap_state,
    open_tensor,
    page,
    screenshot,
    search,
    truth,
    wait_listed,
)

from tensormorph.cli import main
from tensormorph.server import create_app

__all__ = ["base_url", "page", "truth"]  # fixtures, imported for pytest

pytestmark = pytest.mark.timeout(120)

BLOCK = 64  # "blocks" is constant on BLOCK × BLOCK squares
LAYERS = [f"layers.{i}.weight" for i in range(3)]


def cube() -> np.ndarray:
    return np.random.default_rng(20).standard_normal((4, 48, 64)).astype(np.float32)


def blocks() -> np.ndarray:
    i, j = np.meshgrid(np.arange(512) // BLOCK, np.arange(1024) // BLOCK, indexing="ij")
    return (((i * 16 + j) % 11 - 5) * 0.37).astype(np.float32)  # 11 values, both signs and zero


@pytest.fixture(scope="module")
def view_url(serve, tmp_path_factory) -> str:
    noise = np.random.default_rng(7).standard_normal((512, 1024)).astype(np.float32)  # a sample is not a mean
    tensors = {"blocks": blocks(), "cube": cube(), "noise": noise}
    for k, name in enumerate(LAYERS):
        tensors[name] = (np.arange(48 * 64, dtype=np.float32).reshape(48, 64) * (k + 1)) % 97
    folder = write_safetensors(tmp_path_factory.mktemp("view") / "ck", tensors)
    return serve(create_app([folder], cache_dir=tmp_path_factory.mktemp("view-tiles")))


def open_page(browser, url: str, width: int = 1440, height: int = 900):
    context = browser.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    page.wait_for_function(READY)
    return page, errors


@pytest.fixture
def vpage(browser, view_url):
    page, errors = open_page(browser, view_url + "/")
    yield page
    body_error = page.evaluate("document.body.dataset.error || null")
    page.context.close()
    assert not errors and body_error is None, (errors, body_error)


def select(page, name: str, **options) -> None:
    page.evaluate("([n, o]) => window.tensormorph.select(n, o)", [name, options])
    page.wait_for_function("(n) => { const s = window.tensormorph.state; return s.record && s.record.name === n; }",
                           arg=name)


# The colours of the canvas at view elements [[r, c], ...], `at` of the way into each (0.5: the centre); zoomed
# out, into the block of step[0] × step[1] elements that holds it (one pixel or so).
COLOURS_AT = """([cells, at]) => { const h = window.tensormorph.state.heatmap;
  const c = document.getElementById('heatmap'); const ctx = c.getContext('2d'); const [sy, sx] = h.step;
  return cells.map(([r, col]) => { const x = Math.floor(((Math.floor(col / sx) + at) * sx - h.x0) * h.scale[1]);
    const y = Math.floor(((Math.floor(r / sy) + at) * sy - h.y0) * h.scale[0]);
    if (x < 0 || y < 0 || x >= c.width || y >= c.height) return null;
    return Array.from(ctx.getImageData(x, y, 1, 1).data.slice(0, 3)).join(','); }); }"""


def colours_at(page, cells: list[tuple[int, int]], at: float = 0.5) -> list[str | None]:
    return page.evaluate(COLOURS_AT, [[list(c) for c in cells], at])


def visible_cells(page) -> list[tuple[int, int]]:
    v = heatmap_state(page)["visible"]
    return [(r, c) for r in range(v["r0"], v["r1"]) for c in range(v["c0"], v["c1"])]


def set_display(page, cmap: str, agg: str, norm: str | None = None) -> None:
    page.get_by_test_id("colormap").select_option(cmap)
    page.get_by_test_id("aggregation").select_option(agg)
    if norm:
        page.get_by_test_id("normalisation").select_option(norm)


SETTINGS = [("diverging", "auto"), ("viridis", "auto"), ("viridis", "mean"), ("viridis", "min"), ("magma", "max")]


def test_colours_identical_before_and_after_the_exact_tile(vpage):
    page = vpage
    held = []
    tiles = re.compile(r"/api/checkpoints/a/tile\?")
    page.route(tiles, lambda route: held.append(route) if "exact=1" in route.request.url else route.continue_())
    select(page, "blocks")
    page.wait_for_function("() => { const h = window.tensormorph.state.heatmap; return h.approximate === true; }")
    state = heatmap_state(page)
    assert state["step"] != [1, 1]  # the approximate tile is a sample, not every element
    centres = [(BLOCK * bi + BLOCK // 2, BLOCK * bj + BLOCK // 2) for bi in range(8) for bj in range(16)]
    truth = blocks()
    before = {}
    for cmap, agg in SETTINGS:
        set_display(page, cmap, agg)
        before[cmap, agg] = (colours_at(page, centres), page.locator(".legend").inner_text())
    expect(page.get_by_test_id("aggregation").locator("option").first).to_have_text("auto: abs-max")
    screenshot(page, "colours-approximate.png")
    assert held, "the exact tile was never asked for"
    page.unroute(tiles)
    for route in held:
        with contextlib.suppress(PlaywrightError):  # the page dropped it itself (a newer request replaced it)
            route.continue_()
    page.wait_for_function(EXACT_TILE)
    for cmap, agg in SETTINGS:
        set_display(page, cmap, agg)
        after = (colours_at(page, centres), page.locator(".legend").inner_text())
        assert after == before[cmap, agg], (cmap, agg)
        # one value, one colour; every value its own colour
        by_value = {}
        for (r, c), colour in zip(centres, after[0]):
            value = abs(truth[r, c]) if (agg == "auto" and cmap != "diverging") else truth[r, c]
            by_value.setdefault(float(value), set()).add(colour)
        assert all(len(v) == 1 for v in by_value.values()), (cmap, agg, by_value)
        assert len({next(iter(v)) for v in by_value.values()}) == len(by_value), (cmap, agg)
    set_display(page, "diverging", "auto")
    expect(page.get_by_test_id("aggregation").locator("option").first).to_have_text("auto: mean")
    screenshot(page, "colours-exact.png")


def legend(page) -> tuple[float, float]:
    return float(page.locator("#legend-lo").inner_text()), float(page.locator("#legend-hi").inner_text())


def test_scale_locks_to_the_tensor_range(vpage):
    page = vpage
    select(page, "cube")  # the view is cube[0]; the tensor's range is wider
    page.wait_for_function(EXACT_TILE)
    values = cube()
    lock = page.get_by_test_id("lock-scale")
    expect(lock).to_be_enabled()  # the statistics arrived
    set_display(page, "viridis", "mean")
    assert legend(page) == pytest.approx((values[0].min(), values[0].max()), rel=1e-3)
    lock.check()
    assert legend(page) == pytest.approx((values.min(), values.max()), rel=1e-3)
    assert (values.min(), values.max()) != pytest.approx((values[0].min(), values[0].max()), rel=1e-2)
    assert "lock=1" in page.evaluate("new Promise(r => setTimeout(() => r(location.hash), 400))")
    lock.uncheck()
    assert legend(page) == pytest.approx((values[0].min(), values[0].max()), rel=1e-3)


def test_deep_link_restores_zoom_pan_and_colours(browser, view_url, vpage):
    page = vpage
    select(page, "cube")
    page.wait_for_function(EXACT_TILE)
    page.get_by_test_id("fixed-0").fill("2")
    page.get_by_test_id("fixed-0").press("Enter")
    for _ in range(3):
        page.get_by_test_id("zoom-in").click()
    page.get_by_test_id("heatmap").focus()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowDown")
    set_display(page, "magma", "max", "symmetric")
    box = page.get_by_test_id("heatmap").bounding_box()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)  # pin the centre
    expect(page.get_by_test_id("pin-card")).to_be_visible()
    page.wait_for_function(EXACT_TILE)
    page.wait_for_function("() => /zoom=.*at=.*pin=/.test(location.hash)")
    page.get_by_test_id("copy-link").click()
    link = page.get_by_test_id("toast").get_attribute("data-copied")
    assert link == page.url and "cmap=magma" in link and "agg=max" in link and "fixed=2" in link, link
    first = heatmap_state(page)
    assert not first["atFit"] and first["fixed"] == [2]
    cells = visible_cells(page)
    assert 30 < len(cells) < 400  # zoomed in, and not by one element only
    # a corner of each element: away from the value written in it, the grid and the hover frame
    colours = colours_at(page, cells, 0.2)
    assert len({c for c in colours if c}) > 20
    page2, errors = open_page(browser, link)
    try:
        page2.wait_for_function(EXACT_TILE)
        expect(page2.get_by_test_id("pin-card")).to_be_visible()
        second = heatmap_state(page2)
        assert second["settings"] == first["settings"]
        assert (second["axes"], second["fixed"], second["pin"]) == (first["axes"], first["fixed"], first["pin"])
        assert second["zoom"] == pytest.approx(first["zoom"], rel=1e-3)
        assert (second["x0"], second["y0"]) == pytest.approx((first["x0"], first["y0"]), abs=0.02)
        assert visible_cells(page2) == cells
        assert colours_at(page2, cells, 0.2) == colours
        assert page2.locator(".legend").inner_text() == page.locator(".legend").inner_text()
        expect(page2.get_by_test_id("colormap")).to_have_value("magma")
        screenshot(page2, "deep-link.png")
    finally:
        page2.context.close()
    assert not errors


def open_by_click(page, name: str) -> None:
    search(page, name)
    wait_listed(page, {name})
    page.locator(f'#tree-list [data-testid=tensor-row][data-name="{name}"]').click()
    page.wait_for_function("(n) => { const s = window.tensormorph.state; return s.record && s.record.name === n; }",
                           arg=name)
    page.wait_for_function(EXACT_TILE)


def shown(page, name: str, *, fit: bool) -> dict:
    page.wait_for_function("""([n, fit]) => { const s = window.tensormorph.state; const h = s.heatmap;
      return s.record && s.record.name === n && h.atFit === fit && h.approximate === false; }""", arg=[name, fit])
    return heatmap_state(page)


def test_back_and_forward_step_through_three_tensors(vpage):
    page = vpage
    open_by_click(page, LAYERS[0])
    open_by_click(page, LAYERS[1])
    page.get_by_test_id("zoom-in").click()
    page.get_by_test_id("zoom-in").click()
    page.wait_for_function("() => location.hash.includes('zoom=')")
    zoomed = heatmap_state(page)
    open_by_click(page, LAYERS[2])
    assert page.evaluate("history.length") >= 4  # the start, then one entry per tensor opened
    page.go_back()
    again = shown(page, LAYERS[1], fit=False)
    assert again["zoom"] == pytest.approx(zoomed["zoom"], rel=1e-3)
    assert (again["x0"], again["y0"]) == pytest.approx((zoomed["x0"], zoomed["y0"]), abs=0.02)
    page.go_back()
    shown(page, LAYERS[0], fit=True)
    expect(page.get_by_test_id("inspector-name")).to_have_text(LAYERS[0])
    page.go_forward()
    shown(page, LAYERS[1], fit=False)
    page.go_forward()
    shown(page, LAYERS[2], fit=True)
    expect(page.locator("#view-title")).to_contain_text(LAYERS[2])
    screenshot(page, "history.png")


def test_pin_shows_index_value_chunk_rank_and_file(page, truth, viewer_pair):
    open_tensor(page, EMBEDDINGS)
    state = heatmap_state(page)
    assert state["step"][0] > 1  # zoomed out: the pinned value is still the element's own
    ticks = [int(t) for t in page.get_by_test_id("ruler-left").get_attribute("data-ticks").split(",")]
    assert ticks[0] == 0 and len(ticks) > 3 and len({b - a for a, b in zip(ticks, ticks[1:])}) == 1
    assert str(ticks[1])[0] in "125" and set(str(ticks[1])[1:]) <= {"0"}  # 1, 2 or 5 × 10^k
    cols = [int(t) for t in page.get_by_test_id("ruler-top").get_attribute("data-ticks").split(",")]
    assert cols[0] == 0 and cols[-1] < 384
    box = page.get_by_test_id("heatmap").bounding_box()
    x, y = box["width"] * 0.37, box["height"] * 0.61
    page.mouse.click(box["x"] + x, box["y"] + y)
    card = page.get_by_test_id("pin-card")
    expect(card).to_have_attribute("data-value", re.compile(r"."))
    r, c = (int(v) for v in card.get_attribute("data-index").split(","))
    assert abs(r - (state["y0"] + y / state["scale"][0])) <= 1 and abs(c - (state["x0"] + x / state["scale"][1])) <= 1
    assert float(card.get_attribute("data-value")) == float(truth[EMBEDDINGS][r, c])
    chunks = page.evaluate("window.tensormorph.state.record.chunks")
    (i, chunk), = [(i, ch) for i, ch in enumerate(chunks)
                   if all(o <= v < o + n for o, n, v in zip(ch["offsets"], ch["shape"], (r, c)))]
    expect(page.get_by_test_id("pin-chunk")).to_contain_text(f"#{i} ")
    expect(page.get_by_test_id("pin-rank")).to_have_text(", ".join(map(str, chunk["ranks"])))
    expect(page.get_by_test_id("pin-file")).to_have_text(chunk["file"])
    page.wait_for_function("(pin) => location.hash.includes(pin)", arg=f"pin={r},{c}")
    screenshot(page, "pinned.png")
    # "copy show" of the pinned element: the command prints the same value
    page.get_by_test_id("pin-copy").click()
    command = page.get_by_test_id("toast").get_attribute("data-copied")
    assert command == f"tensormorph show {viewer_pair[0]} {EMBEDDINGS} --slice '{r}, {c}'"
    result = CliRunner().invoke(main, shlex.split(command)[1:])
    assert result.exit_code == 0 and float(result.output.split()[-1]) == pytest.approx(float(truth[EMBEDDINGS][r, c]))
    page.keyboard.press("Escape")
    expect(card).to_be_hidden()
    page.wait_for_function("() => !location.hash.includes('pin=')")
    # without a pin: the visible region
    page.get_by_test_id("copy-show").click()
    expect(page.get_by_test_id("toast")).to_have_attribute(
        "data-copied", f"tensormorph show {viewer_pair[0]} {EMBEDDINGS} --slice '0:30522, 0:384'")


def test_hovered_chunk_does_not_tint_values(page, truth):
    open_tensor(page, "model.pattern")  # left half zeros; four chunks of 16 rows (Shard(0) on 4 ranks)
    state = heatmap_state(page)
    assert truth["model.pattern"][20, 5] == truth["model.pattern"][40, 5] == 0
    box = page.get_by_test_id("heatmap").bounding_box()
    sy, sx = state["scale"]
    page.mouse.move(box["x"] + (20.5 - state["x0"]) * sx, box["y"] + (20.5 - state["y0"]) * sy)
    expect(page.locator("[data-testid=chunks] tr.hot")).to_have_attribute("data-chunk", "1")
    inside, outside = colours_at(page, [(20, 5), (40, 5)])
    assert inside == outside


def test_route_and_show_command_round_trip(vpage, tmp_path):
    """route.js's pure functions in the page: a route survives the URL; a show command survives the shell."""
    route = {"ck": "a", "t": "odd name, with 'quotes' & #hash", "rank": 3, "kind": None,
             "view": {"axes": [0, 2], "fixed": [5], "zoom": 0.0123456, "at": [12.3456789, 4000.5], "pin": [5, 6, 7]},
             "settings": {"cmap": "diverging", "norm": "clip", "agg": "mean", "clip": 2.5, "lock": True}}
    back = vpage.evaluate("""async (route) => { const m = await import('./route.js');
      const hash = m.formatRoute(route); return [hash, m.parseRoute(hash)]; }""", route)
    hash, parsed = back
    assert "," in hash and "%2C" not in hash  # readable
    assert parsed["t"] == route["t"] and parsed["rank"] == 3 and parsed["settings"] == route["settings"]
    view = parsed["view"]
    assert (view["axes"], view["fixed"], view["pin"]) == ([0, 2], [5], [5, 6, 7])
    assert view["zoom"] == pytest.approx(0.0123456, rel=1e-3)
    # the centre to a thousandth of a pixel at the link's zoom
    assert view["at"] == pytest.approx([12.3456789, 4000.5], abs=1e-3 / view["zoom"])
    path = str(tmp_path / "my checkpoints" / "it's here")
    command = vpage.evaluate("""async ([path, name]) => (await import('./route.js')).showCommand(path, name,
      [[0, 4], 7, [100, 108]], 2)""", [path, route["t"]])
    assert shlex.split(command) == ["tensormorph", "show", path, route["t"], "--slice", "0:4, 7, 100:108",
                                    "--rank", "2"]


def test_chunk_rows_open_their_chunk(page):
    open_tensor(page, EMBEDDINGS)  # 30522 × 384 in four chunks of rows (Shard(0) on 4 ranks)
    chunk = page.evaluate("window.tensormorph.state.record.chunks[2]")
    r0, r1 = chunk["offsets"][0], chunk["offsets"][0] + chunk["shape"][0]
    page.locator('[data-testid=chunks] tr[data-chunk="2"]').click()  # the chunk, whole, fills the view
    page.wait_for_function("([r0, r1]) => { const v = window.tensormorph.state.heatmap.visible; "
                           "return v && Math.abs(v.r0 - r0) <= 2 && Math.abs(v.r1 - r1) <= 2; }", arg=[r0, r1])
    assert (heatmap_state(page)["visible"]["c0"], heatmap_state(page)["visible"]["c1"]) == (0, 384)
    page.get_by_test_id("rank-select").select_option("1")  # in a local view, a row opens that rank's view
    page.wait_for_function("window.tensormorph.state.rank === 1")
    page.locator('[data-testid=chunks] tr[data-chunk="3"]').press("Enter")
    page.wait_for_function("window.tensormorph.state.rank === 3")


def test_the_exact_tile_keeps_the_scale_of_the_view(vpage):
    """On values that vary inside every block (a sample and a block mean differ), the legend the approximate tile
    set stays when the exact tile of the same view arrives: one colour scale for both."""
    page = vpage
    held = []
    tiles = re.compile(r"/api/checkpoints/a/tile\?")
    page.route(tiles, lambda route: held.append(route) if "exact=1" in route.request.url else route.continue_())
    select(page, "noise")
    page.wait_for_function("() => window.tensormorph.state.heatmap.approximate === true")
    set_display(page, "diverging", "mean")
    before = page.locator(".legend").inner_text()
    page.unroute(tiles)
    for route in held:
        with contextlib.suppress(PlaywrightError):
            route.continue_()
    page.wait_for_function(EXACT_TILE)
    assert page.locator(".legend").inner_text() == before
