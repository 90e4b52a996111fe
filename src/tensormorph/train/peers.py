"""The peer tier: a copy of each rank's memory snapshot in the memory of a rank on another node, so that losing
a whole node loses no step.

Buddies: nodes are ordered by name; the i-th rank of a node sends its snapshots to the (i mod n)-th of the n
ranks of the next node, so every node's snapshots live on one other node and the loss of any single node
leaves a copy of each. With one node there is no buddy and the tier does nothing. Copies travel over a gloo
group of the Checkpointer's own, as the snapshot's files (its manifest and rank file, checked again by their
checksums when loaded) in pieces of bounded size, and are stored under the holder's rank folder:

    <memory_dir>/<run id>/<node>/rank-00002/peer-00000/step-00000120/

At resume, a rank without its own snapshot of the chosen step gets it back from whoever holds a copy, writes it
into its own memory folder, and loads it from there.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..distributed.collective import Collective
from ..errors import CheckpointError
from ..storage import create_new
from ..tmformat.commit import discard_folder
from ..tmformat.manifest import MANIFEST
from .memory import HELD, MemoryTier, committed

__all__ = ["PeerTier", "buddies"]

PEER_PIECE = 64 << 20  # bytes a copy sends or receives at once per peer: its memory beyond the snapshot's own
MAX_TABLE_BYTES = 1 << 20  # a snapshot's file table (a few names and sizes) announced by a peer


def buddies(nodes: list[str]) -> list[int | None]:
    """Each rank's buddy (the rank that holds copies of its snapshots) given every rank's node; None when all
    ranks share one node."""
    order = sorted(set(nodes))
    if len(order) < 2:
        return [None] * len(nodes)
    members = {node: [r for r, n in enumerate(nodes) if n == node] for node in order}
    out: list[int | None] = []
    for rank, node in enumerate(nodes):
        index = members[node].index(rank)
        following = members[order[(order.index(node) + 1) % len(order)]]
        out.append(following[index % len(following)])
    return out


class PeerTier:
    """Sends this rank's snapshots to its buddy, holds copies of the ranks whose buddy it is, and gives them back."""

    def __init__(self, memory: MemoryTier, collective: Collective, nodes: list[str]) -> None:
        self.memory = memory
        self.collective = collective
        self.rank = collective.rank
        self.buddy_of = buddies(nodes)
        self.buddy = self.buddy_of[self.rank]
        self.senders = [r for r, b in enumerate(self.buddy_of) if b == self.rank]
        for leftover in [*memory.folder.glob(".tmp-peer-*"), *memory.folder.glob("peer-*/.tmp-peer-*")]:
            shutil.rmtree(leftover, ignore_errors=True)  # a copy whose receiver was killed mid-way

    @property
    def active(self) -> bool:
        return self.buddy is not None

    def exchange(self, snapshot: Path) -> None:
        """Send this rank's new snapshot to its buddy and store the ones sent to it (every rank, same step)."""
        if not self.active:
            return
        step = int(snapshot.name.split("-")[1])
        holds = {origin: self.memory.folder / f"peer-{origin:05d}" for origin in self.senders}
        self._transfer({self.buddy: snapshot} if self.buddy is not None else {},
                       {origin: held / f"step-{step:08d}" for origin, held in holds.items()})
        for held in holds.values():
            for old in committed(held)[:-self.memory.keep]:
                discard_folder(old.path)

    def held(self) -> dict[int, list[int]]:
        """The steps of the copies this rank holds, by the rank they belong to."""
        out: dict[int, list[int]] = {}
        for folder in self.memory.folder.iterdir():
            match = HELD.match(folder.name)
            if match and folder.is_dir():
                out[int(match.group(1))] = [s.step for s in committed(folder)]
        return out

    def pack(self, plan: list[tuple[int, int, int]]) -> dict[int, Path]:
        """The copies this rank must give back under `plan` (holder, origin, step), by origin; a copy that is not
        there (whole) raises here, before anything is sent."""
        out = {}
        for holder, origin, step in plan:
            if holder == self.rank:
                copy = self.memory.folder / f"peer-{origin:05d}" / f"step-{step:08d}"
                if not (copy / MANIFEST).is_file():
                    raise CheckpointError(f"rank {self.rank} no longer holds rank {origin}'s copy of step {step}",
                                          file=str(copy))
                out[origin] = copy
        return out

    def deliver(self, plan: list[tuple[int, int, int]], outgoing: dict[int, Path]) -> None:
        """Carry out `plan` on every rank: holders send the copies `pack` found, each origin stores its copy as its
        own snapshot, where the memory tier then loads it."""
        incoming = {holder: self.memory.folder / f"step-{step:08d}" for holder, origin, step in plan
                    if origin == self.rank}
        self._transfer(outgoing, incoming)

    def _transfer(self, outgoing: dict[int, Path], incoming: dict[int, Path]) -> None:
        """Point-to-point: send each snapshot folder of `outgoing` to its rank, and receive one from each rank of
        `incoming` as the folder named there (atomically). Each file goes in pieces of at most PEER_PIECE bytes, so
        a copy needs one piece of memory per peer, not the snapshot's size. A receiver that cannot write goes on
        receiving (its senders would otherwise wait forever) and raises at the end."""
        group = self.collective.group
        if not self.collective.distributed:
            return
        announced = {d: _table(folder) for d, folder in outgoing.items()}  # what is sent is what was announced
        tables = _exchange_tables(group, announced, list(incoming))
        sending = {d: _pieces(table) for d, table in announced.items()}
        unread: OSError | CheckpointError | None = None  # a piece this rank could not read: sent as zeros
        receiving = {s: _pieces(table) for s, table in tables.items()}
        send_buffers = {d: torch.empty(PEER_PIECE, dtype=torch.uint8) for d in outgoing}
        receive_buffers = {s: torch.empty(PEER_PIECE, dtype=torch.uint8) for s in incoming}
        writers = {s: _Receiver(folder, tables[s]) for s, folder in incoming.items()}
        try:
            for piece in range(max(map(len, [*sending.values(), *receiving.values()]), default=0)):
                requests = []
                for d, pieces in sending.items():
                    if piece < len(pieces):
                        name, offset, size = pieces[piece]
                        view = send_buffers[d][:size]
                        try:
                            _read_into(outgoing[d] / name, offset, view.numpy())
                        except (OSError, CheckpointError) as exc:  # the receiver must not wait in vain; the
                            view.zero_()                            # copy's checksums reject the zeros
                            unread = unread or exc
                        requests.append(dist.isend(view, _global(group, d), group=group))
                posted = [(s, pieces[piece]) for s, pieces in receiving.items() if piece < len(pieces)]
                requests += [dist.irecv(receive_buffers[s][:size], _global(group, s), group=group)
                             for s, (_, _, size) in posted]
                _wait(requests)
                for s, (name, offset, size) in posted:
                    writers[s].write(name, offset, receive_buffers[s][:size].numpy())
            for writer in writers.values():
                writer.finish()
            if unread is not None:
                raise CheckpointError(f"a snapshot file could not be read while it was sent to a peer ({unread})")
        finally:
            for writer in writers.values():
                writer.abandon()


