"""Writing the Tensormorph format, independent of torch: one `SaveTransaction`, prepare -> write -> commit.

The distributed save (`tensormorph.save`) and the offline resharder
(`convert --to tensormorph`) both describe what each rank holds as `Piece`s
and go through a SaveTransaction: `plan_writers` picks one writer per
distinct box, each rank streams its chunks into one safetensors file
(`write_rank_file`), writes its share of parity or copies, and the committing
process assembles the manifest (`build_manifest`) and commits it (commit.py).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from .. import dtypes
from ..core import Chunk
from ..errors import CheckpointError, ChunkLayoutError, HeaderError
from ..tiling import LayoutOnly, validate_tiling
from ..version import __version__
from .checksums import CHECKSUM_BLOCK, crc32c_combine
from .commit import LocalDestination, destination, store
from .layout import assign_writers
from .manifest import ChunkRecord, FileRecord, Manifest, Redundancy, TensorRecord, rank_file
from .parity import SEGMENT, Extras, Scheme, parity_writer, parse_scheme, stripes, write_extras
from .stream import OutputFile, TensorSpec, Written, write_stream

SHARDING_KEY = "DCP_SHARDING_INFO"  # DCP's HuggingFaceStorageReader reads each chunk's offsets from here

Key = tuple[str, tuple[int, ...], tuple[int, ...], int]  # (tensor, offsets, shape, contribution)


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one tensor (metadata only; sent between ranks)."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    rank: int
    mesh: tuple[int, ...] | None = None
    mesh_ranks: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None
    placements: tuple[str, ...] | None = None
    contribution: int = 0  # under Partial placements: which contribution this rank's box is part of

    @property
    def key(self) -> Key:
        return self.name, self.offsets, self.shape, self.contribution

    def fields(self) -> tuple[Any, ...]:
        """Every field in order, as a plain tuple (Piece(*fields) makes it again): what ranks exchange."""
        return (self.name, self.dtype, self.global_shape, self.offsets, self.shape, self.rank, self.mesh,
                self.mesh_ranks, self.mesh_dim_names, self.placements, self.contribution)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


def plan_writers(pieces: Iterable[Piece]) -> dict[Key, int]:
    """One writer rank for every distinct non-empty box (replicas are written once, balanced by bytes).

    Also checks that all ranks agree on each tensor's dtype and global shape and that the boxes tile it (each
    contribution's, under Partial placements).
    """
    holders: dict[Key, tuple[int, list[int]]] = {}
    first: dict[str, Piece] = {}
    contributions: dict[str, set[int]] = {}
    for piece in pieces:
        seen = first.setdefault(piece.name, piece)
        if (seen.dtype, seen.global_shape) != (piece.dtype, piece.global_shape):
            raise HeaderError(f"rank {seen.rank} holds it as {seen.dtype} {list(seen.global_shape)}, rank "
                              f"{piece.rank} as {piece.dtype} {list(piece.global_shape)}: every rank must agree",
                              tensor=piece.name)
        contributions.setdefault(piece.name, set()).add(piece.contribution)
        if math.prod(piece.shape) == 0:
            continue
        holders.setdefault(piece.key, (piece.nbytes, []))[1].append(piece.rank)
    by_tensor: dict[tuple[str, int], list[Chunk]] = {}
    for name, offsets, shape, contribution in holders:
        by_tensor.setdefault((name, contribution), []).append(Chunk(offsets, shape, None, None, source=LayoutOnly()))
    tiled: set[tuple[Any, ...]] = set()  # layouts found to tile: 20,000 tensors of a few shapes are a few checks
    for name, piece in first.items():
        for contribution in sorted(contributions[name]):
            chunks = by_tensor.get((name, contribution), [])
            kind = (piece.global_shape, tuple(sorted((c.offsets, c.shape) for c in chunks)))
            if kind in tiled:
                continue
            try:
                validate_tiling(name, piece.global_shape, chunks)
                tiled.add(kind)
            except ChunkLayoutError as exc:
                which = f"contribution {contribution}: " if contribution or len(contributions[name]) > 1 else ""
                raise ChunkLayoutError(f"the ranks' shards do not tile the tensor: {which}{exc.reason}",
                                       tensor=name) from None
    return assign_writers(holders)


def write_rank_file(f: OutputFile, rank: int,
                    chunks: Sequence[tuple[Piece, Callable[[], Iterable[np.ndarray]]]]) -> Written:
    """Stream one rank's chunks into a safetensors file (an open binary file object).

    Each chunk is stored under its tensor's name with its global offsets in DCP_SHARDING_INFO,
    so the file is also a DCP sharded-safetensors file.
    """
    names, info = [], {}
    taken = {piece.name for piece, _ in chunks}
    for piece, _ in chunks:  # a rank's further boxes of one tensor (_StridedShard) are named by their offsets
        name = piece.name
        if name in info:
            name = base = f"{piece.name}@{','.join(map(str, piece.offsets))}"
            suffix = 1
            while name in taken or name in info:  # another tensor may be called that: never a repeated key
                name, suffix = f"{base}~{suffix}", suffix + 1
        names.append(name)
        info[name] = {"saved_offsets": list(piece.offsets)}
    metadata = {"format": "pt", SHARDING_KEY: json.dumps(info, separators=(",", ":")), "tensormorph_rank": str(rank)}
    return write_stream(f, [(TensorSpec(name, p.dtype, p.shape), blocks()) for name, (p, blocks) in zip(names, chunks)],
                        metadata, checksum_block=CHECKSUM_BLOCK)


def build_manifest(pieces: Iterable[Piece], writers: dict[Key, int], written: dict[int, tuple[list[Key], Written]],
                   objects: dict, world_size: int, extra: dict | None = None, prefix: str = "") -> Manifest:
    """The manifest of a save, from every rank's pieces, the writer choice and what each writer wrote."""
    stored: dict[Key, ChunkRecord] = {}
    files: dict[str, FileRecord] = {}
    holders: dict[Key, list[int]] = {}
    by_name: dict[str, Piece] = {}
    for piece in pieces:
        by_name.setdefault(piece.name, piece)
        holders.setdefault(piece.key, []).append(piece.rank)
    for rank, (keys, result) in written.items():
        name = prefix + rank_file(rank)
        files[name] = FileRecord(result.size, result.crc32c, rank)
        for key, byte_range, crcs in zip(keys, result.ranges, result.block_crc32c):
            stored[key] = ChunkRecord(name, key[1], key[2], byte_range, np.asarray(crcs, dtype=np.uint32), rank,
                                      tuple(sorted(holders[key])), key[3])
    missing = [key for key in writers if key not in stored]
    if missing:
        raise HeaderError(f"{len(missing)} chunks were planned but not written, e.g. {missing[0]}")
    chunks_of: dict[str, list[ChunkRecord]] = {}
    for key, chunk in stored.items():
        chunks_of.setdefault(key[0], []).append(chunk)
    tensors = {}
    for name, piece in by_name.items():
        chunks = tuple(sorted(chunks_of.get(name, []), key=lambda c: (c.contribution, c.offsets)))
        tensors[name] = TensorRecord(piece.dtype, piece.global_shape, chunks, piece.mesh, piece.mesh_ranks,
                                     piece.mesh_dim_names, piece.placements)
    writer = {"tensormorph": __version__, "python": platform.python_version(), "host": platform.node()}
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Manifest(tensors, objects, files, world_size, writer, created, extra or {})


