"""Declared sizes that outgrow the bytes behind them: zstd DCP items, expanded (stride-0) torch tensors, storages
named many times, overlapping items and zip records (issue 14, defects 5, 7 and 9; see hostile_support)."""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch  # a dev dependency: the seeds are made by torch itself
import zstandard
from click.testing import CliRunner
from hostile_support import (
    FUZZ,
    copy_dcp,
    edits,
    load_metadata,
    mutate,
    outcome,
    replace_file,
    run_bounded,
    save_metadata,
    torch_zip,
)
from hypothesis import event, given
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph import torchzip
from tensormorph.cli import main
from tensormorph.errors import (
    BudgetExceededError,
    HeaderError,
    TruncatedFileError,
    UnsupportedError,
)
from tensormorph.formats import dcp as dcp_format
from tensormorph.formats.deepspeed import states as deepspeed_states
from tensormorph.formats.deepspeed import tensors as deepspeed_tensors
from tensormorph.storage import LocalFiles

pytestmark = pytest.mark.timeout(120)

TENSORS = {
    "x": torch.arange(4, dtype=torch.float32),
    "t": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # transposed
    "s": torch.arange(40, dtype=torch.int64)[3::7],  # a slice with a step, at an offset
    "n": torch.arange(48, dtype=torch.float32).reshape(6, 8)[1:5, ::3],  # rows and a step
    "b": (torch.arange(15, dtype=torch.float32) / 7).to(torch.bfloat16).reshape(5, 3).t(),
    "p": torch.arange(8).expand((1, -1)),  # a position_ids buffer as transformers registers it
    "e": torch.tensor([1.5, -2.0, 0.25]).expand(5, 3),  # a small expanded view: stride 0
}


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The values of a torch tensor as numpy holds them (bf16 through its bits)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.contiguous().numpy()


def cli(*args: Any) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def opening(path: Path, then: str = "") -> str:
    """Code for run_bounded: tm.open(path), then `then` on what it returns (the import is warmed in setup)."""
    return f"import tensormorph\n# measure\nimport tensormorph as tm\ntm.open({str(path)!r}){then}\n"


def assert_one_line_exit_2(result: Any, *fragments: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert all(fragment in lines[0] for fragment in fragments), (lines[0], fragments)


# ---------------------------------------------------------------------------
# zstd-compressed DCP items
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zstd_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DCP checkpoint saved by dcp.save with the ZStandard extension: every item 'stream.zstd/1'."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    folder = tmp_path_factory.mktemp("dcp_zstd") / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({**TENSORS, "step": 7, "cfg": {"lr": 0.1}},
                 storage_writer=dcp.FileSystemWriter(str(folder), _extensions=[ZStandard()]))
    return folder


def test_real_zstd_dcp_reads_bit_exact(zstd_seed: Path) -> None:
    metadata = load_metadata(zstd_seed)
    assert {tuple(info.transform_descriptors) for info in metadata.storage_data.values()} == {("stream.zstd/1",)}
    with tm.open(zstd_seed) as ck:
        for name, tensor in TENSORS.items():
            read = ck[name].full()
            assert read.dtype == as_numpy(tensor).dtype and read.tobytes() == as_numpy(tensor).tobytes(), name
        assert ck["n"][1:3, 1].tolist() == [19.0, 27.0]
        assert ck.objects["step"].value() == 7 and ck.objects["cfg.lr"].value() == 0.1
        assert [problem for _, problem in dcp_format.checksum_problems(ck)] == [None] * len(metadata.storage_data)


def zero_frame(nbytes: int) -> bytes:
    """A zstd frame of `nbytes` zero bytes made of RLE blocks: a few bytes per 128 KiB, no content size."""
    block = 1 << 17
    out = [b"\x28\xb5\x2f\xfd", b"\x00", bytes([7 << 3])]  # magic; no content size, no checksum; 128 KiB window
    for start in range(0, nbytes, block):
        size, last = min(block, nbytes - start), start + block >= nbytes
        out.append(struct.pack("<I", last | (1 << 1) | (size << 3))[:3] + b"\x00")  # an RLE block of zeros
    return b"".join(out)


