"""The shared harness of the hostile-input tests (tests/test_hostile_*.py).

Hostile bytes at every parser. Each input has one right outcome, decided from the input itself (the
format's rules, or a reference reader: the standard unpickler, the zipfile module, torch.load), and the
reader must meet it exactly: the values, or the error class naming the file. Never another exception, never
code execution, never a hang. Inputs whose outcome only a second reader could decide are left to properties
that build them on purpose.

Seeds are real files made by the real libraries (safetensors, torch.save, dcp.save in one process);
hypothesis mutates them or builds headers from scratch.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import shutil
import struct
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch  # a dev dependency: the seeds are made by torch itself
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tensormorph import safe_pickle
from tensormorph.errors import CheckpointError, HeaderError, TruncatedFileError, UnsafePickleError, UnsupportedError

FUZZ = settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])


# ---------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------


def outcome(action: Callable[[], Any]) -> Any:
    """The value, or the CheckpointError raised; any other exception fails the test."""
    try:
        return action()
    except CheckpointError as exc:
        return exc


@st.composite
def edits(draw: st.DrawFn, size: int, hot: list[tuple[int, int]] | None = None) -> tuple[list, int | None]:
    """Up to 8 byte replacements (biased to the structural `hot` ranges) and an optional truncation."""
    ranges = [(0, size)] + (hot or [])
    changes = []
    for _ in range(draw(st.integers(0, 8))):
        begin, end = draw(st.sampled_from(ranges))
        changes.append((draw(st.integers(begin, max(begin, end - 1))), draw(st.integers(0, 255))))
    cut = draw(st.none() | st.integers(0, size) | st.integers(max(0, size - 64), size))
    return changes, cut


class Refused(Exception):
    """The reference unpickler met a global or persistent id that safe_pickle must refuse."""


class ReferenceUnpickler(pickle._Unpickler):
    """The standard library's unpickler, allowed exactly safe_pickle's stand-ins: the reference outcome. The
    pure-Python one, as safe_pickle: the C one differs on malformed streams (an unterminated last line)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return safe_pickle.BASE_GLOBALS[(module, name)]
        except KeyError:
            raise Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise Refused(repr(pid))


def reference_stream(payload: bytes) -> bytes:
    """`payload` as the reference unpickler should see it: without FRAME opcodes (safe_pickle skips them: they
    only announce lengths), and ending in an invalid opcode where a BYTEARRAY8 claims more bytes than remain
    (safe_pickle refuses it; pickle itself would first allocate what it claims)."""
    stream, frames, parsed, end = io.BytesIO(payload), [], 0, len(payload)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # genops decoding a STRING with a bad escape
            for opcode, _, begin in pickletools.genops(stream):
                parsed = stream.tell()  # the end of the last opcode read whole
                if opcode.name == "FRAME":
                    frames.append((begin, parsed))
                elif opcode.name == "STOP":
                    end = parsed
    except Exception:  # genops raises many types where a stream breaks
        if payload[parsed:].startswith(pickle.BYTEARRAY8):
            return reference_stream(payload[:parsed]) + b"\xff"
    kept, position = [], 0
    for begin, stop in frames:
        kept.append(payload[position:begin])
        position = stop
    return b"".join(kept) + payload[position:end]


def replace_file(path: Path, content: bytes) -> None:
    """Swap in new content by rename, so maps of the old file (still held by numpy views) stay valid."""
    staging = path.with_name(path.name + ".new")
    staging.write_bytes(content)
    os.replace(staging, path)


def mutate(seed: bytes, change: tuple[list, int | None]) -> bytes:
    changes, cut = change
    data = bytearray(seed)
    for position, value in changes:
        if position < len(data):
            data[position] = value
    return bytes(data if cut is None else data[:cut])


def huge_memo_index(data: bytes) -> bool:
    """A PUT/LONG_BINPUT naming a memo slot far beyond the pickle's size (see test_pickle_memo_index_...).

    CPython's C unpickler grows its memo array to twice such an index and zeroes it, so a 10-byte pickle
    can demand gigabytes. Fuzz inputs that do this are left to the dedicated test, so the fuzz cannot
    exhaust the test machine's memory.
    """
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT") and int(arg) > 1 << 16:
                return True
    except Exception:  # genops stops where the stream breaks; so does the unpickler
        pass
    return False


json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=4)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=6)


# ---------------------------------------------------------------------------
# torch.save archives
# ---------------------------------------------------------------------------


