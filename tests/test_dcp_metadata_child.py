"""DCP `.metadata` read by CPython's C unpickler in a limited child process (formats/dcp_metadata).

The fast path must give what the in-process allowlist unpickler gives on real checkpoints, bit for bit, and end the
C unpickler's known attacks (a forged memo index or length, keys of one hash value, a global off the allowlist, a
"billion laughs" of shared references) as an error naming the file."""

from __future__ import annotations

import pickle
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hostile_support import FUZZ, PAYLOADS, copy_dcp, edits, load_metadata, mutate, outcome, save_metadata
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hostile_pickle_work import colliding_pairs, items

import tensormorph as tm
from tensormorph.errors import HeaderError, UnsafePickleError
from tensormorph.formats import dcp_metadata

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _without_the_native_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the child and the in-process unpickler: the native reader (test_dcp_native) is off."""
    monkeypatch.setattr(dcp_metadata, "_dcp_pickle", None)


@pytest.fixture(scope="module")
def wide_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real dcp.save of 6,000 tensors of several dtypes and shapes plus objects: a .metadata over 1 MB."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("wide") / "ckpt"
    g = torch.Generator().manual_seed(0)
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.float16)
    state: dict[str, Any] = {f"model.layers.{i}.block.w{i % 7}": torch.randn(3, i % 5 + 1, generator=g).to(
        dtypes[i % 4]) for i in range(6000)}
    state.update({"step": 11, "schedule": {"lr": 0.5, "name": "cosine"}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))
    assert (folder / ".metadata").stat().st_size >= dcp_metadata.CHILD_FROM_BYTES
    return folder


def real_metadata(folders: list[Path]) -> list[bytes]:
    return [p.read_bytes() for folder in folders for p in sorted(folder.glob("*.metadata"))]


def test_the_child_gives_the_in_process_summary_on_real_checkpoints(
        wide_dcp: Path, dcp_ckpt: Path, dcp_zstd_ckpt: Path, dcp_per_rank_ckpt: Path, dcp_llama_2d: Path,
        dcp_seed: Path) -> None:
    blobs = real_metadata([wide_dcp, dcp_ckpt, dcp_zstd_ckpt, dcp_per_rank_ckpt, dcp_llama_2d, dcp_seed])
    assert len(blobs) == 9  # per-rank __N.metadata files as well
    for blob in blobs:
        fast = dcp_metadata.summary_in_child(blob, "x/.metadata")
        assert fast == dcp_metadata.summary_in_process(blob, "x/.metadata")
        assert fast["entries"] and fast["storage"]


def _described(ck: Any) -> Any:
    tensors = {name: (t.dtype, t.shape, [(c.offsets, c.shape, c.file, c.byte_range, c.ranks) for c in t.chunks])
               for name, t in ck.tensors.items()}
    return tensors, {name: o.value() for name, o in ck.objects.items()}, ck.metadata


def sampled(ck: Any) -> list[str]:
    return sorted(ck)[::50]  # values of one tensor in 50: the chunks of all are compared above


@pytest.mark.parametrize("name", ["wide_dcp", "dcp_per_rank_ckpt", "dcp_zstd_ckpt"])
def test_open_through_the_child_reads_the_same_checkpoint(name: str, request: pytest.FixtureRequest,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    folder = request.getfixturevalue(name)
    children = []
    monkeypatch.setattr(dcp_metadata, "summary_in_child",
                        lambda data, where, real=dcp_metadata.summary_in_child: children.append(where)
                        or real(data, where))
    with monkeypatch.context() as patched:
        patched.setattr(dcp_metadata, "CHILD_FROM_BYTES", 1 << 40)
        with tm.open(folder, "dcp") as ck:
            slow, slow_values = _described(ck), {n: ck[n].full().tobytes() for n in sampled(ck)}
    assert children == []
    monkeypatch.setattr(dcp_metadata, "CHILD_FROM_BYTES", 0)
    with tm.open(folder, "dcp") as ck:
        assert _described(ck) == slow
        assert {n: ck[n].full().tobytes() for n in sampled(ck)} == {n: slow_values[n] for n in sampled(ck)}
    assert children and all(where.endswith("metadata") for where in children)


@settings(FUZZ, max_examples=60)  # each example starts a child
@given(data=st.data())
def test_mutated_metadata_reads_alike_in_the_child(dcp_seed: Path, data: st.DataObject) -> None:
    """Whatever the bytes, the child and the in-process unpickler agree: both give the same summary, or both refuse
    (which refusal may differ: the C unpickler checks a frame's length before it reads what the frame holds)."""
    seed = (dcp_seed / ".metadata").read_bytes()
    blob = mutate(seed, data.draw(edits(len(seed))))
    here = outcome(lambda: dcp_metadata.summary_in_process(blob, "s/.metadata"))
    there = outcome(lambda: dcp_metadata.summary_in_child(blob, "s/.metadata"))
    if isinstance(here, dict) or isinstance(there, dict):
        assert there == here
    else:
        assert isinstance(there, HeaderError | UnsafePickleError), there
        assert "s/.metadata" in str(there)


@pytest.mark.parametrize("forged", [
    pytest.param(b"\x80\x04N" + b"r" + struct.pack("<I", 0xFFFFFFF0) + b".", id="LONG_BINPUT 2**32"),
    pytest.param(b"\x80\x04N" + b"r" + struct.pack("<I", 1 << 27) + b".", id="LONG_BINPUT 2**27"),
    pytest.param(b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"xy.", id="BINBYTES8 of a terabyte"),
    pytest.param(b"\x80\x04\x96" + struct.pack("<Q", 1 << 40) + b"xy.", id="BYTEARRAY8 of a terabyte"),
])
def test_forged_memo_index_or_length_is_refused_within_the_memory_limit(forged: bytes) -> None:
    with pytest.raises(HeaderError) as info:
        dcp_metadata.summary_in_child(forged, "ckpt/.metadata")
    assert "ckpt/.metadata" in str(info.value)
    assert "memory" in str(info.value) or "truncated" in str(info.value) or "malformed" in str(info.value)


def test_forged_memo_index_in_a_checkpoint_is_named(dcp_seed: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ck")
    (folder / ".metadata").write_bytes(b"\x80\x04N" + b"r" + struct.pack("<I", 0xFFFFFFF0) + b".")
    monkeypatch.setattr(dcp_metadata, "CHILD_FROM_BYTES", 0)
    with pytest.raises(HeaderError, match=r"needs more than \d+ bytes of memory") as info:
        tm.open(folder, "dcp")
    assert info.value.file is not None and info.value.file.endswith(".metadata")


def test_keys_of_one_hash_value_end_at_the_cpu_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dict of 60,000 keys sharing one hash value: the C unpickler fills it in quadratic time, so the child is
    stopped at its CPU limit (1 s here) and the reader says so."""
    forged = b"\x80\x02}(" + items(colliding_pairs(60_000)) + b"u."
    monkeypatch.setattr(dcp_metadata, "CHILD_CPU_S", 1)
    monkeypatch.setattr(dcp_metadata, "CHILD_CPU_S_PER_MB", 0)
    with pytest.raises(HeaderError, match=r"used more than its 1 s of CPU time"):
        dcp_metadata.summary_in_child(forged, "ckpt/.metadata")


@pytest.mark.parametrize("case", ["GLOBAL os.system", "STACK_GLOBAL os.system", "subprocess.Popen"])
def test_a_global_off_the_allowlist_is_refused_as_in_process(case: str, tmp_path: Path) -> None:
    name, build = PAYLOADS[case]
    marker = tmp_path / "ran"
    payload = build(marker)
    with pytest.raises(UnsafePickleError) as child:
        dcp_metadata.summary_in_child(payload, "ckpt/.metadata")
    with pytest.raises(UnsafePickleError) as here:
        dcp_metadata.summary_in_process(payload, "ckpt/.metadata")
    assert str(child.value) == str(here.value) and name in str(child.value)
    assert not marker.exists()


def aliased_expansion(seed: Path) -> bytes:
    """The seed's metadata with 2,000 names that all refer to one tensor entry of 5,000 chunks: 10 million chunks to
    write out from a pickle of about 100 KB."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    metadata = load_metadata(seed)
    entry = metadata.state_dict_metadata["w"]
    entry.chunks = [ChunkStorageMetadata(torch.Size([i, 0]), torch.Size([1, 6])) for i in range(5000)]
    for i in range(2000):
        metadata.state_dict_metadata[f"alias.{i}"] = entry
    blob = pickle.dumps(metadata, protocol=4)
    assert len(blob) < 400_000
    return blob


def test_shared_references_cannot_expand_the_summary(dcp_seed: Path) -> None:
    """Refused by the walk's budget, in the child as in process."""
    blob = aliased_expansion(dcp_seed)
    for read in (dcp_metadata.summary_in_child, dcp_metadata.summary_in_process):
        with pytest.raises(HeaderError, match="expands to more than") as info:
            read(blob, "ckpt/.metadata")
        assert "ckpt/.metadata" in str(info.value)


def test_a_real_save_of_the_seed_still_reads_after_a_round_trip(dcp_seed: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """save_metadata rewrites .metadata with protocol 4 (DCP's own default may differ): both paths read it."""
    folder = copy_dcp(dcp_seed, tmp_path / "ck")
    save_metadata(folder, load_metadata(folder))
    monkeypatch.setattr(dcp_metadata, "CHILD_FROM_BYTES", 0)
    with tm.open(folder, "dcp") as ck:
        assert np.array_equal(ck["w"].full(), np.arange(24, dtype=np.float32).reshape(4, 6))
        assert ck.objects["step"].value() == 7


def test_without_limits_the_child_reads_nothing_and_the_file_is_read_in_process(
        wide_dcp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the child cannot set its limits (macOS has no RLIMIT_AS; here one too large for the platform), it
    refuses to unpickle, and the reader falls back to the in-process unpickler."""
    blob = (wide_dcp / ".metadata").read_bytes()
    monkeypatch.setattr(dcp_metadata, "CHILD_MEMORY", 2**70)
    monkeypatch.setattr(dcp_metadata, "CHILD_MEMORY_PER_BYTE", 0)
    with pytest.raises(dcp_metadata.LimitsUnavailable):
        dcp_metadata.summary_in_child(blob, "ckpt/.metadata")
    with tm.open(wide_dcp, "dcp") as ck:
        assert len(ck.tensors) == 6000 and ck.objects["step"].value() == 11


def test_metadata_files_that_disagree_on_an_entry_kind_are_refused(dcp_per_rank_ckpt: Path, tmp_path: Path) -> None:
    """Per-rank `__N.metadata` files: one declaring "w" as bytes where the others declare a tensor is an error
    naming "w", not a silently dropped chunk list."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = copy_dcp(dcp_per_rank_ckpt, tmp_path / "ck")
    rank_file = sorted(folder.glob("__*.metadata"))[-1]
    metadata = pickle.loads(rank_file.read_bytes())  # our own fixture
    metadata.state_dict_metadata["w"] = BytesStorageMetadata()
    rank_file.write_bytes(pickle.dumps(metadata, protocol=4))
    with pytest.raises(HeaderError, match="declare it both as") as info:
        tm.open(folder, "dcp")
    assert info.value.tensor == "w"
