"""Save without pause until killed: the process the crash-safety trials SIGKILL at random moments.

    python crash_loop.py --root R [--async]

Resumes from the newest checkpoint under R, prints `READY <step>`, then for
step = resumed + 1, + 2, ... sets every parameter to `expected(step)` and saves
it (keep=2), printing `SAVED <step>` after each save returns.
"""

from __future__ import annotations

import argparse

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
    args = p.parse_args()
    torch.set_num_threads(1)
    model = build_model()
    ckpt = Checkpointer(args.root, keep=2, async_save=args.async_save)
    step = ckpt.resume(model=model)
    print(f"READY {step}", flush=True)
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