def forge_item(seed: Path, folder: Path, name: str, shape: tuple[int, ...], item: bytes | None = None) -> Path:
    """A copy of `seed` whose .metadata declares `shape` for tensor `name` (one chunk) and, when given, whose
    item for it is `item` (a zstd frame), appended to the data file."""
    copy_dcp(seed, folder)
    metadata = load_metadata(folder)
    entry = metadata.state_dict_metadata[name]
    chunk = dataclasses.replace(entry.chunks[0], sizes=torch.Size(shape))
    metadata.state_dict_metadata[name] = dataclasses.replace(entry, size=torch.Size(shape), chunks=[chunk])
    if item is not None:
        key = next(k for k in metadata.storage_data if k.fqn == name)
        data = folder / metadata.storage_data[key].relative_path
        offset = data.stat().st_size
        replace_file(data, data.read_bytes() + item)
        metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], offset=offset, length=len(item))
    save_metadata(folder, metadata)
    return folder


def test_zstd_item_over_the_read_budget_is_refused_before_decompressing(zstd_seed: Path, tmp_path: Path) -> None:
    """An item declaring 3 GiB, whose frame really decompresses to 3 GiB (96 KiB of RLE blocks)."""
    folder = forge_item(zstd_seed, tmp_path / "ckpt", "x", (3 << 28,), zero_frame(3 << 30))
    result = run_bounded(opening(folder, "['x'][:2]"), seconds=5, grown_mib=100)
    assert result is not None and result[0] == "BudgetExceededError", result
    assert "'x'" in result[1] and "3.0 GiB, over the read budget of 2.0 GiB" in result[1]
    assert_one_line_exit_2(cli("stats", folder, "x"), "over the read budget", "__0_0.distcp")


def test_zstd_item_declaring_2_to_the_40_elements_is_a_budget_error(zstd_seed: Path, tmp_path: Path) -> None:
    folder = forge_item(zstd_seed, tmp_path / "ckpt", "x", (2**40,))
    with tm.open(folder) as ck:  # opening reads only .metadata
        with pytest.raises(BudgetExceededError, match="4.0 TiB, over the read budget") as info:
            ck["x"][:1]
        assert info.value.tensor == "x" and "__0_0.distcp" in str(info.value)
        assert ck["t"].full().tobytes() == as_numpy(TENSORS["t"]).tobytes()  # the others still read
    assert_one_line_exit_2(cli("stats", folder, "x"), "over the read budget")


