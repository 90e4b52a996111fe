"""Fast paths for states of very many small tensors (issue 17), each bit-exact against the slow path it replaces.

- load: boxes that are whole small chunks are read in coalesced runs (BoxReader.whole_chunk_reads / read_whole),
  every block still verified; damage falls back to the per-chunk read, which names it.
- save: small pieces are staged into large writes (stream.SMALL_WRITE); DTensor layouts are computed once per
  (mesh, placements, shape, dtype) (state.held_pieces' memo); repeated tilings are checked once (plan_writers).
- the manifest's body is written once and checksummed in place (Manifest.to_bytes).
Multi-rank cases run on real gloo ranks; the linear checks run at 100,000 chunks.
"""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import crc32c
import dist_workers as w
import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp

import tensormorph as tm
from tensormorph.errors import CheckpointError, ChecksumError
from tensormorph.storage import LocalFiles
from tensormorph.tmformat import stream
from tensormorph.tmformat.checkpoint import read_manifest
from tensormorph.tmformat.manifest import MANIFEST, ChunkRecord, FileRecord, Manifest, TensorRecord, parse
from tensormorph.tmformat.reader import BoxReader
from tensormorph.tmformat.stream import TensorSpec, header_bytes, write_stream
from tensormorph.tmformat.writer import Piece, plan_writers

# name -> (global shape, dtype, placement on the 1-D mesh of 2): small uneven shards, replicas, and large ones
LAYOUT = {f"optim.{i}.exp_avg": ((9 + i % 4, 16), "float32", "Shard(0)") for i in range(240)}
LAYOUT.update({f"optim.{i}.step": ((3,), "bfloat16", "Replicate()") for i in range(20)})
LAYOUT.update({f"model.{i}.weight": ((1030, 512), "float32", "Shard(0)") for i in range(3)})  # 1 MiB shards
LAYOUT.update({"model.odd": ((7, 5), "int64", "Shard(1)"), "model.empty": ((0, 4), "float32", "Shard(0)")})


