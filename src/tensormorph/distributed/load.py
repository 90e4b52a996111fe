"""`tensormorph.load`: fill a state dict in place from any checkpoint the library reads, resharding as needed.

Each rank reads only the bytes of the boxes it holds: from a Tensormorph checkpoint through the checked
BoxReader (local or remote), from any other format through its logical tensors' region reads.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import dtypes
from ..core import Checkpoint
from ..errors import StateMismatchError, UnsupportedError
from ..formats import detect, open_checkpoint
from ..gc_pause import gc_paused
from ..geometry import Box
from ..ops.rules import as_targets, rule_list
from ..storage import LocalFiles, RemoteFiles, is_url, local_path
from ..tmformat.checkpoint import is_checkpoint_folder, read_manifest, root_of
from ..tmformat.reader import BoxReader
from ..torch_arrays import as_numpy, to_torch, vocabulary
from .state import Layout, Leaves, Memo, dtensor_types, flatten, held_pieces

READ_THREADS = 8


@dataclass
class LoadReport:
    path: str
    format: str
    missing: list[str] = field(default_factory=list)  # in the state dict, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the state dict
    mismatched: list[str] = field(default_factory=list)  # "name: why"
    tensors_loaded: int = 0
    bytes_needed: int = 0  # bytes of the boxes this rank holds
    bytes_read: int = 0  # bytes this rank read from the checkpoint's data files
    blocks_verified: int = 0  # checksum blocks (64 KiB) checked on the way
    seconds: float = 0.0


def _open_source(path: str | os.PathLike[str], storage_options: dict[str, Any] | None, verify: bool,
                 whole: bool = False) -> tuple[BoxReader | Checkpoint, str]:
    """A BoxReader for the Tensormorph format (local or remote), else a Checkpoint of any other format (local or
    remote); with `whole` (rules see logical tensors), a Checkpoint of any format."""
    if whole or is_url(path) and detect(os.fspath(path), storage_options=storage_options) != "tensormorph":
        checkpoint = open_checkpoint(os.fspath(path), storage_options=storage_options)
        return checkpoint, checkpoint.format
    if is_url(path):
        remote = RemoteFiles(os.fspath(path), storage_options)
        return BoxReader(read_manifest(remote, remote.url), remote, remote.url, verify=verify), "tensormorph"
    local = local_path(path)
    if is_checkpoint_folder(local):
        root = root_of(local)
        files = LocalFiles(root)
        manifest = read_manifest(files, str(root))
        return BoxReader(manifest, files, str(root), verify=verify), "tensormorph"
    checkpoint = open_checkpoint(local)
    return checkpoint, checkpoint.format


def load(path: str | os.PathLike, state_dict: dict[str, Any], *, strict: bool = True, verify: bool = True,
         cast: bool = False, process_group: Any = None, storage_options: dict[str, Any] | None = None,
         rules: str | Sequence[Any] | None = None, rename: Sequence[str] | None = None,
         transpose: Sequence[str] | None = None) -> LoadReport:
    """Fill `state_dict` in place from any checkpoint the library reads, resharding as needed.

    Tensors are filled in place; each DTensor's local shard is read from exactly the bytes that hold
    its box, whatever mesh and world size saved it. Plain values are replaced in their containers.
    Strict: missing or unexpected keys and shape or dtype mismatches raise one StateMismatchError
    listing every offender; with strict=False they are skipped and listed in the report. dtypes are
    converted only with cast=True. With verify, block checksums of the Tensormorph format are checked (always when
    `rules`, `rename` or `transpose` are given: the checkpoint is then read as logical tensors, which check them).

    `rules` (a rule set such as 'flax-torch', or a rule file), `rename` and `transpose` align names and layouts as
    diff's do (docs/diff-rules.md), with the checkpoint as side a and the state dict as side b: a Flax kernel fills
    the transposed torch weight, read lazily, chunk by chunk. The report names the state dict's tensors; an
    unexpected checkpoint name is shown with its aligned name, 'params.x.kernel (as x.weight)'.
    """
    del process_group  # loading needs no collectives: every rank reads its own boxes
    with gc_paused():  # tens of thousands of records, no cycles among them: the collector would rescan them
        return _load(path, state_dict, strict, verify, cast, storage_options, rules, rename, transpose)


def _load(path: str | os.PathLike, state_dict: dict[str, Any], strict: bool, verify: bool, cast: bool,
          storage_options: dict[str, Any] | None, rules: str | Sequence[Any] | None, rename: Sequence[str] | None,
          transpose: Sequence[str] | None) -> LoadReport:
    started = time.perf_counter()
    leaves = flatten(state_dict)
    steps = rule_list(rules, rename, transpose) if rules or rename or transpose else None
    source, format_name = _open_source(path, storage_options, verify, whole=steps is not None)
    report = LoadReport(os.fspath(path), format_name)
    try:
        objects: dict[str, Any]  # plain values from a manifest, loaders from other formats
        unmatched: list[str] = []
        if steps is not None:
            assert isinstance(source, Checkpoint)
            targets = as_targets(source, steps, {n: t.dim() for n, t in leaves.tensors.items()}, list(leaves.objects))
            source, unmatched = targets.checkpoint, targets.unmatched
        if isinstance(source, BoxReader):
            stored = {n: (r.dtype, r.shape) for n, r in source.manifest.tensors.items()}
            objects = source.manifest.objects
        else:
            stored = {n: (t.dtype, t.shape) for n, t in source.tensors.items()}
            objects = _regroup({n: o.value for n, o in source.objects.items()}, leaves.objects)
        work = _match(leaves, stored, objects, report, cast)
        report.unexpected += unmatched
        if (report.missing or report.unexpected or report.mismatched) and strict:
            raise StateMismatchError(_mismatch_message(report), file=os.fspath(path), missing=report.missing,
                                     unexpected=report.unexpected, mismatched=report.mismatched)
        dtensor = dtensor_types()
        jobs = []
        memo: Memo = {}
        with torch.no_grad():  # DTensor.to_local is then a plain attribute read, not an autograd call per tensor
            for name in work:
                held, layout = held_pieces(name, leaves.tensors[name], dtensor, memo)
                for part in held:
                    jobs.append(_Job(name, part.box, part.data, _wanted(name, layout, part.contribution, source)))
                    report.bytes_needed += math.prod(part.box[1]) * dtypes.itemsize(stored[name][0])
        tasks: list[Callable[[], None]] = []
        if isinstance(source, BoxReader):  # boxes that are small whole chunks: a few coalesced reads
            direct = [k for k, job in enumerate(jobs) if _in_place(job, stored[job.name][0])]
            batches, others = source.whole_chunk_reads(
                [(jobs[k].name, jobs[k].box, as_numpy(jobs[k].local.detach(), stored[jobs[k].name][0]),
                  _contribution(jobs[k])) for k in direct])
            tasks += [functools.partial(source.read_whole, batch) for batch in batches]
            coalesced = set(direct) - {direct[k] for k in others}
            jobs = [job for k, job in enumerate(jobs) if k not in coalesced]
        tasks += [functools.partial(_fill, job, stored[job.name][0], source) for job in jobs]
        with ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(lambda task: task(), tasks))
        report.tensors_loaded = len(work)
        for name, (container, key) in leaves.slots.items():
            if name in objects and not isinstance(container, tuple):
                value = objects[name]
                container[key] = value if isinstance(source, BoxReader) else value()
        if isinstance(source, BoxReader):
            report.bytes_read, report.blocks_verified = source.bytes_read, source.blocks_verified
        else:
            report.bytes_read = report.bytes_needed
    finally:
        source.close()
    report.seconds = time.perf_counter() - started
    return report


def _regroup(loaders: dict[str, Callable[[], Any]], wanted: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """Other formats (DCP) flatten nested plain values into dotted names; gather them back into one dict
    for each name the state dict holds whole ("config" from "config.lr", "config.betas", ...)."""
    grouped = dict(loaders)
    for name in wanted:
        if name in loaders:
            continue
        parts = {n[len(name) + 1:]: grouped.pop(n) for n in list(grouped) if n.startswith(name + ".")}
        if parts:
            def nested(parts: dict[str, Callable[[], Any]] = parts) -> dict[str, Any]:
                out: dict[str, Any] = {}
                for path, load in parts.items():
                    *outer, last = path.split(".")
                    node = out
                    for key in outer:
                        node = node.setdefault(key, {})
                    node[last] = load()
                return out
            grouped[name] = nested
    return grouped


def _match(leaves: Leaves, stored: dict[str, tuple[str, tuple[int, ...]]], objects: dict[str, Any],
           report: LoadReport, cast: bool) -> list[str]:
    """The tensors to load; fills the report's missing / unexpected / mismatched lists."""
    work = []
    for name, tensor in leaves.tensors.items():
        if name not in stored:
            report.missing.append(name)
            continue
        dtype, shape = stored[name]
        if tuple(tensor.shape) != tuple(shape):
            report.mismatched.append(f"{name}: shape {list(shape)} in the checkpoint, {list(tensor.shape)} in the "
                                     "state dict")
        elif vocabulary(tensor.dtype) != dtype and not cast:
            report.mismatched.append(f"{name}: dtype {dtype} in the checkpoint, {vocabulary(tensor.dtype)} in the "
                                     "state dict (pass cast=True to convert)")
        else:
            work.append(name)
    report.missing += [name for name in leaves.objects if name not in objects]
    report.mismatched += [f"{name}: a plain value inside a tuple cannot be replaced in place (use a list)"
                          for name, (container, _) in leaves.slots.items()
                          if name in objects and isinstance(container, tuple)]
    report.unexpected += [name for name in stored if name not in leaves.tensors]
    report.unexpected += [name for name in objects if name not in leaves.objects]
    return work


