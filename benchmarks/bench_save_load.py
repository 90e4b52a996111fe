"""Save and load ~2 GiB of DTensor state on 2 gloo ranks: tm.save / tm.load vs dcp.save / dcp.load.

State: 14 tensors (fp32 and bf16, 64-250 MiB each; two have an odd row count, so the 2 ranks
hold unequal shards), DTensors Shard(0) on a 1-D mesh of 2. Each rank builds only its own shard.
Per repetition, in one run (ours and DCP alternate which goes first):
  disk write  each rank os.write's its shards' bytes to one file, then fsync (the save ceiling)
  save        tm.save; dcp.save with FileSystemWriter(sync_files=True): both fsync every data file
  disk read   each rank preadv's its file back into its shards' memory (the load ceiling)
  load        tm.load; dcp.load with FileSystemReader, into the same DTensors (zeroed first)
Every step starts from a flushed page cache (dropped when root, so the reads are cold) and a
prefault on each rank, with barriers on both sides; its time is the slowest rank's. After every
read and load, each rank's shards are checked against CRC-32C taken before the first save.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .common import (
    GiB,
    drop_caches,
    fmt_bytes,
    fmt_s,
    init_gloo,
    load_averages,
    print_table,
    proc_status,
    reset_peak_rss,
    row,
    shard_state,
    spawn_ranks,
    summary,
    timed_on_ranks,
    work_dir,
    write_result,
)

NAME = "save_load"
RUNS = 5
RANKS = 2
PREFAULT = 3 * GiB  # per rank: its 1 GiB in the page cache plus the copies DCP makes while (de)serialising

# name -> (global shape, dtype); 32003 and 8193 rows split 16002/16001 and 4097/4096
TENSORS = {
    "model.embed_tokens.weight": ((32000, 2048), "float32"),
    "model.layers.0.self_attn.qkv.weight": ((12288, 4096), "bfloat16"),
    "model.layers.0.self_attn.o.weight": ((4096, 4096), "float32"),
    "model.layers.0.mlp.up.weight": ((11008, 4096), "float32"),
    "model.layers.0.mlp.down.weight": ((4096, 11008), "bfloat16"),
    "model.layers.1.self_attn.qkv.weight": ((12288, 4096), "bfloat16"),
    "model.layers.1.self_attn.o.weight": ((4096, 4096), "float32"),
    "model.layers.1.mlp.up.weight": ((11008, 4096), "float32"),
    "model.layers.1.mlp.down.weight": ((4096, 11008), "bfloat16"),
    "model.layers.2.mlp.up.weight": ((11008, 4096), "float32"),
    "lm_head.weight": ((32003, 2048), "bfloat16"),
    "optim.embed_tokens.exp_avg": ((32000, 2048), "float32"),
    "optim.embed_tokens.exp_avg_sq": ((32000, 2048), "float32"),
    "optim.final_norm_proj.exp_avg": ((8193, 4096), "float32"),
}
STEPS = ("disk_write", "tm_save", "dcp_save", "disk_read", "tm_load", "dcp_load")


# ---------------------------------------------------------------- rank side

def _bytes_of(tensor: Any) -> memoryview:
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _crcs(shards: list[Any]) -> list[int]:
    import crc32c

    return [crc32c.crc32c(_bytes_of(t)) for t in shards]


def _write_plain(shards: list[Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in shards:
            view, done = _bytes_of(tensor), 0
            while done < len(view):
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_plain(shards: list[Any], path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        for tensor in shards:
            view, done = _bytes_of(tensor), 0
            while done < len(view):
                done += os.preadv(fd, [view[done:]], offset + done)
            offset += done
    finally:
        os.close(fd)


def _worker(rank: int, world: int, port: int, work: str, cold: bool, tensors: dict[str, Any] | None = None,
            runs: int = RUNS, prefault_bytes: int = PREFAULT) -> None:
    """One rank of the benchmark: every step of `runs` repetitions on the state `tensors` (TENSORS by default), each
    step's times, what the library reported and this rank's peak RSS (all repetitions) written to result.json."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh

    import tensormorph as tm

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    try:
        root = Path(work)
        mesh = init_device_mesh("cpu", (world,))
        start = time.perf_counter()
        state = shard_state(mesh, rank, world, TENSORS if tensors is None else tensors)
        shards = [t.to_local() for t in state.values()]
        truth = _crcs(shards)
        build_s = time.perf_counter() - start

        def run(k: int, label: str, state: dict[str, Any]) -> dict[str, Any]:
            """One step of repetition k on this rank: what the library reported, and the step's peak RSS."""
            reset_peak_rss()  # after timed_on_ranks' prefault: the peak is this step's own
            before = proc_status()["VmRSS"]
            out: dict[str, Any] = {}
            if label == "disk_write":
                _write_plain(shards, root / f"plain-{k}" / f"rank{rank}.bin")
            elif label == "disk_read":
                _read_plain(shards, root / f"plain-{k}" / f"rank{rank}.bin")
            elif label == "tm_save":
                out["bytes_written"] = tm.save(state, root / f"tm-{k}").bytes_written
            elif label == "tm_load":
                report = tm.load(root / f"tm-{k}", state)
                out.update(bytes_needed=report.bytes_needed, bytes_read=report.bytes_read)
            elif label == "dcp_save":
                dcp.save(state, storage_writer=FileSystemWriter(root / f"dcp-{k}", sync_files=True))
            else:
                dcp.load(state, storage_reader=FileSystemReader(root / f"dcp-{k}"))
            status = proc_status()
            return {**out, "peak_rss": status["VmHWM"], "peak_rss_growth": status["VmHWM"] - before}

        # imports and first-call setup of every step, off the clock, on a small state of the same kind
        warm_state = shard_state(mesh, rank, world, {"w": ((1025, 64), "float32"), "v": ((128, 128), "float32")})
        for label in ("tm_save", "dcp_save", "tm_load", "dcp_load"):
            run(-1, label, warm_state)
        dist.barrier()
        if rank == 0:
            for sub in ("tm--1", "dcp--1"):
                shutil.rmtree(root / sub)

        times: dict[str, list[float]] = {label: [] for label in STEPS}
        reports: dict[str, list[list[Any]]] = {label: [] for label in STEPS}
        sizes: dict[str, int] = {}
        for k in range(runs):
            first, second = ("tm", "dcp") if k % 2 == 0 else ("dcp", "tm")
            for label in ("disk_write", f"{first}_save", f"{second}_save",
                          "disk_read", f"{first}_load", f"{second}_load"):
                if label.endswith(("_load", "_read")):
                    for tensor in shards:
                        tensor.zero_()
                seconds, results = timed_on_ranks(functools.partial(run, k, label, state),
                                                  prefault_bytes=prefault_bytes, cold=cold)
                times[label].append(seconds)
                reports[label].append(results)
                if label.endswith(("_load", "_read")) and _crcs(shards) != truth:
                    raise AssertionError(f"rank {rank}: {label} (run {k}) did not restore the saved shards")
                if rank == 0:
                    print(f"run {k} {label}: {fmt_s(seconds)}", flush=True)
            dist.barrier()
            if rank == 0:
                for sub in ("plain", "tm", "dcp"):
                    sizes.setdefault(sub, sum(p.stat().st_size for p in (root / f"{sub}-{k}").rglob("*")
                                              if p.is_file()))
                    shutil.rmtree(root / f"{sub}-{k}")
            dist.barrier()
        local_bytes = sum(t.numel() * t.element_size() for t in shards)
        everyone = [None] * world
        dist.all_gather_object(everyone, local_bytes)
        if rank == 0:
            (root / "result.json").write_text(json.dumps({
                "times": times, "reports": reports, "file_bytes": sizes, "rank_bytes": everyone,
                "build_s": build_s}))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- driver


