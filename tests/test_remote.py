"""Every checkpoint format opened from a URL, against real servers (tests/remote_support.py): moto's S3 server and
a hub-layout HTTP server, both behind the counting proxy. The real fixtures are uploaded as they are and read back
bit for bit against the local open; region reads are counted in bytes at the proxy; the on-disk range cache serves
a second open without data requests and never serves a changed object stale; diff takes a local and a remote side.
The fault and hostile-input cases are in test_remote_faults.py.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from fixtures import deepspeed_builders, gguf_builders, megatron_builders
from fixtures.cache import cached_build
from remote_support import CountingProxy, HubServer, S3Endpoint

import tensormorph as tm
from tensormorph.core import Checkpoint
from tensormorph.errors import CheckpointError, ChecksumError, UnsupportedError

pytestmark = pytest.mark.timeout(180)

BUCKET = "ckpts"
REPO = "org"  # every fixture is its own hub repo, "org/<case>"
REGION_ROWS, REGION_COLS = slice(3, 40), slice(5, 60)
BIG_SHAPE = (4096, 1024)  # 16 MiB of float32: a region is a tiny share of the file, so over-fetching would show
MAX_TRANSFER_RATIO = 1.1  # bytes transferred / bytes needed for a region read (issue 15)
HF_SHARDS = 24  # shards of the many-file repo: enough for the per-file request cost to dominate the constant
# requests opening an HF repo may make besides its shards': the index's size and bytes, and the probes detection
# makes (on S3: four listings asking whether the index URL is a folder; over HTTP, HEAD+GET of absent files)
OPEN_CONSTANT_REQUESTS = 8


@dataclass(frozen=True)
class Case:
    """A real fixture: `local` is what the local open is given; `root` is the folder uploaded (as it is); `key` is
    `local` relative to `root` ("" for the folder itself), the object URL's tail."""

    local: Path
    root: Path
    http_key: str | None = None  # the file an HTTP open is given; None where HTTP cannot open the format

    @property
    def key(self) -> str:
        return "" if self.local == self.root else self.local.relative_to(self.root).as_posix()


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-exact: same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _plain(value: Any) -> Any:
    """An object's value in a form == compares (arrays by dtype, shape and bytes)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _value(entry: Any) -> Any:
    try:
        return _plain(entry.value())
    except CheckpointError as exc:  # an object the safe unpickler refuses must be refused remotely too
        return ("refused", type(exc).__name__)


def assert_same_checkpoint(local: Checkpoint, remote: Checkpoint) -> None:
    """Same format, tensor names in order, every tensor bit-exact, and the same objects with equal values."""
    assert remote.format == local.format
    assert list(remote) == list(local)
    for name in local:
        assert same_array(local[name].full(force=True), remote[name].full(force=True)), name
    assert list(remote.objects) == list(local.objects)
    for name, entry in local.objects.items():
        assert _value(remote.objects[name]) == _value(entry), name


# ---------------------------------------------------------------------------
# the fixtures, as the format tests build them (cached), and the servers
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tensormorph_ckpt(dcp_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tm") / "ckpt"
    result = tm.convert(dcp_ckpt, out, to="tensormorph", mesh=2)
    assert result.check is not None and result.check.identical
    return out


@pytest.fixture(scope="module")
def cases(dcp_ckpt, dcp_zstd_ckpt, dcp_safetensors_ckpt, hf_llama_safetensors, hf_llama_bin, torch_pickles,
          tensormorph_ckpt) -> dict[str, Case]:
    gguf = cached_build("gguf", gguf_builders, gguf_builders.build)
    ds = cached_build("deepspeed", deepspeed_builders, deepspeed_builders.build_all)
    megatron = cached_build("megatron", megatron_builders, lambda d: megatron_builders.build(d / "ckpt")) / "ckpt"
    pickles = torch_pickles["zip"].parent
    return {
        "dcp": Case(dcp_ckpt, dcp_ckpt, ".metadata"),
        "dcp-zstd": Case(dcp_zstd_ckpt, dcp_zstd_ckpt, ".metadata"),
        # HTTP cannot list, and no file of a DCP sharded-safetensors save names the others
        "dcp-safetensors": Case(dcp_safetensors_ckpt, dcp_safetensors_ckpt),
        "hf-safetensors": Case(hf_llama_safetensors, hf_llama_safetensors, "model.safetensors.index.json"),
        "hf-bin": Case(hf_llama_bin, hf_llama_bin, "pytorch_model.bin.index.json"),
        "safetensors": Case(hf_llama_safetensors / "model-00002-of-00003.safetensors", hf_llama_safetensors,
                            "model-00002-of-00003.safetensors"),
        "torch-zip": Case(torch_pickles["zip"], pickles, "state_zip.pt"),
        "torch-bin": Case(torch_pickles["bin"], pickles, "pytorch_model.bin"),
        "megatron": Case(megatron, megatron, "metadata.json"),
        "megatron-by-dcp-metadata": Case(megatron, megatron, ".metadata"),
        "gguf-split": Case(gguf / "split" / "model-00001-of-00003.gguf", gguf / "split",
                           "model-00001-of-00003.gguf"),
        "gguf": Case(gguf / "single" / "model.gguf", gguf / "single", "model.gguf"),
        # DeepSpeed over HTTP: tests below; the universal layout (zero/<param>/) needs a listing
        "deepspeed-zero2": Case(ds / "zero2_fp32" / "ckpt", ds / "zero2_fp32" / "ckpt"),
        "deepspeed-zero3-bf16": Case(ds / "zero3_bf16" / "ckpt", ds / "zero3_bf16" / "ckpt"),
        "deepspeed-universal": Case(ds / "zero2_fp32" / "ckpt" / "global_step3_universal",
                                    ds / "zero2_fp32" / "ckpt"),
        "tensormorph": Case(tensormorph_ckpt, tensormorph_ckpt, "manifest.json"),
    }


@pytest.fixture(scope="module")
def s3(cases: dict[str, Case]) -> Iterator[S3Endpoint]:
    with S3Endpoint() as endpoint:
        endpoint.make_bucket(BUCKET)
        for name, case in cases.items():
            endpoint.upload(case.root, f"s3://{BUCKET}/{name}")
        yield endpoint


@pytest.fixture(scope="module")
def s3_proxy(s3: S3Endpoint) -> Iterator[CountingProxy]:
    with CountingProxy(s3.endpoint) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def hub(cases: dict[str, Case]) -> Iterator[HubServer]:
    with HubServer() as server:
        for name, case in cases.items():
            server.add(f"{REPO}/{name}", case.root)
        yield server


@pytest.fixture(scope="module")
def hub_proxy(hub: HubServer) -> Iterator[CountingProxy]:
    with CountingProxy(hub.url) as proxy:
        yield proxy


@pytest.fixture(autouse=True)
def _fresh_counts(request: pytest.FixtureRequest) -> None:
    """Each test counts only its own requests (the proxies are shared by the module)."""
    for name in ("s3_proxy", "hub_proxy"):
        if name in request.fixturenames:
            request.getfixturevalue(name).reset()


def s3_url(name: str, case: Case) -> str:
    return f"s3://{BUCKET}/{name}" + (f"/{case.key}" if case.key else "")


def hub_url(proxy: CountingProxy, name: str, file: str = "") -> str:
    """The URL of `file` in repo org/<name> through `proxy`; of the repo's root (a folder) without a file."""
    return f"{proxy.url}/{REPO}/{name}/resolve/main" + (f"/{file}" if file else "")


