"""What Checkpoint, LogicalTensor, DiffReport, Plan and History show in a notebook (`_repr_html_`): real values,
hostile names escaped, and reads bounded."""

from __future__ import annotations

import base64
import io
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import save_file
from transformers import LlamaConfig

import tensormorph as tm
from tensormorph import notebook
from tensormorph.ops.convert import convert
from tensormorph.planner import Workload

pytestmark = pytest.mark.timeout(120)

HOSTILE = "<script>alert(1)</script>"


class _Structure(HTMLParser):
    """Tags and text of an HTML fragment; fails on a <script> element."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []
        self.images: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        assert tag != "script", "a name was not escaped"
        self.tags.append(tag)
        if tag in ("img", "image"):  # an <img>, or the PNG inside an inline SVG
            self.images.append(dict(attrs)["src" if tag == "img" else "href"])

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parsed(html: str) -> _Structure:
    parser = _Structure()
    parser.feed(html)
    parser.close()
    return parser


def _png(src: str) -> np.ndarray:
    assert src.startswith("data:image/png;base64,")
    with Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))) as image:
        return np.asarray(image.convert("RGB"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("notebook")
    rng = np.random.default_rng(3)
    tensors = {f"model.layers.{i}.mlp.w": rng.standard_normal((24, 40)).astype(np.float32) for i in range(4)}
    tensors[HOSTILE] = np.arange(6, dtype=np.float32)
    tensors["model.embed.weight"] = rng.standard_normal((64, 32)).astype(np.float32)
    paths = {"a": base / "a.safetensors", "b": base / "b.safetensors", "sharded": base / "sharded"}
    save_file(tensors, str(paths["a"]))
    changed = dict(tensors)
    changed["model.layers.2.mlp.w"] = tensors["model.layers.2.mlp.w"] * 2
    changed["model.layers.1.mlp.w"] = tensors["model.layers.1.mlp.w"] + np.float32(1e-7)
    del changed["model.embed.weight"]
    save_file(changed, str(paths["b"]))
    convert(paths["a"], paths["sharded"], to="tensormorph", mesh=2, placements=["Shard(0)"])
    return paths


def test_checkpoint_shows_summary_and_folded_tree_with_names_escaped(files):
    with tm.open(files["a"]) as ck:
        html = ck._repr_html_()
    parsed = _parsed(html)
    text = "".join(parsed.text)
    assert "safetensors" in text and "6 tensors" in text and f"{4 * 24 * 40 + 6 + 64 * 32:,} parameters" in text
    assert "0..3 ×4" in text  # the four identical layers fold into one node
    assert HOSTILE in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "<script>" not in html
    assert parsed.tags.count("details") >= 3


def test_tensor_shows_placement_picture_and_exact_statistics(files):
    with tm.open(files["sharded"]) as ck:
        tensor = ck["model.embed.weight"]
        html = tensor._repr_html_()
        expected = tm.heatmap(tensor, size=notebook.PREVIEW_SIZE, exact=False)
    parsed = _parsed(html)
    text = " ".join(parsed.text)
    values = np.asarray(tm.open(files["a"])["model.embed.weight"].full(), np.float64)
    assert "64×32" in text and "F32" in text and "mesh(d0=2) [Shard(0)]" in text and "2 chunks" in text
    assert f"min {values.min():.6g}" in text and f"max {values.max():.6g}" in text
    assert f"mean {values.mean():.6g}" in text and "0 NaN" in text
    [src] = parsed.images
    np.testing.assert_array_equal(_png(src), expected.pixels)
    assert _png(src).shape == (128, 64, 3)  # 64 rows × 32 columns, each element 2 × 2 pixels within 256 × 128


def test_tensor_reads_are_bounded(files, monkeypatch):
    """Above STATS_READ_BYTES the statistics are the preview sample's, and say so; above PREVIEW_READ_BYTES nothing
    is drawn at all."""
    with tm.open(files["a"]) as ck:
        tensor = ck["model.layers.0.mlp.w"]
        monkeypatch.setattr(notebook, "STATS_READ_BYTES", 1024)
        monkeypatch.setattr(notebook, "PREVIEW_SIZE", (20, 12))  # 24 × 40 sampled every 2nd row and column
        text = " ".join(_parsed(tensor._repr_html_()).text)
        sample = np.asarray(ck["model.layers.0.mlp.w"].full(), np.float64)[::2, ::2]
        assert f"min {sample.min():.6g}" in text and f"max {sample.max():.6g}" in text
        assert f"strided sample of {sample.size:,} elements" in text
        monkeypatch.setattr(notebook, "PREVIEW_READ_BYTES", 64)
        html = tensor._repr_html_()
        assert "<img" not in html and "no picture: its sample would read about" in html
        assert "not computed" in html
        monkeypatch.setattr(notebook, "_pillow", lambda: False)
        assert "no picture: pip install 'tensormorph[pictures]'" in tensor._repr_html_()


def test_diff_report_is_a_table_worst_first(files):
    report = tm.diff(files["a"], files["b"], atol=1e-6)
    html = report._repr_html_()
    parsed = _parsed(html)
    rows = re.findall(r"<tr><td class='l'>(.*?)</td><td class='l'><span class='\w*'>(\w+)</span>", html)
    assert [status for _, status in rows] == ["different", "only_a", "close", "equal", "equal", "equal"]
    assert rows[0][0] == "model.layers.2.mlp.w" and rows[1][0] == "model.embed.weight"
    assert ("&lt;script&gt;alert(1)&lt;/script&gt;", "equal") in rows
    worst = next(t for t in report.tensors if t.status == "different")
    assert f"{worst.max_abs:.6g}" in "".join(parsed.text) and "different" in "".join(parsed.text)


def test_plan_shows_a_bar_per_device():
    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=1000)
    plan = tm.plan(config, ["cuda:0=2GiB,tflops=100,bw=900,reserve=0B", "cuda:1=6MiB,tflops=30,bw=300,reserve=0B"],
                   Workload(context=2048))
    html = plan._repr_html_()
    parsed = _parsed(html)
    assert parsed.tags.count("div") >= 2 and "cuda:0" in parsed.text and "cuda:1" in parsed.text
    for row in plan.devices:
        whole = max(row.device.memory, row.used)
        assert f"width:{100 * row.weights / whole:.2f}%" in html and f"width:{100 * row.kv_cache / whole:.2f}%" in html
    assert ("fits" in html) and f"{plan.decode_tokens_per_s:,.1f} tokens/s" in html


def test_history_table_and_drift_picture(tmp_path):
    rng = np.random.default_rng(9)
    run = tmp_path / "run"
    run.mkdir()
    w = rng.standard_normal((8, 8)).astype(np.float32)
    saved = []
    for step in (1, 2, 3):
        w = w + np.float32(0.1) * rng.standard_normal(w.shape).astype(np.float32)
        saved.append(w.astype(np.float64))
        save_file({"layers.0.w": w, HOSTILE: w[0]}, str(run / f"ckpt-{step}.safetensors"))
    result = tm.history(run, cache=False)
    html = result._repr_html_()
    parsed = _parsed(html)
    text = " ".join(parsed.text)
    assert "3 checkpoint(s)" in text and text.count("committed") == 3
    total = np.linalg.norm(saved[2] - saved[1]) / np.linalg.norm(saved[1])
    assert f"{result.checkpoints[2].total_drift:.6g}" in text
    assert result.checkpoints[2].total_drift == pytest.approx(
        np.sqrt(np.sum((saved[2] - saved[1]) ** 2) + np.sum((saved[2][0] - saved[1][0]) ** 2))
        / np.sqrt(np.sum(saved[1] ** 2) + np.sum(saved[1][0] ** 2)), rel=1e-9)
    assert total > 0 and "<script>" not in html
    assert "<svg" in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # the layer labels, escaped
    assert {"1", "2", "3"} <= set(parsed.text)  # the steps along the bottom
    [src] = parsed.images
    np.testing.assert_array_equal(_png(src), tm.pictures.drift_heatmap(result, size=notebook.DRIFT_PICTURE_SIZE)
                                  .pixels)
