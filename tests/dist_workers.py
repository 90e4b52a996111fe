"""Rank processes for the sharded save/load tests (spawned with torch.multiprocessing, gloo on CPU).

Each worker records what it observed in `<out>/result-<rank>.json`; the test
process asserts on those records, so a failing rank shows up as a failed
assertion with its values rather than as a hung collective.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

# tensor name -> (global shape, dtype name, placements on the 2x2 save mesh, seed)
SAVE_LAYOUT = {
    # uneven on both mesh dims; large against the 64 KiB checksum blocks, as real weights are
    "model.w": ((4003, 1602), "float32", ("Shard(0)", "Shard(1)"), 1),
    "model.v": ((9, 6), "float32", ("Shard(1)", "Shard(0)"), 2),
    "model.b": ((7,), "bfloat16", ("Shard(0)", "Replicate()"), 3),
    "model.r": ((3, 5), "float32", ("Replicate()", "Replicate()"), 4),
    "model.e": ((0, 4), "float32", ("Shard(0)", "Shard(1)"), 5),  # empty
    "model.i": ((5, 3), "int64", ("Shard(0)", "Shard(0)"), 6),  # the same dim sharded twice
    "opt.step": ((), "float32", None, 7),  # a plain tensor: replicated, written once
}
OBJECTS = {"step": 1000, "config": {"lr": 0.001, "betas": (0.9, 0.95), "name": "run", 3: b"\x00\x01"}}


def full_tensor(name: str):
    import torch

    shape, dtype, _, seed = SAVE_LAYOUT[name]
    g = torch.Generator().manual_seed(seed)
    if dtype == "int64":
        return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int64)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def init(rank: int, world: int, port: int, timeout_s: float = 120) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def _mesh(shape: tuple[int, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _placements(texts, ndim: int = 8):
    """Placements from text; a Shard beyond the tensor's last dimension shards its last one instead."""
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if t == "Replicate()" else Shard(min(int(t[6:-1]), ndim - 1)) for t in texts]


def save_state(mesh_shape=(2, 2)):
    """The test state on the current process group, as DTensors on a mesh of `mesh_shape`."""
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh(mesh_shape)
    model, opt = {}, {}
    for name, (_, _, placements, _) in SAVE_LAYOUT.items():
        full = full_tensor(name)
        # on a 1-D mesh, each tensor keeps the placement of the first mesh dimension
        value = full if placements is None else distribute_tensor(full, mesh, _placements(placements[:len(mesh_shape)]))
        (model if name.startswith("model.") else opt)[name.split(".", 1)[1]] = value
    return {"model": model, "opt": opt, **OBJECTS}


