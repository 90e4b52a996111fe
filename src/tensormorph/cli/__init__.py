"""The `tensormorph` command: thin over the library (parse, call, print), one module per command family.

Paths are `CheckpointPath`s, unchecked by click: the library says what is wrong with one as a CheckpointError, one
line and exit 2 like every other error.
"""

from __future__ import annotations

import click

from ..storage import remote_options
from .compare import diff_command
from .convert import convert_command
from .history import history_command
from .integrity import repair_command, verify_command
from .measure import measure_command
from .output import parse_storage_options
from .pictures import heatmap_command
from .plan import plan_command
from .rollback import rollback_command
from .tensors import inspect, show, stats
from .tiers import list_command, tiers_command
from .viewer import view_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tensormorph")
@click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
              help="An fsspec storage option for URLs (repeatable; dotted keys nest: "
                   "client_kwargs.endpoint_url=http://127.0.0.1:9000). Credentials also come from the environment.")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Folder of the on-disk cache of remote bytes (default: $TENSORMORPH_CACHE or "
                   "~/.cache/tensormorph).")
@click.option("--no-cache", is_flag=True, help="Read remote checkpoints without the on-disk cache.")
@click.pass_context
def main(ctx: click.Context, storage_options: tuple[str, ...], cache_dir: str | None, no_cache: bool) -> None:
    """Open any sharded model checkpoint as one logical checkpoint: a local path, or a URL (s3://, gs://, az://,
    https://, any fsspec protocol)."""
    options = parse_storage_options(storage_options)
    ctx.with_resource(remote_options(options or None, False if no_cache else cache_dir or True))


for _command in (inspect, show, stats, diff_command, verify_command, repair_command, convert_command, view_command,
                 plan_command, measure_command, list_command, tiers_command, history_command, rollback_command,
                 heatmap_command):
    main.add_command(_command)

__all__ = ["main"]
