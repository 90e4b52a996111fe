"""`diff`: compare the logical tensors of two checkpoints."""

from __future__ import annotations

import sys

import click
from rich.markup import escape
from rich.table import Table

from ..formats import open_checkpoint
from ..ops.diff import diff
from .output import CheckpointPath, byte_progress, console, fails_cleanly, number, print_json
from .spread import command_team

_STATUS_STYLE = {"equal": "[green]equal[/green]", "close": "[green]close[/green]", "different": "[red]different[/red]",
                 "shape_mismatch": "[red]shape_mismatch[/red]", "dtype_mismatch": "[yellow]dtype_mismatch[/yellow]",
                 "only_a": "[yellow]only_a[/yellow]", "only_b": "[yellow]only_b[/yellow]"}


@click.command("diff")
@click.argument("a", type=CheckpointPath())
@click.argument("b", type=CheckpointPath())
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance (times |b|).")
@click.option("--rename", "renames", multiple=True,
              help="Align names on both sides: 'PREFIX=NEW' (e.g. 'model.=' strips model.) or 're:PATTERN=REPL'.")
@click.option("--transpose", "transposes", multiple=True,
              help="Transpose side a's tensors whose name (after renaming) matches: 're:.*kernel$' swaps 2-D ones, "
                   "'re:PATTERN=3,2,0,1' permutes 4-D ones; 'b:' for side b.")
@click.option("--rules", "rule_sets", multiple=True,
              help="A rule set applied before --rename: 'flax-torch' (Flax vs transformers' torch naming) or a JSON "
                   "file of {\"rename\": ...} and {\"transpose\": ...} rules.")
@click.option("--all", "show_all", is_flag=True, help="List equal tensors too.")
@click.option("--common-only", is_flag=True,
              help="Compare only names both sides hold (weights vs a training checkpoint).")
@click.option("--heatmap", "heatmap_name", default=None, metavar="NAME",
              help="Instead of the table, draw a − b of tensor NAME into the picture -o names (PNG or SVG).")
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False), help="The picture --heatmap draws.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def diff_command(a: str, b: str, atol: float, rtol: float, renames: tuple[str, ...], transposes: tuple[str, ...],
                 rule_sets: tuple[str, ...], show_all: bool, common_only: bool, heatmap_name: str | None,
                 output: str | None, as_json: bool) -> None:
    """Compare the logical tensors of two checkpoints (exit 0 same, 1 different, 2 error). Under torchrun, the
    processes share the tensors, and rank 0 prints."""
    if (heatmap_name is None) != (output is None):
        raise click.UsageError("--heatmap NAME and -o FILE go together")
    if heatmap_name is not None and output is not None:
        _draw_difference(a, b, heatmap_name, output, as_json)
        return
    with (command_team() as team, open_checkpoint(a) as ck_a, open_checkpoint(b) as ck_b,
          byte_progress("diff", ck_b.nbytes, enabled=not as_json and team.rank == 0) as progress):
        # under torchrun the bar counts rank 0's share: its total is not known here
        task = progress.add_task("diff", total=ck_b.nbytes if team.world == 1 else None)
        report = diff(ck_a, ck_b, atol=atol, rtol=rtol, rename=list(renames), transpose=list(transposes),
                      rules=list(rule_sets), common_only=common_only, progress=lambda n: progress.advance(task, n),
                      team=team)
    if team.rank != 0:  # every process holds the whole report: the same exit status everywhere
        sys.exit(0 if report.identical else 1)
    if as_json:
        print_json(report.to_dict())
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
            table.add_row(escape(t.name), _STATUS_STYLE.get(t.status, t.status), dtype, shape, number(t.max_abs),
                          number(t.max_rel), number(t.rel_l2), number(t.cosine),
                          f"{t.mismatches:,} ({t.mismatch_fraction:.2%})" if t.mismatches else "",
                          str(list(t.worst_index)) if t.worst_index is not None else "")
        console.print(table)
    for o in report.objects:
        if o.status != "equal":
            console.print(f"object [bold]{escape(o.name)}[/bold]: {o.status} {escape(o.detail)}", highlight=False)
    if report.renames:  # as given: a rule set by its name, not the rules it holds
        console.print(f"[dim]rules: {escape(', '.join([*rule_sets, *renames, *transposes]))}[/dim]")
    counts = ", ".join(f"{n} {status}" for status, n in report.counts.items())
    verdict = "[green]same[/green]" if report.identical else "[red]different[/red]"
    console.print(f"{verdict}: {len(report.tensors)} tensors compared ({counts}); atol={atol} rtol={rtol}")
    sys.exit(0 if report.identical else 1)


def _draw_difference(a: str, b: str, name: str, output: str, as_json: bool) -> None:
    """The viewer's diff heatmap of a − b for one tensor, as a picture (pictures.py)."""
    from ..pictures import diff_heatmap, picture_path

    picture_path(output)  # a wrong suffix fails before any tensor is read
    picture = diff_heatmap(a, b, name)
    written = picture.save(output)
    if as_json:
        print_json({"output": str(written), "title": picture.title, "cmap": picture.cmap, "norm": picture.scale.mode,
                    "lo": picture.scale.lo, "hi": picture.scale.hi})
        return
    console.print(f"wrote {escape(str(written))}: {escape(picture.title)}", highlight=False)


def _shape(shape: tuple[int, ...] | None) -> str:
    return "—" if shape is None else "×".join(map(str, shape)) or "scalar"