# ---------------------------------------------------------------------------
# every format from S3 and over HTTP, bit-exact against the local open
# ---------------------------------------------------------------------------

S3_CASES = ["dcp", "dcp-zstd", "dcp-safetensors", "hf-safetensors", "hf-bin", "safetensors", "torch-zip", "torch-bin",
            "megatron", "gguf-split", "gguf", "deepspeed-zero2", "deepspeed-zero3-bf16", "deepspeed-universal",
            "tensormorph"]
HTTP_CASES = ["dcp", "dcp-zstd", "hf-safetensors", "hf-bin", "safetensors", "torch-zip", "torch-bin", "megatron",
              "megatron-by-dcp-metadata", "gguf-split", "gguf", "tensormorph"]


@pytest.mark.parametrize("name", S3_CASES)
def test_every_format_opens_from_s3_bit_exact(name, cases, s3, s3_proxy):
    case = cases[name]
    remote = tm.open(s3_url(name, case), storage_options=s3.storage_options_via(s3_proxy.url), cache=False)
    assert_same_checkpoint(tm.open(case.local), remote)
    assert s3_proxy.requests, "the reads went around the proxy"


@pytest.mark.parametrize("name", HTTP_CASES)
def test_every_format_opens_over_http_by_its_key_file_bit_exact(name, cases, hub_proxy):
    case = cases[name]
    assert case.http_key is not None
    remote = tm.open(hub_url(hub_proxy, name, case.http_key), cache=False)
    assert_same_checkpoint(tm.open(case.local), remote)
    assert hub_proxy.requests


