"""The two shortcuts of the memory tier: an async save to host memory alone writes its snapshot straight from
training's tensors (no staging copy), and a resume shapes a fresh optimizer's state from the checkpoint instead
of running torch's state-making optimizer step. Both must leave the results bit for bit as without them."""

from __future__ import annotations

import pytest
import torch
from test_train_tiers import _step, _train, _training
from torch import nn

from tensormorph.errors import CheckpointError, StateMismatchError
from tensormorph.train import Checkpointer, checkpointer
from tensormorph.train.memory import MemoryTier

torch.set_num_threads(1)


def _steps_taken(opt: torch.optim.Optimizer) -> list[int]:
    """A list that grows by one at each step of `opt`."""
    taken: list[int] = []
    opt.register_step_pre_hook(lambda *args: taken.append(1))
    return taken


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    left, right = a.state_dict()["state"], b.state_dict()["state"]
    return left.keys() == right.keys() and all(
        left[i].keys() == right[i].keys() and all(torch.equal(left[i][k], right[i][k]) for k in left[i])
        for i in left)


def test_a_memory_only_async_save_copies_nothing_into_staging_buffers(tmp_path):
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run", memory_every=1, disk_every=4, memory_dir=tmp_path / "shm",
                        async_save=True, release_memory_on_close=False)
    _train(ckpt, model, opt, range(1, 4))
    assert ckpt._staging._buffers == {}  # steps 1-3 went to memory alone: written from the live tensors
    _train(ckpt, model, opt, range(4, 6))
    assert set(ckpt._staging._buffers) >= {"model.weight", "optimizer.state.weight.exp_avg"}  # step 4: disk too
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    ckpt.close()
    fresh, fresh_opt = _training(seed=1)
    again = Checkpointer(tmp_path / "run", memory_every=1, disk_every=4, memory_dir=tmp_path / "shm")
    assert (again.resume(model=fresh, optimizer=fresh_opt), again.resumed_from) == (5, "memory")
    assert all(torch.equal(p, saved[n]) for n, p in fresh.named_parameters())
    assert _same_state(fresh_opt, opt)
    again.close()


def test_a_tensor_changed_while_its_snapshot_is_written_fails_the_save(tmp_path, monkeypatch):
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run", memory_every=1, disk_every=10, memory_dir=tmp_path / "shm",
                        async_save=True)
    _train(ckpt, model, opt, range(1, 2))
    real_save = MemoryTier.save

    def changed_first(self, step, state, extra, versions=None):
        with torch.no_grad():
            model.bias.add_(1.0)  # in place, outside the optimizer's step: the version counter moves
        return real_save(self, step, state, extra, versions)

    monkeypatch.setattr(MemoryTier, "save", changed_first)
    _step(model, opt, 2)
    ckpt.save(2, model=model, optimizer=opt)
    with pytest.warns(UserWarning, match=r"memory snapshot of step 2 failed: .*model\.bias.*changed in place"):
        ckpt.wait()
    assert ckpt.memory_steps() == (1,)  # nothing of step 2 was kept
    monkeypatch.setattr(MemoryTier, "save", real_save)
    _step(model, opt, 3)
    ckpt.save(3, model=model, optimizer=opt)  # the fence was released: training and saving go on
    ckpt.wait()
    assert ckpt.memory_steps() == (1, 3)
    ckpt.close()


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_resume_shapes_the_optimizer_state_without_an_optimizer_step(tmp_path, tier):
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run", memory_every=1 if tier == "memory" else None, memory_dir=tmp_path / "shm",
                        release_memory_on_close=False)
    _train(ckpt, model, opt, range(1, 4))
    ckpt.close()
    fresh, fresh_opt = _training(seed=1)
    taken = _steps_taken(fresh_opt)
    again = Checkpointer(tmp_path / "run", memory_every=1 if tier == "memory" else None, memory_dir=tmp_path / "shm")
    assert (again.resume(model=fresh, optimizer=fresh_opt), again.resumed_from) == (3, tier)
    assert taken == []  # torch's _init_optim_state would have stepped the empty optimizer once
    assert _same_state(fresh_opt, opt)
    _step(model, opt, 4), _step(fresh, fresh_opt, 4)  # and the next step is the same step
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))
    again.close()


def test_without_the_optimizers_record_torchs_own_step_makes_the_state(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointer, "optimizer_classes", lambda given: None)  # a checkpoint of an older version
    model, opt = _training()
    ckpt = Checkpointer(tmp_path / "run")
    _train(ckpt, model, opt, range(1, 3))
    fresh, fresh_opt = _training(seed=1)
    taken = _steps_taken(fresh_opt)
    assert ckpt.resume(model=fresh, optimizer=fresh_opt) == 2
    assert taken == [1] and _same_state(fresh_opt, opt)
    ckpt.close()


def test_another_optimizer_class_is_still_a_mismatch(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm", release_memory_on_close=False)
    _train(ckpt, model, sgd, range(1, 3))
    ckpt.close()
    fresh, adamw = _training(seed=1)
    again = Checkpointer(tmp_path / "run", memory_every=1, memory_dir=tmp_path / "shm")
    with pytest.raises((StateMismatchError, CheckpointError), match="exp_avg|momentum_buffer"):
        again.resume(model=fresh, optimizer=adamw)
    again.close()
