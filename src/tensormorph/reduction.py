"""Reducing the contributions of a `Partial` placement to the logical value, in a fixed, documented order.

A tensor placed `Partial(op)` over some mesh dimensions is stored as one contribution per coordinate of
those dimensions (contribution i is the i-th coordinate in row-major order). Its logical value is

    sum: ((c0 + c1) + c2) + ...        avg: the sum, divided by the number of contributions
    min / max: element-wise, NaN-propagating as torch.minimum / torch.maximum

computed in the tensor's own dtype (the avg's division in float32 for dtypes narrower than that), left to right
by contribution index, so every reader gets the same bits.
Torch's `full_tensor()` reduces in its collective's order; with two contributions any order gives the same
bits (float addition is commutative), with more the results agree to rounding.

Integers: a sum is refused (CheckpointError naming the tensor) as soon as a partial sum, in that order, leaves the
dtype's range, never wrapped (torch's collectives wrap); `sum` and `avg` of float8_e8m0fnu, which has no zero, are
refused too. `avg` is defined for floating dtypes only (torch refuses it for integers too), and `sum`/`avg`
of booleans is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import CheckpointError, UnsupportedError

REDUCE_OPS = ("sum", "avg", "min", "max")


@dataclass(frozen=True)
class Reduction:
    """How a Partial tensor's stored contributions combine into its value."""

    op: str  # one of REDUCE_OPS
    contributions: int  # how many are stored (the product of the Partial mesh dimensions' sizes)
    mesh_dims: tuple[int, ...] = ()  # the mesh dimensions placed Partial

    def describe(self) -> str:
        dims = self.mesh_dims
        over = f" over mesh dim{'s' if len(dims) > 1 else ''} {', '.join(map(str, dims))}" if dims else ""
        return f"Partial({self.op}){over}: {self.contributions} contribution{'s' if self.contributions != 1 else ''}"


def check_reducible(op: str, dtype: np.dtype, tensor: str | None = None) -> None:
    """UnsupportedError naming the tensor when `op` has no meaning for `dtype`."""
    if op not in REDUCE_OPS:
        raise UnsupportedError(f"unknown reduce op {op!r}: expected one of {', '.join(REDUCE_OPS)}", tensor=tensor)
    if op in ("sum", "avg") and dtype == np.bool_:
        raise UnsupportedError(f"Partial({op}) of a boolean tensor has no value", tensor=tensor)
    if op in ("sum", "avg") and dtype.name == "float8_e8m0fnu":
        raise UnsupportedError(f"Partial({op}) of float8_e8m0fnu (powers of two, no zero) has no value", tensor=tensor)
    if op == "avg" and dtype.kind in "iu":
        raise UnsupportedError("Partial(avg) of an integer tensor is undefined (torch refuses it too)", tensor=tensor)


def combine(op: str, total: np.ndarray, piece: np.ndarray, tensor: str | None = None) -> None:
    """Fold one more contribution `piece` into `total`, in place (avg sums here; `finish` divides)."""
    if op in ("sum", "avg"):
        if total.dtype.kind in "iu":
            _checked_integer_sum(total, piece, tensor)
        else:
            np.add(total, piece, out=total)
    elif op == "max":
        np.maximum(total, piece, out=total)
    elif op == "min":
        np.minimum(total, piece, out=total)
    else:
        raise UnsupportedError(f"unknown reduce op {op!r}", tensor=tensor)


def finish(op: str, total: np.ndarray, contributions: int) -> None:
    """Complete the reduction in place once every contribution is folded in."""
    if op == "avg" and contributions > 1:  # narrow floats cannot hold the count exactly: divide in float32
        wide = np.float32 if total.dtype.itemsize < 4 else total.dtype.type
        total[...] = (total.astype(wide) / wide(contributions)).astype(total.dtype)


def _checked_integer_sum(total: np.ndarray, piece: np.ndarray, tensor: str | None) -> None:
    info = np.iinfo(total.dtype)
    if total.dtype.itemsize < 8:  # exact in int64, then range-checked
        wide = total.astype(np.int64) + piece.astype(np.int64)
        bad = (wide < info.min) | (wide > info.max)
        result = wide
    elif total.dtype.kind == "i":  # int64: a wrapped sum has the sign neither operand had
        result = total + piece
        bad = ((total ^ result) & (piece ^ result)) < 0
    else:  # uint64: a wrapped sum is smaller than an operand
        result = total + piece
        bad = result < total
    if np.any(bad):
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckpointError(
            f"the Partial(sum) of its contributions leaves the range of {total.dtype} at element {list(at)} "
            f"({int(total[at])} + {int(piece[at])}): refused rather than wrapped", tensor=tensor)
    total[...] = result
