"""Offline convert and diff of a 4 GiB checkpoint on 1 process vs 2 under torchrun, against the disk's own rates.

The checkpoints are bench_diff's: (A) 16 fp32 tensors of 16384x4096 (4 GiB) saved by dcp.save from 4 gloo ranks,
Shard(0); (B) the same weights as an HF-sharded safetensors folder (4 files).
- convert: `tensormorph.convert(A, out, max_shard_size=600MB, check=False)`: reads A, writes 8 safetensors files
  (2 tensors each) and the index. Under torchrun each process writes whole files of its share (4 and 4).
- diff: `tensormorph.diff(A, B)`: reads both sides (8 GiB), all 16 tensors equal (the bytewise path).
1 process is the plain library call (no torch imported); 2 processes are `torchrun --nproc_per_node 2` on this
machine, the same call with the launch's team (gloo). Each run drops the page cache (rank 0) and prefaults every
process; the clock starts once every process is ready and stops when the slowest has finished (the torchrun
launch itself, torch's import and the rendezvous, is reported apart as `launch_s`). Medians of RUNS.
The first 2-process output must equal the first 1-process output byte for byte.
Anchor, the disk: cold sequential reads of A (1 reader, then 2 readers at once on halves of the files), and writes
with fsync of 4 GiB (1 writer, then 2 writers of 2 GiB at once). The disk's floors, at the best of those rates: for
convert, reading 4 GiB and writing 4 GiB (`serial`: one after the other; `overlapped`: the longer of the two), for
diff reading 8 GiB. A run near its floor is limited by the disk, not the CPU, and a second process can only help as
far as the disk serves two streams faster than one.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from .bench_diff import RANKS, TENSORS, _dcp_worker, build_hf
from .common import (
    REPO,
    GiB,
    cpu_seconds,
    drop_caches,
    emit,
    files_under,
    fmt_bytes,
    fmt_s,
    free_port,
    io_read_bytes,
    load_averages,
    prefault,
    print_table,
    proc_status,
    require_drop_caches,
    reset_peak_rss,
    row,
    run_child,
    spawn_ranks,
    summary,
    warm_page_cache,
    work_dir,
    write_result,
)

NAME = "offline"
RUNS = 3
PROCESSES = (1, 2)
MAX_SHARD = "600MB"  # 2 tensors of 256 MiB per file: 8 files to share out
PREFAULT = 3 * GiB
WRITE_BLOCK = 64 << 20  # the disk anchor writes 64 MiB at a time
OPS = ("convert", "diff")
TORCHRUN_TIMEOUT_S = 900


# ---------------------------------------------------------------- one run (in its own process or launch)

def child(op: str, a: Path, b: Path, out: Path) -> None:
    """One timed op, alone or as one process of a torchrun launch (rank 0 emits the result)."""
    import tensormorph as tm
    from tensormorph.ops.spread import ALONE, under_torchrun

    if under_torchrun():
        from tensormorph.distributed.offline import launched_team
        context: Any = launched_team()
    else:
        context = nullcontext(ALONE)
    with context as team:
        if team.rank == 0:
            drop_caches()
        team.each(lambda: None)  # no process reads before the cache is dropped
        prefault(PREFAULT)
        reset_peak_rss()
        team.each(lambda: None)
        io0, cpu0 = io_read_bytes(), cpu_seconds()
        start = time.perf_counter()
        if op == "convert":
            result = tm.convert(a, out, max_shard_size=MAX_SHARD, check=False, team=team)
            outcome: dict[str, Any] = {"files": len(result.files), "bytes_written": result.bytes_written}
        else:
            report = tm.diff(a, b, team=team)
            if not report.identical:
                raise AssertionError(f"diff found differences: {report.counts}")
            outcome = {"counts": report.counts}
        own = time.perf_counter() - start  # until the op returned here: its last collective waits for the slowest
        stats = {"own_s": own, "cpu_s": cpu_seconds() - cpu0, "read_bytes": io_read_bytes() - io0,
                 "peak_rss": proc_status()["VmHWM"]}
        everyone = team.each(lambda: stats)  # the clock stops once the slowest process is done
        elapsed = time.perf_counter() - start
    if team.rank == 0:
        emit({"op": op, "processes": team.world, "time_s": elapsed, "ranks": everyone, **outcome})


def run(op: str, processes: int, a: Path, b: Path, out: Path) -> dict[str, Any]:
    args = ["--child", op, str(a), str(b), str(out)]
    start = time.perf_counter()
    if processes == 1:
        result = run_child("benchmarks.bench_offline", args, timeout=TORCHRUN_TIMEOUT_S)
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(processes),
                               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                               "-m", "benchmarks.bench_offline", *args],
                              cwd=REPO, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun {op} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads([line for line in proc.stdout.splitlines() if line.strip()][-1])
    result["launch_s"] = time.perf_counter() - start - result["time_s"]  # process start, imports, rendezvous
    return result


# ---------------------------------------------------------------- the disk's own rates

def _write(path: Path, nbytes: int) -> None:
    import numpy as np

    block = np.random.default_rng(0).integers(0, 255, WRITE_BLOCK, dtype=np.uint8).tobytes()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(nbytes // WRITE_BLOCK):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)


def _together(steps: list[Callable[[], Any]]) -> float:
    """Seconds for these steps run at once, one thread each (reads and writes release the GIL)."""
    threads = [threading.Thread(target=step) for step in steps]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def disk_child(a: Path, scratch: Path) -> None:
    files = files_under(a)
    nbytes = sum(p.stat().st_size for p in files)
    half = len(files) // 2
    rates: dict[str, float] = {}
    for streams, groups in ((1, [files]), (2, [files[:half], files[half:]])):
        drop_caches()
        prefault(PREFAULT)
        rates[f"read_{streams}"] = nbytes / _together([partial(warm_page_cache, g, WRITE_BLOCK) for g in groups])
    size = 4 * GiB
    for streams in (1, 2):
        prefault(PREFAULT)
        paths = [scratch / f"write-{k}" for k in range(streams)]
        rates[f"write_{streams}"] = size / _together([partial(_write, p, size // streams) for p in paths])
        for p in paths:
            p.unlink()
    emit({"read_bytes": nbytes, "rates": rates})


# ---------------------------------------------------------------- driver

def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
        return
    if len(sys.argv) == 4 and sys.argv[1] == "--disk":
        disk_child(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    require_drop_caches()
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {op: {n: [] for n in PROCESSES} for op in OPS}
    loads = [load_averages()]
    with work_dir(NAME) as work:
        a, b = work / "dcp", work / "hf"
        t0 = time.perf_counter()
        spawn_ranks(_dcp_worker, RANKS, str(a))
        build_hf(b, work / "hf-perturbed")
        shutil.rmtree(work / "hf-perturbed")
        print(f"built the {RANKS}-rank DCP and HF-sharded checkpoints in {time.perf_counter() - t0:.1f} s", flush=True)
        logical = sum(p.stat().st_size for p in files_under(b)) - (b / "model.safetensors.index.json").stat().st_size
        disk = run_child("benchmarks.bench_offline", ["--disk", str(a), str(work)])
        print("disk: " + ", ".join(f"{k} {fmt_bytes(v)}/s" for k, v in disk["rates"].items()), flush=True)
        identical = None
        for k in range(RUNS):
            for op in OPS:
                for n in PROCESSES:
                    out = work / f"out-{op}-{n}-{k}"
                    result = run(op, n, a, b, out)
                    runs[op][n].append(result)
                    print(f"  run {k + 1} {op} x{n}: {fmt_s(result['time_s'])} (launch {fmt_s(result['launch_s'])})",
                          flush=True)
                    if op == "convert" and k > 0:
                        shutil.rmtree(out)
            if k == 0:
                first = [work / f"out-convert-{n}-0" for n in PROCESSES]
                names = sorted(p.name for p in first[0].iterdir())
                identical = names == sorted(p.name for p in first[1].iterdir()) and all(
                    filecmp.cmp(first[0] / name, first[1] / name, shallow=False) for name in names)
                for path in first:
                    shutil.rmtree(path)
                if not identical:
                    raise AssertionError("the 2-process convert wrote other bytes than the 1-process one")
        loads.append(load_averages())

    rates = disk["rates"]
    read_rate, write_rate = max(rates["read_1"], rates["read_2"]), max(rates["write_1"], rates["write_2"])
    floors = {"convert": {"serial": logical / read_rate + logical / write_rate,
                          "overlapped": max(logical / read_rate, logical / write_rate)},
              "diff": {"serial": (disk["read_bytes"] + logical) / read_rate}}
    floors["diff"]["overlapped"] = floors["diff"]["serial"]
    cases: dict[str, Any] = {}
    table, rows = [], []
    for op in OPS:
        case: dict[str, Any] = {"floor_s": floors[op]}
        floor = floors[op]["overlapped"]
        for n in PROCESSES:
            rs = runs[op][n]
            case[f"x{n}"] = {
                "time_s": summary([r["time_s"] for r in rs]), "launch_s": summary([r["launch_s"] for r in rs]),
                "cpu_s_per_process": summary([max(x["cpu_s"] for x in r["ranks"]) for r in rs]),
                "read_bytes": summary([sum(x["read_bytes"] for x in r["ranks"]) for r in rs]),
                "peak_rss_per_process": summary([max(x["peak_rss"] for x in r["ranks"]) for r in rs]),
                "ranks_own_s": [[x["own_s"] for x in r["ranks"]] for r in rs]}
            t = case[f"x{n}"]["time_s"]["median"]
            cpu = case[f"x{n}"]["cpu_s_per_process"]["median"]
            table.append([op, n, fmt_s(t), fmt_s(cpu), f"{cpu / t:.0%}", f"{floor / t:.0%}",
                          fmt_s(case[f"x{n}"]["launch_s"]["median"])])
        t1, t2 = case["x1"]["time_s"]["median"], case["x2"]["time_s"]["median"]
        case["speedup_2_over_1"] = t1 / t2
        cases[op] = case
        what = "convert 4 GiB DCP to safetensors (8 files)" if op == "convert" else "diff 4 GiB DCP vs HF (8 GiB read)"
        rows.append(row(f"offline {what}, cold", "2 processes (torchrun) vs 1: time",
                        tensormorph=fmt_s(t2), anchor=f"1 process: {fmt_s(t1)}", ratio=t1 / t2, target=">= 1.0x",
                        met=t1 / t2 >= 1.0,
                        note=f"disk floor {fmt_s(floor)} (1 process at {floor / t1:.0%} of it, 2 at {floor / t2:.0%}); "
                             f"torchrun launch {fmt_s(case['x2']['launch_s']['median'])} not counted"))
    print()
    print_table(["op", "processes", "time", "cpu/process", "cpu/time", "disk floor/time", "launch (apart)"], table)
    print("disk: " + ", ".join(f"{k} {fmt_bytes(v)}/s" for k, v in rates.items()))
    write_result(NAME, {
        "title": "Offline convert and diff of 4 GiB on 1 vs 2 processes (torchrun), cold, vs the disk's rates",
        "runs": RUNS,
        "sizes": {"tensors": TENSORS, "logical_bytes": logical, "dcp_file_bytes": disk["read_bytes"],
                  "max_shard_size": MAX_SHARD},
        "disk": {"rates_bytes_per_s": rates, "floors_s": floors},
        "outputs_identical": identical,
        "load_averages": loads,
        "cases": cases,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
