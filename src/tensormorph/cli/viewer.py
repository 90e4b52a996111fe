"""`view`: serve the browser viewer for one checkpoint, two to compare, or a training run's root (its steps listed
with the tiers that hold each, any of them opened beside the newest)."""

from __future__ import annotations

import secrets
import socket
import webbrowser
from pathlib import Path

import click
from rich.markup import escape

from ..extras import require
from ..storage import remote_defaults
from ..units import parse_size
from .output import CheckpointPath, console, fails_cleanly
from .tiers import MEMORY_DIR_HELP


@click.command("view")
@click.argument("paths", nargs=-1, required=True, type=CheckpointPath())
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on; beyond loopback, the page and API need the printed token.")
@click.option("--port", type=int, default=0, help="Port (default: a free one).")
@click.option("--rename", "renames", multiple=True, help="Align names for the diff view, as for diff.")
@click.option("--rules", "rule_sets", multiple=True,
              help="A rule set for the diff view, as for diff: 'flax-torch' or a JSON rule file.")
@click.option("--transpose", "transposes", multiple=True,
              help="Transpose side a's tensors for the diff view, as for diff ('re:.*kernel$'; 'b:' for side b).")
@click.option("--read-budget", default="2GiB", show_default=True,
              help="Full reads above this ask for confirmation in the page.")
@click.option("--cache-size", default="256MiB", show_default=True,
              help="Disk space for cached exact tiles (least recently used ones go first).")
@click.option("--no-browser", is_flag=True, help="Only print the URL (for servers).")
@click.option("--memory-dir", default=None, help=f"For a training run: {MEMORY_DIR_HELP}")
@click.option("--remote", default=None, metavar="URL",
              help="For a training run: its object store (the Checkpointer's remote=), listed and opened too.")
@fails_cleanly
def view_command(paths: tuple[str, ...], host: str, port: int, renames: tuple[str, ...], rule_sets: tuple[str, ...],
                 transposes: tuple[str, ...], read_budget: str, cache_size: str, no_browser: bool,
                 memory_dir: str | None, remote: str | None) -> None:
    """Open one checkpoint (or two, to diff them) in the browser viewer. A training run's root (a Checkpointer's
    folder) opens its newest checkpoint, with a panel listing every step and the tiers that hold it."""
    # imported here, and named when missing: the other commands start without the server's packages
    uvicorn = require("uvicorn", None, feature="tensormorph view")
    require("starlette", None, feature="tensormorph view")
    from ..server import create_app, default_cache_dir
    from ..server_guard import is_loopback
    from ..server_run import RunView, is_run

    if len(paths) > 2:
        raise click.UsageError("view takes one checkpoint, or two to compare")
    # the object store's options are --storage-option's, handed over: the listing runs in the server's threads
    run = RunView(Path(paths[0]), memory_dir, remote, parse_size(read_budget), remote_defaults().storage_options) \
        if len(paths) == 1 and is_run(paths[0]) else None
    if run is None and (memory_dir or remote):
        raise click.UsageError("--memory-dir and --remote are for a training run's root (a Checkpointer's folder)")
    opened: list[str | Path] = [str(run.newest())] if run is not None else list(paths)
    host = host.strip("[]")
    token = None if is_loopback(host) else secrets.token_urlsafe(16)
    if port == 0:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            try:
                probe.bind((host, 0))
            except OSError as exc:  # an unknown name, an address of no interface here
                raise click.BadParameter(f"cannot listen on {host!r}: {exc.strerror or exc}",
                                         param_hint="--host") from None
            port = probe.getsockname()[1]
    app = create_app(opened, host=host, token=token, rename=list(renames), cache_dir=default_cache_dir(),
                     cache_bytes=parse_size(cache_size), read_budget=parse_size(read_budget), run=run,
                     rules=list(rule_sets), transpose=list(transposes))
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/" + (f"?token={token}" if token else "")
    if run is not None:
        console.print(f"Training run {escape(str(run.root))}: opened {escape(str(opened[0]))}", highlight=False)
    console.print(f"Tensormorph viewer on [bold]{url}[/bold]  (Ctrl+C to stop)")
    if not no_browser:
        webbrowser.open(url)
    uvicorn.run(app, host=host, port=port, log_level="warning")
