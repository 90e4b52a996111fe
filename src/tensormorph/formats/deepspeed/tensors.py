"""The logical tensors: fp32 masters and optimizer state from the layout, frozen parameters, the module's own
tensors, tied aliases, and the order they are listed in."""

from __future__ import annotations

import math

from ... import torchzip
from ...core import LogicalTensor, Placement
from ...errors import HeaderError
from ...storage import ByteStore
from ..torch_pickle import tensor_chunk
from .arrays import flat_chunks, reshaped
from .names import MODULE_PREFIX, OPTIMIZER_PREFIX, STATE_PREFIX
from .pieces import Layout, Piece
from .states import ModelStates, RankStates, read_model_states


def _shape_of(model: ModelStates, name: str) -> tuple[int, ...]:
    for shapes in model.param_shapes:
        if name in shapes:
            return shapes[name]
    return model.frozen_shapes[name]


def _reuse_budget(files: ByteStore, model: ModelStates) -> torchzip.ReuseBudget:
    """A budget for the model file's tensors by name: a pickle may name one storage under many names."""
    return torchzip.ReuseBudget(files.describe(model.file), files.size(model.file))


def master_tensors(files: ByteStore, layout: Layout, model: ModelStates, ranks: list[RankStates],
                   placement: Placement) -> dict[str, LogicalTensor]:
    """<param>: the fp32 master weights, read from the ranks' flat partitions."""
    tensors: dict[str, LogicalTensor] = {}
    for name, pieces in layout.items():
        shape = _shape_of(model, name)
        dtype, chunks = flat_chunks(files, name, shape, pieces,
                                    lambda p: (ranks[p.rank].file, ranks[p.rank].flats[p.slot]))
        tensors[name] = LogicalTensor(name, dtype, shape, tuple(chunks), placement)
    return tensors


def optimizer_state_tensors(files: ByteStore, layout: Layout, model: ModelStates, ranks: list[RankStates],
                            placement: Placement) -> dict[str, LogicalTensor]:
    """optimizer.state.<param>.<key>: flat state laid out like the masters, scalars from the first piece."""
    tensors: dict[str, LogicalTensor] = {}
    for name, pieces in layout.items():
        if not pieces:
            continue
        shape = _shape_of(model, name)
        first = pieces[0]
        for key in ranks[first.rank].state[first.slot]:
            full = f"{STATE_PREFIX}{name}.{key}"
            ref = ranks[first.rank].state[first.slot][key]
            if not ref.shape:
                file = ranks[first.rank].file
                tensors[full] = LogicalTensor(full, ref.dtype, (), (tensor_chunk(files, file, ref,
                                                                                 ranks=(first.rank,)),))
                continue

            def source(p: Piece, key: str = key, full: str = full) -> tuple[str, torchzip.TensorRef]:
                held = ranks[p.rank].state[p.slot].get(key)
                if held is None or not held.shape:
                    raise HeaderError(f"rank {p.rank} has no flat {key!r} state for flat tensor {p.slot}",
                                      file=files.describe(ranks[p.rank].file), tensor=full)
                return ranks[p.rank].file, held

            dtype, chunks = flat_chunks(files, full, shape, pieces, source)
            tensors[full] = LogicalTensor(full, dtype, shape, tuple(chunks), placement)
    return tensors


