"""`rollback`: a training run goes back to a step; later checkpoints are kept aside (or deleted with --delete)."""

from __future__ import annotations

import click

from .output import fails_cleanly, print_json
from .tiers import MEMORY_DIR_HELP


@click.command("rollback")
@click.argument("run")
@click.option("--to", "step", type=int, required=True, help="The step to go back to (a committed checkpoint).")
@click.option("--delete", is_flag=True, help="Delete the later checkpoints instead of keeping them aside.")
@click.option("--remote", default=None, metavar="URL",
              help="The run's object store (the Checkpointer's remote=); its options come from --storage-option.")
@click.option("--memory-dir", default=None, help=MEMORY_DIR_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def rollback_command(run: str, step: int, delete: bool, remote: str | None, memory_dir: str | None,
                     as_json: bool) -> None:
    """Roll RUN (a Checkpointer root) back to STEP: the checkpoints committed after it are abandoned (local ones
    renamed abandoned-step-N-<commit>, kept unless --delete), this machine's memory snapshots of later steps are
    released, and the next resume() starts from STEP. Refused while the run is alive."""
    from ..train.rollback import roll_back

    done = roll_back(run, step, delete=delete, memory_dir=memory_dir, remote=remote)
    if as_json:
        print_json(done)
        return
    click.echo(f"rolled {run} back to step {step}: {len(done['abandoned'])} later checkpoint(s) "
               f"{'deleted' if delete else 'abandoned'}, {done['memory_snapshots_released']} memory snapshot(s) "
               "released")
    for entry in done["abandoned"]:
        click.echo(f"  step {entry['step']:>8}  " + (f"kept at {entry['kept_at']}" if entry["kept_at"] else "deleted"))
