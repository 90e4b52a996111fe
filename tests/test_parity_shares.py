"""Parity written in place by every rank: each encodes its share of every stripe (all m parity files in one pass)
and writes it at its offset; the manifest's CRC-32C of each parity file is combined from the ranks' parts.

The parity files are compared bit-exact with the ones a single writer encodes whole (encode_parity), on a real
checkpoint (the 4-rank DCP fixture converted with rs(4,2) and rs(2,1), whose ranks the conversion plays in turn)
and on 4 gloo ranks (tests/test_distributed.py rebuilds lost files from them).
"""

from __future__ import annotations

import os

import crc32c
import pytest
import zfec
from hypothesis import given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph.errors import CheckpointError
from tensormorph.storage import LocalFiles
from tensormorph.tmformat import linear_code
from tensormorph.tmformat.checkpoint import read_manifest
from tensormorph.tmformat.checksums import crc32c_combine
from tensormorph.tmformat.manifest import FileRecord
from tensormorph.tmformat.output_files import SharedOutput
from tensormorph.tmformat.parity import Stripe, encode_parity, parse_scheme, share, write_extras
from tensormorph.tmformat.writer import redundancy_record


@settings(max_examples=300, deadline=None)
@given(first=st.binary(max_size=3000), second=st.binary(max_size=3000), seed=st.integers(0, 2**32 - 1))
def test_the_crc_of_two_parts_combines_into_the_crc_of_the_whole(first: bytes, second: bytes, seed: int) -> None:
    assert crc32c_combine(crc32c.crc32c(first), crc32c.crc32c(second), len(second)) == crc32c.crc32c(first + second)
    assert crc32c_combine(seed, 0, 0) == seed  # nothing appended


def test_combining_long_parts_matches_one_pass() -> None:
    whole = os.urandom(9 << 20)
    cuts = [0, 1, 4096, 3 << 20, (3 << 20) + 17, 9 << 20]
    crc = 0
    for begin, end in zip(cuts, cuts[1:]):
        crc = crc32c_combine(crc, crc32c.crc32c(whole[begin:end]), end - begin)
    assert crc == crc32c.crc32c(whole)


def test_combining_parts_of_512_mib_and_more_matches_one_pass() -> None:
    """A rank's share of a large stripe is easily 2^29 bytes or more: the table of shifts must reach that far (CRC-32C's
    x has no period 2^32 - 1, so zlib's wrap at 32 entries would be wrong here). Zeros keep it fast: 4 GiB + 3 bytes."""
    head, zeros = os.urandom(100), bytes(8 << 20)
    for parts in (64, 64 * 8):  # 512 MiB and 4 GiB of zeros, then 3 more bytes
        tail = b"\x01\x02\x03"
        whole = first = crc32c.crc32c(head)
        part = 0
        for _ in range(parts):
            whole, part = crc32c.crc32c(zeros, whole), crc32c.crc32c(zeros, part)
        whole, part = crc32c.crc32c(tail, whole), crc32c.crc32c(tail, part)
        assert crc32c_combine(first, part, parts * len(zeros) + 3) == whole, parts


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 10**6), min_size=1, max_size=12), world=st.integers(1, 40),
       segment=st.sampled_from([1, 7, 4096, 65536]))
