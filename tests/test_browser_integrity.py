"""The integrity panel and the Plan page (issue 20): a Tensormorph checkpoint with rs(3,1) parity and one parity
file removed shows every file with its size and CRC-32C, the stripe and that it is still recoverable, and a
verify that streams its problems; a folder holding only a config.json opens the Plan page; an encoder-only
model is planned as one forward pass (no KV cache, no decoding).

Checkpoints are made here (tm.convert) and served by real uvicorn servers; the BERT encoder is the
viewer_pair of test_browser.py. Screenshots go to build/screenshots/.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from browser_support import write_safetensors
from playwright.sync_api import expect
from test_browser import READY, TIMEOUT, screenshot
from test_browser_view import open_page

import tensormorph as tm
from tensormorph.server import create_app

pytestmark = pytest.mark.timeout(120)

PARITY = "parity-00000-0.bin"
DATA = [f"rank-{r:05d}.safetensors" for r in range(3)]
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
         "torch_dtype": "bfloat16", "max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """An rs(3,1) checkpoint on 3 ranks, its one parity file removed (recoverable: the data files are whole)."""
    root = tmp_path_factory.mktemp("rs31")
    tensors = {"layers.0.weight": np.arange(96 * 16, dtype=np.float32).reshape(96, 16), "bias": np.ones(30, np.float32)}
    source = write_safetensors(root / "src", tensors)
    out = root / "ck"
    tm.convert(source / "model.safetensors", out, to="tensormorph", mesh=3, placements=["Shard(0)"],
               redundancy="rs(3,1)")
    (out / PARITY).unlink()
    return out


def test_integrity_panel_on_rs31_with_a_parity_file_removed(browser, serve, damaged, tmp_path):
    manifest = json.loads((damaged / "manifest.json").read_text())["body"]
    assert manifest["redundancy"]["scheme"] == "rs(3,1)"
    page, errors = open_page(browser, serve(create_app([damaged], cache_dir=tmp_path)) + "/")
    try:
        panel = page.get_by_test_id("integrity")
        expect(panel).to_have_attribute("data-state", "ready")
        expect(page.get_by_test_id("redundancy")).to_have_text("rs(3,1)")
        expect(page.get_by_test_id("integrity-verdict")).to_contain_text("1 file damaged: recoverable")
        files = page.get_by_test_id("files")
        expect(files.locator(f'tr[data-file="{PARITY}"]')).to_have_attribute("data-status", "missing")
        for name in DATA:  # the data files: present, their size and CRC-32C as the manifest records them
            row = files.locator(f'tr[data-file="{name}"]')
            expect(row).to_have_attribute("data-status", "ok")
            expect(row).to_contain_text(manifest["files"][name]["crc32c"])
        expect(files.locator("tr[data-file]")).to_have_count(1 + len(DATA) + 1)  # manifest, data, parity
        stripe = page.get_by_test_id("stripes").locator('[data-stripe="0"]')
        expect(stripe).to_contain_text("3 data + 1 parity files")
        expect(stripe).to_contain_text("1 damaged, recoverable")
        screenshot(page, "integrity.png")
        page.get_by_test_id("verify-button").click()
        verify = page.get_by_test_id("verify")
        expect(verify).to_have_attribute("data-state", "problems")
        problems = page.get_by_test_id("verify-problems").locator("li")
        expect(problems.filter(has_text=PARITY)).to_have_count(1)
        expect(page.get_by_test_id("verify-progress")).to_contain_text(re.compile(r"^1 problem"))
        screenshot(page, "integrity-verify.png")
    finally:
        page.context.close()
    assert not errors


def plan_page(browser, url: str):
    context = browser.new_context(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    return page, errors


def test_plan_page_opens_a_config_only_folder(browser, serve, tmp_path):
    folder = tmp_path / "Llama-3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    page, errors = plan_page(browser, serve(create_app([folder], cache_dir=tmp_path / "tiles")) + "/")
    try:
        page.wait_for_url(re.compile(r"/plan\.html"))  # the viewer has no tensors to show: it hands over
        page.wait_for_function(READY)
        expect(page.get_by_test_id("plan-device")).to_have_count(2)
        expect(page.get_by_test_id("plan-kind")).to_have_text("decoder")
        expect(page.get_by_test_id("plan-model")).to_contain_text("from config.json")
        expect(page.get_by_test_id("plan-model")).to_contain_text("8.03B params")
        expect(page.get_by_test_id("plan-what")).to_contain_text("KV cache")
        expect(page.get_by_test_id("plan-overall")).to_contain_text("decode")
        expect(page.locator("#viewer-link")).to_be_hidden()
        screenshot(page, "plan-config-only.png")
        # an error in human units: a device far too small
        page.get_by_test_id("devices").fill("cuda:0=2GiB,tflops=165,bw=1000")
        page.get_by_test_id("plan-button").click()
        verdict = page.get_by_test_id("plan-verdict")
        expect(verdict).to_contain_text("GiB")
        assert not re.search(r"\d{7,}", verdict.inner_text()), verdict.inner_text()
    finally:
        page.context.close()
    assert not errors


def test_plan_page_on_an_encoder_only_model(browser, serve, viewer_pair, tmp_path):
    page, errors = plan_page(browser, serve(create_app([viewer_pair[0]], cache_dir=tmp_path)) + "/plan.html")
    try:
        page.wait_for_function(READY)
        expect(page.get_by_test_id("plan-kind")).to_have_text("encoder-only")
        expect(page.get_by_test_id("plan-model")).not_to_contain_text("null")
        expect(page.get_by_test_id("plan-what")).to_contain_text("no KV cache")
        overall = page.get_by_test_id("plan-overall")
        expect(overall).to_contain_text("one forward pass")
        expect(overall).not_to_contain_text("decode")
        for device in page.get_by_test_id("plan-device").all():
            assert "decode" not in device.inner_text()
            assert device.locator(".seg.kv").get_attribute("data-bytes") == "0"
        expect(page.locator(".kv-legend")).to_be_hidden()
        expect(page.get_by_test_id("optimize")).to_be_disabled()
        screenshot(page, "plan-encoder.png")
    finally:
        page.context.close()
    assert not errors
