"""The fixture cache (tests/fixtures/cache.py) shared by concurrent processes: two builds of one entry both
succeed and keep their folder, a process of another builder version never removes a build in use, and stale
builds and leftovers are removed once nothing holds them."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from fixtures.cache import cached_build

pytestmark = pytest.mark.timeout(120)

TESTS_DIR = Path(__file__).resolve().parent
PARTS = 20

# A builder that waits until `CACHE_TEST_BUILDERS` builders have started, so concurrent builds really overlap.
BUILDER = """
import os
import time
from pathlib import Path

VERSION = {version}


def build(folder: Path) -> None:
    gate = Path(os.environ["CACHE_TEST_GATE"])
    (gate / f"started-{{os.getpid()}}").touch()
    deadline = time.monotonic() + 60
    while len(list(gate.glob("started-*"))) < int(os.environ["CACHE_TEST_BUILDERS"]):
        if time.monotonic() > deadline:
            raise TimeoutError("the other builder never started")
        time.sleep(0.01)
    for part in range({parts}):
        (folder / f"part{{part}}").write_text(f"{{VERSION}} {{os.getpid()}}")
"""

# A test session in miniature: look the entry up, print its folder, use it until stdin says to finish, then
# report whether the folder is still whole.
USER = """
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
from fixtures.cache import cached_build

spec = importlib.util.spec_from_file_location("builder", sys.argv[3])
builder = importlib.util.module_from_spec(spec)
spec.loader.exec_module(builder)
folder = cached_build("race", builder, builder.build, root=Path(sys.argv[2]))
print(folder, flush=True)
sys.stdin.readline()
writers = {(folder / f"part{i}").read_text() for i in range(int(sys.argv[4]))}
print("intact" if len(writers) == 1 else f"mixed {writers}", flush=True)
"""


def write_builder(tmp_path: Path, version: int) -> Path:
    path = tmp_path / f"builder_v{version}.py"
    path.write_text(BUILDER.format(version=version, parts=PARTS))
    return path


def build_folder(root: Path, builder: Path) -> Path:
    return root / "race" / hashlib.sha1(builder.read_bytes()).hexdigest()


def start_user(root: Path, builder: Path, gate: Path, builders: int) -> subprocess.Popen:
    environment = {**os.environ, "CACHE_TEST_GATE": str(gate), "CACHE_TEST_BUILDERS": str(builders)}
    return subprocess.Popen([sys.executable, "-c", USER, str(TESTS_DIR), str(root), str(builder), str(PARTS)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=environment)


def folder_of(user: subprocess.Popen) -> Path:
    """The build folder a user printed."""
    line = user.stdout.readline().strip()
    if not line:
        raise AssertionError(f"the user process failed: {user.stderr.read()}")
    return Path(line)


def finish(user: subprocess.Popen) -> str:
    """Tell a user to finish; its last line ("intact" when its folder stayed whole)."""
    out, err = user.communicate("\n", timeout=60)
    assert user.returncode == 0, err
    return out.splitlines()[-1]


def run_user(root: Path, builder: Path, gate: Path) -> Path:
    user = start_user(root, builder, gate, builders=1)
    folder = folder_of(user)
    assert finish(user) == "intact"
    return folder


def test_concurrent_builds_both_succeed_and_stale_builds_go_once_unused(tmp_path: Path) -> None:
    root, gate = tmp_path / "cache", tmp_path / "gate"
    gate.mkdir()
    v1, v2 = write_builder(tmp_path, 1), write_builder(tmp_path, 2)
    first, second = (start_user(root, v1, gate, builders=2) for _ in range(2))
    folders = {folder_of(first), folder_of(second)}
    assert folders == {build_folder(root, v1)}
    assert {p.name for p in gate.iterdir()} == {f"started-{first.pid}", f"started-{second.pid}"}  # both built
    (folder,) = folders
    writers = {(folder / f"part{i}").read_text() for i in range(PARTS)}
    assert writers in ({f"1 {first.pid}"}, {f"1 {second.pid}"})  # one whole build won the rename
    assert os.listdir(folder.parent) == [folder.name]  # the loser removed only its own temporary folder

    # a process of the next builder version sweeps the group while both still use the old build: it stays
    assert run_user(root, v2, gate) == build_folder(root, v2)
    assert sorted(os.listdir(folder.parent)) == sorted([folder.name, build_folder(root, v2).name])
    assert finish(first) == "intact" and finish(second) == "intact"

    # once no process holds it, the next sweep removes the stale build, and only it
    assert run_user(root, v2, gate) == build_folder(root, v2)
    assert os.listdir(folder.parent) == [build_folder(root, v2).name]
    assert len(list(gate.iterdir())) == 3  # the second v2 run found v2 built


def load_builder(path: Path, source: str) -> ModuleType:
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_leftovers_of_dead_processes_are_removed_and_held_folders_kept(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    builder = load_builder(tmp_path / "builder.py", "VERSION = 3\n")
    group = root / "group"
    leftovers = [group / ".tmp-4242-0badcafe", group / ".stale-0123", group / ("0" * 40),
                 root / ("f" * 40) / "dcp" / "ckpt"]  # the last: the layout before groups
    for folder in leftovers:
        folder.mkdir(parents=True)
        (folder / "file").write_bytes(b"x")
    held = group / ("1" * 40)  # another version's build, in use by a live process (here: this one)
    held.mkdir()
    descriptor = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(descriptor, fcntl.LOCK_SH)
    try:
        built = cached_build("group", builder, lambda folder: (folder / "value").write_text("3"), root=root)
    finally:
        os.close(descriptor)
    assert (built / "value").read_text() == "3"
    assert sorted(os.listdir(group)) == sorted([built.name, held.name])
    assert os.listdir(root) == ["group"]


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    builder = load_builder(tmp_path / "builder.py", "VERSION = 4\n")

    def failing(folder: Path) -> None:
        (folder / "half").write_text("x")
        raise RuntimeError("builder broke")

    with pytest.raises(RuntimeError, match="builder broke"):
        cached_build("group", builder, failing, root=root)
    assert os.listdir(root / "group") == []
    built = cached_build("group", builder, lambda folder: (folder / "value").write_text("4"), root=root)
    assert os.listdir(root / "group") == [built.name] and (built / "value").read_text() == "4"
    assert cached_build("group", builder, failing, root=root) == built  # built once per process and version
