"""The 2-D (FSDP2 + tensor parallel) training state: save and load vs DCP, and the 2-D -> 1-D reshard's reads.

State: a Llama (transformers) of ~38 M parameters on 4 gloo ranks, parallelised as
tests/fixtures/placement_builders.py does (parallelize_module colwise/rowwise on tp=2, then fully_shard on dp=2),
after one AdamW step: parameters and both moments, ~450 MB, as get_state_dict gives them. The column-parallel
weights and their moments are `(_StridedShard(0, sf=2), Shard(0))`; intermediate 2050 and vocab 8002 make
their splits uneven.
  save      tm.save vs dcp.save (FileSystemWriter sync_files=True), on the 4 ranks
  load      tm.load vs dcp.load back into the same DTensors (zeroed first), on the 4 ranks
  reshard   the same model under plain FSDP2 on a 1-D mesh loads either checkpoint. On 2 ranks each rank needs
            the rows of its Shard(0) half: whole saved chunks (2 of the 4 of every 2-D tensor). On 3 ranks its
            rows cut the saved chunks (strided ones included) mid-way: DCP reads every overlapping chunk whole
Bytes read are counted by the kernel: the rchar delta of /proc/self/io around a load (every byte through
a read system call, manifest and metadata included). Each step runs once off the clock first (imports);
measured steps follow DESIGN.md (cold page cache when root, prefault, barriers, the slowest rank's time).
Every load is checked: same mesh, each rank's shards against CRC-32C taken before the first save; reshard,
tensormorph's and DCP's loaded shards against each other.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .common import (
    REPO,
    GiB,
    drop_caches,
    fmt_bytes,
    fmt_s,
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

NAME = "placements"
RUNS = 3
SAVE_RANKS = 4  # a (dp=2, tp=2) mesh
RESHARD_RANKS = (2, 3)  # plain FSDP2 on a 1-D mesh of each size
PREFAULT = GiB // 2  # per rank: its ~110 MB of state, DCP's serialised copies of it, and headroom
# hidden 768 (12 heads of 64, 4 kv heads), intermediate and vocab uneven over tp then dp (1025 -> 513/512)
CONFIG = {"hidden_size": 768, "num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 4,
          "vocab_size": 8002, "intermediate_size": 2050, "max_position_embeddings": 64}
SIDES = ("tm", "dcp")


def _builders() -> Any:
    """tests/fixtures/placement_builders.py: the model, its 2-D parallelisation and its training state."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from fixtures import placement_builders

    return placement_builders


def _crcs(tensors: list[Any]) -> list[int]:
    import crc32c
    import torch

    return [crc32c.crc32c(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())) for t in tensors]


def _state(mesh_shape: tuple[int, ...], rank: int) -> tuple[dict[str, Any], list[Any]]:
    """The training state after one AdamW step on this mesh, and every tensor's local part on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    pb = _builders()
    names = pb.MESH_DIM_NAMES if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = pb.parallelize(pb.llama(CONFIG), mesh)
    state = pb.training_state(model, pb.train(model, 1, mesh["dp"].get_local_rank() if names else rank))
    return state, [pb.local(t) for t in pb.flat_tensors(state).values()]


def _io(side: str, action: str, path: Path, state: dict[str, Any], needed: int) -> dict[str, Any]:
    """One save or load by `side`; what it reported, and the bytes this rank read (rchar) for a load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    import tensormorph as tm

    before = io_rchar()
    out: dict[str, Any] = {"bytes_needed": needed}
    if (side, action) == ("tm", "save"):
        out["bytes_written"] = tm.save(state, path).bytes_written
    elif side == "tm":
        report = tm.load(path, state)
        out.update(bytes_needed=report.bytes_needed, bytes_read=report.bytes_read)
    elif action == "save":
        dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=True))
    else:
        dcp.load(state, storage_reader=FileSystemReader(path))
    out["rchar"] = io_rchar() - before
    return out


def _zero(shards: list[Any]) -> None:
    for t in shards:
        t.zero_()