def _mismatch_message(report: LoadReport) -> str:
    parts = []
    for label, names in (("missing from the checkpoint", report.missing),
                         ("not in the state dict", report.unexpected), ("mismatched", report.mismatched)):
        if names:
            shown = ", ".join(names[:20]) + (f" ... and {len(names) - 20} more" if len(names) > 20 else "")
            parts.append(f"{len(names)} {label}: {shown}")
    return "state dict and checkpoint disagree; " + "; ".join(parts) + " (strict=False loads what matches)"


@dataclass(frozen=True)
class _Job:
    name: str
    box: Box
    local: torch.Tensor  # the view of the local tensor that holds the box
    wanted: str | int  # "value", "identity" (a Partial target's neutral share), or a stored contribution


def _wanted(name: str, layout: Layout, contribution: int, source: BoxReader | Checkpoint) -> str | int:
    """What a target box receives. A Partial target on the layout it was saved with gets its own contribution;
    any other Partial target gets the reduced value, split so that its reduction is that value exactly: under sum
    the first contribution holds it and the others -0.0 (x + -0.0 == x for every x), under min and max all hold it."""
    if layout.reduce_op is None:
        return "value"
    record = source.manifest.tensors[name] if isinstance(source, BoxReader) else None
    saved = record.reduction if record is not None else None
    if (saved is not None and record is not None and (saved.op, saved.contributions) == (layout.reduce_op,
                                                                                         layout.contributions)
            and record.mesh == layout.mesh and record.placements == layout.placements):
        return contribution
    if layout.reduce_op == "avg" and layout.contributions > 1:
        raise UnsupportedError(f"loading into Partial(avg) over {layout.contributions} contributions needs a "
                               "checkpoint saved with the same mesh and placements (an even split of the value "
                               "would not average back to it exactly); load into Replicate or Shard instead",
                               tensor=name)
    return "identity" if layout.reduce_op == "sum" and contribution else "value"


