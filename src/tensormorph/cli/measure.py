"""`measure`: thin over `tensormorph.planner.measure` (parse, plan and run, print measured beside predicted)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from ..planner import Measurement, Workload, measure
from ..planner.measure_run import DEFAULT_NEW_TOKENS, DEFAULT_PROMPT_TOKENS
from ..units import human_bytes
from .output import CheckpointPath, console, fails_cleanly, print_json
from .plan import _holds


@click.command("measure")
@click.argument("source", type=CheckpointPath())
@click.option("--device", "devices", multiple=True, required=True, metavar="SPEC",
              help="As for `tensormorph plan`, in pipeline order; each device that holds anything runs as one "
                   "process (on its GPU when it is cuda:N and this machine has it, else on the CPU).")
@click.option("--link", type=float, help="GB/s between neighbouring devices  [default: 32]")
@click.option("--context", type=int, help="Tokens per sequence the plan is made for  [default: prompt + new tokens]")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences at once (each its own prompt).")
@click.option("--dtype", help="Weights and activations: bf16, fp16, fp32  [default: as stored]")
@click.option("--cache-dtype", help="KV cache: the activations' dtype (the run keeps it so)")
@click.option("--prefill-chunk", type=int, help="Tokens per prefill pass  [default: the whole prompt]")
@click.option("--optimize", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True,
              help="The phase the plan makes fastest.")
@click.option("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, show_default=True,
              help="Random prompt tokens per sequence.")
@click.option("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS, show_default=True,
              help="Greedy decode steps after the prefill.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompt.")
@click.option("--threads", type=int, help="torch threads per stage  [default: the cores shared out]")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def measure_command(source: str, devices: tuple[str, ...], link: float | None, context: int | None, batch: int,
                    dtype: str | None, cache_dtype: str | None, prefill_chunk: int | None, optimize: str,
                    prompt_tokens: int, new_tokens: int, seed: int, threads: int | None, as_json: bool) -> None:
    """Plan a Hugging Face model (config.json + safetensors) on the devices, run the plan on one process per stage
    with one prompt (prefill, then decode), and print each stage's measured compute, transfer, idle time and
    memory beside the plan's prediction (exit 0, or 2 on bad input or a plan that does not fit)."""
    workload = Workload(context=context or prompt_tokens + new_tokens, batch=batch, dtype=dtype,
                        cache_dtype=cache_dtype, prefill_chunk=prefill_chunk, optimize=optimize)
    with console.status("running the plan's stages", spinner="dots") if not as_json else nullcontext():
        result = measure(source, list(devices), workload, link=link, prompt_tokens=prompt_tokens,
                         new_tokens=new_tokens, seed=seed, threads=threads)
    if as_json:
        print_json(result.to_dict())
        return
    for line in render(result):
        console.print(line, highlight=False)


def render(m: Measurement) -> list[Any]:
    """A header, one table per phase (measured beside predicted), the memory table, the totals and the notes."""
    p = m.plan
    header = (f"[bold]{escape(p.model.name)}[/bold]  {len(m.stages)} stages  ·  prompt {m.prompt_tokens} × batch "
              f"{p.workload.batch}" + (f" in chunks of {m.prefill_chunk}" if m.prefill_chunk < m.prompt_tokens else "")
              + f", then {m.new_tokens} decode steps  ·  plan made for a context of {p.workload.context:,}")
    lines: list[Any] = [header]
    for phase, title in (("prefill", "prefill (the whole prompt)"), ("decode", "decode (per step)")):
        table = Table(title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
        for column in ("device", "ran on", "layers", "compute", "transfer", "idle", "send", "measured",
                       "predicted", "ratio"):
            table.add_column(column, justify="left" if column in ("device", "ran on", "layers") else "right")
        for stage in m.stages:
            t = stage.phase(phase)
            table.add_row(stage.device, stage.ran_on, escape(_holds(p.usage(stage.device))), _time(t.compute_s),
                          _time(t.transfer_s), _time(t.idle_s), _time(t.send_s), _time(t.stage_s),
                          _time(t.predicted_stage_s), _ratio(t.ratio))
        lines.append(table)
    memory = Table(title="memory", title_justify="left", box=None, header_style="bold", pad_edge=False)
    for column in ("device", "tensors held", "weights predicted", "KV cache", "KV predicted", "activations predicted",
                   "RSS before", "RSS growth"):
        memory.add_column(column, justify="left" if column == "device" else "right")
    for stage in m.stages:
        memory.add_row(stage.device, human_bytes(stage.tensor_bytes), human_bytes(stage.predicted.weights),
                       human_bytes(stage.kv_cache_bytes), human_bytes(stage.predicted.kv_cache),
                       human_bytes(stage.predicted.activations), human_bytes(stage.rss_before),
                       human_bytes(stage.rss_growth)
                       + (f" (GPU peak {human_bytes(stage.accelerator_peak)})" if stage.accelerator_peak else ""))
    lines.append(memory)
    lines.append(f"overall: prefill {_time(m.prefill_s)} measured, {_time(m.predicted_prefill_s)} predicted "
                 f"({_ratio(_over(m.prefill_s, m.predicted_prefill_s))}); decode {_time(m.decode_step_s)} per step "
                 f"measured, {_time(m.predicted_decode_step_s)} predicted "
                 f"({_ratio(_over(m.decode_step_s, m.predicted_decode_step_s))})")
    lines.extend(f"[dim]note: {escape(n)}[/dim]" for n in (*p.notes, *m.notes))
    return lines


def _over(measured: float, predicted: float | None) -> float | None:
    return measured / predicted if predicted else None


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"×{value:,.2f}"
