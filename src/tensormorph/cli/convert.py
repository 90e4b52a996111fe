"""`convert`: any checkpoint to a Hugging Face safetensors folder, or re-sharded into the Tensormorph format; either
into a local folder or to an object store's URL."""

from __future__ import annotations

import re
import sys

import click
from rich.markup import escape

from ..formats import open_checkpoint
from ..ops.convert import ConvertResult, convert
from ..units import human_bytes
from .output import CheckpointPath, byte_progress, console, fails_cleanly, print_json
from .spread import command_team

# commas between placements, not the ones inside a placement's parentheses
_PLACEMENT_SEPARATOR = re.compile(r",\s*(?![^()]*\))")


@click.command("convert")
@click.argument("source", type=CheckpointPath())
@click.argument("destination", type=CheckpointPath())
@click.option("--to", "target", type=click.Choice(["safetensors", "tensormorph"]), default="safetensors",
              show_default=True, help="safetensors: a Hugging Face folder; tensormorph: re-sharded for a mesh.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest shard file (HF units: GB = 10^9).")
@click.option("--world", "--mesh", "mesh", default="1", show_default=True,
              help="tensormorph: the world size (4) or mesh shape (2x2) to shard for.")
@click.option("--placements", default="Shard(0)", show_default=True,
              help="tensormorph: one placement per mesh dimension, comma-separated: 'Shard(0),Replicate()'.")
@click.option("--redundancy", help="tensormorph: Reed-Solomon parity 'rs(4,2)' or copies 'replicate:2'.")
@click.option("--dtype", help="Cast floating-point tensors: bf16, fp16, fp32.")
@click.option("--rename", "renames", multiple=True,
              help="Rename output tensors, as for diff: 'model.=' drops a prefix.")
@click.option("--no-check", is_flag=True, help="Skip diffing the output against the source.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@fails_cleanly
def convert_command(source: str, destination: str, target: str, max_shard_size: str, mesh: str, placements: str,
                    redundancy: str | None, dtype: str | None, renames: tuple[str, ...], no_check: bool,
                    as_json: bool) -> None:
    """Write any checkpoint as a Hugging Face safetensors folder, or re-shard it into the Tensormorph
    format for another world size and placement; streaming, then checked against the source. DESTINATION is a new
    local folder or a new prefix of an object store (s3://bucket/out). Under torchrun, the processes share the
    files to write (and the check), and rank 0 prints."""
    split = [p.strip() for p in _PLACEMENT_SEPARATOR.split(placements) if p.strip()]
    with (command_team() as team, open_checkpoint(source) as ck,
          byte_progress("convert", ck.nbytes, enabled=not as_json and team.rank == 0) as progress):
        # under torchrun the bar counts rank 0's share: its total is not known here
        task = progress.add_task("convert", total=ck.nbytes if team.world == 1 else None)
        result = convert(ck, destination, to=target, max_shard_size=max_shard_size, dtype=dtype,
                         rename=list(renames), mesh=mesh, placements=split, redundancy=redundancy,
                         check=not no_check, progress=lambda n: progress.advance(task, n), team=team)
    if team.rank == 0:
        _print_result(result, target, as_json)
    if result.check is not None and not result.check.identical:
        sys.exit(1)


def _print_result(result: ConvertResult, target: str, as_json: bool) -> None:
    check = result.check
    if as_json:
        print_json({"destination": str(result.destination), "files": result.files, "tensors": result.tensors,
                    "bytes_written": result.bytes_written, "skipped_objects": result.skipped_objects,
                    "check": check.to_dict() if check else None})
        return
    console.print(f"wrote {result.tensors} tensors, {human_bytes(result.bytes_written)} in {len(result.files)} "
                  f"file(s) to {escape(str(result.destination))}")
    if result.skipped_objects:
        why = "safetensors holds tensors only" if target == "safetensors" else "not plain data"
        console.print(f"[yellow]not written[/yellow] ({why}): "
                      f"{escape(', '.join(result.skipped_objects))}", highlight=False)
    if check is not None:
        verdict = "[green]matches the source[/green]" if check.identical else "[red]differs from the source[/red]"
        console.print(f"check: {verdict} ({', '.join(f'{n} {s}' for s, n in check.counts.items())})")
