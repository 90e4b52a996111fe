"""The `tensormorph` command: thin over the library (parse, call, print)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from contextlib import nullcontext
from functools import wraps
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from rich.tree import Tree

from . import open as open_checkpoint
from .core import human_bytes, parse_index
from .errors import CheckpointError
from .ops.convert import convert, parse_size
from .ops.diff import diff
from .ops.stats import checkpoint_stats
from .ops.summary import describe, split_description, totals_by_dtype
from .ops.tree import ModuleNode, module_tree
from .ops.verify import verify

# Piped output is not cut to 80 columns: long tensor names must survive grep and files.
console = Console(width=None if sys.stdout.isatty() else 240)
errors = Console(stderr=True)


def _fails_cleanly(command: Callable[..., Any]) -> Callable[..., Any]:
    """Checkpoint errors become one line on stderr and exit code 2, never a traceback."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except CheckpointError as exc:
            _print_error(exc)
            sys.exit(2)

    return wrapper


def _print_error(exc: CheckpointError) -> None:
    errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)


def _print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.hex()
    return repr(value)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tensormorph")
def main() -> None:
    """Open any sharded model checkpoint as one logical checkpoint."""


@main.command()
@click.argument("path", type=click.Path(exists=True))
@click.option("--format", "format_", help="Force a reader instead of detecting one.")
@click.option("--chunks", is_flag=True, help="List every chunk: offsets, shape, file, ranks.")
@click.option("--no-tree", is_flag=True, help="Skip the module tree.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@_fails_cleanly
def inspect(path: str, format_: str | None, chunks: bool, no_tree: bool, as_json: bool) -> None:
    """Show every tensor of a checkpoint: dtype, shape, size, how it is split."""
    with open_checkpoint(path, format_) as ck:
        if as_json:
            _print_json(describe(ck, chunks=True))
            return
        params = sum(t.numel for t in ck.values())
        console.print(f"[bold]{escape(str(ck.path))}[/bold]  format [cyan]{ck.format}[/cyan]  "
                      f"{len(ck)} tensors  {params:,} params  {human_bytes(ck.nbytes)}  {len(ck.files)} file(s)")
        for key, value in ck.metadata.items():
            if value not in (None, {}, []):
                console.print(f"[dim]{escape(key)}:[/dim] {escape(_short(value))}", highlight=False)
        rows = [("name", "dtype", "shape", "size", "split")]
        for tensor in ck.values():
            rows.append((tensor.name, tensor.dtype, "×".join(map(str, tensor.shape)) or "scalar",
                         human_bytes(tensor.nbytes), split_description(tensor)))
            if chunks:
                rows.extend((f"  {list(c.offsets)} +{list(c.shape)}", "", "", "", f"{c.file} ranks {list(c.ranks)}")
                            for c in tensor.chunks)
        click.echo(_columns(rows, right={3}))
        if ck.objects:
            console.print(f"[bold]{len(ck.objects)} non-tensor entries:[/bold] "
                          + escape(", ".join(list(ck.objects)[:20])) + (" ..." if len(ck.objects) > 20 else ""))
        totals = [("dtype", "tensors", "params", "size")]
        totals.extend((dtype, str(t["tensors"]), f"{t['params']:,}", human_bytes(t["nbytes"]))
                      for dtype, t in totals_by_dtype(ck).items())
        click.echo("\ntotals by dtype\n" + _columns(totals, right={1, 2, 3}))
        if not no_tree:
            console.print(_render_tree(module_tree(ck.values())))


def _columns(rows: list[tuple[str, ...]], right: set[int]) -> str:
    """Rows as aligned plain-text columns: fast for 20,000 tensors, where a rich Table takes seconds."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows)


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, default=repr, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + " ..."


def _render_tree(root: ModuleNode, max_depth: int = 6, max_nodes: int = 400) -> Tree:
    tree = Tree(f"[bold]model[/bold]  {root.params:,} params  {human_bytes(root.nbytes)}")
    shown = 0

    def add(parent: Tree, node: ModuleNode, depth: int) -> None:
        nonlocal shown
        for position, child in enumerate(node.children.values()):
            if shown >= max_nodes:
                parent.add(f"[dim]... {len(node.children) - position} more (see --json for the whole tree)[/dim]")
                return
            shown += 1
            label = escape(child.name) + (f" ×{child.repeat}" if child.repeat > 1 else "")
            badges = (" [magenta]⧉ sharded[/magenta]" if child.placement_sharded else "") + \
                     (" [blue]⎘ files[/blue]" if child.multi_file else "")
            if child.tensor is not None and not child.children:
                detail = f"{child.tensor.dtype} {list(child.tensor.shape)}"
            elif child.repeat > 1:
                detail = (f"{child.params:,} params {human_bytes(child.nbytes)} in all, "
                          f"{child.params // child.repeat:,} each")
            else:
                detail = f"{child.params:,} params {human_bytes(child.nbytes)}"
            branch = parent.add(f"{label}  [dim]{detail}[/dim]{badges}")
            if depth < max_depth:
                add(branch, child, depth + 1)

    add(tree, root, 1)
    return tree


@main.command()
@click.argument("path", type=click.Path(exists=True))
@click.argument("name")
@click.option("--slice", "slice_text", default="", help="Region to read, numpy style: '0:4, 100:108'.")
@click.option("--rank", type=int, help="Show only what this rank holds (its local chunk).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@_fails_cleanly
def show(path: str, name: str, slice_text: str, rank: int | None, as_json: bool) -> None:
    """Print a tensor's values, reading only the bytes needed."""
    with open_checkpoint(path) as ck:
        tensor = ck[name]
        index = parse_index(slice_text)
        values = tensor.local(rank)[index] if rank is not None else tensor.read(index)
        if as_json:
            _print_json({"name": name, "dtype": tensor.dtype, "shape": list(tensor.shape), "slice": slice_text,
                         "rank": rank, "values": values.astype(np.float64).tolist()
                         if values.dtype.kind not in "biu" else values.tolist()})
            return
        console.print(f"[bold]{escape(name)}[/bold] {tensor.dtype} {list(tensor.shape)}  "
                      f"[dim]{split_description(tensor)}[/dim]"
                      + (f"  rank {rank}" if rank is not None else "") + (f"  {escape(f'[{slice_text}]')}" if slice_text else ""))
        with np.printoptions(threshold=400, edgeitems=4, linewidth=console.width or 120):
            console.print(str(values), highlight=False, markup=False)


@main.command()
@click.argument("path", type=click.Path(exists=True))
@click.argument("names", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@_fails_cleanly
def stats(path: str, names: tuple[str, ...], as_json: bool) -> None:
    """Stream min/max/mean/std/abs-max, zero fraction and NaN/Inf counts."""
    with open_checkpoint(path) as ck:
        tensors = [ck[n] for n in names] if names else list(ck.values())
        total = sum(t.nbytes for t in tensors)
        with _byte_progress("stats", total, enabled=not as_json) as progress:
            task = progress.add_task("stats", total=total)
            results = checkpoint_stats(tensors, progress=lambda n: progress.advance(task, n))
        if as_json:
            _print_json([r.to_dict() for r in results])
            return
        table = Table(box=None, header_style="bold")
        for column in ("name", "dtype", "min", "max", "mean", "std", "abs max", "zeros", "nan", "inf"):
            table.add_column(column, justify="left" if column in ("name", "dtype") else "right")
        for r in results:
            table.add_row(escape(r.name), r.dtype, _num(r.min), _num(r.max), _num(r.mean), _num(r.std), _num(r.abs_max),
                          f"{r.zero_fraction:.2%}", str(r.nans), str(r.infs))
        console.print(table)


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.6g}"


def _byte_progress(label: str, total: int, *, enabled: bool) -> Progress:
    """A transfer-style bar on stderr, shown only on a terminal."""
    return Progress(TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                    console=errors, transient=True, disable=not enabled or not errors.is_terminal)


@main.command("diff")
@click.argument("a", type=click.Path(exists=True))
@click.argument("b", type=click.Path(exists=True))
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance (times |b|).")
@click.option("--rename", "renames", multiple=True,
              help="Align names on both sides: 'PREFIX=NEW' (e.g. 'model.=' strips model.) or 're:PATTERN=REPL'.")
@click.option("--all", "show_all", is_flag=True, help="List equal tensors too.")
@click.option("--common-only", is_flag=True, help="Compare only names both sides hold (weights vs a training checkpoint).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def diff_command(a: str, b: str, atol: float, rtol: float, renames: tuple[str, ...], show_all: bool,
                 common_only: bool, as_json: bool) -> None:
    """Compare the logical tensors of two checkpoints (exit 0 same, 1 different, 2 error)."""
    try:
        with open_checkpoint(a) as ck_a, open_checkpoint(b) as ck_b:
            with _byte_progress("diff", ck_b.nbytes, enabled=not as_json) as progress:
                task = progress.add_task("diff", total=ck_b.nbytes)
                report = diff(ck_a, ck_b, atol=atol, rtol=rtol, rename=list(renames), common_only=common_only,
                              progress=lambda n: progress.advance(task, n))
    except CheckpointError as exc:
        _print_error(exc)
        sys.exit(2)
    if as_json:
        _print_json(report.to_dict())
        sys.exit(0 if report.identical else 1)
    rows = report.tensors if show_all else report.changed()
    if rows:
        table = Table(box=None, header_style="bold")
        for column in ("name", "status", "dtype", "shape", "max abs", "max rel", "rel l2", "cosine", "outside tol",
                       "worst at"):
            table.add_column(column, justify="left" if column in ("name", "status", "dtype", "shape") else "right")
        for t in rows:
            dtype = t.dtype_a if t.dtype_a == t.dtype_b else f"{t.dtype_a or '—'}→{t.dtype_b or '—'}"
            shape = _shape(t.shape_a) if t.shape_a == t.shape_b else f"{_shape(t.shape_a)}→{_shape(t.shape_b)}"
            table.add_row(escape(t.name), _STATUS_STYLE.get(t.status, t.status), dtype, shape, _num(t.max_abs),
                          _num(t.max_rel), _num(t.rel_l2), _num(t.cosine),
                          f"{t.mismatches:,} ({t.mismatch_fraction:.2%})" if t.mismatches else "",
                          str(list(t.worst_index)) if t.worst_index is not None else "")
        console.print(table)
    for o in report.objects:
        if o.status != "equal":
            console.print(f"object [bold]{escape(o.name)}[/bold]: {o.status} {escape(o.detail)}", highlight=False)
    if report.renames:
        console.print(f"[dim]rename rules: {escape(', '.join(report.renames))}[/dim]")
    counts = ", ".join(f"{n} {status}" for status, n in report.counts.items())
    verdict = "[green]same[/green]" if report.identical else "[red]different[/red]"
    console.print(f"{verdict}: {len(report.tensors)} tensors compared ({counts}); atol={atol} rtol={rtol}")
    sys.exit(0 if report.identical else 1)


_STATUS_STYLE = {"equal": "[green]equal[/green]", "close": "[green]close[/green]", "different": "[red]different[/red]",
                 "shape_mismatch": "[red]shape_mismatch[/red]", "dtype_mismatch": "[yellow]dtype_mismatch[/yellow]",
                 "only_a": "[yellow]only_a[/yellow]", "only_b": "[yellow]only_b[/yellow]"}


def _shape(shape: tuple[int, ...] | None) -> str:
    return "—" if shape is None else "×".join(map(str, shape)) or "scalar"


@main.command("verify")
@click.argument("path", type=click.Path(exists=True))
@click.option("--full", is_flag=True, help="Also read every byte and report NaN/Inf.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def verify_command(path: str, full: bool, as_json: bool) -> None:
    """Check layout, files, byte ranges and checksums (exit 0 fine, 1 problems, 2 could not run)."""
    try:
        with _byte_progress("verify", 0, enabled=full and not as_json) as progress:
            task = progress.add_task("verify", total=None)
            report = verify(path, full=full, progress=lambda n: progress.advance(task, n))
    except CheckpointError as exc:
        _print_error(exc)
        sys.exit(2)
    if as_json:
        _print_json(report.to_dict())
    else:
        for problem in report.problems:
            where = ": ".join(part for part in (problem.file, problem.tensor and f"tensor {problem.tensor!r}") if part)
            console.print(f"[red]{problem.kind}[/red] {escape(where)}: {escape(problem.message)}", highlight=False,
                          soft_wrap=True)
        detail = f"{report.tensors} tensors, {report.files} files, {report.checksums_checked} checksums"
        if full:
            detail += f", {human_bytes(report.bytes_read)} read"
        verdict = "[green]ok[/green]" if report.ok else f"[red]{len(report.problems)} problem(s)[/red]"
        console.print(f"{verdict}: {escape(report.path)} ({report.format or 'unreadable'}; {detail})")
    sys.exit(0 if report.ok else 1)


@main.command("repair")
@click.argument("path", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@_fails_cleanly
def repair_command(path: str, as_json: bool) -> None:
    """Rebuild the damaged files of a Tensormorph checkpoint from its parity or copies, then verify it."""
    from .ops.repair import repair

    with console.status("repairing", spinner="dots") if not as_json else nullcontext():
        report = repair(path)
    if as_json:
        _print_json(report.to_dict())
    else:
        for name in report.repaired:
            console.print(f"[green]rebuilt[/green] {escape(name)} from {report.scheme}")
        for name, why in report.unrecoverable.items():
            console.print(f"[red]unrecoverable[/red] {escape(name)}: {escape(why)}", highlight=False)
        if not report.repaired and not report.unrecoverable:
            console.print("nothing to repair: every file matches its checksum")
        verdict = "[green]ok[/green]" if report.ok else "[red]still damaged[/red]"
        console.print(f"{verdict}: {escape(report.path)}")
    sys.exit(0 if report.ok else 1)


@main.command("convert")
@click.argument("source", type=click.Path(exists=True))
@click.argument("destination", type=click.Path())
@click.option("--to", "target", type=click.Choice(["safetensors", "tensormorph"]), default="safetensors",
              show_default=True, help="safetensors: a Hugging Face folder; tensormorph: re-sharded for a mesh.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest shard file (HF units: GB = 10^9).")
@click.option("--world", "--mesh", "mesh", default="1", show_default=True,
              help="tensormorph: the world size (4) or mesh shape (2x2) to shard for.")
@click.option("--placements", default="Shard(0)", show_default=True,
              help="tensormorph: one placement per mesh dimension, comma-separated: 'Shard(0),Replicate()'.")
@click.option("--redundancy", help="tensormorph: Reed-Solomon parity 'rs(4,2)' or copies 'replicate:2'.")
@click.option("--dtype", help="Cast floating-point tensors: bf16, fp16, fp32.")
@click.option("--rename", "renames", multiple=True, help="Rename output tensors, as for diff: 'model.=' drops a prefix.")
@click.option("--no-check", is_flag=True, help="Skip diffing the output against the source.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@_fails_cleanly
def convert_command(source: str, destination: str, target: str, max_shard_size: str, mesh: str, placements: str,
                    redundancy: str | None, dtype: str | None, renames: tuple[str, ...], no_check: bool, as_json: bool) -> None:
    """Write any checkpoint as a Hugging Face safetensors folder, or re-shard it into the Tensormorph
    format for another world size and placement; streaming, then checked against the source."""
    split = [p.strip() for p in re.split(r",\s*(?![^()]*\))", placements) if p.strip()]
    with open_checkpoint(source) as ck:
        with _byte_progress("convert", ck.nbytes, enabled=not as_json) as progress:
            task = progress.add_task("convert", total=ck.nbytes)
            result = convert(ck, destination, to=target, max_shard_size=max_shard_size, dtype=dtype,
                             rename=list(renames), mesh=mesh, placements=split, redundancy=redundancy,
                             check=not no_check,
                             progress=lambda n: progress.advance(task, n))
    check = result.check
    if as_json:
        _print_json({"destination": str(result.destination), "files": result.files, "tensors": result.tensors,
                     "bytes_written": result.bytes_written, "skipped_objects": result.skipped_objects,
                     "check": check.to_dict() if check else None})
    else:
        console.print(f"wrote {result.tensors} tensors, {human_bytes(result.bytes_written)} in {len(result.files)} "
                      f"file(s) to {escape(str(result.destination))}")
        if result.skipped_objects:
            why = "safetensors holds tensors only" if target == "safetensors" else "not plain data"
            console.print(f"[yellow]not written[/yellow] ({why}): "
                          f"{escape(', '.join(result.skipped_objects))}", highlight=False)
        if check is not None:
            verdict = "[green]matches the source[/green]" if check.identical else "[red]differs from the source[/red]"
            console.print(f"check: {verdict} ({', '.join(f'{n} {s}' for s, n in check.counts.items())})")
    if check is not None and not check.identical:
        sys.exit(1)


@main.command("view")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", type=int, default=0, help="Port (default: a free one).")
@click.option("--rename", "renames", multiple=True, help="Align names for the diff view, as for diff.")
@click.option("--read-budget", default="2GiB", show_default=True,
              help="Full reads above this ask for confirmation in the page.")
@click.option("--no-browser", is_flag=True, help="Only print the URL (for servers).")
@_fails_cleanly
def view_command(paths: tuple[str, ...], host: str, port: int, renames: tuple[str, ...], read_budget: str,
                 no_browser: bool) -> None:
    """Open one checkpoint (or two, to diff them) in the browser viewer."""
    import secrets
    import socket
    import webbrowser

    import uvicorn

    from .server import create_app, default_cache_dir

    if len(paths) > 2:
        raise click.UsageError("view takes one checkpoint, or two to compare")
    loopback = host in ("127.0.0.1", "localhost", "::1")
    token = None if loopback else secrets.token_urlsafe(16)
    if port == 0:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    app = create_app(list(paths), token=token, rename=list(renames), cache_dir=default_cache_dir(),
                     read_budget=parse_size(read_budget))
    url = f"http://{'127.0.0.1' if loopback else host}:{port}/" + (f"?token={token}" if token else "")
    console.print(f"Tensormorph viewer on [bold]{url}[/bold]  (Ctrl+C to stop)")
    if not no_browser:
        webbrowser.open(url)
    uvicorn.run(app, host=host, port=port, log_level="warning")


from .planner.cli import plan_command  # noqa: E402  (the planner's command lives with the planner)

main.add_command(plan_command)


if __name__ == "__main__":
    main()
