"""The viewer's colour maps and value scales, so that a picture shows the colours the page shows.

The colour tables are read from the page's own module (web/colormaps.js), which keeps them as data (hex strings):
the two can never drift apart. The scales (linear, symmetric ±, log |x|, percentile clip) and the painting of NaN
and infinite values follow that module's makeNormaliser and paint step for step, in float64 as JavaScript computes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from .errors import CheckpointError

SOURCE = Path(__file__).resolve().parent / "web" / "colormaps.js"
NORMS = ("linear", "symmetric", "log", "clip")
QUANTILE_SAMPLES = 65536  # the page estimates percentiles on at most this many values (colormaps.js quantiles)
LOG_FLOOR = 1e-12  # a log scale spans at most 12 decades below the largest magnitude, as the page's does
FLAG_NAN = 1  # bits of a tile's non-finite flags (ops/search.py, colormaps.js)
FLAG_INF = 2 | 4
LUT_SIZE = 256

_TABLE = re.compile(r"(\w+):\s*((?:'[0-9a-f]+'\s*\+?\s*)+)")
_LABEL = re.compile(r"(\w+):\s*'([^']*)'")


@dataclass(frozen=True)
class Palette:
    """What the page paints with: its colour tables (name -> 256 × 3 uint8), their labels, and the NaN/Inf colours."""

    tables: dict[str, np.ndarray]
    labels: dict[str, str]
    nan: tuple[int, int, int]
    inf: tuple[int, int, int]


@cache
def palette() -> Palette:
    """The page's colour maps, parsed from web/colormaps.js once."""
    text = SOURCE.read_text(encoding="utf-8")
    hex_block = _between(text, "const HEX = {", "};")
    tables = {}
    for name, body in _TABLE.findall(hex_block):
        digits = "".join(re.findall(r"'([0-9a-f]+)'", body))
        if len(digits) != LUT_SIZE * 6:
            raise RuntimeError(f"{SOURCE}: colour map {name!r} has {len(digits) // 6} colours, not {LUT_SIZE}")
        tables[name] = np.frombuffer(bytes.fromhex(digits), np.uint8).reshape(LUT_SIZE, 3)
    tables["grey"] = np.repeat(np.arange(LUT_SIZE, dtype=np.uint8)[:, None], 3, axis=1)
    order = dict(_LABEL.findall(_between(text, "export const COLORMAP_LABELS = {", "};")))
    missing = set(order) - set(tables)
    if missing:
        raise RuntimeError(f"{SOURCE}: no table for the colour maps {sorted(missing)}")
    return Palette({name: tables[name] for name in order}, order, _rgb(text, "NAN_RGB"), _rgb(text, "INF_RGB"))


def colormap(name: str) -> np.ndarray:
    """The 256 × 3 uint8 table of one of the page's colour maps; CheckpointError naming the others."""
    tables = palette().tables
    if name not in tables:
        raise CheckpointError(f"no colour map {name!r}: the viewer's are {', '.join(tables)}")
    return tables[name]


@dataclass(frozen=True)
class Scale:
    """A value -> [0, 1] mapping, as colormaps.js makeNormaliser builds it; lo and hi are the colour bar's ends."""

    mode: str
    lo: float
    hi: float
    log: bool = False
    floor: float = 0.0  # log10 of the smallest magnitude shown (log scales)

    def positions(self, values: np.ndarray) -> np.ndarray:
        """Each finite value's place on the bar, unclamped (float64); anything for NaN and infinities."""
        v = np.asarray(values, np.float64)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            if self.log:
                span = math.log10(self.hi) - self.floor if self.hi > 0 else 0.0
                magnitude = np.abs(v)
                if not span > 0:
                    return np.where(magnitude == 0, 0.0, 1.0 if self.hi > 0 else 0.0)
                return np.where(magnitude == 0, 0.0, (np.log10(magnitude) - self.floor) / span)
            span = self.hi - self.lo
            if not span > 0:
                return np.where(v > self.lo, 1.0, np.where(v < self.lo, 0.0, 0.5))
            return (v - self.lo) / span


