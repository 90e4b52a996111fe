"""`tensormorph measure` (issue 19): a plan run on real processes, one per stage, with the real transformers model.

The model is the tiny LlamaForCausalLM of builders.build_hf_llama (save_pretrained, seeded, cached). Two stages run on
the CPU as gloo ranks; the reference is transformers' own `generate` of the whole model in this process.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from starlette.testclient import TestClient

from tensormorph.cli.measure import measure_command
from tensormorph.planner import PlanError, Workload, measure, plan
from tensormorph.server import create_app
from tensormorph.server_measure import MEASURE_MAX_PROMPT_TOKENS, MEASURE_ROUTES

# 400 KiB each, no reserve: the tiny Llama (546 KiB of fp32 weights) must be split over both
DEVICES = ["cuda:0=400KiB,tflops=0.05,bw=5,reserve=0B", "cuda:1=400KiB,tflops=0.05,bw=5,reserve=0B"]
PROMPT, NEW = 16, 4


def _reference(folder, prompt, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(logits per step, tokens) of transformers' greedy generate over the whole model, on one thread."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa", dtype=torch.float32).eval()
        ids = torch.tensor(prompt)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    finally:
        torch.set_num_threads(threads)
    return torch.stack(out.logits).numpy(), out.sequences[:, ids.shape[1]:].numpy()


@pytest.fixture(scope="module")
def measured(hf_llama_safetensors):
    return measure(hf_llama_safetensors, DEVICES, Workload(context=PROMPT + NEW), prompt_tokens=PROMPT,
                   new_tokens=NEW, threads=1)


def test_stage_split_is_the_plans(measured, hf_llama_safetensors):
    p = plan(hf_llama_safetensors, DEVICES, Workload(context=PROMPT + NEW))
    held = [row for row in p.devices if row.units]
    assert len(held) == 2, "the devices are too small for one to hold the model"
    assert [s.device for s in measured.stages] == [row.name for row in held]
    for stage, row in zip(measured.stages, held):
        assert stage.modules == row.units
        # what the stage process read and held, against the plan's bytes: fp32 tensors, no tie in this model
        assert stage.tensors == sum(len(u.tensors) for u in p.model.units if u.name in row.units)
        assert stage.tensor_bytes == row.weights
        here = torch.cuda.is_available() and int(stage.device[-1]) < torch.cuda.device_count()
        assert stage.ran_on == (stage.device if here else "cpu")


def test_staged_logits_equal_the_whole_model(measured, hf_llama_safetensors):
    logits, tokens = _reference(hf_llama_safetensors, measured.prompt, NEW + 1)
    assert measured.logits.shape == (NEW + 1, 1, 512)
    # bit-exact: each stage runs the very ops of the whole model in the same order, in fp32 on one thread
    np.testing.assert_array_equal(measured.logits, logits)
    assert measured.tokens == tuple(tuple(int(t) for t in row) for row in tokens)


def test_timings_are_positive_and_add_up(measured, hf_llama_safetensors):
    walls = measured.phase_wall_s
    assert walls["prefill"] == pytest.approx(measured.prefill_s) and measured.prefill_s > 0
    assert measured.decode_step_s > 0
    for stage in measured.stages:
        for phase, steps in (("prefill", 1), ("decode", NEW)):
            t = stage.phase(phase)
            assert t.compute_s > 0 and t.transfer_s >= 0 and t.idle_s >= 0 and t.send_s >= 0
            # one process's intervals are disjoint and lie within its phase's span
            assert (t.compute_s + t.transfer_s + t.idle_s + t.send_s) * steps <= walls[phase] * (1 + 1e-9)
            assert t.ratio is not None and math.isfinite(t.ratio) and t.ratio > 0
    first, second = measured.stages
    assert first.prefill.transfer_s == 0 and first.prefill.idle_s == 0  # the prompt is its own: nothing received
    assert second.prefill.transfer_s + second.prefill.idle_s > 0  # it waited for the first stage's activations
    assert first.decode.transfer_s + first.decode.idle_s > 0  # each next token comes back from the head
    # the predictions are the plan's own rows for this split at the measured workload
    at_prompt = plan(hf_llama_safetensors, DEVICES, Workload(context=PROMPT), device_map=measured.plan.device_map)
    at_end = plan(hf_llama_safetensors, DEVICES, Workload(context=PROMPT + NEW), device_map=measured.plan.device_map)
    for stage in measured.stages:
        assert stage.prefill.predicted_compute_s == at_prompt.usage(stage.device).prefill_s > 0
        assert stage.decode.predicted_transfer_s == at_end.usage(stage.device).decode_handoff_s
    assert measured.predicted_prefill_s == at_prompt.prefill_time_s
    assert measured.predicted_decode_step_s == at_end.decode_step_s


def test_memory_is_measured(measured):
    kv_layer = 2 * 32 * (PROMPT + NEW) * 4  # K and V, 2 KV heads × 16, every token of the run, fp32
    for stage in measured.stages:
        assert stage.kv_cache_bytes == stage.predicted.kv_cache == kv_layer  # one layer per stage
        assert stage.rss_before > 50 << 20  # torch and transformers are loaded
        assert stage.rss_growth > 0
        assert stage.accelerator_peak is None
    d = json.loads(json.dumps(measured.to_dict()))
    assert [s["tensor_bytes"] for s in d["stages"]] == [s.tensor_bytes for s in measured.stages]
    assert d["stages"][1]["prefill"]["ratio"] == measured.stages[1].prefill.ratio
    assert d["overall"]["decode_ratio"] == measured.decode_step_s / measured.predicted_decode_step_s


def test_chunked_prefill_of_two_sequences(hf_llama_safetensors):
    devices = [d.split(",tflops")[0] + ",reserve=0B" for d in DEVICES]  # memory alone: no predicted times
    m = measure(hf_llama_safetensors, devices, Workload(context=20, batch=2, prefill_chunk=5), prompt_tokens=PROMPT,
                new_tokens=NEW, seed=3, threads=1)
    assert m.prefill_chunk == 5 and len(m.prompt) == 2
    logits, tokens = _reference(hf_llama_safetensors, m.prompt, NEW + 1)
    # not bit-exact: chunks sum each query's attention over other blocks than one pass over the prompt does
    np.testing.assert_allclose(m.logits, logits, rtol=0, atol=1e-5)
    assert m.tokens == tuple(tuple(int(t) for t in row) for row in tokens)
    assert all(s.prefill.ratio is None and s.decode.predicted_stage_s is None for s in m.stages)
    assert m.predicted_prefill_s is None and m.to_dict()["overall"]["prefill_ratio"] is None


def test_tied_head_on_the_first_device_of_three(tmp_path):
    """A given map: the embedding and the tied head on cuda:0, whose process runs the first and the last segment;
    norm and head receive only the prompt's last position."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                 num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
                     ).save_pretrained(tmp_path)
    device_map = {"model.embed_tokens": "cuda:0", "model.norm": "cuda:0", "lm_head": "cuda:0",
                  "model.layers.0": "cuda:1", "model.layers.1": "cuda:2", "model.layers.2": "cuda:2"}
    devices = [f"cuda:{i}=2GiB,tflops=0.05,bw=5" for i in range(3)]
    m = measure(tmp_path, devices, Workload(context=24, prefill_chunk=4), device_map=device_map, prompt_tokens=10,
                new_tokens=3, threads=1)
    assert [s.modules for s in m.stages] == [("model.embed_tokens", "model.norm", "lm_head"), ("model.layers.0",),
                                             ("model.layers.1", "model.layers.2")]
    assert m.stages[0].tensors == 2  # the embedding and the final norm: the head is the embedding
    assert [s.tensor_bytes for s in m.stages] == [s.predicted.weights for s in m.stages]
    logits, tokens = _reference(tmp_path, m.prompt, 4)
    np.testing.assert_allclose(m.logits, logits, rtol=0, atol=1e-5)  # chunked prefill, as above
    assert m.tokens == tuple(tuple(int(t) for t in row) for row in tokens)
    assert m.stages[0].decode.idle_s > 0  # waits for the other two stages every step


