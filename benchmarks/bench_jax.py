"""JAX checkpoints: opening and reading Orbax and Flax files with Tensormorph (no JAX) against JAX's own libraries.

Checkpoints, written here by the real libraries (jax on CPU with 4 host devices):
  * Orbax, 2,000 small arrays (StandardCheckpointer, OCDBT): open + list every shape. Anchor: Orbax's own metadata
    read, `StandardCheckpointer().metadata(path)`, which lists the same shapes.
  * Orbax, one ARRAY_BYTES float32 array sharded 2x2 over the mesh: a full read. Anchor: `restore` of the array
    (Orbax's own read, onto the mesh it was saved with); also a 1024x1024 region read, for which Orbax has no
    counterpart but the whole restore.
  * Flax msgpack, `flax.serialization.to_bytes` of one ARRAY_BYTES array: a full read. Anchor: `msgpack_restore`
    of the file's bytes (what `from_bytes` runs).
Each step is timed warm (the files in the page cache, as a second open is) after prefaulting memory; medians of
RUNS runs, with the ratio anchor / Tensormorph (above 1: Tensormorph is faster). Values are checked equal.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .common import (
    GiB,
    MiB,
    files_under,
    fmt_bytes,
    fmt_s,
    prefault,
    print_table,
    row,
    summary,
    warm_page_cache,
    work_dir,
    write_result,
)

NAME = "jax"
RUNS = 3
SMALL_ARRAYS = 2000  # the "Open and list an Orbax checkpoint of 2,000 arrays"
ARRAY_BYTES = 256 * MiB  # one large array; the issue names 1 GiB, smaller here to fit this shared 2-core machine
REGION = 1024  # the side of the region read
PREFAULT = 1 * GiB


def _jax() -> Any:
    """jax on CPU with 4 host devices (set before jax is first imported), for the 2x2 mesh the arrays live on."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    import jax

    return jax


