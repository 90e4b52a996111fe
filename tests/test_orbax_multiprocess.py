"""Orbax checkpoints saved by several JAX processes (tests/fixtures/orbax_builders.build_multiprocess: 2 processes
of 2 CPU devices each, global arrays on the 2x2 mesh). Each process writes the chunks of its own devices into its own
OCDBT database, `ocdbt.process_N/`; at the end of the save Orbax merges them into the root `manifest.ocdbt`, which
references their data files, and Orbax's restore reads that root only. Read here without JAX and compared bit for bit
with the values saved (which every writing process checked against Orbax's own restore).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fixtures import orbax_builders
from fixtures.cache import cached_build
from test_orbax import assert_bit_exact

import tensormorph as tm
from tensormorph.errors import CheckpointError, UnsupportedError
from tensormorph.formats.orbax.arrays import ZarrBox

pytestmark = pytest.mark.timeout(300)

EXPECTED = orbax_builders.values(orbax_builders.MP_STEP)
INLINE_BYTES = 1024  # Orbax's OCDBT max_inline_value_bytes: smaller values live in the B-tree itself
ITEM = f"{orbax_builders.MP_STEP}/default"  # the manager's step folder and its one item


@pytest.fixture(scope="module")
def built() -> Path:
    return cached_build("orbax_multiprocess", orbax_builders, orbax_builders.build_multiprocess)


def process_keys(item: Path) -> dict[int, dict[str, bytes]]:
    """Each per-process OCDBT database's keys and stored values, read with tensorstore on its own."""
    import tensorstore as ts

    out = {}
    for folder in sorted(item.glob("ocdbt.process_*")):
        kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": f"{folder}/"}}).result()
        out[int(folder.name.removeprefix("ocdbt.process_"))] = {
            key.decode(): bytes(kv.read(key).result().value) for key in kv.list().result()}
    return out


def test_opens_with_the_values_orbax_restores(built: Path) -> None:
    assert tm.detect(built / "multiprocess") == "orbax"
    with tm.open(built / "multiprocess") as ck:  # the manager root: its latest (only) step
        assert ck.metadata["step"] == orbax_builders.MP_STEP and ck.metadata["use_ocdbt"] is True
        arrays = {k: v for k, v in EXPECTED.items() if isinstance(v, np.ndarray)}
        assert sorted(ck.keys()) == sorted(arrays)
        for name, expected in arrays.items():
            assert_bit_exact(ck[name].full(), expected)
        assert_bit_exact(ck["params.dense.kernel"][30:34, 20:28], EXPECTED["params.dense.kernel"][30:34, 20:28])
        assert {name: ck.objects[name].value() for name in ("step", "lr")} == {
            "step": EXPECTED["step"], "lr": EXPECTED["lr"]}


def test_each_chunk_comes_from_the_process_that_wrote_it(built: Path) -> None:
    """Every chunk key is in exactly one process's database, a process owning a device that holds the chunk, and the
    root database serves that process's stored bytes; both processes wrote chunks of the row-sharded arrays."""
    device_process = {int(k): v for k, v in json.loads((built / "devices.json").read_text()).items()}
    assert sorted(device_process.values()) == [0, 0, 1, 1]
    stores = process_keys(built / "multiprocess" / ITEM)
    assert sorted(stores) == [0, 1]
    writers: dict[str, set[int]] = {}
    with tm.open(built / "multiprocess") as ck:
        root = ck["params.dense.kernel"].chunks[0].source.zarr.store
        for name, tensor in ck.items():
            for chunk in tensor.chunks:
                source = chunk.source
                assert isinstance(source, ZarrBox)
                holders = [p for p, keys in stores.items() if source.key in keys]
                assert len(holders) == 1, (source.key, holders)
                assert holders[0] in {device_process[r] for r in chunk.ranks}, (source.key, chunk.ranks)
                assert root.read_many([source.key]) == [stores[holders[0]][source.key]]
                writers.setdefault(name, set()).add(holders[0])
                box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))
                assert_bit_exact(source.array(), EXPECTED[name][box])
        kernel_rows = {c.offsets[0]: c.ranks for c in ck["params.dense.kernel"].chunks}
    assert writers["params.dense.kernel"] == writers["params.embed.table"] == {0, 1}
    assert {device_process[r] for r in kernel_rows[32]} == {1}  # rows 32-63 live on the second process's devices