@pytest.mark.parametrize(("devices", "workload", "match"), [
    (["cuda:0=0GiB,tflops=1,bw=1", DEVICES[1]], None, "memory must be positive"),
    (["cuda:0=64KiB,reserve=0B", "cuda:1=64KiB,reserve=0B"], None, "cannot fit .* at any context"),
    (DEVICES, Workload(context=4096), r"the plan does not fit \(cuda:\d over by .*measure runs only a plan that fits"),
    (DEVICES, Workload(context=20, cache_dtype="fp8"), "keeps the KV cache in the activations' dtype"),
])
def test_refuses_what_it_cannot_run(hf_llama_safetensors, devices, workload, match):
    with pytest.raises(PlanError, match=match):
        measure(hf_llama_safetensors, devices, workload, prompt_tokens=4, new_tokens=1)


def test_refuses_other_sources(hf_llama_safetensors, hf_llama_bin, tmp_path):
    (tmp_path / "config.json").write_text((hf_llama_safetensors / "config.json").read_text())
    for source in (tmp_path, hf_llama_bin, tmp_path / "absent"):  # config alone, .bin shards, nothing
        with pytest.raises(PlanError, match="from a Hugging Face folder with config.json and \\*.safetensors"):
            measure(source, DEVICES)
    with pytest.raises(PlanError, match="measure runs pipeline plans"):
        measure(hf_llama_safetensors, DEVICES, strategy="tensor")
    with pytest.raises(PlanError, match="over the 1.0 KiB measure may run here"):
        measure(hf_llama_safetensors, DEVICES, max_bytes=1024)


