"""The peer tier: a copy of each rank's memory snapshot in the memory of a rank on another node, so that losing
a whole node loses no step.

Buddies: nodes are ordered by name; the i-th rank of a node sends its snapshots to the (i mod n)-th of the n
ranks of the next node, so every node's snapshots live on one other node and the loss of any single node
leaves a copy of each. With one node there is no buddy and the tier does nothing. Copies travel over a gloo
group of the Checkpointer's own, as the snapshot's files (its manifest and rank file, checked again by their
checksums when loaded), and are stored under the holder's rank folder:

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

import torch
import torch.distributed as dist

from ..distributed.collective import Collective
from ..storage import create_new
from .memory import HELD, MemoryTier, committed

__all__ = ["PeerTier", "buddies"]


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
        received = self._transfer({self.buddy: _pack(snapshot)} if self.buddy is not None else {}, self.senders)
        for origin, payload in received.items():
            held = self.memory.folder / f"peer-{origin:05d}"
            _unpack(payload, held / f"step-{step:08d}")
            for old in sorted(held.glob("step-*"))[:-self.memory.keep]:
                shutil.rmtree(old, ignore_errors=True)

    def held(self) -> dict[int, list[int]]:
        """The steps of the copies this rank holds, by the rank they belong to."""
        out: dict[int, list[int]] = {}
        for folder in self.memory.folder.iterdir():
            match = HELD.match(folder.name)
            if match and folder.is_dir():
                out[int(match.group(1))] = [s.step for s in committed(folder)]
        return out

    def pack(self, plan: list[tuple[int, int, int]]) -> dict[int, bytes]:
        """The copies this rank must give back under `plan` (holder, origin, step), by origin, read from memory."""
        return {origin: _pack(self.memory.folder / f"peer-{origin:05d}" / f"step-{step:08d}")
                for holder, origin, step in plan if holder == self.rank}

    def deliver(self, plan: list[tuple[int, int, int]], outgoing: dict[int, bytes]) -> None:
        """Carry out `plan` on every rank: holders send the copies `pack` read, each origin stores its copy as its
        own snapshot, where the memory tier then loads it."""
        incoming = [holder for holder, origin, _ in plan if origin == self.rank]
        for payload in self._transfer(outgoing, incoming).values():
            step = next(s for _, origin, s in plan if origin == self.rank)
            _unpack(payload, self.memory.folder / f"step-{step:08d}")

    def _transfer(self, outgoing: dict[int, bytes], sources: list[int]) -> dict[int, bytes]:
        """Point-to-point: send each payload to its rank and receive one from each source (sizes first)."""
        group = self.collective.group
        if not self.collective.distributed:
            return {}
        sizes = {s: torch.zeros(1, dtype=torch.int64) for s in sources}
        _wait([*(dist.isend(torch.tensor([len(p)], dtype=torch.int64), _global(group, d), group=group)
                 for d, p in outgoing.items()),
               *(dist.irecv(t, _global(group, s), group=group) for s, t in sizes.items())])
        buffers = {s: torch.empty(int(t.item()), dtype=torch.uint8) for s, t in sizes.items()}
        _wait([*(dist.isend(torch.frombuffer(bytearray(p), dtype=torch.uint8), _global(group, d), group=group)
                 for d, p in outgoing.items() if p),
               *(dist.irecv(t, _global(group, s), group=group) for s, t in buffers.items() if t.numel())])
        return {s: t.numpy().tobytes() for s, t in buffers.items()}


def _global(group: object, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank  # type: ignore[arg-type]


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _pack(snapshot: Path) -> bytes:
    """A snapshot folder's files as one payload: a JSON table of names and sizes, then the bytes."""
    files = sorted(p for p in snapshot.iterdir() if p.is_file())
    table = json.dumps([[p.name, p.stat().st_size] for p in files]).encode()
    return len(table).to_bytes(8, "little") + table + b"".join(p.read_bytes() for p in files)


def _unpack(payload: bytes, destination: Path) -> None:
    """Write a payload's files as the folder `destination`, atomically (a temporary folder renamed)."""
    size = int.from_bytes(payload[:8], "little")
    table = json.loads(payload[8:8 + size])
    temporary = destination.parent / f".tmp-peer-{uuid.uuid4().hex[:8]}"
    temporary.mkdir(parents=True)
    position = 8 + size
    for name, length in table:
        if "/" in name or name.startswith("."):  # only a snapshot's own file names, from our own ranks
            raise ValueError(f"unexpected file name {name!r} in a peer snapshot")
        with create_new(temporary / name) as handle:
            handle.write(payload[position:position + length])
            os.fsync(handle.fileno())
        position += length
    if destination.exists():
        shutil.rmtree(destination)
    os.replace(temporary, destination)