def _contribution(job: _Job) -> int | None:
    """The one contribution a job reads as stored, or None for the reduced value."""
    return job.wanted if isinstance(job.wanted, int) else None


def _in_place(job: _Job, stored_dtype: str) -> bool:
    """Whether a job reads its stored bytes straight into its local tensor's memory (see _fill)."""
    local = job.local
    return (job.wanted != "identity" and local.device.type == "cpu" and local.is_contiguous()
            and vocabulary(local.dtype) == stored_dtype)


def _fill(job: _Job, stored_dtype: str, source: BoxReader | Checkpoint) -> None:
    """Read one box into its local tensor: in place when the tensor's memory can take the bytes directly."""
    name, box, local = job.name, job.box, job.local
    if job.wanted == "identity":
        with torch.no_grad():
            local.fill_(-0.0)
        return
    contribution = _contribution(job)
    if isinstance(source, Checkpoint):
        index = tuple(slice(o, o + n) for o, n in zip(*box))
        data = source[name].read(index, budget=max(1, int(np.prod(box[1])) * dtypes.itemsize(stored_dtype)))
    elif _in_place(job, stored_dtype):
        source.read_box(name, box, as_numpy(local.detach(), stored_dtype), contribution)
        return
    else:
        data = np.empty(box[1], dtypes.numpy_dtype(stored_dtype))
        source.read_box(name, box, data, contribution)
    with torch.no_grad():
        local.copy_(to_torch(data, stored_dtype))
