"""File names that leave the checkpoint folder (traversal, absolute paths, links, NUL bytes) in HF indexes and
DCP metadata (see hostile_support)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from hostile_support import (
    SHARD1,
    SHARD2,
    copy_dcp,
    load_metadata,
    outcome,
    save_metadata,
    write_index,
)

import tensormorph as tm
from tensormorph.errors import CheckpointError, MissingFileError, TensorNotFoundError, UnsafePathError

pytestmark = pytest.mark.timeout(120)




@pytest.mark.parametrize("target, error, message", [
    ("/etc/passwd", UnsafePathError, "outside the checkpoint folder"),
    ("../outside.safetensors", UnsafePathError, "outside the checkpoint folder"),
    ("link.safetensors", UnsafePathError, "resolves outside the checkpoint folder"),
    ("linkdir/stolen.safetensors", UnsafePathError, "resolves outside the checkpoint folder"),
    ("missing.safetensors", MissingFileError, r"missing\.safetensors.*is missing"),
    (SHARD2, TensorNotFoundError, "does not contain it"),
])
def test_hf_index_bad_targets(hf_folder: Path, target: str, error: type, message: str) -> None:
    folder = write_index(hf_folder, {"metadata": {}, "weight_map": {"a": target, "b": SHARD1}})
    with pytest.raises(error, match=message) as info:
        tm.open(folder)
    if error is TensorNotFoundError:
        assert info.value.tensor == "a"
    assert "passwd" not in str(info.value) or target == "/etc/passwd"
    shutil.rmtree(folder)


def test_hf_index_that_is_itself_a_link_outside_is_refused(hf_folder: Path) -> None:
    folder = write_index(hf_folder, {"weight_map": {"a": SHARD1}}, name="elsewhere.json")
    (hf_folder.parent / "evil.index.json").write_text(json.dumps({"weight_map": {"a": SHARD1}}))
    (folder / "model.safetensors.index.json").symlink_to(hf_folder.parent / "evil.index.json")
    with pytest.raises(UnsafePathError):
        tm.open(folder)
    shutil.rmtree(folder)


@pytest.mark.parametrize("relative", ["../../etc/passwd", "/etc/passwd", "../outside.distcp", "~/x.distcp", "",
                                      "sub/../../x.distcp"])
def test_dcp_storage_path_outside_the_folder_is_refused(dcp_seed: Path, tmp_path: Path, relative: str) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    (tmp_path / "outside.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    metadata = load_metadata(folder)
    key = next(k for k in metadata.storage_data if k.fqn == "w")
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path=relative)
    save_metadata(folder, metadata)
    with pytest.raises(UnsafePathError, match="outside the checkpoint folder") as info:
        tm.open(folder)
    assert ".metadata" in str(info.value)


def test_dcp_storage_path_through_an_escaping_link_is_refused(dcp_seed: Path, tmp_path: Path) -> None:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    (tmp_path / "outside.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    (folder / "__0_1.distcp").symlink_to(tmp_path / "outside.distcp")
    metadata = load_metadata(folder)
    for key, info in metadata.storage_data.items():
        metadata.storage_data[key] = dataclasses.replace(info, relative_path="__0_1.distcp")
    save_metadata(folder, metadata)
    with pytest.raises(UnsafePathError, match="resolves outside the checkpoint folder"):
        tm.open(folder)


@pytest.mark.parametrize("where", ["dcp", "hf"])
def test_nul_byte_in_a_named_file_is_a_checkpoint_error(dcp_seed: Path, hf_folder: Path, tmp_path: Path,
                                                         where: str) -> None:
    if where == "dcp":
        folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
        metadata = load_metadata(folder)
        key = next(k for k in metadata.storage_data if k.fqn == "w")
        metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path="__0_0\x00.distcp")
        save_metadata(folder, metadata)
    else:
        folder = write_index(hf_folder, {"weight_map": {"a": "model\x00.safetensors"}})
    assert isinstance(outcome(lambda: tm.open(folder)), CheckpointError)


def test_megatron_detection_reads_no_metadata_json_linked_out_of_the_folder(dcp_seed: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    folder = copy_dcp(dcp_seed, tmp_path / "ck")
    (folder / "metadata.json").symlink_to(outside)
    assert tm.detect(folder) == "dcp"  # the link is not followed: a plain DCP folder, not a Megatron one
    (folder / "metadata.json").unlink()
    (folder / "metadata.json").write_text(outside.read_text())
    assert tm.detect(folder) == "megatron-torch-dist"
