"""Peer copies travel in bounded pieces: a snapshot many pieces long arrives byte for byte, on both directions at
once, and is given back the same way; the receiver's memory is one piece per peer, not the snapshot."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

PIECE = 4096  # small, so that one snapshot file takes many pieces


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _worker(rank: int, port: int, out: str) -> None:
    from tensormorph.distributed.collective import Collective
    from tensormorph.train import peers
    from tensormorph.train.memory import MemoryTier

    peers.PEER_PIECE = PIECE
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    root = Path(out)
    memory = MemoryTier(root / "run", rank, keep=3, memory_dir=root / "shm", node="ab"[rank])
    torch.manual_seed(rank)
    state = {"weight": torch.randn(100, 77), "bias": torch.randn(3), "empty": torch.empty(0), "step": 5}
    snapshot = memory.save(7, state, {"who": rank})
    tier = peers.PeerTier(memory, Collective(dist.new_group(backend="gloo")), ["a", "b"])
    tier.exchange(snapshot)  # each rank sends its snapshot to the other and holds the other's
    other = 1 - rank
    held = memory.folder / f"peer-{other:05d}" / "step-00000007"
    result = {"held": {k: v.hex() for k, v in _files(held).items()}, "own": {k: v.hex() for k, v in
                                                                             _files(snapshot).items()},
              "pieces": len(peers._pieces(peers._table(snapshot))), "holds": tier.held()}
    # rank 1 loses its own snapshot; rank 0 gives its copy back
    dist.barrier()
    if rank == 1:
        import shutil

        shutil.rmtree(snapshot)
    dist.barrier()
    plan = [(0, 1, 7)]
    tier.deliver(plan, tier.pack(plan))
    result["restored"] = {k: v.hex() for k, v in _files(memory.folder / "step-00000007").items()}
    target = {"weight": torch.zeros(100, 77), "bias": torch.zeros(3), "empty": torch.empty(0), "step": None}
    extra = memory.load(memory.folder / "step-00000007", target)
    result["loaded_equal"] = bool(torch.equal(target["weight"], state["weight"]) and
                                  torch.equal(target["bias"], state["bias"])) and target["step"] == 5
    result["extra"] = extra["who"]
    (root / f"result-{rank}.json").write_text(json.dumps(result))
    memory.release()
    dist.destroy_process_group()


def test_a_snapshot_many_pieces_long_is_copied_and_given_back_byte_for_byte(tmp_path):
    tmp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["pieces"] > 5  # the rank file alone is ~31 KB: eight pieces of 4 KiB
        assert result["held"] == results[1 - rank]["own"]  # the buddy's files, byte for byte
        assert result["holds"] == {str(1 - rank): [7]}
        assert result["restored"] == result["own"] and result["loaded_equal"] and result["extra"] == rank
