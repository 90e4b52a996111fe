"""The servers of the remote benchmarks, and obstore against s3fs on the same ranged-read workloads.

Servers (used by bench_remote too): moto's S3 server and a hub-layout HTTP server (tests/remote_support.py; each repo
at revision "main" and at the commit HUB_COMMIT),
behind the CountingProxy, which counts what it sends and adds LATENCY_S to every request. The proxy (and the hub
server) run in a child process, so serving does not share the client's GIL; on this 2-core machine client and
servers still share the cores, so steps also record the client's and the servers' CPU seconds. moto reads a
whole object to answer any ranged GET (O(object) per request, where S3 is O(range)); our moto process patches
that to read only the range.

obstore against s3fs (issue 15 asks to choose the client by the figures), with and without the 20 ms, on the
same moto endpoint and proxy. Two workloads, every byte checked:
  * small: 256 ranged GETs of 64 KiB across 4 objects of 32 MiB (64 per object, 512 KiB apart), all at once;
  * large: one 256 MiB object read in 32 ranges of 8 MiB, all at once.
Clients, each made once and warmed by one request before the timed runs:
  * s3fs `cat_ranges` (what tensormorph's RemoteFiles calls), with aiobotocore's default pool of 10
    connections, and with the pool raised to POOL connections;
  * obstore `get_range` for every range, in THREADS threads (tensormorph's reads are blocking calls in threads);
  * obstore `get_ranges` per object, one thread per object, with coalescing off (it keeps at most 10 requests in
    flight per call; adjacent ranges are still merged into one request).
obstore's async functions are left out: awaited from asyncio, one 8 MiB `get_range_async` took ~0.6 s of CPU here
against ~12 ms for the blocking `get_range` (obstore 0.12.1).
Figures: medians of RUNS runs (the clients interleaved), MB/s of bytes needed, requests per second, client CPU.

    python -m benchmarks.bench_remote_store
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .common import REPO, GiB, KiB, MiB, cpu_seconds, prefault, print_table, row, summary, write_result

NAME = "remote_store"
RUNS = 3
LATENCY_S = 0.020  # added to every request by the proxy: a WAN round trip
PREFAULT = 1 * GiB
BUCKET = "bench"
HUB_COMMIT = "3f2a" * 10  # the hub server serves each repo at "main" and at this commit hash (an immutable revision)
SERVER_TIMEOUT_S = 120  # a server (moto, or the proxy process) that has not answered by then has failed
SMALL_OBJECTS, SMALL_OBJECT_BYTES, SMALL_RANGES, SMALL_RANGE, SMALL_STRIDE = 4, 32 * MiB, 64, 64 * KiB, 512 * KiB
LARGE_BYTES, LARGE_RANGE = 256 * MiB, 8 * MiB
POOL = 64  # connections for the s3fs variant with a raised pool: more than the 32 requests tensormorph sends at once
THREADS = 32  # obstore's blocking calls run in this many threads: tensormorph's MAX_CONCURRENT_REQUESTS

Ranges = list[tuple[str, int, int]]  # (key, begin, end)


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

    fake_key: Any = models.FakeKey  # patched below, so typed loosely
    s3_response: Any = responses.S3Response
    ranged = threading.local()
    whole = fake_key.value

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

    original = s3_response.key_response

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

    fake_key.value = property(value, whole.fset)
    s3_response.key_response = key_response
    server.main(["-H", "127.0.0.1", "-p", str(port)])


def moto_endpoint() -> Any:
    """An S3Endpoint (tests/remote_support.py) whose server is `serve_moto`."""
    s = support()
    endpoint: Any = s.S3Endpoint

    class RangedMoto(endpoint):
        def __enter__(self) -> Any:
            self._port = s.free_port()
            self._log = tempfile.TemporaryFile()
            command = f"from benchmarks.bench_remote_store import serve_moto; serve_moto({self._port})"
            self._process = subprocess.Popen([sys.executable, "-c", command], cwd=REPO, stdout=subprocess.DEVNULL,
                                             stderr=self._log)
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
                hub.add(repo, folder, revision=HUB_COMMIT)
            upstream = hub.url
        proxy = stack.enter_context(s.CountingProxy(upstream))
        conn.send(proxy.url)
        while (message := conn.recv())[0] != "stop":
            command, value = message
            reply: Any = None
            if command == "latency":
                proxy.latency_s = value
            elif command == "reset":
                proxy.reset()
            else:
                records = proxy.requests
                reply = {"requests": len(records), "bytes": sum(r.bytes_sent for r in records),
                         "methods": dict(Counter(r.method for r in records)),
                         "suffixes": dict(Counter(os.path.splitext(r.path)[1] for r in records)),
                         "errors": sum(r.status >= 400 for r in records)}
            conn.send(reply)
        conn.send(None)


class Proxy:
    """A CountingProxy adding `latency_s`, in its own process, in front of `upstream` or of a HubServer serving
    `repos`; `server_pids` are other server processes whose CPU time `stats` adds (moto)."""

    def __init__(self, upstream: str | None = None, repos: dict[str, str] | None = None,
                 latency_s: float = LATENCY_S, server_pids: tuple[int, ...] = ()) -> None:
        self.upstream, self.repos, self.latency_s, self.server_pids = upstream, repos or {}, latency_s, server_pids
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

    def server_cpu(self) -> float:
        """CPU seconds the proxy process and `server_pids` have used so far."""
        import psutil

        times = [psutil.Process(pid).cpu_times() for pid in (self._process.pid, *self.server_pids)]
        return sum(t.user + t.system for t in times)

    def reset(self) -> None:
        self._ask("reset")
        self._cpu = self.server_cpu()

    def stats(self) -> dict[str, Any]:
        """Since the last reset: requests, body bytes sent, requests per method and suffix, error answers, and
        the servers' CPU seconds."""
        return {**self._ask("stats"), "server_cpu_s": round(self.server_cpu() - self._cpu, 3)}


