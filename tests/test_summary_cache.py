"""The viewer's summary cache on disk (summary_cache.py): a hit is the fresh description byte for byte, a changed
file misses, and an altered, planted or swapped entry is refused and described afresh.

Checkpoints are copies of the real fixtures (transformers' save_pretrained shards, DCP on 4 gloo ranks), since the
tests change their files.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from starlette.testclient import TestClient

from tensormorph import summary_cache
from tensormorph.server import Viewer, create_app
from tensormorph.summary_cache import KEY_FILE, MAGIC, SUMMARY_FOLDER, top_identity


@pytest.fixture(autouse=True)
def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies are made just before each test: taken as settled at once (test_files_changed_just_now_... keeps
    the rule)."""
    monkeypatch.setattr(summary_cache, "SETTLED_S", 0.0)


@pytest.fixture
def hf_copy(hf_llama_safetensors: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(hf_llama_safetensors, tmp_path / "hf"))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """The viewer's tile folder: summaries go beside it, in SUMMARY_FOLDER."""
    return tmp_path / "cache" / "tiles"


@pytest.fixture
def described(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths Viewer.describe was called for, in order: a hit describes nothing."""
    calls: list[str] = []
    original = Viewer.describe

    def counting(self: Viewer, ck):  # type: ignore[no-untyped-def]
        calls.append(str(ck.path))
        return original(self, ck)

    monkeypatch.setattr(Viewer, "describe", counting)
    return calls


def summary_of(path: Path, cache: Path | None) -> tuple[bytes, bytes]:
    """(what a new viewer on `path` serves, a fresh description of the same opened checkpoint)."""
    viewer = Viewer([path], cache_dir=cache)
    try:
        served = viewer.summary("a")
        assert gzip.decompress(served.packed) == served.raw
        return served.raw, Viewer.describe(viewer, viewer.checkpoint("a"))
    finally:
        viewer.close()


def entries(cache: Path) -> list[Path]:
    folder = cache.parent / SUMMARY_FOLDER
    return sorted(p for p in folder.iterdir() if p.name != KEY_FILE) if folder.exists() else []


def hf_shards(path: Path) -> list[Path]:
    return sorted(path.glob("model-*.safetensors"))


def test_a_hit_is_the_fresh_description_byte_for_byte(hf_copy, cache, described):
    first, fresh = summary_of(hf_copy, cache)
    assert first == fresh and described == [str(hf_copy)] * 2  # the miss described it, then the fresh one
    (entry,) = entries(cache)
    assert entry.read_bytes().startswith(MAGIC) and len(entry.read_bytes()) < len(first)  # packed
    assert (cache.parent / SUMMARY_FOLDER / KEY_FILE).stat().st_mode & 0o777 == 0o600
    described.clear()
    hit, fresh = summary_of(hf_copy, cache)
    assert described == [str(hf_copy)]  # only the fresh description of the test: the viewer read its entry
    assert hit == fresh == first
    body = json.loads(hit)
    assert body["tensor_count"] == len(body["tensors"]) > 0 and body["config"]["model_type"] == "llama"


def test_a_hit_on_dcp_on_four_ranks_and_through_the_endpoint(dcp_ckpt, tmp_path, cache, described):
    folder = Path(shutil.copytree(dcp_ckpt, tmp_path / "dcp"))
    first, _ = summary_of(folder, cache)
    described.clear()
    with TestClient(create_app([folder], cache_dir=cache)) as client:
        answer = client.get("/api/checkpoints/a/summary", headers={"Accept-Encoding": "gzip"})
        assert answer.status_code == 200 and answer.content == first
        assert answer.headers["content-encoding"] == "gzip" and int(answer.headers["content-length"]) < len(first)
        plain = client.get("/api/checkpoints/a/summary", headers={"Accept-Encoding": "identity"})
        assert "content-encoding" not in plain.headers and plain.content == first
    assert described == []
    assert json.loads(first)["format"] == "dcp"


def _rewrite_shard_as_f16(folder: Path) -> None:
    """The first shard saved again with its tensors in float16, its mtime set back to the old one."""
    shard = hf_shards(folder)[0]
    before = shard.stat()
    tensors = safetensors.numpy.load_file(str(shard))
    safetensors.numpy.save_file({k: v.astype(np.float16) for k, v in tensors.items()}, str(shard),
                                metadata={"format": "pt"})
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))


def _replace_shard_with_same_bytes(folder: Path) -> None:
    """A copy of the first shard (same bytes, size and mtime) renamed over it: only its inode and ctime differ."""
    shard = hf_shards(folder)[0]
    copy = shard.with_name("copy.tmp")
    shutil.copy2(shard, copy)
    os.replace(copy, shard)


def _touch_shard(folder: Path) -> None:
    shard = hf_shards(folder)[-1]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1_000_000_000))


def _edit_config(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "mistral"
    (folder / "config.json").write_text(json.dumps(config))


def _add_a_file(folder: Path) -> None:
    (folder / "README.md").write_text("a file added beside the shards\n")


@pytest.mark.parametrize("change", [_rewrite_shard_as_f16, _replace_shard_with_same_bytes, _touch_shard, _edit_config,
                                    _add_a_file])
def test_a_changed_file_misses(hf_copy, cache, described, change):
    first, _ = summary_of(hf_copy, cache)
    change(hf_copy)
    described.clear()
    served, fresh = summary_of(hf_copy, cache)
    assert described == [str(hf_copy)] * 2  # described by the viewer, then by the test
    assert served == fresh
    if change is _rewrite_shard_as_f16:
        assert served != first and "F16" in json.loads(served)["totals_by_dtype"]
    if change is _edit_config:
        assert json.loads(served)["config"]["model_type"] == "mistral"
    described.clear()
    again, _ = summary_of(hf_copy, cache)  # the new description replaced the entry
    assert again == fresh and described == [str(hf_copy)]


def _flip_a_payload_byte(entry: Path, other: Path) -> None:
    data = bytearray(entry.read_bytes())
    data[-10] ^= 0x01
    entry.write_bytes(bytes(data))


def _forge_with_another_key(entry: Path, other: Path) -> None:
    """The entry's body with its header saying the same, signed under a key the cache does not have."""
    import hashlib
    import hmac

    body = entry.read_bytes()[len(MAGIC) + 32:]
    entry.write_bytes(MAGIC + hmac.new(b"k" * 32, body, hashlib.sha256).digest() + body)


def _swap_in_another_checkpoints_entry(entry: Path, other: Path) -> None:
    """A validly signed entry, of another checkpoint, put under this one's name."""
    entry.write_bytes(other.read_bytes())


def _plant_a_link(entry: Path, other: Path) -> None:
    """The entry moved away and a link to it put in its place: a valid entry, but read only through a link."""
    moved = entry.with_name("moved")
    os.replace(entry, moved)
    entry.symlink_to(moved)


@pytest.mark.parametrize("tamper", [_flip_a_payload_byte, _forge_with_another_key, _swap_in_another_checkpoints_entry,
                                    _plant_a_link])
def test_a_tampered_entry_is_refused_and_described_afresh(hf_copy, tmp_path, cache, described, tamper):
    other = Path(shutil.copytree(hf_copy, tmp_path / "other"))
    _rewrite_shard_as_f16(other)  # a different summary
    first, _ = summary_of(hf_copy, cache)
    before = set(entries(cache))
    summary_of(other, cache)
    (other_entry,) = set(entries(cache)) - before
    (entry,) = before
    original = entry.read_bytes()
    tamper(entry, other_entry)
    described.clear()
    served, fresh = summary_of(hf_copy, cache)
    assert described == [str(hf_copy)] * 2 and served == fresh == first
    assert not entry.is_symlink() and entry.read_bytes() != other_entry.read_bytes()  # rewritten, the link replaced
    if tamper is _plant_a_link:
        assert (entry.parent / "moved").read_bytes() == original  # the write replaced the link, not its target
    assert "F16" in json.loads(summary_of(other, cache)[0])["totals_by_dtype"]  # the link's target untouched
    described.clear()
    assert summary_of(hf_copy, cache)[0] == first and described == [str(hf_copy)]  # a hit again


def test_a_linked_key_is_not_followed(hf_copy, tmp_path, cache, described):
    (cache.parent / SUMMARY_FOLDER).mkdir(parents=True)
    (tmp_path / "elsewhere").write_bytes(b"k" * 32)
    (cache.parent / SUMMARY_FOLDER / KEY_FILE).symlink_to(tmp_path / "elsewhere")
    first, fresh = summary_of(hf_copy, cache)
    assert first == fresh and not entries(cache)  # no key it trusts: nothing cached
    described.clear()
    assert summary_of(hf_copy, cache)[0] == first and len(described) == 2


def test_files_changed_while_opening_are_not_cached(hf_copy, cache, monkeypatch):
    stale = top_identity(hf_copy)
    assert stale is not None
    _touch_shard(hf_copy)  # between the identity taken before the open and the open itself
    monkeypatch.setattr("tensormorph.server.top_identity", lambda path: stale)
    served, fresh = summary_of(hf_copy, cache)
    assert served == fresh and not entries(cache)


def test_a_single_file_checkpoint_and_its_config_beside(tmp_path, cache, described):
    folder = tmp_path / "one"
    folder.mkdir()
    path = folder / "model.safetensors"
    safetensors.numpy.save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(path))
    first, _ = summary_of(path, cache)
    assert json.loads(first)["config"] is None
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # appears beside it: a miss
    described.clear()
    served, fresh = summary_of(path, cache)
    assert served == fresh and json.loads(served)["config"] == {"model_type": "gpt2"} and len(described) == 2


