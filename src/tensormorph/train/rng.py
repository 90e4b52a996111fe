"""Random number generator states of one process as plain values, and back.

Python's `random`, NumPy's global generator, torch's CPU generator and the
generator of every CUDA device. States are plain data (bytes, ints, floats)
so they go into a checkpoint's manifest under per-rank names.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["capture", "derive_seed", "restore", "reseed"]


def capture() -> dict[str, Any]:
    """Every generator's state in this process."""
    version, words, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": np.asarray(words, dtype="<u4").tobytes(), "gauss": gauss},
        "numpy": {"kind": kind, "key": np.asarray(key, dtype="<u4").tobytes(), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(cached)},
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    # only a process that already uses CUDA has device generators worth keeping; asking would create contexts
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict[str, Any]) -> None:
    """Put every generator back to a state from `capture`."""
    python = state["python"]
    random.setstate((python["version"], tuple(np.frombuffer(python["state"], "<u4").tolist()), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], np.frombuffer(numpy["key"], "<u4").astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["gauss"]))
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            warnings.warn(f"the checkpoint holds the generator states of {len(cuda)} CUDA devices, but CUDA is not "
                          "available here; GPU random streams start afresh", stacklevel=3)
            return
        count = torch.cuda.device_count()
        if count != len(cuda):
            warnings.warn(f"the checkpoint holds {len(cuda)} CUDA generator states and this process sees {count} "
                          "devices; the first ones are restored", stacklevel=3)
        for index, raw in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8), index)


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed determined by `parts` (a run's seed, a step, a rank ...)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def reseed(seed: int) -> None:
    """Seed every generator from one number (torch.manual_seed also seeds every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
