"""`history` of a run on an object store (moto's real S3 server): the Checkpointer's object-store tier copies every
checkpoint of a run with a NaN injected at a known step, one checkpoint is damaged on both tiers, and the history
read from the URL equals the local run's. Its cache lives locally, and a step replaced on the store is read again
at once (never taken from the range cache's version records, which trust an object's version for a while)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from remote_support import S3Endpoint
from test_history import NAN_STEP, STEPS, train_step
from torch import nn

from tensormorph.cli import main
from tensormorph.ops import history as history_module
from tensormorph.ops.history import History, history
from tensormorph.tmformat.transfer import copy_checkpoint
from tensormorph.train import Checkpointer
from tensormorph.train import rollback as train_rollback

torch.set_num_threads(1)

BUCKET = "runs"
URL = f"s3://{BUCKET}/run"
DAMAGED_STEP = 2  # its data file is cut short on the local disk and on the object store alike
REPLACED_STEP = 5  # saved anew on the object store in the staleness test
# what differs between a local and a remote record of the same checkpoint: where it is, the manifest's length (the
# copy names its generation folder), the save timings (the Checkpointer records them on the local disk only), and
# whether the drift came from the cache
WHERE = ("path", "problem", "size", "tiers", "blocked_s", "durable_s", "cached")


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


@pytest.fixture(scope="module")
def s3():
    with S3Endpoint() as endpoint:
        endpoint.make_bucket(BUCKET)
        yield endpoint


@pytest.fixture(autouse=True)
def range_cache(tmp_path, monkeypatch) -> Path:
    """The range cache (and the default history cache of a remote run) in the test's own folder."""
    monkeypatch.setenv("TENSORMORPH_CACHE", str(tmp_path / "tm-cache"))
    return tmp_path / "tm-cache"


@pytest.fixture(scope="module")
def run(s3, tmp_path_factory) -> Path:
    """The local root of a run whose every checkpoint the object-store tier copied to URL."""
    root = tmp_path_factory.mktemp("remote-history") / "run"
    model, opt = _model()
    ckpt = Checkpointer(root, remote=URL, remote_every=1, remote_storage_options=s3.storage_options)
    for step in STEPS:
        loss = train_step(model, opt, step, 16)
        ckpt.save(step, model=model, optimizer=opt, extra={"loss": loss})
        ckpt.wait()  # each step reaches the store: a slow store may otherwise skip one for a newer
    ckpt.close()
    assert ckpt.remote_errors == ()
    local = root / f"step-{DAMAGED_STEP:08d}" / "rank-00000.safetensors"
    (key,) = [k for k in _fs(s3).find(f"{BUCKET}/run/step-{DAMAGED_STEP:08d}") if k.endswith(".safetensors")]
    _fs(s3).pipe_file(key, local.read_bytes()[:-100])
    local.write_bytes(local.read_bytes()[:-100])
    return root


def _fs(s3):
    import s3fs

    return s3fs.S3FileSystem(**s3.storage_options, skip_instance_cache=True)


def _same(a: History, b: History) -> None:
    """Everything but where the checkpoints are equal, drift and NaN counts exactly (as JSON: losses after the NaN
    are NaN, which equals nothing)."""
    assert json.dumps([{k: v for k, v in r.to_dict().items() if k not in WHERE} for r in a.checkpoints]) == \
        json.dumps([{k: v for k, v in r.to_dict().items() if k not in WHERE} for r in b.checkpoints])
    assert a.first_nonfinite == b.first_nonfinite and a.most_moved(10) == b.most_moved(10)