def fit_scale(values: np.ndarray, mode: str = "linear", *, clip_percent: float = 1.0,
              value_range: tuple[float, float] | None = None) -> Scale:
    """The scale the page fits to `values` under a normalisation (linear, symmetric, log, clip); `value_range`
    (lo, hi) replaces the values' own finite range (the page's scale locked to the tensor's)."""
    if mode not in NORMS:
        raise CheckpointError(f"no normalisation {mode!r}: the viewer's are {', '.join(NORMS)}")
    flat = np.asarray(values, np.float64).reshape(-1)
    finite = flat[np.isfinite(flat)]
    if value_range is not None:
        lo, hi = value_range
    elif finite.size:
        lo, hi = float(finite.min()), float(finite.max())
    else:
        lo = hi = 0.0
    if mode == "symmetric":
        top = max(abs(lo), abs(hi))
        return Scale(mode, -top, top)
    if mode == "clip" and value_range is None:
        low, high = _quantiles(flat, (clip_percent / 100, 1 - clip_percent / 100))
        return Scale(mode, lo if math.isnan(low) else low, hi if math.isnan(high) else high)
    if mode == "log":
        top = max(abs(lo), abs(hi))
        if not top > 0:
            return Scale(mode, 0.0, 0.0, log=True)
        magnitudes = np.abs(finite)
        nonzero = magnitudes[magnitudes > 0]
        least = max(float(nonzero.min()) if nonzero.size else top, top * LOG_FLOOR)
        return Scale(mode, least, top, log=True, floor=math.log10(least))
    return Scale("linear", lo, hi)


def paint(values: np.ndarray, scale: Scale, lut: np.ndarray, flags: np.ndarray | None = None) -> np.ndarray:
    """RGB pixels (uint8, values' shape + (3,)) as colormaps.js paint colours them: a flagged block (a NaN or an
    infinity inside) or a NaN/infinite value takes the NaN/Inf colour, every other value its colour map index
    floor(clamp(t, 0, 1) · 255 + 0.5)."""
    v = np.asarray(values, np.float64)
    t = np.clip(np.nan_to_num(scale.positions(v), nan=0.0, posinf=1.0, neginf=0.0), 0.0, 1.0)
    # take copies even for a single value, where indexing would hand back a view of the shared table
    rgb = np.take(lut, np.floor(t * (LUT_SIZE - 1) + 0.5).astype(np.intp), axis=0)
    colours = palette()
    nan = np.isnan(v)
    inf = np.isinf(v)
    if flags is not None:
        flagged = flags != 0
        nan = np.where(flagged, (flags & FLAG_NAN) != 0, nan)
        inf = np.where(flagged, ((flags & FLAG_INF) != 0) & ((flags & FLAG_NAN) == 0), inf)
    rgb[inf] = colours.inf
    rgb[nan] = colours.nan
    return rgb


def _quantiles(values: np.ndarray, qs: tuple[float, float]) -> tuple[float, float]:
    """colormaps.js quantiles: a strided sample of at most QUANTILE_SAMPLES values, sorted, rounded ranks."""
    stride = max(1, values.size // QUANTILE_SAMPLES)
    sample = values[::stride]
    ordered = np.sort(sample[np.isfinite(sample)])
    if not ordered.size:
        return math.nan, math.nan
    last = ordered.size - 1
    return tuple(float(ordered[min(last, max(0, math.floor(q * last + 0.5)))]) for q in qs)  # type: ignore[return-value]


def _between(text: str, start: str, end: str) -> str:
    at = text.find(start)
    if at < 0:
        raise RuntimeError(f"{SOURCE}: {start!r} not found")
    return text[at + len(start):text.index(end, at)]


def _rgb(text: str, name: str) -> tuple[int, int, int]:
    found = re.search(rf"{name} = \[(\d+), (\d+), (\d+)\]", text)
    if found is None:
        raise RuntimeError(f"{SOURCE}: {name} not found")
    red, green, blue = (int(x) for x in found.groups())
    return red, green, blue
