"""The bench's emulated disk (glm53.bench.emulated_disk): its pacing hook alone, then end to end on the store's
native reads through the store library's read hook. Only lower bounds (and orderings with wide margins) are asserted
on times: CI is a noisy 2-core machine, and a stall only makes a read slower."""

from __future__ import annotations

import os
import threading
import time

import pytest
from nvme_support import reference, small_store

from glm53.bench import emulated_disk as E
from store import native
from store.directio import alloc_aligned, alloc_slots, open_for_read
from store.format import read_header
from store.read_timing import pick_prefetch_at_once, time_two_at_once
from store.reader import Priority, StoreReader

RECORD_S = 0.03  # what one record of the test store takes on the emulated disk
built = pytest.mark.skipif(not list(E.Path(E.__file__).parent.glob(E.LIB_GLOB)),
                           reason="the emulated disk's library is not built (pip install -e .)")
hooked = pytest.mark.skipif(E.store_hook_setter() is None,
                            reason=f"the store's native library is not built: {native.unavailable_reason()}")


@pytest.fixture(autouse=True)
def never_left_on():
    if E.problem() is None:
        assert E.store_hook_setter()(0) == 0, "a hook was installed before the test"
    yield
    if list(E.Path(E.__file__).parent.glob(E.LIB_GLOB)):
        assert E.set_rate(0.0) == 0.0, "a test left a rate set"
    if E.problem() is None:
        assert E.store_hook_setter()(0) == 0, "a test left the hook installed"


def hook_call(nbytes: int, began: int | None = None) -> float:
    """Seconds one call of the hook takes for a part of `nbytes` that began at `began` (default: now)."""
    lib = E.library()
    t0 = time.perf_counter()
    lib.glm53_bench_disk_hook(nbytes, lib.glm53_bench_steady_ns() if began is None else began)
    return time.perf_counter() - t0


@built
def test_the_hook_books_each_part_on_one_timeline_from_when_it_began():
    spb = RECORD_S / 1_000_000  # a 1 MB part takes RECORD_S
    assert E.set_rate(spb) == 0.0
    try:
        assert hook_call(1_000_000) >= RECORD_S * 0.999
        # A part whose read began 2 RECORD_S ago, on an idle disk, took its real pread's time: not slowed again.
        time.sleep(3 * RECORD_S)
        assert hook_call(1_000_000, E.library().glm53_bench_steady_ns() - int(2 * RECORD_S * 1e9)) < RECORD_S
        # Two parts at once share the rate: the second books behind the first.
        other = threading.Thread(target=hook_call, args=(1_000_000,))
        t0 = time.perf_counter()
        other.start()
        hook_call(1_000_000)
        other.join()
        assert time.perf_counter() - t0 >= 2 * RECORD_S * 0.999
    finally:
        assert E.set_rate(0.0) == spb
    assert hook_call(1 << 30) < RECORD_S, "no rate: every part passes"
    assert E.set_rate(-1.0) == 0.0 and E.set_rate(0.0) == 0.0  # not above 0: off


def test_without_the_store_hook_it_says_why(monkeypatch):
    monkeypatch.setattr(E, "store_hook_setter", lambda: None)
    if not list(E.Path(E.__file__).parent.glob(E.LIB_GLOB)):
        with pytest.raises(E.EmulatorUnavailable, match="not built"), E.emulated_disk(1e-9):
            pass
        return
    with pytest.raises(E.EmulatorUnavailable, match="glm53_store_set_read_hook"), E.emulated_disk(1e-9):
        pass
    assert E.set_rate(0.0) == 0.0, "nothing set when it cannot pace"


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


def read(fd, header, key, buf, parts: int) -> float:
    e = header.entry(*key)
    t0 = time.perf_counter()
    assert native.pread_parts(fd, buf[:e.extent], e.offset, parts, 4096)[0] == e.extent
    return time.perf_counter() - t0


@built
@hooked
def test_the_context_manager_installs_and_removes_the_hook_and_rate():
    setter = E.store_hook_setter()
    with E.emulated_disk(1e-9) as r:
        assert r == 1e-9
        assert setter(E.hook_address()) == E.hook_address()  # installed (put back as it was)
        with E.emulated_disk(0) as inner:
            assert inner == 0.0
            assert setter(0) == 0  # an inner block at 0: no hook
        assert setter(E.hook_address()) == E.hook_address() and E.set_rate(1e-9) == 1e-9
    with pytest.raises(RuntimeError), E.emulated_disk(2e-9):
        raise RuntimeError("the block fails")
    # never_left_on checks that neither hook nor rate stayed


@built
@hooked
@pytest.mark.parametrize("parts", [1, 4])
def test_one_read_takes_at_least_its_booked_time_and_lands_the_bytes(store, header, fd, rate, parts):
    buf = alloc_aligned(header.max_extent)
    key = sorted(header.index)[0]
    with E.emulated_disk(rate):
        took = read(fd, header, key, buf, parts)
    assert took >= RECORD_S * 0.999
    assert buf[:header.entry(*key).extent].tobytes() == reference(store, *key)
    assert read(fd, header, key, buf, parts) < RECORD_S  # off again: the page cache's speed (40 KiB)


@built
@hooked
@pytest.mark.parametrize("parts", [1, 4])
def test_two_records_read_at_once_take_about_twice_one_alone(header, fd, rate, parts):
    keys = sorted(header.index)
    bufs = [alloc_aligned(header.max_extent) for _ in range(2)]
    with E.emulated_disk(rate):
        alone = min(read(fd, header, k, bufs[0], parts) for k in keys[:3])
        other = threading.Thread(target=read, args=(fd, header, keys[4], bufs[1], parts))
        t0 = time.perf_counter()
        other.start()
        read(fd, header, keys[3], bufs[0], parts)
        other.join()
        both = time.perf_counter() - t0
    assert both >= 1.7 * alone and both >= 2 * RECORD_S * 0.999


@built
@hooked
def test_the_tier_calibration_sees_one_read_keeping_the_emulated_disk_busy(store, header, rate):
    keys = sorted(header.index)
    with E.emulated_disk(rate):
        gain = time_two_at_once(store, header, keys, 4, allow_buffered=True)
    assert gain is not None and gain < 1.25
    assert pick_prefetch_at_once(gain, 4) == 1


def demand_latency(store, rate, cap: int, threads: int = 3) -> float:
    """Seconds from submit to result of a demand read submitted while six prefetches are queued and `cap` (the most
    the cap lets run) of them are under way, on the emulated disk."""
    with StoreReader(store, threads=threads, allow_buffered=True, verify=True, prefetch_at_once=cap) as r, \
            E.emulated_disk(rate):
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


@built
@hooked
def test_a_demand_read_behind_guesses_comes_in_sooner_with_the_guesses_capped(store, rate):
    # Capped at one guess under way: the demand read takes a free worker at once and books behind that guess's
    # record (~2 records). Uncapped: every worker reads a guess, all booked; the demand read waits for a worker,
    # then books behind the guesses still booked (~4 records).
    capped = demand_latency(store, rate, cap=1)
    uncapped = demand_latency(store, rate, cap=3)
    assert capped >= RECORD_S * 0.999 and uncapped >= 3 * RECORD_S * 0.999
    assert capped < 0.8 * uncapped, (capped, uncapped)
