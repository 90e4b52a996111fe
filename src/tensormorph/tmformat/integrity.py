"""Whole files of a Tensormorph checkpoint judged against the sizes and CRC-32C the manifest records."""

from __future__ import annotations

from ..errors import CheckpointError, ChecksumError, HeaderError, MissingFileError, TruncatedFileError
from ..storage import ByteStore
from .checksums import RunningCrc
from .manifest import FileRecord

FILE_PIECE = 64 * 1024**2  # bytes of a whole-file check read at a time


def file_crc32c(files: ByteStore, name: str) -> int:
    size, running = files.size(name), RunningCrc()
    buffer = memoryview(bytearray(min(FILE_PIECE, max(size, 1))))
    while running.size < size:
        count = min(FILE_PIECE, size - running.size)
        files.read_into(name, running.size, buffer[:count])
        running.update(buffer[:count])
    return running.value


def size_problem(files: ByteStore, name: str, record: FileRecord) -> CheckpointError | None:
    """Why a file cannot be what the manifest records, judged by its presence and size alone."""
    try:
        size = files.size(name)
    except MissingFileError:
        return MissingFileError(f"file of rank {record.rank} is missing", file=files.describe(name))
    if size != record.size:
        error = TruncatedFileError if size < record.size else HeaderError
        return error(f"is {size} bytes, the manifest records {record.size}", file=files.describe(name))
    return None


def file_problem(files: ByteStore, name: str, record: FileRecord) -> CheckpointError | None:
    """Presence, size, then the CRC-32C of the whole file."""
    problem = size_problem(files, name, record)
    if problem is not None:
        return problem
    found = file_crc32c(files, name)
    if found != record.crc32c:
        return ChecksumError(f"CRC-32C is {found:08x}, the manifest records {record.crc32c:08x}: the file is damaged",
                             file=files.describe(name))
    return None