@contextlib.contextmanager
def s3_behind_proxy() -> Iterator[tuple[Any, Proxy, dict[str, Any]]]:
    """(moto endpoint with bucket BUCKET, the proxy before it, s3fs options through the proxy, no shared client)."""
    with moto_endpoint() as s3, Proxy(s3.endpoint, server_pids=(s3._process.pid,)) as proxy:
        s3.make_bucket(BUCKET)
        yield s3, proxy, {**s3.storage_options_via(proxy.url), "skip_instance_cache": True}


def timed(step: Callable[[], Any], proxy: Proxy) -> tuple[float, Any, dict[str, Any]]:
    """(seconds, result, proxy stats with this process's CPU seconds) of one step, after prefaulting."""
    prefault(PREFAULT)
    proxy.reset()
    cpu = cpu_seconds()
    start = time.perf_counter()
    result = step()
    seconds = time.perf_counter() - start
    return seconds, result, {**proxy.stats(), "client_cpu_s": round(cpu_seconds() - cpu, 3)}


# ---------------------------------------------------------------- obstore vs s3fs


def workloads() -> dict[str, tuple[dict[str, bytes], Ranges]]:
    """name -> (objects to upload, ranges to read)."""
    rng = np.random.default_rng(15)
    small = {f"small/{k}.bin": rng.integers(0, 256, SMALL_OBJECT_BYTES, dtype=np.uint8).tobytes()
             for k in range(SMALL_OBJECTS)}
    small_ranges = [(key, k * SMALL_STRIDE, k * SMALL_STRIDE + SMALL_RANGE) for key in small
                    for k in range(SMALL_RANGES)]
    large = {"large.bin": rng.integers(0, 256, LARGE_BYTES, dtype=np.uint8).tobytes()}
    large_ranges = [("large.bin", b, b + LARGE_RANGE) for b in range(0, LARGE_BYTES, LARGE_RANGE)]
    return {"small_64KiB_x256": (small, small_ranges), "large_8MiB_x32": (large, large_ranges)}


def s3fs_reader(options: dict[str, Any], pool: int | None) -> Callable[[Ranges], list[bytes]]:
    import s3fs

    extra = {"config_kwargs": {"max_pool_connections": pool}} if pool else {}
    fs = s3fs.S3FileSystem(**options, **extra)

    def read(ranges: Ranges) -> list[bytes]:
        return list(fs.cat_ranges([f"{BUCKET}/{k}" for k, _, _ in ranges], [b for _, b, _ in ranges],
                                  [e for _, _, e in ranges], batch_size=len(ranges), on_error="raise"))

    return read


def obstore_reader(s3: Any, proxy_url: str, per_range: bool) -> Callable[[Ranges], list[bytes]]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=proxy_url, access_key_id=s3.key, secret_access_key=s3.secret,
                    region=support().S3_REGION, client_options={"allow_http": True})

    def every_range(ranges: Ranges) -> list[bytes]:
        with ThreadPoolExecutor(THREADS) as pool:
            return list(pool.map(lambda r: bytes(obstore.get_range(store, r[0], start=r[1], end=r[2])), ranges))

    def per_object(ranges: Ranges) -> list[bytes]:
        keys = list(dict.fromkeys(k for k, _, _ in ranges))

        def one(key: str) -> list[bytes]:
            group = [(b, e) for k, b, e in ranges if k == key]
            return [bytes(p) for p in obstore.get_ranges(store, key, starts=[b for b, _ in group],
                                                         ends=[e for _, e in group], coalesce=0)]

        with ThreadPoolExecutor(len(keys)) as pool:
            by_key = dict(zip(keys, pool.map(one, keys)))
        return [by_key[k].pop(0) for k, _, _ in ranges]

    return every_range if per_range else per_object


