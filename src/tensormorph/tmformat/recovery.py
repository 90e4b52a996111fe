"""Rebuilding a lost or damaged file of a Tensormorph checkpoint from its stripe's parity or a copy.

parity.py is the coder and knows no manifest; this module finds, from the manifest, which files can
rebuild which, and whether enough of them are intact. The file -> group index is built once per manifest, so
checking every damaged file of a wide checkpoint stays linear in its files.
"""

from __future__ import annotations

import queue
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import CheckpointError
from . import parity
from .linear_code import BytesLike
from .manifest import FileRecord, Manifest
from .parity import Decoding, Reader, Scheme, Stripe, copied, decoding, parse_scheme, rebuild, replica_file

MIN_PIECE = 4096  # the least a degraded read decodes per step, however wide the stripe and small the buffer


@dataclass(frozen=True)
class _Group:
    """The files that can rebuild one another: a data file and its copies, or a stripe's data and parity."""

    data: tuple[str, ...]
    parity: tuple[str, ...]  # () for copies

    @property
    def files(self) -> tuple[str, ...]:
        return self.data + self.parity


# by id: a Manifest holds dicts, so it cannot be hashed; an entry goes when its manifest does
_INDEXES: dict[int, tuple[Scheme, dict[str, _Group]]] = {}


def _index(manifest: Manifest) -> tuple[Scheme, dict[str, _Group]]:
    """The scheme, and each data, parity or copy file's group (built on first use)."""
    known = _INDEXES.get(id(manifest))
    if known is not None:
        return known
    plan = manifest.redundancy
    if plan is None:
        raise CheckpointError("the checkpoint was saved without redundancy")
    scheme = parse_scheme(plan.scheme)
    groups: dict[str, _Group] = {}
    if scheme.kind == "replicate":
        for data in manifest.files:
            group = _Group((data, *(replica_file(data, c) for c in range(1, scheme.copies))), ())
            groups.update(dict.fromkeys(group.files, group))
    else:
        for data_files, parity_files in plan.stripes:
            group = _Group(tuple(data_files), tuple(parity_files))
            groups.update(dict.fromkeys(group.files, group))
    _INDEXES[id(manifest)] = scheme, groups
    weakref.finalize(manifest, _INDEXES.pop, id(manifest), None)
    return scheme, groups


def all_files(manifest: Manifest) -> dict[str, FileRecord]:
    """Data files, then parity files and copies."""
    return {**manifest.files, **(manifest.redundancy.files if manifest.redundancy else {})}


def group_of(manifest: Manifest, name: str) -> tuple[str, ...]:
    """The files that can rebuild `name`: its stripe (data and parity), or its copies; () without redundancy."""
    if manifest.redundancy is None:
        return ()
    group = _index(manifest)[1].get(name)
    return group.files if group is not None else ()


def _group(manifest: Manifest, lost: str) -> tuple[Scheme, _Group]:
    try:
        scheme, groups = _index(manifest)
    except CheckpointError:
        raise CheckpointError(f"cannot rebuild {lost}: the checkpoint was saved without redundancy") from None
    group = groups.get(lost)
    if group is None:
        what = "a data file or copy" if scheme.kind == "replicate" else "in any stripe"
        raise CheckpointError(f"cannot rebuild {lost}: it is not {what} of this checkpoint")
    return scheme, group


def recover(manifest: Manifest, lost: str, intact: set[str], read: Reader) -> Iterator[BytesLike]:
    """The bytes of file `lost`, rebuilt from parity or a copy; CheckpointError when beyond the redundancy.

    Segments are read and decoded on several threads ahead of the consumer, holding at most
    parity.CODING_BUFFER bytes (parity.in_order)."""
    scheme, group = _group(manifest, lost)
    plan = manifest.redundancy
    assert plan is not None  # _group refused a manifest without redundancy
    if scheme.kind == "replicate":
        return copied(read, _copy_of(group, lost, intact), all_files(manifest)[lost].size, plan.segment)
    stripe = Stripe(group.data, tuple(manifest.files[d].size for d in group.data), group.parity)
    return rebuild(stripe, scheme.k, scheme.m, lost, intact, read, plan.segment)


def _copy_of(group: _Group, lost: str, intact: set[str]) -> str:
    sources = [n for n in group.data if n != lost and n in intact]
    if not sources:
        raise CheckpointError(f"cannot rebuild {lost}: every copy of {group.data[0]} is damaged or missing")
    return sources[0]