def _save_load_worker(rank: int, world: int, port: int, work: str, cold: bool) -> None:
    import torch.distributed as dist

    pb = _builders()
    pb.init(rank, world, port, timeout_s=600)
    root = Path(work)
    state, shards = _state(pb.MESH, rank)
    truth, needed = _crcs(shards), sum(t.numel() * t.element_size() for t in shards)
    strided = sum(pb.strided(t) for t in pb.flat_tensors(state).values())
    for side in SIDES:  # imports and first-call setup, off the clock
        _io(side, "save", root / f"{side}-warm", state, needed)
        _io(side, "load", root / f"{side}-warm", state, needed)
    dist.barrier()
    if rank == 0:
        for side in SIDES:
            shutil.rmtree(root / f"{side}-warm")
    times: dict[str, list[float]] = {f"{side}_{a}": [] for a in ("save", "load") for side in SIDES}
    reports: dict[str, list[Any]] = {}
    for k in range(RUNS):
        order = SIDES if k % 2 == 0 else SIDES[::-1]
        keep = k == RUNS - 1  # the last run's checkpoints are the reshard's sources
        for action in ("save", "load"):
            for side in order:
                path = root / (side if keep else f"{side}-{k}")
                if action == "load":
                    _zero(shards)
                step = functools.partial(_io, side, action, path, state, needed)
                seconds, results = timed_on_ranks(step, prefault_bytes=PREFAULT, cold=cold)
                times[f"{side}_{action}"].append(seconds)
                reports.setdefault(f"{side}_{action}", results)
                if action == "load" and _crcs(shards) != truth:
                    raise AssertionError(f"rank {rank}: {side}.load (run {k}) did not restore the saved state")
        dist.barrier()
        if rank == 0 and not keep:
            for side in SIDES:
                shutil.rmtree(root / f"{side}-{k}")
    if rank == 0:
        sizes = {side: sum(p.stat().st_size for p in (root / side).rglob("*") if p.is_file()) for side in SIDES}
        (root / "save_load.json").write_text(json.dumps({
            "times": times, "reports": reports, "file_bytes": sizes, "tensors": len(shards),
            "strided_tensors": strided}))
    dist.barrier()
    pb.finish(root, rank, {})


def _reshard_worker(rank: int, world: int, port: int, work: str, cold: bool) -> None:
    import torch.distributed as dist

    pb = _builders()
    pb.init(rank, world, port, timeout_s=600)
    root = Path(work)
    state, shards = _state((world,), rank)
    needed = sum(t.numel() * t.element_size() for t in shards)
    for side in SIDES:  # imports and first-call setup, off the clock and out of the counts
        _io(side, "load", root / side, state, needed)
    reference: list[int] | None = None  # the first load's shards: every later load, by either side, must match
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    counts: dict[str, list[Any]] = {side: [] for side in SIDES}
    for k in range(RUNS):
        for side in SIDES if k % 2 == 0 else SIDES[::-1]:
            _zero(shards)
            step = functools.partial(_io, side, "load", root / side, state, needed)
            seconds, results = timed_on_ranks(step, prefault_bytes=PREFAULT, cold=cold)
            times[side].append(seconds)
            counts[side].append(results)
            reference = reference or _crcs(shards)
            if _crcs(shards) != reference:
                raise AssertionError(f"rank {rank}: {side}.load (run {k}) disagrees with the other loads of the "
                                     f"same state on {world} ranks")
    if rank == 0:
        (root / f"reshard-{world}.json").write_text(json.dumps({"times": times, "counts": counts}))
    dist.barrier()
    pb.finish(root, rank, {})


