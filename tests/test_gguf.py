"""GGUF: files written by the gguf package's GGUFWriter (one file, and a 3-way split set), read by our own
header parser and compared bit for bit with gguf.GGUFReader + gguf.quants.dequantize; the CLI and the
viewer API on them; hostile headers (hypothesis) that must fail as CheckpointErrors, small and fast.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import struct
import time
import tracemalloc
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from fixtures import gguf_builders
from fixtures.cache import cached_build
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from test_tiles import assert_fields_equal, decode_tile, reference_tile

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import CheckpointError, HeaderError, MissingFileError, TruncatedFileError, UnsupportedError
from tensormorph.formats import gguf as reader
from tensormorph.formats.gguf import quantized
from tensormorph.formats.gguf.header import MAX_METADATA_ITEMS, MAX_TENSORS
from tensormorph.ops.summary import describe
from tensormorph.server import create_app
from tensormorph.storage import LocalFiles

pytestmark = pytest.mark.timeout(120)

QUANTIZED = {"token_embd.weight": "Q4_K", "blk.0.attn_q.weight": "Q8_0", "blk.0.attn_k.weight": "Q4_0",
             "blk.0.attn_v.weight": "Q8_0", "blk.0.ffn_down.weight": "Q6_K"}
DTYPES = {**dict.fromkeys(QUANTIZED, "F32"), "blk.0.attn_norm.weight": "F32", "blk.0.ffn_up.weight": "F16",
          "blk.0.ffn_gate.weight": "BF16", "blk.0.attn_output.weight": "F32", "rope_freqs.weight": "I32",
          "output_norm.weight": "F16"}
SPLIT_FILES = [f"model-{k:05d}-of-00003.gguf" for k in (1, 2, 3)]


# ---------------------------------------------------------------------------
# fixtures: built once by gguf_builders into the fixture cache (tests/fixtures/cache.py)
# ---------------------------------------------------------------------------


def _cached_build() -> Path:
    return cached_build("gguf", gguf_builders, gguf_builders.build)


@pytest.fixture(scope="module")
def built() -> Path:
    return _cached_build()


@pytest.fixture(scope="module")
def single(built: Path) -> Path:
    return built / "single" / "model.gguf"


@pytest.fixture(scope="module")
def split(built: Path) -> Path:
    return built / "split" / SPLIT_FILES[0]


@pytest.fixture(scope="module")
def truth(single: Path) -> dict[str, np.ndarray]:
    return gguf_builders.reference([single])


@pytest.fixture(scope="module")
def split_truth(built: Path) -> dict[str, np.ndarray]:
    return gguf_builders.reference([built / "split" / name for name in SPLIT_FILES])


@pytest.fixture(scope="module")
def safetensors_copy(truth: dict[str, np.ndarray], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same values written by the safetensors library: quantized ones as gguf dequantizes them."""
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    arrays = {name: value.astype(ml_dtypes.bfloat16) if DTYPES[name] == "BF16" else value
              for name, value in truth.items()}
    safetensors.numpy.save_file(arrays, str(path))
    return path


def bits(array: np.ndarray) -> np.ndarray:
    """The array's bytes as unsigned integers of its item size: equality means bit-exact."""
    array = np.ascontiguousarray(array)
    return array.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[array.dtype.itemsize])


def assert_bit_exact(ours: np.ndarray, reference: np.ndarray, dtype: str) -> None:
    expected = reference.astype(ml_dtypes.bfloat16) if dtype == "BF16" else reference
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    np.testing.assert_array_equal(bits(ours), bits(expected))


# ---------------------------------------------------------------------------
# opening, values, metadata
# ---------------------------------------------------------------------------


def test_ggml_type_table_matches_gguf() -> None:
    sizes = {int(t): size for t, size in gguf.GGML_QUANT_SIZES.items()}
    names = {int(t): t.name for t in gguf.GGMLQuantizationType}
    assert {k: (n, b, s) for k, (n, b, s) in reader.GGML_TYPES.items() if k in sizes} == \
        {k: (names[k], *sizes[k]) for k in sizes}
    assert set(reader.GGML_TYPES) == set(sizes)


