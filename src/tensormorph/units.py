"""Byte sizes as people write them ('5GB', '2GiB', '500 MB') and as we print them ('1.5 GiB')."""

from __future__ import annotations

import math
import re

from .errors import CheckpointError

# an optional sign, a number with an optional fraction ('1.5', '1.', '.5'; no exponent), then an optional unit
_SIZE = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)$")
# GB, MB... count in powers of 1000 as Hugging Face does; GiB, MiB... in powers of 1024
_UNITS = {"B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str, what: str | None = None, *, unit_required: bool = False, signed: bool = False) -> int:
    """Bytes in a size: '5GB' -> 5_000_000_000, '2GiB' -> 2_147_483_648, '1.5 MB' -> 1_500_000, '512' -> 512.

    Units are case-insensitive: B; K, KB, M, MB, G, GB, T, TB (powers of 1000); KiB, MiB, GiB, TiB (powers of 1024).
    `unit_required` refuses a bare number, for sizes where '24' is ambiguous (24 bytes or 24 GB?).
    `signed` accepts a leading '-' so that the caller can say why a negative size is wrong.
    `what` names the size in the error message. Errors are CheckpointError.
    """
    prefix = f"{what}: " if what else ""
    match = _SIZE.match(text.strip())
    sign, number, unit = match.groups() if match else ("", "", "")
    unit = unit.upper() or ("" if unit_required else "B")
    # where a unit is required, K/M/G/T alone are refused too: '80G' could mean GB or GiB
    ambiguous = unit_required and not unit.endswith("B")
    if not match or unit not in _UNITS or ambiguous or (sign == "-" and not signed):
        hint = "; write a number with a unit, e.g. 24GiB or 500MB" if unit_required else ": use e.g. 5GB, 500MB, 2GiB"
        raise CheckpointError(f"{prefix}cannot read size {text!r}{hint}")
    value = float(sign + number) * _UNITS[unit]
    if not math.isfinite(value):
        raise CheckpointError(f"{prefix}size {text!r} is not a finite number")
    return int(value)


def human_bytes(nbytes: float) -> str:
    """Bytes as a short human string (KiB, MiB, ...)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def number_ranges(numbers: tuple[int, ...]) -> str:
    """'0-23' or '0-3, 9' for sorted numbers; '' when none."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
