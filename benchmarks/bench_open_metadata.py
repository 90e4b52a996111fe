"""Open a 20,000-tensor checkpoint and list every shape: metadata only.

Targets (issue 17): HF-sharded cold <= 0.6 s (warm < 1 s); DCP <= 0.5x the time of DCP's own read_metadata, cold
and warm (a ratio >= 2). A DCP .metadata of 20,000 tensors (4.7 MB) is read by the native reader
(csrc/dcp_pickle/); `--no-native` times the general path instead (the C unpickler in a limited child process,
formats/dcp_metadata.py), as on a machine where the package was installed without a C compiler, and prints
without writing the results file.

Three checkpoints, all written by the real libraries:
  * HF-sharded safetensors: 1,000 files of 20 small tensors each (safetensors.numpy.save_file)
    plus model.safetensors.index.json;
  * DCP, 2 gloo ranks, each saving 10,000 tensors of its own: 2 .distcp files, 20,000 chunks;
  * with --dtensor also DCP, 4 gloo ranks, 20,000 DTensors Shard(0) on a 1-D mesh (FSDP-like): 4 files,
    80,000 chunks. It is off by default because dcp.save itself needs ~3 minutes to write it here.
Tensormorph: `tensormorph.open(path)` then every tensor's shape. Anchors: `safe_open` over every
file (keys and shapes, after reading the index), and DCP's `FileSystemReader(path).read_metadata()`.
Each is timed cold (after drop_caches) and warm; medians of RUNS runs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import (
    GiB,
    drop_caches,
    fmt_bytes,
    fmt_s,
    init_gloo,
    prefault,
    print_table,
    require_drop_caches,
    row,
    spawn_ranks,
    summary,
    work_dir,
    write_result,
)

NAME = "open_metadata"
RUNS = 3
FILES = 1000
PER_FILE = 20
DCP_TENSORS = 20_000
PREFAULT = 1 * GiB


def build_hf(root: Path) -> Path:
    from safetensors.numpy import save_file

    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    weight_map: dict[str, str] = {}
    total = 0
    kinds = [((16, 8), np.float32), ((32,), np.float16), ((4, 4, 2), np.float32), ((8,), np.int64)]
    for f in range(FILES):
        shard = f"model-{f + 1:05d}-of-{FILES:05d}.safetensors"
        tensors = {}
        for t in range(PER_FILE):
            shape, dtype = kinds[t % len(kinds)]
            name = f"model.layers.{f}.block.{t}.weight"
            tensors[name] = rng.standard_normal(shape).astype(dtype)
            weight_map[name] = shard
            total += tensors[name].nbytes
        save_file(tensors, str(root / shard), metadata={"format": "np"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return root


def _dcp_unique_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    init_gloo(rank, world, port)
    try:
        per_rank = DCP_TENSORS // world
        g = torch.Generator().manual_seed(rank)
        state = {f"model.layers.{rank * per_rank + i}.weight": torch.randn(16, 8, generator=g)
                 for i in range(per_rank)}
        dcp.save(state, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


def _dcp_dtensor_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    init_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(rank)
        rows = 4
        state = {f"model.layers.{i}.weight": DTensor.from_local(torch.randn(rows, 8, generator=g), mesh, [Shard(0)],
                                                                run_check=False)
                 for i in range(DCP_TENSORS)}
        dcp.save(state, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


def _dir_bytes(root: Path) -> tuple[int, int]:
    files = [p for p in root.iterdir() if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def open_tensormorph(path: Path) -> tuple[dict[str, tuple[int, ...]], int]:
    import tensormorph as tm

    ck = tm.open(path)
    shapes = {name: tensor.shape for name, tensor in ck.items()}
    read = ck.header_bytes_read
    ck.close()
    return shapes, read


def open_safe_open(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    index = json.loads((path / "model.safetensors.index.json").read_text())
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in dict.fromkeys(index["weight_map"].values()):
        with safe_open(str(path / shard), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118  safe_open objects are not iterable
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def open_dcp_metadata(path: Path) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    return {name: tuple(entry.size) for name, entry in md.state_dict_metadata.items()}


def measure(fn: Any, path: Path, *, cold: bool) -> tuple[float, Any]:
    if cold:
        drop_caches()
    prefault(PREFAULT)
    start = time.perf_counter()
    value = fn(path)
    return time.perf_counter() - start, value


def bench_case(label: str, path: Path, anchor_name: str, anchor: Any) -> dict[str, Any]:
    files, total_bytes = _dir_bytes(path)
    results: dict[str, Any] = {"files": files, "file_bytes": total_bytes, "anchor": anchor_name}
    for mode in ("cold", "warm"):
        tm_times, anchor_times = [], []
        tm_shapes: dict[str, tuple[int, ...]] = {}
        anchor_shapes: dict[str, tuple[int, ...]] = {}
        header_read = 0
        if mode == "warm":  # fill the page cache once
            open_tensormorph(path)
            anchor(path)
        for _ in range(RUNS):
            t, (tm_shapes, header_read) = measure(open_tensormorph, path, cold=mode == "cold")
            tm_times.append(t)
            t, anchor_shapes = measure(anchor, path, cold=mode == "cold")
            anchor_times.append(t)
        if tm_shapes != anchor_shapes:
            missing = set(anchor_shapes) ^ set(tm_shapes)
            raise AssertionError(f"{label}: tensormorph and {anchor_name} disagree on shapes ({len(missing)} names "
                                 f"differ, e.g. {sorted(missing)[:3]})")
        results[mode] = {"tensormorph_s": summary(tm_times), "anchor_s": summary(anchor_times),
                         "ratio_anchor_over_tm": summary(anchor_times)["median"] / summary(tm_times)["median"]}
        results["tensors"] = len(tm_shapes)
        results["header_bytes_read"] = header_read
    return results


def _target(case: str, mode: str, seconds: float, ratio: float) -> tuple[str, bool]:
    """The target of a row and whether it is met."""
    if case.startswith("dcp"):
        return "<= 0.5x read_metadata (ratio >= 2)", ratio >= 2
    if mode == "cold":
        return "<= 0.6 s", seconds <= 0.6
    return "< 1 s", seconds < 1


def main() -> None:
    require_drop_caches()
    from tensormorph.formats import dcp_metadata

    if "--no-native" in sys.argv[1:]:
        dcp_metadata._dcp_pickle = None  # as if built without a C compiler
    print(f"DCP .metadata reader: {'native' if dcp_metadata._dcp_pickle else 'the general path (child process)'}")
    cases: dict[str, dict[str, Any]] = {}
    with work_dir(NAME) as work:
        t0 = time.perf_counter()
        hf = build_hf(work / "hf")
        print(f"built HF-sharded checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
        cases["hf_sharded_1000_files"] = bench_case("HF-sharded", hf, "safe_open over every file", open_safe_open)

        t0 = time.perf_counter()
        unique = work / "dcp_2ranks"
        spawn_ranks(_dcp_unique_worker, 2, str(unique))
        print(f"built DCP (2 ranks, whole tensors) in {time.perf_counter() - t0:.1f} s", flush=True)
        cases["dcp_2_files"] = bench_case("DCP 2 files", unique, "FileSystemReader.read_metadata", open_dcp_metadata)
        cases["dcp_2_files"]["chunks"] = DCP_TENSORS

        if "--dtensor" in sys.argv[1:]:
            t0 = time.perf_counter()
            sharded = work / "dcp_dtensor"
            spawn_ranks(_dcp_dtensor_worker, 4, str(sharded))
            print(f"built DCP (4 ranks, DTensor Shard(0)) in {time.perf_counter() - t0:.1f} s", flush=True)
            cases["dcp_dtensor_4_ranks"] = bench_case("DCP DTensor", sharded, "FileSystemReader.read_metadata",
                                                      open_dcp_metadata)
            cases["dcp_dtensor_4_ranks"]["chunks"] = 4 * DCP_TENSORS

    labels = {"hf_sharded_1000_files": "HF-sharded, 1,000 files", "dcp_2_files": "DCP, 2 files (2 ranks)",
              "dcp_dtensor_4_ranks": "DCP, 4 ranks DTensor (80k chunks)"}
    table, rows = [], []
    for key, r in cases.items():
        for mode in ("cold", "warm"):
            m = r[mode]
            tm_med, an_med = m["tensormorph_s"]["median"], m["anchor_s"]["median"]
            target, met = _target(key, mode, tm_med, m["ratio_anchor_over_tm"])
            table.append([labels[key], mode, r["files"], r["tensors"], fmt_s(tm_med), fmt_s(an_med),
                          f"{m['ratio_anchor_over_tm']:.2f}x", f"{fmt_bytes(r['header_bytes_read'])} of "
                          f"{fmt_bytes(r['file_bytes'])}", target, "yes" if met else "NO"])
            rows.append(row("open + list shapes (20,000 tensors)", f"{labels[key]}, {mode} cache",
                            tensormorph=fmt_s(tm_med), anchor=f"{r['anchor']}: {fmt_s(an_med)}",
                            ratio=m["ratio_anchor_over_tm"], target=target, met=met))
    print()
    print_table(["checkpoint", "cache", "files", "tensors", "tensormorph", "anchor", "anchor/tm", "bytes read",
                 "target", "met"], table)
    if "--no-native" in sys.argv[1:]:
        print("(--no-native: printed only; the results file keeps the run of the installed reader)")
        return
    write_result(NAME, {
        "title": "Open a 20,000-tensor checkpoint and list every shape",
        "runs": RUNS,
        "dcp_reader": "native" if dcp_metadata._dcp_pickle else "child",
        "sizes": {k: {"files": v["files"], "tensors": v["tensors"], "file_bytes": v["file_bytes"]}
                  for k, v in cases.items()},
        "cases": cases,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
