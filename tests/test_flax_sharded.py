"""Sharded Flax checkpoints (`flax_model.msgpack.index.json` + `flax_model-0000k-of-0000n.msgpack`), as transformers'
FlaxPreTrainedModel.save_pretrained(max_shard_size=...) writes them: the checked-in fixture was written by transformers
4.57.1 (tests/fixtures/flax_builders.py says how), with the torch BertModel transformers itself converted from it.
The truth is flax's own msgpack_restore of every shard, merged as transformers' loader merges them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
from fixtures import flax_builders
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensormorph as tm
from tensormorph.errors import CheckpointError, HeaderError, MissingFileError, TensorNotFoundError, UnsafePathError
from tensormorph.formats import flax_msgpack
from tensormorph.ops.rules import as_targets, rule_list

serialization = pytest.importorskip("flax.serialization")
FLAX, TORCH = flax_builders.SHARDED / "flax", flax_builders.SHARDED / "torch"
INDEX = "flax_model.msgpack.index.json"


def restored() -> dict[str, np.ndarray]:
    """Every shard as flax restores it, flattened to dotted names and merged (transformers'
    load_flax_sharded_weights merges `flatten_dict(from_bytes(...), sep="/")` the same way)."""
    merged: dict[str, np.ndarray] = {}

    def flat(tree: dict[str, Any], prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                flat(value, f"{prefix}{key}.")
            else:
                merged[prefix + key] = np.asarray(value)

    for shard in sorted(FLAX.glob("flax_model-*.msgpack")):
        flat(serialization.msgpack_restore(shard.read_bytes()), "")
    return merged


def open_sharded(path: Path) -> tm.Checkpoint:
    ck = tm.open(path)  # detected: hf_sharded leaves *.msgpack.index.json to this reader
    assert ck.format == "flax_msgpack"
    return ck


def copy(tmp_path: Path) -> Path:
    folder = tmp_path / "flax"
    shutil.copytree(FLAX, folder)
    return folder


def test_one_logical_checkpoint_over_the_shards_equals_flax_restore() -> None:
    truth = restored()
    index = json.loads((FLAX / INDEX).read_text())["weight_map"]
    assert len(set(index.values())) == 6 and len(truth) == 39
    assert flax_msgpack.detect(FLAX).found == FLAX / INDEX
    assert flax_msgpack.detect(FLAX / INDEX).found == FLAX / INDEX
    for path in (FLAX, FLAX / INDEX):
        with open_sharded(path) as ck:
            assert ck.format == "flax_msgpack" and len(ck.files) == 6 and sorted(ck) == sorted(truth)
            assert ck.metadata["shards"] == 6 and ck.metadata["index_metadata"] == {"total_size": 78080}
            for name, value in truth.items():
                tensor = ck[name]
                shard = index[name.replace(".", "/")]
                assert tensor.files == (shard,) and tensor.file_shard == (int(shard[11:16]), 6), name
                got = tensor.full()
                assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), name
            assert ck["encoder.layer.1.output.dense.kernel"][3:9, 30:32].tobytes() == \
                truth["encoder.layer.1.output.dense.kernel"][3:9, 30:32].tobytes()


def test_the_built_in_rules_match_transformers_own_flax_to_torch_conversion() -> None:
    with open_sharded(FLAX) as ck:
        report = tm.diff(ck, TORCH, rules="flax-torch")
    assert report.identical and report.counts == {"equal": 39}
    pairs = {t.name_a: t.name_b for t in report.tensors}
    assert pairs["encoder.layer.0.attention.self.query.kernel"] == "encoder.layer.0.attention.self.query.weight"


def test_the_shards_seen_as_the_torch_state_dict_tm_load_fills() -> None:
    """What tm.load(folder, state, rules="flax-torch") reads (ops.rules.as_targets): the torch names and layouts."""
    expected = safetensors.numpy.load_file(str(TORCH / "model.safetensors"))
    with open_sharded(FLAX) as ck:
        view = as_targets(ck, rule_list("flax-torch", None, None), {n: v.ndim for n, v in expected.items()}, [])
        assert view.unmatched == [] and sorted(view.checkpoint.tensors) == sorted(expected)
        for name, tensor in view.checkpoint.tensors.items():
            assert tensor.full().tobytes() == expected[name].tobytes(), name


def test_a_missing_shard_a_misplaced_name_and_a_leaf_in_two_shards(tmp_path: Path) -> None:
    folder = copy(tmp_path)
    (folder / "flax_model-00004-of-00006.msgpack").unlink()
    with pytest.raises(MissingFileError, match=r"flax_model-00004-of-00006\.msgpack.*places \d+ tensor\(s\) in it"):
        open_sharded(folder)
    folder = copy(tmp_path / "2")
    index = json.loads((folder / INDEX).read_text())
    index["weight_map"]["pooler/dense/bias"] = "flax_model-00001-of-00006.msgpack"
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(TensorNotFoundError, match=r"00001-of-00006\.msgpack.*pooler\.dense\.bias.*holds no such"):
        open_sharded(folder)
    folder = copy(tmp_path / "3")
    index = json.loads((folder / INDEX).read_text())
    first = "embeddings/LayerNorm/bias"
    shutil.copy(folder / index["weight_map"][first], folder / "copy.msgpack")
    index["weight_map"][first] = "copy.msgpack"
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(HeaderError, match=r"is in both 'copy.msgpack' and 'flax_model-00001-of-00006.msgpack'"):
        open_sharded(folder)
    index["weight_map"][first] = "../flax/copy.msgpack"
    (folder / INDEX).write_text(json.dumps(index))
    with pytest.raises(UnsafePathError):
        open_sharded(folder)


@settings(max_examples=120, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_indexes_open_or_fail_cleanly(tmp_path: Path, data: st.DataObject) -> None:
    folder = tmp_path / "flax"
    if not folder.exists():
        shutil.copytree(FLAX, folder)
    text = bytearray((FLAX / INDEX).read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text) - 1))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            text[at] = data.draw(st.sampled_from(b'{}[]",:/0123456789-eE .\\nul'))
        elif action == "cut":
            del text[at:at + data.draw(st.integers(1, 64))]
        else:
            text[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    (folder / INDEX).write_bytes(bytes(text))
    try:
        ck = open_sharded(folder)
    except CheckpointError as exc:
        assert "\n" not in str(exc).strip()
    else:
        with ck:
            assert 0 < len(ck) <= 39 and all(t.numel > 0 for t in ck.values())


@settings(max_examples=80, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(weight_map=st.dictionaries(st.text(max_size=12), st.one_of(st.text(max_size=40), st.integers(), st.none()),
                                  max_size=6),
       metadata=st.one_of(st.none(), st.integers(), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)))
def test_forged_weight_maps_fail_cleanly(tmp_path: Path, weight_map: dict[str, Any], metadata: Any) -> None:
    folder = tmp_path / "flax"
    if not folder.exists():
        shutil.copytree(FLAX, folder)
    (folder / INDEX).write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}))
    try:
        ck = open_sharded(folder)
    except CheckpointError as exc:
        assert str(exc)
    else:  # only names that the shards hold, placed where they are
        with ck:
            assert set(ck) >= {k.replace("/", ".") for k in weight_map}
