"""Checkpointer and ResumableSampler in one process: listing, retention, async saves and their errors, bad input,
and the sampler's order, consumption count and resharding."""

from __future__ import annotations

import json
import shutil
import struct
import threading
import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import tensormorph as tm
from tensormorph.errors import CheckpointError, ChecksumError, StateMismatchError
from tensormorph.tmformat.manifest import MANIFEST, decode_value, encode_value
from tensormorph.train import Checkpointer, ResumableSampler
from tensormorph.train import checkpointer as checkpointer_module
from tensormorph.train import rng as tm_rng
from tensormorph.train.plain import from_plain, to_plain


def _training(out_features: int = 2, extra_layer: bool = False):
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8), nn.Linear(8, out_features)] + ([nn.Linear(out_features, 1)] if extra_layer else [])
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- listing and resuming ---------------------------------------------------------------------------------

def test_nothing_to_resume(tmp_path):
    ckpt = Checkpointer(tmp_path / "run")
    model, opt, _ = _training()
    before = _params(model)
    assert ckpt.resume(model=model, optimizer=opt) == 0 and ckpt.extra is None
    assert ckpt.list() == [] and ckpt.latest() is None
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_list_describes_committed_checkpoints(tmp_path):
    ckpt = Checkpointer(tmp_path / "run")
    model, opt, sched = _training()
    before = time.time()
    for step in (5, 10):
        ckpt.save(step, model=model, optimizer=opt, scheduler=sched, extra={"tokens_seen": step * 100})
    (tmp_path / "run" / "notes").mkdir()  # not a checkpoint: no manifest
    infos = ckpt.list()
    assert [i.step for i in infos] == [5, 10] and [i.seq for i in infos] == [1, 2]
    latest = ckpt.latest()
    assert latest == infos[-1] and latest.path == tmp_path / "run" / "step-00000010"
    assert before <= latest.time <= time.time()
    on_disk = sum(p.stat().st_size for p in latest.path.iterdir())
    assert latest.size == on_disk
    assert (latest.world_size, latest.mesh) == (1, None)
    assert latest.components == ("model", "optimizer", "scheduler", "extra")


def test_resume_restores_model_optimizer_scheduler_extra_exactly(tmp_path):
    model, opt, sched = _training()
    Checkpointer(tmp_path / "run").save(7, model=model, optimizer=opt, scheduler=sched,
                                        extra={"tokens_seen": 123, "ids": (1, 2), "blob": b"\x00\xff"})
    fresh, fresh_opt, fresh_sched = _training()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    ckpt = Checkpointer(tmp_path / "run")
    assert ckpt.resume(model=fresh, optimizer=fresh_opt, scheduler=fresh_sched) == 7
    assert ckpt.extra == {"tokens_seen": 123, "ids": (1, 2), "blob": b"\x00\xff"}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    for name, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, fresh_opt.state_dict()["state"][name][key])
    assert fresh_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert fresh_sched.state_dict() == sched.state_dict()


def test_resume_a_chosen_step(tmp_path):
    ckpt = Checkpointer(tmp_path / "run")
    model, opt, _ = _training()
    first = _params(model)
    ckpt.save(1, model=model, optimizer=opt)
    with torch.no_grad():
        model[0].weight.mul_(2)
    ckpt.save(2, model=model, optimizer=opt)
    assert ckpt.resume(model=model, optimizer=opt, step=1) == 1
    assert torch.equal(model[0].weight, first["0.weight"])
    with pytest.raises(CheckpointError, match="no committed checkpoint of step 3"):
        ckpt.resume(model=model, optimizer=opt, step=3)


