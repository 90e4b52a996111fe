"""Hostile bytes at every parser: the outcome is a value or a CheckpointError, never another exception,
never code execution, never a hang.

Seeds are real files made by the real libraries (safetensors, torch.save, dcp.save in one process);
hypothesis mutates them or builds headers from scratch.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch  # a dev dependency: the seeds are made by torch itself
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph import safe_pickle
from tensormorph.ops.stats import tensor_stats
from tensormorph.errors import (
    CheckpointError,
    ChunkLayoutError,
    HeaderError,
    MissingFileError,
    TensorNotFoundError,
    TruncatedFileError,
    UnknownFormatError,
    UnsafePathError,
    UnsafePickleError,
    UnsupportedError,
)


pytestmark = pytest.mark.timeout(120)

FUZZ = settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])


# ---------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------


def outcome(action: Callable[[], Any]) -> Any:
    """The value, or the CheckpointError raised; any other exception fails the test."""
    try:
        return action()
    except CheckpointError as exc:
        return exc


def exercise(path: Path, format: str | None = None, *, detect: bool = True) -> Any:
    """Detect, open, read every tensor in full and decode every object; all must be values or CheckpointErrors."""
    if detect:
        detected = outcome(lambda: tm.detect(path))
        assert detected is None or isinstance(detected, (str, CheckpointError))
    opened = outcome(lambda: tm.open(path, format))
    event(f"open {format or 'detected'}: {type(opened).__name__}")
    if isinstance(opened, CheckpointError):
        return opened
    with opened as ck:
        assert isinstance(ck, tm.Checkpoint)
        for name, tensor in ck.items():
            assert isinstance(name, str)
            assert all(isinstance(d, int) and d >= 0 for d in tensor.shape)
            value = outcome(tensor.full)
            if not isinstance(value, CheckpointError):
                value = np.asarray(value)
                assert value.shape == tensor.shape
                assert value.dtype == tensor.numpy_dtype
            outcome(lambda tensor=tensor: tensor_stats(tensor))  # what `tensormorph stats` runs
        for entry in ck.objects.values():
            outcome(entry.value)
    return opened


@st.composite
def edits(draw: st.DrawFn, size: int, hot: list[tuple[int, int]] | None = None) -> tuple[list, int | None]:
    """Up to 8 byte replacements (biased to the structural `hot` ranges) and an optional truncation."""
    ranges = [(0, size)] + (hot or [])
    changes = []
    for _ in range(draw(st.integers(0, 8))):
        begin, end = draw(st.sampled_from(ranges))
        changes.append((draw(st.integers(begin, max(begin, end - 1))), draw(st.integers(0, 255))))
    cut = draw(st.none() | st.integers(0, size) | st.integers(max(0, size - 64), size))
    return changes, cut


def replace_file(path: Path, content: bytes) -> None:
    """Swap in new content by rename, so maps of the old file (still held by numpy views) stay valid."""
    staging = path.with_name(path.name + ".new")
    staging.write_bytes(content)
    os.replace(staging, path)


def mutate(seed: bytes, change: tuple[list, int | None]) -> bytes:
    changes, cut = change
    data = bytearray(seed)
    for position, value in changes:
        if position < len(data):
            data[position] = value
    return bytes(data if cut is None else data[:cut])


def huge_memo_index(data: bytes) -> bool:
    """A PUT/LONG_BINPUT naming a memo slot far beyond the pickle's size (see test_pickle_memo_index_...).

    CPython's C unpickler grows its memo array to twice such an index and zeroes it, so a 10-byte pickle
    can demand gigabytes. Fuzz inputs that do this are left to the dedicated test, so the fuzz cannot
    exhaust the test machine's memory.
    """
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT") and int(arg) > 1 << 16:
                return True
    except Exception:  # genops stops where the stream breaks; so does the unpickler
        pass
    return False


def safetensors_bytes(header: Any, data: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


# ---------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------

SAFE_DTYPES = ["F32", "BF16", "F8_E4M3", "I64", "BOOL", "U8", "F64", "F16", "I8", "C64", "F8_E8M0"]
ITEMSIZE = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "I64": 8, "BOOL": 1, "U8": 1, "F64": 8, "F16": 2, "I8": 1, "C64": 8,
            "F8_E8M0": 1}
json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=4)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=6)


def _no_unrepresentable_empty(shape: Any) -> bool:
    """Keeps zero-size shapes with astronomically large other dims out of the fuzz (a known bug, tested below)."""
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        return True
    return 0 not in shape or math.prod(d for d in shape if d > 0) < 2**40


dims = st.integers(-3, 9) | st.sampled_from([2**31, 2**32 + 1, 2**63 - 1, 2**63, 2**64 + 1]) | \
    st.floats(-2, 2**65) | st.text(max_size=2) | st.booleans() | st.none()
shapes = st.lists(dims, max_size=4).filter(_no_unrepresentable_empty) | json_scalars
offset_values = st.integers(-5, 300) | st.sampled_from([2**63, 2**64 + 7]) | st.floats() | st.text(max_size=2) \
    | st.none() | st.booleans()
wild_entries = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(SAFE_DTYPES + ["f32", "float32", "", "Q4_K", "F8"]) | json_scalars,
    "shape": shapes,
    "data_offsets": st.lists(offset_values, max_size=3) | offset_values,
    "extra": json_values,
}) | json_values


@st.composite
def plausible_entries(draw: st.DrawFn) -> dict:
    """Entries that are valid or one step away from valid (off-by-one sizes, ranges past the data)."""
    dtype = draw(st.sampled_from(SAFE_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    begin = draw(st.integers(0, 96))
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    end = begin + nbytes + draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@st.composite
def headers(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(json_values)  # not an object at all
    names = st.text(min_size=1, max_size=6)
    header = draw(st.dictionaries(names, plausible_entries() | wild_entries, max_size=5))
    choice = draw(st.integers(0, 3))
    if choice == 1:
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
    elif choice == 2:
        header["__metadata__"] = draw(json_values)
    return header


@FUZZ
@given(header=headers(), data_len=st.integers(0, 160), seed=st.integers(0, 2**32 - 1))
@example(header={"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, data_len=16, seed=0)
@example(header={"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, data_len=0, seed=0)
@example(header={"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "__metadata__": [1]}, data_len=16,
         seed=0)
def test_safetensors_random_headers(header: Any, data_len: int, seed: int) -> None:
    data = np.random.default_rng(seed).bytes(data_len)
    blob = safetensors_bytes(header, data)
    header_end = len(blob) - data_len
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        path.write_bytes(blob)
        result = outcome(lambda: tm.open(path, "safetensors"))
        event(type(result).__name__)
        if isinstance(result, CheckpointError):
            assert str(path) in str(result)
            return
        with result as ck:
            # accepted headers are consistent: known dtypes, exact sizes, in range, no overlaps
            spans = []
            assert isinstance(header, dict)
            assert set(ck) == {k for k in header if k != "__metadata__"}
            assert dict(ck.metadata) == (header.get("__metadata__") or {})
            for name, tensor in ck.items():
                begin, end = header[name]["data_offsets"]
                assert tensor.dtype == header[name]["dtype"]
                assert list(tensor.shape) == header[name]["shape"]
                assert end - begin == tensor.nbytes and end <= data_len
                assert tensor.chunks[0].byte_range == (header_end + begin, header_end + end)
                stored = np.frombuffer(data[begin:end], np.uint8)
                if tensor.dtype == "BOOL":  # any non-zero byte is True; numpy copies normalise it to 1
                    assert np.array_equal(tensor.full().reshape(-1), stored != 0)
                else:
                    assert tensor.full().tobytes() == data[begin:end]
                if end > begin:
                    spans.append((begin, end))
            spans.sort()
            assert all(b1 >= e0 for (_, e0), (b1, _) in zip(spans, spans[1:]))


def seed_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "a": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
        "c": rng.standard_normal((2, 2)).astype(ml_dtypes.float8_e4m3fn),
        "d": np.array([-(2**40), 2**40], dtype=np.int64),
        "e": np.array([True, False, True]),
        "z": np.zeros((0, 3), np.float32),
        "s": np.array(2.5, np.float32),
    }


@functools.cache
def safetensors_seed_bytes() -> bytes:
    return safetensors.numpy.save(seed_tensors(), metadata={"format": "np", "note": "seed"})


@pytest.fixture(scope="module")
def safetensors_seed() -> bytes:
    return safetensors_seed_bytes()


def _header_range(blob: bytes) -> list[tuple[int, int]]:
    (length,) = struct.unpack("<Q", blob[:8])
    return [(0, 8), (8, 8 + length), (8, 8 + length), (8, 8 + length)]


@FUZZ
@given(data=st.data())
def test_safetensors_mutated_bytes(data: st.DataObject) -> None:
    seed = safetensors_seed_bytes()
    blob = mutate(seed, data.draw(edits(len(seed), _header_range(seed))))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        path.write_bytes(blob)
        exercise(path, "safetensors")
        exercise(path)
        exercise(Path(folder))


def test_safetensors_seed_reads_back(safetensors_seed: bytes, tmp_path: Path) -> None:
    """The unmutated seed opens and every tensor matches the reference library (the fuzz starts from valid)."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_seed)
    expected = seed_tensors()
    with tm.open(path) as ck:
        assert dict(ck.metadata) == {"format": "np", "note": "seed"}
        assert sorted(ck) == sorted(expected)
        for name, want in expected.items():
            got = ck[name].full()
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("claim", [100_000_001, 25_000_000_000, 2**63, 2**64 - 1])
def test_safetensors_huge_header_length_claims_fail_fast(tmp_path: Path, claim: int) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", claim) + b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}' + bytes(4))
    with pytest.raises(HeaderError, match="exceeds the limit"):
        tm.open(path, "safetensors")
    with pytest.raises(UnknownFormatError):
        tm.open(path)  # not recognised as safetensors at all


