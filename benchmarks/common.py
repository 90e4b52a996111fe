"""Shared helpers for the benchmarks: memory prefaulting, cold caches, I/O and RSS counters, results.

Every timed step follows DESIGN.md's rules for this VM: prefault a few GiB
(idle memory goes back to the host and is slow to touch again), drop the page
cache when the step is meant to read from disk, and quote medians of several
runs next to an anchor measured in the same run.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime
import json
import math
import mmap
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from tensormorph.units import human_bytes

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
WORK_ROOT = BENCH_DIR / ".work"
RESULTS_DIR = BENCH_DIR / "results"
COMMAND = "make bench"
PAGE = mmap.PAGESIZE


# ---------------------------------------------------------------- memory and caches

def prefault(nbytes: int = 3 * GiB) -> float:
    """Touch `nbytes` of fresh memory (one write per page) and free it; returns the seconds it took.

    This VM returns memory idle for ~2 s to its host, and touching such memory
    runs ~10x slower than recycled memory, so every timed step starts with this.
    """
    import time

    start = time.perf_counter()
    block = np.empty(int(nbytes), dtype=np.uint8)
    block[::PAGE] = 1
    del block
    return time.perf_counter() - start


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (needs root); False when not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


def require_drop_caches() -> None:
    if not drop_caches():
        sys.exit("benchmarks need root: cold-cache reads use `echo 3 > /proc/sys/vm/drop_caches`")


def proc_status() -> dict[str, int]:
    """This process's memory counters from /proc/self/status, in bytes (VmHWM = peak RSS)."""
    wanted = {"VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"}
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in wanted:
                out[key] = int(value.split()[0]) * KiB
    return out


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so a step's peak excludes earlier work."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")


def io_read_bytes() -> int:
    """Bytes this process has caused to be fetched from storage (page faults and readahead included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes line")


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_bytes(paths: Sequence[Path]) -> int:
    """Bytes of these files now in the page cache (mincore over a fresh, never-touched mapping)."""
    total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap failed for {path}")
            try:
                pages = (size + PAGE - 1) // PAGE
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore failed for {path}")
                total += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * PAGE
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


def files_under(path: Path) -> list[Path]:
    """Every regular file below `path` (a file itself when `path` is one), sorted."""
    path = Path(path)
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def warm_page_cache(paths: Sequence[Path], chunk: int = 64 * MiB) -> int:
    """Read these files once (plain reads into one reused buffer) so they sit in the page cache; bytes read."""
    buffer = bytearray(chunk)
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buffer]):
                total += n
        finally:
            os.close(fd)
    return total


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (all threads)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- machine and results

def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _read_ahead_kb(path: Path) -> int | None:
    dev = os.stat(path).st_dev
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for candidate in (base / "queue" / "read_ahead_kb", base.parent / "queue" / "read_ahead_kb"):
        try:
            return int(candidate.read_text())
        except (OSError, ValueError):
            continue
    return None


def _git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty-src" if dirty else "")


def machine_info() -> dict[str, Any]:
    """Cores, RAM, kernel, disk readahead and library versions, for every result file."""
    import psutil

    WORK_ROOT.mkdir(parents=True, exist_ok=True)
    return {
        "cpu_count": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": _version("torch"),
        "safetensors": _version("safetensors"),
        "tensormorph": _version("tensormorph"),
        "tensormorph_commit": _git_commit(),
        "work_disk_read_ahead_kb": _read_ahead_kb(WORK_ROOT),
        "page_size": PAGE,
    }


def write_result(name: str, data: dict[str, Any]) -> Path:
    """Write benchmarks/results/<name>.json (machine info and timestamp added)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    record = {"name": name, "command": COMMAND,
              "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), **data}
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path.relative_to(REPO)}")
    return path


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and every run."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def row(benchmark: str, case: str, *, tensormorph: str, anchor: str, ratio: float | None, target: str,
        met: bool, note: str = "") -> dict[str, Any]:
    """One line of the README performance table."""
    return {"benchmark": benchmark, "case": case, "tensormorph": tensormorph, "anchor": anchor,
            "ratio": None if ratio is None else round(ratio, 2), "target": target, "met": bool(met), "note": note}


# ---------------------------------------------------------------- formatting

def fmt_bytes(n: float) -> str:
    return human_bytes(n)


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for k, r in enumerate(cells):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


# ---------------------------------------------------------------- processes

@contextlib.contextmanager
def work_dir(name: str) -> Iterator[Path]:
    """benchmarks/.work/<name>, empty on entry and removed (with its large files) on exit."""
    path = WORK_ROOT / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_child(module: str, args: Sequence[str], *, timeout: float = 600) -> dict[str, Any]:
    """Run `python -m module args...` in a fresh process; its last stdout line is a JSON result."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run fn(rank, world_size, port, *args) on `world_size` spawned processes (gloo rendezvous on `port`)."""
    import torch.multiprocessing as tmp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp.spawn(fn, args=(world_size, free_port(), *args), nprocs=world_size, join=True)


def init_gloo(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def emit(result: dict[str, Any]) -> None:
    """A child's result: one JSON line on stdout (the parent reads the last line)."""
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------- multi-rank steps

def io_rchar() -> int:
    """Bytes this process has passed through read system calls (page-cache hits included, all threads)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (default process group)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def timed_on_ranks(step: Callable[[], Any], *, prefault_bytes: int, cold: bool) -> tuple[float, list[Any]]:
    """Run `step` on every rank at once and time it as the slowest rank saw it.

    Rank 0 drops the page cache when `cold` (it is machine-wide) and flushes dirty pages either way,
    so no step pays for an earlier one's writeback; then every rank prefaults, and barriers fence
    the step on both sides. Returns (max seconds over ranks, every rank's step result).
    """
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0 and not (cold and drop_caches()):
        os.sync()
    dist.barrier()
    prefault(prefault_bytes)
    dist.barrier()
    start = time.perf_counter()
    result = step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    return max(gather(elapsed)), gather(result)


def load_averages() -> list[float]:
    """1, 5 and 15-minute load averages: how busy the shared machine was around a run."""
    return [round(x, 2) for x in os.getloadavg()]


def shard_state(mesh: Any, rank: int, world: int, tensors: dict[str, tuple[tuple[int, ...], str]]) -> dict:
    """DTensors Shard(0) whose local shard (split as torch.chunk splits) is made on this rank only."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    state = {}
    for i, (name, (shape, dtype)) in enumerate(tensors.items()):
        per_rank = -(-shape[0] // world)
        rows = max(0, min(per_rank, shape[0] - rank * per_rank))
        local = torch.randn((rows, *shape[1:]), generator=torch.Generator().manual_seed(1000 * i + rank),
                            dtype=getattr(torch, dtype))
        stride = tuple(math.prod(shape[k + 1:]) for k in range(len(shape)))
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                         stride=stride)
    return state
