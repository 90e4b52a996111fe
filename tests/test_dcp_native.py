"""The native `.metadata` reader (formats._dcp_pickle, from csrc/dcp_pickle/): the child's summary, or it declines.

On every real DCP checkpoint it must give, bit for bit, the summary of the C unpickler in the limited child. On any
other bytes it may only give that same summary or decline (None); then the general path reads the file and names
what is wrong with it. Its bounds hold whatever the bytes: memory, the memo, keys, nesting."""

from __future__ import annotations

import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from hostile_support import FUZZ, PAYLOADS, edits, load_metadata, mutate, outcome
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dcp_metadata_child import aliased_expansion, real_metadata, wide_dcp  # noqa: F401  (a fixture)
from test_hostile_pickle_work import colliding_pairs, items

import tensormorph as tm
from tensormorph import safe_pickle
from tensormorph.errors import HeaderError, UnsafePickleError
from tensormorph.formats import dcp_metadata, dcp_summary

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(dcp_metadata._dcp_pickle is None and shutil.which("cc") is None,
                                 reason="NATIVE READER NOT BUILT: no C compiler when the package was installed")]


def test_the_native_reader_is_built_where_a_compiler_is() -> None:
    """setup.py builds it as optional (an install without a compiler still works): where there is one, a missing
    module is a failed build, not a reason to skip."""
    assert dcp_metadata._dcp_pickle is not None, "a C compiler is here, but tensormorph.formats._dcp_pickle is not"


def native(blob: bytes, memory: int = 1 << 30) -> dict | None:
    return dcp_metadata._dcp_pickle.summarize(blob, dcp_metadata._native_allowlist(),
                                              safe_pickle.expansion_budget(len(blob)), memory,
                                              dcp_summary.STATE_RECORDS)


def test_real_checkpoints_read_natively_as_the_child_reads_them(
        wide_dcp: Path, dcp_ckpt: Path, dcp_zstd_ckpt: Path, dcp_per_rank_ckpt: Path,  # noqa: F811
        dcp_llama_2d: Path, dcp_seed: Path) -> None:
    blobs = real_metadata([wide_dcp, dcp_ckpt, dcp_zstd_ckpt, dcp_per_rank_ckpt, dcp_llama_2d, dcp_seed])
    assert len(blobs) == 9
    for blob in blobs:
        summary = dcp_metadata.native_summary(blob)
        assert summary is not None  # DCP's own files are never declined
        assert summary == dcp_metadata.summary_in_child(blob, "x/.metadata")
        assert summary == dcp_metadata.summary_in_process(blob, "x/.metadata")


def test_megatron_save_plans_read_natively_as_the_child_reads_them() -> None:
    """Megatron-Core's dist_checkpointing keeps every rank's save plan in the metadata (enums called with their
    value): read natively too, equal to the child's summary."""
    from fixtures import megatron_builders
    from fixtures.cache import cached_build

    single = cached_build("megatron", megatron_builders, lambda folder: megatron_builders.build(folder / "ckpt"))
    tp_dp = cached_build("megatron-tp-dp", megatron_builders, megatron_builders.build_tp_dp)
    blobs = real_metadata([single / "ckpt", tp_dp / megatron_builders.FULLY_PARALLEL,
                           tp_dp / megatron_builders.MAIN_REPLICAS])
    assert len(blobs) == 3 and all(b"all_local_plans" in blob for blob in blobs)
    for blob in blobs:
        summary = dcp_metadata.native_summary(blob)
        assert summary is not None
        assert summary == dcp_metadata.summary_in_child(blob, "x/.metadata")


