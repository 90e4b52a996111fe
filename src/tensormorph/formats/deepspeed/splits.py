"""How the tensor-parallel shards of a parameter make its logical tensor, from the `universal_checkpoint_info`
that DeepSpeed saves in the model states (written by AutoTP, or set on the module by Megatron-DeepSpeed).

The rules are DeepSpeed's own (deepspeed/checkpoint/ds_to_universal.py, merge_tp_slices), in its order:
1. an `affine_map` entry whose pattern matches: each rank's pieces say which box of the logical tensor each
   box of its shard is (only unscaled pieces that are boxes on both sides are read here);
2. `autotp_unsupported_parameter_patterns`: DeepSpeed itself cannot rebuild it;
3. `tp_replicated_parameter_patterns`: every rank holds it whole; model-parallel rank 0's copy is read;
4. `parameter_to_average_patterns`: the logical value is the mean of the ranks' copies: a Partial(avg) tensor,
   one contribution per model-parallel rank;
5. sub-parameter layouts (`parameter_with_2_sub_params_cat_dim_0`, `parameter_with_sub_params`);
6. `parameter_with_row_parallelism_patterns`: shards concatenated along dim 1; anything else along dim 0;
then `vocabulary_parameter_patterns`: the concatenation cut to `original_vocab_size` rows.
Patterns are matched with `re.match`, as DeepSpeed does. Cases 2 and 5 are not rebuilt (`Unmerged`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import regex

from ...errors import HeaderError
from ...geometry import intersect

INFO_KEY = "universal_checkpoint_info"
AFFINE_VERSION = 1  # the affine-map encoding read here (DeepSpeed's AFFINE_MAP_FORMAT_VERSION)
MAX_PATTERNS = 100_000  # patterns per list; each parameter is matched against all of them
MAX_PATTERN_CHARS = 4096
MATCH_TIMEOUT_S = 0.5
"""A pattern from the file is matched with this timeout: a backtracking pattern ((a|aa)+$) could take hours."""
MAX_MATCHES = 5_000_000
"""Most pattern-against-name matches one checkpoint may ask for (patterns that are not one literal name, times
the parameters): beyond it, reading the layout would take minutes."""

REPLICATED = "tp_replicated_parameter_patterns"
AVERAGED = "parameter_to_average_patterns"
ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
VOCABULARY = "vocabulary_parameter_patterns"
TWO_SUB_PARAMS = "parameter_with_2_sub_params_cat_dim_0"
SUB_PARAMS = "parameter_with_sub_params"
UNSUPPORTED = "autotp_unsupported_parameter_patterns"


@dataclass(frozen=True)
class Block:
    """The box of one model-parallel rank's shard at `shard` with `shape` is the logical tensor's box at `full`."""

    shard: tuple[int, ...]
    full: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Split:
    """A parameter rebuilt from its shards: its logical shape and, per model-parallel rank, where its blocks go."""

    placement: str  # "Shard(0)", "Shard(1)", "Replicate()", "affine map"
    shape: tuple[int, ...]
    blocks: tuple[tuple[Block, ...], ...]


@dataclass(frozen=True)
class Unmerged:
    """A parameter not rebuilt: its shards are listed per model-parallel rank."""

    reason: str


class Patterns:
    """Patterns matched as DeepSpeed matches them (re.match), each with a value. Those that name one parameter
    exactly (`^name$`: AutoTP writes one per parameter) are looked up by name, so matching every parameter stays
    linear in the parameters rather than their product with the patterns."""

    def __init__(self, items: list[tuple[regex.Pattern[str], Any]], budget: list[int], path: str) -> None:
        self.budget, self.path = budget, path  # the budget is shared by every Patterns of one checkpoint
        self.exact: dict[str, list[tuple[str, Any]]] = {}
        self.other: list[tuple[regex.Pattern[str], Any]] = []
        for pattern, value in items:
            literal = _literal(pattern.pattern)
            if literal is None:
                self.other.append((pattern, value))
            else:
                self.exact.setdefault(literal, []).append((pattern.pattern, value))

    def matches(self, name: str) -> list[tuple[str, Any]]:
        """(pattern, value) of every pattern that matches `name`."""
        self.budget[0] -= len(self.other)
        if self.budget[0] < 0:
            raise HeaderError(f"{INFO_KEY} asks for more than {MAX_MATCHES:,} pattern matches", file=self.path)
        found = self.exact.get(name, [])
        for pattern, value in self.other:
            try:
                if pattern.match(name, timeout=MATCH_TIMEOUT_S):
                    found = [*found, (pattern.pattern, value)]
            except TimeoutError:
                raise HeaderError(f"{INFO_KEY} pattern {pattern.pattern[:80]!r} takes over {MATCH_TIMEOUT_S} s to "
                                  "match one name", file=self.path, tensor=name) from None
        return found


def _literal(pattern: str) -> str | None:
    """The one name `^name$` matches (with re.escape's escapes), else None."""
    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
        return None
    inner = pattern[1:-1]
    plain = re.sub(r"\\(.)", r"\1", inner, flags=re.S)
    return plain if re.escape(plain) == inner else None


class Rules:
    """The parsed universal_checkpoint_info of one checkpoint."""

    def __init__(self, info: Any, path: str) -> None:
        if not isinstance(info, dict):
            raise HeaderError(f"{INFO_KEY} should be a dict, found {type(info).__name__}", file=path)
        self.path = path
        budget = [MAX_MATCHES]
        self.lists = {key: Patterns([(p, None) for p in self._patterns(info, key)], budget, path)
                      for key in (REPLICATED, AVERAGED, ROW_PARALLEL, VOCABULARY, TWO_SUB_PARAMS)}
        self.sub_params = Patterns([(p, None) for entry in self._list(info, SUB_PARAMS) for p in self._patterns(
            entry if isinstance(entry, dict) else {}, "patterns", f"{SUB_PARAMS} entry")], budget, path)
        unsupported = info.get(UNSUPPORTED) or {}
        if not isinstance(unsupported, dict):
            raise HeaderError(f"{INFO_KEY}[{UNSUPPORTED!r}] should map patterns to reasons", file=path)
        self.unsupported = Patterns([(self._compile(p, UNSUPPORTED), str(r)) for p, r in unsupported.items()],
                                    budget, path)
        vocab = info.get("original_vocab_size")
        self.vocab_size = vocab if type(vocab) is int and vocab >= 0 else None
        affine = info.get("affine_map") or {}
        if not isinstance(affine, dict) or not isinstance(affine.get("params", {}), dict):
            raise HeaderError(f"{INFO_KEY}['affine_map'] should be a dict with a 'params' dict", file=path)
        self.affine_version = affine.get("version", AFFINE_VERSION)
        self.affine = Patterns([(self._compile(p, "affine_map"), e) for p, e in affine.get("params", {}).items()],
                               budget, path)

    def _list(self, info: dict, key: str) -> list:
        value = info.get(key) or []
        if not isinstance(value, list) or len(value) > MAX_PATTERNS:
            raise HeaderError(f"{INFO_KEY}[{key!r}] should be a list of at most {MAX_PATTERNS}, found "
                              f"{type(value).__name__}", file=self.path)
        return value

    def _patterns(self, info: dict, key: str, where: str | None = None) -> list[regex.Pattern[str]]:
        return [self._compile(p, where or key) for p in self._list(info, key)]

    def _compile(self, pattern: Any, key: str) -> regex.Pattern[str]:
        if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN_CHARS:
            raise HeaderError(f"{INFO_KEY}[{key!r}] holds {str(pattern)[:80]!r}, not a pattern of at most "
                              f"{MAX_PATTERN_CHARS} characters", file=self.path)
        try:
            return regex.compile(pattern)  # the regex module's default (VERSION0) matches as re does
        except regex.error as exc:
            raise HeaderError(f"{INFO_KEY}[{key!r}] holds {pattern[:80]!r}, not a regular expression: {exc}",
                              file=self.path) from None

    def _matched(self, patterns: Patterns, name: str, key: str) -> bool:
        hits = [pattern for pattern, _ in patterns.matches(name)]
        if len(hits) > 1:  # DeepSpeed's converter refuses this too
            raise HeaderError(f"matches {len(hits)} patterns of {INFO_KEY}[{key!r}]: {hits[:4]}", file=self.path,
                              tensor=name)
        return bool(hits)

    def split(self, name: str, shapes: list[tuple[int, ...]], paths: list[str]) -> Split | Unmerged:
        """How the shards of parameter `name`, of these shapes (one per model-parallel rank, recorded in the files
        `paths`), make one tensor."""
        maps = [entry for _, entry in self.affine.matches(name)]
        if len(maps) > 1:
            raise HeaderError(f"matches {len(maps)} patterns of {INFO_KEY}['affine_map']", file=self.path,
                              tensor=name)
        if maps:
            if self.affine_version != AFFINE_VERSION:
                return Unmerged(f"its affine map has encoding version {self.affine_version!r}; this reader knows "
                                f"version {AFFINE_VERSION}")
            return self._vocabulary(name, affine_split(maps[0], shapes, name, self.path, paths))
        for _, reason in self.unsupported.matches(name)[:1]:
            return Unmerged(f"DeepSpeed records it cannot be rebuilt: {reason}")
        if self._matched(self.lists[REPLICATED], name, REPLICATED):
            _check_equal_except(shapes, None, name, paths)
            return self._vocabulary(name, replicated(shapes[0], len(shapes)))
        if self._matched(self.lists[AVERAGED], name, AVERAGED):
            _check_equal_except(shapes, None, name, paths)
            return self._vocabulary(name, averaged(shapes[0], len(shapes)))  # ds_to_universal cuts after any branch
        if self._matched(self.lists[TWO_SUB_PARAMS], name, TWO_SUB_PARAMS) or self.sub_params.matches(name):
            return Unmerged("a sub-parameter layout (fused parameters split per sub-parameter), which this reader "
                            "does not rebuild")
        dim = 1 if self._matched(self.lists[ROW_PARALLEL], name, ROW_PARALLEL) else 0
        return self._vocabulary(name, concatenated(shapes, dim, name, paths))

    def _vocabulary(self, name: str, split: Split | Unmerged) -> Split | Unmerged:
        """A vocabulary parameter: the rows past original_vocab_size (padding) are cut."""
        if isinstance(split, Unmerged) or not self._matched(self.lists[VOCABULARY], name, VOCABULARY):
            return split
        rows = self.vocab_size
        if rows is None or not split.shape or rows > split.shape[0]:
            raise HeaderError(f"is a vocabulary parameter of shape {split.shape}, but original_vocab_size is "
                              f"{rows!r}", file=self.path, tensor=name)
        shape = (rows, *split.shape[1:])
        blocks = []
        for held in split.blocks:
            kept = []
            for block in held:
                hit = intersect((block.full, block.shape), ((0,) * len(shape), shape))
                if hit is not None:
                    shard = tuple(s + h - f for s, h, f in zip(block.shard, hit[0], block.full))
                    kept.append(Block(shard, hit[0], hit[1]))
            blocks.append(tuple(kept))
        return Split(f"{split.placement}, cut to {rows} rows", shape, tuple(blocks))


def replicated(shape: tuple[int, ...], ranks: int) -> Split:
    """Every rank holds the whole tensor: model-parallel rank 0's copy is read."""
    return Split("Replicate()", shape, ((Block((0,) * len(shape), (0,) * len(shape), shape),),) + ((),) * (ranks - 1))


def averaged(shape: tuple[int, ...], ranks: int) -> Split:
    """Every rank holds a copy and the value is their mean (DeepSpeed's universal checkpoint averages them):
    each copy is one contribution of a Partial(avg) tensor."""
    return Split("Partial(avg)", shape, tuple((Block((0,) * len(shape), (0,) * len(shape), shape),)
                                              for _ in range(ranks)))


def concatenated(shapes: list[tuple[int, ...]], dim: int, name: str, paths: list[str]) -> Split:
    """The shards concatenated along `dim`, in model-parallel rank order."""
    if len(shapes[0]) <= dim:
        raise HeaderError(f"has shape {shapes[0]}: its shards cannot be concatenated along dim {dim}", file=paths[0],
                          tensor=name)
    _check_equal_except(shapes, dim, name, paths)
    blocks, at = [], 0
    for shape in shapes:
        full = tuple(at if d == dim else 0 for d in range(len(shape)))
        blocks.append((Block((0,) * len(shape), full, shape),))
        at += shape[dim]
    total = tuple(at if d == dim else n for d, n in enumerate(shapes[0]))
    return Split(f"Shard({dim})", total, tuple(blocks))


def _check_equal_except(shapes: list[tuple[int, ...]], dim: int | None, name: str, paths: list[str]) -> None:
    for mp, shape in enumerate(shapes[1:], 1):
        if len(shape) != len(shapes[0]) or any(a != b for d, (a, b) in enumerate(zip(shape, shapes[0])) if d != dim):
            need = "the same shape" if dim is None else f"the same sizes on every dimension but {dim}"
            raise HeaderError(f"model-parallel rank {mp} holds it with shape {shape}, rank 0 with {shapes[0]}; its "
                              f"split needs {need}", file=paths[mp], tensor=name)


def affine_split(entry: Any, shapes: list[tuple[int, ...]], name: str, path: str,
                 paths: list[str]) -> Split | Unmerged:
    """A parameter's affine map (deepspeed/checkpoint/affine.py, ParamAffineMap.to_dict) as blocks. A piece held
    by several ranks is read from the lowest of them."""
    def bad(what: str) -> HeaderError:
        return HeaderError(f"its affine map {what}", file=path, tensor=name)

    if not isinstance(entry, dict) or not isinstance(entry.get("ranks"), dict):
        raise bad("should be a dict with 'logical_shape' and 'ranks'")
    logical = _ints(entry.get("logical_shape"), bad, "logical_shape")
    ranks = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in entry["ranks"].items()}
    if set(ranks) != set(range(len(shapes))):
        raise bad(f"describes ranks {sorted(map(str, ranks))[:8]}, the checkpoint has model-parallel ranks "
                  f"0-{len(shapes) - 1}")
    blocks = []
    for mp, shape in enumerate(shapes):
        held = ranks[mp]
        if not isinstance(held, dict) or not isinstance(held.get("pieces"), list):
            raise bad(f"should give rank {mp} a dict with 'shard_shape' and 'pieces'")
        recorded = _ints(held.get("shard_shape"), bad, "shard_shape")
        if math.prod(recorded) != math.prod(shape):
            raise HeaderError(f"the affine map in {path} gives model-parallel rank {mp} a shard of shape {recorded}, "
                              f"this file records {shape}", file=paths[mp], tensor=name)
        if recorded != shape:  # the same elements viewed in another shape
            return Unmerged(f"its affine map gives rank {mp} a shard of shape {recorded}, a view of the saved {shape}")
        own = []
        for piece in held["pieces"]:
            if not isinstance(piece, dict):
                raise bad(f"holds a piece of rank {mp} that is not a dict")
            locations = piece.get("locations")
            if not isinstance(locations, list) or mp not in locations or not all(type(r) is int for r in locations):
                raise bad(f"holds a piece of rank {mp} whose locations {str(locations)[:40]} do not include it")
            if piece.get("scale", 1.0) != 1.0:
                return Unmerged(f"its affine map holds a piece scaled by {piece.get('scale')!r} (the shard holds "
                                "the values multiplied), which this reader does not undo")
            extent = _ints(piece.get("shape"), bad, "piece shape")
            full = _box(piece.get("source"), extent, logical)
            local = _box(piece.get("dest"), extent, shape)
            if full is None or local is None:
                return Unmerged("its affine map holds a piece that is not a box of the logical tensor and of the "
                                "shard, which this reader does not rebuild")
            if mp == min(locations) and math.prod(extent):
                own.append(Block(local, full, extent))
        blocks.append(tuple(own))
    split = Split("affine map", logical, tuple(blocks))
    # named as the plain split it is, when it is one (AutoTP describes every parameter by a map)
    plain = [replicated(logical, len(shapes))] if all(shape == logical for shape in shapes) else []
    plain += [concatenated(shapes, d, name, paths) for d in range(len(logical)) if all(
        len(shape) == len(logical) and all(a == b for e, (a, b) in enumerate(zip(shape, shapes[0])) if e != d)
        for shape in shapes)]
    return next((p for p in plain if p.shape == logical and p.blocks == split.blocks), split)


def _ints(value: Any, bad: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(type(n) is int and n >= 0 for n in value):
        raise bad(f"holds {what} {str(value)[:60]}, not a list of sizes")
    return tuple(value)


def _box(address: Any, extent: tuple[int, ...], within: tuple[int, ...]) -> tuple[int, ...] | None:
    """The offsets of the box of `extent` that an (offset, strides) address of a row-major `within` names, or
    None when the address is not such a box."""
    if not (isinstance(address, (list, tuple)) and len(address) == 2 and type(address[0]) is int
            and isinstance(address[1], (list, tuple)) and len(address[1]) == len(extent) == len(within)):
        return None
    flat, strides = address
    row_major = [math.prod(within[d + 1:]) for d in range(len(within))]
    if any(n > 1 and s != r for n, s, r in zip(extent, strides, row_major)):
        return None
    offsets = []
    for stride in row_major:
        offsets.append(flat // stride if stride else 0)
        flat -= offsets[-1] * stride
    if flat != 0 or any(o < 0 or o + n > w for o, n, w in zip(offsets, extent, within)):
        return None
    return tuple(offsets)
