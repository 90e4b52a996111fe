"""Pickles that would run code, and hostile pickle streams, at safe_pickle and every reader using it
(see hostile_support)."""

from __future__ import annotations

import collections
import io
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hostile_support import (
    FUZZ,
    PAYLOADS,
    ReferenceUnpickler,
    Refused,
    assert_refused,
    edits,
    huge_memo_index,
    json_values,
    mutate,
    outcome,
    reference_stream,
    short_str,
    torch_zip,
)
from hypothesis import assume, event, example, given
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph import safe_pickle
from tensormorph.errors import CheckpointError, HeaderError, UnsafePickleError
from tensormorph.formats import dcp_metadata

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_safe_pickle_refuses_code_globals(tmp_path: Path, case: str) -> None:
    name, build = PAYLOADS[case]
    marker = tmp_path / "ran"
    payload = build(marker)
    assert_refused(lambda: safe_pickle.loads(payload, file="x.pkl"), name, marker, payload)


@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_torch_archive_with_code_pickle_is_refused(tmp_path: Path, case: str) -> None:
    name, build = PAYLOADS[case]
    marker = tmp_path / "ran"
    payload = build(marker)
    path = tmp_path / "malicious.pt"
    path.write_bytes(torch_zip(payload))
    error = assert_refused(lambda: tm.open(path), name, marker, payload)
    assert str(path) in str(error)
    marker.unlink()
    assert_refused(lambda: tm.open(path, "torch"), name, marker, payload)


DCP_HEAD = b"\x80\x04" + short_str("torch.distributed.checkpoint") + b"0"  # a string, popped: passes detection


@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_dcp_metadata_with_code_pickle_is_refused(tmp_path: Path, case: str) -> None:
    name, build = PAYLOADS[case]
    marker = tmp_path / "ran"
    payload = DCP_HEAD + build(marker)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(payload)
    error = assert_refused(lambda: tm.open(folder), name, marker, payload)
    assert ".metadata" in str(error)


