"""Remote checkpoints over a simulated WAN: every request passes a counting proxy that adds 20 ms.

Cases, each beside its anchor in the same run (medians of RUNS runs):
  * open_hf: a 1,000-file HF-sharded repo (20 tiny tensors per file) on a hub-like HTTP server; list every
    tensor's shape with `tensormorph.open(index URL)` against huggingface_hub's `get_safetensors_metadata`.
    Target: at least as fast, <= 2 requests per file.
  * region: a 1024x1024 block of a 512 MiB fp32 DCP tensor saved by 4 gloo ranks (DTensor Shard(0), 4 files)
    on S3, against downloading the files it touches with fsspec `get`. Targets: bytes sent / bytes needed
    <= 1.1, and >= 50x faster.
  * cached_open: a second open of the same remote checkpoint from the range cache against opening the local
    files (warm page cache), for the 1,000-file repo (HTTP) and the DCP checkpoint (S3). Target: within 2x.
  * diff: two 256 MiB DCP checkpoints on S3 differing in one tensor; `tensormorph.diff` of the URLs against
    fsspec `get` of both then a local diff, each in its own process for its peak RSS. Targets: faster, and
    peak RSS <= 1/8.

Servers: moto's S3 server and a hub-layout HTTP server (tests/remote_support.py), with the CountingProxy in
front; the proxy (and the hub server) run in a child process so serving never shares the client's GIL.
moto reads a whole object to answer any ranged GET (O(object) per request, where S3 is O(range)); our moto
process patches that to read only the range, so the figures measure the client, not moto.

    python -m benchmarks.bench_remote [--cases open_hf,region,cached_open,diff]
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .common import (
    GiB,
    MiB,
    REPO,
    emit,
    fmt_bytes,
    fmt_s,
    init_gloo,
    load_averages,
    prefault,
    print_table,
    proc_status,
    reset_peak_rss,
    row,
    run_child,
    spawn_ranks,
    summary,
    work_dir,
    write_result,
)

NAME = "remote"
RUNS = 3
LATENCY_S = 0.020  # added to every request by the proxy: a WAN round trip
PREFAULT = 1 * GiB
BUCKET = "bench"
HUB_REPO = "org/model"
CHILD_MODULE = "benchmarks.bench_remote"
SERVER_TIMEOUT_S = 120  # a server (moto, or the proxy process) that has not answered by then has failed
# region: a ROWS x COLS fp32 tensor saved by RANKS ranks (Shard(0)), and a BLOCK x BLOCK read across two chunks
ROWS, COLS, RANKS, BLOCK = 8192, 16384, 4, 1024
REGION_TENSOR = "model.embed.weight"
MULT, MOD = 2654435761, 1 << 24
# diff: DIFF_TENSORS tensors of DIFF_SHAPE fp32 (256 MiB) per checkpoint; DIFF_CHANGED differs in b
DIFF_TENSORS, DIFF_SHAPE, DIFF_CHANGED = 16, (4096, 1024), "layers.7.weight"


# ---------------------------------------------------------------- servers

def support() -> Any:
    """tests/remote_support.py, the real servers of the remote tests."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import remote_support

    return remote_support


def serve_moto(port: int) -> None:
    """moto's S3 server, answering a ranged GET by reading only that range of the object."""
    from moto import server
    from moto.s3 import models, responses

    ranged = threading.local()
    whole = models.FakeKey.value

    class Window:
        """An object's bytes as moto's range code slices them, read a slice at a time."""

        def __init__(self, key: Any) -> None:
            self.key = key

        def __len__(self) -> int:
            return int(self.key.size)

        def __getitem__(self, part: slice) -> bytes:
            with self.key.lock:
                self.key._value_buffer.seek(part.start)
                return bytes(self.key._value_buffer.read(part.stop - part.start))

    def value(key: Any) -> Any:
        return Window(key) if getattr(ranged, "on", False) else whole.fget(key)

    original = responses.S3Response.key_response

    def key_response(self: Any, request: Any, full_url: str, headers: Any) -> Any:
        spec = request.headers.get("range", "")
        ranged.on = request.method == "GET" and spec.startswith("bytes=") and "," not in spec
        try:
            status, out_headers, body = original(self, request, full_url, headers)
        finally:
            ranged.on = False
        if isinstance(body, Window):  # the range was not served after all: send the whole object
            body = body[0:len(body)]
        return status, out_headers, body

    models.FakeKey.value = property(value, whole.fset)
    responses.S3Response.key_response = key_response
    server.main(["-H", "127.0.0.1", "-p", str(port)])


