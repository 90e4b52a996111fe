"""Bounds on the shapes, offsets and sizes a file declares, checked before any arithmetic on them.

A header may declare any JSON or pickle integer: thousands of dimensions, or integers of thousands of digits.
Multiplying or formatting those costs time quadratic in their size (and Python refuses to print one of more
than 4300 digits), so every reader checks declared shapes and offsets here first, and messages show a huge
integer by its bit length only.
"""

from __future__ import annotations

from typing import Any

from .errors import HeaderError

MAX_DIMS = 64
"""Most dimensions a tensor may declare: numpy's own limit (NPY_MAXDIMS), so no readable tensor has more."""
MAX_DIM = 2**62
"""Dimensions at or above this are rejected as corrupt: no real tensor is that large, and numpy cannot index it."""
MAX_OFFSET = 2**63
"""Byte or element offsets, lengths and sizes a file declares lie in [0, MAX_OFFSET): what an int64 holds."""
_SHOWN_ITEMS = 8  # a refused shape shows this many dimensions at most


def describe(value: Any) -> str:
    """`value` for a message: an integer of more than 64 bits by its bit length, never all its digits; a list or
    tuple by its first items."""
    if type(value) is int and value.bit_length() > 64:
        return f"<{'-' if value < 0 else ''}{value.bit_length()}-bit integer>"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(describe(item) for item in value[:_SHOWN_ITEMS])
        return f"[{shown}, ... ({len(value)} items)]" if len(value) > _SHOWN_ITEMS else f"[{shown}]"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_shape(shape: Any, *, file: str | None, tensor: str | None, what: str = "shape") -> tuple[int, ...]:
    """`shape` as a tuple, once it is a list or tuple of at most MAX_DIMS ints (not bools) in [0, MAX_DIM).

    HeaderError naming the file and tensor otherwise."""
    if not isinstance(shape, (list, tuple)):
        raise HeaderError(f"{what} must be a list of integers, found {describe(shape)}", file=file, tensor=tensor)
    if len(shape) > MAX_DIMS:
        raise HeaderError(f"{what} has {len(shape)} dimensions; at most {MAX_DIMS} are allowed",
                          file=file, tensor=tensor)
    for d in shape:
        if type(d) is not int or not 0 <= d < MAX_DIM:
            raise HeaderError(f"{what} must be a list of integers in [0, 2**62), found {describe(shape)}",
                              file=file, tensor=tensor)
    return tuple(shape)


def check_offset(value: Any, *, file: str | None, tensor: str | None, what: str) -> int:
    """`value` once it is an int (not a bool) in [0, MAX_OFFSET); HeaderError naming the file and tensor otherwise."""
    if type(value) is not int or not 0 <= value < MAX_OFFSET:
        raise HeaderError(f"{what} must be an integer in [0, 2**63), found {describe(value)}", file=file, tensor=tensor)
    return value
