"""The `tensormorph` command: thin over the library (parse, call, print)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from rich.tree import Tree

from . import open as open_checkpoint
from .core import human_bytes, parse_index
from .errors import CheckpointError
from .ops.stats import checkpoint_stats
from .ops.summary import describe, split_description
from .ops.tree import ModuleNode, module_tree

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
            errors.print(f"[red]error:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
            sys.exit(2)

    return wrapper


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
        summary = describe(ck, chunks=chunks or as_json)
        if as_json:
            _print_json(summary)
            return
        console.print(f"[bold]{ck.path}[/bold]  format [cyan]{ck.format}[/cyan]  "
                      f"{len(ck)} tensors  {summary['params']:,} params  {human_bytes(ck.nbytes)}  "
                      f"{len(ck.files)} file(s)")
        for key, value in ck.metadata.items():
            if value not in (None, {}, []):
                console.print(f"[dim]{key}:[/dim] {_short(value)}", highlight=False)
        table = Table(box=None, header_style="bold")
        for column in ("name", "dtype", "shape", "size", "split"):
            table.add_column(column, justify="right" if column == "size" else "left")
        for tensor in ck.values():
            table.add_row(tensor.name, tensor.dtype, "×".join(map(str, tensor.shape)) or "scalar",
                          human_bytes(tensor.nbytes), split_description(tensor))
            if chunks:
                for c in tensor.chunks:
                    table.add_row(f"  [dim]{list(c.offsets)} +{list(c.shape)}[/dim]", "", "", "",
                                  f"[dim]{c.file} ranks {list(c.ranks)}[/dim]")
        console.print(table)
        if ck.objects:
            console.print(f"[bold]{len(ck.objects)} non-tensor entries:[/bold] "
                          + ", ".join(list(ck.objects)[:20]) + (" ..." if len(ck.objects) > 20 else ""))
        dtype_table = Table(title="totals by dtype", box=None, header_style="bold")
        for column in ("dtype", "tensors", "params", "size"):
            dtype_table.add_column(column, justify="left" if column == "dtype" else "right")
        for dtype, totals in summary["totals_by_dtype"].items():
            dtype_table.add_row(dtype, str(totals["tensors"]), f"{totals['params']:,}", human_bytes(totals["nbytes"]))
        console.print(dtype_table)
        if not no_tree:
            console.print(_render_tree(module_tree(ck.values())))


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[:limit] + " ..."


def _render_tree(root: ModuleNode, max_depth: int = 6) -> Tree:
    tree = Tree(f"[bold]model[/bold]  {root.params:,} params  {human_bytes(root.nbytes)}")

    def add(parent: Tree, node: ModuleNode, depth: int) -> None:
        for child in node.children.values():
            label = child.name + (f" ×{child.repeat}" if child.repeat > 1 else "")
            badges = (" [magenta]⧉ sharded[/magenta]" if child.placement_sharded else "") + \
                     (" [blue]⎘ files[/blue]" if child.multi_file else "")
            if child.tensor is not None and not child.children:
                detail = f"{child.tensor.dtype} {list(child.tensor.shape)}"
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
        console.print(f"[bold]{name}[/bold] {tensor.dtype} {list(tensor.shape)}  "
                      f"[dim]{split_description(tensor)}[/dim]"
                      + (f"  rank {rank}" if rank is not None else "") + (f"  [{slice_text}]" if slice_text else ""))
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
        with Progress(TextColumn("stats"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=errors, transient=True,
                      disable=as_json or not errors.is_terminal) as progress:
            task = progress.add_task("stats", total=total)
            results = checkpoint_stats(tensors, progress=lambda n: progress.advance(task, n))
        if as_json:
            _print_json([r.to_dict() for r in results])
            return
        table = Table(box=None, header_style="bold")
        for column in ("name", "dtype", "min", "max", "mean", "std", "abs max", "zeros", "nan", "inf"):
            table.add_column(column, justify="left" if column in ("name", "dtype") else "right")
        for r in results:
            table.add_row(r.name, r.dtype, _num(r.min), _num(r.max), _num(r.mean), _num(r.std), _num(r.abs_max),
                          f"{r.zero_fraction:.2%}", str(r.nans), str(r.infs))
        console.print(table)


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.6g}"


if __name__ == "__main__":
    main()
