"""A second open from the range cache, counted at real servers (tests/remote_support.py): a hub URL at a commit hash
is never asked again; any other URL's version is trusted for the revalidation time, then asked again, and a changed
object is never served past it; bytes are fetched only after the cached version is confirmed; one client per
process serves every open of the same protocol and options (and obstore's S3 ranges only in the process that first
used it, s3fs in a forked child).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from remote_support import CountingProxy, HubServer, S3Endpoint

import tensormorph as tm
from tensormorph.errors import CheckpointError
from tensormorph.storage import as_path
from tensormorph.storage.known_versions import REVALIDATE_ENV, is_immutable
from tensormorph.storage.range_cache import RangeCache

pytestmark = pytest.mark.timeout(120)

BUCKET = "cached"
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a revision that is a full commit hash
SHARDS = 6
SHAPE = (64, 512)  # 128 KiB per tensor: its data lies past the first 64 KiB read with the header
TINY_TTL_S = 0.5  # a revalidation time short enough to wait out in a test


def _tensors(seed: int) -> dict[str, dict[str, np.ndarray]]:
    """shard file -> its tensors: SHARDS files of two float32 tensors each."""
    rng = np.random.default_rng(seed)
    return {f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors":
            {f"layers.{k}.{w}": rng.standard_normal(SHAPE, dtype=np.float32) for w in ("q", "k")}
            for k in range(SHARDS)}


def write_repo(folder: Path, seed: int) -> dict[str, np.ndarray]:
    """An HF sharded repo (safetensors shards and their index) in `folder`; its tensors by name."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, tensors = {}, {}
    for shard, part in _tensors(seed).items():
        safetensors.numpy.save_file(part, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
        tensors.update(part)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    folder = tmp_path_factory.mktemp("repo") / "model"
    return folder, write_repo(folder, seed=0)


@pytest.fixture(scope="module")
def hub(repo: tuple[Path, dict[str, np.ndarray]]) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add("org/model", repo[0], revision=COMMIT)
        server.add("org/model", repo[0], revision="main")
        yield server


@pytest.fixture(scope="module")
def proxy(hub: HubServer) -> Iterator[CountingProxy]:
    with CountingProxy(hub.url) as counting:
        yield counting


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with S3Endpoint() as endpoint:
        endpoint.make_bucket(BUCKET)
        yield endpoint


@pytest.fixture(scope="module")
def s3_proxy(s3: S3Endpoint) -> Iterator[CountingProxy]:
    with CountingProxy(s3.endpoint) as counting:
        yield counting


@pytest.fixture(autouse=True)
def _fresh(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REVALIDATE_ENV, raising=False)
    for name in ("proxy", "s3_proxy"):
        if name in request.fixturenames:
            request.getfixturevalue(name).reset()


def index_url(proxy: CountingProxy, revision: str) -> str:
    return f"{proxy.url}/org/model/resolve/{revision}/model.safetensors.index.json"


def assert_values(ck: tm.Checkpoint, tensors: dict[str, np.ndarray]) -> None:
    assert sorted(ck) == sorted(tensors)
    for name, values in tensors.items():
        got = ck[name].full()
        assert got.dtype == values.dtype and got.tobytes() == values.tobytes(), name


def test_a_hub_url_at_a_commit_hash_is_immutable():
    assert is_immutable(f"https://huggingface.co/org/model/resolve/{COMMIT}/model.safetensors")
    assert not is_immutable("https://huggingface.co/org/model/resolve/main/model.safetensors")
    assert not is_immutable(f"https://huggingface.co/org/model/resolve/{COMMIT[:-1]}/model.safetensors")
    assert not is_immutable(f"s3://bucket/org/model/resolve/{COMMIT}/model.safetensors")
    assert not is_immutable(f"https://host/org/model/resolve/{COMMIT}/model.safetensors?download=1")


def test_second_open_at_a_commit_hash_makes_no_request(repo, proxy, tmp_path):
    """Even with a revalidation time of 0, a commit's files are never asked again: the open, the shapes and the
    tensors cached by the first open all come from the cache."""
    _, tensors = repo
    cache = RangeCache(tmp_path / "cache", revalidate_after_s=0)
    first = tm.open(index_url(proxy, COMMIT), cache=cache)
    assert_values(first, tensors)
    per_file = {r.path.rsplit("/", 1)[-1] for r in proxy.requests}
    assert len(per_file) == SHARDS + 1  # every shard and the index were fetched
    proxy.reset()
    second = tm.open(index_url(proxy, COMMIT), cache=RangeCache(tmp_path / "cache", revalidate_after_s=0))
    assert_values(second, tensors)
    assert proxy.requests == []


def test_a_first_open_through_the_cache_costs_one_request_per_file(repo, proxy, tmp_path):
    """The first bytes come with the size and version in one ranged GET, and are cached from it."""
    _, tensors = repo
    ck = tm.open(index_url(proxy, "main"), cache=tmp_path / "cache")
    assert sorted(ck) == sorted(tensors)
    methods = [(r.method, r.path.rsplit("/", 1)[-1]) for r in proxy.requests]
    assert len(methods) == SHARDS + 1 and {m for m, _ in methods} == {"GET"}, methods
    assert len({f for _, f in methods}) == SHARDS + 1


def test_a_mutable_url_is_trusted_for_the_revalidation_time_then_asked_again(repo, proxy, tmp_path):
    _, tensors = repo
    folder = tmp_path / "cache"
    tm.open(index_url(proxy, "main"), cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S)).close()
    proxy.reset()
    ck = tm.open(index_url(proxy, "main"), cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S))
    assert proxy.requests == []  # within the revalidation time: no request
    time.sleep(TINY_TTL_S)
    ck = tm.open(index_url(proxy, "main"), cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S))
    assert sorted(ck) == sorted(tensors)
    # after it: one HEAD per file asks the version; the same version's bytes come from the cache
    assert sorted(r.method for r in proxy.requests) == ["HEAD"] * (SHARDS + 1)


