"""Placement arithmetic (tmformat/layout.py) against torch's own splitting code, and Partial reductions."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from tensormorph.errors import CheckpointError, UnsupportedError
from tensormorph.reduction import check_reducible, combine, finish
from tensormorph.tmformat.layout import (
    MAX_LOCAL_PIECES,
    contribution_of,
    local_pieces,
    parse_spec,
    reduce_op,
)


def torch_local(shape, mesh, placements, coordinate) -> torch.Tensor:
    """The local tensor torch gives the rank at `coordinate` of an arange tensor: placements applied left to
    right with torch's own `_split_tensor` (what distribute_tensor does on each mesh dimension)."""
    local = torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape)
    for size, placement, index in zip(mesh, placements, coordinate):
        if isinstance(placement, (Shard, _StridedShard)):
            local = placement._split_tensor(local, size, with_padding=False)[0][index]
    return local


def assembled(shape, pieces) -> np.ndarray:
    """The local tensor our pieces describe, filled from an arange tensor."""
    full = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    local_shape = [0] * len(shape)
    for (_offsets, sizes), within in pieces:
        for d in range(len(shape)):
            local_shape[d] = max(local_shape[d], within[d] + sizes[d])
    out = np.full(local_shape, -1, np.int64)
    for (offsets, sizes), within in pieces:
        out[tuple(slice(w, w + n) for w, n in zip(within, sizes))] = \
            full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
    return out


placement_choices = st.one_of(
    st.just(("Replicate()", Replicate())),
    st.integers(0, 1).map(lambda d: (f"Shard({d})", Shard(d))),
    st.tuples(st.integers(0, 1), st.integers(1, 16)).map(
        lambda a: (f"_StridedShard({a[0]}, sf={a[1]})", _StridedShard(a[0], split_factor=a[1]))),
)


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 13), min_size=2, max_size=2).map(tuple),
       mesh=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple), data=st.data())
def test_local_pieces_match_torch_split_tensor(shape, mesh, data):
    chosen = [data.draw(placement_choices) for _ in mesh]
    texts, objects = [c[0] for c in chosen], [c[1] for c in chosen]
    every = [local_pieces(shape, mesh, texts, c) for c in itertools.product(*(range(n) for n in mesh))]
    for coordinate, pieces in zip(itertools.product(*(range(n) for n in mesh)), every):
        expected = torch_local(shape, mesh, objects, coordinate).numpy()
        got = assembled(shape, pieces)
        assert got.shape == expected.shape, (texts, coordinate, pieces)
        assert (got == expected).all(), (texts, coordinate, pieces)


def test_fsdp2_over_tp_is_one_box_per_rank_in_tp_major_order():
    # Linear(16, 40), ColwiseParallel on tp, fully_shard on dp of a 2x2 mesh: checked on real ranks (FORMATS.md)
    placements = ["_StridedShard(0, sf=2)", "Shard(0)"]
    rows = {c: local_pieces((40, 16), (2, 2), placements, c) for c in itertools.product(range(2), range(2))}
    assert {c: [p[0][0][0] for p in ps] for c, ps in rows.items()} == {(0, 0): [0], (0, 1): [20], (1, 0): [10],
                                                                        (1, 1): [30]}
    assert all(len(ps) == 1 and ps[0][0][1] == (10, 16) for ps in rows.values())
    # uneven, 42 and 7 rows: the same as torch's __create_chunk_list__ on real ranks
    assert [local_pieces((42,), (2, 2), placements, c)[0][0] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == [
        ((0,), (11,)), ((21,), (11,)), ((11,), (10,)), ((32,), (10,))]
    assert [local_pieces((7,), (2, 2), placements, c)[0][0] for c in [(0, 0), (0, 1), (1, 0), (1, 1)]] == [
        ((0,), (2,)), ((4,), (2,)), ((2,), (2,)), ((6,), (1,))]


def test_strided_shard_alone_gives_several_boxes():
    pieces = local_pieces((8, 3), (2,), ["_StridedShard(0, sf=2)"], (1,))
    assert pieces == [(((2, 0), (2, 3)), (0, 0)), (((6, 0), (2, 3)), (2, 0))]


def test_bad_placements_are_refused_by_name():
    with pytest.raises(CheckpointError, match="unknown reduce op 'prod'"):
        parse_spec("Partial(prod)", 2)
    with pytest.raises(CheckpointError, match="split factor 0"):
        parse_spec("_StridedShard(0, sf=0)", 2)
    # a split factor beyond the dimension leaves parts empty, as torch.chunk does, and costs nothing more
    huge = [f"_StridedShard(0, sf={2**60})"]  # three parts of one row, each given whole to rank 0
    assert local_pieces((3, 4), (2,), huge, (0,)) == [(((0, 0), (3, 4)), (0, 0))]
    assert local_pieces((3, 4), (2,), huge, (1,))[0][0][1] == (0, 4)
    with pytest.raises(CheckpointError, match="dimension 2 of a 2-dimensional"):
        parse_spec("_StridedShard(2, sf=2)", 2)
    with pytest.raises(CheckpointError, match="mix reduce ops"):
        reduce_op(["Partial(sum)", "Partial(max)"], "w")
    nested = ["_StridedShard(0, sf=100)", "_StridedShard(1, sf=100)"]
    with pytest.raises(CheckpointError, match=f"more than {MAX_LOCAL_PIECES} boxes"):
        local_pieces((1000, 1000), (2, 2), nested, (0, 0))


def test_contributions_are_numbered_row_major_over_partial_dims():
    placements = ["Partial(sum)", "Shard(0)", "Partial(sum)"]
    seen = {c: contribution_of((2, 3, 2), placements, c) for c in itertools.product(range(2), range(3), range(2))}
    assert seen[(0, 0, 0)] == (0, 4) and seen[(0, 2, 1)] == (1, 4) and seen[(1, 1, 0)] == (2, 4)
    assert seen[(1, 0, 1)] == (3, 4)
    assert contribution_of((4,), ["Shard(0)"], (3,)) == (0, 1)
    assert parse_spec("Partial()", 1).op == "sum" and reduce_op(["Partial(avg)", "Shard(0)"]) == "avg"


def test_reductions_in_order_and_integer_overflow_refused():
    parts = [np.array([1.5, -2.0, np.nan], np.float32), np.array([0.25, 4.0, 1.0], np.float32)]
    for op, expected in (("sum", [1.75, 2.0, np.nan]), ("avg", [0.875, 1.0, np.nan]), ("max", [1.5, 4.0, np.nan]),
                         ("min", [0.25, -2.0, np.nan])):
        total = parts[0].copy()
        combine(op, total, parts[1])
        finish(op, total, 2)
        np.testing.assert_array_equal(total, np.array(expected, np.float32))
    total = np.array([2**31 - 2, 5], np.int32)
    combine("sum", total, np.array([1, -9], np.int32))
    assert total.tolist() == [2**31 - 1, -4]
    for dtype, big in ((np.int32, 2**31 - 1), (np.int64, 2**63 - 1), (np.uint64, 2**64 - 1), (np.int8, 127)):
        with pytest.raises(CheckpointError, match="leaves the range") as caught:
            combine("sum", np.array([0, big], dtype), np.array([0, 1], dtype), "w")
        assert caught.value.tensor == "w" and "element [1]" in str(caught.value)
    with pytest.raises(UnsupportedError, match="integer"):
        check_reducible("avg", np.dtype(np.int32), "w")
    with pytest.raises(UnsupportedError, match="boolean"):
        check_reducible("sum", np.dtype(np.bool_), "w")
