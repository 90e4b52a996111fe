"""Hostile safetensors files: random headers, mutated seeds and named bad headers (see hostile_support)."""

from __future__ import annotations

import functools
import json
import math
import struct
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hostile_support import FUZZ, edits, json_scalars, json_values, mutate, outcome
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph.dtypes import NUMPY_DTYPES
from tensormorph.errors import CheckpointError, HeaderError, TruncatedFileError, UnknownFormatError
from tensormorph.formats.safetensors import MAX_HEADER_BYTES
from tensormorph.ops.stats import tensor_stats
from tensormorph.storage import MAX_JSON_VALUES

pytestmark = pytest.mark.timeout(120)


def safetensors_bytes(header: Any, data: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


SAFE_DTYPES = ["F32", "BF16", "F8_E4M3", "I64", "BOOL", "U8", "F64", "F16", "I8", "C64", "F8_E8M0"]
ITEMSIZE = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "I64": 8, "BOOL": 1, "U8": 1, "F64": 8, "F16": 2, "I8": 1, "C64": 8,
            "F8_E8M0": 1}


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


def safetensors_verdict(blob: bytes) -> type[CheckpointError] | None:
    """The outcome the reference demands for `blob`: None when the safetensors library itself reads it (and none
    of our stricter rules refuses it), else the error. TruncatedFileError where the file is only too short for
    what its header promises (the length prefix, or the tensors' data: the same file padded with zeros reads);
    HeaderError for every other problem."""
    if len(blob) < 8:
        return TruncatedFileError
    (length,) = struct.unpack("<Q", blob[:8])
    if length > MAX_HEADER_BYTES:
        return HeaderError
    if length > len(blob) - 8:
        return TruncatedFileError
    text = blob[8:8 + length]
    if sum(text.count(c) for c in b",[{:") + 1 > MAX_JSON_VALUES:
        return HeaderError
    if reference_reads(blob):
        return HeaderError if stricter_than_reference(text) else None
    needed = declared_data_end(text)
    if needed is not None and needed > len(blob) - 8 - length and not stricter_than_reference(text):
        with tempfile.TemporaryDirectory() as folder:
            padded = Path(folder) / "padded.safetensors"
            padded.write_bytes(blob)
            with padded.open("r+b") as f:
                f.truncate(8 + length + needed)  # sparse: the reference maps it and reads no data
            if reference_opens(padded):
                return TruncatedFileError
    return HeaderError


def reference_reads(blob: bytes) -> bool:
    """Whether the safetensors library reads `blob` (its header validation, Metadata::validate)."""
    try:
        safetensors.deserialize(blob)
    except safetensors.SafetensorError:
        return False
    return True


def reference_opens(path: Path) -> bool:
    """reference_reads for a file (the library maps it), so a sparse file stands for a large one."""
    try:
        with safetensors.safe_open(str(path), "numpy"):
            return True
    except safetensors.SafetensorError:
        return False


class Pairs(list):
    """A JSON object as its list of (key, value) pairs, repeats kept (json.loads object_pairs_hook)."""


def stricter_than_reference(text: bytes) -> bool:
    """Headers the reference reads but we refuse on purpose: a tensor named twice (the library keeps the last),
    an entry spelt as a list of its fields, more than 64 dimensions or one of 2**62 or more (numpy cannot shape
it), a dtype numpy
    cannot hold (F4, F6_E2M3, F6_E3M2)."""
    pairs = json.loads(text, object_pairs_hook=Pairs)
    names = [name for name, _ in pairs if name != "__metadata__"]
    if len(set(names)) != len(names):
        return True
    for name, entry in pairs:
        if name == "__metadata__":
            continue
        if not isinstance(entry, Pairs):
            return True
        fields = dict(entry)
        dtype, shape = fields.get("dtype"), fields.get("shape")
        if not isinstance(dtype, str) or not isinstance(shape, list):
            continue  # a field missing or mistyped: the reference refuses it too
        if dtype not in NUMPY_DTYPES or len(shape) > 64 or any(isinstance(d, int) and d >= 2**62 for d in shape):
            return True
    return False


