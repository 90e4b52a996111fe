"""The host-memory tier: what a memory checkpoint costs the training loop, how fast a restart resumes from
it, and how many steps a failure loses at the same overhead.

The model and loop of bench_train_async (imported): 8 Linear(3344, 3344) layers sharded with FSDP2 on 2 gloo
ranks (CPU), AdamW, so parameters plus both moments are 1.0 GiB (512 MiB per rank).

1. Blocked per checkpoint. Per repetition, in one run (the order rotates), each save started after a flush of
   dirty pages and a prefault behind barriers, then training goes on until the save is durable:
     memory      Checkpointer(memory_every=1, disk_every=<never>, async_save=True): each rank's snapshot on
                 /dev/shm; durable = the snapshot committed (memory_s)
     disk async  Checkpointer(async_save=True): today's save; durable = the disk commit
     dcp async   get_state_dict + dcp.async_save on its own gloo group, FileSystemWriter
   Blocked = time inside save(), plus the optimizer step's wait for the background copy (slowest rank). One
   save of each kind first is reported apart. Then a steady run saves to memory at every step (no prefault,
   no flush: the loop as a user runs it), beside as many steps without saving.
2. Restart to the first training step. One checkpoint of step 1 is written to every tier (memory, local disk
   and object store, the same state); then new processes are started (torch.multiprocessing spawn) that build the model,
   resume and take a step. memory: a Checkpointer with the memory tier (it resumes from /dev/shm); disk: one
   without (it resumes from the disk checkpoint, whose files are flushed and dropped from the page cache
   first with posix_fadvise(DONTNEED), for those files only, their residency checked by mincore). Restart =
   from the spawn call to the end of resume() on the slowest rank (the first step begins), and from the
   process's own start (its interpreter and imports, the same for every tier and the noisiest part on a
   loaded machine, excluded: ready_s, which the ratio uses); the first step's own time is reported apart.
   Each rank checks that it resumed from the tier asked, with the state saved (CRC-32 of its parameters and
   AdamW state), and counts the bytes it read from the disk during resume().
   remote: the memory and the local disk are lost (a new, empty local root); the Checkpointer resumes from
   its object store, moto's S3 server behind a proxy adding 20 ms per request (the copy there was drained
   from the disk checkpoint by the writers' Checkpointer).
3. Steps lost per failure, computed from (1): a checkpoint every N steps of T seconds, durable d seconds after
   its step, costs blocked / (N T) of the training time; a failure at a uniformly random moment loses on
   average N/2 + d/T steps (at most N + d/T). Memory every step (N = 1, d = memory_s, blocked of the steady
   run) against disk every 100 steps (N = 100, d and blocked of the async disk save), T = the measured step.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from .bench_remote_store import Proxy, moto_endpoint
from .bench_train_async import LAYERS, PREFAULT, RANKS, WIDTH, build_training
from .common import (
    files_under,
    fmt_bytes,
    fmt_s,
    gather,
    init_gloo,
    io_read_bytes,
    load_averages,
    prefault,
    print_table,
    resident_bytes,
    row,
    spawn_ranks,
    summary,
    work_dir,
    write_result,
)

NAME = "tiers"
RUNS = 5  # isolated saves of each kind, after the first
STEADY = 4  # steps saved to memory one after another, and steps without saving
RESTARTS = 3  # restarts from each tier
DISK_NEVER = 10**9  # disk_every of the memory-only Checkpointer: no step of this run reaches it
RESTART_STEP = 1
METHODS = ("memory", "disk_async", "dcp_async")
TIERS = ("memory", "disk", "remote")
BUCKET = "tiers"
LATENCY_S = 0.02  # added to every request to the object store, as the issue asks
BUDGET = 0.01  # the overhead budget: training time spent blocked by checkpoints
DISK_INTERVAL = 100  # steps between disk checkpoints in the steps-lost comparison
TARGET_BLOCKED_S = 0.006  # today's async disk save (bench_train_async), which the memory tier must not exceed
TARGET_MEMORY_S = 0.2  # durable in memory within this
TARGET_RESTART = 5.0  # memory at least this many times faster than local disk


def _fingerprint(model: Any, opt: Any) -> int:
    """CRC-32 of this rank's parameters and optimizer state (local shards), in parameter order."""
    crc = 0
    for p in model.parameters():
        for t in (p, *(v for _, v in sorted(opt.state[p].items()))):
            local = t.to_local() if hasattr(t, "to_local") else t
            crc = zlib.crc32(local.detach().contiguous().numpy().reshape(-1).view("uint8"), crc)
    return crc


