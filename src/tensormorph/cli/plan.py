"""`plan`: thin over `tensormorph.planner.plan` (parse, plan, print)."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.markup import escape
from rich.table import Table

from ..planner import DeviceUsage, Plan, Workload, plan
from ..units import human_bytes, number_ranges
from .output import CheckpointPath, console, fails_cleanly, print_json

EMITTERS = ("llama.cpp", "vllm", "accelerate")


@click.command("plan")
@click.argument("source", type=CheckpointPath())
@click.option("--device", "devices", multiple=True, required=True, metavar="SPEC",
              help="NAME=MEMORY[,tflops=T,bw=GBPS][,reserve=SIZE][,link=GBPS], a model name (rtx3090, "
                   "'rtx 4060 ti 16gb', cuda:1=a100-80gb, mps=m2-max,64GiB), cpu=SIZE (host RAM) or auto (this "
                   "machine); in pipeline order, repeat per device. Without tflops/bw: planned by memory alone.")
@click.option("--link", type=float, help="GB/s between neighbouring devices  [default: 32]")
@click.option("--context", type=int, default=4096, show_default=True, help="Tokens per sequence.")
@click.option("--batch", type=int, default=1, show_default=True, help="Sequences at once.")
@click.option("--strategy", type=click.Choice(["pipeline", "tensor"]), default="pipeline", show_default=True)
@click.option("--dtype", help="Weights and activations: bf16, fp16, fp32, fp8  [default: as stored]")
@click.option("--cache-dtype", help="KV cache: bf16, fp16, fp8, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl  "
                                    "[default: the activations' dtype; f16 for a GGUF model, as llama.cpp]")
@click.option("--prefill-chunk", type=int, help="Tokens per prefill pass  [default: the whole context]")
@click.option("--optimize", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True,
              help="The phase to make fastest.")
@click.option("--uneven", is_flag=True, help="Tensor parallel: split by device speed (runtimes that allow it).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--emit", type=click.Choice(EMITTERS), help="Print the runtime's settings for the plan instead: "
              "llama-server's flags, vLLM's engine arguments, or accelerate's device_map and max_memory (JSON).")
@fails_cleanly
def plan_command(source: str, devices: tuple[str, ...], link: float | None, context: int, batch: int, strategy: str,
                 dtype: str | None, cache_dtype: str | None, prefill_chunk: int | None, optimize: str, uneven: bool,
                 as_json: bool, emit: str | None) -> None:
    """Place a model (a checkpoint, a GGUF file, or a config.json) on uneven devices: memory per device
    (weights, KV cache, activations, reserve), predicted speed per stage, and the bottleneck (exit 0 fits,
    1 does not fit, 2 error)."""
    workload = Workload(context=context, batch=batch, dtype=dtype, cache_dtype=cache_dtype,
                        prefill_chunk=prefill_chunk, optimize=optimize)
    result = plan(source, list(devices), workload, strategy, link=link, uneven=uneven)
    if emit is not None:
        _emit(result, emit, as_json)
    elif as_json:
        print_json(result.to_dict())
    else:
        for line in render(result):
            console.print(line, highlight=False)
    sys.exit(0 if result.fits else 1)


def _emit(p: Plan, runtime: str, as_json: bool) -> None:
    """The runtime's settings: a shell line with its notes as comments (JSON with --json); accelerate's as JSON."""
    if runtime == "accelerate":
        print_json(p.accelerate_settings())
        return
    command = p.to_llama_cpp() if runtime == "llama.cpp" else p.to_vllm()
    if as_json:
        print_json(command.to_dict())
        return
    click.echo(str(command))
    for note in command.notes:
        click.echo(f"# {note}")
    if not p.fits:
        click.echo(f"# the plan does not fit: {', '.join(p.shortfall.suggestions()) if p.shortfall else ''}")


def render(p: Plan) -> list[Any]:
    """The plan as rich renderables: a header, the per-device table, totals, bottleneck, shortfall, notes."""
    m, w = p.model, p.workload
    encoder = m.arch.encoder  # an encoder-only model decodes nothing: no KV cache or decode figures
    cache = w.cache_dtype or m.default_cache
    header = (f"[bold]{escape(m.name)}[/bold]  {m.params / 1e9:.2f} B params, {human_bytes(m.nbytes)} in {m.dtype}, "
              f"{m.arch.layers} layers  ·  context {w.context:,} × batch {w.batch}"
              + ("" if encoder else f", KV cache {cache}") + f"  ·  {p.strategy}"
              + ("" if encoder else f", optimised for {w.optimize}") + f"\n{escape(p.plans)}")
    table = Table(box=None, header_style="bold", pad_edge=False)
    rows = [{"device": row.name, "layers" if p.strategy == "pipeline" else "share": escape(_holds(row)),
             "weights": human_bytes(row.weights), "KV cache": human_bytes(row.kv_cache),
             "activations": human_bytes(row.activations), "reserve": human_bytes(row.reserve),
             "used / memory": f"{human_bytes(row.used)} / {human_bytes(row.device.memory)}",
             "free": human_bytes(row.free) if row.fits else f"[red]{human_bytes(row.free)}[/red]",
             "decode tok/s": _rate(w.batch, row.decode_stage_s),
             "prefill tok/s": _rate(w.batch * w.context, row.prefill_stage_s)} for row in p.devices]
    hidden: tuple[str, ...] = ("KV cache", "decode tok/s") if encoder else ()
    if not p.speed_known:  # no times to show
        hidden += ("decode tok/s", "prefill tok/s")
    columns = [c for c in rows[0] if c not in hidden] if rows else []
    for column in columns:
        table.add_column(column, justify="left" if column in ("device", "layers", "share") else "right")
    for cells in rows:
        table.add_row(*(cells[c] for c in columns))
    lines: list[Any] = [header, table]
    lines.extend(_overall(p))
    if p.shortfall is not None:
        over = ", ".join(f"{name} over by {human_bytes(n)}" for name, n in p.shortfall.over.items())
        lines.append(f"[red]does not fit:[/red] {escape(over)}")
        suggestions = p.shortfall.suggestions()
        if suggestions:
            lines.append("would fit with: " + escape(" · ".join(suggestions)))
    else:
        lines.append("[green]fits[/green]")
    lines.extend(f"[dim]note: {escape(n)}[/dim]" for n in p.notes)
    return lines


def _overall(p: Plan) -> list[str]:
    """The predicted speed and the bottleneck; with a device of unknown speed, only that."""
    if not p.speed_known or p.decode_step_s is None or p.prefill_time_s is None or p.prefill_tokens_per_s is None:
        return [escape(p.bottleneck.reason)]
    w, encoder = p.workload, p.model.arch.encoder
    links = ", ".join(f"{g:g}" for g in p.links)
    decode = "" if encoder else (f"decode [bold]{p.decode_tokens_per_s or 0:,.1f} tok/s[/bold] "
                                 f"({p.decode_step_s * 1e3:,.2f} ms per step), ")
    return [f"overall: {decode}{'encode' if encoder else 'prefill'} [bold]{p.prefill_tokens_per_s:,.0f} "
            f"tok/s[/bold] ({p.prefill_time_s:,.2f} s for {w.batch}×{w.context:,} tokens)"
            + (f"; links {links} GB/s" if p.links else "")
            + (f"; host link {p.host_link:g} GB/s" if p.host_link else ""),
            f"bottleneck ({p.bottleneck.limit}): {escape(p.bottleneck.reason)}"]


def _holds(row: DeviceUsage) -> str:
    if row.share is not None:
        return f"{row.share['heads']} heads, {row.share['mlp']:.0%} MLP"
    extras = [u for u in row.units if not u.split(".")[-1].isdigit()]
    text = row.layer_ranges
    if extras:
        text += (" + " if text else "") + ", ".join(u.rsplit(".", 1)[-1] for u in extras)
    if row.expert_layers:
        text += (" + " if text else "") + f"experts of {number_ranges(row.expert_layers)}"
    return text or "—"


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.0f}" if seconds > 0 else "—"
