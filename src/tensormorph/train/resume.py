"""Resuming: which checkpoint, and its state put back into the model, optimizer, scheduler, scaler, data
loader and random generators, so that the resumed run continues as the uninterrupted one would have.

Every rank's generators and data position are plain values in the manifest. All are read (no data file
is touched for them); a rank uses its own, and another world size uses every rank's data position.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..distributed import load as tm_load
from ..distributed.collective import Collective
from ..errors import CheckpointError
from ..storage import AnyPath, LocalFiles, as_path, store_at
from ..tmformat.checkpoint import read_manifest
from ..tmformat.manifest import Manifest
from . import rng
from .manager import TRAIN_KEY, CheckpointManager
from .memory import LAYOUT_KEY, MemoryTier
from .optim_shell import OPTIMIZERS_KEY, prefill
from .peers import PeerTier
from .plain import from_plain, to_plain
from .rollback import read_marker
from .state import component_states, generator_state, loader_parts, optimizers

__all__ = ["Choice", "Resumer"]


@dataclass(frozen=True)
class Choice:
    """Where a resume reads from: the tier ("memory" or "disk"), the step, the snapshot or checkpoint, the newer
    steps passed over and why, and the disk checkpoint to use when a memory snapshot fails on any rank."""

    tier: str
    step: int
    path: AnyPath
    rejected: list[str] = field(default_factory=list)
    fallback: Choice | None = None
    plan: list[tuple[int, int, int]] = field(default_factory=list)  # (holder, rank, step): copies to give back
    options: dict[str, Any] | None = None  # storage options of a disk or object-store checkpoint


@dataclass
class _Generators:
    """One rank's saved generator states, and its DataLoader's own generator's (when it has one)."""

    states: dict[str, Any] | None
    loader: bytes | None = None