def _everywhere(flag: bool) -> bool:
    """Whether `flag` holds on every rank: each rank's memory snapshot is committed on its own, and a rank that
    stopped training alone would leave the others waiting in the next step's collectives."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _worker(rank: int, world: int, port: int, work: str, remote: str) -> None:
    """Part 1, then the checkpoint of part 2 (kept in memory when these processes end)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tensormorph.train import Checkpointer

    init_gloo(rank, world, port)
    root = Path(work)
    model, opt, train_step = build_training(world)
    train_step()  # AdamW's moments exist from here on
    local_bytes = sum(p.to_local().numel() * 4 * 3 for p in model.parameters())
    ours = {"memory": Checkpointer(root / "memory", memory_every=1, disk_every=DISK_NEVER, async_save=True),
            "disk_async": Checkpointer(root / "disk_async", async_save=True)}
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
            assert timing.tiers == (("memory",) if method == "memory" else ("disk",)), timing.tiers

            def durable() -> float | None:
                return timing.memory_s if method == "memory" else timing.durable_s
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
        while not _everywhere(durable() is not None):  # the loop goes on while the save is in flight
            train_step()
            steps += 1
        if method == "dcp_async":
            future.result()
        else:
            ours[method].wait()
            blocked = timing.blocked_s  # the call, plus the optimizer steps' wait for the background copy
        dist.barrier()
        durable_s = durable()
        assert durable_s is not None
        return blocked, durable_s, steps

    def clear() -> None:
        dist.barrier()
        if rank == 0:
            for method in ("disk_async", "dcp_async"):
                for old in (root / method).glob("step-*"):
                    shutil.rmtree(old)
        dist.barrier()

    step = 1  # not 0: every Checkpointer's disk tier is due at step 0
    first = {m: save(m, step) for m in METHODS}
    clear()
    results: dict[str, list[tuple[float, float, int]]] = {m: [] for m in METHODS}
    for k in range(RUNS):
        step += 1
        for method in METHODS[k % 3:] + METHODS[:k % 3]:
            results[method].append(save(method, step))
        clear()

    # the loop as a user runs it: steps alone, then a memory checkpoint after every step
    plain, steady = [], []
    for _ in range(STEADY):
        dist.barrier()
        start = time.perf_counter()
        train_step()
        plain.append(time.perf_counter() - start)
    timings = []
    dist.barrier()
    for _ in range(STEADY):
        start = time.perf_counter()
        train_step()
        step += 1
        timings.append(ours["memory"].save(step, model=model, optimizer=opt))
        steady.append(time.perf_counter() - start)
    train_step()  # its optimizer step waits for the last save's copy: that wait belongs to the last save
    ours["memory"].wait()
    memory_bytes = ours["memory"].memory_bytes
    for checkpointer in ours.values():
        checkpointer.close()

    # part 2's checkpoint: step 1 on every tier, the same state; its snapshot outlives these processes
    tiers = Checkpointer(root / "restart", memory_every=1, disk_every=1, release_memory_on_close=False,
                         **_remote_arguments(remote, 1))
    tiers.save(RESTART_STEP, model=model, optimizer=opt)
    tiers.wait()  # its copy to the object store too
    if tiers.remote_errors:
        raise RuntimeError(f"the copy to the object store failed: {tiers.remote_errors}")
    tiers.close()
    everyone = gather({"results": results, "first": first, "local_bytes": local_bytes, "memory_bytes": memory_bytes,
                       "plain_step_s": plain, "steady_step_s": steady,
                       "steady": [(t.blocked_s, t.memory_s) for t in timings],
                       "fingerprint": _fingerprint(model, opt)})
    if rank == 0:
        size = sum(f.stat().st_size for f in files_under(root / "restart" / f"step-{RESTART_STEP:08d}"))
        (root / "result.json").write_text(json.dumps({"ranks": everyone, "restart_bytes": size}))
    dist.destroy_process_group()


