"""Region reads of logical tensors equal numpy indexing of the whole array.

Checkpoints are written for real on disk in the DCP sharded-safetensors layout
(one safetensors file per chunk, written by the safetensors library, each
carrying DCP_SHARDING_INFO) and opened through the public `tensormorph.open`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph.core import Chunk, LogicalTensor
from tensormorph.errors import BudgetExceededError, CheckpointError, ChunkLayoutError
from tensormorph.indexing import parse_index
from tensormorph.tiling import validate_tiling

pytestmark = pytest.mark.timeout(120)

DTYPES = {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}

SETTINGS = settings(max_examples=150, deadline=2000, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------
# building real checkpoints
# ---------------------------------------------------------------------------


def random_array(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    """Arbitrary bit patterns (NaNs, infs, subnormals included) so comparisons are bit-exact."""
    rng = np.random.default_rng(seed)
    if dtype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    np_dtype = DTYPES[dtype]
    raw = rng.bytes(math.prod(shape) * np_dtype.itemsize)
    return np.frombuffer(raw, dtype=np_dtype).reshape(shape).copy()


def grid_boxes(shape: tuple[int, ...], cuts: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes (offsets, sizes) of a grid: dim d split at sorted cut points (duplicates make empty chunks)."""
    per_dim = []
    for n, points in zip(shape, cuts):
        edges = [0, *sorted(points), n]
        per_dim.append([(a, b - a) for a, b in zip(edges, edges[1:])])
    return [(tuple(o for o, _ in combo), tuple(s for _, s in combo)) for combo in itertools.product(*per_dim)]