def test_an_open_partly_cached_asks_only_for_what_the_cache_lacks(repo, proxy, tmp_path, monkeypatch):
    """The files whose first bytes are cached are read at once in the opening thread; only the others go to the
    request threads (one shard's bytes evicted: its version, trusted, is confirmed, then its first bytes fetched)."""
    from tensormorph.storage import remote as remote_module
    from tensormorph.storage.range_cache import ObjectKey

    _, tensors = repo
    folder = tmp_path / "cache"
    tm.open(index_url(proxy, "main"), cache=RangeCache(folder)).close()
    evicted = index_url(proxy, "main").replace("model.safetensors.index.json", "model-00003-of-00006.safetensors")
    known = RangeCache(folder).versions.lookup(evicted)
    assert known is not None and known.info is not None
    digest = ObjectKey(evicted, int(known.info["size"]), known.info["ETag"]).digest()
    for entry in folder.glob(f"*/{digest}.*"):
        entry.unlink()
    pooled: list[str] = []
    pool = remote_module.ThreadPoolExecutor

    def counting_pool(workers: int) -> Any:
        pooled.append("pool")
        return pool(workers)

    monkeypatch.setattr(remote_module, "ThreadPoolExecutor", counting_pool)
    proxy.reset()
    ck = tm.open(index_url(proxy, "main"), cache=RangeCache(folder))
    assert [(r.method, r.path.rsplit("/", 1)[-1]) for r in proxy.requests] == [
        ("HEAD", "model-00003-of-00006.safetensors"), ("GET", "model-00003-of-00006.safetensors")]
    assert pooled == ["pool"]  # one pool, for the one file that needed requests
    assert_values(ck, tensors)
    proxy.reset()
    pooled.clear()
    tm.open(index_url(proxy, "main"), cache=RangeCache(folder)).close()
    assert proxy.requests == [] and pooled == []  # all cached: no request, no thread


