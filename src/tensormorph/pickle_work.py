"""A bound on the work of hashing keys that a pickle chose: hash-collision keys ("HashDoS") are refused.

A dict or set compares a new key with every key it holds of the same full hash value, so N keys of one hash value
cost N**2/2 comparisons: 20,000 of them in a 280 KB pickle take 9 s, a 100 MB one hours. Hashes of str and bytes
are salted per process, but a pickle can choose those of numbers and of tuples of them: numbers hash to their value
modulo the prime 2**61 - 1 (k * (2**61 - 1) + c all hash to c; a float's hash is its mantissa's 61 bits rotated by
its exponent), and the tuple hash is an invertible mix of its items' hashes (whatever the first item, a second one
can be computed that completes any chosen hash). So each dict and set that a pickle fills counts its keys per hash
value, and a key past MAX_KEYS_PER_HASH of one hash value is refused before it is inserted.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from .errors import HeaderError

MAX_KEYS_PER_HASH = 64
"""Keys of one dict, or members of one set, that may share a hash value the pickle can choose. Inserting the n-th
compares it with the n - 1 before it, so a pickle of groups of 64 such keys in one dict reads about 2 times slower
than one of distinct keys of its length (2.8 against 1.3 microseconds a key, for integers), and real ones are not
slowed. Distinct keys of real data share a hash by accident only: x and x * 2**61 do, and -1 and -2, so tuples
holding -1 or -2 in six places can be 2**6 = 64 keys of one hash value."""

HASH_MODULUS = sys.hash_info.modulus
"""2**61 - 1: a number hashes to its value modulo this prime."""
_SALTED_OR_FEW = frozenset({str, bytes, bool, type(None)})  # salted per process, or two values at most


def hash_values(keys: Iterable[Any]) -> list[int]:
    """The hash values of the keys whose hash a pickle can choose: all but strings, bytes, bools, None and integers
    below the modulus (each its own hash value, but -1 and -2)."""
    return [hash(key) for key in keys
            if type(key) not in _SALTED_OR_FEW and (type(key) is not int or not -HASH_MODULUS < key < HASH_MODULUS)]


class KeyHashes:
    """The hash values of the keys each dict or set holds, where the pickle chose them."""

    def __init__(self, dict_makers: tuple[Any, ...] = (), file: str | None = None) -> None:
        self._dict_makers = dict_makers  # functions that, like dict, make a dict of their first argument
        self._file = file  # named by the refusal
        # id -> (the container, kept alive so that its id stays its own; the hash values of its keys; how many
        # keys share each hash value held more than once)
        self._held: dict[int, tuple[Any, set[int], dict[int, int]]] = {}

    def admit(self, keys: Iterable[Any], into: Any = None) -> None:
        """Refuse `keys` before a dict or set hashes them: `into` (counting the keys it holds on first sight), or
        a new one when None. Costs one hash per key whose hash value the pickle chose, and nothing for the rest."""
        values = hash_values(keys)
        if not values:
            return
        if into is None:
            self._add(set(), {}, values)
            return
        entry = self._held.get(id(into))
        if entry is None:
            entry = self._held[id(into)] = (into, set(), {})
            self._add(entry[1], entry[2], hash_values(into))
        self._add(entry[1], entry[2], values)

    def admit_call(self, func: Any, args: Any) -> None:
        """Refuse the keys or members that calling `func(*args)` would hash: those of the first argument of a dict,
        set or frozenset type (or its __new__: frozenset's builds too) or of a dict maker."""
        makes_dict = func in self._dict_makers or isinstance(func, type) and issubclass(func, dict)
        if not args or not (makes_dict or isinstance(func, type) and issubclass(func, (set, frozenset))):
            return
        source = args[0]
        if makes_dict:  # a mapping, or (key, value) pairs
            self.admit(source.keys() if isinstance(source, dict) else [tuple(pair)[0] for pair in source])
        else:
            self.admit(source)

    def _add(self, seen: set[int], repeats: dict[int, int], values: list[int]) -> None:
        # The hash values are counted in a set and a dict, which hash them in turn: an integer's hash is its value
        # modulo 2**61 - 1, so at most 10 of the 2**64 hash values share one there, and the counting cannot itself
        # be flooded. Sets and dicts compare the full hash, so these counts are exact.
        if seen.isdisjoint(values):
            size = len(seen)
            seen.update(values)
            if len(seen) == size + len(values):  # each a new hash value: the usual case, all in C loops
                return
            seen.difference_update(values)  # one came twice in this batch: count them one by one
        for value in values:
            if value not in seen:
                seen.add(value)
                continue
            count = repeats[value] = repeats.get(value, 1) + 1
            if count > MAX_KEYS_PER_HASH:
                raise HeaderError(f"{count} keys share one hash value in one dict or set (the limit is "
                                  f"{MAX_KEYS_PER_HASH}): hash-collision keys make each insertion compare with all "
                                  "the others", file=self._file)
