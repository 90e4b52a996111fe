"""What every command shares: the consoles, --json printing, progress bars, and errors as exit code 2."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from ..errors import CheckpointError

# Piped output is not cut to 80 columns: long tensor names must survive grep and files.
console = Console(width=None if sys.stdout.isatty() else 240)
errors = Console(stderr=True)


def fails_cleanly(command: Callable[..., Any]) -> Callable[..., Any]:
    """Checkpoint errors become one line on stderr and exit code 2, never a traceback."""

    @wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except CheckpointError as exc:
            errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
            sys.exit(2)

    return wrapper


class CheckpointPath(click.Path):
    """A path argument that click leaves alone: the library says what is wrong with it (missing, a dangling link, a
    NUL byte) as a one-line CheckpointError. click's own check prints a usage block, or fails on a NUL byte."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value


def parse_storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """KEY=VALUE pairs as fsspec storage options: dotted keys nest, and values that read as JSON (true, 3, {...})
    are taken as such, others as strings."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--storage-option")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        *parents, last = key.split(".")
        level = options
        for part in parents:
            level = level.setdefault(part, {})
            if not isinstance(level, dict):
                raise click.BadParameter(f"{key!r} nests under a value that is not a group",
                                         param_hint="--storage-option")
        level[last] = value
    return options


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=_json_default))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.hex()
    return repr(value)


def byte_progress(label: str, total: int, *, enabled: bool) -> Progress:
    """A transfer-style bar on stderr, shown only on a terminal."""
    return Progress(TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                    console=errors, transient=True, disable=not enabled or not errors.is_terminal)


def number(value: float | None) -> str:
    """A statistic in a table cell: six significant digits, a dash when there is none."""
    return "—" if value is None else f"{value:.6g}"
