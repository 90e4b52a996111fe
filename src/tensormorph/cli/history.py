"""`history`: a run's checkpoints in order, their health, metrics and how far each moved from the one before."""

from __future__ import annotations

import time

import click
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ..ops.history import CheckpointRecord, History, history
from ..pictures import drift_heatmap, picture_path
from ..units import human_bytes
from .output import CheckpointPath, console, errors, fails_cleanly, number, print_json
from .pictures import parse_size, picture_options

SPARK = "▁▂▃▄▅▆▇█"
STATUS_STYLE = {"committed": "green", "incomplete": "yellow", "damaged": "bold red", "abandoned": "dim"}
MAX_METRICS_SHOWN = 4  # metrics per row in the table (--json has them all)


@click.command("history")
@click.argument("run", type=CheckpointPath())
@click.option("--sample", type=click.IntRange(min=1), default=None, metavar="N",
              help="Read only N blocks of each tensor (the same ones every time): a quick estimate.")
@click.option("--no-cache", "no_cache", is_flag=True, help="Compute every pair afresh; read and write no cache.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Keep the drift cache in this folder instead of the run's folder (a URL's: the local cache folder).")
@click.option("--top", "top", type=click.IntRange(min=0), default=5, show_default=True,
              help="How many of the most-moved layers to list.")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), default=None,
              help="Also draw the drift as a picture (.png or .svg): a row per layer, a column per checkpoint.")
@picture_options
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def history_command(run: str, sample: int | None, no_cache: bool, cache_dir: str | None, top: int,
                    output: str | None, cmap: str | None, norm: str | None, size_text: str, as_json: bool) -> None:
    """RUN's checkpoints in order (a Checkpointer root, or any folder of checkpoints; local or an object store's
    URL): step, time, size, status by a quick verify, the metrics the run saved, and each one's drift from the one
    before, per layer (‖Δ‖/‖w‖, streamed), with the layers that moved most and the first NaN or infinity of each
    tensor."""
    size = parse_size(size_text)
    if output is not None:
        picture_path(output)  # a wrong suffix fails before the run is read
    with Progress(TextColumn("comparing checkpoints"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=errors, transient=True, disable=as_json or not errors.is_terminal) as bar:
        task = bar.add_task("pairs", total=None)
        result = history(run, sample=sample, cache=not no_cache, cache_dir=cache_dir,
                         progress=lambda done, total: bar.update(task, completed=done, total=total))
    written = None
    if output is not None:
        picture = drift_heatmap(result, cmap=cmap or "viridis", norm=norm or "linear", size=size)
        written = str(picture.save(output))
    if as_json:
        data = result.to_dict()
        data["most_moved"] = [list(m) for m in result.most_moved(top)]
        if written is not None:
            data["picture"] = written
        print_json(data)
        return
    _print(result, top)
    if written is not None:
        console.print(f"wrote {escape(written)}: drift per layer (rows) and checkpoint (columns)", highlight=False)


def _print(result: History, top: int) -> None:
    records = result.checkpoints
    console.print(f"[bold]{escape(result.run)}[/bold]  {len(records)} checkpoint(s)"
                  + (f"  [yellow]estimate: {result.sample} block(s) per tensor[/yellow]" if result.estimate else ""),
                  highlight=False)
    if not records:
        return
    scale = max((d.relative for r in records for d in r.drift or () if d.relative is not None), default=0.0)
    metrics = list(dict.fromkeys(k for r in records for k in r.metrics))[:MAX_METRICS_SHOWN]
    timed = any(r.blocked_s is not None for r in records)  # the Checkpointer recorded its saves
    table = Table(box=None, pad_edge=False)
    for column in ("step", "time", "size", "status", *(("blocked", "durable") if timed else ()), *metrics, "drift",
                   "per layer"):
        table.add_column(escape(column), justify="right" if column not in ("status", "per layer") else "left")
    for record in records:
        status = f"[{STATUS_STYLE[record.status]}]{record.status}[/]"
        if record.nonfinite:
            status += " [bold red]NaN/Inf[/]"
        table.add_row("—" if record.step is None else str(record.step),
                      time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.time)), human_bytes(record.size),
                      status, *((_seconds(record.blocked_s), _seconds(record.durable_s)) if timed else ()),
                      *(number(record.metrics.get(m)) for m in metrics),
                      number(record.total_drift) + ("*" if record.cached else ""), _sparkline(record, scale))
    console.print(table)
    notes = ["drift: ‖w − w_prev‖ / ‖w_prev‖ per layer (bars share one scale across the run)"]
    if result.cache_hits:
        notes.append(f"* from the cache ({result.cache_hits} pair(s); {result.computed} computed)")
    console.print("[dim]" + escape("; ".join(notes)) + "[/dim]", highlight=False)
    moved = result.most_moved(top)
    if moved:
        console.print("\n[bold]most-moved layers[/bold]")
        by_name = {r.name: r for r in records}
        for layer, name, drift in moved:
            record = by_name[name]
            before = by_name[record.previous] if record.previous else None
            console.print(f"  {escape(layer)}  {number(drift)}  (step {record.step} from step "
                          f"{before.step if before else '—'})", highlight=False)
    for found in result.first_nonfinite:
        console.print(f"[bold red]first NaN/Inf:[/bold red] {escape(found.tensor)} at step {found.step} "
                      f"({escape(found.checkpoint)}: {found.nans} NaN, {found.infs} infinite)", highlight=False)
    for record in records:
        for change in record.changes:
            console.print(f"[yellow]{change.kind} change:[/yellow] {escape(change.tensor)} at step {record.step}: "
                          f"{escape(str(change.before or '—'))} → {escape(str(change.after or '—'))}", highlight=False)
        if record.problem:
            console.print(f"[{STATUS_STYLE[record.status]}]{record.status}:[/] {escape(record.problem)}",
                          highlight=False)
    if result.cache_error:
        console.print(f"[yellow]cache not written:[/yellow] {escape(result.cache_error)}", highlight=False)


def _sparkline(record: CheckpointRecord, scale: float) -> str:
    """One bar per layer, in the model's order, on the run's common scale; · for a layer without a figure."""
    if not record.drift:
        return ""
    bars = []
    for layer in record.drift:
        if layer.relative is None or not scale:
            bars.append("·")
        else:
            bars.append(SPARK[min(len(SPARK) - 1, int(layer.relative / scale * len(SPARK)))])
    return "".join(bars)


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"
