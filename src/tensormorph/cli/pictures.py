"""`heatmap`: a tensor as a PNG or SVG picture, coloured as the viewer colours it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.markup import escape

from ..colormaps import NORMS, palette
from ..ops.tiles import AGGREGATES
from ..pictures import DEFAULT_SIZE, heatmap, picture_path
from .output import CheckpointPath, console, fails_cleanly, print_json


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' (or 'W×H') as (width, height)."""
    width, sep, height = text.lower().replace("×", "x").partition("x")
    try:
        if not sep:
            raise ValueError
        return int(width), int(height)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not WIDTHxHEIGHT (e.g. 1024x768)", param_hint="--size") from None


F = TypeVar("F", bound=Callable[..., Any])


def picture_options(command: F) -> F:
    """The viewer's display settings, shared by every command that draws a picture."""
    for option in reversed([
        click.option("--cmap", type=click.Choice(list(palette().tables)), default=None,
                     help="The viewer's colour map (default: viridis; diverging for a − b)."),
        click.option("--norm", type=click.Choice(NORMS), default=None,
                     help="Scale: linear (min/max), symmetric (±max), log |x|, clip (percentiles; default: "
                          "symmetric on the diverging map, else linear)."),
        click.option("--size", "size_text", default=f"{DEFAULT_SIZE[0]}x{DEFAULT_SIZE[1]}", show_default=True,
                     metavar="WxH", help="The largest picture, in pixels."),
    ]):
        command = option(command)
    return command


@click.command("heatmap")
@click.argument("path", type=CheckpointPath())
@click.argument("name")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="The picture to write: .png or .svg.")
@click.option("--region", default=None, help="Rows and columns of the 2-D view: '0:512, 0:1024'.")
@click.option("--rank", type=int, default=None, help="Draw only what this rank holds.")
@click.option("--axes", "axes_text", default=None, metavar="R,C",
              help="The tensor's axes drawn as rows and columns (default: the last two).")
@click.option("--fixed", "fixed_text", default=None, metavar="I,...",
              help="The index of each other axis, in order (default: 0).")
@click.option("--agg", type=click.Choice(["auto", *AGGREGATES]), default="auto", show_default=True,
              help="Block summary: auto is the mean on the diverging map, abs-max on the others (as the viewer).")
@click.option("--approximate", is_flag=True, help="A strided sample instead of exact block aggregates (fast).")
@picture_options
@click.option("--json", "as_json", is_flag=True, help="Print what was drawn as JSON.")
@fails_cleanly
def heatmap_command(path: str, name: str, output: str, region: str | None, rank: int | None, axes_text: str | None,
                    fixed_text: str | None, agg: str, approximate: bool, cmap: str | None, norm: str | None,
                    size_text: str, as_json: bool) -> None:
    """Draw tensor NAME of PATH into a PNG or SVG (-o) from the viewer's tiles, colour maps and scales."""
    picture_path(output)  # a wrong suffix fails before any tensor is read
    axes = _ints(axes_text, "--axes")
    if axes is not None and len(axes) != 2:
        raise click.BadParameter(f"{axes_text!r} is not two axes R,C", param_hint="--axes")
    picture = heatmap(path, name, region=region, rank=rank, cmap=cmap or "viridis", norm=norm, agg=agg,
                      size=parse_size(size_text), exact=not approximate, axes=(axes[0], axes[1]) if axes else None,
                      fixed=_ints(fixed_text, "--fixed") or ())
    written = picture.save(output)
    drawn = picture.tile
    assert drawn is not None  # a tensor's picture always has its tile
    if as_json:
        print_json({"output": str(written), "title": picture.title, "pixels": list(picture.pixels.shape[:2]),
                    "rows": list(drawn.rows), "cols": list(drawn.cols), "step": list(drawn.step),
                    "approximate": drawn.approximate, "cmap": picture.cmap, "norm": picture.scale.mode,
                    "lo": picture.scale.lo, "hi": picture.scale.hi, "nan": drawn.nan, "inf": drawn.inf})
        return
    height, width = picture.pixels.shape[:2]
    console.print(f"wrote {escape(str(written))}: {width}×{height} px, {escape(picture.title)}  "
                  f"[dim]{escape(picture.caption)}[/dim]", highlight=False)


def _ints(text: str | None, option: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not integers separated by commas", param_hint=option) from None