def _full(i: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    if dtype == "int64":
        return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def _state(mesh) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    # src_data_rank=None: every rank makes the full tensor itself and keeps its shard, no collective per tensor
    return {name: distribute_tensor(_full(i, shape, dtype), mesh, [Replicate() if p == "Replicate()" else
                                                                   Shard(int(p[6]))], src_data_rank=None)
            for i, (name, (shape, dtype, p)) in enumerate(LAYOUT.items())}


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for tensor in state.values():
        h.update(tensor.to_local().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def small_worker(rank: int, port: int, out: str, world: int, root: str) -> None:
    """Save the state fast and slow, load it fast and slow, and record what each gave."""
    from torch.distributed.device_mesh import init_device_mesh

    from tensormorph.distributed import state as state_module

    w.init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    state = _state(mesh)
    truth = _digest(state)
    record: dict = {"truth": truth}
    # the layout memo gives every tensor the boxes and layout the memo-less path gives
    memo: state_module.Memo = {}
    dtensor = state_module.dtensor_types()
    record["memo_same"] = all(
        [(h.box, h.contribution, h.data.data_ptr(), tuple(h.data.shape)) for h in fast[0]] ==
        [(h.box, h.contribution, h.data.data_ptr(), tuple(h.data.shape)) for h in slow[0]] and fast[1] == slow[1]
        for fast, slow in ((state_module.held_pieces(n, t, dtensor, memo), state_module.held_pieces(n, t, dtensor))
                           for n, t in state.items()))
    record["memo_kinds"] = len(memo)

    tm.save(state, Path(root, "fast"))
    small_write = stream.SMALL_WRITE
    stream.SMALL_WRITE = 0  # every piece written on its own, as before staging
    try:
        tm.save(state, Path(root, "slow"))
    finally:
        stream.SMALL_WRITE = small_write

    loads = {}
    whole = BoxReader.whole_chunk_reads
    for label, path in (("fast", "fast"), ("slow", "fast"), ("from_slow_save", "slow")):
        for tensor in state.values():
            tensor.to_local().zero_()
        if label == "slow":  # no coalesced read: every box through read_box
            BoxReader.whole_chunk_reads = lambda self, requests: ([], list(range(len(requests))))  # type: ignore
        try:
            report = tm.load(Path(root, path), state)
        finally:
            BoxReader.whole_chunk_reads = whole  # type: ignore[method-assign]
        loads[label] = {"digest": _digest(state), "bytes_read": report.bytes_read,
                        "blocks_verified": report.blocks_verified, "bytes_needed": report.bytes_needed}
    record["loads"] = loads
    w._write(out, rank, record)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_fast_paths_match_slow_paths(tmp_path: Path) -> None:
    out = tmp_path / "results"
    out.mkdir()
    tmp.spawn(small_worker, args=(_free_port(), str(out), 2, str(tmp_path)), nprocs=2, join=True)
    records = [json.loads((out / f"result-{r}.json").read_text()) for r in range(2)]
    for record in records:
        assert record["memo_same"]
        assert record["memo_kinds"] == len({(shape, dtype, p) for shape, dtype, p in LAYOUT.values()}) == 8
        loads = record["loads"]
        assert loads["fast"]["digest"] == loads["slow"]["digest"] == loads["from_slow_save"]["digest"] \
            == record["truth"]
        # the coalesced reads read exactly the bytes the per-box reads did, and verify the same blocks
        assert loads["fast"]["bytes_read"] == loads["slow"]["bytes_read"] == loads["fast"]["bytes_needed"]
        assert loads["fast"]["blocks_verified"] == loads["slow"]["blocks_verified"] > len(LAYOUT) // 2
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    for rank in range(2):  # staged writes make the same data files, byte for byte
        name = f"rank-{rank:05d}.safetensors"
        assert (fast / name).read_bytes() == (slow / name).read_bytes()
    a, b = (json.loads((p / MANIFEST).read_text())["body"] for p in (fast, slow))
    assert a["tensors"] == b["tensors"] and a["files"] == b["files"]


# ---------------------------------------------------------------- one process: damage, files, 100,000 chunks

def _plain_state(count: int = 300) -> dict[str, torch.Tensor]:
    return {f"t{i}": _full(i, (8, 16 + i % 3), "float32") for i in range(count)}


def test_damaged_small_chunk_is_named_and_the_rest_still_checked(tmp_path: Path) -> None:
    state = _plain_state()
    tm.save(state, tmp_path / "ck")
    manifest = read_manifest(LocalFiles(tmp_path / "ck"), str(tmp_path / "ck"))
    chunk = manifest.tensors["t157"].chunks[0]
    data = tmp_path / "ck" / chunk.file
    raw = bytearray(data.read_bytes())
    raw[chunk.byte_range[0] + 100] ^= 0x40
    data.write_bytes(bytes(raw))
    target = {n: torch.zeros_like(t) for n, t in state.items()}
    with pytest.raises(ChecksumError) as caught:
        tm.load(tmp_path / "ck", target)
    assert "t157" in str(caught.value) and chunk.file in str(caught.value)
    assert f"bytes [{chunk.byte_range[0]}, {chunk.byte_range[1]})" in str(caught.value)
    # unverified, the damaged byte comes through, and everything else is intact: the batch really was read
    tm.load(tmp_path / "ck", target, verify=False)
    assert not torch.equal(target["t157"], state["t157"])
    assert all(torch.equal(target[n], state[n]) for n in state if n != "t157")


def test_coalesced_load_matches_per_box_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _plain_state()
    tm.save(state, tmp_path / "ck")
    target = {n: torch.zeros_like(t) for n, t in state.items()}
    fast = tm.load(tmp_path / "ck", target)
    assert all(torch.equal(target[n], state[n]) for n in state)
    batches = []
    read = BoxReader.read_whole
    monkeypatch.setattr(BoxReader, "read_whole", lambda self, batch: (batches.append(len(batch)), read(self, batch)))
    for tensor in target.values():
        tensor.zero_()
    tm.load(tmp_path / "ck", target)
    assert sum(batches) == len(state) and len(batches) == 1  # 300 x ~0.5 KiB: one read
    monkeypatch.setattr(BoxReader, "whole_chunk_reads", lambda self, requests: ([], list(range(len(requests)))))
    for tensor in target.values():
        tensor.zero_()
    slow = tm.load(tmp_path / "ck", target)
    assert all(torch.equal(target[n], state[n]) for n in state)
    assert (fast.bytes_read, fast.blocks_verified) == (slow.bytes_read, slow.blocks_verified)


def test_truncated_file_fails_as_the_per_box_read_does(tmp_path: Path) -> None:
    state = _plain_state(50)
    tm.save(state, tmp_path / "ck")
    data = tmp_path / "ck" / "rank-00000.safetensors"
    data.write_bytes(data.read_bytes()[:-300])
    with pytest.raises(CheckpointError) as caught:
        tm.load(tmp_path / "ck", {n: torch.zeros_like(t) for n, t in state.items()})
    assert "rank-00000.safetensors" in str(caught.value)


class _Sink:
    """An OutputFile that records each write, to see how many the stream made."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes | memoryview) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def flush(self) -> None: ...

    def fileno(self) -> int:
        return -1

    def close(self) -> None: ...


@pytest.mark.parametrize("small_write", [stream.SMALL_WRITE, 0])
def test_staged_writes_make_the_same_bytes_and_checksums(small_write: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream, "SMALL_WRITE", small_write)
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal((n,), dtype=np.float32) for n in [3, 16384, 70000, 5, 2 * 1024**2, 1, 300000]]
    arrays += [rng.standard_normal((257,), dtype=np.float32) for _ in range(5000)]  # ~5 MiB of small tensors
    specs = [TensorSpec(f"t{i}", "F32", a.shape) for i, a in enumerate(arrays)]
    sink = _Sink()
    written = write_stream(sink, [(s, iter([a])) for s, a in zip(specs, arrays)], {"k": "v"})
    data = b"".join(sink.parts)
    head = header_bytes(specs, {"k": "v"})
    assert data == head + b"".join(a.tobytes() for a in arrays)
    assert (written.size, written.crc32c) == (len(data), crc32c.crc32c(data))
    position = len(head)
    for a, (begin, end), crcs in zip(arrays, written.ranges, written.block_crc32c):
        raw = a.tobytes()
        assert (begin, end) == (position, position + len(raw))
        assert crcs == [crc32c.crc32c(raw[k:k + 65536]) for k in range(0, len(raw), 65536)]
        position = end
    if small_write:
        assert len(sink.parts) < 20  # 5,000 small tensors in a few writes, not 5,000
        assert max(len(p) for p in sink.parts) <= stream.WRITE_PIECE + stream.SMALL_WRITE


def test_manifest_body_written_once_is_the_canonical_form(tmp_path: Path) -> None:
    state = _plain_state(30)
    extra = {"run": "é\n\"x\"", "numbers": [1, 2.5, -0.0, 1e300], "nested": {"a": None}}
    tm.save({**state, "config": {"lr": 1e-3, "name": "ünï"}}, tmp_path / "ck", extra=extra)
    raw = (tmp_path / "ck" / MANIFEST).read_bytes()
    outer = json.loads(raw)
    text = json.dumps(outer["body"], separators=(",", ":"), allow_nan=False)
    slow = json.dumps({"manifest_crc32c": f"{crc32c.crc32c(text.encode()):08x}", "body": json.loads(text)},
                      separators=(",", ":"), allow_nan=False).encode()
    assert raw == slow  # what the double serialisation wrote, byte for byte
    manifest = parse(raw, "m")
    assert isinstance(manifest, Manifest) and manifest.extra == extra and manifest.to_bytes() == raw


def test_hundred_thousand_chunks_plan_read_and_coalesce(tmp_path: Path) -> None:
    """One tensor of 100,000 chunks (a row each): the tiling memo, the exact-chunk lookup and the batching stay
    linear; every row comes back, verified, in one coalesced read."""
    rows = 100_000
    full = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    writers = plan_writers([Piece("t", "F32", (rows, 4), (r, 0), (1, 4), r % 2) for r in range(rows)])
    assert len(writers) == rows and all(writers[("t", (r, 0), (1, 4), 0)] == r % 2 for r in range(0, rows, 997))
    (tmp_path / "data.bin").write_bytes(b"head" + full.tobytes())
    chunks = tuple(ChunkRecord("data.bin", (r, 0), (1, 4), (4 + 16 * r, 20 + 16 * r),
                               np.array([crc32c.crc32c(full[r].tobytes())], dtype=np.uint32), 0, (0,))
                   for r in range(rows))
    manifest = Manifest({"t": TensorRecord("F32", (rows, 4), chunks)}, {},
                        {"data.bin": FileRecord(4 + full.nbytes, 0, 0)}, 1)
    reader = BoxReader(manifest, LocalFiles(tmp_path), str(tmp_path))
    out = np.zeros_like(full)
    batches, others = reader.whole_chunk_reads([("t", ((r, 0), (1, 4)), out[r:r + 1], None) for r in range(rows)])
    assert others == [] and [len(b) for b in batches] == [rows]  # 1.6 MB of adjacent chunks: one read
    reader.read_whole(batches[0])
    assert np.array_equal(out, full)
    assert (reader.bytes_read, reader.blocks_verified) == (full.nbytes, rows)
    # boxes that are not whole chunks are left to read_box
    _, others = reader.whole_chunk_reads([("t", ((0, 0), (2, 4)), out[:2], None),
                                          ("t", ((5, 1), (1, 3)), out[5:6, 1:], None)])
    assert others == [0, 1]
    reader.close()