class Resumer:
    """Resumes from the checkpoints of `manager` on `control`'s ranks. A generator restore that must wait
    for the data loader's first index is held here meanwhile: it is the state a save in between captures."""

    def __init__(self, manager: CheckpointManager, control: Collective,
                 storage_options: dict[str, Any] | None = None, memory: MemoryTier | None = None,
                 peers: PeerTier | None = None, remote: CheckpointManager | None = None,
                 remote_options: dict[str, Any] | None = None) -> None:
        self._manager = manager
        self._remote, self._remote_storage_options = remote, remote_options
        self._memory = memory
        self._peers = peers
        self._control = control
        self._storage_options = storage_options
        self._pending: _Generators | None = None
        self._pending_data: tuple[Any, dict[str, Any]] | None = None  # a StatefulDataLoader's, until it iterates
        self._prefilled: tuple[Any, ...] = ()  # optimizers given empty state shells by the resume under way

    def choose(self, step: int | None) -> Choice | None:
        """What to resume: the newest step, or `step`, on the fastest tier that holds it complete (a memory
        snapshot counts only when every rank has one of that step); None when there is nothing. Collective."""
        found = self._control.decide(lambda: [(i.step, str(i.path), i.seq) for i in self._manager.list()],
                                     "cannot list the checkpoints", self._manager.root)
        marker = read_marker(self._manager.root)
        own = [s.step for s in self._memory.snapshots()] if self._memory is not None else []
        held = self._peers.held() if self._peers is not None else {}
        if marker is not None and not marker.resumed:  # snapshots of steps a rollback abandoned, on any machine
            own, held = [s for s in own if s <= marker.step], {o: [s for s in steps if s <= marker.step]
                                                               for o, steps in held.items()}
        shared = self._control.gather((own, held)) if self._memory is not None else []
        everyone = [steps for steps, _ in shared]
        # a step counts for a rank when it holds the snapshot, or another rank holds a copy of it
        copies = {(origin, step): holder for holder, (_, held_there) in reversed(list(enumerate(shared)))
                  for origin, steps in held_there.items() for step in steps}  # the lowest-ranked holder of each
        available = [set(steps) | {step for (origin, step) in copies if origin == rank}
                     for rank, steps in enumerate(everyone)]
        complete = set.intersection(*available) if available else set()
        notes: list[str] = []
        stored: list[tuple[int, str, int]] = []
        if self._remote is not None:  # an object store that does not answer leaves the faster tiers to resume
            remote = self._remote
            try:
                stored = self._control.decide(lambda: [(i.step, str(i.path), i.seq) for i in remote.list()
                                                       if not (marker and marker.abandons(i.step, i.seq))],
                                              "cannot list the object store's checkpoints", remote.root)
            except CheckpointError as exc:
                notes.append(f"the object store was not listed: {exc.reason}")
        if step is not None:
            found, stored = [f for f in found if f[0] == step], [f for f in stored if f[0] == step]
            complete &= {step}
            if not found and not stored and not complete:
                raise CheckpointError(f"has no committed checkpoint of step {step}", file=str(self._manager.root))
        # the disk and the object store compare by commit order: after a rollback a higher step can be older
        on_remote = bool(stored) and (not found or stored[-1][2] > found[-1][2])
        newest_disk = stored[-1] if on_remote else (found[-1] if found else None)
        rejected = notes + [
            f"step {s} is in memory on ranks {[r for r, steps in enumerate(everyone) if s in steps]} only"
            for s in sorted({s for steps in everyone for s in steps} - complete, reverse=True)
            if s > max(complete, default=-1) and (step is None or s == step)]
        options = self._remote_storage_options if on_remote else self._storage_options
        disk = None if newest_disk is None else Choice(
            "remote" if on_remote else "disk", newest_disk[0], as_path(newest_disk[1], options, cache=False),
            rejected, options=options)
        # every whole memory step at least as new as the disk's, newest first, each falling back to the next
        choice = disk
        for candidate in sorted(s for s in complete if newest_disk is None or s >= newest_disk[0]):
            assert self._memory is not None
            plan = [(copies[(rank, candidate)], rank, candidate) for rank, steps in enumerate(everyone)
                    if candidate not in steps]
            choice = Choice("peer" if plan else "memory", candidate, self._memory.folder / f"step-{candidate:08d}",
                            rejected, fallback=choice, plan=plan)
        return choice

    def restore(self, choice: Choice, *, model: Any, optimizer: Any, scheduler: Any, scaler: Any, dataloader: Any,
                strict: bool) -> tuple[Choice, int, Any]:
        """Load what `choice` names into what is given (collective): a memory snapshot, or when any rank cannot
        (damaged, another layout), the disk checkpoint; what was used, its step and its `extra`."""
        given = optimizers(optimizer)
        self._prefilled = ()
        while choice.tier in ("memory", "peer"):  # the newest whole memory step, then older ones, then the disk
            restored = self._from_memory(choice, given, model, scheduler, scaler, dataloader, strict)
            if not isinstance(restored, str):
                return choice, *restored
            reason = restored
            if choice.fallback is None:
                raise CheckpointError(f"cannot resume step {choice.step} from memory ({reason}), and no older "
                                      "snapshot or disk checkpoint exists", file=str(self._manager.root))
            choice = replace(choice.fallback, rejected=[*choice.rejected,
                                                        f"step {choice.step} in memory: {reason}"])
        path = choice.path
        manifest = read_manifest(store_at(path), str(path))
        target = self._target(model, given, scheduler, scaler, manifest, dataloader)
        tm_load(path if isinstance(path, Path) else str(path), target, strict=strict, storage_options=choice.options)
        step, extra = self._apply(path, manifest.extra[TRAIN_KEY], target, model, given, scheduler, scaler, dataloader)
        return choice, step, extra

    def _from_memory(self, choice: Choice, given: tuple[Any, ...], model: Any, scheduler: Any, scaler: Any,
                     dataloader: Any, strict: bool) -> tuple[int, Any] | str:
        """Load the memory snapshot `choice` names on every rank (its peer copies given back first): its step and
        `extra`, or why some rank could not."""
        assert self._memory is not None and isinstance(choice.path, Path)
        snapshot, memory = choice.path, self._memory
        delivered: str | None = None  # why a copy from a peer did not arrive
        if choice.plan:  # ranks without their own snapshot get it back from the ranks holding copies
            peers, plan = self._peers, choice.plan
            assert peers is not None
            packed = self._control.run(lambda: peers.pack(plan), label="peer copy: ")  # kept here, not gathered
            unreadable = [error for error in self._control.gather(packed.error) if error is not None]
            if unreadable:  # a holder lost its copy: nothing is sent, and the load below falls back
                delivered = unreadable[0]
            else:  # every holder has its copy in hand: none is waited for in vain
                delivered = self._control.run(lambda: peers.deliver(plan, packed.unwrap()),
                                              label="peer copy: ").error
        world = self._control.world
        filled: dict[str, Any] = {}

        def load_mine() -> dict[str, Any]:
            # everything that may fail on one rank happens here, where every rank learns of it and falls back
            if delivered is not None and any(origin == self._control.rank for _, origin, _ in choice.plan):
                raise CheckpointError(f"its copy from a peer did not arrive ({delivered})")
            files = LocalFiles(snapshot)
            try:
                manifest = read_manifest(files, str(snapshot))
            finally:
                files.close()
            target = filled["target"] = self._target(model, given, scheduler, scaler, manifest, dataloader)
            meta = memory.load(snapshot, target, strict=strict)[TRAIN_KEY]
            if meta["world_size"] != world:  # a snapshot holds one rank's share: only its own world resumes
                raise CheckpointError(f"it was saved on {meta['world_size']} ranks, this run has {world}")
            return meta

        outcomes = self._control.everyone(load_mine, label="memory snapshot: ")
        failed = [o for o in outcomes if not o.ok]
        if not failed:
            target = filled["target"]
            if self._peers is not None:  # the buddies hold this step again: a copy never lags behind a resume
                tier = self._peers
                copied = [o for o in self._control.everyone(lambda: tier.exchange(snapshot), label="peer copy: ")
                          if not o.ok]
                if copied:  # the resume stands; the next save copies again
                    warnings.warn(f"giving the buddies step {choice.step} again failed: rank {copied[0].rank}: "
                                  f"{copied[0].error}", stacklevel=1)
            for rank, position in enumerate(self._control.gather(target.get(f"data.rank{self._control.rank}"))):
                target[f"data.rank{rank}"] = position  # every rank's, as a disk checkpoint holds them
            return self._apply(choice.path, outcomes[self._control.rank].unwrap(), target, model, given, scheduler,
                               scaler, dataloader)
        return f"rank {failed[0].rank}: {failed[0].error}"

    def _target(self, model: Any, given: tuple[Any, ...], scheduler: Any, scaler: Any, manifest: Manifest,
                dataloader: Any) -> dict[str, Any]:
        """The state to fill: the components given (empty optimizers shaped from the checkpoint, which spares
        torch's state-making step), and the plain values the checkpoint holds for them."""
        for optimizer in self._prefilled:  # shells of an attempt that failed: torch's path must see them empty
            optimizer.state.clear()
        layouts = manifest.extra.get(LAYOUT_KEY, {})  # a memory snapshot's records hold local shapes
        saved = {name: (record.dtype, tuple(layouts[name]["shape"]) if name in layouts else record.shape)
                 for name, record in manifest.tensors.items()}
        if prefill(model, given, saved, manifest.extra.get(TRAIN_KEY, {}).get(OPTIMIZERS_KEY)):
            self._prefilled = given
        objects = manifest.objects
        target: dict[str, Any] = {"step": None, **component_states(model, given, scheduler, scaler)}
        if "extra" in objects:
            target["extra"] = None
        for name in objects:
            if name.startswith(("rng.rank", "data.rank")):
                target[name] = None
        if dataloader is not None and not any(n.startswith("data.rank") for n in objects):
            target["data.rank0"] = None  # reported as missing: the checkpoint holds no data position
        return target

    def _apply(self, path: AnyPath, meta: dict[str, Any], target: dict[str, Any], model: Any,
               given: tuple[Any, ...], scheduler: Any, scaler: Any, dataloader: Any) -> tuple[int, Any]:
        """Put the filled state into the components; the step and the saved `extra`."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if model is not None:
            if given:
                set_state_dict(model, given, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
            else:
                set_model_state_dict(model, target["model"])
        if scheduler is not None:
            scheduler.load_state_dict(target["scheduler"])
        if scaler is not None:
            scaler.load_state_dict(target["scaler"])
        self._restore_position(path, meta, target, dataloader)
        return int(meta["step"]), target.get("extra")

    def generator_states(self) -> dict[str, Any]:
        """This process's generator states, as they are or as a pending restore will make them."""
        pending = self._pending
        return pending.states if pending is not None and pending.states else rng.capture()

    def data_position(self, dataloader: Any) -> dict[str, Any]:
        """This rank's data position, as plain values."""
        kind, sampler, loader = loader_parts(dataloader)
        if kind == "stateful":
            saved = self._pending_data
            if saved is not None and saved[0] is loader:  # its state_dict() would make the iterator now
                return saved[1]
            return {"kind": kind, "state": to_plain(loader.state_dict(), "dataloader")}
        pending = self._pending
        generator = pending.loader if pending is not None and pending.loader else generator_state(loader)
        assert sampler is not None
        return {"kind": kind, "state": sampler.state_dict(), "generator": generator}

    def _restore_position(self, path: AnyPath, meta: dict[str, Any], target: dict[str, Any], dataloader: Any) -> None:
        """The data position and the generators; per-rank random streams are re-seeded from the run's seed,
        the step and the rank on another world size."""
        rank, world = self._control.rank, self._control.world
        same_world = meta["world_size"] == world
        generators = _Generators(target.get(f"rng.rank{rank}") if same_world else None)
        if generators.states is None:
            rng.reseed(rng.derive_seed(meta["seed"], meta["step"], rank, world))
        data: list[Any] = [target.get(f"data.rank{r}") for r in range(meta["world_size"])]
        if dataloader is None or any(d is None for d in data):  # no position saved: only with strict=False
            self._restore(generators, None)
            return
        kind, sampler, loader = loader_parts(dataloader)
        if any(d["kind"] != kind for d in data):
            raise CheckpointError(f"holds a {data[0]['kind']} data position, and a {kind} was given", file=str(path))
        if kind == "stateful":
            if not same_world:
                raise CheckpointError(
                    f"was saved on {meta['world_size']} ranks and is resumed on {world}: a "
                    "StatefulDataLoader's state is one rank's share of the data and cannot be split anew; use a "
                    "ResumableSampler, or resume without dataloader= to start the data afresh", file=str(path))
            loader.load_state_dict(from_plain(data[rank]["state"]))
            if not isinstance(loader, DataLoader):  # no DataLoader iterator, no draw of it to wait for
                self._restore(generators, None)
                return
            # The loader makes its iterator, and its sampler's order, when the loop next iterates it, after the
            # loop's set_epoch; that draws from the global generator, where the uninterrupted run (which had its
            # iterator) drew nothing. The generators are restored right after that draw; until then a save
            # stores the saved generator states and data position.
            self._pending, self._pending_data = generators, (loader, data[rank])
            _after_next_iterator(loader, lambda: self._restore(generators, None))
            return
        assert sampler is not None
        sampler.load_states([data[rank]["state"]] if same_world else [d["state"] for d in data], same_world=same_world)
        if loader is None or not same_world:
            # the sampler alone: whoever iterates it makes no draw of its own; on another number of ranks the
            # generators were re-seeded above, before any draw
            self._restore(generators, None)
            return
        generators.loader = data[rank]["generator"]
        # A DataLoader draws from a generator when it makes an iterator. When no pass was under way at the save
        # (none had begun in that epoch) the uninterrupted run makes one at the next pass too, so the generators
        # are restored now and the draws match. When one was (mid-pass, or complete: its end not yet seen) it
        # had an iterator, the resumed loader makes one: the restore waits for that loader's first index. A
        # loop that skips the rest of the pass and sets another epoch first makes one iterator, as the
        # uninterrupted run does: then the restore comes at that set_epoch. Workers that persist keep their
        # iterator across passes, so with them the restore always waits for the first index.
        persistent = loader.persistent_workers and loader.num_workers > 0
        if not sampler._began and not persistent:
            self._restore(generators, loader)
        else:
            self._pending = generators
            sampler._run_later(lambda: self._restore(generators, loader), at_new_epoch=not persistent)

    def _restore(self, generators: _Generators, loader: Any) -> None:
        self._pending = self._pending_data = None
        if generators.states is not None:
            rng.restore(generators.states)
        if generators.loader is not None and isinstance(getattr(loader, "generator", None), torch.Generator):
            loader.generator.set_state(torch.frombuffer(bytearray(generators.loader), dtype=torch.uint8))


def _after_next_iterator(loader: DataLoader, hook: Callable[[], None]) -> None:
    """Run `hook` once, right after `loader` next makes an iterator (DataLoader.__iter__ calls `_get_iterator`)."""
    vars(loader).pop("_get_iterator", None)  # the hook of an earlier resume that never ran
    make = loader._get_iterator

    def make_then_hook() -> Any:
        vars(loader).pop("_get_iterator", None)
        iterator = make()
        hook()
        return iterator

    setattr(loader, "_get_iterator", make_then_hook)  # noqa: B010  (an instance attribute over the method)
