"""Hostile torch.save zip archives: mutated storages, zip structure and pickles (see hostile_support)."""

from __future__ import annotations

import functools
import io
import json
import pickle
import struct
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch  # a dev dependency: the seeds are made by torch itself
from hostile_support import (
    FUZZ,
    ReferenceUnpickler,
    Refused,
    archive_verdict,
    edits,
    huge_memo_index,
    mutate,
    outcome,
    reference_stream,
    torch_zip,
)
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph import torchzip
from tensormorph.errors import CheckpointError, HeaderError, TruncatedFileError, UnsafePickleError, UnsupportedError

pytestmark = pytest.mark.timeout(120)


@functools.cache
def torch_seed_bytes() -> bytes:
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {
        "w": w,
        "row": w[1],  # shares w's storage at an offset
        "t": torch.arange(12, dtype=torch.float32).reshape(4, 3).t(),  # non-contiguous
        "h": torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16),
        "i": torch.tensor([[1, -2], [3, 2**40]], dtype=torch.int64),
        "m": torch.tensor([True, False, True]),
        "nested": {"list": [torch.ones(2), torch.zeros(1, dtype=torch.float64)], "step": 3, "name": "x", "lr": 0.5},
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def torch_seed() -> bytes:
    return torch_seed_bytes()


def _zip_hot_ranges(blob: bytes) -> list[tuple[int, int]]:
    archive = zipfile.ZipFile(io.BytesIO(blob))
    hot = []
    for info in archive.infolist():
        start = info.header_offset
        if info.filename.endswith("data.pkl"):
            hot.append((start, start + 30 + len(info.filename) + 64 + info.file_size))
        else:
            hot.append((start, start + 30 + len(info.filename)))
    central = blob.rfind(b"PK\x01\x02", 0, blob.rfind(b"PK\x05\x06"))
    hot.append((blob.find(b"PK\x01\x02"), len(blob)))
    hot.append((central, len(blob)))
    return hot


