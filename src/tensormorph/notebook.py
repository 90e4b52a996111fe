"""Tensormorph in notebooks: the HTML that Checkpoint, LogicalTensor, DiffReport, Plan and History show in Jupyter,
VS Code or Colab (their `_repr_html_` call these functions).

Names come from files that may be hostile, so every text goes through html.escape. Showing an object never fails
and never reads much: a tensor's inline picture is its approximate tile (a strided sample) drawn only when its read
stays under PREVIEW_READ_BYTES, and its statistics are exact only for tensors up to STATS_READ_BYTES (else those of
the sample, said to be so). The pictures need Pillow (the `pictures` extra); without it the tables still show.
"""

from __future__ import annotations

import base64
import importlib.util
import math
import time
from html import escape
from typing import TYPE_CHECKING, Any

import numpy as np

from .core import Checkpoint, LogicalTensor
from .errors import CheckpointError
from .ops.diff import DiffReport
from .ops.history import History
from .ops.stats import tensor_stats
from .ops.summary import split_description, totals_by_dtype
from .ops.tree import ModuleNode, module_tree
from .pictures import drift_heatmap, heatmap
from .units import human_bytes

if TYPE_CHECKING:  # showing a checkpoint must not load the planner
    from .planner.result import Plan

PREVIEW_SIZE = (256, 128)  # (width, height): the largest inline picture of a tensor
PREVIEW_READ_BYTES = 8 * 1024**2  # the most an inline picture may read (sampled rows × the pages they touch)
STATS_READ_BYTES = 4 * 1024**2  # exact statistics (one streamed pass) only for tensors up to this size
PAGE_BYTES = 4096  # a strided read touches at least a page per element it takes
MAX_ROWS = 100  # rows of a diff or history table; the others are counted
MAX_TREE_NODES = 300  # nodes of a module tree drawn; the others are counted
MAX_METRICS = 4  # metric columns of a history table
DRIFT_PICTURE_SIZE = (640, 320)
STYLE = ("<style>.tm{font-family:system-ui,sans-serif;font-size:13px}.tm table{border-collapse:collapse}"
         ".tm td,.tm th{padding:2px 8px;text-align:right;white-space:nowrap}.tm td.l,.tm th.l{text-align:left}"
         ".tm .dim{color:#667}.tm .bad{color:#c0392b;font-weight:bold}.tm .warn{color:#b7791f}.tm .ok{color:#2f855a}"
         ".tm details{margin-left:1em}.tm summary{cursor:pointer}"
         ".tm .bar{display:flex;position:relative;width:320px;height:12px;background:#e8ebf0;border:1px solid #aab}"
         ".tm .bar span{display:block;height:100%}"
         ".tm .bar i{position:absolute;top:-3px;bottom:-3px;width:2px;background:#c0392b}</style>")
BAR_COLOURS = {"weights": "#4c72b0", "kv_cache": "#dd8452", "activations": "#55a868", "reserve": "#8c8c8c"}
STATUS_CLASS = {"equal": "ok", "close": "ok", "committed": "ok", "different": "bad", "shape_mismatch": "bad",
                "damaged": "bad", "dtype_mismatch": "warn", "only_a": "warn", "only_b": "warn", "incomplete": "warn",
                "abandoned": "dim"}


def checkpoint_html(ck: Checkpoint) -> str:
    """A checkpoint's summary (format, path, tensors, size, dtypes) and its folded module tree."""
    params = sum(t.numel for t in ck.values())
    head = (f"<b>{escape(ck.format)}</b> checkpoint <code>{escape(str(ck.path))}</code><br>"
            f"{len(ck):,} tensors · {params:,} parameters · {human_bytes(ck.nbytes)}"
            + (f" · {len(ck.objects):,} other entries" if ck.objects else ""))
    dtypes = _table(["dtype", "tensors", "parameters", "bytes"], [
        [escape(d), f"{v['tensors']:,}", f"{v['params']:,}", human_bytes(v["nbytes"])]
        for d, v in totals_by_dtype(ck).items()])
    budget = [MAX_TREE_NODES]
    tree = "".join(_node(child, budget, top=True) for child in module_tree(ck.values()).children.values())
    more = f"<div class='dim'>… {-budget[0]:,} more modules</div>" if budget[0] < 0 else ""
    return _wrap(f"{head}{dtypes}<details open><summary>modules</summary>{tree}{more}</details>")