def torch_zip(pickle_bytes: bytes, storages: dict[str, bytes] | None = None, *, byteorder: bytes = b"little") -> bytes:
    """A torch.save-shaped zip around any data.pkl (ZIP_STORED, valid CRCs)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/byteorder", byteorder)
        for key, raw in (storages or {}).items():
            archive.writestr(f"archive/data/{key}", raw)
        archive.writestr("archive/version", b"3\n")
    return buffer.getvalue()


def archive_view(blob: bytes) -> dict[str, tuple[int, int, bytes | None]] | type[CheckpointError]:
    """{record: (compression, declared size, content)}: what reading a torch.save archive relies on, or the
    error its first unreadable part must raise. The records the central directory lists, with the sizes it
    declares (the reader bounds them); data.pkl and byteorder as the zipfile module reads them (CRC checked);
    each storage's bytes where its local header puts them, in order (reading does not check their CRCs; verify
    does); no other record is read."""
    if len(blob) >= 2 and blob[0] == 0x80:
        return UnsupportedError  # the legacy torch.save format's first byte
    if blob[:4] != b"PK\x03\x04":
        return HeaderError
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob))
        view: dict[str, tuple[int, int, bytes | None]] = {}
        for info in archive.infolist():
            content = None
            if info.filename.endswith(("data.pkl", "byteorder")):
                content = archive.read(info)
            elif "/data/" in info.filename:
                local = blob[info.header_offset:info.header_offset + 30]
                if len(local) < 30 or local[:4] != b"PK\x03\x04":
                    return HeaderError
                begin = info.header_offset + 30 + sum(struct.unpack("<HH", local[26:30]))
                if begin + info.file_size > len(blob):
                    return TruncatedFileError
                content = blob[begin:begin + info.file_size]
            view[info.filename] = (info.compress_type, info.file_size, content)
    except Exception:  # zipfile raises many types on damaged archives
        return HeaderError
    return view if any(name.endswith("data.pkl") for name in view) else HeaderError


def archive_verdict(blob: bytes, seed: bytes) -> type[CheckpointError] | None | str:
    """None when `blob` reads as the archive `seed` is, the error reading it must raise when it is unreadable,
    and "undecided" when it reads as another archive."""
    view = archive_view(blob)
    if isinstance(view, type):
        return view
    return None if view == archive_view(seed) else "undecided"


# ---------------------------------------------------------------------------
# pickles that would run code
# ---------------------------------------------------------------------------


class ReduceToSystem:
    """A classic malicious object: unpickling calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


class TouchOnInit:
    """Unpickling imports this class and calls it: its constructor has the side effect."""

    def __init__(self, marker: str):
        Path(marker).touch()
        self.marker = marker

    def __reduce__(self) -> tuple:
        return TouchOnInit, (self.marker,)


