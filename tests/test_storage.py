"""The byte-store contract, kept the same by both stores: a local folder and an fsspec prefix (memory://)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import fsspec
import pytest

from tensormorph.errors import MissingFileError, TruncatedFileError, UnsafePathError
from tensormorph.storage import ByteStore, LocalFiles, RemoteFiles

FILES = {"a.bin": bytes(range(256)) * 40, "sub/b.json": b'{"k": [1, 2, 3]}'}


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path: Path) -> ByteStore:
    if request.param == "local":
        for name, data in FILES.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_bytes(data)
        os.symlink("/etc/hostname", tmp_path / "outside")  # a link that leaves the folder is no file of it
        return LocalFiles(tmp_path)
    url = f"memory://store-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for name, data in FILES.items():
        fs.pipe_file(f"{url}/{name}", data)
    return RemoteFiles(url)


def test_both_stores_keep_the_protocol(store: ByteStore):
    assert isinstance(store, ByteStore)
    assert store.mappable == isinstance(store, LocalFiles)
    assert store.is_dir() and store.is_dir("sub") and not store.is_dir("a.bin")
    assert [n for n in store.listdir() if n != "outside"] == ["a.bin", "sub"] and store.listdir("sub") == ["b.json"]
    assert store.head("a.bin", 5) == FILES["a.bin"][:5] and store.head("nope.bin", 5) == b""
    whole = store.buffer("a.bin")
    assert len(whole) == len(FILES["a.bin"]) and bytes(whole[1000:1010]) == FILES["a.bin"][1000:1010]
    assert whole[7] == FILES["a.bin"][7]
    assert store.list() == sorted(FILES)
    assert store.exists("a.bin") and not store.exists("nope.bin")
    assert store.size("a.bin") == len(FILES["a.bin"])
    data = FILES["a.bin"]
    assert store.read("a.bin", 300, 20) == data[300:320]
    assert store.read_json("sub/b.json", 1024) == {"k": [1, 2, 3]}
    runs = [(0, 3), (5, 9), (4000, 4100), (9000, 10240)]
    target = bytearray(sum(end - begin for begin, end in runs))
    store.read_runs("a.bin", runs, memoryview(target))
    assert bytes(target) == b"".join(data[begin:end] for begin, end in runs)
    assert store.read_ranges("a.bin", runs) == [data[begin:end] for begin, end in runs]
    into = bytearray(100)
    store.read_into("a.bin", 10, memoryview(into))
    assert bytes(into) == data[10:110]
    assert store.describe("a.bin").endswith("a.bin")


def test_both_stores_refuse_the_same_bad_requests(store: ByteStore):
    with pytest.raises(MissingFileError, match="missing"):
        store.size("nope.bin")
    with pytest.raises(TruncatedFileError):
        store.read("a.bin", len(FILES["a.bin"]) - 4, 8)
    for name in ("../x", "/etc/passwd"):
        with pytest.raises(UnsafePathError, match="outside"):
            store.describe(name, referrer="index.json")
