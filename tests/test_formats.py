"""Every reader against checkpoints written by the real libraries, compared bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fixtures.builders import expected_paths, load_expected

import tensormorph as tm
from tensormorph.errors import BudgetExceededError, CheckpointError, UnsafePickleError, UnsupportedError


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def as_json(value):
    """Tuples become lists, as in the JSON ground truth."""
    return json.loads(json.dumps(value))


def assert_matches_ground_truth(ck: tm.Checkpoint, path: Path, *, objects: bool = True) -> None:
    tensors_file, objects_file = expected_paths(path)
    expected = load_expected(tensors_file)
    assert set(ck) == set(expected)
    for name, value in expected.items():
        tensor = ck[name]
        assert tensor.shape == value.shape and tensor.numpy_dtype == value.dtype, name
        assert same_bits(tensor.full(), value), name
    if objects and objects_file.exists():
        for name, value in json.loads(objects_file.read_text()).items():
            assert as_json(ck.objects[name].value()) == value, name


def test_dcp_four_ranks_bit_exact(dcp_ckpt):
    ck = tm.open(dcp_ckpt)
    assert ck.format == "dcp" and tm.detect(dcp_ckpt) == "dcp"
    assert_matches_ground_truth(ck, dcp_ckpt)
    assert ck["dtensors.fp8"].dtype == "F8_E4M3" and ck["dtensors.w_sr"].dtype == "BF16"
    assert ck["dtensors.w_rs"].dtype == "I64"


def test_dcp_uneven_empty_and_2d_mesh_chunks(dcp_ckpt):
    ck = tm.open(dcp_ckpt)
    uneven = ck["dtensors.uneven"]
    assert [(c.offsets, c.shape) for c in uneven.chunks] == [
        ((0, 0), (3, 3)), ((3, 0), (3, 3)), ((6, 0), (3, 3)), ((9, 0), (1, 3))]
    assert [c.ranks for c in uneven.chunks] == [(0,), (1,), (2,), (3,)]
    assert [c.file for c in uneven.chunks] == [f"__{r}_0.distcp" for r in range(4)]
    tiny = ck["dtensors.tiny"]
    empty = [c for c in tiny.chunks if c.numel == 0]
    assert len(empty) == 1 and empty[0].offsets == (3, 0) and empty[0].shape == (0, 2)
    grid = ck["dtensors.w_ss"]
    assert sorted(c.offsets for c in grid.chunks) == [(0, 0), (0, 3), (4, 0), (4, 3)]
    assert all(c.shape == (4, 3) for c in grid.chunks)
    # a replicated dimension is stored once: [Shard(0), Replicate()] over a 2x2 mesh gives 2 chunks
    assert len(ck["dtensors.w_sr"].chunks) == 2


def test_dcp_local_is_the_rank_chunk(dcp_ckpt):
    ck = tm.open(dcp_ckpt)
    tensor = ck["dtensors.uneven"]
    full = tensor.full()
    assert same_bits(tensor.local(3), full[9:10])
    assert same_bits(tensor.local(1), full[3:6])


def test_dcp_region_read_crosses_chunks(dcp_ckpt):
    ck = tm.open(dcp_ckpt)
    tensor = ck["model.0.weight"]
    full = tensor.full()
    assert same_bits(tensor[2:8, 1:3], full[2:8, 1:3])
    assert same_bits(tensor[::-3, -1], full[::-3, -1])
    assert same_bits(ck["dtensors.w_ss"][3:5, 2:4], ck["dtensors.w_ss"].full()[3:5, 2:4])


def test_dcp_zstd_items_decompress_bit_exact(dcp_zstd_ckpt):
    ck = tm.open(dcp_zstd_ckpt)
    assert_matches_ground_truth(ck, dcp_zstd_ckpt)


def test_dcp_zstd_and_plain_agree(dcp_ckpt, dcp_zstd_ckpt):
    plain, compressed = tm.open(dcp_ckpt), tm.open(dcp_zstd_ckpt)
    for name in plain:
        assert same_bits(plain[name].full(), compressed[name].full()), name


def test_dcp_per_rank_metadata_files_merge(dcp_per_rank_ckpt):
    assert not (dcp_per_rank_ckpt / ".metadata").exists()
    ck = tm.open(dcp_per_rank_ckpt)
    assert ck.metadata["metadata_files"] == [f"__{r}.metadata" for r in range(4)]
    assert [c.shape[0] for c in ck["w"].chunks] == [3, 3, 3, 1]
    assert_matches_ground_truth(ck, dcp_per_rank_ckpt, objects=False)


def test_dcp_missing_data_file_is_named(dcp_ckpt, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(dcp_ckpt, copy)
    (copy / "__2_0.distcp").unlink()
    with pytest.raises(CheckpointError, match="__2_0.distcp"):
        tm.open(copy)


def test_dcp_truncated_data_file_is_reported(dcp_ckpt, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(dcp_ckpt, copy)
    data = copy / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp.*past the end"):
        tm.open(copy)


def test_dcp_safetensors_bit_exact(dcp_safetensors_ckpt):
    ck = tm.open(dcp_safetensors_ckpt)
    assert ck.format == "dcp-safetensors"
    assert_matches_ground_truth(ck, dcp_safetensors_ckpt)
    ranks = sorted({r for t in ck.values() for c in t.chunks for r in c.ranks})
    assert ranks == [0, 1, 2, 3]


def test_dcp_safetensors_missing_trailing_shard_is_a_gap(dcp_safetensors_ckpt, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(dcp_safetensors_ckpt, copy)
    ck = tm.open(copy)
    # remove the files of the rank holding a middle chunk of a sharded tensor: coverage must fail by name
    victim = next(t for t in ck.values() if len([c for c in t.chunks if c.numel]) >= 3)
    middle = sorted((c for c in victim.chunks if c.numel), key=lambda c: c.offsets)[1]
    ck.close()
    (copy / middle.file).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        tm.open(copy)


def test_hf_sharded_safetensors(hf_llama_safetensors):
    ck = tm.open(hf_llama_safetensors)
    assert ck.format == "hf-sharded" and len(ck.files) == 3
    assert_matches_ground_truth(ck, hf_llama_safetensors)
    shards = {t.file_shard for t in ck.values()}
    assert {n for _, n in shards} == {3} and {k for k, _ in shards} == {1, 2, 3}
    assert ck.metadata["total_size"] == sum(t.nbytes for t in ck.values())


def test_hf_sharded_bin(hf_llama_bin):
    ck = tm.open(hf_llama_bin)
    assert ck.format == "hf-sharded" and ck.metadata["index"] == "pytorch_model.bin.index.json"
    assert_matches_ground_truth(ck, hf_llama_bin)


def test_hf_bin_and_safetensors_hold_the_same_model(hf_llama_bin, hf_llama_safetensors):
    a, b = tm.open(hf_llama_bin), tm.open(hf_llama_safetensors)
    assert set(a) == set(b)
    for name in a:
        assert same_bits(a[name].full(), b[name].full()), name


def test_hf_index_naming_a_missing_shard(hf_llama_safetensors, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(hf_llama_safetensors, copy)
    (copy / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        tm.open(copy)


def test_torch_zip_pickle(torch_pickles):
    path = torch_pickles["zip"]
    ck = tm.open(path)
    assert ck.format == "torch"
    assert_matches_ground_truth(ck, path)


def test_torch_bin_state_dict(torch_pickles):
    path = torch_pickles["bin"]
    assert_matches_ground_truth(tm.open(path), path)


def test_torch_legacy_format_is_a_clear_error(torch_pickles):
    with pytest.raises(UnsupportedError, match="legacy"):
        tm.open(torch_pickles["legacy"])


def test_malicious_pickle_is_refused_by_name(torch_pickles):
    with pytest.raises(UnsafePickleError, match=r"posix\.system"):
        tm.open(torch_pickles["malicious"])


def test_real_pretrained_minilm(minilm):
    from safetensors.numpy import load_file

    ck = tm.open(minilm)
    reference = load_file(str(minilm / "model.safetensors"))
    assert ck.format == "safetensors" and set(ck) == set(reference) and len(ck) == 104
    for name, value in reference.items():
        assert same_bits(ck[name].full(), value), name
    assert ck.metadata == {"format": "pt"}
    word = ck["embeddings.word_embeddings.weight"]
    assert word.shape == (30522, 384) and word.nbytes == 30522 * 384 * 4


def test_detection_is_by_content_not_name(minilm, torch_pickles, tmp_path):
    renamed = tmp_path / "weights.data"
    shutil.copyfile(minilm / "model.safetensors", renamed)
    assert tm.detect(renamed) == "safetensors"
    renamed_pickle = tmp_path / "state.anything"
    shutil.copyfile(torch_pickles["zip"], renamed_pickle)
    assert tm.detect(renamed_pickle) == "torch"
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert tm.detect(text) is None
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        tm.open(text)


def test_read_budget_guards_full_reads(minilm):
    ck = tm.open(minilm, read_budget=1 << 20)
    word = ck["embeddings.word_embeddings.weight"]
    with pytest.raises(BudgetExceededError, match="embeddings.word_embeddings.weight"):
        word.full()
    assert word[:10].shape == (10, 384)
    assert same_bits(word.full(force=True)[:10], word[:10])


def test_large_chunks_read_directly_bit_exact(viewer_pair, minilm):
    """Chunks of a megabyte and more are read with pread straight into the result: same bits as the source."""
    from safetensors.numpy import load_file

    dcp_minilm, _ = viewer_pair
    reference = load_file(str(minilm / "model.safetensors"))["embeddings.word_embeddings.weight"]
    tensor = tm.open(dcp_minilm)["model.embeddings.word_embeddings.weight"]
    assert min(c.numel for c in tensor.chunks) * 4 >= 1 << 20  # every chunk takes the direct path
    assert same_bits(tensor.full(), reference)
    assert same_bits(tensor[1000:9000], reference[1000:9000])  # crosses a chunk boundary, rows only
    assert same_bits(tensor[1000:9000, 5:9], reference[1000:9000, 5:9])  # not contiguous: mapped path