def test_safetensors_header_length_past_the_end_is_truncation(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 50_000_000) + b"{}")
    with pytest.raises(TruncatedFileError, match="runs past the end"):
        tm.open(path, "safetensors")


GOOD = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize("header, data_len, error, message", [
    ({"w": {**GOOD, "dtype": "F31"}}, 16, HeaderError, "unknown dtype 'F31'"),
    ({"w": {**GOOD, "dtype": 4}}, 16, HeaderError, "unknown dtype 4"),
    ({"w": {**GOOD, "shape": [-2, -2]}}, 16, HeaderError, r"integers in \[0, 2\*\*62\)"),
    ({"w": {**GOOD, "shape": [2.0, 2]}}, 16, HeaderError, r"integers in \[0, 2\*\*62\)"),
    ({"w": {**GOOD, "shape": [True, 4]}}, 16, HeaderError, r"integers in \[0, 2\*\*62\)"),
    ({"w": {**GOOD, "shape": [2**64, 2**64]}}, 16, HeaderError, r"integers in \[0, 2\*\*62\)"),
    ({"w": {**GOOD, "data_offsets": [0, 32]}}, 32, HeaderError, "holds 32 bytes"),
    ({"w": {**GOOD, "data_offsets": [16, 0]}}, 16, HeaderError, "begin <= end"),
    ({"w": {**GOOD, "data_offsets": [-16, 0]}}, 16, HeaderError, "data_offsets"),
    ({"w": {**GOOD, "data_offsets": [0, 16, 32]}}, 16, HeaderError, "data_offsets"),
    ({"w": {**GOOD, "data_offsets": [2**64, 2**64 + 16]}}, 16, TruncatedFileError, "data ends at byte"),
    ({"w": {**GOOD, "data_offsets": [8, 24]}}, 16, TruncatedFileError, "data ends at byte 24"),
    ({"w": GOOD, "v": {**GOOD, "data_offsets": [8, 24]}}, 32, HeaderError, "overlap"),
    ({"w": GOOD, "__metadata__": ["a"]}, 16, HeaderError, "__metadata__"),
    ({"w": GOOD, "__metadata__": {"k": 1}}, 16, HeaderError, "__metadata__"),
    ({"w": GOOD, "__metadata__": "text"}, 16, HeaderError, "__metadata__"),
    ({"w": [1, 2]}, 16, HeaderError, "header entry must be an object"),
    ([GOOD], 16, HeaderError, "must be a JSON object"),
    ("w", 16, HeaderError, "must be a JSON object"),
])
def test_safetensors_bad_headers_name_the_problem(tmp_path: Path, header: Any, data_len: int, error: type,
                                                   message: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(header, bytes(data_len)))
    with pytest.raises(error, match=message) as info:
        tm.open(path, "safetensors")
    assert str(path) in str(info.value)
    if isinstance(header, dict) and "w" in header and "overlap" not in message and "__metadata__" not in message:
        assert info.value.tensor == "w"


