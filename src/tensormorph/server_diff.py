"""The viewer's diff: how it pairs the tensors of a and b (renames, rule sets such as `flax-torch`, transposes, as
`tensormorph diff` takes them; ops/rules.py), the diff report's endpoint and the tiles of a − b.

With rules, each side is seen through them once (`aligned_view`): a Flax kernel paired with a torch weight is shown
and searched transposed, read lazily through its own chunks, so its a − b tiles line up with b's layout.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .core import Checkpoint, LogicalTensor
from .ops.diff import DiffReport, aligned_names, diff, parse_rename
from .ops.rules import Rule, aligned_view, rule_list
from .ops.tiles import tile
from .server_request import ApiError, choice_param, finite, flag_param, float_param, region, view_of
from .tile_cache import compress, negotiate

if TYPE_CHECKING:
    from .server import Viewer

SCALE_HEADER = "X-Tensormorph-Scale"  # a tile's answer: the whole tensor's finite range, JSON, when known


class Pairing:
    """How the diff pairs a's tensors with b's: `rename` rules, then (with `rules` or `transpose`) rule sets and
    transposes, in diff's order. Parsed at start, so a bad rule fails before the server listens."""

    def __init__(self, rename: Sequence[str] = (), rules: Sequence[str] = (), transpose: Sequence[str] = ()):
        self.rename, self.rules, self.transpose = list(rename), list(rules), list(transpose)
        self._steps: list[Rule] | None = rule_list(self.rules, self.rename, self.transpose) \
            if self.rules or self.transpose else None
        for rule in self.rename if self._steps is None else ():
            parse_rename(rule)  # checked now, applied by name in aligned()
        self._views: dict[tuple[int, int], tuple[Checkpoint, Checkpoint]] = {}
        self._lock = threading.Lock()

    @property
    def key(self) -> list[Any]:
        """What the pairing does, for cache keys: each parsed rule's own text (a rule file's rules, not its name,
        so an edited file keys anew), sides and permutation."""
        if self._steps is None:
            return list(self.rename)
        return [(type(s).__name__, s.text, s.sides, getattr(s, "permutation", None)) for s in self._steps]

    def report(self, a: Checkpoint, b: Checkpoint, atol: float, rtol: float) -> DiffReport:
        return diff(a, b, atol=atol, rtol=rtol, rename=self.rename, rules=self.rules, transpose=self.transpose)

    def aligned(self, a: Checkpoint, b: Checkpoint, name: str | None) -> tuple[LogicalTensor, LogicalTensor]:
        """The tensors of a and b the diff pairs under the aligned `name` (each in the aligned layout), of one
        shape."""
        if self._steps is None:
            rules = [parse_rename(r) for r in self.rename]
            a_names, b_names = aligned_names(list(a), rules, "a"), aligned_names(list(b), rules, "b")
            found = (a[a_names[name]], b[b_names[name]]) if name and name in a_names and name in b_names else None
        else:
            view_a, view_b = self._views_of(a, b)
            found = (view_a.tensors[name], view_b.tensors[name]) \
                if name and name in view_a.tensors and name in view_b.tensors else None
        if found is None:
            raise ApiError(404, f"tensor {name!r} is not in both checkpoints")
        left, right = found
        if left.shape != right.shape:
            raise ApiError(400, f"shapes differ: {list(left.shape)} vs {list(right.shape)}")
        return left, right

    def _views_of(self, a: Checkpoint, b: Checkpoint) -> tuple[Checkpoint, Checkpoint]:
        assert self._steps is not None
        key = (id(a), id(b))  # a pairing lives as long as its viewer's checkpoints, so these ids stay theirs
        with self._lock:
            if key not in self._views:
                self._views = {key: (aligned_view(a, self._steps, "a"), aligned_view(b, self._steps, "b"))}
            return self._views[key]


def diff_endpoint(request: Request) -> JSONResponse:
    """The diff report of the two checkpoints."""
    viewer: Viewer = request.app.state.viewer
    report = viewer.diff_report(float_param(request, "atol", 0.0), float_param(request, "rtol", 0.0))
    return JSONResponse(finite(report.to_dict()))


def diff_tile(request: Request) -> Response:
    """A binary tile of a − b (kind=diff) or |a − b| (kind=absdiff) for one aligned tensor name."""
    viewer: Viewer = request.app.state.viewer
    name = request.query_params.get("name")
    a, b = viewer.aligned(name)
    kind = choice_param(request, "kind", ("diff", "absdiff"), "diff")
    view_a, view_b = view_of(a, request), view_of(b, request)
    area = region(request, view_a)
    exact, shuffle = flag_param(request, "exact"), flag_param(request, "shuffle")

    def difference(rows: slice, cols: slice) -> np.ndarray:
        delta = view_a.read(rows, cols).astype(np.float64) - view_b.read(rows, cols).astype(np.float64)
        return np.abs(delta) if kind == "absdiff" else delta

    def compute() -> bytes:
        known = None
        if not exact:
            left = viewer.nonfinite(_memo_id(viewer, "a", a), a)
            right = viewer.nonfinite(_memo_id(viewer, "b", b), b)
            known = left.difference(right, absolute=kind == "absdiff") if left and right else None
        return tile(view_a, *area, exact=exact, reader=difference, nonfinite=known).encode(shuffle=shuffle)

    scale = viewer.diff_scale(name or "", kind)
    encoding = negotiate(request.headers.get("accept-encoding"))
    if not exact:
        return binary(*compress(compute(), encoding), scale)
    # the rules are part of the key: a transposed view reads the same files as the tensor it shows
    key = ["diff", kind, viewer.pairing.key, view_a.axes, view_a.fixed, area, shuffle]
    return binary(*viewer.cached_tile(key, [(viewer.checkpoint("a"), a), (viewer.checkpoint("b"), b)], compute,
                                      encoding), scale)


def binary(data: bytes, encoding: str | None = None, scale: dict[str, float | None] | None = None) -> Response:
    """A tile: Content-Encoding when compressed, and the tensor's range when known (not in the cached bytes:
    it becomes known later than a tile may be cached)."""
    headers = {"Vary": "Accept-Encoding"}
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    if scale is not None:
        headers[SCALE_HEADER] = json.dumps(finite(scale))
    return Response(data, media_type="application/octet-stream", headers=headers)



def _memo_id(viewer: Viewer, cid: str, tensor: LogicalTensor) -> str:
    """The id under which the viewer remembers a side's NaN/Inf positions: a transposed view shares its tensor's
    name, so it is kept apart from what the plain tiles of that tensor remember."""
    return cid if viewer.checkpoint(cid).tensors.get(tensor.name) is tensor else f"{cid}:aligned"