def moto_endpoint() -> Any:
    """An S3Endpoint (tests/remote_support.py) whose server is `serve_moto`."""
    s = support()

    class RangedMoto(s.S3Endpoint):  # type: ignore[misc, name-defined]
        def __enter__(self) -> Any:
            self._port = s.free_port()
            self._log = tempfile.TemporaryFile()
            self._process = subprocess.Popen(
                [sys.executable, "-c", f"from benchmarks.bench_remote import serve_moto; serve_moto({self._port})"],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=self._log)
            if not self._wait_until_answering():
                self._log.seek(0)
                log = self._log.read().decode(errors="replace")[-2000:]
                self.__exit__(None, None, None)
                raise RuntimeError(f"moto did not start:\n{log}")
            return self

    return RangedMoto()


def _serve(conn: Any, upstream: str | None, repos: dict[str, str]) -> None:
    """The proxy process: a CountingProxy (before a HubServer serving `repos` when given), driven over `conn`."""
    s = support()
    with contextlib.ExitStack() as stack:
        if repos:
            hub = stack.enter_context(s.HubServer())
            for repo, folder in repos.items():
                hub.add(repo, folder)
            upstream = hub.url
        proxy = stack.enter_context(s.CountingProxy(upstream))
        conn.send(proxy.url)
        while True:
            command, value = conn.recv()
            reply: Any = None
            if command == "stop":
                break
            if command == "latency":
                proxy.latency_s = value
            elif command == "reset":
                proxy.reset()
            elif command == "stats":
                records = proxy.requests
                reply = {"requests": len(records), "bytes": sum(r.bytes_sent for r in records),
                         "methods": dict(Counter(r.method for r in records)),
                         "suffixes": dict(Counter(os.path.splitext(r.path)[1] for r in records)),
                         "errors": sum(r.status >= 400 for r in records)}
            conn.send(reply)
        conn.send(None)


class Proxy:
    """A CountingProxy with LATENCY_S added, in its own process, in front of `upstream` or of a HubServer."""

    def __init__(self, upstream: str | None = None, repos: dict[str, str] | None = None,
                 latency_s: float = LATENCY_S) -> None:
        self.upstream, self.repos, self.latency_s = upstream, repos or {}, latency_s
        self.url = ""

    def __enter__(self) -> Proxy:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self.upstream, self.repos), daemon=True)
        self._process.start()
        if not self._conn.poll(SERVER_TIMEOUT_S):
            raise RuntimeError("the proxy process did not start")
        self.url = self._conn.recv()
        self.set_latency(self.latency_s)
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError, EOFError):
            self._ask("stop")
        self._process.join(SERVER_TIMEOUT_S)
        if self._process.is_alive():
            self._process.terminate()

    def _ask(self, command: str, value: Any = None) -> Any:
        self._conn.send((command, value))
        return self._conn.recv()

    def set_latency(self, seconds: float) -> None:
        self._ask("latency", seconds)

    def reset(self) -> None:
        self._ask("reset")

    def stats(self) -> dict[str, Any]:
        """Requests, response body bytes, requests per method and error answers since the last reset."""
        return dict(self._ask("stats"))


@contextlib.contextmanager
def s3_behind_proxy() -> Iterator[tuple[Any, Proxy, dict[str, Any]]]:
    """(moto endpoint with bucket BUCKET, proxy in front of it, s3fs storage options that go through the proxy)."""
    with moto_endpoint() as s3, Proxy(s3.endpoint) as proxy:
        s3.make_bucket(BUCKET)
        yield s3, proxy, {**s3.storage_options_via(proxy.url), "skip_instance_cache": True}


def timed(step: Callable[[], Any], proxy: Proxy) -> tuple[float, Any, dict[str, Any]]:
    """(seconds, result, proxy stats) of one step, after prefaulting; the proxy's counts cover the step only."""
    prefault(PREFAULT)
    proxy.reset()
    start = time.perf_counter()
    result = step()
    return time.perf_counter() - start, result, proxy.stats()


# ---------------------------------------------------------------- region

