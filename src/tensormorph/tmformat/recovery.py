"""Rebuilding a lost or damaged file of a Tensormorph checkpoint from its stripe's parity or a copy.

parity.py is the coder and knows no manifest; this module finds, from the manifest, which files can
rebuild which, and whether enough of them are intact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..errors import CheckpointError
from .manifest import FileRecord, Manifest
from .parity import Stripe, parse_scheme, rebuild, replica_file


def all_files(manifest: Manifest) -> dict[str, FileRecord]:
    """Data files, then parity files and copies."""
    return {**manifest.files, **(manifest.redundancy.files if manifest.redundancy else {})}


def group_of(manifest: Manifest, name: str) -> tuple[str, ...]:
    """The files that can rebuild `name`: its stripe (data and parity), or its copies; () without redundancy."""
    plan = manifest.redundancy
    if plan is None:
        return ()
    scheme = parse_scheme(plan.scheme)
    if scheme.kind == "replicate":
        for data in manifest.files:
            copies = (data, *(replica_file(data, c) for c in range(1, scheme.copies)))
            if name in copies:
                return copies
        return ()
    return next((data + parity for data, parity in plan.stripes if name in data or name in parity), ())


def recover(manifest: Manifest, lost: str, intact: set[str], read: Callable[[str, int, int], bytes]) -> Iterator[bytes]:
    """The bytes of file `lost`, rebuilt from parity or a copy; CheckpointError when beyond the redundancy."""
    plan = manifest.redundancy
    if plan is None:
        raise CheckpointError(f"cannot rebuild {lost}: the checkpoint was saved without redundancy")
    scheme = parse_scheme(plan.scheme)
    if scheme.kind == "replicate":
        data_file = next((d for d in manifest.files for c in range(1, scheme.copies)
                          if lost in (d, replica_file(d, c))), None)
        if data_file is None:
            raise CheckpointError(f"cannot rebuild {lost}: it is not a data file or copy of this checkpoint")
        copies = [data_file] + [replica_file(data_file, c) for c in range(1, scheme.copies)]
        sources = [n for n in copies if n != lost and n in intact]
        if not sources:
            raise CheckpointError(f"cannot rebuild {lost}: every copy of {data_file} is damaged or missing")
        size = all_files(manifest)[lost].size
        return (read(sources[0], b, min(b + plan.segment, size)) for b in range(0, size, plan.segment))
    for data, parity in plan.stripes:
        if lost in data or lost in parity:
            stripe = Stripe(data, tuple(manifest.files[d].size for d in data), parity)
            return rebuild(stripe, scheme.k, scheme.m, lost, intact, read, plan.segment)
    raise CheckpointError(f"cannot rebuild {lost}: no stripe holds it")


def check_recoverable(manifest: Manifest, name: str, intact: set[str]) -> None:
    """Raise CheckpointError unless `name` can be rebuilt from the intact files."""
    plan = manifest.redundancy
    if plan is None:
        raise CheckpointError("the checkpoint was saved without redundancy")
    scheme = parse_scheme(plan.scheme)
    if scheme.kind == "replicate":
        recover(manifest, name, intact, lambda *_: b"")  # lazy: only checks that an intact copy exists
        return
    for data, parity in plan.stripes:
        if name in data or name in parity:
            alive = sum(1 for f in data + parity if f in intact and f != name) + (scheme.k - len(data))
            if alive < scheme.k:
                raise CheckpointError(f"only {alive} of its stripe's {scheme.k + scheme.m} files are intact, "
                                      f"{scheme.k} are needed")
            return
    raise CheckpointError(f"no stripe holds {name}")
