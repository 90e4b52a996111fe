"""Check that 100,000 chunks tile their tensor: target < 1 s.

Cases (medians of RUNS runs, memory prefaulted before each timed step), each 100,000 chunks or about:
  * a grid of 1000 x 100 boxes (Shard on two mesh dimensions);
  * a 1-D split into 100,000 pieces (a flat tensor over 100,000 ranks);
  * ZeRO-style flat ranges of a 3-D tensor over 40,000 ranks, each cut into boxes at row edges (not a grid);
  * the grid with one box moved onto its neighbour (an overlap), and with one box removed (a gap).
Anchor: merely sorting the chunks' offsets (`sorted(c.offsets for c in chunks)`), timed in the same run: a
lower bound for any check that orders the chunks. The ratio is the sort's time over validate_tiling's, as in
every row of the README table (higher is better). Before issue 14 the check compared pairs: 2,500 chunks took
4.9 s, 10,000 over 60 s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from .common import MiB, fmt_s, prefault, print_table, row, summary, write_result

NAME = "tiling"
RUNS = 5
PREFAULT = 256 * MiB
TARGET_S = 1.0


def timed(fn: Callable[[], Any]) -> list[float]:
    times = []
    for _ in range(RUNS):
        prefault(PREFAULT)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def layouts() -> dict[str, tuple[str, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]], str]]:
    """key -> (label, tensor shape, boxes, expected outcome: 'ok', 'overlap' or 'missing')."""
    from tensormorph.geometry import flat_boxes

    grid = [((4 * i, 5 * j), (4, 5)) for i in range(1000) for j in range(100)]
    moved = grid[:50_050] + [((4 * 500, 5 * 50 + 1), (4, 5))] + grid[50_051:]
    zero_shape, ranks = (211, 101, 1009), 40_000
    cuts = [math.prod(zero_shape) * r // ranks for r in range(ranks + 1)]
    zero = [(o, s) for r in range(ranks) for o, s, _ in flat_boxes(zero_shape, cuts[r], cuts[r + 1])]
    return {
        "grid": ("grid 1000 x 100", (4000, 500), grid, "ok"),
        "split": ("1-D split into 100,000", (300_000,), [((3 * i,), (3,)) for i in range(100_000)], "ok"),
        "zero": (f"ZeRO flat ranges of {zero_shape} over {ranks:,} ranks", zero_shape, zero, "ok"),
        "overlap": ("grid 1000 x 100, one box overlapping", (4000, 500), moved, "overlap"),
        "gap": ("grid 1000 x 100, one box missing", (4000, 500), grid[:50_050] + grid[50_051:], "missing"),
    }


def main() -> None:
    from tensormorph.core import Chunk
    from tensormorph.errors import ChunkLayoutError
    from tensormorph.tiling import LayoutOnly, validate_tiling

    source = LayoutOnly()
    cases: dict[str, dict[str, Any]] = {}
    table, rows = [], []
    for key, (label, shape, boxes, expected) in layouts().items():
        chunks = [Chunk(o, s, f"rank-{i:06d}", None, source, (i,)) for i, (o, s) in enumerate(boxes)]

        def check(chunks: list[Chunk] = chunks, shape: tuple[int, ...] = shape) -> str:
            try:
                validate_tiling("w", shape, chunks)
            except ChunkLayoutError as exc:
                return "overlap" if "overlap" in exc.reason else "missing"
            return "ok"

        outcome = check()
        assert outcome == expected, (key, outcome)
        ours = summary(timed(check))
        anchor = summary(timed(lambda chunks=chunks: sorted(c.offsets for c in chunks)))
        ratio = anchor["median"] / ours["median"]
        cases[key] = {"label": label, "chunks": len(chunks), "shape": list(shape), "outcome": outcome,
                      "tensormorph_s": ours, "anchor_sort_s": anchor, "ratio_to_sort": ratio}
        print(f"{label}: {len(chunks):,} chunks, {outcome}, {fmt_s(ours['median'])} "
              f"(sorting the offsets: {fmt_s(anchor['median'])}, {ratio:.3f}x)", flush=True)
        met = ours["median"] < TARGET_S
        table.append([label, f"{len(chunks):,}", outcome, fmt_s(ours["median"]), fmt_s(anchor["median"]),
                      f"{ratio:.3f}x", "yes" if met else "NO"])
        rows.append(row("validate that ~100,000 chunks tile a tensor", label, tensormorph=fmt_s(ours["median"]),
                        anchor=f"sorting the chunk offsets: {fmt_s(anchor['median'])}", ratio=ratio,
                        target=f"< {TARGET_S:g} s", met=met))
    print()
    print_table(["case", "chunks", "outcome", "validate_tiling", "sort offsets", "sort/validate", "< 1 s"], table)
    write_result(NAME, {
        "title": "Validate that 100,000 chunks tile a tensor",
        "runs": RUNS,
        "sizes": {key: case["chunks"] for key, case in cases.items()},
        "anchor": {"name": "sorted(c.offsets for c in chunks): a lower bound for any check that orders them"},
        "cases": cases,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
