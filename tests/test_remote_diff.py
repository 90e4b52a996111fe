"""A diff with a remote side streams small blocks read ahead, and long ranges are fetched as parallel parts; counted
at moto's S3 server behind the counting proxy (tests/remote_support.py). Reports are the local diff's, bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from remote_support import CountingProxy, S3Endpoint

import tensormorph as tm
from tensormorph.ops import diff as diff_module
from tensormorph.ops.diff import DiffReport
from tensormorph.storage import remote as remote_module
from tensormorph.storage.remote_context import FIRST_READ

pytestmark = pytest.mark.timeout(120)

BUCKET = "diffs"
SHAPE = (256, 512)  # 512 KiB of float32 per tensor
FETCH = 128 * 1024  # the remote diff's fetches in these tests: 64 rows, 4 per tensor


def _report(report: DiffReport) -> list[tuple]:
    """Every figure of every tensor, floats by repr (so NaN equals NaN and -0.0 differs from 0.0)."""
    fields = [(t.name, t.status, t.max_abs, t.max_rel, t.rel_l2, t.cosine, t.mismatches, t.nan_mismatches,
               t.worst_index, t.worst_a, t.worst_b) for t in report.tensors]
    return [tuple(repr(v) if isinstance(v, float) else v for v in f) for f in fields]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two safetensors checkpoints: one tensor equal, one differing in its first row, one in its last element,
    one within 1e-3 everywhere, one with a NaN against a number."""
    root = tmp_path_factory.mktemp("pair")
    rng = np.random.default_rng(3)
    a = {name: rng.standard_normal(SHAPE, dtype=np.float32) for name in ("same", "first", "last", "close", "nan")}
    b = {name: values.copy() for name, values in a.items()}
    b["first"][0, :7] += 1.0
    b["last"][-1, -1] -= 2.0
    b["close"] += np.float32(1e-4)
    b["nan"][100, 3] = np.nan
    for side, tensors in (("a", a), ("b", b)):
        (root / side).mkdir()
        safetensors.numpy.save_file(tensors, str(root / side / "model.safetensors"))
    return root / "a", root / "b"


@pytest.fixture(scope="module")
def s3(pair: tuple[Path, Path]) -> Iterator[S3Endpoint]:
    with S3Endpoint() as endpoint:
        endpoint.make_bucket(BUCKET)
        for folder in pair:
            endpoint.upload(folder, f"s3://{BUCKET}/{folder.name}")
        yield endpoint


@pytest.fixture(scope="module")
def proxy(s3: S3Endpoint) -> Iterator[CountingProxy]:
    with CountingProxy(s3.endpoint) as counting:
        yield counting


def test_a_remote_diff_fetching_several_blocks_at_once_reports_what_the_local_diff_does(pair, s3, proxy,
                                                                                        monkeypatch):
    """Bit-exact against the local diff in the same blocks; against the local diff's default (larger) blocks, the
    sums behind rel_l2 and cosine add in another order, so those two agree to rounding and all else exactly. Blocks
    are fetched FETCH bytes at a time, and only the fetches a comparison needs are made."""
    block = 64 * 1024  # 8 Ki float64 elements: 16 rows of float32, 32 blocks per tensor
    monkeypatch.setattr(diff_module, "REMOTE_BLOCK_BYTES", block)
    monkeypatch.setattr(diff_module, "REMOTE_FETCH_BYTES", FETCH)
    options = s3.storage_options_via(proxy.url)
    local = tm.diff(*pair, atol=1e-3, block_bytes=block)
    default = tm.diff(*pair, atol=1e-3)
    for a, b in ((pair[0], f"s3://{BUCKET}/b"), (f"s3://{BUCKET}/a", f"s3://{BUCKET}/b")):
        proxy.reset()
        with tm.open(b, storage_options=options, cache=False) as remote_b:
            if isinstance(a, Path):
                report = tm.diff(a, remote_b, atol=1e-3)
            else:
                with tm.open(a, storage_options=options, cache=False) as remote_a:
                    report = tm.diff(remote_a, remote_b, atol=1e-3)
        assert _report(report) == _report(local)
        for got, want in zip(report.tensors, default.tensors):
            assert (got.name, got.status, got.max_abs, got.max_rel, got.mismatches, got.worst_index) == \
                (want.name, want.status, want.max_abs, want.max_rel, want.mismatches, want.worst_index)
            assert got.rel_l2 == pytest.approx(want.rel_l2, rel=1e-12)
            assert got.cosine == pytest.approx(want.cosine, rel=1e-12)
        assert {t.name: t.status for t in report.tensors} == {"same": "equal", "first": "different",
                                                              "last": "different", "close": "close",
                                                              "nan": "different"}
        # besides the header's first read, every GET is one fetch of 4 blocks (64 rows); per remote side: "same" all 4
        # fetches, "first" and "close" 1 (the first block differs) then 4 for the figures, "nan" 2 (row 100) then 4,
        # "last" 4 then 4
        lengths = [_range_length(r.range) for r in proxy.requests if r.method == "GET" and r.range]
        fetches = [n for n in lengths if n != FIRST_READ]
        remote_sides = 1 if isinstance(a, Path) else 2
        assert fetches == [FETCH] * len(fetches) and len(fetches) == (4 + 5 + 8 + 5 + 6) * remote_sides, lengths


def _range_length(header: str) -> int:
    begin, end = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", header).groups())  # type: ignore[union-attr]
    return end - begin + 1


def test_a_long_range_is_fetched_as_parallel_parts_bit_exact(pair, s3, proxy, monkeypatch):
    part = 100 * 1024
    monkeypatch.setattr(remote_module, "PART_BYTES", part)
    ck = tm.open(f"s3://{BUCKET}/b/model.safetensors", storage_options=s3.storage_options_via(proxy.url),
                 cache=False)
    proxy.reset()
    values = ck["last"].full()
    assert values.tobytes() == safetensors.numpy.load_file(str(pair[1] / "model.safetensors"))["last"].tobytes()
    gets = [r for r in proxy.requests if r.method == "GET"]
    assert sorted(_range_length(r.range) for r in gets if r.range) == [512 * 1024 - 5 * part] + [part] * 5
    assert proxy.bytes_sent == 512 * 1024


def test_fetch_groups_join_consecutive_blocks_into_one_box_within_the_limit():
    rows = [(slice(r, r + 2), slice(0, 8)) for r in range(0, 10, 2)]  # 5 blocks of 2 rows
    assert diff_module.fetch_groups(rows, 48) == [((slice(0, 6), slice(0, 8)), rows[:3]),
                                                  ((slice(6, 10), slice(0, 8)), rows[3:])]
    assert diff_module.fetch_groups(rows, 15) == [(box, [box]) for box in rows]  # one block is already over
    # boxes that differ along two axes (the next lead index of a 3-d split), or leave a gap, stay apart
    split = [(slice(0, 1), slice(0, 4), slice(0, 3)), (slice(0, 1), slice(4, 8), slice(0, 3)),
             (slice(1, 2), slice(0, 4), slice(0, 3)), (slice(1, 2), slice(6, 8), slice(0, 3))]
    assert diff_module.fetch_groups(split, 1000) == [((slice(0, 1), slice(0, 8), slice(0, 3)), split[:2]),
                                                    (split[2], [split[2]]), (split[3], [split[3]])]
    assert diff_module.fetch_groups([()], 1) == [((), [()])]  # a 0-d tensor's one box
