"""Pytest plumbing for real checkpoint fixtures.

Fixtures are built once (by the real libraries, see tests/fixtures/builders.py) into the fixture cache
(tests/fixtures/cache.py: ``tests/.fixture-cache/<name>/<sha1 of builders.py>/``) and reused by later runs.

Layout of each cached fixture folder::

    <folder>/ckpt                       the checkpoint (dir or file set)
    <folder>/ckpt.expected.safetensors  full logical tensors by flattened name
    <folder>/ckpt.expected.json         non-tensor items by flattened name
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    # spawned DCP ranks inherit sys.path and import fixtures.builders by name
    sys.path.insert(0, str(TESTS_DIR))

from fixtures import builders  # noqa: E402
from fixtures.cache import cached_build  # noqa: E402
from hostile_support import make_dcp_seed, make_hf_folder  # noqa: E402

# CI draws the same examples every run, so a submission is judged on the code and not on a new random draw;
# runs elsewhere keep drawing new examples and keep finding new cases (hypothesis saves each failure it finds)
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def _cached(name: str, build: Callable[[Path], None]) -> Path:
    """The cache folder of fixture `name`, which `build(folder)` fills when builders.py has not built it yet."""
    return cached_build(name, builders, build)


@pytest.fixture(scope="session")
def fixture_builders():
    """The builders module (build_*, load_expected, expected_paths, ...)."""
    return builders


@pytest.fixture(scope="session")
def dcp_ckpt() -> Path:
    """DCP FileSystemWriter checkpoint (4 gloo ranks). Ground truth via
    ``builders.expected_paths(dcp_ckpt)``."""
    return _cached("dcp", lambda d: builders.build_dcp(d / "ckpt")) / "ckpt"


@pytest.fixture(scope="session")
def dcp_zstd_ckpt() -> Path:
    """Same as dcp_ckpt, every item zstd-compressed (transform 'stream.zstd/1')."""
    return _cached("dcp_zstd", lambda d: builders.build_dcp(d / "ckpt", zstd=True)) / "ckpt"


@pytest.fixture(scope="session")
def dcp_safetensors_ckpt() -> Path:
    """DCP HuggingFaceStorageWriter(save_distributed=True) output folder."""
    return _cached("dcp_safetensors", lambda d: builders.build_dcp_safetensors(d / "ckpt")) / "ckpt"


@pytest.fixture(scope="session")
def hf_llama_safetensors() -> Path:
    """Tiny LlamaForCausalLM, save_pretrained -> model-0000i-of-00003.safetensors + index."""
    return (
        _cached(
            "hf_llama_safetensors",
            lambda d: builders.build_hf_llama(d / "ckpt", safe_serialization=True, max_shard_size="200KB"),
        )
        / "ckpt"
    )


@pytest.fixture(scope="session")
def hf_llama_bin() -> Path:
    """Same model as .bin shards (pytorch_model-0000i-of-00003.bin) + pytorch_model.bin.index.json."""
    return (
        _cached(
            "hf_llama_bin",
            lambda d: builders.build_hf_llama(d / "ckpt", safe_serialization=False, max_shard_size="200KB"),
        )
        / "ckpt"
    )


_PICKLE_NAMES = {
    "zip": "state_zip.pt",
    "legacy": "state_legacy.pt",
    "malicious": "malicious.pt",
    "bin": "pytorch_model.bin",
}


def _build_pickles(d: Path) -> None:
    paths = builders.build_torch_pickles(d / "ckpt")
    assert {k: p.name for k, p in paths.items()} == _PICKLE_NAMES, paths


@pytest.fixture(scope="session")
def torch_pickles() -> dict[str, Path]:
    """{"zip","legacy","malicious","bin"} -> torch.save files; ground truth at
    ``<file>.expected.safetensors`` / ``<file>.expected.json`` (not for malicious)."""
    root = _cached("torch_pickles", _build_pickles) / "ckpt"
    return {k: root / v for k, v in _PICKLE_NAMES.items()}


@pytest.fixture(scope="session")
def minilm() -> Path:
    """Folder of the real all-MiniLM-L6-v2 (model.safetensors, config.json, ...)."""
    return builders.minilm_dir()


@pytest.fixture(scope="session")
def dcp_per_rank_ckpt() -> Path:
    """DCP saved with use_collectives=False (per-rank __{rank}.metadata files); tensor "w" is 10x3 over 4 ranks."""
    return _cached("dcp_per_rank", lambda d: builders.build_dcp_per_rank_metadata(d / "ckpt")) / "ckpt"


@pytest.fixture(scope="session")
def dcp_llama_1d(hf_llama_safetensors) -> Path:
    """build_hf_llama's weights saved by DCP on 4 gloo ranks, every tensor Shard(0) on a 1-D mesh, HF names,
    plus objects step=7, schedule.lr, schedule.warmup."""
    return _cached("dcp_llama_1d", lambda d: builders.build_dcp_llama(
        d / "ckpt", weights=builders.expected_paths(hf_llama_safetensors)[0], layout="1d")) / "ckpt"


@pytest.fixture(scope="session")
def dcp_llama_2d(hf_llama_safetensors) -> Path:
    """The same weights by DCP on 2 gloo ranks over 2-D meshes (2,1)/(1,2) mixing Shard/Replicate,
    fqns "model." + HF name, same objects as dcp_llama_1d."""
    return _cached("dcp_llama_2d", lambda d: builders.build_dcp_llama(
        d / "ckpt", weights=builders.expected_paths(hf_llama_safetensors)[0], layout="2d")) / "ckpt"


@pytest.fixture(scope="session")
def viewer_pair() -> tuple[Path, Path]:
    """(a, b) as examples/demo.py builds them, from the real MiniLM: a = DCP on 4 ranks under "model." plus
    builders.viewer_extras(); b = the same under bare names, HF-sharded, with builders.VIEWER_ALTERED applied.
    Open them together with rename ["a:model.="]. Truth of a: ``builders.expected_paths(a)``."""
    root = _cached("viewer_pair", builders.build_viewer_pair)
    return root / "a", root / "b"


@pytest.fixture(scope="session")
def serve():
    """serve(app) -> base URL: runs a real uvicorn server on 127.0.0.1 (port 0) in a thread until the session ends."""
    import threading
    import time

    import uvicorn

    running = []

    def start(app) -> str:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        running.append((server, thread))
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server, _thread in running:
        server.should_exit = True
    for _server, thread in running:
        thread.join(10)


@pytest.fixture(scope="session")
def browser():
    """One headless Debian chromium for the browser tests (their modules skip loudly without it)."""
    from browser_support import CHROMIUM, CHROMIUM_ARGS, sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="session")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small sharded HF folder (index + two safetensors shards), the seed the hostile-input tests mutate."""
    return make_hf_folder(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="session")
def dcp_seed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small DCP checkpoint, the seed the hostile-input tests mutate."""
    return make_dcp_seed(tmp_path_factory.mktemp("dcp") / "ckpt")
