"""Headers and indexes within their size limits, made to expand: every one is refused, or read, in bounded time
and memory (measured in a child interpreter by run_bounded, which also caps the child's address space so that
a regression fails the test instead of exhausting the machine). Also the small-file reads under them: only
regular files, never more than their cap."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from hostile_support import copy_dcp, load_metadata, run_bounded, save_metadata

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import HeaderError, MissingFileError
from tensormorph.formats import gguf
from tensormorph.formats.hf_sharded import MAX_INDEX_BYTES, MAX_INDEX_FILES
from tensormorph.shapes import MAX_DIMS, check_offset, check_shape, describe
from tensormorph.storage import MAX_JSON_VALUES, LocalFiles
from tensormorph.storage.local import read_capped

pytestmark = pytest.mark.timeout(300)

ADDRESS_SPACE = 3 << 30  # what the measured child may map beyond what its imports did; a regression hits it


def opened_in_child(target: Path, format: str | None = None, *, seconds: float, grown_mib: float,
                    then: str = "") -> tuple[str, str] | None:
    """(error class, message) of tm.open(target, format) (and of `then`, run on the checkpoint `ck`) in a
    fresh interpreter, asserting its time and peak-RSS growth; None when it opens."""
    code = f"""
import resource
from pathlib import Path
import tensormorph as tm
held = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (held + {ADDRESS_SPACE}, held + {ADDRESS_SPACE}))
# measure
import tensormorph as tm  # imported already: the measured code runs in globals of its own
ck = tm.open({str(target)!r}, {format!r})
{then}
"""
    return run_bounded(code, seconds=seconds, grown_mib=grown_mib)


def write_safetensors_header(path: Path, *pieces: bytes, repeat: int = 1) -> None:
    """A safetensors file of a header alone: pieces[0], pieces[1] `repeat` times, then pieces[2]."""
    head, middle, tail = pieces
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(head) + len(middle) * repeat + len(tail)) + head)
        for _ in range(repeat):
            f.write(middle)
        f.write(tail)


# ---------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------


def test_safetensors_99_mb_header_of_empty_lists_is_refused_at_once(tmp_path: Path) -> None:
    """The review's 99 MB header of empty lists took 2.5 GB to parse; its values are counted first (the reference
    library's 100 MB header limit is kept: the values are what costs)."""
    path = tmp_path / "model.safetensors"
    lists = 33_000_000
    write_safetensors_header(path, b'{"__metadata__":{},"junk":[', b"[]," * 1_000_000, b"[]]}", repeat=33)
    assert path.stat().st_size > 99_000_000
    error = opened_in_child(path, "safetensors", seconds=5, grown_mib=200)
    assert error is not None and error[0] == "HeaderError", error
    assert f"header holds about {2 * lists + 8} JSON values, over the limit of {MAX_JSON_VALUES}" in error[1]
    path.unlink()  # pytest keeps the folders of the last runs


def test_safetensors_header_just_under_the_values_limit_parses_in_bounded_memory(tmp_path: Path) -> None:
    """The costliest shape per value (lists nested 500 deep, about 100 bytes a value) just under the limit:
    parsed, then refused for what it is (not a tensor entry), in well under 1 GiB."""
    groups = MAX_JSON_VALUES // 501 - 2
    nested = b"[" * 500 + b"]" * 500
    path = tmp_path / "model.safetensors"
    write_safetensors_header(path, b'{"junk":[', nested + b",", nested + b"]}", repeat=groups - 1)
    error = opened_in_child(path, "safetensors", seconds=20, grown_mib=512)
    assert error is not None and error[0] == "HeaderError", error
    assert "tensor 'junk': header entry must be an object" in error[1]


# ---------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def gguf_metadata(path: Path, kvs: list[tuple[bytes, int, list[bytes]]]) -> None:
    """A GGUF file of key/values only: (key, value type, the pieces of its payload)."""
    with path.open("wb") as f:
        f.write(b"GGUF" + u32(3) + u64(0) + u64(len(kvs)))
        for key, vtype, payload in kvs:
            f.write(u64(len(key)) + key + u32(vtype))
            for piece in payload:
                f.write(piece)
        f.write(bytes(-f.tell() % 32))


def nested_bools(arrays: int, each: int) -> list[bytes]:
    """The payload of an array of `arrays` arrays of `each` booleans."""
    inner = u32(7) + u64(each) + b"\x01" * each
    return [u32(9) + u64(arrays)] + [inner] * arrays


