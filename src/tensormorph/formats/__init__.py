"""Format readers: one module per format, each with `detect(path)` and `open(path)`.

Modules in this package are found automatically; each declares NAME and a
PRIORITY (lower is tried first, so specific formats win over generic ones).
Adding a format means adding one module here and nothing else.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
import pkgutil
from pathlib import Path
from types import ModuleType

from ..core import Checkpoint
from ..errors import CheckpointError, MissingFileError, UnknownFormatError


def readers() -> list[ModuleType]:
    """Every format module, in detection order."""
    modules = [importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)]
    return sorted((m for m in modules if hasattr(m, "detect") and hasattr(m, "NAME")), key=lambda m: m.PRIORITY)


@contextmanager
def _collection_paused() -> Iterator[None]:
    """Parsing builds hundreds of thousands of small objects and no cycles; the cyclic GC would only
    rescan them again and again (about a third of the time of opening a large DCP checkpoint)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def detect(path: str | Path) -> str | None:
    """The format name of the checkpoint at `path`, judged by content; None when unknown."""
    path = Path(path)
    for reader in readers():
        if reader.detect(path):
            return reader.NAME
    return None


def open_checkpoint(path: str | Path, format: str | None = None) -> Checkpoint:
    """Open a checkpoint file or folder as one logical checkpoint."""
    path = Path(path)
    if not path.exists():
        raise MissingFileError("no such file or folder", file=str(path))
    by_name = {r.NAME: r for r in readers()}
    if format is not None:
        if format not in by_name:
            raise UnknownFormatError(f"unknown format {format!r}; known: {', '.join(by_name)}", file=str(path))
        reader = by_name[format]
    else:
        name = detect(path)
        if name is None:
            raise UnknownFormatError(
                f"not a checkpoint any reader recognises (known formats: {', '.join(by_name)})", file=str(path))
        reader = by_name[name]
    try:
        with _collection_paused():
            return reader.open(path)
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError("structure is nested too deeply to read", file=str(path)) from None


def opened(source: str | Path | Checkpoint, stack: ExitStack) -> Checkpoint:
    """`source` itself when already open, else opened from its path and closed when `stack` unwinds."""
    return source if isinstance(source, Checkpoint) else stack.enter_context(open_checkpoint(source))