def test_open_reads_the_same_checkpoint_with_and_without_the_native_reader(
        dcp_llama_2d: Path, dcp_zstd_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for folder in (dcp_llama_2d, dcp_zstd_ckpt):
        with tm.open(folder, "dcp") as ck:
            fast = {n: (t.dtype, t.shape, [(c.offsets, c.shape, c.file, c.byte_range) for c in t.chunks])
                    for n, t in ck.tensors.items()}
            fast_values = {n: ck[n].full().tobytes() for n in list(ck)[:8]}
            fast_metadata = ck.metadata
        with monkeypatch.context() as patched:
            patched.setattr(dcp_metadata, "_dcp_pickle", None)
            with tm.open(folder, "dcp") as ck:
                assert {n: (t.dtype, t.shape, [(c.offsets, c.shape, c.file, c.byte_range) for c in t.chunks])
                        for n, t in ck.tensors.items()} == fast
                assert {n: ck[n].full().tobytes() for n in list(ck)[:8]} == fast_values
                assert ck.metadata == fast_metadata


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_mutated_metadata_gives_the_childs_summary_or_is_declined(dcp_seed: Path, data: st.DataObject) -> None:
    seed = (dcp_seed / ".metadata").read_bytes()
    blob = mutate(seed, data.draw(edits(len(seed))))
    mine = native(blob)
    if mine is None:
        return
    assert mine == outcome(lambda: dcp_metadata.summary_in_process(blob, "s/.metadata"))


@settings(FUZZ, max_examples=300)
@given(blob=st.binary(max_size=300), opcodes=st.lists(st.sampled_from(
    [b"\x80\x04", b"N", b"}", b"]", b")", b"(", b"t", b"\x85", b"\x86", b"a", b"e", b"s", b"u", b"\x94", b"h\x00",
     b"h\x01", b"q\x00", b"q\x05", b"K\x07", b"J\xff\xff\xff\xff", b"\x8a\x01\x80", b"\x8c\x01a", b"\x8c\x01\xff",
     b"\x93", b"\x81", b"R", b"b", b"."]), max_size=60))
def test_any_bytes_give_the_in_process_summary_or_are_declined(blob: bytes, opcodes: list[bytes]) -> None:
    """Random bytes, and random runs of the opcodes it reads, never crash it: it declines, or agrees."""
    for candidate in (blob, b"".join(opcodes)):
        mine = native(candidate)
        if mine is not None:
            assert mine == outcome(lambda c=candidate: dcp_metadata.summary_in_process(c, "s/.metadata"))


@pytest.mark.parametrize("forged", [
    pytest.param(b"\x80\x04N" + b"r" + struct.pack("<I", 0xFFFFFFF0) + b".", id="LONG_BINPUT 2**32"),
    pytest.param(b"\x80\x04N" + b"h\x05.", id="BINGET of an unset slot"),
    pytest.param(b"\x80\x04X" + struct.pack("<I", 0xFFFFFFF0) + b"xy.", id="BINUNICODE past the end"),
    pytest.param(b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62) + b"xy.", id="BINUNICODE8 of 2**62 bytes"),
    pytest.param(b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N.", id="FRAME past the end"),
    pytest.param(b"\x80\x04}(K\x01N\x8a\x08" + struct.pack("<q", 2**61 - 1 + 1) + b"Nu.", id="an int key"),
    pytest.param(b"\x80\x04" + b"]" * 5000 + b"a" * 4999 + b".", id="lists nested 5,000 deep"),
])
def test_forged_or_unsupported_pickles_are_declined(forged: bytes) -> None:
    assert native(forged) is None


def test_a_global_off_the_allowlist_is_declined_and_refused_by_the_general_path(tmp_path: Path) -> None:
    for case in ("STACK_GLOBAL os.system", "GLOBAL os.system", "subprocess.Popen"):
        name, build = PAYLOADS[case]
        payload = build(tmp_path / "ran")
        assert native(payload) is None
        with pytest.raises(UnsafePickleError, match=name):
            dcp_metadata.read_summary(_Bytes(payload), ".metadata")
        assert not (tmp_path / "ran").exists()


def test_keys_of_one_hash_value_are_declined_without_hashing_them() -> None:
    """60,000 integer keys sharing one hash value: the native reader takes only strings and records as keys."""
    forged = b"\x80\x02}(" + items(colliding_pairs(60_000)) + b"u."
    assert native(forged) is None


def test_memory_past_the_limit_is_declined() -> None:
    """Many values in a small pickle: past the memory it was given, the reader declines (the child, limited, then
    reads the file)."""
    blob = b"\x80\x04](" + b"]" * 200_000 + b"e."  # 200,000 empty lists in one list
    assert native(blob, memory=1 << 20) is None
    assert native(blob) is None  # a list is no DCP Metadata, whatever the memory


def test_shared_references_cannot_expand_the_summary(dcp_seed: Path) -> None:
    """10 million chunks through shared references (aliased_expansion): declined by the walk's budget, and the
    general path gives its error."""
    blob = aliased_expansion(dcp_seed)
    assert native(blob) is None
    with pytest.raises(HeaderError, match="expands to more than"):
        dcp_metadata.read_summary(_Bytes(blob), ".metadata")


def test_one_entry_of_many_chunks_sharing_one_long_list_is_stopped_by_the_budget(dcp_seed: Path) -> None:
    """3,000 chunks of one tensor whose offsets are all one list of 3,000 numbers: 18 million numbers to write out
    from a small pickle. Declined natively, and refused by the budget in the child and in process alike."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    metadata = load_metadata(dcp_seed)
    shared = torch.Size([0] * 3000)
    metadata.state_dict_metadata["w"].chunks = [ChunkStorageMetadata(shared, shared) for _ in range(3000)]
    blob = pickle.dumps(metadata, protocol=4)
    assert len(blob) < 200_000
    assert native(blob) is None
    for read in (dcp_metadata.summary_in_child, dcp_metadata.summary_in_process):
        with pytest.raises(HeaderError, match="expands to more than"):
            read(blob, "ckpt/.metadata")


def test_a_key_set_twice_keeps_its_first_place_and_last_value(dcp_seed: Path) -> None:
    """DCP's dicts as a dict holds them: a name set again (a forged file) keeps its first place and last value."""
    blob = (dcp_seed / ".metadata").read_bytes()
    names = list(load_metadata(dcp_seed).state_dict_metadata)
    assert names.index("w") < names.index("h")
    at = blob.index(b"\x8c\x01h")  # the state dict's key "h", named "w" again
    forged = blob[:at] + b"\x8c\x01w" + blob[at + 3:]
    mine = native(forged)
    assert mine is not None
    assert mine == dcp_metadata.summary_in_process(forged, "s/.metadata")
    assert [e[0] for e in mine["entries"]] == [n for n in names if n != "h"]
    assert mine["entries"][0][2] == "bfloat16"  # "w" now holds what "h" declared


class _Bytes:
    """The ByteStore read_summary needs, over bytes in memory."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def describe(self, name: str) -> str:
        return f"mem/{name}"

    def size(self, name: str) -> int:
        return len(self.data)

    def read(self, name: str, offset: int, size: int) -> bytes:
        return self.data[offset:offset + size]


def test_a_tensor_of_100000_chunks_reads_natively(tmp_path: Path) -> None:
    """One tensor split into 100,000 chunks (DCP's own records, pickled as dcp.save does): read natively, equal to
    the child's summary, and opened with every chunk in place (a quadratic step would time the test out)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    count, row = 100_000, 16
    chunks = [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 4])) for i in range(count)]
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([count, 4]), chunks)
    storage = {MetadataIndex("w", torch.Size([i, 0])): _StorageInfo("__0_0.distcp", i * row, row)
               for i in range(count)}
    blob = pickle.dumps(Metadata({"w": entry}, storage_data=storage), protocol=4)
    summary = native(blob)
    assert summary is not None and len(summary["entries"][0][4]) == count == len(summary["storage"])
    assert summary == dcp_metadata.summary_in_child(blob, "x/.metadata")
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / ".metadata").write_bytes(blob)
    (folder / "__0_0.distcp").write_bytes(bytes(count * row))
    with tm.open(folder, "dcp") as ck:
        chunks_read = ck["w"].chunks
        assert len(chunks_read) == count
        assert [c.offsets for c in chunks_read[:3]] == [(0, 0), (1, 0), (2, 0)]
        assert chunks_read[-1].byte_range == ((count - 1) * row, count * row)


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


