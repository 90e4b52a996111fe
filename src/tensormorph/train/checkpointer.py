"""Checkpointer: the whole training state saved in shards, resumed exactly, safe against crashes.

Each checkpoint is a Tensormorph checkpoint `<root>/step-NNNNNNNN/` written by
`tensormorph.save` on every rank; its manifest is the commit, and the
manifest's `extra["tensormorph.train"]` records the step, the save time, a
sequence number, the world size and the mesh. Which checkpoints exist, which
is newest and which retention may delete are decided from manifests only:
folder names and modification times are never trusted.

State layout (flattened names in the checkpoint):
  model.*            model state (DTensors under FSDP2), from get_state_dict
  optimizer.*        optimizer state keyed by parameter names
  scheduler, scaler  their state_dicts
  rng.rank<r>        rank r's generators (Python, NumPy, torch CPU, every CUDA device)
  data.rank<r>       rank r's data position (ResumableSampler or StatefulDataLoader state)
  extra, step        the caller's JSON-able state and the step
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from ..distributed import load as tm_load
from ..distributed import save as tm_save
from ..errors import CheckpointError
from ..locations import remove_abandoned
from ..manifest import MANIFEST, TEMP_PREFIX, encode_value, parse
from . import rng, workers
from .plain import from_plain, to_plain
from .sampler import ResumableSampler

__all__ = ["CheckpointInfo", "Checkpointer", "SaveTiming"]

TRAIN_KEY = "tensormorph.train"
FOLDER_PREFIX = "step-"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed training checkpoint, as its manifest describes it."""

    step: int
    path: Path
    time: float  # seconds since the epoch when the save began
    size: int  # bytes: data files and manifest
    world_size: int
    mesh: dict[str, Any] | None  # {"shape": [...], "dim_names": [...]} of the model's DTensors
    seq: int  # commit order within the root folder: newer saves have higher numbers
    components: tuple[str, ...]  # of model, optimizer, scheduler, scaler, data, extra


@dataclass
class SaveTiming:
    """How long one `save` held up the training loop, and when the checkpoint became durable."""

    step: int
    path: Path
    blocked_s: float = 0.0  # inside save() (waiting for the previous save, capturing), plus the optimizer
    # step's wait for the background copy
    durable_s: float | None = None  # from the call until the commit; None while in flight


@dataclass
class _Group:
    """Process groups and this process's place in them (one process without torch.distributed)."""

    distributed: bool
    rank: int = 0
    world: int = 1
    save: Any = None  # gloo group used by the (background) save: its collectives never meet the training's
    control: Any = None  # gloo group for the main thread's agreement (resume choice, stop requests)


def _optimizers(optimizer: Any) -> tuple[Any, ...]:
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    return tuple(optimizer)


def _find_mesh(state: Any) -> dict[str, Any] | None:
    from torch.distributed.tensor import DTensor

    for value in state.values():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            return {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None}
    return None


