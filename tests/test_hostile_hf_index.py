"""Hostile Hugging Face index files: random weight maps and bytes (see hostile_support)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from hostile_support import (
    FUZZ,
    HOLDS,
    SHARD1,
    SHARD2,
    TRUTH,
    edits,
    json_values,
    mutate,
    outcome,
    replace_file,
    write_index,
)
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph.errors import CheckpointError, HeaderError, MissingFileError, TensorNotFoundError, UnsafePathError
from tensormorph.formats import hf_sharded
from tensormorph.formats.hf_sharded import MAX_INDEX_BYTES, MAX_INDEX_FILES, MAX_INDEX_TENSORS
from tensormorph.storage import MAX_JSON_VALUES

pytestmark = pytest.mark.timeout(120)



@pytest.fixture(scope="module")
def hf_scratch(hf_folder: Path) -> Path:
    """A copy of hf_folder whose index each fuzz example replaces."""
    return write_index(hf_folder, "")


UNSAFE = ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors", "link.safetensors",
          "linkdir/stolen.safetensors", "~/x.safetensors", "..\\outside.safetensors", "./../outside.safetensors"]
MISSING = ["missing.safetensors", "sub/model.safetensors"]
SAFE_FILES = [SHARD1, SHARD2, "inside_link.safetensors", "./" + SHARD1]


@settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(weight_map=st.dictionaries(st.sampled_from(["a", "b", "c", "d"]),
                                  st.sampled_from(SAFE_FILES + UNSAFE + MISSING) | st.sampled_from([SHARD1, SHARD2]),
                                  min_size=1, max_size=4),
       metadata=st.none() | st.just({"total_size": 44}) | json_values)
def test_hf_index_weight_maps(hf_scratch: Path, weight_map: dict, metadata: Any) -> None:
    index: dict[str, Any] = {"weight_map": weight_map}
    if metadata is not None:
        index["metadata"] = metadata
    replace_file(hf_scratch / "model.safetensors.index.json", json.dumps(index).encode())
    result = outcome(lambda: tm.open(hf_scratch))
    files = list(weight_map.values())
    if any(f in UNSAFE for f in files):
        assert isinstance(result, UnsafePathError), result
    elif metadata and not isinstance(metadata, dict):
        assert isinstance(result, HeaderError), result
    elif any(f in MISSING or name not in HOLDS[f.removeprefix("./")] for name, f in weight_map.items()):
        # shards are read in index order: whichever problem comes first is reported
        assert isinstance(result, (MissingFileError, TensorNotFoundError)), result
        if not any(f in MISSING for f in files):
            assert isinstance(result, TensorNotFoundError), result
            assert result.tensor in weight_map
    else:
        assert not isinstance(result, CheckpointError), result
        with result as ck:
            assert list(ck) == list(weight_map)
            for name in weight_map:
                got = ck[name].full()
                assert got.dtype == TRUTH[name].dtype and got.tobytes() == TRUTH[name].tobytes()
                assert ck[name].file_shard[1] == len(set(files))


@pytest.mark.parametrize("text", ['{"weight_map": [1]}', '{"weight_map": {"a": 5}}', '{"weight_map": {"a": null}}',
                                  '{"weight_map": {}, "metadata": 3}', '["weight_map"]', '"weight_map"',
                                  '{"weight_map": {"a": "' + SHARD1 + '"}', "\xff\"weight_map\"", ""])
def test_hf_index_malformed_is_a_header_error(hf_folder: Path, text: str) -> None:
    folder = write_index(hf_folder, text)
    with pytest.raises(HeaderError):
        tm.open(folder, "hf-sharded")
    shutil.rmtree(folder)


HF_SEED = json.dumps({"metadata": {"total_size": 44}, "weight_map": {"a": SHARD1, "c": SHARD2}}).encode()


def hf_index_verdict(content: bytes, folder: Path) -> type[CheckpointError] | None:
    """The error an index with `content` in `folder` (a copy of hf_folder) must raise, None when it opens: the
    index is checked whole first (its size and number of JSON values, a JSON object, a weight_map of at most
    MAX_INDEX_TENSORS names and MAX_INDEX_FILES file names inside the folder, a metadata object), then the shards
    in the order the index first names them."""
    if len(content) > MAX_INDEX_BYTES or sum(content.count(c) for c in b",[{:") + 1 > MAX_JSON_VALUES:
        return HeaderError
    try:
        index = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return HeaderError
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        return HeaderError
    weight_map = index["weight_map"]
    if len(weight_map) > MAX_INDEX_TENSORS:
        return HeaderError
    if not all(isinstance(file, str) for file in weight_map.values()):
        return HeaderError
    if len(set(weight_map.values())) > MAX_INDEX_FILES:
        return HeaderError
    if any(escapes(folder, file) for file in weight_map.values()):
        return UnsafePathError
    if not isinstance(index.get("metadata") or {}, dict):
        return HeaderError
    for shard in dict.fromkeys(weight_map.values()):
        target = folder.joinpath(*PurePosixPath(shard.replace("\\", "/")).parts)
        if not target.is_file():
            return MissingFileError
        held = HOLDS.get(target.resolve().name)
        if held is None:
            return HeaderError  # neither a safetensors nor a torch.save file
        if any(name not in held for name, file in weight_map.items() if file == shard):
            return TensorNotFoundError
    return None


def escapes(folder: Path, file: str) -> bool:
    """Whether an index's file name leaves the folder (\\ counts as a separator; ~ and NUL are refused)."""
    pure = PurePosixPath(file.replace("\\", "/"))
    if not file or "\x00" in file or file.startswith("~") or pure.is_absolute() or ".." in pure.parts:
        return True
    real, root = folder.joinpath(*pure.parts).resolve(), folder.resolve()
    return real != root and root not in real.parents


