"""Finding a DeepSpeed checkpoint's files: the tag folder `latest` names, and one optimizer-states file per rank."""

from __future__ import annotations

import re
from pathlib import Path

from ...errors import HeaderError, MissingFileError, UnsupportedError
from ...storage import LocalFiles, read_small

LATEST = "latest"
MAX_TAG_BYTES = 4096
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def read_tag(latest: Path) -> str:
    """The tag a `latest` file names (one line of text)."""
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


def tag_folder(path: Path, latest: str = LATEST) -> Path:
    """The tag folder: the one `path/latest` names (kept inside `path`), else `path` itself."""
    pointer = path / latest
    if not pointer.is_file():
        return path
    tag = read_tag(pointer)
    folder = LocalFiles(path).resolve(tag, referrer=str(pointer))
    if not folder.is_dir():
        raise MissingFileError(f"names tag {tag!r}, but there is no such folder", file=str(pointer))
    return folder


def optim_files(folder: Path) -> list[str]:
    """The optimizer-state files, indexed by data-parallel rank, checked to be complete and unambiguous."""
    by_rank: dict[int, str] = {}
    for entry in sorted(folder.iterdir()):
        match = OPTIM_FILE.match(entry.name)
        if not match:
            continue
        rank, mp = int(match.group(2)), int(match.group(3))
        if mp != 0:
            raise UnsupportedError("holds model-parallel (tensor/pipeline) partitions; convert it with DeepSpeed's "
                                   "ds_to_universal first, whose output this library reads", file=str(entry))
        if rank in by_rank:
            raise HeaderError(f"{by_rank[rank]} and {entry.name} both hold data-parallel rank {rank}'s optimizer "
                              "states (a bf16 and a non-bf16 save mixed in one folder)", file=str(folder))
        by_rank[rank] = entry.name
    # ranks must be 0..n-1 for n files; comparing against the count keeps a forged rank number cheap
    missing = [r for r in range(len(by_rank)) if r not in by_rank] if by_rank else [0]
    if not missing and max(by_rank) >= len(by_rank):
        missing = [len(by_rank)]
    if missing:
        raise MissingFileError(f"the optimizer states of data-parallel ranks {missing} are missing "
                               f"(found {len(by_rank)} *_optim_states.pt files)", file=str(folder))
    return [by_rank[r] for r in range(len(by_rank))]


def model_file(folder: Path) -> str:
    """Rank 0's model-states file (stage 3 names it per rank)."""
    found = sorted(e.name for e in folder.iterdir() if MODEL_FILE.match(e.name))
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
