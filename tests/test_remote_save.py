"""Saving to an object store (moto's real S3 server): an overwrite never removes a valid checkpoint before the new
one commits, and the Checkpointer keeps, lists and resumes a run whose root is an S3 prefix."""

from __future__ import annotations

import json

import numpy as np
import pytest
import s3fs
import torch
from remote_support import S3Endpoint
from torch import nn

import tensormorph as tm
from tensormorph.tmformat import writer as writer_module
from tensormorph.tmformat.manifest import MANIFEST
from tensormorph.train import Checkpointer

pytestmark = pytest.mark.timeout(180)
BUCKET = "saves"


@pytest.fixture(scope="module")
def s3():
    with S3Endpoint() as endpoint:
        endpoint.make_bucket(BUCKET)
        yield endpoint


def _keys(s3, prefix: str) -> list[str]:
    fs = s3fs.S3FileSystem(**s3.storage_options)
    fs.invalidate_cache()
    return sorted(key[len(f"{BUCKET}/{prefix}/"):] for key in fs.find(f"{BUCKET}/{prefix}"))


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 32), value), "b": torch.arange(16, dtype=torch.float32) * value}


def test_an_overwrite_that_fails_leaves_the_old_checkpoint_whole_and_a_good_one_replaces_it(s3, monkeypatch):
    url = f"s3://{BUCKET}/overwrite"
    tm.save(_state(1.0), url, storage_options=s3.storage_options)
    first = _keys(s3, "overwrite")
    generation = {key.split("/")[0] for key in first if "/" in key}
    assert len(generation) == 1 and generation.pop().startswith("gen-")

    def fail(*args, **kwargs):
        raise OSError("disk on fire")

    with monkeypatch.context() as patch:
        patch.setattr(writer_module, "write_rank_file", fail)
        with pytest.raises(Exception, match="disk on fire"):
            tm.save(_state(2.0), url, storage_options=s3.storage_options, overwrite=True)
    # the failed save's own files are gone; the old manifest and every file it names are untouched
    assert [k for k in _keys(s3, "overwrite") if k != ".tensormorph-save"] == first
    ck = tm.open(url, storage_options=s3.storage_options, cache=False)
    assert np.array_equal(ck["w"].full(), np.full((64, 32), 1.0, np.float32))

    tm.save(_state(3.0), url, storage_options=s3.storage_options, overwrite=True)
    after = _keys(s3, "overwrite")
    assert not set(first) - {MANIFEST} & set(after), "the replaced checkpoint's files are deleted after the commit"
    manifest = json.loads(s3fs.S3FileSystem(**s3.storage_options).cat_file(f"{BUCKET}/overwrite/{MANIFEST}"))
    assert sorted(manifest["body"]["files"]) == [k for k in after if k not in (MANIFEST,)]
    ck = tm.open(url, storage_options=s3.storage_options, cache=False)
    assert np.array_equal(ck["b"].full(), np.arange(16, dtype=np.float32) * 3.0)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    generator = torch.Generator().manual_seed(len(losses))
    for _ in range(steps):
        x = torch.randn(5, 4, generator=generator)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_checkpointer_on_s3_keeps_lists_and_resumes_exactly(s3):
    root = f"s3://{BUCKET}/run"
    model, opt = _model()
    ckpt = Checkpointer(root, keep=2, storage_options=s3.storage_options)
    for step in (1, 2, 3):
        _train(model, opt, 2)
        ckpt.save(step, model=model, optimizer=opt, extra={"loss": float(step)})
    assert [info.step for info in ckpt.list()] == [2, 3] and ckpt.latest().step == 3
    assert {key.split("/")[0] for key in _keys(s3, "run")} == {"step-00000002", "step-00000003"}
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    after_save = _train(model, opt, 3)

    fresh, fresh_opt = _model()
    again = Checkpointer(root, keep=2, storage_options=s3.storage_options)
    assert again.resume(model=fresh, optimizer=fresh_opt) == 3 and again.extra == {"loss": 3.0}
    assert all(torch.equal(expected[name], value) for name, value in fresh.state_dict().items())
    assert _train(fresh, fresh_opt, 3) == after_save  # the losses after resume are bitwise the same


def test_a_failure_after_the_manifest_put_keeps_the_new_checkpoint(s3, monkeypatch):
    """Once the manifest is PUT the save is committed: a failure tidying up (removing the marker, deleting the
    replaced files) is a warning, and nothing of the new checkpoint is deleted."""
    url = f"s3://{BUCKET}/tidy"
    tm.save(_state(1.0), url, storage_options=s3.storage_options)

    def refuse(path, *args, **kwargs):
        raise PermissionError("DeleteObject denied")

    with monkeypatch.context() as patch:
        # fsspec keeps one client per set of options: the one the save uses
        patch.setattr(s3fs.S3FileSystem(**s3.storage_options), "rm_file", refuse)
        with pytest.warns(UserWarning, match="committed, but tidying up after it failed"):
            tm.save(_state(2.0), url, storage_options=s3.storage_options, overwrite=True)
    ck = tm.open(url, storage_options=s3.storage_options, cache=False)
    assert np.array_equal(ck["w"].full(), np.full((64, 32), 2.0, np.float32))


def test_an_old_manifest_naming_the_manifest_cannot_make_the_overwrite_delete_it(s3):
    url = f"s3://{BUCKET}/crafted"
    tm.save(_state(1.0), url, storage_options=s3.storage_options)
    fs = s3fs.S3FileSystem(**s3.storage_options)
    raw = json.loads(fs.cat_file(f"{BUCKET}/crafted/{MANIFEST}"))
    body = raw["body"]
    data = sorted(body["files"])[0]
    body["files"] = {MANIFEST: body["files"][data], **body["files"]}  # names the manifest itself as a data file
    fs.pipe_file(f"{BUCKET}/crafted/{MANIFEST}", json.dumps(raw).encode())  # its checksum no longer matches
    tm.save(_state(4.0), url, storage_options=s3.storage_options, overwrite=True)
    ck = tm.open(url, storage_options=s3.storage_options, cache=False)
    assert np.array_equal(ck["w"].full(), np.full((64, 32), 4.0, np.float32))


def test_a_checkpointer_sees_what_another_saved_since_its_last_listing(s3):
    root = f"s3://{BUCKET}/watched"
    model, opt = _model()
    watcher = Checkpointer(root, storage_options=s3.storage_options)
    assert watcher.list() == []
    Checkpointer(root, storage_options=s3.storage_options).save(5, model=model, optimizer=opt)
    assert [info.step for info in watcher.list()] == [5]
