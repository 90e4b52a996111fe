"""Sharded save and load on torch.distributed: `tensormorph.save` and `tensormorph.load`.

Every rank calls `save(state_dict, path)`; each writes the chunks it was
chosen for into its own safetensors file, in parallel, and one rank commits
the manifest. `load(path, state_dict)` fills tensors and DTensors in place on
any mesh and world size: each rank reads only the bytes of the boxes it
holds. Coordination uses torch.distributed collectives on the default group
(or the one given); without an initialised process group both run in one
process. The format itself, torch-free, is `tensormorph.tmformat`.
"""

from __future__ import annotations

from .load import LoadReport, load
from .save import SaveReport, save

__all__ = ["LoadReport", "SaveReport", "load", "save"]