def test_deepspeed_opens_over_http_by_its_latest_file(cases, hub_proxy):
    case = cases["deepspeed-zero2"]
    assert_same_checkpoint(tm.open(case.local), tm.open(hub_url(hub_proxy, "deepspeed-zero2", "latest"), cache=False))


@pytest.mark.parametrize("name", ["deepspeed-zero2", "deepspeed-zero3-bf16"])
def test_deepspeed_save_folder_opens_over_http(name, cases, hub_proxy):
    case = cases[name]
    # docs/remote.md: the save folder's URL, ending in "/"
    assert_same_checkpoint(tm.open(case.local), tm.open(hub_url(hub_proxy, name) + "/", cache=False))


def test_http_folder_of_an_hf_repo_opens_by_its_index_name(cases, hub_proxy):
    """HTTP has no listing, but the Hugging Face index names are known: the folder URL finds the index by name."""
    case = cases["hf-safetensors"]
    assert_same_checkpoint(tm.open(case.local), tm.open(hub_url(hub_proxy, "hf-safetensors"), cache=False))


@pytest.mark.parametrize("name", ["dcp-safetensors"])
def test_http_folder_without_key_file_says_how_to_open_it(name, hub_proxy):
    with pytest.raises(UnsupportedError, match="HTTP has no listing: open the checkpoint by the URL of its index or "
                                               "metadata file") as raised:
        tm.open(hub_url(hub_proxy, name), cache=False)
    assert f"/{REPO}/{name}/resolve/main" in str(raised.value)
    assert len(str(raised.value).splitlines()) == 1


def test_tensormorph_format_checksums_are_verified_remotely(cases, s3, hub_proxy, tmp_path, monkeypatch):
    """verify() over HTTP checks every block's checksum; a byte flipped in a data object on S3 is a ChecksumError
    naming that object, never wrong values."""
    monkeypatch.setenv("TENSORMORPH_CACHE", str(tmp_path / "cache"))  # verify() uses the default cache
    report = tm.verify(hub_url(hub_proxy, "tensormorph", "manifest.json"), full=True)
    assert report.ok, report.problems
    assert report.format == "tensormorph" and report.checksums_checked > 0

    local = cases["tensormorph"].local
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for file in local.iterdir():
        (damaged / file.name).write_bytes(file.read_bytes())
    ck = tm.open(local)
    data_file = sorted(damaged.glob("rank-*.safetensors"))[0]
    raw = bytearray(data_file.read_bytes())
    raw[-5] ^= 0xFF  # the last tensor's data: inside some checksummed block of rank 0's file
    data_file.write_bytes(bytes(raw))
    s3.upload(damaged, f"s3://{BUCKET}/tensormorph-damaged")
    remote = tm.open(f"s3://{BUCKET}/tensormorph-damaged", storage_options=s3.storage_options, cache=False)
    with pytest.raises(ChecksumError) as raised:
        for tensor in remote:  # the damaged block belongs to one tensor; every other reads correctly
            value = remote[tensor].full(force=True)
            assert same_array(value, ck[tensor].full(force=True)), tensor
    assert f"tensormorph-damaged/{data_file.name}" in str(raised.value)


