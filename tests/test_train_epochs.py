"""Resuming across an epoch boundary, with `sampler.set_epoch(epoch)` before each pass as torchdata documents it,
for every kind of data loader the Checkpointer takes: a ResumableSampler in a torch DataLoader (no workers,
workers, persistent workers) or alone, and torchdata's StatefulDataLoader with a DistributedSampler (no workers,
workers, persistent workers) or with torchdata's StatefulDistributedSampler.

tests/train_scripts/epoch_loop.py runs 2 epochs of 12 steps uninterrupted, saving at steps 12 and 16, then in a
new process resumes each variant from step 16 (saving again at once, before the loop sets the epoch), from that
new checkpoint, and from step 12. Every resumed step must train on the uninterrupted run's samples with its
loss bit for bit: a loader that made its iterator during `resume`, before `set_epoch`, replays epoch 0's order.
In one process: a ResumableSampler's position saved at the end of an epoch resumes there, as torchdata's does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train import SCRIPTS, TIMEOUT, Zygote, _free_port, zygote  # noqa: F401  (zygote: the fixture)
from torch.utils.data import DataLoader

from tensormorph.train import ResumableSampler

VARIANTS = ["sampler", "sampler-workers", "sampler-persistent", "sampler-alone", "sampler-workers-epoch-from-step",
            "sampler-persistent-epoch-from-step", "stateful", "stateful-workers", "stateful-persistent",
            "stateful-sampler-workers"]
STEPS_PER_EPOCH, STEPS, BATCH = 12, 24, 2


def _launch(z: Zygote, tmp_path: Path, phase: str, world: int) -> list[dict]:
    """Run every variant's `phase` on `world` ranks; each rank's records."""
    port = _free_port()
    logs = [tmp_path / f"{phase}-{rank}.log" for rank in range(world)]
    pids = [z.spawn("epoch_loop:main", ["--root", str(tmp_path / "root"), "--out", str(tmp_path),
                                             "--phase", phase, "--variants", *VARIANTS, "--world", str(world),
                                             "--rank", str(rank), "--port", str(port)], logs[rank])
            for rank in range(world)]
    codes = [z.wait(pid, TIMEOUT) for pid in pids]
    assert codes == [0] * world, f"exit codes {codes}\n" + "\n".join(log.read_text()[-3000:] for log in logs)
    return [[json.loads(line) for line in (tmp_path / f"{phase}-rank{rank}.jsonl").read_text().splitlines()]
            for rank in range(world)]


@pytest.mark.parametrize("world", [1, 2], ids=["1-process", "2-ranks-fsdp2"])
def test_resume_across_an_epoch_boundary_sees_the_uninterrupted_samples(zygote, tmp_path, world):  # noqa: F811
    assert (SCRIPTS / "epoch_loop.py").exists()
    reference, resumed = _launch(zygote, tmp_path, "run", world), _launch(zygote, tmp_path, "resume", world)
    samples = STEPS_PER_EPOCH * BATCH * world
    problems = []
    for rank in range(world):
        for variant in VARIANTS:
            expected = {r["step"]: r for r in reference[rank] if r["variant"] == variant}
            assert sorted(expected) == list(range(STEPS))
            epochs = [[i for s in range(e * STEPS_PER_EPOCH, (e + 1) * STEPS_PER_EPOCH) for i in expected[s]["ids"]]
                      for e in range(2)]
            assert epochs[0] != epochs[1]  # each epoch a new shuffle: a resume into the wrong epoch shows
            for tag, start in (("resaved", 16), ("16", 16), ("12", 12)):
                got = {r["step"]: r for r in resumed[rank] if r["variant"] == variant and r["from"] == tag}
                assert sorted(got) == list(range(start, STEPS)), (variant, tag)
                wrong = [s for s in sorted(got) if got[s]["ids"] != expected[s]["ids"]]
                differ = [s for s in sorted(got) if got[s]["loss"] != expected[s]["loss"]]
                if wrong:
                    problems.append(f"rank {rank}, {variant} resumed from {tag}: steps {wrong} trained on other "
                                    f"samples, first {got[wrong[0]]['ids']} instead of {expected[wrong[0]]['ids']}")
                elif differ:
                    problems.append(f"rank {rank}, {variant} resumed from {tag}: the losses of steps {differ} differ")
    assert not problems, "\n".join(problems)
    for variant in VARIANTS:  # each epoch, the ranks' shares together are the whole data set, once
        for epoch in range(2):
            ids = [i for rank in range(world) for r in reference[rank] if r["variant"] == variant
                   and r["step"] // STEPS_PER_EPOCH == epoch for i in r["ids"]]
            assert sorted(ids) == list(range(samples)), (variant, epoch)


def test_a_position_saved_at_the_end_of_an_epoch_resumes_there():
    """The epoch that ended stays ended, as in torchdata: its pass yields nothing, so a loop that sets the epoch
    it saved replays nothing, and set_epoch(epoch + 1) goes on; samples a DataLoader's drop_last dropped stay
    dropped, on the same number of ranks and on another."""
    data = list(range(14))
    sampler = ResumableSampler(data, 1, 0, seed=3)
    it = iter(DataLoader(data, batch_size=4, sampler=sampler, drop_last=True))
    for _ in range(3):
        next(it)
    state = sampler.state_dict()
    assert state["complete"] and state["consumed"] == 12 and state["in_pass"]
    resumed = ResumableSampler(data, 1, 0, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    assert (resumed.epoch, len(resumed), list(resumed)) == (0, 0, [])
    assert resumed.state_dict()["complete"]
    resumed.set_epoch(1)
    sampler.set_epoch(1)
    assert list(resumed) == list(sampler)
    two = [ResumableSampler(data, 2, rank, seed=3) for rank in range(2)]
    for other in two:
        other.load_states([state], same_world=False)
    assert [list(other) for other in two] == [[], []]