# ---------------------------------------------------------------- driver

def save_load_rows(size: str, cold: bool, steps: dict[str, Any], ratios: dict[str, float], rate: dict[str, float],
                   detail: Any, targets: tuple[float, float] = (1.0, 1.0), prefix: str = "") -> list[dict[str, Any]]:
    """The README rows of a save and a load against DCP's: `detail(step)` follows each time (a rate, a peak RSS),
    `prefix` opens each note."""
    cases = (("save", f"save, {size}", "tm.save vs dcp.save (FileSystemWriter sync_files=True)", targets[0],
              "write + fsync rate", "disk_write"),
             ("load", f"load, {size}, {'cold' if cold else 'warm'}", "tm.load vs dcp.load into the same DTensors",
              targets[1], "read rate", "disk_read"))
    return [row(bench, case, tensormorph=f"{fmt_s(steps[f'tm_{kind}']['median'])}{detail(f'tm_{kind}')}",
                anchor=f"dcp.{kind}: {fmt_s(steps[f'dcp_{kind}']['median'])}{detail(f'dcp_{kind}')}",
                ratio=ratios[f"{kind}_tm_over_dcp"], target=f">= {target:.1f}x",
                met=ratios[f"{kind}_tm_over_dcp"] >= target,
                note=f"{prefix}{ratios[f'{kind}_tm_fraction_of_disk']:.0%} of the disk's {what}, {rate[disk]:.2f} GB/s")
            for kind, bench, case, target, what, disk in cases]