# ---------------------------------------------------------------------------
# bytes and requests, counted at the proxy
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A folder with one 4096x1024 float32 tensor saved by DCP (one process) and by safetensors."""
    import torch
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("big")
    weight = np.random.default_rng(15).standard_normal(BIG_SHAPE, dtype=np.float32)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.from_numpy(weight)}, checkpoint_id=str(root / "dcp"), no_dist=True)
    (root / "st").mkdir()
    safetensors.numpy.save_file({"w": weight}, str(root / "st" / "model.safetensors"))
    return root, weight


@pytest.fixture(scope="module")
def big_urls(big, s3, hub) -> dict[str, tuple[str, str]]:
    """Format -> (the S3 key under s3://ckpts/big/, the file an HTTP open is given) of `big`, uploaded and served."""
    root, _ = big
    s3.upload(root, f"s3://{BUCKET}/big")
    hub.add(f"{REPO}/big", root)
    return {"dcp": ("dcp", "dcp/.metadata"), "safetensors": ("st/model.safetensors", "st/model.safetensors")}


def _data_span(file: Path, weight: np.ndarray) -> tuple[int, int]:
    """Where the tensor's bytes lie in `file` (DCP writes them raw inside the item's zip)."""
    raw = file.read_bytes()
    begin = raw.find(weight[:4].tobytes())
    assert begin >= 0 and raw[begin:begin + weight.nbytes] == weight.tobytes()
    return begin, begin + weight.nbytes


def _range_of(header: str | None) -> tuple[int, int]:
    assert header is not None and header.startswith("bytes="), header
    first, last = header[len("bytes="):].split("-")
    return int(first), int(last) + 1


@pytest.mark.parametrize("fmt", ["dcp", "safetensors"])
@pytest.mark.parametrize("via", ["s3", "s3-s3fs", "http"])
def test_region_read_transfers_at_most_1_1x_the_bytes_it_needs(fmt, via, big, big_urls, s3, s3_proxy, hub_proxy,
                                                               monkeypatch):
    """On S3 the ranges go through obstore where it is installed, else (s3-s3fs) through s3fs: both are held to it."""
    from tensormorph.storage import obstore_ranges

    monkeypatch.setattr(obstore_ranges, "USE_OBSTORE", via != "s3-s3fs")
    root, weight = big
    proxy = hub_proxy if via == "http" else s3_proxy
    s3_key, http_file = big_urls[fmt]
    url = hub_url(proxy, "big", http_file) if via == "http" else f"s3://{BUCKET}/big/{s3_key}"
    ck = tm.open(url, storage_options=None if via == "http" else s3.storage_options_via(proxy.url), cache=False)
    assert ck.storage is not None and (ck.storage.remote.fast is not None) == (via == "s3")
    expected = weight[REGION_ROWS, REGION_COLS]
    needed = expected.nbytes
    proxy.reset()  # not counted: the open's requests (headers, index, metadata)
    assert same_array(ck["w"][REGION_ROWS, REGION_COLS], expected)
    records = proxy.requests
    assert all(r.method == "GET" and r.status == 206 for r in records), records
    if fmt == "dcp":
        # Also not counted here, but bounded: a DCP item is a torch.save zip, and its first read parses the zip's
        # local header and its central directory (the item's last bytes), at most two small requests that are not
        # wholly inside the tensor's bytes. The second region read below, of the same item, is counted whole.
        begin, end = _data_span(root / "dcp" / "__0_0.distcp", weight)
        structure = [r for r in records if not begin <= _range_of(r.range)[0] < _range_of(r.range)[1] <= end]
        assert len(structure) <= 2 and sum(r.bytes_sent for r in structure) <= 8192, structure
        records = [r for r in records if r not in structure]
    transferred = sum(r.bytes_sent for r in records)
    assert needed <= transferred <= MAX_TRANSFER_RATIO * needed, (transferred, needed)

    proxy.reset()
    rows = slice(1000, 1040)
    assert same_array(ck["w"][rows, REGION_COLS], weight[rows, REGION_COLS])
    assert proxy.bytes_sent <= MAX_TRANSFER_RATIO * weight[rows, REGION_COLS].nbytes


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory, s3: S3Endpoint,
                hub: HubServer) -> tuple[Path, dict[str, np.ndarray]]:
    """An HF repo of HF_SHARDS safetensors shards and their index, served as org/many and at s3://ckpts/many."""
    root = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(1)
    tensors, weight_map = {}, {}
    for k in range(HF_SHARDS):
        shard = f"model-{k + 1:05d}-of-{HF_SHARDS:05d}.safetensors"
        part = {f"layers.{k}.{w}": rng.standard_normal((8, 4), dtype=np.float32) for w in ("q", "k")}
        safetensors.numpy.save_file(part, str(root / shard))
        tensors.update(part)
        weight_map.update(dict.fromkeys(part, shard))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    hub.add(f"{REPO}/many", root)
    s3.upload(root, f"s3://{BUCKET}/many")
    return root, tensors


