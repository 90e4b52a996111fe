"""Save without pause until killed: the process the crash-safety trials SIGKILL at random moments.

    python crash_loop.py --root R [--async] [--memory-dir D [--peers --world 2 --rank r --port P --nodes a,b]]
                         [--remote URL --remote-options JSON]

Resumes from the newest checkpoint under R, prints `READY <step> <tier> <exact>` (the tier it resumed from, and
whether every parameter is `expected(step)`), then for step = resumed + 1, + 2, ... sets every parameter to
`expected(step)` and saves it (keep=2), printing `SAVED <step>` after each save returns. With --memory-dir, a
memory snapshot every step and a disk checkpoint every third; with --remote, every sixth is copied there.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 384), nn.Linear(384, 8))  # about 0.8 MiB: saves take a while


def expected(step: int) -> dict[str, torch.Tensor]:
    """The parameters saved at `step`, made from the step alone."""
    g = torch.Generator().manual_seed(step)
    return {name: torch.randn(p.shape, generator=g) for name, p in build_model().named_parameters()}


def main() -> None:
    from tensormorph.train import Checkpointer

    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--memory-dir", default=None)
    p.add_argument("--peers", action="store_true")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--nodes", default=None)
    p.add_argument("--remote", default=None)
    p.add_argument("--remote-options", default="{}")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world)
    tiers: dict = {}
    if args.memory_dir:
        tiers = dict(memory_every=1, disk_every=3, memory_dir=args.memory_dir, peers=args.peers,
                     node=args.nodes.split(",")[args.rank] if args.nodes else None)
    if args.remote:
        tiers.update(disk_every=3, remote=args.remote, remote_every=6,
                     remote_storage_options=json.loads(args.remote_options))
    model = build_model()
    ckpt = Checkpointer(args.root, keep=2, async_save=args.async_save, **tiers)
    step = ckpt.resume(model=model)
    exact = all(torch.equal(p.detach(), expected(step)[n]) for n, p in model.named_parameters()) if step else True
    print(f"READY {step} {ckpt.resumed_from} {exact}", flush=True)
    print(f"NOTES {json.dumps(ckpt.resume_notes)}", flush=True)
    params = dict(model.named_parameters())
    while True:
        step += 1
        with torch.no_grad():
            for name, value in expected(step).items():
                params[name].copy_(value)
        ckpt.save(step, model=model, extra={"step": step})
        print(f"SAVED {step}", flush=True)


if __name__ == "__main__":
    main()