def main() -> None:
    if len(sys.argv) > 1:
        sys.exit(f"usage: python -m benchmarks.{NAME}")
    cold = drop_caches()
    if not cold:
        print("WARNING: cannot drop the page cache (not root): loads and disk reads are warm", flush=True)
    loads_before, started = load_averages(), time.perf_counter()
    with work_dir(NAME) as work:
        spawn_ranks(_worker, RANKS, str(work), cold)
        data = json.loads((work / "result.json").read_text())
    wall_s = time.perf_counter() - started

    total = sum(data["rank_bytes"])
    steps = {label: summary(data["times"][label]) for label in STEPS}
    rate = {label: total / s["median"] / 1e9 for label, s in steps.items()}
    ratios = {"save_tm_over_dcp": rate["tm_save"] / rate["dcp_save"],
              "load_tm_over_dcp": rate["tm_load"] / rate["dcp_load"],
              "save_tm_fraction_of_disk": rate["tm_save"] / rate["disk_write"],
              "load_tm_fraction_of_disk": rate["tm_load"] / rate["disk_read"],
              "save_dcp_fraction_of_disk": rate["dcp_save"] / rate["disk_write"],
              "load_dcp_fraction_of_disk": rate["dcp_load"] / rate["disk_read"]}

    names = {"disk_write": "os.write + fsync (disk)", "tm_save": "tm.save", "dcp_save": "dcp.save",
             "disk_read": "preadv (disk)", "tm_load": "tm.load", "dcp_load": "dcp.load"}
    table = [[names[label], fmt_s(s["median"]), f"{fmt_s(s['min'])} - {fmt_s(s['max'])}", f"{rate[label]:.2f} GB/s"]
             for label, s in steps.items()]
    print()
    print(f"{len(TENSORS)} tensors, {fmt_bytes(total)} on {RANKS} ranks "
          f"({' + '.join(map(fmt_bytes, data['rank_bytes']))}), {'cold' if cold else 'WARM'} reads, medians of {RUNS}")
    print_table(["step", "median", "range", "rate"], table)
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")

    rows = save_load_rows(f"{fmt_bytes(total)} of DTensors, {RANKS} ranks (gloo)", cold, steps, ratios, rate,
                          detail=lambda step: f" ({rate[step]:.2f} GB/s)")
    tm_load = data["reports"]["tm_load"][0]  # every repetition reads the same bytes: the first one's
    write_result(NAME, {
        "title": f"Sharded save and load of {fmt_bytes(total)} of DTensors on {RANKS} gloo ranks vs DCP",
        "runs": RUNS,
        "ranks": RANKS,
        "cold_reads": cold,
        "noise": ("shared 2-core VM: other engineers' test runs may overlap this one; "
                  f"load averages {loads_before} before, {load_averages()} after; whole run {wall_s:.0f} s"),
        "prefault_bytes_per_rank": PREFAULT,
        "sizes": {"tensors": len(TENSORS), "state_bytes": total, "rank_bytes": data["rank_bytes"],
                  "file_bytes": data["file_bytes"]},
        "tensors": [{"name": n, "shape": list(s), "dtype": d, "placement": "Shard(0)"}
                    for n, (s, d) in TENSORS.items()],
        "steps": {label: {"what": names[label], "time_s": steps[label], "gb_per_s": rate[label]} for label in STEPS},
        "ratios": ratios,
        "tm_save_bytes_written": [r["bytes_written"] for r in data["reports"]["tm_save"][0]],
        "tm_load": {"bytes_needed": [r["bytes_needed"] for r in tm_load],
                    "bytes_read": [r["bytes_read"] for r in tm_load]},
        "build_s": data["build_s"],
        "rows": rows,
    })


if __name__ == "__main__":
    main()
