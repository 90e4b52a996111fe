"""Predicted vs measured stage times: `tensormorph measure` on this machine (issue 19, "Speed against measure").

A Llama-style model (8 layers, hidden 512, fp32, 124 MB, written by save_pretrained) is planned on two "devices"
that stand for this machine's CPU, each process on one thread: their speed is this machine's own, calibrated in the
same run (the anchor): compute from a 1024² fp32 matmul, bandwidth from a matrix-vector product over 128 MB of
weights, both with torch on one thread, as the stages run them. Each device gets 60% of the memory the model needs,
so the plan splits it in two. The plan is then run (`planner.measure`) RUNS times with a 128-token prompt, in one
pass and in chunks of 32, then 16 decode steps; every figure is the median of the runs, and the ratio is measured
over predicted stage time (compute + transfer).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from .common import GiB, MiB, fmt_s, prefault, print_table, row, work_dir, write_result

NAME = "measure"
RUNS = 3
PREFAULT = 1 * GiB
PROMPT, NEW = 128, 16
CHUNK = 32
SHARE = 0.6  # of the memory the whole model needs, per device: neither holds it alone
CONFIG = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
          "num_key_value_heads": 2, "vocab_size": 8000, "max_position_embeddings": 512, "tie_word_embeddings": False}


def build_model(root: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).save_pretrained(root / "llama-8-layers")
    return root / "llama-8-layers"


def calibrate() -> tuple[float, float]:
    """(TFLOP/s, GB/s) of torch on one thread here: the speed the plan is given for each stage."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    weights, x = torch.randn(8192, 4096), torch.randn(1, 4096)
    flops, reads = [], []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        flops.append(4 * 2 * 1024**3 / (time.perf_counter() - start))
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(x, weights.T)
        reads.append(4 * weights.numel() * 4 / (time.perf_counter() - start))
    return statistics.median(flops) / 1e12, statistics.median(reads) / 1e9


def main() -> None:
    from tensormorph.planner import Workload, measure, plan

    tflops, bandwidth = calibrate()
    print(f"this machine, torch on one thread: {tflops * 1e3:.1f} GFLOP/s, {bandwidth:.1f} GB/s", flush=True)
    cases: dict[str, Any] = {}
    table, rows = [], []
    with work_dir(NAME) as work:
        folder = build_model(work)
        alone = plan(folder, [f"cuda:0=64GiB,tflops={tflops},bw={bandwidth},reserve=0B"], Workload(PROMPT + NEW))
        memory = int(alone.devices[0].used * SHARE)
        devices = [f"cuda:{i}={memory}B,tflops={tflops},bw={bandwidth},reserve=0B" for i in range(2)]
        for key, chunk in (("one_pass", None), ("chunked", CHUNK)):
            workload = Workload(context=PROMPT + NEW, prefill_chunk=chunk)
            runs = []
            for _ in range(RUNS):
                prefault(PREFAULT)
                runs.append(measure(folder, devices, workload, prompt_tokens=PROMPT, new_tokens=NEW, threads=1))
            cases[key] = _case(runs)
            label = f"prompt {PROMPT}" + (f" in chunks of {chunk}" if chunk else " in one pass")
            for phase in ("prefill", "decode"):
                for stage in cases[key]["stages"]:
                    t = stage[phase]
                    table.append([label, phase, stage["device"], stage["layers"], fmt_s(t["measured_s"]),
                                  fmt_s(t["predicted_s"]), f"{t['ratio']:.2f}x", fmt_s(t["idle_s"])])
                whole = cases[key]["overall"][phase]
                table.append([label, phase, "overall", "", fmt_s(whole["measured_s"]), fmt_s(whole["predicted_s"]),
                              f"{whole['ratio']:.2f}x", ""])
                rows.append(row("measure: predicted vs measured (2 CPU stages)", f"{label}, {phase}",
                                tensormorph=f"measured {fmt_s(whole['measured_s'])}",
                                anchor=f"predicted {fmt_s(whole['predicted_s'])}", ratio=whole["ratio"],
                                target="reported", met=True,
                                note="ratio = measured / predicted; speeds calibrated here on one thread"))
        model_bytes = alone.model.nbytes
    print()
    print_table(["case", "phase", "stage", "layers", "measured", "predicted", "measured/predicted", "idle"], table)
    write_result(NAME, {
        "title": "Predicted vs measured stage times (tensormorph measure, 2 CPU stages)",
        "runs": RUNS,
        "sizes": {"model": CONFIG, "model_bytes": model_bytes, "model_size": f"{model_bytes / MiB:.1f} MiB",
                  "prompt_tokens": PROMPT, "new_tokens": NEW, "chunk": CHUNK, "devices_spec": devices},
        "anchor": {"name": "this machine's torch on one thread", "tflops": tflops, "bandwidth_gbps": bandwidth},
        "cases": cases,
        "rows": rows,
    })


def _case(runs: list[Any]) -> dict[str, Any]:
    """Medians over the runs, per stage and phase, of measured and predicted stage times."""
    first = runs[0]

    def median(values: list[float]) -> float:
        return statistics.median(values)

    stages = []
    for k, stage in enumerate(first.stages):
        entry: dict[str, Any] = {"device": stage.device, "layers": first.plan.usage(stage.device).layer_ranges,
                                 "modules": list(stage.modules)}
        for phase in ("prefill", "decode"):
            times = [m.stages[k].phase(phase) for m in runs]
            measured = median([t.stage_s for t in times])
            predicted = times[0].predicted_stage_s or 0.0
            entry[phase] = {"measured_s": measured, "predicted_s": predicted,
                            "ratio": measured / predicted if predicted else None,
                            "compute_s": median([t.compute_s for t in times]),
                            "transfer_s": median([t.transfer_s for t in times]),
                            "idle_s": median([t.idle_s for t in times]),
                            "predicted_compute_s": times[0].predicted_compute_s,
                            "predicted_transfer_s": times[0].predicted_transfer_s}
        stages.append(entry)
    prefill = median([m.prefill_s for m in runs])
    decode = median([m.decode_step_s for m in runs])
    return {"stages": stages,
            "overall": {"prefill": {"measured_s": prefill, "predicted_s": first.predicted_prefill_s,
                                    "ratio": prefill / first.predicted_prefill_s},
                        "decode": {"measured_s": decode, "predicted_s": first.predicted_decode_step_s,
                                   "ratio": decode / first.predicted_decode_step_s}},
            "runs": [m.to_dict()["overall"] for m in runs]}


if __name__ == "__main__":
    main()
