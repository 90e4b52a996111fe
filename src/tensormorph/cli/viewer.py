"""`view`: serve the browser viewer for one checkpoint, or two to compare."""

from __future__ import annotations

import secrets
import socket
import webbrowser

import click

from ..extras import require
from ..units import parse_size
from .output import CheckpointPath, console, fails_cleanly


@click.command("view")
@click.argument("paths", nargs=-1, required=True, type=CheckpointPath())
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to listen on; beyond loopback, the page and API need the printed token.")
@click.option("--port", type=int, default=0, help="Port (default: a free one).")
@click.option("--rename", "renames", multiple=True, help="Align names for the diff view, as for diff.")
@click.option("--read-budget", default="2GiB", show_default=True,
              help="Full reads above this ask for confirmation in the page.")
@click.option("--cache-size", default="256MiB", show_default=True,
              help="Disk space for cached exact tiles (least recently used ones go first).")
@click.option("--no-browser", is_flag=True, help="Only print the URL (for servers).")
@fails_cleanly
def view_command(paths: tuple[str, ...], host: str, port: int, renames: tuple[str, ...], read_budget: str,
                 cache_size: str, no_browser: bool) -> None:
    """Open one checkpoint (or two, to diff them) in the browser viewer."""
    # imported here, and named when missing: the other commands start without the server's packages
    uvicorn = require("uvicorn", None, feature="tensormorph view")
    require("starlette", None, feature="tensormorph view")
    from ..server import create_app, default_cache_dir
    from ..server_guard import is_loopback

    if len(paths) > 2:
        raise click.UsageError("view takes one checkpoint, or two to compare")
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
    app = create_app(list(paths), host=host, token=token, rename=list(renames), cache_dir=default_cache_dir(),
                     cache_bytes=parse_size(cache_size), read_budget=parse_size(read_budget))
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/" + (f"?token={token}" if token else "")
    console.print(f"Tensormorph viewer on [bold]{url}[/bold]  (Ctrl+C to stop)")
    if not no_browser:
        webbrowser.open(url)
    uvicorn.run(app, host=host, port=port, log_level="warning")
