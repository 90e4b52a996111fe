"""The real servers of the remote tests (tests/remote_support.py) do what the remote tests rely on.

moto's S3 server with signature checks on, reached by s3fs through the counting proxy; the hub-layout file
server with Range; every fault mode of the proxy as an httpx client sees it; and the request sequences of
the clients the remote code and its benchmark anchors build on (fsspec's HTTP filesystem, huggingface_hub).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import fsspec
import httpx
import numpy as np
import pytest
import s3fs
import safetensors.numpy
from remote_support import CountingProxy, HubServer, S3Endpoint, request_log, s3_storage_options

SIZE = 300_000
DATA = np.random.default_rng(15).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
REPO = "org/model"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("remote-servers")
    repo = root / "repo"
    (repo / "sub").mkdir(parents=True)
    (repo / "a.bin").write_bytes(DATA)
    (repo / "sub" / "b.json").write_text('{"x": 1}')
    (root / "secret.txt").write_text("outside the repo")
    return repo


@pytest.fixture(scope="module")
def s3(folder):
    with S3Endpoint(auth=True) as endpoint:
        endpoint.make_bucket("ckpts")
        assert endpoint.upload(folder, "s3://ckpts/run1") == ["run1/a.bin", "run1/sub/b.json"]
        yield endpoint


@pytest.fixture(scope="module")
def hub(folder):
    with HubServer() as server:
        server.add(REPO, folder)
        yield server


@pytest.fixture
def s3_proxy(s3):
    with CountingProxy(s3.endpoint) as proxy:
        yield proxy


@pytest.fixture
def proxy(hub):
    with CountingProxy(hub.url) as proxy:
        yield proxy


def _fs(options: dict) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(**options, skip_instance_cache=True)


# -- S3 through the proxy ---------------------------------------------------------------------------------


def test_s3fs_through_proxy_lists_reads_writes_bit_exact(s3, s3_proxy):
    fs = _fs(s3.storage_options_via(s3_proxy.url))
    assert fs.find("ckpts/run1") == ["ckpts/run1/a.bin", "ckpts/run1/sub/b.json"]
    fs.invalidate_cache()  # info from a HEAD, not from the listing
    assert fs.info("ckpts/run1/a.bin")["size"] == SIZE
    assert fs.cat_file("ckpts/run1/a.bin") == DATA
    assert fs.cat_file("ckpts/run1/sub/b.json") == b'{"x": 1}'
    fs.pipe_file("ckpts/put/x.bin", DATA[:5000])
    body = s3.client().get_object(Bucket="ckpts", Key="put/x.bin")["Body"].read()  # directly, not via the proxy
    assert body == DATA[:5000]
    seen = {(r.method, r.status) for r in s3_proxy.requests}
    assert {("GET", 200), ("HEAD", 200), ("PUT", 200)} <= seen
    assert any("list-type=2" in r.query for r in s3_proxy.requests)
    assert s3_proxy.bytes_sent >= SIZE


def test_s3_ranged_read_counts_exactly_the_bytes_asked_for(s3, s3_proxy):
    fs = _fs(s3.storage_options_via(s3_proxy.url))
    assert fs.cat_file("ckpts/run1/a.bin", start=1000, end=1000 + 65536) == DATA[1000:66536]
    assert request_log(s3_proxy.requests) == [("GET", "bytes=1000-66535", 206, 65536)]
    assert s3_proxy.bytes_sent == 65536


def test_s3_signatures_are_checked_through_the_proxy(s3, s3_proxy):
    fs = _fs(s3_storage_options(s3_proxy.url, s3.key, "not-the-secret"))
    with pytest.raises(PermissionError, match="signature"):
        fs.cat_file("ckpts/run1/a.bin", start=0, end=8)  # a GET, whose error has a body (a HEAD's has none)
    assert {r.status for r in s3_proxy.requests} == {403}


def test_s3_upload_of_one_file_keeps_its_bytes(s3, folder):
    assert s3.upload(folder / "a.bin", "s3://ckpts/single/copy.bin") == ["single/copy.bin"]
    assert _fs(s3.storage_options).cat_file("ckpts/single/copy.bin") == DATA


# -- the hub-layout server ---------------------------------------------------------------------------------


def test_hub_honours_range_with_headers(hub):
    url = hub.url_for(REPO, "a.bin")
    ranged = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert ranged.status_code == 206
    assert ranged.content == DATA[10:20]
    assert ranged.headers["content-range"] == f"bytes 10-19/{SIZE}"
    assert ranged.headers["content-length"] == "10"
    whole = httpx.get(url)
    assert (whole.status_code, whole.content) == (200, DATA)
    assert whole.headers["content-length"] == str(SIZE)
    assert whole.headers["etag"] == ranged.headers["etag"] != ""
    assert whole.headers["x-repo-commit"] == HubServer.commit(REPO, "main")
    nested = httpx.get(hub.url_for(REPO, "sub/b.json"))
    assert (nested.status_code, nested.content) == (200, b'{"x": 1}')


@pytest.mark.parametrize(("path", "code"), [
    (f"{REPO}/resolve/main/missing.bin", "EntryNotFound"),
    (f"{REPO}/resolve/main/sub", "EntryNotFound"),  # a folder: no listing
    (f"{REPO}/resolve/main/%2e%2e/secret.txt", "EntryNotFound"),  # climbing out of the repo
    (f"{REPO}/resolve/v2/a.bin", "RevisionNotFound"),
    ("org/other/resolve/main/a.bin", "RepoNotFound"),
    (f"{REPO}/a.bin", "RepoNotFound"),
])
def test_hub_answers_404_with_the_hub_error_code(hub, path, code):
    response = httpx.get(f"{hub.url}/{path}")
    assert (response.status_code, response.headers["x-error-code"]) == (404, code)
    assert b"outside" not in response.content


# -- fault modes, as an httpx client sees them ---------------------------------------------------------------


def test_fail_next_answers_the_status_then_recovers(proxy):
    url = f"{proxy.url}/{REPO}/resolve/main/a.bin"
    proxy.fail_next(2, 503, path_contains="a.bin")
    with httpx.Client() as client:
        assert client.get(f"{proxy.url}/{REPO}/resolve/main/sub/b.json").status_code == 200  # does not match
        first, second = client.get(url), client.get(url)
        assert (first.status_code, second.status_code) == (503, 503)
        assert b"<Code>SlowDown</Code>" in first.content
        assert client.get(url).content == DATA
        proxy.fail_next(1, 500, method="HEAD")
        assert client.get(url).status_code == 200
        assert client.head(url).status_code == 500
    assert [r.fault for r in proxy.requests] == [None, "fail", "fail", None, None, "fail"]


def test_cut_next_drops_the_connection_mid_body(proxy):
    url = f"{proxy.url}/{REPO}/resolve/main/a.bin"
    proxy.cut_next(1, after_bytes=1000)
    with httpx.Client() as client:
        with client.stream("GET", url) as response:
            assert response.headers["content-length"] == str(SIZE)
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete|complete message body"):
                response.read()
        assert client.get(url).content == DATA  # one cut only
    assert request_log(proxy.requests) == [("GET", None, 200, 1000), ("GET", None, 200, SIZE)]
    assert proxy.requests[0].fault == "cut"


def test_lie_content_length_longer_breaks_the_body(proxy):
    url = f"{proxy.url}/{REPO}/resolve/main/a.bin"
    proxy.lie_content_length(50, n=1)
    with httpx.Client() as client, client.stream("GET", url) as response:
        assert response.headers["content-length"] == str(SIZE + 50)
        with pytest.raises(httpx.RemoteProtocolError):
            response.read()
    assert (proxy.requests[0].fault, proxy.bytes_sent) == ("lie", SIZE)


def test_lie_content_length_shorter_contradicts_content_range(proxy):
    url = f"{proxy.url}/{REPO}/resolve/main/a.bin"
    proxy.lie_content_length(-10)
    response = httpx.get(url, headers={"Range": "bytes=0-99"})
    assert response.status_code == 206
    assert response.headers["content-range"] == f"bytes 0-99/{SIZE}"  # what the server should have sent
    assert response.headers["content-length"] == "90"
    assert response.content == DATA[:90]
    head = httpx.head(url)
    assert head.headers["content-length"] == str(SIZE - 10)
    proxy.clear_faults()
    assert httpx.get(url).content == DATA


def test_redirect_loop_loops(proxy):
    url = f"{proxy.url}/{REPO}/resolve/main/a.bin?x=1"
    proxy.redirect_loop("a.bin")
    with httpx.Client(follow_redirects=True, max_redirects=4) as client, pytest.raises(httpx.TooManyRedirects):
        client.get(url)
    assert httpx.get(url).headers["location"] == url
    assert [(r.status, r.fault, r.query) for r in proxy.requests] == [(302, "redirect", "x=1")] * 6


def test_latency_is_added_to_every_request(proxy):
    url = f"{proxy.url}/{REPO}/resolve/main/sub/b.json"
    proxy.latency_s = 0.05
    with httpx.Client() as client:
        for _ in range(4):
            start = time.monotonic()
            assert client.get(url).status_code == 200
            assert time.monotonic() - start >= 0.05
    assert len(proxy.requests) == 4


# -- the clients the remote code builds on -------------------------------------------------------------------


def test_fsspec_http_request_sequence(proxy):
    """One HEAD for info, one ranged GET per cat_file and per range of cat_ranges, no HEAD before them."""
    url = f"{proxy.url}/{REPO}/resolve/main/a.bin"
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    assert fs.info(url)["size"] == SIZE
    assert request_log(proxy.requests) == [("HEAD", None, 200, 0)]
    proxy.reset()
    assert fs.cat_file(url, 0, 8) == DATA[:8]
    assert request_log(proxy.requests) == [("GET", "bytes=0-7", 206, 8)]
    proxy.reset()
    starts, ends = [0, 100, 1000], [10, 200, 5000]
    assert fs.cat_ranges([url] * 3, starts, ends) == [DATA[s:e] for s, e in zip(starts, ends)]
    assert sorted(request_log(proxy.requests)) == [("GET", "bytes=0-9", 206, 10), ("GET", "bytes=100-199", 206, 100),
                                                    ("GET", "bytes=1000-4999", 206, 4000)]


def test_huggingface_hub_reads_safetensors_metadata_from_the_hub(tmp_path, monkeypatch):
    """The benchmark anchor, get_safetensors_metadata, works against HubServer: one ranged GET per shard."""
    import huggingface_hub.constants
    from huggingface_hub import HfApi

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    repo = tmp_path / "repo"
    repo.mkdir()
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    for i, name in enumerate(names):
        safetensors.numpy.save_file({f"layer{i}.w": np.zeros((3, i + 1), np.float32)}, repo / name)
    weight_map = {f"layer{i}.w": name for i, name in enumerate(names)}
    (repo / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with HubServer() as hub, CountingProxy(hub.url) as proxy:
        hub.add(REPO, repo)
        metadata = HfApi(endpoint=proxy.url).get_safetensors_metadata(REPO, token=False)
        shard_gets = sorted(r.path.rsplit("/", 1)[1] for r in proxy.requests
                            if r.method == "GET" and r.path.endswith(".safetensors"))
    assert metadata.weight_map == weight_map
    assert {n: m.tensors[f"layer{i}.w"].shape for i, (n, m) in
            enumerate(sorted(metadata.files_metadata.items()))} == {n: [3, i + 1] for i, n in enumerate(names)}
    assert shard_gets == names
