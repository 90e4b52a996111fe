"""Asynchronous saves: the state copied where training cannot change it, then written in the background.

Tensors go into CPU staging buffers reused between saves (pinned when the source is on a GPU); plain
values are deep-copied. The CPU parameters and optimizer state change only in the optimizer's step, so
their copy is left to the background thread, running while the next forward and backward do, and each
optimizer's step waits for it (a step pre-hook: the fence). A save to host memory alone copies them not at
all: its snapshot is written from them, behind the same fence. At most one save is in flight.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..distributed.collective import Collective
from ..errors import CheckpointError
from ..storage import AnyPath
from .state import walk

__all__ = ["DeferredCopy", "SaveTiming", "Staging"]


@dataclass
class SaveTiming:
    """How long one `save` held up the training loop, and when the checkpoint became durable."""

    step: int
    path: AnyPath  # a local folder, or a RemotePath on an object store
    blocked_s: float = 0.0  # inside save() (waiting for the previous save, capturing), plus the optimizer
    # step's wait for the background copy
    durable_s: float | None = None  # from the call until the commit; None while in flight
    tiers: tuple[str, ...] = ()  # where this save goes: "memory", "disk"
    memory_s: float | None = None  # from the call until the memory snapshot was committed
    peer_s: float | None = None  # from the call until the buddy held its copy


@dataclass
class DeferredCopy:
    """A copy into a staging buffer left to the background thread, with the source's version when deferred."""

    name: str
    buffer: torch.Tensor
    source: torch.Tensor
    version: int


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _owned_by(model: Any, optimizers: tuple[Any, ...]) -> set[int]:
    """Storages that only an optimizer step changes: the parameters (their local shards) and optimizer state."""
    owned = {_storage(_local(p)) for p in model.parameters()} if model is not None else set()
    for optimizer in optimizers:
        for state in optimizer.state.values():
            owned.update(_storage(_local(v)) for v in state.values() if isinstance(v, torch.Tensor))
    owned.discard(0)  # empty tensors share no memory worth tracking
    return owned


def _copy_deferred(deferred: Sequence[DeferredCopy], path: AnyPath) -> None:
    for job in deferred:
        job.buffer.copy_(job.source)
        # unchanged after the copy: nothing wrote to it since save() began, so the copy is whole
        if job.source._version != job.version:
            raise CheckpointError(
                "was changed in place after save() returned and before its background copy finished "
                "(only the optimizer's step may change parameters then, and it waits for the copy); "
                "the checkpoint was not written", file=str(path), tensor=job.name)


class Staging:
    """The staging buffers, the optimizers' fences and the background thread of one Checkpointer."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self._error: BaseException | None = None  # the background's, raised at the next wait
        self._staged = threading.Event()  # clear while the background thread still copies state
        self._staged.set()
        self._inflight: SaveTiming | None = None
        self._fences: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # optimizer -> hook
        self._buffers: dict[str, torch.Tensor] = {}  # by state name, reused between saves

    def stage(self, state: dict[str, Any], model: Any, optimizers: tuple[Any, ...],
              borrow: bool = False) -> tuple[dict[str, Any], list[DeferredCopy], dict[str, int]]:
        """A copy of `state` that training cannot change, and the copies deferred to the background thread
        (those of the CPU parameters and optimizer state, which the optimizers' steps then wait for).

        With `borrow`, those tensors are not copied at all: the staged state holds training's own, the third
        result their version counters, and the optimizers' steps wait until `release` (a memory snapshot is
        itself the copy: written straight from them, it spares a pass over the state and its buffers)."""
        staged, deferred, borrowed = self._copy(state, _owned_by(model, optimizers) if optimizers else set(), borrow)
        if deferred or borrowed:
            self._fence(optimizers)
            self._staged.clear()
        return staged, deferred, borrowed

    def release(self) -> None:
        """The borrowed tensors are written: the optimizers' steps may change them again."""
        self._staged.set()

    def start(self, work: Callable[[], None], timing: SaveTiming, name: str) -> None:
        """Run `work` (finishing the copies, writing) in the background; its error is raised by `wait`."""
        def run() -> None:
            try:
                work()
            except BaseException as exc:  # handed to the training thread at its next save or wait
                self._error = exc

        self._inflight = timing
        self.thread = threading.Thread(target=run, name=name)
        try:
            self.thread.start()
        except BaseException:
            self._staged.set()  # no copy will come: the optimizer's step must not wait for one
            self.thread = None
            raise

    def finish_copies(self, deferred: Sequence[DeferredCopy], path: AnyPath, collective: Collective,
                      release: bool = True) -> None:
        """Make the deferred copies (background thread); raise on every rank when any rank's copy failed,
        so that none is left waiting inside the save's collectives. A failed rank raises its own error.
        Without `release` the optimizers' steps still wait afterwards (for tensors borrowed, until `release()`)."""
        own: Exception | None = None

        def copy_mine() -> None:
            nonlocal own
            try:
                _copy_deferred(deferred, path)
            except Exception as exc:
                own = exc
                raise
            finally:
                if release:
                    self._staged.set()

        failed = [o for o in collective.everyone(copy_mine) if not o.ok]
        if own is not None:
            raise own
        if failed:
            raise CheckpointError(f"not written: rank {failed[0].rank}'s copy of the state failed ({failed[0].error})",
                                  file=str(path))

    def wait(self) -> None:
        """Block until the save in flight (if any) is done; raise its error if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Unhook the optimizers (after `wait`)."""
        for handle in list(self._fences.values()):
            handle.remove()
        self._fences.clear()

    def _copy(self, state: dict[str, Any], deferrable: set[int],
              borrow: bool) -> tuple[dict[str, Any], list[DeferredCopy], dict[str, int]]:
        """`state` with tensors in reused CPU buffers and plain values deep-copied; CPU tensors whose storage
        is in `deferrable` are not copied yet: their copies are returned, for the background thread (or, with
        `borrow`, they stay as they are, with their version counters returned)."""
        buffers = self._buffers
        on_gpu = False
        deferred: list[DeferredCopy] = []
        borrowed: dict[str, int] = {}

        def copy_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
            nonlocal on_gpu
            local = _local(tensor)
            if borrow and not local.is_cuda and _storage(local) in deferrable:
                borrowed[name] = local._version
                return tensor
            buffer = buffers.get(name)
            if buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
                buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)
                buffers[name] = buffer
            if not local.is_cuda and _storage(local) in deferrable:
                deferred.append(DeferredCopy(name, buffer, local.detach(), local._version))
            else:
                on_gpu |= local.is_cuda
                buffer.copy_(local.detach(), non_blocking=local.is_cuda)
            if isinstance(tensor, DTensor):
                # the same placements and global shape over the CPU copy (from_local would move it back)
                return DTensor(buffer, tensor._spec, requires_grad=False)
            return buffer

        staged = walk(state, copy_tensor, lambda name, value: copy.deepcopy(value))
        if on_gpu:
            torch.cuda.synchronize()
        return staged, deferred, borrowed

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