def test_impossible_split_numbers_are_refused(single: Path, tmp_path: Path) -> None:
    for name in ("m-00001-of-00000.gguf", "m-00004-of-00003.gguf"):
        forged = tmp_path / name
        forged.write_bytes(single.read_bytes())
        with pytest.raises(HeaderError, match="split"):
            tm.open(forged)


def test_detect_and_structure(single: Path, split: Path, truth: dict[str, np.ndarray]) -> None:
    assert tm.detect(single) == tm.detect(single.parent) == tm.detect(split) == "gguf"
    with tm.open(single) as ck:
        assert ck.format == "gguf" and ck.files == ("model.gguf",) and list(ck) == list(truth)
        assert {n: t.dtype for n, t in ck.items()} == DTYPES
        assert all(t.file_shard is None and len(t.chunks) == 1 for t in ck.values())
        assert {n: list(t.shape) for n, t in ck.items()} == {n: list(v.shape) for n, v in truth.items()}
    with tm.open(split.parent) as ck:
        assert ck.path == split and ck.files == tuple(SPLIT_FILES)
        shards = {n: t.file_shard for n, t in ck.items()}
        assert [shards[n] for n in truth] == [(1, 3)] * 4 + [(2, 3)] * 4 + [(3, 3)] * 3
        assert ck["blk.0.attn_output.weight"].files == (SPLIT_FILES[2],)


@pytest.mark.parametrize("which", ["single", "split"])
def test_full_reads_bit_exact(which: str, single: Path, split: Path, truth, split_truth) -> None:
    path, reference = (single, truth) if which == "single" else (split, split_truth)
    with tm.open(path) as ck:
        for name, tensor in ck.items():
            assert_bit_exact(tensor.full(), reference[name], DTYPES[name])
            assert_bit_exact(tensor.chunks[0].read(), reference[name], DTYPES[name])


REGIONS = [
    (np.s_[3, 300:301], "one value inside the second Q4_K block"),
    (np.s_[::5, ::300], "strided columns that skip whole blocks"),
    (np.s_[1:11:3, 255:258], "a block boundary"),
    (np.s_[-1, ::-7], "a negative step"),
    (np.s_[..., 511], "the last column"),
    (np.s_[4:4, :], "empty"),
]


@pytest.mark.parametrize("index", [r[0] for r in REGIONS], ids=[r[1] for r in REGIONS])
def test_region_reads_of_quantized_and_float_tensors(single: Path, truth, index: Any) -> None:
    with tm.open(single) as ck:
        for name in ("token_embd.weight", "blk.0.ffn_down.weight"):
            assert_bit_exact(ck[name][index], truth[name][index], "F32")
        rows = ck["blk.0.attn_output.weight"]  # F32, 4-D: mapped straight from the file
        assert_bit_exact(rows[1, ::2, 3:5, -3:], truth["blk.0.attn_output.weight"][1, ::2, 3:5, -3:], "F32")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_regions_bit_exact(data: st.DataObject, split: Path, split_truth) -> None:
    name = data.draw(st.sampled_from(sorted(DTYPES)))
    reference = split_truth[name]

    def piece(size: int) -> Any:
        return data.draw(st.one_of(
            st.integers(-size, size - 1),
            st.builds(slice, st.none() | st.integers(-size - 2, size + 2), st.none() | st.integers(-size - 2, size + 2),
                      st.none() | st.integers(-9, 40).filter(bool))))

    index = tuple(piece(n) for n in reference.shape)
    with tm.open(split) as ck:
        assert_bit_exact(ck[name][index], reference[index], DTYPES[name])