def _component_states(model: Any, optimizers: tuple[Any, ...], scheduler: Any, scaler: Any) -> dict[str, Any]:
    """The state dicts of the training components given (model and optimizer FSDP2/DTensor aware)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizers and model is None:
        raise ValueError("optimizer state is keyed by the model's parameter names: pass model= as well")
    states: dict[str, Any] = {}
    if model is not None:
        if optimizers:
            states["model"], states["optimizer"] = get_state_dict(model, optimizers)
        else:
            states["model"] = get_model_state_dict(model)
    if scheduler is not None:
        states["scheduler"] = scheduler.state_dict()
    if scaler is not None:
        states["scaler"] = scaler.state_dict()
    return states


def _has_state(obj: Any) -> bool:
    """Duck typing of a loader that keeps its own position (torchdata's StatefulDataLoader)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _loader_parts(dataloader: Any) -> tuple[str, ResumableSampler | None, Any]:
    """(kind, sampler, loader) for what was passed as `dataloader=`; kind is 'sampler' or 'stateful'."""
    if isinstance(dataloader, ResumableSampler):
        return "sampler", dataloader, None
    if isinstance(dataloader, DataLoader):
        candidates = [dataloader.sampler, getattr(dataloader.batch_sampler, "sampler", None)]
        sampler = next((s for s in candidates if isinstance(s, ResumableSampler)), None)
        stateful = _has_state(dataloader)
        if stateful and sampler is not None:
            raise TypeError(f"{type(dataloader).__name__} keeps its own position; give it its own sampler, or use "
                            "a ResumableSampler with a plain torch DataLoader")
        if stateful:
            return "stateful", None, dataloader
        if sampler is None:
            raise TypeError(f"the DataLoader's sampler is a {type(dataloader.sampler).__name__}, which cannot say "
                            "how far training got; use tensormorph.train.ResumableSampler (a drop-in for "
                            "DistributedSampler) or torchdata's StatefulDataLoader")
        return "sampler", sampler, dataloader
    if _has_state(dataloader):
        return "stateful", None, dataloader
    raise TypeError(f"dataloader= takes a DataLoader with a ResumableSampler, a ResumableSampler, or an object with "
                    f"state_dict/load_state_dict (torchdata's StatefulDataLoader); got {type(dataloader).__name__}")


def _walk(state: dict[str, Any], on_tensor: Callable[[str, torch.Tensor], Any],
          on_value: Callable[[str, Any], Any]) -> dict[str, Any]:
    """`state` rebuilt with each tensor and each other leaf replaced by the callbacks' results."""
    def visit(value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            return on_tensor(name, value)
        if isinstance(value, dict):
            return {k: visit(v, f"{name}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [visit(v, f"{name}.{i}") for i, v in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        return on_value(name, value)

    return {k: visit(v, k) for k, v in state.items()}


@dataclass
class _Copy:
    """A copy into a staging buffer left to the background thread, with the source's version when deferred."""

    name: str
    buffer: torch.Tensor
    source: torch.Tensor
    version: int


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _owned_by(model: Any, optimizers: tuple[Any, ...]) -> set[int]:
    """Storages that only an optimizer step changes: the parameters (their local shards) and optimizer state."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if isinstance(t, DTensor) else t

    owned = {_storage(local(p)) for p in model.parameters()} if model is not None else set()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            owned.update(_storage(local(v)) for v in state.values() if isinstance(v, torch.Tensor))
    owned.discard(0)  # empty tensors share no memory worth tracking
    return owned


@dataclass
class _Generators:
    """One rank's saved generator states, and its DataLoader's own generator's (when it has one)."""

    states: dict[str, Any] | None
    loader: bytes | None = None


def _generator_state(loader: Any) -> bytes | None:
    generator = getattr(loader, "generator", None)
    return generator.get_state().numpy().tobytes() if isinstance(generator, torch.Generator) else None


class Checkpointer:
    """Saves and resumes the whole training state under one root folder.

        ckpt = Checkpointer("runs/exp1", keep=3, async_save=True)
        start = ckpt.resume(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
        ...
        ckpt.save(step, model=model, optimizer=opt, scheduler=sched, dataloader=loader, extra={...})
        ckpt.wait()

    Construct it, `save` and `resume` on every rank (they are collective). `keep=N` keeps the N
    newest committed checkpoints. With `async_save` the state is copied to CPU memory and written
    by a background thread while training goes on; at most one save is in flight. Leftover
    temporary folders of saves that never committed are removed when a Checkpointer starts.
    """

    def __init__(self, root: str | os.PathLike, *, keep: int | None = None, async_save: bool = False,
                 redundancy: str | None = None) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (the newest checkpoint is never deleted), got {keep}")
        if "://" in os.fspath(root):
            raise ValueError(f"{os.fspath(root)!r}: the Checkpointer needs a local (or shared) folder, whose renames "
                             "commit checkpoints; tensormorph.save writes single checkpoints to object stores")
        self.root = Path(root).absolute()
        self.keep = keep
        self.async_save = async_save
        self.redundancy = redundancy
        self.extra: Any = None
        self.timings: list[SaveTiming] = []
        distributed = dist.is_available() and dist.is_initialized()
        self._g = _Group(distributed)
        if distributed:
            self._g.rank, self._g.world = dist.get_rank(), dist.get_world_size()
            self._g.save = dist.new_group(backend="gloo")
            self._g.control = dist.new_group(backend="gloo")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staged = threading.Event()  # clear while the background thread still copies state
        self._staged.set()
        self._inflight: SaveTiming | None = None
        self._fences: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # optimizer -> hook
        self._buffers: dict[str, torch.Tensor] = {}  # staging buffers by state name, reused between saves
        self._manifest_cache: dict[Path, tuple[tuple[int, int, int], CheckpointInfo | None]] = {}
        self._pending: _Generators | None = None  # generator states waiting for the loader's first index
        self._signals: tuple[int, ...] = ()
        self._signalled = False
        self._stopping = False
        self._closed = False
        self._barrier()
        outcome: Any = ("ok", 0)
        if self._g.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._clean_leftovers()
                outcome = ("ok", max((info.seq for info in self.list()), default=0))
            except Exception as exc:  # every rank raises it, none waits for rank 0
                outcome = ("error", f"{type(exc).__name__}: {exc}")
        outcome = self._broadcast(outcome)
        if outcome[0] == "error":
            raise CheckpointError(f"cannot use the folder: {outcome[1]}", file=str(self.root))
        self._seq = outcome[1]

    # ---- listing --------------------------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Committed training checkpoints under the root, oldest first (by commit order). No collectives."""
        found = []
        try:
            children = list(self.root.iterdir())
        except FileNotFoundError:
            return []
        for child in children:
            if child.name.startswith(TEMP_PREFIX) or not child.is_dir():
                continue
            info = self._info(child)
            if info is not None:
                found.append(info)
        return sorted(found, key=lambda i: (i.seq, i.time))

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None."""
        infos = self.list()
        return infos[-1] if infos else None

    def _info(self, folder: Path) -> CheckpointInfo | None:
        manifest_path = folder / MANIFEST
        try:
            stat = manifest_path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None  # not a checkpoint (or one being deleted right now)
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        cached = self._manifest_cache.get(folder)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            manifest = parse(manifest_path.read_bytes(), str(manifest_path))
        except FileNotFoundError:
            return None
        except CheckpointError as exc:
            warnings.warn(f"ignoring a checkpoint whose manifest is damaged: {exc}", stacklevel=3)
            return None
        meta = manifest.extra.get(TRAIN_KEY)
        info = None
        if meta is not None:  # other Tensormorph checkpoints in the folder are not training checkpoints
            try:
                info = CheckpointInfo(step=int(meta["step"]), path=folder, time=float(meta["time"]),
                                      size=sum(f.size for f in manifest.files.values()) + stat.st_size,
                                      world_size=manifest.world_size, mesh=meta.get("mesh"), seq=int(meta["seq"]),
                                      components=tuple(meta["components"]))
            except (KeyError, TypeError, ValueError) as exc:
                warnings.warn(f"ignoring a checkpoint whose manifest has an incomplete training record ({exc!r}): "
                              f"{manifest_path}", stacklevel=3)
        self._manifest_cache[folder] = (key, info)
        return info

    def _clean_leftovers(self) -> None:
        """Remove temporary folders of saves (and deletions) that a crash interrupted; a save in progress
        in another process (its marker still locked) is left alone."""
        remove_abandoned(self.root)

    def _retain(self) -> None:
        """Delete committed checkpoints beyond the `keep` newest (rank 0, after a commit)."""
        if self.keep is None:
            return
        for info in self.list()[:-self.keep]:
            # renamed out of sight first: a crash mid-delete leaves a temporary folder, never a broken checkpoint
            doomed = self.root / f"{TEMP_PREFIX}deleting-{info.path.name}-{uuid.uuid4().hex[:12]}"
            try:
                os.rename(info.path, doomed)
            except FileNotFoundError:
                continue
            self._manifest_cache.pop(info.path, None)
            shutil.rmtree(doomed, ignore_errors=True)

    # ---- collectives ----------------------------------------------------------------------------------

    def _agree(self, error: Exception | None, path: Path) -> None:
        """Raise on every rank when any rank's background copy failed (on the save group, which only the
        background thread uses)."""
        if not self._g.distributed:
            if error is not None:
                raise error
            return
        outcomes: list[Any] = [None] * self._g.world
        dist.all_gather_object(outcomes, None if error is None else str(error), group=self._g.save)
        if error is not None:
            raise error
        failed = [(rank, message) for rank, message in enumerate(outcomes) if message]
        if failed:
            rank, message = failed[0]
            raise CheckpointError(f"not written: rank {rank}'s copy of the state failed ({message})", file=str(path))

    def _barrier(self) -> None:
        if self._g.distributed:
            dist.barrier(group=self._g.control)

    def _broadcast(self, value: Any) -> Any:
        if not self._g.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._g.control)
        return box[0]

    # ---- saving ---------------------------------------------------------------------------------------

    def save(self, step: int, *, model: torch.nn.Module | None = None, optimizer: Any = None,
             scheduler: Any = None, scaler: Any = None, dataloader: Any = None,
             extra: Any = None) -> SaveTiming:
        """Save the training state at `step` as `<root>/step-NNNNNNNN` (collective: every rank calls it).

        Synchronous: returns once the checkpoint is committed. Asynchronous: returns once the state
        is captured; an error in the background is raised by the next save or wait. With an optimizer,
        the CPU parameters and optimizer state are copied by the background thread while the next
        forward and backward run, and the optimizer's next step waits for that copy: they must not be
        changed in place otherwise until then (a change seen by the tensors' version counters fails the save
        on every rank; writes through `.data` are not seen). After a stop
        request (`save_on_signal`) it waits for the commit and exits the process.
        """
        started = time.perf_counter()
        if self._closed:
            raise CheckpointError("this Checkpointer is closed; make a new one to save again", file=str(self.root))
        self.wait()
        state, meta = self._collect(step, model, optimizer, scheduler, scaler, dataloader, extra)
        # what a checkpoint cannot hold is refused here, naming the entry, before anything is written
        _walk(state, lambda name, tensor: tensor, lambda name, value: encode_value(value, name))
        path = self.root / f"{FOLDER_PREFIX}{step:08d}"
        timing = SaveTiming(step, path)
        self.timings.append(timing)
        if self.async_save:
            optimizers = _optimizers(optimizer)
            staged, deferred = self._stage(state, _owned_by(model, optimizers) if optimizers else set())
            if deferred:
                self._fence(optimizers)
                self._staged.clear()
            self._inflight = timing
            self._thread = threading.Thread(target=self._write_in_background,
                                            args=(staged, deferred, path, meta, timing, started),
                                            name=f"tensormorph-save-{step}")
            try:
                self._thread.start()
            except BaseException:
                self._staged.set()  # no copy will come: the optimizer's step must not wait for one
                self._thread = None
                raise
        else:
            self._write(state, path, meta, timing, started)
        timing.blocked_s += time.perf_counter() - started
        if self._stopping:
            self.wait()
            self._barrier()
            raise SystemExit(0)
        return timing

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _collect(self, step: int, model: Any, optimizer: Any, scheduler: Any, scaler: Any, dataloader: Any,
                 extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:

        state: dict[str, Any] = {"step": step, **_component_states(model, _optimizers(optimizer), scheduler, scaler)}
        if extra is not None:
            state["extra"] = extra
        rank = self._g.rank
        # a restore still waiting for the loader's first index is the state this process is really in
        pending = self._pending
        state[f"rng.rank{rank}"] = pending.states if pending is not None and pending.states else rng.capture()
        if dataloader is not None:
            self._guard_workers(dataloader)
            kind, sampler, loader = _loader_parts(dataloader)
            if kind == "sampler":
                generator = pending.loader if pending is not None and pending.loader else _generator_state(loader)
                state[f"data.rank{rank}"] = {"kind": kind, "state": sampler.state_dict(), "generator": generator}
            else:
                state[f"data.rank{rank}"] = {"kind": kind, "state": to_plain(loader.state_dict(), "dataloader")}
        components = [k for k in ("model", "optimizer", "scheduler", "scaler", "extra") if k in state]
        if dataloader is not None:
            components.append("data")
        meta = {TRAIN_KEY: {"step": step, "time": time.time(), "seq": self._seq + 1, "world_size": self._g.world,
                            "mesh": _find_mesh(state["model"]) if "model" in state else None,
                            "components": components, "seed": torch.initial_seed()}}
        self._seq += 1
        return state, meta

    def _stage(self, state: dict[str, Any], deferrable: set[int]) -> tuple[dict[str, Any], list[_Copy]]:
        """A copy of `state` that training cannot change: tensors go into reused CPU buffers (pinned when
        the source is on a GPU), plain values are deep-copied. CPU tensors whose storage is in `deferrable`
        are not copied yet: their copies are returned, for the background thread."""
        from torch.distributed.tensor import DTensor

        buffers = self._buffers
        on_gpu = False
        deferred: list[_Copy] = []

        def copy_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
            nonlocal on_gpu
            local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
            buffer = buffers.get(name)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
                buffers[name] = buffer
            if not local.is_cuda and _storage(local) in deferrable:
                deferred.append(_Copy(name, buffer, local.detach(), local._version))
            else:
                on_gpu |= local.is_cuda
                buffer.copy_(local.detach(), non_blocking=local.is_cuda)
            if isinstance(tensor, DTensor):
                # the same placements and global shape over the CPU copy (from_local would move it back)
                return DTensor(buffer, tensor._spec, requires_grad=False)
            return buffer

        staged = _walk(state, copy_tensor, lambda name, value: copy.deepcopy(value))
        if on_gpu:
            torch.cuda.synchronize()
        return staged, deferred

    def _fence(self, optimizers: tuple[Any, ...]) -> None:
        """Make each optimizer's step wait until the background copy of the parameters and its state is done."""
        for optimizer in optimizers:
            if optimizer not in self._fences:
                self._fences[optimizer] = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._staged.is_set():
            started = time.perf_counter()
            self._staged.wait()
            if self._inflight is not None:
                self._inflight.blocked_s += time.perf_counter() - started

    def _write(self, state: dict[str, Any], path: Path, meta: dict[str, Any], timing: SaveTiming,
               started: float) -> None:
        tm_save(state, path, process_group=self._g.save, overwrite=True, extra=meta, redundancy=self.redundancy)
        timing.durable_s = time.perf_counter() - started
        if self._g.rank == 0:
            try:
                self._retain()
            except OSError as exc:  # the new checkpoint is committed; an old one that stays is no failure
                warnings.warn(f"could not delete an old checkpoint under {self.root}: {exc}", stacklevel=2)

    def _write_in_background(self, state: dict[str, Any], deferred: list[_Copy], path: Path, meta: dict[str, Any],
                             timing: SaveTiming, started: float) -> None:
        try:
            copy_error: Exception | None = None
            try:
                for job in deferred:
                    job.buffer.copy_(job.source)
                    # unchanged after the copy: nothing wrote to it since save() began, so the copy is whole
                    if job.source._version != job.version:
                        raise CheckpointError(
                            "was changed in place after save() returned and before its background copy finished "
                            "(only the optimizer's step may change parameters then, and it waits for the copy); "
                            "the checkpoint was not written", file=str(path), tensor=job.name)
            except Exception as exc:
                copy_error = exc
            finally:
                self._staged.set()
            # every rank learns whether every copy succeeded: one failing alone must not leave the others
            # waiting inside the save's collectives
            self._agree(copy_error, path)
            self._write(state, path, meta, timing, started)
        except BaseException as exc:  # handed to the training thread at its next save or wait
            self._error = exc

    # ---- resuming -------------------------------------------------------------------------------------

    def resume(self, *, model: torch.nn.Module | None = None, optimizer: Any = None, scheduler: Any = None,
               scaler: Any = None, dataloader: Any = None, step: int | None = None, strict: bool = True) -> int:
        """Load the newest committed checkpoint (or the one of `step`) into what is given; returns its step,
        0 when there is nothing to resume. Collective. `self.extra` becomes the saved `extra`.

        Strict: every mismatch between the given state and the checkpoint (missing or unexpected
        entries, other shapes or dtypes, components saved but not given) raises one StateMismatchError,
        before anything is loaded; with strict=False what matches is loaded. On another world size, model
        and optimizer are resharded, a ResumableSampler continues at the same global sample, and per-rank
        random streams are re-seeded from the run's seed, the step and the rank.
        """
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        self.wait()
        if dataloader is not None:
            self._guard_workers(dataloader)
        path = self._choose(step)
        if path is None:
            self.extra = None
            return 0
        manifest = parse((path / MANIFEST).read_bytes(), str(path / MANIFEST))
        meta = manifest.extra[TRAIN_KEY]
        optimizers = _optimizers(optimizer)
        target: dict[str, Any] = {"step": None, **_component_states(model, optimizers, scheduler, scaler)}
        if "extra" in manifest.objects:
            target["extra"] = None
        # every rank's generators and data position are plain values in the manifest: all are read (no
        # data files touched), this rank's are used, and another world size uses all ranks' positions
        for name in manifest.objects:
            if name.startswith(("rng.rank", "data.rank")):
                target[name] = None
        if dataloader is not None and not any(n.startswith("data.rank") for n in manifest.objects):
            target["data.rank0"] = None  # reported as missing: the checkpoint holds no data position

        tm_load(path, target, strict=strict)

        if model is not None:
            if optimizers:
                set_state_dict(model, optimizers, model_state_dict=target["model"],
                               optim_state_dict=target["optimizer"])
            else:
                set_model_state_dict(model, target["model"])
        if scheduler is not None:
            scheduler.load_state_dict(target["scheduler"])
        if scaler is not None:
            scaler.load_state_dict(target["scaler"])
        self.extra = target.get("extra")

        rank, same_world = self._g.rank, meta["world_size"] == self._g.world
        generators = _Generators(target.get(f"rng.rank{rank}") if same_world else None)
        if generators.states is None:
            rng.reseed(rng.derive_seed(meta["seed"], meta["step"], rank, self._g.world))
        data = [target.get(f"data.rank{r}") for r in range(meta["world_size"])]
        if dataloader is None or any(d is None for d in data):  # no position saved: only with strict=False
            self._restore(generators, None)
            return int(meta["step"])
        kind, sampler, loader = _loader_parts(dataloader)
        if any(d["kind"] != kind for d in data):
            raise CheckpointError(f"holds a {data[0]['kind']} data position, and a {kind} was given", file=str(path))
        mine = data[rank] if same_world else None
        if kind == "stateful":
            if not same_world:
                raise CheckpointError(
                    f"was saved on {meta['world_size']} ranks and is resumed on {self._g.world}: a "
                    "StatefulDataLoader's state is one rank's share of the data and cannot be split anew; use a "
                    "ResumableSampler, or resume without dataloader= to start the data afresh", file=str(path))
            loader.load_state_dict(from_plain(mine["state"]))
            # StatefulDataLoader makes its iterator here, drawing from the global generator; the restore
            # below comes after that draw, so the resumed run's streams match the uninterrupted one's
            loader.state_dict()
            self._restore(generators, None)
            return int(meta["step"])
        sampler.load_states([mine["state"]] if same_world else [d["state"] for d in data], same_world=same_world)
        if loader is None:  # the sampler alone: whoever iterates it makes no draw of its own
            self._restore(generators, None)
            return int(meta["step"])
        generators.loader = mine["generator"] if mine is not None else None
        in_pass = any(d["state"].get("in_pass", not d["state"]["complete"]) for d in data)
        # A DataLoader draws from a generator when it makes an iterator. When no pass was in progress at the
        # save (an epoch had ended, or none had begun) the uninterrupted run makes one at this point too
        # (unless its workers persist, keeping theirs), so the generators are restored now and the draws
        # match. Mid-pass it made none: the restore waits for the resumed loader's first index, which comes
        # after that loader's draw.
        if not in_pass and not (loader.persistent_workers and loader.num_workers > 0):
            self._restore(generators, loader)
        else:
            self._pending = generators
            sampler._on_first_index = lambda: self._restore(generators, loader)
        return int(meta["step"])

    def _choose(self, step: int | None) -> Path | None:
        """The checkpoint to resume, chosen by rank 0 for all: the newest, or the newest of `step`."""
        chosen: Any = None
        if self._g.rank == 0:
            try:
                infos = self.list()
            except Exception as exc:  # every rank raises it, none waits for rank 0
                infos, chosen = [], ("error", f"cannot list the checkpoints: {type(exc).__name__}: {exc}")
            if step is not None and chosen is None:
                infos = [i for i in infos if i.step == step]
                if not infos:
                    chosen = ("error", f"has no committed checkpoint of step {step}")
            if infos:
                chosen = ("ok", str(infos[-1].path))
        chosen = self._broadcast(chosen)
        if chosen is not None and chosen[0] == "error":
            raise CheckpointError(chosen[1], file=str(self.root))
        return Path(chosen[1]) if chosen is not None else None

    def _restore(self, generators: _Generators, loader: Any) -> None:
        self._pending = None
        if generators.states is not None:
            rng.restore(generators.states)
        if generators.loader is not None and isinstance(getattr(loader, "generator", None), torch.Generator):
            loader.generator.set_state(torch.frombuffer(bytearray(generators.loader), dtype=torch.uint8))

    # ---- preemption -----------------------------------------------------------------------------------

    def save_on_signal(self, *signals: int) -> None:
        """On any of `signals` (default SIGTERM), the next `stop_requested()` is True on every rank, and
        the save made then waits for its commit and exits the process (SystemExit(0)). The workers of the
        DataLoader given to `resume`/`save` ignore these signals, so that a signal to every process of the
        machine does not kill them (they exit with the training process)."""
        self._signals = tuple(signals or (signal.SIGTERM,))
        for sig in self._signals:
            signal.signal(sig, self._on_signal)

    def _guard_workers(self, dataloader: Any) -> None:
        if self._signals and isinstance(dataloader, DataLoader):
            workers.guard(dataloader, self._signals)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signalled = True  # only a flag: a signal handler must not do I/O or collectives

    def stop_requested(self) -> bool:
        """Whether any rank was signalled; call it at every step boundary on every rank (collective)."""
        flag = self._signalled or self._stopping
        if self._g.distributed:
            vote = torch.tensor([int(flag)])
            dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._g.control)
            flag = bool(vote.item())
        self._stopping = flag
        return flag

    def close(self) -> None:
        """Wait for the save in flight, unhook the optimizers and release the process groups."""
        self.wait()
        for handle in list(self._fences.values()):
            handle.remove()
        self._fences.clear()
        if self._g.distributed:
            for group in (self._g.save, self._g.control):
                dist.destroy_process_group(group)
        self._closed = True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

