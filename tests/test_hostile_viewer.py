"""The viewer against hostile pages and requests (issue 14: defects 2, 8, 9's token, 12).

- DNS rebinding: a page on evil.example that resolves its name to 127.0.0.1 sends `Host: evil.example`;
  every route refuses it, while the names of this machine are served.
- Beyond loopback the token guards the page too; a non-ASCII token is a wrong token, not a crash.
- config.json is read like every file of the folder: a link out of it is not followed.
- Heavy requests run a bounded number at a time: 50 simultaneous large tiles keep the server's memory bounded.
- The disk tile cache stays under its byte cap, dropping the least recently used tiles.
- The viewer's server is in the base install; a missing optional package is named in one line, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import httpx
import numpy as np
import pytest
import safetensors.numpy
import test_server
import tomllib
from click.testing import CliRunner
from starlette.testclient import TestClient
from test_server import ok_json, ok_tile

import tensormorph.cli.viewer as viewer_cli
from tensormorph.cli import main
from tensormorph.server import create_app
from tensormorph.server_guard import HEAVY_REQUESTS_AT_ONCE, parse_host
from tensormorph.tile_cache import DISK_CACHE_SLACK, TileCache

pytestmark = pytest.mark.timeout(120)
small_ckpt = test_server.small_ckpt  # the fixture: one safetensors file with w (12 × 10) and v

ROOT = Path(__file__).resolve().parent.parent
ROUTES = ["/", "/index.html", "/app.js", "/style.css", "/api/checkpoints", "/api/checkpoints/a/summary",
          "/api/checkpoints/a/tensor?name=w", "/api/checkpoints/a/tile?name=w", "/api/checkpoints/a/stats?name=w",
          "/api/openapi.json"]
FOREIGN_HOSTS = ["evil.example", "evil.example:8123", "127.0.0.1.evil.example", "localhost.evil.example:8123",
                 "[::1].evil.example", "", "localhost:http", "[::1", "::1"]
LOCAL_HOSTS = ["localhost:8123", "127.0.0.1:8123", "[::1]:8123", "LOCALHOST:8123", "127.0.0.1", "localhost"]


def raw_status(app, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    """The status of one GET sent straight to the ASGI app: a request without any Host header, which no HTTP
    client sends."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8123)}
    # in a thread of its own: a test before this one (playwright's sync API) may leave a loop running in this one
    worker = threading.Thread(target=anyio.run, args=(app, scope, receive, send))
    worker.start()
    worker.join(timeout=30)
    return sent[0]["status"]


# ---------------------------------------------------------------------------
# DNS rebinding and cross-origin requests
# ---------------------------------------------------------------------------


def test_host_header_parsing():
    assert parse_host("LocalHost:8123") == ("localhost", "8123")
    assert parse_host("[::1]:8123") == ("::1", "8123") and parse_host("[::1]") == ("::1", "")
    assert parse_host("127.0.0.1") == ("127.0.0.1", "")
    for bad in ("", ":8123", "[::1", "[::1]x", "[]:80", "::1", "localhost:http", "localhost:８０"):
        assert parse_host(bad) is None, bad


def test_a_foreign_host_is_refused_on_every_route(small_ckpt):
    with TestClient(create_app([small_ckpt])) as c:
        for path in ROUTES:
            for host in FOREIGN_HOSTS:
                response = c.get(path, headers={"host": host})
                assert response.status_code == 403, (path, host, response.text[:200])
                assert "DNS rebinding" in response.text and "tensor_count" not in response.text
                if path.startswith("/api/"):
                    assert response.json()["error"].startswith("refused: Host")
        app = c.app
    assert raw_status(app, "/api/checkpoints", []) == 403  # no Host header at all
    assert raw_status(app, "/api/checkpoints", [(b"host", b"127.0.0.1:8123")]) == 200


def test_the_names_of_this_machine_are_served(small_ckpt):
    with TestClient(create_app([small_ckpt])) as c:
        for host in LOCAL_HOSTS:
            for path in ROUTES:
                response = c.get(path, headers={"host": host})
                assert response.status_code == 200, (path, host, response.text[:200])
            assert ok_json(c.get("/api/checkpoints", headers={"host": host}))[0]["tensor_count"] == 2
            _, fields = ok_tile(c.get("/api/checkpoints/a/tile?name=w", headers={"host": host}))
            np.testing.assert_array_equal(fields["value"], np.arange(120, dtype=np.float32).reshape(12, 10) - 60)


