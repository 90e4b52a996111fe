"""The notebook heatmap widget (tm.widget, issue 21): the kernel answers the page's tile requests with the library's
tiles byte for byte, and their values are the saved array's; bad requests get error answers, never exceptions; the
widget's traits follow the tensor; and the page (web/widget.js bundled with the viewer's modules) draws in real
chromium the colours of the tiles the kernel sent, with a hostile name shown as text."""

from __future__ import annotations

import base64
import json
import struct
import sys

import numpy as np
import pytest
import traitlets
from safetensors.numpy import save_file

import tensormorph as tm
from tensormorph import colormaps, widget
from tensormorph.errors import CheckpointError, MissingDependencyError
from tensormorph.ops.search import nonfinite
from tensormorph.ops.tiles import View, tile
from tensormorph.widget import MAX_TILE_PIXELS, TileServer, widget_module

pytestmark = pytest.mark.timeout(120)

HOSTILE = '<img src=x onerror="window.pwned=1">'
ROWS, COLS = 900, 1200  # drawn at fit on a 600 × 400 canvas: 3 × 3 blocks, so a sample first, then the exact tile


@pytest.fixture(scope="module")
def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(21)
    w = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    w[10, 21] = np.nan  # not on the sampling grid of a 10 × 10 block tile: only the scan can flag it
    w[203, 401] = np.inf
    return {"w": w, "cube": rng.standard_normal((4, 6, 5)).astype(np.float32), HOSTILE: w}


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory, arrays: dict[str, np.ndarray]):
    out = tmp_path_factory.mktemp("widget") / "model.safetensors"
    save_file(arrays, str(out))
    return out


@pytest.fixture()
def ck(path):
    with tm.open(path) as opened:
        yield opened


def _request(r0: int, r1: int, c0: int, c1: int, h: int, w: int, *, exact: bool, id: int = 7) -> dict:
    return {"type": "tile", "id": id, "r0": r0, "r1": r1, "c0": c0, "c1": c1, "h": h, "w": w, "exact": exact}


