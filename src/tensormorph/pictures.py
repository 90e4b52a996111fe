"""Pictures for papers and PRs: a tensor, a difference a − b, or a run's per-layer drift as PNG or SVG.

A tensor's picture is its level-of-detail tile (ops/tiles.py: exact block aggregates by default, the ones the viewer
draws) coloured with the viewer's own colour maps and scale (colormaps.py), so a picture shows what the page shows
for the same view and settings: under the block summary 'auto', the block mean on the diverging map and the block
abs-max on the others, and a scale fitted to the picture's values. PNG is written by Pillow (the `pictures` extra,
imported on first use); SVG holds that PNG as an <image>, with the title, the axes' indices and a colour bar as text.
"""

from __future__ import annotations

import base64
import io
import math
import os
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np

from .colormaps import Scale, colormap, fit_scale, paint, palette
from .core import Checkpoint, LogicalTensor
from .errors import CheckpointError
from .extras import require
from .formats import opened
from .indexing import parse_index
from .ops.history import History
from .ops.tiles import AGGREGATES, MAX_PIXELS, Tile, View, tile
from .storage import replace_file

DEFAULT_SIZE = (1024, 1024)  # (width, height): the largest picture unless told, a page column at print resolution
MIN_HEIGHT = 24  # pixels: a 1-D tensor (one row of pixels) is drawn as a strip at least this tall
MAX_CELL = 32  # pixels per cell side of a drift picture with few layers and checkpoints
MAX_AXIS_LABELS = 64  # row or column labels written into an SVG; more are thinned to every k-th
NO_FIGURE_RGB = (232, 235, 240)  # a drift cell without a figure: the page's empty background, not a colour of a map
FONT_PX = 12  # SVG text size
CHAR_PX = 7.2  # approximate width of a character of the SVG font, for the margins
SUFFIXES = (".png", ".svg")