def test_a_real_server_refuses_a_rebound_name(serve, small_ckpt):
    base = serve(create_app([small_ckpt]))
    port = base.rsplit(":", 1)[1]
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/api/checkpoints").status_code == 200
        assert http.get("/api/checkpoints", headers={"host": f"localhost:{port}"}).status_code == 200
        for path in ("/", "/app.js", "/api/checkpoints", "/api/checkpoints/a/tile?name=w"):
            assert http.get(path, headers={"host": f"evil.example:{port}"}).status_code == 403, path


def test_another_sites_origin_is_refused(small_ckpt):
    host = {"host": "127.0.0.1:8123"}
    with TestClient(create_app([small_ckpt])) as c:
        for origin in ("http://evil.example", "http://127.0.0.1:8124", "https://127.0.0.1:8123", "null"):
            for path in ("/api/checkpoints", "/api/checkpoints/a/tile?name=w", "/app.js"):
                response = c.get(path, headers={**host, "origin": origin})
                assert response.status_code == 403 and "origin" in response.text, (origin, path)
        assert c.get("/api/checkpoints", headers={**host, "origin": "http://127.0.0.1:8123"}).status_code == 200
        assert c.get("/app.js", headers={**host, "origin": "http://127.0.0.1:8123"}).status_code == 200


# ---------------------------------------------------------------------------
# the token, beyond loopback
# ---------------------------------------------------------------------------


def test_beyond_loopback_the_token_guards_the_page_too(small_ckpt):
    with pytest.raises(ValueError, match="needs a token"):
        create_app([small_ckpt], host="0.0.0.0")
    host = {"host": "gpu-box:8123"}  # listening on every interface: any name, but only with the token
    with TestClient(create_app([small_ckpt], host="0.0.0.0", token="s3cret")) as c:
        for path in ROUTES:
            refused = c.get(path, headers=host)
            assert refused.status_code == 401 and "token" in refused.text, path
            assert "<html" not in refused.text.lower() and "import" not in refused.text
        page = c.get("/", params={"token": "s3cret"}, headers=host)
        assert page.status_code == 200 and "<html" in page.text.lower()
        cookie = page.headers["set-cookie"]
        assert cookie.startswith("tensormorph-token-8123=s3cret;") and "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        c.cookies.clear()
        # the page's scripts and styles load with the cookie; API calls also with the header
        assert c.get("/app.js", headers={**host, "cookie": "tensormorph-token-8123=s3cret"}).status_code == 200
        assert c.get("/app.js", headers={**host, "cookie": "tensormorph-token-9999=s3cret"}).status_code == 401
        assert ok_json(c.get("/api/checkpoints", headers={**host, "x-tensormorph-token": "s3cret"}))
    with TestClient(create_app([small_ckpt], host="192.0.2.7", token="s3cret")) as c:
        assert c.get("/", params={"token": "s3cret"}, headers={"host": "192.0.2.7:8123"}).status_code == 200
        assert c.get("/", params={"token": "s3cret"}, headers={"host": "evil.example:8123"}).status_code == 403


def test_view_beyond_loopback_serves_with_a_token(small_ckpt, monkeypatch):
    served = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: served.update(app=app, **kwargs))
    result = CliRunner().invoke(main, ["view", str(small_ckpt), "--host", "0.0.0.0", "--no-browser"])
    assert result.exit_code == 0, result.output
    url = result.stdout.split("viewer on ", 1)[1].split()[0]
    token = url.split("?token=", 1)[1]
    assert served["host"] == "0.0.0.0" and len(token) >= 16
    with TestClient(served["app"]) as c:
        assert c.get("/", headers={"host": "gpu-box"}).status_code == 401
        assert c.get("/api/checkpoints", headers={"host": "gpu-box"}).status_code == 401
        assert c.get("/", params={"token": token}, headers={"host": "gpu-box"}).status_code == 200
    result = CliRunner().invoke(main, ["view", str(small_ckpt), "--no-browser"])
    assert result.exit_code == 0 and "?token=" not in result.stdout  # loopback: no token to type


