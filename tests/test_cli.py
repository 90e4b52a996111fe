"""The `tensormorph` command on small real checkpoints, driven through click's CliRunner."""

from __future__ import annotations

import io
import json
import math
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch  # a dev dependency: the seeds are made by torch itself
from click.testing import CliRunner, Result

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)


def seeded_stats_target() -> np.ndarray:
    rng = np.random.default_rng(11)
    values = rng.standard_normal((6, 7)).astype(np.float32) * 3
    values[0, :3] = 0.0
    values[2, 2] = -0.0
    values[1, 1] = np.nan
    values[4, 6] = np.nan
    values[3, 0] = np.inf
    values[5, 5] = -np.inf
    return values


ST_TENSORS = {
    "model.embed.weight": np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32),
    "model.layers.0.attn.w": np.random.default_rng(2).standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
    "model.layers.1.attn.w": np.random.default_rng(3).standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
    "stats.target": seeded_stats_target(),
    "ids": np.array([-(2**40), -1, 0, 7, 2**53 + 1], dtype=np.int64),
    "mask": np.array([True, False, False, True]),
}
SHARDED_FULL = seeded_stats_target().T.copy()  # (7, 6): rows split 2,2,2,1 over 4 ranks, NaNs in two chunks
SHARDED_ROWS = [(0, 2), (2, 4), (4, 6), (6, 7)]


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def ok(*args: str) -> Result:
    result = invoke(*args)
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


