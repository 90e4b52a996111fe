"""Read a torch.save zip archive without torch and without running its pickle's code.

The archive is a ZIP_STORED zip: `<prefix>/data.pkl` describes the object
tree, `<prefix>/data/<key>` hold raw little-endian storage bytes. Tensors
come back as `TensorRef`s: byte offsets into the buffer the archive was read
from, so callers can memory-map them instead of copying.

Nothing an archive declares may make reading it cost more than its bytes: a
storage must fit its record; a tensor view must lie inside its storage; a view
that holds more bytes than it spans (stride 0 or overlapping strides, as
`expand` makes) is read only up to MAX_EXPANDED_BYTES per archive (torch.load
returns such views as they are; tensormorph refuses the rest with
UnsupportedError, so a file of a few hundred bytes cannot declare gigabytes);
the byteorder record is tiny; and verifying CRCs reads no byte twice.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Protocol, overload

from . import dtypes, safe_pickle
from .errors import CheckpointError, ChecksumError, HeaderError, TruncatedFileError, UnsafePickleError, UnsupportedError
from .shapes import check_offset, check_shape, describe

MAX_PICKLE_BYTES = 100_000_000
MAX_EXPANDED_BYTES = 64 * 1024**2
"""Most logical bytes the expanded views of one archive may hold together: tensors whose strides address fewer
bytes than they hold (stride 0, overlapping strides). Ordinary state dicts have none beyond size-1 dimensions."""
MAX_BYTEORDER_BYTES = 64  # the byteorder record holds "little" or "big"; a bigger one would be read whole
MAX_REUSE_FACTOR = 64  # the tensors of a file hold at most this many times its bytes (tied weights, shared buffers)


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: str | None  # None for an untyped storage: the tensor names its dtype
    nbytes: int  # bytes the pickle declares for it (numel × itemsize)
    offset: int  # of the storage's first byte in the buffer


@dataclass(frozen=True)
class TensorRef:
    """A tensor inside an archive: a strided view of one storage."""

    storage: StorageRef
    dtype: str
    storage_offset: int  # elements of dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # elements of dtype

    @property
    def offset(self) -> int:
        """Byte offset of the first element in the buffer."""
        return self.storage.offset + self.storage_offset * dtypes.itemsize(self.dtype)

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, step in reversed(list(zip(self.shape, self.stride))):
            if size != 1 and step != expected:
                return False
            expected *= size
        return True

    @property
    def nbytes(self) -> int:
        """Logical bytes: what reading the whole tensor materialises."""
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)

    @property
    def is_expanded(self) -> bool:
        """Whether the view holds more bytes than it spans in its storage (stride 0 or overlapping strides)."""
        begin, end = self.byte_span
        return self.nbytes > end - begin

    @property
    def byte_span(self) -> tuple[int, int]:
        """[begin, end) of the bytes this view can touch in the buffer."""
        itemsize = dtypes.itemsize(self.dtype)
        if math.prod(self.shape) == 0:
            return self.offset, self.offset
        last = sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return self.offset, self.offset + (last + 1) * itemsize


class ExpansionBudget:
    """The logical bytes an archive's expanded views hold together; UnsupportedError beyond MAX_EXPANDED_BYTES."""

    def __init__(self, file: str):
        self.file = file
        self.total = 0

    def charge(self, ref: TensorRef, tensor: str | None) -> None:
        if not ref.is_expanded:
            return
        self.total += ref.nbytes
        if self.total > MAX_EXPANDED_BYTES:
            begin, end = ref.byte_span
            raise UnsupportedError(
                f"a tensor of shape {list(ref.shape)} with strides {list(ref.stride)} holds {ref.nbytes} bytes but "
                f"addresses only {end - begin} of storage {ref.storage.key!r} (an expanded view); expanded views are "
                f"read up to {MAX_EXPANDED_BYTES} bytes per file", file=self.file, tensor=tensor)