def declared_data_end(text: bytes) -> int | None:
    """Where the tensors' data ends by the header's own offsets (their largest end), when it says."""
    try:
        header = json.loads(text)
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except Exception:  # any header this cannot read has other problems first
        return None
    return max(ends, default=0) if all(type(end) is int and 0 <= end < 2**62 for end in ends) else None


def detected_as_safetensors(blob: bytes) -> bool:
    """Detection by content: a plausible header length followed by '{'."""
    return (len(blob) >= 9 and blob[8:9] == b"{"
            and struct.unpack("<Q", blob[:8])[0] <= min(MAX_HEADER_BYTES, len(blob) - 8))


def assert_safetensors_outcome(blob: bytes, file: Path, target: Path, format: str | None) -> None:
    """Opening `target` (`file`, holding `blob`, or its folder) ends exactly as the rules demand: the verdict's
    error naming the file, or every tensor and the metadata exactly as the header and data section say."""
    expected = safetensors_verdict(blob)
    if format is None and not detected_as_safetensors(blob):
        assert tm.detect(target) != "safetensors"
        assert isinstance(outcome(lambda: tm.open(target)), CheckpointError)
        return
    result = outcome(lambda: tm.open(target, format))
    event(f"{format or 'detected'}: {type(result).__name__}")
    if expected is not None:
        assert type(result) is expected, (result, expected)
        assert str(file) in str(result)
        return
    assert not isinstance(result, CheckpointError), result
    (length,) = struct.unpack("<Q", blob[:8])
    header, data = json.loads(blob[8:8 + length]), blob[8 + length:]
    reference = {name: (info["dtype"], info["shape"], bytes(info["data"]))
                 for name, info in safetensors.deserialize(blob)}
    with result as ck:
        assert ck.format == "safetensors"
        assert dict(ck.metadata) == (header.pop("__metadata__", None) or {})
        assert set(ck) == set(header) == set(reference)
        for name, tensor in ck.items():
            begin, end = header[name]["data_offsets"]
            assert (tensor.dtype, list(tensor.shape)) == reference[name][:2] == (header[name]["dtype"],
                                                                                 header[name]["shape"])
            assert tensor.chunks[0].byte_range == (8 + length + begin, 8 + length + end)
            assert data[begin:end] == reference[name][2]
            stored = np.frombuffer(data[begin:end], np.uint8)
            if tensor.dtype == "BOOL":  # any non-zero byte is True; numpy copies normalise it to 1
                assert np.array_equal(tensor.full().reshape(-1), stored != 0)
            else:
                assert tensor.full().tobytes() == stored.tobytes()
            tensor_stats(tensor)  # what `tensormorph stats` runs, on whatever the bytes hold (NaN, inf)