def check_recoverable(manifest: Manifest, name: str, intact: set[str]) -> None:
    """Raise CheckpointError unless `name` can be rebuilt from the intact files."""
    scheme, group = _group(manifest, name)
    if scheme.kind == "replicate":
        if not any(n != name and n in intact for n in group.data):
            raise CheckpointError(f"every copy of {group.data[0]} is damaged or missing")
        return
    alive = sum(1 for f in group.files if f in intact and f != name) + (scheme.k - len(group.data))
    if alive < scheme.k:
        raise CheckpointError(f"only {alive} of its stripe's {scheme.k + scheme.m} files are intact, "
                              f"{scheme.k} are needed")


ReadInto = Callable[[str, int, memoryview], None]  # (file, offset, target): fill target from the file's offset


Slots = queue.LifoQueue  # of list[memoryview] | None: the buffers of the reads decoding at once


def decode_slots() -> Slots:
    """parity.CODING_THREADS slots for the reads that decode at once, each filled with its buffers on first use:
    one set per load, shared by every file it rebuilds, so the load holds at most parity.CODING_BUFFER for them."""
    slots: Slots = queue.LifoQueue()
    for _ in range(parity.CODING_THREADS):
        slots.put(None)
    return slots


class RebuiltRanges:
    """A lost or damaged data file, served range by range: each range read is rebuilt from the same range of k
    other files of its stripe (parity.Decoding), or read from a copy. Nothing is written, a process rebuilds only
    the bytes it reads (a rank of a resharded load, its share), and the reads decoding at once take a slot of
    `slots` each, holding k pieces of at most `piece` bytes: within parity.CODING_BUFFER whatever the file's size."""

    def __init__(self, name: str, size: int, read_into: ReadInto, *, plan: Decoding | None = None,
                 copy: str | None = None, segment: int = parity.SEGMENT, slots: Slots | None = None):
        self.name, self.size, self._read_into, self._plan, self._copy = name, size, read_into, plan, copy
        k = len(plan.sources) if plan is not None else 0
        self._piece = max(MIN_PIECE, min(segment, parity.CODING_BUFFER // (parity.CODING_THREADS * (k + 1))))
        self._slots = slots if slots is not None else decode_slots()

    def read_runs(self, runs: Sequence[tuple[int, int]], into: memoryview) -> None:
        """Bytes of each [begin, end) run, one after another into `into`."""
        position = 0
        for begin, end in runs:
            if not 0 <= begin <= end <= self.size:
                raise CheckpointError(f"bytes [{begin}, {end}) are outside the {self.size} bytes it has",
                                      file=f"{self.name} (rebuilt)")
            target = into[position:position + end - begin]
            if self._copy is not None:
                self._read_into(self._copy, begin, target)
            else:
                self._decode(begin, end, target)
            position += end - begin

    def read_ranges(self, runs: Sequence[tuple[int, int]]) -> list[bytes]:
        out = []
        for begin, end in runs:
            buffer = bytearray(end - begin)
            self.read_runs([(begin, end)], memoryview(buffer))
            out.append(bytes(buffer))
        return out

    def _decode(self, begin: int, end: int, target: memoryview) -> None:
        plan = self._plan
        assert plan is not None, "a file without a copy has a decoding plan"
        held = self._slots.get()  # waits while CODING_THREADS reads are decoding
        try:
            if held is None or len(held) != len(plan.sources) or len(held[0]) != self._piece:
                held = [memoryview(bytearray(self._piece)) for _ in plan.sources]
            for first in range(begin, end, self._piece):
                last = min(end, first + self._piece)
                blocks = [buffer[:last - first] for buffer in held]
                for (name, size), block in zip(plan.sources, blocks):
                    have = max(0, min(last, size) - first)  # past a file's end (or in a virtual one): zeros
                    if name is not None and have:
                        self._read_into(name, first, block[:have])
                    if have < len(block):
                        np.frombuffer(block, np.uint8)[have:] = 0
                plan.code.apply_into(blocks, target[first - begin:last - begin])
        finally:
            self._slots.put(held)


def rebuilt_ranges(manifest: Manifest, lost: str, available: set[str], read_into: ReadInto,
                   slots: Slots | None = None) -> RebuiltRanges:
    """`lost` served by rebuilding the ranges read (RebuiltRanges, decoding in `slots`) from the available files of
    its group; CheckpointError when they are beyond the redundancy."""
    scheme, group = _group(manifest, lost)
    plan = manifest.redundancy
    assert plan is not None  # _group refused a manifest without redundancy
    size = all_files(manifest)[lost].size
    if scheme.kind == "replicate":
        return RebuiltRanges(lost, size, read_into, copy=_copy_of(group, lost, available))
    stripe = Stripe(group.data, tuple(manifest.files[d].size for d in group.data), group.parity)
    return RebuiltRanges(lost, size, read_into, plan=decoding(stripe, scheme.k, scheme.m, lost, available),
                         segment=plan.segment, slots=slots)