def test_shares_cover_every_stripe_once_and_are_balanced(lengths: list[int], world: int, segment: int) -> None:
    covered: dict[int, list[tuple[int, int]]] = {}
    segments = []
    for rank in range(world):
        parts = share(lengths, world, rank, segment)
        segments.append(sum(-(-(e - b) // segment) for _, b, e in parts))
        for stripe, begin, end in parts:
            assert begin % segment == 0 and begin < end <= lengths[stripe]
            covered.setdefault(stripe, []).append((begin, end))
    for stripe, length in enumerate(lengths):
        runs = sorted(covered.get(stripe, []))
        if length == 0:  # an empty stripe's parity is written whole (empty) by its parity_writer
            assert not runs
            continue
        assert [b for b, _ in runs] == [0] + [e for _, e in runs[:-1]] and runs[-1][1] == length
    assert max(segments) - min(segments) <= 1 + len(lengths)  # whole segments, split as evenly as they go


def test_a_hundred_thousand_stripes_over_a_thousand_ranks() -> None:
    lengths = [4096 * 3] * 99_999 + [4096 * 2 + 5]  # 300,000 segments: 300 each, whole stripes of 3 segments
    for rank in (0, 1, 500, 998):
        assert share(lengths, 1000, rank, 4096) == [(s, 0, 4096 * 3) for s in range(100 * rank, 100 * rank + 100)]
    assert share(lengths, 1000, 999, 4096)[-1] == (99_999, 0, 4096 * 2 + 5)


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 10), m=st.integers(1, 4), length=st.sampled_from([1, 33, 4097]), data=st.data())
def test_all_parity_rows_at_once_are_zfecs(k: int, m: int, length: int, data: st.DataObject) -> None:
    blocks = [data.draw(st.binary(min_size=length, max_size=length)) for _ in range(k)]
    want = [bytes(b) for b in zfec.Encoder(k, k + m).encode(blocks, tuple(range(k, k + m)))]
    assert [bytes(b) for b in linear_code.ParityRows(k, m).apply(blocks)] == want


@pytest.mark.parametrize("scheme", ["rs(4,2)", "rs(2,1)"])
def test_parity_written_in_place_equals_parity_encoded_whole(dcp_ckpt, tmp_path, scheme) -> None:
    out = tmp_path / "ck"
    tm.convert(dcp_ckpt, out, to="tensormorph", mesh=4, placements=["Shard(0)"], redundancy=scheme)
    files = LocalFiles(out)
    manifest = read_manifest(files, str(out))
    plan = manifest.redundancy
    assert plan is not None and plan.scheme == scheme
    k, m = parse_scheme(scheme).k, parse_scheme(scheme).m
    assert len(plan.stripes) == 4 // k
    for data, parity in plan.stripes:
        stripe = Stripe(tuple(data), tuple(manifest.files[d].size for d in data), tuple(parity))
        for j, name in enumerate(parity):
            whole = b"".join(encode_parity(stripe, k, m, j, lambda n, b, e: files.read(n, b, e - b), segment=4096))
            assert (out / name).read_bytes() == whole
            assert plan.files[name].size == len(whole) and plan.files[name].crc32c == crc32c.crc32c(whole)
    assert tm.verify(out).ok
    files.close()


def _record(extras):
    data = {f"rank-{r:05d}.safetensors": FileRecord(100, 0, r) for r in range(2)}
    return redundancy_record(parse_scheme("rs(2,1)"), data, extras)


def test_the_manifest_refuses_parts_that_leave_a_gap_or_fall_short() -> None:
    whole = os.urandom(100)
    parts = [{"parity-00000-0.bin": (0, 60, crc32c.crc32c(whole[:60]))},
             {"parity-00000-0.bin": (60, 40, crc32c.crc32c(whole[60:]))}]
    record = _record(parts)
    assert record.files["parity-00000-0.bin"] == FileRecord(100, crc32c.crc32c(whole), 0)
    with pytest.raises(CheckpointError, match=r"overlap at \[50, 60\)"):
        _record([parts[0], {"parity-00000-0.bin": (50, 50, 0)}])
    with pytest.raises(CheckpointError, match=r"leave bytes \[60, 70\) unwritten"):
        _record([parts[0], {"parity-00000-0.bin": (70, 30, 0)}])
    with pytest.raises(CheckpointError, match="wrote 60 bytes of parity-00000-0.bin, its stripe is 100"):
        _record([parts[0], {}])
    with pytest.raises(CheckpointError, match="no rank wrote the parity files parity-00000-0.bin"):
        _record([{}, {}])


def test_a_shared_file_is_never_written_through_a_link(tmp_path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep")
    (tmp_path / "link.bin").symlink_to(outside)
    with pytest.raises(OSError):
        SharedOutput(tmp_path / "link.bin")
    os.link(outside, tmp_path / "hard.bin")
    with pytest.raises(CheckpointError, match="not a plain file of this save"):
        SharedOutput(tmp_path / "hard.bin")
    os.mkfifo(tmp_path / "fifo.bin")  # a FIFO would block a plain open for writing until a reader came
    with pytest.raises((OSError, CheckpointError)):
        SharedOutput(tmp_path / "fifo.bin")
    assert outside.read_bytes() == b"keep"
    first, second = SharedOutput(tmp_path / "p.bin"), SharedOutput(tmp_path / "p.bin")  # two ranks, one file
    second.write_at(3, b"def")
    first.write_at(0, b"abc")
    for output in (first, second):
        output.finish()
        output.close()
    assert (tmp_path / "p.bin").read_bytes() == b"abcdef"


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["copy_file_range", "through-the-process"])
def test_copies_are_made_in_place_bit_exact(dcp_ckpt, tmp_path, monkeypatch, kernel_copy) -> None:
    if not kernel_copy:  # a file system pair without copy_file_range: the copy goes through this process
        def refuse(*_args: object) -> int:
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    out = tmp_path / "ck"
    tm.convert(dcp_ckpt, out, to="tensormorph", mesh=4, placements=["Shard(0)"], redundancy="replicate:2")
    manifest = read_manifest(LocalFiles(out), str(out))
    assert manifest.redundancy is not None
    copies = manifest.redundancy.files
    assert len(copies) == 4
    for rank in range(4):
        data, copy = f"rank-{rank:05d}.safetensors", f"rank-{rank:05d}.copy1.safetensors"
        assert (out / copy).read_bytes() == (out / data).read_bytes()
        assert copies[copy] == FileRecord(manifest.files[data].size, crc32c.crc32c((out / copy).read_bytes()),
                                          (rank + 1) % 4)
    assert tm.verify(out).ok


def test_a_parity_file_that_cannot_be_opened_leaves_no_other_open() -> None:
    opened, closed = [], []

    class Part:
        def write_at(self, offset: int, data: bytes | bytearray) -> None:
            pass

        def finish(self) -> None:
            pass

        def close(self) -> None:
            closed.append(self)

    class Folder:
        def open_shared(self, name: str) -> Part:
            if opened:  # the second parity file: a full disk
                raise OSError(28, "No space left on device")
            opened.append(Part())
            return opened[-1]

        def copy_file(self, source: str, name: str) -> None:
            raise AssertionError("rs(k,m) makes no copies")

    data = {"rank-00000.safetensors": b"a" * 10, "rank-00001.safetensors": b"b" * 10}
    with pytest.raises(OSError, match="No space"):
        write_extras(parse_scheme("rs(2,2)"), [(n, 10, crc32c.crc32c(d)) for n, d in data.items()], 0, 1,
                     lambda n, b, e: data[n][b:e], lambda name, chunks: None, in_place=Folder())
    assert closed == opened and len(opened) == 1
