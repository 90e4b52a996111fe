"""DCP `.metadata` reduced to the few fields the reader needs, in plain lists (JSON-able).

This module imports only the standard library: it also runs as the script of a child process
(`python -I -S dcp_summary.py`), which unpickles a large `.metadata` with CPython's C unpickler (about four
times faster than the pure-Python one) under hard CPU and memory limits. The C unpickler cannot be run on a
hostile file in the reader's own process: a LONG_BINPUT index makes it allocate and zero a memo array of that
size, and keys chosen to share one hash value make filling a dict quadratic. In the child those attacks end as
its resource limits, which dcp_metadata reports as errors naming the file.

The child's protocol, in `marshal` (builtin, so the child imports nothing for it, and five times faster than
JSON both ways): on stdin the request's length in 8 bytes, the request (the allowlist as tags, the limits), then
the pickle's bytes; on stdout {"summary": ...} or {"error": message, "tensor": name or None, "unsafe": list or
None}. marshal is no weaker a boundary than JSON here: the child's output is made by the code below from plain
values, and a child taken over through the C unpickler would already run as the user.

`summarize` walks the records once, counting the nodes it visits and the bytes it writes out against a budget,
so shared references (a "billion laughs" pickle) cannot make it expand the metadata beyond that budget. It runs
on the records of either unpickler: the C one's stand-ins below, or safe_pickle's Records in process.
"""

from __future__ import annotations

import _pickle  # the C unpickler itself: `pickle` would also import `re` and more, in a child started cold
import gc
import io
import marshal
import sys
from collections import OrderedDict
from typing import Any

TENSOR_ENTRY = "TensorStorageMetadata"
STATE_RECORDS = ("TensorProperties",)
"""Records whose pickled state is not a dict (TensorProperties pickles a tuple), kept as `.state`."""


class Malformed(Exception):
    """The records are not DCP metadata as expected; the message names the field (and the tensor, if any)."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class Refused(Exception):
    """The pickle names a global that is not on the allowlist."""

    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


class _Budget:
    """Nodes visited and text written out: the walk stops past `limit` units."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def charge(self, units: int) -> None:
        self.used += units
        if self.used > self.limit:
            raise Malformed(f"expands to more than {self.limit} objects through shared references")


def _kind(value: Any) -> str:
    return type(value).__name__


def _text_units(text: str) -> int:
    return 1 + len(text) // 64


def plain(value: Any, budget: _Budget) -> Any:
    """A metadata field as a JSON-able value: records as dicts of their fields, others as their repr."""
    budget.charge(1)
    if isinstance(value, str):
        budget.charge(len(value) // 64)
        return value
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if isinstance(getattr(type(value), "kind", None), str) and type(getattr(value, "__dict__", None)) is dict:
        return {k: plain(v, budget) for k, v in vars(value).items() if k != "args"}  # a record stand-in
    if isinstance(value, dict):
        return {_key(k): plain(v, budget) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, budget) for v in value]
    # A repr only where it cannot hold an address or records: the summary is the same from either unpickler.
    text = repr(value) if isinstance(value, (bytes, complex)) or _kind(value) == "TorchDType" else f"<{_kind(value)}>"
    budget.charge(_text_units(text))
    return text


def _key(key: Any) -> str:
    return str(key) if isinstance(key, (str, int, float, bool)) or key is None else f"<{_kind(key)}>"