def test_placement_and_ranks_are_the_global_devices(built: Path) -> None:
    devices = sorted(int(k) for k in json.loads((built / "devices.json").read_text()))
    with tm.open(built / "multiprocess") as ck:
        kernel = ck["params.dense.kernel"]
        assert kernel.placement is not None
        assert (kernel.placement.mesh_shape, kernel.placement.placements) == ((2, 2), ("Shard(0)", "Shard(1)"))
        assert [(c.offsets, c.ranks) for c in kernel.chunks] == [
            ((0, 0), (devices[0],)), ((0, 24), (devices[1],)), ((32, 0), (devices[2],)), ((32, 24), (devices[3],))]
        bias = ck["params.dense.bias"]  # replicated over "data": each piece on one device of each process
        assert bias.placement is not None and bias.placement.placements == ("Replicate()", "Shard(0)")
        assert {c.ranks for c in bias.chunks} == {(devices[0], devices[2]), (devices[1], devices[3])}


def test_verify_and_a_lost_process_database(built: Path, tmp_path: Path) -> None:
    """The merge copies each process's B-tree into the root: values up to Orbax's max_inline_value_bytes (1024) are
    inline in it, larger ones stay in the process's data files. Losing process 1's data files loses exactly its
    large chunks (the kernel's rows 32-63), and verify and reads name them."""
    folder = tmp_path / "step"
    shutil.copytree(built / "multiprocess" / str(orbax_builders.MP_STEP), folder)
    report = tm.verify(folder)
    assert report.ok and not report.problems and report.checksums_checked == 4 + 4 + 4 + 1
    large = sorted(key for key, value in process_keys(folder / "default")[1].items() if len(value) > INLINE_BYTES)
    assert large == ["params.dense.kernel/1.0", "params.dense.kernel/1.1"]
    for data in (folder / "default" / "ocdbt.process_1" / "d").iterdir():
        data.unlink()  # the second process's data files are gone; the root still references them
    report = tm.verify(folder)
    assert sorted(p.message.split()[1] for p in report.problems) == large
    assert {p.tensor for p in report.problems} == {"params.dense.kernel"}
    with tm.open(folder) as ck:
        assert_bit_exact(ck["params.dense.kernel"][:32], EXPECTED["params.dense.kernel"][:32])  # process 0's rows
        assert_bit_exact(ck["params.embed.table"].full(), EXPECTED["params.embed.table"])  # inline in the root
        with pytest.raises(CheckpointError, match="cannot be read") as caught:
            ck["params.dense.kernel"][32:]
    assert caught.value.tensor == "params.dense.kernel" and "manifest.ocdbt:params.dense.kernel/1." in caught.value.file


def test_unmerged_process_databases_are_refused(built: Path, tmp_path: Path) -> None:
    """Without the merged root (a save that stopped before its finalize), Orbax's restore finds nothing (its spec is
    the root database); we refuse it with a message that says why, rather than guess."""
    folder = tmp_path / "item"
    shutil.copytree(built / "multiprocess" / ITEM, folder)
    (folder / "manifest.ocdbt").unlink()
    shutil.rmtree(folder / "d", ignore_errors=True)
    with pytest.raises(UnsupportedError, match="per-process OCDBT databases") as caught:
        tm.open(folder)
    assert caught.value.file.endswith("manifest.ocdbt")


def test_the_cache_holds_a_row_of_chunks(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """C-order band reads decode every chunk of a row of chunks: the cache is sized to hold the widest such row
    (with its margin), so that each band does not decode them again. Here with the floor lowered below that row."""
    from tensormorph.formats.orbax import arrays

    monkeypatch.setattr(arrays, "CACHE_BYTES", 1000)
    with tm.open(built / "multiprocess") as ck:
        source = ck["params.dense.kernel"].chunks[0].source
        assert isinstance(source, ZarrBox)
        row = 32 * 48 * 4  # the kernel's chunks are (32, 24) float32, two across: the widest row of chunks
        assert source.zarr.store.cache_bytes == int(row * arrays.CACHE_MARGIN)
        assert_bit_exact(ck["params.dense.kernel"].full(), EXPECTED["params.dense.kernel"])
    monkeypatch.setattr(arrays, "MAX_CACHE_BYTES", 4096)
    with tm.open(built / "multiprocess") as ck:
        source = ck["params.dense.kernel"].chunks[0].source
        assert isinstance(source, ZarrBox) and source.zarr.store.cache_bytes == 4096
