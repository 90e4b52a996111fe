"""Reading one DCP `.metadata` into its summary (dcp_summary): natively, in process, or in a limited child process.

`.metadata` is a pickle of DCP's dataclasses. The native reader (_dcp_pickle, from csrc/dcp_pickle/, built with
the package where a C compiler is) reads what DCP writes, in a bounded subset of the pickle machine, straight into
the summary, and declines anything else; it is several times faster than DCP's own read_metadata. What it
declines, and every file where it was not built, is read as follows. A small one is read in process by
safe_pickle's allowlist unpickler, which bounds its own work. A large one (20,000 tensors is about 5 MB) is read by
CPython's C unpickler, about four times faster, in a child process (`python -I -S`: no site packages, no
environment) under RLIMIT_CPU and RLIMIT_AS, with the same allowlist. The C unpickler's known attacks (a
LONG_BINPUT index that makes it allocate a memo of that size, keys of one hash value that make filling a dict
quadratic) there end as the child's limits, and are reported as a HeaderError naming the file. All paths give the
same summary, which the reader then validates field by field.
"""

from __future__ import annotations

import marshal
import os
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

from .. import safe_pickle
from ..errors import HeaderError
from ..storage import ByteStore
from . import dcp_summary

try:
    from . import _dcp_pickle  # type: ignore[attr-defined]  # the optional native reader (setup.py)
except ImportError:  # built without a C compiler: every file is read the general way
    _dcp_pickle = None

MAX_METADATA_BYTES = 1_000_000_000

CHILD_FROM_BYTES = 1 << 20
"""A `.metadata` this long or longer is read in a child process: starting one takes about 30 ms, the time the
pure-Python unpickler spends on 100 KB; the C one saves about 0.2 s per MB."""

CHILD_CPU_S = 10
CHILD_CPU_S_PER_MB = 2
"""CPU seconds the child may use: the C unpickler reads a real `.metadata` at about 10 MB/s of CPU time, so this
is 20 times that, plus a floor; keys of one hash value past it are stopped there."""

CHILD_MEMORY = 512 << 20
CHILD_MEMORY_PER_BYTE = 64
CHILD_MEMORY_SHARE = 0.5
"""Address space the child may map: the interpreter, plus the records of a real `.metadata` (about 20 bytes of
objects per byte of pickle here) three times over, and never more than this share of the machine's memory, so
that a forged memo index in a large file cannot make the child swap the machine out. Asking for more fails."""

SUMMARY_PER_BYTE = 2
MIN_SUMMARY = 16 << 20
"""The child's answer may be at most this many bytes per byte of pickle (a real one is about one), plus a floor."""

CHILD_WALL_FACTOR = 10
MAX_CHILD_WALL_S = 3600
"""Wall-clock seconds allowed per CPU second (on a loaded machine the child gets a share of a core), at most
MAX_CHILD_WALL_S: past them a child that does not use its CPU time (blocked) is stopped."""


def _posix_path(*parts: Any) -> str:
    return str(PurePosixPath(*(str(p) for p in parts)))


_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed._shard.sharded_tensor.metadata")
_RECORDS = ("Metadata", "MetadataIndex", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
            "TensorProperties", "StorageMeta")


