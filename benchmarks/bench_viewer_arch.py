"""Part 3 of bench_viewer: the Architecture view of 20,000 tensors, first loads (cold, with and without the summary
cached on disk) and warm loads, in Debian's chromium driven by Playwright (see bench_viewer's docstring).

    python -m benchmarks.bench_viewer --architecture
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .bench_viewer import NAME, PREFAULT, Server
from .common import drop_caches, fmt_bytes, fmt_s, prefault, require_drop_caches, row, summary, work_dir, write_result

PAGE_RUNS = 5
CACHED_RUNS = 3  # first loads of a viewer started again, each after drop_caches
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
READY = "document.body.dataset.ready === '1'"
# records performance.now() (ms since navigation start) the moment the page marks itself ready
READY_PROBE = """
(() => {
  const mark = () => {
    if (window.__readyAt === undefined && document.body && document.body.dataset.ready === '1') {
      window.__readyAt = performance.now();
    }
  };
  new MutationObserver(mark).observe(document, {subtree: true, attributes: true, attributeFilter: ['data-ready']});
})();
"""


def open_describe(path: Path) -> tuple[float, int]:
    import tensormorph as tm
    from tensormorph.ops.summary import describe

    t0 = time.perf_counter()
    with tm.open(path) as ck:
        described = describe(ck, chunks=False)
    return time.perf_counter() - t0, described["tensor_count"]


# the page's own account of a load: when its modules had run (DOMContentLoaded) and when /summary had arrived
PAGE_TIMES = """() => {
  const summary = performance.getEntriesByType('resource').find((r) => r.name.includes('/summary'));
  return {modules_s: performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd / 1e3,
          summary_start_s: summary ? summary.startTime / 1e3 : null,
          summary_end_s: summary ? summary.responseEnd / 1e3 : null};
}"""


def page_load(browser: Any, base: str, path: str = "/") -> dict[str, Any]:
    """A fresh context's load of the page (`path` another URL: only the time to load it, the browser's own share)."""
    context = browser.new_context(viewport={"width": 1440, "height": 900}, device_scale_factor=1)
    try:
        context.add_init_script(READY_PROBE)
        page = context.new_page()
        page.set_default_timeout(60_000)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        t0 = time.perf_counter()
        page.goto(base + path)
        if path != "/":
            return {"wall_s": time.perf_counter() - t0}
        page.wait_for_function(READY, polling=5)
        wall = time.perf_counter() - t0
        in_page = page.evaluate("window.__readyAt") / 1e3
        rows = page.evaluate("document.querySelectorAll('#tree-list [data-testid=tree-node], "
                             "#tree-list [data-testid=tensor-row]').length")
        error = page.evaluate("document.body.dataset.error || null")
        if errors or error:
            raise AssertionError(f"the page failed: {errors or error}")
        count = page.evaluate("window.tensormorph.state.summaries.a.tensor_count")
        if count != 20_000:
            raise AssertionError(f"the page shows {count} tensors, expected 20,000")
        return {"ready_s": in_page, "wall_s": wall, "rows_rendered": rows, **page.evaluate(PAGE_TIMES)}
    finally:
        context.close()


def cold_start(path: Path, cache: Path) -> tuple[float, Server]:
    """drop_caches, then a viewer started on `path` (seconds create_app took, the server to enter)."""
    from tensormorph.server import create_app

    drop_caches()
    prefault(PREFAULT)
    t0 = time.perf_counter()
    app = create_app([path], cache_dir=cache)
    return time.perf_counter() - t0, Server(app)


def architecture(path: Path, cache: Path) -> dict[str, Any]:
    """Part 3. The first load of a viewer whose caches (tiles in `cache`, summaries beside it: emptied) hold nothing
    yet, its warm loads; then CACHED_RUNS first loads of a viewer started again after drop_caches, finding the
    summary on disk; and the browser's own share: a fresh context loading one small file after drop_caches, and warm."""
    import shutil

    from playwright.sync_api import sync_playwright

    cold_anchor, warm_anchor = [], []
    for _ in range(3):
        drop_caches()
        prefault(PREFAULT)
        t, count = open_describe(path)
        cold_anchor.append(t)
    if count != 20_000:
        raise AssertionError(f"describe lists {count} tensors, expected 20,000")
    for _ in range(3):
        prefault(PREFAULT)
        warm_anchor.append(open_describe(path)[0])

    shutil.rmtree(cache.parent, ignore_errors=True)  # the tiles and the summaries beside them (summary_cache.py)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            server_start, server = cold_start(path, cache)
            with server as base:
                first = page_load(browser, base)
                warm = []
                for _ in range(PAGE_RUNS):
                    prefault(PREFAULT)
                    warm.append(page_load(browser, base))
                import httpx

                summary_times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    response = httpx.get(base + "/api/checkpoints/a/summary", timeout=60)  # asks for gzip
                    summary_times.append(time.perf_counter() - t0)
            cached, cached_start = [], []
            for _ in range(CACHED_RUNS):
                started, server = cold_start(path, cache)
                with server as base:
                    cached.append(page_load(browser, base))
                    cached_start.append(started)
                    drop_caches()
                    prefault(PREFAULT)
                    browser_cold = page_load(browser, base, "/layout.js")["wall_s"]
                    browser_warm = page_load(browser, base, "/layout.js")["wall_s"]
        finally:
            browser.close()
    return {
        "anchor_open_describe_cold_s": summary(cold_anchor), "anchor_open_describe_warm_s": summary(warm_anchor),
        "server_create_app_cold_s": server_start, "first_load": first,
        "warm_ready_s": summary([w["ready_s"] for w in warm]), "warm_wall_s": summary([w["wall_s"] for w in warm]),
        "summary_endpoint_s": summary(summary_times), "summary_json_bytes": len(response.content),
        "summary_wire_bytes": response.num_bytes_downloaded,
        "rows_rendered": warm[-1]["rows_rendered"],
        "first_load_cached_ready_s": summary([c["ready_s"] for c in cached]), "first_load_cached": cached,
        "server_create_app_cached_s": summary(cached_start),
        "browser_file_load_cold_s": browser_cold, "browser_file_load_warm_s": browser_warm, "page_runs": PAGE_RUNS,
    }


