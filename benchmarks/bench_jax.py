"""JAX checkpoints: opening, reading and converting Orbax and Flax files with Tensormorph (no JAX) against JAX's own
libraries, the cases the issue names.

Checkpoints, written here by the real libraries (jax on CPU with 4 host devices):
  * Orbax, 2,000 small arrays (StandardCheckpointer, OCDBT): open + list every shape, warm. Anchor: Orbax's own
    metadata read, `StandardCheckpointer().metadata(path)`, which lists the same shapes.
  * Orbax, one ARRAY_BYTES (1 GiB) float32 array sharded 2x2 over the mesh (StandardCheckpointer's defaults: OCDBT,
    zarr v2, one zstd chunk per shard):
      - a full read, warm. Anchor: `restore` of the array onto the mesh it was saved with;
      - a REGION x REGION region, cold (drop_caches before each run): time and bytes read from storage
        (/proc/self/io read_bytes, tensorstore's threads included). Anchor: Orbax's restore of the whole array, the
        only way Orbax reads part of an array, also cold;
      - convert to an HF safetensors folder, cold, each side in its own fresh process (imports off the clock, VmHWM
        reset just before the step, so each peak RSS is its own): `tensormorph.convert(src, out)` with and without
        its check, against "restore with Orbax, then safetensors.numpy.save_file" (fsynced, as convert fsyncs).
        The outputs of the first run are loaded with safetensors and must be bit-identical.
  * Flax msgpack, `flax.serialization.to_bytes` of one ARRAY_BYTES array: a full read, warm. Anchor:
    `msgpack_restore` of the file's bytes (what `from_bytes` runs).
Warm steps run after prefaulting memory, with the files in the page cache; medians of RUNS runs, with the ratio
anchor / Tensormorph (above 1: Tensormorph is faster or smaller). Values are checked equal.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .common import (
    GiB,
    cpu_seconds,
    drop_caches,
    emit,
    files_under,
    fmt_bytes,
    fmt_s,
    io_read_bytes,
    load_averages,
    prefault,
    print_table,
    proc_status,
    require_drop_caches,
    reset_peak_rss,
    row,
    run_child,
    summary,
    warm_page_cache,
    work_dir,
    write_result,
)

NAME = "jax"
RUNS = 3
SMALL_ARRAYS = 2000  # the "Open and list an Orbax checkpoint of 2,000 arrays"
ARRAY_BYTES = 1 * GiB  # the "1 GiB sharded array"
COLUMNS = 4096
REGION = 1024  # the side of the region read
BOX = (slice(1000, 1000 + REGION), slice(1500, 1500 + REGION))
PREFAULT = 3 * GiB  # the anchor's restore holds the array on the devices and once more gathered to the host
CONVERT_SIDES = ("tm-check", "tm-nocheck", "anchor")
CONVERT_LABELS = {"tm-check": "tensormorph.convert(check=True)", "tm-nocheck": "tensormorph.convert(check=False)",
                  "anchor": "Orbax restore + safetensors save_file"}


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
    big = rng.standard_normal((ARRAY_BYTES // 4 // COLUMNS, COLUMNS), dtype=np.float32)
    sharding = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model")),
                             PartitionSpec("data", "model"))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((root / "small").absolute(), small)
    placed = jax.device_put(big, sharding)
    checkpointer.save((root / "big").absolute(), {"w": placed})
    checkpointer.wait_until_finished()
    checkpointer.close()
    del placed
    (root / "big.msgpack").write_bytes(serialization.to_bytes({"w": big}))
    return {"big": big, "sharding": sharding}


def timed(fn: Callable[[], Any]) -> tuple[list[float], Any]:
    """Warm runs: seconds of each, and the last value."""
    times, value = [], None
    for _ in range(RUNS):
        prefault(PREFAULT)
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return times, value


def timed_cold(fn: Callable[[], Any]) -> tuple[list[float], list[int], Any]:
    """Cold runs (page cache dropped first): seconds and bytes read from storage of each, and the last value."""
    times, io, value = [], [], None
    for _ in range(RUNS):
        drop_caches()
        prefault(PREFAULT)
        io0, start = io_read_bytes(), time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
        io.append(io_read_bytes() - io0)
    return times, io, value


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


def chunks_touched(path: Path, name: str, box: tuple[slice, ...]) -> tuple[int, int]:
    """How many of the array's stored chunks `box` overlaps, and the bytes of one chunk."""
    import tensormorph as tm

    with tm.open(path) as ck:
        chunks = ck[name].chunks
        touched = [c for c in chunks if all(o < s.stop and s.start < o + n for o, n, s in zip(c.offsets, c.shape, box))]
        return len(touched), int(np.prod(chunks[0].shape)) * 4


def ours_read(path: Path, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    import tensormorph as tm

    with tm.open(path) as ck:
        tensor = ck[name]
        return tensor.read(index if index is not None else ..., budget=tensor.nbytes)


def orbax_restore(path: Path, sharding: Any = None, like: np.ndarray | None = None) -> np.ndarray:
    """Orbax's restore of array `w`: onto `sharding` when given, else onto the sharding it was saved with."""
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    try:
        if like is None:
            restored = checkpointer.restore(path.absolute())
        else:
            target = {"w": jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=sharding)}
            restored = checkpointer.restore(path.absolute(), target)
        return np.asarray(restored["w"])
    finally:
        checkpointer.close()