def metadata_globals() -> dict[tuple[str, str], Any]:
    """The allowlist: DCP's records as stand-ins, plus plain values (safe_pickle.BASE_GLOBALS)."""
    table: dict[tuple[str, str], Any] = dict(safe_pickle.BASE_GLOBALS)
    for module in _MODULES:
        for record in _RECORDS:
            table[(module, record)] = safe_pickle.record_class(record)
        table[(module, "_MEM_FORMAT_ENCODING")] = int
        table[(module, "MEM_FORMAT_ENCODING")] = int
    table[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = safe_pickle.record_class("_StorageInfo")
    # Megatron-Core keeps every rank's save plan in Metadata.all_local_plans (to reuse it on the next save)
    for record in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"):
        table[("torch.distributed.checkpoint.planner", record)] = safe_pickle.record_class(record)
    table[("torch.serialization", "_get_layout")] = str
    table[("torch", "strided")] = "torch.strided"
    for path_class in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        table[("pathlib", path_class)] = _posix_path
    return table


_CALL_TAGS: dict[Any, str] = {
    tuple: "tuple", int: "int", str: "str", set: "set", frozenset: "frozenset", complex: "complex",
    safe_pickle.ordered_dict: "ordered_dict", safe_pickle.latin1_encode: "latin1", _posix_path: "path"}


def child_allowlist() -> list[list[str]]:
    """metadata_globals() as the child's tags (dcp_summary.stand_ins): the one allowlist, written down once."""
    tags = []
    for (module, name), value in metadata_globals().items():
        if isinstance(value, type) and issubclass(value, safe_pickle.Record):
            tags.append([module, name, "record", value.kind])
        elif isinstance(value, safe_pickle.TorchDType):
            tags.append([module, name, "dtype", value.torch_name])
        elif isinstance(value, str):
            tags.append([module, name, "const", value])
        else:
            tags.append([module, name, "call", _CALL_TAGS[value]])
    return tags


def read_summary(files: ByteStore, name: str) -> dict[str, Any]:
    """The summary (dcp_summary.summarize) of the `.metadata` file `name`, or a CheckpointError naming it."""
    where = files.describe(name)
    size = files.size(name)
    if size > MAX_METADATA_BYTES:
        raise HeaderError(f"is {size} bytes, over the {MAX_METADATA_BYTES}-byte limit", file=where)
    data = bytes(files.read(name, 0, size))
    summary = native_summary(data)
    if summary is not None:
        return summary
    if size >= CHILD_FROM_BYTES:
        try:
            return summary_in_child(data, where)
        except (OSError, LimitsUnavailable):  # no interpreter to start, or no limits to run it under: read it here
            pass
    return summary_in_process(data, where)


NATIVE_MEMORY_PER_BYTE = 32
"""The native reader's values may take this many bytes per byte of pickle (a real `.metadata` takes about 12), plus
CHILD_MEMORY, at most CHILD_MEMORY_SHARE of the machine; past that it declines, and the child, limited, reads it."""

# the native reader's codes: they must match the G_ enum in csrc/dcp_pickle/reader.h
_NATIVE_CODES = {"record": 0, "dtype": 1, "const": 2}
_NATIVE_CALLS = {"tuple": 3, "str": 4, "int": 5, "path": 7}  # the calls DCP pickles; any other declines when called
_NATIVE_OTHER_CALL = 6


@cache  # made once: it holds only names and codes (the reader reads it, never changes it), and building it took
# half of opening a small checkpoint
def _native_allowlist() -> dict[tuple[str, str], tuple[int, Any]]:
    """child_allowlist() as the native reader's table: (module, name) -> (code, argument); a path's argument is
    the function that joins its parts."""
    table = {}
    for module, name, tag, arg in child_allowlist():
        code = _NATIVE_CALLS.get(arg, _NATIVE_OTHER_CALL) if tag == "call" else _NATIVE_CODES[tag]
        table[(module, name)] = (code, _posix_path if arg == "path" else arg)
    return table


def native_summary(data: bytes) -> dict[str, Any] | None:
    """The summary by the native reader, or None where it declines the file (or was not built)."""
    if _dcp_pickle is None:
        return None
    memory = _memory_limit(NATIVE_MEMORY_PER_BYTE, len(data))
    try:
        summary: dict[str, Any] | None = _dcp_pickle.summarize(
            data, _native_allowlist(), safe_pickle.expansion_budget(len(data)), memory, dcp_summary.STATE_RECORDS)
    except MemoryError:  # the machine's memory, not the reader's limit: the child's limits then decide
        return None
    return summary


class LimitsUnavailable(Exception):
    """The child could not set its CPU and memory limits (a platform without them), so it did not read the file."""


def summary_in_process(data: bytes, where: str) -> dict[str, Any]:
    record = safe_pickle.loads(data, metadata_globals(), file=where)
    try:
        return dcp_summary.summarize(record, safe_pickle.expansion_budget(len(data)))
    except dcp_summary.Malformed as exc:
        raise HeaderError(str(exc), file=where, tensor=exc.tensor) from None
    except RecursionError:  # as the child answers
        raise HeaderError("pickle is nested too deeply", file=where) from None


def _machine_memory_share() -> int:
    """CHILD_MEMORY_SHARE of this machine's memory (0 where it cannot be told)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * CHILD_MEMORY_SHARE)
    except (ValueError, OSError, AttributeError):
        return 0


def _memory_limit(per_byte: int, nbytes: int) -> int:
    """CHILD_MEMORY plus `per_byte` for each byte of the pickle, at most CHILD_MEMORY_SHARE of the machine."""
    return min(CHILD_MEMORY + per_byte * nbytes, max(CHILD_MEMORY, _machine_memory_share()))


def summary_in_child(data: bytes, where: str) -> dict[str, Any]:
    """The summary, made by the C unpickler in a child process under CPU and memory limits."""
    cpu_s = CHILD_CPU_S + CHILD_CPU_S_PER_MB * len(data) // 1_000_000
    memory = _memory_limit(CHILD_MEMORY_PER_BYTE, len(data))
    wall_s = min(CHILD_WALL_FACTOR * cpu_s, MAX_CHILD_WALL_S)
    request = {"length": len(data), "cpu_s": cpu_s, "memory": memory, "allowlist": child_allowlist(),
               "budget": safe_pickle.expansion_budget(len(data)),
               "max_output": max(MIN_SUMMARY, SUMMARY_PER_BYTE * len(data))}
    command = [sys.executable, "-I", "-S", "-B", str(Path(dcp_summary.__file__))]
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        out, _ = child.communicate(dcp_summary.request_bytes(request, data), timeout=wall_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise HeaderError(f"reading it took more than {wall_s} s", file=where) from None
    if child.returncode == -signal.SIGXCPU:
        raise HeaderError(f"reading it used more than its {cpu_s} s of CPU time (a real .metadata of "
                          f"{len(data)} bytes takes a small fraction of that)", file=where)
    if child.returncode == -signal.SIGKILL:  # past the hard CPU limit, or the system's out-of-memory killer
        raise HeaderError(f"the process reading it was killed: over its {cpu_s} s of CPU time, or out of memory",
                          file=where)
    try:
        answer = marshal.loads(out)  # the child's own output (see dcp_summary on why marshal)
        if type(answer) is not dict:
            raise ValueError(type(answer).__name__)
    except (ValueError, EOFError, TypeError):
        raise HeaderError(f"the child reading it stopped with status {child.returncode} and no answer",
                          file=where) from None
    if "summary" in answer:
        return answer["summary"]
    if answer.get("unsafe"):
        raise safe_pickle.refused(*answer["unsafe"], file=where)
    if answer["error"] == "limits":
        raise LimitsUnavailable(where)
    if answer["error"] == "memory":
        raise HeaderError(f"reading it needs more than {memory} bytes of memory, the limit for a pickle of "
                          f"{len(data)} bytes (a forged memo index or length?)", file=where)
    raise HeaderError(answer["error"], file=where, tensor=answer["tensor"])
