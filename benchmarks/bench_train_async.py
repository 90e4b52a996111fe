"""How long a checkpoint holds up training: Checkpointer async vs sync vs torch.distributed.checkpoint.async_save.

The same model on 2 gloo ranks (CPU): 8 Linear(3344, 3344) layers sharded with FSDP2, trained with AdamW,
so parameters plus both AdamW moments are 1.0 GiB (512 MiB per rank). Per repetition, in one run (the
order of the three rotates):
  ours sync    Checkpointer(async_save=False).save(...): the loop waits for the commit
  ours async   Checkpointer(async_save=True).save(...): a thread copies the state into reused CPU buffers
               while the next forward and backward run (the optimizer step waits for the copy; that
               wait counts as blocked), then writes and commits
  dcp async    get_state_dict + dcp.async_save(..., process_group=<own gloo group>), FileSystemWriter
               (sync_files=True): DCP stages into new CPU memory, a thread writes
After each save call the loop goes on training until the checkpoint is durable. Blocked = time inside
the call, plus any wait of the optimizer step for ours async (slowest rank); durable = from the call to
the commit (ours) or the future's completion (DCP).
Every save starts after a flush of dirty pages and a prefault on each rank, behind barriers; one
save of each kind first (imports, first buffers) is reported apart and left out of the medians.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .common import (
    GiB,
    fmt_bytes,
    fmt_s,
    init_gloo,
    load_averages,
    prefault,
    print_table,
    row,
    spawn_ranks,
    summary,
    work_dir,
    write_result,
)

NAME = "train_async"
RUNS = 5
RANKS = 2
LAYERS, WIDTH = 8, 3344  # 89.5 M parameters: x 3 (weights, exp_avg, exp_avg_sq) x 4 bytes = 1.0 GiB
PREFAULT = 2 * GiB  # per rank
METHODS = ("ours_sync", "ours_async", "dcp_async")


def build_training(world: int) -> tuple[Any, Any, Any]:
    """The benchmark's model, FSDP2-sharded on `world` ranks, its AdamW, and one training step (bench_tiers too)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(4, WIDTH)

    def train_step() -> None:
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, train_step


