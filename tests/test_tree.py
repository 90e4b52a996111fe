"""The module tree: totals and folding of repeated blocks, on real checkpoints."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import save_file

import tensormorph as tm
from tensormorph.ops.tree import module_tree


def test_minilm_layers_fold_into_one_node(minilm):
    ck = tm.open(minilm)
    root = module_tree(ck.values())
    assert root.params == sum(t.numel for t in ck.values()) and root.nbytes == ck.nbytes
    layers = root.children["encoder"].children["layer"]
    (folded,) = layers.children.values()
    assert folded.name == "0..5" and folded.repeat == 6 and folded.path == "encoder.layer.0"
    one_layer = sum(t.numel for n, t in ck.items() if n.startswith("encoder.layer.0."))
    assert folded.params == 6 * one_layer
    assert folded.children["attention"].params == sum(
        t.numel for n, t in ck.items() if n.startswith("encoder.layer.0.attention."))
    assert root.dtypes == {"F32": ck.nbytes - 4096, "I64": 4096}  # position_ids is the one int64 buffer


def test_unfolded_tree_keeps_every_layer(minilm):
    root = module_tree(tm.open(minilm).values(), fold=False)
    assert list(root.children["encoder"].children["layer"].children) == [str(i) for i in range(6)]


def test_a_different_layer_breaks_the_run(tmp_path):
    tensors = {f"layers.{i}.w": np.zeros((4, 4), np.float32) for i in range(5)}
    tensors["layers.2.w"] = np.zeros((4, 8), np.float32)  # layer 2 differs in shape
    tensors["layers.4.w"] = np.zeros((4, 4), np.float16)  # layer 4 differs in dtype
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layers = module_tree(tm.open(tmp_path).values()).children["layers"]
    assert [(n.name, n.repeat) for n in layers.children.values()] == [("0..1", 2), ("2", 1), ("3", 1), ("4", 1)]
    assert layers.children["0..1"].nbytes == 2 * 64 and layers.dtypes == {"F32": 64 * 4 + 128 - 64, "F16": 32}


def test_sharding_and_file_badges(dcp_ckpt, hf_llama_safetensors):
    dcp = module_tree(tm.open(dcp_ckpt).values())
    assert dcp.children["dtensors"].placement_sharded and not dcp.children["plain"].placement_sharded
    hf = module_tree(tm.open(hf_llama_safetensors).values())
    assert hf.multi_file is False  # each tensor lives in exactly one file
    assert hf.children["model"].children["layers"].children["0..1"].repeat == 2
