"""A plan as the runtime's own settings: llama.cpp's flags, vLLM's engine arguments, accelerate's device_map and
max_memory; checked literally on known cases, and `tensormorph plan --emit`.

Each expected line follows from the plan's rows by the runtimes' documented rules (llama.cpp's common/arg.cpp and
llama-model.cpp: -ngl counts the last n_layer + 1 slots, the output layer last; -ts proportions per GPU in -dev
order; vLLM's engine arguments), worked out by hand in the comments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_planner_gguf import write_model

import tensormorph as tm
from tensormorph.cli.plan import plan_command
from tensormorph.planner import PlanError, Workload

pytestmark = pytest.mark.timeout(120)

GiB = 1 << 30
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "num_local_experts": 4,
           "num_experts_per_tok": 2, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
TWO_EVEN = ["cuda:0=12GiB", "cuda:1=12GiB"]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("export") / "Llama-3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    return folder


def test_llama_cpp_flags_for_a_pipeline_over_two_gpus(llama3):
    p = tm.plan(llama3, TWO_EVEN, Workload(context=8192, batch=2, cache_dtype="q8_0", prefill_chunk=512))
    assert [r.layer_ranges for r in p.devices] == ["0-15", "16-31"] and p.device_map["lm_head"] == "cuda:1"
    command = p.to_llama_cpp()
    # 32 layers + the output slot on the GPUs; cuda:1 holds 16 layers and the output: 16,17; -c is shared by 2 slots
    assert command.args == ("-dev", "CUDA0,CUDA1", "-ngl", "33", "-ts", "16,17", "-c", "16384", "-np", "2",
                            "-ctk", "q8_0", "-ctv", "q8_0", "-b", "512", "-ub", "512")
    assert str(command) == (f"llama-server -m {llama3} -dev CUDA0,CUDA1 -ngl 33 -ts 16,17 -c 16384 -np 2 -ctk q8_0 "
                            "-ctv q8_0 -b 512 -ub 512")
    assert "llama.cpp keeps the input embedding on the CPU; the plan counts 1002.0 MiB of it on cuda:0" in command.notes
    assert "a quantized V cache needs flash attention (-fa; llama.cpp enables it where it can)" in command.notes


def test_llama_cpp_flags_with_layers_on_the_host(llama3):
    p = tm.plan(llama3, ["cuda:0=8GiB", "cpu=64GiB"], Workload(context=8192))
    gpu, host = p.devices
    assert (gpu.layer_ranges, host.layer_ranges) == ("21-31", "0-20")
    # 11 layers and the output on the GPU: -ngl 12; the first 21 layers stay on the CPU
    assert p.to_llama_cpp().args == ("-dev", "CUDA0", "-ngl", "12", "-c", "8192", "-ctk", "bf16", "-ctv", "bf16")


def test_llama_cpp_flags_for_an_uneven_row_split(llama3):
    p = tm.plan(llama3, ["cuda:0=24GiB,tflops=165,bw=1000", "cuda:1=12GiB,tflops=70,bw=360"],
                Workload(context=8192), strategy="tensor", uneven=True)
    assert p.to_llama_cpp().args == ("-dev", "CUDA0,CUDA1", "-ngl", "33", "-sm", "row", "-ts", "24,8", "-c", "8192",
                                     "-ctk", "bf16", "-ctv", "bf16")


def test_llama_cpp_refuses_what_it_cannot_run(llama3):
    with pytest.raises(PlanError, match=r"llama.cpp has no fp8 KV cache; -ctk/-ctv take f32, f16, bf16, q8_0"):
        tm.plan(llama3, ["cuda:0=24GiB"], Workload(context=8192, cache_dtype="fp8")).to_llama_cpp()
    with pytest.raises(PlanError, match="llama.cpp keeps the first layers on the CPU"):
        tm.plan(llama3, ["cuda:0=24GiB", "cpu=64GiB"], Workload(context=1024),
                device_map={"model": "cuda:0", "model.layers.31": "cpu", "lm_head": "cuda:0"}).to_llama_cpp()


def test_vllm_arguments_for_an_even_tensor_split(llama3):
    p = tm.plan(llama3, ["cuda:0=24GiB", "cuda:1=24GiB"], Workload(context=8192, batch=4, cache_dtype="fp8"),
                strategy="tensor")
    command = p.to_vllm()
    fullest = max(r.used / r.device.memory for r in p.devices)
    assert 0.47 < fullest <= 0.48  # rounded up to hundredths: 0.48
    assert command.env == (("CUDA_VISIBLE_DEVICES", "0,1"),)
    assert command.args == ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
                            "--gpu-memory-utilization", "0.48", "--max-model-len", "8192", "--kv-cache-dtype", "fp8",
                            "--max-num-seqs", "4")
    assert str(command).startswith(f"CUDA_VISIBLE_DEVICES=0,1 vllm serve {llama3} --tensor-parallel-size 2")


def test_vllm_arguments_for_a_pipeline_with_experts_on_the_host(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    whole = tm.plan(tmp_path, ["cuda:0=1GiB,reserve=0B"], Workload(context=256)).devices[0]
    p = tm.plan(tmp_path, ["cuda:0=1GiB,reserve=0B", f"cuda:2={whole.used * 3 // 10}B,reserve=0B", "cpu=1GiB"],
                Workload(context=256))
    rows = {r.name: r for r in p.devices}
    host = rows["cpu"]
    assert host.expert_layers == () and host.units == ()  # the first GPU holds it all: nothing on the host
    tight = [f"cuda:0={whole.used * 3 // 10}B,reserve=0B", f"cuda:2={whole.used * 3 // 10}B,reserve=0B", "cpu=1GiB"]
    p = tm.plan(tmp_path, tight, Workload(context=256))
    gpus, host = p.devices[:2], p.devices[2]
    assert host.expert_layers and host.kv_cache == 0
    layers = [len(r.layers) for r in gpus]
    utilization = max(r.used / r.device.memory for r in gpus)
    per_gpu = host.weights / 2 / GiB
    args = p.to_vllm().args
    assert p.to_vllm().env == (("CUDA_VISIBLE_DEVICES", "0,2"), ("VLLM_PP_LAYER_PARTITION", f"{layers[0]},{layers[1]}"))
    assert args[:4] == ("--tensor-parallel-size", "1", "--pipeline-parallel-size", "2")
    assert args[4:8] == ("--gpu-memory-utilization", f"{-(-utilization * 100 // 1) / 100:g}", "--max-model-len", "256")
    assert args[8:] == ("--kv-cache-dtype", "auto", "--cpu-offload-gb", f"{-(-per_gpu * 10 // 1) / 10:g}")


def test_vllm_refuses_what_it_cannot_run(llama3, tmp_path):
    uneven = tm.plan(llama3, ["cuda:0=24GiB,tflops=165,bw=1000", "cuda:1=12GiB,tflops=70,bw=360"],
                     Workload(context=8192), strategy="tensor", uneven=True)
    with pytest.raises(PlanError, match=r"vLLM splits every layer evenly .* unevenly \(24 / 8 heads\)"):
        uneven.to_vllm()
    with pytest.raises(PlanError, match="vLLM runs one kind of accelerator; this plan mixes cuda, mps"):
        tm.plan(llama3, ["cuda:0=12GiB", "mps=16GiB"], Workload(context=8192)).to_vllm()
    with pytest.raises(PlanError, match=r"vLLM keeps the whole KV cache on the GPUs; this plan puts layers 0-20"):
        tm.plan(llama3, ["cuda:0=8GiB", "cpu=64GiB"], Workload(context=8192)).to_vllm()
    with pytest.raises(PlanError, match=r"vLLM's KV cache is the model's dtype \(bf16, 'auto'\) or fp8, not q4_0"):
        tm.plan(llama3, TWO_EVEN, Workload(context=8192, cache_dtype="q4_0")).to_vllm()
    split = write_model(tmp_path / "tiny.gguf", split=10)
    with pytest.raises(PlanError, match=r"vLLM loads a single GGUF file, not a split one") as caught:
        tm.plan(split, ["cuda:0=1GiB,reserve=0B"]).to_vllm()
    assert caught.value.file == str(split)


def test_accelerate_settings_place_experts_apart_and_cap_each_device(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    whole = tm.plan(tmp_path, ["cuda:0=1GiB,reserve=0B"], Workload(context=256)).devices[0]
    p = tm.plan(tmp_path, [f"cuda:0={whole.used * 6 // 10}B,reserve=0B", "cpu=1GiB"], Workload(context=256))
    gpu, host = p.devices
    assert host.expert_layers == (0, 1, 2)
    settings = p.accelerate_settings()
    layer0 = {k: v for k, v in settings["device_map"].items() if k.startswith("model.layers.0")}
    assert layer0 == {"model.layers.0.self_attn": 0, "model.layers.0.block_sparse_moe.gate": 0,
                      "model.layers.0.block_sparse_moe.experts": "cpu", "model.layers.0.input_layernorm": 0,
                      "model.layers.0.post_attention_layernorm": 0}
    assert settings["device_map"]["model.layers.3"] == 0 and settings["device_map"]["model.embed_tokens"] == "cpu"
    assert settings["max_memory"] == {0: gpu.device.memory - gpu.kv_cache - gpu.activations,
                                      "cpu": host.device.memory - host.activations}
    assert settings["max_memory"][0] >= gpu.weights and settings["max_memory"]["cpu"] >= host.weights


def test_the_cli_emits_each_runtimes_settings(llama3):
    base = [str(llama3), "--device", "cuda:0=12GiB", "--device", "cuda:1=12GiB", "--context", "8192"]
    result = CliRunner().invoke(plan_command, [*base, "--emit", "llama.cpp"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"llama-server -m {llama3} -dev CUDA0,CUDA1 -ngl 33 -ts 16,17 -c 8192 -ctk bf16 -ctv bf16"
    assert all(line.startswith("# ") for line in lines[1:]) and len(lines) == 3
    result = CliRunner().invoke(plan_command, [*base, "--emit", "vllm"])
    assert result.output.splitlines()[0] == (f"CUDA_VISIBLE_DEVICES=0,1 VLLM_PP_LAYER_PARTITION=16,16 vllm serve "
                                             f"{llama3} --tensor-parallel-size 1 --pipeline-parallel-size 2 "
                                             "--gpu-memory-utilization 0.82 --max-model-len 8192 --kv-cache-dtype auto")
    assert 0.81 < max(r.used / r.device.memory for r in tm.plan(llama3, TWO_EVEN, Workload(context=8192)).devices) \
        <= 0.82
    result = CliRunner().invoke(plan_command, [*base, "--emit", "vllm", "--json"])
    assert json.loads(result.output)["env"] == {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_PP_LAYER_PARTITION": "16,16"}
    result = CliRunner().invoke(plan_command, [*base, "--emit", "accelerate"])
    data = json.loads(result.output)
    p = tm.plan(llama3, ["cuda:0=12GiB", "cuda:1=12GiB"], Workload(context=8192))
    assert data["device_map"] == p.to_accelerate()
    assert data["max_memory"] == {"0": 12 * GiB - p.devices[0].kv_cache - p.devices[0].activations - GiB,
                                  "1": 12 * GiB - p.devices[1].kv_cache - p.devices[1].activations - GiB}
    result = CliRunner().invoke(plan_command, [*base, "--cache-dtype", "q4_0", "--emit", "vllm"])
    assert result.exit_code == 2 and "vLLM's KV cache is the model's dtype (bf16, 'auto') or fp8, not q4_0" in \
        result.output.replace("\n", " ")
