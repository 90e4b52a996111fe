"""Checkpoints that survive lost and damaged files: rs(4,2) parity and replicas.

A 4-rank Tensormorph checkpoint (made offline from the real 4-rank DCP
fixture, so no ranks are needed here) loses every combination of up to two
of its stripe's six files, and takes a thousand random byte flips and
truncations: every one is detected, every one within the parity budget is
repaired bit-exact, and beyond it the error lists the tensors that are lost.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from fixtures.builders import expected_paths, load_expected

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import CheckpointError, ChecksumError, HeaderError
from tensormorph.tmformat.manifest import MANIFEST
from tensormorph.tmformat.parity import Scheme, overhead, parity_writer, parse_scheme

DATA = [f"rank-{r:05d}.safetensors" for r in range(4)]
PARITY = ["parity-00000-0.bin", "parity-00000-1.bin"]


@pytest.fixture(scope="module")
def protected(dcp_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("rs") / "ck"
    tm.convert(dcp_ckpt, out, to="tensormorph", mesh=4, placements=["Shard(0)"], redundancy="rs(4,2)")
    return out


@pytest.fixture(scope="module")
def truth(dcp_ckpt):
    return load_expected(expected_paths(dcp_ckpt)[0])


@pytest.fixture
def work(protected, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(protected, folder)
    return folder


def _state(truth) -> dict:
    """Zeroed torch tensors shaped like the checkpoint's, keyed as in the checkpoint."""
    state = {}
    for name, array in truth.items():
        tensor = torch.from_numpy(np.zeros(array.shape, array.dtype).reshape(-1).view(np.uint8).copy())
        state[name] = tensor.view(_torch_dtype(array.dtype)).reshape(array.shape)
    return state


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    import ml_dtypes

    table = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn,
             np.dtype(ml_dtypes.float8_e5m2): torch.float8_e5m2}
    return table.get(np.dtype(dtype)) or torch.from_numpy(np.zeros(1, dtype)).dtype


def _loaded_equals_truth(folder, truth) -> None:
    state = _state(truth)
    tm.load(folder, state, strict=False)
    for name, array in truth.items():
        assert state[name].reshape(-1).view(torch.uint8).numpy().tobytes() == array.tobytes(), name


def test_layout_records_one_stripe_with_two_parity_files(protected):
    body = json.loads((protected / MANIFEST).read_text())["body"]
    plan = body["redundancy"]
    assert plan["scheme"] == "rs(4,2)" and plan["stripes"] == [{"data": DATA, "parity": PARITY}]
    sizes = [body["files"][f]["size"] for f in DATA]
    assert [plan["files"][p]["size"] for p in PARITY] == [max(sizes)] * 2
    # the two parity files are written by two different ranks
    assert len({plan["files"][p]["rank"] for p in PARITY}) == 2
    assert overhead(Scheme("rs", 4, 2), sizes) == pytest.approx(2 * max(sizes) / sum(sizes))
    assert tm.verify(protected).ok and tm.verify(protected).checksums_checked == 6


@pytest.mark.parametrize("lost", [c for n in (1, 2) for c in itertools.combinations(DATA + PARITY, n)],
                         ids=lambda c: "+".join(f.split(".")[0] for f in c))
def test_any_two_lost_files_of_the_stripe_still_load_bit_exact_and_repair(work, truth, lost):
    for name in lost:
        (work / name).unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loaded_equals_truth(work, truth)
    lost_data = [f for f in lost if f in DATA]
    assert sorted({w_.message.args[0].split(":")[0].rsplit("/", 1)[-1] for w_ in caught}) == sorted(lost_data)
    report = tm.verify(work)
    assert sorted(p.file.rsplit("/", 1)[-1] for p in report.problems) == sorted(lost)
    assert all("recoverable from rs(4,2)" in p.message for p in report.problems)
    fixed = tm_repair(work)
    assert sorted(fixed.repaired) == sorted(lost) and fixed.ok


