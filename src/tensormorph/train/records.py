"""What each save cost the run, kept beside its checkpoints: one JSON line per save in the root's SAVES_FILE.

A checkpoint's manifest is written before its save is over (the commit is part of it), so the time to durable
and the training steps' wait for the background copy cannot go into it. Rank 0 appends each finished save's
timing here, when the next save begins or the Checkpointer closes; `tensormorph history` shows them per step.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from .staging import SaveTiming

__all__ = ["SAVES_FILE", "append_saves"]

SAVES_FILE = ".tensormorph-saves.jsonl"  # in a local run root (ops/history.py reads it under the same name)


def append_saves(root: Path, timings: Iterable[SaveTiming]) -> None:
    """Append one line per finished save (never through a link: the root is the user's folder)."""
    lines = [json.dumps({"step": t.step, "tiers": list(t.tiers), "blocked_s": t.blocked_s, "durable_s": t.durable_s,
                         "memory_s": t.memory_s, "peer_s": t.peer_s}) + "\n" for t in timings]
    if not lines:
        return
    # never through a link, and never waiting on a FIFO planted there: anything but a regular file is refused
    descriptor = os.open(root / SAVES_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK, 0o644)
    with os.fdopen(descriptor, "a") as handle:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise OSError(f"{root / SAVES_FILE} is not a regular file")
        handle.write("".join(lines))
