"""The host-memory tier: each rank's snapshot in shared memory, resumed before the disk when it is newer and
whole on every rank, bit for bit; a damaged or partial snapshot falls back to the next tier and says why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_train import Run, _assert_same_as
from test_train import zygote as zygote  # the module fixture, re-exported for the two-rank test
from torch import nn

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import CheckpointError, ChecksumError
from tensormorph.train import Checkpointer
from tensormorph.train.memory import run_folder

torch.set_num_threads(1)


def _training(seed: int = 0, width: int = 3):
    torch.manual_seed(seed)
    model = nn.Linear(4, width)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(100 + step)
    model(torch.randn(2, 4)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _train(ckpt: Checkpointer, model, opt, steps: range) -> dict[str, torch.Tensor]:
    for step in steps:
        _step(model, opt, step)
        ckpt.save(step, model=model, optimizer=opt, extra={"step": step})
    ckpt.wait()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _memory_folder(root, memory_dir=None) -> Path:
    """Where the run under `root` keeps its memory snapshots (named by the root and the run's id in it)."""
    from tensormorph.train.manager import CheckpointManager

    manager = CheckpointManager(root, None)
    return run_folder(manager.root, memory_dir, manager.run_id())


def _flip_byte(path: Path, at: int = -8) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _disk_data_files(root: Path) -> list[Path]:
    return sorted(root.glob("step-*/rank-*.safetensors"))


@pytest.mark.parametrize("async_save", [False, True])
def test_resumes_from_memory_without_reading_the_disk(tmp_path, async_save):
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run", memory_every=1, disk_every=3, memory_dir=tmp_path / "shm",
                        async_save=async_save, release_memory_on_close=False)
    saved = _train(ckpt, model, opt, range(1, 6))
    assert ckpt.memory_steps() == (4, 5) and [i.step for i in ckpt.list()] == [3]  # memory_keep=2
    assert [t.tiers for t in ckpt.timings] == [("memory",), ("memory",), ("memory", "disk"), ("memory",),
                                               ("memory",)]
    assert all(t.memory_s is not None and t.memory_s <= t.durable_s for t in ckpt.timings)
    assert ckpt.memory_bytes == sum(f.stat().st_size for f in (tmp_path / "shm").rglob("*")
                                    if f.is_file() and f.name != ".alive")
    ckpt.close()
    for data in _disk_data_files(tmp_path / "run"):
        _flip_byte(data)  # any read of the disk's data would fail its checksum

    fresh, fresh_opt = _training(seed=1)
    again = Checkpointer(tmp_path / "run", memory_every=1, disk_every=3, memory_dir=tmp_path / "shm")
    assert again.resume(model=fresh, optimizer=fresh_opt) == 5
    assert (again.resumed_from, again.resume_notes, again.extra) == ("memory", [], {"step": 5})
    assert all(torch.equal(p, saved[n]) for n, p in fresh.named_parameters())
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(fresh_opt.state_dict()["state"][0][key], opt.state_dict()["state"][0][key])
    again.close()
    assert not _memory_folder(again.root, tmp_path / "shm").exists()  # a finished run's memory is released


def test_a_damaged_snapshot_falls_back_to_disk_and_says_why(tmp_path):
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run", memory_every=1, disk_every=2, memory_dir=tmp_path / "shm",
                        release_memory_on_close=False)
    for step in range(1, 4):
        _step(model, opt, step)
        ckpt.save(step, model=model, optimizer=opt)
        if step == 2:
            at_disk = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt.close()
    _flip_byte(next((tmp_path / "shm").rglob("step-00000003/rank-00000.safetensors")))
    fresh, fresh_opt = _training(seed=1)
    again = Checkpointer(tmp_path / "run", memory_every=1, disk_every=2, memory_dir=tmp_path / "shm",
                         release_memory_on_close=False)
    assert again.resume(model=fresh, optimizer=fresh_opt) == 2
    assert again.resumed_from == "memory"  # the older whole snapshot, before the disk
    assert len(again.resume_notes) == 1 and "step 3 in memory: rank 0" in again.resume_notes[0]
    assert ChecksumError.__name__ in again.resume_notes[0] and "CRC-32C" in again.resume_notes[0]
    assert all(torch.equal(p, at_disk[n]) for n, p in fresh.named_parameters())
    again.close()
    _flip_byte(next((tmp_path / "shm").rglob("step-00000002/rank-00000.safetensors")))
    last = Checkpointer(tmp_path / "run", memory_every=1, disk_every=2, memory_dir=tmp_path / "shm")
    assert last.resume(model=fresh, optimizer=fresh_opt) == 2 and last.resumed_from == "disk"
    assert [n.split(":")[0] for n in last.resume_notes] == ["step 2 in memory"]
    last.close()