def flax_restore(path: Path) -> np.ndarray:
    from flax import serialization

    return np.asarray(serialization.msgpack_restore(path.read_bytes())["w"])


def case(label: str, ours: list[float], anchor: list[float], anchor_name: str, nbytes: int,
         **extra: Any) -> dict[str, Any]:
    ratio = summary(anchor)["median"] / summary(ours)["median"]
    print(f"{label}: tensormorph {fmt_s(summary(ours)['median'])}, {anchor_name} {fmt_s(summary(anchor)['median'])} "
          f"({ratio:.2f}x)", flush=True)
    return {"label": label, "anchor": anchor_name, "bytes": nbytes, "tensormorph_s": summary(ours),
            "anchor_s": summary(anchor), "ratio_anchor_over_tm": ratio, **extra}


# ---------------------------------------------------------------- convert: each side in its own process

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert_child(side: str, src: Path, out: Path) -> None:
    if side == "anchor":
        jax = _jax()
        import orbax.checkpoint  # noqa: F401  (imports and device start-up stay off the clock)
        import safetensors.numpy

        jax.devices()
    else:
        import tensormorph as tm
    drop_caches()
    prefault(PREFAULT)
    reset_peak_rss()
    io0, cpu0, start = io_read_bytes(), cpu_seconds(), time.perf_counter()
    if side == "anchor":
        out.mkdir()
        array = orbax_restore(src)
        safetensors.numpy.save_file({"w": array}, str(out / "model.safetensors"))
        _fsync(out / "model.safetensors")
        tensors = 1
    else:
        result = tm.convert(src, out, check=side == "tm-check")
        if side == "tm-check" and (result.check is None or not result.check.identical):
            raise AssertionError(f"convert's own check failed: {result.check and result.check.counts}")
        tensors = result.tensors
    elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    emit({"side": side, "time_s": elapsed, "cpu_s": cpu, "read_bytes": io_read_bytes() - io0,
          "peak_rss": proc_status()["VmHWM"], "tensors": tensors,
          "bytes_written": sum(p.stat().st_size for p in files_under(out))})


def _same_outputs(folders: list[Path], big: np.ndarray) -> None:
    """Every output folder holds exactly `w`, bit for bit equal to the array saved."""
    import safetensors.numpy

    for folder in folders:
        state: dict[str, np.ndarray] = {}
        for file in files_under(folder):
            if file.suffix == ".safetensors":
                state.update(safetensors.numpy.load_file(str(file)))
        if list(state) != ["w"] or state["w"].dtype != big.dtype or state["w"].tobytes() != big.tobytes():
            raise AssertionError(f"{folder}: {sorted(state)} differs from the array saved")


def convert_runs(work: Path, big: np.ndarray) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in CONVERT_SIDES}
    for k in range(RUNS):
        for side in CONVERT_SIDES:
            out = work / f"out-{side}"
            runs[side].append(run_child("benchmarks.bench_jax", ["--child", side, str(work / "big"), str(out)]))
            if k == 0:
                _same_outputs([out], big)
            shutil.rmtree(out)
        print(f"  convert run {k + 1}: " + ", ".join(f"{s} {fmt_s(runs[s][-1]['time_s'])} "
                                                    f"{fmt_bytes(runs[s][-1]['peak_rss'])}" for s in CONVERT_SIDES),
              flush=True)
    out: dict[str, Any] = {}
    for side, rs in runs.items():
        out[side] = {key: summary([r[key] for r in rs]) for key in ("time_s", "cpu_s", "read_bytes", "peak_rss")}
        out[side]["bytes_written"] = rs[0]["bytes_written"]
    return out


# ---------------------------------------------------------------- driver

