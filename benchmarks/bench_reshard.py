"""Reshard on load, 4 ranks -> 3: bytes each rank reads and load time, tm.load vs dcp.load.

~430 MiB of state (fp32 and bf16, two tensors uneven on both dims) is saved by 4 gloo ranks as
DTensors [Shard(0), Shard(1)] on a 2x2 mesh, with tm.save and with dcp.save. 3 ranks then load
it into DTensors Shard(0) on a 1-D mesh: each needs a band of rows that spans 2 or 4 saved
chunks. Ours reads the byte runs of its band only; DCP reads every overlapping saved chunk whole.
Bytes read are counted by the kernel: the rchar delta of /proc/self/io around the load (every
byte passed through a read system call, manifest and metadata included). Each side loads once
before the measured loads, so the modules that loading imports are not counted as reads.
The measured loads are cold (page cache dropped when root), after a prefault on each rank, with
barriers around them; their time is the slowest rank's. Loaded shards are checked (CRC-32C)
against the saved values after every load.
"""

from __future__ import annotations

import functools
import json
import math
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
    io_rchar,
    load_averages,
    print_table,
    row,
    spawn_ranks,
    summary,
    timed_on_ranks,
    work_dir,
    write_result,
)

NAME = "reshard"
RUNS = 5
SAVE_MESH, LOAD_RANKS = (2, 2), 3
PREFAULT = 3 * GiB // 2  # per rank: DCP's rank 1 reads every chunk whole and deserialises it (~2x its 430 MiB)

# name -> (global shape, dtype)
TENSORS = {
    "model.embed_tokens.weight": ((16384, 2048), "float32"),
    "model.layers.0.attn.weight": ((4096, 4096), "float32"),
    "model.layers.0.mlp.weight": ((8192, 4096), "bfloat16"),
    "model.layers.1.attn.weight": ((4099, 4097), "float32"),
    "model.layers.1.mlp.weight": ((6001, 2050), "float32"),
    "lm_head.weight": ((16384, 2048), "bfloat16"),
}
SIDES = ("tm", "dcp")


def _full(i: int, shape: tuple[int, ...], dtype: str) -> Any:
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(i), dtype=getattr(torch, dtype))


def _crc(tensor: Any) -> int:
    import crc32c
    import torch

    return crc32c.crc32c(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()))