def test_the_environment_sets_the_revalidation_time(repo, proxy, tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    tm.open(index_url(proxy, "main"), cache=folder).close()
    proxy.reset()
    monkeypatch.setenv(REVALIDATE_ENV, "0")
    tm.open(index_url(proxy, "main"), cache=folder).close()
    assert sorted(r.method for r in proxy.requests) == ["HEAD"] * (SHARDS + 1)
    monkeypatch.setenv(REVALIDATE_ENV, "soon")
    with pytest.raises(CheckpointError, match=REVALIDATE_ENV):
        tm.open(index_url(proxy, "main"), cache=folder)


def test_a_changed_object_at_a_mutable_url_is_seen_after_the_revalidation_time(s3, s3_proxy, tmp_path):
    """Within the revalidation time the cached version is served; after it, never: the new bytes are read."""
    options, url = s3.storage_options_via(s3_proxy.url), f"s3://{BUCKET}/ttl/model.safetensors"
    old = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    new = {"w": -old["w"]}  # the same size and header: only the data bytes differ
    safetensors.numpy.save_file(old, str(tmp_path / "model.safetensors"))
    s3.upload(tmp_path / "model.safetensors", url)
    folder = tmp_path / "cache"

    def region() -> np.ndarray:
        with tm.open(url, storage_options=options, cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S)) as ck:
            return np.asarray(ck["w"][1:5, 2:6])

    assert region().tobytes() == old["w"][1:5, 2:6].tobytes()
    changed_at = time.time()
    safetensors.numpy.save_file(new, str(tmp_path / "model.safetensors"))
    s3.upload(tmp_path / "model.safetensors", url)
    while time.time() - changed_at < TINY_TTL_S:
        got = region()
        assert got.tobytes() in (old["w"][1:5, 2:6].tobytes(), new["w"][1:5, 2:6].tobytes())
    time.sleep(TINY_TTL_S)
    assert region().tobytes() == new["w"][1:5, 2:6].tobytes()


def test_bytes_of_a_trusted_version_are_fetched_only_after_the_server_confirms_it(s3, s3_proxy, tmp_path):
    """The open comes from cached headers; the first read of uncached data asks the version first. A changed
    object is then an error naming the URL, never data of another version; the next open sees the new one."""
    options, url = s3.storage_options_via(s3_proxy.url), f"s3://{BUCKET}/confirm/model.safetensors"
    old = {"w": np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)}
    new = {"w": -old["w"]}
    safetensors.numpy.save_file(old, str(tmp_path / "model.safetensors"))
    s3.upload(tmp_path / "model.safetensors", url)
    folder = tmp_path / "cache"
    tm.open(url, storage_options=options, cache=folder).close()  # caches the header only
    ck = tm.open(url, storage_options=options, cache=folder)
    s3_proxy.reset()
    assert ck["w"][60:62, :].tobytes() == old["w"][60:62, :].tobytes()
    assert [r.method for r in s3_proxy.requests] == ["HEAD", "GET"]  # confirmed, then fetched

    stale = tm.open(url, storage_options=options, cache=folder)  # trusted: no request
    safetensors.numpy.save_file(new, str(tmp_path / "model.safetensors"))
    s3.upload(tmp_path / "model.safetensors", url)
    with pytest.raises(CheckpointError, match="changed on the server") as caught:
        stale["w"][40:42, :]
    assert url in str(caught.value)
    fresh = tm.open(url, storage_options=options, cache=folder)
    assert fresh["w"][40:42, :].tobytes() == new["w"][40:42, :].tobytes()


def _upload_model(s3: S3Endpoint, folder: Path, url: str) -> dict[str, np.ndarray]:
    """A one-file safetensors checkpoint (data past the first 64 KiB) in `folder`, uploaded under `url`."""
    values = {"w": np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE)}
    folder.mkdir()
    safetensors.numpy.save_file(values, str(folder / "model.safetensors"))
    s3.upload(folder, url)
    return values