def tensor_html(tensor: LogicalTensor) -> str:
    """A tensor: shape, dtype, how it is stored, a small picture and statistics, each within its read bound."""
    shape = "×".join(map(str, tensor.shape)) or "scalar"
    rows = [["dtype", escape(tensor.dtype)], ["shape", escape(shape)],
            ["size", f"{tensor.numel:,} elements · {human_bytes(tensor.nbytes)}"],
            ["stored", escape(split_description(tensor))]]
    if tensor.placement is not None:
        rows.append(["placement", escape(str(tensor.placement))])
    if tensor.files:
        shown = ", ".join(tensor.files[:3]) + (f" … ({len(tensor.files)} files)" if len(tensor.files) > 3 else "")
        rows.append(["files", escape(shown)])
    picture, sample = _preview(tensor)
    rows.append(["statistics", _statistics(tensor, sample)])
    body = "".join(f"<tr><th class='l'>{key}</th><td class='l'>{value}</td></tr>" for key, value in rows)
    return _wrap(f"<b>{escape(tensor.name)}</b><table>{body}</table>{picture}")


def diff_html(report: DiffReport) -> str:
    """A diff report: the verdict and the counts, then the table of tensors, worst first."""
    counts = ", ".join(f"{n} {escape(status)}" for status, n in report.counts.items())
    verdict = "<span class='ok'>same</span>" if report.identical else "<span class='bad'>different</span>"
    head = (f"{verdict}: <code>{escape(report.a)}</code> vs <code>{escape(report.b)}</code><br>"
            f"{len(report.tensors):,} tensors ({counts}); atol={report.atol:g} rtol={report.rtol:g}")
    rows = []
    for t in report.tensors[:MAX_ROWS]:
        dtype = t.dtype_a if t.dtype_a == t.dtype_b else f"{t.dtype_a or '—'}→{t.dtype_b or '—'}"
        shape = _shape(t.shape_a) if t.shape_a == t.shape_b else f"{_shape(t.shape_a)}→{_shape(t.shape_b)}"
        rows.append([escape(t.name), _status(t.status), escape(str(dtype)), escape(shape), _num(t.max_abs),
                     _num(t.max_rel), _num(t.rel_l2), _num(t.cosine),
                     f"{t.mismatches:,} ({t.mismatch_fraction:.2%})" if t.mismatches else ""])
    table = _table(["name", "status", "dtype", "shape", "max abs", "max rel", "rel l2", "cosine", "outside tol"],
                   rows, left=4)
    objects = "".join(f"<div>object <b>{escape(o.name)}</b>: {_status(o.status)} {escape(o.detail)}</div>"
                      for o in report.objects if o.status != "equal")
    return _wrap(head + table + _more(len(report.tensors)) + objects)


