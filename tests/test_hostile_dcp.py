"""Hostile DCP checkpoints: mutated .metadata and data files, and forged records (see hostile_support)."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch  # a dev dependency: the seeds are made by torch itself
from hostile_support import (
    FUZZ,
    PAYLOADS,
    ReferenceUnpickler,
    Refused,
    archive_verdict,
    assert_refused,
    copy_dcp,
    edits,
    huge_memo_index,
    load_metadata,
    mutate,
    outcome,
    reference_stream,
    replace_file,
    save_metadata,
    torch_zip,
)
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph import safe_pickle
from tensormorph.errors import (
    CheckpointError,
    ChunkLayoutError,
    HeaderError,
    MissingFileError,
    TruncatedFileError,
    UnknownFormatError,
    UnsafePickleError,
)
from tensormorph.formats import dcp_metadata

pytestmark = pytest.mark.timeout(120)



def nul_in_stored_path(blob: bytes) -> bool:
    """A .metadata naming a data file with a NUL byte: a known bug (test_nul_byte_in_a_named_file_...)."""
    try:
        record = safe_pickle.loads(blob, dcp_metadata.metadata_globals())
    except CheckpointError:
        return False
    storage = getattr(record, "storage_data", None)
    return isinstance(storage, dict) and any("\x00" in str(getattr(v, "relative_path", "")) for v in storage.values())


def test_dcp_seed_reads_back(dcp_seed: Path) -> None:
    with tm.open(dcp_seed) as ck:
        assert ck.format == "dcp"
        assert np.array_equal(ck["w"].full(), np.arange(24, dtype=np.float32).reshape(4, 6))
        assert ck["h"].full().astype(np.float32).tolist() == [1.5, -2.0, 0.25, 8.0, -0.5]
        assert ck["i"][2, 1] == -(2**40)
        assert ck["m"].full().tolist() == [True, False, False, True]
        assert ck.objects["step"].value() == 7


@pytest.fixture(scope="module")
def dcp_scratch(dcp_seed: Path) -> Path:
    """A copy of the DCP seed whose files each fuzz example replaces."""
    return copy_dcp(dcp_seed, dcp_seed.parent / "scratch")


def seed_contents(folder: Path) -> tuple[dict[str, bytes], dict[str, Any]]:
    """(tensor bytes, object values) of the DCP seed: what an equivalent checkpoint must read."""
    with tm.open(folder) as ck:
        return {name: ck[name].full().tobytes() for name in ck}, {k: v.value() for k, v in ck.objects.items()}


def assert_reads_as_the_seed(folder: Path, format: str | None, seed: tuple[dict[str, bytes], dict[str, Any]]
                             ) -> None:
    tensors, objects = seed
    with tm.open(folder, format) as ck:
        assert {name: ck[name].full().tobytes() for name in ck} == tensors
        assert {k: v.value() for k, v in ck.objects.items()} == objects


class _DcpMetadataUnpickler(ReferenceUnpickler):
    """The reference unpickler with the DCP reader's stand-ins for DCP's metadata records."""

    allowed = dcp_metadata.metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise Refused(f"{module}.{name}") from None


def metadata_tree(blob: bytes) -> tuple[type[CheckpointError] | None, str]:
    """(error class, "") that unpickling a .metadata must raise, or (None, the decoded records' repr)."""
    try:
        return None, repr(_DcpMetadataUnpickler(io.BytesIO(reference_stream(blob))).load())
    except Refused:
        return UnsafePickleError, ""
    except CheckpointError as exc:
        return type(exc), ""
    except Exception:  # a malformed stream
        return HeaderError, ""


def detected_as_dcp(metadata: bytes) -> bool:
    return metadata[:1] == b"\x80" and b"torch.distributed.checkpoint" in metadata[:256]


@settings(FUZZ, suppress_health_check=[*FUZZ.suppress_health_check, HealthCheck.filter_too_much])
@given(data=st.data())
def test_dcp_metadata_mutated_bytes(dcp_seed: Path, dcp_scratch: Path, data: st.DataObject) -> None:
    """A .metadata whose pickle cannot be decoded is refused as the reference unpickler refuses it; one that
    decodes to the seed's very records opens as the seed. (Records that decode to other values are checked
    one field at a time by the dedicated DCP tests.)"""
    seed = (dcp_seed / ".metadata").read_bytes()
    blob = mutate(seed, data.draw(edits(len(seed))))
    assume(not huge_memo_index(blob))
    assume(not nul_in_stored_path(blob))
    expected, tree = metadata_tree(blob)
    assume(expected is not None or tree == metadata_tree(seed)[1])
    replace_file(dcp_scratch / ".metadata", blob)
    for format in ("dcp", None):
        if format is None and not detected_as_dcp(blob):
            assert type(outcome(lambda: tm.open(dcp_scratch))) is UnknownFormatError
        elif expected is None:
            event("the seed's records")
            assert_reads_as_the_seed(dcp_scratch, format, seed_contents(dcp_seed))
        else:
            event(expected.__name__)
            result = outcome(lambda format=format: tm.open(dcp_scratch, format))
            assert type(result) is expected, (result, expected)
            assert ".metadata" in str(result)


def _dcp_items(folder: Path) -> dict[str, tuple[int, int]]:
    """{fqn: (begin, end)} of every item in the seed's data file."""
    return {key.fqn: (info.offset, info.offset + info.length)
            for key, info in load_metadata(folder).storage_data.items()}


@FUZZ
@given(data=st.data())
def test_dcp_data_file_mutated_bytes(dcp_seed: Path, dcp_scratch: Path, data: st.DataObject) -> None:
    """A data file cut short is refused at open. Each item is a torch.save archive: one that reads as the seed's
    archive reads the seed's value, an unreadable one is refused when read (see archive_verdict). (Items that
    read as other archives are the torch.save tests' business.)"""
    (name,) = [p.name for p in dcp_seed.glob("*.distcp")]
    seed = (dcp_seed / name).read_bytes()
    changes, cut = data.draw(edits(len(seed), _zip_hot_ranges_all(seed)))
    blob = mutate(seed, (changes, None if cut == len(seed) else cut))
    items = _dcp_items(dcp_seed)
    replace_file(dcp_scratch / ".metadata", (dcp_seed / ".metadata").read_bytes())
    replace_file(dcp_scratch / name, blob)
    if len(blob) < len(seed):
        event("cut")
        result = outcome(lambda: tm.open(dcp_scratch))
        assert type(result) is TruncatedFileError and name in str(result), result
        return
    verdicts = {fqn: archive_verdict(blob[begin:end], seed[begin:end]) for fqn, (begin, end) in items.items()}
    assume("undecided" not in verdicts.values())
    tensors, objects = seed_contents(dcp_seed)
    with tm.open(dcp_scratch) as ck:
        for fqn, expected in verdicts.items():
            event(f"{'object' if fqn in objects else 'tensor'}: {expected.__name__ if expected else 'the seed'}")
            read = ck.objects[fqn].value if fqn in objects else (lambda fqn=fqn: ck[fqn].full().tobytes())
            result = outcome(read)
            if expected is None:
                assert result == (objects[fqn] if fqn in objects else tensors[fqn])
            else:
                assert type(result) is expected, (fqn, result)
                assert name in str(result)


def _zip_hot_ranges_all(blob: bytes) -> list[tuple[int, int]]:
    """The local headers, pickles and central directories of every archive concatenated in a .distcp file."""
    hot = []
    for marker in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"\x80\x02"):
        start = blob.find(marker)
        while start != -1 and len(hot) < 200:
            hot.append((start, min(len(blob), start + 80)))
            start = blob.find(marker, start + 1)
    return hot


