"""What protects a checkpoint, as the viewer's integrity panel shows it: every file with its size and the
checksum its format records, the parity stripes or replicas of a Tensormorph checkpoint and what they protect,
and the plain objects (step, config ...) with their values.

Nothing is read beyond the manifest or index and the files' sizes: checking the checksums is `verify`'s job.
"""

from __future__ import annotations

import reprlib
from typing import Any

from ..core import Checkpoint
from ..errors import CheckpointError, MissingFileError, UnsafePickleError
from ..formats import reader_of
from ..formats.contract import no_checksums
from ..storage import ByteStore
from ..tmformat.checkpoint import read_manifest
from ..tmformat.integrity import size_problem
from ..tmformat.manifest import FORMAT, MANIFEST, FileRecord, Manifest
from ..tmformat.parity import parse_scheme, replica_file

MAX_OBJECTS = 1000  # objects listed with their values; a checkpoint with more lists the first ones
MAX_OBJECT_BYTES = 1 << 20  # an object stored in more bytes than this is listed by its size, not decoded
MAX_PREVIEW = 200  # characters of an object's one-line preview
MAX_ITEMS = 100  # items of a list or dict value kept; the rest is cut ("...")
MAX_DEPTH = 4  # nesting of a value kept; deeper values are shown by their preview only
# a preview never formats a large value whole: at most 3 levels and 20 items of each
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 3, MAX_PREVIEW, MAX_PREVIEW, 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 20


def integrity(ck: Checkpoint) -> dict[str, Any]:
    """The integrity panel of an open checkpoint (docs/viewer-api.md, "Integrity panel")."""
    files = ck.require_storage()
    if ck.format == FORMAT:
        record = _tensormorph(files, read_manifest(files, str(ck.path)))
    else:
        checked = reader_of(ck).checksum_problems is not no_checksums
        record = {"checksum": "crc32 (zip records)" if checked else None, "redundancy": None,
                  "files": [_file(files, name, "data", None) for name in ck.files], "stripes": [], "replicas": []}
    damaged = {f["name"]: "missing" if f["actual_size"] is None else
               f"is {f['actual_size']} bytes, {f['size']} recorded" for f in record["files"] if f["status"] != "ok"}
    return {"format": ck.format, **record, "objects": objects(ck), "damaged_files": damaged}


def _file(files: ByteStore, name: str, role: str, record: FileRecord | None) -> dict[str, Any]:
    try:
        actual: int | None = files.size(name)
    except MissingFileError:
        actual = None
    if record is None:
        status = "ok" if actual is not None else "missing"
    else:
        problem = size_problem(files, name, record)
        status = "ok" if problem is None else "missing" if actual is None else "size"
    return {"name": name, "role": role, "rank": record.rank if record else None,
            "size": record.size if record else actual, "actual_size": actual,
            "crc32c": f"{record.crc32c:08x}" if record else None, "status": status}


def _tensormorph(files: ByteStore, manifest: Manifest) -> dict[str, Any]:
    plan = manifest.redundancy
    listed = [_file(files, MANIFEST, "manifest", None)]
    listed += [_file(files, name, "data", record) for name, record in sorted(manifest.files.items())]
    stripes: list[dict[str, Any]] = []
    replicas: list[dict[str, Any]] = []
    if plan is not None:
        scheme = parse_scheme(plan.scheme)
        role = "replica" if scheme.kind == "replicate" else "parity"
        listed += [_file(files, name, role, record) for name, record in sorted(plan.files.items())]
        status = {entry["name"]: entry["status"] for entry in listed}
        for index, (data, parity) in enumerate(plan.stripes):
            damaged = [name for name in data + parity if status.get(name) != "ok"]
            stripes.append({"index": index, "data": list(data), "parity": list(parity),
                            "protects": sum(manifest.files[name].size for name in data), "tolerates": scheme.m,
                            "damaged": damaged, "recoverable": len(damaged) <= scheme.m})
        if scheme.kind == "replicate":
            for name in sorted(manifest.files):
                copies = [replica_file(name, c) for c in range(1, scheme.copies)]
                damaged = [n for n in [name, *copies] if status.get(n) != "ok"]
                replicas.append({"data": name, "copies": copies, "damaged": damaged,
                                 "recoverable": len(damaged) < scheme.copies})
    return {"checksum": "crc32c", "redundancy": plan.scheme if plan else None, "files": listed,
            "stripes": stripes, "replicas": replicas}


def objects(ck: Checkpoint) -> list[dict[str, Any]]:
    """The first MAX_OBJECTS objects: name, type, value as JSON (null when not plain data) and a preview."""
    out = []
    for entry in list(ck.objects.values())[:MAX_OBJECTS]:
        if entry.nbytes is not None and entry.nbytes > MAX_OBJECT_BYTES:  # not decoded: the panel stays cheap
            out.append({"name": entry.name, "type": None, "value": None,
                        "preview": f"{entry.nbytes:,} bytes, not decoded here (tensormorph show)"})
            continue
        try:
            value = entry.value()
        except UnsafePickleError:
            out.append({"name": entry.name, "type": None, "value": None, "preview": "not plain data"})
            continue
        except CheckpointError as exc:
            out.append({"name": entry.name, "type": None, "value": None, "preview": f"unreadable: {exc.reason}"})
            continue
        out.append({"name": entry.name, "type": type(value).__name__, "value": json_value(value),
                    "preview": _preview(value)})
    return out


def json_value(value: Any, depth: int = 0) -> Any:
    """A plain value as JSON: numbers, strings, lists and dicts as they are (cut at MAX_ITEMS items and
    MAX_DEPTH levels), numpy scalars and small arrays as numbers, anything else by its preview."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value if len(value) <= MAX_PREVIEW * 10 else value[:MAX_PREVIEW * 10] + "..."
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "size", None) == 1:  # a numpy scalar or 1-element array
        return json_value(item(), depth)
    if depth >= MAX_DEPTH:
        return _preview(value)
    if isinstance(value, (list, tuple)):
        kept = [json_value(v, depth + 1) for v in value[:MAX_ITEMS]]
        return kept + ["..."] if len(value) > MAX_ITEMS else kept
    if isinstance(value, dict):
        items = list(value.items())
        kept_items = {str(k): json_value(v, depth + 1) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            kept_items["..."] = f"{len(items) - MAX_ITEMS} more"
        return kept_items
    return _preview(value)


def _preview(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    text = " ".join(_SHORT.repr(value).split())
    return text if len(text) <= MAX_PREVIEW else text[:MAX_PREVIEW - 3] + "..."