def architecture_rows(arch: dict[str, Any]) -> list[dict[str, Any]]:
    """Print part 3 and give its rows of the README table."""
    warm_ready, first = arch["warm_ready_s"]["median"], arch["first_load"]["ready_s"]
    cached = arch["first_load_cached_ready_s"]["median"]
    an_warm, an_cold = arch["anchor_open_describe_warm_s"]["median"], arch["anchor_open_describe_cold_s"]["median"]
    where = arch["first_load_cached"][len(arch["first_load_cached"]) // 2]
    print(f"architecture view (20,000 tensors): first load {fmt_s(cached)} with the summary cached on disk, "
          f"{fmt_s(first)} without (server start {fmt_s(arch['server_create_app_cold_s'])}, cold); "
          f"warm loads median {fmt_s(warm_ready)} (wall {fmt_s(arch['warm_wall_s']['median'])}); "
          f"open+describe warm {fmt_s(an_warm)}, cold {fmt_s(an_cold)}; "
          f"/summary {fmt_s(arch['summary_endpoint_s']['median'])} ({fmt_bytes(arch['summary_json_bytes'])}, "
          f"{fmt_bytes(arch['summary_wire_bytes'])} gzip-ed)")
    print(f"  first load, cached: modules ran at {fmt_s(where['modules_s'])}, /summary asked at "
          f"{fmt_s(where['summary_start_s'])} and in at {fmt_s(where['summary_end_s'])}, ready at "
          f"{fmt_s(where['ready_s'])}; the browser loads one small file in {fmt_s(arch['browser_file_load_cold_s'])}"
          f" cold, {fmt_s(arch['browser_file_load_warm_s'])} warm")
    bench = "viewer: Architecture view of 20,000 tensors (1,000 HF shards), navigation to interactive"
    start = f"server start {fmt_s(arch['server_create_app_cached_s']['median'])} not included"
    return [
        row(bench, "warm server, fresh page loads", tensormorph=fmt_s(warm_ready),
            anchor=f"open + describe (warm): {fmt_s(an_warm)}", ratio=an_warm / warm_ready, target="< 1 s",
            met=warm_ready < 1),
        row(bench, "first load after drop_caches (viewer run before: summary cached on disk)",
            tensormorph=fmt_s(cached), anchor=f"open + describe (cold): {fmt_s(an_cold)}", ratio=an_cold / cached,
            target="< 1 s", met=cached < 1, note=f"median of {CACHED_RUNS}; {start}"),
        row(bench, "first load after drop_caches, first view of these files (nothing cached)",
            tensormorph=fmt_s(first), anchor=f"open + describe (cold): {fmt_s(an_cold)}", ratio=an_cold / first,
            target="< 1 s", met=first < 1,
            note=f"one run; server start {fmt_s(arch['server_create_app_cold_s'])} not included"),
    ]


def main_architecture() -> None:
    """Only part 3, merged into results/viewer.json (the other rows kept as they were)."""
    from .bench_open_metadata import build_hf
    from .common import RESULTS_DIR

    require_drop_caches()
    started = time.perf_counter()
    with work_dir(NAME) as work:
        arch = architecture(build_hf(work / "hf"), work / "viewer-cache" / "tiles")
    rows = architecture_rows(arch)
    previous = json.loads((RESULTS_DIR / f"{NAME}.json").read_text())
    kept = [r for r in previous["rows"] if not r["benchmark"].startswith("viewer: Architecture view")]
    for key in ("name", "command", "timestamp", "machine"):
        previous.pop(key, None)
    write_result(NAME, {**previous, "architecture": arch, "rows": kept + rows,
                        "architecture_total_s": time.perf_counter() - started})