def frozen_tensors(files: ByteStore, model: ModelStates, model_names: list[str], placement: Placement,
                   stage: int) -> dict[str, LogicalTensor]:
    """Frozen parameters: whole fragments (stages 1-2), or one flat fragment per rank (stage 3)."""
    tensors = {}
    if stage == 3 and model.frozen_shapes:
        per_rank = [model] + [read_model_states(files, n) for n in model_names[1:]]
        for name, shape in model.frozen_shapes.items():
            numel, pieces, begin = math.prod(shape), [], 0
            for rank, states in enumerate(per_rank):
                fragment = states.frozen_fragments.get(name)
                if fragment is None or len(fragment.shape) != 1:
                    raise HeaderError("is frozen, but this rank holds no flat fragment of it",
                                      file=files.describe(states.file), tensor=name)
                count = min(fragment.shape[0], numel - begin)
                if count > 0:
                    pieces.append(Piece(rank, 0, 0, begin, count))
                    begin += count
            if begin != numel:
                raise HeaderError(f"the ranks' fragments hold {begin} of its {numel} elements",
                                  file=files.describe(per_rank[-1].file), tensor=name)

            def fragment_of(p: Piece, name: str = name) -> tuple[str, torchzip.TensorRef]:
                return per_rank[p.rank].file, per_rank[p.rank].frozen_fragments[name]

            dtype, chunks = flat_chunks(files, name, shape, pieces, fragment_of)
            tensors[name] = LogicalTensor(name, dtype, shape, tuple(chunks), placement)
        return tensors
    reuse = _reuse_budget(files, model)
    for name, shape in model.frozen_shapes.items():
        fragment = model.frozen_fragments.get(name)
        if fragment is None or math.prod(fragment.shape) != math.prod(shape):
            raise HeaderError(f"is frozen with shape {shape}, but its fragment is "
                              f"{None if fragment is None else fragment.shape}", file=files.describe(model.file),
                              tensor=name)
        reuse.charge(fragment, name)
        tensors[name] = reshaped(LogicalTensor(name, fragment.dtype, fragment.shape,
                                               (tensor_chunk(files, model.file, fragment),)), shape)
    if stage <= 1:
        # ZeRO-1 does not record frozen parameters: whatever the module holds beyond the trainable
        # parameters, buffers and tied names is one, and the module's own copy is its value
        trainable = {n for shapes in model.param_shapes for n in shapes}
        for name, ref in model.module.items():
            if name not in trainable and name not in model.buffers and name not in model.shared:
                reuse.charge(ref, name)
                tensors[name] = LogicalTensor(name, ref.dtype, ref.shape, (tensor_chunk(files, model.file, ref),))
    return tensors


def module_tensors(files: ByteStore, model: ModelStates) -> dict[str, LogicalTensor]:
    """Buffers under their own names; the module's weights as module.<name> (stage-3 placeholders left out)."""
    tensors = {}
    expected = {n: s for shapes in model.param_shapes for n, s in shapes.items()} | model.frozen_shapes
    reuse = _reuse_budget(files, model)
    for name, ref in model.module.items():
        reuse.charge(ref, name)
        if name in model.shared:
            continue  # an alias of its source, added with the others
        if name in model.buffers:
            tensors[name] = LogicalTensor(name, ref.dtype, ref.shape, (tensor_chunk(files, model.file, ref),))
            continue
        if name in expected and ref.shape != expected[name]:
            continue  # ZeRO-3 keeps only an empty placeholder in the module
        full = MODULE_PREFIX + name
        tensors[full] = LogicalTensor(full, ref.dtype, ref.shape, (tensor_chunk(files, model.file, ref),))
    return tensors


def add_aliases(tensors: dict[str, LogicalTensor], shared: dict[str, str]) -> dict[str, str]:
    """Add each tied name (and its module.<name>) as an alias of its source; alias -> source."""
    aliases = {}
    for alias, source in shared.items():
        for prefix in ("", MODULE_PREFIX):
            if prefix + source in tensors and prefix + alias not in tensors:
                original = tensors[prefix + source]
                tensors[prefix + alias] = LogicalTensor(prefix + alias, original.dtype, original.shape,
                                                        original.chunks, original.placement)
                aliases[prefix + alias] = prefix + source
    return aliases


def in_model_order(tensors: dict[str, LogicalTensor], model: ModelStates) -> dict[str, LogicalTensor]:
    """The model's own tensors in the module's order, then module.<name>, then the optimizer state."""
    rank = {name: i for i, name in enumerate(model.module)}

    def key(name: str) -> tuple[int, int]:
        kind = 2 if name.startswith(OPTIMIZER_PREFIX) else 1 if name.startswith(MODULE_PREFIX) else 0
        return kind, rank.get(name, len(rank))

    return {name: tensors[name] for name in sorted(tensors, key=key)}  # stable: ties keep their order