def test_a_folder_listed_within_the_revalidation_time_is_taken_from_its_record_then_listed_again(s3, s3_proxy,
                                                                                                 tmp_path):
    """A new command (a new client and RangeCache) reopening a folder seen a moment ago asks nothing: the listing
    record is trusted whole. An object gone since is then found at the first read of uncached bytes (confirmed
    first), and after the revalidation time the folder is listed again and the open fails, naming it."""
    url = f"s3://{BUCKET}/listed"
    values = _upload_model(s3, tmp_path / "ck", url)
    options, folder = {**s3.storage_options_via(s3_proxy.url), "skip_instance_cache": True}, tmp_path / "cache"
    tm.open(url, storage_options=options, cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S)).close()
    s3_proxy.reset()
    ck = tm.open(url, storage_options=options, cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S))
    assert s3_proxy.requests == [] and ck["w"].shape == SHAPE
    s3.client().delete_object(Bucket=BUCKET, Key="listed/model.safetensors")
    with pytest.raises(CheckpointError, match="changed on the server .* is gone") as caught:
        ck["w"][60:62, :]
    assert f"{url}/model.safetensors" in str(caught.value)
    assert [r.method for r in s3_proxy.requests] == ["HEAD"]
    time.sleep(TINY_TTL_S)
    with pytest.raises(CheckpointError, match="no such object or folder") as gone:
        tm.open(url, storage_options=options, cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S))
    assert url in str(gone.value)
    s3.upload(tmp_path / "ck", url)  # back at once: a missing object's record at a mutable URL is never trusted
    with tm.open(url, storage_options=options, cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S)) as back:
        assert back["w"].full().tobytes() == values["w"].tobytes()


def test_revalidating_a_cached_folder_costs_a_head_and_a_listing(s3, s3_proxy, tmp_path):
    """With a revalidation time of 0 every open asks afresh, but only what an open must: the folder's URL as an
    object and its listing (with every object's version); the header bytes still come from the cache."""
    url = f"s3://{BUCKET}/revalidated"
    values = _upload_model(s3, tmp_path / "ck", url)
    options, folder = {**s3.storage_options_via(s3_proxy.url), "skip_instance_cache": True}, tmp_path / "cache"
    tm.open(url, storage_options=options, cache=RangeCache(folder)).close()
    for _ in range(2):
        s3_proxy.reset()
        with tm.open(url, storage_options=options, cache=RangeCache(folder, revalidate_after_s=0)) as ck:
            assert [(r.method, "list-type" in r.query) for r in s3_proxy.requests] == [("HEAD", False), ("GET", True)]
            assert ck["w"][0:2, :].tobytes() == values["w"][0:2, :].tobytes()
            assert ck.storage.fs._s3 is None  # obstore asked: no s3fs client built


