"""Sharded save and load on torch.distributed: `tensormorph.save` and `tensormorph.load`.

Every rank calls `save(state_dict, path)`; each writes the chunks it was
chosen for into its own safetensors file, in parallel, and one rank commits
the manifest. `load(path, state_dict)` fills tensors and DTensors in place on
any mesh and world size: each rank reads only the bytes of the boxes it
holds. Coordination uses torch.distributed collectives on the default group
(or the one given); without an initialised process group both run in one
process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import dtypes
from .boxread import BoxReader
from .core import Checkpoint
from .errors import CheckpointError, StateMismatchError, UncommittedCheckpointError, UnsupportedError
from .formats import open_checkpoint
from .formats import tensormorph as tm_format
from .layout import Box
from .locations import RemoteFiles, destination, is_url, store
from .manifest import MANIFEST, MAX_MANIFEST_BYTES, decode_value, encode_value, parse, rank_file
from .redundancy import parse_scheme, write_extras
from .saving import Piece, build_manifest, plan_writers, redundancy_record, write_rank_file
from .storage import LocalFiles

__all__ = ["LoadReport", "SaveReport", "load", "save"]

READ_THREADS = 8


# ---- state dicts: flatten to named leaves, remember where each leaf lives --------------------------------

@dataclass
class _Leaves:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # object name -> (container, key)


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > 64:
        return False
    if isinstance(value, dict):
        return any(_holds_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    return False


def _flatten(state: Any) -> _Leaves:
    """Tensors by dotted path; containers without tensors are kept whole as plain values."""
    if not isinstance(state, dict):
        raise TypeError(f"a state dict must be a dict, got {type(state).__name__}")
    leaves = _Leaves()

    def visit(container: Any, key: Any, value: Any, name: str) -> None:
        if isinstance(value, torch.Tensor):
            leaves.tensors[name] = value
        elif isinstance(value, dict) and _holds_tensor(value):
            for k, v in value.items():
                visit(value, k, v, f"{name}.{k}")
        elif isinstance(value, (list, tuple)) and _holds_tensor(value):
            for i, v in enumerate(value):
                visit(value, i, v, f"{name}.{i}")
        else:
            leaves.objects[name] = value
            leaves.slots[name] = (container, key)
        if name in leaves.tensors and name in leaves.objects:
            raise ValueError(f"two entries of the state dict flatten to the same name {name!r}")

    for key, value in state.items():
        visit(state, key, value, str(key))
    return leaves


# ---- torch <-> numpy without copies ---------------------------------------------------------------------

def _vocabulary(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    try:
        return dtypes.TORCH_DTYPE_NAMES[name]
    except KeyError:
        raise UnsupportedError(f"tensors of dtype {dtype} cannot be stored") from None


def _as_numpy(tensor: torch.Tensor, vocabulary: str) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's memory with the matching (ml_dtypes) dtype."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8).numpy().view(dtypes.numpy_dtype(vocabulary)).reshape(tuple(tensor.shape))


def _dtensor_types() -> tuple[type, ...]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return ()
    return (DTensor,)


def _local_box(name: str, tensor: torch.Tensor, dtensor: tuple[type, ...]) -> tuple[Box, torch.Tensor, dict]:
    """(the box this rank holds, its local data, mesh facts) of a tensor or DTensor."""
    if dtensor and isinstance(tensor, dtensor[0]):
        for p in tensor.placements:
            kind = type(p).__name__
            if kind == "_StridedShard":
                raise UnsupportedError(
                    f"has placement {p} (_StridedShard, from FSDP2 combined with tensor parallelism), whose local "
                    "shard is not one box of the tensor; redistribute it to Shard/Replicate before saving", tensor=name)
            if p.is_partial():
                raise UnsupportedError(f"has placement {p} (Partial): it awaits a reduction and holds no value of "
                                       "its own; reduce it (redistribute to Replicate or Shard) first", tensor=name)
        placements = tuple(f"Shard({p.dim})" if p.is_shard() else "Replicate()" for p in tensor.placements)
        chunk = tensor.__create_chunk_list__()
        if len(chunk) != 1:
            raise UnsupportedError(f"its local shard is {len(chunk)} boxes; only one box per rank is supported",
                                   tensor=name)
        mesh = tensor.device_mesh
        facts = {"mesh": tuple(mesh.shape), "mesh_ranks": tuple(int(r) for r in mesh.mesh.flatten().tolist()),
                 "mesh_dim_names": tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                 "placements": placements}
        return (tuple(chunk[0].offsets), tuple(chunk[0].sizes)), tensor.to_local(), facts
    return ((0,) * tensor.dim(), tuple(tensor.shape)), tensor, {}


def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


# ---- save ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SaveReport:
    path: str
    rank: int
    world_size: int
    bytes_written: int  # by this rank
    seconds: float


def _group_info(group: Any) -> tuple[bool, int, int]:
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(group), dist.get_world_size(group)
    return False, 0, 1


def _all_gather(value: Any, group: Any, world: int) -> list[Any]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


def _broadcast(value: Any, group: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def _shared(outcome: tuple[str, Any], distributed: bool, group: Any, failure: str, path: str | os.PathLike) -> Any:
    """Rank 0's ("ok", value) or ("error", message), made every rank's; every rank raises on an error."""
    if distributed:
        outcome = _broadcast(outcome, group)
    if outcome[0] == "error":
        raise CheckpointError(f"{failure}: {outcome[1]}", file=os.fspath(path))
    return outcome


def save(state_dict: dict[str, Any], path: str | os.PathLike, *, process_group: Any = None, overwrite: bool = False,
         storage_options: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
         redundancy: str | None = None) -> SaveReport:
    """Save a (nested) state dict of tensors, DTensors and plain values as a Tensormorph checkpoint.

    Call it on every rank. Each distinct box is written once, by the least-loaded rank holding it;
    the checkpoint appears under `path` only after every rank's file is durable and the manifest is
    committed. `path` may be a local folder or an fsspec URL (s3://bucket/prefix ...).
    `redundancy="rs(4,2)"` adds Reed-Solomon parity over stripes of 4 rank files (any 2 of each 6
    may be lost); `"replicate:2"` stores a second copy of each rank's file, written by a peer rank.
    """
    started = time.perf_counter()
    scheme = parse_scheme(redundancy) if redundancy else None
    distributed, rank, world = _group_info(process_group)
    leaves = _flatten(state_dict)
    dtensor = _dtensor_types()
    pieces, local_data = [], {}
    for name, tensor in leaves.tensors.items():
        box, local, facts = _local_box(name, tensor, dtensor)
        vocabulary = _vocabulary(tensor.dtype)
        pieces.append(Piece(name, vocabulary, tuple(tensor.shape), box[0], box[1], rank, **facts))
        local_data[name] = local
    everyone = [p for ps in _all_gather(pieces, process_group, world) for p in ps] if distributed else pieces

    # the first process prepares the destination; the others learn its name, or its error. Every
    # failure is turned into a message that all ranks receive: none may be left waiting in a collective.
    outcome: Any = None
    target = None
    if rank == 0:
        try:
            writers = plan_writers(everyone)
            target = destination(path, overwrite=overwrite, storage_options=storage_options)
            outcome = ("ok", target.prepare())
        except Exception as exc:
            outcome = ("error", f"{type(exc).__name__}: {exc}")
    outcome = _shared(outcome, distributed, process_group, "save failed before writing", path)
    if rank != 0:
        writers = plan_writers(everyone)  # the same inputs as rank 0's, which succeeded
    mine = [p for p in pieces if writers.get(p.key) == rank]
    result: Any
    try:
        if target is None:
            target = destination(path, overwrite=overwrite, storage_options=storage_options)
        target.join(outcome[1])
        # plain values are checked here, on their own rank, so a bad one fails every rank cleanly
        objects = {name: encode_value(value, name) for name, value in leaves.objects.items()}
        f = target.open(rank_file(rank))
        try:
            written = write_rank_file(f, rank, [(p, _blocks(local_data[p.name], p.dtype)) for p in mine])
        finally:
            target.finish_file(f)
        result = ("ok", [p.key for p in mine], written, objects)
    except Exception as exc:  # reported to the committing rank, which then refuses to commit
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}")
    results = _all_gather(result, process_group, world) if distributed else [result]
    errors = [r[1] for r in results if r[0] == "error"]

    extras: list[Any] = []
    if scheme is not None and not errors:
        data_files = [(rank_file(r), results[r][2].size) for r in range(world)]
        try:
            extras = [("ok", write_extras(scheme, data_files, rank, world, target.read_range,
                                          partial(store, target)))]
        except Exception as exc:  # as above: the commit is refused
            extras = [("error", f"rank {rank} writing redundancy: {type(exc).__name__}: {exc}")]
        extras = _all_gather(extras[0], process_group, world) if distributed else extras
        errors += [e[1] for e in extras if e[0] == "error"]

    status: Any = ("ok", None)
    if rank == 0:
        if errors:
            status = ("error", "; ".join(errors))
        else:
            try:
                merged: dict[str, Any] = {}
                for r in reversed(results):  # the lowest rank's value wins for names several ranks hold
                    merged.update({name: decode_value(value) for name, value in r[3].items()})
                written_by = {i: (r[1], r[2]) for i, r in enumerate(results)}
                manifest = build_manifest(everyone, writers, written_by, merged, world, extra)
                if scheme is not None:
                    manifest = replace(manifest, redundancy=redundancy_record(scheme, manifest.files, extras))
                target.commit(manifest.to_bytes())
            except Exception as exc:
                status = ("error", f"{type(exc).__name__}: {exc}")
    _shared(status, distributed, process_group, "save did not commit", path)
    return SaveReport(target.describe(), rank, world, result[2].size, time.perf_counter() - started)


def _blocks(tensor: torch.Tensor, vocabulary: str) -> Callable[[], Iterable[np.ndarray]]:
    def blocks() -> Iterable[np.ndarray]:
        yield _as_numpy(_cpu_contiguous(tensor), vocabulary).reshape(-1)
    return blocks


# ---- load ---------------------------------------------------------------------------------------------

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
    blocks_verified: int = 0  # checksum blocks (1 MiB) checked on the way
    seconds: float = 0.0


def _open_source(path: str | os.PathLike, storage_options: dict[str, Any] | None,
                 verify: bool) -> tuple[Checkpoint | None, BoxReader | None, str]:
    """A BoxReader for the Tensormorph format (local or remote), else a Checkpoint of any other format."""
    if is_url(path):
        files = RemoteFiles(os.fspath(path), storage_options)
        where = f"{files.url}/{MANIFEST}"
        if not files.exists(MANIFEST):
            raise UncommittedCheckpointError(
                "holds no manifest: not a committed Tensormorph checkpoint", file=files.url)
        raw = files.read_all(MANIFEST, MAX_MANIFEST_BYTES)
        return None, BoxReader(parse(raw, where), files, files.url, verify=verify), "tensormorph"
    local = Path(os.fspath(path).removeprefix("file://"))
    if tm_format.detect(local):
        root = tm_format.root_of(local)
        files = LocalFiles(root)
        manifest = tm_format.read_manifest(files, str(root))
        return None, BoxReader(manifest, files, str(root), verify=verify), "tensormorph"
    checkpoint = open_checkpoint(local)
    return checkpoint, None, checkpoint.format


def load(path: str | os.PathLike, state_dict: dict[str, Any], *, strict: bool = True, verify: bool = True,
         cast: bool = False, process_group: Any = None, storage_options: dict[str, Any] | None = None) -> LoadReport:
    """Fill `state_dict` in place from any checkpoint the library reads, resharding as needed.

    Tensors are filled in place; each DTensor's local shard is read from exactly the bytes that hold
    its box, whatever mesh and world size saved it. Plain values are replaced in their containers.
    Strict: missing or unexpected keys and shape or dtype mismatches raise one StateMismatchError
    listing every offender; with strict=False they are skipped and listed in the report. dtypes are
    converted only with cast=True. With verify, block checksums of the Tensormorph format are checked.
    """
    del process_group  # loading needs no collectives: every rank reads its own boxes
    started = time.perf_counter()
    leaves = _flatten(state_dict)
    checkpoint, reader, format_name = _open_source(path, storage_options, verify)
    report = LoadReport(os.fspath(path), format_name)
    try:
        if reader is not None:
            stored = {n: (r.dtype, r.shape) for n, r in reader.manifest.tensors.items()}
            objects = reader.manifest.objects
        else:
            stored = {n: (t.dtype, t.shape) for n, t in checkpoint.tensors.items()}
            objects = _regroup({n: o.value for n, o in checkpoint.objects.items()}, leaves.objects)
        work = _match(leaves, stored, objects, report, cast)
        if (report.missing or report.unexpected or report.mismatched) and strict:
            raise StateMismatchError(_mismatch_message(report), file=os.fspath(path), missing=report.missing,
                                     unexpected=report.unexpected, mismatched=report.mismatched)
        dtensor = _dtensor_types()
        jobs = []
        for name in work:
            box, local, _facts = _local_box(name, leaves.tensors[name], dtensor)
            jobs.append((name, box, local))
            report.bytes_needed += int(np.prod(box[1])) * dtypes.itemsize(stored[name][0])
        with ThreadPoolExecutor(READ_THREADS) as pool:
            for _ in pool.map(lambda job: _fill(job, stored[job[0]][0], reader, checkpoint), jobs):
                report.tensors_loaded += 1
        for name, (container, key) in leaves.slots.items():
            if name in objects and not isinstance(container, tuple):
                value = objects[name]
                container[key] = value if reader is not None else value()
        report.bytes_read = reader.bytes_read if reader is not None else report.bytes_needed
        report.blocks_verified = reader.blocks_verified if reader is not None else 0
    finally:
        if reader is not None:
            reader.close()
        if checkpoint is not None:
            checkpoint.close()
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


def _match(leaves: _Leaves, stored: dict[str, tuple[str, tuple[int, ...]]], objects: dict[str, Any],
           report: LoadReport, cast: bool) -> list[str]:
    """The tensors to load; fills the report's missing / unexpected / mismatched lists."""
    work = []
    for name, tensor in leaves.tensors.items():
        if name not in stored:
            report.missing.append(name)
            continue
        dtype, shape = stored[name]
        if tuple(tensor.shape) != tuple(shape):
            report.mismatched.append(f"{name}: shape {list(shape)} in the checkpoint, {list(tensor.shape)} in the state dict")
        elif _vocabulary(tensor.dtype) != dtype and not cast:
            report.mismatched.append(f"{name}: dtype {dtype} in the checkpoint, {_vocabulary(tensor.dtype)} in the "
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


def _fill(job: tuple[str, Box, torch.Tensor], stored_dtype: str, reader: BoxReader | None,
          checkpoint: Checkpoint | None) -> None:
    """Read one box into its local tensor: in place when the tensor's memory can take the bytes directly."""
    name, box, local = job
    direct = (reader is not None and local.device.type == "cpu" and local.is_contiguous()
              and _vocabulary(local.dtype) == stored_dtype)
    if direct:
        reader.read_box(name, box, _as_numpy(local.detach(), stored_dtype))
        return
    if reader is not None:
        data = np.empty(box[1], dtypes.numpy_dtype(stored_dtype))
        reader.read_box(name, box, data)
    else:
        index = tuple(slice(o, o + n) for o, n in zip(*box))
        data = checkpoint[name].read(index, budget=max(1, int(np.prod(box[1])) * dtypes.itemsize(stored_dtype)))
    with torch.no_grad():
        local.copy_(_to_torch(data, stored_dtype))


def _to_torch(array: np.ndarray, vocabulary: str) -> torch.Tensor:
    """A torch tensor over the array's bytes (copied when read-only or strided; torch wants writable memory)."""
    torch_dtype = getattr(torch, next(k for k, v in dtypes.TORCH_DTYPE_NAMES.items() if v == vocabulary))
    flat = array.reshape(-1)
    if not flat.flags.writeable or not flat.flags.c_contiguous:
        flat = flat.copy()
    return torch.from_numpy(flat.view(np.uint8)).view(torch_dtype).reshape(array.shape)
