"""`tensormorph.save`: every rank writes the boxes it was chosen for, in parallel; rank 0 commits.

All collective steps go through `Collective`, so a failure on any rank reaches every rank and none is
left waiting: a failed save raises the same CheckpointError everywhere and commits nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError
from ..gc_pause import gc_paused
from ..tmformat.manifest import decode_value, encode_value
from ..tmformat.writer import Blocks, Piece, RankResult, SaveTransaction
from ..torch_arrays import as_numpy, cpu_contiguous, vocabulary
from .collective import Collective, failures
from .state import Memo, dtensor_types, flatten, held_pieces


@dataclass(frozen=True)
class SaveReport:
    path: str
    rank: int
    world_size: int
    bytes_written: int  # by this rank
    seconds: float


def save(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: Any = None,
         overwrite: bool = False, storage_options: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
         redundancy: str | None = None) -> SaveReport:
    """Save a (nested) state dict of tensors, DTensors and plain values as a Tensormorph checkpoint.

    Call it on every rank. Each distinct box is written once, by the least-loaded rank holding it;
    the checkpoint appears under `path` only after every rank's file is durable and the manifest is
    committed. `path` may be a local folder or an fsspec URL (s3://bucket/prefix ...).
    `redundancy="rs(4,2)"` adds Reed-Solomon parity over stripes of 4 rank files (any 2 of each 6
    may be lost); `"replicate:2"` stores a second copy of each rank's file, written by a peer rank.
    """
    with gc_paused():  # tens of thousands of records, no cycles among them: the collector would rescan them
        return _save(state_dict, path, process_group, overwrite, storage_options, extra, redundancy)


def _save(state_dict: dict[str, Any], path: str | os.PathLike[str], process_group: Any, overwrite: bool,
          storage_options: dict[str, Any] | None, extra: dict[str, Any] | None, redundancy: str | None) -> SaveReport:
    started = time.perf_counter()
    group = Collective(process_group)
    # every rank makes its own transaction; a rank that cannot (a bad redundancy spelling, an unreachable
    # object store) must not leave the others waiting in the next collective
    made = group.run(lambda: SaveTransaction(path, overwrite=overwrite, storage_options=storage_options,
                                             redundancy=redundancy, extra=extra))
    refused = [error for error in group.gather(made.error) if error is not None]
    if refused:
        raise CheckpointError(f"save failed before writing: {refused[0]}", file=os.fspath(path))
    save = made.unwrap()
    leaves = flatten(state_dict)
    dtensor = dtensor_types()
    pieces, local_data = [], {}
    memo: Memo = {}
    with torch.no_grad():  # DTensor.to_local is then a plain attribute read, not an autograd call per tensor
        for name, tensor in leaves.tensors.items():
            held, layout = held_pieces(name, tensor, dtensor, memo)
            for part in held:
                piece = Piece(name, vocabulary(tensor.dtype), tuple(tensor.shape), part.box[0], part.box[1],
                              group.rank, layout.mesh, layout.mesh_ranks, layout.mesh_dim_names, layout.placements,
                              part.contribution)
                pieces.append(piece)
                local_data[piece.key] = part.data
    # sent as plain tuples: pickling 20,000 dataclass instances per rank costs seconds, tuples a fraction of that
    everyone = [Piece(*fields) for ps in group.gather([p.fields() for p in pieces]) for fields in ps]

    # rank 0 plans and prepares the destination; the others learn its token, or its error
    def prepare() -> str:
        save.plan(everyone)
        return save.prepare()

    token = group.decide(prepare, "save failed before writing", path)
    if group.rank != 0:
        save.plan(everyone)  # the same inputs as rank 0's, which succeeded

    def write() -> RankResult:
        save.join(token)
        # plain values are checked here, on their own rank, so a bad one fails every rank cleanly
        objects = {name: encode_value(value, name) for name, value in leaves.objects.items()}
        mine = save.written_by(group.rank, pieces)
        return save.write_rank(group.rank, [(p, _blocks(local_data[p.key], p.dtype)) for p in mine], objects)

    results = group.everyone(write, label=f"rank {group.rank}: ")
    errors = failures(results)
    extras = []
    if save.scheme is not None and not errors:
        extras = group.everyone(lambda: save.write_redundancy(group.rank, [r.unwrap().written for r in results]),
                                label=f"rank {group.rank} writing redundancy: ")
        errors += failures(extras)

    if errors:  # every rank holds the same outcomes: all refuse together, no collective needed
        save.abort()
        raise CheckpointError(f"save did not commit: {'; '.join(errors)}", file=os.fspath(path))

    def commit() -> None:
        merged: dict[str, Any] = {}
        for result in reversed(results):  # the lowest rank's value wins for names several ranks hold
            merged.update({name: decode_value(value) for name, value in result.unwrap().objects.items()})
        save.commit([r.unwrap() for r in results], [e.unwrap() for e in extras], merged)

    try:
        group.decide(commit, "save did not commit", path)
    except CheckpointError:
        save.abort()
        raise
    written = results[group.rank].unwrap().written.size
    return SaveReport(save.target.describe(), group.rank, group.world, written, time.perf_counter() - started)


def _blocks(tensor: torch.Tensor, dtype: str) -> Blocks:
    def blocks() -> Iterable[np.ndarray]:
        yield as_numpy(cpu_contiguous(tensor), dtype).reshape(-1)
    return blocks