def test_gguf_240_mb_of_nested_bool_arrays_is_refused_at_once(tmp_path: Path) -> None:
    """The review's 240 MB of nested bool arrays took 4.6 GB: 60 arrays (few enough to be decoded on open) of
    4,000,000 booleans. Items are counted across every array before any is decoded."""
    path = tmp_path / "bools.gguf"
    gguf_metadata(path, [(b"a", 9, nested_bools(60, 4_000_000))])
    assert path.stat().st_size > 240_000_000
    error = opened_in_child(path, "gguf", seconds=3, grown_mib=64)
    assert error is not None and error[0] == "HeaderError", error
    assert f"more than {gguf.header.MAX_METADATA_ITEMS} values and array items, over the limit" in error[1]
    path.unlink()


def test_gguf_long_array_of_nested_arrays_is_walked_not_decoded(tmp_path: Path) -> None:
    """A long array (summarised on open) of 1,000 arrays of 200,000 booleans: opening walks past them without
    decoding them; loading the whole array is refused (200 M items), also at once."""
    path = tmp_path / "long.gguf"
    gguf_metadata(path, [(b"a", 9, nested_bools(1_000, 200_000))])
    assert opened_in_child(path, "gguf", seconds=3, grown_mib=64) is None
    error = opened_in_child(path, "gguf", seconds=3, grown_mib=64, then="ck.objects['a'].value()")
    assert error is not None and error[0] == "HeaderError" and "over the limit" in error[1], error


