"""The interactive heatmap widget for notebooks: `tm.widget(...)`, an anywidget (Jupyter, VS Code, Colab).

The page (web/widget.js) draws a tensor's 2-D view and asks the kernel for level-of-detail tiles as the user pans and
zooms, by anywidget custom messages. The kernel answers with the tile the viewer's HTTP API would send: computed by
ops/tiles.py, in its binary encoding. The widget draws with the viewer's own modules (camera, renderer, pointer, colour
maps, tile parser), inlined into its module when it is built, so it shows what the page shows and loads nothing from
the network.

Messages (JSON content; binary buffers beside it):
    page -> kernel  {"type": "tile", "id": n, "r0", "r1", "c0", "c1", "h", "w": integers, "exact": bool}
    kernel -> page  {"type": "tile", "id": n, "limited": bool} and one buffer, the encoded tile, or
                    {"type": "error", "id": n, "error": "one line"}
`limited`: an exact tile was asked over more than EXACT_READ_BYTES, and the strided sample came instead.

The kernel answers on its main thread, so every answer is bounded: at most MAX_TILE_PIXELS pixels, an exact tile only
over a region of at most EXACT_READ_BYTES, a strided sample coarser (fewer pixels) where it would touch more than
SAMPLE_READ_BYTES, and the NaN/Inf scan that completes approximate tiles only for tensors up to NONFINITE_SCAN_BYTES.
A bad request gets an error answer; it never raises into the kernel.
"""

from __future__ import annotations

import math
import re
import sys
import types
from contextlib import ExitStack
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .colormaps import NORMS, palette
from .core import Checkpoint, LogicalTensor
from .errors import CheckpointError
from .extras import require
from .formats import opened
from .notebook import strided_read_bytes
from .ops.search import NonFinite, nonfinite
from .ops.tiles import View, steps, tile
from .pictures import _title, resolve_agg

if TYPE_CHECKING:  # anywidget is the `notebook` extra, imported when a widget is made
    from anywidget import AnyWidget

WEB = Path(__file__).resolve().parent / "web"
MAX_TILE_PIXELS = 2048 * 2048  # pixels of one answer: a 1024 × 1024 canvas at twice the density (64 MiB exact)
EXACT_READ_BYTES = 128 * 1024**2  # an exact tile streams its whole region: past this, the sample answers (~0.1 s)
SAMPLE_READ_BYTES = 128 * 1024**2  # what a strided sample may touch (a page per element): past it, fewer pixels
NONFINITE_SCAN_BYTES = 16 * 1024**2  # a tensor this small is scanned once for NaN/Inf, flagged in every sample
DEFAULT_HEIGHT = 400  # CSS pixels of the widget's canvas
REGION_KEYS = ("r0", "r1", "c0", "c1", "h", "w")
_IMPORT = re.compile(r"^import \{([^}]*)\} from '\./([\w-]+\.js)';\n", re.MULTILINE)
_EXPORT = re.compile(r"^export (?=(?:async )?(?:function|const|class|let) )", re.MULTILINE)
_EXPORTED = re.compile(r"^export (?:async )?(?:function|const|class|let) (\w+)", re.MULTILINE)


@cache
def widget_module() -> str:
    """web/widget.js with the viewer modules it imports (and theirs) inlined, each in its own scope and once: one
    self-contained ES module, as anywidget loads it from a string, where relative imports cannot resolve."""
    order: list[str] = []  # modules in dependency order, each after those it imports

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise RuntimeError(f"web/{module}: the widget's modules import each other in a cycle: {path}")
        if module not in order:
            for found in _IMPORT.finditer(_source(module)):
                visit(found.group(2), (*path, module))
            order.append(module)

    visit("widget.js", ())
    parts = []
    for module in order[:-1]:
        body = _EXPORT.sub("", _IMPORT.sub(_bind, _source(module)))
        if re.search(r"^(?:import|export) ", body, re.MULTILINE):
            raise RuntimeError(f"web/{module}: an import or export the widget's inliner does not know")
        names = ", ".join(_EXPORTED.findall(_source(module)))
        parts.append(f"const {_scope(module)} = (() => {{  // ./{module}, inlined\n{body}\n"
                     f"return {{ {names} }};\n}})();\n")
    return "".join(parts) + _IMPORT.sub(_bind, _source("widget.js"))