def _write(out: str, rank: int, record: dict) -> None:
    """Record what this rank saw and end the process at once: an interpreter shutdown with gloo's C++
    threads still around now and then aborts ("terminate called without an active exception"), which
    would fail a rank that did everything right."""
    Path(out, f"result-{rank}.json").write_text(json.dumps(record))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def save_worker(rank: int, port: int, out: str, world: int, targets: dict) -> None:
    """Save the 2x2-mesh state with tm.save to each target (and with dcp.save when asked)."""
    import torch.distributed.checkpoint as dcp

    import tensormorph as tm

    init(rank, world, port)
    state = save_state()
    record = {}
    for label, (path, options, *redundancy) in targets.items():
        if label == "dcp":
            dcp.save(state, checkpoint_id=path)
        else:
            record[label] = tm.save(state, path, storage_options=options,
                                    redundancy=redundancy[0] if redundancy else None).bytes_written
    _write(out, rank, record)


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def load_worker(rank: int, port: int, out: str, world: int, mesh_shape: tuple, placements: tuple,
                sources: dict) -> None:
    """Load every source into DTensors on `mesh_shape` with `placements` and record each local shard's check."""
    import torch
    from torch.distributed.tensor import distribute_tensor

    import tensormorph as tm

    init(rank, world, port)
    mesh = _mesh(tuple(mesh_shape))
    record = {}
    for label, (path, options) in sources.items():
        targets = {}
        for name, (shape, dtype, _, _) in SAVE_LAYOUT.items():
            zeros = torch.zeros(shape, dtype=getattr(torch, dtype))
            targets[name] = zeros if not shape else distribute_tensor(zeros, mesh, _placements(placements, len(shape)))
        state = {"model": {k.split(".", 1)[1]: v for k, v in targets.items() if k.startswith("model.")},
                 "opt": {"step": targets["opt.step"]}, "step": 0, "config": None}
        # the first load imports what loading needs (torch modules); the measured one reads only checkpoint bytes
        tm.load(path, state, storage_options=options)
        for tensor in targets.values():
            (tensor.to_local() if hasattr(tensor, "to_local") else tensor).zero_()
        before = _rchar()
        report = tm.load(path, state, storage_options=options)
        read = _rchar() - before
        equal = {}
        for name, tensor in targets.items():
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            chunk = tensor.__create_chunk_list__()[0] if hasattr(tensor, "to_local") else None
            truth = full_tensor(name)
            if chunk is not None:
                truth = truth[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            equal[name] = bool(torch.equal(local, truth))
        # DCP flattens nested values and keeps no key types: its config comes back with string keys
        config = OBJECTS["config"] if label != "dcp" else {str(k): v for k, v in OBJECTS["config"].items()}
        record[label] = {"equal": equal, "objects_ok": state["step"] == OBJECTS["step"] and
                         _plain(state["config"]) == _plain(config), "bytes_needed": report.bytes_needed,
                         "bytes_read": report.bytes_read, "rchar": read}
    _write(out, rank, record)


def _plain(value):
    """Tuples as lists, for comparing values that went through formats without tuples."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def placements_alone_worker(rank: int, port: int, out: str, world: int, path: str) -> None:
    """Partial(sum) and a _StridedShard alone (each rank's local is two boxes) saved on a 1-D mesh; each rank
    records torch's own full_tensor() and what a load on the same mesh restores."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    import tensormorph as tm

    init(rank, world, port)
    mesh = _mesh((world,))
    local = torch.arange(8, dtype=torch.float32).reshape(4, 2) * (rank + 1) + 0.1
    record: dict = {}
    for label, placement in (("partial", Partial()), ("strided", _StridedShard(0, split_factor=2))):
        tensor = DTensor.from_local(local.clone(), mesh, [placement], run_check=False)
        tm.save({"t": tensor}, f"{path}-{label}")
        target = DTensor.from_local(torch.zeros_like(local), mesh, [placement], run_check=False)
        tm.load(f"{path}-{label}", {"t": target})
        replicated = DTensor.from_local(torch.zeros(tuple(tensor.shape)), mesh, [Replicate()], run_check=False)
        tm.load(f"{path}-{label}", {"t": replicated})
        record[label] = {"full": tensor.full_tensor().tolist(), "restored": target.to_local().tolist(),
                         "local": local.tolist(), "into_replicate": replicated.to_local().tolist()}
        # a Partial target of another layout gets shares that reduce to the value exactly
        for op in ("sum", "max"):
            other = DTensor.from_local(torch.zeros(tuple(tensor.shape)), mesh, [Partial(op)], run_check=False)
            tm.load(f"{path}-{label}", {"t": other})
            record[label][f"into_partial_{op}"] = {"full": other.full_tensor().tolist(),
                                                   "local": other.to_local().tolist()}
    _write(out, rank, record)


def crash_worker(rank: int, port: int, out: str, world: int, path: str) -> None:
    """Overwrite a committed checkpoint, but rank 1 dies halfway through writing its file."""
    import tensormorph as tm
    from tensormorph.tmformat import writer

    init(rank, world, port, timeout_s=20)
    state = save_state((2,))
    if rank == 1:
        def die_halfway(f, *args, **kwargs):
            f.write(b"\x00" * 4096)  # some bytes reach the temporary file, then the process is gone
            f.flush()
            os._exit(17)

        writer.write_rank_file = die_halfway
    tm.save(state, path, overwrite=True)
    _write(out, rank, {"committed": True})


def plain_save_worker(rank: int, port: int, out: str, world: int, path: str, mesh_shape: tuple) -> None:
    import tensormorph as tm

    init(rank, world, port)
    tm.save(save_state(tuple(mesh_shape)), path)
    _write(out, rank, {"saved": True})


def hf_load_worker(rank: int, port: int, out: str, world: int, path: str) -> None:
    """Load a Hugging Face safetensors folder straight into tensor-parallel DTensors ([Shard(0)] / [Shard(1)])."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.tensor import Shard, distribute_tensor

    import tensormorph as tm

    init(rank, world, port)
    mesh = _mesh((world,))
    truth = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        truth.update(load_file(str(file)))
    state, placements = {}, {}
    for name, tensor in truth.items():
        dim = 1 if tensor.dim() == 2 and "o_proj" in name else 0  # row- and column-parallel layers
        state[name] = distribute_tensor(torch.zeros_like(tensor), mesh, [Shard(dim)]) if tensor.dim() else \
            torch.zeros_like(tensor)
        placements[name] = dim
    report = tm.load(path, state)
    equal = {}
    for name, tensor in state.items():
        if hasattr(tensor, "to_local"):
            chunk = tensor.__create_chunk_list__()[0]
            expected = truth[name][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
            equal[name] = bool(torch.equal(tensor.to_local(), expected))
        else:
            equal[name] = bool(torch.equal(tensor, truth[name]))
    _write(out, rank, {"equal": equal, "format": report.format, "tensors": report.tensors_loaded})