def test_a_snapshot_of_another_layout_falls_back_to_disk(tmp_path):
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run", memory_every=1, disk_every=1, memory_dir=tmp_path / "shm",
                        release_memory_on_close=False)
    _train(ckpt, model, opt, range(1, 3))
    ckpt.close()
    shutil.rmtree(tmp_path / "run" / "step-00000002")  # disk holds step 1, memory steps 1 and 2
    wider, wider_opt = _training(width=5)
    again = Checkpointer(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm")
    with pytest.raises(Exception, match="shape"):  # the disk checkpoint does not fit either: strict says so
        again.resume(model=wider, optimizer=wider_opt)
    again.close()


def test_a_newer_disk_checkpoint_wins_over_older_memory(tmp_path):
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run", memory_every=4, disk_every=1, memory_dir=tmp_path / "shm",
                        release_memory_on_close=False)
    saved = _train(ckpt, model, opt, range(1, 6))
    assert ckpt.memory_steps() == (4,)
    ckpt.close()
    fresh, fresh_opt = _training(seed=1)
    again = Checkpointer(tmp_path / "run", memory_every=4, memory_dir=tmp_path / "shm")
    assert again.resume(model=fresh, optimizer=fresh_opt) == 5 and again.resumed_from == "disk"
    assert all(torch.equal(p, saved[n]) for n, p in fresh.named_parameters())
    assert again.resume(model=fresh, optimizer=fresh_opt, step=4) == 4 and again.resumed_from == "memory"
    again.close()


def test_tiers_list_and_clean_a_dead_run(tmp_path):
    model, opt = _training()
    memory = str(tmp_path / "shm")
    ckpt = Checkpointer(tmp_path / "run", memory_every=1, disk_every=2, memory_dir=memory,
                        release_memory_on_close=False)
    _train(ckpt, model, opt, range(1, 4))
    listed = CliRunner().invoke(main, ["list", str(tmp_path / "run"), "--memory-dir", memory, "--json"])
    assert listed.exit_code == 0, listed.output
    report = json.loads(listed.output)
    assert [(r["step"], r["tiers"], r["disk"] is not None, r["memory"]["ranks"]) for r in report["steps"]] == [
        (2, ["memory", "disk"], True, [0]), (3, ["memory"], False, [0])]
    assert report["steps"][0]["disk"]["bytes"] == ckpt.list()[0].size and report["world_size"] == 1
    assert report["ranks"][0]["alive"] and report["ranks"][0]["bytes"] == ckpt.memory_bytes > 0
    refused = CliRunner().invoke(main, ["tiers", "clean", str(tmp_path / "run"), "--memory-dir", memory])
    assert refused.exit_code != 0 and "alive" in refused.output
    ckpt.close()  # the run ends without releasing: as after a crash
    cleaned = CliRunner().invoke(main, ["tiers", "clean", str(tmp_path / "run"), "--memory-dir", memory, "--json"])
    assert cleaned.exit_code == 0, cleaned.output
    assert json.loads(cleaned.output)["released_bytes"] == report["ranks"][0]["bytes"]
    assert not _memory_folder(ckpt.root, memory).exists()
    human = CliRunner().invoke(main, ["list", str(tmp_path / "run"), "--memory-dir", memory])
    assert human.exit_code == 0, human.output
    rows = [line.split()[:3] for line in human.output.splitlines()]
    assert rows[rows.index(["step", "resumes", "from"]) + 1:] == [["2", "disk", "-"]]  # step 3 was in memory only


