"""The interim emulated disk on the store's read hook (glm53.cpu_lane.emulated_disk): reads in flight share one fixed rate, as on
the GPU machine's rate-capped virtual disk, so store read scheduling can be studied on a machine whose store comes
from the page cache. Only lower bounds (and orderings with wide margins) are asserted on times: CI is a noisy
2-core machine, and a stall only makes a read slower."""

from __future__ import annotations

import os
import threading
import time

import pytest
from test_nvme_tier_support import reference, small_store

import store.read_timing as T
from glm53.cpu_lane import emulated_disk as kernel
from store import native
from store.directio import alloc_aligned, alloc_slots, open_for_read
from store.format import read_header
from store.reader import Priority, StoreReader

RECORD_S = 0.03  # what one record of the test store takes on the emulated disk


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return small_store(tmp_path_factory.mktemp("emulated-disk"))


@pytest.fixture(scope="module")
def header(store):
    return read_header(store)


@pytest.fixture
def rate(header):
    """Seconds per byte that make one of the test store's records (all one size) take RECORD_S."""
    extents = {header.entry(*k).extent for k in header.index}
    assert len(extents) == 1
    return RECORD_S / extents.pop()


@pytest.fixture
def fd(store):
    fd, _ = open_for_read(store, True)
    yield fd
    os.close(fd)


@pytest.fixture(autouse=True)
def never_left_on():
    assert kernel.set_emulated_disk(0.0) == 0.0
    yield
    assert kernel.set_emulated_disk(0.0) == 0.0, "a test left the emulated disk on"


def read(fd, header, key, buf, parts: int) -> float:
    e = header.entry(*key)
    t0 = time.perf_counter()
    assert native.pread_parts(fd, buf[:e.extent], e.offset, parts, 4096)[0] == e.extent
    return time.perf_counter() - t0


def test_the_context_manager_sets_and_puts_back_the_rate():
    assert kernel.set_emulated_disk(0.0) == 0.0  # off by default
    with kernel.emulated_disk(1e-9) as r:
        assert r == 1e-9
        with kernel.emulated_disk(0) as inner:
            assert inner == 0.0
            assert kernel.set_emulated_disk(0.0) == 0.0
        assert kernel.set_emulated_disk(1e-9) == 1e-9
    assert kernel.set_emulated_disk(0.0) == 0.0
    with pytest.raises(RuntimeError), kernel.emulated_disk(2e-9):
        raise RuntimeError("the block fails")
    assert kernel.set_emulated_disk(-1.0) == 0.0  # not above 0: off
    assert kernel.set_emulated_disk(0.0) == 0.0


def test_without_the_library_it_says_why(monkeypatch):
    monkeypatch.setattr(native, "_LIB", None)
    with pytest.raises(native.NativeUnavailable, match="unavailable"), kernel.emulated_disk(1e-9):
        pass


@pytest.mark.parametrize("parts", [1, 4])
def test_one_read_takes_at_least_its_booked_time_and_lands_the_bytes(store, header, fd, rate, parts):
    buf = alloc_aligned(header.max_extent)
    key = sorted(header.index)[0]
    with kernel.emulated_disk(rate):
        took = read(fd, header, key, buf, parts)
    assert took >= RECORD_S * 0.999
    assert buf[:header.entry(*key).extent].tobytes() == reference(store, *key)
    assert read(fd, header, key, buf, parts) < RECORD_S  # off again: the page cache's speed (40 KiB)


@pytest.mark.parametrize("parts", [1, 4])
def test_two_records_read_at_once_take_about_twice_one_alone(header, fd, rate, parts):
    keys = sorted(header.index)
    bufs = [alloc_aligned(header.max_extent) for _ in range(2)]
    with kernel.emulated_disk(rate):
        alone = min(read(fd, header, k, bufs[0], parts) for k in keys[:3])
        other = threading.Thread(target=read, args=(fd, header, keys[4], bufs[1], parts))
        t0 = time.perf_counter()
        other.start()
        read(fd, header, keys[3], bufs[0], parts)
        other.join()
        both = time.perf_counter() - t0
    assert both >= 1.7 * alone and both >= 2 * RECORD_S * 0.999


def test_the_tier_calibration_sees_one_read_keeping_the_emulated_disk_busy(store, header, rate):
    keys = sorted(header.index)
    with kernel.emulated_disk(rate):
        gain = T.time_two_at_once(store, header, keys, 4, allow_buffered=True)
    assert gain is not None and gain < 1.25
    assert T.pick_prefetch_at_once(gain, 4) == 1
    # Off, on page-cached reads: whatever two reads at once are worth on this machine (nothing asserted of it).
    off = T.time_two_at_once(store, header, keys, 4, allow_buffered=True)
    assert off is None or off > 0


def demand_latency(store, rate, cap: int, threads: int = 3) -> float:
    """Seconds from submit to result of a demand read submitted while six prefetches are queued and `cap` (the most
    the cap lets run) of them are under way, on the emulated disk."""
    with StoreReader(store, threads=threads, allow_buffered=True, verify=True, prefetch_at_once=cap) as r, \
            kernel.emulated_disk(rate):
        arena = alloc_slots(7, r.max_extent)
        pre = r.read_many([(1, e, arena[e]) for e in range(6)], priority=Priority.PREFETCH)
        deadline = time.monotonic() + 10
        while sum(f.running() for f in pre) < min(cap, threads):
            assert time.monotonic() < deadline, "the prefetches never started"
            time.sleep(0.0005)
        t0 = time.perf_counter()
        dem = r.read(2, 7, arena[6], priority=Priority.DEMAND)
        dem.result(10)
        took = time.perf_counter() - t0
        assert dem.result().data.tobytes() == reference(store, 2, 7)
        for f in pre:
            f.cancel()
    return took


def test_a_demand_read_behind_guesses_comes_in_sooner_with_the_guesses_capped(store, rate):
    # Capped at one guess under way: the demand read takes a free worker at once and books behind that guess's
    # record (~2 records). Uncapped: every worker reads a guess, all booked; the demand read waits for a worker,
    # then books behind the guesses still booked (~4 records).
    capped = demand_latency(store, rate, cap=1)
    uncapped = demand_latency(store, rate, cap=3)
    assert capped >= RECORD_S * 0.999 and uncapped >= 3 * RECORD_S * 0.999
    assert capped < 0.8 * uncapped, (capped, uncapped)