def tm_repair(folder):
    from tensormorph.ops.repair import repair

    return repair(folder)


def test_three_lost_files_fail_with_the_unrecoverable_tensors_listed(work, truth):
    for name in (DATA[0], DATA[1], PARITY[0]):
        (work / name).unlink()
    ck = tm.open(work)  # still opens: the manifest is intact and lists the damage
    held = sorted({n for n, t in ck.items() if any(c.file == DATA[0] for c in t.chunks)})
    assert set(ck.metadata["damaged_files"]) == {DATA[0], DATA[1]}
    with pytest.raises(CheckpointError, match="cannot be rebuilt from rs\\(4,2\\)") as info, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tm.load(work, _state(truth), strict=False)
    assert not [w for w in caught if "rebuilt from" in str(w.message)]  # nothing was
    assert "Unrecoverable tensors" in str(info.value)
    assert any(name in str(info.value) for name in held)
    report = tm.verify(work)
    assert all("not recoverable" in p.message for p in report.problems)
    run = CliRunner().invoke(main, ["repair", str(work)])
    assert run.exit_code == 1 and "unrecoverable" in run.output


def test_a_thousand_random_flips_and_truncations_are_detected_and_repaired(work, protected):
    rng = random.Random(20261130)
    files = DATA + PARITY + [MANIFEST]
    originals = {f: (protected / f).read_bytes() for f in files}
    detected = repaired = manifest_errors = 0
    for trial in range(1000):
        name = rng.choice(files)
        data = bytearray(originals[name])
        if rng.random() < 0.8:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:
            del data[rng.randrange(len(data)):]
        (work / name).write_bytes(bytes(data))
        if name == MANIFEST:
            # a damaged manifest is refused by its own checksum, with a clear error
            with pytest.raises((ChecksumError, HeaderError), match="manifest"):
                tm.open(work)
            manifest_errors += 1
        else:
            report = tm.verify(work)
            assert [p.file.rsplit("/", 1)[-1] for p in report.problems] == [name], (trial, name)
            detected += 1
            fixed = tm_repair(work)
            assert fixed.repaired == [name] and fixed.ok, (trial, name)
            assert (work / name).read_bytes() == originals[name]
            repaired += 1
        (work / name).write_bytes(originals[name])
    assert detected + manifest_errors == 1000 and repaired == detected and manifest_errors > 50


def test_replicas_survive_the_loss_of_a_data_file(dcp_ckpt, truth, tmp_path):
    out = tmp_path / "copies"
    tm.convert(dcp_ckpt, out, to="tensormorph", mesh=2, placements=["Shard(0)"], redundancy="replicate:2")
    names = sorted(p.name for p in out.iterdir())
    assert names == [MANIFEST, "rank-00000.copy1.safetensors", "rank-00000.safetensors",
                     "rank-00001.copy1.safetensors", "rank-00001.safetensors"]
    plan = json.loads((out / MANIFEST).read_text())["body"]["redundancy"]
    assert plan["files"]["rank-00000.copy1.safetensors"]["rank"] == 1  # the copy is a peer's job
    (out / "rank-00001.safetensors").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _loaded_equals_truth(out, truth)
    assert tm_repair(out).repaired == ["rank-00001.safetensors"]


def test_scheme_spelling_and_parity_placement():
    assert str(parse_scheme("RS(4, 2)")) == "rs(4,2)" and str(parse_scheme("replicate:3")) == "replicate:3"
    for bad in ("rs(0,2)", "rs(4)", "replicate:1", "mirror"):
        with pytest.raises(CheckpointError, match="redundancy"):
            parse_scheme(bad)
    # 8 ranks, rs(4,2): stripe 0 (ranks 0-3) gets its parity from ranks 4 and 5, stripe 1 from 0 and 1
    assert [parity_writer(s, j, 4, 8) for s in (0, 1) for j in (0, 1)] == [4, 5, 0, 1]
