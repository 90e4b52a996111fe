"""Pictures (tm.heatmap, diff_heatmap, `tensormorph heatmap`, `history -o`): the pixels of the PNG, decoded with
Pillow, are the viewer's colour map applied to block aggregates computed here with numpy from the saved arrays."""

from __future__ import annotations

import base64
import io
import json
import math
import sys
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from safetensors.numpy import save_file

import tensormorph as tm
from tensormorph import colormaps
from tensormorph.cli import main
from tensormorph.errors import CheckpointError, MissingDependencyError
from tensormorph.ops.convert import convert
from tensormorph.pictures import MIN_HEIGHT, NO_FIGURE_RGB, diff_heatmap, drift_heatmap

pytestmark = pytest.mark.timeout(120)

SVG = "{http://www.w3.org/2000/svg}"
ODD_NAME = 'x<"&>y'  # a name that must come out escaped in SVG


def _weights(seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((300, 500)).astype(np.float32)
    w[10, 21] = np.nan
    w[203, 401] = np.inf
    return w


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pictures")
    rng = np.random.default_rng(1)
    w = _weights()
    paths = {"a": base / "a.safetensors", "b": base / "b.safetensors", "sharded": base / "sharded"}
    save_file({"w": w, "v": rng.standard_normal(1000).astype(np.float32),
               "t3": rng.standard_normal((3, 40, 50)).astype(np.float32), ODD_NAME: np.eye(4, dtype=np.float32)},
              str(paths["a"]))
    moved = w + np.float32(0.01) * rng.standard_normal(w.shape).astype(np.float32)
    save_file({"w": moved}, str(paths["b"]))
    convert(paths["b"], paths["sharded"], to="tensormorph", mesh=2, placements=["Shard(0)"])
    return paths


def _blocks(values: np.ndarray, s: int, reduce) -> np.ndarray:
    """Every s × s block of `values` reduced (ragged edges padded with NaN and ignored), in float64."""
    rows, cols = math.ceil(values.shape[0] / s) * s, math.ceil(values.shape[1] / s) * s
    padded = np.full((rows, cols), np.nan)
    padded[:values.shape[0], :values.shape[1]] = values
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN blocks: NaN, as the tile says
        return reduce(padded.reshape(rows // s, s, cols // s, s), axis=(1, 3))


def _expected(values: np.ndarray, lut: np.ndarray, lo: float, hi: float, nonfinite: np.ndarray) -> np.ndarray:
    """The colour of each value as colormaps.js paints it: index floor(clamp((v − lo)/(hi − lo)) · 255 + 0.5)."""
    t = np.clip((values - lo) / (hi - lo), 0, 1)
    rgb = lut[np.floor(np.nan_to_num(t) * 255 + 0.5).astype(int)]
    rgb[nonfinite] = colormaps.palette().nan
    return rgb


def _decoded(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as image:
        assert image.format == "PNG" and image.mode == "RGB"
        return np.asarray(image)


def test_colour_tables_are_the_pages():
    """Read from web/colormaps.js: matplotlib's viridis at 0, 0.5 and 1, and the page's NaN/Inf colours."""
    tables = colormaps.palette().tables
    assert list(tables) == ["viridis", "magma", "diverging", "grey", "cividis"]
    assert [tuple(tables["viridis"][i]) for i in (0, 128, 255)] == [(0x44, 0x01, 0x54), (0x21, 0x91, 0x8C),
                                                                      (0xFD, 0xE7, 0x25)]
    assert tuple(tables["grey"][77]) == (77, 77, 77) and tables["magma"].shape == (256, 3)
    assert colormaps.palette().nan == (255, 0, 200) and colormaps.palette().inf == (0, 232, 255)
    with pytest.raises(CheckpointError, match="viridis, magma, diverging, grey, cividis"):
        colormaps.colormap("jet")


def test_png_pixels_are_the_colour_map_of_the_exact_block_aggregates(files):
    """Default settings: abs-max of each 4 × 4 block (300 × 500 into 128 × 128), a linear scale over them."""
    picture = tm.heatmap(files["a"], "w", size=(128, 128))
    w = _weights().astype(np.float64)
    assert picture.tile.step == (4, 4) and not picture.tile.approximate
    finite = np.where(np.isfinite(w), np.abs(w), np.nan)
    absmax = _blocks(finite, 4, np.nanmax)
    flagged = _blocks(np.where(np.isfinite(w), 0.0, 1.0), 4, np.nanmax) > 0
    np.testing.assert_array_equal(picture.values[~flagged], absmax[~flagged].astype(np.float32))
    drawn = absmax.astype(np.float32)
    drawn[203 // 4, 401 // 4] = np.nan  # the block holding +inf has abs-max +inf: outside the scale's range
    lo, hi = float(np.nanmin(drawn)), float(np.nanmax(drawn))
    assert (picture.scale.lo, picture.scale.hi) == (lo, hi)
    expected = _expected(picture.values.astype(np.float64), colormaps.colormap("viridis"), lo, hi, flagged)
    assert flagged.sum() == 2  # one NaN and one infinity, in different blocks: both painted the NaN/Inf colours
    expected[203 // 4, 401 // 4] = colormaps.palette().inf
    pixels = _decoded(picture.to_png())
    assert picture.zoom == (1, 1) and pixels.shape == (75, 125, 3)
    np.testing.assert_array_equal(pixels, expected)


def test_diverging_map_draws_block_means_on_a_symmetric_scale(files):
    picture = tm.heatmap(files["b"], "w", cmap="diverging", size=(250, 150))  # 2 × 2 blocks
    b = np.asarray(tm.open(files["b"])["w"].full(), np.float64)
    means = _blocks(b, 2, np.mean).astype(np.float32)
    # w + noise: NaN stays NaN, inf stays inf; the finite blocks' means are the figures drawn
    finite = np.isfinite(means)
    np.testing.assert_allclose(picture.values[finite], means[finite], rtol=1e-6)
    top = float(np.max(np.abs(picture.values[np.isfinite(picture.values)])))
    assert picture.scale.mode == "symmetric" and (picture.scale.lo, picture.scale.hi) == (-top, top)
    pixels = _decoded(picture.to_png())[::picture.zoom[0], ::picture.zoom[1]]
    expected = _expected(picture.values.astype(np.float64), colormaps.colormap("diverging"), -top, top, ~finite)
    expected[203 // 2, 401 // 2] = colormaps.palette().inf
    np.testing.assert_array_equal(pixels, expected)


def test_small_region_is_drawn_element_by_element_and_enlarged(files):
    picture = tm.heatmap(files["a"], "w", region="100:116, 30:62", size=(256, 256), norm="symmetric", agg="max")
    region = _weights()[100:116, 30:62].astype(np.float64)
    assert picture.tile.rows == (100, 116) and picture.tile.cols == (30, 62) and picture.tile.step == (1, 1)
    assert picture.zoom == (8, 8)  # 16 × 32 elements, each 8 × 8 pixels in a 256-pixel-wide picture
    top = float(np.abs(region).max())
    expected = _expected(region, colormaps.colormap("viridis"), -top, top, ~np.isfinite(region))
    pixels = _decoded(picture.to_png())
    assert pixels.shape == (128, 256, 3)
    np.testing.assert_array_equal(pixels, np.repeat(np.repeat(expected, 8, axis=0), 8, axis=1))
    for bad in ("5:5, 0:10", "0:10:2, 0:5", "0:10", "0:4, 0:4, 0:4"):
        with pytest.raises(CheckpointError, match="region"):
            tm.heatmap(files["a"], "w", region=bad)
    strip = tm.heatmap(files["a"], "v", size=(500, 500))  # a 1-D tensor: one row, drawn as a strip
    assert strip.rgb.shape == (1, 500, 3) and strip.pixels.shape[0] >= MIN_HEIGHT


def test_rank_draws_what_that_rank_holds(files, tmp_path):
    b = np.asarray(tm.open(files["b"])["w"].full(), np.float64)
    out = tmp_path / "rank1.png"
    result = CliRunner().invoke(main, ["heatmap", str(files["sharded"]), "w", "--rank", "1", "-o", str(out),
                                       "--size", "500x150", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["rows"] == [0, 150] and data["cols"] == [0, 500] and data["step"] == [1, 1]
    half = b[150:]  # Shard(0) over 2 ranks: rank 1 holds rows 150..299
    values = np.abs(half)
    flagged = ~np.isfinite(half)
    lo, hi = float(values[~flagged].min()), float(values[~flagged].max())
    assert (data["lo"], data["hi"]) == (lo, hi)
    expected = _expected(values, colormaps.colormap("viridis"), lo, hi, flagged)
    expected[203 - 150, 401] = colormaps.palette().inf
    np.testing.assert_array_equal(_decoded(out.read_bytes()), expected)


def test_diff_heatmap_is_the_tile_of_a_minus_b(files):
    a = _weights().astype(np.float64)
    b = np.asarray(tm.open(files["b"])["w"].full(), np.float64)
    with np.errstate(invalid="ignore"):
        delta = a - b
    picture = diff_heatmap(files["a"], files["b"], "w", size=(100, 100))  # 3 × 3 blocks (5 to fit 500 in 100)
    step = picture.tile.step[0]
    assert picture.tile.step == (5, 5) and step == 5
    means = _blocks(delta, step, np.mean)
    finite = np.isfinite(means)
    np.testing.assert_allclose(picture.values[finite], means[finite].astype(np.float32), rtol=1e-6)
    assert finite.sum() == finite.size - 2 and (picture.tile.mask[~finite] == colormaps.FLAG_NAN).all()
    top = float(np.abs(picture.values[finite]).max())
    assert picture.cmap == "diverging" and (picture.scale.lo, picture.scale.hi) == (-top, top)
    expected = _expected(picture.values.astype(np.float64), colormaps.colormap("diverging"), -top, top, ~finite)
    np.testing.assert_array_equal(_decoded(picture.to_png()), expected)
    absolute = diff_heatmap(files["a"], files["b"], "w", kind="absdiff", size=(100, 100))
    assert absolute.cmap == "magma" and absolute.scale.mode == "linear"
    np.testing.assert_array_equal(absolute.values[finite],
                                  _blocks(np.abs(delta), step, np.max)[finite].astype(np.float32))
    with pytest.raises(CheckpointError, match="shapes differ"):
        diff_heatmap(files["a"], files["a"], "w", name_b="t3")


def test_cli_diff_heatmap_draws_the_same_picture(files, tmp_path):
    runner = CliRunner()
    out = runner.invoke(main, ["diff", str(files["a"]), str(files["b"]), "--heatmap", "w", "-o",
                               str(tmp_path / "d.png"), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["cmap"] == "diverging"
    expected = diff_heatmap(files["a"], files["b"], "w").to_png()
    np.testing.assert_array_equal(_decoded((tmp_path / "d.png").read_bytes()), _decoded(expected))
    alone = runner.invoke(main, ["diff", str(files["a"]), str(files["b"]), "--heatmap", "w"])
    assert alone.exit_code == 2 and "--heatmap NAME and -o FILE go together" in alone.output


def test_svg_is_well_formed_and_holds_the_png(files, tmp_path):
    picture = tm.heatmap(files["a"], ODD_NAME)
    target = picture.save(tmp_path / "odd.svg")
    root = ET.parse(target).getroot()
    assert root.tag == f"{SVG}svg" and root.find(f"{SVG}title").text.startswith(ODD_NAME + " F32 4×4")
    image = root.find(f"{SVG}image")
    href = image.get("href")
    assert href.startswith("data:image/png;base64,")
    png = base64.b64decode(href.split(",", 1)[1])
    assert png == picture.to_png()
    assert int(image.get("width")) == picture.pixels.shape[1] == 1024  # 4 × 4 elements, 256 pixels each
    assert 'x&lt;"&amp;&gt;y' in target.read_text()
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "linear · viridis · 0 … 1" in texts and "4" in texts  # the colour bar's ends and the axes' ends
    with pytest.raises(CheckpointError, match="name it .png or .svg"):
        picture.save(tmp_path / "odd.jpg")
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("untouched")
    (tmp_path / "planted.svg").symlink_to(elsewhere)
    picture.save(tmp_path / "planted.svg")  # the link itself is replaced, never written through
    assert elsewhere.read_text() == "untouched" and not (tmp_path / "planted.svg").is_symlink()


def test_cli_heatmap_writes_png_and_svg_and_fails_in_one_line(files, tmp_path):
    runner = CliRunner()
    png, svg = tmp_path / "w.png", tmp_path / "w.svg"
    result = runner.invoke(main, ["heatmap", str(files["a"]), "w", "-o", str(png), "--region", "0:64, 0:64",
                                  "--cmap", "magma", "--size", "64x64"])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.stdout and "64×64 px" in result.stdout
    expected = tm.heatmap(files["a"], "w", region="0:64, 0:64", cmap="magma", size=(64, 64))
    np.testing.assert_array_equal(_decoded(png.read_bytes()), expected.pixels)
    assert runner.invoke(main, ["heatmap", str(files["a"]), "t3", "-o", str(svg)]).exit_code == 0
    ET.parse(svg)
    bad = runner.invoke(main, ["heatmap", str(files["a"]), "nope", "-o", str(png)])
    assert bad.exit_code == 2 and "no such tensor" in bad.output and "Traceback" not in bad.output
    size = runner.invoke(main, ["heatmap", str(files["a"]), "w", "-o", str(png), "--size", "big"])
    assert size.exit_code == 2 and "WIDTHxHEIGHT" in size.output


def test_without_pillow_one_line_names_the_extra(files, monkeypatch):
    picture = tm.heatmap(files["a"], "v")
    for module in ("PIL", "PIL.Image", "PIL.PngImagePlugin"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'tensormorph\[pictures\]'"):
        picture.to_png()


def test_history_picture_columns_are_the_drift_colours(tmp_path):
    """history -o: a row per layer, a column per checkpoint; each cell the colour of ‖b − a‖/‖a‖ (numpy), the
    first checkpoint's column (no figure) in the page's background grey."""
    rng = np.random.default_rng(5)
    run = tmp_path / "run"
    run.mkdir()
    states = []
    weights = {"layers.0.w": rng.standard_normal((16, 16)), "layers.1.w": rng.standard_normal((8, 16)),
               "head.w": rng.standard_normal((4, 16))}
    for step in range(4):
        weights = {k: v + (0.02 * (step + 1) if k != "head.w" else 0.3) * rng.standard_normal(v.shape)
                   for k, v in weights.items()}
        states.append({k: v.astype(np.float32) for k, v in weights.items()})
        save_file(states[-1], str(run / f"ckpt-{step}.safetensors"))
    out = tmp_path / "drift.png"
    result = CliRunner().invoke(main, ["history", str(run), "-o", str(out), "--no-cache", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["picture"] == str(out)
    layers = ["layers.0", "layers.1", "head"]
    names = {"layers.0": "layers.0.w", "layers.1": "layers.1.w", "head": "head.w"}
    drift = np.full((3, 4), np.nan)
    for j in range(1, 4):
        for i, layer in enumerate(layers):
            a, b = (states[k][names[layer]].astype(np.float64) for k in (j - 1, j))
            drift[i, j] = np.linalg.norm(b - a) / np.linalg.norm(a)
    pixels = _decoded(out.read_bytes())
    cell = 32  # MAX_CELL: 3 × 4 cells in a 1024-pixel picture
    assert pixels.shape == (3 * cell, 4 * cell, 3)
    lo, hi = np.nanmin(drift), np.nanmax(drift)
    lut = colormaps.colormap("viridis")
    picture = drift_heatmap(tm.history(run, cache=False))
    order = [label for _, label in picture.rows]
    assert sorted(order) == sorted(layers) and [label for _, label in picture.cols] == ["0", "1", "2", "3"]
    for i, layer in enumerate(order):
        row = layers.index(layer)
        assert tuple(pixels[i * cell + cell // 2, cell // 2]) == NO_FIGURE_RGB
        for j in range(1, 4):
            t = (drift[row, j] - lo) / (hi - lo)
            colour = lut[int(np.floor(np.clip(t, 0, 1) * 255 + 0.5))]
            np.testing.assert_array_equal(pixels[i * cell + cell // 2, j * cell + cell // 2], colour)


def test_axes_and_fixed_choose_the_view(files, tmp_path):
    t3 = tm.open(files["a"])["t3"].full()  # (3, 40, 50)
    picture = tm.heatmap(files["a"], "t3", axes=(2, 0), fixed=(5,), agg="max")
    np.testing.assert_array_equal(picture.values, t3[:, 5, :].T)  # rows: axis 2, columns: axis 0
    assert "(columns, axis 1 = 5, rows)" in picture.title
    out = tmp_path / "t3.png"
    result = CliRunner().invoke(main, ["heatmap", str(files["a"]), "t3", "--axes", "2,0", "--fixed", "5", "--agg",
                                       "max", "-o", str(out)])
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(_decoded(out.read_bytes()), picture.pixels)
    early = CliRunner().invoke(main, ["heatmap", str(files["a"]), "nope", "-o", str(tmp_path / "t3.gif")])
    assert early.exit_code == 2 and "name it .png or .svg" in early.output  # before the tensor is looked up


@pytest.mark.parametrize(("setting", "message"), [({"cmap": "jet"}, "no colour map 'jet'"),
                                                   ({"norm": "sqrt"}, "no normalisation 'sqrt'"),
                                                   ({"agg": "median"}, "no block summary 'median'"),
                                                   ({"size": (0, 5)}, "0 × 5 pixels")])
def test_wrong_settings_fail_before_anything_is_read(tmp_path, setting, message):
    with pytest.raises(CheckpointError, match=message):
        tm.heatmap(tmp_path / "missing", "w", **setting)  # the path does not exist: never opened


def test_one_value_is_painted_like_an_array_of_it():
    """A 0-d value gets its own pixel (the colour table is shared and read-only), as in a 1-element array."""
    lut = colormaps.colormap("viridis")
    scale = colormaps.Scale("linear", 0.0, 1.0)
    single = colormaps.paint(np.float64(0.5), scale, lut)
    assert single.shape == (3,) and single.flags.writeable
    np.testing.assert_array_equal(single, colormaps.paint(np.array([0.5]), scale, lut)[0])
    np.testing.assert_array_equal(colormaps.paint(np.float64(np.nan), scale, lut), colormaps.palette().nan)