def test_mismatched_model_lists_every_difference_at_once(tmp_path):
    model, opt, sched = _training()
    Checkpointer(tmp_path / "run").save(3, model=model, optimizer=opt, scheduler=sched)
    other, other_opt, other_sched = _training(out_features=3, extra_layer=True)
    before = _params(other)
    with pytest.raises(StateMismatchError) as caught:
        Checkpointer(tmp_path / "run").resume(model=other, optimizer=other_opt, scheduler=other_sched)
    error = caught.value
    assert sorted(error.missing) == ["model.2.bias", "model.2.weight", "optimizer.state.2.bias.exp_avg",
                                     "optimizer.state.2.bias.exp_avg_sq", "optimizer.state.2.bias.step",
                                     "optimizer.state.2.weight.exp_avg", "optimizer.state.2.weight.exp_avg_sq",
                                     "optimizer.state.2.weight.step"]
    assert error.unexpected == []
    assert sorted(m.split(":")[0] for m in error.mismatched) == [
        "model.1.bias", "model.1.weight", "optimizer.state.1.bias.exp_avg", "optimizer.state.1.bias.exp_avg_sq",
        "optimizer.state.1.weight.exp_avg", "optimizer.state.1.weight.exp_avg_sq"]
    assert "model.1.weight: shape [2, 8] in the checkpoint, [3, 8] in the state dict" in error.mismatched
    assert str(tmp_path / "run" / "step-00000003") in str(error)
    assert all(torch.equal(before[n], p) for n, p in other.named_parameters())  # nothing was loaded


def test_components_saved_but_not_given_are_refused_unless_not_strict(tmp_path):
    model, opt, sched = _training()
    Checkpointer(tmp_path / "run").save(4, model=model, optimizer=opt, scheduler=sched, extra={"a": 1})
    fresh, fresh_opt, _ = _training()
    ckpt = Checkpointer(tmp_path / "run")
    with pytest.raises(StateMismatchError) as caught:
        ckpt.resume(model=fresh)
    unexpected = caught.value.unexpected
    assert "scheduler" in unexpected and "optimizer.param_groups" in unexpected
    assert sorted(n for n in unexpected if n.startswith("optimizer.state.")) == sorted(
        f"optimizer.state.{p}.{k}" for p in ("0.weight", "0.bias", "1.weight", "1.bias")
        for k in ("step", "exp_avg", "exp_avg_sq"))
    assert ckpt.resume(model=fresh, strict=False) == 4
    assert torch.equal(fresh[0].weight, model[0].weight) and ckpt.extra == {"a": 1}
    with pytest.raises(StateMismatchError) as caught:
        ckpt.resume(model=fresh, optimizer=fresh_opt, scheduler=torch.optim.lr_scheduler.LambdaLR(
            fresh_opt, lambda s: 1.0), scaler=torch.amp.GradScaler("cpu"))
    assert caught.value.missing == ["scaler"]


def test_corrupt_data_file_is_named(tmp_path):
    model, opt, _ = _training()
    Checkpointer(tmp_path / "run").save(2, model=model, optimizer=opt)
    data = tmp_path / "run" / "step-00000002" / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    header = struct.unpack("<Q", raw[:8])[0]
    raw[8 + header + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError) as caught:
        Checkpointer(tmp_path / "run").resume(model=model, optimizer=opt)
    assert str(data) in str(caught.value)


def test_damaged_manifest_is_reported_and_not_listed(tmp_path):
    ckpt = Checkpointer(tmp_path / "run")
    model, opt, _ = _training()
    ckpt.save(1, model=model, optimizer=opt)
    ckpt.save(2, model=model, optimizer=opt)
    manifest = tmp_path / "run" / "step-00000002" / MANIFEST
    manifest.write_bytes(manifest.read_bytes().replace(b'"step":2', b'"step":9'))
    with pytest.warns(UserWarning, match="manifest is damaged") as caught:
        assert [i.step for i in Checkpointer(tmp_path / "run").list()] == [1]
    assert str(manifest) in str(caught[0].message)


# ---- retention --------------------------------------------------------------------------------------------

