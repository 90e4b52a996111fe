"""ResumableSampler: DistributedSampler's order, plus a position that survives a restart.

Each epoch is one permutation of the dataset drawn from `seed + epoch` (the
same order DistributedSampler gives), split over the ranks by interleaving.
The sampler counts the indices it hands out; a DataLoader with workers asks
for indices ahead of the batches training has taken, so the position saved
is what the loader's iterator has *yielded*, not what the sampler handed out.

The position is global: `start` (where in the epoch's order the current split
began) plus `world x consumed`. Resuming on another number of ranks splits
the rest of the epoch over the new ranks, so no sample is repeated or skipped.

A position is restored exactly where it was saved, as torchdata restores a
StatefulDataLoader: one saved at the end of an epoch resumes in that epoch,
whose pass yields nothing, and `set_epoch(epoch + 1)` starts the next. So the
loop may set the epoch from its own saved counter, from the step, or from
`sampler.epoch`: `set_epoch` with the epoch in progress keeps its position.
"""

from __future__ import annotations

import math
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sized
from types import FrameType
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import CheckpointError

__all__ = ["ResumableSampler"]

_FRAMES_TO_SEARCH = 8  # our __iter__ is called from the loader's iterator at most a few frames up


class _Pass:
    """One pass over this rank's share: hands out indices and counts them."""

    def __init__(self, sampler: ResumableSampler, indices: list[int], loader_iter: Any):
        self.sampler = sampler
        self.indices = indices
        self.handed = 0
        self.finished = False
        self.loader_iter = weakref.ref(loader_iter) if loader_iter is not None else None

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> int:
        self.sampler._first_index()
        if self.handed >= len(self.indices):
            self.finished = True
            raise StopIteration
        index = self.indices[self.handed]
        self.handed += 1
        return index

    def consumed(self) -> tuple[int, bool]:
        """(samples of this pass training has taken, whether the pass is complete)."""
        it = self.loader_iter() if self.loader_iter is not None else None
        if it is None:  # iterated directly (or its loader's iterator is gone): what was handed out counts
            return self.handed, self.finished
        if getattr(it, "_in_order", True) is False:
            raise CheckpointError("the DataLoader has in_order=False: batches arrive out of order, so no position "
                                  "in the sample order marks what training has consumed; use in_order=True")
        batches = it._num_yielded
        if not it._auto_collation:
            per_batch = 1
        else:
            batch_size = getattr(it._index_sampler, "batch_size", None)
            if not isinstance(batch_size, int):
                raise CheckpointError(f"the DataLoader's batch sampler {type(it._index_sampler).__name__} has no "
                                      "integer batch_size, so the samples consumed cannot be counted")
            per_batch = batch_size
        total_batches = len(it._index_sampler)
        return min(self.handed, batches * per_batch), batches >= total_batches