def _source(module: str) -> str:
    return (WEB / module).read_text(encoding="utf-8")


def _scope(module: str) -> str:
    return "_module_" + re.sub(r"\W", "_", module.removesuffix(".js"))


def _bind(found: re.Match[str]) -> str:
    """`import { a, b as c } from './m.js';` as `const { a, b: c } = _module_m;` (m inlined above)."""
    names = [n.strip().replace(" as ", ": ") for n in found.group(1).split(",") if n.strip()]
    return f"const {{ {', '.join(names)} }} = {_scope(found.group(2))};\n"


class TileServer:
    """Answers a widget's tile requests for one 2-D view of a tensor (anywidget not needed: tests drive it)."""

    def __init__(self, tensor: LogicalTensor, axes: tuple[int, int] | None = None, fixed: tuple[int, ...] = ()):
        self.view = View.of(tensor, axes, fixed)
        self._nonfinite: NonFinite | None = None
        self._scanned = False

    @property
    def tensor(self) -> LogicalTensor:
        return self.view.tensor

    def answer(self, message: object) -> tuple[dict[str, Any], list[bytes]]:
        """The answer (content, buffers) to one message of the page."""
        request_id = message.get("id") if isinstance(message, dict) else None
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            request_id = None
        try:
            content, buffers = self._tile(message)
        except CheckpointError as exc:
            return {"type": "error", "id": request_id, "error": str(exc)}, []
        except OSError as exc:  # a file vanished or a remote read failed after opening
            error = CheckpointError(f"cannot read: {exc.strerror or exc}", file=exc.filename, tensor=self.tensor.name)
            return {"type": "error", "id": request_id, "error": str(error)}, []
        return {**content, "id": request_id}, buffers

    def _tile(self, message: object) -> tuple[dict[str, Any], list[bytes]]:
        name = self.tensor.name
        kind = message.get("type") if isinstance(message, dict) else type(message).__name__
        if not isinstance(message, dict) or kind != "tile":
            raise CheckpointError(f"the widget answers tile requests only, not {str(kind)[:40]!r}", tensor=name)
        values = [message.get(key) for key in REGION_KEYS]
        region = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        if len(region) != len(REGION_KEYS):
            raise CheckpointError(f"a tile request needs integers {', '.join(REGION_KEYS)}; got "
                                  f"{ {k: v for k, v in zip(REGION_KEYS, values)}!r:.200}", tensor=name)
        r0, r1, c0, c1, h, w = region
        if not 1 <= h * w <= MAX_TILE_PIXELS:
            raise CheckpointError(f"a tile of {h} × {w} pixels is outside the widget's [1, {MAX_TILE_PIXELS}] "
                                  "pixels", tensor=name)
        exact = message.get("exact") is True
        item = self.tensor.numpy_dtype.itemsize
        limited = exact and max(0, r1 - r0) * max(0, c1 - c0) * item > EXACT_READ_BYTES
        exact = exact and not limited
        if not exact and 0 <= r0 < r1 and 0 <= c0 < c1:  # a sample spread thin touches a page per element: fewer
            while (h > 1 or w > 1) and strided_read_bytes(r1 - r0, c1 - c0, *steps(r0, r1, c0, c1, h, w),
                                                          item) > SAMPLE_READ_BYTES:
                h, w = math.ceil(h / 2), math.ceil(w / 2)
        drawn = tile(self.view, r0, r1, c0, c1, h, w, exact=exact, nonfinite=None if exact else self._known())
        return {"type": "tile", "limited": limited}, [drawn.encode()]

    def _known(self) -> NonFinite | None:
        """Where the tensor's NaN and Inf are, scanned once when it is small enough; None when not known."""
        if not self._scanned and self.tensor.nbytes <= NONFINITE_SCAN_BYTES:
            self._scanned = True
            try:
                self._nonfinite = nonfinite(self.tensor)
            except CheckpointError:  # a damaged block: tiles of the intact parts still come, as samples
                self._nonfinite = NonFinite.unknown(self.tensor.shape)
        return self._nonfinite