def test_dcp_item_past_the_end_of_its_file(dcp_seed: Path, tmp_path: Path) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    metadata = load_metadata(folder)
    key = next(k for k in metadata.storage_data if k.fqn == "w")
    size = (folder / "__0_0.distcp").stat().st_size
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], offset=size - 10, length=20)
    save_metadata(folder, metadata)
    with pytest.raises(TruncatedFileError, match="lies past the end") as info:
        tm.open(folder)
    assert info.value.tensor == "w"


def test_dcp_missing_data_file(dcp_seed: Path, tmp_path: Path) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    (folder / "__0_0.distcp").unlink()
    with pytest.raises(MissingFileError):
        tm.open(folder)


def test_dcp_chunk_outside_its_tensor_is_a_layout_error(dcp_seed: Path, tmp_path: Path) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    metadata = load_metadata(folder)
    entry = metadata.state_dict_metadata["w"]
    metadata.state_dict_metadata["w"] = dataclasses.replace(entry, size=torch.Size([3, 6]))
    save_metadata(folder, metadata)
    with pytest.raises(ChunkLayoutError, match="outside the tensor's shape") as info:
        tm.open(folder)
    assert info.value.tensor == "w"


@pytest.mark.parametrize("case", ["GLOBAL os.system", "__reduce__ object", "subprocess.Popen"])
def test_dcp_object_item_with_code_pickle_is_refused(dcp_seed: Path, tmp_path: Path, case: str) -> None:
    name, build = PAYLOADS[case]
    marker = tmp_path / "ran"
    payload = build(marker)
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    archive = torch_zip(payload)
    (folder / "__0_1.distcp").write_bytes(archive)
    metadata = load_metadata(folder)
    key = next(k for k in metadata.storage_data if k.fqn == "step")
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path="__0_1.distcp",
                                                     offset=0, length=len(archive))
    save_metadata(folder, metadata)
    with tm.open(folder) as ck:  # opening reads only .metadata
        assert np.array_equal(ck["w"].full(), np.arange(24, dtype=np.float32).reshape(4, 6))
        assert_refused(ck.objects["step"].value, name, marker, payload)


def test_dcp_storage_keys_of_one_hash_value_are_refused(dcp_seed: Path, tmp_path: Path) -> None:
    """`.metadata` whose storage_data names many chunks of one tensor at offsets that share one hash value: the
    reader's (name, offsets) index would hash them all into one chain (quadratic), so they are counted first."""
    from test_hostile_pickle_work import LIMIT, colliding_pairs
    from torch.distributed.checkpoint.metadata import MetadataIndex

    folder = copy_dcp(dcp_seed, tmp_path / "ck")
    metadata = load_metadata(folder)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.offset is not None)
    for pair in colliding_pairs(LIMIT + 1):
        metadata.storage_data[MetadataIndex(index.fqn, torch.Size(pair))] = info
    save_metadata(folder, metadata)
    with pytest.raises(HeaderError, match=f"{LIMIT + 1} keys share one hash value"):
        tm.open(folder)
