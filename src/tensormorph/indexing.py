"""Index plans: numpy-style indices (ints, slices with steps, Ellipsis) over a tensor's shape, intersected with
stored boxes, and the same indices parsed from text without eval."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CheckpointError


@dataclass(frozen=True)
class _DimPlan:
    start: int
    step: int  # > 0
    count: int
    drop: bool  # an integer index: the dimension disappears from the result
    reverse: bool  # a negative step: gather forwards, flip at the end


@dataclass(frozen=True)
class IndexPlan:
    dims: tuple[_DimPlan, ...]

    @staticmethod
    def build(index: Any, shape: tuple[int, ...], name: str) -> IndexPlan:
        items = index if isinstance(index, tuple) else (index,)
        if sum(1 for item in items if item is Ellipsis) > 1:
            raise CheckpointError("an index can hold only one Ellipsis", tensor=name)
        explicit = [item for item in items if item is not Ellipsis]
        if len(explicit) > len(shape):
            raise CheckpointError(f"too many indices ({len(explicit)}) for a tensor of shape {shape}", tensor=name)
        expanded: list[Any] = []
        for item in items:
            if item is Ellipsis:
                expanded.extend([slice(None)] * (len(shape) - len(explicit)))
            else:
                expanded.append(item)
        expanded.extend([slice(None)] * (len(shape) - len(expanded)))
        dims = []
        for axis, (item, size) in enumerate(zip(expanded, shape)):
            if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
                position = int(item) + size if item < 0 else int(item)
                if not 0 <= position < size:
                    raise CheckpointError(f"index {item} is out of range for axis {axis} of size {size}", tensor=name)
                dims.append(_DimPlan(position, 1, 1, True, False))
            elif isinstance(item, slice):
                if item.step == 0:
                    raise CheckpointError(f"slice step cannot be zero (axis {axis})", tensor=name)
                start, stop, step = item.indices(size)
                positions = range(start, stop, step)
                count = len(positions)
                if step < 0 and count:
                    dims.append(_DimPlan(positions[-1], -step, count, False, True))
                else:
                    dims.append(_DimPlan(start if count else 0, abs(step), count, False, False))
            else:
                raise CheckpointError(
                    f"unsupported index {item!r} on axis {axis}: use ints, slices or Ellipsis", tensor=name)
        return IndexPlan(tuple(dims))

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(d.count for d in self.dims)

    def intersect(self, offsets: tuple[int, ...],
                  shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
        """(index into the chunk, index into the output) for the overlap, or None when empty."""
        source, target = [], []
        for d, o, s in zip(self.dims, offsets, shape):
            if d.count == 0 or s == 0:
                return None
            # selected positions are d.start + k*d.step for k in [0, d.count)
            first = max(0, -(-(o - d.start) // d.step))
            last = min(d.count, -(-(o + s - d.start) // d.step))
            if first >= last:
                return None
            begin = d.start + first * d.step - o
            source.append(slice(begin, begin + (last - first - 1) * d.step + 1, d.step))
            target.append(slice(first, last))
        return tuple(source), tuple(target)

    def finish(self, out: np.ndarray) -> np.ndarray:
        flips = tuple(slice(None, None, -1) if d.reverse else slice(None) for d in self.dims)
        if any(d.reverse for d in self.dims):
            out = np.ascontiguousarray(out[flips])
        drops = tuple(0 if d.drop else slice(None) for d in self.dims)
        return out[drops] if any(d.drop for d in self.dims) else out


def parse_index(text: str) -> tuple[Any, ...]:
    """Parse a numpy-style index written as text ('0:4, 100:108', '..., -1', '::2') without eval."""
    items: list[Any] = []
    for part in (p.strip() for p in text.split(",")) if text.strip() else []:
        if part in ("...", "…"):
            items.append(Ellipsis)
            continue
        fields = part.split(":")
        try:
            if len(fields) == 1:
                items.append(int(fields[0]))
            elif len(fields) <= 3:
                items.append(slice(*(int(f) if f.strip() else None for f in fields)))
            else:
                raise ValueError
        except ValueError:
            raise CheckpointError(f"cannot parse index {part!r} in {text!r}: use ints, start:stop[:step] or ...") \
                from None
    return tuple(items)
