"""A resumable training loop: a small transformer on synthetic data, checkpointed with tensormorph.train.

    python examples/train_resumable.py                              # one process
    torchrun --nproc_per_node 2 examples/train_resumable.py         # 2 ranks, FSDP2 on gloo (CPU)

Kill it at any moment (Ctrl-C, `kill -9`, a lost machine) and run the same command again: it continues
from the newest committed checkpoint in runs/exp1 as if nothing had happened. `kill -TERM` (what a spot
instance receives) makes it save at the next step boundary and exit cleanly. `--fresh` starts over.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tensormorph.train import Checkpointer, ResumableSampler

VOCAB, CONTEXT = 256, 32


class Copying(Dataset):
    """Sequences whose second half repeats the first: a model that attends learns it. Sample i comes from i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        half = torch.randint(1, VOCAB, (CONTEXT // 2,), generator=torch.Generator().manual_seed(i))
        return torch.cat([half, half])


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, dim: int = 128, heads: int = 4, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(CONTEXT, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("mask", torch.triu(torch.full((CONTEXT, CONTEXT), float("-inf")), 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The loss of predicting the repeated second half of each sequence (the first half is unpredictable)."""
        inputs = tokens[:, :-1]
        x = self.embed(inputs) + self.pos[: inputs.shape[1]]
        for block in self.blocks:
            x = block(x, self.mask[: inputs.shape[1], : inputs.shape[1]])
        logits = self.head(x)[:, CONTEXT // 2 - 1:]
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, CONTEXT // 2:].reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="runs/exp1", help="checkpoint folder (default runs/exp1)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--sync", action="store_true", help="synchronous saves (default: asynchronous)")
    p.add_argument("--fresh", action="store_true", help="delete the checkpoint folder and start over")
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    if args.fresh and rank == 0:
        shutil.rmtree(args.root, ignore_errors=True)
    if world > 1:
        dist.barrier()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = TinyTransformer()
    torch.manual_seed(1234 + rank)  # each rank its own dropout masks
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    warmup = 30
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    data = Copying(4096)
    sampler = ResumableSampler(data, world, rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=2)

    ckpt = Checkpointer(args.root, keep=args.keep, async_save=not args.sync)
    ckpt.save_on_signal(signal.SIGTERM)
    start = ckpt.resume(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    tokens = ckpt.extra["tokens_seen"] if ckpt.extra else 0
    if rank == 0:
        print(f"{'resumed from step ' + str(start) if start else 'starting'}: {world} rank(s), epoch {sampler.epoch}, "
              f"checkpoints in {args.root}", flush=True)

    def batches():
        while True:
            yield from loader
            sampler.set_epoch(sampler.epoch + 1)

    stream = batches()
    started = time.perf_counter()
    for step in range(start, args.steps):
        tokens_in = next(stream)
        loss = model(tokens_in)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        tokens += tokens_in.numel() * world
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1:4d}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"{(time.perf_counter() - started) / (step + 1 - start):.3f} s/step", flush=True)
        stop = ckpt.stop_requested()  # collective: every rank asks at every step
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps or stop:
            if stop and rank == 0:
                print(f"signalled: saving step {step + 1}, then exiting", flush=True)
            timing = ckpt.save(step + 1, model=model, optimizer=opt, scheduler=sched, dataloader=loader,
                               extra={"tokens_seen": tokens})
            if rank == 0:
                print(f"saved step {step + 1} (training blocked {timing.blocked_s * 1e3:.1f} ms)", flush=True)
    ckpt.wait()
    if rank == 0:
        latest = ckpt.latest()
        print(f"done: {tokens} tokens; newest checkpoint {latest.path} ({latest.size / 2**20:.1f} MiB); kept: "
              f"{[i.step for i in ckpt.list()]}", flush=True)
    ckpt.close()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
