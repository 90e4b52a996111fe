"""`list` and `tiers clean`: a training run's checkpoints on each tier, and the release of the shared memory a
dead run left behind on this machine."""

from __future__ import annotations

import shutil
from pathlib import Path

import click
from rich.markup import escape

from ..units import human_bytes
from .output import console, fails_cleanly, print_json

MEMORY_DIR_HELP = "Where memory snapshots live (default /dev/shm/tensormorph-<uid>, as the Checkpointer's memory_dir)."


@click.group("tiers")
def tiers_command() -> None:
    """A training run's tiers: `tiers clean` releases what a dead run left in this machine's memory."""


def _run_state(run: str, memory_dir: str | None) -> tuple[Path, list, list]:
    from ..train.manager import CheckpointManager
    from ..train.memory import run_folder, survey

    manager = CheckpointManager(run, None)
    folder = run_folder(manager.root, memory_dir, manager.run_id())
    return folder, survey(folder) if folder.is_dir() else [], manager.list()


@click.command("list")
@click.argument("run")
@click.option("--memory-dir", default=None, help=MEMORY_DIR_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def list_command(run: str, memory_dir: str | None, as_json: bool) -> None:
    """Each step of RUN (a Checkpointer root) with the tiers that hold it."""
    folder, ranks, disk = _run_state(run, memory_dir)
    steps = sorted({s for r in ranks for s in r.steps} | {i.step for i in disk})
    on_disk = {i.step for i in disk}
    rows = [{"step": step, "disk": step in on_disk,
             "memory": {"ranks": [r.rank for r in ranks if step in r.steps], "of": len(ranks)}} for step in steps]
    if as_json:
        print_json({"run": run, "memory_folder": str(folder), "steps": rows,
                    "ranks": [{"node": r.node, "rank": r.rank, "steps": list(r.steps), "bytes": r.nbytes,
                               "alive": r.alive} for r in ranks]})
        return
    console.print(f"[bold]{escape(run)}[/bold]  memory: {escape(str(folder))}"
                  f" ({human_bytes(sum(r.nbytes for r in ranks))} in {len(ranks)} rank(s),"
                  f" {'alive' if any(r.alive for r in ranks) else 'no live process'})", highlight=False)
    for row in rows:
        held = row["memory"]["ranks"]
        memory = "complete" if held and len(held) == len(ranks) else (f"ranks {held} only" if held else "-")
        click.echo(f"  step {row['step']:>8}  memory {memory:<20} disk {'yes' if row['disk'] else '-'}")


@tiers_command.command("clean")
@click.argument("run")
@click.option("--memory-dir", default=None, help=MEMORY_DIR_HELP)
@click.option("--force", is_flag=True, help="Release even when a process of the run still holds its snapshots.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def clean_command(run: str, memory_dir: str | None, force: bool, as_json: bool) -> None:
    """Release the shared memory that RUN's snapshots take on this machine (a dead run's)."""
    folder, ranks, _ = _run_state(run, memory_dir)
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
