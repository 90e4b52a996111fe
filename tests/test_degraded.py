"""Degraded files of an rs(4,2) checkpoint: a rebuild streams through a bounded buffer, and a degraded load
rebuilds the ranges it reads from the same ranges of the stripe's other files.

The checkpoint is a real safetensors file (written by the safetensors library) converted to a 4-rank
Tensormorph checkpoint with rs(4,2) parity; its rank files differ in size, so the stripe is padded and each
file ends mid-segment. Rebuilds are checked bit-exact against the files themselves and loads against the
intact load; the memory a rebuild holds is measured with tracemalloc against parity.CODING_BUFFER.
"""

from __future__ import annotations

import dataclasses
import shutil
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import tensormorph as tm
from tensormorph.errors import CheckpointError
from tensormorph.ops.repair import repair
from tensormorph.storage import LocalFiles
from tensormorph.tmformat import parity, writer
from tensormorph.tmformat.checkpoint import read_manifest
from tensormorph.tmformat.recovery import all_files, rebuilt_ranges, recover

DATA = [f"rank-{r:05d}.safetensors" for r in range(4)]
PARITY = ["parity-00000-0.bin", "parity-00000-1.bin"]
DTYPES = {"embed": torch.float32, "odd": torch.int32, "bias": torch.float32}
SEGMENT = 64 * 1024  # decoding with another segment than the save's is exact: RS codes each byte column alone
BUFFER = 768 * 1024  # the CODING_BUFFER these tests allow: two steps of the 4-wide stripe, a third of a file


@pytest.fixture(scope="module")
def protected(tmp_path_factory):
    """~9 MiB of tensors in one safetensors file, converted to 4 ranks with rs(4,2)."""
    folder = tmp_path_factory.mktemp("degraded")
    rng = np.random.default_rng(17)
    tensors = {"embed": rng.standard_normal((1000, 1500), dtype=np.float32),  # rows split 250 per rank
               "odd": rng.integers(0, 2**31, (1003, 777), dtype=np.int32),  # rows 251/251/251/250: files differ
               "bias": rng.standard_normal(13, dtype=np.float32)}
    source = folder / "src"
    source.mkdir()
    save_file(tensors, str(source / "model.safetensors"))
    out = folder / "ck"
    tm.convert(source, out, to="tensormorph", mesh=4, placements=["Shard(0)"], redundancy="rs(4,2)")
    return out


@pytest.fixture(scope="module")
def fine(tmp_path_factory, protected):
    """The same checkpoint with a SEGMENT-byte segment recorded in its manifest (the writer's 4 MiB exceeds these
    files), so a load's rebuild is bounded by BUFFER well below a file."""
    out = tmp_path_factory.mktemp("fine") / "ck"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writer, "SEGMENT", SEGMENT)
        tm.convert(protected.parent / "src", out, to="tensormorph", mesh=4, placements=["Shard(0)"],
                   redundancy="rs(4,2)")
    return out