def test_keep_decides_by_manifests_not_folder_names(tmp_path):
    """A committed checkpoint from an earlier run, with a higher step in its name, is the oldest by commit
    order: it neither shadows the current run's latest nor makes retention delete the current run's ones."""
    model, opt, _ = _training()
    Checkpointer(tmp_path / "earlier").save(99999999, model=model, optimizer=opt)
    (tmp_path / "run").mkdir()
    shutil.move(tmp_path / "earlier" / "step-99999999", tmp_path / "run" / "step-99999999")
    ckpt = Checkpointer(tmp_path / "run", keep=2)
    ckpt.save(1, model=model, optimizer=opt)
    assert [i.step for i in ckpt.list()] == [99999999, 1] and ckpt.latest().step == 1
    ckpt.save(2, model=model, optimizer=opt)
    assert [i.step for i in ckpt.list()] == [1, 2]
    ckpt.save(3, model=model, optimizer=opt)
    assert [i.step for i in ckpt.list()] == [2, 3]
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")) == [
        "step-00000002", "step-00000003"]  # and the record of saves (.tensormorph-saves.jsonl)


def test_keep_must_leave_the_newest():
    with pytest.raises(ValueError, match="keep must be at least 1"):
        Checkpointer("unused", keep=0)


def test_leftover_temporary_folders_are_removed_on_start(tmp_path):
    model, opt, _ = _training()
    Checkpointer(tmp_path / "run").save(1, model=model, optimizer=opt)
    leftover = tmp_path / "run" / ".tmp-tensormorph-step-00000002-0123456789ab"
    leftover.mkdir()
    (leftover / "rank-00000.safetensors").write_bytes(b"half")
    (leftover / ".tensormorph-save").write_text("{}")
    ckpt = Checkpointer(tmp_path / "run")
    assert not leftover.exists() and [i.step for i in ckpt.list()] == [1]


# ---- async saves ------------------------------------------------------------------------------------------

class _HeldSave:
    """Stands in for tensormorph.save: each call waits for `release` (or raises `fail` for its step)."""

    def __init__(self, real, fail_step: int | None = None):
        self.real, self.fail_step = real, fail_step
        self.release = threading.Event()

    def __call__(self, state, path, **kwargs):
        self.release.wait(30)
        if state["step"] == self.fail_step:
            raise CheckpointError("no space left on device", file=str(path))
        return self.real(state, path, **kwargs)


def test_async_save_is_listed_only_after_its_commit_and_one_at_a_time(tmp_path, monkeypatch):
    held = _HeldSave(checkpointer_module.tm_save)
    monkeypatch.setattr(checkpointer_module, "tm_save", held)
    model, opt, sched = _training()
    ckpt = Checkpointer(tmp_path / "run", keep=1, async_save=True)
    first = ckpt.save(1, model=model, optimizer=opt, scheduler=sched)
    assert first.durable_s is None and ckpt.latest() is None
    threading.Timer(0.3, held.release.set).start()
    second = ckpt.save(2, model=model, optimizer=opt, scheduler=sched)  # waits for the first
    assert second.blocked_s >= 0.25 and first.durable_s is not None and first.durable_s >= 0.25
    ckpt.wait()
    assert second.durable_s >= second.blocked_s
    assert [i.step for i in ckpt.list()] == [2]
    assert [t.step for t in ckpt.timings] == [1, 2]


def _hold_background(monkeypatch) -> threading.Event:
    """Make the background thread of the next async saves wait, before it copies anything, for the event."""
    release = threading.Event()
    original = Checkpointer._write_in_background

    def held(self, *args):
        release.wait(30)
        original(self, *args)

    monkeypatch.setattr(Checkpointer, "_write_in_background", held)
    return release


def test_the_optimizer_step_waits_for_the_background_copy(tmp_path, monkeypatch):
    release = _hold_background(monkeypatch)
    model, opt, sched = _training()
    ckpt = Checkpointer(tmp_path / "run", async_save=True)
    at_save = {**_params(model), **{f"{n}.exp_avg": opt.state[p]["exp_avg"].clone()
                                   for n, p in model.named_parameters()}}
    timing = ckpt.save(1, model=model, optimizer=opt, scheduler=sched)
    assert ckpt._thread is not None and ckpt._thread.is_alive()  # save returned while the copy is held
    model(torch.randn(3, 4)).sum().backward()  # forward and backward run while the copy is pending
    threading.Timer(0.3, release.set).start()
    opt.step()  # waits for the copy
    assert timing.blocked_s >= 0.25
    ckpt.wait()
    saved = tm.open(tmp_path / "run" / "step-00000001")
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), at_save[name])  # the step changed it, after the copy
        assert np.array_equal(saved[f"model.{name}"].read(), at_save[name].numpy())
        assert np.array_equal(saved[f"optimizer.state.{name}.exp_avg"].read(), at_save[f"{name}.exp_avg"].numpy())