@pytest.fixture
def dequantized(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the block arrays the reader hands to gguf's dequantizer, call by call."""
    seen: list[tuple[int, ...]] = []
    dequantize = gguf.quants.dequantize

    def counting(rows: np.ndarray, qtype: Any) -> np.ndarray:
        seen.append(rows.shape)
        return dequantize(rows, qtype)

    monkeypatch.setattr(quantized, "_dequantizer", lambda: counting)
    return seen


def test_quantized_reads_dequantize_only_the_blocks_needed(single: Path, truth, dequantized) -> None:
    seen = dequantized
    with tm.open(single) as ck:
        embed = ck["token_embd.weight"]  # Q4_K, 12 rows of 2 blocks of 256 values (144 bytes each)
        assert_bit_exact(embed[3, 300:301], truth["token_embd.weight"][3, 300:301], "F32")
        assert seen == [(1, 144)]
        seen.clear()
        assert_bit_exact(embed[::5, 7], truth["token_embd.weight"][::5, 7], "F32")
        assert seen == [(3, 144)]
        seen.clear()
        q8 = ck["blk.0.attn_q.weight"]  # Q8_0, rows of 3 blocks of 32 values (34 bytes each)
        assert_bit_exact(q8[10, ::64], truth["blk.0.attn_q.weight"][10, ::64], "F32")
        assert seen == [(1, 68)]  # blocks 0 and 2, not the one between


def test_statistics_of_a_quantized_tensor_stream_in_bands(single: Path, truth, dequantized) -> None:
    from tensormorph.ops.stats import tensor_stats

    seen = dequantized
    with tm.open(single) as ck:
        embed = ck["token_embd.weight"]  # Q4_K, 12 rows of 512 values
        stats = tensor_stats(embed, block_bytes=2 * 512 * 8)  # bands of two rows
    values = truth["token_embd.weight"].astype(np.float64)
    assert (stats.min, stats.max) == (values.min(), values.max())
    assert len(seen) == 6 and all(shape[0] <= 2 for shape in seen)  # never the whole tensor at once


def test_metadata_and_long_arrays(single: Path, split: Path) -> None:
    fields = gguf.GGUFReader(single).fields
    with tm.open(single) as ck:
        meta = ck.metadata
        assert (meta["gguf_version"], meta["alignment"], meta["general.alignment"]) == (3, 64, 64)
        assert meta["tensor_types"] == {"F32": 2, "Q8_0": 2, "F16": 2, "Q4_K": 1, "Q4_0": 1, "BF16": 1, "Q6_K": 1,
                                        "I32": 1}
        for key in ("general.architecture", "general.name", "llama.context_length", "tensormorph.flag",
                    "tensormorph.negative", "tensormorph.pi", "tensormorph.small", "tensormorph.unicode"):
            assert meta[key] == fields[key].contents(), key
        assert meta["tensormorph.nested"] == [[1, 2], [3]]  # gguf's reader flattens nested arrays (its FIXME)
        assert fields["tensormorph.nested"].contents() == [1, 2, 3]
        assert meta["llama.attention.layer_norm_rms_epsilon"] == float(np.float32(1e-5))
        assert meta["tokenizer.ggml.tokens"] == "100 x STRING ['tok0', 'tok1', 'tok2', 'tok3', 'tok4', ...]"
        long_arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
        assert list(ck.objects) == list(long_arrays)
        for key in long_arrays:
            assert ck.objects[key].value() == fields[key].contents(), key
            assert ck.objects[key].file == "model.gguf"
        assert "split.count" not in meta
    with tm.open(split) as ck:
        assert (ck.metadata["split.count"], ck.metadata["split.tensors.count"], ck.metadata["alignment"]) == (3, 11, 32)


def test_encoding_is_shown_per_tensor(single: Path) -> None:
    with tm.open(single) as ck:
        records = {r["name"]: r for r in describe(ck)["tensors"]}
    q4k = records["token_embd.weight"]
    assert q4k["encoding"] == {
        "format": "Q4_K", "block_values": 256, "block_bytes": 144, "bits_per_value": 4.5, "stored_bytes": 12 * 2 * 144,
        "description": "Q4_K (256-value blocks of 144 B, 4.5 bits/value)"}
    assert q4k["split"] == "whole, Q4_K (256-value blocks of 144 B, 4.5 bits/value)"
    assert q4k["chunks"][0]["byte_range"][1] - q4k["chunks"][0]["byte_range"][0] == 12 * 2 * 144
    assert {n for n, r in records.items() if r["encoding"]} == set(QUANTIZED)
    assert {r["encoding"]["format"] for r in records.values() if r["encoding"]} == set(QUANTIZED.values())
    assert records["blk.0.ffn_up.weight"]["split"] == "whole"


def test_diff_against_a_safetensors_copy_is_equal(single: Path, split: Path, safetensors_copy: Path) -> None:
    for path in (single, split):
        report = tm.diff(path, safetensors_copy, objects=False)
        assert report.identical, report.to_dict()
        assert sorted(t.name for t in report.tensors) == sorted(DTYPES)
    report = tm.diff(single, split)
    assert report.identical, report.to_dict()  # same tensors, same long arrays, whatever the files


# ---------------------------------------------------------------------------
# split sets, folders, structural errors
# ---------------------------------------------------------------------------


def copy_split(split: Path, target: Path, names: dict[str, str] | None = None) -> Path:
    target.mkdir()
    for name in SPLIT_FILES:
        if names is None or name in names:
            shutil.copy(split.parent / name, target / (names or {}).get(name, name))
    return target


def test_any_split_file_opens_the_whole_set(split: Path) -> None:
    with tm.open(split.parent / SPLIT_FILES[1]) as ck:
        assert ck.path == split and len(ck) == 11


def test_missing_split_names_the_absent_file(split: Path, tmp_path: Path) -> None:
    folder = copy_split(split, tmp_path / "set", {SPLIT_FILES[0]: SPLIT_FILES[0], SPLIT_FILES[2]: SPLIT_FILES[2]})
    with pytest.raises(MissingFileError) as caught:
        tm.open(folder / SPLIT_FILES[0])
    assert caught.value.file == str(folder / SPLIT_FILES[1])
    assert "split 2 of 3 is missing" in str(caught.value)


def test_split_keys_must_match_the_names(split: Path, tmp_path: Path) -> None:
    swapped = copy_split(split, tmp_path / "swapped", {SPLIT_FILES[0]: SPLIT_FILES[0], SPLIT_FILES[1]: SPLIT_FILES[2],
                                                       SPLIT_FILES[2]: SPLIT_FILES[1]})
    with pytest.raises(HeaderError, match=r"split.no is 2, but the file name makes it split 1 \(0-based\)"):
        tm.open(swapped)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(split, renamed / "model.gguf")
    with pytest.raises(HeaderError, match="says it is split 0 .0-based. of 3"):
        tm.open(renamed / "model.gguf")


def test_folder_with_two_models_is_refused(single: Path, split: Path, tmp_path: Path) -> None:
    shutil.copy(single, tmp_path / "a-Q4_K.gguf")
    shutil.copy(single, tmp_path / "a-Q8_0.gguf")
    with pytest.raises(HeaderError, match="holds 2 GGUF models"):
        tm.open(tmp_path)
    with tm.open(tmp_path / "a-Q8_0.gguf") as ck:
        assert len(ck) == 11


def test_reading_quantized_tensors_without_gguf(single: Path, truth, monkeypatch) -> None:
    monkeypatch.setattr(quantized, "_dequantizer", lambda: None)
    with tm.open(single) as ck:
        assert_bit_exact(ck["blk.0.ffn_up.weight"].full(), truth["blk.0.ffn_up.weight"], "F16")
        with pytest.raises(UnsupportedError, match=r"reading it needs the gguf package") as caught:
            ck["token_embd.weight"][0, :4]
    assert caught.value.tensor == "token_embd.weight"


# ---------------------------------------------------------------------------
# CLI and viewer
# ---------------------------------------------------------------------------


def cli(*args: Any) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_cli_inspect_show_stats_diff(single: Path, split: Path, truth, safetensors_copy: Path) -> None:
    text = cli("inspect", split)
    assert "format gguf" in text and "11 tensors" in text and "3 file(s)" in text
    assert "shard 1 of 3, Q4_K (256-value blocks of 144 B, 4.5 bits/value)" in text
    assert "3 non-tensor entries: tokenizer.ggml.tokens, tokenizer.ggml.scores, tokenizer.ggml.token_type" in text
    data = json.loads(cli("inspect", "--json", single))
    record = next(t for t in data["tensors"] if t["name"] == "blk.0.ffn_down.weight")
    assert record["dtype"] == "F32" and record["encoding"]["format"] == "Q6_K" and record["shape"] == [6, 512]
    assert data["metadata"]["general.architecture"] == "llama" and data["format"] == "gguf"
    shown = json.loads(cli("show", "--json", single, "token_embd.weight", "--slice", "2:4, 250:260"))
    assert shown["values"] == truth["token_embd.weight"][2:4, 250:260].astype(np.float64).tolist()
    stats = json.loads(cli("stats", "--json", split, "blk.0.attn_k.weight"))[0]
    reference = truth["blk.0.attn_k.weight"].astype(np.float64)
    assert (stats["min"], stats["max"]) == (reference.min(), reference.max())
    assert stats["mean"] == pytest.approx(reference.mean(), rel=1e-12)
    assert "same: 11 tensors compared (11 equal)" in cli("diff", single, split)
    result = CliRunner().invoke(main, ["diff", "--json", str(single), str(safetensors_copy)])
    assert result.exit_code == 1, result.output  # the tokenizer arrays are objects only GGUF has
    report = json.loads(result.output)
    assert {t["name"]: t["status"] for t in report["tensors"]} == dict.fromkeys(DTYPES, "equal")
    assert {o["name"]: o["status"] for o in report["objects"]} == {
        "tokenizer.ggml.tokens": "only_a", "tokenizer.ggml.scores": "only_a", "tokenizer.ggml.token_type": "only_a"}


def test_viewer_shows_the_block_format(single: Path, truth) -> None:
    with TestClient(create_app([single])) as client:
        info = client.get("/api/checkpoints/a/tensor", params={"name": "token_embd.weight"}).json()
        assert info["encoding"]["format"] == "Q4_K"
        assert info["split"] == "whole, Q4_K (256-value blocks of 144 B, 4.5 bits/value)"  # the Inspector's "stored"
        summary = client.get("/api/checkpoints/a/summary").json()
        assert summary["format"] == "gguf" and summary["metadata"]["general.name"] == "tensormorph-fixture"
        response = client.get("/api/checkpoints/a/tile", params={"name": "token_embd.weight", "exact": "1",
                                                                 "h": "6", "w": "64"})
        assert response.status_code == 200, response.text
        header, fields = decode_tile(response.content)
        assert_fields_equal(fields, reference_tile(truth["token_embd.weight"], 0, 12, 0, 512, 6, 64, True))
        stats = client.get("/api/checkpoints/a/stats", params={"name": "blk.0.ffn_down.weight"}).json()
        assert (stats["min"], stats["max"]) == (float(truth["blk.0.ffn_down.weight"].min()),
                                                float(truth["blk.0.ffn_down.weight"].max()))


# ---------------------------------------------------------------------------
# hostile headers
# ---------------------------------------------------------------------------


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return u64(len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def info(name: str | bytes, ne: tuple[int, ...], type_id: int = 0, offset: int = 0) -> bytes:
    return gstr(name) + u32(len(ne)) + b"".join(u64(n) for n in ne) + u32(type_id) + u64(offset)


def gguf_file(kvs: list[bytes] = (), infos: list[bytes] = (), data: bytes = b"", *, version: int = 3,
              counts: tuple[int, int] | None = None, alignment: int = 32) -> bytes:
    tensor_count, kv_count = counts or (len(infos), len(kvs))
    header = b"GGUF" + u32(version) + u64(tensor_count) + u64(kv_count) + b"".join(kvs) + b"".join(infos)
    return header + bytes(-len(header) % alignment) + data


F32_4 = info("w", (4,))
HOSTILE = [
    ("tensor count", gguf_file(counts=(2**63, 0)), HeaderError, "claims 9223372036854775808 tensor records"),
    ("kv count", gguf_file(counts=(0, 2**40)), HeaderError, "key/value records, over the limit"),
    ("key length", b"GGUF" + u32(3) + u64(0) + u64(1) + u64(2**62), HeaderError, "over the 67108864-byte limit"),
    ("string value", gguf_file([gstr("k") + u32(8) + u64(10**6) + b"abc"]), TruncatedFileError,
     "the string value of 'k'"),
    ("array count", gguf_file([kv("a", 9, u32(10) + u64(2**61))]), TruncatedFileError,
     "array 'a' claims 2305843009213693952 items of at least 8 bytes"),
    ("string array count", gguf_file([kv("a", 9, u32(8) + u64(2**40))]), TruncatedFileError, "array 'a' claims"),
    ("nesting", gguf_file([kv("a", 9, (u32(9) + u64(1)) * 9 + u32(0) + u64(0))]), HeaderError,
     "nests arrays more than 8 deep"),
    ("value type", gguf_file([kv("a", 77, b"")]), HeaderError, "value type 77"),
    ("array item type", gguf_file([kv("a", 9, u32(13) + u64(1))]), HeaderError, "item type 13"),
    ("duplicate key", gguf_file([kv("a", 4, u32(1)), kv("a", 4, u32(1))]), HeaderError, "repeats the metadata key"),
    ("alignment zero", gguf_file([kv("general.alignment", 4, u32(0))]), HeaderError, "power of two, found 0"),
    ("alignment type", gguf_file([kv("general.alignment", 6, struct.pack("<f", 32.0))]), HeaderError,
     "power of two, found 32.0"),
    ("dims", gguf_file(infos=[info("w", (1, 1, 1, 1, 1))]), HeaderError, "has 5 dimensions"),
    ("dim size", gguf_file(infos=[info("w", (2**63,))]), HeaderError, "at or above 2**62"),
    ("type", gguf_file(infos=[info("w", (4,), 99)]), UnsupportedError, "ggml type 99"),
    ("block", gguf_file(infos=[info("w", (33, 2), 8)]), HeaderError, "not a whole number of 32-value Q8_0 blocks"),
    ("offset alignment", gguf_file(infos=[info("w", (4,), 0, 4)], data=bytes(64)), HeaderError,
     "not a multiple of the alignment 32"),
    ("data past end", gguf_file(infos=[F32_4], data=bytes(8)), TruncatedFileError, "runs past the end"),
    ("overlap", gguf_file(infos=[F32_4, info("v", (16,))], data=bytes(64)), HeaderError, "overlap"),
    ("duplicate tensor", gguf_file(infos=[F32_4, info("w", (4,), 0, 32)], data=bytes(64)), HeaderError,
     "appears twice"),
    ("tensor infos", gguf_file(counts=(MAX_TENSORS + 1, 0)), HeaderError,
     f"claims {MAX_TENSORS + 1} tensor records, over the limit of {MAX_TENSORS}"),
    ("name utf-8", gguf_file(infos=[info(b"\xff\xfe", (4,))], data=bytes(16)), HeaderError, "not valid UTF-8"),
    ("version 1", b"GGUF" + u32(1) + bytes(16), UnsupportedError, "version 1"),
    ("big-endian", b"GGUF" + struct.pack(">I", 3) + bytes(16), UnsupportedError, "big-endian"),
    ("version", b"GGUF" + u32(7) + bytes(16), HeaderError, "version 7"),
    ("magic", b"GGUF"[:3], TruncatedFileError, "the magic"),
]


@pytest.mark.parametrize("blob, kind, fragment", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_headers_fail_with_a_clear_error(tmp_path: Path, blob: bytes, kind: type, fragment: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(blob)
    with pytest.raises(kind) as caught:
        tm.open(path, format="gguf")
    assert fragment in str(caught.value) and str(path) in str(caught.value)
    if kind is not HeaderError or "tensor" in fragment:
        return
    assert caught.value.file == str(path)


def test_tensor_errors_name_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_file(infos=[info("blk.3.w", (33, 2), 8)]))
    with pytest.raises(HeaderError) as caught:
        tm.open(path)
    assert caught.value.tensor == "blk.3.w" and caught.value.file == str(path)


def test_metadata_items_are_counted_across_key_values(tmp_path: Path) -> None:
    """Each key/value alone is under MAX_METADATA_ITEMS; together they are over it (the count runs across the
    whole header, not per array), and the error names the key/value that crosses it."""
    half = MAX_METADATA_ITEMS // 2 + 1
    nested = u32(9) + u64(1) + u32(7) + u64(half) + bytes(half)  # [[False] * half]: decoded on open
    path = tmp_path / "items.gguf"
    path.write_bytes(gguf_file([kv("a", 9, nested)]))
    with tm.open(path, format="gguf") as ck:
        assert ck.metadata["a"] == [[False] * half]
    path.write_bytes(gguf_file([kv("a", 9, nested), kv("b", 9, nested)]))
    with pytest.raises(HeaderError, match=f"the items of array 'b': the metadata holds more than "
                                          f"{MAX_METADATA_ITEMS} values and array items, over the limit"):
        tm.open(path, format="gguf")


def test_long_arrays_of_arrays_are_summarised_and_load_whole(tmp_path: Path) -> None:
    """A long array whose items are arrays: walked past on open (its first items shown), read whole on demand."""
    path = tmp_path / "nested.gguf"
    path.write_bytes(gguf_file([kv("a", 9, u32(9) + u64(65) + (u32(4) + u64(2) + u32(1) + u32(2)) * 65),
                                kv("b", 4, u32(7))]))
    with tm.open(path, format="gguf") as ck:
        assert ck.metadata["a"] == "65 x ARRAY [[1, 2], [1, 2], [1, 2], [1, 2], [1, 2], ...]"
        assert ck.metadata["b"] == 7
        assert ck.objects["a"].value() == [[1, 2]] * 65


def open_and_read_everything(path: Path) -> CheckpointError | dict[str, np.ndarray]:
    """Open and read every tensor and object, in bounded memory: the tensors read, or the CheckpointError."""
    tracemalloc.start()
    try:
        with tm.open(path, format="gguf") as ck:
            read = {name: tensor.full() for name, tensor in ck.items()}
            for entry in ck.objects.values():
                entry.value()
        event("opened and read")
        return read
    except CheckpointError as exc:
        event(type(exc).__name__)
        return exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 32 * 1024**2, f"peak {peak} bytes"


HEADER_ERRORS = (HeaderError, TruncatedFileError, UnsupportedError)


def assert_refused(result: Any, path: Path, kinds: tuple[type, ...] = HEADER_ERRORS) -> None:
    assert type(result) in kinds, result
    assert str(path) in str(result)


REFERENCE_MEMORY = 256 << 20  # bytes the reference may allocate beyond what the test process holds already
REFERENCE_SECONDS = 2  # it parses the small fixture in milliseconds


def reference_refuses(path: Path) -> bool:
    """Whether the gguf package's own reader cannot parse the file (its header or its tensor table).

    It runs in a forked child with bounded memory and time: on a forged count the reference allocates
    whatever the count says (tens of GiB), and one that cannot parse the file in bounded memory refuses it."""
    held = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmSize:"))
    pid = os.fork()
    if pid == 0:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (held + REFERENCE_MEMORY, held + REFERENCE_MEMORY))
            gguf_builders.reference([path])
        except BaseException:  # the reference raises many types on damaged files, MemoryError among them
            os._exit(1)
        os._exit(0)
    deadline = time.monotonic() + REFERENCE_SECONDS
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) != 0
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return True


FUZZ = settings(max_examples=150, deadline=3000, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.filter_too_much])