def _planner_data(value: Any, budget: _Budget) -> Any:
    """fqn -> the original nesting path (kept cheap: it has an entry per tensor)."""
    if not isinstance(value, dict):
        return plain(value, budget)
    paths = {}
    for key, path in value.items():
        if type(key) is str and type(path) is tuple and all(type(part) is str for part in path):
            budget.charge(2 + len(path) + (len(key) + sum(map(len, path))) // 64)
            paths[key] = list(path)
        else:
            budget.charge(1)
            paths[_key(key)] = [plain(part, budget) for part in path] if type(path) is tuple else plain(path, budget)
    return paths


def _field(record: Any, name: str, expected: type | tuple[type, ...], default: Any = ...) -> Any:
    value = getattr(record, name, default)
    if value is ...:
        raise Malformed(f"{_kind(record)} lacks field {name!r}")
    if value is not None and not isinstance(value, expected):
        raise Malformed(f"{_kind(record)}.{name} should be {expected}, found {_kind(value)}")
    return value


def _numbers(value: Any, budget: _Budget) -> Any:
    """A size or offsets as a list (checked by the reader), or the value's repr when it is not a sequence."""
    kind = type(value)
    if kind is tuple or kind is list:
        budget.charge(1 + len(value))  # at once: one entry's chunks may all share one long list
        for v in value:
            if type(v) is not int:
                return [v if type(v) is int else plain(v, budget) for v in value]
        return list(value)
    return plain(value, budget)


def _dtype(properties: Any, budget: _Budget) -> str | None:
    dtype = getattr(properties, "dtype", None)
    state = getattr(properties, "state", None)
    if dtype is None and isinstance(state, tuple) and state:
        dtype = state[0]
    name = getattr(dtype, "torch_name", None) if _kind(dtype) == "TorchDType" else None
    if isinstance(name, str):
        budget.charge(_text_units(name))
    return name if isinstance(name, str) else None


def _entry(fqn: Any, entry: Any, budget: _Budget) -> list[Any]:
    if type(fqn) is not str:
        raise Malformed(f"state_dict_metadata key {_kind(fqn)} is not a string")
    kind = _kind(entry)
    if kind != TENSOR_ENTRY:
        budget.charge(_text_units(fqn))
        return [fqn, kind]
    chunks = getattr(entry, "chunks", None) or []
    if not isinstance(chunks, (list, tuple)):
        raise Malformed(f"TensorStorageMetadata.chunks should be a list, found {_kind(chunks)}", tensor=fqn)
    budget.charge(_text_units(fqn) + len(chunks))
    return [fqn, kind, _dtype(getattr(entry, "properties", None), budget),
            _numbers(getattr(entry, "size", None), budget),
            [[_numbers(getattr(c, "offsets", None), budget), _numbers(getattr(c, "sizes", None), budget)]
             for c in chunks]]


def _storage(index: Any, info: Any, budget: _Budget) -> list[Any]:
    fqn = getattr(index, "fqn", None)
    if _kind(index) != "MetadataIndex" or type(fqn) is not str:
        raise Malformed(f"storage_data key {_kind(index)} is not a MetadataIndex")
    offset = getattr(index, "offset", None)
    # A record's fields straight from its __dict__ (the stand-ins have no class attributes of these names, so this
    # is what getattr gives), checked by _field only when one is not of the plain type: this runs once per item.
    fields = getattr(info, "__dict__", None)
    if type(fields) is not dict:
        fields = {}
    relative, begin, length = fields.get("relative_path"), fields.get("offset"), fields.get("length")
    if type(relative) is not str or type(begin) is not int or type(length) is not int:
        relative, begin, length = (_field(info, "relative_path", str), _field(info, "offset", int),
                                   _field(info, "length", int))
        if relative is None:
            raise Malformed("_StorageInfo.relative_path should be a string, found None", tensor=fqn)
    transforms = fields.get("transform_descriptors")
    if transforms is not None:  # DCP's compression (zstd) names its transforms here; most items have none
        transforms = _field(info, "transform_descriptors", (list, tuple))
        if not all(isinstance(t, str) for t in transforms):
            raise Malformed(f"transform_descriptors should be strings, found {len(transforms)} values of which "
                            f"some are not", tensor=fqn)
        budget.charge(len(transforms))
    budget.charge(_text_units(fqn) + _text_units(relative))
    return [fqn, None if offset is None else _numbers(offset, budget), relative, begin, length,
            list(transforms) if transforms else []]


def summarize(record: Any, limit: int) -> dict[str, Any]:
    """The entries and storage items of one `.metadata`'s Metadata record, walked within `limit` units."""
    if _kind(record) != "Metadata":
        raise Malformed(f"holds a {_kind(record)}, not DCP Metadata")
    budget = _Budget(limit)
    state = _field(record, "state_dict_metadata", dict) or {}
    storage = _field(record, "storage_data", dict) or {}
    budget.charge(len(state) + len(storage))
    return {
        "entries": [_entry(fqn, entry, budget) for fqn, entry in state.items()],
        "storage": [_storage(index, info, budget) for index, info in storage.items()],
        "version": plain(getattr(record, "version", None), budget),
        "storage_meta": plain(getattr(record, "storage_meta", None), budget),
        "planner_data": _planner_data(getattr(record, "planner_data", None), budget),
    }


# ---------------------------------------------------------------- the child process


class TorchDType:
    """A torch dtype named by the pickle (slotted: a BUILD cannot give it state)."""

    __slots__ = ("torch_name",)

    def __init__(self, torch_name: str):
        self.torch_name = torch_name

    def __repr__(self) -> str:
        return f"torch.{self.torch_name}"


class _Record:
    # No __setstate__: NEWOBJ and BUILD of a dataclass's dict state stay inside the C unpickler.
    kind = "Record"

    def __init__(self, *args: Any, **kwargs: Any):  # only a REDUCE calls it, as safe_pickle's Record
        self.args = args
        self.__dict__.update(kwargs)


class _StateRecord(_Record):
    # TensorProperties pickles its fields as a tuple; safe_pickle's Record keeps such a state as `.state`.
    def __setstate__(self, state: Any) -> None:
        if type(state) is dict:
            self.__dict__.update(state)
        else:
            self.state = state


def _encode(text: str, encoding: str = "latin1") -> bytes:
    if encoding not in ("latin1", "latin-1"):
        raise Malformed(f"_codecs.encode with encoding {encoding!r} is not plain data")
    return text.encode("latin1")


def _posix_path(*parts: Any) -> str:
    from pathlib import PurePosixPath  # rare in a .metadata (a Path as checkpoint_id); slow to import

    return str(PurePosixPath(*(str(p) for p in parts)))


_CALLS: dict[str, Any] = {
    "tuple": tuple, "int": int, "str": str, "set": set, "frozenset": frozenset, "complex": complex,
    "ordered_dict": OrderedDict, "latin1": _encode,
    "path": _posix_path,
}
"""The allowlist's callables by tag (see dcp_metadata.child_allowlist, which names them)."""


def stand_ins(tags: list[list[str]]) -> dict[tuple[str, str], Any]:
    """(module, name) -> stand-in, from the allowlist's tags: [module, name, "record"|"dtype"|"const"|"call", arg]."""
    table: dict[tuple[str, str], Any] = {}
    for module, name, tag, arg in tags:
        if tag == "record":
            base = _StateRecord if arg in STATE_RECORDS else _Record
            table[(module, name)] = type(arg, (base,), {"kind": arg})
        elif tag == "dtype":
            table[(module, name)] = TorchDType(arg)
        elif tag == "const":
            table[(module, name)] = arg
        else:
            table[(module, name)] = _CALLS[arg]
    return table


class _Unpickler(_pickle.Unpickler):
    def __init__(self, data: bytes, table: dict[tuple[str, str], Any]):
        super().__init__(io.BytesIO(data))
        self._table = table

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._table[(module, name)]
        except KeyError:
            raise Refused(module, name) from None


def _set_limits(cpu_s: int, memory: int) -> None:
    import resource

    def within_hard(kind: int, value: int) -> int:  # a parent run under `ulimit` keeps its tighter limit
        hard = resource.getrlimit(kind)[1]
        return value if hard == resource.RLIM_INFINITY else min(value, hard)

    cpu_s, memory = within_hard(resource.RLIMIT_CPU, cpu_s), within_hard(resource.RLIMIT_AS, memory)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, within_hard(resource.RLIMIT_CPU, cpu_s + 1)))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))