def _decode(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """The tile encoding (docs/viewer-api.md), read here independently of the library: header, then fields."""
    (n,) = struct.unpack_from("<I", data)
    header = json.loads(data[4:4 + n])
    rows, cols = header["shape"]
    fields, offset = {}, 4 + n
    for name in header["fields"]:
        fields[name] = np.frombuffer(data, "<f4", rows * cols, offset).reshape(rows, cols)
        offset += rows * cols * 4
    assert offset == len(data)
    return header, fields


def test_answers_are_the_library_tiles_and_the_saved_values(ck, arrays):
    server = TileServer(ck["w"])
    w = arrays["w"].astype(np.float64)
    content, buffers = server.answer(_request(0, ROWS, 0, COLS, 90, 120, exact=True))
    assert content == {"type": "tile", "id": 7, "limited": False}
    assert buffers == [tile(View.of(ck["w"]), 0, ROWS, 0, COLS, 90, 120, exact=True).encode()]
    header, fields = _decode(buffers[0])
    assert header["step"] == [10, 10] and header["shape"] == [90, 120] and not header["approximate"]
    blocks = w.reshape(90, 10, 120, 10).transpose(0, 2, 1, 3).reshape(90, 120, 100)
    np.testing.assert_array_equal(fields["min"], np.fmin.reduce(blocks, axis=2).astype(np.float32))
    np.testing.assert_array_equal(fields["max"], np.fmax.reduce(blocks, axis=2).astype(np.float32))
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(fields["mean"], np.nanmean(blocks, axis=2), rtol=1e-6)
    assert fields["nonfinite"][1, 2] == colormaps.FLAG_NAN and fields["nonfinite"][20, 40] != 0
    assert np.count_nonzero(fields["nonfinite"]) == 2

    content, buffers = server.answer(_request(0, ROWS, 0, COLS, 90, 120, exact=False, id=8))
    assert content == {"type": "tile", "id": 8, "limited": False}
    expected = tile(View.of(ck["w"]), 0, ROWS, 0, COLS, 90, 120, nonfinite=nonfinite(ck["w"])).encode()
    assert buffers == [expected]
    header, fields = _decode(buffers[0])
    assert header["approximate"] and header["nonfinite_complete"]
    np.testing.assert_array_equal(fields["value"], arrays["w"][::10, ::10])
    assert np.isfinite(fields["value"][1, 2]) and fields["nonfinite"][1, 2] == colormaps.FLAG_NAN  # flagged by the scan


def test_an_exact_tile_past_the_bound_is_the_sample(ck, arrays, monkeypatch):
    monkeypatch.setattr(widget, "EXACT_READ_BYTES", 100 * 100 * 4)
    server = TileServer(ck["w"])
    content, buffers = server.answer(_request(0, 100, 0, 101, 10, 10, exact=True))
    assert content["limited"] is True
    header, fields = _decode(buffers[0])
    assert header["approximate"]
    np.testing.assert_array_equal(fields["value"], arrays["w"][0:100:10, 0:101:11])
    content, buffers = server.answer(_request(0, 100, 0, 100, 10, 10, exact=True))  # at the bound: exact
    assert content["limited"] is False and "mean" in _decode(buffers[0])[1]


def test_a_sample_spread_thin_comes_coarser(ck, arrays, monkeypatch):
    """A sample whose elements sit a row (4800 bytes) apart touches a page or more per element: past SAMPLE_READ_BYTES
    the answer has fewer pixels (a coarser step), and it is the library's tile at that size."""
    monkeypatch.setattr(widget, "SAMPLE_READ_BYTES", 64 * 4096)
    server = TileServer(ck["w"])
    _, buffers = server.answer(_request(0, ROWS, 0, COLS, 450, 1, exact=False))  # 450 × 4800 bytes asked
    header, fields = _decode(buffers[0])
    assert (header["shape"], header["step"]) == ([29, 1], [32, 1200])  # halved 4 times: 29 × 4800 <= 64 pages
    assert buffers == [tile(View.of(ck["w"]), 0, ROWS, 0, COLS, 29, 1, nonfinite=nonfinite(ck["w"])).encode()]
    np.testing.assert_array_equal(fields["value"], arrays["w"][::32, ::1200])
    _, buffers = server.answer(_request(0, ROWS, 0, COLS, 450, 1, exact=True))  # exact: the bound is another one
    assert _decode(buffers[0])[0]["shape"] == [450, 1]


def test_a_view_of_two_axes_at_a_fixed_index(ck, arrays):
    server = TileServer(ck["cube"], axes=(2, 0), fixed=(3,))
    _, buffers = server.answer(_request(0, 5, 0, 4, 5, 4, exact=True))
    header, fields = _decode(buffers[0])
    assert header["view_shape"] == [5, 4]
    np.testing.assert_array_equal(fields["value"], arrays["cube"][:, 3, :].T)


@pytest.mark.parametrize("message, expected", [
    (None, "tile requests only, not 'NoneType'"),
    ({"type": "ping", "id": 3}, "tile requests only, not 'ping'"),
    ({"type": "tile", "id": 3, "r0": 0}, "needs integers r0, r1, c0, c1, h, w"),
    ({**_request(0, 10, 0, 10, 1, 1, exact=False, id=3), "h": 1.5}, "needs integers"),
    ({**_request(0, 10, 0, 10, 1, 1, exact=False, id=3), "w": True}, "needs integers"),
    (_request(0, ROWS + 1, 0, 10, 1, 1, exact=False, id=3), f"outside the {ROWS} × {COLS} view"),
    (_request(5, 5, 0, 10, 1, 1, exact=True, id=3), "is empty or outside"),
    (_request(-1, 10, 0, 10, 1, 1, exact=True, id=3), "is empty or outside"),
    (_request(0, 10, 0, 10, 0, 10, exact=False, id=3), "outside the widget's [1, "),
    (_request(0, ROWS, 0, COLS, 2049, 2049, exact=False, id=3), f"[1, {MAX_TILE_PIXELS}] pixels"),
])
def test_bad_requests_are_answered_with_errors(ck, message, expected):
    content, buffers = TileServer(ck["w"]).answer(message)
    assert buffers == []
    assert content["type"] == "error" and content["id"] == (3 if message else None)
    assert content["error"].startswith("tensor 'w': ") and expected in content["error"], content["error"]


def test_a_failed_read_is_an_error_answer(ck, monkeypatch):
    server = TileServer(ck["w"])

    def fail(self: View, rows: slice, cols: slice) -> np.ndarray:
        raise OSError(5, "Input/output error", "model.safetensors")

    monkeypatch.setattr(View, "read", fail)
    content, _ = server.answer(_request(0, 10, 0, 10, 5, 5, exact=True, id=1))
    assert content == {"type": "error", "id": 1,
                       "error": "model.safetensors: tensor 'w': cannot read: Input/output error"}


def test_widget_traits_follow_the_tensor(path, ck):
    view = tm.widget(path, "w", cmap="diverging")
    try:
        assert (view.name, view.shape, view.view_shape, view.dtype, view.axes, view.fixed) == (
            "w", [ROWS, COLS], [ROWS, COLS], "F32", [0, 1], [])
        assert (view.cmap, view.norm, view.agg, view.value_range) == ("diverging", "symmetric", "auto", None)
        sent = []
        view.send = lambda content, buffers=None: sent.append((content, buffers))
        view._on_message(view, _request(0, 90, 0, 120, 9, 12, exact=True, id=4), [])
        assert sent[-1][0] == {"type": "tile", "id": 4, "limited": False}
        assert sent[-1][1] == [tile(View.of(ck["w"]), 0, 90, 0, 120, 9, 12, exact=True).encode()]
        view._on_message(view, {"type": "tile", "id": 5}, [])
        assert sent[-1][0]["type"] == "error" and view.error == sent[-1][0]["error"]

        view.name = "cube"  # another tensor of the same checkpoint: its last two axes, the first fixed at 0
        assert (view.shape, view.view_shape, view.axes, view.fixed, view.error) == ([4, 6, 5], [6, 5], [1, 2], [0], "")
        assert view.title == "cube F32 4×6×5 (axis 0 = 0, rows, columns)"
        with pytest.raises(traitlets.TraitError, match="no tensor 'nope'"):
            view.name = "nope"
        assert view.name == "cube"
        with pytest.raises(traitlets.TraitError, match="no colour map 'jet'"):
            view.cmap = "jet"
        with pytest.raises(traitlets.TraitError, match="no normalisation"):
            view.norm = "sqrt"
        with pytest.raises(traitlets.TraitError, match="finite numbers lo <= hi"):
            view.value_range = [1.0, -1.0]
        view.value_range = [-2.0, 2.0]
        assert view.value_range == [-2.0, 2.0]
    finally:
        view.close()

    one = tm.widget(ck["cube"], axes=(0, 2), fixed=(1,))
    assert (one.view_shape, one.fixed) == ([4, 5], [1])
    with pytest.raises(traitlets.TraitError, match="shows the one tensor 'cube'"):
        one.name = "w"
    one.close()
    with pytest.raises(CheckpointError, match="not a tensor and a name"):
        tm.widget(ck["w"], "w")
    with pytest.raises(CheckpointError, match="no colour map 'jet'"):
        tm.widget(ck["w"], cmap="jet")
    with pytest.raises(CheckpointError, match="name the tensor"):
        tm.widget(path)


def test_without_anywidget_one_line_names_the_extra(ck, monkeypatch):
    monkeypatch.setitem(sys.modules, "anywidget", None)
    widget._widget_class.cache_clear()
    try:
        with pytest.raises(MissingDependencyError, match=r"tm.widget needs the 'notebook' extra .*"
                                                         r"pip install 'tensormorph\[notebook\]'"):
            tm.widget(ck["w"])
    finally:
        widget._widget_class.cache_clear()


def test_the_bundle_inlines_the_viewer_modules_once():
    bundle = widget_module()
    assert [line for line in bundle.splitlines() if line.startswith(("import ", "export "))] == [
        "export default { render };"]
    for module in ("api", "camera", "colormaps", "format", "pointer", "render", "tiles"):
        assert bundle.count(f"const _module_{module} = ") == 1, module
    assert bundle.rstrip().endswith("export default { render };")


# ---------------------------------------------------------------- the page, in chromium

HARNESS = """async ([bundle, traits]) => {
  const url = URL.createObjectURL(new Blob([bundle], { type: 'text/javascript' }));
  const module = await import(url);
  const handlers = {};
  const state = { ...traits };
  const model = {
    sent: [],
    get: (key) => state[key],
    set: (key, value) => { state[key] = value; (handlers['change:' + key] || []).forEach((f) => f()); },
    save_changes: () => {},
    on: (events, f) => events.split(' ').forEach((e) => (handlers[e] = handlers[e] || []).push(f)),
    off: () => {},
    send: (msg) => model.sent.push(msg),
    deliver: (msg, b64) => {
      const bytes = b64 ? Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)) : null;
      (handlers['msg:custom'] || []).forEach((f) => f(msg, bytes ? [new DataView(bytes.buffer)] : []));
    },
  };
  window.model = model;
  const host = document.getElementById('host');
  module.default.render({ model, el: host });
}"""


def _serve(page, view) -> list[dict]:
    """Carry the page's messages to the widget's own handler and its answers back, until the page asks no more;
    the page's requests, in order."""
    asked, answers = [], []
    view.send = lambda content, buffers=None: answers.append((content, buffers))
    for _ in range(20):
        page.wait_for_timeout(150)  # the page waits FETCH_DELAY_MS for the view to settle
        batch = page.evaluate("() => window.model.sent.splice(0)")
        if not batch:
            return asked
        for message in batch:
            asked.append(message)
            view._on_message(view, message, [])
            content, buffers = answers.pop()
            page.evaluate("([m, b]) => window.model.deliver(m, b)",
                          [content, base64.b64encode(buffers[0]).decode() if buffers else None])
    raise AssertionError(f"the page kept asking: {asked[-3:]}")


def _traits(view) -> dict:
    return {key: getattr(view, key) for key in ("name", "shape", "dtype", "view_shape", "axes", "fixed", "title",
                                                "cmap", "norm", "agg", "value_range", "height", "error")}


PIXEL = "([x, y]) => Array.from(document.querySelector('.tm-canvas').getContext('2d').getImageData(x, y, 1, 1).data" \
        ".slice(0, 3))"


def test_the_page_draws_the_kernel_tiles_in_their_colours(browser, path, ck, arrays):
    """The widget in chromium, its messages carried to the kernel side's handler: a sample, then the exact tile;
    a pixel is the viewer's colour of its exact block abs-max on the scale fitted to the first tile; the hostile
    name is text, and so is an error."""
    view = tm.widget(path, HOSTILE, height=300)
    page = browser.new_page(viewport={"width": 700, "height": 500}, device_scale_factor=1)
    try:
        page.set_content("<div id='host' style='width:600px'></div>")
        page.evaluate(HARNESS, [widget_module(), _traits(view)])
        asked = _serve(page, view)
        assert [m["exact"] for m in asked] == [False, True]
        assert all((m["r0"], m["r1"], m["c0"], m["c1"], m["h"], m["w"]) == (0, ROWS, 0, COLS, 300, 600)
                   for m in asked)  # the 600 × 300 canvas at fit: 3 rows × 2 columns a pixel
        assert page.text_content(".tm-title") == f"{HOSTILE} F32 {ROWS}×{COLS}"
        assert page.evaluate("() => document.querySelectorAll('img, script').length") == 0
        assert page.evaluate("() => window.pwned") is None
        assert page.text_content(".tm-message") == ""

        box = page.locator(".tm-canvas").bounding_box()
        page.mouse.move(box["x"] + 1 + 100.2, box["y"] + 1 + 50.2)  # inside the 1 px border
        readout = page.locator(".tm-readout")
        assert (readout.get_attribute("data-row"), readout.get_attribute("data-col")) == ("150", "200")
        approx = tile(View.of(ck["w"]), 0, ROWS, 0, COLS, 300, 600)
        exact = tile(View.of(ck["w"]), 0, ROWS, 0, COLS, 300, 600, exact=True)
        block = np.float32(arrays["w"][150:153, 200:202])
        stats = {key: float(exact.fields[key][50, 100]) for key in ("min", "max", "mean", "absmax")}
        assert (stats["min"], stats["max"], stats["absmax"]) == (block.min(), block.max(), np.abs(block).max())

        def shown(v: float) -> str:  # format.js value(v, 4) for a magnitude in [1e-3, 1e5)
            return repr(float(f"{v:.4g}"))

        assert readout.text_content() == (f"[150:153, 200:202] (6 el.)  min {shown(stats['min'])}  max "
                                          f"{shown(stats['max'])}  mean {shown(stats['mean'])}  |max| "
                                          f"{shown(stats['absmax'])}")
        page.mouse.move(0, 0)  # away: no hover frame over the pixels read below

        cell = (140, 301)  # canvas pixel (301, 140) at 1 pixel per tile cell
        at = (slice(140, 141), slice(301, 302))
        assert exact.fields["absmax"][cell] == np.abs(arrays["w"][420:423, 602:604]).max()
        scale = colormaps.fit_scale(np.abs(approx.fields["value"]), "linear")  # kept when the exact tile came
        expected = colormaps.paint(exact.fields["absmax"][at], scale, colormaps.colormap("viridis"))
        assert page.evaluate(PIXEL, [301, 140]) == expected[0, 0].tolist()

        page.select_option(".tm-widget select[title='colour map']", "diverging")
        assert page.evaluate("() => window.model.get('cmap')") == "diverging"
        # as on the page, the normalisation stays (linear); 'auto' is the block mean there, its scale refitted
        scale = colormaps.fit_scale(exact.fields["mean"], "linear")
        assert page.text_content(".tm-foot").startswith(f"{scale.lo:.3f}"[:5])
        expected = colormaps.paint(exact.fields["mean"][at], scale, colormaps.colormap("diverging"))
        assert page.evaluate(PIXEL, [301, 140]) == expected[0, 0].tolist()

        page.evaluate("() => window.model.deliver({type: 'tile', id: -1}, null)")  # a stale answer: dropped
        assert page.text_content(".tm-message") == ""
        page.mouse.move(box["x"] + 300, box["y"] + 150)
        page.mouse.wheel(0, -400)  # zoom in: the next request is answered with an error naming the tensor
        page.wait_for_timeout(200)
        message = page.evaluate("() => window.model.sent.splice(0)")[-1]
        error = {"type": "error", "id": message["id"], "error": f"tensor {HOSTILE!r}: the disk is on fire"}
        page.evaluate("([m]) => window.model.deliver(m, null)", [error])
        assert page.text_content(".tm-message") == error["error"]
        assert "error" in page.get_attribute(".tm-message", "class")
        assert page.evaluate("() => document.querySelectorAll('img, script').length") == 0
    finally:
        page.close()
        view.close()