def test_gguf_metadata_just_under_the_limits_opens_in_bounded_memory(tmp_path: Path) -> None:
    """The costliest metadata that opens: strings of two bytes (about 60 bytes each once decoded) filling the
    item budget, beside one string of the longest decodable size whose characters are 4 bytes wide."""
    each = (gguf.header.MAX_METADATA_ITEMS - 1_000) // 60
    inner = u32(8) + u64(each) + (u64(2) + b"ab") * each
    wide = ("\U0001f600" + "a" * 1023).encode() * ((gguf.header.MAX_DECODED_STRING_BYTES - 120 * each - 64) // 1027)
    path = tmp_path / "strings.gguf"
    gguf_metadata(path, [(b"a", 9, [u32(9) + u64(60)] + [inner] * 60), (b"b", 8, [u64(len(wide)), wide])])
    assert opened_in_child(path, "gguf", seconds=30, grown_mib=640) is None
    path.unlink()


# ---------------------------------------------------------------------------
# Hugging Face indexes
# ---------------------------------------------------------------------------


def hf_folder_with(tmp_path: Path, make_index) -> Path:
    """A folder with two real shards and `make_index(path)` at model.safetensors.index.json."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    safetensors.numpy.save_file({"a": np.zeros(2)}, str(folder / "model-00001-of-00002.safetensors"))
    safetensors.numpy.save_file({"b": np.ones(2)}, str(folder / "model-00002-of-00002.safetensors"))
    make_index(folder / "model.safetensors.index.json")
    return folder


def sparse(size: int):
    def make(path: Path) -> None:
        with path.open("wb") as f:
            f.truncate(size)
    return make


@pytest.mark.parametrize("make, error, message", [
    (lambda path: path.symlink_to("/dev/zero"), "UnsafePathError", "resolves outside the checkpoint folder"),
    (lambda path: os.mkfifo(path), "MissingFileError", "is a FIFO, not a regular file"),
    (lambda path: path.mkdir(), "MissingFileError", "is a folder, not a regular file"),
    (sparse(8 << 30), "HeaderError", f"index is over the {MAX_INDEX_BYTES}-byte limit"),
    (sparse(MAX_INDEX_BYTES + 1), "HeaderError", f"index is over the {MAX_INDEX_BYTES}-byte limit"),
], ids=["dev-zero", "fifo", "folder", "sparse-8GiB", "one-byte-over"])
@pytest.mark.parametrize("format", [None, "hf-sharded"])
def test_hf_index_that_is_no_small_file_is_refused_at_once(tmp_path: Path, make, error: str, message: str,
                                                          format: str | None) -> None:
    """Detection used to read any *.index.json whole: a link to /dev/zero or a sparse 8 GiB file took gigabytes,
    and a FIFO blocked for ever. Now the index is read only when it is a regular file, and never more than
    MAX_INDEX_BYTES + 1 bytes of it."""
    folder = hf_folder_with(tmp_path, make)
    found = opened_in_child(folder, format, seconds=3, grown_mib=32)
    assert found is not None and found[0] == error and message in found[1], found
    assert str(folder) in found[1] and "model.safetensors.index.json" in found[1]


def write_hf_index(folder: Path, weight_map: dict[str, str]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_hf_index_naming_a_million_files_is_refused_at_once(tmp_path: Path) -> None:
    """The review's index naming 10^6 files ran for over a minute (a path resolution for each, then the first
    missing file); the number of files is bounded before any of them is looked at."""
    write_hf_index(tmp_path / "ckpt", {f"t{k}": f"model-{k:07d}.safetensors" for k in range(1_000_000)})
    error = opened_in_child(tmp_path / "ckpt", seconds=10, grown_mib=512)
    assert error is not None and error[0] == "HeaderError", error
    assert f"weight_map names 1000000 files, over the limit of {MAX_INDEX_FILES}" in error[1]


def test_hf_index_naming_the_most_files_allowed_costs_little_a_file(tmp_path: Path) -> None:
    """Just under the limit, every name is checked to stay inside the folder (one lstat a name, not one for
    each component of the folder's own path too) before the first missing file is reported."""
    write_hf_index(tmp_path / "ckpt", {f"t{k}": f"model-{k:07d}.safetensors" for k in range(MAX_INDEX_FILES)})
    error = opened_in_child(tmp_path / "ckpt", seconds=10, grown_mib=256)
    assert error is not None and error[0] == "MissingFileError", error
    assert "model-0000000.safetensors: tensor 't0': shard file is missing" in error[1]


def test_hf_index_taking_one_tensor_from_each_of_many_links_reads_the_file_once(tmp_path: Path) -> None:
    """1,000 links to one file of 1,000 tensors, the index taking one tensor through each: the file is read
    once, and only the tensors taken are made (not a million)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    safetensors.numpy.save_file({f"t{k}": np.full(2, k, np.float32) for k in range(1_000)},
                                str(folder / "all.safetensors"))
    for k in range(1_000):
        (folder / f"link-{k:04d}.safetensors").symlink_to("all.safetensors")
    write_hf_index(folder, {f"t{k}": f"link-{k:04d}.safetensors" for k in range(1_000)})
    assert opened_in_child(folder, seconds=5, grown_mib=64,
                           then="assert len(ck) == 1000 and ck['t7'].full().tolist() == [7.0, 7.0]") is None


# ---------------------------------------------------------------------------
# the small-file reads under them
# ---------------------------------------------------------------------------


def test_read_capped_never_reads_more_than_the_cap_whatever_the_size_says() -> None:
    """/dev/zero says it holds 0 bytes and reads without end: the read stops one byte past the cap."""
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        assert os.fstat(fd).st_size == 0
        assert read_capped(fd, 10 << 20) is None
    finally:
        os.close(fd)


@pytest.mark.parametrize("name, kind", [("zero", "a character device"), ("fifo", "a FIFO"), ("folder", "a folder")])
@pytest.mark.parametrize("read", ["read_json", "read", "read_prefixed", "buffer", "read_into"])
def test_local_files_read_only_regular_files(tmp_path: Path, name: str, kind: str, read: str) -> None:
    """Every read of a store names the file that is not a regular file, and none blocks on a FIFO."""
    files = LocalFiles(Path("/dev") if name == "zero" else tmp_path)
    if name == "fifo":
        os.mkfifo(tmp_path / name)
    elif name == "folder":
        (tmp_path / name).mkdir()
    calls = {"read_json": lambda: files.read_json(name, 1000), "read": lambda: files.read(name, 0, 8),
             "read_prefixed": lambda: files.read_prefixed(name, 1000), "buffer": lambda: files.buffer(name),
             "read_into": lambda: files.read_into(name, 0, memoryview(bytearray(8)))}
    with pytest.raises(MissingFileError, match=f"is {kind}, not a regular file") as info:
        calls[read]()
    assert info.value.file == files.describe(name)


# ---------------------------------------------------------------------------
# declared shapes and offsets: a bounded number of dimensions, each a bounded integer, checked before arithmetic
# ---------------------------------------------------------------------------


def safetensors_of_shape(path: Path, shape_json: bytes) -> Path:
    """A safetensors file whose one tensor declares `shape_json` and holds no data."""
    write_safetensors_header(path, b'{"w":{"dtype":"F32","shape":', shape_json, b',"data_offsets":[0,0]}}')
    return path


def test_safetensors_300_huge_dimensions_are_one_header_error(tmp_path: Path) -> None:
    """[2**61] * 300 (6 KB) made a 5,500-digit product, which the error message could not even format (exit 1)."""
    path = safetensors_of_shape(tmp_path / "model.safetensors", json.dumps([2**61] * 300).encode())
    error = opened_in_child(path, "safetensors", seconds=2, grown_mib=50)
    assert error == ("HeaderError", f"{path}: tensor 'w': shape has 300 dimensions; at most {MAX_DIMS} are allowed")
    result = CliRunner().invoke(main, ["inspect", str(path)], catch_exceptions=True)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and error[1] in lines[0] and "Traceback" not in result.output, result.output


def test_safetensors_100k_dimensions_are_refused_at_once(tmp_path: Path) -> None:
    """A 2 MB header of 100,000 dimensions took 25 s to multiply out."""
    path = safetensors_of_shape(tmp_path / "model.safetensors", b"[" + b"3," * 99_999 + b"3]")
    error = opened_in_child(path, "safetensors", seconds=2, grown_mib=100)
    assert error is not None and error[0] == "HeaderError" and "shape has 100000 dimensions" in error[1], error


@pytest.mark.parametrize("shape, message", [
    ([2**61] * 2, "holds 2**64 or more elements"),  # the reference library's checked_mul overflows too
    ([2**62], "shape must be a list of integers in [0, 2**62), found [4611686018427387904]"),
    ([2] * 65, "shape has 65 dimensions"),
])
def test_safetensors_shapes_beyond_the_bounds_are_header_errors(tmp_path: Path, shape: list[int],
                                                                message: str) -> None:
    path = safetensors_of_shape(tmp_path / "model.safetensors", json.dumps(shape).encode())
    with pytest.raises(HeaderError) as info:
        tm.open(path, "safetensors")
    assert message in str(info.value) and info.value.tensor == "w" and info.value.file == str(path)
    assert "\n" not in str(info.value)


def test_safetensors_64_dimensions_of_size_1_still_open(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"w": np.arange(3, dtype=np.float32).reshape((1,) * 63 + (3,))}, str(path))
    with tm.open(path) as ck:
        assert ck["w"].shape == (1,) * 63 + (3,) and ck["w"].full().ravel().tolist() == [0, 1, 2]


def test_a_huge_integer_in_a_message_shows_its_bit_length() -> None:
    assert describe(10**5000) == "<16610-bit integer>" and describe(-(2**70)) == "<-71-bit integer>"
    with pytest.raises(HeaderError, match=r"found <16610-bit integer>"):
        check_offset(10**5000, file="f", tensor="t", what="storage offset")
    with pytest.raises(HeaderError, match=r"found \[2, <16610-bit integer>\]"):
        check_shape([2, 10**5000], file="f", tensor="t")


def _set(record: object, field: str, value: object) -> None:
    object.__setattr__(record, field, value)  # torch's metadata dataclasses may be frozen


DCP_HUGE = {  # the review's reproducers: each made a 5,000-digit integer that a message could not format
    "chunk size": ("chunk sizes must be a list of integers in [0, 2**62), found [<16610-bit integer>, 6]",
                   lambda entry, item: _set(entry.chunks[0], "sizes", (10**5000, 6))),
    "tensor size": ("size has 70 dimensions; at most 64",
                    lambda entry, item: _set(entry, "size", (1,) * 70)),
    "chunk offsets": ("chunk offsets must be a list of integers in [0, 2**62), found [<16610-bit integer>, 0]",
                      lambda entry, item: _set(entry.chunks[0], "offsets", (10**5000, 0))),
    "storage offset": ("storage offset must be an integer in [0, 2**63), found <16610-bit integer>",
                       lambda entry, item: _set(item, "offset", 10**5000)),
    "storage length": ("storage length must be an integer in [0, 2**63), found -1",
                       lambda entry, item: _set(item, "length", -1)),
}


@pytest.mark.parametrize("case", list(DCP_HUGE))
def test_dcp_huge_sizes_and_offsets_are_one_line_header_errors(dcp_seed: Path, tmp_path: Path, case: str) -> None:
    message, forge = DCP_HUGE[case]
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    metadata = load_metadata(folder)
    key = next(k for k in metadata.storage_data if k.fqn == "w")
    forge(metadata.state_dict_metadata["w"], metadata.storage_data[key])
    save_metadata(folder, metadata)
    error = run_bounded(f"import tensormorph as tm\n# measure\ntm.open({str(folder)!r})\n", seconds=2, grown_mib=50)
    assert error is not None and error[0] == "HeaderError" and message in error[1], error
    assert "tensor 'w'" in error[1] and ".metadata" in error[1] and "\n" not in error[1]


def test_stats_names_a_huge_size_by_its_exponent() -> None:
    """check_scannable formatted 1e... with str() of the whole integer: quadratic in its digits."""
    from types import SimpleNamespace

    from tensormorph.errors import BudgetExceededError
    from tensormorph.ops.stats import check_scannable

    tensor = SimpleNamespace(nbytes=4 * 2**(62 * 64), shape=(2**62,) * 64, dtype="F32", files=("f",), name="w")
    with pytest.raises(BudgetExceededError, match=r"about 1e1195 bytes: too large to scan"):
        check_scannable(tensor)  # type: ignore[arg-type]