def _save_worker(rank: int, world: int, port: int, work: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import tensormorph as tm

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", SAVE_MESH)
        # every rank makes the same full tensor and keeps its own box of it (no scatter)
        state = {name: distribute_tensor(_full(i, shape, dtype), mesh, [Shard(0), Shard(1)], src_data_rank=None)
                 for i, (name, (shape, dtype)) in enumerate(TENSORS.items())}
        tm.save(state, Path(work, "tm"))
        dcp.save(state, storage_writer=FileSystemWriter(Path(work, "dcp"), sync_files=True))
    finally:
        dist.destroy_process_group()


def _load_worker(rank: int, world: int, port: int, work: str, cold: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import tensormorph as tm

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state, truth = {}, []
        for i, (name, (shape, dtype)) in enumerate(TENSORS.items()):
            per_rank = -(-shape[0] // world)  # torch.chunk's split: ceil division, trailing ranks short
            begin, end = min(rank * per_rank, shape[0]), min((rank + 1) * per_rank, shape[0])
            truth.append(_crc(_full(i, shape, dtype)[begin:end]))
            local = torch.zeros((end - begin, *shape[1:]), dtype=getattr(torch, dtype))
            state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                             stride=tuple(math.prod(shape[k + 1:]) for k in range(len(shape))))
        shards = [t.to_local() for t in state.values()]
        needed = sum(t.numel() * t.element_size() for t in shards)

        def load(side: str) -> dict[str, Any]:
            before = io_rchar()
            if side == "tm":
                report = tm.load(Path(work, "tm"), state)
                out = {"bytes_needed": report.bytes_needed, "bytes_read": report.bytes_read}
            else:
                dcp.load(state, storage_reader=FileSystemReader(Path(work, "dcp")))
                out = {"bytes_needed": needed}
            out["rchar"] = io_rchar() - before
            return out

        def check_and_clear(side: str) -> None:
            if [_crc(t) for t in shards] != truth:
                raise AssertionError(f"rank {rank}: {side} load did not restore the saved values")
            for t in shards:
                t.zero_()

        for side in SIDES:  # imports and first-call setup, off the clock and out of the counts
            load(side)
            check_and_clear(side)
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        counts: dict[str, list[list[dict[str, Any]]]] = {side: [] for side in SIDES}
        for k in range(RUNS):
            for side in SIDES if k % 2 == 0 else SIDES[::-1]:
                seconds, per_rank = timed_on_ranks(functools.partial(load, side), prefault_bytes=PREFAULT, cold=cold)
                times[side].append(seconds)
                counts[side].append(per_rank)
                check_and_clear(side)
        if rank == 0:
            Path(work, "result.json").write_text(json.dumps({"times": times, "counts": counts}))
    finally:
        dist.destroy_process_group()


def _per_rank(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each rank's counts, with the largest rchar any run saw (the counts barely vary between runs)."""
    out = []
    for rank, first in enumerate(runs[0]):
        rchar = max(run[rank]["rchar"] for run in runs)
        out.append({**first, "rchar": rchar, "rchar_over_needed": rchar / first["bytes_needed"]})
    return out


def main() -> None:
    if len(sys.argv) > 1:
        sys.exit(f"usage: python -m benchmarks.{NAME}")
    cold = drop_caches()
    if not cold:
        print("WARNING: cannot drop the page cache (not root): the loads are warm", flush=True)
    loads_before, started = load_averages(), time.perf_counter()
    with work_dir(NAME) as work:
        spawn_ranks(_save_worker, math.prod(SAVE_MESH), str(work))
        saved_s = time.perf_counter() - started
        file_bytes = {side: sum(p.stat().st_size for p in (work / side).rglob("*") if p.is_file()) for side in SIDES}
        spawn_ranks(_load_worker, LOAD_RANKS, str(work), cold)
        data = json.loads((work / "result.json").read_text())
    wall_s = time.perf_counter() - started

    state_bytes = sum(math.prod(s) * (2 if d == "bfloat16" else 4) for s, d in TENSORS.values())
    times = {side: summary(data["times"][side]) for side in SIDES}
    ranks = {side: _per_rank(data["counts"][side]) for side in SIDES}
    worst = {side: max(ranks[side], key=lambda r: r["rchar_over_needed"]) for side in SIDES}
    total = {side: sum(r["rchar"] for r in ranks[side]) / sum(r["bytes_needed"] for r in ranks[side]) for side in SIDES}
    ratios = {"load_time_dcp_over_tm": times["dcp"]["median"] / times["tm"]["median"],
              "worst_rank_read_over_needed": {side: worst[side]["rchar_over_needed"] for side in SIDES},
              "all_ranks_read_over_needed": total}

    print()
    print(f"{fmt_bytes(state_bytes)} saved by {math.prod(SAVE_MESH)} ranks on a {SAVE_MESH[0]}x{SAVE_MESH[1]} mesh, "
          f"loaded on {LOAD_RANKS} ranks Shard(0), {'cold' if cold else 'WARM'}, medians of {RUNS}")
    table = []
    for side in SIDES:
        for rank, r in enumerate(ranks[side]):
            table.append([side, rank, fmt_bytes(r["bytes_needed"]),
                          fmt_bytes(r["bytes_read"]) if "bytes_read" in r else "-",
                          fmt_bytes(r["rchar"]), f"{r['rchar_over_needed']:.2f}x"])
    print_table(["side", "rank", "needed", "LoadReport.bytes_read", "rchar", "rchar / needed"], table)
    for side in SIDES:
        t = times[side]
        print(f"{side} load: {fmt_s(t['median'])} ({fmt_s(t['min'])} - {fmt_s(t['max'])})")
    print(f"load time dcp/tm: {ratios['load_time_dcp_over_tm']:.2f}x; bytes read / needed, all ranks: "
          f"tm {total['tm']:.2f}x, dcp {total['dcp']:.2f}x")

    bench = (f"reshard load, {math.prod(SAVE_MESH)} ranks ({SAVE_MESH[0]}x{SAVE_MESH[1]} mesh) -> {LOAD_RANKS} ranks "
             f"Shard(0), {fmt_bytes(state_bytes)}, {'cold' if cold else 'warm'}")

    def share(side: str) -> str:
        r = worst[side]
        rank = ranks[side].index(r)
        return f"{r['rchar_over_needed']:.2f}x (rank {rank}: {fmt_bytes(r['rchar'])} of {fmt_bytes(r['bytes_needed'])})"

    rows = [
        row(bench, "load time, slowest rank", tensormorph=fmt_s(times["tm"]["median"]),
            anchor=f"dcp.load: {fmt_s(times['dcp']['median'])}", ratio=ratios["load_time_dcp_over_tm"],
            target=">= 1.0x", met=ratios["load_time_dcp_over_tm"] >= 1.0),
        row(bench, "bytes read / bytes needed, worst rank (rchar; ratio = Tensormorph's, lower is better)",
            tensormorph=share("tm"), anchor=f"dcp.load: {share('dcp')}", ratio=worst["tm"]["rchar_over_needed"],
            target="<= 1.05x", met=worst["tm"]["rchar_over_needed"] <= 1.05,
            note=f"all ranks: {total['tm']:.2f}x vs {total['dcp']:.2f}x"),
    ]
    write_result(NAME, {
        "title": f"Reshard on load, {math.prod(SAVE_MESH)} ranks ({SAVE_MESH[0]}x{SAVE_MESH[1]}) -> {LOAD_RANKS}: "
                 "bytes read and load time vs DCP",
        "runs": RUNS,
        "cold_reads": cold,
        "noise": ("shared 2-core VM: other engineers' test runs may overlap this one; "
                  f"load averages {loads_before} before, {load_averages()} after; whole run {wall_s:.0f} s "
                  f"(save on {math.prod(SAVE_MESH)} ranks {saved_s:.0f} s)"),
        "prefault_bytes_per_rank": PREFAULT,
        "sizes": {"tensors": len(TENSORS), "state_bytes": state_bytes, "file_bytes": file_bytes},
        "save": {"mesh": list(SAVE_MESH), "placements": ["Shard(0)", "Shard(1)"]},
        "load": {"mesh": [LOAD_RANKS], "placements": ["Shard(0)"]},
        "tensors": [{"name": n, "shape": list(s), "dtype": d} for n, (s, d) in TENSORS.items()],
        "load_time_s": times,
        "per_rank": ranks,
        "ratios": ratios,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
