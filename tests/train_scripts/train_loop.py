"""A tiny training run driven by the resumable-training tests (one process per rank).

    python train_loop.py --root R --out O --tag T --steps 24 --save-every 3 [--world 2 --rank 0 --port P]

The model has dropout, the DataLoader shuffles with worker processes, AdamW runs
with a warm-up scheduler, and Python's and NumPy's generators weigh each loss; with
--world > 1 the model is sharded with FSDP2 on gloo. Every step appends
`{"step", "loss", "ids"}` to `<out>/<tag>-rank<r>.jsonl`
(the loss as the hex of its float32 bits) and flushes, so a killed run leaves
what it trained. After `ckpt.save(k)` for k in --markers, every rank waits
until the save is durable, rank 0 prints `DURABLE k`, and the ranks pause until
the test, on reading that line, kills them (so the kill lands right after that
save and the resumed run starts from it).
At the end every rank's model, optimizer, scheduler, scaler and generator
states are saved with tensormorph.save to `<out>/final-<tag>`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


class Synthetic(torch.utils.data.Dataset):
    """Sample i is made from i alone, so a sample id says exactly what was trained on."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(1000 + i)
        return i, torch.randn(8, generator=g), torch.randn(4, generator=g)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 32), nn.GELU(),
                         nn.Dropout(0.3), nn.Linear(32, 4))


def model_optimizer_scheduler(world: int):
    """The model (FSDP2 per linear layer and whole, beyond one rank), AdamW and a warm-up schedule."""
    model = build_model()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    return model, opt, sched


def bits(x: float) -> str:
    return struct.pack("<f", x).hex()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--save-at", type=int, nargs="*", default=[])
    p.add_argument("--markers", type=int, nargs="*", default=[])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--loader", choices=["sampler", "stateful"], default="sampler")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--scaler", action="store_true")
    p.add_argument("--preempt", action="store_true")
    p.add_argument("--dump-resumed", action="store_true", help="save the state right after resume, then go on")
    p.add_argument("--memory-every", type=int, default=None, help="memory-tier snapshots every N steps")
    p.add_argument("--disk-every", type=int, default=1, help="disk checkpoints at every N-th save step")
    p.add_argument("--nodes", default=None, help="each rank's node name, comma-separated (for the memory tier)")
    p.add_argument("--peers", action="store_true", help="copy each memory snapshot to a rank on another node")
    args = p.parse_args()

    from torch.distributed.checkpoint.state_dict import get_state_dict

    import tensormorph as tm
    from tensormorph.train import Checkpointer, ResumableSampler
    from tensormorph.train import rng as tm_rng

    torch.set_num_threads(1)
    random.seed(11)
    np.random.seed(12)
    rank, world = args.rank, args.world
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    model, opt, sched = model_optimizer_scheduler(world)
    scaler = torch.amp.GradScaler("cpu") if args.scaler else None

    data = Synthetic(args.samples)
    if args.loader == "sampler":
        sampler = ResumableSampler(data, world, rank, shuffle=True, seed=7)
        loader = torch.utils.data.DataLoader(data, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                                             persistent_workers=args.persistent)
    else:
        from torchdata.stateful_dataloader import StatefulDataLoader

        sampler = None
        loader = StatefulDataLoader(data, batch_size=args.batch, shuffle=True, num_workers=args.workers,
                                    persistent_workers=args.persistent)

    ckpt = Checkpointer(args.root, keep=3, async_save=not args.sync, memory_every=args.memory_every,
                        disk_every=args.disk_every, node=args.nodes.split(",")[rank] if args.nodes else None,
                        peers=args.peers)
    if args.preempt:
        ckpt.save_on_signal()
    state = dict(model=model, optimizer=opt, scheduler=sched, scaler=scaler, dataloader=loader)
    start = ckpt.resume(**state)
    tokens = ckpt.extra["tokens_seen"] if ckpt.extra else 0
    out = Path(args.out)
    if args.dump_resumed:
        msd, osd = get_state_dict(model, opt)
        tm.save({"model": msd, "optimizer": osd, f"rng.rank{rank}": torch.get_rng_state()},
                out / f"resumed-{args.tag}", overwrite=True)
    if rank == 0:
        print(f"RESUMED {start}", flush=True)
        print(f"RESUMED-FROM {ckpt.resumed_from} {json.dumps(ckpt.resume_notes)}", flush=True)

    def batches():
        while True:
            yield from loader
            if sampler is not None:
                sampler.set_epoch(sampler.epoch + 1)

    with open(out / f"{args.tag}-rank{rank}.jsonl", "a") as records:
        stream = batches()
        for step in range(start, args.steps):
            ids, x, y = next(stream)
            # Python's and NumPy's generators weigh the loss, so their restored states matter too
            weight = 1 + 0.1 * random.random() + 0.1 * abs(float(np.random.standard_normal()))
            loss = nn.functional.mse_loss(model(x), y) * weight
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            sched.step()
            opt.zero_grad()
            tokens += len(ids)
            records.write(json.dumps({"step": step, "loss": bits(loss.item()), "ids": ids.tolist()}) + "\n")
            records.flush()
            due = (step + 1) % args.save_every == 0 or step + 1 in args.save_at
            if due or (args.preempt and ckpt.stop_requested()):
                ckpt.save(step + 1, **state, extra={"tokens_seen": tokens})
                if step + 1 in args.markers:
                    ckpt.wait()
                    if world > 1:
                        dist.barrier()  # every rank's save is done (its peer copies kept and pruned) before the word
                    if rank == 0:
                        print(f"DURABLE {step + 1}", flush=True)
                    time.sleep(600)
            if rank == 0:
                print(f"STEP {step + 1}", flush=True)
    ckpt.wait()
    msd, osd = get_state_dict(model, opt)
    final = {"model": msd, "optimizer": osd, "scheduler": sched.state_dict(), "tokens": tokens,
             f"rng.rank{rank}": tm_rng.capture()}
    if scaler is not None:
        final["scaler"] = scaler.state_dict()
    tm.save(final, out / f"final-{args.tag}", overwrite=True)
    ckpt.close()
    if world > 1:
        dist.destroy_process_group()
    print("DONE", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
