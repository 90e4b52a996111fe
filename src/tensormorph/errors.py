"""One hierarchy for every failure a checkpoint can cause.

Each message names the file, the tensor (when there is one) and what was
expected against what was found, so the CLI can print it as one line.
"""

from __future__ import annotations

from collections.abc import Iterable


class CheckpointError(Exception):
    """Base class: something about a checkpoint is wrong or unreadable."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.reason = message  # without the file and tensor, for re-raising with more context
        self.file = file
        self.tensor = tensor
        where = []
        if file is not None:
            where.append(str(file))
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


class UnknownFormatError(CheckpointError):
    """No reader recognises the path."""


class HeaderError(CheckpointError):
    """A header, index or metadata record is malformed or inconsistent."""


class TruncatedFileError(CheckpointError):
    """A file ends before the bytes its header promises."""


class MissingFileError(CheckpointError):
    """A file named by the checkpoint is absent."""


class ChecksumError(CheckpointError):
    """Bytes do not match the checksum the checkpoint recorded for them."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None, record: str = ""):
        super().__init__(message, file=file, tensor=tensor)
        self.record = record  # the damaged record inside the file, when the format has records


class UnsafePathError(CheckpointError):
    """A checkpoint names a file outside its own folder."""


class UnsafePickleError(CheckpointError):
    """A pickle names a global outside the allowlist (it would run code)."""


class ChunkLayoutError(CheckpointError):
    """Chunks do not tile their tensor: out of bounds, overlapping or leaving gaps."""


class BudgetExceededError(CheckpointError):
    """A read would materialise more bytes than the configured budget."""


class UnsupportedError(CheckpointError):
    """The checkpoint uses a feature this version cannot read."""


class UncommittedCheckpointError(CheckpointError):
    """A save that never committed: data files without a manifest (a crash or a failed rank)."""


class StateMismatchError(CheckpointError):
    """A state dict and a checkpoint disagree: missing or unexpected keys, other shapes or dtypes."""

    def __init__(self, message: str, *, file: str | None = None, missing: Iterable[str] = (),
                 unexpected: Iterable[str] = (), mismatched: Iterable[str] = ()):
        super().__init__(message, file=file)
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)


class TensorNotFoundError(CheckpointError, KeyError):
    """A tensor name is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return Exception.__str__(self)


class MissingDependencyError(CheckpointError):
    """A feature needs an optional dependency (an extra) that is not installed."""


class AccessDeniedError(CheckpointError):
    """A remote store refuses access to a file (401/403): the credentials are missing or do not allow it."""
