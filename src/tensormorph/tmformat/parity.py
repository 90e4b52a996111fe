"""Redundancy for Tensormorph checkpoints: Reed-Solomon parity over stripes of rank files, or replicas.

`rs(k,m)`: the data files, in rank order, are grouped into stripes of k (the
last stripe is completed with virtual all-zero files). For each stripe, m
parity files are computed with zfec's code (the Reed-Solomon coder of Tahoe-LAFS;
applied by a SIMD kernel where it is built, linear_code.py) segment by segment
over the files zero-padded to the stripe's longest, so any k of the k+m files
rebuild the others. Parity file j of stripe s
belongs to rank (s*k + k + j) mod world (the rank the manifest records): the
m parity files of a stripe land on m different ranks, after the stripe's own
ranks where the world is larger than k.

`replicate:n`: each rank's file is copied n-1 times, copy i belonging to rank
(r + i) mod world, for node-local storage tiers.

Each copy, and each parity file on an object store, is written whole by the rank
that owns it (write_extras); on a file system a copy is made by the kernel
(copy_file_range), its CRC-32C that of its data file. On a file system every rank writes its `share` of
every stripe's parity in place, all m files in one pass over its part of the
data, so the encoding and its writes are spread over the whole world rather than
m ranks while the others wait. Encoding and rebuilding run CODING_THREADS
segments at once and hold at most CODING_BUFFER bytes (in_order), whatever the
files' size.

The manifest records every parity file and copy with its size and CRC-32C,
so damage anywhere is detected and, within the budget, repaired bit-exact.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Protocol, TypeVar

from ..errors import CheckpointError, TruncatedFileError
from . import linear_code
from .checksums import RunningCrc
from .linear_code import BytesLike

SEGMENT = 4 * 1024**2  # bytes of each file encoded per zfec call

MAX_CODE_FILES = 256  # k + m of rs(k,m): zfec's limit (GF(2^8) has 256 evaluation points)
MAX_PARITY = 64  # m of rs(k,m): more parity files than this per stripe protects against nothing real
MAX_COPIES = 64  # n of replicate:n: every rank file stored n times; no storage tier keeps more copies
MAX_SEGMENT = 64 * 1024**2  # a manifest's segment: bytes of each file read at a time to rebuild a file
MAX_STEP_BYTES = 1024**3  # k * segment: bytes of a stripe held at once to rebuild a file (the writer's 4 MiB
# segment with k = 255 is just under)
CODING_THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
# segments read and coded at once, one per core this process may use (at most 4): pread and zfec release the GIL,
# so one segment's reads overlap another's coding; more threads than cores only cost CPU (caches, switching)
CODING_BUFFER = 256 * 1024**2  # bytes of segments one encode or rebuild holds at once (at least one segment's
# k inputs and output, however large): memory stays bounded whatever the files' size

_RS = re.compile(r"^rs\((\d+),\s*(\d+)\)$")
_REPLICATE = re.compile(r"^replicate:(\d+)$")

Reader = Callable[[str, int, int], BytesLike]  # (file, begin, end) -> its bytes, for files that exist


@dataclass(frozen=True)
class Scheme:
    kind: str  # "rs" or "replicate"
    k: int = 0
    m: int = 0
    copies: int = 0

    def __str__(self) -> str:
        return f"rs({self.k},{self.m})" if self.kind == "rs" else f"replicate:{self.copies}"


def parse_scheme(text: str) -> Scheme:
    """'rs(4,2)' or 'replicate:2'."""
    spec = text.replace(" ", "").lower()
    shown = repr(text) if len(text) <= 40 else f"{text[:40]!r}... ({len(text)} characters)"
    match = _RS.match(spec)
    if match:
        k, m = _count(match.group(1)), _count(match.group(2))
        if not (k >= 1 and 1 <= m <= MAX_PARITY and k + m <= MAX_CODE_FILES):
            raise CheckpointError(f"redundancy {shown}: rs(k,m) needs k >= 1, 1 <= m <= {MAX_PARITY} and "
                                  f"k + m <= {MAX_CODE_FILES}")
        return Scheme("rs", k=k, m=m)
    match = _REPLICATE.match(spec)
    if match:
        copies = _count(match.group(1))
        if not 2 <= copies <= MAX_COPIES:
            raise CheckpointError(f"redundancy {shown}: replicate:n needs 2 <= n <= {MAX_COPIES}")
        return Scheme("replicate", copies=copies)
    raise CheckpointError(f"unknown redundancy {shown}: use rs(k,m), e.g. rs(4,2), or replicate:n")


def _count(digits: str) -> int:
    """A count spelled in decimal; any of more than 6 digits is too large (and int() of thousands is slow)."""
    return int(digits) if len(digits) <= 6 else 10**6


def parity_file(stripe: int, index: int) -> str:
    return f"parity-{stripe:05d}-{index}.bin"


def replica_file(data_file: str, copy: int) -> str:
    return f"{data_file.removesuffix('.safetensors')}.copy{copy}.safetensors"


@dataclass(frozen=True)
class Stripe:
    data: tuple[str, ...]  # the stripe's data files (fewer than k in a short last stripe)
    sizes: tuple[int, ...]
    parity: tuple[str, ...]

    @property
    def length(self) -> int:
        return max(self.sizes, default=0)


def stripes(files: Sequence[tuple[str, int]], k: int, m: int, prefix: str = "") -> list[Stripe]:
    """Group (file, size) pairs, in order, into stripes of k with their m parity files (named under `prefix`, the
    save's generation folder on object stores)."""
    out = []
    for s, start in enumerate(range(0, len(files), k)):
        group = files[start:start + k]
        out.append(Stripe(tuple(f for f, _ in group), tuple(n for _, n in group),
                          tuple(prefix + parity_file(s, j) for j in range(m))))
    return out


def parity_writer(stripe: int, index: int, k: int, world: int) -> int:
    return (stripe * k + k + index) % world


def _segments(length: int, segment: int) -> Iterator[tuple[int, int]]:
    for begin in range(0, length, segment):
        yield begin, min(length, begin + segment)


def _ahead(k: int, segment: int, outputs: int = 1) -> int:
    """Segments in flight for a k-wide stripe: one per thread, fewer where CODING_BUFFER holds fewer, at least one
    (measured: more in flight than threads only evicts the caches and scatters the reads)."""
    return max(1, min(CODING_THREADS, CODING_BUFFER // ((k + outputs) * max(1, segment))))


T = TypeVar("T")


def in_order(steps: Iterator[Callable[[], T]], ahead: int) -> Iterator[T]:
    """The results of `steps`, run on CODING_THREADS threads with at most `ahead` submitted and not yet taken,
    yielded in order. The first failure is raised in order; a consumer that stops early cancels the rest. A single
    step (a file within one segment, the common small case) runs here, without starting threads."""
    steps = iter(steps)
    head = list(itertools.islice(steps, 2))
    if len(head) < 2:
        for step in head:
            yield step()
        return
    steps = itertools.chain(head, steps)
    pending: deque[Future[T]] = deque()
    with ThreadPoolExecutor(max_workers=min(ahead, CODING_THREADS), thread_name_prefix="tm-coding") as pool:
        try:
            for step in steps:
                pending.append(pool.submit(step))
                if len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def _padded(read: Reader, file: str | None, size: int, begin: int, end: int) -> BytesLike:
    """Bytes [begin, end) of a data file, zero-padded past its end (virtual files are all zeros)."""
    if file is None or begin >= size:
        return bytes(end - begin)
    data = read(file, begin, min(end, size))
    if len(data) != min(end, size) - begin:  # a file shorter than recorded: never code over made-up zeros
        raise TruncatedFileError(f"ends before byte {min(end, size)} (read {len(data)} bytes from {begin}); "
                                 f"{size} bytes were expected", file=file)
    return data if len(data) == end - begin else bytes(data) + bytes(end - begin - len(data))


def encode_parity(stripe: Stripe, k: int, m: int, index: int, read: Reader,
                  segment: int = SEGMENT) -> Iterator[bytes]:
    """Parity file `index` of a stripe, segment by segment (several segments read and encoded at once)."""
    files: list[str | None] = list(stripe.data) + [None] * (k - len(stripe.data))
    sizes = list(stripe.sizes) + [0] * (k - len(stripe.sizes))
    code = linear_code.Code(k, k + m, range(k), k + index)

    def step(first: int, stop: int) -> bytes:
        return code.apply(tuple(_padded(read, f, n, first, stop) for f, n in zip(files, sizes)))

    return in_order((partial(step, b, e) for b, e in _segments(stripe.length, segment)), _ahead(k, segment))


@dataclass(frozen=True)
class Decoding:
    """How file `lost` of a stripe is rebuilt: byte i of it from byte i of k other files (the code works on each
    byte column alone), so any byte range is rebuilt from the same range of those files."""

    sources: tuple[tuple[str | None, int], ...]  # the k (file, size) it is made from; None: a virtual all-zero file
    size: int  # the lost file's own length: a short data file's padding past its end is not rebuilt
    code: linear_code.Code

    def sources_of(self, read: Reader, begin: int, end: int) -> tuple[BytesLike, ...]:
        return tuple(_padded(read, name, size, begin, end) for name, size in self.sources)


def decoding(stripe: Stripe, k: int, m: int, lost: str, available: set[str]) -> Decoding:
    """The plan to rebuild file `lost` (data or parity) from k available files of its stripe.

    Raises CheckpointError when fewer than k files of the stripe are available.
    """
    names: list[str | None] = list(stripe.data) + [None] * (k - len(stripe.data)) + list(stripe.parity)
    sizes = list(stripe.sizes) + [0] * (k - len(stripe.sizes)) + [stripe.length] * m
    usable = [i for i, name in enumerate(names) if name is None or (name in available and name != lost)]
    if len(usable) < k:
        gone = [name for name in names if name is not None and name != lost and name not in available]
        raise CheckpointError(f"cannot rebuild {lost}: {len(usable)} of the stripe's {k + m} files are intact, "
                              f"{k} are needed (damaged or missing besides it: {', '.join(gone)})")
    chosen = tuple(usable[:k])
    target = names.index(lost)
    return Decoding(tuple((names[i], sizes[i]) for i in chosen), sizes[target],
                    linear_code.Code(k, k + m, chosen, target))


def share(lengths: Sequence[int], world: int, rank: int, segment: int = SEGMENT) -> list[tuple[int, int, int]]:
    """The parts of the stripes' parity that `rank` of `world` encodes, as (stripe, begin, end): the stripes'
    segments, one after another, cut into `world` runs as even as whole segments allow (balanced however many
    stripes there are, and each stripe's files read once per segment for all m parity files)."""
    counts = [-(-length // segment) for length in lengths]
    total = sum(counts)
    first, stop = total * rank // world, total * (rank + 1) // world
    out, before = [], 0
    for s, (count, length) in enumerate(zip(counts, lengths)):
        low, high = max(first, before), min(stop, before + count)
        if low < high:
            out.append((s, (low - before) * segment, min(length, (high - before) * segment)))
        before += count
    return out


def encode_share(stripe: Stripe, k: int, m: int, begin: int, end: int, read: Reader,
                 segment: int = SEGMENT) -> Iterator[tuple[int, list[bytes | bytearray]]]:
    """Bytes [begin, end) of each of a stripe's m parity files, segment by segment: (offset, m blocks)."""
    files: list[str | None] = list(stripe.data) + [None] * (k - len(stripe.data))
    sizes = list(stripe.sizes) + [0] * (k - len(stripe.sizes))
    code = linear_code.ParityRows(k, m)

    def step(first: int, stop: int) -> tuple[int, list[bytes | bytearray]]:
        return first, code.apply(tuple(_padded(read, f, n, first, stop) for f, n in zip(files, sizes)))

    pieces = ((b, min(end, b + segment)) for b in range(begin, end, segment))
    return in_order((partial(step, b, e) for b, e in pieces), _ahead(k, segment, m))


def rebuild(stripe: Stripe, k: int, m: int, lost: str, available: set[str], read: Reader,
            segment: int = SEGMENT) -> Iterator[bytes]:
    """The bytes of file `lost` (data or parity) of a stripe, rebuilt from k available files, segment by segment.

    Raises CheckpointError when fewer than k files of the stripe are available.
    """
    plan = decoding(stripe, k, m, lost, available)

    def step(begin: int, end: int) -> bytes:
        return plan.code.apply(plan.sources_of(read, begin, end))[:min(end, plan.size) - begin]

    return in_order((partial(step, b, e) for b, e in _segments(plan.size, segment)), _ahead(k, segment))


def copied(read: Reader, file: str, size: int, segment: int = SEGMENT) -> Iterator[BytesLike]:
    """A file, segment by segment, several segments read at once (a copy made or restored)."""
    return in_order((partial(read, file, b, e) for b, e in _segments(size, segment)), _ahead(0, segment))


class SharedFile(Protocol):
    """A file several processes write at once, each its own byte ranges (a parity file on a shared file system)."""

    def write_at(self, offset: int, data: bytes | bytearray) -> None: ...

    def finish(self) -> None:
        """Make this process's writes durable."""

    def close(self) -> None: ...


Extras = dict[str, tuple[int, int, int]]  # what one rank wrote of parity files or copies: name -> (offset,
# length, CRC-32C of those bytes); a file several ranks wrote in place comes in several parts


class InPlace(Protocol):
    """A destination whose files every rank can write in place (a file system)."""

    def open_shared(self, name: str) -> SharedFile: ...

    def copy_file(self, source: str, name: str) -> None: ...


def write_extras(scheme: Scheme, data_files: Sequence[tuple[str, int, int]], rank: int, world: int, read: Reader,
                 write: Callable[[str, Iterator[BytesLike]], None], prefix: str = "",
                 in_place: InPlace | None = None) -> Extras:
    """Write the parity (or copies) that `rank` is responsible for; returns what it wrote of each file.

    `data_files` are (name, size, CRC-32C) in rank order; `read` reads them; `write(name, chunks)` stores one file
    durably. With `in_place` (a file system), every rank encodes its `share` of every stripe's parity, all m files
    in one pass, and copies are made by the kernel (their CRC-32C is their data file's); otherwise each parity file
    is encoded whole by its `parity_writer`, and copies pass through this process.
    """
    done: Extras = {}

    def stored(name: str, chunks: Iterator[BytesLike]) -> None:
        running = RunningCrc()
        write(name, running.passing(chunks))
        done[name] = (0, running.size, running.value)

    if scheme.kind == "rs":
        all_stripes = stripes([(name, size) for name, size, _ in data_files], scheme.k, scheme.m, prefix)
        for s, stripe in enumerate(all_stripes):  # whole, by one rank each: not in place, or empty
            if in_place is None or stripe.length == 0:
                for j, name in enumerate(stripe.parity):
                    if parity_writer(s, j, scheme.k, world) == rank:
                        stored(name, encode_parity(stripe, scheme.k, scheme.m, j, read))
        if in_place is not None:
            for s, begin, end in share([stripe.length for stripe in all_stripes], world, rank):
                done.update(_encode_in_place(all_stripes[s], scheme, begin, end, read, in_place.open_shared))
    else:
        for source_rank, (name, size, crc) in enumerate(data_files):
            for copy in range(1, scheme.copies):
                if (source_rank + copy) % world == rank:
                    if in_place is None:
                        stored(replica_file(name, copy), copied(read, name, size))
                    else:
                        in_place.copy_file(name, replica_file(name, copy))
                        done[replica_file(name, copy)] = (0, size, crc)
    return done


def _encode_in_place(stripe: Stripe, scheme: Scheme, begin: int, end: int, read: Reader,
                     open_shared: Callable[[str], SharedFile]) -> Extras:
    """Bytes [begin, end) of every parity file of a stripe, written in place."""
    outputs: list[SharedFile] = []
    try:
        for name in stripe.parity:
            outputs.append(open_shared(name))
        crcs = [RunningCrc() for _ in outputs]
        for offset, blocks in encode_share(stripe, scheme.k, scheme.m, begin, end, read):
            for output, crc, block in zip(outputs, crcs, blocks):
                output.write_at(offset, block)
                crc.update(block)
        for output in outputs:
            output.finish()
    finally:
        for output in outputs:
            output.close()
    return {name: (begin, crc.size, crc.value) for name, crc in zip(stripe.parity, crcs)}


def overhead(scheme: Scheme, sizes: Sequence[int]) -> float:
    """Extra bytes the scheme stores, as a fraction of the data."""
    data = sum(sizes)
    if data == 0:
        return 0.0
    if scheme.kind == "replicate":
        return scheme.copies - 1.0
    groups = [sizes[i:i + scheme.k] for i in range(0, len(sizes), scheme.k)]
    return sum(scheme.m * max(g) for g in groups) / data if groups else 0.0
