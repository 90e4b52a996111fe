"""The plan page of the viewer in a real browser: Playwright (Python, sync API) driving Debian's chromium.

A real uvicorn server serves a tiny Llama checkpoint written by save_pretrained; the page plans it
through /api/plan and draws one stacked bar per device. The bars are checked against the library's
own plan, byte for byte and pixel for pixel. Without /usr/bin/chromium or the playwright package
this module is skipped, loudly; no browser is ever downloaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from browser_support import SCREENSHOTS
from playwright.sync_api import expect

import tensormorph as tm
from tensormorph.planner import Workload
from tensormorph.server import create_app

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 20_000  # ms
CONTEXT = 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    path = tmp_path_factory.mktemp("plan-viewer") / "tiny-llama"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def devices(checkpoint) -> list[str]:
    """A big fast card and a small slow one, sized so that the model must be split between them."""
    whole = tm.plan(checkpoint, ["cuda:0=1GiB,tflops=10,bw=100,reserve=0B"], Workload(context=CONTEXT)).devices[0]
    return [f"cuda:0={int(whole.used * 0.8)}B,tflops=20,bw=200,reserve=16KiB",
            f"cuda:1={int(whole.used * 0.7)}B,tflops=10,bw=100,reserve=16KiB"]


@pytest.fixture(scope="module")
def base_url(serve, checkpoint) -> str:
    return serve(create_app([checkpoint]))


@pytest.fixture
def page(browser, base_url):
    context = browser.new_context(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(base_url + "/plan.html")
    page.wait_for_function("document.body.dataset.ready === '1'")
    yield page
    body_error = page.evaluate("document.body.dataset.error || null")
    context.close()
    assert not errors and body_error is None, (errors, body_error)


def plan_in_page(page, devices: list[str], context: int) -> dict:
    runs = int(page.evaluate("document.body.dataset.runs"))
    page.get_by_test_id("devices").fill("\n".join(devices))
    page.get_by_test_id("context").fill(str(context))
    page.get_by_test_id("plan-button").click()
    page.wait_for_function("(n) => Number(document.body.dataset.runs) > n", arg=runs)
    return page.evaluate("JSON.parse(JSON.stringify(window.tensormorphPlan.state))")


def test_each_device_is_a_bar_of_its_weights_cache_activations_reserve_and_free(page, checkpoint, devices):
    state = plan_in_page(page, devices, CONTEXT)
    expected = tm.plan(checkpoint, devices, Workload(context=CONTEXT), link=32)
    assert state["error"] is None
    assert state["plan"] == json.loads(json.dumps(expected.to_dict()))
    assert expected.fits and all(d.units for d in expected.devices)  # both cards hold something
    widest = max(d.device.memory for d in expected.devices)
    expect(page.get_by_test_id("plan-device")).to_have_count(2)
    for row in expected.devices:
        device = page.locator(f"[data-testid=plan-device][data-device='{row.name}']")
        bar = device.get_by_test_id("plan-bar").bounding_box()
        column = device.locator(".detail").bounding_box()["width"]  # the bars' column: the widest device
        assert device.locator(".track").bounding_box()["width"] == pytest.approx(
            column * row.device.memory / widest, abs=1.5)  # sized by memory
        figures = {"weights": row.weights, "kv": row.kv_cache, "act": row.activations, "reserve": row.reserve,
                   "free": row.free}
        for kind, nbytes in figures.items():
            segment = device.locator(f".bar [data-kind={kind}]")
            assert int(segment.get_attribute("data-bytes")) == nbytes, (row.name, kind)
            width = segment.bounding_box()["width"]
            assert width == pytest.approx((bar["width"] - 2) * nbytes / row.device.memory, abs=1.5), (row.name, kind)
        expect(device).to_contain_text(f"layers {row.layer_ranges}")
        if expected.device_map["lm_head"] == row.name:
            expect(device).to_contain_text("lm_head")
    expect(page.get_by_test_id("plan-verdict")).to_have_text("Fits.")
    expect(page.get_by_test_id("plan-bottleneck")).to_contain_text(expected.bottleneck.reason)
    expect(page.get_by_test_id("plan-model")).to_contain_text("tiny-llama")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "plan.png"))


def test_a_device_over_its_memory_is_hatched_and_the_fixes_are_listed(page, checkpoint, devices):
    context = 4 * CONTEXT
    state = plan_in_page(page, devices, context)
    expected = tm.plan(checkpoint, devices, Workload(context=context), link=32)
    assert not expected.fits and state["plan"]["fits"] is False
    for name, over in expected.shortfall.over.items():
        device = page.locator(f"[data-testid=plan-device][data-device='{name}']")
        expect(device.get_by_test_id("plan-bar")).to_have_class(re.compile(r"\bover\b"))
        mark = device.locator(".over-mark")
        assert int(mark.get_attribute("data-bytes")) == over
        expect(device).to_contain_text("over by")
    verdict = page.get_by_test_id("plan-verdict")
    expect(verdict).to_contain_text("Does not fit")
    expect(verdict).to_contain_text(f"a context of at most {expected.shortfall.max_context:,} tokens")


def test_a_bad_device_spec_shows_the_servers_message(page):
    state = plan_in_page(page, ["cuda:0=24GiB,tflops=165"], CONTEXT)
    assert state["plan"] is None
    expect(page.get_by_test_id("plan-verdict")).to_have_text(
        "Cannot plan: device cuda:0: missing bw= (memory bandwidth, GB/s), e.g. cuda:0=24GiB,tflops=165,bw=1000 "
        "(or neither, planning by memory alone)")
    expect(page.get_by_test_id("plan-device")).to_have_count(0)


def test_the_viewer_links_to_the_plan_page(browser, base_url):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT)
    page.goto(base_url + "/")
    page.wait_for_function("document.body.dataset.ready === '1'")
    page.get_by_test_id("plan-link").click()
    page.wait_for_function("document.body.dataset.ready === '1' && !!window.tensormorphPlan")
    assert page.url.endswith("/plan.html")
    expect(page.get_by_test_id("plan-device")).to_have_count(2)  # the form's two example cards
    context.close()


def test_devices_of_unknown_speed_show_no_rates_and_say_so(page, checkpoint, devices):
    by_memory = [",".join(p for p in spec.split(",") if not p.startswith(("tflops=", "bw="))) for spec in devices]
    state = plan_in_page(page, by_memory, CONTEXT)
    expected = tm.plan(checkpoint, by_memory, Workload(context=CONTEXT), link=32)
    assert not expected.speed_known and state["plan"] == json.loads(json.dumps(expected.to_dict()))
    speeds = page.get_by_test_id("plan-speed")
    expect(speeds).to_have_count(2)
    expect(speeds).to_have_text([" · speed unknown", " · speed unknown"])
    expect(page.get_by_test_id("plan-rate")).to_have_text(re.compile(r"^Speed unknown: a device was given by its "
                                                                     r"memory alone"))
    assert "tok/s" not in page.locator("#plan-bars").inner_text() + page.locator("#plan-overall").inner_text()
    assert "–" not in page.locator("#plan-bars").inner_text()
    expect(page.get_by_test_id("plan-bottleneck")).to_have_text(
        "Placed by memory alone: " + expected.bottleneck.reason.split("; ", 1)[1])
    state = plan_in_page(page, devices, CONTEXT)  # speeds again: the rates come back
    expect(page.get_by_test_id("plan-speed").first).to_contain_text("tok/s")
