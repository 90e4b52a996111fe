"""Plan an 80-layer model over 8 uneven devices: target < 1 s.

Cases (medians of RUNS runs, memory prefaulted before each timed step):
  * Llama-3-70B shapes (80 layers, hidden 8192, 64 heads, 8 KV heads, vocab 128256), planned from the
    config alone, over 4 × 24 GiB fast and 4 × 16 GiB slower cards at 8,192 tokens: pipeline optimised
    for decode, pipeline optimised for a chunked prefill, and uneven tensor parallel;
  * an 80-layer checkpoint on disk (tiny widths, the Llama layout, written by save_pretrained), where
    the time includes opening it (metadata only).
Anchor: accelerate's `infer_auto_device_map` on the same model (built on the meta device, not timed) with
the same memory less the same 1 GiB reserve, timed in the same run. Its map is then evaluated by the
planner's cost model, to show what the faster anchor leaves out (KV cache, activations, device speed).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .common import GiB, fmt_s, prefault, print_table, row, summary, work_dir, write_result

NAME = "plan"
RUNS = 5
PREFAULT = 1 * GiB
LLAMA3_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "_name_or_path": "Llama-3-70B"}
DEVICES = [f"cuda:{i}=24GiB,tflops=165,bw=1000" for i in range(4)] + \
          [f"cuda:{i}=16GiB,tflops=80,bw=500" for i in range(4, 8)]
CONTEXT = 8192


def timed(fn: Any) -> tuple[list[float], Any]:
    times, value = [], None
    for _ in range(RUNS):
        prefault(PREFAULT)
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return times, value


def build_checkpoint(root: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=80, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "llama-80-layers")
    return root / "llama-80-layers"


def accelerate_anchor(config: dict[str, Any], memory: dict[int, int]) -> tuple[list[float], dict]:
    import torch
    from accelerate import infer_auto_device_map
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in config.items()
                                                                  if not k.startswith("_")}))
    return timed(lambda: infer_auto_device_map(model, max_memory=memory,
                                               no_split_module_classes=list(model._no_split_modules),
                                               dtype=torch.bfloat16))


def main() -> None:
    import tensormorph as tm
    from tensormorph.planner import Workload, parse_device

    devices = [parse_device(d) for d in DEVICES]
    memory = {i: d.memory - d.reserve_bytes for i, d in enumerate(devices)}
    decode = Workload(context=CONTEXT)
    prefill = Workload(context=CONTEXT, prefill_chunk=512, optimize="prefill")
    cases: dict[str, dict[str, Any]] = {}

    anchor_times, anchor_map = accelerate_anchor(LLAMA3_70B, memory)
    anchor = summary(anchor_times)

    def record(key: str, label: str, fn: Any) -> None:
        times, p = timed(fn)
        cases[key] = {"label": label, "tensormorph_s": summary(times), "fits": p.fits,
                      "decode_tokens_per_s": p.decode_tokens_per_s, "prefill_tokens_per_s": p.prefill_tokens_per_s,
                      "bottleneck": p.bottleneck.reason, "layers": {d.name: d.layer_ranges for d in p.devices}}
        print(f"{label}: {fmt_s(cases[key]['tensormorph_s']['median'])}", flush=True)

    record("pipeline_decode", "config-only, pipeline, optimised for decode",
           lambda: tm.plan(LLAMA3_70B, devices, decode, link=32))
    record("pipeline_prefill", "config-only, pipeline, optimised for a chunked prefill",
           lambda: tm.plan(LLAMA3_70B, devices, prefill, link=32))
    record("tensor_uneven", "config-only, uneven tensor parallel",
           lambda: tm.plan(LLAMA3_70B, devices, decode, "tensor", uneven=True, link=32))
    with work_dir(NAME) as work:
        path = build_checkpoint(work)
        tiny = [f"cuda:{i}=64MiB,tflops={165 if i < 4 else 80},bw={1000 if i < 4 else 500},reserve=0B"
                for i in range(8)]
        record("checkpoint", "80-layer checkpoint on disk, open + pipeline plan",
               lambda: tm.plan(path, tiny, Workload(context=CONTEXT), link=32))

    theirs = tm.plan(LLAMA3_70B, devices, decode, link=32, device_map=anchor_map)
    ours = tm.plan(LLAMA3_70B, devices, decode, link=32)
    quality = {"accelerate_map": {"fits": theirs.fits, "over": theirs.shortfall.over if theirs.shortfall else {},
                                  "decode_tokens_per_s": theirs.decode_tokens_per_s,
                                  "bottleneck_s": theirs.bottleneck.seconds},
               "tensormorph_plan": {"fits": ours.fits, "decode_tokens_per_s": ours.decode_tokens_per_s,
                                    "bottleneck_s": ours.bottleneck.seconds}}

    table, rows = [], []
    for case in cases.values():
        median = case["tensormorph_s"]["median"]
        ratio = anchor["median"] / median
        table.append([case["label"], fmt_s(median), fmt_s(anchor["median"]), f"{ratio:.2f}x",
                      "yes" if median < 1 else "NO"])
        rows.append(row("plan 80 layers over 8 uneven devices", case["label"], tensormorph=fmt_s(median),
                        anchor=f"accelerate infer_auto_device_map: {fmt_s(anchor['median'])}", ratio=ratio,
                        target="< 1 s", met=median < 1))
    print()
    print_table(["case", "tensormorph", "accelerate", "accelerate/tm", "< 1 s"], table)
    print(f"\nat {CONTEXT:,} tokens, accelerate's map {'fits' if theirs.fits else 'does not fit'}"
          + (f" ({', '.join(f'{k} over by {v / GiB:.2f} GiB' for k, v in theirs.shortfall.over.items())})"
             if theirs.shortfall else "")
          + f" and decodes at {theirs.decode_tokens_per_s:.2f} tok/s; the plan fits and decodes at "
            f"{ours.decode_tokens_per_s:.2f} tok/s")
    write_result(NAME, {
        "title": "Plan an 80-layer model over 8 uneven devices",
        "runs": RUNS,
        "sizes": {"layers": 80, "devices": len(devices), "context": CONTEXT,
                  "model": LLAMA3_70B["_name_or_path"], "devices_spec": DEVICES},
        "anchor": {"name": "accelerate infer_auto_device_map", "s": anchor},
        "cases": cases,
        "quality_at_context": quality,
        "rows": rows,
    })


if __name__ == "__main__":
    main()