def test_no_cache_dir_describes_every_time(hf_copy, described):
    assert summary_of(hf_copy, None)[0] == summary_of(hf_copy, None)[0]
    assert len(described) == 4


def test_the_least_recently_used_entries_go(tmp_path, cache, monkeypatch):
    monkeypatch.setattr("tensormorph.summary_cache.MAX_ENTRIES", 2)
    paths = []
    for k in range(3):
        path = tmp_path / f"m{k}.safetensors"
        safetensors.numpy.save_file({"w": np.full((2, k + 1), k, dtype=np.float32)}, str(path))
        paths.append(path)
    summary_of(paths[0], cache)
    (oldest,) = entries(cache)
    summary_of(paths[1], cache)
    os.utime(oldest, ns=(1, 1))  # long unused
    summary_of(paths[2], cache)
    assert len(entries(cache)) == 2 and oldest not in entries(cache)
    assert (cache.parent / SUMMARY_FOLDER / KEY_FILE).is_file()  # the key is never evicted


def test_a_changed_link_target_misses(hf_copy, cache, described):
    """A shard that is a link (as in a Hugging Face snapshot, to its blob): rewriting what it points to misses."""
    shard = hf_shards(hf_copy)[0]
    (hf_copy / "blobs").mkdir()
    blob = hf_copy / "blobs" / shard.name
    os.replace(shard, blob)
    shard.symlink_to(Path("blobs") / shard.name)
    first, _ = summary_of(hf_copy, cache)
    tensors = safetensors.numpy.load_file(str(blob))
    before = blob.stat()
    with open(blob, "r+b") as handle:  # in place: the link and both folders keep their identity
        handle.truncate(0)
        handle.write(_f16_bytes(tensors))
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    described.clear()
    served, fresh = summary_of(hf_copy, cache)
    assert len(described) == 2 and served == fresh != first and "F16" in json.loads(served)["totals_by_dtype"]


def _f16_bytes(tensors: dict) -> bytes:
    return safetensors.numpy.save({k: v.astype(np.float16) for k, v in tensors.items()}, metadata={"format": "pt"})


def test_files_changed_just_now_are_not_cached(hf_copy, cache, described, monkeypatch):
    """A file changed within SETTLED_S could change again within the same clock tick keeping its identity: such a
    checkpoint is described and served, not stored, until its files have settled."""
    monkeypatch.setattr(summary_cache, "SETTLED_S", 3600.0)  # the copy was made within the hour
    raw, fresh = summary_of(hf_copy, cache)
    assert raw == fresh and entries(cache) == []
    monkeypatch.setattr(summary_cache, "SETTLED_S", 0.0)
    summary_of(hf_copy, cache)
    assert len(entries(cache)) == 1
