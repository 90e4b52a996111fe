"""Compare two checkpoints tensor by tensor, as logical tensors, in bounded memory.

Both sides are read in boxes aligned to the chunk boundaries of both (one chunk per side each), cut into blocks under
a budget. Equal-dtype blocks are compared bytewise first; only when one differs is the tensor compared numerically, in
float64, for the error figures. Only logical values are compared: a change of sharding alone never shows up.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from .. import dtypes
from ..core import Checkpoint, LogicalTensor
from ..errors import CheckpointError
from ..formats import opened
from ..geometry import split_box
from .object_diff import ObjectDiff, compare_objects
from .spread import ALONE, Team, share
from .stats import check_scannable

DEFAULT_BLOCK_BYTES = 64 * 1024**2  # a local diff's blocks
# with a remote side: small blocks compared (their float64 temporaries stay small) ...
REMOTE_BLOCK_BYTES = 2 * 1024**2
# ... fetched several at once, up to this many bytes as stored: one ranged request (storage/remote.py's PART_BYTES),
# as a request costs the server much (moto behind a proxy: 512 MiB in 312 GETs took 4.7 s of its CPU, in 2 took 2.4 s)
REMOTE_FETCH_BYTES = 8 * 1024**2
# fetches of each side in flight while one is compared, per tensor: with none, the two tensors compared at a time still
# keep four requests in flight, and each side holds at most a fetch and its copy (one ahead added ~50% to peak RSS)
REMOTE_FETCHES_AHEAD = 0

Box = tuple[slice, ...]
STATUS_ORDER = ("different", "shape_mismatch", "dtype_mismatch", "only_a", "only_b", "close", "equal")
"""Worst first: the order of the report table."""


@dataclass(frozen=True)
class TensorDiff:
    name: str  # the aligned name (after rename rules)
    status: str  # one of STATUS_ORDER
    name_a: str | None = None
    name_b: str | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    rel_l2: float | None = None  # ||a - b|| / ||b||
    cosine: float | None = None
    mismatches: int = 0  # elements outside atol + rtol * |b| (NaN against a number counts)
    mismatch_fraction: float = 0.0
    nan_mismatches: int = 0  # positions where exactly one side is NaN
    worst_index: tuple[int, ...] | None = None
    worst_a: float | None = None
    worst_b: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DiffReport:
    a: str
    b: str
    atol: float
    rtol: float
    renames: list[str]
    tensors: list[TensorDiff] = field(default_factory=list)
    objects: list[ObjectDiff] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        counts = {status: 0 for status in STATUS_ORDER}
        for t in self.tensors:
            counts[t.status] += 1
        return {k: v for k, v in counts.items() if v}

    @property
    def identical(self) -> bool:
        """Every tensor and object equal or within tolerance, none missing on either side."""
        return all(t.status in ("equal", "close") for t in self.tensors) and \
            all(o.status == "equal" for o in self.objects)

    def changed(self) -> list[TensorDiff]:
        return [t for t in self.tensors if t.status != "equal"]

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "atol": self.atol, "rtol": self.rtol, "renames": self.renames,
                "identical": self.identical, "counts": self.counts,
                "tensors": [t.to_dict() for t in self.tensors],
                "objects": [asdict(o) for o in self.objects]}

    def _repr_html_(self) -> str:  # notebooks: a layer above (pyproject's ignore_imports says why)
        from ..notebook import diff_html
        return diff_html(self)


@dataclass(frozen=True)
class NameRule:
    """A rename rule and the side(s) it applies to."""

    text: str
    apply: Callable[[str], str]
    sides: str  # "ab", "a" or "b"


def parse_rename(rule: str) -> NameRule:
    """A name rule: 'OLD=NEW' replaces a prefix (NEW may be empty), 're:PATTERN=REPLACEMENT' rewrites
    by regex (split at the last '='); 'a:RULE' or 'b:RULE' applies it to one side only."""
    sides, body = ("a", rule[2:]) if rule.startswith("a:") else ("b", rule[2:]) if rule.startswith("b:") \
        else ("ab", rule)
    return NameRule(rule, _rule_function(body, rule), sides)


def _rule_function(body: str, rule: str) -> Callable[[str], str]:
    if body.startswith("re:"):
        pattern, sep, replacement = body[3:].rpartition("=")
        if not sep:
            raise CheckpointError(f"rename rule {rule!r} needs '=': 're:PATTERN=REPLACEMENT'")
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise CheckpointError(f"rename rule {rule!r}: bad regular expression: {exc}") from None
        return lambda name: compiled.sub(replacement, name)
    old, sep, new = body.partition("=")
    if not sep or not old:
        raise CheckpointError(f"rename rule {rule!r} should be 'PREFIX=REPLACEMENT' or 're:PATTERN=REPLACEMENT'")
    return lambda name: new + name[len(old):] if name.startswith(old) else name


def aligned_names(names: Sequence[str], rules: Sequence[NameRule], side: str) -> dict[str, str]:
    """aligned name -> original name, after the rules that apply to this side."""
    result: dict[str, str] = {}
    for name in names:
        aligned = name
        for rule in rules:
            if side in rule.sides:
                aligned = rule.apply(aligned)
        if aligned in result:
            raise CheckpointError(f"rename rules map both {result[aligned]!r} and {name!r} of checkpoint {side} "
                                  f"to {aligned!r}")
        result[aligned] = name
    return result


def diff(a: str | Path | Checkpoint, b: str | Path | Checkpoint, *, atol: float = 0.0, rtol: float = 0.0,
         names: Sequence[str] | None = None, rename: Sequence[str] | None = None, cast: str | None = None,
         objects: bool = True, common_only: bool = False, block_bytes: int | None = None,
         threads: int = 2, progress: Callable[[int], None] | None = None, transpose: Sequence[str] | None = None,
         rules: str | Sequence[Any] | None = None, team: Team = ALONE) -> DiffReport:
    """Compare the logical tensors (and non-tensor entries) of two checkpoints.

    `names` limits the comparison to these aligned names; `rename` holds rules applied to the names of both sides
    ('model.=' strips a prefix, 're:PATTERN=REPL' rewrites; an 'a:' or 'b:' prefix limits a rule to one side); `cast`
    converts side a's floating-point values to that dtype before comparing (to check a conversion exactly);
    `objects=False` compares tensors only; `common_only=True` leaves out what only one side holds (a training
    checkpoint's optimizer state against a weights-only export). Tensors are compared in blocks of about `block_bytes`
    (as float64; by default DEFAULT_BLOCK_BYTES, or REMOTE_BLOCK_BYTES with a remote side, whose blocks are fetched
    REMOTE_FETCH_BYTES at a time, REMOTE_FETCHES_AHEAD ahead). `progress` receives the number of bytes of side b
    compared so far, in increments.
    `rules` (a rule set: 'flax-torch', a JSON rule file, or parsed rules), then `rename`, then `transpose` (rules
    that permute side a's tensors whose aligned name matches: 're:.*kernel$' swaps 2-D ones) align the two sides
    (ops/rules.py). `team` spreads the tensors over processes (ops/spread.py): each compares its share, and every
    process returns the whole report.
    """
    name_rules, steps = [parse_rename(r) for r in rename or ()], None
    if transpose or rules:  # each side seen through the rules (ops.rules builds on this module's rename rules)
        from .rules import aligned_view, rule_list
        name_rules, steps = [], rule_list(rules, rename, transpose)
    with ExitStack() as stack:
        ck_a, ck_b = opened(a, stack), opened(b, stack)
        if steps is not None:
            ck_a, ck_b = aligned_view(ck_a, steps, "a"), aligned_view(ck_b, steps, "b")
        report = _diff(ck_a, ck_b, name_rules, atol=atol, rtol=rtol, names=names, cast=cast, objects=objects,
                       block_bytes=block_bytes, threads=threads, progress=progress, team=team)
    if steps is not None:
        report.renames = [step.text for step in steps]
    if common_only:
        report.tensors = [t for t in report.tensors if t.status not in ("only_a", "only_b")]
        report.objects = [o for o in report.objects if o.status not in ("only_a", "only_b")]
    return report


def _diff(ck_a: Checkpoint, ck_b: Checkpoint, rules: list[NameRule], *, atol: float, rtol: float,
          names: Sequence[str] | None, cast: str | None, objects: bool, block_bytes: int | None, threads: int,
          progress: Callable[[int], None] | None, team: Team) -> DiffReport:
    map_a, map_b = aligned_names(list(ck_a), rules, "a"), aligned_names(list(ck_b), rules, "b")
    wanted = list(dict.fromkeys([*map_a, *map_b])) if names is None else list(names)
    report = DiffReport(str(ck_a.path), str(ck_b.path), atol, rtol, [r.text for r in rules])
    remote = any(ck.storage is not None and not ck.storage.mappable for ck in (ck_a, ck_b))
    if block_bytes is None:
        block_bytes = REMOTE_BLOCK_BYTES if remote else DEFAULT_BLOCK_BYTES

    def compare(name: str) -> TensorDiff:
        ta = ck_a[map_a[name]] if name in map_a else None
        tb = ck_b[map_b[name]] if name in map_b else None
        return compare_tensors(name, ta, tb, atol=atol, rtol=rtol, cast=cast, block_bytes=block_bytes,
                               progress=progress, ahead=REMOTE_FETCHES_AHEAD,
                               fetch_bytes=REMOTE_FETCH_BYTES if remote else 0)

    mine = share(team, {name: _work(ck_a, map_a.get(name), ck_b, map_b.get(name)) for name in wanted})

    def compare_share() -> tuple[list[TensorDiff], list[ObjectDiff]]:
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
            tensors = list(pool.map(compare, [name for name in wanted if name in mine]))
        if not objects or names is not None or team.rank != 0:
            return tensors, []
        return tensors, compare_objects(ck_a, ck_b, aligned_names(list(ck_a.objects), rules, "a"),
                                        aligned_names(list(ck_b.objects), rules, "b"))

    parts = team.each(compare_share)
    report.tensors = sorted((t for tensors, _ in parts for t in tensors), key=_severity)
    report.objects = [o for _, found in parts for o in found]
    return report


def _work(ck_a: Checkpoint, name_a: str | None, ck_b: Checkpoint, name_b: str | None) -> int:
    """The bytes comparing a tensor reads: none when one side lacks it or the shapes differ."""
    if name_a is None or name_b is None:
        return 0
    a, b = ck_a[name_a], ck_b[name_b]
    return a.nbytes + b.nbytes if a.shape == b.shape else 0


def _severity(t: TensorDiff) -> tuple:
    return STATUS_ORDER.index(t.status), -(t.rel_l2 or 0.0), -(t.max_abs or 0.0), t.name


def compare_tensors(name: str, a: LogicalTensor | None, b: LogicalTensor | None, *, atol: float = 0.0,
                    rtol: float = 0.0, cast: str | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES,
                    progress: Callable[[int], None] | None = None, ahead: int = 0, fetch_bytes: int = 0) -> TensorDiff:
    """Compare two logical tensors block by block (either may be missing). With `fetch_bytes` (a remote side), blocks
    are fetched that many bytes (as stored) at a time, both sides at once, `ahead` fetches ahead of the one compared."""
    if a is None or b is None:
        if a is not None:
            return TensorDiff(name, "only_a", name_a=a.name, dtype_a=a.dtype, shape_a=a.shape)
        assert b is not None, "at least one side holds the tensor"
        return TensorDiff(name, "only_b", name_b=b.name, dtype_b=b.dtype, shape_b=b.shape)
    base = _Sides(name_a=a.name, name_b=b.name, dtype_a=a.dtype, dtype_b=b.dtype, shape_a=a.shape, shape_b=b.shape)
    if a.shape != b.shape:
        return TensorDiff(name, "shape_mismatch", **base)
    check_scannable(a)
    check_scannable(b)
    cast = cast if cast and dtypes.is_floating(a.dtype) else None  # a dtype conversion leaves integers alone
    if cast:
        base["dtype_a"] = cast  # the dtype actually compared
    cast_dtype = dtypes.numpy_dtype(cast) if cast else None
    same_dtype = base["dtype_a"] == b.dtype
    boxes = list(aligned_blocks(a, b, block_bytes))
    itemsize = max(a.numpy_dtype.itemsize, b.numpy_dtype.itemsize, cast_dtype.itemsize if cast_dtype else 0)
    groups = fetch_groups(boxes, fetch_bytes // itemsize) if fetch_bytes else [(box, [box]) for box in boxes]
    reported = 0  # blocks already counted in progress
    if same_dtype:
        differs = False
        for _box, block_a, block_b in _blocks_ahead(a, b, groups, cast_dtype, ahead, bool(fetch_bytes)):
            reported += 1
            if progress is not None:
                progress(block_b.nbytes)
            if not _same_bytes(block_a, block_b):
                differs = True  # the numeric pass below reads every block again, so stop here
                break
            del block_a, block_b  # views of a fetched group: let go of before the next group is fetched
        if not differs:
            # bitwise equal: the figures are exact without a numeric pass (cosine of identical vectors is 1)
            return TensorDiff(name, "equal", **base, max_abs=0.0, max_rel=0.0, rel_l2=0.0,
                              cosine=1.0 if a.numel else None)
    accumulator = _NumericAccumulator(a.shape, atol, rtol)
    for i, (box, block_a, block_b) in enumerate(_blocks_ahead(a, b, groups, cast_dtype, ahead, bool(fetch_bytes))):
        accumulator.add(box, block_a, block_b)
        if progress is not None and i >= reported:
            progress(block_b.nbytes)
        del block_a, block_b
    figures = accumulator.result()
    if not same_dtype:
        status = "dtype_mismatch"
    elif figures["mismatches"] == 0:
        status = "close"
    else:
        status = "different"
    return TensorDiff(name, status, **base, **figures)


class _Sides(TypedDict):
    """The TensorDiff fields that describe both tensors."""

    name_a: str
    name_b: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]


def _blocks_ahead(a: LogicalTensor, b: LogicalTensor, groups: list[tuple[Box, list[Box]]], cast: np.dtype | None,
                  ahead: int, remote: bool) -> Iterator[tuple[Box, np.ndarray, np.ndarray]]:
    """(box, a's block, b's block) for every box of every (fetched box, its boxes) group, in order. From a `remote`
    side, both sides of a group are fetched at once, and of `ahead` next groups while one is compared: reads wait on
    round trips, comparing on the CPU, so they overlap, and reads in flight hide each other's latency."""
    if not remote:
        for _, inside in groups:
            for box in inside:
                yield box, _read(a, box, cast), b.read(box)
        return
    with ThreadPoolExecutor(max_workers=2 * (ahead + 1)) as pool:
        pending: deque[tuple[Box, list[Box], Future[np.ndarray], Future[np.ndarray]]] = deque()
        upcoming = iter(groups)
        try:
            while True:  # the caller holds no block of the group before (memory): it is fetching the next
                for box, inside in itertools.islice(upcoming, ahead + 1 - len(pending)):
                    pending.append((box, inside, pool.submit(_read, a, box, cast), pool.submit(b.read, box)))
                if not pending:
                    return
                fetched, inside, future_a, future_b = pending.popleft()
                values_a, values_b = future_a.result(), future_b.result()
                for box in inside:  # views of the fetched values, no copies
                    within = tuple(slice(s.start - f.start, s.stop - f.start) for s, f in zip(box, fetched))
                    yield box, values_a[within + (Ellipsis,)], values_b[within + (Ellipsis,)]
                del values_a, values_b, future_a, future_b
        finally:  # the caller stopped early (a difference found), or a read failed: the reads ahead are not needed
            for future in itertools.chain.from_iterable(futures for _, _, *futures in pending):
                future.cancel()


def fetch_groups(boxes: list[Box], limit: int) -> list[tuple[Box, list[Box]]]:
    """(joined box, its boxes): consecutive boxes that continue each other along one axis, within `limit` elements."""
    groups: list[tuple[Box, list[Box]]] = []
    for box in boxes:
        last = groups[-1][0] if groups else ()
        differ = [d for d, (s, t) in enumerate(zip(last, box)) if s != t]
        if len(differ) == 1 and box[differ[0]].start == last[differ[0]].stop:
            d = differ[0]
            joined = last[:d] + (slice(last[d].start, box[d].stop),) + last[d + 1:]
            if math.prod(s.stop - s.start for s in joined) <= limit:
                groups[-1] = (joined, [*groups[-1][1], box])
                continue
        groups.append((box, [box]))
    return groups


def _read(tensor: LogicalTensor, box: Box, cast: np.dtype | None) -> np.ndarray:
    values = tensor.read(box)
    return values.astype(cast) if cast is not None and values.dtype != cast else values


def _same_bytes(x: np.ndarray, y: np.ndarray) -> bool:
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    bx = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    by = np.ascontiguousarray(y).reshape(-1).view(np.uint8)
    words = bx.size // 8 * 8  # comparing 8-byte words runs about 3x faster than bytes
    return bool(np.array_equal(bx[:words].view(np.uint64), by[:words].view(np.uint64))
                and np.array_equal(bx[words:], by[words:]))


def aligned_blocks(a: LogicalTensor, b: LogicalTensor, block_bytes: int) -> Iterator[tuple[slice, ...]]:
    """Boxes covering the tensor once, each inside one chunk of a and one chunk of b, each under the budget."""
    if not a.shape:
        yield ()
        return
    itemsize = max(a.numpy_dtype.itemsize, b.numpy_dtype.itemsize, 8)  # blocks are upcast to float64
    limit = max(1, block_bytes // itemsize)
    cuts = [sorted({0, n} | _chunk_edges(a, d) | _chunk_edges(b, d)) for d, n in enumerate(a.shape)]
    for cell in _cells(cuts):
        yield from split_box(cell, limit)


def _chunk_edges(tensor: LogicalTensor, dim: int) -> set[int]:
    edges: set[int] = set()
    for c in tensor.tiling:
        edges.add(c.offsets[dim])
        edges.add(c.offsets[dim] + c.shape[dim])
    return edges


def _cells(cuts: list[list[int]]) -> Iterator[tuple[slice, ...]]:
    """The grid of boxes between consecutive cut points of every dimension."""
    intervals = [[slice(lo, hi) for lo, hi in zip(c, c[1:]) if hi > lo] for c in cuts]
    return itertools.product(*intervals)


class _NumericAccumulator:
    """Error figures over blocks, in float64."""

    def __init__(self, shape: tuple[int, ...], atol: float, rtol: float):
        self.shape, self.atol, self.rtol = shape, atol, rtol
        self.numel = math.prod(shape)
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.diff_sq = self.a_sq = self.b_sq = self.dot = 0.0
        self.mismatches = self.nan_mismatches = 0
        self.worst: tuple[float, tuple[int, ...], float, float] | None = None

    def add(self, box: tuple[slice, ...], block_a: np.ndarray, block_b: np.ndarray) -> None:
        x = _as_float64(block_a).reshape(-1)
        y = _as_float64(block_b).reshape(-1)
        if np.isfinite(x).all() and np.isfinite(y).all():
            self._add_finite(box, block_a.shape, x, y)
            return
        nan_x, nan_y = np.isnan(x), np.isnan(y)
        one_nan = nan_x != nan_y
        both_nan = nan_x & nan_y
        same_inf = np.isinf(x) & (x == y)
        with np.errstate(invalid="ignore"):  # inf - inf: handled by the masks below
            delta = np.abs(x - y)
        delta[both_nan | same_inf] = 0.0
        delta[one_nan] = np.inf
        # a NaN or infinite b must not make the tolerance NaN or infinite
        magnitude = np.where(np.isfinite(y), np.abs(y), 0.0)
        outside = delta > (self.atol + self.rtol * magnitude)
        self.mismatches += int(outside.sum())
        self.nan_mismatches += int(one_nan.sum())
        finite = np.isfinite(x) & np.isfinite(y)
        if finite.any():
            fx, fy, fd = x[finite], y[finite], delta[finite]
            self.diff_sq += _dot(fd, fd)
            self.a_sq += _dot(fx, fx)
            self.b_sq += _dot(fy, fy)
            self.dot += _dot(fx, fy)
            with np.errstate(divide="ignore", invalid="ignore"):
                relative = np.where(fd == 0, 0.0, fd / np.abs(fy))
            self.max_rel = max(self.max_rel, float(relative.max()))
        self._track_worst(box, block_a.shape, x, y, delta)

    def _add_finite(self, box: tuple[slice, ...], shape: tuple[int, ...], x: np.ndarray, y: np.ndarray) -> None:
        """The common case, with as few float64 temporaries as possible (memory and time)."""
        delta = np.subtract(x, y)
        np.abs(delta, out=delta)
        magnitude = np.abs(y)
        self.diff_sq += _dot(delta, delta)
        self.a_sq += _dot(x, x)
        self.b_sq += _dot(y, y)
        self.dot += _dot(x, y)
        if self.rtol:
            tolerance = magnitude * self.rtol
            tolerance += self.atol
            self.mismatches += int(np.count_nonzero(delta > tolerance))
            del tolerance
        else:
            self.mismatches += int(np.count_nonzero(delta > self.atol))
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(delta, magnitude, out=magnitude, where=delta > 0)  # 0/0 positions keep |y|: masked next
        magnitude[delta == 0] = 0.0
        if magnitude.size:
            self.max_rel = max(self.max_rel, float(magnitude.max()))
        self._track_worst(box, shape, x, y, delta)

    def _track_worst(self, box: tuple[slice, ...], shape: tuple[int, ...], x: np.ndarray, y: np.ndarray,
                     delta: np.ndarray) -> None:
        if not delta.size:
            return
        flat = int(np.argmax(delta))
        value = float(delta[flat])
        if self.worst is None or value > self.worst[0]:
            local = np.unravel_index(flat, shape) if shape else ()
            index = tuple(int(s.start + i) for s, i in zip(box, local))
            self.worst = (value, index, float(x[flat]), float(y[flat]))
        self.max_abs = max(self.max_abs, value)

    def result(self) -> dict[str, Any]:
        norm_b = math.sqrt(self.b_sq)
        norm_a = math.sqrt(self.a_sq)
        worst = self.worst
        return {
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "rel_l2": math.sqrt(self.diff_sq) / norm_b if norm_b else (0.0 if self.diff_sq == 0 else math.inf),
            "cosine": self.dot / (norm_a * norm_b) if norm_a and norm_b else None,
            "mismatches": self.mismatches,
            "mismatch_fraction": self.mismatches / self.numel if self.numel else 0.0,
            "nan_mismatches": self.nan_mismatches,
            "worst_index": worst[1] if worst and worst[0] > 0 else None,
            "worst_a": worst[2] if worst and worst[0] > 0 else None,
            "worst_b": worst[3] if worst and worst[0] > 0 else None,
        }


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    """x · y, summed the same way whatever the thread count: np.dot goes to a BLAS whose threads split the sum
    differently (the last bits of the figures would change with OMP_NUM_THREADS, e.g. under torchrun); einsum's
    own loop runs as fast on one core."""
    return float(np.einsum("i,i->", x, y))


def _as_float64(values: np.ndarray) -> np.ndarray:
    if values.dtype == np.bool_:
        return values.astype(np.float64)
    if np.issubdtype(values.dtype, np.complexfloating):
        raise CheckpointError("complex tensors are not compared yet")
    return values.astype(np.float64)
