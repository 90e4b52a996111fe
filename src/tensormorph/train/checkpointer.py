"""Checkpointer: the whole training state saved in shards, resumed exactly, safe against crashes.

Each checkpoint is a Tensormorph checkpoint `<root>/step-NNNNNNNN/` written by
`tensormorph.save` on every rank; its manifest is the commit, and the
manifest's `extra["tensormorph.train"]` records the step, the save time, a
sequence number, the world size and the mesh. Which checkpoints exist, which
is newest and which retention may delete are decided from manifests only
(`manager`); `staging` makes saves asynchronous, `resume` puts a checkpoint
back, `preemption` turns signals into a last save. This class composes them.

State layout (flattened names in the checkpoint):
  model.*            model state (DTensors under FSDP2), from get_state_dict
  optimizer.*        optimizer state keyed by parameter names
  scheduler, scaler  their state_dicts
  rng.rank<r>        rank r's generators (Python, NumPy, torch CPU, every CUDA device)
  data.rank<r>       rank r's data position (ResumableSampler or StatefulDataLoader state)
  extra, step        the caller's JSON-able state and the step
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import save as tm_save
from ..distributed.collective import Collective, failures
from ..errors import CheckpointError
from ..storage import AnyPath
from ..tmformat.manifest import encode_value
from .drain import Drain, Drained
from .liveness import LiveLock
from .manager import TRAIN_KEY, CheckpointInfo, CheckpointManager
from .memory import MemoryTier
from .optim_shell import OPTIMIZERS_KEY, optimizer_classes
from .peers import PeerTier
from .preemption import Preemption
from .records import append_saves
from .resume import Resumer
from .rollback import read_marker, write_marker
from .staging import DeferredCopy, SaveTiming, Staging
from .state import component_states, find_mesh, optimizers, walk

__all__ = ["CheckpointInfo", "Checkpointer", "SaveTiming"]


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
                 redundancy: str | None = None, storage_options: dict[str, Any] | None = None,
                 memory_every: int | None = None, disk_every: int = 1, memory_keep: int = 2,
                 memory_dir: str | os.PathLike | None = None, node: str | None = None, peers: bool = False,
                 remote: str | None = None, remote_every: int | None = None, remote_keep: int | None = None,
                 remote_storage_options: dict[str, Any] | None = None,
                 release_memory_on_close: bool = True) -> None:
        if disk_every < 1 or (memory_every is not None and memory_every < 1):
            raise ValueError(f"memory_every and disk_every count steps: at least 1, got {memory_every} and "
                             f"{disk_every}")
        if remote is not None and (remote_every is None or remote_every < 1 or remote_every % disk_every):
            raise ValueError(f"remote_every must be a multiple of disk_every ({disk_every}): the object store gets "
                             f"copies of disk checkpoints; got {remote_every}")
        self._manager = CheckpointManager(root, keep, storage_options)
        self.storage_options = storage_options
        self.async_save = async_save
        self.redundancy = redundancy
        self.memory_every, self.disk_every = memory_every, disk_every
        self.release_memory_on_close = release_memory_on_close
        self.extra: Any = None
        self.resumed_from: str | None = None  # "memory" or "disk" after a resume; None for a fresh start
        self.resume_notes: list[str] = []  # newer steps a resume passed over, and why
        self.timings: list[SaveTiming] = []
        self._recorded = 0  # timings already appended to the run's record of saves
        distributed = dist.is_available() and dist.is_initialized()
        # gloo groups of their own: the background save's collectives never meet the training's, nor the
        # main thread's agreements (resume choice, stop requests)
        self._save = Collective(dist.new_group(backend="gloo") if distributed else None)
        self._control = Collective(dist.new_group(backend="gloo") if distributed else None)
        self._staging = Staging()
        run_id = self._control.decide(lambda: self._manager.run_id(create=True), "cannot use the folder", self.root) \
            if memory_every is not None else ""
        # with peers a third snapshot is kept: a buddy's copies may lag a rank's own by one, and a lost node's
        # ranks need a step both hold
        self._memory = MemoryTier(self.root, self._control.rank, keep=max(memory_keep, 3) if peers else memory_keep,
                                  memory_dir=memory_dir, node=node, run_id=run_id) if memory_every is not None else None
        self._peers = None
        if peers and self._memory is not None:  # every rank passes the same arguments: the group is made by all
            group = Collective(dist.new_group(backend="gloo") if distributed else None)
            self._peers = PeerTier(self._memory, group, self._control.gather(self._memory.node))
        self.remote_every = remote_every if remote is not None else None
        self._drain = Drain(remote, remote_storage_options, remote_keep) \
            if remote is not None and self._control.rank == 0 else None
        remote_manager = CheckpointManager(remote, remote_keep, remote_storage_options) if remote is not None else None
        self._resumer = Resumer(self._manager, self._control, storage_options, self._memory, self._peers,
                                remote_manager, remote_storage_options)
        self._preemption = Preemption(self._control)
        self._closed = False
        self._live: LiveLock | None = None  # held from the first save or resume: rollback waits for close()
        self._control.barrier()
        self._seq = self._control.decide(self._manager.prepare, "cannot use the folder", self.root)
        if remote_manager is not None:  # commit order continues the object store's, whatever the disk lost
            try:
                self._seq = max(self._seq, self._control.decide(remote_manager.prepare, "cannot list the object store",
                                                                remote_manager.root))
            except CheckpointError as exc:  # training can go on without it; its copies are retried at each save
                warnings.warn(f"{exc}; commit order goes on from the local checkpoints", stacklevel=2)

    @property
    def root(self) -> AnyPath:
        """The root folder, or a RemotePath for an object store's prefix."""
        return self._manager.root

    @property
    def keep(self) -> int | None:
        return self._manager.keep

    @keep.setter
    def keep(self, keep: int | None) -> None:
        self._manager.keep = keep

    @property
    def _thread(self) -> threading.Thread | None:
        """The background save's thread while one is in flight."""
        return self._staging.thread

    # ---- listing --------------------------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Committed training checkpoints under the root, oldest first (by commit order). No collectives."""
        return self._manager.list()

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None."""
        return self._manager.latest()

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
        self._hold_live()
        path = self._manager.path(step)
        tiers = tuple(tier for tier, every in (("memory", self.memory_every), ("disk", self.disk_every),
                                               ("remote", self.remote_every))
                      if every is not None and step % every == 0)
        timing = SaveTiming(step, path, tiers=tiers)
        if not tiers and not self._preemption.stopping:
            return timing  # no tier is due at this step
        if self._preemption.stopping and "disk" not in tiers:
            tiers = timing.tiers = (*tiers, "disk")  # the last save before a stop goes to disk: memory may go too
        self._staging.wait()  # the save in flight; never the copy to the object store
        self._record_saves()
        state, meta = self._collect(step, model, optimizer, scheduler, scaler, dataloader, extra)
        # what a checkpoint cannot hold is refused here, naming the entry, before anything is written
        walk(state, lambda name, tensor: tensor, lambda name, value: encode_value(value, name))
        self.timings.append(timing)
        if self.async_save:  # a step saved to host memory alone is written straight from training's tensors
            staged, deferred, borrowed = self._staging.stage(state, model, optimizers(optimizer),
                                                             borrow=tiers == ("memory",))
            self._staging.start(partial(self._write_in_background, staged, deferred, borrowed, path, meta, timing,
                                        started), timing, name=f"tensormorph-save-{step}")
        else:
            self._write(state, path, meta, timing, started)
        timing.blocked_s += time.perf_counter() - started
        if self._preemption.stopping:
            self._staging.wait()  # the save is on disk; an upload in flight must not outlast the grace period
            self._control.barrier()
            raise SystemExit(0)
        return timing

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed, and its copy to the object store too; raise the
        save's error if it failed (a failed copy is in `remote_errors`)."""
        self._staging.wait()
        if self._drain is not None:
            self._drain.wait()

    @property
    def remote_copies(self) -> tuple[Drained, ...]:
        """The copies to the object store that committed: each step, and seconds from its hand-over (rank 0)."""
        return tuple(self._drain.drained) if self._drain is not None else ()

    @property
    def remote_errors(self) -> tuple[str, ...]:
        """Copies to the object store that failed (rank 0 copies; other ranks have none)."""
        return tuple(self._drain.errors) if self._drain is not None else ()

    def _record_saves(self) -> None:
        """Rank 0 appends the saves finished since the last call to the run's record (a local root only); a record
        that cannot be written is a warning, never a failed save."""
        finished = [t for t in self.timings[self._recorded:] if t.durable_s is not None]
        self._recorded = len(self.timings)
        if self._control.rank == 0 and isinstance(self.root, Path) and finished:
            try:
                append_saves(self.root, finished)
            except OSError as exc:
                warnings.warn(f"could not record the saves' timings in {self.root}: {exc}", stacklevel=3)

    def _collect(self, step: int, model: Any, optimizer: Any, scheduler: Any, scaler: Any, dataloader: Any,
                 extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state to save and the training record for the manifest."""
        state: dict[str, Any] = {"step": step, **component_states(model, optimizers(optimizer), scheduler, scaler)}
        if extra is not None:
            state["extra"] = extra
        rank = self._control.rank
        state[f"rng.rank{rank}"] = self._resumer.generator_states()
        if dataloader is not None:
            self._preemption.guard_workers(dataloader)
            state[f"data.rank{rank}"] = self._resumer.data_position(dataloader)
        components: list[str] = [k for k in ("model", "optimizer", "scheduler", "scaler", "extra") if k in state]
        if dataloader is not None:
            components.append("data")
        meta = {TRAIN_KEY: {"step": step, "time": time.time(), "seq": self._seq + 1, "world_size": self._control.world,
                            "mesh": find_mesh(state["model"]) if "model" in state else None,
                            "components": components, "seed": torch.initial_seed(),
                            OPTIMIZERS_KEY: optimizer_classes(optimizers(optimizer))}}
        self._seq += 1
        return state, meta

    def _write(self, state: dict[str, Any], path: AnyPath, meta: dict[str, Any], timing: SaveTiming,
               started: float, borrowed: dict[str, int] | None = None) -> None:
        """Each tier due: this rank's memory snapshot first (no collective), then the disk checkpoint.
        `borrowed`: training's own tensors in `state` (async, memory only), free again once the snapshot is."""
        if "memory" in timing.tiers and self._memory is not None:
            memory = self._memory
            outcomes = self._save.everyone(lambda: memory.save(timing.step, state, meta, borrowed),
                                           label="memory snapshot: ")
            self._staging.release()
            failed = failures(outcomes)
            if failed:  # every rank sees it alike: no copy goes out, and the disk tier still saves
                warnings.warn(f"memory snapshot of step {timing.step} failed: {failed[0]}", stacklevel=1)
            else:
                timing.memory_s = time.perf_counter() - started
                if self._peers is not None:
                    peers, snapshot = self._peers, outcomes[self._save.rank].unwrap()
                    copied = failures(self._save.everyone(lambda: peers.exchange(snapshot), label="peer copy: "))
                    if copied:  # every rank learns it, and the disk tier still saves
                        warnings.warn(f"peer copy of step {timing.step} failed: {copied[0]}", stacklevel=1)
                    else:
                        timing.peer_s = time.perf_counter() - started
        if "disk" in timing.tiers:
            tm_save(state, path if isinstance(path, Path) else str(path), process_group=self._save.group,
                    overwrite=True, extra=meta, redundancy=self.redundancy, storage_options=self.storage_options)
            if self._drain is not None and "remote" in timing.tiers and isinstance(path, Path):
                self._drain.submit(timing.step, path)  # copied by the drain's thread; nothing waits for it
            if self._save.rank == 0:
                self._manager.retain(protect=self._drain.in_use() if self._drain is not None else ())
        timing.durable_s = time.perf_counter() - started

    def _write_in_background(self, state: dict[str, Any], deferred: Sequence[DeferredCopy],
                             borrowed: dict[str, int], path: AnyPath, meta: dict[str, Any], timing: SaveTiming,
                             started: float) -> None:
        """The background thread's work: the deferred copies, agreed on by every rank, then the write."""
        try:
            self._staging.finish_copies(deferred, path, self._save, release=not borrowed)
            self._write(state, path, meta, timing, started, borrowed)
        finally:
            self._staging.release()  # whatever failed, the optimizers' steps never wait in vain

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
        self.wait()
        self._hold_live()
        if dataloader is not None:
            self._preemption.guard_workers(dataloader)
        choice = self._resumer.choose(step)
        if choice is None:
            self.extra, self.resumed_from, self.resume_notes = None, None, []
            return 0
        used, resumed, self.extra = self._resumer.restore(choice, model=model, optimizer=optimizer,
                                                          scheduler=scheduler, scaler=scaler, dataloader=dataloader,
                                                          strict=strict)
        self.resumed_from, self.resume_notes = used.tier, used.rejected
        if self._memory is not None:  # snapshots of later steps belong to the timeline this resume abandons
            self._memory.forget_after(resumed)
        self._settle_rollback()
        return resumed

    def _settle_rollback(self) -> None:
        """After the first resume since a rollback every rank has forgotten the later snapshots: from now on
        snapshots past the rollback's step are this run's own again."""
        marker = read_marker(self.root)
        if marker is None or marker.resumed or self._memory is None:  # without a memory tier nothing was forgotten
            return
        self._control.barrier()
        self._control.decide(lambda: write_marker(self.root, replace(marker, resumed=True)),
                             "cannot update the rollback marker", self.root)

    # ---- tiers ----------------------------------------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        """Shared memory this rank's snapshots take (0 without a memory tier)."""
        return self._memory.nbytes() if self._memory is not None else 0

    def memory_steps(self) -> tuple[int, ...]:
        """The steps of this rank's memory snapshots, oldest first (no collective)."""
        return tuple(s.step for s in self._memory.snapshots()) if self._memory is not None else ()

    # ---- preemption -----------------------------------------------------------------------------------

    def save_on_signal(self, *signals: int) -> None:
        """On any of `signals` (default SIGTERM), the next `stop_requested()` is True on every rank, and
        the save made then waits for its commit and exits the process (SystemExit(0)). The workers of the
        DataLoader given to `resume`/`save` ignore these signals, so that a signal to every process of the
        machine does not kill them (they exit with the training process)."""
        self._preemption.save_on_signal(*signals)

    def stop_requested(self) -> bool:
        """Whether any rank was signalled; call it at every step boundary on every rank (collective)."""
        return self._preemption.stop_requested()

    def close(self) -> None:
        """Wait for the save in flight, unhook the optimizers and release the process groups."""
        self.wait()
        self._record_saves()
        self._staging.close()
        if self._drain is not None:
            self._drain.close()
        if self._memory is not None:
            if self.release_memory_on_close:  # a finished run gives its shared memory back
                self._control.barrier()  # no rank releases while another may still resume from it
                self._memory.release()
            else:
                self._memory.close()
        for collective in (self._save, self._control, *((self._peers.collective,) if self._peers else ())):
            if collective.distributed:
                dist.destroy_process_group(collective.group)
        if self._live is not None:
            self._live.release()
        self._closed = True

    def _hold_live(self) -> None:
        """Say that this process trains the run (a local one) until close(), so that no rollback runs meanwhile."""
        if self._live is None and isinstance(self.root, Path):
            self._live = LiveLock(self.root)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, error: type[BaseException] | None, *exc: Any) -> None:
        if error is not None:  # leaving on an exception: a restart will want the memory snapshots
            self.release_memory_on_close = False
        self.close()