def test_a_parameter_changed_in_place_before_the_copy_fails_the_save(tmp_path, monkeypatch):
    release = _hold_background(monkeypatch)
    model, opt, _ = _training()
    ckpt = Checkpointer(tmp_path / "run", async_save=True)
    ckpt.save(1, model=model, optimizer=opt)
    with torch.no_grad():
        model[1].bias.add_(1.0)  # not the optimizer: nothing waits for the copy
    release.set()
    with pytest.raises(CheckpointError, match="'model.1.bias'.*changed in place after save"):
        ckpt.wait()
    assert ckpt.list() == []


def test_background_error_is_raised_at_the_next_save_and_nothing_is_deleted(tmp_path, monkeypatch):
    held = _HeldSave(checkpointer_module.tm_save, fail_step=2)
    held.release.set()
    monkeypatch.setattr(checkpointer_module, "tm_save", held)
    model, opt, _ = _training()
    ckpt = Checkpointer(tmp_path / "run", keep=1, async_save=True)
    ckpt.save(1, model=model, optimizer=opt)
    ckpt.save(2, model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match="no space left on device"):
        ckpt.save(3, model=model, optimizer=opt)
    assert [i.step for i in ckpt.list()] == [1]  # the failed save deleted nothing
    ckpt.save(3, model=model, optimizer=opt)
    held.fail_step = 4
    ckpt.save(4, model=model, optimizer=opt)
    with pytest.raises(CheckpointError, match="no space left on device"):
        ckpt.wait()
    assert [i.step for i in ckpt.list()] == [3]
    ckpt.wait()  # the error was handed over once


@pytest.mark.parametrize("async_save", [False, True])
def test_values_a_checkpoint_cannot_hold_are_refused_in_the_caller(tmp_path, async_save):
    model, opt, _ = _training()
    ckpt = Checkpointer(tmp_path / "run", async_save=async_save)
    with pytest.raises(TypeError, match="'extra.when'.*datetime"):
        import datetime

        ckpt.save(1, model=model, optimizer=opt, extra={"when": datetime.datetime.now()})
    ckpt.wait()
    assert ckpt.list() == []


def test_optimizer_without_model_is_refused(tmp_path):
    _, opt, _ = _training()
    with pytest.raises(ValueError, match="pass model="):
        Checkpointer(tmp_path / "run").save(1, optimizer=opt)


def test_dataloader_without_a_resumable_position_is_refused(tmp_path):
    loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
    with pytest.raises(TypeError, match="RandomSampler.*ResumableSampler"):
        Checkpointer(tmp_path / "run").save(1, dataloader=loader)


def test_a_save_before_the_first_batch_after_resume_keeps_the_saved_generators(tmp_path):
    """The restore of the generators waits for the loader's first index; a save before that saves them."""
    data = list(range(20))
    sampler = ResumableSampler(data, 1, 0)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    it = iter(loader)
    next(it)
    ckpt = Checkpointer(tmp_path / "run")
    ckpt.save(1, dataloader=loader)
    torch.rand(5)
    resumed_sampler = ResumableSampler(data, 1, 0)
    resumed = Checkpointer(tmp_path / "run")
    resumed.resume(dataloader=DataLoader(data, batch_size=2, sampler=resumed_sampler))
    resumed.save(2, dataloader=DataLoader(data, batch_size=2, sampler=resumed_sampler))
    objects = [tm.open(tmp_path / "run" / f"step-0000000{s}").objects["rng.rank0"].value() for s in (1, 2)]
    assert objects[0] == objects[1]
    assert objects[0]["torch"] != torch.get_rng_state().numpy().tobytes()


