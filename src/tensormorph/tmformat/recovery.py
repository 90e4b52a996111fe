"""Rebuilding a lost or damaged file of a Tensormorph checkpoint from its stripe's parity or a copy.

parity.py is the coder and knows no manifest; this module finds, from the manifest, which files can
rebuild which, and whether enough of them are intact. The file -> group index is built once per manifest, so
checking every damaged file of a wide checkpoint stays linear in its files.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from ..errors import CheckpointError
from ..storage.local import pread_into
from .checksums import RunningCrc
from .manifest import FileRecord, Manifest
from .parity import Scheme, Stripe, copied, parse_scheme, rebuild, replica_file


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


def recover(manifest: Manifest, lost: str, intact: set[str], read: Callable[[str, int, int], bytes]) -> Iterator[bytes]:
    """The bytes of file `lost`, rebuilt from parity or a copy; CheckpointError when beyond the redundancy.

    Segments are read and decoded on several threads ahead of the consumer, holding at most
    parity.CODING_BUFFER bytes (parity.in_order)."""
    scheme, group = _group(manifest, lost)
    plan = manifest.redundancy
    assert plan is not None  # _group refused a manifest without redundancy
    if scheme.kind == "replicate":
        sources = [n for n in group.data if n != lost and n in intact]
        if not sources:
            raise CheckpointError(f"cannot rebuild {lost}: every copy of {group.data[0]} is damaged or missing")
        return copied(read, sources[0], all_files(manifest)[lost].size, plan.segment)
    stripe = Stripe(group.data, tuple(manifest.files[d].size for d in group.data), group.parity)
    return rebuild(stripe, scheme.k, scheme.m, lost, intact, read, plan.segment)


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


class RebuiltFile:
    """A file rebuilt from its stripe or a copy into an unlinked temporary file: a degraded load reads it back with
    pread, so no process holds the whole rebuilt file in memory (only the rebuild's parity.CODING_BUFFER)."""

    def __init__(self, name: str, size: int, handle: BinaryIO):
        self.name, self.size, self._handle = name, size, handle

    def read_runs(self, runs: Sequence[tuple[int, int]], into: memoryview) -> None:
        """Bytes of each [begin, end) run, one after another into `into`."""
        position = 0
        for begin, end in runs:
            pread_into(self._handle.fileno(), begin, into[position:position + end - begin], f"{self.name} (rebuilt)")
            position += end - begin

    def read_ranges(self, runs: Sequence[tuple[int, int]]) -> list[bytes]:
        out = []
        for begin, end in runs:
            buffer = bytearray(end - begin)
            self.read_runs([(begin, end)], memoryview(buffer))
            out.append(bytes(buffer))
        return out

    def close(self) -> None:
        self._handle.close()


def rebuild_file(manifest: Manifest, lost: str, intact: set[str], read: Callable[[str, int, int], bytes],
                 folder: str | None = None) -> RebuiltFile:
    """Rebuild `lost` (recover) into an unlinked temporary file in `folder` (the system's temporary folder by
    default), checked against the size and CRC-32C the manifest records; CheckpointError when beyond the redundancy
    or when the bytes do not match (a file it was rebuilt from is damaged too)."""
    record = all_files(manifest)[lost]
    chunks = recover(manifest, lost, intact, read)
    handle = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115 (the RebuiltFile returned owns and closes it)
    try:
        running = RunningCrc()
        for chunk in running.passing(chunks):
            view = memoryview(chunk)
            while view:
                view = view[os.write(handle.fileno(), view):]
        if (running.size, running.value) != (record.size, record.crc32c):
            raise CheckpointError(f"the rebuilt bytes ({running.size} bytes, CRC-32C {running.value:08x}) do not "
                                  f"match the {record.size} bytes with CRC-32C {record.crc32c:08x} recorded for it")
    except BaseException:
        handle.close()
        raise
    return RebuiltFile(lost, record.size, handle)
