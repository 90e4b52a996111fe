"""The contract every format reader keeps: a module with NAME, detect, open and checksum_problems.

`detect` judges a path by its content and returns what it found (a `Detection`), which `open` reuses
instead of searching and reading again; `tm.open(path, format=...)` skips detection and hands `open`
a Detection of the bare path. Readers return data (a `Checkpoint` of frozen records) and read bytes
only through the checkpoint's byte store: `open` makes the store, and everything after it uses only the
`storage.ByteStore` protocol, never asking which store it has (local, or remote behind a URL).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..core import Checkpoint
from ..errors import CheckpointError
from ..storage import AnyPath


@dataclass(frozen=True)
class Detection:
    """What a reader's `detect` found at `path`: the file or folder it judged, and what it parsed on the way."""

    path: AnyPath
    found: Any = None  # reader-specific (the key file, the split set ...); None when detection was skipped


Problems = Iterator[tuple[str, CheckpointError | None]]  # (file or item checked, its problem or None)


class FormatReader(Protocol):
    """A format module. Listed once, in detection order, in `tensormorph.formats.READERS`."""

    NAME: str

    def detect(self, path: AnyPath) -> Detection | None:
        """A Detection when the content at `path` is this format, else None; never raises for foreign input."""
        ...

    def open(self, detection: Detection) -> Checkpoint:
        """The checkpoint, validated; every problem a CheckpointError naming the file and tensor."""
        ...

    def checksum_problems(self, checkpoint: Checkpoint) -> Problems:
        """Check every checksum the format records (nothing, for formats that record none)."""
        ...


def no_checksums(checkpoint: Checkpoint) -> Problems:
    """For formats that record no checksums: there is nothing to check beyond what opening validated."""
    return iter(())
