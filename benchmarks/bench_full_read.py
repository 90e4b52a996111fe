"""Read a whole ~2 GiB checkpoint into memory, cold: Tensormorph vs DCP and vs safetensors.

(a) DCP written by 4 gloo ranks (DTensors Shard(0), Shard(1) and Replicate on a
    1-D mesh). Tensormorph: open + `full(force=True)` of every tensor. Anchor:
    `dcp.load` (no process group) into a state dict preallocated from the metadata.
(b) HF-sharded safetensors: 4 shard files written by safetensors.numpy.save_file plus
    model.safetensors.index.json. Tensormorph: open + `full(force=True)` of every
    tensor. Anchor: `safetensors.numpy.load_file` per shard.
Each side runs in its own fresh process (imports excluded from the clock), after
drop_caches and a prefault, so its peak RSS (VmHWM, reset just before the read)
is its own. Both sides must produce bit-identical tensors (crc32 per tensor, checked on the first run).
Reference: reading the same files with plain os.readv into one reused buffer.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .common import (
    PAGE,
    GiB,
    MiB,
    drop_caches,
    emit,
    fmt_bytes,
    fmt_s,
    init_gloo,
    io_read_bytes,
    prefault,
    print_table,
    proc_status,
    require_drop_caches,
    reset_peak_rss,
    row,
    run_child,
    spawn_ranks,
    summary,
    work_dir,
    write_result,
)

NAME = "full_read"
RUNS = 3
RANKS = 4
PREFAULT = 5 * GiB  # 2 GiB of results + 2 GiB of page cache + transient buffers

DCP_TENSORS = [
    ("model.embed_tokens.weight", (32768, 4096), "Shard(0)"),
    ("model.layers.0.self_attn.weight", (8192, 8192), "Shard(0)"),
    ("model.layers.0.mlp.weight", (8192, 8192), "Shard(1)"),
    ("model.layers.1.self_attn.weight", (8192, 8192), "Shard(0)"),
    ("model.layers.1.mlp.weight", (8192, 8192), "Shard(1)"),
    ("lm_head.weight", (32768, 4096), "Shard(1)"),
    ("model.norm.weight", (4096,), "Replicate()"),
]
HF_SHARDS, HF_PER_SHARD, HF_SHAPE = 4, 8, (4096, 4096)


# ---------------------------------------------------------------- building

def _dcp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state = {}
        for i, (name, shape, placement) in enumerate(DCP_TENSORS):
            local_shape = list(shape)
            if placement.startswith("Shard"):
                dim = int(placement[6])
                local_shape[dim] //= world
                seed, placements = 1000 * i + rank, [Shard(dim)]
            else:
                seed, placements = 1000 * i, [Replicate()]
            local = torch.randn(local_shape, generator=torch.Generator().manual_seed(seed))
            state[name] = DTensor.from_local(local, mesh, placements, run_check=False)
        dcp.save(state, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


def build_hf(root: Path) -> None:
    from safetensors.numpy import save_file

    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for s in range(HF_SHARDS):
        shard = f"model-{s + 1:05d}-of-{HF_SHARDS:05d}.safetensors"
        tensors = {f"model.layers.{s}.w{t}": rng.standard_normal(HF_SHAPE, dtype=np.float32)
                   for t in range(HF_PER_SHARD)}
        save_file(tensors, str(root / shard), metadata={"format": "np"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(a.nbytes for a in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ---------------------------------------------------------------- the sides (each in its own process)

def _touch(arrays: dict[str, np.ndarray]) -> int:
    return sum(int(a.reshape(-1).view(np.uint8)[::PAGE].sum()) for a in arrays.values() if a.size)


def _crcs(arrays: dict[str, np.ndarray]) -> dict[str, int]:
    return {name: zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1)) for name, a in arrays.items()}


def _read_tensormorph(path: Path) -> tuple[dict[str, np.ndarray], Any]:
    import tensormorph as tm

    ck = tm.open(path)
    return {name: tensor.full(force=True) for name, tensor in ck.items()}, ck


def _prepare_dcp_anchor(path: Path) -> Any:
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata()
    state = {name: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
             for name, entry in md.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}

    def load(_path: Path) -> tuple[dict[str, np.ndarray], Any]:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=str(path))
        return {name: t.numpy() for name, t in state.items()}, None

    return load


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], Any]:
    from safetensors.numpy import load_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    out: dict[str, np.ndarray] = {}
    for shard in dict.fromkeys(index["weight_map"].values()):
        out.update(load_file(str(path / shard)))
    return out, None


def _read_plain(path: Path) -> tuple[dict[str, np.ndarray], Any]:
    import os

    buffer = bytearray(64 * MiB)
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        fd = os.open(file, os.O_RDONLY)
        try:
            while os.readv(fd, [buffer]):
                pass
        finally:
            os.close(fd)
    return {}, None


def child(side: str, path: Path, repeat: int, checksum: bool) -> None:
    if side == "dcp-anchor":
        read = _prepare_dcp_anchor(path)  # preallocation is the anchor's setup, not its read
    else:
        read = {"tm": _read_tensormorph, "st-anchor": _read_safetensors, "plain": _read_plain}[side]
        if side == "tm":
            import tensormorph  # noqa: F401  (imports stay off the clock)
        elif side == "st-anchor":
            import safetensors.numpy  # noqa: F401
    results = []
    for _ in range(repeat):  # repeat > 1 only for the plain reader, which holds no results
        drop_caches()
        prefault(PREFAULT)
        reset_peak_rss()
        io0 = io_read_bytes()
        start = time.perf_counter()
        arrays, keep = read(path)
        _touch(arrays)
        elapsed = time.perf_counter() - start
        io = io_read_bytes() - io0
        status = proc_status()
        results.append({"side": side, "time_s": elapsed, "read_bytes": io, "peak_rss": status["VmHWM"],
                        "rss_anon_end": status.get("RssAnon"), "rss_file_end": status.get("RssFile"),
                        "result_bytes": sum(a.nbytes for a in arrays.values()),
                        "crc32": _crcs(arrays) if checksum else None})
        if keep is not None:
            keep.close()
        del arrays, keep
    emit({"runs": results})


# ---------------------------------------------------------------- driver

def compare(label: str, path: Path, anchor_side: str, tensors: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"tm": [], anchor_side: []}
    for k in range(RUNS):
        for side in runs:  # one fresh process per run, so each run's peak RSS is its own
            args = ["--child", side, str(path), "1", "1" if k == 0 else "0"]
            runs[side] += run_child("benchmarks.bench_full_read", args)["runs"]
    runs["plain"] = run_child("benchmarks.bench_full_read", ["--child", "plain", str(path), str(RUNS), "0"])["runs"]
    crcs = {side: [r.pop("crc32") for r in rs] for side, rs in runs.items()}
    reference = crcs["tm"][0]
    if len(reference) != tensors or reference != crcs[anchor_side][0]:
        raise AssertionError(f"{label}: Tensormorph and {anchor_side} read different bytes")
    out: dict[str, Any] = {"tensors": len(reference), "file_bytes": sum(p.stat().st_size for p in path.iterdir()),
                           "identical": True}
    for side, rs in runs.items():
        out[side] = {key: summary([r[key] for r in rs]) for key in ("time_s", "read_bytes", "peak_rss",
                                                                    "rss_anon_end", "rss_file_end")}
        out[side]["result_bytes"] = rs[0]["result_bytes"]
    out["ratio_anchor_over_tm"] = out[anchor_side]["time_s"]["median"] / out["tm"]["time_s"]["median"]
    out["tm_over_disk_time"] = out["tm"]["time_s"]["median"] / out["plain"]["time_s"]["median"]
    return out


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
        return
    require_drop_caches()
    cases: dict[str, dict[str, Any]] = {}
    with work_dir(NAME) as work:
        t0 = time.perf_counter()
        spawn_ranks(_dcp_worker, RANKS, str(work / "dcp"))
        print(f"built {RANKS}-rank DCP checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
        cases["dcp"] = compare("DCP", work / "dcp", "dcp-anchor", len(DCP_TENSORS))
        cases["dcp"]["anchor"] = "dcp.load into a preallocated state dict"
        shutil.rmtree(work / "dcp")  # free the disk before the next build
        t0 = time.perf_counter()
        build_hf(work / "hf")
        print(f"built HF-sharded checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
        cases["hf_sharded"] = compare("HF-sharded", work / "hf", "st-anchor", HF_SHARDS * HF_PER_SHARD)
        cases["hf_sharded"]["anchor"] = "safetensors.numpy.load_file per shard"

    table, rows = [], []
    labels = {"dcp": ("DCP, 4 ranks", "dcp-anchor", "dcp.load"),
              "hf_sharded": ("HF-sharded safetensors, 4 files", "st-anchor", "safetensors load_file")}
    for key, case in cases.items():
        label, anchor_side, anchor_name = labels[key]
        tm_, an, plain = case["tm"], case[anchor_side], case["plain"]
        size = tm_["result_bytes"]
        for who, side in (("tensormorph", tm_), (anchor_name, an), ("plain readv (disk)", plain)):
            t = side["time_s"]["median"]
            table.append([label, who, fmt_s(t), f"{size / t / 1e9:.2f} GB/s", fmt_bytes(side["read_bytes"]["median"]),
                          fmt_bytes(side["peak_rss"]["median"]), fmt_bytes(side["rss_anon_end"]["median"]),
                          fmt_bytes(side["rss_file_end"]["median"])])
        table.append([label, "ratio anchor/tm", f"{case['ratio_anchor_over_tm']:.2f}x", "", "", "", "", ""])
        met = case["ratio_anchor_over_tm"] >= 1.0
        rows.append(row(f"full read, {fmt_bytes(size)} cold", label, tensormorph=fmt_s(tm_["time_s"]["median"]),
                        anchor=f"{anchor_name}: {fmt_s(an['time_s']['median'])}", ratio=case["ratio_anchor_over_tm"],
                        target=">= 1.0x", met=met,
                        note=f"peak RSS {fmt_bytes(tm_['peak_rss']['median'])} vs "
                             f"{fmt_bytes(an['peak_rss']['median'])}; disk alone "
                             f"{fmt_s(plain['time_s']['median'])}"))
    print()
    print_table(["checkpoint", "reader", "time", "rate", "read_bytes", "peak RSS", "anon RSS end", "file RSS end"],
                table)
    write_result(NAME, {
        "title": "Full read of a ~2 GiB checkpoint, cold",
        "runs": RUNS,
        "sizes": {k: {"tensors": v["tensors"], "file_bytes": v["file_bytes"], "result_bytes": v["tm"]["result_bytes"]}
                  for k, v in cases.items()},
        "dcp_tensors": [{"name": n, "shape": list(s), "placement": p} for n, s, p in DCP_TENSORS],
        "cases": cases,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