def test_torch_seed_reads_back(torch_seed: bytes, tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    path.write_bytes(torch_seed)
    state = torch.load(io.BytesIO(torch_seed), weights_only=True)
    with tm.open(path) as ck:
        assert ck.format == "torch"
        for name in ("w", "row", "t", "i", "m"):
            assert np.array_equal(ck[name].full(), state[name].numpy())
        assert ck["h"].full().tobytes() == state["h"].view(torch.int16).numpy().tobytes()
        assert np.array_equal(ck["nested.list.0"].full(), np.ones(2, np.float32))
        assert ck.objects["nested.step"].value() == 3


def flat_state(value: Any, prefix: str = "") -> dict[str, Any]:
    """A torch.load result flattened to dotted names, as the reader names tensors and objects."""
    if isinstance(value, (dict, list, tuple)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return {k: v for key, item in items for k, v in flat_state(item, f"{prefix}{key}.").items()}
    return {prefix[:-1]: value}


def assert_reads_as_torch_loads(path: Path, reference: bytes) -> None:
    """`path` opens (detected) with every tensor bit-exact and every object equal to torch.load(`reference`)."""
    state = flat_state(torch.load(io.BytesIO(reference), weights_only=True))
    with tm.open(path) as ck:
        assert ck.format == "torch" and set(ck) | set(ck.objects) == set(state)
        for name in ck:
            want = state[name].contiguous()
            want = want.view(torch.int16) if want.dtype == torch.bfloat16 else want
            assert ck[name].full().tobytes() == want.numpy().tobytes(), name
        for name, entry in ck.objects.items():
            assert entry.value() == state[name]


def _storage_spans(blob: bytes) -> dict[str, tuple[int, int]]:
    """Where each storage record's bytes lie in a (valid) torch.save archive."""
    spans = {}
    for info in zipfile.ZipFile(io.BytesIO(blob)).infolist():
        if "/data/" in info.filename:
            name_length, extra_length = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
            begin = info.header_offset + 30 + name_length + extra_length
            spans[info.filename.split("/")[-1]] = (begin, begin + info.file_size)
    return spans


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_torch_zip_storage_bytes_mutated_read_the_new_values(data: st.DataObject) -> None:
    """Edits of storage bytes alone (their CRCs now stale: reading does not check them, verify does) open and
    read exactly what torch.load reads from the same storages in a sound archive."""
    seed = torch_seed_bytes()
    pkl, storages = torch_seed_parts_cached()
    spans = _storage_spans(seed)
    blob, edited = bytearray(seed), {key: bytearray(raw) for key, raw in storages.items()}
    for _ in range(data.draw(st.integers(1, 8))):
        key = data.draw(st.sampled_from(sorted(spans)))
        at, value = data.draw(st.integers(0, len(edited[key]) - 1)), data.draw(st.integers(0, 255))
        edited[key][at] = value
        blob[spans[key][0] + at] = value
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.pt"
        path.write_bytes(bytes(blob))
        assert_reads_as_torch_loads(path, torch_zip(pkl, {k: bytes(v) for k, v in edited.items()}))


@FUZZ
@given(data=st.data())
def test_torch_zip_truncated_anywhere_is_refused(data: st.DataObject) -> None:
    """A cut loses the end-of-central-directory record, whatever else was edited: never a checkpoint."""
    seed = torch_seed_bytes()
    changes, _ = data.draw(edits(len(seed), _zip_hot_ranges(seed)))
    blob = mutate(seed, (changes, data.draw(st.integers(0, len(seed) - 1))))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.pt"
        path.write_bytes(blob)
        result = outcome(lambda: tm.open(path, "torch"))
        legacy = len(blob) >= 2 and blob[0] == 0x80  # the legacy pickle format's first byte
        assert type(result) is (UnsupportedError if legacy else HeaderError), result
        assert str(path) in str(result)
        assert isinstance(outcome(lambda: tm.open(path)), CheckpointError)


@settings(FUZZ, suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.filter_too_much])
@given(data=st.data())
def test_torch_zip_structural_edits_as_the_zip_reference_reads_them(data: st.DataObject) -> None:
    """Edits of the zip structure after which the archive reads as the very same one change nothing; those after
    which it cannot be read (see archive_view) are refused. (Edits after which it reads as another archive are
    outcomes of its records, tested one by one in test_torch_zip_structural_damage.)"""
    seed = torch_seed_bytes()
    changes, _ = data.draw(edits(len(seed), _zip_hot_ranges(seed)))
    blob = mutate(seed, (changes, None))
    expected = archive_verdict(blob, seed)
    assume(expected != "undecided")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.pt"
        path.write_bytes(blob)
        if expected is None:
            event("the same archive")
            assert_reads_as_torch_loads(path, seed)
            return
        event(expected.__name__)
        result = outcome(lambda: tm.open(path, "torch"))
        if expected in DAMAGE:
            # with several records damaged, which one is met first depends on the order of reading: a damaged
            # archive is refused as damaged (a bad record or one cut short), never read and never another error
            assert type(result) in DAMAGE, result
        else:
            assert type(result) is expected, result
        assert str(path) in str(result)


DAMAGE = (HeaderError, TruncatedFileError)


def test_torch_detection_of_a_zip_with_an_unsupported_version(torch_seed: bytes, tmp_path: Path) -> None:
    blob = bytearray(torch_seed)
    central = blob.find(b"PK\x01\x02")
    blob[central + 6] = 64  # "version needed to extract" 6.4
    path = tmp_path / "state.pt"
    path.write_bytes(bytes(blob))
    assert isinstance(outcome(lambda: tm.open(path, "torch")), HeaderError)  # the reader itself copes
    assert isinstance(outcome(lambda: tm.open(path)), CheckpointError)


@functools.cache
def torch_seed_parts_cached() -> tuple[bytes, dict[str, bytes]]:
    archive = zipfile.ZipFile(io.BytesIO(torch_seed_bytes()))
    pkl = archive.read("archive/data.pkl")
    storages = {n.split("/")[-1]: archive.read(n) for n in archive.namelist() if "/data/" in n}
    return pkl, storages


@pytest.fixture(scope="module")
def torch_seed_parts() -> tuple[bytes, dict[str, bytes]]:
    return torch_seed_parts_cached()


class _RecordingUnpickler(ReferenceUnpickler):
    """The reference unpickler over a torch.save data.pkl: each allowed global becomes a recorder, so the calls
    the reader would make (to rebuild tensors, fetch storages) are listed instead of made."""

    allowed = set(torchzip._tensor_globals(lambda *args: None))

    def __init__(self, stream: io.BytesIO):
        super().__init__(stream)
        self.calls: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise Refused(f"{module}.{name}")

        def call(*args: Any) -> str:
            self.calls.append(f"{module}.{name}{args!r}")
            return f"<{len(self.calls)}>"

        return call

    def persistent_load(self, pid: Any) -> Any:
        self.calls.append(f"storage {pid!r}")
        return f"<{len(self.calls)}>"


def recorded(payload: bytes) -> tuple[type[CheckpointError] | None, list[str]]:
    """(how the reference stream ends: None, or the error class safe_pickle raises for it; the calls made)."""
    unpickler = _RecordingUnpickler(io.BytesIO(reference_stream(payload)))
    try:
        unpickler.calls.append(repr(unpickler.load()))
        return None, unpickler.calls
    except Refused:
        return UnsafePickleError, unpickler.calls
    except Exception:  # a malformed stream
        return HeaderError, unpickler.calls


@settings(FUZZ, suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.filter_too_much])
@given(data=st.data())
def test_torch_zip_mutated_pickle_in_a_valid_zip(data: st.DataObject) -> None:
    """A data.pkl that makes every call the seed's does, in order, and then breaks is refused as the reference
    unpickler refuses it (a malformed stream or a global off the allowlist); one that makes exactly the seed's
    calls and builds the same tree reads as the seed. (Other calls are checked one by one in
    test_torch_zip_structural_damage and the pickle tests.)"""
    pkl, storages = torch_seed_parts_cached()
    mutated = mutate(pkl, data.draw(edits(len(pkl))))
    assume(not huge_memo_index(mutated))
    expected, calls = recorded(mutated)
    seed_calls = recorded(pkl)[1]
    assume(calls == seed_calls if expected is None else calls == seed_calls[:len(calls)])
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.pt"
        blob = torch_zip(mutated, storages)
        path.write_bytes(blob)
        if expected is None:
            event("the seed's calls")
            assert_reads_as_torch_loads(path, torch_zip(pkl, storages))
            return
        event(expected.__name__)
        for format in ("torch", None):
            result = outcome(lambda format=format: tm.open(path, format))
            assert type(result) is expected, result
            assert str(path) in str(result)


