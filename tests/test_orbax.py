"""Orbax: checkpoints written by the real orbax-checkpoint with jax on 4 CPU devices (tests/fixtures/orbax_builders),
read without JAX through tensorstore and compared bit for bit with the values saved (which the builder checked
against Orbax's own restore); the chunk grid and the sharding; the CLI; diff against safetensors; tm.load; damaged
chunks; and a property test of the metadata parsers on mutated metadata.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from fixtures import orbax_builders
from fixtures.cache import cached_build
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from test_tiles import assert_fields_equal, decode_tile, reference_tile

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import CheckpointError, HeaderError, MissingDependencyError, UnsafePathError
from tensormorph.formats import orbax as reader
from tensormorph.server import create_app

pytestmark = pytest.mark.timeout(300)

DTYPES = {"params.dense.kernel": "F32", "params.dense.bias": "BF16", "params.embed.table": "F32", "params.ids": "I32"}
LAYOUTS = {  # fixture folder -> (step saved, the objects it holds, (file, key) of the kernel's chunk (0, 1))
    "manager/1": (1, ("lr", "step"), ("default/manifest.ocdbt", "default/params.dense.kernel/0.1")),
    "manager/2/default": (2, ("lr", "step"), ("manifest.ocdbt", "params.dense.kernel/0.1")),
    "pytree": (2, ("lr", "name", "step"), ("manifest.ocdbt", "params.dense.kernel/c/0/1")),
    "no_ocdbt": (2, ("lr", "name", "step"), ("params.dense.kernel/0.1", "params.dense.kernel/0.1")),
}


@pytest.fixture(scope="module")
def built() -> Path:
    return cached_build("orbax", orbax_builders, orbax_builders.build)


def bits(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    return array.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[array.dtype.itemsize])


def assert_bit_exact(ours: np.ndarray, expected: np.ndarray) -> None:
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    np.testing.assert_array_equal(bits(ours), bits(expected))


def copy_of(built: Path, layout: str, tmp_path: Path) -> Path:
    target = tmp_path / layout.replace("/", "_")
    shutil.copytree(built / layout, target)
    return target


# ---------------------------------------------------------------------------
# detection, values, chunk grid, sharding
# ---------------------------------------------------------------------------


def test_detects_step_and_item_folders(built: Path, tmp_path: Path) -> None:
    for layout in (*LAYOUTS, "manager/2", "manager/2/default/_METADATA"):
        assert tm.detect(built / layout) == "orbax", layout
    (tmp_path / "_METADATA").write_text('{"not": "orbax"}')
    assert tm.detect(tmp_path) is None


def test_manager_root_opens_its_latest_step(built: Path, tmp_path: Path) -> None:
    assert tm.detect(built / "manager") == "orbax"
    with tm.open(built / "manager") as ck:  # as Orbax's restore of the latest step
        assert ck.path == built / "manager" / "2" and (ck.metadata["steps"], ck.metadata["step"]) == ([1, 2], 2)
        assert ck.objects["step"].value() == 2
    root = tmp_path / "root"
    shutil.copytree(built / "manager", root)
    (root / "2" / "_CHECKPOINT_METADATA").unlink()  # step 2 unfinished: step 1 is the latest complete one
    with tm.open(root) as ck:
        assert ck.path == root / "1" and ck.objects["step"].value() == 1


def test_a_step_of_several_items(built: Path) -> None:
    expected = orbax_builders.values(2)
    with tm.open(built / "composite") as ck:
        assert ck.metadata["items"] == ["meta", "opt", "state"] and ck.metadata["step"] == orbax_builders.COMPOSITE_STEP
        assert sorted(ck) == sorted(["opt.mu", *(f"state.{n}" for n in DTYPES)])
        assert_bit_exact(ck["opt.mu"].full(), orbax_builders.OPT_MU)
        assert_bit_exact(ck["state.params.dense.kernel"][::7, 3], expected["params.dense.kernel"][::7, 3])
        assert sorted(ck.objects) == ["meta", "state.lr", "state.step"]
        assert ck.objects["meta"].value() == orbax_builders.META and ck.objects["state.step"].value() == 2
        assert ck["state.params.dense.kernel"].chunks[0].source.where == "state/params.dense.kernel/0.0"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_values_are_bit_exact(built: Path, layout: str) -> None:
    step, objects, _ = LAYOUTS[layout]
    expected = orbax_builders.values(step)
    with tm.open(built / layout) as ck:
        assert ck.format == "orbax" and sorted(ck) == sorted(DTYPES)
        assert {n: t.dtype for n, t in ck.items()} == DTYPES
        for name, tensor in ck.items():
            assert_bit_exact(tensor.full(), expected[name])
        assert tuple(sorted(ck.objects)) == objects
        assert {n: ck.objects[n].value() for n in objects} == {n: expected[n] for n in objects}
        assert type(ck.objects["step"].value()) is int and type(ck.objects["lr"].value()) is float


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunk_grid_follows_the_sharding(built: Path, layout: str) -> None:
    file, key = LAYOUTS[layout][2]
    with tm.open(built / layout) as ck:
        kernel, table, bias = ck["params.dense.kernel"], ck["params.embed.table"], ck["params.dense.bias"]
        assert [(c.offsets, c.shape, c.ranks) for c in kernel.chunks] == [
            ((0, 0), (32, 24), (0,)), ((0, 24), (32, 24), (1,)), ((32, 0), (32, 24), (2,)), ((32, 24), (32, 24), (3,))]
        assert kernel.chunks[1].file == file and kernel.chunks[1].source.where == key
        assert str(kernel.placement) == "mesh(data=2, model=2) [Shard(0), Shard(1)]"
        rows = [((10 * i, 0), (10, 16), (i,)) for i in range(4)]
        assert [(c.offsets, c.shape, c.ranks) for c in table.chunks] == rows
        assert str(table.placement) == "mesh(data=2, model=2) [Shard(0), Shard(0)]"  # both axes split the rows
        assert bias.placement is None and [(c.offsets, c.shape) for c in bias.chunks] == [((0,), (48,))]
        expected = orbax_builders.values(LAYOUTS[layout][0])
        assert_bit_exact(kernel.local(3), expected["params.dense.kernel"][32:, 24:])  # what device 3 held
        assert_bit_exact(kernel.chunks[1].read(), expected["params.dense.kernel"][:32, 24:])


REGIONS = [
    (np.s_[3:40:5, 7:30:4], "strided across all four chunks"),
    (np.s_[31:33, 23:25], "the corner where the four chunks meet"),
    (np.s_[-1, ::-7], "a negative step"),
    (np.s_[5, 30], "one value"),
    (np.s_[10:10, :], "empty"),
    (np.s_[..., 47], "the last column"),
]


@pytest.mark.parametrize("index", [r[0] for r in REGIONS], ids=[r[1] for r in REGIONS])
def test_region_reads_equal_numpy_slices(built: Path, index: Any) -> None:
    expected = orbax_builders.values(2)
    with tm.open(built / "pytree") as ck:
        assert_bit_exact(np.asarray(ck["params.dense.kernel"][index]), expected["params.dense.kernel"][index])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_regions_bit_exact(data: st.DataObject, built: Path) -> None:
    layout = data.draw(st.sampled_from(["manager/2", "pytree", "no_ocdbt"]))
    name = data.draw(st.sampled_from(sorted(DTYPES)))
    reference = orbax_builders.values(2)[name]

    def piece(size: int) -> Any:
        return data.draw(st.one_of(
            st.integers(-size, size - 1),
            st.builds(slice, st.none() | st.integers(-size - 2, size + 2), st.none() | st.integers(-size - 2, size + 2),
                      st.none() | st.integers(-9, 20).filter(bool))))

    index = tuple(piece(n) for n in reference.shape)
    with tm.open(built / layout) as ck:
        assert_bit_exact(np.asarray(ck[name][index]), reference[index])


def test_region_reads_decode_only_the_chunks_they_overlap(built: Path, tmp_path: Path) -> None:
    folder = copy_of(built, "no_ocdbt", tmp_path)  # OCDBT off: each chunk is a file of its own
    for chunk in ("0.0", "1.0", "1.1"):
        (folder / "params.dense.kernel" / chunk).write_bytes(b"\x28\xb5\x2f\xfd garbage")
    expected = orbax_builders.values(2)["params.dense.kernel"]
    with tm.open(folder) as ck:
        kernel = ck["params.dense.kernel"]
        assert_bit_exact(kernel[2:30:3, 25:], expected[2:30:3, 25:])  # chunk (0, 1) only: intact
        with pytest.raises(CheckpointError) as caught:
            kernel[30:34, 25]  # reaches into chunk (1, 1)
    assert caught.value.tensor == "params.dense.kernel"
    assert "chunk params.dense.kernel/1.1 cannot be read" in str(caught.value)
    report = tm.verify(folder)
    assert sorted(p.tensor for p in report.problems) == ["params.dense.kernel"] * 3
    assert report.checksums_checked == 4 + 4 + 1 + 1


def test_damaged_ocdbt_data_is_reported(built: Path, tmp_path: Path) -> None:
    folder = copy_of(built, "pytree", tmp_path)
    with tm.open(folder) as ck:
        checked = dict(reader.checksum_problems(ck))
    assert set(checked.values()) == {None} and len(checked) == 10
    assert {k for k in checked if k.startswith("params.dense.kernel/")} == {
        f"params.dense.kernel/c/{i}/{j}" for i in (0, 1) for j in (0, 1)}
    data = sorted((folder / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)[-1]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncate the largest data file
    report = tm.verify(folder)
    assert report.problems and {p.tensor for p in report.problems} == {"params.dense.kernel"}  # the largest array
    assert all(p.message.startswith("chunk params.dense.kernel/c/") and "cannot be read" in p.message
               for p in report.problems)
    with tm.open(folder) as ck, pytest.raises(CheckpointError, match="cannot be read") as caught:
        ck["params.dense.kernel"].full()
    assert caught.value.tensor == "params.dense.kernel" and "manifest.ocdbt:params.dense.kernel/c/" in caught.value.file


def test_missing_tensorstore_names_the_extra(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorstore", None)  # import fails as when it is not installed
    assert tm.detect(built / "pytree") == "orbax"  # detection reads JSON only
    with pytest.raises(MissingDependencyError, match=r"pip install 'tensormorph\[orbax\]'"):
        tm.open(built / "pytree")


# ---------------------------------------------------------------------------
# commands: inspect, show, stats, verify, diff; tm.load
# ---------------------------------------------------------------------------


def cli(*args: Any, code: int = 0) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, (result.output, result.exception)
    return result.output


def test_cli_inspect_show_stats_verify(built: Path) -> None:
    step = built / "manager" / "2"
    expected = orbax_builders.values(2)
    text = cli("inspect", step)
    assert "format orbax" in text and "4 tensors" in text
    assert "4 chunks, ranks 0-3, zarr v2 chunks of [32, 24], zstd" in text
    data = json.loads(cli("inspect", "--json", "--chunks", built / "pytree"))
    record = next(t for t in data["tensors"] if t["name"] == "params.dense.kernel")
    assert record["placement"] == {"mesh_shape": [2, 2], "placements": ["Shard(0)", "Shard(1)"],
                                   "mesh_dim_names": ["data", "model"]}
    assert [c["file"] for c in record["chunks"]] == ["manifest.ocdbt"] * 4  # the OCDBT database holds every chunk
    assert record["encoding"]["codecs"] == ["sharding_indexed", "bytes", "zstd"]
    assert data["metadata"]["use_zarr3"] is True
    shown = json.loads(cli("show", "--json", step, "params.embed.table", "--slice", "8:12, 3:5"))
    assert shown["values"] == expected["params.embed.table"][8:12, 3:5].astype(np.float64).tolist()
    stats = json.loads(cli("stats", "--json", step, "params.dense.bias"))[0]
    reference = expected["params.dense.bias"].astype(np.float64)
    assert (stats["min"], stats["max"]) == (reference.min(), reference.max())
    verified = json.loads(cli("verify", "--json", "--full", step))
    assert verified["ok"] and verified["checksums_checked"] == 10 and verified["format"] == "orbax"


def test_diff_against_safetensors_with_the_same_values(built: Path, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({f"model.{n}": v for n, v in orbax_builders.arrays(2).items()}, str(path))
    report = tm.diff(built / "pytree", path, rename=["b:model.="], objects=False)
    assert report.identical, report.to_dict()
    assert sorted(t.name for t in report.tensors) == sorted(DTYPES)
    assert {t.status for t in report.tensors} == {"equal"}
    result = json.loads(cli("diff", "--json", built / "manager" / "1", built / "manager" / "2", code=1))
    assert {t["name"]: t["status"] for t in result["tensors"]} == dict.fromkeys(DTYPES, "different")
    assert "same" in cli("diff", built / "manager" / "2", built / "no_ocdbt", "--common-only")


def test_convert_to_safetensors_and_tensormorph(built: Path, tmp_path: Path) -> None:
    expected = orbax_builders.arrays(2)
    result = tm.convert(built / "pytree", tmp_path / "hf", to="safetensors")  # diffs the output against the source
    assert sorted(result.skipped_objects) == ["lr", "name", "step"]
    with tm.open(tmp_path / "hf") as ck:
        for name, value in expected.items():
            assert_bit_exact(ck[name].full(), value)
    tm.convert(built / "manager" / "2", tmp_path / "tm", to="tensormorph", mesh=2)
    with tm.open(tmp_path / "tm") as ck:
        assert_bit_exact(ck["params.dense.kernel"].full(), expected["params.dense.kernel"])
        assert ck.objects["step"].value() == 2


def test_viewer_shows_the_chunk_grid(built: Path) -> None:
    expected = orbax_builders.values(2)["params.dense.kernel"]
    with TestClient(create_app([built / "pytree"])) as client:
        info = client.get("/api/checkpoints/a/tensor", params={"name": "params.dense.kernel"}).json()
        assert info["split"] == ("4 chunks, ranks 0-3, zarr v3 chunks of [32, 24], sharding_indexed+bytes+zstd")
        summary = client.get("/api/checkpoints/a/summary").json()
        assert summary["format"] == "orbax" and summary["metadata"]["use_zarr3"] is True
        stats = client.get("/api/checkpoints/a/stats", params={"name": "params.dense.kernel"}).json()
        assert (stats["min"], stats["max"]) == (float(expected.min()), float(expected.max()))
        response = client.get("/api/checkpoints/a/tile", params={"name": "params.dense.kernel", "exact": "1",
                                                                 "h": "8", "w": "12"})
        assert response.status_code == 200, response.text
        _, fields = decode_tile(response.content)
        assert_fields_equal(fields, reference_tile(expected, 0, 64, 0, 48, 8, 12, True))


def test_tm_load_into_torch_tensors(built: Path) -> None:
    torch = pytest.importorskip("torch")
    expected = orbax_builders.values(2)
    state = {"params": {"dense": {"kernel": torch.zeros(64, 48), "bias": torch.zeros(48, dtype=torch.bfloat16)},
                        "embed": {"table": torch.zeros(40, 16)}, "ids": torch.zeros(10, dtype=torch.int32)},
             "step": 0, "lr": 0.0}
    tm.load(built / "manager" / "2", state)
    assert (state["step"], state["lr"]) == (2, 0.5)
    assert_bit_exact(state["params"]["dense"]["kernel"].numpy(), expected["params.dense.kernel"])
    assert_bit_exact(state["params"]["dense"]["bias"].view(torch.int16).numpy().view(ml_dtypes.bfloat16),
                     expected["params.dense.bias"])
    assert_bit_exact(state["params"]["ids"].numpy(), expected["params.ids"])


# ---------------------------------------------------------------------------
# hostile metadata
# ---------------------------------------------------------------------------


def forged(built: Path, tmp_path: Path, name: str, content: bytes) -> Path:
    folder = copy_of(built, "no_ocdbt", tmp_path)
    (folder / name).write_bytes(content)
    return folder


def test_forged_metadata_is_refused(built: Path, tmp_path: Path) -> None:
    tree = json.loads((built / "no_ocdbt" / "_METADATA").read_text())
    leaf = tree["tree_metadata"]["('params', 'ids')"]
    leaf["key_metadata"] = [{"key": "..", "key_type": 2}]
    folder = forged(built, tmp_path / "a", "_METADATA", json.dumps(tree).encode())
    with pytest.raises(UnsafePathError, match="outside the checkpoint"):
        tm.open(folder)
    zarray = json.loads((built / "no_ocdbt" / "params.ids" / ".zarray").read_text())
    zarray.update(shape=[2**20, 2**20], chunks=[1, 1])
    folder = forged(built, tmp_path / "b", "params.ids/.zarray", json.dumps(zarray).encode())
    with pytest.raises(HeaderError, match="chunks, over the limit") as caught:
        tm.open(folder)
    assert caught.value.tensor == "params.ids"
    zarray.update(shape=[10], chunks=[10], dtype="|O")
    folder = forged(built, tmp_path / "c", "params.ids/.zarray", json.dumps(zarray).encode())
    with pytest.raises(HeaderError, match="dtype '|O' is not one this reader knows"):
        tm.open(folder)
    (folder / "params.ids" / ".zarray").unlink()
    with pytest.raises(CheckpointError, match=r"has no zarr metadata \(.zarray\)"):
        tm.open(folder)


def test_links_out_of_the_folder_are_refused(built: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(built / "no_ocdbt" / "params.ids", outside)
    folder = copy_of(built, "no_ocdbt", tmp_path)
    shutil.rmtree(folder / "params.ids")
    (folder / "params.ids").symlink_to(outside)  # tensorstore would follow it
    with pytest.raises(UnsafePathError, match="resolves outside the checkpoint folder"):
        tm.open(folder)
    inside = copy_of(built, "pytree", tmp_path)
    data = next((inside / "d").iterdir())
    data.rename(inside / "moved")
    data.symlink_to(inside / "moved")  # a link that stays inside is fine
    with tm.open(inside) as ck:
        assert_bit_exact(ck["params.ids"].full(), orbax_builders.values(2)["params.ids"])


def _mutations(seed: Any) -> st.SearchStrategy:
    """JSON values like `seed` with one part replaced by something else (recursively)."""
    anything = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=12)
                            | st.floats(allow_nan=False), lambda inner: st.lists(inner, max_size=4)
                            | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
    if isinstance(seed, dict) and seed:
        return st.sampled_from(sorted(seed)).flatmap(
            lambda key: st.one_of(anything, _mutations(seed[key])).map(lambda value: {**seed, key: value}))
    if isinstance(seed, list) and seed:
        return st.integers(0, len(seed) - 1).flatmap(
            lambda i: st.one_of(anything, _mutations(seed[i])).map(lambda value: [*seed[:i], value, *seed[i + 1:]]))
    return anything


@pytest.fixture(scope="module")
def seeds(built: Path) -> dict[str, Any]:
    folder = built / "pytree"
    sharding = json.loads((folder / "_sharding").read_text())
    return {"tree": json.loads((folder / "_METADATA").read_text()),
            "zarray": json.loads((built / "no_ocdbt" / "params.dense.kernel" / ".zarray").read_text()),
            "sharding": {k: json.loads(v) for k, v in sharding.items()}}


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(data=st.data())
def test_metadata_parsers_on_mutated_metadata(data: st.DataObject, seeds: dict[str, Any]) -> None:
    which = data.draw(st.sampled_from(["tree", "zarray", "sharding"]))
    value = data.draw(_mutations(seeds[which]))
    if which == "sharding":
        value = {k: json.dumps(v) if data.draw(st.booleans()) else v for k, v in value.items()}
    raw = json.dumps(value).encode()
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(raw)))
        raw = raw[:cut] + data.draw(st.binary(max_size=4)) + raw[cut + 1:]
    parse = {"tree": lambda: reader.parse_tree(raw, "_METADATA"),
             "zarray": lambda: reader.parse_zarr(raw, ".zarray", "t"),
             "sharding": lambda: reader.parse_shardings(raw, "_sharding")}[which]
    try:
        parse()
    except CheckpointError as exc:
        assert exc.file in ("_METADATA", ".zarray", "_sharding") and str(exc).count("\n") == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_opening_with_mutated_metadata_fails_cleanly(data: st.DataObject, built: Path, seeds: dict[str, Any],
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = copy_of(built, "no_ocdbt", tmp_path_factory.mktemp("mutated"))
    which = data.draw(st.sampled_from(["_METADATA", "params.dense.kernel/.zarray"]))
    seed = seeds["tree"] if which == "_METADATA" else seeds["zarray"]
    (folder / which).write_text(json.dumps(data.draw(_mutations(seed))))
    try:
        with tm.open(folder) as ck:
            for tensor in ck.values():
                tensor[:1] if tensor.shape else tensor.full()
    except CheckpointError as exc:
        assert str(exc).count("\n") == 0
