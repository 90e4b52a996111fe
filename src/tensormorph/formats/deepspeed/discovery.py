"""Finding a DeepSpeed checkpoint's files: the tag folder `latest` names, and one optimizer-states file per rank."""

from __future__ import annotations

import re
from pathlib import Path

from ...errors import HeaderError, MissingFileError, UnsupportedError
from ...storage import AnyPath, RemotePath, entries, read_small, store_at

LATEST = "latest"
MAX_TAG_BYTES = 4096
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MAX_PROBED_RANKS = 4096  # over HTTP (no listing) the per-rank files are found by name, rank after rank


def read_tag(latest: AnyPath) -> str:
    """The tag a `latest` file names (one line of text)."""
    if isinstance(latest, RemotePath):  # object stores and HTTP have no links
        store = latest.parent.store()
        size = store.size(latest.name)
        raw = store.read(latest.name, 0, size) if size <= MAX_TAG_BYTES else None
    else:
        real = latest.resolve()
        if latest.parent.resolve() not in real.parents:
            raise HeaderError(f"is a link to {real}, outside the checkpoint folder", file=str(latest))
        raw = read_small(real, MAX_TAG_BYTES)  # a FIFO or a device is refused, not waited on or read without end
    if raw is None:
        raise HeaderError(f"is over {MAX_TAG_BYTES} bytes; a tag file holds one short line", file=str(latest))
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise HeaderError("is not UTF-8 text naming a tag", file=str(latest)) from None
    if not tag or "\n" in tag or "\x00" in tag:
        raise HeaderError(f"should name one tag folder, found {tag[:80]!r}", file=str(latest))
    return tag


def tag_folder(path: AnyPath, latest: str = LATEST) -> AnyPath:
    """The tag folder: the one `path/latest` names (kept inside `path`), else `path` itself."""
    pointer = path / latest
    if not pointer.is_file():
        return path
    tag = read_tag(pointer)
    store_at(path).describe(tag, referrer=str(pointer))  # refuses a tag that leaves the folder
    folder = path / tag
    if isinstance(folder, Path):
        folder = folder.resolve()
    if not folder.is_dir():
        raise MissingFileError(f"names tag {tag!r}, but there is no such folder", file=str(pointer))
    return folder


def names_in(folder: AnyPath) -> list[str]:
    """The file names in a tag folder: listed, or over HTTP (no listing) found by the names DeepSpeed gives them."""
    if not (isinstance(folder, RemotePath) and folder.remote.is_http):
        return [entry.name for entry in entries(folder)]
    found = [name for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
             if (folder / name).is_file()]
    for prefix in ("", "bf16_"):
        for rank in range(MAX_PROBED_RANKS):
            name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            if not (folder / name).is_file():
                break
            found.append(name)
    return sorted(found)


def optim_files(folder: AnyPath) -> list[str]:
    """The optimizer-state files, indexed by data-parallel rank, checked to be complete and unambiguous."""
    by_rank: dict[int, str] = {}
    for name in names_in(folder):
        match = OPTIM_FILE.match(name)
        if not match:
            continue
        rank, mp = int(match.group(2)), int(match.group(3))
        if mp != 0:
            raise UnsupportedError("holds model-parallel (tensor/pipeline) partitions; convert it with DeepSpeed's "
                                   "ds_to_universal first, whose output this library reads", file=str(folder / name))
        if rank in by_rank:
            raise HeaderError(f"{by_rank[rank]} and {name} both hold data-parallel rank {rank}'s optimizer "
                              "states (a bf16 and a non-bf16 save mixed in one folder)", file=str(folder))
        by_rank[rank] = name
    # ranks must be 0..n-1 for n files; comparing against the count keeps a forged rank number cheap
    missing = [r for r in range(len(by_rank)) if r not in by_rank] if by_rank else [0]
    if not missing and max(by_rank) >= len(by_rank):
        missing = [len(by_rank)]
    if missing:
        raise MissingFileError(f"the optimizer states of data-parallel ranks {missing} are missing "
                               f"(found {len(by_rank)} *_optim_states.pt files)", file=str(folder))
    return [by_rank[r] for r in range(len(by_rank))]


def model_file(folder: AnyPath) -> str:
    """Rank 0's model-states file (stage 3 names it per rank)."""
    found = [name for name in names_in(folder) if MODEL_FILE.match(name)]
    for name in found:
        match = MODEL_FILE.match(name)
        if match is not None and int(match.group(2)) != 0:
            raise UnsupportedError("holds a model-parallel (tensor/pipeline) partition; convert the checkpoint with "
                                   "DeepSpeed's ds_to_universal first, whose output this library reads",
                                   file=str(folder / name))
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt"):
        if name in found:
            return name
    raise MissingFileError("holds no rank-0 model states (mp_rank_00_model_states.pt, or for ZeRO-3 "
                           "zero_pp_rank_0_mp_rank_00_model_states.pt)", file=str(folder))
