"""Resumable training end to end: SIGKILL a training run right after a save, resume it in a new process,
and compare with a run that was never interrupted, bit for bit.

The runs are tests/train_scripts/train_loop.py (dropout, a shuffled DataLoader with 2 worker processes,
AdamW with a warm-up scheduler; FSDP2 on gloo ranks), started as fresh processes forked from one process
that imported torch once (tests/train_scripts/zygote.py): nothing of a killed run survives but its files.
Every step's loss is recorded as the bits of its float32, with the sample ids it trained on; at the end
each run saves its model, optimizer, scheduler, scaler and generator states, and those are compared
byte for byte with the uninterrupted run's.

The crash trials SIGKILL a process that saves without pause (tests/train_scripts/crash_loop.py) at random
moments, 20 times in a row in one folder, and check what a new Checkpointer finds there each time.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tensormorph as tm
from tensormorph.tmformat.manifest import MANIFEST, TEMP_PREFIX, parse
from tensormorph.train import Checkpointer
from tensormorph.train import rng as tm_rng

SCRIPTS = Path(__file__).resolve().parent / "train_scripts"
sys.path.insert(0, str(SCRIPTS))

import crash_loop  # noqa: E402

TIMEOUT = 120


class Zygote:
    """The client side of tests/train_scripts/zygote.py."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SCRIPTS / "zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError("the zygote process did not start")

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def spawn(self, target: str, argv: list[str], log: Path) -> int:
        return self.ask(cmd="spawn", target=target, argv=argv, log=str(log))["pid"]

    def wait(self, pid: int, timeout: float = TIMEOUT) -> int:
        code = self.ask(cmd="wait", pid=pid, timeout=timeout)["code"]
        if code is None:
            self.kill(pid)
            self.ask(cmd="wait", pid=pid, timeout=30)
            raise AssertionError(f"process {pid} still ran after {timeout} s")
        return code

    def kill(self, pid: int, sig: int = signal.SIGKILL, group: bool = True) -> None:
        self.ask(cmd="kill", pid=pid, signal=int(sig), group=group)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_line(log: Path, prefix: str, timeout: float = TIMEOUT) -> str:
    """The first line of `log` starting with `prefix`, waiting for it to appear."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            for line in log.read_text().splitlines():
                if line.startswith(prefix):
                    return line
        time.sleep(0.01)
    raise AssertionError(f"{log} has no line {prefix!r} after {timeout} s:\n{log.read_text() if log.exists() else ''}")


class Run:
    """One training run of train_loop.py on `world` ranks (one process each)."""

    def __init__(self, zygote: Zygote, out: Path, tag: str, world: int, argv: list[str]):
        self.zygote, self.out, self.tag = zygote, out, tag
        port = _free_port()
        self.logs = [out / f"{tag}-{r}.log" for r in range(world)]
        self.pids = [zygote.spawn("train_loop:main", ["--out", str(out), "--tag", tag, "--world", str(world),
                                                      "--rank", str(r), "--port", str(port), *argv], self.logs[r])
                     for r in range(world)]

    def line(self, prefix: str) -> str:
        return _wait_line(self.logs[0], prefix)

    def finish(self) -> list[int]:
        codes = [self.zygote.wait(pid) for pid in self.pids]
        assert codes == [0] * len(codes), self.failure(codes)
        return codes

    def kill(self) -> None:
        for pid in self.pids:
            self.zygote.kill(pid)
        codes = [self.zygote.wait(pid) for pid in self.pids]
        assert codes == [-signal.SIGKILL] * len(codes), self.failure(codes)

    def failure(self, codes: list[int]) -> str:
        return f"exit codes {codes}\n" + "\n".join(log.read_text()[-3000:] for log in self.logs)

    def resumed(self) -> int:
        return int(self.line("RESUMED ").split()[1])

    def steps(self, rank: int = 0) -> dict[int, dict]:
        lines = (self.out / f"{self.tag}-rank{rank}.jsonl").read_text().splitlines()
        return {record["step"]: record for record in map(json.loads, lines)}


def _contents(path: Path) -> dict[str, object]:
    """Every tensor (dtype, shape, bytes) and plain value of a Tensormorph checkpoint."""
    ck = tm.open(path)
    values: dict[str, object] = {n: (t.dtype, t.shape, t.read().tobytes()) for n, t in ck.tensors.items()}
    values.update({n: o.value() for n, o in ck.objects.items()})
    return values


def _assert_same_as(reference: Run, runs: list[Run], steps: int, world: int) -> None:
    """Each run's recorded steps match the reference's loss bits and sample ids; together they cover every step."""
    for rank in range(world):
        expected = reference.steps(rank)
        assert sorted(expected) == list(range(steps))
        covered = set()
        for run in runs:
            got = run.steps(rank)
            mismatched = [s for s in sorted(got) if got[s] != expected[s]]
            assert not mismatched, (f"rank {rank}, run {run.tag}: steps {mismatched} differ from the uninterrupted "
                                    f"run, first: {got[mismatched[0]]} vs {expected[mismatched[0]]}")
            covered |= set(got)
        assert covered == set(range(steps))
    final, expected_final = _contents(runs[-1].out / f"final-{runs[-1].tag}"), _contents(reference.out /
                                                                                         f"final-{reference.tag}")
    assert final.keys() == expected_final.keys()
    assert [n for n in final if final[n] != expected_final[n]] == []
    assert any(n.startswith("optimizer.state.") for n in final) and any(n.startswith("rng.rank") for n in final)


# ---- same world size: bitwise identical -------------------------------------------------------------------

# 40 samples in batches of 4: an epoch is 10 steps. The first run is killed right after its save at step 7
# (mid-epoch, with the workers' prefetched batches in flight), the second right after its save at step 10
# (exactly at the end of the epoch), the third runs to step 24, across the epoch boundary at 20.
SINGLE = ["--steps", "24", "--samples", "40", "--batch", "4", "--save-every", "4", "--save-at", "7", "10"]


@pytest.mark.parametrize("loader, extra", [
    ("sampler", ["--scaler"]),  # async saves, workers restarted every epoch, GradScaler
    ("sampler", ["--persistent", "--sync"]),  # workers kept between epochs, synchronous saves
    ("stateful", []),  # torchdata's StatefulDataLoader
], ids=["sampler-async-scaler", "sampler-persistent-sync", "stateful-dataloader"])
def test_killed_and_resumed_run_is_bitwise_identical(zygote, tmp_path, loader, extra):
    argv = [*SINGLE, "--loader", loader, *extra]
    reference = Run(zygote, tmp_path, "ref", 1, ["--root", str(tmp_path / "ref-root"), *argv])
    reference.finish()
    root = ["--root", str(tmp_path / "run")]
    first = Run(zygote, tmp_path, "a", 1, [*root, *argv, "--markers", "7"])
    first.line("DURABLE 7")
    first.kill()
    second = Run(zygote, tmp_path, "b", 1, [*root, *argv, "--markers", "10"])
    second.line("DURABLE 10")
    second.kill()
    third = Run(zygote, tmp_path, "c", 1, [*root, *argv])
    third.finish()
    assert (second.resumed(), third.resumed()) == (7, 10)
    _assert_same_as(reference, [first, second, third], 24, 1)
    steps = [info.step for info in Checkpointer(tmp_path / "run").list()]
    assert steps == [16, 20, 24]  # keep=3


def test_fsdp2_two_ranks_killed_preempted_and_resumed_is_bitwise_identical(zygote, tmp_path):
    """2 gloo ranks with FSDP2: killed after the save at step 6 (one step into the second epoch); in the
    resumed run rank 1 and its DataLoader workers get SIGTERM (rank 0 does not): both ranks save at the next
    step boundary and exit cleanly; the third run resumes from that save and finishes."""
    argv = ["--steps", "24", "--samples", "40", "--batch", "4", "--save-every", "3", "--preempt"]
    reference = Run(zygote, tmp_path, "ref", 2, ["--root", str(tmp_path / "ref-root"), *argv])
    reference.finish()
    root = ["--root", str(tmp_path / "run")]
    first = Run(zygote, tmp_path, "a", 2, [*root, *argv, "--markers", "6"])
    first.line("DURABLE 6")
    first.kill()
    second = Run(zygote, tmp_path, "b", 2, [*root, *argv])
    second.line("STEP 10")
    zygote.kill(second.pids[1], signal.SIGTERM)
    second.finish()
    third = Run(zygote, tmp_path, "c", 2, [*root, *argv])
    third.finish()
    preempted_at = max(second.steps(0)) + 1
    assert second.resumed() == 6 and 10 <= preempted_at < 24
    assert third.resumed() == preempted_at
    assert max(second.steps(1)) + 1 == preempted_at  # rank 1 stopped at the same boundary
    assert "DONE" not in second.logs[0].read_text()
    _assert_same_as(reference, [first, second, third], 24, 2)
    info = Checkpointer(tmp_path / "run").latest()
    assert (info.step, info.world_size, info.mesh) == (24, 2, {"shape": [2], "dim_names": None})


# ---- another world size: resharded exactly, the data continues at the same global sample --------------------

def test_saved_on_four_ranks_resumed_on_two(zygote, tmp_path):
    """64 samples, 4 per rank per step: 4 ranks consume 16 a step and are killed after the save at step 3
    (48 samples); 2 ranks resume, consuming 8 a step: steps 3-4 finish the epoch, 5-12 are the next one."""
    argv = ["--root", str(tmp_path / "run"), "--samples", "64", "--batch", "4", "--save-every", "100"]
    first = Run(zygote, tmp_path, "a", 4, [*argv, "--steps", "13", "--save-at", "3", "--markers", "3"])
    first.line("DURABLE 3")
    first.kill()
    second = Run(zygote, tmp_path, "b", 2, [*argv, "--steps", "13", "--dump-resumed"])
    second.finish()
    assert second.resumed() == 3

    before = [i for r in range(4) for s, rec in first.steps(r).items() if s < 3 for i in rec["ids"]]
    after = [[i for s, rec in second.steps(r).items() for i in rec["ids"] if s in window] for r in range(2)
             for window in [range(3, 5), range(5, 13)]]
    first_epoch = before + after[0] + after[2]
    second_epoch = after[1] + after[3]
    assert sorted(first_epoch) == list(range(64)), "samples repeated or skipped across the resume"
    assert sorted(second_epoch) == list(range(64))

    saved, resumed = _contents(tmp_path / "run" / "step-00000003"), _contents(tmp_path / "resumed-b")
    state = [n for n in saved if n.startswith(("model.", "optimizer.state."))]
    assert len(state) == 6 + 6 * 3  # 6 parameters; AdamW's step, exp_avg and exp_avg_sq of each
    assert [n for n in state if resumed[n] != saved[n]] == []
    assert resumed["optimizer.param_groups"] == saved["optimizer.param_groups"]

    # per-rank random streams cannot continue on other ranks: they are re-seeded from the run, step and rank
    seed = parse((tmp_path / "run" / "step-00000003" / MANIFEST).read_bytes(), "manifest").extra[
        "tensormorph.train"]["seed"]
    for rank in range(2):
        g = torch.Generator()
        g.manual_seed(tm_rng.derive_seed(seed, 3, rank, 2))
        assert resumed[f"rng.rank{rank}"][2] == g.get_state().numpy().tobytes()


# ---- crash safety: SIGKILL at random moments while saving ----------------------------------------------------

TRIALS = 20


def test_sigkill_at_random_moments_never_leaves_a_broken_latest(zygote, tmp_path):
    root = tmp_path / "run"
    chance = random.Random(20261130)
    last_seen, with_leftovers = 0, 0
    for trial in range(TRIALS):
        mode = ["--async"] if trial % 2 else []
        log = tmp_path / f"trial-{trial}.log"
        pid = zygote.spawn("crash_loop:main", ["--root", str(root), *mode], log)
        ready = int(_wait_line(log, "READY ").split()[1])
        assert ready == last_seen, f"trial {trial} resumed from {ready}, the newest committed was {last_seen}"
        time.sleep(chance.uniform(0.0, 0.25))
        zygote.kill(pid)
        assert zygote.wait(pid) == -signal.SIGKILL
        saved = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("SAVED ")]
        with_leftovers += any(p.name.startswith(TEMP_PREFIX) for p in root.iterdir())

        ckpt = Checkpointer(root, keep=2)
        assert [p.name for p in root.iterdir() if p.name.startswith(TEMP_PREFIX)] == []
        infos = ckpt.list()
        latest = infos[-1].step if infos else 0
        assert ckpt.latest() == (infos[-1] if infos else None)
        # committed for sure: a sync save once it returned, an async one once the next save began (it waits);
        # at most one more save may have committed before the kill
        last = saved[-1] if saved else ready
        lowest = last - 1 if saved and mode else last
        assert lowest <= latest <= last + 1, (trial, saved[-3:], latest)
        assert len(infos) <= 3  # keep=2, plus one when the kill fell between a commit and its retention
        for info in infos:
            report = tm.verify(info.path, full=True)
            assert report.ok, report.problems
        model = crash_loop.build_model()
        assert ckpt.resume(model=model) == latest
        if latest:
            assert ckpt.extra == {"step": latest}
            for name, value in model.named_parameters():
                assert torch.equal(value.detach(), crash_loop.expected(latest)[name]), (trial, name)
        last_seen = latest
    # the kills must have landed inside saves, not only between them
    assert with_leftovers >= 3, f"only {with_leftovers} of {TRIALS} kills left an unfinished save behind"


def test_dataloader_workers_survive_a_storm_of_preemption_signals(zygote, tmp_path):
    """SIGTERM to the whole process group every few milliseconds while DataLoader workers start 80 times over:
    none dies of it (a worker signalled before its worker_init_fn ran would), the run records the request."""
    log = tmp_path / "storm.log"
    pid = zygote.spawn("signal_storm:main", ["--root", str(tmp_path / "run"), "--epochs", "40"], log)
    _wait_line(log, "READY")
    sent, code, deadline = 0, None, time.monotonic() + TIMEOUT
    while code is None and time.monotonic() < deadline:
        zygote.kill(pid, signal.SIGTERM)
        sent += 1
        time.sleep(0.003)
        code = zygote.ask(cmd="wait", pid=pid, timeout=0)["code"]
    assert code == 0, log.read_text()[-3000:]
    assert _wait_line(log, "DONE") == "DONE 40 True" and sent > 40