@pytest.mark.parametrize("blob, error", [
    (b"", TruncatedFileError),
    (b"\x05\x00\x00", TruncatedFileError),
    (struct.pack("<Q", 4) + b"\xff\xfe{}", HeaderError),  # not UTF-8
    (struct.pack("<Q", 3) + b"{,}", HeaderError),
    (struct.pack("<Q", 20000) + b"[" * 10000 + b"]" * 10000, HeaderError),  # nested too deeply for json
])
def test_safetensors_garbage_files(tmp_path: Path, blob: bytes, error: type) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    with pytest.raises(error):
        tm.open(path, "safetensors")


def test_safetensors_truncated_data_section(safetensors_seed: bytes, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_seed[:-3])
    with pytest.raises(TruncatedFileError, match="data ends at byte"):
        tm.open(path)


def test_safetensors_header_with_a_huge_integer_is_a_header_error(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(None, raw_header=b'{"w":{"dtype":"F32","shape":[' + b"7" * 5000
                                       + b'],"data_offsets":[0,0]}}'))
    with pytest.raises(HeaderError):
        tm.open(path, "safetensors")


@pytest.mark.parametrize("shape", [[0, 2**70], [0, 2**40, 2**40]])
def test_safetensors_unrepresentable_empty_shape(tmp_path: Path, shape: list[int]) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}))
    result = outcome(lambda: tm.open(path, "safetensors"))
    if not isinstance(result, CheckpointError):
        outcome(result["w"].full)


