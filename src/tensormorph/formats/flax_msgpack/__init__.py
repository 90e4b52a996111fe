"""Flax msgpack: what `flax.serialization.to_bytes` / `msgpack_serialize` write (`*.msgpack`), read without JAX.

The file is one msgpack map: a nested state dict whose arrays are msgpack ext type 1 (a msgpack of shape, dtype
name and the raw C-order bytes); ext 2 is a Python complex (real, imag) and ext 3 a numpy scalar. Flax splits an
array over 2**30 bytes into a map `{"__msgpack_chunked_array__": true, "shape": {...}, "chunks": {...}}` of flat
pieces. Every array is a tensor under its dotted path (list items by index); every other leaf is an object.

The walk (`walk`) is bounded: msgpack's Unpacker with every size limit set, `strict_map_key`, no hooks, and limits
on nesting and leaves; array bytes are located by offset and read only when a tensor is read (a memory map
locally). msgpack is the optional extra `tensormorph[flax]`. docs/formats/flax_msgpack.md has the details.
"""

from __future__ import annotations

from .reader import NAME, checksum_problems, detect, open
from .walk import MAX_CONTAINER_LEN, MAX_DEPTH, MAX_LEAVES, MAX_VALUE_BYTES, Walk

__all__ = ["MAX_CONTAINER_LEN", "MAX_DEPTH", "MAX_LEAVES", "MAX_VALUE_BYTES", "NAME", "Walk", "checksum_problems",
           "detect", "open"]