@dataclass(frozen=True)
class Heatmap:
    """A picture: RGB cells drawn `zoom` (rows, columns) pixels each, its scale, and the labels of its axes."""

    title: str
    rgb: np.ndarray  # (rows, columns, 3) uint8: one cell per tile pixel (or per layer and checkpoint)
    zoom: tuple[int, int]
    cmap: str
    scale: Scale
    rows: Sequence[tuple[int, str]]  # (cell row, label) along the left edge
    cols: Sequence[tuple[int, str]]  # (cell column, label) along the bottom edge
    values: np.ndarray  # the figures coloured, one per cell (float32 or float64)
    tile: Tile | None = None  # a tensor's picture: the tile it was drawn from

    @property
    def pixels(self) -> np.ndarray:
        """The picture's pixels: every cell repeated `zoom` times down and across."""
        zy, zx = self.zoom
        return np.repeat(np.repeat(self.rgb, zy, axis=0), zx, axis=1)

    @property
    def caption(self) -> str:
        """The scale in words: normalisation, colour map, and the values at the two ends of the bar."""
        ends = f"|x| {self.scale.lo:.4g} … {self.scale.hi:.4g}" if self.scale.log else \
            f"{self.scale.lo:.4g} … {self.scale.hi:.4g}"
        return f"{self.scale.mode} · {palette().labels[self.cmap]} · {ends}"

    def to_png(self) -> bytes:
        """The picture as PNG bytes (Pillow), with its title and scale as text chunks."""
        image = require("PIL.Image", "pictures", feature="pictures (PNG)")
        info = require("PIL.PngImagePlugin", "pictures", feature="pictures (PNG)").PngInfo()
        info.add_text("Title", self.title)
        info.add_text("Description", self.caption)
        info.add_text("Software", "tensormorph")
        out = io.BytesIO()
        image.fromarray(np.ascontiguousarray(self.pixels), "RGB").save(out, format="PNG", pnginfo=info)
        return out.getvalue()

    def to_svg(self) -> str:
        """The picture as SVG: the PNG as an <image>, with the title, axis labels and colour bar as text."""
        png = base64.b64encode(self.to_png()).decode()
        height, width = self.pixels.shape[:2]
        left = math.ceil(max((len(text) for _, text in self.rows), default=1) * CHAR_PX) + 12
        top, bar = 2 * FONT_PX + 8, 12
        bottom = FONT_PX + 8 + bar + FONT_PX + 12
        total_w = left + max(width, 256) + 16
        total_h = top + height + bottom
        zy, zx = self.zoom
        lut = colormap(self.cmap)
        parts = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{total_h}" '
            f'viewBox="0 0 {total_w} {total_h}" font-family="sans-serif" font-size="{FONT_PX}">',
            f"<title>{escape(self.title)}</title>",
            f'<text x="{left}" y="{FONT_PX + 2}" font-weight="bold">{escape(self.title)}</text>',
            f'<image x="{left}" y="{top}" width="{width}" height="{height}" style="image-rendering:pixelated" '
            f'preserveAspectRatio="none" href="data:image/png;base64,{png}"/>',
        ]
        for row, text in _thinned(self.rows):
            y = top + min(row * zy, height)
            baseline = "auto" if row * zy >= height else "hanging"  # the end label sits above the bottom edge
            parts.append(f'<text x="{left - 4}" y="{y}" text-anchor="end" dominant-baseline="{baseline}">'
                         f"{escape(text)}</text>")
        for col, text in _thinned(self.cols):
            x = left + min(col * zx, width)
            parts.append(f'<text x="{x}" y="{top + height + 4}" dominant-baseline="hanging">{escape(text)}</text>')
        bar_y = top + height + FONT_PX + 10
        stops = "".join(f'<stop offset="{i / (len(lut) - 1):.4f}" stop-color="#{r:02x}{g:02x}{b:02x}"/>'
                        for i, (r, g, b) in enumerate(lut.tolist()))
        parts += [f'<defs><linearGradient id="bar">{stops}</linearGradient></defs>',
                  f'<rect x="{left}" y="{bar_y}" width="256" height="{bar}" fill="url(#bar)"/>',
                  f'<text x="{left}" y="{bar_y + bar + 4}" dominant-baseline="hanging">{escape(self.caption)}</text>',
                  "</svg>"]
        return "\n".join(parts) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the picture to `path`, PNG or SVG by its suffix."""
        target = picture_path(path)
        data = self.to_png() if target.suffix.lower() == ".png" else self.to_svg().encode()
        try:
            replace_file(target, data)  # never written through a link planted at the name
        except OSError as exc:
            raise CheckpointError(f"cannot write the picture: {exc.strerror or exc}", file=str(target)) from None
        return target

    def _repr_png_(self) -> bytes:
        return self.to_png()


def picture_path(path: str | os.PathLike[str]) -> Path:
    """`path` when its suffix names a picture format (.png, .svg); CheckpointError otherwise."""
    target = Path(path)
    if target.suffix.lower() not in SUFFIXES:
        raise CheckpointError(f"cannot tell the picture's format from {target.name!r}: name it .png or .svg",
                              file=str(target))
    return target


def heatmap(source: LogicalTensor | Checkpoint | str | Path, name: str | None = None, *,
            region: str | tuple[slice, slice] | None = None, cmap: str = "viridis", norm: str | None = None,
            agg: str = "auto", rank: int | None = None, size: tuple[int, int] = DEFAULT_SIZE,
            axes: tuple[int, int] | None = None, fixed: tuple[int, ...] = (), exact: bool = True,
            clip: float = 1.0) -> Heatmap:
    """The picture of a tensor: `source` a LogicalTensor, or a checkpoint (open, or its path) and the tensor's `name`.

    `region` is 'r0:r1, c0:c1' of the 2-D view (the last two axes unless `axes`, the others at `fixed`; a 1-D
    tensor is one row); `rank` draws only what that rank holds; `size` (width, height) bounds the picture, each
    tile pixel a square block of elements. `cmap` and `norm` (linear, symmetric, log, clip at `clip` percent; by
    default symmetric on the diverging map, else linear) and `agg` (auto, mean, min, max, absmax) are the viewer's
    settings. `exact=False` draws a strided sample instead of block aggregates: fast on huge tensors, approximate.
    """
    norm = norm or _default_norm(cmap)
    _check_settings(cmap, norm, agg, size)
    with ExitStack() as stack:
        if isinstance(source, LogicalTensor):
            if name is not None:
                raise CheckpointError("give a tensor, or a checkpoint and a name, not a tensor and a name",
                                      tensor=source.name)
            tensor = source
        else:
            if name is None:
                raise CheckpointError("name the tensor to draw", file=str(getattr(source, "path", source)))
            tensor = opened(source, stack)[name]
        if rank is not None:
            tensor = tensor.local_tensor(rank)
        view = View.of(tensor, axes, fixed)
        area = _area(view, region, size)
        drawn = tile(view, *area, exact=exact)
    return _picture(drawn, _title(tensor, view, area), cmap, norm, agg, size, clip)


def diff_heatmap(a: Checkpoint | str | Path, b: Checkpoint | str | Path, name: str, *,
                 name_b: str | None = None, kind: str = "diff", region: str | tuple[slice, slice] | None = None,
                 cmap: str | None = None, norm: str | None = None, agg: str = "auto",
                 size: tuple[int, int] = DEFAULT_SIZE, axes: tuple[int, int] | None = None, fixed: tuple[int, ...] = (),
                 exact: bool = True, clip: float = 1.0) -> Heatmap:
    """The picture of a − b (kind 'diff') or |a − b| ('absdiff') for tensor `name` of a (`name_b` of b, by default
    the same), as the viewer's diff view draws it: in float64, on the diverging map with a symmetric scale (diff)
    or magma with a linear one (absdiff) unless `cmap`/`norm` say otherwise. The other options are heatmap's."""
    if kind not in ("diff", "absdiff"):
        raise CheckpointError(f"kind must be 'diff' or 'absdiff', got {kind!r}", tensor=name)
    cmap = cmap or ("magma" if kind == "absdiff" else "diverging")
    norm = norm or ("linear" if kind == "absdiff" else "symmetric")
    _check_settings(cmap, norm, agg, size)
    with ExitStack() as stack:
        ta, tb = opened(a, stack)[name], opened(b, stack)[name_b or name]
        if ta.shape != tb.shape:
            raise CheckpointError(f"shapes differ: {list(ta.shape)} in a vs {list(tb.shape)} in b", tensor=name)
        view_a, view_b = View.of(ta, axes, fixed), View.of(tb, axes, fixed)

        def difference(rows: slice, cols: slice) -> np.ndarray:
            delta = view_a.read(rows, cols).astype(np.float64) - view_b.read(rows, cols).astype(np.float64)
            return np.abs(delta) if kind == "absdiff" else delta

        area = _area(view_a, region, size)
        drawn = tile(view_a, *area, exact=exact, reader=difference)
    return _picture(drawn, _title(ta, view_a, area, "|a − b|" if kind == "absdiff" else "a − b"), cmap, norm, agg,
                    size, clip)