def ok_json(*args: str) -> Any:
    return json.loads(ok(*args, "--json").stdout)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp

    base = tmp_path_factory.mktemp("cli")
    paths: dict[str, Path] = {}

    paths["st"] = base / "model.safetensors"
    safetensors.numpy.save_file(ST_TENSORS, str(paths["st"]), metadata={"format": "np"})

    paths["pt"] = base / "state.pt"
    torch.save({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4,
                "nested": {"b": torch.tensor([5, -6], dtype=torch.int64)}, "step": 3}, paths["pt"])

    paths["dcp"] = base / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(24, dtype=torch.float32).reshape(4, 6) - 5.5, "step": 5},
                 checkpoint_id=str(paths["dcp"]))

    paths["sharded"] = base / "sharded"
    paths["sharded"].mkdir()
    for rank, (begin, end) in enumerate(SHARDED_ROWS):
        info = json.dumps({"w": {"saved_offsets": [begin, 0]}})
        safetensors.numpy.save_file({"w": SHARDED_FULL[begin:end].copy()},
                                    str(paths["sharded"] / f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"),
                                    metadata={"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": info})

    paths["marker"] = base / "payload-ran"
    paths["malicious"] = base / "malicious.pt"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", f"cos\nsystem\n(S'touch {paths['marker']}'\ntR.".encode())
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    paths["malicious"].write_bytes(buffer.getvalue())

    paths["legacy"] = base / "legacy.pt"
    torch.save({"w": torch.ones(2)}, paths["legacy"], _use_new_zipfile_serialization=False)

    paths["text"] = base / "notes.txt"
    paths["text"].write_text("not a checkpoint\n")
    return paths


def header_offsets(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return 8 + length, json.loads(raw[8:8 + length])


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------


def test_inspect_json_safetensors(ckpts: dict[str, Path]) -> None:
    data = ok_json("inspect", ckpts["st"])
    assert data["format"] == "safetensors"
    assert data["files"] == ["model.safetensors"]
    assert data["tensor_count"] == len(ST_TENSORS)
    assert data["params"] == sum(a.size for a in ST_TENSORS.values())
    assert data["nbytes"] == sum(a.nbytes for a in ST_TENSORS.values())
    assert data["metadata"] == {"format": "np"}
    data_start, header = header_offsets(ckpts["st"])
    records = {t["name"]: t for t in data["tensors"]}
    assert set(records) == set(ST_TENSORS)
    for name, array in ST_TENSORS.items():
        record = records[name]
        assert record["dtype"] == header[name]["dtype"]
        assert record["shape"] == list(array.shape)
        assert record["numel"] == array.size
        assert record["nbytes"] == array.nbytes
        assert record["split"] == "whole"
        assert record["files"] == ["model.safetensors"]
        assert record["chunk_count"] == 1
        begin, end = header[name]["data_offsets"]
        assert record["chunks"] == [{"offsets": [0] * array.ndim, "shape": list(array.shape),
                                     "file": "model.safetensors", "byte_range": [data_start + begin, data_start + end],
                                     "ranks": [], "contribution": 0}]
    assert records["model.layers.0.attn.w"]["dtype"] == "BF16"
    assert data["totals_by_dtype"]["BF16"] == {"tensors": 2, "params": 30, "nbytes": 60}
    assert data["totals_by_dtype"]["F32"] == {"tensors": 2, "params": 74, "nbytes": 296}
    assert data["totals_by_dtype"]["I64"] == {"tensors": 1, "params": 5, "nbytes": 40}
    assert data["totals_by_dtype"]["BOOL"] == {"tensors": 1, "params": 4, "nbytes": 4}


def test_inspect_text_safetensors(ckpts: dict[str, Path]) -> None:
    out = ok("inspect", ckpts["st"]).stdout
    assert "format safetensors" in out
    assert "6 tensors" in out and "113 params" in out
    for name in ST_TENSORS:
        assert name in out
    assert "8×4" in out and "6×7" in out and "3×5" in out
    assert "0..1 ×2" in out  # the two identical layers fold in the module tree
    assert "totals by dtype" in out
    no_tree = ok("inspect", ckpts["st"], "--no-tree").stdout
    assert "0..1 ×2" not in no_tree and "model.embed.weight" in no_tree


def test_inspect_json_placement_sharded(ckpts: dict[str, Path]) -> None:
    data = ok_json("inspect", ckpts["sharded"])
    assert data["format"] == "dcp-safetensors"
    (record,) = data["tensors"]
    assert record["shape"] == [7, 6] and record["dtype"] == "F32" and record["nbytes"] == 7 * 6 * 4
    assert record["split"] == "4 chunks, ranks 0-3"
    assert [c["offsets"] for c in record["chunks"]] == [[0, 0], [2, 0], [4, 0], [6, 0]]
    assert [c["shape"] for c in record["chunks"]] == [[2, 6], [2, 6], [2, 6], [1, 6]]
    assert [c["ranks"] for c in record["chunks"]] == [[0], [1], [2], [3]]
    text = ok("inspect", ckpts["sharded"], "--chunks").stdout
    assert "4 chunks, ranks 0-3" in text
    assert "[6, 0] +[1, 6]" in text


def test_inspect_json_torch_and_dcp(ckpts: dict[str, Path]) -> None:
    pt = ok_json("inspect", ckpts["pt"])
    assert pt["format"] == "torch"
    assert {t["name"]: (t["dtype"], t["shape"]) for t in pt["tensors"]} == {"w": ("F32", [3, 4]),
                                                                            "nested.b": ("I64", [2])}
    assert [o["name"] for o in pt["objects"]] == ["step"]
    dcp = ok_json("inspect", ckpts["dcp"])
    assert dcp["format"] == "dcp"
    assert [(t["name"], t["dtype"], t["shape"], t["nbytes"]) for t in dcp["tensors"]] == [("w", "F32", [4, 6], 96)]
    assert [o["name"] for o in dcp["objects"]] == ["step"]
    assert dcp["tensors"][0]["chunks"][0]["ranks"] == [0]


# ---------------------------------------------------------------------------
# show
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, text, index", [
    ("model.embed.weight", "1:3, ::-1", (slice(1, 3), slice(None, None, -1))),
    ("model.embed.weight", "-1", (-1,)),
    ("model.embed.weight", "..., 2", (Ellipsis, 2)),
    ("model.layers.1.attn.w", "::2, 1:4", (slice(None, None, 2), slice(1, 4))),
    ("stats.target", "1:5, 0:3", (slice(1, 5), slice(0, 3))),
    ("ids", "", ()),
    ("mask", "::-1", (slice(None, None, -1),)),
    ("ids", "4", (4,)),
])
def test_show_json_values_equal_numpy(ckpts: dict[str, Path], name: str, text: str, index: tuple) -> None:
    data = ok_json("show", ckpts["st"], name, "--slice", text)
    expected = ST_TENSORS[name][index]
    assert data["name"] == name and data["slice"] == text and data["rank"] is None
    assert data["shape"] == list(ST_TENSORS[name].shape)
    if expected.dtype.kind in "biu":
        assert data["values"] == expected.tolist()
        assert np.asarray(data["values"]).dtype.kind == expected.dtype.kind or expected.ndim == 0
    else:
        got = np.asarray(data["values"], dtype=np.float64)
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got, expected.astype(np.float64))  # exact, NaN == NaN