def _global(group: object, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank  # type: ignore[arg-type]


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _table(snapshot: Path) -> list[tuple[str, int]]:
    """A snapshot folder's files: names and sizes."""
    return [(p.name, p.stat().st_size) for p in sorted(snapshot.iterdir()) if p.is_file()]


def _pieces(table: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(file, offset, size) of each piece a table's files travel in, in order."""
    return [(name, offset, min(PEER_PIECE, size - offset)) for name, size in table
            for offset in range(0, size, PEER_PIECE)]


def _exchange_tables(group: Any, outgoing: dict[int, list[tuple[str, int]]],
                     sources: list[int]) -> dict[int, list[tuple[str, int]]]:
    """Send each destination its table and receive each source's (length first, then the JSON)."""
    encoded = {d: json.dumps(t).encode() for d, t in outgoing.items()}
    lengths = {s: torch.zeros(1, dtype=torch.int64) for s in sources}
    _wait([*(dist.isend(torch.tensor([len(e)], dtype=torch.int64), _global(group, d), group=group)
             for d, e in encoded.items()),
           *(dist.irecv(t, _global(group, s), group=group) for s, t in lengths.items())])
    if any(not 0 < int(t.item()) <= MAX_TABLE_BYTES for t in lengths.values()):
        raise CheckpointError(f"a peer announced a file table outside 1..{MAX_TABLE_BYTES} bytes")
    buffers = {s: torch.empty(int(t.item()), dtype=torch.uint8) for s, t in lengths.items()}
    _wait([*(dist.isend(torch.frombuffer(bytearray(e), dtype=torch.uint8), _global(group, d), group=group)
             for d, e in encoded.items()),
           *(dist.irecv(t, _global(group, s), group=group) for s, t in buffers.items())])
    tables = {s: [(str(name), int(size)) for name, size in json.loads(t.numpy().tobytes())]
              for s, t in buffers.items()}
    for table in tables.values():
        for name, size in table:
            if "/" in name or name.startswith(".") or size < 0:  # only a snapshot's own files, from our own ranks
                raise CheckpointError(f"unexpected file {name!r} of {size} bytes in a peer's snapshot")
    return tables


def _read_into(path: Path, offset: int, out: np.ndarray) -> None:
    with open(path, "rb") as handle:
        handle.seek(offset)
        if handle.readinto(out.data) != len(out):
            raise CheckpointError(f"shorter than its size when sent to a peer (at byte {offset})", file=str(path))


class _Receiver:
    """One incoming snapshot: written into a temporary folder, renamed to its name once whole."""

    def __init__(self, destination: Path, table: list[tuple[str, int]]) -> None:
        self.destination = destination
        self.temporary = destination.parent / f".tmp-peer-{uuid.uuid4().hex[:8]}"
        self.error: BaseException | None = None
        self.handles: dict[str, Any] = {}
        try:
            self.temporary.mkdir(parents=True)
            for name, _ in table:  # one at a time: those opened before a failure are closed by `abandon`
                self.handles[name] = create_new(self.temporary / name)
        except OSError as exc:
            self.error = exc

    def write(self, name: str, offset: int, data: np.ndarray) -> None:
        if self.error is not None:
            return  # received and dropped: the sender must not be left waiting
        try:
            handle = self.handles[name]
            handle.seek(offset)
            handle.write(data.data)
        except OSError as exc:
            self.error = exc

    def finish(self) -> None:
        if self.error is not None:
            raise CheckpointError(f"a copy from a peer could not be written ({self.error})", file=str(self.destination))
        for handle in self.handles.values():
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        if self.destination.exists():
            discard_folder(self.destination)
        os.replace(self.temporary, self.destination)

    def abandon(self) -> None:
        """After `finish`, nothing; otherwise close and delete the partial copy."""
        for handle in self.handles.values():
            handle.close()
        shutil.rmtree(self.temporary, ignore_errors=True)