# ---------------------------------------------------------------------------
# Hugging Face index files
# ---------------------------------------------------------------------------

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
TRUTH = {
    "a": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.array([1, -2, 3], dtype=np.int64),
    "c": np.array([0.5, -1.5], dtype=ml_dtypes.bfloat16),
}
HOLDS = {SHARD1: {"a", "b"}, SHARD2: {"c"}, "inside_link.safetensors": {"c"}}


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hf")
    folder = base / "ckpt"
    folder.mkdir()
    safetensors.numpy.save_file({k: TRUTH[k] for k in ("a", "b")}, str(folder / SHARD1))
    safetensors.numpy.save_file({"c": TRUTH["c"]}, str(folder / SHARD2))
    outside = base / "outside"
    outside.mkdir()
    safetensors.numpy.save_file(TRUTH, str(outside / "stolen.safetensors"))
    safetensors.numpy.save_file(TRUTH, str(base / "outside.safetensors"))
    (folder / "link.safetensors").symlink_to(outside / "stolen.safetensors")
    (folder / "linkdir").symlink_to(outside, target_is_directory=True)
    (folder / "inside_link.safetensors").symlink_to(SHARD2)  # relative: stays inside copies too
    return folder


def write_index(folder: Path, index: Any, name: str = "model.safetensors.index.json") -> Path:
    target = Path(tempfile.mkdtemp(dir=folder.parent))
    for entry in folder.iterdir():
        (target / entry.name).symlink_to(os.readlink(entry)) if entry.is_symlink() else \
            shutil.copy(entry, target / entry.name)
    (target / name).write_text(index if isinstance(index, str) else json.dumps(index))
    return target


@pytest.fixture(scope="module")
def hf_scratch(hf_folder: Path) -> Path:
    """A copy of hf_folder whose index each fuzz example replaces."""
    return write_index(hf_folder, "")


UNSAFE = ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors", "link.safetensors",
          "linkdir/stolen.safetensors", "~/x.safetensors", "..\\outside.safetensors", "./../outside.safetensors"]
MISSING = ["missing.safetensors", "sub/model.safetensors"]
SAFE_FILES = [SHARD1, SHARD2, "inside_link.safetensors", "./" + SHARD1]


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(weight_map=st.dictionaries(st.sampled_from(["a", "b", "c", "d"]),
                                  st.sampled_from(SAFE_FILES + UNSAFE + MISSING) | st.sampled_from([SHARD1, SHARD2]),
                                  min_size=1, max_size=4),
       metadata=st.none() | st.just({"total_size": 44}) | json_values)
def test_hf_index_weight_maps(hf_scratch: Path, weight_map: dict, metadata: Any) -> None:
    index: dict[str, Any] = {"weight_map": weight_map}
    if metadata is not None:
        index["metadata"] = metadata
    replace_file(hf_scratch / "model.safetensors.index.json", json.dumps(index).encode())
    result = outcome(lambda: tm.open(hf_scratch))
    files = list(weight_map.values())
    if any(f in UNSAFE for f in files):
        assert isinstance(result, UnsafePathError), result
    elif metadata and not isinstance(metadata, dict):
        assert isinstance(result, HeaderError), result
    elif any(f in MISSING or name not in HOLDS[f.removeprefix("./")] for name, f in weight_map.items()):
        # shards are read in index order: whichever problem comes first is reported
        assert isinstance(result, (MissingFileError, TensorNotFoundError)), result
        if not any(f in MISSING for f in files):
            assert isinstance(result, TensorNotFoundError), result
            assert result.tensor in weight_map
    else:
        assert not isinstance(result, CheckpointError), result
        with result as ck:
            assert list(ck) == list(weight_map)
            for name in weight_map:
                got = ck[name].full()
                assert got.dtype == TRUTH[name].dtype and got.tobytes() == TRUTH[name].tobytes()
                assert ck[name].file_shard[1] == len(set(files))


@pytest.mark.parametrize("target, error, message", [
    ("/etc/passwd", UnsafePathError, "outside the checkpoint folder"),
    ("../outside.safetensors", UnsafePathError, "outside the checkpoint folder"),
    ("link.safetensors", UnsafePathError, "resolves outside the checkpoint folder"),
    ("linkdir/stolen.safetensors", UnsafePathError, "resolves outside the checkpoint folder"),
    ("missing.safetensors", MissingFileError, r"missing\.safetensors.*is missing"),
    (SHARD2, TensorNotFoundError, "does not contain it"),
])
def test_hf_index_bad_targets(hf_folder: Path, target: str, error: type, message: str) -> None:
    folder = write_index(hf_folder, {"metadata": {}, "weight_map": {"a": target, "b": SHARD1}})
    with pytest.raises(error, match=message) as info:
        tm.open(folder)
    if error is TensorNotFoundError:
        assert info.value.tensor == "a"
    assert "passwd" not in str(info.value) or target == "/etc/passwd"
    shutil.rmtree(folder)


def test_hf_index_that_is_itself_a_link_outside_is_refused(hf_folder: Path) -> None:
    folder = write_index(hf_folder, {"weight_map": {"a": SHARD1}}, name="elsewhere.json")
    (hf_folder.parent / "evil.index.json").write_text(json.dumps({"weight_map": {"a": SHARD1}}))
    (folder / "model.safetensors.index.json").symlink_to(hf_folder.parent / "evil.index.json")
    with pytest.raises(UnsafePathError):
        tm.open(folder)
    shutil.rmtree(folder)


