"""Orbax (JAX): a step folder, or the item folder under it, read as one logical checkpoint without JAX.

An item folder holds `_METADATA` (the PyTree: each leaf's key path and value type), `_sharding` (each sharded
array's NamedSharding), `_strings.json` (string leaves), and the arrays: one zarr (v2 or v3) array per leaf,
under the leaf's dotted name, in an OCDBT key/value store (`manifest.ocdbt`, `d/`, `ocdbt.process_*/`) or, with
OCDBT off, in plain folders. A step folder adds `_CHECKPOINT_METADATA` and holds one item folder per item.

Every array is a logical tensor under its dotted PyTree path; its chunks are the zarr chunk grid (which follows
the sharding the arrays were saved with), and a region read decodes only the chunks it overlaps. Scalars
(the step) and strings are objects. The JSON is parsed here, bounded (`metadata`); the arrays are read with
tensorstore (`arrays`), the optional extra `tensormorph[orbax]`. docs/formats/orbax.md has the on-disk facts.
"""

from __future__ import annotations

from .metadata import MAX_CHUNKS, MAX_LEAVES, parse_shardings, parse_tree, parse_zarr
from .reader import NAME, checksum_problems, detect, open

__all__ = ["MAX_CHUNKS", "MAX_LEAVES", "NAME", "checksum_problems", "detect", "open", "parse_shardings",
           "parse_tree", "parse_zarr"]