def short_str(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _binunicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


PAYLOADS: dict[str, tuple[str, Callable[[Path], bytes]]] = {
    "GLOBAL os.system": ("os.system", lambda m: f"cos\nsystem\n(S'touch {m}'\ntR.".encode()),
    "STACK_GLOBAL os.system": ("os.system", lambda m: b"\x80\x04" + short_str("os") + short_str("system") + b"\x93"
                               + short_str(f"touch {m}") + b"\x85R."),
    "builtins.eval": ("builtins.eval", lambda m: b"\x80\x02cbuiltins\neval\n"
                      + _binunicode(f"open({str(m)!r}, 'w').close()") + b"\x85R."),
    "subprocess.Popen": ("subprocess.Popen", lambda m: f"csubprocess\nPopen\n((S'touch'\nS'{m}'\nltR.".encode()),
    "getattr chain": ("builtins.getattr", lambda m: (
        "cbuiltins\ngetattr\n(cbuiltins\n__import__\n(S'os'\ntRS'system'\ntR(S'touch "
        + str(m) + "'\ntR.").encode()),
    "inside a dict": ("os.system", lambda m: f"(dp0\nS'k'\ncos\nsystem\n(S'touch {m}'\ntRs.".encode()),
    "__reduce__ object": (f"{os.system.__module__}.system", lambda m: pickle.dumps(ReduceToSystem(m), protocol=2)),
    "class with side effects": (f"{TouchOnInit.__module__}.TouchOnInit",
                                lambda m: pickle.dumps(_touch_on_init_stub(m), protocol=4)),
}


def _touch_on_init_stub(marker: Path) -> TouchOnInit:
    """An instance made without running __init__, so pickling it has no side effect."""
    stub = TouchOnInit.__new__(TouchOnInit)
    stub.marker = str(marker)
    return stub


def run_control(payload: bytes) -> None:
    """Plain pickle.loads really runs the payload (so the checks below can fail)."""
    value = pickle.loads(payload)
    if hasattr(value, "wait"):
        value.wait()


def assert_refused(action: Callable[[], Any], global_name: str, marker: Path, payload: bytes) -> UnsafePickleError:
    with pytest.raises(UnsafePickleError) as info:
        action()
    assert f"refuses global {global_name}" in str(info.value)
    assert not marker.exists(), "the payload ran"
    run_control(payload)
    assert marker.exists(), "control: this payload should create the marker when unpickled naively"
    return info.value


# ---------------------------------------------------------------------------
# a Hugging Face sharded checkpoint with links in and out
# ---------------------------------------------------------------------------


SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
TRUTH = {
    "a": np.arange(6, dtype=np.float32).reshape(2, 3),
    "b": np.array([1, -2, 3], dtype=np.int64),
    "c": np.array([0.5, -1.5], dtype=ml_dtypes.bfloat16),
}
HOLDS = {SHARD1: {"a", "b"}, SHARD2: {"c"}, "inside_link.safetensors": {"c"}}


def make_hf_folder(base: Path) -> Path:
    """An HF sharded checkpoint in base/ckpt (no index yet), with files and links outside it to escape to."""
    folder = base / "ckpt"
    folder.mkdir()
    safetensors.numpy.save_file({k: TRUTH[k] for k in ("a", "b")}, str(folder / SHARD1))
    safetensors.numpy.save_file({"c": TRUTH["c"]}, str(folder / SHARD2))
    outside = base / "outside"
    outside.mkdir()
    safetensors.numpy.save_file(TRUTH, str(outside / "stolen.safetensors"))
    safetensors.numpy.save_file(TRUTH, str(base / "outside.safetensors"))
    (folder / "link.safetensors").symlink_to(outside / "stolen.safetensors")
    (folder / "linkdir").symlink_to(outside, target_is_directory=True)
    (folder / "inside_link.safetensors").symlink_to(SHARD2)  # relative: stays inside copies too
    return folder


def write_index(folder: Path, index: Any, name: str = "model.safetensors.index.json") -> Path:
    target = Path(tempfile.mkdtemp(dir=folder.parent))
    for entry in folder.iterdir():
        (target / entry.name).symlink_to(os.readlink(entry)) if entry.is_symlink() else \
            shutil.copy(entry, target / entry.name)
    (target / name).write_text(index if isinstance(index, str) else json.dumps(index))
    return target


# ---------------------------------------------------------------------------
# DCP
# ---------------------------------------------------------------------------


def make_dcp_seed(folder: Path) -> Path:
    """A DCP checkpoint saved into `folder` by dcp.save in this process."""
    import torch.distributed.checkpoint as dcp  # slow to import: only the DCP tests need it

    state = {
        "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
        "h": torch.tensor([1.5, -2.0, 0.25, 8.0, -0.5], dtype=torch.bfloat16),
        "i": torch.tensor([[1, 2], [3, 4], [5, -(2**40)]], dtype=torch.int64),
        "m": torch.tensor([True, False, False, True]),
        "step": 7,
        "cfg": {"lr": 0.1, "name": "run"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    return folder


def copy_dcp(seed: Path, target: Path) -> Path:
    shutil.copytree(seed, target)
    return target


def load_metadata(folder: Path) -> Any:
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # our own, trusted file


def save_metadata(folder: Path, metadata: Any) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))


# ---------------------------------------------------------------------------
# bounded work: time and peak memory of one case, measured in a child process
# ---------------------------------------------------------------------------

_BOUNDED_PROBE = """
import json, sys, time
def peak_kib():  # VmHWM: ru_maxrss would carry the parent's peak across exec
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
before = peak_kib()
started = time.perf_counter()
try:
    exec(compile(sys.argv[1], "<case>", "exec"), globals())  # the setup's names are visible
    outcome = None
except BaseException as exc:
    outcome = [type(exc).__name__, str(exc)]
print(json.dumps({"seconds": time.perf_counter() - started, "outcome": outcome,
                  "grown_mib": (peak_kib() - before) / 1024}))
"""


def run_bounded(code: str, *, seconds: float, grown_mib: float, cwd: Path | None = None) -> tuple[str, str] | None:
    """Run `code` in a fresh interpreter (after its imports are in place) and assert that it ends within
    `seconds` and grows the peak RSS by less than `grown_mib`. Returns (exception class name, message), or
    None when the code raised nothing. Statements before a line `# measure` are setup, not measured."""
    setup, _, measured = code.rpartition("# measure\n")
    import subprocess
    import sys
    probe = setup + _BOUNDED_PROBE
    finished = subprocess.run([sys.executable, "-c", probe, measured], capture_output=True, text=True,
                              timeout=max(60.0, seconds * 4), cwd=cwd)
    assert finished.returncode == 0, finished.stderr[-2000:]
    report = json.loads(finished.stdout.strip().splitlines()[-1])
    assert report["seconds"] < seconds, f"took {report['seconds']:.2f} s (bound {seconds} s): {report['outcome']}"
    assert report["grown_mib"] < grown_mib, f"peak RSS grew {report['grown_mib']:.0f} MiB (bound {grown_mib} MiB)"
    return tuple(report["outcome"]) if report["outcome"] else None
