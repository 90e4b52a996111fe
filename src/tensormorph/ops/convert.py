"""Convert any readable checkpoint into a Hugging Face style safetensors folder, streaming.

Tensors are written one by one, in blocks no larger than a budget, into
shards of at most `max_shard_size` (a tensor larger than that gets a shard
of its own), plus `model.safetensors.index.json` when there is more than one
shard. The folder is assembled under a temporary name and renamed into place
when complete, and the result is then diffed against the source.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import dtypes
from ..core import Checkpoint, LogicalTensor, split_box
from ..errors import CheckpointError
from ..safetensors_writer import TensorSpec, write_file
from ..formats import opened
from .diff import DiffReport, aligned_names, diff, parse_rename

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
DEFAULT_BLOCK_BYTES = 64 * 1024**2
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
          "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4, "K": 1000, "M": 1000**2, "G": 1000**3}
DTYPE_ALIASES = {"bf16": "BF16", "fp16": "F16", "f16": "F16", "half": "F16", "fp32": "F32", "f32": "F32",
                 "float32": "F32", "float16": "F16", "bfloat16": "BF16", "fp64": "F64", "f64": "F64"}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000 (HF counts GB in powers of 1000)."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise CheckpointError(f"cannot read size {text!r}: use e.g. 5GB, 500MB, 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_dtype(text: str) -> str:
    name = DTYPE_ALIASES.get(text.lower(), text.upper())
    if name not in dtypes.NUMPY_DTYPES or not dtypes.is_floating(name):
        raise CheckpointError(f"cannot convert to dtype {text!r}: use a floating type such as bf16, fp16, fp32")
    return name


@dataclass
class ConvertResult:
    destination: Path
    files: list[str]
    tensors: int
    bytes_written: int
    skipped_objects: list[str] = field(default_factory=list)
    check: DiffReport | None = None


def plan_shards(tensors: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors in order into shards of at most max_shard_bytes (an oversized tensor stands alone)."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in tensors:
        if not shards or (size + spec.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def tensor_blocks(tensor: LogicalTensor, dtype: str, block_bytes: int) -> Iterator[np.ndarray]:
    """The logical tensor's values in C order, block by block, cast to `dtype`."""
    target = dtypes.numpy_dtype(dtype)
    limit = max(1, block_bytes // max(tensor.numpy_dtype.itemsize, target.itemsize))
    for box in split_box(tuple(slice(0, n) for n in tensor.shape), limit):
        values = tensor.read(box)
        yield values if values.dtype == target else values.astype(target)


def convert(source: str | Path | Checkpoint, destination: str | Path, *, to: str = "safetensors",
            max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES, dtype: str | None = None,
            rename: Sequence[str] | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES, check: bool = True,
            progress: Callable[[int], None] | None = None) -> ConvertResult:
    """Write `source` as a Hugging Face safetensors folder at `destination` and diff it against the source.

    `dtype` casts floating-point tensors (integers keep theirs); `rename` rules (as for diff, e.g.
    'model.=' to drop a wrapper's prefix) give the output names. Non-tensor entries cannot be stored
    in safetensors and are listed in the result's `skipped_objects`.
    """
    if to != "safetensors":
        raise CheckpointError(f"cannot convert to {to!r}: supported targets are 'safetensors'")
    with ExitStack() as stack:
        return _convert(opened(source, stack), Path(destination), max_shard_size=max_shard_size, dtype=dtype,
                        rename=rename, block_bytes=block_bytes, check=check, progress=progress)


def _convert(ck: Checkpoint, destination: Path, *, max_shard_size: int | str, dtype: str | None,
             rename: Sequence[str] | None, block_bytes: int, check: bool,
             progress: Callable[[int], None] | None) -> ConvertResult:
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise CheckpointError("destination exists and is not an empty folder; choose a new path", file=str(destination))
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    target = parse_dtype(dtype) if dtype else None

    def out_dtype(t: LogicalTensor) -> str:
        return target if target and dtypes.is_floating(t.dtype) else t.dtype

    rules = [parse_rename(r) for r in rename or ()]
    output_names = {original: aligned for aligned, original in aligned_names(list(ck), rules, "a").items()}
    specs = [TensorSpec(output_names[t.name], out_dtype(t), t.shape) for t in ck.values()]
    source_of = {spec.name: t for spec, t in zip(specs, ck.values())}
    shards = plan_shards(specs, limit)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    staging = destination.parent / f".{destination.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    written = 0
    try:
        for name, shard in zip(names, shards):
            def blocks(spec: TensorSpec) -> Iterator[np.ndarray]:
                for block in tensor_blocks(source_of[spec.name], spec.dtype, block_bytes):
                    yield block
                    if progress is not None:
                        progress(block.nbytes)
            written += write_file(staging / name, [(spec, blocks(spec)) for spec in shard], {"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                     "weight_map": {spec.name: name for name, shard in zip(names, shards) for spec in shard}}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if destination.exists():
            destination.rmdir()
        os.replace(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    result = ConvertResult(destination, names, len(specs), written, skipped_objects=list(ck.objects))
    if check:
        result.check = diff(ck, destination, cast=target, objects=False, block_bytes=block_bytes,
                            rename=[f"a:{r}" for r in rename or ()])
    return result
