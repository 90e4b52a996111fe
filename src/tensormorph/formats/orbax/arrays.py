"""Orbax's arrays through tensorstore: the key/value store of an item folder (one OCDBT database, or plain files
with OCDBT off), each array a zarr v2 or v3 array in it, and chunk sources that read a sub-box of one chunk.

tensorstore reads OCDBT and zarr without JAX, and a read of a sub-box decodes only the chunks (a zarr3 shard's
inner chunks) that it overlaps. It reads the files itself, through its own drivers (kvstores.py): a local folder,
an S3 bucket or an HTTP server.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import dtypes
from ...errors import CheckpointError
from ...extras import require
from ...storage import AnyPath
from .kvstores import base_spec
from .metadata import ArrayLayout

FEATURE = "reading Orbax checkpoints"
CACHE_BYTES = 256 * 1024**2  # the least decoded chunks tensorstore keeps per item folder (a chunk decodes once)
MAX_CACHE_BYTES = 1024**3  # at most: a wider row of chunks is decoded again by each C-order band that crosses it
CACHE_MARGIN = 1.25  # the pool evicts before it is full: a row of chunks of exactly its size was decoded per band


def tensorstore() -> Any:
    """The tensorstore module; MissingDependencyError naming the orbax extra when it is not installed."""
    return require("tensorstore", "orbax", feature=FEATURE)


def _message(exc: BaseException) -> str:
    """tensorstore's message, on one line (its errors carry source locations on the following lines)."""
    return " ".join(str(exc).split())[:500]