@pytest.mark.parametrize("text", ['{"weight_map": [1]}', '{"weight_map": {"a": 5}}', '{"weight_map": {"a": null}}',
                                  '{"weight_map": {}, "metadata": 3}', '["weight_map"]', '"weight_map"',
                                  '{"weight_map": {"a": "' + SHARD1 + '"}', "\xff\"weight_map\"", ""])
def test_hf_index_malformed_is_a_header_error(hf_folder: Path, text: str) -> None:
    folder = write_index(hf_folder, text)
    with pytest.raises(HeaderError):
        tm.open(folder, "hf-sharded")
    shutil.rmtree(folder)


HF_SEED = json.dumps({"metadata": {"total_size": 44}, "weight_map": {"a": SHARD1, "c": SHARD2}}).encode()


@FUZZ
@given(blob=st.binary(max_size=300) | st.builds(lambda v: json.dumps(v).encode(), json_values),
       change=edits(len(HF_SEED)))
def test_hf_index_random_bytes(hf_scratch: Path, blob: bytes, change: Any) -> None:
    for content in (blob, mutate(HF_SEED, change)):
        replace_file(hf_scratch / "model.safetensors.index.json", content)
        # detection of indexes that do not name a weight_map has a known bug (test_hf_index_detection_...)
        named = b'"weight_map"' in content
        exercise(hf_scratch, "hf-sharded", detect=named)
        if named:
            exercise(hf_scratch)


@pytest.mark.parametrize("text", ["5", "null", "[" * 100000 + "]" * 100000])
def test_hf_index_detection_of_non_object_json(hf_folder: Path, text: str) -> None:
    folder = write_index(hf_folder, text)
    result = outcome(lambda: tm.open(folder))
    assert isinstance(result, CheckpointError)


# ---------------------------------------------------------------------------
# torch.save zip archives
# ---------------------------------------------------------------------------


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


def zip_detection_bug(blob: bytes) -> bool:
    """zipfile raises something other than BadZipFile/OSError/ValueError: a known detection bug
    (test_torch_detection_of_a_zip_with_an_unsupported_version)."""
    try:
        zipfile.ZipFile(io.BytesIO(blob)).namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return False
    except Exception:
        return True
    return False


@FUZZ
@given(data=st.data())
def test_torch_zip_mutated_bytes(data: st.DataObject) -> None:
    seed = torch_seed_bytes()
    blob = mutate(seed, data.draw(edits(len(seed), _zip_hot_ranges(seed))))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.pt"
        path.write_bytes(blob)
        exercise(path, "torch", detect=False)
        if not zip_detection_bug(blob):
            exercise(path)


def test_torch_detection_of_a_zip_with_an_unsupported_version(torch_seed: bytes, tmp_path: Path) -> None:
    blob = bytearray(torch_seed)
    central = blob.find(b"PK\x01\x02")
    blob[central + 6] = 64  # "version needed to extract" 6.4
    path = tmp_path / "state.pt"
    path.write_bytes(bytes(blob))
    assert isinstance(outcome(lambda: tm.open(path, "torch")), HeaderError)  # the reader itself copes
    assert isinstance(outcome(lambda: tm.open(path)), CheckpointError)


def torch_zip(pickle_bytes: bytes, storages: dict[str, bytes] | None = None, *, byteorder: bytes = b"little") -> bytes:
    """A torch.save-shaped zip around any data.pkl (ZIP_STORED, valid CRCs)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/byteorder", byteorder)
        for key, raw in (storages or {}).items():
            archive.writestr(f"archive/data/{key}", raw)
        archive.writestr("archive/version", b"3\n")
    return buffer.getvalue()


@functools.cache
def torch_seed_parts_cached() -> tuple[bytes, dict[str, bytes]]:
    archive = zipfile.ZipFile(io.BytesIO(torch_seed_bytes()))
    pkl = archive.read("archive/data.pkl")
    storages = {n.split("/")[-1]: archive.read(n) for n in archive.namelist() if "/data/" in n}
    return pkl, storages


@pytest.fixture(scope="module")
def torch_seed_parts() -> tuple[bytes, dict[str, bytes]]:
    return torch_seed_parts_cached()


@FUZZ
@given(data=st.data())
def test_torch_zip_mutated_pickle_in_a_valid_zip(data: st.DataObject) -> None:
    pkl, storages = torch_seed_parts_cached()
    mutated = mutate(pkl, data.draw(edits(len(pkl))))
    assume(not huge_memo_index(mutated))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.pt"
        path.write_bytes(torch_zip(mutated, storages))
        exercise(path, "torch")


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


# ---------------------------------------------------------------------------
# pickles that would run code
# ---------------------------------------------------------------------------


class ReduceToSystem:
    """A classic malicious object: unpickling calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


class TouchOnInit:
    """Unpickling imports this class and calls it: its constructor has the side effect."""

    def __init__(self, marker: str):
        Path(marker).touch()
        self.marker = marker

    def __reduce__(self) -> tuple:
        return TouchOnInit, (self.marker,)


