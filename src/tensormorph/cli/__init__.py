"""The `tensormorph` command: thin over the library (parse, call, print), one module per command family.

Paths are `CheckpointPath`s, unchecked by click: the library says what is wrong with one as a CheckpointError, one
line and exit 2 like every other error.
"""

from __future__ import annotations

import click

from .compare import diff_command
from .convert import convert_command
from .integrity import repair_command, verify_command
from .plan import plan_command
from .tensors import inspect, show, stats
from .viewer import view_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tensormorph")
def main() -> None:
    """Open any sharded model checkpoint as one logical checkpoint."""


for _command in (inspect, show, stats, diff_command, verify_command, repair_command, convert_command, view_command,
                 plan_command):
    main.add_command(_command)

__all__ = ["main"]
