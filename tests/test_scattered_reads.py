"""A region of whole rows far apart is read by pread straight into the result, every row's read queued first
(storage.scattered): the same values as numpy slicing, and only the pages of its rows brought in."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import tensormorph as tm
from tensormorph.errors import TruncatedFileError
from tensormorph.storage import LocalFiles, scattered

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def resident_pages(path: Path) -> np.ndarray:
    """Which pages of the file are in the page cache (mincore over a fresh mapping that touches none)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        try:
            vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
            assert _libc.mincore(addr, size, vec) == 0
            return np.frombuffer(vec, dtype=np.uint8) & 1
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A 2048 x 4096 fp32 tensor (32 MiB) in one safetensors file: a row is 16 KiB, four pages."""
    array = np.arange(2048 * 4096, dtype=np.float32).reshape(2048, 4096)
    path = tmp_path_factory.mktemp("wide") / "model.safetensors"
    save_file({"w": array}, str(path))
    return path, array


def test_scattered_rows_read_at_once_equal_numpy(wide: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    path, array = wide
    calls = []
    monkeypatch.setattr(scattered, "_gaps", lambda pieces, real=scattered._gaps: calls.append(len(pieces))
                        or real(pieces))
    with tm.open(path) as ck:
        region = ck["w"][100:612, 1024:2048]  # 512 rows of 4 KiB, 16 KiB apart: 2 MiB
        stepped = ck["w"][7:1500:3, 5:4000]  # rows of a step: still whole rows, in order
    assert calls[:2] == [512, 498]
    assert np.array_equal(region, array[100:612, 1024:2048])
    assert np.array_equal(stepped, array[7:1500:3, 5:4000])


def test_a_cold_scattered_read_brings_in_only_its_rows_pages(wide: tuple[Path, np.ndarray]) -> None:
    path, array = wide
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert resident_pages(path).sum() == 0, "the page cache kept the file: this check needs it dropped"
    with tm.open(path) as ck:
        opened = set(np.flatnonzero(resident_pages(path)).tolist())  # the header, and what readahead took with it
        region = ck["w"][1000:1512, 2048:3072]  # 512 rows of 4 KiB: one or two pages each
    assert np.array_equal(region, array[1000:1512, 2048:3072])
    data_start = path.stat().st_size - array.nbytes
    wanted = {(data_start + (r * 4096 + c) * 4) // PAGE for r in range(1000, 1512) for c in (2048, 3071)}
    assert not wanted & opened
    brought = set(np.flatnonzero(resident_pages(path)).tolist()) - opened
    assert brought == wanted


def test_a_piece_past_the_end_is_named_and_the_others_read(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 1024)  # 256 KiB
    files = LocalFiles(tmp_path)
    runs = [(i * 6000, i * 6000 + 100) for i in range(40)] + [(300_000, 300_100)]  # the last lies past the end
    target = memoryview(bytearray(100 * 41))
    with pytest.raises(TruncatedFileError, match="data"):
        files.read_runs("data", runs, target)
    good = memoryview(bytearray(100 * 40))
    files.read_runs("data", runs[:40], good)
    expected = b"".join(path.read_bytes()[begin:end] for begin, end in runs[:40])
    assert bytes(good) == expected