def expected(r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
    """The values the ranks wrote at rows [r0, r1) and columns [c0, c1)."""
    index = np.arange(r0, r1, dtype=np.int64)[:, None] * COLS + np.arange(c0, c1, dtype=np.int64)
    return (index * MULT % MOD).astype(np.float32)


def _region_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    init_gloo(rank, world, port)
    try:
        mesh = init_device_mesh("cpu", (world,))
        rows = ROWS // world
        local = torch.from_numpy(expected(rank * rows, (rank + 1) * rows, 0, COLS))
        dcp.save({REGION_TENSOR: DTensor.from_local(local, mesh, [Shard(0)], run_check=False)}, checkpoint_id=out)
    finally:
        dist.destroy_process_group()


def bench_region(local: Path, url: str, proxy: Proxy, options: dict[str, Any], work: Path) -> dict[str, Any]:
    import s3fs

    import tensormorph as tm

    r0, c0 = 2 * (ROWS // RANKS) - BLOCK // 2, COLS // 2  # rows cross the boundary of chunks 1 and 2
    want = expected(r0, r0 + BLOCK, c0, c0 + BLOCK)
    with tm.open(local) as ck:
        touched = sorted({c.file for c in ck[REGION_TENSOR].chunks
                          if c.offsets[0] < r0 + BLOCK and c.offsets[0] + c.shape[0] > r0} | {".metadata"})
    touched_bytes = sum((local / f).stat().st_size for f in touched)
    tm_open, tm_region, tm_total, anchor = [], [], [], []
    open_stats: dict[str, Any] = {}
    region_stats: dict[str, Any] = {}
    for _ in range(RUNS):
        prefault(PREFAULT)
        proxy.reset()
        start = time.perf_counter()
        ck = tm.open(url, storage_options=options, cache=False)
        opened = time.perf_counter()
        open_stats = proxy.stats()
        proxy.reset()
        block = ck[REGION_TENSOR][r0:r0 + BLOCK, c0:c0 + BLOCK]
        done = time.perf_counter()
        region_stats = proxy.stats()
        ck.close()
        if not np.array_equal(block, want):
            raise AssertionError(f"the block at ({r0}, {c0}) read from {url} differs from the values written")
        tm_open.append(opened - start)
        tm_region.append(done - opened)
        tm_total.append(done - start)

        target = work / "download"
        fs = s3fs.S3FileSystem(**options)
        seconds, _, stats = timed(lambda: fs.get([f"{url[5:]}/{f}" for f in touched], f"{target}/"), proxy)
        got = sum(p.stat().st_size for p in target.iterdir())
        shutil.rmtree(target)
        if got != touched_bytes:
            raise AssertionError(f"fsspec get downloaded {got} bytes, expected {touched_bytes}")
        anchor.append(seconds)
    needed = BLOCK * BLOCK * 4
    return {"tensor_shape": [ROWS, COLS], "chunks": RANKS, "block": [BLOCK, BLOCK], "rows": [r0, r0 + BLOCK],
            "cols": [c0, c0 + BLOCK], "needed_bytes": needed, "files_touched": touched,
            "files_touched_bytes": touched_bytes, "tm_open_s": summary(tm_open), "tm_region_s": summary(tm_region),
            "tm_total_s": summary(tm_total), "anchor_s": summary(anchor), "open_stats": open_stats,
            "region_stats": region_stats, "bytes_over_needed": region_stats["bytes"] / needed,
            "speedup": summary(anchor)["median"] / summary(tm_total)["median"],
            "speedup_region_only": summary(anchor)["median"] / summary(tm_region)["median"]}


# ---------------------------------------------------------------- open and cached open

def tm_shapes(path: str | Path, **options: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, with `tensormorph.open`."""
    import tensormorph as tm

    with tm.open(path, **options) as ck:
        return {name: tuple(tensor.shape) for name, tensor in ck.items()}


def bench_open_hf(repo: Path, files: int, hf_cache: Path) -> dict[str, Any]:
    import huggingface_hub.constants
    from huggingface_hub import HfApi
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    huggingface_hub.constants.HF_HUB_CACHE = str(hf_cache)  # read at each call: the anchor never sees ~/.cache

    def anchor(endpoint: str) -> dict[str, tuple[int, ...]]:
        shutil.rmtree(hf_cache, ignore_errors=True)  # cold, like tensormorph's cache=False: the index is fetched
        metadata = HfApi(endpoint=endpoint).get_safetensors_metadata(HUB_REPO, token=False)
        return {name: tuple(info.shape) for file in metadata.files_metadata.values()
                for name, info in file.tensors.items()}

    tm_times, anchor_times = [], []
    with Proxy(repos={HUB_REPO: str(repo)}) as proxy:
        url = f"{proxy.url}/{HUB_REPO}/resolve/main/model.safetensors.index.json"
        for run in range(RUNS):
            steps = [("tm", lambda: tm_shapes(url, cache=False)), ("anchor", lambda: anchor(proxy.url))]
            for label, step in steps if run % 2 == 0 else steps[::-1]:  # alternate which goes first
                seconds, shapes, stats = timed(step, proxy)
                (tm_times if label == "tm" else anchor_times).append(seconds)
                if label == "tm":
                    tm_shapes_, tm_stats = shapes, stats
                else:
                    anchor_shapes, anchor_stats = shapes, stats
    if tm_shapes_ != anchor_shapes:
        raise AssertionError(f"tensormorph and get_safetensors_metadata disagree on {len(set(tm_shapes_) ^ set(anchor_shapes))} names")
    return {"files": files, "tensors": len(tm_shapes_), "tm_s": summary(tm_times), "anchor_s": summary(anchor_times),
            "tm_stats": tm_stats, "anchor_stats": anchor_stats,
            "tm_requests_per_file": tm_stats["requests"] / files,
            "anchor_requests_per_file": anchor_stats["requests"] / files,
            "ratio": summary(anchor_times)["median"] / summary(tm_times)["median"]}


def bench_cached_open(local: Path, url: str, proxy: Proxy, cache: Path, **options: Any) -> dict[str, Any]:
    """A second open of `url` from the range cache at `cache`, against `tm.open(local)` (page cache warm)."""
    want = tm_shapes(local)
    shutil.rmtree(cache, ignore_errors=True)
    proxy.reset()
    if tm_shapes(url, cache=cache, **options) != want:  # the first open fills the cache
        raise AssertionError(f"{url} and {local} disagree on shapes")
    first = proxy.stats()
    cached_times, local_times = [], []
    stats: dict[str, Any] = {}
    for _ in range(RUNS):
        seconds, shapes, stats = timed(lambda: tm_shapes(url, cache=cache, **options), proxy)
        if shapes != want:
            raise AssertionError(f"{url} from the cache and {local} disagree on shapes")
        cached_times.append(seconds)
        prefault(PREFAULT)
        start = time.perf_counter()
        tm_shapes(local)
        local_times.append(time.perf_counter() - start)
    return {"first_open_stats": first, "cached_stats": stats, "cached_s": summary(cached_times),
            "local_s": summary(local_times),
            "ratio": summary(local_times)["median"] / summary(cached_times)["median"]}


# ---------------------------------------------------------------- diff

def build_diff_pair(a: Path, b: Path) -> None:
    """Two DCP checkpoints of DIFF_TENSORS fp32 tensors (one process, no process group) that differ in one."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(15)
    state = {f"layers.{i}.weight": torch.randn(DIFF_SHAPE, generator=g) for i in range(DIFF_TENSORS)}
    dcp.save(state, checkpoint_id=str(a), no_dist=True)
    state[DIFF_CHANGED] = state[DIFF_CHANGED].clone()
    state[DIFF_CHANGED][::97, ::13] += 1.0
    dcp.save(state, checkpoint_id=str(b), no_dist=True)


def _diff_child(args: dict[str, Any]) -> dict[str, Any]:
    """One diff variant in this process: its wall time, and its peak RSS above the RSS it started from."""
    import s3fs  # noqa: F401  both variants import the same modules before the baseline is taken

    import tensormorph as tm

    options = args["options"]
    prefault(PREFAULT)
    reset_peak_rss()
    baseline = proc_status()["VmRSS"]
    start = time.perf_counter()
    download_s = 0.0
    if args["variant"] == "remote":
        with tm.open(args["a"], storage_options=options, cache=False) as a, \
                tm.open(args["b"], storage_options=options, cache=False) as b:
            report = tm.diff(a, b)
    else:
        import s3fs

        fs = s3fs.S3FileSystem(**options)
        local = Path(args["download_to"])
        for side in ("a", "b"):
            fs.get(args[side][len("s3://"):] + "/", f"{local / side}/", recursive=True)
        download_s = time.perf_counter() - start
        report = tm.diff(local / "a", local / "b")
    seconds = time.perf_counter() - start
    status = proc_status()
    return {"seconds": seconds, "download_s": download_s, "baseline_rss": baseline, "peak_rss": status["VmHWM"],
            "peak_growth": status["VmHWM"] - baseline,
            "differing": sorted(t.name for t in report.tensors if t.status != "equal")}


def bench_diff(urls: tuple[str, str], proxy: Proxy, options: dict[str, Any], work: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"remote": [], "download": []}
    for run in range(RUNS):
        variants = ["remote", "download"] if run % 2 == 0 else ["download", "remote"]
        for variant in variants:
            target = work / "download"
            args = {"variant": variant, "a": urls[0], "b": urls[1], "options": options, "download_to": str(target)}
            proxy.reset()
            result = run_child(CHILD_MODULE, ["--child", json.dumps(args)])
            shutil.rmtree(target, ignore_errors=True)
            if result["differing"] != [DIFF_CHANGED]:
                raise AssertionError(f"{variant} diff found {result['differing']}, expected [{DIFF_CHANGED!r}]")
            runs[variant].append({**result, "proxy": proxy.stats()})
    out: dict[str, Any] = {"tensors": DIFF_TENSORS, "shape": list(DIFF_SHAPE), "changed": DIFF_CHANGED}
    for variant, results in runs.items():
        out[variant] = {key: summary([r[key] for r in results])
                        for key in ("seconds", "download_s", "baseline_rss", "peak_rss", "peak_growth")}
        out[variant]["proxy"] = results[-1]["proxy"]
    med = {v: {k: out[v][k]["median"] for k in ("seconds", "peak_rss", "peak_growth")} for v in runs}
    out["ratio_time"] = med["download"]["seconds"] / med["remote"]["seconds"]
    out["ratio_peak_rss"] = med["download"]["peak_rss"] / med["remote"]["peak_rss"]
    out["ratio_peak_growth"] = med["download"]["peak_growth"] / med["remote"]["peak_growth"]
    return out


# ---------------------------------------------------------------- main

def run_cases(cases: set[str], work: Path) -> dict[str, Any]:
    from .bench_open_metadata import FILES, build_hf

    out: dict[str, Any] = {}
    if cases & {"open_hf", "cached_open"}:
        repo = build_hf(work / "hf")
        if "open_hf" in cases:
            out["open_hf"] = bench_open_hf(repo, FILES, work / "hf-cache")
            print(f"open_hf: {json.dumps(out['open_hf']['ratio'])}", flush=True)
        if "cached_open" in cases:
            with Proxy(repos={HUB_REPO: str(repo)}) as proxy:
                url = f"{proxy.url}/{HUB_REPO}/resolve/main/model.safetensors.index.json"
                out["cached_open"] = {"hf_http": bench_cached_open(repo, url, proxy, work / "cache-hf")}
    if not cases & {"region", "cached_open", "diff"}:
        return out
    with s3_behind_proxy() as (s3, proxy, options):
        if cases & {"region", "cached_open"}:
            local = work / "region"
            spawn_ranks(_region_worker, RANKS, str(local))
            url = f"s3://{BUCKET}/region"
            s3.upload(local, url)
            if "region" in cases:
                out["region"] = bench_region(local, url, proxy, options, work)
            if "cached_open" in cases:
                out["cached_open"]["dcp_s3"] = bench_cached_open(local, url, proxy, work / "cache-dcp",
                                                                 storage_options=options)
            shutil.rmtree(local)
        if "diff" in cases:
            build_diff_pair(work / "a", work / "b")
            urls = f"s3://{BUCKET}/diff-a", f"s3://{BUCKET}/diff-b"
            s3.upload(work / "a", urls[0])
            s3.upload(work / "b", urls[1])
            out["diff"] = bench_diff(urls, proxy, options, work)
    return out


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        emit(_diff_child(json.loads(sys.argv[2])))
        return
    everything = ["open_hf", "region", "cached_open", "diff"]
    cases = set(everything)
    if "--cases" in sys.argv:
        cases = set(sys.argv[sys.argv.index("--cases") + 1].split(","))
        if cases - set(everything):
            sys.exit(f"unknown cases {sorted(cases - set(everything))}; known: {', '.join(everything)}")
    load_before = load_averages()
    with work_dir(NAME) as work:
        results = run_cases(cases, work)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