def assert_hf_index_outcome(folder: Path, content: bytes, format: str | None) -> None:
    expected = hf_index_verdict(content, folder)
    result = outcome(lambda: tm.open(folder, format))
    event(f"{format or 'detected'}: {type(result).__name__}")
    if expected is not None:
        assert type(result) is expected, (result, expected)
        return
    assert not isinstance(result, CheckpointError), result
    weight_map = json.loads(content)["weight_map"]
    with result as ck:
        assert ck.format == "hf-sharded" and list(ck) == list(weight_map)
        for name in weight_map:
            got = ck[name].full()
            assert got.dtype == TRUTH[name].dtype and got.tobytes() == TRUTH[name].tobytes()
            assert ck[name].file_shard[1] == len(set(weight_map.values()))


@FUZZ
@given(blob=st.binary(max_size=300) | st.builds(lambda v: json.dumps(v).encode(), json_values),
       change=edits(len(HF_SEED)))
@example(blob=HF_SEED, change=([], None))
def test_hf_index_random_bytes(hf_scratch: Path, blob: bytes, change: Any) -> None:
    for content in (blob, mutate(HF_SEED, change)):
        replace_file(hf_scratch / "model.safetensors.index.json", content)
        assert_hf_index_outcome(hf_scratch, content, "hf-sharded")
        # detection of indexes that do not name a weight_map has a known bug (test_hf_index_detection_...)
        if b'"weight_map"' in content:
            assert_hf_index_outcome(hf_scratch, content, None)


@pytest.mark.parametrize("text", ["5", "null", "[" * 100000 + "]" * 100000])
def test_hf_index_detection_of_non_object_json(hf_folder: Path, text: str) -> None:
    folder = write_index(hf_folder, text)
    result = outcome(lambda: tm.open(folder))
    assert isinstance(result, CheckpointError)


def test_hf_index_limits_the_tensors_and_files_it_names(hf_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An index names at most MAX_INDEX_TENSORS tensors and MAX_INDEX_FILES files (each is opened and read);
    both are checked before any file is looked at (small limits here stand for the real ones)."""
    folder = write_index(hf_folder, {"weight_map": {"a": SHARD1, "b": SHARD1, "c": SHARD2}})
    monkeypatch.setattr(hf_sharded, "MAX_INDEX_TENSORS", 2)
    with pytest.raises(HeaderError, match="weight_map names 3 tensors, over the limit of 2") as info:
        tm.open(folder)
    assert info.value.file == str(folder / "model.safetensors.index.json")
    monkeypatch.setattr(hf_sharded, "MAX_INDEX_TENSORS", 3)
    monkeypatch.setattr(hf_sharded, "MAX_INDEX_FILES", 1)
    with pytest.raises(HeaderError, match="weight_map names 2 files, over the limit of 1"):
        tm.open(folder)
    monkeypatch.setattr(hf_sharded, "MAX_INDEX_FILES", 2)
    with tm.open(folder) as ck:
        assert list(ck) == ["a", "b", "c"]
    shutil.rmtree(folder)
