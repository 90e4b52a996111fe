"""Orbax checkpoints from URLs: an S3 bucket (moto's real S3 server, with keys it checks) and an HTTP server that
honours Range, read through tensorstore's own `s3` and `http` drivers (formats/orbax/kvstores.py).

The checkpoints are written by the real orbax-checkpoint (tests/fixtures/orbax_builders.py); the truth is the values
they were saved from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fixtures import orbax_builders
from fixtures.cache import cached_build
from remote_support import CountingProxy, HubServer, S3Endpoint

import tensormorph as tm
from tensormorph.errors import CheckpointError, UnsupportedError

pytestmark = pytest.mark.timeout(300)
BUCKET = "orbax"


@pytest.fixture(scope="module")
def built() -> Path:
    return cached_build("orbax", orbax_builders, orbax_builders.build)


@pytest.fixture(scope="module")
def s3(built: Path) -> Iterator[S3Endpoint]:
    with S3Endpoint(auth=True) as endpoint:  # moto checks every request's signature against the keys it made
        endpoint.make_bucket(BUCKET)
        endpoint.upload(built, f"s3://{BUCKET}/runs")
        yield endpoint


@pytest.fixture(scope="module")
def http(built: Path) -> Iterator[tuple[HubServer, CountingProxy]]:
    with HubServer() as hub, CountingProxy(origin(hub)) as proxy:
        hub.add("r/orbax", built)
        yield hub, proxy


def origin(hub: HubServer) -> str:
    """The hub's scheme, host and port, which the counting proxy forwards to."""
    return hub.url_for("r/orbax", "").split("/r/orbax/")[0]


def assert_holds(ck: tm.Checkpoint, step: int, objects: tuple[str, ...]) -> None:
    expected = orbax_builders.values(step)
    assert sorted(ck) == sorted(orbax_builders.arrays(step))
    for name in ck:
        got, want = ck[name].full(), expected[name]
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
    assert {name: ck.objects[name].value() for name in objects} == {name: expected[name] for name in objects}


@pytest.mark.parametrize(("layout", "step", "objects"), [
    ("pytree", 2, ("lr", "name", "step")),  # OCDBT, sharded zarr3
    ("no_ocdbt", 2, ("lr", "name", "step")),  # plain chunk files
    ("manager", 2, ("lr", "step")),  # a CheckpointManager root: its latest step
])
def test_s3_checkpoints_equal_what_was_saved(s3: S3Endpoint, layout: str, step: int, objects: tuple[str, ...]) -> None:
    with tm.open(f"s3://{BUCKET}/runs/{layout}", storage_options=s3.storage_options, cache=False) as ck:
        assert ck.format == "orbax" and "_METADATA" in "".join(ck.files)
        assert_holds(ck, step, objects)
        kernel = orbax_builders.values(step)["params.dense.kernel"]
        assert ck["params.dense.kernel"][30:34, 20:30].tobytes() == kernel[30:34, 20:30].tobytes()
        assert ck["params.dense.kernel"].placement is not None


def test_s3_keys_are_checked_and_a_wrong_one_is_one_clear_error(s3: S3Endpoint) -> None:
    wrong = {**s3.storage_options, "secret": "not-the-secret"}
    with (pytest.raises(CheckpointError) as caught,
          tm.open(f"s3://{BUCKET}/runs/no_ocdbt", storage_options=wrong, cache=False) as ck):
        ck["params.dense.kernel"].full()
    assert "\n" not in str(caught.value) and "runs/no_ocdbt" in str(caught.value)
    assert "403" in str(caught.value) or "Forbidden" in str(caught.value) or "denied" in str(caught.value).lower()


def test_tm_load_fills_torch_tensors_from_s3(s3: S3Endpoint) -> None:
    expected = orbax_builders.arrays(2)
    state = {"params.dense.kernel": torch.zeros(64, 48), "params.embed.table": torch.zeros(40, 16),
             "params.ids": torch.zeros(10, dtype=torch.int32)}
    report = tm.load(f"s3://{BUCKET}/runs/pytree", state, strict=False, storage_options=s3.storage_options)
    assert report.format == "orbax" and report.tensors_loaded == 3 and report.missing == []
    for name, tensor in state.items():
        assert tensor.numpy().tobytes() == expected[name].tobytes(), name


def test_http_item_folders_and_region_reads_fetch_only_their_chunks(http: tuple[HubServer, CountingProxy]) -> None:
    hub, proxy = http
    with tm.open(hub.url_for("r/orbax", "pytree").replace(origin(hub), proxy.url), cache=False) as ck:
        assert ck.files == ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "_sharding")
        kernel = orbax_builders.values(2)["params.dense.kernel"]  # (64, 48) in chunks of (32, 24)
        proxy.reset()
        assert ck["params.dense.kernel"][0:8, 0:8].tobytes() == kernel[0:8, 0:8].tobytes()
        one_chunk = proxy.bytes_sent
        proxy.reset()
        assert ck["params.dense.kernel"].full().tobytes() == kernel.tobytes()
        assert 0 < one_chunk < proxy.bytes_sent / 2  # one of four chunks, not the whole array
        assert_holds(ck, 2, ("lr", "name", "step"))
    step = hub.url_for("r/orbax", "manager/2")
    with pytest.raises(UnsupportedError, match="HTTP has no listing"):
        tm.open(step, cache=False)
    with tm.open(hub.url_for("r/orbax", "manager/2/default"), cache=False) as ck:
        assert_holds(ck, 2, ("lr", "step"))


def test_other_protocols_are_refused_by_name(tmp_path: Path, built: Path) -> None:
    import fsspec

    memory = fsspec.filesystem("memory")
    for file in (built / "no_ocdbt").rglob("*"):
        if file.is_file():
            memory.pipe(f"/orbax/{file.relative_to(built / 'no_ocdbt').as_posix()}", file.read_bytes())
    with pytest.raises(UnsupportedError, match=r"s3://, http://, https:// URLs only"):
        tm.open("memory://orbax", cache=False)