@pytest.mark.parametrize("via", ["s3", "http"])
def test_opening_an_hf_sharded_repo_costs_at_most_two_requests_per_shard(via, many_shards, s3, s3_proxy, hub_proxy):
    root, tensors = many_shards
    proxy = s3_proxy if via == "s3" else hub_proxy
    if via == "s3":
        url = f"s3://{BUCKET}/many/model.safetensors.index.json"
        ck = tm.open(url, storage_options=s3.storage_options_via(proxy.url), cache=False)
    else:
        ck = tm.open(hub_url(proxy, "many", "model.safetensors.index.json"), cache=False)
    local = tm.open(root)
    assert [(n, ck[n].shape, ck[n].dtype) for n in ck] == [(n, local[n].shape, local[n].dtype) for n in local]
    assert sorted(ck) == sorted(tensors) and all(ck[n].shape == tensors[n].shape for n in tensors)
    per_file = Counter(r.path.rsplit("/", 1)[-1] for r in proxy.requests)
    shards = {f: n for f, n in per_file.items() if f.endswith(".safetensors")}
    assert len(shards) == HF_SHARDS and max(shards.values()) <= 2, per_file
    assert sum(per_file.values()) - sum(shards.values()) <= OPEN_CONSTANT_REQUESTS, per_file
    proxy.reset()
    assert same_array(ck["layers.7.k"].full(), tensors["layers.7.k"])  # the headers read at open hold the offsets
    assert {r.path.rsplit("/", 1)[-1] for r in proxy.requests} == {f"model-00008-of-{HF_SHARDS:05d}.safetensors"}


# ---------------------------------------------------------------------------
# the on-disk range cache
# ---------------------------------------------------------------------------


def _data_requests(proxy: CountingProxy) -> list[Any]:
    """GETs of objects, ranged or whole: reads of their bytes (HEADs and bucket listings ask for sizes and names)."""
    return [r for r in proxy.requests if r.method == "GET" and "list-type=" not in r.query and r.path != f"/{BUCKET}"]