def widget(source: LogicalTensor | Checkpoint | str | Path, name: str | None = None, *, cmap: str = "viridis",
           norm: str | None = None, agg: str = "auto", value_range: tuple[float, float] | None = None,
           rank: int | None = None, axes: tuple[int, int] | None = None, fixed: tuple[int, ...] = (),
           height: int = DEFAULT_HEIGHT) -> AnyWidget:
    """An interactive heatmap of a tensor: `source` a LogicalTensor, or a checkpoint (open, or its path) and the
    tensor's `name`. Drag to pan; the wheel zooms, and so does a double-click (shift: out); the kernel sends the
    tiles as the view moves. A checkpoint opened here from its path stays open until the widget is closed.

    `cmap`, `norm` (by default symmetric on the diverging map, else linear) and `agg` are the viewer's settings;
    `value_range` (lo, hi) fixes the scale to those values instead of fitting it to the view (under abs-max:
    0 … max(|lo|, |hi|), or from the smaller magnitude when both have one sign). `rank`, `axes` and `fixed` choose the
    view as for tm.heatmap. The widget's traits `name`, `cmap`, `norm`, `agg` and `value_range` may be set later;
    a new `name` shows another tensor of the same checkpoint. Needs the `notebook` extra (anywidget).
    """
    cls = _widget_class()
    return cls(source, name, cmap=cmap, norm=norm or ("symmetric" if cmap == "diverging" else "linear"), agg=agg,
               value_range=value_range, rank=rank, axes=axes, fixed=fixed, height=height)


def _checked_settings(cmap: str, norm: str, agg: str) -> None:
    if cmap not in palette().tables:
        raise CheckpointError(f"no colour map {cmap!r}: the viewer's are {', '.join(palette().tables)}")
    if norm not in NORMS:
        raise CheckpointError(f"no normalisation {norm!r}: the viewer's are {', '.join(NORMS)}")
    resolve_agg(agg, cmap)