@FUZZ
@given(header=headers(), data_len=st.integers(0, 160), seed=st.integers(0, 2**32 - 1))
@example(header={"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, data_len=16, seed=0)
@example(header={"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, data_len=0, seed=0)
@example(header={"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "__metadata__": [1]}, data_len=16,
         seed=0)
@example(header={"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, data_len=20, seed=0)
def test_safetensors_random_headers(header: Any, data_len: int, seed: int) -> None:
    blob = safetensors_bytes(header, np.random.default_rng(seed).bytes(data_len))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        path.write_bytes(blob)
        assert_safetensors_outcome(blob, path, path, "safetensors")


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
        assert_safetensors_outcome(blob, path, path, "safetensors")
        assert_safetensors_outcome(blob, path, path, None)
        assert_safetensors_outcome(blob, path, Path(folder), None)


@settings(FUZZ, max_examples=50)
@given(changes=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8))
def test_safetensors_data_section_mutations_read_the_new_values(changes: list[tuple[int, int]]) -> None:
    """Edits of tensor data alone keep the file valid: it opens and reads exactly the edited bytes."""
    seed = safetensors_seed_bytes()
    data_start = _header_range(seed)[1][1]
    blob = mutate(seed, ([(data_start + at % (len(seed) - data_start), value) for at, value in changes], None))
    assert safetensors_verdict(blob) is None
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        path.write_bytes(blob)
        assert_safetensors_outcome(blob, path, path, None)


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
    ({"w": {**GOOD, "data_offsets": [2**64, 2**64 + 16]}}, 16, HeaderError, "data_offsets"),  # no 64-bit int
    ({"w": {**GOOD, "data_offsets": [8, 24]}}, 24, HeaderError, r"its data \[8, 24\) leaves a gap after byte 0"),
    ({"w": GOOD}, 12, TruncatedFileError, "data ends at byte 16 of the data section, but the file holds only 12"),
    ({"w": GOOD}, 20, HeaderError, "the file holds 4 more bytes"),
    ({"w": GOOD, "v": {**GOOD, "data_offsets": [8, 24]}}, 32, HeaderError, "overlap"),
    ({"w": GOOD, "v": {**GOOD, "data_offsets": [24, 40]}}, 40, HeaderError, "leaves a gap after byte 16"),
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
    if isinstance(header, dict) and list(header) == ["w"] and "more bytes" not in message:
        assert info.value.tensor == "w"
    assert safetensors_verdict(path.read_bytes()) is error  # the reference refuses it too


ENTRY = '{"dtype":"F32","shape":[%d],"data_offsets":[%d,%d]}'


def entry(begin: int, end: int) -> str:
    return ENTRY % ((end - begin) // 4, begin, end)


def obj(*pairs: tuple[str, str]) -> str:
    """A JSON object spelt from (key, JSON text) pairs, repeats and all."""
    return "{" + ",".join(f'"{key}":{value}' for key, value in pairs) + "}"


@pytest.mark.parametrize("text, data_len, message, tensor", [
    (obj(("a", entry(0, 8)), ("a", entry(0, 8))), 8, "names the tensor twice", "a"),  # the library keeps the last
    (obj(("a", entry(0, 0)), ("a", entry(0, 8))), 8, "names the tensor twice", "a"),  # ... and reads 2 floats
    (obj(("a", entry(0, 8)), ("b", entry(8, 16)), ("a", entry(8, 16))), 16, "names the tensor twice", "a"),
    (obj(("__metadata__", "{}"), ("a", entry(0, 8)), ("__metadata__", "{}")), 8, "repeats __metadata__", None),
    ('{"a":{"dtype":"F32","shape":[2],"dtype":"F32","data_offsets":[0,8]}}', 8, "repeats the field 'dtype'", "a"),
    ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"data_offsets":[0,8]}}', 8, "the field 'data_offsets'",
     "a"),
])
def test_safetensors_repeated_keys_are_refused(tmp_path: Path, text: str, data_len: int, message: str,
                                               tensor: str | None) -> None:
    """json keeps the last of repeated keys silently; a tensor named twice is ambiguous (another reader may take
    the first), so it is refused, as the library refuses a repeated field or __metadata__."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(None, bytes(data_len), raw_header=text.encode()))
    with pytest.raises(HeaderError, match=message) as info:
        tm.open(path, "safetensors")
    assert info.value.tensor == tensor and info.value.file == str(path)
    assert safetensors_verdict(path.read_bytes()) is HeaderError


@pytest.mark.parametrize("text, metadata", [
    (obj(("__metadata__", '{"k":"1","k":"2"}'), ("a", entry(0, 8))), {"k": "2"}),
    ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1,"x":[2]}}', {}),
])
def test_safetensors_repeats_the_library_reads_read_as_it_does(tmp_path: Path, text: str,
                                                               metadata: dict[str, str]) -> None:
    """A repeated metadata key (the last wins) or unknown field (ignored) is read, as the library reads it."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(None, bytes(range(8)), raw_header=text.encode()))
    assert reference_reads(path.read_bytes())
    with tm.open(path, "safetensors") as ck:
        assert dict(ck.metadata) == metadata and ck["a"].full().tobytes() == bytes(range(8))


@pytest.mark.parametrize("spans, data_len, error, message, tensor", [
    ([("b", 8, 16), ("a", 0, 8)], 16, None, None, None),  # listed out of order, contiguous in order of offsets
    ([("z", 8, 8), ("a", 0, 8), ("b", 8, 16), ("e", 16, 16)], 16, None, None, None),  # empty ones between
    ([("a", 8, 16)], 16, HeaderError, r"its data \[8, 16\) leaves a gap after byte 0", "a"),
    ([("b", 12, 20), ("a", 0, 8)], 20, HeaderError, "leaves a gap after byte 8", "b"),
    ([("a", 0, 8), ("b", 4, 12)], 12, HeaderError, "overlaps the data of 'a', which ends at 8", "b"),
    ([("a", 0, 8), ("b", 0, 8)], 8, HeaderError, "overlaps the data of 'a'", "b"),
    ([("a", 0, 8), ("z", 12, 12)], 12, HeaderError, "leaves a gap after byte 8", "z"),  # empty, past the data
    ([("a", 0, 8)], 12, HeaderError, "the file holds 4 more bytes", None),
    ([], 1, HeaderError, "the file holds 1 more bytes", None),
    ([("b", 8, 16), ("a", 0, 8)], 12, TruncatedFileError, "data ends at byte 16 of the data section, but the file "
     "holds only 12", "b"),
])
def test_safetensors_data_must_tile_the_file_as_the_library_requires(
        tmp_path: Path, spans: list[tuple[str, int, int]], data_len: int, error: type[CheckpointError] | None,
        message: str | None, tensor: str | None) -> None:
    """The tensors' byte ranges, sorted, run from 0 to the end of the file without a gap or an overlap (the
    reference's Metadata::validate and its check that the file is fully covered); the order they are listed
    in does not matter."""
    text = obj(*((name, entry(begin, end)) for name, begin, end in spans))
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(None, bytes(data_len), raw_header=text.encode()))
    assert reference_reads(path.read_bytes()) is (error is None)
    assert safetensors_verdict(path.read_bytes()) is error
    if error is None:
        with tm.open(path, "safetensors") as ck:
            assert {name: ck[name].chunks[0].byte_range for name in ck} == {
                name: (8 + len(text) + begin, 8 + len(text) + end) for name, begin, end in spans}
        return
    with pytest.raises(error, match=message) as info:
        tm.open(path, "safetensors")
    assert info.value.tensor == tensor and info.value.file == str(path)


@st.composite
def laid_out_headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """(header text, data length) laid out the way writers lay files out (each tensor's data right after the
    previous one's, listed in any order), then maybe one step off: an offset or the data length moved by a
    byte or a value, a name repeated, __metadata__ of another type."""
    names = draw(st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=5, unique=True))
    specs = {name: (draw(st.sampled_from(SAFE_DTYPES)), draw(st.lists(st.integers(0, 3), max_size=3)))
             for name in names}
    pairs: list[tuple[str, Any]] = []
    offset = 0
    for name in draw(st.permutations(names)):
        dtype, shape = specs[name]
        size = math.prod(shape) * ITEMSIZE[dtype]
        pairs.append((name, {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}))
        offset += size
    step = draw(st.sampled_from(["none", "none", "begin", "end", "repeat", "metadata"]))
    at = draw(st.integers(0, len(pairs) - 1))
    if step in ("begin", "end"):
        pairs[at][1]["data_offsets"][1 if step == "end" else 0] += draw(st.sampled_from([-4, -1, 1, 4]))
    elif step == "repeat":
        pairs.insert(draw(st.integers(0, len(pairs))), (pairs[at][0], draw(plausible_entries())))
    elif step == "metadata":
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", draw(json_values)))
    text = "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}"
    return text.encode(), max(0, offset + draw(st.sampled_from([0, 0, 0, -1, 1, 8])))


@FUZZ
@given(header=laid_out_headers(), seed=st.integers(0, 2**32 - 1))
def test_safetensors_laid_out_headers(header: tuple[bytes, int], seed: int) -> None:
    """Near-valid layouts: the outcome is the reference's (safetensors_verdict) in every case."""
    text, data_len = header
    blob = safetensors_bytes(None, np.random.default_rng(seed).bytes(data_len), raw_header=text)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model.safetensors"
        path.write_bytes(blob)
        assert_safetensors_outcome(blob, path, path, "safetensors")


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
