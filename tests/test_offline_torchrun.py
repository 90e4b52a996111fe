"""convert, verify and diff under `torchrun --nproc_per_node 2` (gloo): the same files and reports as one process.

Each torchrun start costs seconds (torch imported by every process), so one launch runs every command (this file
is its script: `torchrun ... test_offline_torchrun.py OUT COMMANDS`, one process group for all of them), and one
more runs the installed `tensormorph` command itself, as a user would, for an error on one rank only.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
TORCHRUN_TIMEOUT_S = 240  # a hung collective fails the test instead of the suite


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master-addr", "127.0.0.1",
                           "--master-port", str(_free_port()), *command], cwd=cwd, capture_output=True, text=True,
                          env={**env, "OMP_NUM_THREADS": "1"}, timeout=TORCHRUN_TIMEOUT_S)


def _drive(out: Path, commands: list[list[str]]) -> None:
    """Under torchrun: run each command in this process (one gloo group for all), recording its exit code and
    output in OUT/<i>.rank<r>.json."""
    import torch.distributed as dist

    from tensormorph.cli import main

    dist.init_process_group("gloo")
    for i, args in enumerate(commands):
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                main.main(args, prog_name="tensormorph", standalone_mode=False)
                code = 0
            except SystemExit as exc:
                code = int(exc.code or 0)
        record = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
        (out / f"{i}.rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _alone(args: list[str]) -> tuple[int, str]:
    """One process (no torchrun): the exit code and stdout."""
    from click.testing import CliRunner

    from tensormorph.cli import main

    result = CliRunner().invoke(main, args)
    return result.exit_code, result.stdout


def _corrupt(folder: Path, tensor: str) -> None:
    """Flip one byte of `tensor`'s chunk in the first rank file of a Tensormorph checkpoint."""
    file = folder / "rank-00000.safetensors"
    data = bytearray(file.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    start = 8 + length + json.loads(data[8:8 + length])[tensor]["data_offsets"][0]
    data[start] ^= 0xFF
    file.write_bytes(bytes(data))


def _diff_share(a: Path, b: Path, rank: int) -> list[str]:
    """The tensors that `rank` of 2 compares in `diff a b`, largest first (ops.diff's units: both sides' bytes)."""
    from tensormorph.formats import open_checkpoint
    from tensormorph.ops.spread import balance

    with open_checkpoint(a) as ck_a, open_checkpoint(b) as ck_b:
        sizes = {n: ck_a[n].nbytes + ck_b[n].nbytes for n in dict.fromkeys([*ck_a, *ck_b])}
    return balance(sizes, 2)[rank]


def _manifest(folder: Path) -> dict:
    """A Tensormorph manifest without what differs from save to save (its time, and the checksum over it)."""
    body = json.loads((folder / "manifest.json").read_text())["body"]
    body.pop("created", None)
    return body


@pytest.fixture(scope="module")
def cases(tmp_path_factory, dcp_llama_1d: Path, dcp_llama_2d: Path, hf_llama_safetensors: Path) -> dict:
    """Every command run once alone and once by 2 torchrun processes: {name: (alone, [rank 0, rank 1], outputs)}."""
    from tensormorph.ops.convert import convert

    work = tmp_path_factory.mktemp("offline")
    hf = hf_llama_safetensors
    convert(hf, work / "bf16", dtype="bf16", check=False)
    convert(hf, work / "tm", to="tensormorph", mesh=2, check=False)
    victim = _diff_share(hf, work / "tm", 1)[0]
    _corrupt(work / "tm", victim)
    commands = {
        "convert": ["convert", str(dcp_llama_1d), "{out}", "--max-shard-size", "100KB", "--json"],
        "convert_tm": ["convert", str(hf), "{out}", "--to", "tensormorph", "--world", "4", "--redundancy",
                       "replicate:2", "--json"],
        "verify": ["verify", "--full", "--json", str(dcp_llama_1d)],
        "verify_damaged": ["verify", "--full", "--json", str(work / "tm")],
        "diff_cast": ["diff", "--json", str(hf), str(work / "bf16")],
        "diff_layouts": ["diff", "--json", "--rename", "b:model.=", str(dcp_llama_1d), str(dcp_llama_2d)],
        "convert_damaged": ["convert", str(work / "tm"), "{out}", "--json"],
    }
    alone, spread = {}, []
    for name, args in commands.items():
        alone[name] = _alone([a.replace("{out}", str(work / f"{name}.alone")) for a in args])
        spread.append([a.replace("{out}", str(work / f"{name}.spread")) for a in args])
    runs = work / "runs"
    runs.mkdir()
    launch = _torchrun(__file__, str(runs), json.dumps(spread), cwd=work)
    assert launch.returncode == 0, launch.stderr[-4000:]
    results = {}
    for i, name in enumerate(commands):
        ranks = [json.loads((runs / f"{i}.rank{r}.json").read_text()) for r in range(2)]
        results[name] = (alone[name], ranks, (work / f"{name}.alone", work / f"{name}.spread"))
    return {"results": results, "work": work, "victim": victim, "hf": hf}


def _same_report(case: tuple, code: int) -> dict:
    """The spread run's exit codes and rank 0's stdout against the single process's (paths made the same)."""
    (alone_code, alone_out), ranks, (alone_path, spread_path) = case
    assert (alone_code, ranks[0]["code"], ranks[1]["code"]) == (code, code, code), ranks
    assert ranks[1]["stdout"] == ""  # rank 0 prints
    assert ranks[0]["stdout"].replace(str(spread_path), str(alone_path)) == alone_out
    return json.loads(alone_out)


def test_convert_writes_the_same_files(cases):
    case = cases["results"]["convert"]
    report = _same_report(case, 0)
    alone, spread = case[2]
    assert len(report["files"]) > 2 and report["check"]["identical"]
    assert sorted(p.name for p in spread.iterdir()) == sorted(p.name for p in alone.iterdir()) == \
        sorted([*report["files"], "model.safetensors.index.json"])
    for file in alone.iterdir():
        assert (spread / file.name).read_bytes() == file.read_bytes(), file.name
    assert not [p for p in spread.parent.iterdir() if ".tmp-" in p.name]  # the staging folder was moved into place


def test_convert_to_tensormorph_writes_the_same_files(cases):
    case = cases["results"]["convert_tm"]
    report = _same_report(case, 0)
    alone, spread = case[2]
    ranks = [f"rank-{r:05d}" for r in range(4)]
    assert report["files"] == [f"{r}.safetensors" for r in ranks] and report["check"]["identical"]
    assert sorted(p.name for p in spread.iterdir()) == sorted(p.name for p in alone.iterdir()) == \
        sorted(["manifest.json", *(f"{r}.safetensors" for r in ranks), *(f"{r}.copy1.safetensors" for r in ranks)])
    for file in alone.iterdir():
        if file.name != "manifest.json":
            assert (spread / file.name).read_bytes() == file.read_bytes(), file.name
    assert _manifest(spread) == _manifest(alone)


def test_verify_reports_the_same(cases):
    report = _same_report(cases["results"]["verify"], 0)
    assert report["ok"] and report["full"] and report["checksums_checked"] > 0
    index = json.loads((cases["hf"] / "model.safetensors.index.json").read_text())
    assert report["bytes_read"] == index["metadata"]["total_size"]  # the same weights as the HF model
    damaged = _same_report(cases["results"]["verify_damaged"], 1)
    assert [p["kind"] for p in damaged["problems"]] == ["ChecksumError", "ChecksumError"]  # the file, the tensor
    assert damaged["problems"][1]["tensor"] == cases["victim"]


def test_diff_reports_the_same(cases):
    cast = _same_report(cases["results"]["diff_cast"], 1)
    assert cast["counts"] == {"dtype_mismatch": len(cast["tensors"])}
    errors = [t["rel_l2"] for t in cast["tensors"]]
    assert errors == sorted(errors, reverse=True) and errors[0] > 1e-3 and errors[-1] == 0.0  # worst first
    layouts = _same_report(cases["results"]["diff_layouts"], 0)
    assert set(layouts["counts"]) == {"equal"} and [o["status"] for o in layouts["objects"]] == ["equal"] * 3


def test_an_error_on_one_rank_fails_every_rank(cases):
    (alone_code, _), ranks, (alone, spread) = cases["results"]["convert_damaged"]
    assert (alone_code, ranks[0]["code"], ranks[1]["code"]) == (2, 2, 2)
    for record in ranks:
        assert re.search(r"error: rank [01] of 2: ChecksumError: .*rank-00000\.safetensors", record["stderr"])
        assert record["stdout"] == ""
    assert not spread.exists() and not [p for p in spread.parent.iterdir() if ".tmp-" in p.name]


def test_the_command_under_torchrun_names_the_failing_rank(cases):
    """The installed command, launched as a user would: the group from torchrun's environment, the error of the
    one rank whose share holds the damaged tensor, and a failed launch."""
    run = _torchrun("--no-python", str(BIN / "tensormorph"), "diff", "--json", str(cases["hf"]),
                    str(cases["work"] / "tm"), cwd=cases["work"])
    assert run.returncode != 0 and run.stdout == ""
    errors = re.findall(r"error: rank (\d) of 2: ChecksumError: [^\n]*", run.stderr)
    assert errors == [errors[0]] * 2 and errors[0] == "1", run.stderr[-3000:]  # printed by both ranks
    assert f"tensor {cases['victim']!r}" in run.stderr


def test_alone_never_imports_torch(hf_llama_safetensors: Path):
    code = ("import sys; from click.testing import CliRunner; from tensormorph.cli import main; "
            f"r = CliRunner().invoke(main, ['verify', '--full', {str(hf_llama_safetensors)!r}]); "
            "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_balance_is_greedy_by_bytes():
    from tensormorph.ops.spread import balance, under_torchrun

    assert balance({"a": 5, "b": 4, "c": 3, "d": 3}, 2) == [["a", "d"], ["b", "c"]]
    assert balance({"x": 0, "y": 0, "z": 7}, 3) == [["z"], ["x"], ["y"]]
    assert balance({"a": 1}, 2) == [["a"], []]
    assert under_torchrun({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "h"})
    assert not under_torchrun({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"})


if __name__ == "__main__":  # a process of the torchrun launch above
    _drive(Path(sys.argv[1]), json.loads(sys.argv[2]))
