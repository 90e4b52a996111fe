"""Devices without speeds, by name (the device table), the host tier, and this machine's devices (`auto`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import tensormorph as tm
from tensormorph.cli.plan import plan_command
from tensormorph.planner import PlanError, Workload, parse_device, parse_devices
from tensormorph.planner.catalog import catalog, normalize
from tensormorph.planner.devices import host_memory, local_devices, parse_nvidia_smi
from tensormorph.planner.spec import DEFAULT_HOST_BANDWIDTH_GBPS, DEFAULT_HOST_TFLOPS

pytestmark = pytest.mark.timeout(120)

GiB, MiB = 1 << 30, 1 << 20
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}
# what `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits` prints (MiB)
NVIDIA_SMI_SAMPLE = """NVIDIA GeForce RTX 3090, 24576
NVIDIA GeForce RTX 4060 Ti, 16380
NVIDIA A100-SXM4-80GB, 81920
NVIDIA Future GPU 9000, 49152
"""
MEMINFO_SAMPLE = """MemTotal:       65536000 kB
MemFree:         1000000 kB
MemAvailable:   48000000 kB
Buffers:          100000 kB
"""


# ---------------------------------------------------------------- the device table

def test_the_table_has_sources_and_sane_figures():
    products = catalog()
    assert len({p.name for p in products}) == len(products)
    for p in products:
        assert p.source.startswith("https://"), p.name
        assert p.memory >= 8 * GiB and 50 <= p.bandwidth <= 6000, p.name
        assert p.kind in ("gpu", "apple")
        assert (p.tflops is None) == (p.kind == "apple")  # Apple publishes no half-precision rate
        assert p.tflops is None or 20 <= p.tflops <= 1400, p.name


@pytest.mark.parametrize("typed, name, memory, tflops, bandwidth", [
    ("rtx3060", "NVIDIA GeForce RTX 3060 12GB", 12, 25.5, 360),
    ("RTX 3070", "NVIDIA GeForce RTX 3070", 8, 40.6, 448),
    ("rtx 3080 10gb", "NVIDIA GeForce RTX 3080 10GB", 10, 59.5, 760),
    ("rtx3090", "NVIDIA GeForce RTX 3090", 24, 71.2, 936),
    ("NVIDIA GeForce RTX 3090 Ti", "NVIDIA GeForce RTX 3090 Ti", 24, 80.0, 1008),
    ("rtx-4060", "NVIDIA GeForce RTX 4060", 8, 30.2, 272),
    ("rtx 4060 ti 8gb", "NVIDIA GeForce RTX 4060 Ti 8GB", 8, 44.1, 288),
    ("rtx 4060 ti 16gb", "NVIDIA GeForce RTX 4060 Ti 16GB", 16, 44.1, 288),
    ("rtx4070", "NVIDIA GeForce RTX 4070", 12, 58.3, 504),
    ("rtx 4070 ti", "NVIDIA GeForce RTX 4070 Ti", 12, 80.2, 504),
    ("rtx4080", "NVIDIA GeForce RTX 4080", 16, 97.5, 716.8),
    ("4090", "NVIDIA GeForce RTX 4090", 24, 165.2, 1008),
    ("rtx5090", "NVIDIA GeForce RTX 5090", 32, 209.5, 1792),
    ("a10", "NVIDIA A10", 24, 125, 600),
    ("a100-40gb", "NVIDIA A100 40GB", 40, 312, 1555),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM", 80, 312, 2039),
    ("h100 sxm", "NVIDIA H100 SXM", 80, 989.5, 3350),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 80, 756.5, 2000),
    ("h200", "NVIDIA H200", 141, 989.5, 4800),
    ("L4", "NVIDIA L4", 24, 121, 300),
    ("l40s", "NVIDIA L40S", 48, 362.05, 864),
    ("Tesla T4", "NVIDIA Tesla T4", 16, 65, 320),
    ("v100 32gb", "NVIDIA Tesla V100 SXM2 32GB", 32, 125, 900),
    ("mi250", "AMD Instinct MI250", 128, 362.1, 3276.8),
    ("MI300X", "AMD Instinct MI300X", 192, 1307.4, 5300),
    ("m1", "Apple M1", 8, None, 68.25),
    ("m2-max", "Apple M2 Max", 32, None, 400),
    ("M3 Ultra", "Apple M3 Ultra", 96, None, 819),
    ("m4 max 40c", "Apple M4 Max (40-core GPU)", 48, None, 546),
])
def test_devices_by_loose_name(typed, name, memory, tflops, bandwidth):
    device = parse_device(typed, gpu_name="cuda:3")
    assert device.product == name
    assert (device.memory, device.tflops, device.bandwidth) == (memory * GiB, tflops, bandwidth)
    assert device.name == ("mps" if name.startswith("Apple") else "cuda:3")


def test_ambiguous_names_list_the_candidates_and_memory_picks_one():
    with pytest.raises(PlanError, match=r"device 'rtx 4060 ti' may be any of: NVIDIA GeForce RTX 4060 Ti 8GB; "
                                        r"NVIDIA GeForce RTX 4060 Ti 16GB; name one: 'rtx 4060 ti 8gb' "):
        parse_device("rtx 4060 ti")
    assert parse_device("cuda:1=rtx 4060 ti,16GiB").product == "NVIDIA GeForce RTX 4060 Ti 16GB"
    with pytest.raises(PlanError, match="may be any of: Apple M3 Max \\(30-core GPU\\); Apple M3 Max \\(40-core"):
        parse_device("m3-max")


def test_unknown_names_are_refused_with_the_nearest_ones():
    with pytest.raises(PlanError, match=r"device 'rtx3099' is not in the device table; did you mean 'rtx 3090', "):
        parse_device("rtx3099")
    with pytest.raises(PlanError, match=r"device 'h1000' is not in the device table; did you mean 'h100'"):
        parse_device("cuda:0=h1000")


def test_named_devices_take_options_and_free_cuda_numbers():
    devices = parse_devices(["rtx3090", "cuda:0=rtx4090,reserve=2GiB,link=16", "rtx 4060 ti 8gb,tflops=40,bw=250"])
    assert [d.name for d in devices] == ["cuda:1", "cuda:0", "cuda:2"]
    assert (devices[1].reserve, devices[1].link, devices[1].tflops) == (2 * GiB, 16.0, 165.2)
    assert (devices[2].tflops, devices[2].bandwidth, devices[2].memory) == (40.0, 250.0, 8 * GiB)
    assert parse_device("mps=m2-max,96GiB").memory == 96 * GiB
    assert normalize("NVIDIA GeForce RTX-4060 Ti 16GB") == "rtx4060ti16gb"


# ---------------------------------------------------------------- planning by memory alone

def test_devices_without_speed_are_balanced_by_memory_and_predict_no_times():
    workload = Workload(context=8192)
    p = tm.plan(LLAMA3_8B, ["cuda:0=24GiB", "cuda:1=12GiB"], workload)
    assert p.fits and not p.speed_known
    assert p.decode_step_s is None and p.decode_tokens_per_s is None and p.prefill_tokens_per_s is None
    fill = [(r.used - r.reserve) / (r.device.memory - r.reserve) for r in p.devices]
    layer = p.devices[0].weights / len(p.devices[0].layers) / (11 * GiB)  # one layer's share of the smaller card
    assert abs(fill[0] - fill[1]) < 1.5 * layer, fill
    assert sum(r.weights for r in p.devices) == p.model.nbytes
    data = json.loads(json.dumps(p.to_dict()))
    assert data["speed_known"] is False and data["overall"] == {key: None for key in data["overall"]}
    assert all(r["decode"]["stage_s"] is None and r["prefill"]["tokens_per_s"] is None for r in data["devices"])
    assert data["bottleneck"]["limit"] == "unknown" and data["bottleneck"]["seconds"] is None
    assert any(n.startswith("speed unknown for cuda:0, cuda:1") for n in p.notes)


def test_one_device_without_speed_makes_the_whole_plan_memory_only():
    p = tm.plan(LLAMA3_8B, ["cuda:0=24GiB,tflops=165,bw=1000", "cuda:1=12GiB"], Workload(context=4096))
    assert not p.speed_known and any(n.startswith("speed unknown for cuda:1:") for n in p.notes)


def test_the_host_tier_takes_only_what_the_gpus_cannot_hold():
    small = ["cuda:0=8GiB", "cuda:1=6GiB", "cpu=64GiB"]
    p = tm.plan(LLAMA3_8B, small, Workload(context=4096))
    assert p.fits
    gpu_layers = len(p.devices[0].layers) + len(p.devices[1].layers)
    # the embedding first, then the first layers (llama.cpp's -ngl keeps the last ones on the GPUs)
    assert p.devices[2].layers == tuple(range(32 - gpu_layers)) and p.devices[2].layers
    assert p.devices[2].units[0] == "model.embed_tokens" and p.device_map["lm_head"] != "cpu"
    assert all(r.used <= r.device.memory for r in p.devices)
    roomy = tm.plan(LLAMA3_8B, ["cuda:0=24GiB", "cuda:1=12GiB", "cpu=64GiB"], Workload(context=4096))
    assert roomy.devices[2].units == () and roomy.devices[2].used == 0


def test_the_host_tier_has_its_own_assumed_speed_unless_given():
    cpu = parse_device("cpu=64GiB")
    assert (cpu.memory, cpu.tflops, cpu.bandwidth, cpu.reserve_bytes) == \
        (64 * GiB, DEFAULT_HOST_TFLOPS, DEFAULT_HOST_BANDWIDTH_GBPS, 0)
    assert cpu.notes == (f"cpu: host speed assumed, {DEFAULT_HOST_BANDWIDTH_GBPS:g} GB/s and "
                         f"{DEFAULT_HOST_TFLOPS:g} TFLOP/s (give bw= and tflops=)",)
    given = parse_device("cpu=64GiB,tflops=2,bw=80")
    assert (given.tflops, given.bandwidth, given.notes) == (2.0, 80.0, ())
    half = parse_device("cpu=64GiB,bw=80")  # the host's other figure is assumed, not refused
    assert (half.tflops, half.bandwidth, half.notes) == (DEFAULT_HOST_TFLOPS, 80.0, (
        f"cpu: host compute assumed, {DEFAULT_HOST_TFLOPS:g} TFLOP/s (give tflops=)",))
    assert parse_device("cpu=64GiB,tflops=3").bandwidth == DEFAULT_HOST_BANDWIDTH_GBPS


def test_the_cli_says_speed_is_unknown_and_shows_no_rates(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    result = CliRunner().invoke(plan_command, [str(tmp_path), "--device", "cuda:0=24GiB", "--device", "cuda:1=12GiB"])
    assert result.exit_code == 0, result.output
    assert "tok/s" not in result.output and "bottleneck" not in result.output
    assert "speed unknown: placed by memory alone; the fullest device is cuda:" in result.output


# ---------------------------------------------------------------- this machine

def test_nvidia_smi_output_becomes_devices_with_table_speeds(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO_SAMPLE)
    assert parse_nvidia_smi(NVIDIA_SMI_SAMPLE)[1] == ("NVIDIA GeForce RTX 4060 Ti", 16380 * MiB)
    devices = local_devices(lambda: parse_nvidia_smi(NVIDIA_SMI_SAMPLE), meminfo)
    assert [d.name for d in devices] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cpu"]
    assert [d.product for d in devices] == ["NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 4060 Ti 16GB",
                                            "NVIDIA A100 80GB SXM", "NVIDIA Future GPU 9000", None]
    assert [d.memory for d in devices] == [24576 * MiB, 16380 * MiB, 81920 * MiB, 49152 * MiB, 48000000 * 1024]
    assert [d.bandwidth for d in devices] == [936, 288, 2039, None, DEFAULT_HOST_BANDWIDTH_GBPS]
    assert devices[3].notes == ("cuda:3: NVIDIA Future GPU 9000, found here, is not in the device table: "
                                "speed unknown",)


def test_bad_nvidia_smi_and_meminfo_are_clear_errors():
    with pytest.raises(PlanError, match="nvidia-smi printed 'NVIDIA A10, N/A', not 'NAME, MiB'"):
        parse_nvidia_smi("NVIDIA A10, N/A\n")
    assert host_memory("MemTotal: 1024 kB\n") == 1024 * 1024
    with pytest.raises(PlanError, match="holds neither MemAvailable nor MemTotal"):
        host_memory("SwapTotal: 0 kB\n")


def test_auto_finds_this_machines_devices():
    import torch

    devices = parse_devices(["auto"])
    assert devices[-1].name == "cpu" and devices[-1].speed_known
    total = host_memory(Path("/proc/meminfo").read_text().replace("MemAvailable", "Unused"))
    assert 0 < devices[-1].memory <= total
    if not torch.cuda.is_available() and shutil.which("nvidia-smi") is None:
        assert [d.name for d in devices] == ["cpu"]
    else:
        assert [d.name for d in devices[:-1]] == [f"cuda:{i}" for i in range(len(devices) - 1)]


def test_a_device_without_speed_round_trips_through_its_spec():
    from tensormorph.planner import Device

    device = Device("cuda:0", 24 * GiB, reserve=2 * GiB, link=16.0)
    assert str(device) == f"cuda:0={24 * GiB}B,reserve={2 * GiB}B,link=16.0"
    assert parse_device(str(device)) == device and not device.speed_known
