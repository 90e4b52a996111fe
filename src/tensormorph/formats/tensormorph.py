"""The Tensormorph format's reader: an adapter over the `tensormorph.tmformat` package."""

from __future__ import annotations

from ..core import Checkpoint
from ..storage import AnyPath
from ..tmformat.checkpoint import checksum_problems, is_checkpoint_folder, open_folder, root_of
from ..tmformat.manifest import FORMAT
from .contract import Detection

__all__ = ["NAME", "checksum_problems", "detect", "open"]

NAME = FORMAT


def detect(path: AnyPath) -> Detection | None:
    return Detection(path, root_of(path)) if is_checkpoint_folder(path) else None


def open(detection: Detection) -> Checkpoint:
    return open_folder(detection.found or detection.path)