class ReuseBudget:
    """The logical bytes an archive's tensors hold together, each time a name or a rebuild yields one: UnsupportedError
    beyond MAX_REUSE_FACTOR times the archive's bytes plus MAX_EXPANDED_BYTES, so a pickle cannot name one big storage
    thousands of times and declare far more than the file holds."""

    def __init__(self, file: str, archive_bytes: int):
        self.file = file
        self.archive_bytes = archive_bytes
        self.limit = MAX_REUSE_FACTOR * archive_bytes + MAX_EXPANDED_BYTES
        self.total = 0

    def charge(self, ref: TensorRef, tensor: str | None) -> None:
        self.total += ref.nbytes
        if self.total > self.limit:
            raise UnsupportedError(f"the file's tensors hold {self.total} bytes by this one, over {MAX_REUSE_FACTOR} "
                                   f"times the file's {self.archive_bytes} bytes: one storage is named too many times",
                                   file=self.file, tensor=tensor)


class _StorageType:
    """Stand-in for torch.FloatStorage and friends: only carries the dtype."""

    def __init__(self, dtype: str | None):
        self.dtype = dtype


def _tensor_globals(make_tensor: Any) -> dict[tuple[str, str], Any]:
    def rebuild_tensor_v2(storage: Any, storage_offset: int, size: Any, stride: Any, *_rest: Any) -> TensorRef:
        return make_tensor(storage, storage_offset, size, stride)

    def rebuild_tensor_v3(storage: Any, storage_offset: int, size: Any, stride: Any, _requires_grad: Any,
                          _hooks: Any, dtype: Any, *_rest: Any) -> TensorRef:
        # newer dtypes (float8, uint16...) are saved on an untyped storage with the dtype given here
        if not isinstance(dtype, safe_pickle.TorchDType):
            raise HeaderError(f"_rebuild_tensor_v3 names dtype {dtype!r}, not a torch dtype")
        return make_tensor(storage, storage_offset, size, stride, dtype.vocabulary)

    def rebuild_tensor(storage: Any, storage_offset: int, size: Any, stride: Any) -> TensorRef:
        return make_tensor(storage, storage_offset, size, stride)

    def rebuild_parameter(data: Any, *_rest: Any) -> Any:
        return data

    def rebuild_from_type_v2(func: Any, new_type: Any, args: Any, _state: Any) -> Any:
        if new_type not in (_TENSOR_TYPE, _PARAMETER_TYPE):
            raise HeaderError("_rebuild_from_type_v2 names a type other than Tensor or Parameter")
        # torch passes only a tensor rebuild here; anything else (a set, a dict) would be built from the pickle's
        # arguments without the checks the unpickler applies to the objects it builds itself
        if not any(func is f for f in rebuilds):
            raise UnsafePickleError(f"_rebuild_from_type_v2 calls {getattr(func, '__name__', type(func).__name__)!r}, "
                                    "not a tensor rebuild function")
        if not isinstance(args, tuple):
            raise HeaderError(f"_rebuild_from_type_v2 passes {type(args).__name__} arguments, not a tuple")
        return func(*args)

    rebuilds = (rebuild_tensor_v2, rebuild_tensor_v3, rebuild_tensor, rebuild_parameter)

    table: dict[tuple[str, str], Any] = dict(safe_pickle.BASE_GLOBALS)
    table.update({
        ("torch._utils", "_rebuild_tensor_v2"): rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor_v3"): rebuild_tensor_v3,
        ("torch._utils", "_rebuild_tensor"): rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): rebuild_from_type_v2,
        ("torch", "Tensor"): _TENSOR_TYPE,
        ("torch.nn.parameter", "Parameter"): _PARAMETER_TYPE,
        ("torch", "UntypedStorage"): _StorageType(None),
        ("torch.storage", "UntypedStorage"): _StorageType(None),
        ("torch", "device"): str,
    })
    for name, vocabulary in dtypes.TORCH_STORAGE_NAMES.items():
        table[("torch", name)] = _StorageType(vocabulary)
    return table


_TENSOR_TYPE = object()
_PARAMETER_TYPE = object()


