"""Check a checkpoint's integrity: layout, files, byte ranges, checksums and (with full=True) every value.

Opening a checkpoint already validates its headers, that every referenced
file exists with enough bytes, and that chunks tile each tensor; a failure
there is reported as the first problem. Formats that record checksums (the
CRC-32 of each record of torch.save zips, DCP items included) are checked
through the format reader's `checksum_problems(checkpoint)`. With
full=True every byte is read, and tensors holding NaN or Inf are reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, MissingFileError, UnsafePickleError
from ..formats import open_checkpoint, reader_of
from ..storage import is_url
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


def _problem(exc: CheckpointError) -> Problem:
    return Problem(type(exc).__name__, exc.reason, exc.file, exc.tensor)


def verify(path: str | Path, *, full: bool = False, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Verify the checkpoint at `path`; problems are collected, not raised (MissingFileError when there is no
    file or folder at `path`: nothing was verified)."""
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
        try:
            for _item, problem in reader_of(ck).checksum_problems(ck):
                report.checksums_checked += 1
                if problem is not None:
                    report.problems.append(_problem(problem))
        except CheckpointError as exc:  # a file the checks cannot read at all (gone, a folder): damage found
            report.problems.append(_problem(exc))
        if not full:
            return report
        for tensor in ck.values():
            try:
                stats = tensor_stats(tensor, progress=progress)
            except CheckpointError as exc:
                report.problems.append(_problem(exc))
                continue
            report.bytes_read += tensor.nbytes
            file = tensor.files[0] if tensor.files else None
            if stats.nans:
                report.problems.append(Problem("nan", f"holds {stats.nans} NaN values", file, tensor.name))
            if stats.infs:
                report.problems.append(Problem("inf", f"holds {stats.infs} infinite values", file, tensor.name))
        for entry in ck.objects.values():
            try:
                entry.value()
            except UnsafePickleError:
                pass  # not plain data: listed, deliberately not decoded; not damage
            except CheckpointError as exc:
                report.problems.append(_problem(exc))
    return report
