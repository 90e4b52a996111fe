"""Remote checkpoints under faults and hostile input, against real servers (tests/remote_support.py): moto's S3
server with signature checks, a hub-layout HTTP server, and the counting proxy injecting 503s, cut bodies, a lying
Content-Length and redirect loops. Every failure is one CheckpointError naming the URL, never wrong data; an index
never sends a request to another host; nothing is written locally but the cache folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from remote_support import CountingProxy, HubServer, S3Endpoint

import tensormorph as tm
from tensormorph.errors import (
    AccessDeniedError,
    CheckpointError,
    MissingFileError,
    TruncatedFileError,
    UnknownFormatError,
    UnsafePathError,
)

pytestmark = pytest.mark.timeout(120)

BUCKET = "faults"
WEIGHT = np.random.default_rng(15).standard_normal((256, 256), dtype=np.float32)  # 256 KiB: several body pieces
BIAS = np.arange(10, dtype=np.int64)
# weight_map entries an index may not use: another host, a climb out of the repo, an absolute path
HOSTILE_NAMES = {"other-host": "{other}/org/model/resolve/main/model.safetensors", "climb": "../model.safetensors",
                 "absolute": "/org/model/resolve/main/model.safetensors"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """model/ (one safetensors file, a config.json), missing-shard/ (an index naming a shard that is not there)."""
    root = tmp_path_factory.mktemp("faults")
    model = root / "model"
    model.mkdir()
    safetensors.numpy.save_file({"w": WEIGHT, "b": BIAS}, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"model_type": "llama"}')
    missing = root / "missing-shard"
    missing.mkdir()
    shutil.copy(model / "model.safetensors", missing)
    (missing / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": "model.safetensors", "b": "gone.safetensors"}}))
    return root


@pytest.fixture(scope="module")
def s3(folders: Path) -> Iterator[S3Endpoint]:
    with S3Endpoint(auth=True) as endpoint:
        endpoint.make_bucket(BUCKET)
        endpoint.upload(folders, f"s3://{BUCKET}")
        yield endpoint


@pytest.fixture(scope="module")
def s3_proxy(s3: S3Endpoint) -> Iterator[CountingProxy]:
    with CountingProxy(s3.endpoint) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def hub(folders: Path) -> Iterator[HubServer]:
    with HubServer() as server:
        for folder in folders.iterdir():
            server.add(f"org/{folder.name}", folder)
        yield server


@pytest.fixture(scope="module")
def proxy(hub: HubServer) -> Iterator[CountingProxy]:
    with CountingProxy(hub.url) as counting:
        yield counting


@pytest.fixture(autouse=True)
def _nothing_written_locally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test runs in an empty working folder, with the default cache folder moved into tmp_path; afterwards
    both are still empty (a test that asks for a cache passes its own folder), and the proxies are fresh."""
    cwd, default_cache = tmp_path / "cwd", tmp_path / "default-cache"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("TENSORMORPH_CACHE", str(default_cache))
    for name in ("s3_proxy", "proxy"):
        if name in request.fixturenames:
            counting = request.getfixturevalue(name)
            counting.clear_faults()
            counting.reset()
    yield
    assert list(cwd.iterdir()) == []
    assert not default_cache.exists()


def s3_open(s3: S3Endpoint, proxy: CountingProxy, key: str, **options: object) -> tm.Checkpoint:
    storage_options = {**s3.storage_options_via(proxy.url), **options}
    return tm.open(f"s3://{BUCKET}/{key}", storage_options=storage_options, cache=False)


def hub_url(proxy: CountingProxy, repo: str, file: str) -> str:
    return f"{proxy.url}/org/{repo}/resolve/main/{file}"


def assert_model(ck: tm.Checkpoint) -> None:
    assert sorted(ck) == ["b", "w"]
    assert ck["w"].full().tobytes() == WEIGHT.tobytes() and ck["b"].full().tobytes() == BIAS.tobytes()


# ---------------------------------------------------------------------------
# passing failures are retried
# ---------------------------------------------------------------------------


def test_s3_open_retries_503s(s3, s3_proxy):
    s3_proxy.fail_next(2, 503)
    ck = s3_open(s3, s3_proxy, "model/model.safetensors")
    assert [r.status for r in s3_proxy.requests[:2]] == [503, 503]
    assert_model(ck)


def test_http_open_retries_503s(proxy):
    proxy.fail_next(2, 503)
    assert_model(tm.open(hub_url(proxy, "model", "model.safetensors"), cache=False))


