"""`view`: serve the browser viewer for one checkpoint, or two to compare."""

from __future__ import annotations

import secrets
import socket
import webbrowser

import click

from ..units import parse_size
from .output import console, fails_cleanly


@click.command("view")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", type=int, default=0, help="Port (default: a free one).")
@click.option("--rename", "renames", multiple=True, help="Align names for the diff view, as for diff.")
@click.option("--read-budget", default="2GiB", show_default=True,
              help="Full reads above this ask for confirmation in the page.")
@click.option("--no-browser", is_flag=True, help="Only print the URL (for servers).")
@fails_cleanly
def view_command(paths: tuple[str, ...], host: str, port: int, renames: tuple[str, ...], read_budget: str,
                 no_browser: bool) -> None:
    """Open one checkpoint (or two, to diff them) in the browser viewer."""
    # starlette and uvicorn come with the optional `web` extra: the other commands must run without them
    import uvicorn

    from ..server import create_app, default_cache_dir

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
