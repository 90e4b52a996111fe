"""Every command against hostile-ish inputs: a missing path, a dangling link, a NUL byte, a file where a folder is
expected and a folder where a file is, unreadable files, an output path that is a link, a declared shape too large
to scan, a missing optional package. Each failure is one line on stderr and exit 2 (verify: a found problem is
exit 1), never a traceback (issue 14, defects 9 and 12)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner, Result
from hostile_support import copy_dcp, load_metadata, run_bounded, save_metadata

import tensormorph as tm
from tensormorph.cli import main
from tensormorph.errors import MissingDependencyError
from tensormorph.extras import require, require_for_url

pytestmark = pytest.mark.timeout(120)

OPTIONAL = ("torch", "fsspec", "s3fs", "uvicorn", "starlette", "gguf", "accelerate", "transformers", "safetensors")


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    # an exception other than the exit is a traceback the runner caught, not a pass
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def one_line_error(*args: str) -> str:
    """The command's single output line, after asserting it failed with exit 2."""
    result = invoke(*args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("good")
    safetensors.numpy.save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Paths that are not checkpoints, by what they are."""
    base = tmp_path_factory.mktemp("shapes")
    (base / "file").write_text("not a checkpoint\n")
    (base / "empty").mkdir()
    (base / "dangling").symlink_to(base / "nowhere")
    (base / "holds_dangling").mkdir()
    (base / "holds_dangling" / "model.safetensors").symlink_to(base / "nowhere.safetensors")
    return {"missing": base / "missing", "dangling link": base / "dangling", "NUL byte": base / "bad\x00name",
            "a file": base / "file", "an empty folder": base / "empty", "a folder holding a dangling link":
            base / "holds_dangling"}


COMMANDS = {
    "inspect": lambda p, good: ["inspect", p],
    "show": lambda p, good: ["show", p, "w"],
    "stats": lambda p, good: ["stats", p],
    "diff a": lambda p, good: ["diff", p, good],
    "diff b": lambda p, good: ["diff", good, p],
    "verify": lambda p, good: ["verify", "--full", p],
    "repair": lambda p, good: ["repair", p],
    "convert": lambda p, good: ["convert", p, os.path.join(good, "never-written")],
    "plan": lambda p, good: ["plan", p, "--device", "a=24GB,tflops=100,bw=1000"],
}


@pytest.mark.parametrize("case", ["missing", "dangling link", "NUL byte", "a file", "an empty folder",
                                  "a folder holding a dangling link"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_fails_in_one_line(good: Path, shapes: dict[str, Path], command: str, case: str) -> None:
    path = str(shapes[case])
    args = COMMANDS[command](path, str(good))
    if command == "verify" and case not in ("missing", "dangling link", "NUL byte"):
        # verify ran, and found the path is no checkpoint: a problem (exit 1), one line of it, and the verdict
        result = invoke(*args)
        assert result.exit_code == 1
        problem, verdict = result.output.strip().splitlines()
        assert problem.startswith("UnknownFormatError ") and verdict.startswith("1 problem(s)")
        return
    line = one_line_error(*args)
    assert path.split("\x00")[0] in line
    assert not (good / "never-written").exists()


# ---------------------------------------------------------------------------
# convert: never through a link at the destination
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["safetensors", "tensormorph"])
@pytest.mark.parametrize("link_to", ["an empty folder", "nothing"])
def test_convert_refuses_a_link_as_its_destination(good: Path, tmp_path: Path, target: str, link_to: str) -> None:
    pointed = tmp_path / "pointed"
    if link_to == "an empty folder":
        pointed.mkdir()
    (tmp_path / "out").symlink_to(pointed)
    line = one_line_error("convert", str(good), str(tmp_path / "out"), "--to", target)
    assert "destination is a symbolic link" in line and str(tmp_path / "out") in line
    assert (tmp_path / "out").is_symlink()
    assert (list(pointed.iterdir()) == []) if link_to == "an empty folder" else not pointed.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out"] + (["pointed"] if pointed.exists() else []))


@pytest.mark.parametrize("target", ["safetensors", "tensormorph"])
def test_convert_into_a_path_under_a_file(good: Path, tmp_path: Path, target: str) -> None:
    (tmp_path / "file").write_text("x")
    line = one_line_error("convert", str(good), str(tmp_path / "file" / "out"), "--to", target)
    assert "which is a file, not a folder" in line and str(tmp_path / "file") in line


def test_convert_to_a_url_writes_no_local_folder(good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    line = one_line_error("convert", str(good), "https://example.invalid/out")  # refused before any request
    assert "https://example.invalid/out" in line and "HTTP is read-only" in line
    assert list(tmp_path.iterdir()) == []  # nothing named like the URL appears in the working folder


def test_convert_into_a_non_empty_folder(good: Path, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("precious")
    line = one_line_error("convert", str(good), str(tmp_path))
    assert "not an empty folder" in line
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


# ---------------------------------------------------------------------------
# a folder where a data file is expected; a declared shape too large to scan
# ---------------------------------------------------------------------------


@pytest.fixture
def dcp_with_a_folder(dcp_seed: Path, tmp_path: Path) -> Path:
    folder = copy_dcp(dcp_seed, tmp_path / "ckpt")
    (folder / "__0_0.distcp").unlink()
    (folder / "__0_0.distcp").mkdir()
    return folder


def test_verify_reports_a_data_file_that_is_a_folder(dcp_with_a_folder: Path) -> None:
    result = invoke("verify", str(dcp_with_a_folder))
    assert result.exit_code == 1, result.output  # a damaged checkpoint: a problem found, not a crash
    *problems, verdict = result.output.strip().splitlines()
    assert problems and all("__0_0.distcp" in p for p in problems)
    assert verdict.startswith(f"{len(problems)} problem(s)")


@pytest.mark.parametrize("command", ["stats", "convert"])
def test_reading_a_data_file_that_is_a_folder(dcp_with_a_folder: Path, tmp_path: Path, command: str) -> None:
    args = [command, str(dcp_with_a_folder)] + ([str(tmp_path / "out")] if command == "convert" else [])
    assert "__0_0.distcp" in one_line_error(*args)


HUGE = [2**40, 2**40]  # 2^80 elements: numpy cannot even describe an array of them


@pytest.fixture
def huge_dcp(dcp_seed: Path, tmp_path: Path) -> Path:
    """A DCP checkpoint whose tensor 'w' declares 2^40 x 2^40 floats in a zstd item (nothing checks a compressed
    item's size against its shape before it is decompressed)."""
    import torch
    import zstandard
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    folder = copy_dcp(dcp_seed, tmp_path / "huge")
    metadata = load_metadata(folder)
    size = torch.Size(HUGE)
    metadata.state_dict_metadata["w"] = dataclasses.replace(
        metadata.state_dict_metadata["w"], size=size, chunks=[ChunkStorageMetadata(torch.Size([0, 0]), size)])
    key = next(k for k in metadata.storage_data if k.fqn == "w")
    info = metadata.storage_data.pop(key)
    data = (folder / info.relative_path).read_bytes()
    item = zstandard.ZstdCompressor().compress(data[info.offset:info.offset + info.length])
    (folder / info.relative_path).write_bytes(data + item)
    metadata.storage_data[MetadataIndex("w", torch.Size([0, 0]), 0)] = dataclasses.replace(
        info, offset=len(data), length=len(item), transform_descriptors=["stream.zstd/1"])
    save_metadata(folder, metadata)
    return folder


@pytest.mark.parametrize("names", [[], ["w"]])
def test_stats_refuses_a_tensor_too_large_to_scan(huge_dcp: Path, names: list[str]) -> None:
    line = one_line_error("stats", str(huge_dcp), *names)
    assert "tensor 'w'" in line and "too large to scan" in line and str(HUGE) in line


def test_verify_full_reports_a_tensor_too_large_to_scan(huge_dcp: Path) -> None:
    result = invoke("verify", "--full", str(huge_dcp))
    assert result.exit_code == 1
    assert any(line.startswith("BudgetExceededError") and "tensor 'w'" in line and "too large to scan" in line
               for line in result.output.splitlines())


def test_convert_refuses_a_tensor_too_large_to_scan_before_writing(huge_dcp: Path, tmp_path: Path) -> None:
    line = one_line_error("convert", str(huge_dcp), str(tmp_path / "out"))
    assert "tensor 'w'" in line and "too large to scan" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["huge"]


def test_diff_refuses_a_tensor_too_large_to_scan(huge_dcp: Path) -> None:
    line = one_line_error("diff", str(huge_dcp), str(huge_dcp))
    assert "tensor 'w'" in line and "too large" in line


def test_stats_of_a_huge_declared_tensor_is_refused_at_once(huge_dcp: Path) -> None:
    outcome = run_bounded(f"""
import tensormorph.ops.stats
# measure
import tensormorph as tm
from tensormorph.ops.stats import checkpoint_stats
checkpoint_stats(tm.open({str(huge_dcp)!r}).values())
""", seconds=2, grown_mib=64)
    assert outcome is not None and outcome[0] == "BudgetExceededError" and "'w'" in outcome[1]


# ---------------------------------------------------------------------------
# permission denied: where the tests run as root, in a user namespace of their own, where root's powers over files
# are gone (the owner's permission bits apply, as to anyone)
# ---------------------------------------------------------------------------

_IN_CHILD = """
import json, sys
from click.testing import CliRunner
from tensormorph.cli import main
results = []
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(main, args)
    crashed = r.exception is not None and not isinstance(r.exception, SystemExit)
    results.append([r.exit_code, r.output, repr(r.exception) if crashed else None])
print(json.dumps(results))
"""


def run_without_privileges(commands: list[list[str]]) -> list[tuple[int, str, str | None]]:
    """The CLI run where permission bits hold, each command's (exit code, output, crash)."""
    prefix = []
    if os.geteuid() == 0:
        unshare = shutil.which("unshare")
        if unshare is None or subprocess.run([unshare, "--user", "true"], capture_output=True).returncode != 0:
            pytest.skip("LOUD SKIP: running as root, and `unshare --user` (util-linux) is missing or not allowed "
                        "here, so permission bits cannot be made to apply")
        prefix = [unshare, "--user"]
    done = subprocess.run([*prefix, sys.executable, "-c", _IN_CHILD, json.dumps(commands)], capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def test_unreadable_files_and_folders_fail_in_one_line(good: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    for name in ("source", "unreadable_file", "unreadable_folder"):
        shutil.copytree(good, tmp_path / name)
    sharded = tmp_path / "sharded"
    tm.convert(good, sharded, to="tensormorph", mesh=2, redundancy="replicate:2")
    unreadable_file = tmp_path / "unreadable_file" / "model.safetensors"
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    denied = {unreadable_file: 0, tmp_path / "unreadable_folder": 0, sharded / "rank-00000.safetensors": 0,
              read_only: 0o555}
    cases = [
        (["inspect", str(unreadable_file)], 2, str(unreadable_file)),
        (["stats", str(unreadable_file.parent)], 2, str(unreadable_file.parent)),
        (["inspect", str(tmp_path / "unreadable_folder")], 2, "unreadable_folder"),
        (["stats", str(sharded)], 2, "rank-00000.safetensors"),
        (["verify", str(sharded)], 1, "rank-00000.safetensors"),  # a problem found: the file cannot be read
        (["repair", str(sharded)], 2, "rank-00000.safetensors"),  # could not judge the file: nothing rewritten
        (["convert", str(source), str(read_only / "out")], 2, str(read_only / "out")),
        (["convert", str(source), str(read_only / "out"), "--to", "tensormorph"], 2, str(read_only / "out")),
    ]
    modes = {path: path.stat().st_mode for path in denied}
    try:
        for path, mode in denied.items():
            path.chmod(mode)
        results = run_without_privileges([args for args, _, _ in cases])
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    for (args, code, fragment), (exit_code, output, crash) in zip(cases, results):
        assert crash is None, f"{args}: {crash}"
        lines = output.strip().splitlines()
        assert exit_code == code, f"{args}: {output}"
        assert fragment in lines[0], f"{args}: {output}"
        if code == 2:
            assert len(lines) == 1 and lines[0].startswith("error: "), f"{args}: {output}"
    assert list(read_only.iterdir()) == []
    assert sorted(p.name for p in sharded.iterdir()) == sorted(["manifest.json"] + [
        f"rank-0000{r}{copy}.safetensors" for r in (0, 1) for copy in ("", ".copy1")])


# ---------------------------------------------------------------------------
# optional dependencies (defect 12): a missing one is named in one line, with the extra that installs it
# ---------------------------------------------------------------------------


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # as if not installed
    with pytest.raises(MissingDependencyError) as info:
        require("torch", "torch", feature="tm.load")
    assert str(info.value) == ("tm.load needs the 'torch' extra (torch is not installed): "
                               "pip install 'tensormorph[torch]'")
    assert require("numpy", None) is np


def test_require_names_a_missing_dependency_of_an_installed_package(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "half_installed.py").write_text("import not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingDependencyError, match=r"half_installed is installed, but its dependency "
                       r"not_installed_anywhere is not\): pip install 'tensormorph\[web\]'"):
        require("half_installed", "web")
    with pytest.raises(MissingDependencyError, match=r"needs half_installed .*: pip install 'tensormorph'$"):
        require("half_installed", None)


@pytest.mark.parametrize("missing", ["fsspec", "s3fs"])
def test_require_for_url_names_the_s3_extra(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(MissingDependencyError, match=rf"reading s3://b/ck needs the 's3' extra \({missing} is not "
                                                     r"installed\): pip install 'tensormorph\[s3\]'"):
        require_for_url("s3://b/ck", feature="reading s3://b/ck")


def test_a_missing_extra_is_one_line_in_the_cli(good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)

    def needs_torch(*args: object, **kwargs: object) -> None:
        require("torch", "torch", feature="this reader")

    monkeypatch.setattr("tensormorph.cli.tensors.open_checkpoint", needs_torch)
    line = one_line_error("inspect", str(good))
    assert line == ("error: this reader needs the 'torch' extra (torch is not installed): "
                    "pip install 'tensormorph[torch]'")


_WITHOUT_OPTIONAL = f"""
import sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None  # an import of any of them fails, as on a plain install
from click.testing import CliRunner
from tensormorph.cli import main
failed = []
for args in {{commands}}:
    r = CliRunner().invoke(main, args)
    if r.exit_code != 0:
        failed.append((args, r.exit_code, r.output, repr(r.exception)))
print(failed)
"""


def test_commands_other_than_view_need_no_optional_package(good: Path, tmp_path: Path) -> None:
    import torch

    torch.save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, tmp_path / "pytorch_model.bin")
    commands = [["inspect", str(tmp_path)], ["show", str(tmp_path), "w"], ["stats", str(tmp_path)],
                ["verify", "--full", str(tmp_path)], ["diff", str(tmp_path), str(good)],
                ["convert", str(tmp_path), str(tmp_path / "st")],
                ["convert", str(good), str(tmp_path / "tmf"), "--to", "tensormorph", "--redundancy", "replicate:2"],
                ["repair", str(tmp_path / "tmf")], ["inspect", str(tmp_path / "tmf")]]
    done = subprocess.run([sys.executable, "-c", _WITHOUT_OPTIONAL.format(commands=commands)], capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