def _loader_iterator() -> Any:
    """The torch DataLoader iterator asking for our indices, if one is (found on the call stack)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    frame: FrameType | None = sys._getframe(2)
    for _ in range(_FRAMES_TO_SEARCH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _BaseDataLoaderIter):
            return owner
        frame = frame.f_back
    return None


class ResumableSampler(Sampler[int]):
    """A drop-in for DistributedSampler that knows how far training got and resumes there.

    Same arguments and the same order as `torch.utils.data.distributed.DistributedSampler`
    (each epoch shuffled from `seed + epoch`, padded or truncated to a multiple of the ranks).
    Call `set_epoch(epoch)` at the start of every epoch; with the epoch in progress it keeps the
    position, so after a resume the loop may set the epoch it saved, or `sampler.epoch`. A position
    saved at the end of an epoch resumes there: that pass yields nothing. Give the DataLoader (or
    this sampler) to `Checkpointer.save`/`resume`.
    """

    def __init__(self, dataset: Sized | int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        self.length = dataset if isinstance(dataset, int) else len(dataset)
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            ready = dist.is_available() and dist.is_initialized()
            num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if ready else 1)
            rank = rank if rank is not None else (dist.get_rank() if ready else 0)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._start = 0  # where in the epoch's order this split of the ranks begins
        self._offset = 0  # samples of this rank's share consumed before the next pass
        self._pass: _Pass | None = None
        self._order_cache: tuple[int, list[int]] | None = None
        self._share_cache: tuple[tuple[int, int], list[int]] | None = None
        # restored from a position saved while a pass was under way (or complete: the saving run's DataLoader
        # had an iterator for it, which the resumed run makes anew), and whether that pass was complete
        self._began = False
        self._complete = False
        self._on_first_index: Callable[[], None] | None = None
        self._on_new_epoch: Callable[[], None] | None = None

    # ---- the order ------------------------------------------------------------------------------------

    def _order(self) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != self.epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                order = torch.randperm(self.length, generator=g).tolist()
            else:
                order = list(range(self.length))
            self._order_cache = (self.epoch, order)
        return self._order_cache[1]

    def _share(self) -> list[int]:
        """This rank's indices from `start` to the end of the epoch, split as DistributedSampler splits."""
        if self._share_cache is not None and self._share_cache[0] == (self.epoch, self._start):
            return self._share_cache[1]
        rest = self._order()[self._start:]
        world = self.num_replicas
        if self.drop_last:
            rest = rest[:len(rest) // world * world]
        elif rest and len(rest) % world:
            padding = world - len(rest) % world
            rest = rest + (rest * math.ceil(padding / len(rest)))[:padding]
        self._share_cache = ((self.epoch, self._start), rest[self.rank::world])
        return self._share_cache[1]

    def __len__(self) -> int:
        return len(self._share()) - self._offset

    def __iter__(self) -> Iterator[int]:
        self._pass = _Pass(self, self._share()[self._offset:], _loader_iterator())
        return self._pass

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` (its own shuffle); the epoch already in progress keeps its position."""
        if epoch != self.epoch:
            self.epoch, self._start, self._offset, self._pass = epoch, 0, 0, None
            self._began = self._complete = False
            self._run_hook(self._on_new_epoch)

    def _run_later(self, hook: Callable[[], None], *, at_new_epoch: bool) -> None:
        """Run `hook` once, when this sampler next hands out an index (or, with `at_new_epoch`, when `set_epoch`
        starts another epoch before that), whichever comes first."""
        self._on_first_index, self._on_new_epoch = hook, hook if at_new_epoch else None

    def _first_index(self) -> None:
        self._run_hook(self._on_first_index)

    def _run_hook(self, hook: Callable[[], None] | None) -> None:
        if hook is not None:
            self._on_first_index = self._on_new_epoch = None
            hook()

    # ---- position -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: the epoch, where its split began and how much of its share was consumed."""
        consumed, complete = self._offset, self._complete
        if self._pass is not None:
            taken, complete = self._pass.consumed()
            consumed += taken
        # in_pass: the DataLoader has an iterator for this position (it made one for the pass, complete or not)
        return {"epoch": self.epoch, "start": self._start, "world": self.num_replicas, "rank": self.rank,
                "consumed": consumed, "complete": complete, "in_pass": self._pass is not None or self._began,
                "length": self.length, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from one rank's saved position (same number of ranks)."""
        self.load_states([state], same_world=True)

    def load_states(self, states: list[dict[str, Any]], *, same_world: bool) -> None:
        """Continue from the positions every rank saved: this rank's own when the number of ranks is the
        same, else the global position (the slowest rank's) split over the current ranks. A complete pass
        stays complete: the rest of its epoch is empty."""
        first = states[0]
        for key, mine in (("length", self.length), ("seed", self.seed), ("shuffle", self.shuffle),
                          ("drop_last", self.drop_last)):
            if first[key] != mine:
                raise CheckpointError(f"the sampler was saved with {key}={first[key]!r} and is now {key}={mine!r}: "
                                      "the sample order would differ, so the data position cannot be restored")
        if same_world:
            state = states[0]
            if state["world"] != self.num_replicas:
                raise CheckpointError(f"the sampler's position was saved on {state['world']} ranks and is loaded "
                                      f"on {self.num_replicas}")
            self.epoch, self._start, self._offset = state["epoch"], state["start"], state["consumed"]
            if state["complete"]:  # with a DataLoader's drop_last, what it dropped stays dropped
                self._offset = len(self._share())
            # checkpoints written before in_pass counted complete passes have in_pass False for them
            self._began = state.get("in_pass", True) or state["complete"]
        else:
            consumed = [s["consumed"] for s in states]
            if len(set(consumed)) > 1:
                warnings.warn(f"the ranks had consumed different numbers of samples ({consumed}); resuming on "
                              f"{self.num_replicas} ranks from the slowest, so the faster ranks' extra samples "
                              "are seen again", stacklevel=3)
            self.epoch = first["epoch"]
            self._start = min(self.length, first["start"] + first["world"] * min(consumed))
            if all(s["complete"] for s in states):
                self._start = self.length
            self._offset = 0
            self._began = False  # the generators are re-seeded at the resume, before any DataLoader draws
        self._complete = all(s["complete"] for s in states)
        self._pass = None
