"""Convert any readable checkpoint, streaming: to a Hugging Face safetensors folder, or re-sharded
into the Tensormorph format for another world size and placement.

Safetensors: tensors are written one by one, in blocks no larger than a
budget, into shards of at most `max_shard_size` (a tensor larger than that
gets a shard of its own), plus `model.safetensors.index.json` when there is
more than one shard. Tensormorph: every rank's file of a save on a mesh
(`mesh`, `placements`) is written in turn, each chunk read from the source
in blocks. Either way the folder is assembled under a temporary name and
renamed into place when complete, and the result is then diffed against the
source.

To a URL (an object store): the Tensormorph format commits by its manifest's PUT (tmformat). A safetensors folder
is written one shard at a time into a local temporary folder, each shard uploaded (then deleted locally) as soon as
it is complete, and the index uploaded last: the index names the shards, so a reader that finds it finds them all.
The prefix must hold nothing yet; a failed conversion deletes what it uploaded.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .. import dtypes
from ..core import Checkpoint, LogicalTensor
from ..errors import CheckpointError, UnsupportedError
from ..formats import opened
from ..geometry import split_box
from ..safe_pickle import is_plain
from ..storage import RemotePath, as_path, create_new, is_url, remote_defaults
from ..storage.retry import with_retries
from ..tmformat.layout import local_pieces, parse_spec
from ..tmformat.stream import TensorSpec, write_file
from ..tmformat.writer import Piece, RankResult, SaveTransaction
from ..units import parse_size
from .diff import DiffReport, aligned_names, diff, parse_rename
from .spread import ALONE, Team, share
from .stats import check_scannable

T = TypeVar("T")
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
DEFAULT_BLOCK_BYTES = 64 * 1024**2
DTYPE_ALIASES = {"bf16": "BF16", "fp16": "F16", "f16": "F16", "half": "F16", "fp32": "F32", "f32": "F32",
                 "float32": "F32", "float16": "F16", "bfloat16": "BF16", "fp64": "F64", "f64": "F64"}


def parse_dtype(text: str) -> str:
    name = DTYPE_ALIASES.get(text.lower(), text.upper())
    if name not in dtypes.NUMPY_DTYPES or not dtypes.is_floating(name):
        raise CheckpointError(f"cannot convert to dtype {text!r}: use a floating type such as bf16, fp16, fp32")
    return name


@dataclass
class ConvertResult:
    destination: Path | str  # a local folder, or a URL
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


def tensor_blocks(tensor: LogicalTensor, dtype: str, block_bytes: int,
                  region: tuple[slice, ...] | None = None) -> Iterator[np.ndarray]:
    """The values of the tensor (or of a box of it) in C order, block by block, cast to `dtype`."""
    target = dtypes.numpy_dtype(dtype)
    limit = max(1, block_bytes // max(tensor.numpy_dtype.itemsize, target.itemsize))
    if region is not None and any(s.stop <= s.start for s in region):
        return
    for box in split_box(region or tuple(slice(0, n) for n in tensor.shape), limit):
        values = tensor.read(box)
        yield values if values.dtype == target else values.astype(target)


TARGETS = ("safetensors", "tensormorph")


def parse_mesh(text: str) -> tuple[int, ...]:
    """'4' -> (4,), '2x2' -> (2, 2)."""
    try:
        mesh = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        mesh = ()
    if not mesh or any(n < 1 for n in mesh):
        raise CheckpointError(f"cannot read mesh {text!r}: use a world size such as 4, or a shape such as 2x2")
    return mesh


def convert(source: str | Path | Checkpoint, destination: str | Path, *, to: str = "safetensors",
            max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES, dtype: str | None = None,
            rename: Sequence[str] | None = None, mesh: int | str | Sequence[int] = 1,
            placements: Sequence[str] = ("Shard(0)",), redundancy: str | None = None,
            block_bytes: int = DEFAULT_BLOCK_BYTES, check: bool = True,
            progress: Callable[[int], None] | None = None, team: Team = ALONE) -> ConvertResult:
    """Write `source` at `destination` in the `to` format and diff it against the source.

    "safetensors": a Hugging Face folder with shards of at most `max_shard_size`; non-tensor entries
    cannot be stored there and are listed in the result's `skipped_objects`. "tensormorph": the folder a
    save on a device mesh of shape `mesh` (a world size, '2x2', or a tuple) with `placements` (one per
    mesh dimension, e.g. ['Shard(0)', 'Replicate()']) would write, one file per rank; a tensor with too
    few dimensions for a Shard(d) is replicated along that mesh dimension. `dtype` casts floating-point
    tensors (integers keep theirs); `redundancy` ("rs(4,2)", "replicate:2") adds parity or copies to a
    tensormorph output, as tensormorph.save does; `rename` rules (as for diff, e.g. 'model.=' to drop a wrapper's
    prefix) give the output names. `team` spreads the writing over processes (ops/spread.py): the files are the
    single-process run's, each written whole by one process, the index (or manifest) last by rank 0.
    """
    if to not in TARGETS:
        raise CheckpointError(f"cannot convert to {to!r}: supported targets are {', '.join(TARGETS)}")
    if isinstance(mesh, int):
        mesh_shape: tuple[int, ...] = (mesh,)
    elif isinstance(mesh, str):
        mesh_shape = parse_mesh(mesh)
    else:
        mesh_shape = tuple(mesh)
    if to == "tensormorph" and len(placements) != len(mesh_shape):
        raise CheckpointError(f"a mesh of shape {list(mesh_shape)} needs {len(mesh_shape)} placement(s), got "
                              f"{list(placements)}")
    with ExitStack() as stack:
        ck = opened(source, stack)
        for tensor in ck.values():  # refused before anything is written
            check_scannable(tensor)
        output: Path | str = _checked_url(os.fspath(destination), to) if is_url(destination) else \
            _checked_destination(destination)
        target = parse_dtype(dtype) if dtype else None
        rules = [parse_rename(r) for r in rename or ()]
        output_names = {original: aligned for aligned, original in aligned_names(list(ck), rules, "a").items()}
        specs = [TensorSpec(output_names[t.name], target if target and dtypes.is_floating(t.dtype) else t.dtype,
                            t.shape) for t in ck.values()]
        source_of = {spec.name: t for spec, t in zip(specs, ck.values())}

        def blocks(spec: TensorSpec, box: tuple[slice, ...] | None = None) -> Iterator[np.ndarray]:
            for block in tensor_blocks(source_of[spec.name], spec.dtype, block_bytes, box):
                yield block
                if progress is not None:
                    progress(block.nbytes)

        if to == "safetensors":
            result = _to_safetensors(ck, output, specs, blocks, max_shard_size, team)
        else:
            result = _to_tensormorph(ck, output, specs, blocks, mesh_shape, tuple(placements), redundancy, team)
        if check:
            result.check = diff(ck, output, cast=target, objects=False, block_bytes=block_bytes,
                                rename=[f"a:{r}" for r in rename or ()], team=team)
        return result


def _checked_url(url: str, to: str) -> str:
    """A URL to convert into: an object store's (HTTP is read-only here), under a prefix holding nothing yet."""
    path = as_path(url, cache=False)
    assert isinstance(path, RemotePath)  # a URL
    if path.remote.is_http:
        raise UnsupportedError(f"convert --to {to} writes to an object store (s3://, gs://, az://, ...) or a local "
                               "folder; HTTP is read-only here", file=url)
    if path.exists():
        raise CheckpointError("destination already holds objects; choose a new prefix", file=url)
    return url