@pytest.mark.parametrize("via", ["s3", "s3-s3fs", "http"])
def test_a_body_cut_mid_read_is_fetched_again(via, s3, s3_proxy, proxy, monkeypatch):
    """On S3 through obstore (then s3fs for the retry), and through s3fs alone."""
    from tensormorph.storage import obstore_ranges

    monkeypatch.setattr(obstore_ranges, "USE_OBSTORE", via != "s3-s3fs")
    counting = proxy if via == "http" else s3_proxy
    ck = (tm.open(hub_url(proxy, "model", "model.safetensors"), cache=False) if via == "http"
          else s3_open(s3, s3_proxy, "model/model.safetensors"))
    assert ck.storage is not None and (ck.storage.remote.fast is not None) == (via == "s3")
    counting.reset()
    counting.cut_next(1, after_bytes=1000, path_contains="model.safetensors")
    assert ck["w"][10:200].tobytes() == WEIGHT[10:200].tobytes()
    faults = [r.fault for r in counting.requests]
    assert faults[0] == "cut" and faults[1:] == [None] * (len(faults) - 1) and len(faults) >= 2, faults


# ---------------------------------------------------------------------------
# failures that are not passing: one clear error naming the URL, never wrong data
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [5, -5])
@pytest.mark.parametrize("when", ["open", "read"])
def test_a_lying_content_length_is_an_error_never_wrong_data(extra, when, proxy, tmp_path):
    """Through the cache, so a lie is also never kept: once the server is honest, the same read is right."""
    url, cache = hub_url(proxy, "model", "model.safetensors"), tmp_path / "cache"
    if when == "read":
        ck = tm.open(url, cache=cache)
    proxy.lie_content_length(extra)
    with pytest.raises(CheckpointError) as raised:
        if when == "open":
            ck = tm.open(url, cache=cache)
        ck["w"].full()
    assert str(raised.value).startswith(f"{url}: ") and len(str(raised.value).splitlines()) == 1
    assert isinstance(raised.value, TruncatedFileError)
    proxy.clear_faults()
    assert_model(tm.open(url, cache=cache))


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_s3_content_length_shorter_than_the_body_is_an_error(client, s3, s3_proxy, monkeypatch):
    # a longer Content-Length is left to the HTTP case: s3fs and botocore retry the broken body themselves,
    # 5 x 5 tries with backoff (about 10 s) before the TruncatedFileError comes
    from tensormorph.storage import obstore_ranges

    monkeypatch.setattr(obstore_ranges, "USE_OBSTORE", client == "obstore")
    ck = s3_open(s3, s3_proxy, "model/model.safetensors")
    s3_proxy.lie_content_length(-5, path_contains="model.safetensors")
    with pytest.raises(TruncatedFileError, match=f"^s3://{BUCKET}/model/model.safetensors: "):
        ck["w"].full()


def test_http_redirect_loop_on_a_read_is_one_clear_error(proxy):
    url = hub_url(proxy, "model", "model.safetensors")
    ck = tm.open(url, cache=False)
    proxy.redirect_loop("model.safetensors")
    with pytest.raises(CheckpointError, match="redirects in a loop") as raised:
        ck["w"].full()
    assert str(raised.value).startswith(f"{url}: ")


def test_http_redirect_loop_on_open_is_one_clear_error(proxy):
    proxy.redirect_loop("model.safetensors")
    with pytest.raises(CheckpointError, match="redirects in a loop"):
        tm.open(hub_url(proxy, "model", "model.safetensors"), cache=False)


def test_s3_redirect_loop_is_one_clear_error(s3, s3_proxy):
    s3_proxy.redirect_loop("model.safetensors")
    with pytest.raises(CheckpointError, match="redirects in a loop"):
        s3_open(s3, s3_proxy, "model/model.safetensors")


def test_s3_missing_object_names_the_url(s3, s3_proxy):
    with pytest.raises(MissingFileError, match=f"^s3://{BUCKET}/model/nothing.safetensors: "):
        s3_open(s3, s3_proxy, "model/nothing.safetensors")


@pytest.mark.parametrize("via", ["s3", "http"])
def test_a_shard_missing_from_an_index_names_its_url(via, s3, s3_proxy, proxy):
    if via == "s3":
        ck_url = f"s3://{BUCKET}/missing-shard/gone.safetensors"
        opening = lambda: s3_open(s3, s3_proxy, "missing-shard")  # noqa: E731
    else:
        ck_url = hub_url(proxy, "missing-shard", "gone.safetensors")
        opening = lambda: tm.open(hub_url(proxy, "missing-shard", "model.safetensors.index.json"),  # noqa: E731
                                  cache=False)
    with pytest.raises(MissingFileError) as raised:
        ck = opening()
        ck["b"].full()
    assert str(raised.value).startswith(f"{ck_url}: ") and "'b'" in str(raised.value)


def test_http_missing_file_names_the_url(proxy):
    url = hub_url(proxy, "model", "model-00001-of-00002.safetensors")
    with pytest.raises(MissingFileError, match=f"^{url}: "):
        tm.open(url, cache=False)