def plan_html(plan: Plan) -> str:
    """A plan: one bar per device (weights, KV cache, activations, reserve against its memory), and the speed."""
    rate = plan.decode_tokens_per_s
    head = (f"<b>{escape(plan.strategy)}</b> plan · " + ("<span class='ok'>fits</span>" if plan.fits else
                                                          "<span class='bad'>does not fit</span>")
            + f" · {escape(plan.plans)}<br>"
            + ("decode: " + (f"{rate:,.1f} tokens/s" if rate is not None else "speed unknown"))
            + f" · bottleneck: {escape(plan.bottleneck.device)} ({escape(plan.bottleneck.limit)}): "
              f"{escape(plan.bottleneck.reason)}")
    rows = []
    for d in plan.devices:
        whole = max(d.device.memory, d.used, 1)
        spans = "".join(f"<span style='width:{100 * getattr(d, kind) / whole:.2f}%;background:{colour}' "
                        f"title='{kind.replace('_', ' ')}: {human_bytes(getattr(d, kind))}'></span>"
                        for kind, colour in BAR_COLOURS.items())
        if not d.fits:  # the bar spans what is used: a red line where the memory ends
            spans += f"<i style='left:{100 * d.device.memory / whole:.2f}%' title='memory'></i>"
        state = f"{human_bytes(d.free)} free" if d.fits else f"<span class='bad'>{human_bytes(-d.free)} over</span>"
        rows.append([escape(d.name), escape(d.device.product or ""), f"<div class='bar'>{spans}</div>",
                     f"{human_bytes(d.used)} of {human_bytes(d.device.memory)}", state,
                     escape(d.layer_ranges or ", ".join(d.units[:4]))])
    legend = " ".join(f"<span style='color:{colour}'>■</span> {kind.replace('_', ' ')}"
                      for kind, colour in BAR_COLOURS.items())
    notes = "".join(f"<div class='dim'>{escape(note)}</div>" for note in plan.notes)
    table = _table(["device", "product", "memory", "used", "", "layers"], rows, left=6)
    return _wrap(f"{head}{table}<div class='dim'>{legend}</div>{notes}")


def history_html(result: History) -> str:
    """A run's history: a row per checkpoint (step, time, size, status, metrics, drift), the first NaN or infinity
    of each tensor, and the per-layer drift as a labelled picture (SVG) when Pillow is installed."""
    records = result.checkpoints
    metrics = list(dict.fromkeys(k for r in records for k in r.metrics))[:MAX_METRICS]
    rows = []
    for r in records[:MAX_ROWS]:
        status = _status(r.status) + (" <span class='bad'>NaN/Inf</span>" if r.nonfinite else "")
        if r.problem:
            status += f"<div class='dim'>{escape(r.problem)}</div>"
        rows.append(["—" if r.step is None else str(r.step), time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.time)),
                     human_bytes(r.size), status, *(_num(r.metrics.get(m)) for m in metrics),
                     _num(r.total_drift) + ("*" if r.cached else "")])
    head = f"<b>run</b> <code>{escape(result.run)}</code> · {len(records):,} checkpoint(s)" + (
        f" · <span class='warn'>estimate: {result.sample} block(s) per tensor</span>" if result.estimate else "")
    table = _table(["step", "time", "size", "status", *(escape(m) for m in metrics), "drift"], rows)
    found = "".join(f"<div class='bad'>first NaN/Inf: {escape(n.tensor)} at step {n.step} ({escape(n.checkpoint)}: "
                    f"{n.nans} NaN, {n.infs} infinite)</div>" for n in result.first_nonfinite)
    picture = ""
    if _pillow() and any(r.drift for r in records):
        picture = drift_heatmap(result, size=DRIFT_PICTURE_SIZE).to_svg()  # inline: its layer and step labels show
    return _wrap(head + table + _more(len(records)) + found + picture)


def _preview(tensor: LogicalTensor) -> tuple[str, np.ndarray | None]:
    """The inline picture (HTML) and the values it sampled, or a note and None when it is not drawn."""
    if not _pillow():
        return "<div class='dim'>no picture: pip install 'tensormorph[pictures]'</div>", None
    if tensor.numel == 0:
        return "", None
    rows, cols = (tensor.shape[-2], tensor.shape[-1]) if tensor.ndim >= 2 else (1, max(1, tensor.numel))
    step = max(1, math.ceil(rows / PREVIEW_SIZE[1]), math.ceil(cols / PREVIEW_SIZE[0]))
    touched = strided_read_bytes(rows, cols, step, step, tensor.numpy_dtype.itemsize)
    if touched > PREVIEW_READ_BYTES:
        return (f"<div class='dim'>no picture: its sample would read about {human_bytes(touched)} (the bound is "
                f"{human_bytes(PREVIEW_READ_BYTES)}); use tm.heatmap</div>"), None
    try:
        picture = heatmap(tensor.with_budget(PREVIEW_READ_BYTES), size=PREVIEW_SIZE, exact=False)
    except CheckpointError as exc:
        return f"<div class='bad'>no picture: {escape(str(exc))}</div>", None
    sample = picture.tile.fields["value"] if picture.tile is not None else None
    return f"{_img(picture.to_png(), picture.title)}<div class='dim'>{escape(picture.caption)}</div>", sample