def test_show_text_prints_the_values(ckpts: dict[str, Path]) -> None:
    out = ok("show", ckpts["st"], "model.embed.weight", "--slice", "2:4, 1:3").stdout
    assert "model.embed.weight F32 [8, 4]" in out and "[2:4, 1:3]" in out
    with np.printoptions(threshold=400, edgeitems=4, linewidth=240):
        assert str(ST_TENSORS["model.embed.weight"][2:4, 1:3]) in out
        assert str(ST_TENSORS["ids"]) in ok("show", ckpts["st"], "ids").stdout


def test_show_rank_and_other_formats(ckpts: dict[str, Path]) -> None:
    for rank, (begin, end) in enumerate(SHARDED_ROWS):
        data = ok_json("show", ckpts["sharded"], "w", "--rank", str(rank))
        assert data["rank"] == rank
        np.testing.assert_array_equal(np.asarray(data["values"], np.float64), SHARDED_FULL[begin:end])
    data = ok_json("show", ckpts["sharded"], "w", "--rank", "1", "--slice", "1, ::-2")
    np.testing.assert_array_equal(np.asarray(data["values"], np.float64), SHARDED_FULL[2:4][1, ::-2])
    full = ok_json("show", ckpts["sharded"], "w", "--slice", "1:6, 5")
    np.testing.assert_array_equal(np.asarray(full["values"], np.float64), SHARDED_FULL[1:6, 5])
    pt = ok_json("show", ckpts["pt"], "w", "--slice", ":, 1")
    assert pt["values"] == [0.25, 1.25, 2.25]
    assert ok_json("show", ckpts["pt"], "nested.b")["values"] == [5, -6]
    dcp = ok_json("show", ckpts["dcp"], "w", "--slice", "-1")
    assert dcp["values"] == [12.5, 13.5, 14.5, 15.5, 16.5, 17.5]


# ---------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------


def numpy_stats(array: np.ndarray) -> dict[str, Any]:
    values = array.astype(np.float64).reshape(-1)
    finite = values[np.isfinite(values)]
    return {
        "numel": array.size,
        "min": float(finite.min()), "max": float(finite.max()),
        "mean": float(finite.mean()), "std": float(finite.std()),
        "abs_max": float(np.abs(finite).max()),
        "zeros": int(array.size - np.count_nonzero(array)),
        "nans": int(np.isnan(values).sum()),
        "infs": int(np.isinf(values).sum()),
        "zero_fraction": (array.size - np.count_nonzero(array)) / array.size,
    }


def assert_stats(record: dict, array: np.ndarray, name: str, dtype: str) -> None:
    want = numpy_stats(array)
    assert record["name"] == name and record["dtype"] == dtype
    for key in ("numel", "min", "max", "abs_max", "zeros", "nans", "infs"):
        assert record[key] == want[key], key
    for key in ("mean", "std", "zero_fraction"):
        assert math.isclose(record[key], want[key], rel_tol=1e-12, abs_tol=1e-15), key


def test_stats_json_values_equal_numpy(ckpts: dict[str, Path]) -> None:
    (record,) = ok_json("stats", ckpts["st"], "stats.target")
    assert_stats(record, ST_TENSORS["stats.target"], "stats.target", "F32")
    assert (record["zeros"], record["nans"], record["infs"]) == (4, 2, 2)


def test_stats_json_every_tensor_in_order(ckpts: dict[str, Path]) -> None:
    records = ok_json("stats", ckpts["st"])
    with tm.open(ckpts["st"]) as ck:
        order = list(ck)
    assert [r["name"] for r in records] == order
    by_name = {r["name"]: r for r in records}
    for name in ("model.embed.weight", "model.layers.0.attn.w", "stats.target"):
        assert_stats(by_name[name], ST_TENSORS[name], name, "BF16" if "layers" in name else "F32")
    ids = by_name["ids"]
    assert (ids["min"], ids["max"], ids["zeros"]) == (-(2**40), 2**53 + 1, 1)
    mask = by_name["mask"]
    assert (mask["min"], mask["max"], mask["zeros"], mask["mean"]) == (0, 1, 2, 0.5)


def test_stats_across_chunks_equal_numpy_on_the_whole(ckpts: dict[str, Path]) -> None:
    (record,) = ok_json("stats", ckpts["sharded"], "w")
    assert_stats(record, SHARDED_FULL, "w", "F32")


