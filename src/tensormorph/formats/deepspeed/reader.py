"""The reader's entry points: detect a ZeRO checkpoint, open it as one logical checkpoint, check its CRCs."""

from __future__ import annotations

import math
from collections.abc import Iterator

from ... import torchzip
from ...core import Checkpoint, Placement
from ...errors import CheckpointError, HeaderError, MissingFileError
from ...geometry import shard_range
from ...storage import AnyPath, ByteStore, store_at
from ..contract import Detection
from .discovery import LATEST, MODEL_FILE, OPTIM_FILE, model_file, names_in, optim_files, tag_folder
from .names import NAME
from .objects import model_objects, optimizer_objects
from .pieces import check_mappings
from .states import ModelStates, RankStates, read_model_states, read_rank_states
from .tensors import (
    add_aliases,
    frozen_tensors,
    in_model_order,
    master_tensors,
    module_tensors,
    optimizer_state_tensors,
)
from .zero3 import zero3_layout
from .zero12 import zero12_layout


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
    names = optim_files(folder)
    model_name = model_file(folder)
    model = read_model_states(files, model_name)
    partitioned = model_name.startswith("zero_pp_rank_")  # stage 3 saves the module once per rank
    ranks = [_read_rank(files, name, r, model, partitioned, len(names)) for r, name in enumerate(names)]
    stage = ranks[0].stage
    for rank in ranks:
        if rank.partition_count != len(ranks):
            # fewer files: some rank's save is missing; more: files left over from a save with more ranks
            error = MissingFileError if rank.partition_count > len(ranks) else HeaderError
            raise error(f"says the states are partitioned over {rank.partition_count} data-parallel ranks, but "
                        f"{len(ranks)} optimizer-state files are present", file=files.describe(rank.file))
        if rank.stage != stage:
            raise HeaderError(f"says ZeRO stage {rank.stage}, rank 0's file stage {stage}",
                              file=files.describe(rank.file))
    if (stage == 3) != partitioned:
        raise HeaderError(f"the optimizer states are ZeRO stage {stage}, but the model states are saved as for "
                          f"stage {'3' if partitioned else '1-2'}", file=files.describe(model_name))
    model_names = [model_name]
    if stage == 3:
        model_names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(len(ranks))]
        for name in model_names:
            if not files.exists(name):
                raise MissingFileError("is missing; ZeRO-3 saves every rank's model states", file=files.describe(name))
    layout = zero3_layout(model, ranks, files) if stage == 3 else zero12_layout(model, ranks, files)
    check_mappings(layout, ranks, files)

    placement = Placement((len(ranks),), (f"ZeRO-{stage} flat partition",), ("dp",))
    tensors = master_tensors(files, layout, model, ranks, placement)
    tensors.update(optimizer_state_tensors(files, layout, model, ranks, placement))
    frozen = frozen_tensors(files, model, model_names, placement, stage)
    tensors.update(frozen)
    for name, tensor in module_tensors(files, model).items():
        tensors.setdefault(name, tensor)
    aliases = add_aliases(tensors, model.shared)
    tensors = in_model_order(tensors, model)

    objects = {**model_objects(files, model),
               **optimizer_objects(files, ranks[0].file, ranks[0].settings, ranks[0].param_groups)}
    metadata = {
        "zero_stage": stage, "dp_world_size": len(ranks), "tag": folder.name,
        "ds_version": model.entries.get("ds_version"), "aliases": aliases, "frozen": sorted(frozen),
        "partition_sizes": [[flat.shape[0] for flat in rank.flats] for rank in ranks],
    }
    return Checkpoint(path=folder, format=NAME, tensors=tensors, objects=objects, metadata=metadata,
                      files=tuple(dict.fromkeys([*model_names, *names])), storage=files)


def _read_rank(files: ByteStore, name: str, rank: int, model: ModelStates, partitioned: bool,
               world: int) -> RankStates:
    try:
        return read_rank_states(files, name, rank)
    except CheckpointError as exc:
        if exc.tensor is not None:
            raise
        held = _expected_on(model, rank, world, partitioned)
        listed = ", ".join(held[:8]) + (" ..." if len(held) > 8 else "")
        raise type(exc)(f"{exc.reason}; this file holds data-parallel rank {rank}'s share of the fp32 master "
                        f"weights and optimizer state of {len(held)} parameters: {listed}",
                        file=exc.file or files.describe(name), tensor=held[0] if held else None) from None


def _expected_on(model: ModelStates, rank: int, world: int, partitioned: bool) -> list[str]:
    """The parameters a rank's partition should hold part of, from param_shapes alone (for error messages)."""
    held = []
    for shapes in model.param_shapes:
        total = sum(math.prod(s) for s in shapes.values())
        share = -(-total // (2 * world)) * 2  # DeepSpeed's group padding, split evenly
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            if partitioned:
                begin, end = shard_range(numel, world, rank)
                if end > begin:
                    held.append(name)
            elif offset < (rank + 1) * share and rank * share < offset + numel:
                held.append(name)
            offset += numel
    return held


def checksum_problems(checkpoint: Checkpoint) -> Iterator[tuple[str, CheckpointError | None]]:
    """Check the CRC-32 of every record of every file of the checkpoint."""
    files = checkpoint.require_storage()
    for file in checkpoint.files:
        path = files.describe(file)
        try:
            torchzip.check_crc(files.buffer(file), file=path)
        except CheckpointError as exc:
            yield file, exc
        else:
            yield file, None