def _remote_arguments(remote: str, every: int) -> dict[str, Any]:
    """The Checkpointer's object-store arguments for `remote` (JSON: the URL and the storage options)."""
    url, options = json.loads(remote)
    return {"remote": url, "remote_every": every, "remote_storage_options": options}


def _restart(rank: int, world: int, port: int, work: str, tier: str, spawned: float, remote: str) -> None:
    """A new process of a restarted run: build, resume from `tier`, take the first step. The object store's
    restart has lost the memory and the local disk: its local root is a new, empty folder."""
    import torch.distributed as dist

    from tensormorph.train import Checkpointer

    entered = time.time()
    init_gloo(rank, world, port)
    model, opt, train_step = build_training(world)
    root = Path(work) / ("lost" if tier == "remote" else "restart")
    remote_arguments = _remote_arguments(remote, DISK_NEVER) if tier == "remote" else {}
    ckpt = Checkpointer(root, memory_every=1 if tier == "memory" else None, disk_every=DISK_NEVER, async_save=True,
                        release_memory_on_close=False, **remote_arguments)
    built = time.time()
    read_before, start = io_read_bytes(), time.perf_counter()
    step = ckpt.resume(model=model, optimizer=opt)
    resume_s, read = time.perf_counter() - start, io_read_bytes() - read_before
    resumed = time.time()
    if (ckpt.resumed_from, step) != (tier, RESTART_STEP):
        raise RuntimeError(f"resumed step {step} from {ckpt.resumed_from}, expected step {RESTART_STEP} from {tier}: "
                           f"{ckpt.resume_notes}")
    fingerprint = _fingerprint(model, opt)
    dist.barrier()
    start = time.perf_counter()
    train_step()
    first_step_s = time.perf_counter() - start
    everyone = gather({"started_s": entered - spawned, "built_s": built - spawned, "resume_s": resume_s,
                       "restart_s": resumed - spawned, "ready_s": resumed - entered, "first_step_s": first_step_s,
                       "disk_read_bytes": read, "fingerprint": fingerprint})
    if rank == 0:
        (Path(work) / "restart.json").write_text(json.dumps(everyone))
    ckpt.close()
    dist.destroy_process_group()


def _drop_from_page_cache(folder: Path) -> int:
    """Flush these files and drop them (only them) from the page cache; the bytes of them still cached."""
    files = files_under(folder)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_bytes(files)


def _restarts(work: Path, remote: str) -> tuple[dict[str, list[list[dict[str, Any]]]], list[int]]:
    """Every restart's per-rank figures by tier (in rotation), and the disk bytes still cached before each."""
    found: dict[str, list[list[dict[str, Any]]]] = {t: [] for t in TIERS}
    cached = []
    for k in range(RESTARTS):
        for tier in TIERS[k % 3:] + TIERS[:k % 3]:
            if tier == "disk":
                cached.append(_drop_from_page_cache(work / "restart" / f"step-{RESTART_STEP:08d}"))
            shutil.rmtree(work / "lost", ignore_errors=True)
            spawn_ranks(_restart, RANKS, str(work), tier, time.time(), remote)
            found[tier].append(json.loads((work / "restart.json").read_text()))
    return found, cached


