"""A memory snapshot holds one rank's local shards, which mean something only on the same mesh: a mesh of the same
shape whose ranks sit in another order is another layout, and the snapshot is refused, naming it."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tensormorph.errors import StateMismatchError
    from tensormorph.train.memory import MemoryTier

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    memory = MemoryTier(Path(out) / "run", rank, memory_dir=Path(out) / "shm", node="n")
    full = torch.arange(12.0).reshape(4, 3)
    saved = distribute_tensor(full, DeviceMesh("cpu", [0, 1]), [Shard(0)])
    snapshot = memory.save(1, {"w": saved}, {})
    same = distribute_tensor(torch.zeros(4, 3), DeviceMesh("cpu", [0, 1]), [Shard(0)])
    memory.load(snapshot, {"w": same})
    result = {"same_mesh": same.full_tensor().tolist()}
    swapped = distribute_tensor(torch.zeros(4, 3), DeviceMesh("cpu", [1, 0]), [Shard(0)])
    try:
        memory.load(snapshot, {"w": swapped})
        result["swapped"] = "loaded"
    except StateMismatchError as exc:
        result["swapped"] = str(exc)
    (Path(out) / f"result-{rank}.json").write_text(json.dumps(result))
    memory.release()
    dist.destroy_process_group()


def test_a_snapshot_on_a_mesh_of_other_rank_order_is_refused(tmp_path):
    tmp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert result["same_mesh"] == torch.arange(12.0).reshape(4, 3).tolist()
        assert "w: laid out as" in result["swapped"] and "'ranks': [1, 0]" in result["swapped"]
