"""`tensormorph rollback RUN --to STEP`: later checkpoints are kept aside (or deleted), memory snapshots of later
steps are released or ignored, the next resume starts at STEP exactly, and retention never deletes STEP."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from test_train_tiers import _step, _training
from test_train_tiers import s3 as s3  # the module's moto server fixture

from tensormorph.cli.rollback import rollback_command
from tensormorph.errors import CheckpointError
from tensormorph.train import Checkpointer
from tensormorph.train.rollback import read_marker, roll_back


def _run(tmp_path, steps=range(1, 7), **options):
    """A closed run saved at every step (disk, and memory with memory_keep=2): the weights after each step."""
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm", release_memory_on_close=False,
                        **options)
    at = {}
    for step in steps:
        _step(model, opt, step)
        ckpt.save(step, model=model, optimizer=opt, extra={"step": step})
        at[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt.close()
    return at


def _resume(tmp_path, **options):
    fresh, fresh_opt = _training(seed=1)
    ckpt = Checkpointer(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm", **options)
    step = ckpt.resume(model=fresh, optimizer=fresh_opt)
    return ckpt, step, fresh, fresh_opt


def test_a_rollback_keeps_later_checkpoints_aside_and_resume_starts_at_its_step(tmp_path):
    at = _run(tmp_path)
    result = CliRunner().invoke(rollback_command, [str(tmp_path / "run"), "--to", "3", "--memory-dir",
                                                   str(tmp_path / "shm"), "--json"])
    assert result.exit_code == 0, result.output
    done = json.loads(result.output)
    assert [(a["step"], a["seq"]) for a in done["abandoned"]] == [(4, 4), (5, 5), (6, 6)]
    assert done["memory_snapshots_released"] == 2  # steps 5 and 6 (memory_keep=2)
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")) == [
        "abandoned-step-00000004-4", "abandoned-step-00000005-5", "abandoned-step-00000006-6",
        "step-00000001", "step-00000002", "step-00000003"]
    ckpt, step, fresh, fresh_opt = _resume(tmp_path, release_memory_on_close=False)
    assert (step, ckpt.resumed_from, ckpt.extra) == (3, "disk", {"step": 3})
    assert all(torch.equal(p, at[3][n]) for n, p in fresh.named_parameters())
    assert read_marker(ckpt.root).resumed  # later snapshots are the run's own again
    for step in (4, 5):  # the run goes on from 3: new checkpoints of steps that were abandoned
        _step(fresh, fresh_opt, step)
        ckpt.save(step, model=fresh, optimizer=fresh_opt)
    ckpt.wait()
    assert [(i.step, i.seq) for i in ckpt.list()] == [(1, 1), (2, 2), (3, 3), (4, 7), (5, 8)]  # numbered after 6
    assert (tmp_path / "run" / "abandoned-step-00000004-4").is_dir()  # still kept
    ckpt.close()
    again, step, _, _ = _resume(tmp_path)
    assert (step, again.resumed_from) == (5, "memory")  # the new snapshot of 5 counts: the marker was settled
    again.close()


def test_retention_never_deletes_the_step_rolled_back_to(tmp_path):
    _run(tmp_path, keep=3)  # steps 4, 5, 6 kept on disk
    roll_back(tmp_path / "run", 5, memory_dir=tmp_path / "shm")
    ckpt, step, model, opt = _resume(tmp_path, keep=2)
    assert step == 5
    for step in (6, 7, 8):
        _step(model, opt, step)
        ckpt.save(step, model=model, optimizer=opt)
    ckpt.wait()
    assert [i.step for i in ckpt.list()] == [5, 7, 8]  # keep=2, and the rollback's step
    ckpt.close()


def test_snapshots_left_on_another_machine_are_ignored_by_the_next_resume(tmp_path):
    at = _run(tmp_path)
    other = tmp_path / "other-shm"  # the rollback is run where the run's memory is not: nothing is released
    assert roll_back(tmp_path / "run", 3, memory_dir=other)["memory_snapshots_released"] == 0
    ckpt, step, fresh, _ = _resume(tmp_path)
    assert (step, ckpt.resumed_from) == (3, "disk")  # not the snapshots of 5 and 6
    assert all(torch.equal(p, at[3][n]) for n, p in fresh.named_parameters())
    assert ckpt.memory_steps() == ()  # forgotten by the resume
    ckpt.close()


def test_delete_removes_later_checkpoints_and_bad_requests_are_refused(tmp_path):
    _run(tmp_path, steps=range(1, 5))
    with pytest.raises(CheckpointError, match=r"no committed checkpoint of step 9 .*steps: \[1, 2, 3, 4\]"):
        roll_back(tmp_path / "run", 9, memory_dir=tmp_path / "shm")
    model, opt = _training()
    alive = Checkpointer(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm")
    with pytest.raises(CheckpointError, match="alive"):
        roll_back(tmp_path / "run", 2, memory_dir=tmp_path / "shm")
    alive.close()  # and releases its memory
    done = roll_back(tmp_path / "run", 2, delete=True, memory_dir=tmp_path / "shm")
    assert [a["kept_at"] for a in done["abandoned"]] == [None, None]
    assert sorted(p.name for p in (tmp_path / "run").glob("*step-*")) == ["step-00000001", "step-00000002"]
    (tmp_path / "run" / ".tensormorph-rollback.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="rollback marker is damaged"):
        Checkpointer(tmp_path / "run").list()


def test_a_rollback_reaches_the_object_store(tmp_path, s3):
    options = s3.storage_options
    url = "s3://tiers/rolled"
    remote = dict(remote=url, remote_every=2, remote_storage_options=options)
    at = _run(tmp_path, **remote)  # steps 2, 4 and 6 copied to the store
    roll_back(tmp_path / "run", 2, memory_dir=tmp_path / "shm", remote=url, remote_storage_options=options)
    shutil.rmtree(tmp_path / "run")  # the local disk is lost: only the store (and its marker) remain
    ckpt, step, fresh, _ = _resume(tmp_path, **remote)
    assert (step, ckpt.resumed_from) == (2, "remote")  # not 4 or 6
    assert all(torch.equal(p, at[2][n]) for n, p in fresh.named_parameters())
    ckpt.close()


def test_a_second_rollback_from_a_fresh_disk_keeps_the_stores_earlier_one(tmp_path):
    """The object store's marker holds every rollback's abandoned checkpoints: a rollback run where the local disk
    was lost (no local marker) must not bring them back."""
    url = "memory://rollbacks/run"
    remote = dict(remote=url, remote_every=1, remote_storage_options={})
    at = _run(tmp_path, steps=range(1, 4), **remote)
    roll_back(tmp_path / "run", 1, memory_dir=tmp_path / "shm", remote=url)
    shutil.rmtree(tmp_path / "run")
    (tmp_path / "run").mkdir()
    roll_back(tmp_path / "run", 1, memory_dir=tmp_path / "shm", remote=url)
    marker = read_marker(tmp_path / "run")  # the fresh local root's, merged with the store's
    assert marker is not None and marker.abandoned == [(2, 2), (3, 3)] and marker.max_seq == 3
    ckpt, step, fresh, _ = _resume(tmp_path, **remote)
    assert (step, ckpt.resumed_from) == (1, "remote")  # not step 3
    assert all(torch.equal(p, at[1][n]) for n, p in fresh.named_parameters())
    ckpt.close()


def test_a_rank_folder_planted_as_a_link_is_never_entered(tmp_path):
    from tensormorph.train.manager import CheckpointManager
    from tensormorph.train.memory import run_folder

    _run(tmp_path, steps=range(1, 4))
    victim = tmp_path / "victim" / "step-00000009"
    victim.mkdir(parents=True)
    (victim / "precious").write_text("keep")
    manager = CheckpointManager(tmp_path / "run", None)
    planted = run_folder(manager.root, tmp_path / "shm", manager.run_id()) / "elsewhere" / "rank-00007"
    planted.parent.mkdir()
    planted.symlink_to(victim.parent, target_is_directory=True)
    roll_back(tmp_path / "run", 1, memory_dir=tmp_path / "shm")
    assert (victim / "precious").read_text() == "keep"  # step 9 > 1, but behind a link: untouched


def test_a_run_without_a_memory_tier_is_alive_until_its_checkpointer_closes(tmp_path):
    """The run's lock, held shared from the first save or resume: rollback refuses while it is held, also when no
    memory tier says so; a forked child (a DataLoader worker) does not keep the run alive after its parent closed."""
    import os
    import time

    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run")
    for step in (1, 2, 3):
        _step(model, opt, step)
        ckpt.save(step, model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match="alive .*lock"):
        roll_back(tmp_path / "run", 2)
    assert [i.step for i in Checkpointer(tmp_path / "run").list()] == [1, 2, 3]  # nothing abandoned
    ready, told = os.pipe()
    child = os.fork()
    if child == 0:  # holds a copy of every descriptor: the at-fork hook closed the lock's before fork() returned
        os.write(told, b"1")
        time.sleep(3)
        os._exit(0)
    try:
        assert os.read(ready, 1) == b"1"  # the child runs (a lock's copy is the same lock until it is closed)
        ckpt.close()
        assert roll_back(tmp_path / "run", 2)["abandoned"][0]["step"] == 3
    finally:
        os.waitpid(child, 0)
        os.close(ready)
        os.close(told)
    resumed = Checkpointer(tmp_path / "run")
    assert resumed.resume(model=model, optimizer=opt) == 2
    with pytest.raises(CheckpointError, match="alive"):
        roll_back(tmp_path / "run", 1)  # the resumed run holds it
    resumed.close()


def test_a_link_planted_at_the_runs_lock_is_refused_not_followed(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere.txt"
    run.mkdir()
    elsewhere.write_text("keep")
    (run / ".tensormorph-live").symlink_to(elsewhere)
    model, opt = _training()
    ckpt = Checkpointer(run)
    with pytest.raises(CheckpointError, match=r"\.tensormorph-live"):
        ckpt.save(1, model=model, optimizer=opt)
    assert elsewhere.read_text() == "keep"