def test_two_ranks_killed_resume_from_shared_memory_bitwise_identical(zygote, tmp_path):
    """FSDP2 on 2 gloo ranks, a memory snapshot every step and a disk checkpoint every 6: killed right after step
    8's snapshot, with every disk data file then damaged, the run resumes at step 8 from /dev/shm. Killed again at
    14 with rank 1's snapshot of 14 lost, it resumes at 13, the newest step whole on both ranks, and says why."""
    argv = ["--steps", "20", "--samples", "40", "--batch", "4", "--save-every", "1", "--memory-every", "1",
            "--disk-every", "6"]
    reference = Run(zygote, tmp_path, "ref", 2, ["--root", str(tmp_path / "ref-root"), *argv])
    reference.finish()
    root = ["--root", str(tmp_path / "run")]
    first = Run(zygote, tmp_path, "a", 2, [*root, *argv, "--markers", "8"])
    first.line("DURABLE 8")
    first.kill()
    for data in _disk_data_files(tmp_path / "run"):
        _flip_byte(data)
    second = Run(zygote, tmp_path, "b", 2, [*root, *argv, "--markers", "14"])
    second.line("DURABLE 14")
    second.kill()
    memory = _memory_folder(tmp_path / "run")
    lost = next(memory.glob("*/rank-00001/step-00000014"))
    shutil.rmtree(lost)
    third = Run(zygote, tmp_path, "c", 2, [*root, *argv])
    third.finish()
    assert (second.resumed(), third.resumed()) == (8, 13)
    assert second.line("RESUMED-FROM ") == "RESUMED-FROM memory []"
    assert third.line("RESUMED-FROM ") == 'RESUMED-FROM memory ["step 14 is in memory on ranks [0] only"]'
    _assert_same_as(reference, [first, second, third], 20, 2)
    assert not memory.exists()  # released when the run finished