def test_record_state_cannot_change_a_records_class(tmp_path: Path) -> None:
    """BUILD state naming __class__ (and friends) must not turn a stand-in record into something else."""
    payload = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}(X\x09\x00\x00\x00__class__"
               b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\nX\x0a\x00\x00\x00__reduce__cbuiltins\nset\nub.")
    record = outcome(lambda: safe_pickle.loads(payload, dcp_metadata.metadata_globals()))
    if not isinstance(record, CheckpointError):
        assert type(record).__name__ == "Metadata" and isinstance(record, safe_pickle.Record)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(payload)
    with pytest.raises(HeaderError):
        tm.open(folder)


@pytest.mark.parametrize("payload, error", [
    (b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x05\x00\x00\x00rot13\x86R.", HeaderError),
    (b"\x80\x02ccollections\nOrderedDict\nK\x05\x85R.", HeaderError),
    (b"\x80\x02ctorch\nSize\nK\x05\x85R.", HeaderError),
    (b"\x80\x02}" * 3, HeaderError),
    (b"(" * 100000 + b".", HeaderError),
    (b"\x80\x05\x95\xff\xff\xff\xff\xff\xff\xff\x7f.", HeaderError),
    (b"", HeaderError),
    (b"\x80\x02K\x01Q.", UnsafePickleError),  # a persistent id with no persistent loader
])
def test_safe_pickle_malformed_streams(payload: bytes, error: type) -> None:
    with pytest.raises(error):
        safe_pickle.loads(payload, file="x.pkl")


PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray, safe_pickle.TorchDType)


def only_plain_values(value: Any, seen: set[int] | None = None) -> bool:
    """True when `value` is built only of harmless types (pickles may be self-referential)."""
    seen = set() if seen is None else seen
    if isinstance(value, PLAIN_TYPES):
        return True
    if id(value) in seen:
        return True
    seen.add(id(value))
    if isinstance(value, dict):
        return all(only_plain_values(k, seen) and only_plain_values(v, seen) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(only_plain_values(v, seen) for v in value)
    if isinstance(value, safe_pickle.Record):
        return all(only_plain_values(v, seen) for v in vars(value).values())
    return False


class Changed(Exception):
    """The reference changed an object in a way safe_pickle refuses (with a HeaderError)."""


def _reachable(value: Any, into: dict[int, Any]) -> None:
    """Add `value` and every object inside it (elements, keys, values, instance attributes) to `into`."""
    pending = [value]
    while pending:
        item = pending.pop()
        if id(item) not in into:
            into[id(item)] = item
            if isinstance(item, (list, tuple, set, frozenset)):
                pending.extend(item)
            elif isinstance(item, dict):
                pending.extend([*item.keys(), *item.values()])
            attributes = getattr(item, "__dict__", None)
            if type(attributes) is dict:
                pending.extend([*attributes.keys(), *attributes.values()])


_BASE = pickle._Unpickler.dispatch


def _then(handler: Callable[[Any], None], after: Callable[[Any], None]) -> Callable[[Any], None]:
    return lambda self: (handler(self), after(self))[-1]


def _check(before: Callable[[Any], None], handler: Callable[[Any], None]) -> Callable[[Any], None]:
    return lambda self: (before(self), handler(self))[-1]


class PolicyReference(ReferenceUnpickler):
    """The reference unpickler held to safe_pickle's rules for changing objects, written from the rules: APPEND(S),
    SETITEM(S) and ADDITEMS change only a list, dict or set, and BUILD only a record that a call has just created
    (once); neither once the object, or one holding it, has been referred to again (GET, DUP) or passed to a call
    (so no cycles). Extension codes (copyreg's process-wide registry) are refused."""

    def __init__(self, stream: io.BytesIO):
        super().__init__(stream)
        self.referred: dict[int, Any] = {id(v): v for v in safe_pickle.BASE_GLOBALS.values()}
        self.created: dict[int, Any] = {}

    def refer(self, value: Any) -> None:
        _reachable(value, self.referred)

    def note(self) -> None:
        value = self.stack[-1]
        if id(value) not in self.referred and (isinstance(value, collections.OrderedDict)
                                               or getattr(type(value), "__setstate__", None) is not None):
            self.created[id(value)] = value

    def change(self, target: Any, kind: type, parts: int) -> None:
        if not isinstance(target, kind) or (parts and id(target) in self.referred):
            raise Changed(f"{type(target).__name__} changed")

    def build(self) -> None:
        target, state = self.stack[-2], self.stack[-1]
        if self.created.pop(id(target), None) is not target:
            raise Changed("BUILD on an object no call created")
        self.change(target, object, 1)
        if isinstance(target, collections.OrderedDict) and type(state) is not dict:
            raise Changed("OrderedDict state that is not a dict")

    def extension(self) -> None:
        raise Changed("extension code")

    dispatch = {
        **_BASE,
        **{op[0]: _then(_BASE[op[0]], lambda self: self.refer(self.stack[-1]))
           for op in (pickle.GET, pickle.BINGET, pickle.LONG_BINGET, pickle.DUP)},
        pickle.REDUCE[0]: _then(_check(lambda self: self.refer(self.stack[-1]), _BASE[pickle.REDUCE[0]]), note),
        pickle.NEWOBJ[0]: _then(_check(lambda self: self.refer(self.stack[-1]), _BASE[pickle.NEWOBJ[0]]), note),
        pickle.NEWOBJ_EX[0]: _then(_check(lambda self: self.refer(self.stack[-2:]), _BASE[pickle.NEWOBJ_EX[0]]),
                                   note),
        pickle.OBJ[0]: _then(_check(lambda self: self.refer(self.stack[1:]), _BASE[pickle.OBJ[0]]), note),
        pickle.INST[0]: _then(_check(lambda self: self.refer(self.stack[:]), _BASE[pickle.INST[0]]), note),
        pickle.APPEND[0]: _check(lambda self: self.change(self.stack[-2], list, 1), _BASE[pickle.APPEND[0]]),
        pickle.SETITEM[0]: _check(lambda self: self.change(self.stack[-3], dict, 1), _BASE[pickle.SETITEM[0]]),
        **{op[0]: _check(lambda self, kind=kind: self.change(self.metastack[-1][-1], kind, len(self.stack)),
                         _BASE[op[0]])
           for op, kind in ((pickle.APPENDS, list), (pickle.SETITEMS, dict), (pickle.ADDITEMS, set))},
        pickle.BUILD[0]: _check(build, _BASE[pickle.BUILD[0]]),
        pickle.EXT1[0]: extension,
        pickle.EXT2[0]: extension,
        pickle.EXT4[0]: extension,
    }


def pickle_verdict(payload: bytes) -> tuple[type[CheckpointError] | None, Any]:
    """(error class, None) that safe_pickle.loads must raise for `payload`, or (None, value) it must return."""
    try:
        return None, PolicyReference(io.BytesIO(reference_stream(payload))).load()
    except Refused:
        return UnsafePickleError, None
    except CheckpointError as exc:  # raised by a stand-in, such as _codecs.encode with another encoding
        return type(exc), None
    except Exception:  # a malformed stream, or a change safe_pickle refuses (Changed)
        return HeaderError, None


@FUZZ
@given(payload=st.binary(max_size=200) | st.builds(lambda v: pickle.dumps(v, protocol=4), json_values).flatmap(
    lambda seed: st.builds(mutate, st.just(seed), edits(len(seed)))))
@example(payload=b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00]\x94(K\x01K\x02e.")
@example(payload=b"\x80\x05\x96\x03\x00\x00\x00\x00\x00\x00\x00abc.")
@example(payload=b"\x80\x04]\x94h\x00a.")  # a list that holds itself: refused
@example(payload=b"\x80\x04]\x94\x85h\x00K\x01a.")  # a list changed after a tuple took it in: refused
@example(payload=b"\x80\x02ctorch\nfloat16\n}b.")  # BUILD onto a shared dtype: refused
@example(payload=b"\x80\x02ccollections\nOrderedDict\n)R}X\x01\x00\x00\x00aK\x01sb.")  # a state dict's _metadata
@example(payload=b"\x80\x05\x96\xff\xff\xff\xff\x00\x00\x00\x00abc.")
@example(payload=b"\x80\x02cos\nsystem\n.")
def test_safe_pickle_random_bytes(payload: bytes) -> None:
    """safe_pickle decodes any stream exactly as the standard unpickler with the same allowlist would, held to the
    rules for changing objects (PolicyReference)."""
    assume(not huge_memo_index(payload))
    expected, value = pickle_verdict(payload)
    result = outcome(lambda: safe_pickle.loads(payload, file="x.pkl"))
    event(type(result).__name__ if isinstance(result, CheckpointError) else "value")
    if expected is not None:
        assert type(result) is expected, (result, expected)
        assert "x.pkl" in str(result)
        return
    assert not isinstance(result, CheckpointError), result
    assert only_plain_values(result)
    assert type(result) is type(value) and repr(result) == repr(value)


def test_pickle_memo_index_cannot_demand_gigabytes() -> None:
    probe = (
        "import resource, sys\n"
        "from tensormorph import safe_pickle, errors\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    safe_pickle.loads(b'\\x80\\x02K\\x01r\\x00\\x00\\x00\\x02.')\n"
        "except errors.CheckpointError:\n"
        "    pass\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    grown_kib = int(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                                   timeout=60).stdout)
    assert grown_kib < 64 * 1024, f"unpickling 12 bytes grew the peak RSS by {grown_kib // 1024} MiB"


def test_pickle_bytearray_length_cannot_demand_gigabytes() -> None:
    # protocol 5's BYTEARRAY8 announces its length; pickle itself allocates that much before reading
    forged = b"\x80\x05\x96" + (1 << 40).to_bytes(8, "little") + b"abc."
    with pytest.raises(HeaderError, match="BYTEARRAY8 claims 1099511627776 bytes, but only 4 remain"):
        safe_pickle.loads(forged)
