"""Flax msgpack: files written by the real flax (tests/fixtures/flax_builders), read without JAX; every command on
them; hostile and mutated bytes give a clear CheckpointError."""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from fixtures import flax_builders
from fixtures.cache import cached_build
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import CheckpointError, HeaderError, TruncatedFileError, UnsupportedError
from tensormorph.formats import flax_msgpack


@pytest.fixture(scope="module")
def built() -> Path:
    return cached_build("flax", flax_builders, flax_builders.build)


def bits(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8)


def assert_bit_exact(ours: np.ndarray, expected: np.ndarray) -> None:
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    np.testing.assert_array_equal(bits(ours), bits(expected))


def flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        elif isinstance(value, list):
            out.update(flat({str(i): v for i, v in enumerate(value)}, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def cli(*args: Any, code: int = 0) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.exception)
    return result.output


def write(tmp_path: Path, data: bytes, name: str = "x.msgpack") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------
# detection and values
# ---------------------------------------------------------------------------


def test_detects_msgpack_files_and_folders_by_suffix_and_structure(built: Path, tmp_path: Path) -> None:
    assert tm.detect(built / "bert.msgpack") == "flax_msgpack"
    folder = tmp_path / "hf_flax"
    folder.mkdir()
    shutil.copy(built / "bert.msgpack", folder / "flax_model.msgpack")
    (folder / "config.json").write_text("{}")
    assert tm.detect(folder) == "flax_msgpack"
    assert tm.detect(write(tmp_path, msgpack.packb([1, 2]), "list.msgpack")) is None  # not a map
    assert tm.detect(write(tmp_path, msgpack.packb({1: 2}), "intkey.msgpack")) is None  # keys are not strings
    assert tm.detect(write(tmp_path, (built / "bert.msgpack").read_bytes(), "bert.bin")) != "flax_msgpack"


def test_every_leaf_kind_of_a_real_flax_file(built: Path) -> None:
    expected = flat(flax_builders.mixed_tree())
    arrays = {n: v for n, v in expected.items() if isinstance(v, np.ndarray)}
    with tm.open(built / "mixed.msgpack") as ck:
        assert ck.format == "flax_msgpack" and sorted(ck) == sorted(arrays)
        dtypes = {n: t.dtype for n, t in ck.tensors.items()}
        assert dtypes == {"params.dense.kernel": "F32", "params.dense.bias": "BF16", "params.embed.embedding": "F16",
                          "ids": "I64", "mask": "BOOL", "zero_d": "F32", "empty": "F32", "waves": "C64",
                          "history.0": "I16"}
        for name, value in arrays.items():
            assert_bit_exact(ck[name].full(), value)
        values = {n: e.value() for n, e in ck.objects.items()}
    assert values == {"step": 12, "lr": 0.001, "name": "run-7", "flag": True, "nothing": None, "z": 1.5 - 2j,
                      "blob": b"\x00\x01\xff", "history.1": 4, "history.2": "x", "opt": {}}
    assert type(values["step"]) is int  # a numpy scalar (ext 3) comes back as its Python value


def test_bert_arrays_are_read_lazily_at_their_offsets(built: Path) -> None:
    truth = safetensors.numpy.load_file(str(built / "truth.safetensors"))
    data = (built / "bert.msgpack").read_bytes()
    with tm.open(built / "bert.msgpack") as ck:
        assert sorted(ck) == sorted(truth) and len(ck) == 39 and not ck.objects
        for name, value in truth.items():
            tensor = ck[name]
            (chunk,) = tensor.chunks
            begin, end = chunk.byte_range
            assert data[begin:end] == value.tobytes()  # the raw bytes, where the walk located them
            assert_bit_exact(tensor.full(), value)
        kernel = truth["params.encoder.layer.1.intermediate.dense.kernel"]
        region = ck["params.encoder.layer.1.intermediate.dense.kernel"][3:9:2, -5:]
        np.testing.assert_array_equal(region, kernel[3:9:2, -5:])


def test_reads_from_an_object_store_url(built: Path) -> None:
    import fsspec

    fsspec.filesystem("memory").pipe("/flax-test/bert.msgpack", (built / "bert.msgpack").read_bytes())
    truth = safetensors.numpy.load_file(str(built / "truth.safetensors"))
    with tm.open("memory://flax-test/bert.msgpack", cache=False) as ck:
        assert ck.format == "flax_msgpack" and sorted(ck) == sorted(truth)
        for name, value in truth.items():
            assert_bit_exact(ck[name].full(), value)


def test_chunked_arrays_are_one_tensor_of_flat_pieces(built: Path) -> None:
    expected = flax_builders.chunked_tree()
    with tm.open(built / "chunked.msgpack") as ck:
        assert sorted(ck) == ["big.table", "small"] and not ck.objects
        table = ck["big.table"]
        assert table.shape == (7, 5) and len(table.chunks) > 3  # 35 floats in pieces of 16: cut at row edges
        assert_bit_exact(table.full(), expected["big"]["table"])
        np.testing.assert_array_equal(table[2:6, 1:4], expected["big"]["table"][2:6, 1:4])
        assert_bit_exact(ck["small"].full(), expected["small"])


# ---------------------------------------------------------------------------
# the commands
# ---------------------------------------------------------------------------


def test_cli_inspect_show_stats_verify_convert(built: Path, tmp_path: Path) -> None:
    truth = safetensors.numpy.load_file(str(built / "truth.safetensors"))
    path = built / "bert.msgpack"
    text = cli("inspect", path)
    assert "flax_msgpack" in text and "39 tensors" in text
    name = "params.encoder.layer.0.attention.self.query.kernel"
    shown = json.loads(cli("show", "--json", path, name, "--slice", "1:3, 4:7"))
    assert shown["values"] == truth[name][1:3, 4:7].astype(np.float64).tolist()
    stats = json.loads(cli("stats", "--json", path, name))[0]
    assert (stats["min"], stats["max"]) == (float(truth[name].min()), float(truth[name].max()))
    verified = json.loads(cli("verify", "--json", "--full", path))
    assert verified["ok"] and verified["format"] == "flax_msgpack" and verified["tensors"] == 39
    cli("convert", path, tmp_path / "hf", "--rename", "params.=")  # checked against the source by convert itself
    with tm.open(tmp_path / "hf") as ck:
        assert sorted(ck) == sorted(n.removeprefix("params.") for n in truth)
        for n, value in truth.items():
            assert_bit_exact(ck[n.removeprefix("params.")].full(), value)


def test_load_into_torch_tensors(built: Path) -> None:
    import torch

    truth = safetensors.numpy.load_file(str(built / "truth.safetensors"))
    state = {name: torch.zeros(value.shape) for name, value in truth.items()}
    tm.load(built / "bert.msgpack", state)
    for name, value in truth.items():
        assert_bit_exact(state[name].numpy(), value)


def test_verify_reports_a_truncated_file(built: Path, tmp_path: Path) -> None:
    data = (built / "bert.msgpack").read_bytes()
    path = write(tmp_path, data[:-100])
    report = tm.verify(path)
    assert not report.ok and report.problems[0].kind == "TruncatedFileError"


# ---------------------------------------------------------------------------
# hostile input
# ---------------------------------------------------------------------------


def ext(code: int, payload: bytes) -> bytes:
    return b"\xc9" + struct.pack(">I", len(payload)) + struct.pack(">b", code) + payload


def array_payload(shape: list[int], dtype: str, data: bytes) -> bytes:
    return msgpack.packb([shape, dtype, data], use_bin_type=True)


def map_of(key: str, value: bytes) -> bytes:
    return b"\x81" + msgpack.packb(key) + value


@pytest.mark.parametrize(("data", "error", "match"), [
    (map_of("a", b"\xc6\xff\xff\xff\xff"), TruncatedFileError, "ends inside a value"),  # bin32 of 4 GiB
    (map_of("a", b"\xdb\x7f\xff\xff\xff"), TruncatedFileError, "ends inside a value"),  # str32 of 2 GiB
    (b"\x81" + msgpack.packb("a") + b"\xdf\xff\xff\xff\xff", HeaderError, "over the limit"),  # 4 billion entries
    (b"\x81" + msgpack.packb("a") + b"\xdf\x00\x00\x10\x00", TruncatedFileError, "4096 entries"),
    (b"\xdd\xff\xff\xff\xff", HeaderError, "a list"),  # a list at the top
    (map_of("a", ext(1, b"\x93")), HeaderError, "array header"),
    (map_of("a", b"\xc9\xff\xff\xff\xf0\x01"), TruncatedFileError, "ext of 4294967280 bytes"),
    (map_of("a", ext(1, array_payload([2**40, 2**40], "float32", b"\x00" * 8))), HeaderError, "needs"),
    (map_of("a", ext(1, array_payload([-1], "float32", b""))), HeaderError, "non-negative"),
    (map_of("a", ext(1, array_payload([2], "float32", b"\x00" * 8) + b"xx")), HeaderError, "besides"),
    (map_of("a", ext(1, array_payload([2], "object", b"\x00" * 8))), UnsupportedError, "dtype 'object'"),
    (map_of("a", b"\x01") + b"\x00", HeaderError, "after the msgpack object"),
    (b"\x82" + msgpack.packb("a") + b"\x01" + msgpack.packb("a") + b"\x02", HeaderError, "repeats the key"),
    (b"\x82" + msgpack.packb("a.b") + b"\x01" + msgpack.packb("a") + b"\x81" + msgpack.packb("b") + b"\x02",
     HeaderError, "joined with dots"),
    (map_of("a", b"\x81\x01\x02"), HeaderError, "map key of type int"),
    (map_of("a", b"\xc1"), HeaderError, "not valid msgpack"),
    (map_of("a", ext(2, b"\x92\xa1x\x01")), HeaderError, "complex"),
])
def test_hostile_files_give_one_clear_error(tmp_path: Path, data: bytes, error: type, match: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(error, match=match) as caught:
        tm.open(path, format="flax_msgpack")
    assert str(path) in str(caught.value)


def test_deep_nesting_and_too_many_leaves_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep = b"\x81\xa1k" * 10_000 + b"\x01"
    with pytest.raises(HeaderError, match=f"nested over {flax_msgpack.MAX_DEPTH} levels"):
        tm.open(write(tmp_path, deep))
    monkeypatch.setattr(flax_msgpack.walk, "MAX_LEAVES", 100)
    with pytest.raises(HeaderError, match="over 100 leaves"):
        tm.open(write(tmp_path, msgpack.packb({"a": list(range(101))}), "many.msgpack"))


def test_unknown_ext_codes_are_objects_that_say_so(tmp_path: Path) -> None:
    with tm.open(write(tmp_path, map_of("a", ext(42, b"abc")))) as ck, \
            pytest.raises(UnsupportedError, match="ext of type 42"):
        ck.objects["a"].value()


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_files_give_a_checkpoint_error_or_open(built: Path, tmp_path: Path, data: st.DataObject) -> None:
    """Flipped, overwritten, inserted and cut bytes of real Flax files: a CheckpointError or a checkpoint whose every
    tensor reads, never another exception, a hang or a huge allocation."""
    source = data.draw(st.sampled_from(["mixed.msgpack", "chunked.msgpack"]))
    raw = bytearray((built / source).read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        kind = data.draw(st.sampled_from(["flip", "big", "insert", "cut"]))
        if kind == "flip":
            raw[at] ^= data.draw(st.integers(1, 255))
        elif kind == "big":  # a length field made huge
            raw[at:at + 4] = b"\xff\xff\xff\xf0"
        elif kind == "insert":
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del raw[at:at + data.draw(st.integers(1, 16))]
    path = write(tmp_path, bytes(raw), "m.msgpack")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with tm.open(path, format="flax_msgpack") as ck:
            for tensor in ck.values():
                tensor.full()
            for entry in ck.objects.values():
                with contextlib.suppress(CheckpointError):
                    entry.value()
    except CheckpointError as exc:
        assert str(path) in str(exc)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: no huge allocation