def redundancy_record(scheme: Scheme, data_files: dict[str, FileRecord], extras: Sequence[Extras],
                      prefix: str = "") -> Redundancy:
    """The manifest's redundancy section from every rank's written parity files or copies: each file's parts,
    which must cover it end to end, give its size and CRC-32C (crc32c_combine, no file read again)."""
    parts: dict[str, list[tuple[int, int, int, int]]] = {}
    for rank, done in enumerate(extras):
        for name, (offset, length, crc) in done.items():
            parts.setdefault(name, []).append((offset, length, crc, rank))
    ordered = sorted((name, record.size) for name, record in data_files.items())
    all_stripes = stripes(ordered, scheme.k, scheme.m, prefix) if scheme.kind == "rs" else []
    owners = {name: (parity_writer(s, j, scheme.k, len(extras)), stripe.length)
              for s, stripe in enumerate(all_stripes) for j, name in enumerate(stripe.parity)}
    files = {}
    for name, pieces in parts.items():
        pieces.sort()
        size = crc = 0
        for offset, length, part_crc, _ in pieces:
            if offset > size:
                raise CheckpointError(f"the parts of {name} written by the ranks leave bytes [{size}, {offset}) "
                                      "unwritten")
            if offset < size:
                raise CheckpointError(f"the parts of {name} written by the ranks overlap at [{offset}, {size})")
            crc, size = crc32c_combine(crc, part_crc, length), size + length
        owner, length = owners.get(name, (pieces[0][3], size))
        if size != length:
            raise CheckpointError(f"the ranks wrote {size} bytes of {name}, its stripe is {length} bytes long")
        files[name] = FileRecord(size, crc, owner)
    if missing := sorted(set(owners) - set(files)):
        raise CheckpointError(f"no rank wrote the parity files {', '.join(missing)}")
    return Redundancy(str(scheme), SEGMENT, files, tuple((s.data, s.parity) for s in all_stripes))