def test_buddies_survive_the_loss_of_any_one_node():
    from tensormorph.train.peers import buddies

    assert buddies(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert buddies(["b", "a", "c", "a"]) == [2, 0, 1, 0]  # a -> b -> c -> a, by name
    assert buddies(["a", "a", "a", "b"]) == [3, 3, 3, 0]  # a node of one rank holds the others' copies
    assert buddies(["a", "a"]) == [None, None]  # one node: no copy would survive its loss
    for nodes in (["a", "a", "b", "b", "c"], ["x", "y", "y", "z", "z", "z"]):
        for rank, buddy in enumerate(buddies(nodes)):
            assert nodes[buddy] != nodes[rank]


def test_a_lost_node_is_restored_from_its_buddies_memory_bitwise_identical(zygote, tmp_path):
    """4 FSDP2 ranks on two simulated nodes (shared-memory namespaces "a" and "b"), a snapshot every step copied to
    a buddy on the other node, no disk checkpoint yet. Killed after step 6, node b's memory is deleted: its ranks
    get their snapshots back from node a's memory and the run goes on bit for bit."""
    argv = ["--steps", "10", "--samples", "32", "--batch", "2", "--save-every", "1", "--memory-every", "1",
            "--disk-every", "100", "--workers", "0", "--nodes", "a,a,b,b", "--peers"]
    reference = Run(zygote, tmp_path, "ref", 4, ["--root", str(tmp_path / "ref-root"), *argv])
    reference.finish()
    root = ["--root", str(tmp_path / "run")]
    first = Run(zygote, tmp_path, "a", 4, [*root, *argv, "--markers", "6"])
    first.line("DURABLE 6")
    first.kill()
    memory = _memory_folder(tmp_path / "run")
    held = sorted(p.relative_to(memory).as_posix() for p in memory.glob("*/rank-*/peer-*/step-*"))
    assert held == [f"{node}/rank-{r:05d}/peer-{o:05d}/step-{s:08d}" for node, r, o in
                    (("a", 0, 2), ("a", 1, 3), ("b", 2, 0), ("b", 3, 1)) for s in (4, 5, 6)]  # 3 kept with peers
    shutil.rmtree(memory / "b")  # the node is lost, with its memory
    assert not list((tmp_path / "run").glob("step-*"))  # and there is no disk checkpoint to fall back on
    listed = CliRunner().invoke(main, ["list", str(tmp_path / "run"), "--json"])
    assert listed.exit_code == 0, listed.output
    report = json.loads(listed.output)
    assert report["world_size"] == 4 and [(s["step"], s["tiers"], s["memory"]) for s in report["steps"]] == [
        (s, ["peer"], {"ranks": [0, 1], "copies": [2, 3], "complete": True}) for s in (4, 5, 6)]
    second = Run(zygote, tmp_path, "b", 4, [*root, *argv])
    second.finish()
    assert second.resumed() == 6 and second.line("RESUMED-FROM ") == "RESUMED-FROM peer []"
    _assert_same_as(reference, [first, second], 10, 4)
    assert not memory.exists()


@pytest.fixture(scope="module")
def s3():
    from remote_support import S3Endpoint

    with S3Endpoint() as endpoint:
        endpoint.make_bucket("tiers")
        yield endpoint


def test_memory_and_disk_lost_the_run_resumes_from_the_object_store(tmp_path, s3):
    from tensormorph.train.manager import CheckpointManager

    url = "s3://tiers/run"
    tiers = dict(memory_every=1, disk_every=2, remote=url, remote_every=4, remote_keep=2,
                 remote_storage_options=s3.storage_options, memory_dir=tmp_path / "shm")
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run", keep=2, release_memory_on_close=False, **tiers)
    at = {}
    for step in range(1, 13):
        _step(model, opt, step)
        timing = ckpt.save(step, model=model, optimizer=opt, extra={"step": step})
        at[step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert timing.tiers == tuple(t for t, every in (("memory", 1), ("disk", 2), ("remote", 4)) if step % every == 0)
    ckpt.wait()
    assert ckpt.remote_errors == ()
    assert ckpt.remote_copies[-1].step == 12 and all(c.seconds > 0 for c in ckpt.remote_copies)
    stored = [i.step for i in CheckpointManager(url, None, s3.storage_options).list()]
    # the drain copies the newest step handed over: one waiting behind a copy in progress may be replaced
    assert stored[-1] == 12 and len(stored) == 2 and set(stored) <= {4, 8, 12}  # remote_keep=2
    local = [i.step for i in ckpt.list()]  # keep=2, but retention leaves a step the drain was copying
    assert local[-2:] == [10, 12] and set(local[:-2]) <= {4, 8}
    listed = CliRunner().invoke(main, ["--storage-option", f"key={s3.key}", "--storage-option", f"secret={s3.secret}",
                                       "--storage-option", f"client_kwargs.endpoint_url={s3.endpoint}",
                                       "list", str(tmp_path / "run"), "--memory-dir", str(tmp_path / "shm"),
                                       "--remote", url, "--json"])
    assert listed.exit_code == 0, listed.output
    report = {r["step"]: r for r in json.loads(listed.output)["steps"]}
    assert sorted(report) == sorted({*range(11, 13), *local, *stored})  # memory_keep=2: steps 11 and 12
    assert report[12]["tiers"] == ["memory", "disk", "remote"] and report[11]["tiers"] == ["memory"]
    assert [s for s, r in report.items() if r["remote"]] == stored
    ckpt.close()
    shutil.rmtree(tmp_path / "shm")  # every tier on the machine is lost
    shutil.rmtree(tmp_path / "run")

    fresh, fresh_opt = _training(seed=1)
    again = Checkpointer(tmp_path / "run", keep=2, release_memory_on_close=False, **tiers)
    assert again.resume(model=fresh, optimizer=fresh_opt) == 12
    assert (again.resumed_from, again.extra) == ("remote", {"step": 12})
    assert all(torch.equal(p, at[12][n]) for n, p in fresh.named_parameters())
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    # memory at the newest step (14, also on disk) wins over the disk and the object store
    _train(again, fresh, fresh_opt, range(13, 15))
    again.close()
    newest, newest_opt = _training(seed=2)
    last = Checkpointer(tmp_path / "run", keep=2, **tiers)
    assert last.resume(model=newest, optimizer=newest_opt) == 14 and last.resumed_from == "memory"
    last.close()


# ---- SIGKILL at random moments: a snapshot, a peer copy or a drain cut short is never resumed ------------------

TRIALS = 20


def _ready(log: Path) -> tuple[int, str, bool]:
    from test_train import _wait_line

    _, step, tier, exact = _wait_line(log, "READY ").split()
    return int(step), tier, exact == "True"


def _saved(log: Path) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("SAVED ")]


def test_sigkill_during_memory_snapshots_never_resumes_an_incomplete_step(zygote, tmp_path):
    import random
    import signal
    import time

    import crash_loop

    root, shm = tmp_path / "run", tmp_path / "shm"
    chance = random.Random(20261201)
    last_seen, cut_short, from_memory = 0, 0, 0
    for trial in range(TRIALS):
        mode = ["--async"] if trial % 2 else []
        log = tmp_path / f"trial-{trial}.log"
        pid = zygote.spawn("crash_loop:main", ["--root", str(root), "--memory-dir", str(shm), *mode], log)
        ready, _, exact = _ready(log)
        assert (ready, exact) == (last_seen, True), f"trial {trial} resumed {ready}, the newest whole was {last_seen}"
        time.sleep(chance.uniform(0.0, 0.25))
        zygote.kill(pid)
        assert zygote.wait(pid) == -signal.SIGKILL
        saved = _saved(log)
        folder = next(_memory_folder(root, shm).glob("*/rank-00000"))
        cut_short += any(p.name.startswith(".") and p.is_dir() for p in folder.iterdir())

        ckpt = Checkpointer(root, keep=2, memory_every=1, disk_every=3, memory_dir=shm,
                            release_memory_on_close=False)
        assert not [p for p in folder.iterdir() if p.name.startswith(".") and p.is_dir()]  # leftovers removed
        model = crash_loop.build_model()
        got = ckpt.resume(model=model)
        last = saved[-1] if saved else ready
        assert (last - 1 if saved and mode else last) <= got <= last + 1, (trial, saved[-3:], got)
        assert all(torch.equal(p.detach(), crash_loop.expected(got)[n]) for n, p in model.named_parameters())
        from_memory += ckpt.resumed_from == "memory"
        ckpt.close()
        last_seen = got
    assert cut_short >= 3, f"only {cut_short} of {TRIALS} kills landed inside a snapshot"
    assert from_memory >= TRIALS // 2
    cleaned = CliRunner().invoke(main, ["tiers", "clean", str(root), "--memory-dir", str(shm)])
    assert cleaned.exit_code == 0, cleaned.output
    assert not _memory_folder(root, shm).exists() and not any(shm.rglob("*.safetensors"))


def test_sigkill_during_peer_copies_never_resumes_an_incomplete_step(zygote, tmp_path):
    """Two ranks on two simulated nodes copy each snapshot to each other; killed at random moments, and every
    other time node b's memory lost: the next run resumes a step that every rank holds whole, exactly."""
    import random
    import signal
    import socket
    import time

    root, shm = tmp_path / "run", tmp_path / "shm"
    chance = random.Random(1201)
    last_seen, via_peer = 0, 0
    for trial in range(TRIALS):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        logs = [tmp_path / f"peer-{trial}-{rank}.log" for rank in range(2)]
        pids = [zygote.spawn("crash_loop:main", ["--root", str(root), "--memory-dir", str(shm), "--peers", "--async",
                                                 "--world", "2", "--rank", str(rank), "--port", str(port),
                                                 "--nodes", "a,b"], logs[rank]) for rank in range(2)]
        ready, tier, exact = _ready(logs[0])
        # whole (every parameter exact), and never behind the last resume point: a resume hands its step to the
        # buddies again, so a copy lags its snapshot by at most the copy in flight when the kill came
        assert exact and ready >= last_seen, (trial, ready, tier, last_seen, logs[0].read_text()[-600:])
        via_peer += tier == "peer"
        time.sleep(chance.uniform(0.0, 0.3))
        for pid in pids:
            zygote.kill(pid)
        codes = [zygote.wait(pid) for pid in pids]
        # rank 1 may see rank 0 die first, in a collective, and exit on its own before its own SIGKILL lands
        assert codes[0] == -signal.SIGKILL and codes[1] in (-signal.SIGKILL, 1), (codes, logs[1].read_text()[-1500:])
        last_seen = ready
        if trial % 2 == 0:  # node b is lost with its memory: its rank must get its snapshot from node a's copy
            shutil.rmtree(next(_memory_folder(root, shm).glob("b")), ignore_errors=True)
    assert via_peer >= TRIALS // 4, f"only {via_peer} runs were restored from a peer's copy"


def test_sigkill_during_the_drain_never_leaves_a_broken_copy(zygote, tmp_path, s3):
    """Killed at random moments while copies go to the object store: every checkpoint the store lists opens and
    holds exactly its step's values, and a run that lost its disk resumes the newest of them."""
    import random
    import signal
    import time

    import crash_loop

    from tensormorph.train.manager import CheckpointManager

    url, options = "s3://tiers/drained", s3.storage_options
    chance = random.Random(61)
    copies_seen: set[int] = set()
    newest = 0
    for trial in range(TRIALS):
        log = tmp_path / f"drain-{trial}.log"
        root = tmp_path / f"run-{trial % 2}"  # two local disks take turns, as two machines would
        pid = zygote.spawn("crash_loop:main", ["--root", str(root), "--remote", url, "--remote-options",
                                               json.dumps(options), *(["--async"] if trial % 2 else [])], log)
        ready, tier, exact = _ready(log)
        assert exact and ready == newest and tier == ("remote" if newest else "None"), (trial, ready, tier, newest)
        time.sleep(chance.uniform(0.05, 1.0))  # a copy takes ~0.1-0.5 s here, more on a loaded machine
        zygote.kill(pid)
        assert zygote.wait(pid) == -signal.SIGKILL
        stored = CheckpointManager(url, None, options).list()
        for info in stored:  # each copy listed is whole: its manifest was PUT after every file
            model = crash_loop.build_model()
            report = tm.load(str(info.path), {"model": dict(model.state_dict())}, strict=False,
                             storage_options=options)
            assert report.tensors_loaded == 4
            assert all(torch.equal(p.detach(), crash_loop.expected(info.step)[n]) for n, p in model.named_parameters())
            copies_seen.add(info.step)
        assert not stored or stored[-1].step == max(i.step for i in stored)  # commit order goes on across runs
        newest = stored[-1].step if stored else newest
        shutil.rmtree(root, ignore_errors=True)  # this machine's disk is lost: the next run has the store only
    assert len(copies_seen) >= 3


# ---- found in review: rollbacks, re-created folders, preemption, exceptions, strict, failing uploads ----------

def _memory_run(tmp_path, **options):
    return Checkpointer(tmp_path / "run", memory_every=1, disk_every=100, memory_dir=tmp_path / "shm",
                        release_memory_on_close=False, **options)


def test_a_rollback_abandons_the_later_snapshots(tmp_path):
    model, opt = _training()
    ckpt = _memory_run(tmp_path)
    for step in range(1, 11):
        _step(model, opt, step)
        ckpt.save(step, model=model, optimizer=opt, extra={"timeline": "a"})
    ckpt.close()
    again = _memory_run(tmp_path)
    assert again.resume(model=model, optimizer=opt, step=10) == 10
    again.close()
    rolled = _memory_run(tmp_path)
    # steps 1-8 are not on disk (disk_every=100): a rollback goes to the newest memory snapshot kept (9)
    assert rolled.resume(model=model, optimizer=opt, step=9) == 9 and rolled.memory_steps() == (9,)
    for step in range(10, 13):
        _step(model, opt, step)
        rolled.save(step, model=model, optimizer=opt, extra={"timeline": "b"})
    rolled.close()
    last = _memory_run(tmp_path)
    assert last.resume(model=model, optimizer=opt) == 12 and last.extra == {"timeline": "b"}
    last.close()


def test_a_new_run_in_a_recreated_folder_does_not_resume_the_old_runs_memory(tmp_path):
    model, opt = _training()
    ckpt = _memory_run(tmp_path)
    _train(ckpt, model, opt, range(1, 4))
    ckpt.close()
    shutil.rmtree(tmp_path / "run")
    fresh = _memory_run(tmp_path)
    assert fresh.resume(model=model, optimizer=opt) == 0 and fresh.resumed_from is None
    fresh.close()


def test_leaving_on_an_exception_keeps_the_memory_and_strict_is_kept(tmp_path):
    model, opt = _training()
    with pytest.raises(RuntimeError, match="crash"), Checkpointer(
            tmp_path / "run", memory_every=1, disk_every=100, memory_dir=tmp_path / "shm") as ckpt:
        _train(ckpt, model, opt, range(1, 4))
        raise RuntimeError("crash")
    again = _memory_run(tmp_path)
    assert again.resume(model=model, optimizer=opt) == 3 and again.resumed_from == "memory"
    # the snapshot holds the optimizer: resuming the model alone is a mismatch, from memory as from disk
    with pytest.raises(Exception, match="optimizer"):
        again.resume(model=model)
    assert again.resume(model=model, strict=False) == 3 and again.resumed_from == "memory"
    again.close()


def test_a_stop_request_saves_to_disk_even_when_memory_is_due(tmp_path):
    import os
    import signal

    model, opt = _training()
    ckpt = _memory_run(tmp_path)
    ckpt.save_on_signal(signal.SIGUSR1)
    _train(ckpt, model, opt, range(1, 3))
    os.kill(os.getpid(), signal.SIGUSR1)
    assert ckpt.stop_requested()
    _step(model, opt, 3)
    with pytest.raises(SystemExit):
        ckpt.save(3, model=model, optimizer=opt)
    assert [i.step for i in ckpt.list()] == [3]  # a preempted machine takes its memory with it
    assert ckpt.timings[-1].tiers == ("memory", "disk")
    ckpt.close()


def test_a_damaged_snapshot_manifest_falls_back_and_a_failing_upload_is_kept(tmp_path):
    model, opt = _training()
    # a storage option the client refuses: a TypeError, not a CheckpointError, on every use of the store
    broken = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "key": "k", "secret": "s", "retries": 0}
    with pytest.warns(UserWarning, match="cannot list the object store"):
        ckpt = Checkpointer(tmp_path / "run", memory_every=1, disk_every=2, memory_dir=tmp_path / "shm",
                            release_memory_on_close=False, remote="s3://nowhere/run", remote_every=2,
                            remote_storage_options=broken)
    with pytest.warns(UserWarning, match="copying the checkpoint of step 2"):
        _train(ckpt, model, opt, range(1, 4))  # the copy fails, training goes on, wait() returns
    assert len(ckpt.remote_errors) == 1 and "step 2" in ckpt.remote_errors[0]
    ckpt.close()
    manifest = next((tmp_path / "shm").rglob("step-00000003/manifest.json"))
    _flip_byte(manifest, 40)
    again = Checkpointer(tmp_path / "run", memory_every=1, disk_every=2, memory_dir=tmp_path / "shm")
    assert again.resume(model=model, optimizer=opt) == 2 and again.resumed_from == "memory"  # the older snapshot
    assert "step 3 in memory" in again.resume_notes[0] and "manifest" in again.resume_notes[0]
    again.close()


