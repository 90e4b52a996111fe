"""The processes a command runs on: this one alone, or every process of a torchrun launch (convert, verify, diff)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..ops.spread import ALONE, Team, under_torchrun


@contextmanager
def command_team() -> Iterator[Team]:
    """The launch's team under torchrun; otherwise this process alone, and torch is never imported."""
    if not under_torchrun():
        yield ALONE
        return
    from ..distributed.offline import launched_team  # torch: only for a launch

    with launched_team() as team:
        yield team
