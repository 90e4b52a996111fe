"""The reader's entry points: detect a ZeRO checkpoint, open it as one logical checkpoint, check its CRCs (and,
with several model-parallel ranks, that the replicated tensors' copies agree)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ... import torchzip
from ...core import Checkpoint
from ...errors import CheckpointError, HeaderError
from ...storage import AnyPath, ByteStore, store_at
from ..contract import Detection
from .discovery import LATEST, MODEL_FILE, OPTIM_FILE, model_files, names_in, optim_files, tag_folder
from .names import NAME
from .objects import model_objects, optimizer_objects
from .part import Part, read_part
from .tensors import add_aliases, in_model_order
from .tp import merge, replica_problems


def detect(path: AnyPath) -> Detection | None:
    """The tag folder, when it holds model states and optimizer states."""
    try:
        if path.name == LATEST and path.is_file():  # the save folder, given by the file that names its tag
            path = path.parent
        if not path.is_dir():
            return None
        folder = tag_folder(path)
        names = names_in(folder)
    except (OSError, CheckpointError):
        return None
    found = any(MODEL_FILE.match(n) for n in names) and any(OPTIM_FILE.match(n) for n in names)
    return Detection(path, folder) if found else None


def open(detection: Detection) -> Checkpoint:
    path = detection.path
    folder = detection.found or tag_folder(path.parent if path.name == LATEST and path.is_file() else path)
    files = store_at(folder)
    parts = read_parts(files, folder)
    first = parts[0]
    stage = first.stage
    for part in parts[1:]:
        if part.stage != stage:
            raise HeaderError(f"says ZeRO stage {part.stage}, model-parallel rank 0's files stage {stage}",
                              file=files.describe(part.ranks[0].file))
    metadata: dict[str, Any] = {"zero_stage": stage, "dp_world_size": len(first.ranks), "tag": folder.name,
                                "ds_version": first.model.entries.get("ds_version")}
    if len(parts) == 1:
        tensors = dict(first.tensors)
        aliases = add_aliases(tensors, first.model.shared)
        tensors = in_model_order(tensors, first.model)
        sizes: list[Any] = [[flat.shape[0] for flat in rank.flats] for rank in first.ranks]
    else:
        merged = merge(files, parts)
        tensors, aliases = merged.tensors, merged.aliases
        metadata.update(merged.metadata)
        sizes = [[[flat.shape[0] for flat in rank.flats] for rank in part.ranks] for part in parts]
    metadata.update({"aliases": aliases, "frozen": list(first.frozen), "partition_sizes": sizes})
    objects = {**model_objects(files, first.model),
               **optimizer_objects(files, first.ranks[0].file, first.ranks[0].settings, first.ranks[0].param_groups)}
    names = [name for part in parts for name in (*part.model_names, *part.optim_names)]
    return Checkpoint(path=folder, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(dict.fromkeys(names)), storage=files)


def read_parts(files: ByteStore, folder: AnyPath) -> list[Part]:
    """Every model-parallel rank's part, in rank order."""
    grid = optim_files(folder)
    models = model_files(folder, len(grid))
    return [read_part(files, grid[mp], models[mp], mp, len(grid)) for mp in range(len(grid))]


def checksum_problems(checkpoint: Checkpoint) -> Iterator[tuple[str, CheckpointError | None]]:
    """Check the CRC-32 of every record of every file of the checkpoint."""
    files = checkpoint.require_storage()
    replicated = checkpoint.metadata.get("tp_replicated")
    if replicated:  # copies only model-parallel ranks > 0 hold: compared with the copy read
        yield from replica_problems(read_parts(files, checkpoint.path), replicated)
    for file in checkpoint.files:
        path = files.describe(file)
        try:
            torchzip.check_crc(files.buffer(file), file=path)
        except CheckpointError as exc:
            yield file, exc
        else:
            yield file, None