class Sliceable(Protocol):
    """An archive's bytes: a memoryview of a mapped file, or a remote file that fetches the slices asked for."""

    def __len__(self) -> int: ...

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> bytes | memoryview: ...


class BufferFile(io.RawIOBase):
    """A seekable read-only file over a Sliceable, so zipfile reads only what it needs."""

    def __init__(self, buffer: Sliceable):
        self._buffer = buffer
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: len(self._buffer)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, target: Any) -> int:
        view = self._buffer[self._position:self._position + len(target)]
        target[:len(view)] = view
        self._position += len(view)
        return len(view)


def is_torch_zip(head: bytes) -> bool:
    return head[:4] == b"PK\x03\x04"


def load(buffer: Sliceable, *, file: str, item: str | None = None,
         extra_globals: safe_pickle.Globals | None = None, check_expansion: bool = True) -> Any:
    """The object tree of a torch.save archive held in `buffer`, tensors as TensorRefs.

    `item` names the DCP item the archive belongs to, for error messages. `extra_globals` adds
    format-specific stand-ins (records of a training framework's classes) to the allowlist.
    Each tensor the pickle rebuilds is charged to an ExpansionBudget and a ReuseBudget;
    `check_expansion=False` leaves both to a caller that charges them by tensor name once it has them.
    """
    budgets = (ExpansionBudget(file), ReuseBudget(file, len(buffer))) if check_expansion else ()
    try:
        return _load(buffer, file, item, extra_globals or {}, budgets)
    except CheckpointError:
        raise
    except RecursionError:
        raise HeaderError("archive is nested too deeply", file=file, tensor=item) from None
    except Exception as exc:  # zipfile and struct raise many types on corrupt input
        raise HeaderError(f"not a readable torch.save archive ({type(exc).__name__}: {exc})",
                          file=file, tensor=item) from None