METADATA_MODULE = "torch.distributed.checkpoint.metadata"


@pytest.mark.parametrize("case", ["a frame ending inside an opcode", "invalid UTF-8 in a field's name",
                                  "a __setstate__ field", "path joins of 100,000 parts each"])
def test_what_the_c_unpickler_reads_otherwise_is_declined(dcp_seed: Path, case: str) -> None:
    """Inputs on which the C unpickler misreads, fails or works quadratically (found by review): declined, so that
    the general path gives its answer."""
    seed = (dcp_seed / ".metadata").read_bytes()
    if case == "a frame ending inside an opcode":  # the C unpickler drops the frame's rest and misreads what follows
        assert seed[2] == 0x95  # FRAME, then its 8-byte length
        inside = seed.index(b"\x8c", 40) + 3  # within a short string's bytes
        blob = seed[:3] + struct.pack("<Q", inside - 11) + seed[11:]
    elif case == "invalid UTF-8 in a field's name":  # the C unpickler decodes every string, read or not
        blob = seed.replace(b"\x8c\x0aproperties", b"\x8c\x0aprop\xderties")
    elif case == "a __setstate__ field":  # makes the C unpickler call it on a later BUILD of the same record
        record = _text(METADATA_MODULE) + _text("Metadata") + b"\x93)\x81"
        shadow = _text("__setstate__") + _text("torch") + _text("Size") + b"\x93"
        empty = _text("state_dict_metadata") + b"}" + _text("storage_data") + b"}"
        entry = _text("x") + _text(METADATA_MODULE) + _text("BytesStorageMetadata") + b"\x93)\x81"
        blob = (b"\x80\x04" + record + b"}(" + shadow + empty + b"ub"
                + b"}(" + _text("state_dict_metadata") + b"}(" + entry + b"uub.")
    else:  # each REDUCE of pathlib.PosixPath on a shared tuple of 100,000 parts would join them all
        blob = (b"\x80\x04" + _text("a") + b"\x94" + _text("pathlib") + _text("PosixPath") + b"\x93\x94"
                + b"(" + b"h\x00" * 100_000 + b"t\x94" + b"h\x01h\x02R" * 40 + b".")
    assert blob != seed
    assert native(blob) is None
