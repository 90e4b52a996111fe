"""The on-disk cache of remote byte ranges: exact bytes, only missing ranges fetched, bounded, checked, shared."""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest

from tensormorph.errors import TruncatedFileError
from tensormorph.storage import range_cache
from tensormorph.storage.range_cache import ObjectKey, RangeCache, default_cache_folder

KEY = ObjectKey("s3://bucket/model.safetensors", 1 << 20, '"etag-1"')


def _pattern(seed: int, begin: int, end: int) -> bytes:
    """The object's bytes [begin, end): every byte depends on its offset, so a misplaced byte is caught."""
    index = np.arange(begin, end, dtype=np.uint64)
    return ((index * np.uint64(2654435761) + np.uint64(seed * 7919)) >> np.uint64(11)).astype(np.uint8).tobytes()


class Remote:
    """A fetch that serves the pattern and records every call."""

    def __init__(self, seed: int = 0):
        self.seed, self.calls = seed, []

    def __call__(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        self.calls.append(list(ranges))
        return [_pattern(self.seed, begin, end) for begin, end in ranges]


def _refuse(ranges: list[tuple[int, int]]) -> list[bytes]:
    raise AssertionError(f"fetch called for {ranges}: these bytes are cached")


def _expect(runs, got, seed: int = 0) -> None:
    assert [len(data) for data in got] == [end - begin for begin, end in runs]
    for (begin, end), data in zip(runs, got):
        assert data == _pattern(seed, begin, end), (begin, end)


def _files(cache: RangeCache, key: ObjectKey, kind: str) -> Path:
    return cache.dir / f"{key.digest()}.{kind}"


def test_round_trip_exact_bytes_and_hits_do_not_fetch(tmp_path):
    cache, remote = RangeCache(tmp_path), Remote()
    rng = random.Random(1)
    runs = [(b, min(b + rng.randrange(1, 200_000), KEY.size)) for b in (rng.randrange(KEY.size) for _ in range(40))]
    runs += [(5, 5), (KEY.size - 3, KEY.size), (0, 1)]  # empty, the last bytes, the first
    _expect(runs, cache.read(KEY, runs, remote))
    assert len(remote.calls) == 1
    _expect(runs, cache.read(KEY, runs[::-1], _refuse)[::-1])
    # any sub-range of what was read is a hit too
    inner = [(b + (e - b) // 3, e - (e - b) // 3) for b, e in runs]
    _expect(inner, cache.read(KEY, inner, _refuse))
    assert cache.stats.fetches == 1 and cache.stats.hits_bytes == sum(e - b for b, e in runs + inner)


def test_partial_overlaps_fetch_only_the_missing_ranges(tmp_path):
    cache, remote = RangeCache(tmp_path), Remote()
    cache.read(KEY, [(10_000, 20_000), (30_000, 33_000)], remote)
    runs = [(5_000, 40_000), (100_000, 101_000), (30_500, 30_600)]
    _expect(runs, cache.read(KEY, runs, remote))
    assert remote.calls[1] == [(5_000, 10_000), (20_000, 30_000), (33_000, 40_000), (100_000, 101_000)]
    # a tiny gap between missing pieces is fetched with them; a large one is not
    _expect([(200_000, 204_096), (204_100, 208_192)], cache.read(KEY, [(200_000, 204_096), (204_100, 208_192)], remote))
    assert remote.calls[2] == [(200_000, 208_192)]
    _expect([(0, 5_000)], cache.read(KEY, [(0, 5_000)], remote))
    assert remote.calls[3] == [(0, 5_000)]
    assert cache.stats.fetched_bytes == 13_000 + 23_000 + 8_192 + 5_000


def test_scattered_4k_pieces_transfer_at_most_1_1_times_what_is_needed(tmp_path):
    key = ObjectKey("https://hub.local/repo/resolve/main/big.bin", 256 << 20, "v")
    rng = random.Random(7)
    runs, position = [], 0
    for _ in range(1024):  # rows of a region: 4 KiB pieces behind gaps from a few bytes to a whole row stride
        position += rng.choice([1, 16, 100, 512, 4000, 60_000])
        runs.append((position, position + 4096))
        position += 4096
    cache, remote = RangeCache(tmp_path), Remote()
    _expect(runs, cache.read(key, runs, remote))
    needed = 1024 * 4096
    assert cache.stats.fetched_bytes / needed <= 1.1
    assert len(remote.calls) == 1 and len(remote.calls[0]) < 1024  # small gaps were joined
    _expect(runs, cache.read(key, runs, _refuse))


def test_another_version_or_size_is_another_entry(tmp_path):
    cache = RangeCache(tmp_path)
    cache.read(KEY, [(0, 4096)], Remote())
    other_version, other_size = ObjectKey(KEY.url, KEY.size, '"etag-2"'), ObjectKey(KEY.url, KEY.size + 1, KEY.version)
    for key, seed in ((other_version, 1), (other_size, 2)):
        remote = Remote(seed)
        _expect([(0, 4096)], cache.read(key, [(0, 4096)], remote), seed)
        assert remote.calls == [[(0, 4096)]]
    _expect([(0, 4096)], cache.read(KEY, [(0, 4096)], _refuse))
    assert len(list(cache.dir.glob("*.index"))) == 3


def test_least_recently_used_entries_go_first_and_the_byte_bound_holds(tmp_path):
    keys = [ObjectKey(f"s3://bucket/shard-{i}", 128 << 10, "v") for i in range(5)]
    probe = RangeCache(tmp_path / "probe")
    probe.read(keys[0], [(0, 65536)], Remote())
    entry = probe.held_bytes()
    assert entry >= 65536
    cache = RangeCache(tmp_path / "cache", max_bytes=3 * entry + entry // 2)
    for key in keys[:3]:
        cache.read(key, [(0, 65536)], Remote())
    cache.read(keys[0], [(0, 100)], _refuse)  # 0 is now used more recently than 1
    cache.read(keys[3], [(0, 65536)], Remote())
    remote = Remote()
    cache.read(keys[1], [(0, 65536)], remote)
    assert remote.calls == [[(0, 65536)]]  # 1 was evicted, not 0
    for key in (keys[0], keys[3]):
        cache.read(key, [(0, 65536)], _refuse)
    on_disk = sum(os.lstat(path).st_blocks * 512 for path in cache.dir.iterdir())
    assert cache.held_bytes() == on_disk <= cache.max_bytes
    assert len(list(cache.dir.glob("*.index"))) == 3
    # what cannot fit is served, not kept
    remote = Remote()
    big = ObjectKey("s3://bucket/huge", 10 * entry, "v")
    for _ in range(2):
        _expect([(0, 4 * entry)], cache.read(big, [(0, 4 * entry)], remote))
    assert len(remote.calls) == 2 and cache.held_bytes() <= cache.max_bytes


def test_version_records_are_trusted_for_their_time_and_evicted_and_cleared_with_the_entries(tmp_path):
    cache = RangeCache(tmp_path / "cache", revalidate_after_s=3600)
    url, info = KEY.url, {"size": KEY.size, "ETag": KEY.version}
    assert cache.versions.trusted(url) is None
    cache.versions.remember(url, info, KEY.version)
    known = cache.versions.trusted(url)
    assert known is not None and known.info is not None and not known.immutable
    assert (known.info["size"], known.info["ETag"]) == (KEY.size, KEY.version)
    cache.versions.remember(url, None, "")  # gone: a missing object at a mutable URL is never trusted
    assert cache.versions.trusted(url) is None and cache.versions.lookup(url) is not None
    record = next(cache.dir.glob("*.version"))
    record.write_bytes(b'{"url": "s3://bucket/other", "checked": 0}')  # another URL's (or a damaged) record
    assert cache.versions.lookup(url) is None
    cache.versions.remember(url, info, KEY.version)
    assert RangeCache(tmp_path / "cache", revalidate_after_s=0).versions.trusted(url) is None
    cache.read(KEY, [(0, 4096)], Remote())
    assert cache.held_bytes() >= 4096 + os.lstat(record).st_blocks * 512
    small = RangeCache(tmp_path / "cache", max_bytes=100)
    small.read(ObjectKey("s3://bucket/x", 10, "v"), [(0, 10)], Remote())  # over the bound: everything goes
    assert list(small.dir.glob("*.version")) == [] and list(small.dir.glob("*.index")) == []
    cache.versions.remember(url, info, KEY.version)
    cache.clear()
    assert list(cache.dir.iterdir()) == []


def test_entries_beyond_the_piece_limit_are_not_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(range_cache, "MAX_PIECES", 10)
    cache, remote = RangeCache(tmp_path), Remote()
    runs = [(i * 10_000, i * 10_000 + 10) for i in range(11)]
    _expect(runs, cache.read(KEY, runs, remote))
    _expect(runs, cache.read(KEY, runs, remote))
    assert len(remote.calls) == 2 and not _files(cache, KEY, "index").exists()
    _expect(runs[:10], cache.read(KEY, runs[:10], remote))
    _expect(runs[:10], cache.read(KEY, runs[:10], _refuse))


@pytest.mark.parametrize("damage", ["flip a data byte", "truncate the data", "flip an index byte", "empty index"])
def test_damaged_entries_are_dropped_and_fetched_again(tmp_path, damage):
    cache = RangeCache(tmp_path)
    runs = [(1000, 70_000), (200_000, 200_100)]
    cache.read(KEY, runs, Remote())
    data, index = _files(cache, KEY, "data"), _files(cache, KEY, "index")
    with open(index if "index" in damage else data, "r+b") as f:
        if damage == "truncate the data":
            f.truncate(60_000)
        elif damage == "empty index":
            f.truncate(0)
        else:
            offset = 40 if "index" in damage else 50_000
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))
    remote = Remote()
    _expect(runs, cache.read(KEY, runs, remote))
    assert remote.calls == [runs]
    _expect(runs, cache.read(KEY, runs, _refuse))  # stored afresh


def test_a_fetch_of_the_wrong_length_names_the_url_and_stores_nothing(tmp_path):
    cache = RangeCache(tmp_path)
    message = "^s3://bucket/model.safetensors: expected 4096 bytes at offset 0, got 4095$"
    with pytest.raises(TruncatedFileError, match=message):
        cache.read(KEY, [(0, 4096)], lambda ranges: [b"\0" * 4095])
    with pytest.raises(TruncatedFileError, match="bytes \\[0, 1048577\\) .* 1048576 bytes"):
        cache.read(KEY, [(0, KEY.size + 1)], Remote())
    remote = Remote()
    _expect([(0, 4096)], cache.read(KEY, [(0, 4096)], remote))
    assert remote.calls == [[(0, 4096)]]


def test_an_entry_removed_or_grown_by_another_process_during_a_fetch(tmp_path):
    cache, other = RangeCache(tmp_path), RangeCache(tmp_path)
    cache.read(KEY, [(0, 4096)], Remote())

    def clearing(ranges):
        other.clear()  # evicted between our cached read and our write
        other.read(KEY, [(500_000, 510_000)], Remote())  # and started again with other bytes
        return Remote()(ranges)

    _expect([(0, 8192)], cache.read(KEY, [(0, 8192)], clearing))
    _expect([(4096, 8192), (500_000, 510_000)], cache.read(KEY, [(4096, 8192), (500_000, 510_000)], _refuse))
    remote = Remote()
    _expect([(0, 4096)], cache.read(KEY, [(0, 4096)], remote))
    assert remote.calls == [[(0, 4096)]]  # cleared by the other


def test_an_index_whose_data_file_another_process_removed_restarts_the_entry(tmp_path):
    """The index lists pieces but the data file is gone (removed between a clear's two unlinks): storing more
    finds the listed pieces missing from the new data file and starts the entry again, serving the right bytes."""
    cache = RangeCache(tmp_path)
    cache.read(KEY, [(0, 4096)], Remote())

    def removing(ranges):
        _files(cache, KEY, "data").unlink()  # after our lookup read the pieces, before our store
        return Remote()(ranges)

    _expect([(2048, 8192)], cache.read(KEY, [(2048, 8192)], removing))  # grows the listed piece (0, 4096)
    _expect([(4096, 8192)], cache.read(KEY, [(4096, 8192)], _refuse))


@pytest.mark.parametrize("kind", ["data", "index", "lock"])
def test_a_link_planted_in_place_of_an_entry_file_is_not_followed(tmp_path, kind):
    cache = RangeCache(tmp_path / "cache")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1000)
    if kind != "lock":
        cache.read(KEY, [(0, 8000)], Remote())  # an entry with real files, one of them then swapped for a link
        victim.write_bytes(_files(cache, KEY, kind).read_bytes() if kind == "index" else b"precious" * 1000)
        _files(cache, KEY, kind).unlink()
    before = victim.read_bytes()
    _files(cache, KEY, kind).symlink_to(victim)
    runs = [(0, 8000), (100, 60_000)]
    _expect(runs, cache.read(KEY, runs, Remote()))
    assert victim.read_bytes() == before
    assert not _files(cache, KEY, kind).is_symlink()
    _expect(runs, cache.read(KEY, runs, _refuse))


def test_the_cache_folder_itself_may_not_be_a_planted_link(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "ranges-v1").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(range_cache.UnsafePathError, match="ranges-v1: is a link"):
        RangeCache(tmp_path / "cache")


def test_100k_runs_in_one_entry_cost_linear_work(tmp_path, monkeypatch):
    """Counted work per piece is constant; quadratic work elsewhere would run into pytest's timeout (hours)."""
    monkeypatch.setattr(range_cache, "FETCH_GAP", 0)  # keep every run its own piece
    key = ObjectKey("s3://bucket/embeddings", 4 << 20, "v")
    counts = {"crc": 0, "checked": 0}
    real_crc, real_checked = range_cache.crc32c.crc32c, range_cache._read_checked

    def crc(data, *args):
        counts["crc"] += 1
        return real_crc(data, *args)

    def checked(*args):
        counts["checked"] += 1
        return real_checked(*args)

    monkeypatch.setattr(range_cache.crc32c, "crc32c", crc)
    monkeypatch.setattr(range_cache, "_read_checked", checked)
    n = 100_000
    runs = [(i * 32, i * 32 + 16) for i in range(n)]
    blob = _pattern(0, 0, key.size)

    def fetch(ranges):
        return [blob[b:e] for b, e in ranges]

    cache = RangeCache(tmp_path)
    got = cache.read(key, runs, fetch)
    assert got == [blob[b:e] for b, e in runs]
    assert counts == {"crc": n + 1, "checked": 0}  # a crc per piece and one of the index
    assert os.path.getsize(_files(cache, key, "index")) == 16 + 20 * n + 4
    counts.update(crc=0, checked=0)
    assert cache.read(key, runs[::-1], _refuse) == [blob[b:e] for b, e in runs[::-1]]
    assert counts == {"crc": n + 1, "checked": n}
    # fill the gaps halfway: every old piece is checked once and grows, the count stays
    counts.update(crc=0, checked=0)
    more = [(b + 16, b + 24) for b, _ in runs]
    assert cache.read(key, more, fetch) == [blob[b:e] for b, e in more]
    assert counts == {"crc": 2 * n + 3, "checked": n}  # two loads, each piece checked and remade, one publish
    assert os.path.getsize(_files(cache, key, "index")) == 16 + 20 * n + 4


def _hammer(folder: str, seed: int, start, results) -> None:
    """One of two processes reading overlapping ranges of three objects through a cache too small for them all,
    for HAMMER_SECONDS after both are ready; one of them also clears the cache now and then."""
    cache = RangeCache(folder, max_bytes=400 << 10)
    rng, wrong, rounds = random.Random(seed), 0, 0
    start.wait()
    stop = time.monotonic() + HAMMER_SECONDS
    while time.monotonic() < stop:
        which = rng.randrange(3)
        key = ObjectKey(f"s3://bucket/object-{which}", 256 << 10, "v")
        runs = []
        for _ in range(rng.randrange(1, 6)):
            begin = rng.randrange(key.size)
            runs.append((begin, min(key.size, begin + rng.randrange(1, 48 << 10))))
        got = cache.read(key, runs, Remote(which))
        wrong += sum(data != _pattern(which, b, e) for (b, e), data in zip(runs, got))
        rounds += 1
        if seed == 2 and rounds % 50 == 0:
            cache.clear()
    results.put((seed, wrong, rounds, cache.stats.hits_bytes, cache.stats.fetched_bytes))


HAMMER_SECONDS = 2.0


def test_two_processes_sharing_an_entry_only_ever_see_the_right_bytes(tmp_path):
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_hammer, args=(str(tmp_path), seed, start, results)) for seed in (1, 2)]
    for worker in workers:
        worker.start()
    found = sorted(results.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert [(seed, wrong) for seed, wrong, _, _, _ in found] == [(1, 0), (2, 0)]
    assert all(rounds >= 50 and hits > 0 for _, _, rounds, hits, _ in found)
    assert sum(fetched for *_, fetched in found) > 3 * (256 << 10)  # evictions happened along the way
    assert RangeCache(tmp_path, max_bytes=400 << 10).held_bytes() <= 400 << 10


def test_default_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("TENSORMORPH_CACHE", str(tmp_path / "tm"))
    assert default_cache_folder() == tmp_path / "tm"
    monkeypatch.delenv("TENSORMORPH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_folder() == tmp_path / "xdg" / "tensormorph"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_folder() == tmp_path / "home" / ".cache" / "tensormorph"