def drift_heatmap(result: History, *, cmap: str = "viridis", norm: str = "linear",
                  size: tuple[int, int] = DEFAULT_SIZE) -> Heatmap:
    """A run's per-layer drift (‖Δ‖/‖w‖ from the checkpoint before) as a picture: a row per layer in the model's
    order, a column per checkpoint in the run's order; a cell without a figure (the first checkpoint, a damaged
    one, a layer that was all zeros) in the page's background grey."""
    lut = colormap(cmap)
    layers = list(dict.fromkeys(d.layer for r in result.checkpoints for d in r.drift or ()))
    if not layers:
        raise CheckpointError("has no drift to draw: it needs two readable checkpoints in a row", file=result.run)
    at = {layer: i for i, layer in enumerate(layers)}
    values = np.full((len(layers), len(result.checkpoints)), np.nan)
    for j, record in enumerate(result.checkpoints):
        for d in record.drift or ():
            if d.relative is not None:
                values[at[d.layer], j] = d.relative
    scale = fit_scale(values, norm)
    rgb = paint(values, scale, lut)
    rgb[np.isnan(values)] = NO_FIGURE_RGB
    width, height = _checked_size(size)
    cell = max(1, min(MAX_CELL, width // values.shape[1], height // values.shape[0]))
    steps = [(j, "—" if r.step is None else str(r.step)) for j, r in enumerate(result.checkpoints)]
    title = f"drift per layer · {result.run}" + (" (estimate)" if result.estimate else "")
    return Heatmap(title, rgb, (cell, cell), cmap, scale, list(enumerate(layers)), steps, values)


def _picture(drawn: Tile, title: str, cmap: str, norm: str, agg: str, size: tuple[int, int], clip: float) -> Heatmap:
    lut = colormap(cmap)
    summary = resolve_agg(agg, cmap)
    values = values_of(drawn, summary)
    scale = fit_scale(values, norm, clip_percent=clip)
    rgb = paint(values, scale, lut, drawn.mask)
    width, height = _checked_size(size)
    rows, cols = rgb.shape[:2]
    zoom = max(1, min(width // cols, height // rows))
    zoom_y = max(zoom, min(MIN_HEIGHT, height) // rows)
    (r0, r1), (c0, c1) = drawn.rows, drawn.cols
    if drawn.approximate:
        title += " · strided sample (approximate)"
    return Heatmap(f"{title} · {summary}", rgb, (zoom_y, zoom), cmap, scale, [(0, str(r0)), (rows, str(r1))],
                   [(0, str(c0)), (cols, str(c1))], values, drawn)


def resolve_agg(agg: str, cmap: str) -> str:
    """render.js resolveAgg: 'auto' is the block mean on the diverging map, the block abs-max on the others."""
    if agg == "auto":
        return "mean" if cmap == "diverging" else "absmax"
    if agg not in AGGREGATES:
        raise CheckpointError(f"no block summary {agg!r}: use auto or one of {', '.join(AGGREGATES)}")
    return agg


def values_of(drawn: Tile, agg: str) -> np.ndarray:
    """render.js valuesOf: an exact tile's field, or the single values of a sample (as |x| under abs-max)."""
    if agg in drawn.fields:
        return drawn.fields[agg]
    values = drawn.fields.get("value", next(iter(drawn.fields.values())))
    return np.abs(values) if agg == "absmax" else values


def _check_settings(cmap: str, norm: str, agg: str, size: tuple[int, int]) -> None:
    """Fail on a wrong setting before any tensor is read."""
    colormap(cmap)
    resolve_agg(agg, cmap)
    fit_scale(np.zeros(0), norm)
    _checked_size(size)


def _default_norm(cmap: str) -> str:
    return "symmetric" if cmap == "diverging" else "linear"


def _checked_size(size: tuple[int, int]) -> tuple[int, int]:
    width, height = size
    if not (width >= 1 and height >= 1 and width * height <= MAX_PIXELS):
        raise CheckpointError(f"a picture of {width} × {height} pixels is outside [1, {MAX_PIXELS}] pixels")
    return width, height


def _area(view: View, region: str | tuple[slice, slice] | None, size: tuple[int, int]) -> tuple[int, ...]:
    """(r0, r1, c0, c1, h, w): the region, and the tile pixels that fit `size` with square blocks of elements."""
    width, height = _checked_size(size)
    rows, cols = view.shape
    name = view.tensor.name
    if region is None:
        bounds = [(0, rows), (0, cols)]
    else:
        items = parse_index(region) if isinstance(region, str) else tuple(region)
        if len(items) == 1 and rows == 1:
            items = (slice(None), *items)
        if len(items) != 2 or not all(isinstance(item, slice) and item.step in (None, 1) for item in items):
            raise CheckpointError(f"region {region!r} must be two ranges 'r0:r1, c0:c1' of the {rows} × {cols} view",
                                  tensor=name)
        bounds = [item.indices(n)[:2] for item, n in zip(items, (rows, cols))]
        if any(stop <= start for start, stop in bounds):
            raise CheckpointError(f"region {region!r} is empty in the {rows} × {cols} view", tensor=name)
    (r0, r1), (c0, c1) = bounds
    step = max(1, math.ceil((r1 - r0) / height), math.ceil((c1 - c0) / width))
    return r0, r1, c0, c1, math.ceil((r1 - r0) / step), math.ceil((c1 - c0) / step)


def _title(tensor: LogicalTensor, view: View, area: tuple[int, ...], what: str = "") -> str:
    r0, r1, c0, c1 = area[:4]
    shape = "×".join(map(str, tensor.shape)) or "scalar"
    whole = (r0, r1, c0, c1) == (0, view.shape[0], 0, view.shape[1])
    where = "" if whole else f" [{r0}:{r1}, {c0}:{c1}]"
    if view.axes is not None and (tensor.ndim > 2 or view.axes != (0, 1)):
        fixed = iter(view.fixed)
        where += " (" + ", ".join("rows" if d == view.axes[0] else "columns" if d == view.axes[1] else
                                  f"axis {d} = {next(fixed)}" for d in range(tensor.ndim)) + ")"
    return f"{tensor.name}{': ' + what if what else ''} {tensor.dtype} {shape}{where}"


def _thinned(labels: Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    every = max(1, math.ceil(len(labels) / MAX_AXIS_LABELS))
    return list(labels[::every])

