"""Copying a committed local checkpoint to an object store, as a save there would have written it.

The files go under a generation folder of the copy's own (`gen-<id>/rank-00000.safetensors`), and the
manifest, renamed to match, is PUT last: the object store's commit protocol (commit.py), so a reader never sees
a half-copied checkpoint and an earlier copy under the same prefix stays valid until the new one commits.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..storage import LocalFiles, open_regular
from .checkpoint import read_manifest
from .commit import destination
from .manifest import Manifest
from .recovery import all_files

COPY_PIECE = 8 << 20  # bytes read from the local file and written to the upload at a time


def relocated(manifest: Manifest, prefix: str) -> Manifest:
    """The same manifest with every file it names (data, parity, copies) under `prefix`."""
    tensors = {name: replace(record, chunks=tuple(replace(c, file=prefix + c.file) for c in record.chunks))
               for name, record in manifest.tensors.items()}
    redundancy = manifest.redundancy
    if redundancy is not None:
        redundancy = replace(redundancy, files={prefix + n: f for n, f in redundancy.files.items()},
                             stripes=tuple((tuple(prefix + d for d in data), tuple(prefix + p for p in parity))
                                           for data, parity in redundancy.stripes))
    return replace(manifest, tensors=tensors, files={prefix + n: f for n, f in manifest.files.items()},
                   redundancy=redundancy)


def copy_checkpoint(source: Path, url: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Copy the committed checkpoint in the local folder `source` to `url` (an object store's prefix), replacing
    what is there only once the copy has committed; returns the copy's manifest."""
    files = LocalFiles(source)
    try:
        manifest = read_manifest(files, str(source))
    finally:
        files.close()
    for name in all_files(manifest):  # only the folder's own files: a manifest naming a path elsewhere is refused
        if Path(name).name != name or name.startswith("."):
            raise CheckpointError(f"names the file {name!r}, which is not a file of the checkpoint folder",
                                  file=str(source / "manifest.json"))
    target = destination(url, overwrite=True, storage_options=storage_options)
    target.join(target.prepare())
    try:
        for name in sorted(all_files(manifest)):
            upload = target.open(target.file_prefix + name)
            with os.fdopen(open_regular(source / name, follow=False), "rb") as local:
                while piece := local.read(COPY_PIECE):
                    upload.write(piece)
            target.finish_file(upload)
        copied = relocated(manifest, target.file_prefix)
        target.commit(copied.to_bytes())
    except BaseException:
        target.abort()
        raise
    return copied