def build(root: Path) -> dict[str, Any]:
    jax = _jax()
    import orbax.checkpoint as ocp
    from flax import serialization
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rng = np.random.default_rng(0)
    small = {f"layer_{i:04d}": {"kernel": rng.standard_normal((16, 8)).astype(np.float32)}
             for i in range(SMALL_ARRAYS)}
    rows = int(ARRAY_BYTES // 4 // 4096)
    big = rng.standard_normal((rows, 4096), dtype=np.float32)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    placed = jax.device_put(big, NamedSharding(mesh, PartitionSpec("data", "model")))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((root / "small").absolute(), small)
    checkpointer.save((root / "big").absolute(), {"w": placed})
    checkpointer.wait_until_finished()
    checkpointer.close()
    (root / "big.msgpack").write_bytes(serialization.to_bytes({"w": big}))
    return {"big": big, "sharding": NamedSharding(mesh, PartitionSpec("data", "model"))}


def timed(fn: Callable[[], Any]) -> tuple[list[float], Any]:
    times, value = [], None
    for _ in range(RUNS):
        prefault(PREFAULT)
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return times, value


def ours_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    import tensormorph as tm

    with tm.open(path) as ck:
        return {name: tensor.shape for name, tensor in ck.items()}


def orbax_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    try:
        tree = checkpointer.metadata(path.absolute())
        tree = getattr(tree, "item_metadata", tree)  # newer Orbax wraps the tree in a StepMetadata
        flat: dict[str, tuple[int, ...]] = {}
        for keys, leaf in _leaves(tree, ()):
            flat[".".join(keys)] = tuple(leaf.shape)
        return flat
    finally:
        checkpointer.close()


def _leaves(tree: Any, prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    if hasattr(tree, "items"):
        return [leaf for key, value in tree.items() for leaf in _leaves(value, (*prefix, str(key)))]
    return [(prefix, tree)]


def ours_read(path: Path, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    import tensormorph as tm

    with tm.open(path) as ck:
        tensor = ck[name]
        return tensor.read(index if index is not None else ..., budget=tensor.nbytes)


def orbax_restore(path: Path, sharding: Any, like: np.ndarray) -> np.ndarray:
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    try:
        target = {"w": jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding)}
        restored = checkpointer.restore(path.absolute(), target)
        return np.asarray(restored["w"])
    finally:
        checkpointer.close()


def flax_restore(path: Path) -> np.ndarray:
    from flax import serialization

    return np.asarray(serialization.msgpack_restore(path.read_bytes())["w"])


def case(label: str, ours: list[float], anchor: list[float], anchor_name: str, nbytes: int) -> dict[str, Any]:
    ratio = summary(anchor)["median"] / summary(ours)["median"]
    print(f"{label}: tensormorph {fmt_s(summary(ours)['median'])}, {anchor_name} {fmt_s(summary(anchor)['median'])} "
          f"({ratio:.2f}x)", flush=True)
    return {"label": label, "anchor": anchor_name, "bytes": nbytes, "tensormorph_s": summary(ours),
            "anchor_s": summary(anchor), "ratio_anchor_over_tm": ratio}


def main() -> None:
    cases: dict[str, dict[str, Any]] = {}
    with work_dir(NAME) as work:
        started = time.perf_counter()
        made = build(work)
        print(f"built the checkpoints in {time.perf_counter() - started:.1f} s", flush=True)
        big = made["big"]
        warm_page_cache(files_under(work))

        ours, shapes = timed(lambda: ours_shapes(work / "small"))
        anchor, theirs = timed(lambda: orbax_shapes(work / "small"))
        assert shapes == theirs and len(shapes) == SMALL_ARRAYS, "the shapes listed differ"
        cases["orbax_open_2000"] = case(f"Orbax, open + list {SMALL_ARRAYS:,} arrays", ours, anchor,
                                        "StandardCheckpointer.metadata", 0)

        ours, value = timed(lambda: ours_read(work / "big", "w"))
        assert value.tobytes() == big.tobytes()
        anchor, restored = timed(lambda: orbax_restore(work / "big", made["sharding"], big))
        assert restored.tobytes() == big.tobytes()
        cases["orbax_full_read"] = case(f"Orbax, full read of {fmt_bytes(big.nbytes)} (2x2 sharded)", ours, anchor,
                                        "StandardCheckpointer.restore", big.nbytes)

        box = (slice(1000, 1000 + REGION), slice(1500, 1500 + REGION))
        ours, value = timed(lambda: ours_read(work / "big", "w", box))
        assert value.tobytes() == np.ascontiguousarray(big[box]).tobytes()
        cases["orbax_region"] = case(f"Orbax, {REGION}x{REGION} region", ours, anchor,
                                     "StandardCheckpointer.restore (whole array)", REGION * REGION * 4)

        ours, value = timed(lambda: ours_read(work / "big.msgpack", "w"))
        assert value.tobytes() == big.tobytes()
        anchor, restored = timed(lambda: flax_restore(work / "big.msgpack"))
        assert restored.tobytes() == big.tobytes()
        cases["flax_full_read"] = case(f"Flax msgpack, full read of {fmt_bytes(big.nbytes)}", ours, anchor,
                                       "serialization.msgpack_restore", big.nbytes)

    table, rows = [], []
    for r in cases.values():
        tm_med, an_med = r["tensormorph_s"]["median"], r["anchor_s"]["median"]
        ratio = r["ratio_anchor_over_tm"]
        table.append([r["label"], fmt_s(tm_med), f"{r['anchor']}: {fmt_s(an_med)}", f"{ratio:.2f}x"])
        rows.append(row("JAX checkpoints", r["label"], tensormorph=fmt_s(tm_med), anchor=f"{r['anchor']}: "
                        f"{fmt_s(an_med)}", ratio=ratio, target="faster than the anchor",
                        met=tm_med < an_med))
    print()
    print_table(["case", "tensormorph", "anchor", "anchor/tm"], table)
    write_result(NAME, {
        "title": "JAX checkpoints: Orbax and Flax read without JAX, against Orbax's and Flax's own reads",
        "runs": RUNS,
        "sizes": {"small_arrays": SMALL_ARRAYS, "array_bytes": int(big.nbytes), "region": [REGION, REGION]},
        "cases": cases,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