Blocks = Callable[[], Iterable[np.ndarray]]  # a chunk's data, produced in C-order blocks when its turn comes


@dataclass(frozen=True)
class RankResult:
    """What one rank wrote: its boxes, in file order, the file's sizes and checksums, and its plain values."""

    keys: list[Key]
    written: Written
    objects: dict[str, Any]


class SaveTransaction:
    """One save, by one process or by every rank of a group: plan, prepare, write, then commit or abort.

    The committing process (rank 0) calls `prepare`, every other one `join`s with the token it returns.
    Each rank writes its own file (`write_rank`) and then its share of parity or copies
    (`write_redundancy`); the committing process `commit`s every rank's results. Nothing is visible
    under the final name until the commit; after a failure, `abort` (or `remove`) gives the folder up.
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False,
                 storage_options: dict[str, Any] | None = None, redundancy: str | None = None,
                 extra: dict[str, Any] | None = None):
        self.redundancy = redundancy
        self.scheme = parse_scheme(redundancy) if redundancy else None  # a bad spelling fails before any write
        self.target = destination(path, overwrite=overwrite, storage_options=storage_options)
        self.extra = extra
        self.pieces: list[Piece] = []
        self.writers: dict[Key, int] = {}

    def plan(self, everyone: list[Piece]) -> None:
        """Every rank's pieces; chooses the writer of each box (the same answer on every rank)."""
        self.writers = plan_writers(everyone)
        self.pieces = everyone

    def prepare(self) -> str:
        return self.target.prepare()

    def join(self, token: str) -> None:
        self.target.join(token)

    def written_by(self, rank: int, pieces: Iterable[Piece]) -> list[Piece]:
        """The pieces among `pieces` that `rank` was chosen to write."""
        return [p for p in pieces if self.writers.get(p.key) == rank]

    def write_rank(self, rank: int, chunks: Sequence[tuple[Piece, Blocks]], objects: dict[str, Any]) -> RankResult:
        f = self.target.open(self.target.file_prefix + rank_file(rank))
        try:
            written = write_rank_file(f, rank, chunks)
        finally:
            self.target.finish_file(f)
        return RankResult([piece.key for piece, _ in chunks], written, objects)

    def write_redundancy(self, rank: int, written: Sequence[Written]) -> Extras:
        """This rank's parity files or copies, computed from every rank's data file (`written` in rank order)."""
        if self.scheme is None:
            return {}
        data_files = [(self.target.file_prefix + rank_file(r), w.size, w.crc32c) for r, w in enumerate(written)]
        in_place = self.target if isinstance(self.target, LocalDestination) else None
        try:
            return write_extras(self.scheme, data_files, rank, len(written), self.target.read_range,
                                partial(store, self.target), prefix=self.target.file_prefix, in_place=in_place)
        finally:
            if in_place is not None:
                in_place.release_maps()

    def commit(self, results: Sequence[RankResult], extras: Sequence[Extras], objects: dict[str, Any]) -> Manifest:
        written = {rank: (result.keys, result.written) for rank, result in enumerate(results)}
        prefix = self.target.file_prefix
        manifest = build_manifest(self.pieces, self.writers, written, objects, len(results), self.extra, prefix)
        if self.scheme is not None:
            manifest = replace(manifest, redundancy=redundancy_record(self.scheme, manifest.files, extras, prefix))
        self.target.commit(manifest.to_bytes())
        return manifest

    def abort(self) -> None:
        self.target.abort()

    def remove(self) -> None:
        self.target.remove()
