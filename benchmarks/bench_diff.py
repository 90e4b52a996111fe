"""Diff two ~4 GiB checkpoints holding the same weights with different sharding: Tensormorph vs the naive way.

The same 16 fp32 tensors of 16384x4096 (4 GiB; row block j of tensor i is
torch.randn seeded 1000*i + j) are saved twice:
(A) by dcp.save from 4 gloo ranks, each tensor a DTensor Shard(0) on a 1-D mesh
    (4 .distcp files, one 4096-row chunk per rank and tensor);
(B) as an HF-sharded safetensors folder: safetensors.torch.save_file into 4 shard
    files of 4 whole tensors each, plus model.safetensors.index.json.
(B') is B with one tensor perturbed (every 1000th element times 1.001): its shard
    is rewritten, the other three are hard links to B's files.
Tensormorph: `tensormorph.diff(A, B)` (open both included), which must report all
16 tensors equal (and exactly the perturbed tensor "different" against B').
Anchor, the naive way: read A's metadata, dcp.load into a state dict preallocated
from it, safetensors.torch.load_file every shard of B, then torch.equal per tensor
(and (x - y).abs().max() for a tensor that differs). Both sides run in their own
fresh process (imports excluded from the clock) after a prefault, so each peak RSS
(VmHWM, reset just before the step) is its own. "cold" drops the page cache
first; "warm" reads every file of both checkpoints first (unless mincore says they
are all cached). The perturbed variant runs warm: it shows the numeric path's cost,
which is CPU, not disk. Reference: plain reads of both checkpoints, cold.
Targets: anchor time / Tensormorph time >= 1.0 and Tensormorph peak RSS <= 1/8 of the anchor's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .common import (
    GiB,
    cpu_seconds,
    drop_caches,
    emit,
    files_under,
    fmt_bytes,
    fmt_s,
    init_gloo,
    io_read_bytes,
    prefault,
    print_table,
    proc_status,
    require_drop_caches,
    reset_peak_rss,
    resident_bytes,
    row,
    run_child,
    spawn_ranks,
    summary,
    warm_page_cache,
    work_dir,
    write_result,
)

NAME = "diff"
RUNS = 3
RANKS = 4
TENSORS, ROWS, COLS = 16, 16384, 4096
BLOCK_ROWS = ROWS // RANKS  # the unit of deterministic generation, and A's chunk
HF_SHARDS = 4
PERTURBED = 5  # index of the tensor changed in B'
PREFAULT = 5 * GiB  # the anchor holds A's 4 GiB as anonymous memory; the same prefault for both sides
SIDES = ("tm", "naive")


def tensor_name(i: int) -> str:
    return f"model.layers.{i}.mlp.weight"


def _block(i: int, j: int) -> Any:
    import torch

    return torch.randn(BLOCK_ROWS, COLS, generator=torch.Generator().manual_seed(1000 * i + j))


# ---------------------------------------------------------------- building

def _dcp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state = {tensor_name(i): DTensor.from_local(_block(i, rank), mesh, [Shard(0)], run_check=False)
                 for i in range(TENSORS)}
        dcp.save(state, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


def perturb(tensor: Any) -> Any:
    changed = tensor.clone()
    changed.view(-1)[::1000] *= 1.001
    return changed


def build_hf(root: Path, perturbed_root: Path) -> None:
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    perturbed_root.mkdir(parents=True)
    per_shard = TENSORS // HF_SHARDS
    weight_map, total = {}, 0
    for s in range(HF_SHARDS):
        shard = f"model-{s + 1:05d}-of-{HF_SHARDS:05d}.safetensors"
        names = [tensor_name(i) for i in range(s * per_shard, (s + 1) * per_shard)]
        tensors = {name: torch.cat([_block(s * per_shard + k, j) for j in range(RANKS)])
                   for k, name in enumerate(names)}
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
        if tensor_name(PERTURBED) in tensors:
            tensors[tensor_name(PERTURBED)] = perturb(tensors[tensor_name(PERTURBED)])
            save_file(tensors, str(perturbed_root / shard), metadata={"format": "pt"})
        else:
            os.link(root / shard, perturbed_root / shard)
        weight_map.update(dict.fromkeys(names, shard))
        total += sum(t.nbytes for t in tensors.values())
        del tensors
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    for folder in (root, perturbed_root):
        (folder / "model.safetensors.index.json").write_text(index)


# ---------------------------------------------------------------- the sides (each in its own process)

def _diff_tensormorph(a: Path, b: Path) -> dict[str, Any]:
    import tensormorph as tm

    report = tm.diff(a, b)
    changed = report.changed()
    return {"identical": report.identical, "tensors": len(report.tensors), "counts": report.counts,
            "different": sorted(t.name for t in changed), "max_abs": {t.name: t.max_abs for t in changed}}


def _diff_naive(a: Path, b: Path) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(a)).read_metadata()
    state_a = {name: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
               for name, entry in md.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}
    dcp.load(state_a, checkpoint_id=str(a))
    index = json.loads((b / "model.safetensors.index.json").read_text())
    state_b: dict[str, Any] = {}
    for shard in dict.fromkeys(index["weight_map"].values()):
        state_b.update(load_file(str(b / shard)))
    different, max_abs = [], {}
    for name in sorted(state_a.keys() | state_b.keys()):
        x, y = state_a.get(name), state_b.get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            different.append(name)
        elif not torch.equal(x, y):
            different.append(name)
            max_abs[name] = float((x - y).abs().max())
    return {"identical": not different, "tensors": len(state_a.keys() | state_b.keys()),
            "counts": {"different": len(different), "equal": len(state_a.keys() | state_b.keys()) - len(different)},
            "different": different, "max_abs": max_abs}


def disk_child(a: Path, b: Path) -> None:
    """The disk's own rate: plain reads of both checkpoints' files, cold, one run."""
    files = files_under(a) + files_under(b)
    drop_caches()
    start = time.perf_counter()
    nbytes = warm_page_cache(files)
    emit({"time_s": time.perf_counter() - start, "bytes": nbytes})


def child(side: str, a: Path, b: Path, mode: str) -> None:
    if side == "tm":
        import tensormorph  # noqa: F401  (imports stay off the clock)
        run = _diff_tensormorph
    else:
        import safetensors.torch  # noqa: F401
        import torch.distributed.checkpoint  # noqa: F401
        run = _diff_naive
    files = files_under(a) + files_under(b)
    total = sum(p.stat().st_size for p in files)
    if mode == "cold":
        drop_caches()
    elif resident_bytes(files) < total:
        warm_page_cache(files)
    cached = resident_bytes(files) / total
    prefault(PREFAULT)
    reset_peak_rss()
    io0, cpu0 = io_read_bytes(), cpu_seconds()
    start = time.perf_counter()
    outcome = run(a, b)
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    status = proc_status()
    emit({"side": side, "mode": mode, "time_s": elapsed, "cpu_s": cpu, "read_bytes": io_read_bytes() - io0,
          "peak_rss": status["VmHWM"], "cached_fraction_before": cached, **outcome})


# ---------------------------------------------------------------- driver

def _check(case: str, side: str, result: dict[str, Any]) -> None:
    if case == "equal":
        ok = result["identical"] and result["tensors"] == TENSORS and result["different"] == []
        if side == "tm":
            ok = ok and result["counts"] == {"equal": TENSORS}
    else:
        ok = not result["identical"] and result["different"] == [tensor_name(PERTURBED)]
        if side == "tm":
            ok = ok and result["counts"] == {"different": 1, "equal": TENSORS - 1}
    if not ok:
        raise AssertionError(f"{side} diff, {case} case, reported {json.dumps(result)}")


def measure(case: str, a: Path, b: Path, mode: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for _ in range(RUNS):
        for side in SIDES:
            result = run_child("benchmarks.bench_diff", ["--child", side, str(a), str(b), mode])
            _check(case, side, result)
            runs[side].append(result)
        print(f"  {case}/{mode}: " + ", ".join(f"{s} {fmt_s(runs[s][-1]['time_s'])} "
                                               f"{fmt_bytes(runs[s][-1]['peak_rss'])}" for s in SIDES), flush=True)
    out: dict[str, Any] = {}
    for side, rs in runs.items():
        out[side] = {key: summary([r[key] for r in rs])
                     for key in ("time_s", "cpu_s", "read_bytes", "peak_rss", "cached_fraction_before")}
        out[side]["report"] = {k: rs[0][k] for k in ("identical", "counts", "different", "max_abs")}
    out["ratio_time_naive_over_tm"] = out["naive"]["time_s"]["median"] / out["tm"]["time_s"]["median"]
    out["ratio_rss_naive_over_tm"] = out["naive"]["peak_rss"]["median"] / out["tm"]["peak_rss"]["median"]
    return out


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5])
        return
    if len(sys.argv) == 4 and sys.argv[1] == "--disk":
        disk_child(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    require_drop_caches()
    results: dict[str, dict[str, Any]] = {}
    with work_dir(NAME) as work:
        a, b, b_perturbed = work / "dcp", work / "hf", work / "hf-perturbed"
        t0 = time.perf_counter()
        spawn_ranks(_dcp_worker, RANKS, str(a))
        build_hf(b, b_perturbed)
        print(f"built the {RANKS}-rank DCP and HF-sharded checkpoints in {time.perf_counter() - t0:.1f} s", flush=True)
        sizes = {"dcp_file_bytes": sum(p.stat().st_size for p in files_under(a)),
                 "hf_file_bytes": sum(p.stat().st_size for p in files_under(b)),
                 "dcp_files": len(files_under(a)), "hf_files": len(files_under(b)),
                 "tensors": TENSORS, "shape": [ROWS, COLS], "dtype": "F32",
                 "logical_bytes": TENSORS * ROWS * COLS * 4}
        for case, other, mode in (("equal", b, "cold"), ("equal", b, "warm"), ("perturbed", b_perturbed, "warm")):
            results[f"{case}_{mode}"] = measure(case, a, other, mode)
        disk = run_child("benchmarks.bench_diff", ["--disk", str(a), str(b)])

    table, rows = [], []
    size = fmt_bytes(sizes["logical_bytes"])
    bench = f"diff, {size} DCP (4 ranks, Shard(0)) vs HF-sharded (4 files)"
    for key, res in results.items():
        case, mode = key.split("_")
        tm_, nv = res["tm"], res["naive"]
        for who, side in (("tensormorph", tm_), ("naive: dcp.load + load_file + torch.equal", nv)):
            table.append([case, mode, who, fmt_s(side["time_s"]["median"]), fmt_s(side["cpu_s"]["median"]),
                          fmt_bytes(side["read_bytes"]["median"]), fmt_bytes(side["peak_rss"]["median"])])
        table.append([case, mode, "ratio naive/tm", f"{res['ratio_time_naive_over_tm']:.2f}x", "", "",
                      f"{res['ratio_rss_naive_over_tm']:.1f}x"])
        label = "all equal" if case == "equal" else f"1 of {TENSORS} tensors perturbed (numeric path)"
        note = f"disk alone {fmt_s(disk['time_s'])}, one run" if mode == "cold" else ""
        rows.append(row(bench, f"{label}, {mode} cache: time", tensormorph=fmt_s(tm_["time_s"]["median"]),
                        anchor=f"load both + torch.equal: {fmt_s(nv['time_s']['median'])}",
                        ratio=res["ratio_time_naive_over_tm"], target=">= 1.0x",
                        met=res["ratio_time_naive_over_tm"] >= 1.0, note=note))
        rows.append(row(bench, f"{label}, {mode} cache: peak RSS (ratio = anchor RSS / Tensormorph RSS)",
                        tensormorph=fmt_bytes(tm_["peak_rss"]["median"]),
                        anchor=f"load both + torch.equal: {fmt_bytes(nv['peak_rss']['median'])}",
                        ratio=res["ratio_rss_naive_over_tm"], target=">= 8x", met=res["ratio_rss_naive_over_tm"] >= 8))
    table.append(["both checkpoints", "cold", "disk alone (plain reads, one run)", fmt_s(disk["time_s"]), "",
                  fmt_bytes(disk["bytes"]), ""])
    print()
    print_table(["case", "cache", "side", "time", "cpu", "read_bytes", "peak RSS"], table)
    write_result(NAME, {
        "title": f"Diff of two {size} checkpoints with different sharding vs the naive way",
        "runs": RUNS,
        "sizes": sizes,
        "perturbed_tensor": tensor_name(PERTURBED),
        "anchor": "dcp.load into a state dict preallocated from the metadata, safetensors.torch.load_file per "
                  "shard, torch.equal per tensor ((x - y).abs().max() where not equal)",
        "cases": results,
        "disk_alone_cold": disk,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