def request_bytes(request: dict[str, Any], data: bytes) -> bytes:
    """What the parent writes to the child's stdin (see the module's docstring)."""
    head = marshal.dumps(request)
    return len(head).to_bytes(8, "little") + head + data


def main() -> None:
    # A short-lived process whose records hold no cycles: the cyclic collector would only rescan them, often
    # more time than the unpickling itself. Its memory is bounded by RLIMIT_AS, not by collection.
    gc.disable()
    stdin = sys.stdin.buffer
    request = marshal.loads(stdin.read(int.from_bytes(stdin.read(8), "little")))
    data = stdin.read(request["length"])
    try:
        _set_limits(request["cpu_s"], request["memory"])
    except (ImportError, ValueError, OverflowError, OSError):  # no such limit here (macOS has no RLIMIT_AS)
        sys.stdout.buffer.write(marshal.dumps({"error": "limits", "tensor": None, "unsafe": None}))
        return
    try:
        record = _Unpickler(data, stand_ins(request["allowlist"])).load()
        del data
        text = marshal.dumps({"summary": summarize(record, request["budget"])})
        if len(text) > request["max_output"]:
            raise Malformed(f"summarizes to more than {request['max_output']} bytes")
    except Refused as exc:
        text = marshal.dumps({"error": str(exc), "tensor": None, "unsafe": [exc.module, exc.name]})
    except Malformed as exc:
        text = marshal.dumps({"error": str(exc), "tensor": exc.tensor, "unsafe": None})
    except MemoryError:
        text = marshal.dumps({"error": "memory", "tensor": None, "unsafe": None})
    except RecursionError:
        text = marshal.dumps({"error": "pickle is nested too deeply", "tensor": None, "unsafe": None})
    except Exception as exc:  # any malformed stream: the pickle module raises many types
        text = marshal.dumps({"error": f"pickle is malformed ({type(exc).__name__}: {exc})", "tensor": None,
                              "unsafe": None})
    sys.stdout.buffer.write(text)


if __name__ == "__main__":
    main()