def _archive(folder: Path, name: str) -> bytes:
    """The decompressed torch.save archive of an item of the seed."""
    metadata = load_metadata(folder)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == name)
    raw = (folder / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    return zstandard.ZstdDecompressor().stream_reader(raw).read()


@pytest.mark.parametrize(("case", "message"), [
    ("more", "decompresses to more than the 1048592 bytes its chunk allows"),  # 16 bytes + 1 MiB of archive
    ("fewer", "bytes, fewer than the 4096 bytes of its chunk"),  # the archive of 4 floats (~1.5 KB) for 1024
])
def test_zstd_item_decompressing_to_other_than_its_chunk_is_a_header_error(zstd_seed: Path, tmp_path: Path,
                                                                          case: str, message: str) -> None:
    if case == "more":  # a frame of the real archive and 2 MiB past it
        frame = zstandard.ZstdCompressor().compress(_archive(zstd_seed, "x") + bytes(2 << 20))
        folder = forge_item(zstd_seed, tmp_path / "ckpt", "x", (4,), frame)
    else:
        folder = forge_item(zstd_seed, tmp_path / "ckpt", "x", (1024,))
    with tm.open(folder) as ck, pytest.raises(HeaderError) as info:
        ck["x"].full()
    assert info.value.tensor == "x" and "__0_0.distcp" in str(info.value) and message in info.value.reason


@FUZZ
@given(data=st.data())
def test_zstd_item_mutated_frame_is_read_or_refused(zstd_seed: Path, tmp_path_factory: pytest.TempPathFactory,
                                                    data: st.DataObject) -> None:
    """Any damage to a compressed item gives a value or a CheckpointError, never a MemoryError or ValueError: the
    seed's value where the frame still decompresses to the seed's archive, a HeaderError where zstd refuses it."""
    metadata = load_metadata(zstd_seed)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "n")
    raw = (zstd_seed / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    frame = mutate(raw, data.draw(edits(len(raw), [(0, 24)])))
    try:
        reference: bytes | None = zstandard.ZstdDecompressor().stream_reader(frame).read(1 << 22)
    except zstandard.ZstdError:
        reference = None
    folder = forge_item(zstd_seed, tmp_path_factory.mktemp("fuzz") / "ckpt", "n", (4, 3), frame)
    with tm.open(folder) as ck:
        result = outcome(lambda: ck["n"].full().tobytes())  # re-raises anything but a CheckpointError
    if reference is None:
        event("zstd refuses the frame")
        assert isinstance(result, HeaderError), result
    elif reference == _archive(zstd_seed, "n"):
        event("the seed's archive")
        assert result == as_numpy(TENSORS["n"]).tobytes(), result
    else:
        event("another archive: " + (type(result).__name__ if isinstance(result, Exception) else "a value"))


# ---------------------------------------------------------------------------
# DCP items that share bytes or are shorter than their chunk
# ---------------------------------------------------------------------------


def test_dcp_items_sharing_bytes_are_refused(dcp_seed: Path, tmp_path: Path) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    metadata = load_metadata(folder)
    keys = {k.fqn: k for k in metadata.storage_data}
    metadata.storage_data[keys["h"]] = metadata.storage_data[keys["w"]]  # both name w's item
    save_metadata(folder, metadata)
    with pytest.raises(HeaderError, match="overlaps the item of") as info:
        tm.open(folder)
    assert "__0_0.distcp" in str(info.value) and {info.value.tensor} <= {"w", "h"}


def test_dcp_uncompressed_item_shorter_than_its_chunk_is_refused_at_open(dcp_seed: Path, tmp_path: Path) -> None:
    folder = forge_item(dcp_seed, tmp_path / "ckpt", "w", (4, 1 << 30))  # 16 GiB declared on a ~1.5 KB item
    with pytest.raises(TruncatedFileError, match="declares 17179869184 bytes, but its item is only") as info:
        tm.open(folder)
    assert info.value.tensor == "w"


# ---------------------------------------------------------------------------
# expanded views in torch.save files
# ---------------------------------------------------------------------------


def test_ordinary_and_small_expanded_views_read_bit_exact(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    torch.save(TENSORS, path)
    reference = torch.load(path, weights_only=True)
    assert reference["e"].stride() == (0, 1)  # torch.save keeps an expanded view's stride 0
    with tm.open(path) as ck:
        for name, tensor in reference.items():
            read = ck[name].full()
            assert read.tobytes() == as_numpy(tensor).tobytes() and read.shape == tuple(tensor.shape), name
        assert ck["e"][4].tolist() == [1.5, -2.0, 0.25]


EXPANDED = {  # torch.save of views that hold far more than the storage behind them
    "stride 0, 1 GiB": (lambda: torch.zeros(1).expand(1 << 30), "[0]"),
    "stride 0, 64 GiB": (lambda: torch.zeros(1).expand(1 << 34), "[0]"),
    "overlapping strides, 4 GiB": (lambda: torch.arange(float(1 << 17)).as_strided((1 << 16, 1 << 14), (1, 1)),
                                   "[1, 1]"),
}


@pytest.mark.parametrize("case", list(EXPANDED))
def test_expanded_view_beyond_the_limit_is_refused(tmp_path: Path, case: str) -> None:
    build, strides = EXPANDED[case]
    path = tmp_path / "pytorch_model.bin"
    torch.save({"model.w": build()}, path)
    assert path.stat().st_size < 1 << 20
    result = run_bounded(opening(path), seconds=3, grown_mib=50)
    assert result is not None and result[0] == "UnsupportedError", result
    assert "'model.w'" in result[1] and f"strides {strides}" in result[1] and "expanded view" in result[1]
    for command in (("stats", path), ("convert", path, tmp_path / "out")):
        assert_one_line_exit_2(cli(*command), "pytorch_model.bin", "'model.w'", "expanded view")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_expanded_views_count_together_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchzip, "MAX_EXPANDED_BYTES", 4096)
    path = tmp_path / "model.bin"
    torch.save({"a": torch.zeros(1).expand(768), "b": torch.ones(1).expand(768)}, path)  # 3 KiB each
    with pytest.raises(UnsupportedError, match="read up to 4096 bytes per file") as info:
        tm.open(path)
    assert info.value.tensor == "b"


def test_one_storage_named_too_many_times_is_refused(tmp_path: Path) -> None:
    """Tied weights are fine (T5 names its embedding three times); a million names for one storage are not."""
    shared = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    tied = tmp_path / "tied.bin"
    torch.save({"shared.weight": shared, "encoder.embed.weight": shared, "decoder.embed.weight": shared}, tied)
    with tm.open(tied) as ck:
        assert ck["decoder.embed.weight"][-1] == (1 << 20) - 1
    many = tmp_path / "many.bin"
    torch.save({f"layer.{i}.weight": shared for i in range(100)}, many)  # 400 MiB from a 4 MiB file
    with pytest.raises(UnsupportedError, match="one storage is named too many times") as info:
        tm.open(many)
    assert info.value.tensor is not None and info.value.tensor.startswith("layer.")


# ---------------------------------------------------------------------------
# zip records that expand
# ---------------------------------------------------------------------------


def test_deflated_byteorder_record_is_refused_unread(tmp_path: Path) -> None:
    """A byteorder record of 64 MiB (64 KiB deflated) would be decompressed whole to be compared."""
    path = tmp_path / "model.bin"
    blob = io.BytesIO(torch_zip(pickle_of_empty_dict()))
    with zipfile.ZipFile(blob, "a", zipfile.ZIP_DEFLATED) as archive, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a second byteorder record: the last one wins, as in zipfile
        archive.writestr("archive/byteorder", b"little" + b" " * (64 << 20))
    path.write_bytes(blob.getvalue())
    assert path.stat().st_size < 1 << 20
    result = run_bounded(opening(path), seconds=3, grown_mib=30)
    assert result is not None and result[0] == "HeaderError" and "byteorder record is 67108870 bytes" in result[1]


def pickle_of_empty_dict() -> bytes:
    return b"\x80\x02}q\x00."


def test_verify_reads_no_record_twice(tmp_path: Path) -> None:
    """Central directory entries that all point at one 1 MiB record: checking CRCs would read it 20,000 times."""
    archive = torch_zip(pickle_of_empty_dict(), {"0": bytes(1 << 20)})
    end = archive.rindex(b"PK\x05\x06")
    entries, size, start = struct.unpack("<HII", archive[end + 10:end + 20])
    directory = archive[start:start + size]
    entry = directory[directory.index(b"PK\x01\x02", directory.index(b"archive/data/0") - 46):]
    entry = entry[:46 + sum(struct.unpack("<HHH", entry[28:34]))]
    copies = 20_000
    forged_directory = directory + entry * copies
    eocd = bytearray(archive[end:])
    struct.pack_into("<HHI", eocd, 8, entries + copies, entries + copies, len(forged_directory))
    path = tmp_path / "model.bin"
    path.write_bytes(archive[:start] + forged_directory + bytes(eocd))
    code = (f"from tensormorph import torchzip\n# measure\nfrom tensormorph import torchzip\n"
            f"torchzip.check_crc(memoryview(open({str(path)!r}, 'rb').read()), file='model.bin')\n")
    result = run_bounded(code, seconds=3, grown_mib=100)
    assert result is not None and result[0] == "HeaderError" and "more than the" in result[1], result


def test_a_compressed_items_bound_follows_the_checkpoints_read_budget(dcp_zstd_ckpt: Path) -> None:
    """The whole-item bound of a compressed chunk is the read budget the checkpoint was opened with, not a fixed
    2 GiB: a smaller budget refuses the item, a larger one reads it."""
    name, nbytes = max(((n, t.nbytes) for n, t in tm.open(dcp_zstd_ckpt).tensors.items()
                        if len(t.chunks) > 1), key=lambda p: p[1])
    expected = tm.open(dcp_zstd_ckpt)[name][...]
    small = tm.open(dcp_zstd_ckpt, read_budget=nbytes // len(tm.open(dcp_zstd_ckpt)[name].chunks) // 2)
    with pytest.raises(BudgetExceededError, match="decompressing this zstd item"):
        small[name].read((slice(0, 1),), budget=nbytes)  # the slice fits; the item it lives in does not
    assert np.array_equal(tm.open(dcp_zstd_ckpt, read_budget=nbytes)[name][...], expected)


# ---------------------------------------------------------------------------
# tensor geometry, rebuild calls and storage reuse declared by a torch.save pickle
# ---------------------------------------------------------------------------


class _Storage:
    """Pickled as a persistent storage record, as torch.save writes one."""

    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


class _Call:
    """Pickled as a call of `func` on `args` (a REDUCE), whatever func is."""

    def __init__(self, func: Any, *args: Any):
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel) if isinstance(obj, _Storage) else None


def forged_archive(tree: Any, storages: dict[str, bytes]) -> bytes:
    """A torch.save-shaped archive of `tree`, whose _Call and _Storage leaves pickle as torch's would."""
    buffer = io.BytesIO()
    _TorchPickler(buffer, protocol=4).dump(tree)
    return torch_zip(buffer.getvalue(), storages)


def tensor_call(storage: _Storage, offset: Any, size: Any, stride: Any) -> _Call:
    return _Call(torch._utils._rebuild_tensor_v2, storage, offset, size, stride, False, collections.OrderedDict())


def loaded_in_child(path: Path, seconds: float = 2) -> tuple[str, str] | None:
    code = (f"from tensormorph import torchzip\nblob = memoryview(open({str(path)!r}, 'rb').read())\n# measure\n"
            f"torchzip.load(blob, file={path.name!r})\n")
    return run_bounded(code, seconds=seconds, grown_mib=100)


GEOMETRY = {  # the review's reproducers: byte_span took 14 s on 50,000 dimensions; a 5,000-digit offset crashed
    "50k dimensions": ((0, (1,) * 50_000, (1,) * 50_000), "tensor size has 50000 dimensions; at most 64"),
    "huge offset": ((10**5000, (1,), (1,)), "tensor storage offset must be an integer in [0, 2**63), found "
                                            "<16610-bit integer>"),
    "huge dimension": ((0, (2, 10**5000), (1, 1)), "tensor size must be a list of integers in [0, 2**62), found "
                                                   "[2, <16610-bit integer>]"),
    "negative stride": ((0, (2,), (-1,)), "tensor stride must be a list of integers in [0, 2**62), found [-1]"),
}


@pytest.mark.parametrize("case", list(GEOMETRY))
def test_torch_tensor_geometry_beyond_the_bounds_is_a_header_error(tmp_path: Path, case: str) -> None:
    (offset, size, stride), message = GEOMETRY[case]
    path = tmp_path / "model.bin"
    path.write_bytes(forged_archive({"w": tensor_call(_Storage("0", 4), offset, size, stride)}, {"0": bytes(16)}))
    error = loaded_in_child(path)
    assert error is not None and error[0] == "HeaderError" and message in error[1], error
    assert error[1].startswith("model.bin: ")


def test_torch_storage_of_a_huge_element_count_is_a_header_error(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(forged_archive({"w": tensor_call(_Storage("0", 10**5000), 0, (1,), (1,))}, {"0": bytes(4)}))
    error = loaded_in_child(path)
    assert error is not None and error[0] == "HeaderError", error
    assert "element count of storage '0' must be an integer in [0, 2**63), found <16610-bit integer>" in error[1]


def test_rebuild_from_type_v2_calls_only_a_tensor_rebuild(tmp_path: Path) -> None:
    """_rebuild_from_type_v2(set, Tensor, ([colliding ints],), None) built a set of 8,000 keys of one hash value
    (quadratic), past the unpickler's own hash-collision check; torch passes it nothing but a tensor rebuild."""
    from test_hostile_pickle_work import colliding_ints

    path = tmp_path / "model.bin"
    call = _Call(torch._tensor._rebuild_from_type_v2, set, torch.Tensor, (colliding_ints(8_000),), None)
    path.write_bytes(forged_archive({"w": call}, {}))
    error = loaded_in_child(path, seconds=1)
    assert error == ("UnsafePickleError", "model.bin: _rebuild_from_type_v2 calls 'set', not a tensor rebuild "
                                          "function"), error
    ordinary = tmp_path / "ordinary.bin"  # what torch.save writes for a tensor subclass: still read
    inner = tensor_call(_Storage("0", 4), 0, (4,), (1,))
    call = _Call(torch._tensor._rebuild_from_type_v2, inner.func, torch.Tensor, inner.args, {})
    ordinary.write_bytes(forged_archive({"w": call}, {"0": np.arange(4, dtype=np.float32).tobytes()}))
    assert torchzip.load(memoryview(ordinary.read_bytes()), file="ordinary.bin")["w"].shape == (4,)


def test_one_storage_rebuilt_too_many_times_is_refused_by_every_loader(tmp_path: Path) -> None:
    """Reuse was counted only by the torch reader's names: a DeepSpeed states file (or any torchzip.load) naming a
    1 MiB storage 1,000 times declared 1 GB. Now each rebuild is charged as it is made."""
    storage = _Storage("0", 1 << 18)  # 1 MiB of float32
    tree = {"module": {f"layer.{i}.weight": tensor_call(storage, 0, (1 << 18,), (1,)) for i in range(1000)}}
    blob = forged_archive(tree, {"0": bytes(1 << 20)})
    with pytest.raises(UnsupportedError, match="one storage is named too many times") as info:
        torchzip.load(memoryview(blob), file="mp_rank_00_model_states.pt")
    assert info.value.file == "mp_rank_00_model_states.pt"
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(blob)
    with pytest.raises(UnsupportedError, match="one storage is named too many times"):
        deepspeed_states.read_model_states(LocalFiles(tmp_path), "mp_rank_00_model_states.pt")


def test_one_tensor_under_too_many_module_names_is_refused_by_the_deepspeed_reader(tmp_path: Path) -> None:
    """One pickled tensor (memoised: rebuilt once) under 1,000 module names: the reader made 1,000 tensors of it."""
    shared = torch.zeros(1 << 18)  # 1 MiB
    torch.save({"module": {f"layer.{i}.weight": shared for i in range(1000)}, "buffer_names": [], "param_shapes": []},
               tmp_path / "mp_rank_00_model_states.pt")
    files = LocalFiles(tmp_path)
    model = deepspeed_states.read_model_states(files, "mp_rank_00_model_states.pt")
    with pytest.raises(UnsupportedError, match="one storage is named too many times") as info:
        deepspeed_tensors.module_tensors(files, model)
    assert info.value.tensor is not None and info.value.tensor.startswith("layer.")
    tied = {"module": {"a": shared, "b": shared, "c": shared}, "buffer_names": [], "param_shapes": []}
    (tmp_path / "tied").mkdir()  # a new file: the first one stays mapped
    torch.save(tied, tmp_path / "tied" / "mp_rank_00_model_states.pt")  # tied weights: still read
    files = LocalFiles(tmp_path / "tied")
    model = deepspeed_states.read_model_states(files, "mp_rank_00_model_states.pt")
    assert set(deepspeed_tensors.module_tensors(files, model)) == {"module.a", "module.b", "module.c"}


@pytest.mark.parametrize("shape", [[10**5000, 2], [1] * 65, [-1], "ab"])
def test_deepspeed_declared_shapes_are_bounded_before_any_arithmetic(shape: Any) -> None:
    from tensormorph.formats.deepspeed.states import _shapes

    with pytest.raises(HeaderError) as info:
        _shapes({"w": shape}, "mp_rank_00_model_states.pt")
    assert "mp_rank_00_model_states.pt" in str(info.value) and "'w'" in str(info.value)
    assert len(str(info.value)) < 400  # a 5,000-digit size is named by its bit length, not printed