def box_index(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def write_sharded(folder: Path, tensors: dict[str, tuple[np.ndarray, list]]) -> None:
    """Write the DCP sharded-safetensors layout: file r holds box r of every tensor (rank r)."""
    ranks = max(len(boxes) for _, boxes in tensors.values())
    for r in range(ranks):
        data, info = {}, {}
        for name, (array, boxes) in tensors.items():
            if r < len(boxes):
                offsets, sizes = boxes[r]
                data[name] = np.array(array[box_index(offsets, sizes)], order="C")  # keeps 0-d arrays 0-d
                info[name] = {"saved_offsets": list(offsets)}
        metadata = {"format": "pt", "DCP_VERSION": "1.0", "DCP_SHARDING_INFO": json.dumps(info)}
        safetensors.numpy.save_file(data, str(folder / f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"),
                                    metadata=metadata)


def same(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tobytes() == np.asarray(want).tobytes()


# ---------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[int, ...], list[list[int]], str]:
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    most = {0: 0, 1: 3, 2: 3, 3: 2, 4: 1}[ndim]  # cut points per dim: at most 27 files
    cuts = [draw(st.lists(st.integers(0, n), max_size=most)) for n in shape]
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    return shape, cuts, dtype


def dim_index(n: int) -> st.SearchStrategy:
    bound = n + 3
    slices = st.builds(slice, st.none() | st.integers(-bound, bound), st.none() | st.integers(-bound, bound),
                       st.none() | st.integers(-4, 4).filter(bool))
    if n == 0:
        return slices
    ints = st.integers(-n, n - 1)
    return st.one_of(ints, ints.map(np.int64), slices)


@st.composite
def indices(draw: st.DrawFn, shape: tuple[int, ...]) -> Any:
    items = [draw(dim_index(n)) for n in shape]
    ndim = len(shape)
    mode = draw(st.sampled_from(["prefix", "ellipsis", "bare"]))
    if mode == "bare" and ndim:
        return items[0]
    if mode == "ellipsis":
        before = draw(st.integers(0, ndim))
        after = draw(st.integers(0, ndim - before))
        return tuple(items[:before]) + (Ellipsis,) + tuple(items[ndim - after:])
    return tuple(items[:draw(st.integers(0, ndim))])


@contextlib.contextmanager
def opened_sharded(layout, seed: int):
    """Write a random tensor of `layout` as one DCP-safetensors file per box and open it: (ck, full, boxes)."""
    shape, cuts, dtype = layout
    full = random_array(shape, dtype, seed)
    boxes = grid_boxes(shape, cuts)
    with tempfile.TemporaryDirectory() as folder:
        write_sharded(Path(folder), {"w": (full, boxes)})
        with tm.open(folder) as ck:
            yield ck, full, boxes


# ---------------------------------------------------------------------------
# region reads
# ---------------------------------------------------------------------------


@SETTINGS
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_region_read_equals_numpy_indexing(layout, seed: int, data: st.DataObject) -> None:
    shape, cuts, dtype = layout
    with opened_sharded(layout, seed) as (ck, full, boxes):
        assert ck.format == "dcp-safetensors"
        tensor = ck["w"]
        assert tensor.shape == shape and tensor.dtype == dtype
        same(tensor.full(), full)
        for _ in range(4):
            index = data.draw(indices(shape), label="index")
            same(tensor.read(index), full[index])
            same(tensor[index], full[index])


@SETTINGS
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_region_read_touches_only_overlapping_chunks(layout, seed: int, data: st.DataObject) -> None:
    shape, cuts, dtype = layout
    with opened_sharded(layout, seed) as (ck, full, boxes):
        tensor = ck["w"]
        reads: list[tuple[int, ...]] = []

        class Counting:
            def __init__(self, chunk: Chunk):
                self.chunk = chunk

            def array(self) -> np.ndarray:
                reads.append(self.chunk.offsets)
                return self.chunk.source.array()

        spied = replace(tensor, chunks=tuple(replace(c, source=Counting(c)) for c in tensor.chunks))
        # which chunk owns each element, so numpy says which chunks an index touches
        owner = np.full(shape, -1, dtype=np.int64)
        for k, chunk in enumerate(spied.chunks):
            owner[box_index(chunk.offsets, chunk.shape)] = k
        assert (owner >= 0).all()
        index = data.draw(indices(shape), label="index")
        same(spied.read(index), full[index])
        wanted = sorted({spied.chunks[k].offsets for k in np.unique(np.asarray(owner[index]))})
        assert sorted(reads) == wanted


@SETTINGS
@given(layout=layouts(), seed=st.integers(0, 2**32 - 1))
def test_local_rank_is_the_chunk_that_rank_wrote(layout, seed: int) -> None:
    shape, cuts, dtype = layout
    with opened_sharded(layout, seed) as (ck, full, boxes):
        tensor = ck["w"]
        assert tensor.is_placement_sharded == (len({b for b in boxes}) > 1)
        for rank, (offsets, sizes) in enumerate(boxes):
            same(tensor.local(rank), full[box_index(offsets, sizes)])
        with pytest.raises(CheckpointError, match="rank 999 holds no stored chunk"):
            tensor.local(999)


def test_two_tensors_with_different_chunkings_in_the_same_files(tmp_path: Path) -> None:
    a = random_array((7, 5), "F32", 1)
    b = random_array((4,), "I64", 2)
    a_boxes = grid_boxes(a.shape, [[2, 5], [3]])  # 6 chunks
    b_boxes = grid_boxes(b.shape, [[1]])  # 2 chunks: only files 1 and 2 hold b
    write_sharded(tmp_path, {"a": (a, a_boxes), "b": (b, b_boxes)})
    with tm.open(tmp_path) as ck:
        assert sorted(ck) == ["a", "b"]
        same(ck["a"].full(), a)
        same(ck["b"].full(), b)
        same(ck["a"][-1, ::-2], a[-1, ::-2])
        same(ck["b"][1:], b[1:])
        assert [c.ranks for c in ck["b"].chunks] == [(0,), (1,)]
        same(ck["a"].local(4), a[5:7, 0:3])


def test_missing_trailing_shard_that_leaves_a_hole_is_a_layout_error(tmp_path: Path) -> None:
    full = random_array((4, 4), "F32", 3)
    write_sharded(tmp_path, {"w": (full, grid_boxes(full.shape, [[2], [2]]))})
    (tmp_path / "shard-00002-model-00001-of-00001.safetensors").unlink()  # box (0:2, 2:4)
    with pytest.raises(ChunkLayoutError, match="tensor 'w'.*4 elements are missing"):
        tm.open(tmp_path)


def test_unsupported_and_out_of_range_indices_are_checkpoint_errors(tmp_path: Path) -> None:
    full = random_array((3, 4), "F32", 4)
    write_sharded(tmp_path, {"w": (full, grid_boxes(full.shape, [[1], []]))})
    with tm.open(tmp_path) as ck:
        tensor = ck["w"]
        for bad in (3, -4, (0, 4), (0, -5), (0, 0, 0), (..., 0, ...), slice(None, None, 0), (0, slice(0, 2, 0)),
                    1.0, [0, 1], None, True, "0", np.array([0])):
            with pytest.raises(CheckpointError) as info:
                tensor.read(bad)
            assert info.value.tensor == "w"
            assert "'w'" in str(info.value)


# ---------------------------------------------------------------------------
# budget
# ---------------------------------------------------------------------------


def test_read_budget_limits_materialised_bytes(tmp_path: Path) -> None:
    full = random_array((10, 10), "F32", 5)  # 400 bytes
    write_sharded(tmp_path, {"w": (full, grid_boxes(full.shape, [[5], [5]]))})
    with tm.open(tmp_path, read_budget=80) as ck:
        tensor = ck["w"]
        assert tensor.read_budget == 80
        same(tensor[0], full[0])  # 40 bytes
        same(tensor[0:2], full[0:2])  # exactly 80 bytes: allowed
        with pytest.raises(BudgetExceededError, match=r"tensor 'w'.*exceeds the read budget") as info:
            tensor[0:3]
        assert isinstance(info.value, CheckpointError)
        with pytest.raises(BudgetExceededError):
            tensor.full()
        with pytest.raises(BudgetExceededError):
            tensor[...]
        same(tensor.full(force=True), full)
        same(tensor.read(slice(0, 3), budget=120), full[0:3])
        with pytest.raises(BudgetExceededError):
            tensor.read(slice(0, 3), budget=119)
        roomy = tensor.with_budget(400)
        same(roomy.full(), full)
        assert tensor.read_budget == 80  # with_budget returns a copy
    with tm.open(tmp_path) as ck:
        assert ck["w"].read_budget == tm.DEFAULT_READ_BUDGET
        same(ck["w"].full(), full)


def test_budget_counts_the_selection_not_the_strided_span(tmp_path: Path) -> None:
    full = random_array((100,), "I64", 6)
    write_sharded(tmp_path, {"w": (full, grid_boxes(full.shape, [[30, 60]]))})
    with tm.open(tmp_path, read_budget=80) as ck:
        same(ck["w"][::10], full[::10])  # 10 elements = 80 bytes, spread over all chunks
        with pytest.raises(BudgetExceededError):
            ck["w"][::9]


def test_zero_size_reads_never_exceed_a_zero_budget(tmp_path: Path) -> None:
    full = random_array((3, 0), "F32", 7)
    write_sharded(tmp_path, {"w": (full, grid_boxes(full.shape, [[1], []]))})
    with tm.open(tmp_path, read_budget=0) as ck:
        same(ck["w"].full(), full)
        same(ck["w"].full(force=True), full)


# ---------------------------------------------------------------------------
# parse_index
# ---------------------------------------------------------------------------

bound_ints = st.integers(-10**6, 10**6)
index_items = st.one_of(
    bound_ints,
    st.builds(slice, st.none() | bound_ints, st.none() | bound_ints, st.none() | bound_ints),
    st.just(Ellipsis),
)
spaces = st.sampled_from(["", " ", "  ", "\t"])


@st.composite
def formatted(draw: st.DrawFn) -> tuple[str, tuple]:
    items = draw(st.lists(index_items, max_size=5))
    parts = []
    for item in items:
        if item is Ellipsis:
            text = draw(st.sampled_from(["...", "…"]))
        elif isinstance(item, int):
            text = str(item)
        else:
            fields = ["" if v is None else str(v) for v in (item.start, item.stop)]
            if item.step is not None:
                fields.append(str(item.step))
            elif draw(st.booleans()):
                fields.append("")  # "a:b:" has no step
            text = ":".join(draw(spaces) + f + draw(spaces) for f in fields)
        parts.append(draw(spaces) + text + draw(spaces))
    return ",".join(parts), tuple(items)


@settings(max_examples=300, deadline=2000)
@given(case=formatted())
def test_parse_index_round_trips_formatted_indices(case: tuple[str, tuple]) -> None:
    text, items = case
    assert parse_index(text) == items


@settings(max_examples=300, deadline=2000)
@given(text=st.text(alphabet=st.sampled_from(list("0123456789-:,. …abx[]()+_ \t")), max_size=20) | st.text(max_size=20))
def test_parse_index_returns_a_tuple_or_a_checkpoint_error(text: str) -> None:
    try:
        value = parse_index(text)
    except CheckpointError as exc:
        assert repr(text) in str(exc) or text.strip() == ""
        return
    assert isinstance(value, tuple)
    assert all(v is Ellipsis or isinstance(v, (int, slice)) for v in value)


@pytest.mark.parametrize("text", ["a", "1.5", "1:2:3:4", "[0]", "0,,1", "0,", "1;2", "--1", "0x10", "1 2", "(0)",
                                  "None", ":a", "1:2:x", "eval('1')", "True"])
def test_parse_index_rejects_malformed_text(text: str) -> None:
    with pytest.raises(CheckpointError, match="cannot parse index"):
        parse_index(text)


def test_parse_index_examples() -> None:
    assert parse_index("") == ()
    assert parse_index("  ") == ()
    assert parse_index("0:4, 100:108") == (slice(0, 4), slice(100, 108))
    assert parse_index("..., -1") == (Ellipsis, -1)
    assert parse_index("::2") == (slice(None, None, 2),)
    assert parse_index("::-1, 3") == (slice(None, None, -1), 3)
    assert parse_index(":") == (slice(None),)


# ---------------------------------------------------------------------------
# validate_tiling
# ---------------------------------------------------------------------------


class _NoData:
    def array(self) -> np.ndarray:
        raise AssertionError("validate_tiling must not read data")


def chunk(offsets: tuple[int, ...], sizes: tuple[int, ...], file: str = "f", ranks: tuple[int, ...] = ()) -> Chunk:
    return Chunk(offsets, sizes, file, None, _NoData(), ranks)


@pytest.mark.parametrize("chunks, message", [
    ([chunk((0, 0), (2, 4)), chunk((1, 0), (3, 4))], "overlap"),
    ([chunk((0, 0), (4, 2)), chunk((0, 1), (4, 3))], "overlap"),
    ([chunk((0, 0), (2, 4)), chunk((3, 0), (1, 4))], "4 elements are missing"),
    ([chunk((0, 0), (4, 3))], "4 elements are missing"),
    ([chunk((0, 0), (2, 4)), chunk((2, 0), (3, 4))], "outside the tensor's shape"),
    ([chunk((0, 0), (4, 4)), chunk((0, 5), (4, 0))], "outside the tensor's shape"),
    ([chunk((-1, 0), (5, 4))], "outside the tensor's shape"),
    ([chunk((0, 0), (4, -1)), chunk((0, 0), (4, 4))], "outside the tensor's shape"),
    ([chunk((0,), (16,))], "different rank"),
    ([chunk((0, 0), (4, 4)), chunk((1, 1), (1, 1))], "overlap"),
])
def test_validate_tiling_rejects_bad_layouts_naming_the_tensor(chunks: list[Chunk], message: str) -> None:
    with pytest.raises(ChunkLayoutError, match=message) as info:
        validate_tiling("layers.3.w", (4, 4), chunks, file="ckpt")
    assert info.value.tensor == "layers.3.w"
    assert "tensor 'layers.3.w'" in str(info.value)


def test_validate_tiling_merges_replicas_and_keeps_their_ranks() -> None:
    chunks = [chunk((0,), (3,), ranks=(0,)), chunk((3,), (2,), ranks=(1,)), chunk((0,), (3,), ranks=(2,)),
              chunk((5,), (0,), ranks=(3,))]
    merged = validate_tiling("w", (5,), chunks)
    assert [(c.offsets, c.shape, c.ranks) for c in merged] == [((0,), (3,), (0, 2)), ((3,), (2,), (1,)),
                                                              ((5,), (0,), (3,))]


def test_validate_tiling_scalars_and_empty_tensors() -> None:
    assert len(validate_tiling("s", (), [chunk((), ())])) == 1
    with pytest.raises(ChunkLayoutError, match="1 elements are missing"):
        validate_tiling("s", (), [])
    assert validate_tiling("e", (0, 3), []) == []
    assert len(validate_tiling("e", (0, 3), [chunk((0, 0), (0, 3))])) == 1


@settings(max_examples=200, deadline=2000)
@given(layout=layouts(), data=st.data())
def test_validate_tiling_property(layout, data: st.DataObject) -> None:
    shape, cuts, _ = layout
    boxes = grid_boxes(shape, cuts)
    chunks = [chunk(o, s, f"f{k}") for k, (o, s) in enumerate(boxes)]
    order = data.draw(st.permutations(range(len(chunks))), label="order")
    valid = validate_tiling("w", shape, [chunks[k] for k in order])
    assert {(c.offsets, c.shape) for c in valid} == {(c.offsets, c.shape) for c in chunks}
    filled = [k for k, c in enumerate(chunks) if c.numel]
    if not filled:
        return
    k = data.draw(st.sampled_from(filled), label="box")
    # dropping a non-empty box leaves a gap
    with pytest.raises(ChunkLayoutError, match="missing") as info:
        validate_tiling("w", shape, chunks[:k] + chunks[k + 1:])
    assert info.value.tensor == "w"
    if not shape:
        return
    # an extra unit box anywhere inside the tensor overlaps (unless it is a replica of a stored box)
    point = tuple(data.draw(st.integers(0, n - 1), label="point") for n in shape)
    unit = (1,) * len(shape)
    if (point, unit) not in {(c.offsets, c.shape) for c in chunks}:
        with pytest.raises(ChunkLayoutError, match="overlap"):
            validate_tiling("w", shape, chunks + [chunk(point, unit, "extra")])
    # moving a box one step past the end of some dim leaves the tensor
    d = data.draw(st.integers(0, len(shape) - 1), label="dim")
    moved = list(chunks[k].offsets)
    moved[d] = shape[d] - chunks[k].shape[d] + 1
    with pytest.raises(ChunkLayoutError, match="outside"):
        validate_tiling("w", shape, chunks[:k] + [chunk(tuple(moved), chunks[k].shape)] + chunks[k + 1:])


def test_logical_tensor_built_from_chunks_directly(tmp_path: Path) -> None:
    """whole_chunk + validate_tiling assemble the same tensor as the format reader."""
    from tensormorph.formats import safetensors as st_format
    from tensormorph.storage import LocalFiles

    full = random_array((5, 3), "BF16", 8)
    boxes = grid_boxes(full.shape, [[2], [1]])
    files = LocalFiles(tmp_path)
    chunks = []
    for k, (offsets, sizes) in enumerate(boxes):
        name = f"piece{k}.safetensors"
        safetensors.numpy.save_file({"w": np.array(full[box_index(offsets, sizes)], order="C")}, str(tmp_path / name))
        entry = st_format.read_header(files, name).entries["w"]
        chunks.append(st_format.whole_chunk(files, entry, name, offsets=offsets, ranks=(k,)))
    tensor = LogicalTensor("w", "BF16", full.shape, tuple(validate_tiling("w", full.shape, chunks)))
    same(tensor.full(), full)
    same(tensor[1:4, ::-1], full[1:4, ::-1])
    same(tensor.local(3), full[2:5, 1:3])
    assert tensor.files == tuple(f"piece{k}.safetensors" for k in range(4))
    files.close()
