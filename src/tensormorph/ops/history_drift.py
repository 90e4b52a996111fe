"""The drift between two checkpoints of a run, streamed in bounded memory, and the sidecar cache that keeps it.

Both checkpoints are read in the blocks `diff` uses (aligned to the chunks of both sides, each under a budget);
every sum is a float64 accumulator, so no tensor is ever held whole. Positions where either side is NaN or
infinite are left out of the norms and counted instead.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import dtypes
from ..core import Checkpoint, LogicalTensor
from ..errors import CheckpointError
from ..storage import read_small, replace_file
from .diff import DEFAULT_BLOCK_BYTES, aligned_blocks
from .stats import check_scannable

SAMPLE_BLOCK_BYTES = 1 << 20  # with sampling: blocks of 1 MiB (as float64), so N blocks are a small part of a tensor
SAMPLE_SEED = 21  # fixed, so that every run samples the same blocks: estimates stay comparable and cacheable
CACHE_VERSION = 1  # bumped when what a cached pair holds changes: older entries are then ignored
MAX_CACHE_BYTES = 64 * 1024**2  # a cache file beyond this is not ours (a pair of a 1000-layer model takes ~60 KB)


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name up to the first numbered part (`model.layers.3`), or else its
    module (the name without its last part: `lm_head`)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


@dataclass(frozen=True)
class TensorChange:
    """A tensor whose dtype or shape changed between two checkpoints, or that only one of them holds."""

    tensor: str
    kind: str  # "dtype", "shape", "added" or "removed"
    before: str | None
    after: str | None


@dataclass
class PairDrift:
    """What one pair of consecutive checkpoints (a, then b) computed; sums of squares in float64."""

    layers: dict[str, tuple[float, float, int]] = field(default_factory=dict)  # layer -> (Σ(b-a)², Σa², tensors)
    nonfinite_a: dict[str, tuple[int, int]] = field(default_factory=dict)  # tensor -> (NaNs, infinities), if any
    nonfinite_b: dict[str, tuple[int, int]] = field(default_factory=dict)
    changes: list[TensorChange] = field(default_factory=list)
    elements: int = 0  # elements read on each side

    def to_json(self) -> dict[str, Any]:
        return {"layers": {k: list(v) for k, v in self.layers.items()},
                "nonfinite_a": {k: list(v) for k, v in self.nonfinite_a.items()},
                "nonfinite_b": {k: list(v) for k, v in self.nonfinite_b.items()},
                "changes": [asdict(c) for c in self.changes], "elements": self.elements}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PairDrift:
        """The pair as `to_json` wrote it (KeyError, TypeError or ValueError when it is not that)."""
        return cls({k: (float(d), float(w), int(n)) for k, (d, w, n) in data["layers"].items()},
                   {k: (int(n), int(i)) for k, (n, i) in data["nonfinite_a"].items()},
                   {k: (int(n), int(i)) for k, (n, i) in data["nonfinite_b"].items()},
                   [TensorChange(**c) for c in data["changes"]], int(data["elements"]))


class ReadFailure(Exception):
    """A read of one side failed: that checkpoint is damaged (`side` is "a" or "b")."""

    def __init__(self, side: str, error: CheckpointError):
        super().__init__(str(error))
        self.side, self.error = side, error


def weights(ck: Checkpoint, prefix: str) -> dict[str, LogicalTensor]:
    """The floating-point tensors whose names start with `prefix`: what drift is computed over."""
    return {n: t for n, t in ck.items() if n.startswith(prefix) and dtypes.is_floating(t.dtype)}


def pair_drift(a: dict[str, LogicalTensor], b: dict[str, LogicalTensor], *, sample: int | None = None,
               block_bytes: int | None = None, threads: int = 2) -> PairDrift:
    """Per-layer sums of squares of b - a and of a over the tensors both hold with the same shape, NaN and
    infinity counts of both sides, and the dtype and shape changes. With `sample`, only that many blocks of each
    tensor (the same ones every time) are read, and the sums are scaled up to the whole tensor."""
    result = PairDrift()
    for name in a.keys() - b.keys():
        result.changes.append(TensorChange(name, "removed", _describe(a[name]), None))
    for name in b.keys() - a.keys():
        result.changes.append(TensorChange(name, "added", None, _describe(b[name])))
    common = [n for n in b if n in a]
    for name in common:
        ta, tb = a[name], b[name]
        if ta.shape != tb.shape:
            result.changes.append(TensorChange(name, "shape", _describe(ta), _describe(tb)))
        elif ta.dtype != tb.dtype:
            result.changes.append(TensorChange(name, "dtype", ta.dtype, tb.dtype))
    result.changes.sort(key=lambda c: c.tensor)
    compared = [n for n in common if a[n].shape == b[n].shape]
    for name in compared:  # a forged shape is refused before anything is read
        for side, tensor in (("a", a[name]), ("b", b[name])):
            try:
                check_scannable(tensor)
            except CheckpointError as exc:
                raise ReadFailure(side, exc) from exc
    budget = block_bytes or (SAMPLE_BLOCK_BYTES if sample else DEFAULT_BLOCK_BYTES)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        figures = list(pool.map(lambda n: _tensor_drift(n, a[n], b[n], sample, budget), compared))
    for name, (delta_sq, weight_sq, nonfinite_a, nonfinite_b, elements) in zip(compared, figures, strict=True):
        layer = layer_of(name)
        d, w, n = result.layers.get(layer, (0.0, 0.0, 0))
        result.layers[layer] = (d + delta_sq, w + weight_sq, n + 1)
        if any(nonfinite_a):
            result.nonfinite_a[name] = nonfinite_a
        if any(nonfinite_b):
            result.nonfinite_b[name] = nonfinite_b
        result.elements += elements
    return result


def _describe(t: LogicalTensor) -> str:
    return f"{t.dtype}[{','.join(map(str, t.shape))}]"


def _boxes(name: str, a: LogicalTensor, b: LogicalTensor, sample: int | None,
           block_bytes: int) -> Iterator[tuple[slice, ...]]:
    boxes = list(aligned_blocks(a, b, block_bytes))
    if sample is None or sample >= len(boxes):
        return iter(boxes)
    # seeded by the name: the same blocks of a tensor in every pair and every run
    rng = np.random.default_rng([SAMPLE_SEED, zlib.crc32(name.encode())])
    return iter([boxes[i] for i in sorted(rng.choice(len(boxes), size=sample, replace=False))])


def _read(tensor: LogicalTensor, box: tuple[slice, ...], side: str) -> np.ndarray:
    try:
        return np.asarray(tensor.read(box)).reshape(-1)
    except CheckpointError as exc:
        raise ReadFailure(side, exc) from exc


def _tensor_drift(name: str, a: LogicalTensor, b: LogicalTensor, sample: int | None,
                  block_bytes: int) -> tuple[float, float, tuple[int, int], tuple[int, int], int]:
    """(Σ(b-a)², Σa², (NaNs, infs) of a, of b, elements read), the sums scaled up when sampled."""
    delta_sq = weight_sq = 0.0
    nan_a = inf_a = nan_b = inf_b = elements = 0
    # two float64 blocks reused for every block of the tensor: memory this large is mapped afresh at each allocation,
    # and faulting fresh pages in costs more than the arithmetic
    buffers = np.empty(0), np.empty(0)
    for box in _boxes(name, a, b, sample, block_bytes):
        raw_x, raw_y = _read(a, box, "a"), _read(b, box, "b")
        if buffers[0].size < raw_x.size:
            buffers = np.empty(raw_x.size), np.empty(raw_x.size)
        x, y = buffers[0][:raw_x.size], buffers[1][:raw_x.size]
        x[...], y[...] = raw_x, raw_y
        elements += x.size
        weight = float(np.dot(x, x))
        if not (math.isfinite(weight) and math.isfinite(float(np.dot(y, y)))):  # a NaN or an infinity in the block
            finite_x, finite_y = np.isfinite(x), np.isfinite(y)
            nans_x, nans_y = int(np.isnan(x).sum()), int(np.isnan(y).sum())
            nan_a, inf_a = nan_a + nans_x, inf_a + int(x.size - finite_x.sum()) - nans_x
            nan_b, inf_b = nan_b + nans_y, inf_b + int(y.size - finite_y.sum()) - nans_y
            both = finite_x & finite_y
            x, y = x[both], y[both]
            weight = float(np.dot(x, x))
        weight_sq += weight
        delta = np.subtract(y, x, out=y)  # y is not needed again
        delta_sq += float(np.dot(delta, delta))
    if sample is not None and elements and elements < a.numel:
        scale = a.numel / elements
        delta_sq, weight_sq = delta_sq * scale, weight_sq * scale
    return delta_sq, weight_sq, (nan_a, inf_a), (nan_b, inf_b), elements


def relative(delta_sq: float, weight_sq: float) -> float | None:
    """‖Δ‖/‖w‖, None when the weights are all zero."""
    return math.sqrt(delta_sq) / math.sqrt(weight_sq) if weight_sq > 0 else None


def pair_key(identity_a: str, identity_b: str, how: str) -> str:
    """A cached pair's key: both checkpoints' identities and how they were read (which tensors, sampled or not)."""
    return f"{identity_a}>{identity_b}>{how}"


class DriftCache:
    """Pairs already computed, by the identities of both checkpoints and how they were read, in one JSON file.

    A missing, unreadable or foreign file is an empty cache: it only ever saves work. Entries are used only when
    both checkpoints' identities (taken afresh from their files every run) match the key."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, Any] = {}
        self.used: set[str] = set()
        self.error: str | None = None  # why the file could not be written
        if path is None:
            return
        try:
            raw = read_small(path, MAX_CACHE_BYTES, follow=False)  # never through a link planted at its name
            data = json.loads(raw) if raw is not None else None
        except (CheckpointError, ValueError):
            data = None
        if isinstance(data, dict) and data.get("version") == CACHE_VERSION and isinstance(data.get("pairs"), dict):
            self.entries = data["pairs"]

    def get(self, key: str) -> PairDrift | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        try:
            drift = PairDrift.from_json(entry)
        except (KeyError, TypeError, ValueError):
            return None
        self.used.add(key)
        return drift

    def put(self, key: str, drift: PairDrift) -> None:
        self.entries[key] = drift.to_json()
        self.used.add(key)

    def save(self, identities: set[str]) -> None:
        """Write the pairs of checkpoints that still exist (both `identities` are among those given; other ways
        of reading them, such as another sample size, are kept too): a new file renamed over the old one, so a
        reader never sees half of it. A folder that cannot be written is noted, not raised."""
        if self.path is None:
            return
        kept = {k: v for k, v in self.entries.items() if k in self.used or set(k.split(">")[:2]) <= identities}
        data = json.dumps({"version": CACHE_VERSION, "pairs": dict(sorted(kept.items()))},
                          separators=(",", ":")).encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(self.path, data)
        except OSError as exc:
            self.error = f"{self.path}: {exc.strerror or exc}"
