"""How many requests a remote store keeps in flight: the first reads of a checkpoint of many files go out at once,
PREFETCH_CONCURRENCY at a time (the server's cost per request sets their pace; more in flight only queue there)."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import pytest

from tensormorph.storage import remote as remote_module
from tensormorph.storage import remote_context
from tensormorph.storage.remote import RemoteFiles

FILES = 40
ANSWER_S = 0.01  # each size request takes this long, so that those sent at once overlap


def test_prefetch_keeps_prefetch_concurrency_requests_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"memory://many-{uuid.uuid4().hex}"
    for k in range(FILES):
        fsspec.filesystem("memory").pipe_file(f"{url}/{k}.bin", bytes([k]) * (k + 1))
    files = RemoteFiles(url)
    asked = files.remote.info
    lock, in_flight, most, names = threading.Lock(), [0], [0], []

    def counted(target: str, **options: Any) -> dict[str, Any] | None:
        # known, or tried at once first (it raises WouldAsk instead of asking): no request
        if target in files.remote.infos or getattr(remote_context._no_requests, "on", False):
            return asked(target, **options)
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            names.append(target.rsplit("/", 1)[-1])
        time.sleep(ANSWER_S)
        try:
            return asked(target, **options)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(files.remote, "info", counted)
    files.prefetch([f"{k}.bin" for k in range(FILES)])
    assert most[0] == remote_module.PREFETCH_CONCURRENCY < FILES
    assert sorted(names) == sorted(f"{k}.bin" for k in range(FILES))  # each file asked once
    assert [files.size(f"{k}.bin") for k in range(FILES)] == [k + 1 for k in range(FILES)]
    assert files.read(f"{FILES - 1}.bin", 0, 3) == bytes([FILES - 1]) * 3


def test_a_block_asked_for_by_several_threads_at_once_is_fetched_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lazy parse (a DCP item's zip) reads small aligned blocks; two threads parsing neighbouring items share the
    block between them: one request, and both get its bytes."""
    url = f"memory://blocks-{uuid.uuid4().hex}"
    data = bytes(range(256)) * 64  # 16 KiB: 4 blocks
    fsspec.filesystem("memory").pipe_file(f"{url}/f.bin", data)
    files = RemoteFiles(url)
    read_ranges, asked = files.read_ranges, []

    def slow(name: str, runs: list[tuple[int, int]]) -> list[bytes]:
        asked.extend(begin for begin, _ in runs)
        time.sleep(ANSWER_S)
        return read_ranges(name, runs)

    monkeypatch.setattr(files, "read_ranges", slow)
    block = remote_module.HEAD_BLOCK
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: files.blocks("f.bin", [k % 2, 2])[0], range(8)))
    assert got == [data[(k % 2) * block:(k % 2 + 1) * block] for k in range(8)]
    assert sorted(asked) == [0, block, 2 * block]


@pytest.mark.parametrize("use_obstore", [True, False])
def test_an_s3_checkpoint_opens_and_reads_without_building_s3fs_client_where_obstore_can(use_obstore, tmp_path,
                                                                                         monkeypatch):
    """Where obstore reads the ranges, it also asks the first bytes (with the size and version) and lists the
    folder: s3fs's client (a fifth of a second of CPU to build) is never made, and the requests are the same."""
    import numpy as np
    import safetensors.numpy
    from remote_support import CountingProxy, S3Endpoint

    import tensormorph as tm
    from tensormorph.storage import obstore_ranges

    monkeypatch.setattr(obstore_ranges, "USE_OBSTORE", use_obstore)
    values = {f"w{k}": np.arange(k * 100, k * 100 + 60, dtype=np.float32).reshape(6, 10) for k in range(3)}
    (tmp_path / "ck").mkdir()
    safetensors.numpy.save_file(values, str(tmp_path / "ck" / "model.safetensors"))
    with S3Endpoint() as s3, CountingProxy(s3.endpoint) as proxy:
        s3.make_bucket("opens")
        s3.upload(tmp_path / "ck", "s3://opens/ck")
        options = {**s3.storage_options_via(proxy.url), "skip_instance_cache": True}
        with tm.open("s3://opens/ck", storage_options=options, cache=False) as ck:
            assert {n: ck[n].full().tolist() for n in ck} == {n: v.tolist() for n, v in values.items()}
            assert (ck.storage.fs._s3 is None) is use_obstore  # s3fs makes its client at its first request
        # the folder's URL asked as an object (none), its listing, the file's first bytes, one read per tensor
        assert [(r.method, r.status) for r in proxy.requests][:3] == [("GET", 404), ("GET", 200), ("GET", 206)]
        assert len(proxy.requests) == 3 + len(values)


@pytest.mark.parametrize("use_obstore", [True, False])
@pytest.mark.parametrize("new_client", [True, False])
def test_a_reopening_asks_nothing_with_the_process_client_or_a_new_one(use_obstore, new_client, tmp_path, monkeypatch):
    """A second and third open from the range cache (each with a new RangeCache on the same folder, as a new
    command makes) ask nothing: the folder's listing and the file's version come from the cache's records, its
    header from the cache. With obstore, s3fs's client is never built at all."""
    import numpy as np
    import safetensors.numpy
    from remote_support import CountingProxy, S3Endpoint

    import tensormorph as tm
    from tensormorph.storage import obstore_ranges
    from tensormorph.storage.range_cache import RangeCache

    monkeypatch.setattr(obstore_ranges, "USE_OBSTORE", use_obstore)
    values = {"w": np.arange(60, dtype=np.float32).reshape(6, 10)}
    (tmp_path / "ck").mkdir()
    safetensors.numpy.save_file(values, str(tmp_path / "ck" / "model.safetensors"))
    with S3Endpoint() as s3, CountingProxy(s3.endpoint) as proxy:
        s3.make_bucket("reopens")
        s3.upload(tmp_path / "ck", "s3://reopens/ck")
        options = {**s3.storage_options_via(proxy.url), **({"skip_instance_cache": True} if new_client else {})}
        asked, built = [], []
        for _ in range(3):
            before = len(proxy.requests)
            with tm.open("s3://reopens/ck", storage_options=options, cache=RangeCache(tmp_path / "cache")) as ck:
                assert ck["w"].full().tolist() == values["w"].tolist()
                built.append(ck.storage.fs._s3 is not None)
            asked.append(len(proxy.requests) - before)
        assert asked[0] == 3 and asked[1:] == [0, 0], asked  # the root asked as an object, its listing, the file
        # s3fs's client is built by its first request, if any: a new one asks nothing, the process's one stays
        assert built == [not use_obstore] + [not use_obstore and not new_client] * 2
