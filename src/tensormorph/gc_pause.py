"""The cyclic garbage collector paused for a bulk step that builds many objects and no cycles.

Opening a large checkpoint or saving a state of tens of thousands of tensors makes hundreds of thousands of
small records; the collector would rescan them again and again (a third of the time of opening a large DCP
checkpoint, 5-8x the time of parsing the largest manifest). `gc.disable()` is process-wide, so it is paused only
on the main thread: a background save (the async Checkpointer) or a viewer's worker thread must not leave the
training loop or other requests without collection for as long as it runs.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off for the body when this is the main thread (and it was on); restored after."""
    pause = gc.isenabled() and threading.current_thread() is threading.main_thread()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause:
            gc.enable()