def _per_rank(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each rank's counts, with the largest rchar any run saw (they barely vary between runs)."""
    out = []
    for rank, first in enumerate(runs[0]):
        rchar = max(run[rank]["rchar"] for run in runs)
        out.append({**first, "rchar": rchar, "rchar_over_needed": rchar / first["bytes_needed"]})
    return out


def _reshard_summary(data: dict[str, Any]) -> dict[str, Any]:
    ranks = {side: _per_rank(data["counts"][side]) for side in SIDES}
    worst = {side: max(ranks[side], key=lambda r: r["rchar_over_needed"]) for side in SIDES}
    return {"load_time_s": {side: summary(data["times"][side]) for side in SIDES}, "per_rank": ranks,
            "worst": {side: {"rank": ranks[side].index(worst[side]), **worst[side]} for side in SIDES},
            "all_ranks_read_over_needed": {side: sum(r["rchar"] for r in ranks[side]) /
                                           sum(r["bytes_needed"] for r in ranks[side]) for side in SIDES}}


def main() -> None:
    if len(sys.argv) > 1:
        sys.exit(f"usage: python -m benchmarks.bench_{NAME}")
    cold = drop_caches()
    if not cold:
        print("WARNING: cannot drop the page cache (not root): the loads are warm", flush=True)
    loads_before, started = load_averages(), time.perf_counter()
    with work_dir(NAME) as work:
        spawn_ranks(_save_load_worker, SAVE_RANKS, str(work), cold)
        saved_s = time.perf_counter() - started
        for world in RESHARD_RANKS:
            spawn_ranks(_reshard_worker, world, str(work), cold)
        first = json.loads((work / "save_load.json").read_text())
        reshards = {world: _reshard_summary(json.loads((work / f"reshard-{world}.json").read_text()))
                    for world in RESHARD_RANKS}
        import tensormorph as tm

        state_bytes = tm.open(work / "tm").nbytes  # logical bytes: a tensor replicated over tp counts once
    wall_s = time.perf_counter() - started

    steps = {label: summary(values) for label, values in first["times"].items()}
    ratios: dict[str, Any] = {"save_time_dcp_over_tm": steps["dcp_save"]["median"] / steps["tm_save"]["median"],
                              "load_time_dcp_over_tm": steps["dcp_load"]["median"] / steps["tm_load"]["median"]}
    for world, r in reshards.items():
        times = r["load_time_s"]
        ratios[f"reshard_{world}_time_dcp_over_tm"] = times["dcp"]["median"] / times["tm"]["median"]
        ratios[f"reshard_{world}_worst_rank_read_over_needed"] = {s: r["worst"][s]["rchar_over_needed"] for s in SIDES}
        ratios[f"reshard_{world}_all_ranks_read_over_needed"] = r["all_ranks_read_over_needed"]

    print()
    print(f"{fmt_bytes(state_bytes)} of FSDP2 + TP training state ({first['tensors']} tensors per rank, "
          f"{first['strided_tensors']} _StridedShard) on a 2x2 mesh, {'cold' if cold else 'WARM'}, medians of {RUNS}")
    timings = {**steps, **{f"{side}_reshard_load_{world}_ranks": r["load_time_s"][side]
                           for world, r in reshards.items() for side in SIDES}}
    print_table(["step", "median", "range"], [[label, fmt_s(s["median"]), f"{fmt_s(s['min'])} - {fmt_s(s['max'])}"]
                                              for label, s in timings.items()])
    for world, r in reshards.items():
        print()
        print(f"reshard 2-D ({SAVE_RANKS} ranks) -> plain FSDP2 on {world} ranks: bytes read per rank")
        print_table(["side", "rank", "needed", "LoadReport.bytes_read", "rchar", "rchar / needed"],
                    [[side, rank, fmt_bytes(c["bytes_needed"]),
                      fmt_bytes(c["bytes_read"]) if "bytes_read" in c else "-", fmt_bytes(c["rchar"]),
                      f"{c['rchar_over_needed']:.3f}x"]
                     for side in SIDES for rank, c in enumerate(r["per_rank"][side])])
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else
              f"{key}: " + ", ".join(f"{side} {v:.3f}" for side, v in value.items()))

    bench = f"2-D FSDP2 + TP state (Llama, AdamW), {fmt_bytes(state_bytes)}, {SAVE_RANKS} ranks (2x2 mesh)"

    def time_row(case: str, ours: dict, theirs: dict, anchor: str, ratio: float, note: str = "") -> dict[str, Any]:
        return row(bench, case, tensormorph=fmt_s(ours["median"]), anchor=f"{anchor}: {fmt_s(theirs['median'])}",
                   ratio=ratio, target=">= 1.0x", met=ratio >= 1.0, note=note)

    def share(r: dict[str, Any], side: str) -> str:
        w = r["worst"][side]
        return (f"{w['rchar_over_needed']:.3f}x (rank {w['rank']}: {fmt_bytes(w['rchar'])} of "
                f"{fmt_bytes(w['bytes_needed'])})")

    rows = [
        time_row("save, slowest rank", steps["tm_save"], steps["dcp_save"], "dcp.save",
                 ratios["save_time_dcp_over_tm"]),
        time_row(f"load on the same mesh, slowest rank, {'cold' if cold else 'warm'}", steps["tm_load"],
                 steps["dcp_load"], "dcp.load", ratios["load_time_dcp_over_tm"]),
    ]
    for world, r in reshards.items():
        rows.append(row(bench, f"reshard to plain FSDP2 on {world} ranks: bytes read / bytes needed, worst rank "
                               "(rchar; ratio = Tensormorph's, lower is better)",
                        tensormorph=share(r, "tm"), anchor=f"dcp.load: {share(r, 'dcp')}",
                        ratio=r["worst"]["tm"]["rchar_over_needed"], target="<= 1.05x",
                        met=r["worst"]["tm"]["rchar_over_needed"] <= 1.05,
                        note=f"all ranks: {r['all_ranks_read_over_needed']['tm']:.3f}x vs "
                             f"{r['all_ranks_read_over_needed']['dcp']:.3f}x; load time dcp/tm "
                             f"{ratios[f'reshard_{world}_time_dcp_over_tm']:.2f}x"))
    write_result(NAME, {
        "title": "2-D (FSDP2 + tensor parallel) training state: save, load and 2-D -> 1-D reshard vs DCP",
        "runs": RUNS,
        "cold_reads": cold,
        "noise": ("shared 2-core VM: other engineers' test runs may overlap this one; "
                  f"load averages {loads_before} before, {load_averages()} after; whole run {wall_s:.0f} s "
                  f"(train, save and load on {SAVE_RANKS} ranks {saved_s:.0f} s)"),
        "prefault_bytes_per_rank": PREFAULT,
        "model": {"config": CONFIG, "parallelism": "parallelize_module (tp=2) + fully_shard (dp=2)",
                  "optimizer": "AdamW, 1 step"},
        "sizes": {"tensors": first["tensors"], "strided_tensors": first["strided_tensors"],
                  "state_bytes": state_bytes, "file_bytes": first["file_bytes"]},
        "save_load_time_s": steps,
        "tm_save_bytes_written": [r["bytes_written"] for r in first["reports"]["tm_save"]],
        "reshard": {str(world): {"mesh": [world], "placements": ["Shard(0)"], **r} for world, r in reshards.items()},
        "ratios": ratios,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