@cache
def _widget_class() -> type[AnyWidget]:
    """The widget class, made on first use: anywidget (and its traitlets) load only when a widget is made."""
    anywidget = require("anywidget", "notebook", feature="tm.widget")
    traitlets = require("traitlets", "notebook", feature="tm.widget")

    class HeatmapWidget(anywidget.AnyWidget):  # type: ignore[name-defined]
        """A tensor's heatmap with pan and zoom; tiles computed in the kernel by ops/tiles.py."""

        _esm = widget_module()
        name = traitlets.Unicode().tag(sync=True)
        shape = traitlets.List(traitlets.Int(), read_only=True).tag(sync=True)
        dtype = traitlets.Unicode(read_only=True).tag(sync=True)
        view_shape = traitlets.List(traitlets.Int(), read_only=True).tag(sync=True)  # [rows, columns] drawn
        axes = traitlets.List(traitlets.Int(), allow_none=True, read_only=True).tag(sync=True)  # [row, column] axes
        fixed = traitlets.List(traitlets.Int(), read_only=True).tag(sync=True)  # the other axes' indices
        title = traitlets.Unicode(read_only=True).tag(sync=True)  # which view: the axes and fixed indices
        cmap = traitlets.Unicode("viridis").tag(sync=True)
        norm = traitlets.Unicode("linear").tag(sync=True)
        agg = traitlets.Unicode("auto").tag(sync=True)
        value_range = traitlets.List(traitlets.Float(), minlen=2, maxlen=2, allow_none=True,
                                     default_value=None).tag(sync=True)
        height = traitlets.Int(DEFAULT_HEIGHT).tag(sync=True)
        error = traitlets.Unicode("").tag(sync=True)  # the last failed request, as the widget shows it

        def __init__(self, source: LogicalTensor | Checkpoint | str | Path, name: str | None, *, cmap: str,
                     norm: str, agg: str, value_range: tuple[float, float] | None, rank: int | None,
                     axes: tuple[int, int] | None, fixed: tuple[int, ...], height: int) -> None:
            self._stack = ExitStack()  # first: a widget that failed to start is still closed when collected
            _checked_settings(cmap, norm, agg)
            self._view_options = (rank, axes, fixed)
            with ExitStack() as failed:
                failed.callback(self._stack.close)  # a tensor that is not there: close what was opened for it
                if isinstance(source, LogicalTensor):
                    if name is not None:
                        raise CheckpointError("give a tensor, or a checkpoint and a name, not a tensor and a name",
                                              tensor=source.name)
                    self._checkpoint: Checkpoint | None = None
                    tensor = source
                else:
                    if name is None:
                        raise CheckpointError("name the tensor to draw", file=str(getattr(source, "path", source)))
                    self._checkpoint = opened(source, self._stack)  # kept open: tiles are read as the view moves
                    tensor = self._checkpoint[name]
                self._server = self._serve(tensor)
                failed.pop_all()
            self._source_name = tensor.name
            super().__init__(name=tensor.name, cmap=cmap, norm=norm, agg=agg, height=height,
                             value_range=list(value_range) if value_range is not None else None)
            self._describe()
            self.on_msg(self._on_message)

        def _serve(self, tensor: LogicalTensor) -> TileServer:
            rank, axes, fixed = self._view_options
            return TileServer(tensor.local_tensor(rank) if rank is not None else tensor, axes, fixed)

        def _describe(self) -> None:
            view = self._server.view
            with self.hold_sync():  # one update: the page redraws on the title, with the rest already there
                self.set_trait("shape", list(view.tensor.shape))
                self.set_trait("dtype", view.tensor.dtype)
                self.set_trait("view_shape", list(view.shape))
                self.set_trait("axes", list(view.axes) if view.axes is not None else None)
                self.set_trait("fixed", list(view.fixed))
                self.set_trait("title", _title(view.tensor, view, (0, view.shape[0], 0, view.shape[1])))
                self.error = ""

        @traitlets.validate("name")
        def _valid_name(self, proposal: dict[str, Any]) -> str:
            new = str(proposal["value"])
            shown = getattr(self, "_source_name", new)  # not there yet while __init__ sets the first name
            if new == shown:
                return new
            if self._checkpoint is None:
                raise traitlets.TraitError(f"this widget shows the one tensor {shown!r}; make it from a checkpoint "
                                           "to change tensors")
            if new not in self._checkpoint:
                raise traitlets.TraitError(f"{self._checkpoint.path}: no tensor {new!r}")
            return new

        @traitlets.observe("name")
        def _name_changed(self, change: dict[str, Any]) -> None:
            if self._checkpoint is None or change["new"] == self._source_name:
                return
            try:
                self._server = self._serve(self._checkpoint[change["new"]])
            except CheckpointError as exc:  # another tensor's rank or axes may not fit: the old view stays
                self.error = str(exc)
                return
            self._source_name = change["new"]
            self._describe()

        @traitlets.validate("cmap", "norm", "agg")
        def _valid_setting(self, proposal: dict[str, Any]) -> str:
            settings = {"cmap": self.cmap, "norm": self.norm, "agg": self.agg, proposal["trait"].name:
                        proposal["value"]}
            try:
                _checked_settings(settings["cmap"], settings["norm"], settings["agg"])
            except CheckpointError as exc:
                raise traitlets.TraitError(str(exc)) from None
            return str(proposal["value"])

        @traitlets.validate("value_range")
        def _valid_range(self, proposal: dict[str, Any]) -> list[float] | None:
            value = proposal["value"]
            if value is not None and not (value[0] <= value[1] and all(abs(v) < float("inf") for v in value)):
                raise traitlets.TraitError(f"value_range must be two finite numbers lo <= hi, got {list(value)}")
            return value

        def _on_message(self, _widget: Any, content: Any, _buffers: Any) -> None:
            answer, buffers = self._server.answer(content)
            if answer["type"] == "error":
                self.error = answer["error"]
            self.send(answer, buffers)

        def __repr__(self) -> str:
            return f"HeatmapWidget({self.title!r})"

        def close(self) -> None:
            """Close the widget, and the checkpoint it opened from a path."""
            self._stack.close()
            super().close()

    return HeatmapWidget


class _CallableModule(types.ModuleType):
    """This module, callable as `tm.widget(...)`: importing it binds `tensormorph.widget` to the module, not to the
    function, so the module itself must answer the call, whichever was imported first."""

    def __call__(self, source: LogicalTensor | Checkpoint | str | Path, name: str | None = None,
                 **options: Any) -> AnyWidget:
        return widget(source, name, **options)


sys.modules[__name__].__class__ = _CallableModule
