"""`list` and `tiers clean`: a training run's checkpoints on each tier, and the release of the shared memory a
dead run left behind on this machine."""

from __future__ import annotations

import shutil
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from ..units import human_bytes
from .output import console, fails_cleanly, print_json

MEMORY_DIR_HELP = "Where memory snapshots live (default /dev/shm/tensormorph-<uid>, as the Checkpointer's memory_dir)."


@click.group("tiers")
def tiers_command() -> None:
    """A training run's tiers: `tiers clean` releases what a dead run left in this machine's memory."""


@click.command("list")
@click.argument("run")
@click.option("--memory-dir", default=None, help=MEMORY_DIR_HELP)
@click.option("--remote", default=None, metavar="URL",
              help="The run's object store (the Checkpointer's remote=); its options come from --storage-option.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def list_command(run: str, memory_dir: str | None, remote: str | None, as_json: bool) -> None:
    """Each step of RUN (a Checkpointer root) with the tiers that hold it: this machine's shared memory (the
    ranks' own snapshots and the copies peers hold), the local disk and the object store."""
    from ..train.listing import list_run

    listing = list_run(run, memory_dir=memory_dir, remote=remote)
    if as_json:
        print_json(listing.to_json())
        return
    ranks = listing.ranks
    console.print(f"[bold]{escape(run)}[/bold]  {listing.world_size} rank(s); memory: "
                  f"{escape(str(listing.memory_folder))} ({human_bytes(sum(r.nbytes for r in ranks))} in "
                  f"{len(ranks)} rank folder(s), {'alive' if listing.alive else 'no live process'})", highlight=False)
    if listing.remote_error:
        console.print(f"[yellow]object store not listed:[/yellow] {escape(listing.remote_error)}", highlight=False)
    table = Table(box=None, pad_edge=False)
    for column in ("step", "resumes from", "memory", "disk", *(("object store",) if remote else ())):
        table.add_column(column, justify="right" if column == "step" else "left")
    for step in listing.steps:
        held = [*step.memory, *step.copies]
        memory = ("complete" if step.memory_complete else f"ranks {held} only" if held else "-")
        if step.copies:
            memory += f" (ranks {list(step.copies)} from peers)"
        cells = [str(step.step), step.tiers[0] if step.tiers else "-", memory,
                 human_bytes(step.disk.size) if step.disk else "-"]
        if remote:
            cells.append(human_bytes(step.remote.size) if step.remote else "-")
        table.add_row(*cells)
    console.print(table)


def _run_state(run: str, memory_dir: str | None) -> tuple[Path, list]:
    from ..train.manager import CheckpointManager
    from ..train.memory import run_folder, survey

    manager = CheckpointManager(run, None)
    folder = run_folder(manager.root, memory_dir, manager.run_id())
    return folder, survey(folder) if folder.is_dir() else []


@tiers_command.command("clean")
@click.argument("run")
@click.option("--memory-dir", default=None, help=MEMORY_DIR_HELP)
@click.option("--force", is_flag=True, help="Release even when a process of the run still holds its snapshots.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def clean_command(run: str, memory_dir: str | None, force: bool, as_json: bool) -> None:
    """Release the shared memory that RUN's snapshots take on this machine (a dead run's)."""
    folder, ranks = _run_state(run, memory_dir)
    alive = [r for r in ranks if r.alive]
    if alive and not force:
        raise click.ClickException(f"{folder}: {len(alive)} rank(s) of the run are alive (their Checkpointer holds "
                                   "the snapshots); stop the run, or pass --force")
    freed = sum(r.nbytes for r in ranks)
    if folder.is_dir():
        shutil.rmtree(folder)
    if as_json:
        print_json({"run": run, "memory_folder": str(folder), "released_bytes": freed, "ranks": len(ranks)})
    else:
        click.echo(f"released {human_bytes(freed)} of {len(ranks)} rank(s) in {folder}")