def test_history_on_the_object_store_equals_the_local_run(s3, run, range_cache, tmp_path):
    local = history(run, cache=False)
    stored = _fs(s3).find(BUCKET)
    remote = history(URL, storage_options=s3.storage_options)
    assert remote.run == URL and remote.checkpoints[0].path == f"{URL}/step-00000001"
    assert [(r.step, r.status) for r in remote.checkpoints] == \
        [(s, "damaged" if s == DAMAGED_STEP else "committed") for s in STEPS]
    assert f"{URL}/step-{DAMAGED_STEP:08d}/" in remote.checkpoints[DAMAGED_STEP - 1].problem
    assert remote.first_nonfinite[0].step == NAN_STEP and remote.first_nonfinite[0].tensor == "model.2.weight"
    assert sum(r.drift is not None for r in remote.checkpoints) == 4 and remote.computed == 4
    _same(local, remote)
    # the cache is local (the range cache's folder), never written to the store
    (cache_file,) = (range_cache / history_module.REMOTE_CACHE_FOLDER).iterdir()
    assert remote.cache_file == str(cache_file)
    assert _fs(s3).find(BUCKET) == stored
    again = history(URL, storage_options=s3.storage_options)
    assert again.cache_hits == 4 and again.computed == 0
    _same(local, again)
    elsewhere = history(URL, storage_options=s3.storage_options, cache_dir=tmp_path / "mine")
    assert elsewhere.computed == 4 and len(list((tmp_path / "mine").iterdir())) == 1


def test_a_step_replaced_on_the_store_is_read_again_at_once(s3, run, tmp_path):
    history(URL, storage_options=s3.storage_options)  # the cache, and the range cache's records of every object
    # the same step saved anew: another model, copied as the drain copies
    model, opt = _model(seed=7)
    other = Checkpointer(tmp_path / "other")
    other.save(REPLACED_STEP, model=model, optimizer=opt, extra={"loss": 1.5})
    other.close()
    replacement = tmp_path / "other" / f"step-{REPLACED_STEP:08d}"
    try:
        copy_checkpoint(replacement, f"{URL}/step-{REPLACED_STEP:08d}", s3.storage_options)
        remote = history(URL, storage_options=s3.storage_options)  # well within the records' trusted time
        assert remote.computed == 2 and remote.cache_hits == 2  # the pairs into and out of the replaced step
        assert remote.checkpoints[REPLACED_STEP - 1].metrics == {"loss": 1.5}
        changed = tmp_path / "changed"
        shutil.copytree(run, changed)
        shutil.rmtree(changed / replacement.name)
        shutil.copytree(replacement, changed / replacement.name)
        _same(history(changed, cache=False), remote)
    finally:  # the store's run as the other tests expect it
        copy_checkpoint(run / replacement.name, f"{URL}/step-{REPLACED_STEP:08d}", s3.storage_options)


def test_abandoned_by_a_rollback_on_the_store(s3, run):
    """A rollback leaves the store's later checkpoints in place, named in its marker: listed, never compared."""
    assert history_module.ROLLBACK_FILE == train_rollback.ROLLBACK_FILE
    assert history_module.MAX_MARKER_BYTES == train_rollback.MAX_MARKER_BYTES
    marker = {"step": 5, "seq": 5, "abandoned": [[6, 6]], "max_seq": 6, "resumed": False}
    key = f"{BUCKET}/run/{train_rollback.ROLLBACK_FILE}"
    _fs(s3).pipe_file(key, json.dumps(marker).encode())
    try:
        records = history(URL, storage_options=s3.storage_options, cache=False).checkpoints
    finally:
        _fs(s3).rm_file(key)
    assert [r.status for r in records][-2:] == ["committed", "abandoned"] and records[-1].drift is None


def test_the_cli_on_the_object_store(s3, run, tmp_path):
    options = [item for key, value in (("key", s3.key), ("secret", s3.secret),
                                       ("client_kwargs.endpoint_url", s3.endpoint))
               for item in ("--storage-option", f"{key}={value}")]
    out = CliRunner().invoke(main, [*options, "history", URL, "--json", "--cache-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    _same(History.from_dict(json.loads(out.output)), history(run, cache=False))
    table = CliRunner().invoke(main, [*options, "history", URL, "--cache-dir", str(tmp_path)])
    assert table.exit_code == 0, table.output
    assert "first NaN/Inf: model.2.weight at step 4" in table.output and "damaged:" in table.output
    assert "from the cache (4 pair(s); 0 computed)" in table.output
    missing = CliRunner().invoke(main, [*options, "history", f"s3://{BUCKET}/nothing-here"])
    assert missing.exit_code == 2 and "is not a folder of checkpoints" in missing.output
