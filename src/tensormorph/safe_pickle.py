"""An allowlist unpickler: rebuilds plain data and known records, never runs a checkpoint's code.

Every global a pickle names is looked up in an explicit table of harmless
stand-ins (our own functions and record classes). Any other global — such as
os.system, builtins.eval or a class with a `__reduce__` trick — is refused
with an UnsafePickleError naming it, before anything is called.

The work a pickle causes is bounded too. Its memo lets a few bytes name one object again and again, so a
1 KB pickle can describe a tree of 2**40 objects (a "billion laughs") that hashing, printing or walking the
result would expand. Each further reference to an object (memo GET, DUP) and each call's arguments are charged
their expanded size, and a pickle whose references or value expand beyond a budget proportional to its length
is refused. Keys whose hash values the pickle chose are counted per dict and set before they are inserted
(pickle_work), so hash-collision keys cannot make filling them quadratic. And one pickle cannot change how the next
one reads: the shared stand-ins are immutable, and only a record that the pickle itself created by calling an
allowed class can take state (BUILD).
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

from . import dtypes
from .errors import CheckpointError, HeaderError, UnsafePickleError
from .pickle_work import HASH_MODULUS, KeyHashes

Globals = Mapping[tuple[str, str], Any]

MAX_EXPANSION_PER_BYTE = 16
"""Objects each byte of a pickle may expand to. A pickle spends a byte or more on each object it writes out;
only references (2 to 5 bytes each) expand further. Real checkpoints refer again to strings, classes, dtypes and
the odd tied tensor: every torch.save, DCP, DeepSpeed and Megatron fixture of the tests, and DCP
metadata of 100,000 chunks, charge at most 0.35 objects per byte, and their values hold at most 0.3 per byte.
16 is far above any real file, while a hostile one is held to 16 times the work that reading a real pickle of
its length takes (a 1 GB DCP .metadata, millions of chunks: 16 billion objects at most)."""

MIN_EXPANSION_BUDGET = 1 << 20
"""Expanded objects any pickle may reach, however short: no small real pickle comes near it, and a hostile one
makes the readers walk at most a million objects (about a second)."""

EXPANSION_BYTES_PER_UNIT = 64
"""A string, bytes or integer counts one more object per this many bytes: printing or copying it again costs
its length."""
_INT_BITS_PER_UNIT = 8 * EXPANSION_BYTES_PER_UNIT


def expansion_budget(nbytes: int) -> int:
    """The most objects a pickle of `nbytes` bytes may expand to (its objects and its references to them)."""
    return max(MIN_EXPANSION_BUDGET, MAX_EXPANSION_PER_BYTE * nbytes)


@dataclass(frozen=True, slots=True)
class TorchDType:
    """Stand-in for a torch dtype object such as torch.float32 (slotted: one object serves every load)."""

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


def ordered_dict(*args: Any) -> collections.OrderedDict:
    return collections.OrderedDict(*args)


def latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Protocol-2 pickles of bytes go through _codecs.encode(str, 'latin1').
    if encoding not in ("latin1", "latin-1"):
        raise HeaderError(f"_codecs.encode with encoding {encoding!r} is not plain data")
    return text.encode("latin1")


BASE_GLOBALS: Globals = MappingProxyType({
    ("collections", "OrderedDict"): ordered_dict,
    ("torch", "Size"): tuple,  # readers check that sizes hold integers
    ("_codecs", "encode"): latin1_encode,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    **{("torch", name): TorchDType(name) for name in dtypes.TORCH_DTYPE_NAMES},
})
"""Globals that only build plain values; every safe reader starts from these."""

_SCALARS = frozenset({float, bool, complex, type(None)})
_CACHED_SIZE = 16  # an immutable container this big keeps its size: shared ones are not walked again
_PICKLE = pickle._Unpickler.dispatch  # the standard handlers


def _parts(value: Any) -> list[Any]:
    """The objects `value` holds: elements, keys and values, and instance attributes (records, tensor refs)."""
    if isinstance(value, (list, tuple, set, frozenset)):
        parts = list(value)
    elif isinstance(value, dict):
        parts = [*value.keys(), *value.values()]
    else:
        parts = []
    attributes = getattr(value, "__dict__", None)  # a class's is a mappingproxy: nothing of this pickle's
    if type(attributes) is dict:
        parts += [*attributes.keys(), *attributes.values()]
    return parts


def _call(handler: Callable[[Any], None], arguments: Callable[[Any], list[Any]]) -> Callable[[Any], None]:
    """A handler that calls a stand-in with `arguments(self)`: see _AllowlistUnpickler._load_reduce."""
    def load(self: _AllowlistUnpickler) -> None:
        self._charge(self._size(arguments(self)))
        handler(self)
        self._note_result(self.stack[-1])
    return load


class _AllowlistUnpickler(pickle._Unpickler):
    # The pure-Python unpickler, on purpose: its memo is a dict. The C one keeps an array sized by the
    # largest memo index, so a 12-byte LONG_BINPUT can make it allocate and zero gigabytes.
    #
    # Work is bounded by charging what can be walked again: each further reference to an object (GET, DUP)
    # and each call's arguments (a stand-in may hash, copy or print them) cost their expanded size (1 + the
    # sizes of the objects held, computed once per object and cached). Every other object was written out
    # in the pickle, so hashing a key, building the result and walking it cost at most the pickle's length
    # plus what was charged. Nothing may change once it has been sized, or the cached size would be stale:
    # that also refuses cycles, which need a reference to an unfinished object.

    def __init__(self, data: bytes | memoryview, allowed: Globals, persistent: Callable[[Any], Any] | None,
                 file: str | None):
        self._stream = io.BytesIO(data)
        super().__init__(self._stream)
        self.memo: dict[int, Any] = {}
        self._allowed = allowed
        self._persistent = persistent
        self._file = file
        self._length = len(data)
        self._budget = expansion_budget(self._length)
        self._work = 0
        self._shared = {id(value) for value in allowed.values()}
        self._sizes = dict.fromkeys([*self._shared, id(())], 1)  # id -> expanded size, of objects sized so far
        self._alive: list[Any] = []  # each object in _sizes, so that no other object takes its id
        self._fresh: dict[int, Any] = {}  # records that calls created and that have not taken state yet
        self._keys = KeyHashes(dict_makers=(ordered_dict,))

    def _too_big(self) -> HeaderError:
        return HeaderError(f"pickle expands to more than {self._budget} objects through shared references "
                           f"(the limit is {MAX_EXPANSION_PER_BYTE} per byte of its {self._length} bytes, "
                           f"at least {MIN_EXPANSION_BUDGET})")

    def _charge(self, size: int) -> None:
        self._work += size
        if self._work > self._budget:
            raise self._too_big()

    def _size(self, value: Any) -> int:
        """The expanded size of `value`: the objects in it, each counted once per path that reaches it."""
        kind = type(value)
        if kind is str or kind is bytes or kind is bytearray:  # printing or copying one costs its length
            return 1 + len(value) // EXPANSION_BYTES_PER_UNIT
        if kind is int:
            return 1 + value.bit_length() // _INT_BITS_PER_UNIT
        if kind in _SCALARS:
            return 1
        size = self._sizes.get(id(value))
        if size is None:
            size = 1
            for part in value if kind is tuple else _parts(value):
                part_kind = type(part)  # the common atoms inline: this runs for every argument of every call
                if part_kind is int:
                    size += 1 + part.bit_length() // _INT_BITS_PER_UNIT
                elif part_kind is str:
                    size += 1 + len(part) // EXPANSION_BYTES_PER_UNIT
                else:
                    size += self._size(part)
            if size > self._budget:
                raise self._too_big()
            if size >= _CACHED_SIZE or not (kind is tuple or kind is frozenset):
                self._sizes[id(value)] = size
                self._alive.append(value)
        return size

    def _note_result(self, value: Any) -> None:
        """Remember a record a call has just created (not handed back): only such a record may take state."""
        if id(value) not in self._sizes and (isinstance(value, (Record, collections.OrderedDict))
                                             or getattr(type(value), "__setstate__", None) is not None):
            self._fresh[id(value)] = value

    def _change(self, target: Any, kind: type, opcode: str, parts: int) -> None:
        """Refuse to let `target` take in `parts` objects unless it is a `kind` that has not been sized yet."""
        if not isinstance(target, kind):
            raise HeaderError(f"{opcode} onto a {type(target).__name__}, which is not a {kind.__name__}")
        if parts and id(target) in self._sizes:
            raise HeaderError(f"{opcode} changes a {type(target).__name__} that the pickle has already referred "
                              "to again (a cyclic or self-modifying pickle)")

    def _pop_mark(self) -> list[Any]:
        return self.pop_mark()  # type: ignore[attr-defined]  # typeshed omits pop_mark

    def _push_reference(self, index: int) -> None:
        try:
            value = self.memo[index]
        except KeyError:
            raise pickle.UnpicklingError(f"memo value not found at index {index}") from None
        self.append(value)
        # strings and globals inline: most references are to them
        if type(value) is str:
            self._work += 1 + len(value) // EXPANSION_BYTES_PER_UNIT
        else:
            self._work += self._sizes.get(id(value)) or self._size(value)
        if self._work > self._budget:
            raise self._too_big()

    def _load_binget(self) -> None:
        self._push_reference(self.read(1)[0])

    def _load_long_binget(self) -> None:
        self._push_reference(struct.unpack("<I", self.read(4))[0])

    def _load_dup(self) -> None:
        value = self.stack[-1]
        self.append(value)
        self._charge(self._size(value))

    def _load_append(self) -> None:
        value = self.stack.pop()
        target = self.stack[-1]
        self._change(target, list, "APPEND", 1)
        target.append(value)

    def _load_appends(self) -> None:
        items = self._pop_mark()
        target = self.stack[-1]
        self._change(target, list, "APPENDS", len(items))
        target.extend(items)

    def _load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        target = self.stack[-1]
        self._change(target, dict, "SETITEM", 1)
        if type(key) is not str:
            self._keys.admit((key,), target)
        target[key] = value

    def _load_setitems(self) -> None:
        items = self._pop_mark()
        target = self.stack[-1]
        self._change(target, dict, "SETITEMS", len(items))
        self._keys.admit(items[::2], target)
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _load_additems(self) -> None:
        items = self._pop_mark()
        target = self.stack[-1]
        self._change(target, set, "ADDITEMS", len(items))
        self._keys.admit(items, target)
        target.update(items)

    def _load_dict(self) -> None:
        items = self._pop_mark()
        self._keys.admit(items[::2])
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def _load_frozenset(self) -> None:
        items = self._pop_mark()
        self._keys.admit(items)
        self.append(frozenset(items))

    def _load_put(self) -> None:
        # The memo is a dict: indices of one hash value would make it quadratic. Below the modulus each index is
        # its own hash value, and no pickler numbers anywhere near 2**61 objects.
        index = int(self.readline()[:-1])
        if index >= HASH_MODULUS:
            raise HeaderError(f"PUT names memo index {index}; picklers number objects from 0, far below {HASH_MODULUS}")
        if index < 0:
            raise ValueError("negative PUT argument")
        self.memo[index] = self.stack[-1]

    def _load_build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if self._fresh.pop(id(target), None) is not target:
            shown = repr(target) if id(target) in self._shared else f"a {type(target).__name__}"
            raise HeaderError(f"BUILD would set the state of {shown}; only a record this pickle created takes state")
        self._change(target, object, "BUILD", 1)
        setstate = getattr(type(target), "__setstate__", None)  # the class's: never one the instance holds
        if setstate is not None:
            if isinstance(target, dict) and type(state) is dict:  # a dict-like record merges its state into itself
                self._keys.admit(state, target)
            setstate(target, state)
        elif type(state) is dict:  # an OrderedDict: torch keeps a state dict's _metadata as its attribute
            target.__dict__.update(state)
        else:
            raise HeaderError(f"the state of an OrderedDict should be a dict, found {type(state).__name__}")

    def _load_reduce(self) -> None:
        # a call: its arguments are charged before it (a stand-in may hash, copy or print them)
        stack = self.stack
        args = stack.pop()
        self._charge(self._size(args))
        self._keys.admit_call(stack[-1], args)
        stack[-1] = value = stack[-1](*args)
        self._note_result(value)

    def _load_newobj(self) -> None:
        stack = self.stack
        args = stack.pop()
        self._charge(self._size(args))
        self._keys.admit_call(stack[-1], args)
        stack[-1] = value = stack[-1].__new__(stack[-1], *args)
        self._note_result(value)

    def _load_newobj_ex(self) -> None:
        stack = self.stack
        self._charge(self._size(stack[-2:]))
        kwargs, args = stack.pop(), stack.pop()
        self._keys.admit_call(stack[-1], args)
        stack[-1] = value = stack[-1].__new__(stack[-1], *args, **kwargs)
        self._note_result(value)

    def _instantiate(self, klass: Any, args: list[Any]) -> None:  # OBJ and INST: calls klass(*args)
        self._keys.admit_call(klass, args)
        super()._instantiate(klass, args)  # type: ignore[misc]  # typeshed omits pickle's private _instantiate

    def _load_stop(self) -> None:
        value = self.stack.pop()
        # The value expands to the objects the pickle wrote out (a byte or more each), the references and call
        # arguments charged as work, and what the calls made of those (at most as much again, as text). Only a
        # pickle that refers to much may pass the budget, and only then is the value walked.
        if self._length + 2 * self._work > self._budget:
            self._size(value)
        raise pickle._Stop(value)  # type: ignore[attr-defined]  # typeshed omits pickle's private _Stop

    def _load_ext(self) -> None:
        # copyreg's extension cache is process-wide: it would carry one load's stand-ins into the next
        raise HeaderError("uses a pickle extension code (EXT1, EXT2 or EXT4), which no checkpoint needs")

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

    dispatch = cast(Any, {  # typeshed types these handlers as taking the C Unpickler; they take this class
        **_PICKLE,
        pickle.FRAME[0]: _skip_frame,
        pickle.BYTEARRAY8[0]: _load_bytearray8,
        pickle.GET[0]: lambda self: self._push_reference(int(self.readline()[:-1])),
        pickle.BINGET[0]: _load_binget,
        pickle.LONG_BINGET[0]: _load_long_binget,
        pickle.DUP[0]: _load_dup,
        pickle.APPEND[0]: _load_append,
        pickle.APPENDS[0]: _load_appends,
        pickle.SETITEM[0]: _load_setitem,
        pickle.SETITEMS[0]: _load_setitems,
        pickle.ADDITEMS[0]: _load_additems,
        pickle.DICT[0]: _load_dict,
        pickle.FROZENSET[0]: _load_frozenset,
        pickle.PUT[0]: _load_put,
        pickle.BUILD[0]: _load_build,
        pickle.REDUCE[0]: _load_reduce,
        pickle.NEWOBJ[0]: _load_newobj,
        pickle.NEWOBJ_EX[0]: _load_newobj_ex,
        pickle.OBJ[0]: _call(_PICKLE[pickle.OBJ[0]], lambda self: self.stack[1:]),
        pickle.INST[0]: _call(_PICKLE[pickle.INST[0]], lambda self: self.stack[:]),
        pickle.PERSID[0]: _call(_PICKLE[pickle.PERSID[0]], lambda self: []),
        pickle.BINPERSID[0]: _call(_PICKLE[pickle.BINPERSID[0]], lambda self: self.stack[-1:]),
        pickle.STOP[0]: _load_stop,
        pickle.EXT1[0]: _load_ext,
        pickle.EXT2[0]: _load_ext,
        pickle.EXT4[0]: _load_ext,
    })

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
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]  # typeshed omits pickle's private _Stop
            return stop.value

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise refused(module, name, file=self._file) from None

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise UnsafePickleError(f"unexpected persistent id {pid!r}", file=self._file)
        return self._persistent(pid)


def refused(module: str, name: str, *, file: str | None) -> UnsafePickleError:
    """The refusal of a global that is not on the allowlist."""
    return UnsafePickleError(f"refuses global {module}.{name}: it is not on the allowlist of plain data and tensor "
                             "records, and loading it could run code", file=file)


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
