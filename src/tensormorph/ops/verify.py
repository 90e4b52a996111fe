"""Check a checkpoint's integrity: layout, files, byte ranges, checksums and (with full=True) every value.

Opening a checkpoint already validates its headers, that every referenced
file exists with enough bytes, and that chunks tile each tensor; a failure
there is reported as the first problem. Formats that record checksums (the
CRC-32 of each record of torch.save zips, DCP items included) are checked
through the format reader's `checksum_problems(checkpoint)`. With
full=True every byte is read, and tensors holding NaN or Inf are reported.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core import Checkpoint
from ..errors import CheckpointError, MissingFileError, UnsafePickleError
from ..formats import open_checkpoint, reader_of
from ..formats.contract import no_checksums
from ..storage import is_url
from .spread import ALONE, Team, share
from .stats import tensor_stats


@dataclass(frozen=True)
class Problem:
    kind: str  # the error class name, or "nan"/"inf"
    message: str
    file: str | None = None
    tensor: str | None = None


@dataclass
class VerifyReport:
    path: str
    format: str | None = None
    tensors: int = 0
    files: int = 0
    full: bool = False
    bytes_read: int = 0
    checksums_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass(frozen=True)
class Step:
    """One thing verified: a file or item whose checksums were checked, a tensor read whole, or an object."""

    item: str
    problems: tuple[Problem, ...] = ()
    checksum: bool = False  # a recorded checksum was checked
    bytes_read: int = 0


def _problem(exc: CheckpointError) -> Problem:
    return Problem(type(exc).__name__, exc.reason, exc.file, exc.tensor)


def verify(path: str | Path, *, full: bool = False, progress: Callable[[int], None] | None = None,
           team: Team = ALONE) -> VerifyReport:
    """Verify the checkpoint at `path`; problems are collected, not raised (MissingFileError when there is no
    file or folder at `path`: nothing was verified). `team` spreads the work over processes (ops/spread.py): the
    checksum checks as one unit, each tensor read (full=True) as one; every process returns the whole report."""
    if not is_url(path) and not Path(path).exists():  # nothing to verify: the command could not run, not damage
        raise MissingFileError("no such file or folder", file=str(path))
    report = VerifyReport(str(path), full=full)
    try:
        ck = open_checkpoint(path)
    except CheckpointError as exc:
        report.problems.append(_problem(exc))
        return report
    with ck:
        report.format, report.tensors, report.files = ck.format, len(ck), len(ck.files)
        for step in _spread_steps(ck, full, progress, team):
            report.checksums_checked += step.checksum
            report.bytes_read += step.bytes_read
            report.problems.extend(step.problems)
    return report


_CHECKSUMS, _OBJECTS = ("checksums",), ("objects",)  # units of work beside the tensors (a name is never a tuple)


def _spread_steps(ck: Checkpoint, full: bool, progress: Callable[[int], None] | None, team: Team) -> list[Step]:
    """This process's share of the steps done, every process's steps gathered, in verify_steps' order."""
    checked = reader_of(ck).checksum_problems is not no_checksums
    units: dict[Hashable, int] = {_CHECKSUMS: ck.nbytes if checked else 0}  # the checks read about every byte
    if full:
        units.update({name: tensor.nbytes for name, tensor in ck.items()})
        units[_OBJECTS] = 0
    mine = share(team, units)

    def run_share() -> tuple[list[Step], dict[str, Step], list[Step]]:
        names = [name for name in ck if name in mine]  # one step per tensor
        return (list(_checksum_steps(ck)) if _CHECKSUMS in mine else [],
                dict(zip(names, _tensor_steps(ck, names, progress))),
                list(_object_steps(ck)) if _OBJECTS in mine else [])

    parts = team.each(run_share)
    tensors = {name: step for _, steps, _ in parts for name, step in steps.items()}
    return [*(s for checks, _, _ in parts for s in checks), *(tensors[n] for n in ck if n in tensors),
            *(s for _, _, found in parts for s in found)]


def verify_steps(ck: Checkpoint, *, full: bool = False,
                 progress: Callable[[int], None] | None = None) -> Generator[Step, None, None]:
    """Verify an open checkpoint step by step, each step as it is done (the viewer streams them): every
    checksum the format records, then with full=True every tensor's values and every object."""
    yield from _checksum_steps(ck)
    if full:
        yield from _tensor_steps(ck, list(ck), progress)
        yield from _object_steps(ck)


def _checksum_steps(ck: Checkpoint) -> Iterator[Step]:
    try:
        for item, problem in reader_of(ck).checksum_problems(ck):
            yield Step(item, (_problem(problem),) if problem is not None else (), checksum=True)
    except CheckpointError as exc:  # a file the checks cannot read at all (gone, a folder): damage found
        yield Step(exc.file or str(ck.path), (_problem(exc),))


def _tensor_steps(ck: Checkpoint, names: list[str], progress: Callable[[int], None] | None) -> Iterator[Step]:
    """Each tensor of `names` read whole: damage, NaN and Inf found."""
    for tensor in (ck[name] for name in names):
        try:
            stats = tensor_stats(tensor, progress=progress)
        except CheckpointError as exc:
            yield Step(tensor.name, (_problem(exc),))
            continue
        file = tensor.files[0] if tensor.files else None
        problems = []
        if stats.nans:
            problems.append(Problem("nan", f"holds {stats.nans} NaN values", file, tensor.name))
        if stats.infs:
            problems.append(Problem("inf", f"holds {stats.infs} infinite values", file, tensor.name))
        yield Step(tensor.name, tuple(problems), bytes_read=tensor.nbytes)


def _object_steps(ck: Checkpoint) -> Iterator[Step]:
    for entry in ck.objects.values():
        try:
            entry.value()
        except UnsafePickleError:
            pass  # not plain data: listed, deliberately not decoded; not damage
        except CheckpointError as exc:
            yield Step(entry.name, (_problem(exc),))
            continue
        yield Step(entry.name)