def test_second_open_and_region_read_from_the_cache_make_no_data_requests(big, big_urls, s3, s3_proxy, tmp_path):
    _, weight = big
    options, url, cache = s3.storage_options_via(s3_proxy.url), f"s3://{BUCKET}/big/{big_urls['dcp'][0]}", tmp_path
    first = tm.open(url, storage_options=options, cache=cache)
    assert same_array(first["w"][REGION_ROWS, REGION_COLS], weight[REGION_ROWS, REGION_COLS])
    assert _data_requests(s3_proxy)
    s3_proxy.reset()
    second = tm.open(url, storage_options=options, cache=cache)
    assert same_array(second["w"][REGION_ROWS, REGION_COLS], weight[REGION_ROWS, REGION_COLS])
    assert _data_requests(s3_proxy) == []
    assert s3_proxy.bytes_sent < 4096  # what is left: asking for sizes and versions, not bytes
    assert {p.name for p in cache.iterdir()} == {"ranges-v1"}


def test_a_changed_object_is_not_served_stale_from_the_cache(s3, s3_proxy, tmp_path):
    """With no revalidation time, every open asks the version (test_remote_cache.py has the time itself)."""
    from tensormorph.storage.range_cache import RangeCache

    options, url, cache = s3.storage_options_via(s3_proxy.url), f"s3://{BUCKET}/changing/model.safetensors", tmp_path
    folder = tmp_path / "src"
    folder.mkdir()
    old = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    new = {"w": -old["w"]}  # the same size and header: only the data bytes differ
    for values in (old, new):
        safetensors.numpy.save_file(values, str(folder / "model.safetensors"))
        s3.upload(folder / "model.safetensors", url)
        ck = tm.open(url, storage_options=options, cache=RangeCache(cache / "cache", revalidate_after_s=0))
        assert same_array(ck["w"][1:5, 2:6], values["w"][1:5, 2:6])


# ---------------------------------------------------------------------------
# diff with a local side and a remote side
# ---------------------------------------------------------------------------


def test_diff_of_a_local_and_a_remote_checkpoint(cases, s3, s3_proxy, tmp_path, monkeypatch):
    """diff() opens paths itself and takes no storage_options: a URL side gets its credentials and endpoint from
    the environment, as s3fs reads them; an opened remote Checkpoint is accepted as it is."""
    local = cases["hf-safetensors"].local
    url = s3_url("hf-safetensors", cases["hf-safetensors"])
    remote = tm.open(url, storage_options=s3.storage_options_via(s3_proxy.url), cache=False)
    report = tm.diff(local, remote)
    assert report.identical and report.counts["equal"] == len(remote) > 0

    monkeypatch.setenv("TENSORMORPH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_proxy.url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3_proxy.reset()
    by_url = tm.diff(local, url)
    assert by_url.identical and by_url.counts == report.counts
    assert s3_proxy.requests
    changed = tm.diff(cases["dcp"].local, url)
    assert not changed.identical


def test_a_remote_diff_reads_ahead_and_reports_what_a_local_one_does(tmp_path):
    """With a remote side the diff reads the next block of both sides while comparing one; the report is the same
    as the local diff's, for an equal tensor, for one that differs in its last block, and when it stops early."""
    import uuid

    import fsspec

    values = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    changed = values.copy()
    changed[-1, -1] += 1.0
    for name, data in (("a", {"same": values, "changed": values}), ("b", {"same": values, "changed": changed})):
        (tmp_path / name).mkdir()
        safetensors.numpy.save_file(data, str(tmp_path / name / "model.safetensors"))
    url = f"memory://diff-{uuid.uuid4().hex}"
    stored = (tmp_path / "b" / "model.safetensors").read_bytes()
    fsspec.filesystem("memory").pipe_file(f"{url}/model.safetensors", stored)
    local = tm.diff(tmp_path / "a", tmp_path / "b", block_bytes=8 * 1024)
    remote = tm.diff(tmp_path / "a", tm.open(url, cache=False), block_bytes=8 * 1024)
    assert [(t.name, t.status, t.max_abs, t.mismatches, t.worst_index) for t in remote.tensors] == \
        [(t.name, t.status, t.max_abs, t.mismatches, t.worst_index) for t in local.tensors]
    assert {t.name: t.status for t in remote.tensors} == {"changed": "different", "same": "equal"}
