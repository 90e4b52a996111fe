"""Resuming across an epoch boundary, for every kind of data loader the Checkpointer takes (one process per rank).

    python epoch_loop.py --root R --out O --phase run|resume --variants V ... [--world 2 --rank 0 --port P]

Each variant trains 2 epochs of 12 steps in the loop torchdata documents, `sampler.set_epoch(epoch)` before each
pass, with the epoch counter saved in each checkpoint's `extra` and resumed from it (or, `*-epoch-from-step`,
derived from the step). The model, samples and loss are train_loop.py's: dropout, so that every loss depends on
the torch generator, and a loss weighted by Python's and NumPy's generators; FSDP2 on gloo with --world > 1.
- `run`: uninterrupted, saving at step 12 (the end of epoch 0) and step 16 (inside epoch 1).
- `resume`: a fresh model, optimizer, scheduler, loader and Checkpointer each time: resumed from step 16 and
  saved at once, before the loop sets the epoch or asks for a batch (which replaces checkpoint 16); resumed from
  that checkpoint again; resumed from step 12. Each trains to the end.
Every step appends `{"variant", "from", "step", "loss", "ids"}` to `<out>/<phase>-rank<r>.jsonl`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, default_collate
from torch.utils.data.distributed import DistributedSampler
from train_loop import Synthetic, bits, model_optimizer_scheduler

STEPS_PER_EPOCH = 12
BATCH = 2
STEPS = 2 * STEPS_PER_EPOCH
SAVE_AT = (12, 16)

# variant -> (sampler, loader, worker processes, persistent workers)
VARIANTS = {
    "sampler": ("resumable", "torch", 0, False),
    "sampler-workers": ("resumable", "torch", 2, False),
    "sampler-persistent": ("resumable", "torch", 2, True),
    "sampler-alone": ("resumable", None, 0, False),  # the sampler given to the Checkpointer and iterated directly
    "sampler-workers-epoch-from-step": ("resumable", "torch", 2, False),
    "sampler-persistent-epoch-from-step": ("resumable", "torch", 2, True),
    "stateful": ("distributed", "stateful", 0, False),
    "stateful-workers": ("distributed", "stateful", 2, False),
    "stateful-persistent": ("distributed", "stateful", 2, True),
    "stateful-sampler-workers": ("stateful-distributed", "stateful", 2, False),
}


def _training(variant: str, world: int, rank: int):
    """Model, optimizer, scheduler, sampler and what is iterated (and given to the Checkpointer) for `variant`."""
    from tensormorph.train import ResumableSampler

    random.seed(11)
    np.random.seed(12)
    model, opt, sched = model_optimizer_scheduler(world)

    kind, loader_kind, workers, persistent = VARIANTS[variant]
    data = Synthetic(STEPS_PER_EPOCH * BATCH * world)
    if kind == "resumable":
        sampler = ResumableSampler(data, world, rank, shuffle=True, seed=7)
    elif kind == "distributed":
        sampler = DistributedSampler(data, world, rank, shuffle=True, seed=7)
    else:
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

        sampler = StatefulDistributedSampler(data, world, rank, shuffle=True, seed=7)
    options = dict(batch_size=BATCH, sampler=sampler, num_workers=workers, persistent_workers=persistent)
    if loader_kind == "torch":
        loader = DataLoader(data, **options)
    elif loader_kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(data, **options)
    else:
        loader = sampler
    return model, opt, sched, sampler, loader, data


def _batches(loader, data):
    """The batches of one pass: the loader's, or the sampler's indices batched here."""
    if isinstance(loader, DataLoader):
        yield from loader
        return
    indices = iter(loader)  # taken a batch at a time: what the sampler hands out is what training consumed
    while batch := list(itertools.islice(indices, BATCH)):
        yield default_collate([data[i] for i in batch])


def _train(args, variant: str, resume_from: int | None, records, tag: str) -> None:
    from tensormorph.train import Checkpointer

    rank = args.rank
    model, opt, sched, sampler, loader, data = _training(variant, args.world, rank)
    ckpt = Checkpointer(Path(args.root) / variant)
    state = dict(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    step = epoch = 0
    if resume_from is not None:
        step = ckpt.resume(**state, step=resume_from)
        assert step == resume_from, (step, resume_from)
        epoch = step // STEPS_PER_EPOCH if variant.endswith("-epoch-from-step") else ckpt.extra["epoch"]
        if tag == "resaved":
            ckpt.save(step, **state, extra={"epoch": epoch})
    while step < STEPS:
        sampler.set_epoch(epoch)
        for ids, x, y in _batches(loader, data):
            weight = 1 + 0.1 * random.random() + 0.1 * abs(float(np.random.standard_normal()))
            loss = nn.functional.mse_loss(model(x), y) * weight
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            records.write(json.dumps({"variant": variant, "from": tag, "step": step, "loss": bits(loss.item()),
                                      "ids": ids.tolist()}) + "\n")
            step += 1
            if resume_from is None and step in SAVE_AT:
                ckpt.save(step, **state, extra={"epoch": epoch})
        epoch += 1
    ckpt.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--phase", choices=["run", "resume"], required=True)
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), required=True)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(1)
    if args.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world)
    with open(Path(args.out) / f"{args.phase}-rank{args.rank}.jsonl", "a") as records:
        for variant in args.variants:
            if args.phase == "run":
                _train(args, variant, None, records, "run")
            else:
                for resume_from, tag in ((16, "resaved"), (16, "16"), (12, "12")):
                    _train(args, variant, resume_from, records, tag)
    if args.world > 1:
        dist.destroy_process_group()
    print("DONE", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
