"""`verify` (layout, files, byte ranges, checksums) and `repair` (rebuild damaged files from parity or copies)."""

from __future__ import annotations

import sys
from contextlib import nullcontext

import click
from rich.markup import escape

from ..ops.repair import repair
from ..ops.verify import verify
from ..units import human_bytes
from .output import CheckpointPath, byte_progress, console, fails_cleanly, print_json
from .spread import command_team


@click.command("verify")
@click.argument("path", type=CheckpointPath())
@click.option("--full", is_flag=True, help="Also read every byte and report NaN/Inf.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def verify_command(path: str, full: bool, as_json: bool) -> None:
    """Check layout, files, byte ranges and checksums (exit 0 fine, 1 problems, 2 could not run). Under torchrun,
    the processes share the work, and rank 0 prints."""
    with (command_team() as team,
          byte_progress("verify", 0, enabled=full and not as_json and team.rank == 0) as progress):
        task = progress.add_task("verify", total=None)
        report = verify(path, full=full, progress=lambda n: progress.advance(task, n), team=team)
    if team.rank != 0:  # every process holds the whole report: the same exit status everywhere
        sys.exit(0 if report.ok else 1)
    if as_json:
        print_json(report.to_dict())
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


@click.command("repair")
@click.argument("path", type=CheckpointPath())
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def repair_command(path: str, as_json: bool) -> None:
    """Rebuild the damaged files of a Tensormorph checkpoint from its parity or copies, then verify it."""
    with console.status("repairing", spinner="dots") if not as_json else nullcontext():
        report = repair(path)
    if as_json:
        print_json(report.to_dict())
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
