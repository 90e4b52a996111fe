"""`tm.load` with rules: a Flax checkpoint's names and layouts loaded into transformers' torch BertModel through the
rules diff uses (ops/rules.py).

The Flax side is written by the real flax (and orbax), the torch side by transformers' BertModel holding the same
values, moved by hand with numpy transposes (tests/fixtures/flax_builders), never by Tensormorph."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch
import torch.multiprocessing as tmp
from dist_workers import init
from fixtures import flax_builders
from fixtures.cache import cached_build

import tensormorph as tm
from tensormorph.errors import CheckpointError, StateMismatchError

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def built() -> Path:
    return cached_build("flax", flax_builders, flax_builders.build)


def bert() -> torch.nn.Module:
    torch.manual_seed(0)  # a fresh model: its random values are all overwritten, checked below
    return transformers.BertModel(transformers.BertConfig(**flax_builders.CONFIG))


def assert_holds(state: dict[str, torch.Tensor], expected: dict[str, np.ndarray]) -> None:
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        got = state[name].detach().numpy()
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert got.tobytes() == value.tobytes(), name  # bit-exact


@pytest.mark.parametrize("source", ["bert.msgpack", "orbax"])
def test_flax_params_load_into_transformers_bert_bit_exact(built: Path, source: str) -> None:
    expected = safetensors.numpy.load_file(str(built / "torch" / "model.safetensors"))
    model = bert()
    state = model.state_dict()
    assert any(state[n].numpy().tobytes() != v.tobytes() for n, v in expected.items())  # not the values yet
    report = tm.load(built / source, state, rules="flax-torch")
    assert report.tensors_loaded == 39 and not (report.missing or report.unexpected or report.mismatched)
    assert report.bytes_read == sum(v.nbytes for v in expected.values())
    assert_holds(model.state_dict(), expected)


def test_strict_mode_names_missing_and_unexpected_with_their_aligned_names(built: Path) -> None:
    model = transformers.BertModel(transformers.BertConfig(**flax_builders.CONFIG), add_pooling_layer=False)
    state = model.state_dict()
    before = {n: t.clone() for n, t in state.items()}
    with pytest.raises(StateMismatchError) as caught:
        tm.load(built / "bert.msgpack", state, rules="flax-torch")
    message = str(caught.value)
    assert "2 not in the state dict: params.pooler.dense.kernel (as pooler.dense.weight), params.pooler.dense.bias " \
           "(as pooler.dense.bias)" in message
    assert "bert.msgpack" in message and "missing" not in message
    assert all(torch.equal(before[n], t) for n, t in state.items())  # nothing was loaded
    report = tm.load(built / "bert.msgpack", state, rules="flax-torch", strict=False)
    assert report.tensors_loaded == 37 and report.missing == []
    assert sorted(report.unexpected) == ["params.pooler.dense.bias (as pooler.dense.bias)",
                                         "params.pooler.dense.kernel (as pooler.dense.weight)"]
    expected = safetensors.numpy.load_file(str(built / "torch" / "model.safetensors"))
    assert_holds(model.state_dict(), {n: v for n, v in expected.items() if not n.startswith("pooler.")})


def test_a_model_with_a_head_reports_missing_and_takes_a_rename(built: Path) -> None:
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**flax_builders.CONFIG))
    with pytest.raises(StateMismatchError, match=r"41 missing from the checkpoint: bert\.embeddings\.") as caught:
        tm.load(built / "bert.msgpack", model.state_dict(), rules="flax-torch")  # the base model's prefix differs
    assert {"classifier.weight", "classifier.bias"} < set(caught.value.missing)
    assert "params.pooler.dense.kernel (as pooler.dense.weight)" in caught.value.unexpected
    report = tm.load(built / "bert.msgpack", model.state_dict(), rules="flax-torch", rename=["b:bert.="],
                     strict=False)
    assert report.tensors_loaded == 39 and report.missing == ["classifier.weight", "classifier.bias"]
    expected = safetensors.numpy.load_file(str(built / "torch" / "model.safetensors"))
    state = model.state_dict()
    assert_holds({n: state["bert." + n] for n in expected}, expected)


def test_transpose_rules_on_either_side_and_shape_mismatches(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    kernel, conv = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((2, 2, 3, 5)).astype(np.float32)
    safetensors.numpy.save_file({"dense.kernel": kernel, "conv.kernel": conv}, str(tmp_path / "a.safetensors"))
    linear, conv2d = torch.nn.Linear(3, 4), torch.nn.Conv2d(3, 5, 2)
    state = {"dense.weight": linear.weight, "conv.weight": conv2d.weight}
    tm.load(tmp_path / "a.safetensors", state, rules="flax-torch")
    assert linear.weight.detach().numpy().tobytes() == kernel.T.copy().tobytes()
    assert conv2d.weight.detach().numpy().tobytes() == conv.transpose(3, 2, 0, 1).copy().tobytes()
    # a transpose on side b (the state dict) is undone on the way in: b's weight seen transposed is a's kernel
    other = torch.nn.Linear(3, 4)
    tm.load(tmp_path / "a.safetensors", {"dense.weight": other.weight}, rename=["a:re:kernel$=weight"],
            transpose=["b:dense.weight"], strict=False)
    assert other.weight.detach().numpy().tobytes() == kernel.T.copy().tobytes()
    with pytest.raises(StateMismatchError, match=r"dense.weight: shape \[3, 4\] in the checkpoint, \[4, 3\]"):
        tm.load(tmp_path / "a.safetensors", {"dense.weight": other.weight}, rename=["a:re:kernel$=weight"])


def test_rules_that_send_two_state_dict_names_to_one_are_an_error(tmp_path: Path) -> None:
    safetensors.numpy.save_file({"x": np.ones(2, np.float32)}, str(tmp_path / "a.safetensors"))
    with pytest.raises(CheckpointError, match="map both 'a.x' and 'b.x' of the state dict to 'x'"):
        tm.load(tmp_path / "a.safetensors", {"a.x": torch.zeros(2), "b.x": torch.zeros(2)}, rename=["b:re:^.\\.="])
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"rename": "b:re:^w$=x"}]))
    target = torch.zeros(2)
    assert tm.load(tmp_path / "a.safetensors", {"w": target}, rules=str(rules)).tensors_loaded == 1
    assert target.tolist() == [1.0, 1.0]


def _dtensor_worker(rank: int, port: int, out: str, world: int, source: str, torch_file: str) -> None:
    """Each rank loads the Flax kernels, transposed by the rules, into torch weights sharded over 2 ranks (Shard(0)
    and Shard(1)); its local shards must equal the torch truth's matching boxes."""
    from torch.distributed.tensor import Shard, distribute_tensor

    init(rank, world, port)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    truth = {n: torch.from_numpy(v) for n, v in safetensors.numpy.load_file(torch_file).items()}
    state = {n: distribute_tensor(torch.zeros_like(v), mesh, [Shard(k % v.dim())]) for k, (n, v) in
             enumerate(truth.items())}
    report = tm.load(source, state, rules="flax-torch")
    equal = {}
    for name, tensor in state.items():
        chunk = tensor.__create_chunk_list__()[0]
        box = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
        equal[name] = bool(torch.equal(tensor.to_local(), truth[name][box])) and tensor.to_local().numel() > 0
    Path(out, f"result-{rank}.json").write_text(json.dumps({"equal": equal, "loaded": report.tensors_loaded,
                                                             "needed": report.bytes_needed}))
    torch.distributed.destroy_process_group()


def test_dtensor_shards_on_two_ranks_read_their_boxes_through_the_transpose(built: Path, tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch_file = str(built / "torch" / "model.safetensors")
    tmp.spawn(_dtensor_worker, args=(port, str(tmp_path), 2, str(built / "orbax"), torch_file), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    total = sum(v.nbytes for v in safetensors.numpy.load_file(torch_file).values())
    for record in results:
        assert record["loaded"] == 39 and len(record["equal"]) == 39 and all(record["equal"].values()), record
    assert sum(r["needed"] for r in results) == total  # each rank read only its own half
