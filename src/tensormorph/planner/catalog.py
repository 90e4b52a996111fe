"""Devices by name: the table of common GPUs and Apple chips in devices.json (memory, dense bf16 TFLOP/s,
memory bandwidth, and the public spec sheet each figure comes from), matched loosely.

Names match after lower-casing, dropping everything but letters and digits, and dropping vendor words
(`NVIDIA GeForce RTX 3090`, `rtx3090` and `RTX-3090` are one name), so nvidia-smi's names match too. A
name several entries share (`rtx 4060 ti`: 8 GB and 16 GB) is ambiguous unless the memory picks one.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from ..units import parse_size
from .spec import PlanError

_VENDOR_WORDS = frozenset({"nvidia", "geforce", "tesla", "amd", "instinct", "radeon", "apple"})
MEMORY_MATCH = 0.05  # a memory within 5% of an entry's picks it among ambiguous ones (GiB vs GB, firmware)
SUGGESTIONS = 5  # nearest names offered for an unknown one


@dataclass(frozen=True)
class Product:
    """One entry of the device table."""

    name: str
    kind: str  # gpu (named cuda:N) or apple (named mps)
    memory: int
    tflops: float | None  # dense bf16 TFLOP/s; None where the vendor publishes none
    bandwidth: float  # GB/s
    source: str
    note: str
    aliases: tuple[str, ...]


def normalize(text: str) -> str:
    """The key a name is matched by: letters and digits, lower case, vendor words dropped."""
    return "".join(w for w in re.findall(r"[a-z]+|[0-9]+", text.lower()) if w not in _VENDOR_WORDS)


@cache
def catalog() -> tuple[Product, ...]:
    """Every entry of devices.json, shipped inside the package."""
    data = json.loads(resources.files(__package__).joinpath("devices.json").read_text(encoding="utf-8"))
    return tuple(Product(name=d["name"], kind=d["kind"], memory=parse_size(d["memory"]), tflops=d["bf16_tflops"],
                         bandwidth=float(d["bandwidth_gbps"]), source=d["source"], note=d.get("note", ""),
                         aliases=tuple(d["aliases"])) for d in data["devices"])


@cache
def _index() -> dict[str, tuple[Product, ...]]:
    index: dict[str, list[Product]] = {}
    for product in catalog():
        for key in {normalize(product.name), *map(normalize, product.aliases)}:
            index.setdefault(key, []).append(product)
    return {key: tuple(found) for key, found in index.items()}


def _display(key: str) -> str:
    """A key as a user would type it: the alias (or name) it came from."""
    for product in _index()[key]:
        for text in (*product.aliases, product.name):
            if normalize(text) == key:
                return text
    return key


def _unique_alias(product: Product) -> str:
    """The first of a product's names that means it alone."""
    return next((text for text in (*product.aliases, product.name) if len(_index()[normalize(text)]) == 1),
                product.name)


def find(name: str, memory: int | None = None) -> tuple[Product, ...]:
    """The entries `name` may mean: one when it is known and unambiguous (or `memory` picks one), several when
    it is ambiguous, none when unknown."""
    found = _index().get(normalize(name), ())
    if len(found) > 1 and memory is not None:
        close = tuple(p for p in found if abs(p.memory - memory) <= MEMORY_MATCH * p.memory)
        found = close or found
    return found


def lookup(name: str, memory: int | None = None) -> Product:
    """The one entry `name` names; PlanError for an unknown name (with the nearest known ones) or an
    ambiguous one (with its candidates)."""
    found = find(name, memory)
    if len(found) == 1:
        return found[0]
    if found:
        choices = "; ".join(f"{_unique_alias(p)!r} ({p.name})" for p in found)
        raise PlanError(f"device {name!r} may be any of: {'; '.join(p.name for p in found)}; name one: {choices}")
    near = difflib.get_close_matches(normalize(name), list(_index()), n=SUGGESTIONS, cutoff=0.5)
    hint = f"did you mean {', '.join(repr(_display(k)) for k in near)}? " if near else ""
    raise PlanError(f"device {name!r} is not in the device table; {hint}Or give its figures: "
                    "NAME=MEMORY,tflops=T,bw=GBPS (or NAME=MEMORY alone, planning by memory)")