@pytest.fixture
def work(protected, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(protected, folder)
    return folder


def _empty_state(folder) -> dict[str, torch.Tensor]:
    ck = tm.open(folder)
    return {name: torch.zeros(ck[name].shape, dtype=DTYPES[name]) for name in ck}


def _load(folder) -> dict[str, bytes]:
    state = _empty_state(folder)
    tm.load(folder, state)
    return {name: t.reshape(-1).view(torch.uint8).numpy().tobytes() for name, t in state.items()}


def _manifest(folder):
    files = LocalFiles(folder)
    manifest = read_manifest(files, str(folder))
    plan = manifest.redundancy
    assert plan is not None
    return files, dataclasses.replace(manifest, redundancy=dataclasses.replace(plan, segment=SEGMENT))


def test_the_files_differ_in_size_and_span_many_segments(protected):
    sizes = sorted(all_files(_manifest(protected)[1])[n].size for n in DATA)
    assert len(set(sizes)) > 1 and sizes[0] > 30 * SEGMENT and sizes[0] % SEGMENT != 0


@pytest.mark.parametrize("lost", DATA + PARITY)
def test_rebuild_streams_bit_exact_within_the_coding_buffer(protected, monkeypatch, lost):
    monkeypatch.setattr(parity, "CODING_BUFFER", BUFFER)
    files, manifest = _manifest(protected)
    intact = set(all_files(manifest)) - {lost}

    def read(name: str, begin: int, end: int) -> bytes:
        return files.read(name, begin, end - begin)

    truth = (protected / lost).read_bytes()
    tracemalloc.start()
    try:
        size = sum(len(piece) for piece in recover(manifest, lost, intact, read))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # in flight: at most BUFFER of inputs and outputs, plus the output being taken; the file is 2 MiB+
    assert size == len(truth) and peak <= BUFFER + 2 * SEGMENT and peak < len(truth) // 2, (size, peak)
    assert b"".join(recover(manifest, lost, intact, read)) == truth


@pytest.mark.parametrize("lost", DATA)
def test_any_ranges_of_a_lost_file_are_rebuilt_bit_exact(protected, monkeypatch, lost):
    monkeypatch.setattr(parity, "CODING_BUFFER", BUFFER)
    files, manifest = _manifest(protected)
    truth = (protected / lost).read_bytes()
    rebuilt = rebuilt_ranges(manifest, lost, set(all_files(manifest)) - {lost},
                             lambda name, offset, into: files.read_runs(name, [(offset, offset + len(into))], into))
    whole = bytearray(len(truth))
    tracemalloc.start()
    try:
        rebuilt.read_runs([(0, len(truth))], memoryview(whole))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # straight into the destination: only the decoding's k pieces, within BUFFER
    assert whole == truth and peak <= BUFFER and peak < len(truth) // 2, peak
    assert rebuilt.read_ranges([(100, 200), (len(truth) - 10, len(truth))]) == [truth[100:200], truth[-10:]]
    rng = np.random.default_rng(3)
    cuts = np.sort(rng.choice(len(truth), 40, replace=False)).tolist()  # runs of any length, at any offset
    runs = list(zip(cuts[::2], cuts[1::2]))
    into = bytearray(sum(e - b for b, e in runs))
    rebuilt.read_runs(runs, memoryview(into))
    assert bytes(into) == b"".join(truth[b:e] for b, e in runs)
    with pytest.raises(CheckpointError, match="outside the"):
        rebuilt.read_runs([(len(truth) - 4, len(truth) + 4)], memoryview(bytearray(8)))


def test_a_consumer_that_stops_early_leaves_no_thread_running(protected):
    import threading

    files, manifest = _manifest(protected)
    stream = recover(manifest, DATA[2], set(all_files(manifest)) - {DATA[2]},
                     lambda n, b, e: files.read(n, b, e - b))
    first = next(stream)
    stream.close()
    assert first == (protected / DATA[2]).read_bytes()[:SEGMENT]
    assert not [t for t in threading.enumerate() if t.name.startswith("tm-coding")]


@pytest.mark.parametrize("lost", [(DATA[1],), (DATA[3], PARITY[0]), (DATA[0], DATA[2])],
                         ids=["one-data", "data+parity", "two-data"])
def test_degraded_load_equals_the_intact_load_and_repair_restores_the_files(work, protected, lost):
    truth = _load(protected)
    for name in lost:
        (work / name).unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _load(work) == truth
    assert sorted(str(w.message).split(":")[0].rsplit("/", 1)[-1] for w in caught) == sorted(set(lost) & set(DATA))
    report = repair(work)
    assert sorted(report.repaired) == sorted(lost) and report.ok
    for name in lost:
        assert (work / name).read_bytes() == (protected / name).read_bytes()


@pytest.mark.parametrize("lost", [(DATA[1],), (DATA[1], DATA[2])], ids=["one-file", "two-files"])
def test_a_degraded_load_holds_no_more_than_the_coding_buffer(fine, tmp_path, monkeypatch, lost):
    """The bound is the load's, however many files it rebuilds: they share one set of decoding buffers."""
    monkeypatch.setattr(parity, "CODING_BUFFER", BUFFER)
    folder = tmp_path / "ck"
    shutil.copytree(fine, folder)
    truth = _load(folder)  # also the first load's one-time allocations (imports, caches), out of the measure

    def peak_of_load() -> int:
        state = _empty_state(folder)
        tracemalloc.start()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tm.load(folder, state)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            assert {n: t.reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in state.items()} == truth

    intact = peak_of_load()
    size = (folder / DATA[1]).stat().st_size
    for name in lost:
        (folder / name).unlink()
    degraded = peak_of_load()
    assert degraded <= intact + BUFFER + 2 * SEGMENT and degraded < size // 2, (intact, degraded, size)


def test_a_damaged_parity_file_is_named_when_the_rebuild_fails(work):
    (work / DATA[1]).unlink()
    (work / DATA[2]).unlink()
    with open(work / PARITY[1], "r+b") as f:  # one flipped bit: the parity file is there, its bytes are wrong
        f.seek(12345)
        byte = f.read(1)[0]
        f.seek(12345)
        f.write(bytes([byte ^ 4]))
    with pytest.raises(CheckpointError, match="cannot be rebuilt from rs\\(4,2\\)") as info, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load(work)
    message = str(info.value)
    assert PARITY[1] in message and DATA[2] in message and "Unrecoverable tensors" in message
    report = repair(work)
    assert PARITY[1] in report.unrecoverable[DATA[1]] and not report.ok


@pytest.mark.parametrize("verify", [True, False])
def test_a_rebuild_from_a_damaged_file_is_caught_and_made_from_the_intact_ones(protected, tmp_path, verify):
    """With DATA[1] lost, the first rebuild reads PARITY[0], whose bytes are damaged: the rebuilt bytes fail their
    block checksums (checked even when the load was asked not to verify), and the load rebuilds them again from the
    files whose whole CRC-32C is right (the three other data files and PARITY[1])."""
    folder = tmp_path / "ck"
    shutil.copytree(protected, folder)
    truth = _load(protected)
    (folder / DATA[1]).unlink()
    with open(folder / PARITY[0], "r+b") as f:
        f.seek(777)
        byte = f.read(1)[0]
        f.seek(777)
        f.write(bytes([byte ^ 1]))
    state = _empty_state(folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tm.load(folder, state, verify=verify)
    assert {n: t.reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in state.items()} == truth
    assert [str(w.message).split(":")[0].rsplit("/", 1)[-1] for w in caught] == [DATA[1]]