class ItemStore:
    """The key/value store of one Orbax item folder, opened once and shared by every array in it."""

    def __init__(self, folder: AnyPath, ocdbt: bool):
        ts = tensorstore()
        self.folder, self.ocdbt = folder, ocdbt
        self.base, self._keep = base_spec(folder)  # _keep: a temporary AWS profile, alive as long as the store
        # one cache pool and one OCDBT manifest for all the arrays (fit_cache resizes it before they open)
        self.context = ts.Context({"cache_pool": {"total_bytes_limit": CACHE_BYTES}})
        self.cache_bytes = CACHE_BYTES
        try:
            self.kv = ts.KvStore.open(self.kvstore(""), context=self.context).result()
        except Exception as exc:  # tensorstore maps its status codes onto several exception classes
            raise CheckpointError(f"cannot open the key/value store: {_message(exc)}",
                                  file=str(folder / ("manifest.ocdbt" if ocdbt else ""))) from None

    def fit_cache(self, layouts: Iterable[ArrayLayout]) -> None:
        """Size the cache to hold one row of read chunks of the widest array (within [CACHE_BYTES, MAX_CACHE_BYTES]):
        C-order readers (convert, diff, full reads in blocks) read row bands across the whole width, which decode
        every chunk of a row of chunks, again for each band when they do not all stay in the cache. Called before
        any array opens (they open with this context on their first read)."""
        need = int(max((_row_bytes(layout) for layout in layouts), default=0) * CACHE_MARGIN)
        total = min(MAX_CACHE_BYTES, max(CACHE_BYTES, need))
        if total != CACHE_BYTES:
            self.context = tensorstore().Context({"cache_pool": {"total_bytes_limit": total}})
        self.cache_bytes = total

    def kvstore(self, prefix: str) -> dict[str, Any]:
        if self.ocdbt:
            return {"driver": "ocdbt", "base": self.base, "path": prefix}
        return {**self.base, "path": f"{self.base['path']}{prefix}"} if "path" in self.base \
            else {**self.base, "base_url": f"{self.base['base_url']}{prefix}"}

    def describe(self, key: str) -> str:
        """Where key `key` lives, for messages: in the OCDBT database, or the file itself."""
        return f"{self.folder / 'manifest.ocdbt'}:{key}" if self.ocdbt else str(self.folder / key)

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value (None when missing), read concurrently. tensorstore refuses a byte range past a value's
        end, so values are read whole: an OCDBT value is never larger than the data file that holds it."""
        futures = [self.kv.read(key.encode("utf-8")) for key in keys]
        values: list[bytes | None] = []
        for key, future in zip(keys, futures):
            try:
                result = future.result()
            except Exception as exc:
                raise CheckpointError(f"cannot be read: {_message(exc)}", file=self.describe(key)) from None
            values.append(bytes(result.value) if result.state == "value" else None)
        return values

    def open_array(self, name: str, layout: ArrayLayout) -> ZarrArray:
        driver = "zarr3" if layout.zarr_format == 3 else "zarr"
        spec = {"driver": driver, "kvstore": self.kvstore(f"{name}/"), "recheck_cached_data": False,
                "recheck_cached_metadata": False}
        return ZarrArray(name, spec, self, layout)


def _row_bytes(layout: ArrayLayout) -> int:
    """Decoded bytes of one row of read chunks across the whole array (what a band of its rows decodes)."""
    chunk = layout.read_chunk_shape
    cells = math.prod(c * -(-n // c) for n, c in zip(layout.shape[1:], chunk[1:])) * (chunk[0] if chunk else 1)
    return cells * dtypes.itemsize(layout.dtype)


@dataclass(eq=False)
class ZarrArray:
    """One array, opened with tensorstore on its first read and then shared by all its chunks (thread-safe)."""

    name: str
    spec: dict[str, Any]
    store: ItemStore
    layout: ArrayLayout
    _handle: Any = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def handle(self) -> Any:
        with self._lock:
            if self._handle is None:
                ts = tensorstore()
                try:
                    handle = ts.open(self.spec, open=True, read=True, context=self.store.context).result()
                except Exception as exc:
                    raise CheckpointError(f"cannot open the array: {_message(exc)}",
                                          file=self.store.describe(f"{self.name}/"), tensor=self.name) from None
                expected = dtypes.numpy_dtype(self.layout.dtype)
                if tuple(handle.shape) != self.layout.shape or handle.dtype.numpy_dtype != expected:
                    raise CheckpointError(
                        f"tensorstore opens it as {handle.dtype.name}{list(handle.shape)}, but its metadata says "
                        f"{self.layout.dtype}{list(self.layout.shape)}", file=self.store.describe(f"{self.name}/"),
                        tensor=self.name)
                self._handle = handle
            return self._handle

    def read(self, index: tuple[slice, ...], key: str) -> np.ndarray:
        """The values of `index` (slices with positive steps, in global coordinates): tensorstore decodes only the
        chunks they overlap. Errors name the tensor and the chunk `key` being read."""
        handle = self.handle()
        try:
            values = handle[index].read().result() if index else handle.read().result()
        except Exception as exc:
            raise CheckpointError(f"chunk {key} cannot be read: {_message(exc)}", file=self.store.describe(key),
                                  tensor=self.name) from None
        return np.asarray(values).view(dtypes.numpy_dtype(self.layout.dtype))

    def check_chunk(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> None:
        """Decode one whole chunk (checks that it is present, decompresses and has its size)."""
        self.read(tuple(slice(o, o + n) for o, n in zip(offsets, shape)), key)


@dataclass(frozen=True, slots=True)
class ZarrBox:
    """A chunk source: one chunk (a box of the grid) of a zarr array, read through tensorstore."""

    zarr: ZarrArray
    key: str  # the chunk's key in the store: `<name>/0.1` (zarr v2) or `<name>/c/0/1` (zarr v3)
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    where: str  # the key after its item folder, relative to the folder opened: what verification names

    @property
    def encoding(self) -> dict[str, Any]:
        layout = self.zarr.layout
        codecs = "+".join(layout.codecs) or "raw"
        inner = (f", read in chunks of {list(layout.read_chunk_shape)}"
                 if layout.read_chunk_shape != layout.chunk_shape else "")
        return {"format": f"zarr{layout.zarr_format}", "codecs": list(layout.codecs),
                "chunk_shape": list(layout.chunk_shape), "read_chunk_shape": list(layout.read_chunk_shape),
                "description": f"zarr v{layout.zarr_format} chunks of {list(layout.chunk_shape)}, {codecs}{inner}"}

    def array(self) -> np.ndarray:
        return self.zarr.read(self._global(tuple(slice(0, n, 1) for n in self.shape)), self.key)

    def read_into(self, index: tuple[slice, ...], target: Any) -> bool:
        """Read `index` (positive-step slices into this chunk) straight into `target`."""
        if not isinstance(target, np.ndarray):  # a 0-d result's element: the caller assigns the array read
            return False
        target[...] = self.zarr.read(self._global(index), self.key)
        return True

    def _global(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        return tuple(slice(o + s.start, o + s.stop, s.step) for o, s in zip(self.offsets, index))
