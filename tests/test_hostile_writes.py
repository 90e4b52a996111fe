"""Files Tensormorph creates inside a folder the user gave it never follow a planted link (issue 14, defect 1).

An attacker who controls a checkpoint folder controls its manifest, its copies and any links in it. Repair
must write only inside the folder, never through a link, and replace a damaged name itself rather than
whatever a link at that name points to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import crc32c
import pytest

import tensormorph as tm
from tensormorph.ops.repair import repair, write_checked
from tensormorph.storage import create_new
from tensormorph.tmformat.checksums import RunningCrc
from tensormorph.tmformat.manifest import MANIFEST

pytestmark = pytest.mark.timeout(120)

RANK0, RANK1, COPY0 = "rank-00000.safetensors", "rank-00001.safetensors", "rank-00000.copy1.safetensors"


@pytest.fixture
def replicated(dcp_ckpt: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ck"
    tm.convert(dcp_ckpt, out, to="tensormorph", mesh=2, placements=["Shard(0)"], redundancy="replicate:2")
    return out


def _record_as(folder: Path, name: str, content: bytes) -> None:
    """Make the manifest vouch for `content` under `name`, as an attacker who wrote the manifest would."""
    document = json.loads((folder / MANIFEST).read_text())
    body = document["body"]
    crc = RunningCrc()
    list(crc.passing([content]))
    for records in (body["files"], body["redundancy"]["files"]):
        if name in records:
            records[name].update(size=crc.size, crc32c=f"{crc.value:08x}")
    text = json.dumps(body, separators=(",", ":"), allow_nan=False)
    document["manifest_crc32c"] = f"{crc32c.crc32c(text.encode()):08x}"
    (folder / MANIFEST).write_text(json.dumps(document))


def test_repair_never_writes_through_a_planted_link(replicated: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    size = (replicated / RANK0).stat().st_size
    payload = (b"attacker-chosen bytes " * size)[:size]  # the size the manifest's chunks need
    (replicated / COPY0).write_bytes(payload)
    (replicated / RANK0).write_bytes(b"damaged")
    _record_as(replicated, COPY0, payload)
    _record_as(replicated, RANK0, payload)
    # every name a rebuild could predictably write to
    for planted in (f"{RANK0}.repair", f".{RANK0}.repair", f"{RANK0}.tmp", f".{RANK0}.tmp"):
        (replicated / planted).symlink_to(outside)
    report = repair(replicated)
    assert report.repaired == [RANK0]
    assert outside.read_bytes() == b"precious"
    rebuilt = replicated / RANK0
    assert not rebuilt.is_symlink() and rebuilt.read_bytes() == payload


def test_repair_replaces_a_damaged_link_not_its_target(replicated: Path) -> None:
    """A damaged name that is a link to another file of the checkpoint: the rebuild replaces the link, and the
    file it pointed to keeps its bytes."""
    neighbour = (replicated / RANK1).read_bytes()
    good = (replicated / RANK0).read_bytes()
    (replicated / RANK0).unlink()
    (replicated / RANK0).symlink_to(RANK1)
    report = repair(replicated)
    assert report.repaired == [RANK0] and report.ok
    assert (replicated / RANK1).read_bytes() == neighbour
    assert not (replicated / RANK0).is_symlink() and (replicated / RANK0).read_bytes() == good


@pytest.mark.parametrize("target_exists", [True, False])
def test_new_files_refuse_a_link_at_their_name(tmp_path: Path, target_exists: bool) -> None:
    outside = tmp_path / "outside.bin"
    if target_exists:
        outside.write_bytes(b"precious")
    link = tmp_path / "new.bin"
    link.symlink_to(outside)
    with pytest.raises(FileExistsError):
        write_checked(link, [b"x"])
    with pytest.raises(FileExistsError):
        create_new(link)
    assert outside.read_bytes() == b"precious" if target_exists else not outside.exists()
    assert os.readlink(link) == str(outside)
