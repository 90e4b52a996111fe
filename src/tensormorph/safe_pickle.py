"""An allowlist unpickler: rebuilds plain data and known records, never runs a checkpoint's code.

Every global a pickle names is looked up in an explicit table of harmless
stand-ins (our own functions and record classes). Any other global — such as
os.system, builtins.eval or a class with a `__reduce__` trick — is refused
with an UnsafePickleError naming it, before anything is called.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import dtypes
from .errors import CheckpointError, HeaderError, UnsafePickleError

Globals = Mapping[tuple[str, str], Any]


@dataclass(frozen=True)
class TorchDType:
    """Stand-in for a torch dtype object such as torch.float32."""

    torch_name: str

    @property
    def vocabulary(self) -> str:
        return dtypes.TORCH_DTYPE_NAMES[self.torch_name]

    def __repr__(self) -> str:
        return f"torch.{self.torch_name}"


class Record:
    """Stand-in for an allowed class: keeps constructor arguments and pickled state as attributes."""

    kind = "Record"

    def __init__(self, *args: Any, **kwargs: Any):
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        # dataclasses with __slots__ pickle as (dict_state, slot_state); others as a dict.
        # Filling the instance dict is harmless whatever the keys: special methods are looked up on the type.
        if type(state) is tuple and len(state) == 2 and all(s is None or type(s) is dict for s in state):
            for part in state:
                if part:
                    self.__dict__.update(part)
        elif type(state) is dict:
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{self.kind}({fields})"


def record_class(kind: str) -> type[Record]:
    """A fresh Record subclass named after the class it stands in for."""
    return type(kind, (Record,), {"kind": kind})


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    return collections.OrderedDict(*args)


def _encode(text: str, encoding: str = "latin1") -> bytes:
    # Protocol-2 pickles of bytes go through _codecs.encode(str, 'latin1').
    if encoding not in ("latin1", "latin-1"):
        raise HeaderError(f"_codecs.encode with encoding {encoding!r} is not plain data")
    return text.encode("latin1")


BASE_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): _ordered_dict,
    ("torch", "Size"): tuple,  # readers check that sizes hold integers
    ("_codecs", "encode"): _encode,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    **{("torch", name): TorchDType(name) for name in dtypes.TORCH_DTYPE_NAMES},
}
"""Globals that only build plain values; every safe reader starts from these."""


class _AllowlistUnpickler(pickle._Unpickler):
    # The pure-Python unpickler, on purpose: its memo is a dict. The C one keeps an array sized by the
    # largest memo index, so a 12-byte LONG_BINPUT can make it allocate and zero gigabytes.

    def __init__(self, data: bytes | memoryview, allowed: Globals, persistent: Callable[[Any], Any] | None,
                 file: str | None):
        self._stream = io.BytesIO(data)
        super().__init__(self._stream)
        self._allowed = allowed
        self._persistent = persistent
        self._file = file

    def _skip_frame(self) -> None:
        self.read(8)  # a frame only announces its length: the whole stream is already in memory

    def _load_bytearray8(self) -> None:
        # pickle's own handler allocates the announced length before reading: a forged 8-byte length
        # would make it zero gigabytes. Nothing longer than what is left in the stream can be real.
        (length,) = struct.unpack("<Q", self.read(8))
        left = len(self._stream.getbuffer()) - self._stream.tell()
        if length > left:
            raise HeaderError(f"a BYTEARRAY8 claims {length} bytes, but only {left} remain in the pickle",
                              file=self._file)
        self.append(bytearray(self.read(length)))

    # typeshed types this table's handlers as taking the C `pickle.Unpickler`; pickle calls them with the
    # pure-Python `_Unpickler` (here, this subclass)
    dispatch = {**pickle._Unpickler.dispatch, pickle.FRAME[0]: _skip_frame,  # type: ignore[dict-item]
                pickle.BYTEARRAY8[0]: _load_bytearray8}  # type: ignore[dict-item]

    def load(self) -> Any:
        # pickle's own loop reads through _Unframer, a Python call per read; reading the in-memory
        # stream directly makes the pure-Python unpickler about twice as fast.
        stream = self._stream
        self.read, self.readline, self.readinto = stream.read, stream.readline, stream.readinto
        self.metastack: list[list[Any]] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError("pickle ends without a STOP opcode")
                dispatch[key[0]](self)  # type: ignore[arg-type]  # typeshed: see `dispatch` above
        except pickle._Stop as stop:  # type: ignore[attr-defined]  # typeshed omits pickle's private _Stop
            return stop.value

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                f"refuses global {module}.{name}: it is not on the allowlist of plain data and tensor records, "
                "and loading it could run code", file=self._file) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafePickleError(f"unexpected persistent id {pid!r}", file=self._file)
        return self._persistent(pid)


def loads(data: bytes | memoryview, allowed: Globals = BASE_GLOBALS, *,
          persistent: Callable[[Any], Any] | None = None, file: str | None = None) -> Any:
    """Unpickle `data` using only the stand-ins in `allowed`.

    Returns the value, or raises a CheckpointError (UnsafePickleError for a refused global,
    HeaderError for a malformed stream); never any other exception.
    """
    try:
        return _AllowlistUnpickler(data, allowed, persistent, file).load()
    except CheckpointError as exc:
        if exc.file is None and file is not None:
            raise type(exc)(exc.reason, file=file, tensor=exc.tensor) from None
        raise
    except RecursionError:
        raise HeaderError("pickle is nested too deeply", file=file) from None
    except Exception as exc:  # any malformed stream: the pickle module raises many types
        raise HeaderError(f"pickle is malformed ({type(exc).__name__}: {exc})", file=file) from None


def is_plain(value: Any, depth: int = 0) -> bool:
    """True for values made only of numbers, strings, bytes, None, bools and containers of them."""
    if depth > 100:
        return False
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, TorchDType)):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(is_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
    return False
