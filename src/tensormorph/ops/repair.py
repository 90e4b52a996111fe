"""Rewrite the damaged files of a Tensormorph checkpoint from its parity (or copies), then verify it.

Each data, parity or copy file is checked against the size and CRC-32C the
manifest records; every damaged one that its stripe can still rebuild is
rebuilt into a temporary file, checked against the recorded CRC-32C, fsynced
and renamed over the damaged one. Files beyond the redundancy are listed with
the tensors they hold.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, MissingFileError
from ..storage import LocalFiles, create_new
from ..tmformat.checkpoint import read_manifest, root_of
from ..tmformat.checksums import RunningCrc
from ..tmformat.integrity import file_problem
from ..tmformat.linear_code import BytesLike
from ..tmformat.manifest import FileRecord
from ..tmformat.recovery import all_files, recover
from .verify import VerifyReport, verify

SCAN_THREADS = 4  # files checked at once: their reads queue together on the disk, and CRC-32C (which releases the
# GIL) runs on every core
SCAN_ALONE_BYTES = 64 * 1024**2  # checkpoints smaller than this are checked file after file: starting threads would
# cost more than overlapping their reads saves


@dataclass
class RepairReport:
    path: str
    scheme: str | None
    repaired: list[str] = field(default_factory=list)
    unrecoverable: dict[str, str] = field(default_factory=dict)  # file -> why
    after: VerifyReport | None = None

    @property
    def ok(self) -> bool:
        return not self.unrecoverable and self.after is not None and self.after.ok

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def repair(path: str | Path) -> RepairReport:
    """Rebuild every recoverable damaged file of the checkpoint at `path`, then verify it."""
    if not Path(path).exists():
        raise MissingFileError("no such file or folder", file=str(path))
    root = root_of(Path(path))
    files = LocalFiles(root)
    manifest = read_manifest(files, str(root))
    report = RepairReport(str(root), manifest.redundancy.scheme if manifest.redundancy else None)
    records = all_files(manifest)
    if sum(record.size for record in records.values()) < SCAN_ALONE_BYTES:
        found = {name: file_problem(files, name, record) for name, record in records.items()}
    else:
        with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="tm-repair-scan") as pool:
            found = dict(zip(records, pool.map(lambda item: file_problem(files, *item), records.items())))
    damaged = {name for name, problem in found.items() if problem is not None}
    intact = set(records) - damaged

    def read(name: str, begin: int, end: int) -> bytes:
        return files.read(name, begin, end - begin)

    # data files first: parity is rebuilt from them
    for name in sorted(damaged, key=lambda n: (n not in manifest.files, n)):
        try:
            _rewrite(files, name, records[name], recover(manifest, name, intact, read))
        except CheckpointError as exc:
            report.unrecoverable[name] = exc.reason
            continue
        intact.add(name)
        report.repaired.append(name)
    files.close()
    report.after = verify(root)
    return report


def write_checked(path: Path, chunks: Iterable[BytesLike]) -> tuple[int, int]:
    """Write a stream of byte strings to a new file `path` durably; returns (size, CRC-32C) of what was written.

    The file must not exist, and a link at `path` is refused rather than followed: repairs write inside a
    checkpoint folder, which anyone may have planted links in.
    """
    running = RunningCrc()
    with create_new(path) as f:
        for chunk in running.passing(chunks):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return running.size, running.value


def _rewrite(files: LocalFiles, name: str, record: FileRecord, chunks: Iterable[BytesLike]) -> None:
    files.resolve(name)  # confined to the folder
    # The rebuilt file replaces the name itself: were it a planted link, its target is left alone
    final = files.root / name
    part = final.with_name(f".{final.name}.repair-{uuid.uuid4().hex[:12]}")
    try:
        size, value = write_checked(part, chunks)
    except OSError as exc:  # a read-only folder, a full disk: this file stays unrepaired, the others go on
        if not isinstance(exc, FileExistsError):  # else the name was not ours: create_new refused it
            with contextlib.suppress(OSError):
                part.unlink()  # what a full disk left half written
        raise CheckpointError(f"cannot write the rebuilt file {part.name}: {exc.strerror or exc}",
                              file=str(final)) from None
    if (size, value) != (record.size, record.crc32c):
        part.unlink()
        raise CheckpointError(f"rebuilt {size} bytes with CRC-32C {value:08x}, the manifest records {record.size} "
                              f"bytes with {record.crc32c:08x}: a file it was rebuilt from is damaged too")
    try:
        os.replace(part, final)
    except OSError as exc:  # the damaged name is a folder, or the folder is read-only
        part.unlink()
        raise CheckpointError(f"cannot replace it with the rebuilt file: {exc.strerror or exc}",
                              file=str(final)) from None
