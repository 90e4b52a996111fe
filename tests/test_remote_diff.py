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

pytestmark = pytest.mark.timeout(120)

BUCKET = "diffs"
SHAPE = (256, 512)  # 512 KiB of float32 per tensor


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


def test_a_remote_diff_in_small_blocks_read_ahead_reports_what_the_local_diff_does(pair, s3, proxy, monkeypatch):
    """Bit-exact against the local diff in the same blocks; against the local diff's default (larger) blocks, the
    sums behind rel_l2 and cosine add in another order, so those two agree to rounding and all else exactly."""
    block = 64 * 1024  # 8 Ki float64 elements: 64 blocks per tensor
    monkeypatch.setattr(diff_module, "REMOTE_BLOCK_BYTES", block)
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
        # the blocks are small: no GET asks for more than one block of float32 values (plus the header's first read)
        lengths = [_range_length(r.range) for r in proxy.requests if r.method == "GET" and r.range]
        assert max(lengths) <= 64 * 1024, max(lengths)


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