def test_stats_text_table(ckpts: dict[str, Path]) -> None:
    out = ok("stats", ckpts["st"], "stats.target", "ids").stdout
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    want = numpy_stats(ST_TENSORS["stats.target"])
    row = lines["stats.target"]
    assert row[1] == "F32"
    assert row[2:4] == [f"{want['min']:.6g}", f"{want['max']:.6g}"]
    assert row[-3:] == [f"{want['zero_fraction']:.2%}", "2", "2"]
    assert lines["ids"][2:4] == [f"{-(2**40):.6g}", f"{2**53 + 1:.6g}"]


# ---------------------------------------------------------------------------
# errors: exit code 2, one line on stderr, no traceback
# ---------------------------------------------------------------------------


def library_error(action) -> str:
    with pytest.raises(CheckpointError) as info:
        action()
    return str(info.value)


def assert_clean_failure(result: Result, message: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0] == f"error: {message}"
    assert result.stdout == ""


def test_missing_tensor(ckpts: dict[str, Path]) -> None:
    with tm.open(ckpts["st"]) as ck:
        message = library_error(lambda: ck["nope"])
    assert "'nope'" in message and "no such tensor" in message
    assert_clean_failure(invoke("show", ckpts["st"], "nope"), message)
    assert_clean_failure(invoke("stats", ckpts["st"], "ids", "nope"), message)


def test_unsafe_pickle_is_refused_and_not_run(ckpts: dict[str, Path]) -> None:
    message = library_error(lambda: tm.open(ckpts["malicious"]))
    assert "refuses global os.system" in message and str(ckpts["malicious"]) in message
    for command in ("inspect", "stats"):
        assert_clean_failure(invoke(command, ckpts["malicious"]), message)
    assert_clean_failure(invoke("show", ckpts["malicious"], "w"), message)
    assert not ckpts["marker"].exists()


@pytest.mark.parametrize("text, fragment", [
    ("0:a", "cannot parse index '0:a'"),
    ("1:2:3:4", "cannot parse index"),
    ("99", "index 99 is out of range for axis 0 of size 8"),
    ("0, 0, 0", "too many indices (3)"),
    ("::0", "slice step cannot be zero"),
    ("..., ...", "only one Ellipsis"),
])
def test_bad_slice_text(ckpts: dict[str, Path], text: str, fragment: str) -> None:
    result = invoke("show", ckpts["st"], "model.embed.weight", "--slice", text)
    assert result.exit_code == 2
    assert fragment in result.stderr
    with tm.open(ckpts["st"]) as ck:
        message = library_error(lambda: ck["model.embed.weight"].read(tm.indexing.parse_index(text)))
    assert_clean_failure(result, message)


def test_other_failures_exit_2(ckpts: dict[str, Path]) -> None:
    result = invoke("show", ckpts["sharded"], "w", "--rank", "7")
    assert_clean_failure(result, "tensor 'w': rank 7 holds no stored chunk (chunks were written by ranks [0, 1, 2, 3]; "
                                 "replicated copies are stored once)")
    legacy = invoke("inspect", ckpts["legacy"])
    assert_clean_failure(legacy, library_error(lambda: tm.open(ckpts["legacy"])))
    assert "legacy" in legacy.stderr
    assert_clean_failure(invoke("inspect", ckpts["text"]), library_error(lambda: tm.open(ckpts["text"])))
    assert_clean_failure(invoke("inspect", ckpts["st"], "--format", "gguf"),
                         library_error(lambda: tm.open(ckpts["st"], "gguf")))


@pytest.mark.parametrize("case", ["name w[/x]", "name w[bold]", "header [begin, end]"])
def test_error_messages_are_printed_verbatim(ckpts: dict[str, Path], tmp_path: Path, case: str) -> None:
    if case.startswith("name"):
        name = case.split()[1]
        with tm.open(ckpts["st"]) as ck:
            message = library_error(lambda: ck[name])
        assert_clean_failure(invoke("show", ckpts["st"], name), message)
    else:
        path = tmp_path / "model.safetensors"
        header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}).encode()
        path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
        message = library_error(lambda: tm.open(path))
        assert "data_offsets must be [begin, end]" in message
        assert_clean_failure(invoke("inspect", path), message)


def test_tensor_names_with_brackets_are_shown_verbatim(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"a[/b]": np.arange(3, dtype=np.float32), "c[red]": np.zeros(1, np.int8)}, str(path))
    inspect = invoke("inspect", path, "--no-tree")
    assert inspect.exit_code == 0, inspect.exception
    assert "a[/b]" in inspect.stdout and "c[red]" in inspect.stdout
    show = invoke("show", path, "a[/b]")
    assert show.exit_code == 0, show.exception
    assert "a[/b] F32 [3]" in show.stdout