def _load(buffer: Sliceable, file: str, item: str | None, extra_globals: safe_pickle.Globals,
          budgets: tuple[ExpansionBudget, ReuseBudget] | tuple[()]) -> Any:
    if len(buffer) >= 2 and buffer[0] == 0x80 and not is_torch_zip(bytes(buffer[:4])):
        raise UnsupportedError(
            "is a legacy (pre-1.6, non-zip) torch.save file, which this reader does not support; "
            "re-save it with a current torch.save, or convert it with torch.load + safetensors",
            file=file, tensor=item)
    if not is_torch_zip(bytes(buffer[:4])):
        raise HeaderError("is not a torch.save zip archive (missing the PK zip signature)", file=file, tensor=item)
    archive = zipfile.ZipFile(BufferFile(buffer))
    records = {info.filename: info for info in archive.infolist()}
    pickles = [name for name in records if name.endswith("/data.pkl") or name == "data.pkl"]
    if len(pickles) != 1:
        raise HeaderError(f"expected one data.pkl record in the archive, found {len(pickles)}", file=file, tensor=item)
    prefix = pickles[0][: -len("data.pkl")]
    stray = next((name for name in records if not name.startswith(prefix)), None)
    if stray is not None:  # torch's reader refuses it too: every record lives in the archive's one folder
        raise HeaderError(f"record {stray!r} is outside the archive's folder {prefix!r}", file=file, tensor=item)
    order = records.get(prefix + "byteorder")
    if order is not None and order.file_size > MAX_BYTEORDER_BYTES:
        raise HeaderError(f"byteorder record is {order.file_size} bytes, over the {MAX_BYTEORDER_BYTES}-byte limit",
                          file=file, tensor=item)
    if order is not None and archive.read(order).strip() not in (b"little", b""):
        raise UnsupportedError("stores big-endian tensors, which are not supported", file=file, tensor=item)
    info = records[pickles[0]]
    if info.file_size > MAX_PICKLE_BYTES:
        raise HeaderError(f"data.pkl is {info.file_size} bytes, over the {MAX_PICKLE_BYTES}-byte limit",
                          file=file, tensor=item)
    pickle_bytes = archive.read(info)
    storages: dict[str, StorageRef] = {}

    def persistent(pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise HeaderError(f"unexpected persistent id {pid!r} (expected a storage record)")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str):
            raise HeaderError(f"malformed storage record ({type(storage_type).__name__}, {describe(key)})")
        check_offset(numel, file=file, tensor=item, what=f"the element count of storage {key[:80]!r}")
        if key not in storages:
            record = records.get(f"{prefix}data/{key}")
            if record is None:
                raise TruncatedFileError(f"storage {key!r} is missing from the archive", file=file, tensor=item)
            if record.compress_type != zipfile.ZIP_STORED:
                raise UnsupportedError(f"storage {key!r} is compressed inside the zip", file=file, tensor=item)
            nbytes = numel * (dtypes.itemsize(storage_type.dtype) if storage_type.dtype else 1)
            offset = _data_offset(buffer, record)
            if nbytes > record.file_size or offset + record.file_size > len(buffer):
                raise TruncatedFileError(f"storage {key!r} claims {nbytes} bytes but the archive holds "
                                         f"{min(record.file_size, len(buffer) - offset)}", file=file, tensor=item)
            storages[key] = StorageRef(key, storage_type.dtype, nbytes, offset)
        return storages[key]

    def make_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: str | None = None) -> TensorRef:
        if not isinstance(storage, StorageRef):
            raise HeaderError("a tensor is rebuilt from something that is not a storage")
        dtype = dtype or storage.dtype
        if dtype is None:
            raise HeaderError(f"a tensor on untyped storage {storage.key!r} names no dtype")
        # bounded before any arithmetic: a huge dimension count or integer makes byte_span cost quadratic time
        shape = check_shape(size, file=file, tensor=item, what="tensor size")
        steps = check_shape(stride, file=file, tensor=item, what="tensor stride")
        check_offset(storage_offset, file=file, tensor=item, what="tensor storage offset")
        if len(shape) != len(steps):
            raise HeaderError(f"invalid tensor geometry: size {list(shape)} but stride {list(steps)}",
                              file=file, tensor=item)
        tensor = TensorRef(storage, dtype, storage_offset, shape, steps)
        begin, end = tensor.byte_span
        if end - storage.offset > storage.nbytes:
            raise TruncatedFileError(
                f"a tensor of size {shape} and stride {steps} at offset {storage_offset} reaches past the end "
                f"of storage {storage.key!r} ({storage.nbytes} bytes)", file=file, tensor=item)
        for budget in budgets:
            budget.charge(tensor, item)
        return tensor

    allowed = {**_tensor_globals(make_tensor), **extra_globals}
    return safe_pickle.loads(pickle_bytes, allowed, persistent=persistent, file=file)


def check_crc(buffer: Sliceable, *, file: str, item: str | None = None) -> None:
    """Raise ChecksumError when a record of the archive does not match the CRC-32 the zip recorded.

    The records' declared sizes must add up to at most the archive (plus a compressed data.pkl's limit), so
    records that overlap, or a compressed one that expands, cannot make the check read far more than the file."""
    try:
        archive = zipfile.ZipFile(BufferFile(buffer))
        declared = sum(info.file_size for info in archive.infolist())
        if declared > len(buffer) + MAX_PICKLE_BYTES:
            raise HeaderError(f"zip records declare {declared} bytes in all, more than the {len(buffer)}-byte archive "
                              "holds", file=file, tensor=item)
        bad = archive.testzip()
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged directory raises many types
        raise HeaderError(f"not a readable zip archive ({type(exc).__name__}: {exc})", file=file, tensor=item) from None
    if bad is not None:
        raise ChecksumError(f"zip record {bad!r} does not match its recorded CRC-32", file=file, tensor=item,
                            record=bad)


def _data_offset(buffer: Sliceable, record: zipfile.ZipInfo) -> int:
    """Where a stored record's data starts: past its local header, whose extra field may differ from the central one."""
    start = record.header_offset
    local = bytes(buffer[start:start + 30])
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        raise HeaderError(f"zip record {record.filename!r} has a damaged local header")
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    return start + 30 + name_length + extra_length