def run_once(read: Callable[[Ranges], list[bytes]], ranges: Ranges, objects: dict[str, bytes],
             proxy: Proxy) -> dict[str, Any]:
    """One timed read of every range: seconds, this process's CPU seconds, the proxy's counts; bytes checked."""
    prefault(PREFAULT)
    proxy.reset()
    cpu = cpu_seconds()
    start = time.perf_counter()
    parts = read(ranges)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    stats = proxy.stats()
    for (key, begin, end), part in zip(ranges, parts):
        if part != objects[key][begin:end]:
            raise AssertionError(f"{key}[{begin}:{end}] came back different")
    return {"seconds": seconds, "client_cpu_s": cpu, "proxy": stats}


def measure(readers: dict[str, Callable[[Ranges], list[bytes]]], ranges: Ranges, objects: dict[str, bytes],
            proxy: Proxy) -> dict[str, Any]:
    """Every reader RUNS times, interleaved (the order rotates each run) so a busy spell hits them alike."""
    names = list(readers)
    for read in readers.values():
        read(ranges[:1])  # connect (and, for s3fs, build the client) before the clock starts
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for k in range(RUNS):
        for name in names[k % len(names):] + names[:k % len(names)]:
            runs[name].append(run_once(readers[name], ranges, objects, proxy))
    needed = sum(e - b for _, b, e in ranges)
    out = {}
    for name, results in runs.items():
        median = summary([r["seconds"] for r in results])["median"]
        requests = results[-1]["proxy"]["requests"]
        out[name] = {"time_s": summary([r["seconds"] for r in results]),
                     "client_cpu_s": summary([r["client_cpu_s"] for r in results]), "needed_bytes": needed,
                     "mb_per_s": needed / median / 1e6, "requests_per_s": requests / median,
                     "proxy": results[-1]["proxy"]}
    return out


def main() -> None:
    cases: dict[str, Any] = {}
    with s3_behind_proxy() as (s3, proxy, options):
        client = s3.client()
        loads = workloads()
        for objects, _ in loads.values():
            for key, data in objects.items():
                client.put_object(Bucket=BUCKET, Key=key, Body=data)
        makers = {"s3fs cat_ranges (pool 10)": lambda: s3fs_reader(options, None),
                   f"s3fs cat_ranges (pool {POOL})": lambda: s3fs_reader(options, POOL),
                   f"obstore get_range, {THREADS} threads": lambda: obstore_reader(s3, proxy.url, per_range=True),
                   "obstore get_ranges per object": lambda: obstore_reader(s3, proxy.url, per_range=False)}
        for latency in (0.0, LATENCY_S):
            proxy.set_latency(latency)
            for load, (objects, ranges) in loads.items():
                key = f"{load}, {latency * 1e3:.0f} ms"
                cases[key] = measure({name: make() for name, make in makers.items()}, ranges, objects, proxy)
                for name, r in cases[key].items():
                    print(f"{key}: {name}: {r['mb_per_s']:.0f} MB/s", flush=True)
    table, rows = [], []
    for key, clients in cases.items():
        best_s3fs = max((c for c in clients if c.startswith("s3fs")), key=lambda c: clients[c]["mb_per_s"])
        best_obstore = max((c for c in clients if c.startswith("obstore")), key=lambda c: clients[c]["mb_per_s"])
        for name, r in clients.items():
            table.append([key, name, f"{r['time_s']['median'] * 1e3:.0f} ms", f"{r['mb_per_s']:.0f}",
                          f"{r['requests_per_s']:.0f}", r["proxy"]["requests"],
                          f"{r['client_cpu_s']['median'] * 1e3:.0f} ms"])
        s, o = clients[best_s3fs], clients[best_obstore]
        ratio = s["time_s"]["median"] / o["time_s"]["median"]
        cpu = [f"{c['client_cpu_s']['median'] * 1e3:.0f} ms" for c in (s, o)]
        rows.append(row("obstore vs s3fs, concurrent ranged GETs on moto", key,
                        tensormorph=f"{best_obstore}: {o['mb_per_s']:.0f} MB/s",
                        anchor=f"{best_s3fs}: {s['mb_per_s']:.0f} MB/s", ratio=ratio,
                        target="choose the faster", met=True,
                        note=f"ratio = s3fs time / obstore time; client CPU {cpu[0]} vs {cpu[1]}"))
    print()
    print_table(["workload", "client", "median", "MB/s", "requests/s", "requests", "client CPU"], table)
    for r in rows:
        print(f"{r['case']}: obstore is {r['ratio']:.2f}x the speed of s3fs (best of each)")
    write_result(NAME, {"title": "obstore vs s3fs: concurrent ranged GETs against moto through the counting proxy",
                        "runs": RUNS, "cases": cases, "rows": rows})


if __name__ == "__main__":
    main()