def strided_read_bytes(rows: int, cols: int, sy: int, sx: int, itemsize: int) -> int:
    """About the bytes a strided sample (every sy-th row, every sx-th column) of a rows × cols row-major region
    touches: a page per element it takes, or each sampled row's whole span when that is less."""
    return math.ceil(rows / sy) * min(cols * itemsize, math.ceil(cols / sx) * max(PAGE_BYTES, sx * itemsize))


def _statistics(tensor: LogicalTensor, sample: np.ndarray | None) -> str:
    if tensor.numel == 0:
        return "empty"
    if tensor.nbytes <= STATS_READ_BYTES:
        try:
            s = tensor_stats(tensor)
        except CheckpointError as exc:
            return f"<span class='bad'>{escape(str(exc))}</span>"
        return (f"min {_num(s.min)} · max {_num(s.max)} · mean {_num(s.mean)} · std {_num(s.std)} · "
                f"{s.zeros:,} zeros · {s.nans:,} NaN · {s.infs:,} infinite")
    if sample is None or not sample.size:
        return (f"<span class='dim'>not computed: {human_bytes(tensor.nbytes)} to read "
                "(tensormorph stats computes them)</span>")
    values = sample.astype(np.float64).reshape(-1)
    finite = values[np.isfinite(values)]
    summary = (f"min {_num(float(finite.min()))} · max {_num(float(finite.max()))} · mean {_num(float(finite.mean()))}"
               if finite.size else "no finite value")
    return (f"{summary} · {values.size - finite.size:,} NaN/infinite <span class='dim'>(of a strided sample of "
            f"{values.size:,} elements, not the whole tensor)</span>")


def _node(node: ModuleNode, budget: list[int], *, top: bool = False) -> str:
    """One module: a line for a tensor, a folded <details> for a module (the top ones open); counts down `budget`
    (nodes left)."""
    budget[0] -= 1
    if budget[0] < 0:
        return ""
    name = escape(node.name) + (f" ×{node.repeat}" if node.repeat > 1 else "")
    if node.tensor is not None and not node.children:
        t = node.tensor
        return f"<div>{name} <span class='dim'>{escape(t.dtype)} {escape(_shape(t.shape))}</span></div>"
    children = "".join(_node(child, budget) for child in node.children.values())
    return (f"<details{' open' if top else ''}><summary>{name} <span class='dim'>{node.params:,} params · "
            f"{human_bytes(node.nbytes)}</span></summary>{children}</details>")


def _table(headers: list[str], rows: list[list[str]], *, left: int = 0) -> str:
    """An HTML table of cells already escaped; the first `left` columns aligned left."""
    def cls(i: int) -> str:
        return " class='l'" if i < left else ""

    head = "".join(f"<th{cls(i)}>{h}</th>" for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f"<td{cls(i)}>{c}</td>" for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _img(png: bytes, title: str) -> str:
    return (f"<img style='image-rendering:pixelated' alt={_attr(title)} title={_attr(title)} "
            f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>")


def _attr(text: str) -> str:
    return f"\"{escape(text, quote=True)}\""


def _more(count: int) -> str:
    return f"<div class='dim'>… {count - MAX_ROWS:,} more rows</div>" if count > MAX_ROWS else ""


def _status(status: str) -> str:
    return f"<span class='{STATUS_CLASS.get(status, '')}'>{escape(status)}</span>"


def _num(value: Any) -> str:
    return "—" if value is None else f"{value:.6g}"


def _shape(shape: tuple[int, ...] | None) -> str:
    return "—" if shape is None else "×".join(map(str, shape)) or "scalar"


def _pillow() -> bool:
    return importlib.util.find_spec("PIL") is not None


def _wrap(body: str) -> str:
    return f"{STYLE}<div class='tm'>{body}</div>"