@pytest.mark.parametrize("record", [b"not json", b'{"url": "%s", "checked": %t, "files": 3, "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [["../x", 1, "e"]], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [["a/b", 1, "e"]], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [], "folders": [".."]}',
                                    b'{"url": "%s", "checked": %t, "files": [[7, 1, "e"]], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [["w", "big", "e"]], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [["w", -1, "e"]], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [["w", true, "e"]], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [["w", 1e400, "e"]], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [["w", 9, ""]], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [["w", 9, null]], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [["w", 9]], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": [], "folders": "abc"}',
                                    b'{"url": "%s", "checked": NaN, "files": [], "folders": []}',
                                    b'{"url": "%s", "checked": %t, "files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_a_damaged_or_planted_listing_record_is_ignored(s3, s3_proxy, tmp_path, record):
    """A listing record that is not one, or names what no listing could (outside the folder), is never used to
    reach anything: the open lists the folder, or refuses such names, and reads the right values."""
    url = f"s3://{BUCKET}/planted"
    values = _upload_model(s3, tmp_path / "ck", url)
    options, cache = s3.storage_options_via(s3_proxy.url), RangeCache(tmp_path / "cache")
    tm.open(url, storage_options=options, cache=cache).close()
    (path,) = [p for p in cache.dir.glob("*.version") if json.loads(p.read_bytes()).get("files") is not None]
    path.write_bytes(record.replace(b"%s", url.encode()).replace(b"%t", str(time.time()).encode()))
    with tm.open(url, storage_options=options, cache=RangeCache(tmp_path / "cache")) as ck:
        assert ck["w"].full().tobytes() == values["w"].tobytes()
        assert all("/.." not in u and not u.endswith(("/a/b", "/7")) for u in ck.storage.remote.infos)


@pytest.mark.parametrize("record", [b'{"url": "%s", "checked": %t, "size": 1e400, "version": "e"}',
                                    b'{"url": "%s", "checked": %t, "size": true, "version": "e"}',
                                    b'{"url": "%s", "checked": %t, "size": 9, "version": 7}',
                                    b'{"url": "%s", "checked": "now", "size": 9, "version": "e"}',
                                    b'[' * 5_000 + b']' * 5_000])  # nested past the parser, within the cap
def test_a_damaged_version_record_is_ignored(s3, s3_proxy, tmp_path, record):
    """A version record that is not one is asked again, never trusted and never an error."""
    url = f"s3://{BUCKET}/damaged-version/model.safetensors"
    values = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    safetensors.numpy.save_file(values, str(tmp_path / "model.safetensors"))
    s3.upload(tmp_path / "model.safetensors", url)
    options, cache = s3.storage_options_via(s3_proxy.url), RangeCache(tmp_path / "cache")
    tm.open(url, storage_options=options, cache=cache).close()
    (path,) = cache.dir.glob("*.version")
    path.write_bytes(record.replace(b"%s", url.encode()).replace(b"%t", str(time.time()).encode()))
    assert cache.versions.lookup(url) is None
    s3_proxy.reset()
    with tm.open(url, storage_options=options, cache=RangeCache(tmp_path / "cache")) as ck:
        assert ck["w"].full().tobytes() == values["w"].tobytes()
    assert s3_proxy.requests  # asked again


def test_a_listing_answered_by_the_client_cache_is_not_recorded_as_checked(s3, s3_proxy, tmp_path, monkeypatch):
    """Where s3fs lists (obstore off), a listing its never-expiring cache answers in a long-lived process is not
    written down as just checked: after the revalidation time the next command lists the folder again."""
    from tensormorph.storage import obstore_ranges

    monkeypatch.setattr(obstore_ranges, "USE_OBSTORE", False)
    url = f"s3://{BUCKET}/client-cached"
    _upload_model(s3, tmp_path / "ck", url)
    options, folder = s3.storage_options_via(s3_proxy.url), tmp_path / "cache"
    tm.open(url, storage_options=options, cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S)).close()
    s3.client().delete_object(Bucket=BUCKET, Key="client-cached/model.safetensors")
    time.sleep(TINY_TTL_S)
    # the same process again: s3fs answers the listing from its cache, so the open still finds the file
    tm.open(url, storage_options=options, cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S)).close()
    with pytest.raises(CheckpointError, match="no such object or folder"):  # a new command: listed afresh
        tm.open(url, storage_options={**options, "skip_instance_cache": True},
                cache=RangeCache(folder, revalidate_after_s=TINY_TTL_S))


def test_opens_with_the_same_protocol_and_options_share_one_client(s3, s3_proxy):
    options = s3.storage_options_via(s3_proxy.url)
    a = as_path(f"s3://{BUCKET}/a", options, cache=False)
    b = as_path(f"s3://{BUCKET}/b/c", dict(options), cache=False)
    other = as_path(f"s3://{BUCKET}/a", {**options, "secret": "other"}, cache=False)
    assert a.remote.fs is b.remote.fs and other.remote.fs is not a.remote.fs


def _read_in_child(url: str, options: dict, out: Any) -> None:
    ck = tm.open(url, storage_options=options, cache=False)
    out.put((ck.storage.remote.fast.usable(), ck["w"].full().tobytes()))


def test_a_forked_child_reads_s3_through_s3fs_once_the_parent_used_obstore(s3, s3_proxy, tmp_path):
    """obstore's runtime does not survive a fork: a child of a process that used it reads through s3fs."""
    import multiprocessing

    values = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    safetensors.numpy.save_file(values, str(tmp_path / "model.safetensors"))
    url, options = f"s3://{BUCKET}/fork/model.safetensors", s3.storage_options_via(s3_proxy.url)
    s3.upload(tmp_path / "model.safetensors", url)
    ck = tm.open(url, storage_options=options, cache=False)
    assert ck["w"][0:2, :].tobytes() == values["w"][0:2, :].tobytes()
    assert ck.storage.remote.fast is not None and ck.storage.remote.fast.usable()
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_read_in_child, args=(url, options, out))
    child.start()
    usable, data = out.get(timeout=60)
    child.join(30)
    assert child.exitcode == 0 and not usable and data == values["w"].tobytes()
