"""`tensormorph history` of a run of many large checkpoints: the first run against the cached run, and against
reading every checkpoint once.

The run: `--checkpoints` (50) Tensormorph checkpoints of `--size-mib` (500) MiB each, written by `tm.save` (every
64 KiB block checksummed, as the Checkpointer writes them), LAYERS float32 tensors each, every checkpoint a small
step away from the one before (w_k = base + k·EPS·noise). Each timed step starts with the page cache dropped and
memory prefaulted:
  * anchor: every checkpoint's files read once with plain reads into one reused buffer (the disk's own rate for
    the same bytes, measured in the same run);
  * first run: `history` with an empty cache: every pair read in full (each checkpoint twice, as the later side of
    one pair and the earlier side of the next) with its block checksums checked, the drift summed in float64;
  * cached run: `history` again: the manifests and the quick verify, no tensor data (RUNS_CACHED runs).
Ratios: first run / anchor (what history costs in passes over the disk) and first / cached (what the cache saves).
The full size writes 25 GB; everything is deleted afterwards.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import (
    GiB,
    MiB,
    drop_caches,
    files_under,
    fmt_bytes,
    fmt_s,
    prefault,
    print_table,
    require_drop_caches,
    row,
    summary,
    warm_page_cache,
    work_dir,
    write_result,
)

NAME = "history"
CHECKPOINTS = 50  # the run
SIZE_MIB = 500  # bytes of each checkpoint's tensors
LAYERS = 10  # tensors per checkpoint: model.layers.<i>.weight
EPS = 1e-3  # each checkpoint moves by EPS·noise from the one before
RUNS_CACHED = 3
PREFAULT = 2 * GiB  # two float64 blocks of 64 MiB per thread and the page cache's churn
CACHED_TARGET = 0.05  # the cached run takes at most this share of the first run's time


def write_run(root: Path, checkpoints: int, size: int) -> tuple[float, list[float]]:
    """The run's checkpoints under `root` (ckpt-0001, ...): seconds it took, and each step's expected drift."""
    import torch

    import tensormorph as tm

    rng = np.random.default_rng(0)
    rows = max(1, size // LAYERS // 4 // 1024)
    base = [rng.standard_normal((rows, 1024), dtype=np.float32) for _ in range(LAYERS)]
    noise = [rng.standard_normal((rows, 1024), dtype=np.float32) for _ in range(LAYERS)]
    current = [np.empty_like(b) for b in base]
    started = time.perf_counter()
    expected: list[float] = []
    previous: list[np.ndarray] | None = None
    for k in range(1, checkpoints + 1):
        for b, n, out in zip(base, noise, current, strict=True):
            np.multiply(n, np.float32(k * EPS), out=out)
            out += b
        if previous is not None and k <= 3:  # the first pairs' drift, computed here in float64, checks the result
            delta = sum(float(np.sum((c.astype(np.float64) - p) ** 2)) for c, p in zip(current, previous, strict=True))
            weight = sum(float(np.sum(p ** 2)) for p in previous)
            expected.append(math.sqrt(delta / weight))
        if k <= 2:
            previous = [c.astype(np.float64) for c in current]
        tm.save({"model": {f"layers.{i}.weight": torch.from_numpy(c) for i, c in enumerate(current)}},
                root / f"ckpt-{k:04d}")
        print(f"\rwrote {k}/{checkpoints} checkpoints", end="", flush=True)
    print()
    return time.perf_counter() - started, expected


def timed(fn: Any, runs: int, *, cold: bool) -> tuple[list[float], Any]:
    times, result = [], None
    for _ in range(runs):
        if cold:
            drop_caches()
        prefault(PREFAULT)
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return times, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=int, default=CHECKPOINTS)
    parser.add_argument("--size-mib", type=int, default=SIZE_MIB, help="MiB of tensors per checkpoint")
    parser.add_argument("--runs", type=int, default=1, help="first runs and anchor reads (medians)")
    args = parser.parse_args()
    require_drop_caches()
    from tensormorph.ops.history import history

    with work_dir(NAME) as work:
        root, cache = work / "run", work / "cache"
        root.mkdir()
        write_s, expected = write_run(root, args.checkpoints, args.size_mib * MiB)
        files = files_under(root)
        total = sum(f.stat().st_size for f in files)
        print(f"{args.checkpoints} checkpoints, {fmt_bytes(total)} in all, written in {fmt_s(write_s)}", flush=True)
        anchor, _ = timed(lambda: warm_page_cache(files), args.runs, cold=True)
        print(f"anchor: read every checkpoint once: {fmt_s(min(anchor))}", flush=True)

        def first() -> Any:
            for old in cache.glob("*"):
                old.unlink()
            return history(root, cache_dir=cache)

        first_s, result = timed(first, args.runs, cold=True)
        pairs = args.checkpoints - 1
        assert result.computed == pairs and result.cache_hits == 0, (result.computed, result.cache_hits)
        for got, want in zip((c.total_drift for c in result.checkpoints[1:]), expected, strict=False):
            assert got is not None and abs(got - want) <= 1e-9 * want, (got, want)
        print(f"first run: {fmt_s(min(first_s))}", flush=True)
        cached_s, again = timed(lambda: history(root, cache_dir=cache), RUNS_CACHED, cold=True)
        assert again.cache_hits == pairs and again.computed == 0
        assert [c.drift for c in again.checkpoints] == [c.drift for c in result.checkpoints]
    first_stats, anchor_stats, cached_stats = summary(first_s), summary(anchor), summary(cached_s)
    versus_anchor = first_stats["median"] / anchor_stats["median"]
    speedup = first_stats["median"] / cached_stats["median"]
    read = 2 * total  # every checkpoint but the first and last is read twice
    print_table(["case", "time", "rate", "ratio"], [
        ["read every checkpoint once (anchor)", fmt_s(anchor_stats["median"]),
         f"{fmt_bytes(total / anchor_stats['median'])}/s", "1.00x"],
        ["history, first run", fmt_s(first_stats["median"]), f"{fmt_bytes(total / first_stats['median'])}/s "
         "of checkpoints", f"{versus_anchor:.2f}x the anchor"],
        ["history, cached run", fmt_s(cached_stats["median"]), "", f"first run / cached: {speedup:.0f}x"],
    ])
    size = f"{args.checkpoints} x {args.size_mib} MiB"
    write_result(NAME, {
        "title": f"history of {size} checkpoints: first run, cached run, and reading every checkpoint once",
        "sizes": {"checkpoints": args.checkpoints, "checkpoint_bytes": total // args.checkpoints, "total_bytes": total,
                  "layers": LAYERS, "pairs": pairs, "bytes_read_first_run": read},
        "runs": {"first": args.runs, "anchor": args.runs, "cached": RUNS_CACHED},
        "anchor": {"name": "every checkpoint's files read once, cold (plain reads into one reused buffer)"},
        "write_s": write_s,
        "anchor_s": anchor_stats, "first_run_s": first_stats, "cached_run_s": cached_stats,
        "first_over_anchor": versus_anchor, "first_over_cached": speedup,
        "rows": [
            row("history", f"first run of {size}", tensormorph=fmt_s(first_stats["median"]),
                anchor=f"reading every checkpoint once: {fmt_s(anchor_stats['median'])}", ratio=1 / versus_anchor,
                target="informational", met=True,
                note="every checkpoint but the first and last is read twice, its checksums checked"),
            row("history", f"cached run of {size}", tensormorph=fmt_s(cached_stats["median"]),
                anchor=f"first run: {fmt_s(first_stats['median'])}", ratio=speedup,
                target=f"<= {CACHED_TARGET:.0%} of the first run",
                met=cached_stats["median"] <= CACHED_TARGET * first_stats["median"]),
        ],
    })


if __name__ == "__main__":
    main()