def _checked_destination(destination: str | Path) -> Path:
    """The output folder's path, its parent created: new, or an empty folder (replaced by the finished one); never a
    link, which a conversion would write through."""
    text = os.fspath(destination)
    if "\x00" in text:
        raise CheckpointError("is not a valid path: it holds a NUL byte", file=repr(text))
    path = Path(text)
    if path.is_symlink():
        raise CheckpointError(f"destination is a symbolic link (to {os.readlink(path)}); convert never writes "
                              "through a link: choose a new path", file=text)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CheckpointError("destination exists and is not an empty folder; choose a new path", file=text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CheckpointError(f"cannot write it in {path.parent}, which is a file, not a folder", file=text) from None
    except OSError as exc:  # a file on the way, a read-only file system
        raise CheckpointError(f"cannot create the folder to write it in: {exc.strerror or exc}", file=text) from None
    return path


def _to_safetensors(ck: Checkpoint, destination: Path | str, specs: list[TensorSpec],
                    blocks: Callable[[TensorSpec], Iterator[np.ndarray]], max_shard_size: int | str,
                    team: Team) -> ConvertResult:
    limit = parse_size(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    shards = plan_shards(specs, limit)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    files = [(name, [(spec, blocks(spec)) for spec in shard]) for name, shard in zip(names, shards)]
    index = None
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {spec.name: name for name, shard in zip(names, shards) for spec in shard}}
    if isinstance(destination, str):
        written = _upload_safetensors(destination, files, index, team)
        return ConvertResult(destination, names, len(specs), written, skipped_objects=list(ck.objects))
    # one staging folder for every process: rank 0 names and makes it
    staging = destination.parent / team.each(partial(_staging, destination, team.rank))[0]
    try:
        written = _write_safetensors(staging, files, index, lambda path: None, team)
        team.each(lambda: _move_into_place(staging, destination) if team.rank == 0 else None)
    except BaseException:
        if team.rank == 0:  # every process has stopped writing: each raises only once all have finished a step
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return ConvertResult(destination, names, len(specs), written, skipped_objects=list(ck.objects))


def _staging(destination: Path, rank: int) -> str:
    """Rank 0 makes the folder the output is assembled in, under a new name it returns; other ranks return ''."""
    if rank != 0:
        return ""
    staging = destination.parent / f".{destination.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
    except OSError as exc:  # a folder we may not write in
        raise CheckpointError(f"cannot create the output folder: {exc.strerror or exc}", file=str(destination)) \
            from None
    return staging.name


ShardFiles = list[tuple[str, list[tuple[TensorSpec, Iterator[np.ndarray]]]]]  # file name -> (tensor, its blocks)


def _write_safetensors(folder: Path, files: ShardFiles, index: dict[str, Any] | None,
                       done: Callable[[Path], None], team: Team) -> int:
    """Write every shard (this process: its share of them), then the index (if any; rank 0), into `folder`, calling
    `done` with each file once complete; the bytes of tensor data written by all processes."""
    mine = share(team, {name: sum(spec.nbytes for spec, _ in tensors) for name, tensors in files})

    def write_mine() -> int:
        written = 0
        for name, tensors in files:
            if name in mine:
                written += write_file(folder / name, tensors, {"format": "pt"})
                done(folder / name)
        return written

    written = sum(team.each(write_mine))
    if index is not None:  # once every shard is complete
        team.each(lambda: _write_index(folder, index, done) if team.rank == 0 else None)
    return written


def _write_index(folder: Path, index: dict[str, Any], done: Callable[[Path], None]) -> None:
    with create_new(folder / "model.safetensors.index.json") as f:
        f.write((json.dumps(index, indent=2) + "\n").encode())
    done(folder / "model.safetensors.index.json")


def _upload_safetensors(url: str, files: ShardFiles, index: dict[str, Any] | None, team: Team) -> int:
    """The safetensors folder written at URL `url`: each file uploaded once complete (and then deleted locally, so
    the local disk holds one shard at a time), the index last; on failure each process deletes what it uploaded."""
    path = as_path(url, cache=False)
    assert isinstance(path, RemotePath)  # checked by _checked_url
    fs, uploaded = path.remote.fs, []

    def upload(file: Path) -> None:
        target = path / file.name
        key = path.remote.path(target.url)
        with_retries(lambda: fs.put_file(str(file), key), target.url, attempts=path.remote.attempts)
        uploaded.append(key)
        file.unlink()

    try:
        with tempfile.TemporaryDirectory(prefix="tensormorph-convert-") as folder:
            return _write_safetensors(Path(folder), files, index, upload, team)
    except BaseException:
        for key in reversed(uploaded):  # the index (uploaded last) first: no reader finds a partial folder
            with contextlib.suppress(Exception):
                fs.rm_file(key)
        raise


def _free(destination: Path) -> None:
    """Remove the empty folder at `destination` (checked by _checked_destination), so the output can take its name.
    Whatever appeared there since (a link, files in the folder) makes this fail; it is never written through."""
    try:
        if destination.is_dir() and not destination.is_symlink():
            destination.rmdir()
    except OSError as exc:
        raise CheckpointError(f"cannot replace the empty folder: {exc.strerror or exc}", file=str(destination)) \
            from None


def _move_into_place(staging: Path, destination: Path) -> None:
    _free(destination)
    try:
        os.replace(staging, destination)
    except OSError as exc:  # a link or a file appeared at the name since: rename refuses, never follows it
        raise CheckpointError(f"cannot move the converted folder into place: {exc.strerror or exc}",
                              file=str(destination)) from None


def _fit(placement: str, ndim: int) -> str:
    """`Shard(d)` or `_StridedShard(d, ...)` for a tensor of `ndim` dimensions (negative d counts from the end);
    a tensor without dimension d (or a scalar) is replicated along that mesh dimension instead."""
    spec = parse_spec(placement)
    if spec.dim is None:
        return "Replicate()"
    dim = spec.dim + ndim if spec.dim < 0 else spec.dim
    return str(replace(spec, dim=dim)) if 0 <= dim < ndim else "Replicate()"


def _plain_objects(ck: Checkpoint) -> tuple[dict[str, Any], list[str]]:
    """The checkpoint's plain values (the manifest stores no others), and the names of those skipped."""
    objects, skipped = {}, []
    for name, entry in ck.objects.items():
        try:
            value = entry.value()
        except CheckpointError:
            skipped.append(name)
            continue
        if is_plain(value):
            objects[name] = value
        else:
            skipped.append(name)
    return objects, skipped


def _to_tensormorph(ck: Checkpoint, destination: Path | str, specs: list[TensorSpec],
                    blocks: Callable[..., Iterator[np.ndarray]], mesh: tuple[int, ...],
                    placements: tuple[str, ...], redundancy: str | None, team: Team) -> ConvertResult:
    """Every rank's file of a save on `mesh`, through one SaveTransaction: by this one process in turn, or each
    file by one process of `team` (balanced by bytes), rank 0 preparing and committing."""
    save = SaveTransaction(destination, overwrite=True, redundancy=redundancy,
                           storage_options=remote_defaults().storage_options,
                           extra={"converted_from": {"path": str(ck.path), "format": ck.format}})
    for text in placements:  # the spelling only: dimensions are fitted to each tensor below
        if parse_spec(text).kind == "partial":
            raise CheckpointError(f"placement {text!r}: a conversion writes values, not contributions awaiting a "
                                  "reduction; use Shard(d), _StridedShard(d, split_factor=s) or Replicate()")
    coordinates = list(itertools.product(*(range(n) for n in mesh)))
    pieces: list[list[Piece]] = [[] for _ in coordinates]
    for spec in specs:
        fitted = tuple(_fit(p, len(spec.shape)) for p in placements)
        for rank, coordinate in enumerate(coordinates):
            for (offsets, shape), _ in local_pieces(spec.shape, mesh, fitted, coordinate):
                pieces[rank].append(Piece(spec.name, spec.dtype, spec.shape, offsets, shape, rank, mesh,
                                          tuple(range(len(coordinates))), None, fitted))
    save.plan([p for ps in pieces for p in ps])
    objects, skipped = _plain_objects(ck)
    save.join(team.each(partial(_prepare, save, destination, team.rank))[0])
    chosen = [save.written_by(rank, mine) for rank, mine in enumerate(pieces)]
    mine = share(team, {rank: sum(p.nbytes for p in c) for rank, c in enumerate(chosen)})

    def write(rank: int) -> RankResult:
        return save.write_rank(rank, [
            (p, partial(blocks, TensorSpec(p.name, p.dtype, p.global_shape),
                        tuple(slice(o, o + n) for o, n in zip(p.offsets, p.shape))))
            for p in chosen[rank]], {})

    try:
        results = _by_rank(team.each(lambda: {rank: write(rank) for rank in range(len(chosen)) if rank in mine}))
        sizes = [result.written.size for result in results]
        extras = _by_rank(team.each(lambda: {rank: save.write_redundancy(rank, [r.written for r in results])
                                             for rank in range(len(results)) if rank in mine}))
        manifest = team.each(lambda: save.commit(results, extras, objects) if team.rank == 0 else None)[0]
        assert manifest is not None  # rank 0 committed
    except BaseException:
        if team.rank == 0:  # every process has stopped writing (see _to_safetensors)
            save.remove()
        raise
    return ConvertResult(destination, sorted(manifest.files), len(specs), sum(sizes), skipped_objects=skipped)


def _prepare(save: SaveTransaction, destination: Path | str, rank: int) -> str:
    """Rank 0 takes the destination's name and starts the save, returning the token the others join with."""
    if rank != 0:
        return ""
    if isinstance(destination, Path):
        _free(destination)
    return save.prepare()


def _by_rank(parts: list[dict[int, T]]) -> list[T]:
    """The values of every process's {mesh rank: value}, in mesh rank order."""
    merged = {rank: value for part in parts for rank, value in part.items()}
    return [merged[rank] for rank in range(len(merged))]
