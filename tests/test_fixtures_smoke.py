"""The fixture builders make what they claim, and their ground truth agrees
with what the real libraries read back.  Does not import tensormorph."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from fixtures import builders
from fixtures.builders import expected_paths, load_expected, load_expected_json


def _bytes(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same(got: dict, want: dict):
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype, (k, a.dtype, b.dtype)
        assert tuple(a.shape) == tuple(b.shape), (k, a.shape, b.shape)
        assert torch.equal(_bytes(a), _bytes(b)), k


def _truth(path):
    from safetensors.torch import load_file

    st, js = expected_paths(path)
    return load_file(str(st)), json.loads(js.read_text())


def _check_dcp_roundtrip(ckpt, tmp_path):
    """Ground truth == what DCP's own consolidation (dcp_to_torch_save) yields."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    tensors, plain = _truth(ckpt)
    t_keys = {k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    assert t_keys == set(tensors)
    assert set(md.state_dict_metadata) - t_keys >= set(plain)

    dcp_to_torch_save(str(ckpt), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    flat = {}
    for fqn, path in md.planner_data.items():
        v = full
        for p in path:
            v = v[p]
        flat[fqn] = v
    _assert_same({k: flat[k] for k in tensors}, tensors)
    for k, v in plain.items():
        got = flat[k]
        assert (list(got) if isinstance(got, tuple) else got) == v, k
    return md


def test_dcp(dcp_ckpt, tmp_path):
    names = sorted(p.name for p in dcp_ckpt.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    md = _check_dcp_roundtrip(dcp_ckpt, tmp_path)
    sdm = md.state_dict_metadata
    assert [tuple(c.sizes)[0] for c in sdm["dtensors.uneven"].chunks] == [3, 3, 3, 1]
    assert [tuple(c.offsets)[0] for c in sdm["dtensors.tiny"].chunks] == [0, 1, 2, 3]
    assert sdm["dtensors.fp8"].properties.dtype == torch.float8_e4m3fn
    assert "optim.state.0.weight.exp_avg" in sdm and "model.0.weight" in sdm
    assert all(not getattr(v, "transform_descriptors", None) for v in md.storage_data.values())


def test_dcp_zstd(dcp_zstd_ckpt, tmp_path):
    md = _check_dcp_roundtrip(dcp_zstd_ckpt, tmp_path)
    assert {tuple(v.transform_descriptors) for v in md.storage_data.values()} == {("stream.zstd/1",)}


def test_dcp_safetensors(dcp_safetensors_ckpt):
    from safetensors import safe_open

    files = sorted(p.name for p in dcp_safetensors_ckpt.iterdir())
    assert files == [f"shard-{r:05}-model-{i:05}-of-00002.safetensors" for r in (1, 2, 3, 4) for i in (1, 2)]
    want, _ = _truth(dcp_safetensors_ckpt)
    got = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in want.items()}
    covered = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in want.items()}
    for name in files:
        with safe_open(str(dcp_safetensors_ckpt / name), "pt") as f:
            meta = f.metadata()
            assert meta["DCP_VERSION"] == "1.0" and meta["format"] == "pt"
            info = json.loads(meta["DCP_SHARDING_INFO"])
            names = f.keys()  # safe_open objects are not iterable
            assert set(info) == set(names)
            for k in names:
                t = f.get_tensor(k)
                sl = tuple(slice(o, o + n) for o, n in zip(info[k]["saved_offsets"], t.shape))
                got[k][sl] = t
                covered[k][sl] += 1
    _assert_same(got, want)
    for k, c in covered.items():
        assert bool((c == 1).all()), k  # replicated chunks stored exactly once


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_hf_llama(kind, hf_llama_safetensors, hf_llama_bin):
    ckpt = hf_llama_safetensors if kind == "safetensors" else hf_llama_bin
    index_name = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    index = json.loads((ckpt / index_name).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert all(re.fullmatch(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)", s) for s in shards)
    assert (ckpt / "config.json").is_file()
    want, _ = _truth(ckpt)
    got = {}
    for s in shards:
        if kind == "safetensors":
            from safetensors.torch import load_file

            part = load_file(str(ckpt / s))
        else:
            part = torch.load(ckpt / s, weights_only=True)
        assert all(index["weight_map"][k] == s for k in part)
        got.update(part)
    _assert_same(got, want)


def test_torch_pickles(torch_pickles):
    assert set(torch_pickles) == {"zip", "legacy", "malicious", "bin"}
    for kind in ("zip", "legacy", "bin"):
        p = torch_pickles[kind]
        want, plain = _truth(p)
        tensors, others = builders._flatten_nested(torch.load(p, weights_only=True))
        _assert_same(tensors, want)
        assert json.loads(json.dumps(others)) == plain
    import zipfile

    assert zipfile.is_zipfile(torch_pickles["zip"]) and not zipfile.is_zipfile(torch_pickles["legacy"])
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|global"):
        torch.load(torch_pickles["malicious"], weights_only=True)


def test_load_expected_numpy(torch_pickles):
    import ml_dtypes
    import numpy as np

    arrs = load_expected(expected_paths(torch_pickles["zip"])[0])
    assert arrs["bf16"].dtype == ml_dtypes.bfloat16
    assert arrs["fp8"].dtype == ml_dtypes.float8_e4m3fn
    assert arrs["bool"].dtype == np.bool_
    assert arrs["transposed"].shape == (5, 3)
    from safetensors.torch import load_file

    t = load_file(str(expected_paths(torch_pickles["zip"])[0]))
    np.testing.assert_array_equal(arrs["bf16"].astype(np.float32), t["bf16"].float().numpy())
    np.testing.assert_array_equal(arrs["fp8"].astype(np.float32), t["fp8"].float().numpy())
    assert load_expected_json(expected_paths(torch_pickles["zip"])[1])["meta.str"] == "hello"


def test_minilm(minilm):
    assert (minilm / "config.json").is_file()
    with open(minilm / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    assert any(k.endswith("embeddings.word_embeddings.weight") for k in header)
