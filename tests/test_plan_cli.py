"""`tensormorph plan`, driven through click's CliRunner on the command object itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import tensormorph as tm
from tensormorph.cli.plan import plan_command
from tensormorph.planner import Workload
from tensormorph.units import human_bytes

pytestmark = pytest.mark.timeout(120)

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}
FAST = "cuda:0=24GiB,tflops=165,bw=1000"
SLOW = "cuda:1=12GiB,tflops=70,bw=360"


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    """A Llama-3-8B folder with its config.json only: planned without 16 GB of weights."""
    folder = tmp_path_factory.mktemp("cli") / "Llama-3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    return folder


def invoke(*args: str) -> Result:
    return CliRunner().invoke(plan_command, [str(a) for a in args], catch_exceptions=False)


def test_table_shows_every_device_the_totals_and_the_bottleneck(llama3):
    result = invoke(llama3, "--device", FAST, "--device", SLOW, "--link", "32", "--context", "8192",
                    "--optimize", "prefill", "--prefill-chunk", "512")
    assert result.exit_code == 0, result.output
    p = tm.plan(llama3, [FAST, SLOW], Workload(context=8192, optimize="prefill", prefill_chunk=512), link=32)
    out = result.output
    assert "Llama-3-8B  8.03 B params, 15.0 GiB in bf16, 32 layers" in out
    for row in p.devices:  # each device's row carries the planner's numbers
        line = next(line for line in out.splitlines() if line.startswith(row.name))
        for cell in (row.layer_ranges, human_bytes(row.weights), human_bytes(row.kv_cache),
                     human_bytes(row.activations), f"{human_bytes(row.used)} / {human_bytes(row.device.memory)}",
                     f"{8192 / row.prefill_stage_s:,.0f}"):
            assert cell in line, (cell, line)
    assert f"decode {p.decode_tokens_per_s:,.1f} tok/s" in out
    assert f"bottleneck ({p.bottleneck.limit}): {p.bottleneck.reason}" in out
    assert out.splitlines()[-1] == "fits"


def test_json_is_the_plan_as_data(llama3):
    result = invoke(llama3, "--device", FAST, "--device", SLOW, "--context", "8192", "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    expected = tm.plan(llama3, [FAST, SLOW], Workload(context=8192)).to_dict()
    assert data == json.loads(json.dumps(expected))
    layers_on_0 = [m for m, d in data["device_map"].items() if d == "cuda:0" and m.startswith("model.layers.")]
    assert data["fits"] is True and data["devices"][0]["kv_cache"] == len(layers_on_0) * 2 * 8 * 128 * 8192 * 2


def test_a_plan_that_does_not_fit_exits_1_with_what_would(llama3):
    result = invoke(llama3, "--device", "cuda:0=12GiB,tflops=165,bw=1000", "--device", SLOW, "--context", "32768")
    assert result.exit_code == 1
    assert "does not fit: cuda:0 over by" in result.output
    assert "would fit with: a context of at most" in result.output
    data = json.loads(invoke(llama3, "--device", "cuda:0=12GiB,tflops=165,bw=1000", "--device", SLOW, "--context",
                             "32768", "--json").output)
    assert data["fits"] is False and data["shortfall"]["max_context"] < 32768


def test_tensor_parallel_table_shows_each_share(llama3):
    result = invoke(llama3, "--device", FAST, "--device", SLOW, "--strategy", "tensor", "--uneven")
    assert result.exit_code == 0, result.output
    assert "24 heads, 74% MLP" in result.output and "8 heads, 26% MLP" in result.output


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda:0=24GiB,bw=900"], "device cuda:0: missing tflops= (compute, TFLOP/s)"),
    (["--device", "cuda:0=-4GiB,tflops=1,bw=1"], "memory must be positive, got -4GiB"),
    (["--device", "cuda0:24GiB"], "device 'cuda0:24GiB' is not in the device table"),
    (["--device", "rtx 4060 ti"], "may be any of: NVIDIA GeForce RTX 4060 Ti 8GB; NVIDIA GeForce RTX 4060 Ti 16GB"),
    (["--device", FAST, "--cache-dtype", "int3"], "unknown dtype 'int3'"),
    (["--device", "cuda:0=4GiB,tflops=1,bw=1"], "cannot fit on cuda:0 at any context"),
    (["--device", FAST, "--device", SLOW, "--device", "cuda:2=8GiB,tflops=1,bw=1", "--strategy", "tensor"],
     "needs the 32 attention heads and 8 KV heads to split evenly"),
])
def test_bad_input_is_one_line_and_exit_2(llama3, args, message):
    result = CliRunner().invoke(plan_command, [str(llama3), *args])
    assert result.exit_code == 2
    assert message in result.output.replace("\n", " ")
    assert "Traceback" not in result.output and result.output.count("error:") == 1


def test_an_encoder_plan_shows_no_decoding_and_no_kv_cache() -> None:
    from fixtures.builders import minilm_dir

    result = CliRunner().invoke(plan_command, [str(minilm_dir()), "--device", "cuda:0=8GiB,tflops=100,bw=1000"])
    assert result.exit_code == 0, result.output
    assert "encoder-only (bert): one forward pass" in result.output and "overall: encode " in result.output
    assert "decode" not in result.output and "KV cache" not in result.output.replace("no KV cache", "")