@pytest.mark.parametrize("build, error, message", [
    (lambda pkl, s: torch_zip(pkl, {}), TruncatedFileError, "missing from the archive"),
    (lambda pkl, s: torch_zip(pkl, {k: v[:4] for k, v in s.items()}), TruncatedFileError, "claims"),
    (lambda pkl, s: torch_zip(pkl, s, byteorder=b"big"), UnsupportedError, "big-endian"),
    (lambda pkl, s: torch_zip(b"\x80\x02}q\x00.", s)[:-30], HeaderError, "not a readable torch.save archive"),
    (lambda pkl, s: torch_zip(pickle.dumps({"a": 1}, protocol=2), s), None, None),
])
def test_torch_zip_structural_damage(torch_seed_parts: tuple[bytes, dict], tmp_path: Path, build: Callable,
                                     error: type | None, message: str | None) -> None:
    pkl, storages = torch_seed_parts
    path = tmp_path / "state.pt"
    path.write_bytes(build(pkl, storages))
    if error is None:
        with tm.open(path, "torch") as ck:
            assert len(ck) == 0 and ck.objects["a"].value() == 1
        return
    with pytest.raises(error, match=message) as info:
        tm.open(path, "torch")
    assert str(path) in str(info.value)


def test_legacy_torch_save_is_unsupported_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    for fmt in (None, "torch"):
        with pytest.raises(UnsupportedError, match=r"legacy \(pre-1.6, non-zip\) torch.save file") as info:
            tm.open(path, fmt)
        assert str(path) in str(info.value)
        assert "re-save" in str(info.value)
    # the same file as a shard of an HF index
    (tmp_path / "pytorch_model.bin").write_bytes(path.read_bytes())
    path.unlink()
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"w": "pytorch_model.bin"}}))
    with pytest.raises(UnsupportedError, match="legacy"):
        tm.open(tmp_path)


@pytest.mark.parametrize("record", ["byteorder", "data/0", "version"])
def test_a_record_outside_the_archives_folder_is_refused(record: str) -> None:
    """torch's reader refuses a record outside the archive's one folder; so does ours, whichever record it is
    (found by the DCP data-file fuzz test: a renamed byteorder record was silently skipped)."""
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buffer)
    blob = buffer.getvalue()
    prefix = zipfile.ZipFile(io.BytesIO(blob)).namelist()[0].split("/")[0]
    name = f"{prefix}/{record}".encode()
    central = blob.rindex(name)  # the central directory's copy of the name, after every local header
    forged = blob[:central] + b"\x01" + blob[central + 1:]
    with pytest.raises(HeaderError, match="outside the archive's folder"):
        torchzip.load(memoryview(forged), file="forged.pt")
    assert torchzip.load(memoryview(blob), file="seed.pt")["w"].shape == (4,)
