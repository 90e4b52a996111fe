"""The commit protocol's locks and cleaner: a save's marker is held only by the saving process, released on
failure, closed in forked children, and `remove_abandoned` deletes exactly the leftovers of dead saves."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import time

import pytest
import torch

import tensormorph as tm
from tensormorph.errors import CheckpointError
from tensormorph.tmformat import commit
from tensormorph.tmformat.manifest import INIT_PREFIX, SAVE_MARKER, TEMP_PREFIX


def _in_child(check) -> int:
    """Fork; the child runs `check()` and exits 0 when it returns True; returns the child's exit code."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if check() else 1)
        except BaseException:
            os._exit(2)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_failed_save_releases_its_marker_and_children_keep_unrelated_files(tmp_path):
    # a plain value that cannot be stored makes the save fail after its folder and marker exist
    with pytest.raises(CheckpointError, match="save did not commit"):
        tm.save({"w": torch.ones(3), "bad": object()}, tmp_path / "ckpt")
    assert set() == commit._HELD_MARKERS
    gc.collect()  # the failed save's objects are gone: their descriptor numbers are free for reuse
    unrelated = os.open(tmp_path / "unrelated", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert _in_child(lambda: _is_open(unrelated)) == 0
    finally:
        os.close(unrelated)
    # its folder is left for inspection, but no longer locked: a cleaner removes it
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]
    assert len(leftovers) == 1 and (leftovers[0] / SAVE_MARKER).is_file()
    assert commit.remove_abandoned(tmp_path) == leftovers
    assert not leftovers[0].exists() and not (tmp_path / "ckpt").exists()


def test_a_forked_child_closes_a_live_saves_marker_and_the_lock_stays_with_the_saver(tmp_path):
    target = commit.LocalDestination(tmp_path / "ckpt")
    token = target.prepare()
    marker = next(iter(commit._HELD_MARKERS))
    try:
        assert _in_child(lambda: not _is_open(marker)) == 0  # the fork hook closed the child's copy
        assert _is_open(marker)  # and not the parent's
        assert commit.remove_abandoned(tmp_path) == []  # the saver still holds the lock: a live save
        assert (tmp_path / token).is_dir()
    finally:
        target.abort()
    assert commit.remove_abandoned(tmp_path) == [tmp_path / token]


def test_remove_abandoned_deletes_only_what_no_live_save_owns(tmp_path):
    def folder(name: str, marker: bool, age_s: float = 0.0) -> os.PathLike:
        path = tmp_path / name
        path.mkdir()
        if marker:
            (path / SAVE_MARKER).write_text(json.dumps({"target": "ckpt", "started": 0, "pid": 1}))
        if age_s:
            old = time.time() - age_s
            os.utime(path, (old, old))
        return path

    dead_save = folder(f"{TEMP_PREFIX}ckpt-dead", marker=True)
    replaced = folder(f"{TEMP_PREFIX}replaced-ckpt-1", marker=False)
    young_init = folder(f"{INIT_PREFIX}young", marker=False)
    old_init = folder(f"{INIT_PREFIX}old", marker=False, age_s=3600)
    # set up by a process of this host that was killed before its marker existed: no grace needed
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    dead_init = folder(f"{INIT_PREFIX}{commit._HOST}-{dead_pid.pid}-0123456789ab", marker=False)
    alive_init = folder(f"{INIT_PREFIX}{commit._HOST}-{os.getpid()}-0123456789ab", marker=False)
    other_host_init = folder(f"{INIT_PREFIX}ffffffff-{dead_pid.pid}-0123456789ab", marker=False)
    checkpoint = folder("ckpt", marker=False)
    live = commit.LocalDestination(tmp_path / "other")
    live_folder = tmp_path / live.prepare()
    try:
        removed = commit.remove_abandoned(tmp_path, grace_s=60)
    finally:
        live.abort()
    assert sorted(removed) == sorted([dead_save, replaced, old_init, dead_init])
    assert young_init.is_dir() and checkpoint.is_dir() and live_folder.is_dir()
    assert alive_init.is_dir() and other_host_init.is_dir()