def test_s3_wrong_secret_is_access_denied_naming_the_url(s3, s3_proxy):
    with pytest.raises(AccessDeniedError, match=f"^s3://{BUCKET}/model/model.safetensors: access denied"):
        s3_open(s3, s3_proxy, "model/model.safetensors", secret="not-the-secret")
    assert s3_proxy.requests and all(r.status == 403 for r in s3_proxy.requests)


@pytest.mark.parametrize("via", ["s3", "http"])
def test_a_file_that_is_no_checkpoint_is_unknown_format(via, s3, s3_proxy, proxy):
    with pytest.raises(UnknownFormatError, match="config.json: not a checkpoint"):
        if via == "s3":
            s3_open(s3, s3_proxy, "model/config.json")
        else:
            tm.open(hub_url(proxy, "model", "config.json"), cache=False)


# ---------------------------------------------------------------------------
# an index never sends a request to another host, nor out of its folder
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_host(hub: HubServer) -> Iterator[CountingProxy]:
    """Another origin (another port) serving the same files, to see whether anything reaches it."""
    with CountingProxy(hub.url) as counting:
        yield counting


@pytest.mark.parametrize("kind", list(HOSTILE_NAMES))
@pytest.mark.parametrize("via", ["s3", "http"])
def test_an_index_naming_files_elsewhere_is_refused_without_a_request(kind, via, folders, s3, s3_proxy, proxy, hub,
                                                                      other_host, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(folders / "model" / "model.safetensors", repo)
    hostile = HOSTILE_NAMES[kind].format(other=other_host.url)
    (repo / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"w": hostile, "b": "model.safetensors"}}))
    if via == "s3":
        s3.upload(repo, f"s3://{BUCKET}/hostile-{kind}")
        index_url = f"s3://{BUCKET}/hostile-{kind}/model.safetensors.index.json"
    else:
        hub.add(f"org/hostile-{kind}", repo)
        index_url = hub_url(proxy, f"hostile-{kind}", "model.safetensors.index.json")
    counting = s3_proxy if via == "s3" else proxy
    counting.reset()
    other_host.reset()
    message = f"^{re.escape(index_url)}: names file {re.escape(repr(hostile))}, which is outside the checkpoint"
    with pytest.raises(UnsafePathError, match=message):
        if via == "s3":
            s3_open(s3, s3_proxy, f"hostile-{kind}/model.safetensors.index.json")
        else:
            tm.open(index_url, cache=False)
    assert other_host.requests == []
    assert all(r.path.endswith(("/model.safetensors.index.json", f"/{BUCKET}")) for r in counting.requests), \
        [r.path for r in counting.requests]


def test_nothing_is_written_locally_but_the_cache(proxy, tmp_path):
    """The autouse fixture checks the working folder and the default cache; a cache folder holds only its layout."""
    cache = tmp_path / "cache"
    assert_model(tm.open(hub_url(proxy, "model", "model.safetensors"), cache=cache))
    assert [p.name for p in cache.iterdir()] == ["ranges-v1"]
    assert os.listdir(cache / "ranges-v1")


@pytest.mark.parametrize("name", ["%2e%2e/%2e%2e/%2e%2e/model.safetensors", "x?download=1", "a#b.safetensors"])
def test_escaped_names_stay_below_the_prefix_over_http(name, folders, proxy, hub, tmp_path):
    """An HTTP client decodes %2e%2e and reads ? and # specially: such names are quoted, so the request is for a
    file of that literal name below the repo (missing here), never for one elsewhere on the host."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(folders / "model" / "model.safetensors", repo)
    (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name,
                                                                                  "b": "model.safetensors"}}))
    label = f"escaped-{abs(hash(name))}"
    hub.add(f"org/{label}", repo)
    proxy.reset()
    with pytest.raises(MissingFileError):
        tm.open(hub_url(proxy, label, "model.safetensors.index.json"), cache=False)
    prefix = f"/org/{label}/resolve/main/"
    assert proxy.requests and all(r.path.startswith(prefix) for r in proxy.requests), [r.path for r in proxy.requests]
    assert not any(r.query for r in proxy.requests)


def test_one_failed_range_is_retried_alone(proxy):
    """Of many ranged GETs of one read, the one that fails is asked for again by itself, not the whole batch."""
    ck = tm.open(hub_url(proxy, "model", "model.safetensors"), cache=False)
    proxy.reset()
    proxy.fail_next(1, status=503, path_contains="model.safetensors")
    rows = ck["w"][0:256:8, 0:16]  # 32 separate row pieces: 32 requests
    assert np.array_equal(rows, WEIGHT[0:256:8, 0:16])
    gets = [r for r in proxy.requests if r.method == "GET"]
    assert len(gets) == 33, len(gets)  # 32 pieces and one retry
    proxy.clear_faults()