def test_a_non_ascii_token_is_a_wrong_token_not_a_crash(small_ckpt):
    with TestClient(create_app([small_ckpt], host="0.0.0.0", token="s3cret")) as c:
        for given in ("é", "s3cretü", "\u2028"):
            response = c.get("/api/checkpoints", params={"token": given})
            assert response.status_code == 401 and response.json()["error"].startswith("missing or wrong token")
        for raw in ("s3cret\u00e9".encode(), b"\xff\xfe", "é".encode("latin-1")):
            assert c.get("/api/checkpoints", headers={"x-tensormorph-token": raw}).status_code == 401
            assert c.get("/", headers={"cookie": b"tensormorph-token-80=" + raw}).status_code == 401


# ---------------------------------------------------------------------------
# config.json is confined to the checkpoint folder
# ---------------------------------------------------------------------------

SECRET = "SECRET-OUTSIDE-7f3a"


def test_config_json_linked_out_of_the_folder_is_not_read(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    safetensors.numpy.save_file({"w": np.ones((4, 4), np.float32)}, str(folder / "model.safetensors"))
    outside = tmp_path / "private.json"
    outside.write_text(json.dumps({"model_type": SECRET, "hidden_size": 4242, "architectures": [SECRET]}))
    (folder / "config.json").symlink_to(outside)
    with TestClient(create_app([folder])) as c:
        summary = c.get("/api/checkpoints/a/summary")
        assert summary.status_code == 200 and summary.json()["config"] is None
        assert SECRET not in summary.text and "4242" not in summary.text
        planned = c.get("/api/plan", params={"device": "cpu=1GiB,tflops=1,bw=10"})
        assert planned.status_code == 400 and SECRET not in planned.text
        assert "resolves outside the checkpoint folder" in planned.json()["error"]
    # a link that stays inside the folder is read as the file it names
    (folder / "config.json").unlink()
    (folder / "real-config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 4}))
    (folder / "config.json").symlink_to("real-config.json")
    with TestClient(create_app([folder])) as c:
        assert c.get("/api/checkpoints/a/summary").json()["config"] == {"model_type": "bert", "hidden_size": 4}


def test_an_oversized_config_json_is_left_out(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"w": np.ones((4, 4), np.float32)}, str(path))
    with open(tmp_path / "config.json", "wb") as f:  # sparse: 8 GiB declared, nothing written
        f.truncate(8 * 1024**3)
    started = time.perf_counter()
    with TestClient(create_app([path])) as c:
        assert c.get("/api/checkpoints/a/summary").json()["config"] is None
    assert time.perf_counter() - started < 5


# ---------------------------------------------------------------------------
# heavy requests: bounded concurrency and memory
# ---------------------------------------------------------------------------

ROWS, COLS = 2048, 4096  # 32 MiB of float32: each tile below samples it at 2048 × 1024 pixels (8 MiB)
TILES_AT_ONCE = 50
# HEAVY_REQUESTS_AT_ONCE tiles of about 20 MiB each (the sample, its encoding), plus the mapped file's 32 MiB:
# about 140 MiB here, where the unbounded server grew by about 1 GiB
GROWTH_BOUND_MIB = 256

SERVER = """
import asyncio, sys, uvicorn
from tensormorph.server import create_app
server = uvicorn.Server(uvicorn.Config(create_app([sys.argv[1]]), host="127.0.0.1", port=0, log_level="warning"))
async def main():
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    print(server.servers[0].sockets[0].getsockname()[1], flush=True)
    await task
asyncio.run(main())
"""


def _peak_rss_mib(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM): exact, unlike sampling the current RSS."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def test_fifty_large_approximate_tiles_keep_the_server_memory_bounded(tmp_path):
    values = (np.arange(ROWS * COLS, dtype=np.float32) % 1000.0).reshape(ROWS, COLS)
    path = tmp_path / "big.safetensors"
    safetensors.numpy.save_file({"big": values}, str(path))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=60) as http:  # warm up: imports, the file's header
            ok_tile(http.get("/api/checkpoints/a/tile", params={"name": "big", "h": 8, "w": 8}))
        baseline = _peak_rss_mib(server.pid)
        barrier = threading.Barrier(TILES_AT_ONCE)

        def fetch(i: int) -> tuple[int, int, bytes]:
            params = {"name": "big", "r0": 0, "r1": ROWS, "c0": i, "c1": COLS, "h": 2048, "w": 1024}
            with httpx.Client(base_url=base, timeout=120) as http:
                barrier.wait(30)
                with http.stream("GET", "/api/checkpoints/a/tile", params=params) as response:
                    size, head = 0, b""
                    for piece in response.iter_bytes(1 << 20):  # not kept: the test measures the server
                        head = head or piece[:4096]
                        size += len(piece)
                    return response.status_code, size, head

        started = time.perf_counter()
        with ThreadPoolExecutor(TILES_AT_ONCE) as pool:
            results = list(pool.map(fetch, range(TILES_AT_ONCE)))
        seconds = time.perf_counter() - started
        grown = _peak_rss_mib(server.pid) - baseline
    finally:
        server.terminate()
        server.wait(30)
    for i, (status, size, head) in enumerate(results):
        assert status == 200
        length = int.from_bytes(head[:4], "little")
        header = json.loads(head[4:4 + length])
        assert header["step"] == [1, 4] and header["shape"] == [2048, (COLS - i + 3) // 4] and header["approximate"]
        sample = values[:, i::4]
        assert header["min"] == sample.min() and header["max"] == sample.max()
        assert size == 4 + length + 4 * sample.size
    assert grown < GROWTH_BOUND_MIB, (f"the server's peak RSS grew by {grown:.0f} MiB in {seconds:.1f} s "
                                      f"(at most {HEAVY_REQUESTS_AT_ONCE} heavy requests at once)")


# ---------------------------------------------------------------------------
# the tile cache's byte caps
# ---------------------------------------------------------------------------


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_the_disk_tile_cache_stays_under_its_byte_cap(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({"m": np.linspace(-1, 1, 256 * 256, dtype=np.float32).reshape(256, 256)},
                                str(path))
    cache, cap = tmp_path / "cache", 100_000  # each tile below: 4 fields of up to 30 × 30 float32, 12-15 KB
    stale = cache / "ab" / ("ab" + "0" * 62)  # what an older viewer left: three times the cap
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 3 * cap)
    os.utime(stale, (1, 1))
    params = {"name": "m", "exact": "1", "h": "30", "w": "30", "r0": "0", "c0": "0"}
    # uncompressed, so that the sizes above hold; kept on disk after a byte naming the encoding ("-": none)
    with TestClient(create_app([path], cache_dir=cache, cache_bytes=cap), headers={"accept-encoding": "identity"}) as c:
        first = c.get("/api/checkpoints/a/tile", params={**params, "r1": "200", "c1": "200"}).content
        assert not stale.exists() and _disk_bytes(cache) <= cap
        for i in range(40):
            ok_tile(c.get("/api/checkpoints/a/tile", params={**params, "r1": str(100 + i), "c1": "256"}))
            c.get("/api/checkpoints/a/tile", params={**params, "r1": "200", "c1": "200"})  # the first, used again
            assert _disk_bytes(cache) <= cap, i
        files = sorted(cache.rglob("*"), key=lambda p: p.stat().st_mtime_ns)
        assert len([p for p in files if p.is_file()]) >= int(cap * DISK_CACHE_SLACK) // 15_000
    first_on_disk = [p for p in cache.rglob("*") if p.is_file() and p.read_bytes() == b"-" + first]
    assert first_on_disk, "the most recently used tile was evicted"


def test_the_memory_tile_cache_stays_under_its_byte_cap():
    cache = TileCache(None, memory_bytes=1000)
    for i in range(10):
        cache.put(f"k{i}", bytes([i]) * 300)
        assert cache.memory_used <= 1000
    assert cache.get("k0") is None and cache.get("k9") == bytes([9]) * 300
    cache.put("huge", b"x" * 1001)  # larger than the whole cache: not kept
    assert cache.get("huge") is None and cache.memory_used == 900


# ---------------------------------------------------------------------------
# dependencies
# ---------------------------------------------------------------------------


def test_the_viewer_server_is_in_the_base_install():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"]}
    assert {"starlette", "uvicorn"} <= names
    assert project["optional-dependencies"]["web"] == []  # an alias kept for old install commands


@pytest.mark.parametrize("missing", ["uvicorn", "starlette"])
def test_view_without_the_server_packages_names_what_to_install(small_ckpt, monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # import raises ModuleNotFoundError, as when not installed
    monkeypatch.setattr(viewer_cli.webbrowser, "open", lambda url: pytest.fail("opened a browser"))
    result = CliRunner().invoke(main, ["view", str(small_ckpt), "--no-browser"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0] == (f"error: tensormorph view needs {missing} ({missing} is not installed): "
                        "pip install 'tensormorph'")


def test_view_of_a_missing_path_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["view", str(tmp_path / "nowhere"), "--no-browser"])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    assert result.stderr.startswith("error: ") and "nowhere" in result.stderr
