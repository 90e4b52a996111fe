"""Resumable training: the whole training state saved in shards, resumed exactly, safe against crashes.

    from tensormorph.train import Checkpointer, ResumableSampler
    ckpt = Checkpointer("runs/exp1", keep=3, async_save=True)
    start = ckpt.resume(model=model, optimizer=opt, scheduler=sched, dataloader=loader)

docs/training.md describes what is saved, the exactness guarantees, async saves,
crash safety, retention and preemption.
"""

from __future__ import annotations

from .checkpointer import Checkpointer, CheckpointInfo, SaveTiming
from .sampler import ResumableSampler

__all__ = ["CheckpointInfo", "Checkpointer", "ResumableSampler", "SaveTiming"]