def test_a_memory_folder_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "shm").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="is a link or belongs to another user"):
        Checkpointer(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm")
    assert list(elsewhere.iterdir()) == []


def test_a_run_id_planted_as_a_link_is_not_followed(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".tensormorph-run").symlink_to(outside)
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / ".tensormorph-run").symlink_to(tmp_path / "nowhere")
    for root in ("run", "dangling"):
        with pytest.raises(CheckpointError, match="link"):
            Checkpointer(tmp_path / root, memory_every=1, memory_dir=tmp_path / "shm")
    assert outside.read_text() == "keep me" and not (tmp_path / "nowhere").exists()


def test_uploads_killed_before_their_commit_are_swept_at_the_next_start(tmp_path, s3):
    import fsspec

    from tensormorph.tmformat.commit import FsspecDestination

    url, options = "s3://tiers/swept", s3.storage_options
    tiers = dict(disk_every=1, remote=url, remote_every=2, remote_storage_options=options)
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run", **tiers)
    saved = _train(ckpt, model, opt, range(1, 3))  # step 2 is copied to the store
    ckpt.close()
    fs = fsspec.filesystem("s3", **options)
    committed = sorted(fs.find("tiers/swept"))
    for step, overwrite in ((2, True), (4, False)):  # an overwrite and a new copy, killed before their PUT
        upload = FsspecDestination(f"{url}/step-{step:08d}", overwrite=overwrite, storage_options=options)
        upload.prepare()
        with upload.open(f"{upload.file_prefix}rank-00000.safetensors") as handle:
            handle.write(b"\0" * 1000)
    fs.invalidate_cache()
    assert len(fs.find("tiers/swept")) == len(committed) + 4  # two generations' files and two save markers
    again = Checkpointer(tmp_path / "run", **tiers)
    again.close()  # its drain swept before anything else
    fs.invalidate_cache()
    assert sorted(fs.find("tiers/swept")) == committed
    fresh, _ = _training(seed=1)
    tm.load(f"{url}/step-00000002", {"model": dict(fresh.state_dict())}, strict=False, storage_options=options)
    assert all(torch.equal(p, saved[n]) for n, p in fresh.named_parameters())
