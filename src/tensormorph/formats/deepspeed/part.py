"""One model-parallel rank's ZeRO checkpoint: its model states and its data-parallel ranks' flat partitions,
read as tensors shaped like that rank's shards (with one model-parallel rank, the whole checkpoint)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...core import LogicalTensor, Placement
from ...errors import CheckpointError, HeaderError, MissingFileError, UnsupportedError
from ...geometry import shard_range
from ...storage import ByteStore
from .pieces import check_mappings
from .states import ModelStates, RankStates, read_model_states, read_rank_states
from .tensors import frozen_tensors, master_tensors, module_tensors, optimizer_state_tensors
from .zero3 import zero3_layout
from .zero12 import zero12_layout


@dataclass(frozen=True)
class Part:
    """Model-parallel rank `mp`'s tensors (tied aliases not yet added, in no particular order), its chunks'
    ranks global ranks."""

    mp: int
    model: ModelStates
    ranks: tuple[RankStates, ...]  # by data-parallel rank
    stage: int
    tensors: dict[str, LogicalTensor]
    frozen: tuple[str, ...]
    model_names: tuple[str, ...]
    optim_names: tuple[str, ...]


def global_rank(dp: int, mp: int, mp_ranks: int) -> int:
    """The rank of (data-parallel rank, model-parallel rank): tensor-parallel groups are consecutive ranks, as in
    DeepSpeed's AutoTP (dp, tp) mesh and Megatron's default order. The files record only the two coordinates."""
    return dp * mp_ranks + mp


def read_part(files: ByteStore, optim_names: list[str], model_name: str, mp: int, mp_ranks: int) -> Part:
    """Parse, check and lay out one model-parallel rank's files."""
    model = read_model_states(files, model_name)
    _check_world(files, model, mp_ranks)
    partitioned = model_name.startswith("zero_pp_rank_")  # stage 3 saves the module once per rank
    ranks = [_read_rank(files, name, r, model, partitioned, len(optim_names)) for r, name in enumerate(optim_names)]
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
        model_names = [f"zero_pp_rank_{r}_mp_rank_{mp:02d}_model_states.pt" for r in range(len(ranks))]
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
    if mp_ranks > 1:
        tensors = {name: _with_global_ranks(tensor, mp, mp_ranks) for name, tensor in tensors.items()}
    return Part(mp, model, tuple(ranks), stage, tensors, tuple(sorted(frozen)), tuple(model_names),
                tuple(optim_names))


def _check_world(files: ByteStore, model: ModelStates, mp_ranks: int) -> None:
    """The model states' own record of the model-parallel degree agrees with the files present."""
    dims = model.entries.get("checkpoint_parallel_dimensions")
    pipeline = dims.get("pp_degree") if isinstance(dims, dict) else None
    if type(pipeline) is int and pipeline > 1:
        raise UnsupportedError(f"is a pipeline-parallel save (pp_degree {pipeline}); only tensor and data "
                               "parallelism are read", file=files.describe(model.file))
    recorded = model.entries.get("mp_world_size")
    if type(recorded) is not int or recorded == mp_ranks:
        return
    if recorded > mp_ranks:
        raise MissingFileError(f"says mp_world_size {recorded}, but only the files of model-parallel ranks 0-"
                               f"{mp_ranks - 1} are present (mp_rank_{mp_ranks:02d}_model_states.pt and its "
                               "optimizer states are missing)", file=files.describe(model.file))
    raise HeaderError(f"says mp_world_size {recorded}, but the folder holds the files of {mp_ranks} model-parallel "
                      "ranks (left over from another save?)", file=files.describe(model.file))


def _with_global_ranks(tensor: LogicalTensor, mp: int, mp_ranks: int) -> LogicalTensor:
    """The tensor with its chunks' data-parallel ranks turned into global ranks."""
    chunks = tuple(replace(c, ranks=tuple(global_rank(r, mp, mp_ranks) for r in c.ranks)) for c in tensor.chunks)
    return replace(tensor, chunks=chunks)


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
