"""File names that leave the checkpoint folder (traversal, absolute paths, links, NUL bytes) in HF indexes and
DCP metadata (see hostile_support)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
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


def test_a_file_swapped_for_a_link_after_opening_is_not_followed(tmp_path: Path) -> None:
    """A long-lived reader (the viewer, convert) resolved and checked each name when it opened the checkpoint; a
    file replaced by a link afterwards must not lead its reads outside the folder."""
    import safetensors.numpy

    folder = tmp_path / "ck"
    folder.mkdir()
    safetensors.numpy.save_file({"w": np.arange(6, dtype=np.float32)}, str(folder / "model.safetensors"))
    outside = tmp_path / "outside.safetensors"
    safetensors.numpy.save_file({"w": np.full(6, 7, dtype=np.float32)}, str(outside))
    checkpoint = tm.open(folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="became a link after the checkpoint was opened"):
        checkpoint["w"][...]


def test_an_unreadable_file_of_one_format_does_not_stop_detecting_another(tmp_path: Path) -> None:
    import safetensors.numpy

    folder = tmp_path / "ck"
    folder.mkdir()
    safetensors.numpy.save_file({"w": np.arange(6, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / "manifest.json").symlink_to("manifest.json")  # a loop of links: unreadable, so not our format
    assert tm.detect(folder) == "safetensors"
    assert np.array_equal(tm.open(folder)["w"][...], np.arange(6, dtype=np.float32))


def _hub_cache(base: Path) -> Path:
    """A revision of the Hugging Face hub cache, laid out as huggingface_hub lays it out (checked below with its
    own scan_cache_dir): snapshots/<rev>/<file> are relative links to blobs/<hash>."""
    import hashlib

    import safetensors.numpy

    repo = base / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    scratch = base / "scratch.safetensors"
    safetensors.numpy.save_file({"w": np.arange(6, dtype=np.float32)}, str(scratch))
    digest = hashlib.sha256(scratch.read_bytes()).hexdigest()
    scratch.rename(repo / "blobs" / digest)
    (snapshot / "model.safetensors").symlink_to(f"../../blobs/{digest}")
    return snapshot


def test_a_hugging_face_cache_revision_opens_through_its_blob_links(tmp_path: Path) -> None:
    from huggingface_hub import scan_cache_dir

    snapshot = _hub_cache(tmp_path)
    (repo,) = scan_cache_dir(tmp_path / "hub").repos
    assert repo.repo_id == "org/tiny"
    assert [f.file_name for r in repo.revisions for f in r.files] == ["model.safetensors"]
    for path in (snapshot, snapshot / "model.safetensors"):
        assert np.array_equal(tm.open(path)["w"][...], np.arange(6, dtype=np.float32))


def test_a_hugging_face_cache_revision_still_confines_other_links(tmp_path: Path) -> None:
    snapshot = _hub_cache(tmp_path)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((snapshot / "model.safetensors").read_bytes())
    (snapshot / "model.safetensors").unlink()  # a link out of the repo instead of into its blobs
    (snapshot / "model.safetensors").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="resolves outside the checkpoint folder"):
        tm.open(snapshot / "model.safetensors")["w"][...]