def _short_str(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _binunicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


PAYLOADS: dict[str, tuple[str, Callable[[Path], bytes]]] = {
    "GLOBAL os.system": ("os.system", lambda m: f"cos\nsystem\n(S'touch {m}'\ntR.".encode()),
    "STACK_GLOBAL os.system": ("os.system", lambda m: b"\x80\x04" + _short_str("os") + _short_str("system") + b"\x93"
                               + _short_str(f"touch {m}") + b"\x85R."),
    "builtins.eval": ("builtins.eval", lambda m: b"\x80\x02cbuiltins\neval\n"
                      + _binunicode(f"open({str(m)!r}, 'w').close()") + b"\x85R."),
    "subprocess.Popen": ("subprocess.Popen", lambda m: f"csubprocess\nPopen\n((S'touch'\nS'{m}'\nltR.".encode()),
    "getattr chain": ("builtins.getattr", lambda m: (
        "cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'touch "
        + str(m) + "'\ntR.").encode()),
    "inside a dict": ("os.system", lambda m: f"(dp0\nS'k'\ncos\nsystem\n(S'touch {m}'\ntRs.".encode()),
    "__reduce__ object": (f"{os.system.__module__}.system", lambda m: pickle.dumps(ReduceToSystem(m), protocol=2)),
    "class with side effects": (f"{TouchOnInit.__module__}.TouchOnInit",
                                lambda m: pickle.dumps(_touch_on_init_stub(m), protocol=4)),
}


def _touch_on_init_stub(marker: Path) -> TouchOnInit:
    """An instance made without running __init__, so pickling it has no side effect."""
    stub = TouchOnInit.__new__(TouchOnInit)
    stub.marker = str(marker)
    return stub


def run_control(payload: bytes) -> None:
    """Plain pickle.loads really runs the payload (so the checks below can fail)."""
    value = pickle.loads(payload)
    if hasattr(value, "wait"):
        value.wait()


def _assert_refused(action: Callable[[], Any], global_name: str, marker: Path, payload: bytes) -> UnsafePickleError:
    with pytest.raises(UnsafePickleError) as info:
        action()
    assert f"refuses global {global_name}" in str(info.value)
    assert not marker.exists(), "the payload ran"
    run_control(payload)
    assert marker.exists(), "control: this payload should create the marker when unpickled naively"
    return info.value


@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_safe_pickle_refuses_code_globals(tmp_path: Path, case: str) -> None:
    name, build = PAYLOADS[case]
    marker = tmp_path / "ran"
    payload = build(marker)
    _assert_refused(lambda: safe_pickle.loads(payload, file="x.pkl"), name, marker, payload)


@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_torch_archive_with_code_pickle_is_refused(tmp_path: Path, case: str) -> None:
    name, build = PAYLOADS[case]
    marker = tmp_path / "ran"
    payload = build(marker)
    path = tmp_path / "malicious.pt"
    path.write_bytes(torch_zip(payload))
    error = _assert_refused(lambda: tm.open(path), name, marker, payload)
    assert str(path) in str(error)
    marker.unlink()
    _assert_refused(lambda: tm.open(path, "torch"), name, marker, payload)


DCP_HEAD = b"\x80\x04" + _short_str("torch.distributed.checkpoint") + b"0"  # a string, popped: passes detection


@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_dcp_metadata_with_code_pickle_is_refused(tmp_path: Path, case: str) -> None:
    name, build = PAYLOADS[case]
    marker = tmp_path / "ran"
    payload = DCP_HEAD + build(marker)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(payload)
    error = _assert_refused(lambda: tm.open(folder), name, marker, payload)
    assert ".metadata" in str(error)


def test_record_state_cannot_change_a_records_class(tmp_path: Path) -> None:
    """BUILD state naming __class__ (and friends) must not turn a stand-in record into something else."""
    from tensormorph.formats import dcp as dcp_format

    payload = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}(X\x09\x00\x00\x00__class__"
               b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\nX\x0a\x00\x00\x00__reduce__cbuiltins\nset\nub.")
    record = outcome(lambda: safe_pickle.loads(payload, dcp_format._metadata_globals()))
    if not isinstance(record, CheckpointError):
        assert type(record).__name__ == "Metadata" and isinstance(record, safe_pickle.Record)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(payload)
    with pytest.raises(HeaderError):
        tm.open(folder)


@pytest.mark.parametrize("payload, error", [
    (b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x05\x00\x00\x00rot13\x86R.", HeaderError),
    (b"\x80\x02ccollections\nOrderedDict\nK\x05\x85R.", HeaderError),
    (b"\x80\x02ctorch\nSize\nK\x05\x85R.", HeaderError),
    (b"\x80\x02}" * 3, HeaderError),
    (b"(" * 100000 + b".", HeaderError),
    (b"\x80\x05\x95\xff\xff\xff\xff\xff\xff\xff\x7f.", HeaderError),
    (b"", HeaderError),
    (b"\x80\x02K\x01Q.", UnsafePickleError),  # a persistent id with no persistent loader
])
def test_safe_pickle_malformed_streams(payload: bytes, error: type) -> None:
    with pytest.raises(error):
        safe_pickle.loads(payload, file="x.pkl")


PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray, safe_pickle.TorchDType)


def only_plain_values(value: Any, seen: set[int] | None = None) -> bool:
    """True when `value` is built only of harmless types (pickles may be self-referential)."""
    seen = set() if seen is None else seen
    if isinstance(value, PLAIN_TYPES):
        return True
    if id(value) in seen:
        return True
    seen.add(id(value))
    if isinstance(value, dict):
        return all(only_plain_values(k, seen) and only_plain_values(v, seen) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(only_plain_values(v, seen) for v in value)
    if isinstance(value, safe_pickle.Record):
        return all(only_plain_values(v, seen) for v in vars(value).values())
    return False


@FUZZ
@given(payload=st.binary(max_size=200) | st.builds(lambda v: pickle.dumps(v, protocol=4), json_values).flatmap(
    lambda seed: st.builds(mutate, st.just(seed), edits(len(seed)))))
@example(payload=b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00]\x94(K\x01K\x02e.")
@example(payload=b"\x80\x05\x96\x03\x00\x00\x00\x00\x00\x00\x00abc.")
@example(payload=b"\x80\x04]\x94h\x00a.")
def test_safe_pickle_random_bytes(payload: bytes) -> None:
    assume(not huge_memo_index(payload))
    value = outcome(lambda: safe_pickle.loads(payload, file="x.pkl"))
    if not isinstance(value, CheckpointError):
        assert only_plain_values(value)


def test_pickle_memo_index_cannot_demand_gigabytes() -> None:
    probe = (
        "import resource, sys\n"
        "from tensormorph import safe_pickle, errors\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    safe_pickle.loads(b'\\x80\\x02K\\x01r\\x00\\x00\\x00\\x02.')\n"
        "except errors.CheckpointError:\n"
        "    pass\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    grown_kib = int(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                                   timeout=60).stdout)
    assert grown_kib < 64 * 1024, f"unpickling 12 bytes grew the peak RSS by {grown_kib // 1024} MiB"


def test_pickle_bytearray_length_cannot_demand_gigabytes() -> None:
    # protocol 5's BYTEARRAY8 announces its length; pickle itself allocates that much before reading
    forged = b"\x80\x05\x96" + (1 << 40).to_bytes(8, "little") + b"abc."
    with pytest.raises(HeaderError, match="BYTEARRAY8 claims 1099511627776 bytes, but only 4 remain"):
        safe_pickle.loads(forged)


# ---------------------------------------------------------------------------
# DCP
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dcp_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    state = {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "h": torch.tensor([1.5, -2.0, 0.25, 8.0, -0.5], dtype=torch.bfloat16),
        "i": torch.tensor([[1, 2], [3, 4], [5, -(2**40)]], dtype=torch.int64),
        "m": torch.tensor([True, False, False, True]),
        "step": 7,
        "cfg": {"lr": 0.1, "name": "run"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def nul_in_stored_path(blob: bytes) -> bool:
    """A .metadata naming a data file with a NUL byte: a known bug (test_nul_byte_in_a_named_file_...)."""
    from tensormorph.formats import dcp as dcp_format

    try:
        record = safe_pickle.loads(blob, dcp_format._metadata_globals())
    except CheckpointError:
        return False
    storage = getattr(record, "storage_data", None)
    return isinstance(storage, dict) and any("\x00" in str(getattr(v, "relative_path", "")) for v in storage.values())


def copy_dcp(seed: Path, target: Path) -> Path:
    shutil.copytree(seed, target)
    return target


def load_metadata(folder: Path) -> Any:
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # our own, trusted file


def save_metadata(folder: Path, metadata: Any) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))


def test_dcp_seed_reads_back(dcp_seed: Path) -> None:
    with tm.open(dcp_seed) as ck:
        assert ck.format == "dcp"
        assert np.array_equal(ck["w"].full(), np.arange(24, dtype=np.float32).reshape(4, 6))
        assert ck["h"].full().astype(np.float32).tolist() == [1.5, -2.0, 0.25, 8.0, -0.5]
        assert ck["i"][2, 1] == -(2**40)
        assert ck["m"].full().tolist() == [True, False, False, True]
        assert ck.objects["step"].value() == 7


@pytest.fixture(scope="module")
def dcp_scratch(dcp_seed: Path) -> Path:
    """A copy of the DCP seed whose files each fuzz example replaces."""
    return copy_dcp(dcp_seed, dcp_seed.parent / "scratch")


@FUZZ
@given(data=st.data())
def test_dcp_metadata_mutated_bytes(dcp_seed: Path, dcp_scratch: Path, data: st.DataObject) -> None:
    seed = (dcp_seed / ".metadata").read_bytes()
    blob = mutate(seed, data.draw(edits(len(seed))))
    assume(not huge_memo_index(blob))
    assume(not nul_in_stored_path(blob))
    replace_file(dcp_scratch / ".metadata", blob)
    exercise(dcp_scratch, "dcp")
    exercise(dcp_scratch)


@FUZZ
@given(data=st.data())
def test_dcp_data_file_mutated_bytes(dcp_seed: Path, dcp_scratch: Path, data: st.DataObject) -> None:
    (name,) = [p.name for p in dcp_seed.glob("*.distcp")]
    seed = (dcp_seed / name).read_bytes()
    blob = mutate(seed, data.draw(edits(len(seed), _zip_hot_ranges_all(seed))))
    replace_file(dcp_scratch / ".metadata", (dcp_seed / ".metadata").read_bytes())
    replace_file(dcp_scratch / name, blob)
    exercise(dcp_scratch)


def _zip_hot_ranges_all(blob: bytes) -> list[tuple[int, int]]:
    """The local headers, pickles and central directories of every archive concatenated in a .distcp file."""
    hot = []
    for marker in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"\x80\x02"):
        start = blob.find(marker)
        while start != -1 and len(hot) < 200:
            hot.append((start, min(len(blob), start + 80)))
            start = blob.find(marker, start + 1)
    return hot


@pytest.mark.parametrize("relative", ["../../etc/passwd", "/etc/passwd", "../outside.distcp", "~/x.distcp", "",
                                      "sub/../../x.distcp"])
def test_dcp_storage_path_outside_the_folder_is_refused(dcp_seed: Path, tmp_path: Path, relative: str) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    (tmp_path / "outside.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    metadata = load_metadata(folder)
    key = next(k for k in metadata.storage_data if k.fqn == "w")
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path=relative)
    save_metadata(folder, metadata)
    with pytest.raises(UnsafePathError, match="outside the checkpoint folder") as info:
        tm.open(folder)
    assert ".metadata" in str(info.value)


def test_dcp_storage_path_through_an_escaping_link_is_refused(dcp_seed: Path, tmp_path: Path) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    (tmp_path / "outside.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    (folder / "__0_1.distcp").symlink_to(tmp_path / "outside.distcp")
    metadata = load_metadata(folder)
    for key, info in metadata.storage_data.items():
        metadata.storage_data[key] = dataclasses.replace(info, relative_path="__0_1.distcp")
    save_metadata(folder, metadata)
    with pytest.raises(UnsafePathError, match="resolves outside the checkpoint folder"):
        tm.open(folder)


@pytest.mark.parametrize("where", ["dcp", "hf"])
def test_nul_byte_in_a_named_file_is_a_checkpoint_error(dcp_seed: Path, hf_folder: Path, tmp_path: Path,
                                                         where: str) -> None:
    if where == "dcp":
        folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
        metadata = load_metadata(folder)
        key = next(k for k in metadata.storage_data if k.fqn == "w")
        metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path="__0_0\x00.distcp")
        save_metadata(folder, metadata)
    else:
        folder = write_index(hf_folder, {"weight_map": {"a": "model\x00.safetensors"}})
    assert isinstance(outcome(lambda: tm.open(folder)), CheckpointError)


def test_dcp_item_past_the_end_of_its_file(dcp_seed: Path, tmp_path: Path) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    metadata = load_metadata(folder)
    key = next(k for k in metadata.storage_data if k.fqn == "w")
    size = (folder / "__0_0.distcp").stat().st_size
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], offset=size - 10, length=20)
    save_metadata(folder, metadata)
    with pytest.raises(TruncatedFileError, match="lies past the end") as info:
        tm.open(folder)
    assert info.value.tensor == "w"


def test_dcp_missing_data_file(dcp_seed: Path, tmp_path: Path) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(MissingFileError):
        tm.open(folder)


def test_dcp_chunk_outside_its_tensor_is_a_layout_error(dcp_seed: Path, tmp_path: Path) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    metadata = load_metadata(folder)
    entry = metadata.state_dict_metadata["w"]
    metadata.state_dict_metadata["w"] = dataclasses.replace(entry, size=torch.Size([3, 6]))
    save_metadata(folder, metadata)
    with pytest.raises(ChunkLayoutError, match="outside the tensor's shape") as info:
        tm.open(folder)
    assert info.value.tensor == "w"


@pytest.mark.parametrize("case", ["GLOBAL os.system", "__reduce__ object", "subprocess.Popen"])
def test_dcp_object_item_with_code_pickle_is_refused(dcp_seed: Path, tmp_path: Path, case: str) -> None:
    name, build = PAYLOADS[case]
    marker = tmp_path / "ran"
    payload = build(marker)
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    archive = torch_zip(payload)
    (folder / "__0_1.distcp").write_bytes(archive)
    metadata = load_metadata(folder)
    key = next(k for k in metadata.storage_data if k.fqn == "step")
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path="__0_1.distcp",
                                                     offset=0, length=len(archive))
    save_metadata(folder, metadata)
    with tm.open(folder) as ck:  # opening reads only .metadata
        assert np.array_equal(ck["w"].full(), np.arange(24, dtype=np.float32).reshape(4, 6))
        _assert_refused(ck.objects["step"].value, name, marker, payload)