def _release_memory(work: Path) -> None:
    """Remove what this run left in shared memory (the snapshots part 2 kept, any a failure left)."""
    from tensormorph.train.manager import CheckpointManager
    from tensormorph.train.memory import run_folder

    for name in ("memory", "restart"):
        manager = CheckpointManager(work / name, None)  # the folder is named by the root and the run's id in it
        folder = run_folder(manager.root, None, manager.run_id())
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # the memory dir itself, when no other run uses it


def _steps_lost(interval: int, durable_s: float, blocked_s: float, step_s: float) -> dict[str, float]:
    return {"every_steps": interval, "overhead": blocked_s / (interval * step_s),
            "mean_steps_lost": interval / 2 + durable_s / step_s, "max_steps_lost": interval + durable_s / step_s}


def main() -> None:
    if len(sys.argv) > 1:
        sys.exit(f"usage: python -m benchmarks.bench_{NAME}")
    loads_before, started = load_averages(), time.perf_counter()
    with work_dir(NAME) as work, moto_endpoint() as s3, \
            Proxy(s3.endpoint, server_pids=(s3._process.pid,), latency_s=LATENCY_S) as proxy:
        s3.make_bucket(BUCKET)
        remote = json.dumps([f"s3://{BUCKET}/restart", s3.storage_options_via(proxy.url)])
        try:
            spawn_ranks(_worker, RANKS, str(work), remote)
            data = json.loads((work / "result.json").read_text())
            restarts, cached = _restarts(work, remote)
        finally:
            _release_memory(work)
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
    steady = {"blocked_s": summary([max(r["steady"][k][0] for r in ranks) for k in range(STEADY)]),
              "memory_s": summary([max(r["steady"][k][1] for r in ranks) for k in range(STEADY)]),
              "step_s": summary([max(r["steady_step_s"][k] for r in ranks) for k in range(STEADY)]),
              "plain_step_s": summary([max(r["plain_step_s"][k] for r in ranks) for k in range(STEADY)])}
    step_s = steady["plain_step_s"]["median"]

    restart = {t: {key: summary([max(r[key] for r in ranks_) for ranks_ in restarts[t]])
                   for key in ("started_s", "built_s", "resume_s", "restart_s", "ready_s", "first_step_s")}
               for t in TIERS}
    disk_read = {t: [[r["disk_read_bytes"] for r in ranks_] for ranks_ in restarts[t]] for t in TIERS}
    exact = all(r["fingerprint"] == w["fingerprint"] for t in TIERS for ranks_ in restarts[t]
                for r, w in zip(ranks_, ranks))
    r_restart = restart["disk"]["ready_s"]["median"] / restart["memory"]["ready_s"]["median"]
    r_resume = restart["disk"]["resume_s"]["median"] / restart["memory"]["resume_s"]["median"]
    r_remote = restart["remote"]["resume_s"]["median"] / restart["memory"]["resume_s"]["median"]

    memory_plan = _steps_lost(1, steady["memory_s"]["median"], steady["blocked_s"]["median"], step_s)
    disk_plan = _steps_lost(DISK_INTERVAL, d["disk_async"], b["disk_async"], step_s)
    # the fewest steps between disk checkpoints that stay within the budget and never queue behind the last one
    disk_fewest = max(math.ceil(b["disk_async"] / (BUDGET * step_s)), math.ceil(d["disk_async"] / step_s))

    names = {"memory": "memory tier (async)", "disk_async": "disk (async, today)", "dcp_async": "dcp.async_save"}
    print()
    print(f"{LAYERS} x Linear({WIDTH}, {WIDTH}) + AdamW: {fmt_bytes(total)} on {RANKS} ranks (FSDP2), medians of "
          f"{RUNS}; a training step takes {fmt_s(step_s)}")
    print_table(["save", "blocked", "range", "to durable", "steps while saving", "first save blocked"],
                [[names[m], fmt_s(b[m]), f"{fmt_s(blocked[m]['min'])} - {fmt_s(blocked[m]['max'])}", fmt_s(d[m]),
                  str(overlap[m]), fmt_s(first[m]["blocked_s"])] for m in METHODS])
    print(f"memory every step ({STEADY} steps): blocked {fmt_s(steady['blocked_s']['median'])}, in memory after "
          f"{fmt_s(steady['memory_s']['median'])}, step {fmt_s(steady['step_s']['median'])} "
          f"(without saving {fmt_s(step_s)}); {fmt_bytes(ranks[0]['memory_bytes'])} of /dev/shm per rank")
    print_table(["restart from", "to first step", "process up", "model built", "resume()", "first step",
                 "disk read in resume"],
                [[t, fmt_s(restart[t]["restart_s"]["median"]), fmt_s(restart[t]["started_s"]["median"]),
                  fmt_s(restart[t]["built_s"]["median"]), fmt_s(restart[t]["resume_s"]["median"]),
                  fmt_s(restart[t]["first_step_s"]["median"]), fmt_bytes(max(map(sum, disk_read[t])))]
                 for t in TIERS])
    print(f"resumed state bit-exact: {exact}; disk bytes still cached before each disk restart: {cached}")
    print(f"steps lost per failure: memory every step {memory_plan}; disk every {DISK_INTERVAL} {disk_plan}")

    size = f"{fmt_bytes(total)} params + AdamW, {RANKS} ranks (FSDP2, gloo)"
    lost = f"{fmt_s(step_s)} steps, budget {BUDGET:.0%} of step time"
    rows = [
        row(f"training blocked per memory checkpoint, {size}", "memory tier vs today's async disk save",
            tensormorph=fmt_s(b["memory"]), anchor=f"disk async: {fmt_s(b['disk_async'])}",
            ratio=b["disk_async"] / b["memory"], target=f"<= {fmt_s(TARGET_BLOCKED_S)}",
            met=b["memory"] <= TARGET_BLOCKED_S,
            note=f"every step: {fmt_s(steady['blocked_s']['median'])}"),
        row(f"training blocked per memory checkpoint, {size}", "memory tier vs dcp.async_save (own gloo group)",
            tensormorph=fmt_s(b["memory"]), anchor=f"dcp.async_save: {fmt_s(b['dcp_async'])}",
            ratio=b["dcp_async"] / b["memory"], target=">= 1.0x", met=b["dcp_async"] >= b["memory"]),
        row(f"time to durable, {size}", "in memory vs on disk (async), training on meanwhile",
            tensormorph=fmt_s(d["memory"]), anchor=f"disk async: {fmt_s(d['disk_async'])}",
            ratio=d["disk_async"] / d["memory"], target=f"memory <= {fmt_s(TARGET_MEMORY_S)}",
            met=d["memory"] <= TARGET_MEMORY_S,
            note=f"every step: {fmt_s(steady['memory_s']['median'])}; dcp.async_save: {fmt_s(d['dcp_async'])}"),
        row(f"restart to first training step, {size}", "resume from memory vs from local disk (page cache dropped)",
            tensormorph=fmt_s(restart["memory"]["ready_s"]["median"]),
            anchor=f"disk: {fmt_s(restart['disk']['ready_s']['median'])}", ratio=r_restart,
            target=f">= {TARGET_RESTART:.0f}x", met=r_restart >= TARGET_RESTART and exact,
            note="from the process's start (after its interpreter and imports, alike for every tier): gloo, "
                 "model build and resume() included"),
        row(f"resume() call after a restart, {size}", "from memory vs from local disk (page cache dropped)",
            tensormorph=fmt_s(restart["memory"]["resume_s"]["median"]),
            anchor=f"disk: {fmt_s(restart['disk']['resume_s']['median'])}", ratio=r_resume,
            target=f">= {TARGET_RESTART:.0f}x", met=r_resume >= TARGET_RESTART and exact),
        row(f"resume() call after a restart, {size}",
            f"from memory vs from the object store (moto S3, {LATENCY_S * 1000:.0f} ms per request)",
            tensormorph=fmt_s(restart["memory"]["resume_s"]["median"]),
            anchor=f"object store: {fmt_s(restart['remote']['resume_s']['median'])}", ratio=r_remote,
            target="faster", met=r_remote > 1 and exact,
            note=f"to first step: {fmt_s(restart['remote']['restart_s']['median'])}"),
        row(f"steps lost per failure at <= {BUDGET:.0%} overhead, {size}",
            f"memory every step vs disk every {DISK_INTERVAL} steps, mean over failure moments",
            tensormorph=f"{memory_plan['mean_steps_lost']:.2f} steps ({memory_plan['overhead']:.2%} overhead)",
            anchor=f"{disk_plan['mean_steps_lost']:.2f} steps ({disk_plan['overhead']:.3%} overhead)",
            ratio=disk_plan["mean_steps_lost"] / memory_plan["mean_steps_lost"],
            target=f"memory within {BUDGET:.0%}, fewer steps lost",
            met=memory_plan["overhead"] <= BUDGET and memory_plan["mean_steps_lost"] < disk_plan["mean_steps_lost"],
            note=f"computed: {lost}"),
    ]
    write_result(NAME, {
        "title": f"Host-memory tier: blocked, durable, restart and steps lost vs disk and dcp.async_save, {size}",
        "runs": RUNS,
        "ranks": RANKS,
        "note": ("the model of bench_train_async at full size (1.0 GiB), not scaled down. Restarts are new processes "
                 "(spawn) on the same machine after the writers exited; the disk checkpoint's files were flushed "
                 "and dropped from the page cache with posix_fadvise(POSIX_FADV_DONTNEED) on those files only "
                 "(disk_bytes_cached_before_restart: what mincore still saw), no machine-wide drop. The object "
                 f"store restart has lost memory and local disk: moto's S3 server behind a proxy adding "
                 f"{LATENCY_S * 1000:.0f} ms per request, on this machine's cores. Steps lost are computed, not "
                 "measured: a "
                 "checkpoint every N steps of T s, durable d s after its step, costs blocked/(N T) of training "
                 "time and loses N/2 + d/T steps on average (at most N + d/T) to a failure at a uniformly random "
                 "moment; T = the median step without saving. On these 2 cores the background copy and write "
                 "share the CPUs with training (steady.step_s vs steady.plain_step_s); on a GPU they use idle "
                 "host cores."),
        "noise": ("shared 2-core VM: other engineers' test runs may overlap this one; "
                  f"load averages {loads_before} before, {load_averages()} after; whole run {wall_s:.0f} s"),
        "prefault_bytes_per_rank": PREFAULT,
        "sizes": {"layers": LAYERS, "width": WIDTH, "state_bytes": total,
                  "rank_bytes": [r["local_bytes"] for r in ranks],
                  "shared_memory_bytes_per_rank": [r["memory_bytes"] for r in ranks],
                  "restart_checkpoint_bytes": data["restart_bytes"]},
        "training_step_s": step_s,
        "blocked_s": blocked,
        "durable_s": durable,
        "training_steps_while_saving": overlap,
        "first_save": first,
        "steady": steady,
        "restart": restart,
        "disk_read_bytes_in_resume": disk_read,
        "disk_bytes_cached_before_restart": cached,
        "resumed_bit_exact": exact,
        "steps_lost": {"memory_every_step": memory_plan, f"disk_every_{DISK_INTERVAL}": disk_plan,
                       "disk_fewest_steps_within_budget": disk_fewest},
        "rows": rows,
    })


if __name__ == "__main__":
    main()