Q8_BODY = u64(1) + u64(0) + info("q", (32, 2), 8)


@FUZZ
@given(version=st.sampled_from([2, 3, 2**31 + 3]), body=st.binary(max_size=400))
@example(version=3, body=u64(1) + u64(0) + info("w", (2**40, 2**20), 12))
@example(version=3, body=u64(0) + u64(0))
def test_random_headers(tmp_path: Path, version: int, body: bytes) -> None:
    """Random headers: an unknown version, a file too short for its counts or counts over the limit are
    refused; no records is an empty checkpoint; any other header the gguf package cannot parse is refused too
    (headers it parses are left to the tests of real files: this reader is stricter)."""
    path = tmp_path / "random.gguf"
    path.write_bytes(b"GGUF" + u32(version) + body)
    counts = struct.unpack("<QQ", body[:16]) if len(body) >= 16 else None
    if version not in (2, 3):
        expected: tuple[type, ...] | None = (HeaderError,)
    elif counts is None:
        expected = (TruncatedFileError,)
    elif max(counts) > reader.MAX_COUNT:
        expected = (HeaderError,)
    elif counts == (0, 0):
        expected = None
    else:
        assume(reference_refuses(path))
        expected = HEADER_ERRORS
    result = open_and_read_everything(path)
    if expected is None:
        assert result == {}
    else:
        assert_refused(result, path, expected)