def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        convert_child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        return
    require_drop_caches()
    load_before = load_averages()
    cases: dict[str, dict[str, Any]] = {}
    with work_dir(NAME) as work:
        started = time.perf_counter()
        made = build(work)
        print(f"built the checkpoints in {time.perf_counter() - started:.1f} s", flush=True)
        big, sharding = made["big"], made["sharding"]
        warm_page_cache(files_under(work))

        ours, shapes = timed(lambda: ours_shapes(work / "small"))
        anchor, theirs = timed(lambda: orbax_shapes(work / "small"))
        assert shapes == theirs and len(shapes) == SMALL_ARRAYS, "the shapes listed differ"
        cases["orbax_open_2000"] = case(f"Orbax, open + list {SMALL_ARRAYS:,} arrays", ours, anchor,
                                        "StandardCheckpointer.metadata", 0)

        ours, value = timed(lambda: ours_read(work / "big", "w"))
        assert value.tobytes() == big.tobytes()
        anchor, restored = timed(lambda: orbax_restore(work / "big", sharding, big))
        assert restored.tobytes() == big.tobytes()
        del value, restored
        cases["orbax_full_read"] = case(f"Orbax, full read of {fmt_bytes(big.nbytes)} (2x2 sharded), warm", ours,
                                        anchor, "StandardCheckpointer.restore", big.nbytes)

        ours, ours_io, value = timed_cold(lambda: ours_read(work / "big", "w", BOX))
        assert value.tobytes() == np.ascontiguousarray(big[BOX]).tobytes()
        anchor, anchor_io, restored = timed_cold(lambda: orbax_restore(work / "big", sharding, big))
        assert restored[BOX].tobytes() == value.tobytes()
        del restored
        touched, chunk_bytes = chunks_touched(work / "big", "w", BOX)
        cases["orbax_region"] = case(
            f"Orbax, {REGION}x{REGION} region of {fmt_bytes(big.nbytes)} (2x2 sharded), cold", ours, anchor,
            "StandardCheckpointer.restore (whole array)", REGION * REGION * 4,
            tensormorph_read_bytes=summary(ours_io), anchor_read_bytes=summary(anchor_io), chunks_touched=touched,
            chunk_bytes=chunk_bytes)
        print(f"  bytes read: tensormorph {fmt_bytes(summary(ours_io)['median'])}, "
              f"Orbax {fmt_bytes(summary(anchor_io)['median'])}", flush=True)

        ours, value = timed(lambda: ours_read(work / "big.msgpack", "w"))
        assert value.tobytes() == big.tobytes()
        anchor, restored = timed(lambda: flax_restore(work / "big.msgpack"))
        assert restored.tobytes() == big.tobytes()
        del value, restored
        cases["flax_full_read"] = case(f"Flax msgpack, full read of {fmt_bytes(big.nbytes)}, warm", ours, anchor,
                                       "serialization.msgpack_restore", big.nbytes)
        (work / "big.msgpack").unlink()

        convert = convert_runs(work, big)

    table, rows = [], []
    for r in cases.values():
        tm_med, an_med = r["tensormorph_s"]["median"], r["anchor_s"]["median"]
        ratio = r["ratio_anchor_over_tm"]
        table.append([r["label"], fmt_s(tm_med), f"{r['anchor']}: {fmt_s(an_med)}", f"{ratio:.2f}x"])
        rows.append(row("JAX checkpoints", r["label"], tensormorph=fmt_s(tm_med), anchor=f"{r['anchor']}: "
                        f"{fmt_s(an_med)}", ratio=ratio, target="faster than the anchor", met=tm_med < an_med))
    region = cases["orbax_region"]
    ours_io, anchor_io = region["tensormorph_read_bytes"]["median"], region["anchor_read_bytes"]["median"]
    rows.append(row("JAX checkpoints", f"Orbax, {REGION}x{REGION} region, bytes read from storage (cold)",
                    tensormorph=fmt_bytes(ours_io), anchor=f"restore (whole array): {fmt_bytes(anchor_io)}",
                    ratio=anchor_io / max(ours_io, 1), target="fewer bytes than the anchor", met=ours_io < anchor_io,
                    note=f"zarr v2 decodes whole chunks (one per shard, {fmt_bytes(region['chunk_bytes'])}); "
                         f"the region overlaps {region['chunks_touched']} of them"))
    anchor_side = convert["anchor"]
    for side in ("tm-check", "tm-nocheck"):
        s = convert[side]
        rss, anchor_rss = s["peak_rss"]["median"], anchor_side["peak_rss"]["median"]
        s["ratio_rss_anchor_over_side"] = anchor_rss / rss
        s["ratio_time_anchor_over_side"] = anchor_side["time_s"]["median"] / s["time_s"]["median"]
        label = f"convert {fmt_bytes(big.nbytes)} Orbax -> HF safetensors, peak RSS ({CONVERT_LABELS[side]})"
        rows.append(row("JAX checkpoints", label, tensormorph=fmt_bytes(rss),
                        anchor=f"{CONVERT_LABELS['anchor']}: {fmt_bytes(anchor_rss)}", ratio=anchor_rss / rss,
                        target="lower peak RSS than the anchor", met=rss < anchor_rss,
                        note=f"time {fmt_s(s['time_s']['median'])} vs {fmt_s(anchor_side['time_s']['median'])}"))
    for side in CONVERT_SIDES:
        s = convert[side]
        table.append([f"convert, {CONVERT_LABELS[side]}", fmt_s(s["time_s"]["median"]),
                      f"peak RSS {fmt_bytes(s['peak_rss']['median'])}, read {fmt_bytes(s['read_bytes']['median'])}",
                      ""])
    print()
    print_table(["case", "tensormorph", "anchor", "anchor/tm"], table)
    write_result(NAME, {
        "title": "JAX checkpoints: Orbax and Flax read and converted without JAX, against Orbax's and Flax's own",
        "runs": RUNS,
        "load_average_before": load_before,
        "load_average_after": load_averages(),
        "sizes": {"small_arrays": SMALL_ARRAYS, "array_bytes": int(big.nbytes), "array_shape": list(big.shape),
                  "region": [REGION, REGION]},
        "cases": {**cases, "orbax_convert": convert},
        "rows": rows,
    })


if __name__ == "__main__":
    main()
