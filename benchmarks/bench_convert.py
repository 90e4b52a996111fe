"""Convert a ~2 GiB DCP checkpoint to safetensors: Tensormorph vs dcp_to_torch_save + torch.load + save_file.

The source is written by dcp.save from 4 gloo ranks (DTensors Shard(0), Shard(1)
and Replicate on a 1-D mesh, the tensors of bench_full_read). Sides, each in its
own fresh process after drop_caches and a prefault (imports off the clock, VmHWM
reset just before the step, so each peak RSS is its own):
- `tensormorph.convert(src, out, check=True)`: write, then diff the output against the source;
- `tensormorph.convert(src, out, check=False)`: write only;
- anchor: `torch.distributed.checkpoint.format_utils.dcp_to_torch_save(src, tmp.pt)`, then
  `torch.load(tmp.pt)` and `safetensors.torch.save_file(..., out/model.safetensors)`, then an
  fsync of the output (Tensormorph fsyncs what it writes). The intermediate .pt is deleted off the clock.
The outputs of the first run of every side are loaded with safetensors.torch.load_file
and must hold the same names, dtypes, shapes and bit-identical values.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .bench_full_read import DCP_TENSORS, _dcp_worker
from .common import (
    GiB,
    cpu_seconds,
    drop_caches,
    emit,
    files_under,
    fmt_bytes,
    fmt_s,
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

NAME = "convert"
RUNS = 3
RANKS = 4
PREFAULT = 6 * GiB  # the anchor holds the 2 GiB state dict twice over (load, then torch.load) plus buffers
SIDES = ("tm-check", "tm-nocheck", "anchor")
LABELS = {"tm-check": "tensormorph.convert(check=True)", "tm-nocheck": "tensormorph.convert(check=False)",
          "anchor": "dcp_to_torch_save + torch.load + save_file"}


# ---------------------------------------------------------------- the sides (each in its own process)

def _convert_tensormorph(src: Path, out: Path, check: bool) -> dict[str, Any]:
    import tensormorph as tm

    result = tm.convert(src, out, check=check)
    if check and (result.check is None or not result.check.identical):
        raise AssertionError(f"convert's own check failed: {result.check and result.check.counts}")
    return {"tensors": result.tensors, "bytes_written": result.bytes_written,
            "check_counts": result.check.counts if result.check else None}


def _convert_anchor(src: Path, out: Path, scratch: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(src, scratch)
    state = torch.load(scratch)
    out.mkdir()
    target = out / "model.safetensors"
    save_file(state, str(target), metadata={"format": "pt"})
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"tensors": len(state), "bytes_written": target.stat().st_size, "check_counts": None}


def child(side: str, src: Path, out: Path, scratch: Path) -> None:
    if side == "anchor":
        import safetensors.torch  # noqa: F401  (imports stay off the clock)
        import torch.distributed.checkpoint.format_utils  # noqa: F401
    else:
        import tensormorph  # noqa: F401
    drop_caches()
    prefault(PREFAULT)
    reset_peak_rss()
    io0, cpu0 = io_read_bytes(), cpu_seconds()
    start = time.perf_counter()
    if side == "anchor":
        outcome = _convert_anchor(src, out, scratch)
    else:
        outcome = _convert_tensormorph(src, out, check=side == "tm-check")
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    status = proc_status()
    scratch.unlink(missing_ok=True)
    emit({"side": side, "time_s": elapsed, "cpu_s": cpu, "read_bytes": io_read_bytes() - io0,
          "peak_rss": status["VmHWM"], **outcome})


def verify_child(folders: list[Path]) -> None:
    """Every folder holds the same tensors, bit for bit (loaded with the safetensors library)."""
    import torch
    from safetensors.torch import load_file

    def load(folder: Path) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for file in files_under(folder):
            if file.suffix == ".safetensors":
                state.update(load_file(str(file)))
        return state

    reference = load(folders[0])
    for folder in folders[1:]:
        other = load(folder)
        if reference.keys() != other.keys():
            raise AssertionError(f"{folder} names {sorted(other)} vs {sorted(reference)}")
        for name, x in reference.items():
            y = other[name]
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                raise AssertionError(f"{folder}: tensor {name} differs from {folders[0]}")
        del other
    emit({"identical": True, "tensors": len(reference), "bytes": sum(t.nbytes for t in reference.values())})


# ---------------------------------------------------------------- driver

def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--verify":
        verify_child([Path(p) for p in sys.argv[2:]])
        return
    require_drop_caches()
    tensors = DCP_TENSORS
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with work_dir(NAME) as work:
        src = work / "dcp"
        t0 = time.perf_counter()
        spawn_ranks(_dcp_worker, RANKS, str(src))
        print(f"built {RANKS}-rank DCP checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
        source_bytes = sum(p.stat().st_size for p in files_under(src))
        kept: dict[str, Path] = {}
        verified: dict[str, Any] = {}
        for k in range(RUNS):
            for side in SIDES:
                out = work / f"out-{side}-{k}"
                result = run_child("benchmarks.bench_convert",
                                   ["--child", side, str(src), str(out), str(work / "anchor-intermediate.pt")])
                if result["tensors"] != len(tensors):
                    raise AssertionError(f"{side} wrote {result['tensors']} tensors, expected {len(tensors)}")
                result["output_files"] = [p.name for p in files_under(out)]
                runs[side].append(result)
                if k == 0:
                    kept[side] = out
                else:
                    shutil.rmtree(out)
            print(f"  run {k + 1}: " + ", ".join(f"{s} {fmt_s(runs[s][-1]['time_s'])} "
                                                f"{fmt_bytes(runs[s][-1]['peak_rss'])}" for s in SIDES), flush=True)
            if k == 0:
                verified = run_child("benchmarks.bench_convert", ["--verify", *(str(kept[s]) for s in SIDES)])
                for out in kept.values():
                    shutil.rmtree(out)

    out: dict[str, Any] = {}
    for side, rs in runs.items():
        out[side] = {key: summary([r[key] for r in rs]) for key in ("time_s", "cpu_s", "read_bytes", "peak_rss")}
        out[side].update({k: rs[0][k] for k in ("bytes_written", "output_files", "check_counts")})
    anchor = out["anchor"]
    table, rows = [], []
    size = fmt_bytes(verified["bytes"])
    bench = f"convert {size} DCP (4 ranks) to safetensors, cold"
    for side in SIDES:
        s = out[side]
        ratio_t = anchor["time_s"]["median"] / s["time_s"]["median"]
        ratio_m = anchor["peak_rss"]["median"] / s["peak_rss"]["median"]
        s["ratio_time_anchor_over_side"], s["ratio_rss_anchor_over_side"] = ratio_t, ratio_m
        table.append([LABELS[side], fmt_s(s["time_s"]["median"]), fmt_s(s["cpu_s"]["median"]),
                      fmt_bytes(s["read_bytes"]["median"]), fmt_bytes(s["peak_rss"]["median"]),
                      "" if side == "anchor" else f"{ratio_t:.2f}x", "" if side == "anchor" else f"{ratio_m:.1f}x"])
        if side == "anchor":
            continue
        rows.append(row(bench, f"{LABELS[side].removeprefix('tensormorph.')}: time "
                               f"(peak RSS {fmt_bytes(s['peak_rss']['median'])} vs "
                               f"{fmt_bytes(anchor['peak_rss']['median'])})",
                        tensormorph=fmt_s(s["time_s"]["median"]),
                        anchor=f"{LABELS['anchor']}: {fmt_s(anchor['time_s']['median'])}", ratio=ratio_t,
                        target=">= 1.0x", met=ratio_t >= 1.0))
    print()
    print_table(["side", "time", "cpu", "read_bytes", "peak RSS", "anchor/side time", "anchor/side RSS"], table)
    write_result(NAME, {
        "title": f"Convert a {size} DCP checkpoint to safetensors vs dcp_to_torch_save + torch.load + save_file",
        "runs": RUNS,
        "sizes": {"tensors": len(tensors), "source_file_bytes": source_bytes, "tensor_bytes": verified["bytes"]},
        "dcp_tensors": [{"name": n, "shape": list(s), "placement": p} for n, s, p in tensors],
        "outputs_identical": verified["identical"],
        "cases": out,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