def _worker(rank: int, world: int, port: int, work: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tensormorph.train import Checkpointer

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    root = Path(work)
    model, opt, train_step = build_training(world)
    train_step()  # AdamW's moments exist from here on
    local_bytes = sum(p.to_local().numel() * 4 * 3 for p in model.parameters())
    # no retention: old checkpoints are deleted between saves, off the clock, for all three alike
    ours = {"ours_sync": Checkpointer(root / "ours_sync", async_save=False),
            "ours_async": Checkpointer(root / "ours_async", async_save=True)}
    dcp_group = dist.new_group(backend="gloo")

    def save(method: str, step: int) -> tuple[float, float, int]:
        """(seconds blocked, seconds to durable, training steps done while the save was in flight)."""
        if rank == 0:
            os.sync()  # no save pays for an earlier one's writeback
        dist.barrier()
        prefault(PREFAULT)
        dist.barrier()
        start = time.perf_counter()
        if method in ours:
            timing = ours[method].save(step, model=model, optimizer=opt)
            blocked = time.perf_counter() - start

            def durable() -> float | None:
                return timing.durable_s
        else:
            done: list[float] = []
            model_sd, optim_sd = get_state_dict(model, opt)
            future = dcp.async_save({"model": model_sd, "optimizer": optim_sd},
                                    checkpoint_id=str(root / "dcp_async" / f"step-{step:08d}"), process_group=dcp_group)
            blocked = time.perf_counter() - start
            future.add_done_callback(lambda f: done.append(time.perf_counter() - start))

            def durable() -> float | None:
                return done[0] if done else None
        steps = 0
        while durable() is None:  # the loop goes on while the save is in flight
            train_step()
            steps += 1
        if method == "dcp_async":
            future.result()
        else:
            ours[method].wait()
            blocked = timing.blocked_s  # the call, plus the optimizer steps' wait for the background copy
        dist.barrier()
        return blocked, durable(), steps

    def clear() -> None:
        dist.barrier()
        if rank == 0:
            for method in METHODS:
                for old in (root / method).glob("step-*"):
                    shutil.rmtree(old)
        dist.barrier()

    first = {m: save(m, 0) for m in METHODS}
    sizes = {m: sum(f.stat().st_size for f in (root / m).rglob("*") if f.is_file()) for m in METHODS}
    clear()
    step_times = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        train_step()
        step_times.append(time.perf_counter() - start)
    results: dict[str, list[tuple[float, float, int]]] = {m: [] for m in METHODS}
    for k in range(RUNS):
        for method in METHODS[k % 3:] + METHODS[:k % 3]:
            results[method].append(save(method, k + 1))
        clear()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"results": results, "first": first, "local_bytes": local_bytes,
                                      "step_s": sorted(step_times)[len(step_times) // 2]})
    if rank == 0:
        (root / "result.json").write_text(json.dumps({"ranks": everyone, "sizes": sizes}))
    for checkpointer in ours.values():
        checkpointer.close()
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1:
        sys.exit(f"usage: python -m benchmarks.bench_{NAME}")
    loads_before, started = load_averages(), time.perf_counter()
    with work_dir(NAME) as work:
        spawn_ranks(_worker, RANKS, str(work))
        data = json.loads((work / "result.json").read_text())
    wall_s = time.perf_counter() - started
    ranks = data["ranks"]
    total = sum(r["local_bytes"] for r in ranks)

    def slowest(method: str, index: int, field: int) -> float:
        return max(r["results"][method][index][field] if index >= 0 else r["first"][method][field] for r in ranks)

    blocked = {m: summary([slowest(m, k, 0) for k in range(RUNS)]) for m in METHODS}
    durable = {m: summary([slowest(m, k, 1) for k in range(RUNS)]) for m in METHODS}
    overlap = {m: [ranks[0]["results"][m][k][2] for k in range(RUNS)] for m in METHODS}
    first = {m: {"blocked_s": slowest(m, -1, 0), "durable_s": slowest(m, -1, 1)} for m in METHODS}
    b = {m: blocked[m]["median"] for m in METHODS}
    d = {m: durable[m]["median"] for m in METHODS}
    ratios = {"async_blocked_fraction_of_sync": b["ours_async"] / b["ours_sync"],
              "blocked_dcp_over_ours": b["dcp_async"] / b["ours_async"],
              "durable_dcp_over_ours": d["dcp_async"] / d["ours_async"]}

    names = {"ours_sync": "Checkpointer sync", "ours_async": "Checkpointer async", "dcp_async": "dcp.async_save"}
    print()
    print(f"{LAYERS} x Linear({WIDTH}, {WIDTH}) + AdamW: {fmt_bytes(total)} on {RANKS} ranks (FSDP2), medians of "
          f"{RUNS}; a training step takes {fmt_s(ranks[0]['step_s'])}")
    print_table(["save", "blocked", "range", "to durable", "steps while saving", "first save blocked"],
                [[names[m], fmt_s(b[m]), f"{fmt_s(blocked[m]['min'])} - {fmt_s(blocked[m]['max'])}", fmt_s(d[m]),
                  str(overlap[m]), fmt_s(first[m]["blocked_s"])] for m in METHODS])
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}")

    size = f"{fmt_bytes(total)} params + AdamW, {RANKS} ranks (FSDP2, gloo)"
    rows = [
        row(f"training blocked per checkpoint, {size}", "Checkpointer async vs its sync save",
            tensormorph=f"async: {fmt_s(b['ours_async'])}", anchor=f"sync: {fmt_s(b['ours_sync'])}",
            ratio=b["ours_sync"] / b["ours_async"], target=">= 10x (blocked <= 10% of sync)",
            met=ratios["async_blocked_fraction_of_sync"] <= 0.10),
        row(f"training blocked per checkpoint, {size}", "Checkpointer async vs dcp.async_save (own gloo group)",
            tensormorph=fmt_s(b["ours_async"]), anchor=f"dcp.async_save: {fmt_s(b['dcp_async'])}",
            ratio=ratios["blocked_dcp_over_ours"], target=">= 1.0x", met=ratios["blocked_dcp_over_ours"] >= 1.0),
        row(f"time to durable, {size}", "Checkpointer async vs dcp.async_save, training on meanwhile",
            tensormorph=fmt_s(d["ours_async"]), anchor=f"dcp.async_save: {fmt_s(d['dcp_async'])}",
            ratio=ratios["durable_dcp_over_ours"], target=">= 1.0x", met=ratios["durable_dcp_over_ours"] >= 1.0,
            note=f"sync save: {fmt_s(d['ours_sync'])}"),
    ]
    write_result(NAME, {
        "title": f"Training blocked per checkpoint: Checkpointer async/sync vs dcp.async_save, {size}",
        "runs": RUNS,
        "ranks": RANKS,
        "noise": ("shared 2-core VM: other engineers' test runs may overlap this one; "
                  f"load averages {loads_before} before, {load_averages()} after; whole run {wall_s:.0f} s"),
        "prefault_bytes_per_rank": PREFAULT,
        "sizes": {"layers": LAYERS, "width": WIDTH, "state_bytes": total,
                  "rank_bytes": [r["local_bytes"] for r in ranks], "checkpoint_bytes": data["sizes"]},
        "training_step_s": [r["step_s"] for r in ranks],
        "blocked_s": blocked,
        "durable_s": durable,
        "training_steps_while_saving": overlap,
        "first_save": first,
        "ratios": ratios,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
