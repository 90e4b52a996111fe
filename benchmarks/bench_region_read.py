"""Read a 1024x1024 block of a 4 GiB tensor stored as 8 DCP chunks: bytes touched and speed-up.

8 gloo ranks each build their 4096x32768 fp32 row block deterministically
(value = hash of the global element index, exact in fp32) and save one DTensor
Shard(0) on a 1-D mesh with dcp.save: 8 .distcp files of 512 MiB. After
drop_caches we read `ck[name][r0:r0+1024, c0:c0+1024]` with rows crossing the
boundary of chunks 2 and 3, and count the bytes fetched from disk
(/proc/self/io read_bytes) and the bytes the files then have in the page cache
(mincore). Targets: read_bytes <= 1.1x the 4 MiB the block needs, and >= 100x
faster than the anchor, `full(force=True)` of the same tensor, also cold.
The "page-aligned" case picks c0 so each row's 4 KiB is exactly one page;
"unaligned" shifts it by 32 bytes so each row spans two pages.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import (
    PAGE,
    GiB,
    drop_caches,
    fmt_bytes,
    fmt_s,
    init_gloo,
    io_read_bytes,
    prefault,
    print_table,
    require_drop_caches,
    resident_bytes,
    row,
    spawn_ranks,
    summary,
    work_dir,
    write_result,
)

NAME = "region_read"
TENSOR = "model.embed.weight"
N = 32768
RANKS = 8
BLOCK = 1024
MULT, MOD = 2654435761, 1 << 24
REGION_RUNS = 5
FULL_RUNS = 3


def expected(r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
    """The deterministic values of rows [r0, r1) and columns [c0, c1)."""
    index = np.arange(r0, r1, dtype=np.int64)[:, None] * N + np.arange(c0, c1, dtype=np.int64)
    return (index * MULT % MOD).astype(np.float32)


def _save_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        rows = N // world
        local = torch.empty(rows, N, dtype=torch.float32)
        step = 256
        for b in range(0, rows, step):
            local[b:b + step] = torch.from_numpy(expected(rank * rows + b, rank * rows + b + step, 0, N))
        dcp.save({TENSOR: DTensor.from_local(local, mesh, [Shard(0)], run_check=False)}, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


def _data_offsets(path: Path) -> dict[int, tuple[str, int, int]]:
    """chunk row start -> (file, byte offset of element [0, 0] in the file, rows) for every chunk."""
    import tensormorph as tm

    with tm.open(path) as ck:
        out = {}
        for chunk in ck[TENSOR].chunks:
            view = chunk.read()
            base = np.frombuffer(ck.storage.buffer(chunk.file), dtype=np.uint8)
            out[chunk.offsets[0]] = (chunk.file, view.__array_interface__["data"][0] - base.ctypes.data,
                                     chunk.shape[0])
            del view, base
    return out


def _pages_needed(offsets: dict[int, tuple[str, int, int]], r0: int, c0: int) -> int:
    pages = set()
    for r in range(r0, r0 + BLOCK):
        start = max(s for s in offsets if s <= r)
        file, base, _ = offsets[start]
        begin = base + ((r - start) * N + c0) * 4
        end = begin + BLOCK * 4
        pages.update((file, p) for p in range(begin // PAGE, (end - 1) // PAGE + 1))
    return len(pages) * PAGE


def region_runs(path: Path, files: list[Path], r0: int, c0: int) -> dict[str, Any]:
    import tensormorph as tm

    want = expected(r0, r0 + BLOCK, c0, c0 + BLOCK)
    times, io, cached = [], [], []
    for _ in range(REGION_RUNS):
        drop_caches()
        with tm.open(path) as ck:
            tensor = ck[TENSOR]
            resident_before = resident_bytes(files)
            prefault(1 * GiB)
            io0 = io_read_bytes()
            start = time.perf_counter()
            block = tensor[r0:r0 + BLOCK, c0:c0 + BLOCK]
            times.append(time.perf_counter() - start)
            io.append(io_read_bytes() - io0)
            cached.append(resident_bytes(files) - resident_before)
        if not np.array_equal(block, want):
            raise AssertionError(f"block at ({r0}, {c0}) differs from the values the ranks wrote")
    return {"r0": r0, "c0": c0, "time_s": summary(times), "read_bytes": summary(io),
            "page_cache_growth_bytes": summary(cached)}


def full_runs(path: Path, files: list[Path]) -> dict[str, Any]:
    import tensormorph as tm

    times, io = [], []
    for _ in range(FULL_RUNS):
        drop_caches()
        with tm.open(path) as ck:
            tensor = ck[TENSOR]
            prefault(9 * GiB)  # 4 GiB result + 4 GiB page cache
            io0 = io_read_bytes()
            start = time.perf_counter()
            whole = tensor.full(force=True)
            times.append(time.perf_counter() - start)
            io.append(io_read_bytes() - io0)
        for r in (0, N // RANKS - 1, N // RANKS, N - 1):
            if not np.array_equal(whole[r], expected(r, r + 1, 0, N)[0]):
                raise AssertionError(f"full(): row {r} differs from the values the ranks wrote")
        del whole
    return {"time_s": summary(times), "read_bytes": summary(io)}


def main() -> None:
    require_drop_caches()
    with work_dir(NAME) as work:
        path = work / "dcp"
        t0 = time.perf_counter()
        spawn_ranks(_save_worker, RANKS, str(path))
        print(f"built {RANKS}-rank DCP checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
        files = sorted(path.glob("*.distcp"))
        total = sum(f.stat().st_size for f in files)
        offsets = _data_offsets(path)
        r0 = 3 * (N // RANKS) - BLOCK // 2  # rows 11776..12799 cross the boundary of chunks 2 and 3
        _, base, _ = offsets[3 * (N // RANKS)]
        aligned_c0 = N // 2 + ((PAGE - base % PAGE) % PAGE) // 4
        cases = {}
        for label, c0 in (("page_aligned", aligned_c0), ("unaligned", aligned_c0 + 8)):
            cases[label] = region_runs(path, files, r0, c0)
            cases[label]["min_page_bytes"] = _pages_needed(offsets, r0, c0)
        full = full_runs(path, files)

    needed = BLOCK * BLOCK * 4
    table, rows = [], []
    full_med = full["time_s"]["median"]
    for label, case in cases.items():
        med = case["time_s"]["median"]
        read = case["read_bytes"]["median"]
        case["needed_bytes"] = needed
        case["read_over_needed"] = read / needed
        case["speedup_vs_full"] = full_med / med
        table.append([label, case["c0"], fmt_s(med), fmt_s(full_med), f"{case['speedup_vs_full']:.0f}x",
                      fmt_bytes(read), fmt_bytes(case["page_cache_growth_bytes"]["median"]),
                      fmt_bytes(case["min_page_bytes"]), f"{case['read_over_needed']:.2f}x"])
    print()
    print(f"tensor {TENSOR}: {N}x{N} fp32 = {fmt_bytes(N * N * 4)} in {len(files)} files ({fmt_bytes(total)}); "
          f"block {BLOCK}x{BLOCK} at rows {r0}..{r0 + BLOCK - 1} needs {fmt_bytes(needed)}")
    print(f"full(force=True) cold: median {fmt_s(full_med)}, read {fmt_bytes(full['read_bytes']['median'])}")
    print_table(["case", "c0", "region", "full()", "speed-up", "read_bytes", "page cache +", "page minimum",
                 "read/needed"], table)
    aligned = cases["page_aligned"]
    rows.append(row("region read, 1024x1024 of a 4 GiB DCP tensor (8 chunks), cold",
                    "speed-up vs full(force=True)", tensormorph=fmt_s(aligned["time_s"]["median"]),
                    anchor=f"full(): {fmt_s(full_med)}", ratio=aligned["speedup_vs_full"], target=">= 100x",
                    met=aligned["speedup_vs_full"] >= 100))
    rows.append(row("region read, 1024x1024 of a 4 GiB DCP tensor (8 chunks), cold",
                    "bytes read from disk / 4 MiB needed", tensormorph=fmt_bytes(aligned["read_bytes"]["median"]),
                    anchor=f"needed: {fmt_bytes(needed)}", ratio=aligned["read_over_needed"], target="<= 1.1x",
                    met=aligned["read_over_needed"] <= 1.1))
    write_result(NAME, {
        "title": "Region read of a 4 GiB tensor stored as 8 DCP chunks",
        "runs": {"region": REGION_RUNS, "full": FULL_RUNS},
        "sizes": {"tensor_shape": [N, N], "dtype": "F32", "tensor_bytes": N * N * 4, "chunks": RANKS,
                  "file_bytes": total, "block": [BLOCK, BLOCK], "needed_bytes": needed},
        "chunk_data_offsets": {str(k): v[1] for k, v in offsets.items()},
        "region": cases,
        "full": full,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
