"""Finding a DeepSpeed checkpoint's files: the tag folder `latest` names, and the per-rank files of every
model-parallel (tensor-parallel) rank: one model-states file (stage 3: one per rank) and one optimizer-states
file per data-parallel rank."""

from __future__ import annotations

import re
from pathlib import Path

from ...errors import HeaderError, MissingFileError
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
    found: list[str] = []
    for mp in range(MAX_PROBED_RANKS):
        models = [name for name in (f"mp_rank_{mp:02d}_model_states.pt",
                                    f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt") if (folder / name).is_file()]
        if not models:
            break
        found += models
        for prefix in ("", "bf16_"):
            for rank in range(MAX_PROBED_RANKS):
                name = f"{prefix}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"
                if not (folder / name).is_file():
                    break
                found.append(name)
    return sorted(found)


def _complete(numbers: set[int]) -> list[int]:
    """The numbers missing from 0..n-1 for n numbers found ([0] for none); comparing against the count keeps a
    forged rank number cheap (no table of three billion ranks)."""
    if not numbers:
        return [0]
    missing = [r for r in range(len(numbers)) if r not in numbers]
    return missing or ([len(numbers)] if max(numbers) >= len(numbers) else [])


def optim_files(folder: AnyPath) -> list[list[str]]:
    """The optimizer-state files, indexed [model-parallel rank][data-parallel rank], checked to be complete
    and unambiguous: every model-parallel rank holds the same data-parallel ranks."""
    by_rank: dict[int, dict[int, str]] = {}
    for name in names_in(folder):
        match = OPTIM_FILE.match(name)
        if not match:
            continue
        rank, mp = int(match.group(2)), int(match.group(3))
        held = by_rank.setdefault(mp, {})
        if rank in held:
            raise HeaderError(f"{held[rank]} and {name} both hold data-parallel rank {rank}'s optimizer "
                              "states (a bf16 and a non-bf16 save mixed in one folder)", file=str(folder))
        held[rank] = name
    missing_mp = _complete(set(by_rank))
    if missing_mp:
        raise MissingFileError(f"the optimizer states of model-parallel ranks {missing_mp} are missing (found "
                               f"*_mp_rank_XX_optim_states.pt files of model-parallel ranks {sorted(by_rank)[:8]})",
                               file=str(folder))
    grid = []
    for mp in range(len(by_rank)):
        held = by_rank[mp]
        missing = _complete(set(held))
        if missing:
            raise MissingFileError(f"the optimizer states of model-parallel rank {mp}'s data-parallel ranks "
                                   f"{missing} are missing (found {len(held)} *_mp_rank_{mp:02d}_optim_states.pt "
                                   "files)", file=str(folder))
        if len(held) != len(by_rank[0]):
            raise MissingFileError(f"model-parallel rank {mp} has optimizer states of {len(held)} data-parallel "
                                   f"ranks, model-parallel rank 0 of {len(by_rank[0])}: the files of the others "
                                   "are missing", file=str(folder))
        grid.append([held[r] for r in range(len(held))])
    return grid


def model_files(folder: AnyPath, mp_ranks: int) -> list[str]:
    """Each model-parallel rank's (data-parallel rank 0's) model-states file (stage 3 names it per rank)."""
    found: dict[str, int] = {}
    for name in names_in(folder):
        match = MODEL_FILE.match(name)
        if match:
            found[name] = int(match.group(2))
    beyond = sorted(name for name, mp in found.items() if mp >= mp_ranks)
    if beyond:
        raise HeaderError(f"holds the model states of model-parallel rank {found[beyond[0]]}, but the folder holds "
                          f"optimizer states of only {mp_ranks} model-parallel ranks", file=str(folder / beyond[0]))
    names = []
    for mp in range(mp_ranks):
        candidates = (f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt", f"mp_rank_{mp:02d}_model_states.pt")
        chosen = next((n for n in candidates if n in found), None)
        if chosen is None:
            raise MissingFileError(f"holds no model states of model-parallel rank {mp} ({candidates[1]}, or for "
                                   f"ZeRO-3 {candidates[0]})", file=str(folder))
        names.append(chosen)
    return names
