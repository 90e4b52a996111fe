"""Start DataLoader workers over and over while the test sends SIGTERM to the whole process group.

    python signal_storm.py --root R --epochs 40

With `save_on_signal`, no worker may die of the signal, not even one signalled while it starts;
the training process only records the request. Prints `READY`, then `DONE <epochs> <stop requested>`.
"""

from __future__ import annotations

import argparse

from torch.utils.data import DataLoader


def main() -> None:
    from tensormorph.train import Checkpointer, ResumableSampler

    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--epochs", type=int, default=40)
    args = p.parse_args()
    ckpt = Checkpointer(args.root)
    ckpt.save_on_signal()
    sampler = ResumableSampler(8, 1, 0)
    loader = DataLoader(list(range(8)), batch_size=4, sampler=sampler, num_workers=2)
    ckpt.resume(dataloader=loader)
    print("READY", flush=True)
    seen = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        seen += sum(len(batch) for batch in loader)
    print(f"DONE {seen // 8} {ckpt.stop_requested()}", flush=True)


if __name__ == "__main__":
    main()
