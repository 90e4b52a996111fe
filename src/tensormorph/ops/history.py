"""A run's history: every checkpoint of a folder in order, its health, and how far each moved from the one before.

A run is a Checkpointer root (`step-NNNNNNNN` folders whose manifests carry a training record) or any folder of
checkpoints in formats `tensormorph.open` reads, ordered by the step number in their names, else by time; local, or
under an object store's URL (then every size and version is asked afresh, and the cache is kept locally).
Per checkpoint: step, time, size, the Checkpointer's record (its commit number and the caller's `extra` metrics)
and a status from a quick verify (the manifest, and every data file present with its recorded size; no checksum
pass). Per consecutive pair of readable checkpoints (history_drift): each layer's relative update ‖b - a‖/‖a‖,
NaN and infinity counts, dtype and shape changes. Pairs are cached in a JSON file by both checkpoints' identities.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import crc32c

from ..core import Checkpoint
from ..errors import CheckpointError, MissingFileError, UncommittedCheckpointError, UnknownFormatError
from ..formats import open_checkpoint
from ..storage import AnyPath, ByteStore, RemotePath, as_path, entries, is_url, open_regular, store_at
from ..storage.range_cache import default_cache_folder
from ..tmformat.checkpoint import read_manifest
from ..tmformat.manifest import FORMAT, MANIFEST, MAX_MANIFEST_BYTES, SAVE_MARKER, TEMP_PREFIX, Manifest
from .history_drift import (
    DriftCache,
    PairDrift,
    ReadFailure,
    TensorChange,
    pair_drift,
    pair_key,
    relative,
    weights,
)

__all__ = ["CACHE_FILE", "CheckpointRecord", "History", "LayerDrift", "NonFinite", "history"]

TRAIN_KEY = "tensormorph.train"  # the Checkpointer's record in a manifest's extra (train.manager.TRAIN_KEY)
ABANDONED_PREFIX = "abandoned-"  # a checkpoint a rollback set aside (train.manager.ABANDONED_PREFIX)
CACHE_FILE = ".tensormorph-history.json"  # in the run's folder, unless a cache folder is given
SAVES_FILE = ".tensormorph-saves.jsonl"  # the Checkpointer's record of saves (train.records.SAVES_FILE)
ROLLBACK_FILE = ".tensormorph-rollback.json"  # the last rollback's marker (train.rollback.ROLLBACK_FILE)
MAX_MARKER_BYTES = 4 << 20  # the most of that marker read (train.rollback.MAX_MARKER_BYTES)
REMOTE_CACHE_FOLDER = "history"  # under the range cache's folder: the caches of runs on object stores
MAX_SAVES_BYTES = 16 << 20  # the end of that record read: ~150,000 saves
MODEL_PREFIX = "model."  # a training checkpoint's weights: drift leaves optimizer state out
_NUMBER = re.compile(r"\d+")
_STEP_FOLDER = re.compile(r"step-\d{8,}")  # a Checkpointer's checkpoint folder


@dataclass(frozen=True)
class LayerDrift:
    layer: str
    relative: float | None  # ‖b - a‖ / ‖a‖ over the layer's tensors; None when a is all zeros
    delta_norm: float
    weight_norm: float
    tensors: int


@dataclass(frozen=True)
class NonFinite:
    """The first checkpoint where a tensor holds NaN or infinite values."""

    tensor: str
    step: int | None
    checkpoint: str
    nans: int
    infs: int


@dataclass
class CheckpointRecord:
    name: str  # the entry's name in the run folder
    path: str
    step: int | None
    time: float  # seconds since the epoch: the save's start (Checkpointer) or the entry's modification time
    size: int  # bytes of the files present
    status: str  # "committed", "incomplete", "damaged" or "abandoned"
    problem: str | None = None  # what is wrong, for incomplete and damaged ones
    seq: int | None = None  # the Checkpointer's commit number
    format: str | None = None
    redundancy: str | None = None  # a Tensormorph checkpoint's parity or copies ("rs(4,2)", "replicate:2")
    metrics: dict[str, float] = field(default_factory=dict)  # the caller's numeric `extra`, flattened with dots
    previous: str | None = None  # the checkpoint the drift is measured from (the last readable one before)
    drift: list[LayerDrift] | None = None  # per layer, in the order of the model
    total_drift: float | None = None  # ‖b - a‖ / ‖a‖ over every layer
    nonfinite: dict[str, tuple[int, int]] = field(default_factory=dict)  # tensor -> (NaNs, infinities)
    changes: list[TensorChange] = field(default_factory=list)
    cached: bool = False  # the drift came from the cache
    tiers: list[str] | None = None  # from the Checkpointer's record of saves: where the save went
    blocked_s: float | None = None  # how long it held up training
    durable_s: float | None = None  # from the call to the commit

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckpointRecord:
        fields = dict(data)
        fields["drift"] = None if data["drift"] is None else [LayerDrift(**d) for d in data["drift"]]
        fields["nonfinite"] = {k: (int(v[0]), int(v[1])) for k, v in data["nonfinite"].items()}
        fields["changes"] = [TensorChange(**c) for c in data["changes"]]
        return cls(**fields)


@dataclass
class History:
    run: str
    checkpoints: list[CheckpointRecord]  # in order
    sample: int | None = None  # blocks read per tensor; set, the drift figures are estimates
    first_nonfinite: list[NonFinite] = field(default_factory=list)  # per tensor, in order of appearance
    cache_file: str | None = None
    cache_hits: int = 0  # pairs taken from the cache
    computed: int = 0  # pairs read from the checkpoints
    cache_error: str | None = None  # why the cache could not be written

    @property
    def estimate(self) -> bool:
        return self.sample is not None

    def most_moved(self, count: int = 5) -> list[tuple[str, str, float]]:
        """The `count` largest per-layer relative updates over the run: (layer, checkpoint name, drift)."""
        moves = [(d.layer, c.name, d.relative) for c in self.checkpoints for d in c.drift or ()
                 if d.relative is not None]
        return sorted(moves, key=lambda m: -m[2])[:count]

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "sample": self.sample, "estimate": self.estimate,
                "checkpoints": [c.to_dict() for c in self.checkpoints],
                "first_nonfinite": [asdict(n) for n in self.first_nonfinite],
                "most_moved": [list(m) for m in self.most_moved()], "cache_file": self.cache_file,
                "cache_hits": self.cache_hits, "computed": self.computed, "cache_error": self.cache_error}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> History:
        return cls(data["run"], [CheckpointRecord.from_dict(c) for c in data["checkpoints"]], data["sample"],
                   [NonFinite(**n) for n in data["first_nonfinite"]], data["cache_file"], data["cache_hits"],
                   data["computed"], data["cache_error"])

    def _repr_html_(self) -> str:  # notebooks: a layer above (pyproject's ignore_imports says why)
        from ..notebook import history_html
        return history_html(self)


def history(run: str | os.PathLike[str], *, sample: int | None = None, cache: bool = True,
            cache_dir: str | os.PathLike[str] | None = None, threads: int = 2,
            progress: Callable[[int, int], None] | None = None,
            storage_options: dict[str, Any] | None = None) -> History:
    """The history of the run in the folder `run`, local or a URL (see the module's notes). `sample` reads that many
    blocks of each tensor (the same ones every time) for an estimate; `cache=False` neither reads nor writes the
    cache, kept in the run folder (a run on an object store: in the local cache folder, range_cache's
    `default_cache_folder()/history`) or, with `cache_dir`, in that folder. `progress` receives (pairs done, pairs
    in all); `storage_options` go to fsspec for a URL."""
    if sample is not None and sample < 1:
        raise CheckpointError(f"sample must be at least 1 block per tensor, got {sample}")
    root = _root(run, storage_options)
    if not root.is_dir():
        raise MissingFileError("is not a folder of checkpoints", file=str(root))
    if (root / MANIFEST).exists():
        raise CheckpointError("is one checkpoint, not a run: give the folder that holds the checkpoints",
                              file=str(root))
    records, manifests = _records(root)
    if isinstance(root, Path):  # the Checkpointer keeps its record of saves on the local disk only
        _attach_saves(root, records)
    cache_path = None
    if cache:
        cache_path = root / CACHE_FILE if cache_dir is None and isinstance(root, Path) else \
            Path(cache_dir if cache_dir is not None else default_cache_folder() / REMOTE_CACHE_FOLDER) / \
            f"history-{hashlib.sha256(str(root).encode()).hexdigest()[:16]}.json"
    store = DriftCache(cache_path)
    result = History(str(root), records, sample, cache_file=None if cache_path is None else str(cache_path))
    chain = [r for r in records if r.status == "committed"]
    previous: tuple[CheckpointRecord, Checkpoint, str] | None = None
    identities: set[str] = set()  # of the readable checkpoints: cached pairs of others are dropped
    try:
        for done, record in enumerate(chain):
            ck = _open(record, root / record.name)
            if ck is None:
                continue
            try:
                current = (record, ck, _identity(ck, manifests.get(record.path)))
                identities.add(current[2])
                failed = None if previous is None else _compare(previous, current, store, result, sample, threads)
            except BaseException:
                ck.close()
                raise
            if progress is not None and done:
                progress(done, len(chain) - 1)
            if failed == "b":  # the last readable one stays side a of the next pair
                ck.close()
                continue
            if previous is not None:
                previous[1].close()
            previous = current
    finally:
        if previous is not None:
            previous[1].close()
    _first_nonfinite(result)
    if cache:
        store.save(identities)
        result.cache_error = store.error
    return result


def _root(run: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> AnyPath:
    """The run's folder: a local path made absolute, or a URL whose sizes and versions will all be asked afresh."""
    if not is_url(run):
        return Path(run).absolute()
    root = as_path(run, storage_options)
    if isinstance(root, RemotePath):
        # a run changes under its URL: no listing, size or version is taken from the range cache's records (trusted
        # for a while without asking), so each checkpoint's identity is that of the objects there now
        root.remote.forget(root.url)
    return root


def _open(record: CheckpointRecord, place: AnyPath) -> Checkpoint | None:
    """The record's checkpoint, opened from `place`: a quick verify (headers, every file present and whole). When
    that fails, the record says damaged and None is returned."""
    try:
        ck = open_checkpoint(place)
    except CheckpointError as exc:
        record.status, record.problem = "damaged", str(exc)
        return None
    damaged = ck.metadata.get("damaged_files")
    if damaged:  # with parity it opens, but reads of those files fail until it is repaired
        record.status = "damaged"
        record.problem = "; ".join(f"{name}: {why}" for name, why in sorted(damaged.items())) + \
            " (its redundancy can rebuild it: tensormorph repair)"
        ck.close()
        return None
    record.format = ck.format
    return ck


def _compare(previous: tuple[CheckpointRecord, Checkpoint, str], current: tuple[CheckpointRecord, Checkpoint, str],
             store: DriftCache, result: History, sample: int | None, threads: int) -> str | None:
    """The drift of `current` from `previous`, from the cache or read; the side ("a" or "b") whose read failed."""
    (before, ck_a, id_a), (record, ck_b, id_b) = previous, current
    prefix = MODEL_PREFIX if all(r.seq is not None for r in (before, record)) else ""
    key = pair_key(id_a, id_b, f"{prefix or '*'}:{f'sample{sample}' if sample else 'full'}")
    drift = store.get(key)
    record.cached = drift is not None
    if drift is None:
        try:
            drift = pair_drift(weights(ck_a, prefix), weights(ck_b, prefix), sample=sample, threads=threads)
        except ReadFailure as exc:
            damaged = before if exc.side == "a" else record
            damaged.status, damaged.problem = "damaged", str(exc.error)
            return exc.side
        store.put(key, drift)
        result.computed += 1
    else:
        result.cache_hits += 1
    _apply(before, record, drift)
    return None


def _apply(before: CheckpointRecord, record: CheckpointRecord, drift: PairDrift) -> None:
    record.previous = before.name
    record.drift = [LayerDrift(layer, relative(d, w), d ** 0.5, w ** 0.5, n) for layer, (d, w, n) in
                    drift.layers.items()]
    record.total_drift = relative(sum(d for d, _, _ in drift.layers.values()),
                                  sum(w for _, w, _ in drift.layers.values()))
    record.changes = list(drift.changes)
    record.nonfinite = dict(drift.nonfinite_b)
    if before.previous is None:  # the first of the chain: its counts come from its one pair
        before.nonfinite = dict(drift.nonfinite_a)


def _first_nonfinite(result: History) -> None:
    seen: set[str] = set()
    for record in result.checkpoints:
        for tensor, (nans, infs) in record.nonfinite.items():
            if tensor not in seen:
                seen.add(tensor)
                result.first_nonfinite.append(NonFinite(tensor, record.step, record.name, nans, infs))


def _identity(ck: Checkpoint, manifest: bytes | None) -> str:
    """What the checkpoint is, taken afresh: the CRC of a Tensormorph manifest (which holds every data file's
    checksum), else the path, size and modification time of each of its files."""
    if ck.format == FORMAT and manifest is not None:
        return f"tm:{len(manifest)}:{crc32c.crc32c(manifest):08x}"
    files = ck.require_storage()
    listed = sorted(str(files.fingerprint(name)) for name in ck.files)
    return "files:" + hashlib.sha256("\n".join(listed).encode()).hexdigest()[:32]


def _records(root: AnyPath) -> tuple[list[CheckpointRecord], dict[str, bytes]]:
    """Every checkpoint entry of the folder, in order, with the manifest bytes of the Tensormorph ones."""
    records, manifests = [], {}
    abandoned = _abandoned(root)
    for entry in entries(root):
        name = entry.name
        if name.startswith(".") and not name.startswith(TEMP_PREFIX):
            continue  # our cache, the Checkpointer's own files
        try:
            record = CheckpointRecord(name, str(entry), _step_in(name), *_stat(entry), "committed")
        except FileNotFoundError:
            continue  # gone since the listing: a live run's retention, or a save's folder renamed at its commit
        if name.startswith(ABANDONED_PREFIX):
            record.status = "abandoned"
        if entry.is_dir() and ((entry / MANIFEST).exists() or (entry / SAVE_MARKER).exists()):
            raw = _manifest(entry, record)
            if raw is not None:
                manifests[record.path] = raw
            if (record.step, record.seq) in abandoned:  # an object store's abandoned checkpoints stay in place
                record.status = "abandoned"
        elif name.startswith(TEMP_PREFIX):
            continue  # a save's folder before its marker exists: nothing to say yet
        elif _STEP_FOLDER.fullmatch(name) and entry.is_dir():
            record.status, record.problem = "incomplete", f"{entry}: has no {MANIFEST}: the save never committed"
        elif not _is_checkpoint(entry):
            continue
        records.append(record)
    if all(r.step is not None for r in records):
        records.sort(key=lambda r: (r.step, r.seq if r.seq is not None else -1, r.time))
    else:
        records.sort(key=lambda r: r.time)
    return records, manifests


def _abandoned(root: AnyPath) -> set[tuple[int | None, int | None]]:
    """The (step, commit number) pairs the run's rollback marker abandons; none when it has no readable marker (resume
    and `tensormorph list` report a damaged one)."""
    try:
        raw = store_at(root).read_json(ROLLBACK_FILE, MAX_MARKER_BYTES, "rollback marker")
        return {(int(step), int(seq)) for step, seq in raw["abandoned"]}
    except (CheckpointError, KeyError, TypeError, ValueError):
        return set()


def _manifest(folder: AnyPath, record: CheckpointRecord) -> bytes | None:
    """Read a Tensormorph folder's manifest into the record (training record, metrics); its bytes, or None when it
    has none (the record then says incomplete or damaged)."""
    files = store_at(folder)
    try:
        manifest: Manifest = read_manifest(files, str(folder))
        raw = files.read(MANIFEST, 0, min(files.size(MANIFEST), MAX_MANIFEST_BYTES))
    except UncommittedCheckpointError as exc:
        record.status, record.problem = "incomplete", str(exc)
        if name_step := _marker_target_step(files):
            record.step = name_step  # a temporary folder's name is random: its marker names the target
        return None
    except CheckpointError as exc:
        record.status, record.problem = "damaged", str(exc)
        return None
    record.redundancy = manifest.redundancy.scheme if manifest.redundancy is not None else None
    train = manifest.extra.get(TRAIN_KEY)
    if isinstance(train, dict):
        with suppress(KeyError, TypeError, ValueError):  # an incomplete record: the name's step and time stand
            record.step, record.time, record.seq = int(train["step"]), float(train["time"]), int(train["seq"])
        record.metrics = _metrics(manifest.objects.get("extra"))
    record.size = sum(f.size for f in manifest.files.values()) + len(raw)
    return raw


def _attach_saves(root: Path, records: list[CheckpointRecord]) -> None:
    """Each committed checkpoint's save timing from the Checkpointer's record of saves (the last line of its step:
    a step saved again after a rollback was written last). Only the file's last MAX_SAVES_BYTES are read."""
    try:
        descriptor = open_regular(root / SAVES_FILE, follow=False)
    except CheckpointError:
        return  # no record: not a Checkpointer run, or one of an older version
    with os.fdopen(descriptor, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        handle.seek(max(0, size - MAX_SAVES_BYTES))
        lines = handle.read(MAX_SAVES_BYTES).splitlines()[1 if size > MAX_SAVES_BYTES else 0:]
    timings: dict[int, dict[str, Any]] = {}
    for line in lines:
        with suppress(ValueError, TypeError, KeyError, RecursionError):  # a line cut by a crash, or not ours
            entry = json.loads(line)
            timings[int(entry["step"])] = entry
    for record in records:
        entry = timings.get(record.step) if record.status == "committed" and record.step is not None else None
        if entry is not None:
            with suppress(ValueError, TypeError, KeyError):
                record.tiers = [str(t) for t in entry["tiers"]]
                record.blocked_s = float(entry["blocked_s"])
                record.durable_s = None if entry["durable_s"] is None else float(entry["durable_s"])


def _marker_target_step(files: ByteStore) -> int | None:
    try:
        target = json.loads(files.read(SAVE_MARKER, 0, min(files.size(SAVE_MARKER), 4096))).get("target")
    except (CheckpointError, ValueError, AttributeError):
        return None
    return _step_in(Path(target).name) if isinstance(target, str) else None


def _metrics(value: Any, prefix: str = "") -> dict[str, float]:
    """The numbers of the caller's `extra`, nested keys joined with dots."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, int | float):
        return {prefix or "extra": float(value)}
    if not isinstance(value, dict):
        return {}
    found: dict[str, float] = {}
    for key, item in value.items():
        found.update(_metrics(item, f"{prefix}.{key}" if prefix else str(key)))
    return found


def _is_checkpoint(entry: AnyPath) -> bool:
    """A file or folder some reader recognises (a damaged one too: only an unknown format is left out)."""
    try:
        open_checkpoint(entry).close()
    except UnknownFormatError:
        return False
    except CheckpointError:
        return True
    return True


def _step_in(name: str) -> int | None:
    """The step a name carries: the first number of an abandoned checkpoint's (`abandoned-step-N-<commit>`), else
    the last (`checkpoint-1000`, `epoch3-step500`)."""
    if name.startswith(ABANDONED_PREFIX):
        numbers = _NUMBER.findall(name)
        return int(numbers[0]) if numbers else None
    numbers = _NUMBER.findall(name)
    return int(numbers[-1]) if numbers else None


def _stat(entry: AnyPath) -> tuple[float, int]:
    """(modification time, bytes) of a file, or of the files in a folder (its own time; on an object store, which has
    no folders, that of its newest file)."""
    if isinstance(entry, RemotePath):
        try:
            found = entry.remote.fs.find(entry.remote.path(entry.url), detail=True).values()  # one listing request
        except OSError as exc:  # denied, unreachable: named, as local errors are
            raise CheckpointError(f"cannot list the checkpoint's objects: {exc}", file=entry.url) from exc
        return max((_seconds(info) for info in found), default=0.0), sum(int(i.get("size") or 0) for i in found)
    if not entry.is_dir() or entry.is_symlink():
        return entry.lstat().st_mtime, entry.lstat().st_size
    return entry.lstat().st_mtime, sum(p.lstat().st_size for p in entry.rglob("*")
                                       if p.is_file() and not p.is_symlink())


def _seconds(info: dict[str, Any]) -> float:
    """An object's modification time in seconds since the epoch, as its fsspec client gives it; 0 when it gives none."""
    for key in ("LastModified", "mtime", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
    return 0.0