# ---- ResumableSampler -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, world, shuffle, drop_last", [(23, 4, True, False), (23, 4, True, True),
                                                          (8, 3, False, False), (5, 8, True, False)])
def test_sampler_order_is_distributed_samplers(n, world, shuffle, drop_last):
    for epoch in (0, 3):
        for rank in range(world):
            ours = ResumableSampler(n, world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            theirs = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_sampler_counts_what_training_consumed_not_what_workers_prefetched():
    data = list(range(40))
    sampler = ResumableSampler(data, 1, 0, seed=3)
    loader = DataLoader(data, batch_size=2, sampler=sampler, num_workers=2)
    it = iter(loader)
    taken = [next(it).tolist() for _ in range(3)]
    state = sampler.state_dict()
    assert state["consumed"] == 6 and not state["complete"]
    assert sampler._pass.handed == 6 + 2 * 2 * 2  # prefetch_factor 2 x 2 workers, 2 samples each
    rest = [b.tolist() for b in it]
    resumed = ResumableSampler(data, 1, 0, seed=3)
    resumed.load_state_dict(state)
    assert len(resumed) == 34
    assert [b.tolist() for b in DataLoader(data, batch_size=2, sampler=resumed, num_workers=2)] == rest
    assert sorted(i for b in taken + rest for i in b) == data


def test_sampler_saved_at_the_end_of_an_epoch_resumes_there_then_goes_on_with_the_next():
    data = list(range(12))
    sampler = ResumableSampler(data, 1, 0)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = sampler.state_dict()
    assert state["complete"] and state["consumed"] == 12
    resumed = ResumableSampler(data, 1, 0)
    resumed.load_state_dict(state)
    assert resumed.epoch == 0 and list(resumed) == []  # the end of epoch 0: its pass yields nothing
    sampler.set_epoch(1)
    resumed.set_epoch(1)
    assert resumed.epoch == 1 and list(resumed) == list(sampler)


def test_sampler_positions_reshard_to_another_number_of_ranks():
    n = 48
    old = [ResumableSampler(n, 4, r, seed=9) for r in range(4)]
    seen = []
    for sampler in old:
        it = iter(sampler)
        seen += [next(it) for _ in range(5)]
    states = [s.state_dict() for s in old]
    new = [ResumableSampler(n, 2, r, seed=9) for r in range(2)]
    for sampler in new:
        sampler.load_states(states, same_world=False)
    rest = [i for sampler in new for i in sampler]
    assert len(rest) == n - 20 and sorted(seen + rest) == list(range(n))
    for sampler in new:  # the next epoch is whole again
        sampler.set_epoch(1)
    assert sorted(i for sampler in new for i in sampler) == list(range(n))


def test_sampler_reshard_with_ranks_at_different_positions_warns_and_repeats_rather_than_skips():
    old = [ResumableSampler(16, 2, r) for r in range(2)]
    seen = []
    for sampler, count in zip(old, (3, 2)):
        it = iter(sampler)
        seen += [next(it) for _ in range(count)]
    new = ResumableSampler(16, 1, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new.load_states([s.state_dict() for s in old], same_world=False)
    assert "[3, 2]" in str(caught[0].message)
    assert set(seen) | set(new) == set(range(16)) and len(list(new)) == 12


def test_sampler_refuses_a_position_from_another_dataset():
    saved = ResumableSampler(10, 1, 0).state_dict()
    with pytest.raises(CheckpointError, match="length=10.*length=11"):
        ResumableSampler(11, 1, 0).load_state_dict(saved)


def test_generator_states_round_trip():
    import random as pyrandom

    with torch.random.fork_rng():
        pyrandom_state, np_state = pyrandom.getstate(), np.random.get_state()
        try:
            pyrandom.seed(1)
            np.random.seed(2)
            torch.manual_seed(3)
            pyrandom.gauss(0, 1)
            np.random.standard_normal()
            state = tm_rng.capture()
            expected = (pyrandom.random(), pyrandom.gauss(0, 1), np.random.standard_normal(), np.random.random(),
                        torch.rand(3).tolist(), torch.randn(2).tolist())
            tm_rng.reseed(99)
            tm_rng.restore(state)
            got = (pyrandom.random(), pyrandom.gauss(0, 1), np.random.standard_normal(), np.random.random(),
                   torch.rand(3).tolist(), torch.randn(2).tolist())
            assert got == expected
        finally:
            pyrandom.setstate(pyrandom_state)
            np.random.set_state(np_state)


# ---- plain values -----------------------------------------------------------------------------------------

def test_opaque_states_round_trip_through_a_manifest():
    state = {"g": torch.Generator().manual_seed(4).get_state(), "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
             "e": torch.empty(0, 3), "a": np.arange(6, dtype=np.int16).reshape(2, 3), "t": (1, "x", None),
             "n": {3: [np.float32(2.5), b"\x01"]}}
    plain = to_plain(state, "data")
    back = from_plain(decode_value(json.loads(json.dumps(encode_value(plain, "data")))))
    assert back.keys() == state.keys()
    for key in ("g", "b", "e"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key])
    assert back["a"].dtype == np.int16 and np.array_equal(back["a"], state["a"])
    assert back["t"] == (1, "x", None) and back["n"] == {3: [2.5, b"\x01"]}
    with pytest.raises(TypeError, match="'data.f'.*function"):
        to_plain({"f": lambda: 0}, "data")


def test_a_save_before_the_first_batch_resumes_the_same_random_streams(tmp_path):
    """No pass is running at such a save (before training, or right after an end-of-epoch resume): the
    uninterrupted run's next iterator draws from the generator, so the resumed one must draw the same."""
    def run(resume: bool) -> list[float]:
        torch.manual_seed(0)
        sampler = ResumableSampler(16, shuffle=True, seed=0)
        loader = DataLoader(list(range(16)), batch_size=4, sampler=sampler)
        ckpt = Checkpointer(tmp_path / "run")
        if resume:
            assert ckpt.resume(dataloader=loader) == 0
        else:
            ckpt.save(0, dataloader=loader)
        return [torch.rand(1).item() for _ in loader]

    assert run(False) == run(True)


def test_a_second_checkpointer_leaves_a_save_in_progress_alone(tmp_path, monkeypatch):
    """An evaluator polling Checkpointer(root).latest() must not delete the training job's unfinished save."""
    from tensormorph.tmformat import commit as locations

    inside, gate = threading.Event(), threading.Event()
    commit = locations.LocalDestination.commit

    def held(self, manifest):
        inside.set()
        gate.wait(30)
        return commit(self, manifest)

    monkeypatch.setattr(locations.LocalDestination, "commit", held)
    ckpt = Checkpointer(tmp_path / "run", async_save=True)
    ckpt.save(1, model=nn.Linear(4, 4))
    assert inside.wait(30)
    assert Checkpointer(tmp_path / "run").latest() is None  # not committed yet, and not removed either
    gate.set()
    ckpt.wait()
    assert ckpt.latest().step == 1


def _rank_alone(rank: int, port: int, root: str, out: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    ready = threading.Event()
    original = Checkpointer._write_in_background

    def held(self, *args):
        ready.wait(30)  # the background copy starts only after rank 0's in-place change below
        original(self, *args)

    Checkpointer._write_in_background = held
    ckpt = Checkpointer(root, async_save=True)
    ckpt.save(1, model=model, optimizer=opt)
    if rank == 0:
        with torch.no_grad():
            model.weight.add_(1)  # on rank 0 only
    ready.set()
    try:
        ckpt.wait()
        outcome = "ok"
    except CheckpointError as exc:
        outcome = str(exc)
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(outcome)
    dist.destroy_process_group()
    os._exit(0)  # no interpreter shutdown with gloo's threads around (it now and then aborts)


def test_a_copy_failing_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tmp.spawn(_rank_alone, args=(port, str(tmp_path / "run"), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    assert "changed in place" in rank0 and "'model.weight'" in rank0
    assert "rank 0's copy of the state failed" in rank1
    assert not (tmp_path / "run" / "step-00000001").exists()
