"""Part 3 of bench_redundancy: on its last rs(4,2) checkpoint, with one data file lost, the rebuild alone, repair(),
verify() and a degraded tm.load, against one cold read of that file and the disk's rate for the rebuild's k inputs
(see bench_redundancy's docstring)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from .bench_redundancy import FLOOR_PIECE, LOST_RANK, PREFAULT, REBUILD_RUNS, TENSORS, K
from .common import drop_caches, prefault


def _timed(step: Any, *, cold: bool, prefault_bytes: int = PREFAULT) -> tuple[float, Any]:
    if not (cold and drop_caches()):
        os.sync()
    prefault(prefault_bytes)
    start = time.perf_counter()
    result = step()
    return time.perf_counter() - start, result


def _read_file(path: Path, into: np.ndarray) -> int:
    view, done = memoryview(into), 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while done < len(view):
            count = os.preadv(fd, [view[done:]], done)
            if count == 0:
                break
            done += count
    finally:
        os.close(fd)
    return done


def _read_files(paths: list[Path]) -> int:
    """The disk's rate for the rebuild's inputs: every file read whole, one thread per file; bytes read."""
    from concurrent.futures import ThreadPoolExecutor

    def one(path: Path) -> int:
        piece, done = memoryview(bytearray(FLOOR_PIECE)), 0
        fd = os.open(path, os.O_RDONLY)
        try:
            while count := os.preadv(fd, [piece], done):
                done += count
        finally:
            os.close(fd)
        return done

    with ThreadPoolExecutor(len(paths)) as pool:
        return sum(pool.map(one, paths))


def _rebuild_to(root: Path, lost: str, out: Path) -> tuple[int, int]:
    """The rebuild alone: recover() the lost file from its stripe into `out`, fsynced; (size, crc32c)."""
    from tensormorph.ops.repair import write_checked
    from tensormorph.storage import LocalFiles
    from tensormorph.tmformat.checkpoint import read_manifest
    from tensormorph.tmformat.recovery import all_files, recover

    files = LocalFiles(root)
    try:
        manifest = read_manifest(files, str(root))
        intact = set(all_files(manifest)) - {lost}
        chunks = recover(manifest, lost, intact, lambda n, b, e: files.read(n, b, e - b))
        Path(out).unlink(missing_ok=True)  # write_checked creates a new file, never one already there
        return write_checked(Path(out), chunks)
    finally:
        files.close()


def bench_rebuild(root: Path, cold: bool) -> dict[str, Any]:
    import crc32c
    import torch

    import tensormorph as tm
    from tensormorph.ops.repair import repair
    from tensormorph.storage import LocalFiles
    from tensormorph.tmformat.checkpoint import read_manifest
    from tensormorph.tmformat.integrity import file_crc32c
    from tensormorph.tmformat.recovery import all_files

    lost = f"rank-{LOST_RANK:05d}.safetensors"
    path = root / lost
    files = LocalFiles(root)
    manifest = read_manifest(files, str(root))
    record = all_files(manifest)[lost]
    files.close()
    assert manifest.redundancy is not None
    stripe_data, stripe_parity = manifest.redundancy.stripes[0]
    inputs = [root / n for n in (*stripe_data, *stripe_parity) if n != lost][:K]  # what the rebuild reads
    side = root.parent / "rebuilt.bin"

    buffer = np.empty(record.size, np.uint8)
    buffer[::4096] = 0
    state = {n: torch.empty(shape, dtype=getattr(torch, dtype)) for n, (shape, dtype) in TENSORS.items()}

    def tensor_crcs() -> list[int]:
        return [crc32c.crc32c(t.reshape(-1).view(torch.uint8).numpy()) for t in state.values()]

    def zero() -> None:
        for t in state.values():
            t.zero_()

    def load() -> dict[str, Any]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = tm.load(root, state)
        return {"bytes_read": report.bytes_read, "warnings": [str(w.message) for w in caught]}

    times: dict[str, list[float]] = {k: [] for k in ("read", "read_k", "load_intact", "load_lost", "rebuild",
                                                       "repair", "verify")}
    notes: dict[str, Any] = {}
    truth: list[int] | None = None
    for _ in range(REBUILD_RUNS):  # each repetition ends with repair() putting the file back
        seconds, n = _timed(lambda: _read_file(path, buffer), cold=cold)
        assert n == record.size and crc32c.crc32c(buffer) == record.crc32c, "anchor read of the data file"
        times["read"].append(seconds)

        seconds, n = _timed(lambda: _read_files(inputs), cold=cold)
        assert n == sum(p.stat().st_size for p in inputs), "floor read of the rebuild's inputs"
        times["read_k"].append(seconds)

        seconds, report = _timed(lambda: tm.verify(root), cold=cold)
        assert report.ok, report.problems
        times["verify"].append(seconds)

        zero()
        seconds, report = _timed(load, cold=cold)
        assert not report["warnings"], report["warnings"]
        truth = truth or tensor_crcs()
        assert tensor_crcs() == truth, "intact load differs from the first intact load"
        times["load_intact"].append(seconds)
        notes.setdefault("load_intact", report)

        path.unlink()
        zero()
        seconds, report = _timed(load, cold=cold)
        assert report["warnings"] and tensor_crcs() == truth, f"load with {lost} lost: {report['warnings']}"
        times["load_lost"].append(seconds)
        notes.setdefault("load_lost", report)

        seconds, (size, value) = _timed(lambda: _rebuild_to(root, lost, side), cold=cold)
        assert (size, value) == (record.size, record.crc32c), "recover() rebuilt other bytes"
        side.unlink()
        times["rebuild"].append(seconds)

        seconds, report = _timed(lambda: repair(root), cold=cold)
        assert report.ok and report.repaired == [lost], report.to_dict()
        check = LocalFiles(root)
        assert file_crc32c(check, lost) == record.crc32c, "repair() wrote other bytes"
        check.close()
        times["repair"].append(seconds)
        notes.setdefault("repair_after_bytes_read", report.after.bytes_read if report.after else None)
    return {"file": lost, "file_bytes": record.size, "times": times, "notes": notes}