def test_a_hand_made_q8_0_file_reads_as_gguf_does(tmp_path: Path) -> None:
    path = tmp_path / "q8.gguf"
    path.write_bytes(b"GGUF" + u32(3) + Q8_BODY + bytes(-(8 + len(Q8_BODY)) % 32) + bytes(range(68)))
    with tm.open(path, format="gguf") as ck:
        assert list(ck) == ["q"]
        assert_bit_exact(ck["q"].full(), gguf_builders.reference([path])["q"], "F32")


@pytest.fixture(scope="module")
def real_bytes(single: Path) -> tuple[bytes, int]:
    """The single fixture file and where its data starts: mutations land in the header."""
    return single.read_bytes(), reader.read_header(LocalFiles(single.parent), single.name).data_start


@FUZZ
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=8)), max_size=4),
       cut=st.none() | st.floats(0, 1, exclude_max=True))
def test_mutated_real_headers(tmp_path: Path, real_bytes: tuple[bytes, int], edits: list, cut: float | None) -> None:
    """A real file cut short is truncated, whatever else was edited in its header; header edits that the gguf
    package cannot parse are refused; edits that change nothing read the original values."""
    data, data_start = real_bytes
    blob = bytearray(data)
    for where, replacement in edits:
        at = int(where * data_start)
        blob[at:at + len(replacement)] = replacement
    blob = blob[:len(data)]  # a replacement at the end of the header may reach into the data
    changed = bytes(blob) != data
    if cut is not None:
        blob = blob[:int(cut * len(blob))]
    path = tmp_path / "mutated.gguf"
    path.write_bytes(bytes(blob))
    result = open_and_read_everything(path)
    if cut is not None and not changed:
        assert_refused(result, path, (TruncatedFileError,))
    elif cut is None and not changed:
        assert isinstance(result, dict) and set(result) == set(DTYPES)
    else:
        assume(reference_refuses(path))
        assert_refused(result, path)


@settings(FUZZ, max_examples=40)
@given(changes=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_tensor_data_reads_as_gguf_does(tmp_path: Path, real_bytes: tuple[bytes, int],
                                                changes: list) -> None:
    """Edits of tensor data alone keep the file valid: every tensor reads as gguf's own reader reads it."""
    data, data_start = real_bytes
    blob = bytearray(data)
    for where, value in changes:
        blob[data_start + int(where * (len(data) - data_start))] = value
    path = tmp_path / "mutated.gguf"
    path.write_bytes(bytes(blob))
    read = open_and_read_everything(path)
    assert isinstance(read, dict), read
    reference = gguf_builders.reference([path])
    assert set(read) == set(reference) == set(DTYPES)
    for name, value in read.items():
        assert_bit_exact(value, reference[name], DTYPES[name])