def test_cli_json_and_table(hf_llama_safetensors):
    args = [str(hf_llama_safetensors), *(x for d in DEVICES for x in ("--device", d)), "--prompt-tokens", "8",
            "--new-tokens", "2", "--threads", "1"]
    result = CliRunner().invoke(measure_command, [*args, "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert [s["device"] for s in d["stages"]] == ["cuda:0", "cuda:1"] and len(d["tokens"][0]) == 3
    table = CliRunner().invoke(measure_command, args)
    assert table.exit_code == 0, table.output
    assert "prefill (the whole prompt)" in table.output and "decode (per step)" in table.output
    assert "272.5 KiB" in table.output  # the first stage's tensors, held and predicted
    bad = CliRunner().invoke(measure_command, [str(hf_llama_safetensors), "--device", "cuda:0=0GiB"])
    assert bad.exit_code == 2 and "memory must be positive" in bad.output


def _app(folder):
    app = create_app([folder])
    assert {path for path, *_ in MEASURE_ROUTES} <= {getattr(r, "path", None) for r in app.router.routes}
    return app


def test_server_route(hf_llama_safetensors):
    query = [("device", d) for d in DEVICES]
    with TestClient(_app(hf_llama_safetensors)) as client:
        ok = client.post("/api/plan/measure", params=[*query, ("prompt_tokens", "8"), ("new_tokens", "2"),
                                                      ("ck", "a")])
        assert ok.status_code == 200, ok.text
        body = ok.json()
        assert [s["modules"] for s in body["stages"]] == [list(r["modules"]) for r in body["plan"]["devices"]]
        assert body["prompt_tokens"] == 8 and body["stages"][0]["prefill"]["predicted_stage_s"] > 0
        over = client.post("/api/plan/measure", params=[*query, ("prompt_tokens", str(MEASURE_MAX_PROMPT_TOKENS + 1))])
        assert over.status_code == 400 and "over the viewer's limit" in over.json()["error"]
        tensor = client.post("/api/plan/measure", params=[*query, ("strategy", "tensor")])
        assert tensor.status_code == 400 and "pipeline" in tensor.json()["error"]
        assert client.post("/api/plan/measure").status_code == 400
        assert client.get("/api/plan/measure", params=query).status_code in (404, 405)  # POST only: it runs a model


def test_plan_page_measure_button(hf_llama_safetensors, serve, browser):
    """The Plan page's Measure button: each device's row shows what its stage measured beside the prediction."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(serve(_app(hf_llama_safetensors)) + "/plan.html")
    page.wait_for_function("document.body.dataset.ready === '1'")
    page.get_by_test_id("devices").fill("\n".join(DEVICES))
    page.get_by_test_id("context").fill(str(PROMPT + NEW))
    page.get_by_test_id("prompt-tokens").fill(str(PROMPT))
    page.get_by_test_id("new-tokens").fill(str(NEW))
    page.get_by_test_id("measure-button").click()
    page.wait_for_function("document.body.dataset.measures === '1'")
    state = page.evaluate("JSON.parse(JSON.stringify(window.tensormorphPlan.state))")
    assert state["measureError"] is None and state["plan"] == state["measurement"]["plan"]
    rows = page.get_by_test_id("plan-measure")
    assert rows.count() == 2
    for k, stage in enumerate(state["measurement"]["stages"]):
        row = rows.nth(k)
        assert row.get_attribute("data-device") == stage["device"]
        ratios = row.get_by_test_id("measure-ratio").all_inner_texts()
        assert ratios == [f"×{stage[phase]['ratio']:.2f}" for phase in ("prefill", "decode")]
        assert f"ran on {stage['ran_on']}" in row.inner_text()
    assert "Measured on 2 processes" in page.get_by_test_id("measure-overall").inner_text()
    page.get_by_test_id("devices").fill("cuda:0=0GiB")
    page.get_by_test_id("measure-button").click()
    page.wait_for_function("document.body.dataset.measures === '2'")
    assert "Cannot measure: device cuda:0: memory must be positive" in page.get_by_test_id("plan-measured").inner_text()
    context.close()
    assert not errors, errors
