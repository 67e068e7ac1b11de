"""Faults under the nvme tier, injected under the real StoreReader (test_nvme_tier_native.py: under the native
read queue, the default reader): short reads, EIO, checksum mismatches, slow
reads. Each is retried, then raised as an error naming the store path and the record; nothing unverified is
ever used; the tier reports the fault through health() and keeps serving every other record."""

from __future__ import annotations

import errno
import threading
import time

import numpy as np
import pytest
import torch
from test_nvme_tier_support import HIDDEN, PYTHON_READS, Direct, check_bytes, make_store, nvme_plan, slot_forward

import store.reader as R
from glm53.tiers import Where, tiered_moe
from glm53.tiers.nvme_open import open_nvme_tier
from store.errors import StoreCorruptError, StoreError, StoreReadError

EXPERTS = 16
BAD = (1, 5)  # tier layer 1 = store layer 2, expert 5


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("nvme-faults"), layers=3, experts=EXPERTS)


@pytest.fixture(scope="module")
def direct(packed):
    return Direct(packed[0])


@pytest.fixture
def tier(packed):
    ck, store = packed
    with open_nvme_tier(store, ck, nvme_plan(store, EXPERTS + 2, 0, threads=3), timeout_s=0.2,
                        reader_options=PYTHON_READS) as t:
        yield t


class Inject:
    """Replaces the reader's pread_into: `how(call_number)` decides what happens to reads of the bad record."""

    def __init__(self, monkeypatch, tier, how):
        self.real, self.how, self.calls = R.pread_into, how, 0
        self.offset = tier.reader.header.entry(tier.store_layers[BAD[0]], BAD[1]).offset
        monkeypatch.setattr(R, "pread_into", self)

    def __call__(self, fd, view, offset):
        if offset != self.offset:
            return self.real(fd, view, offset)
        self.calls += 1
        return self.how(self.calls, self.real, fd, view, offset)


def eio(n, real, fd, view, offset):
    raise OSError(errno.EIO, "Input/output error")


def short(n, real, fd, view, offset):
    real(fd, view[:4096], offset)
    return 4096


def flipped(n, real, fd, view, offset):
    got = real(fd, view, offset)
    view[1000] = (view[1000] + 1) % 256  # the disk returned a wrong byte
    return got


def step(tier, direct, layer, experts, seed=0):
    """One tiered step over `experts`; returns it after checking it against the direct computation."""
    g = torch.Generator().manual_seed(seed)
    ids = np.array([experts])
    w, x = torch.rand(ids.shape, generator=g), torch.randn(1, HIDDEN, generator=g)
    got = tiered_moe(tier.tiers, layer, x, ids, w, slot_forward(tier.layout), lane_for=lambda lay, e: "cpu")
    assert torch.equal(got.y, direct.moe(tier.store_layers[layer], x, ids, w))
    return got


@pytest.mark.parametrize("how, cls, says", [(eio, StoreReadError, "Input/output error"),
                                            (short, StoreReadError, "short read"),
                                            (flipped, StoreCorruptError, "xxh3")])
def test_a_record_that_keeps_failing_is_an_error_and_the_tier_keeps_serving(tier, direct, monkeypatch, how, cls, says):
    inj = Inject(monkeypatch, tier, how)
    with pytest.raises(cls) as ei:
        step(tier, direct, 1, [2, BAD[1], 9])
    err = ei.value
    assert str(tier.path) in err.problem and "(layer 2, expert 5)" in err.problem and says in err.problem
    assert "after 3 attempts" in err.problem and "glm53 verify-store" in err.fix and "pack-store" in err.fix
    assert inj.calls == 3  # the reader's own retries (2) before giving up
    assert tier.tiers.where[BAD] == Where.STORE, "a record that failed its read was kept"
    health = tier.health()
    assert health["state"] == "fault" and health["store"] == str(tier.path)
    (fault,) = health["faults"]
    assert (fault["store_layer"], fault["expert"], fault["count"]) == (2, 5, 1) and says in fault["error"]
    # Every other record is still served, and correctly, in both layers; the other experts of the failed step
    # landed meanwhile.
    step(tier, direct, 1, [2, 9, 11], seed=1)
    step(tier, direct, 0, [5, 6, 7], seed=2)
    tier.check_invariants()
    check_bytes(tier, tier.path)
    assert tier.stats.snapshot()["nvme"]["failed_reads"] == 1


def test_a_transient_error_is_retried_and_leaves_no_fault(tier, direct, monkeypatch):
    Inject(monkeypatch, tier, lambda n, *a: eio(n, *a) if n == 1 else short(n, *a) if n == 2 else a[0](*a[1:]))
    got = step(tier, direct, 1, [BAD[1], 3])
    assert got.picks["nvme"] == 2 and tier.health() is None and tier.reader.stats()["retries"] == 2


def test_a_fault_clears_once_the_record_reads_cleanly(tier, direct, monkeypatch):
    inj = Inject(monkeypatch, tier, eio)
    with pytest.raises(StoreReadError):
        step(tier, direct, 1, [BAD[1]])
    assert tier.health() is not None
    inj.how = lambda n, real, *a: real(*a)  # the disk recovered (or the sector was remapped)
    step(tier, direct, 1, [BAD[1]])
    assert tier.health() is None


def test_a_failed_prefetch_raises_nothing_but_is_reported(tier, direct, monkeypatch):
    Inject(monkeypatch, tier, eio)
    assert tier.prefetch([BAD, (1, 6)]) == 2
    deadline = time.monotonic() + 10
    while tier._reads and time.monotonic() < deadline:
        tier.poll()
        time.sleep(0.001)
    assert tier.tiers.where[BAD] == Where.STORE and tier.tiers.where[1, 6] == Where.RAM
    assert tier.health()["faults"][0]["expert"] == 5
    with pytest.raises(StoreReadError, match="expert 5"):  # a step that needs it still gets a clear error
        step(tier, direct, 1, [6, BAD[1]])
    tier.check_invariants()


def test_a_slow_read_times_out_and_is_retried_into_a_fresh_slot(tier, direct, monkeypatch):
    """The first read of the record stalls past the timeout: the record is read again into another slot and the
    step goes on; the stalled read's slot stays out of use until that read returns, then is reclaimed."""
    release = threading.Event()

    def stall_first(n, real, fd, view, offset):
        if n == 1:
            assert release.wait(10)
        return real(fd, view, offset)

    Inject(monkeypatch, tier, stall_first)
    guard = threading.Timer(5, release.set)  # never leave a reader thread stuck past the test
    guard.daemon = True
    guard.start()
    got = step(tier, direct, 1, [BAD[1], 4])
    assert got.picks["nvme"] == 2
    snap = tier.stats.snapshot()
    assert snap["nvme"]["timeouts"] == 1 and snap["nvme"]["failed_reads"] == 0
    assert tier.tiers.ram.retired() == 1 and tier.health()["state"] == "degraded"
    tier.check_invariants()
    release.set()
    deadline = time.monotonic() + 10
    while tier.tiers.ram.retired() and time.monotonic() < deadline:
        tier.poll()
        time.sleep(0.005)
    assert tier.tiers.ram.retired() == 0 and tier.health() is None
    tier.check_invariants()
    check_bytes(tier, tier.path)


def test_a_prefetch_queued_past_the_timeout_is_not_a_fault(tier, direct, monkeypatch):
    """A guess read ahead that no step waits for may sit behind demand reads on a busy disk for longer than the
    timeout: /ready must not flip to 503 for it. Once a step waits for it, the timeout counts from then."""
    release = threading.Event()

    def stall(n, real, fd, view, offset):
        assert release.wait(10)
        return real(fd, view, offset)

    Inject(monkeypatch, tier, stall)
    try:
        assert tier.prefetch([BAD]) == 1
        time.sleep(tier.timeout_s * 2)
        assert tier.health() is None
        tier.demand(BAD[0], np.array([BAD[1]]))  # a step now needs it: the clock starts
        time.sleep(tier.timeout_s * 1.5)
        assert tier.health()["state"] == "degraded" and tier.health()["stalled_reads"] == 1
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while tier._reads and time.monotonic() < deadline:
        tier.poll()
        time.sleep(0.005)
    assert tier.health() is None and tier.tiers.where[BAD] == Where.RAM
    tier.check_invariants()


def test_a_read_that_stays_stalled_is_an_error_naming_the_record(tier, direct, monkeypatch):
    release = threading.Event()

    def stall(n, real, fd, view, offset):
        assert release.wait(10)
        return real(fd, view, offset)

    Inject(monkeypatch, tier, stall)
    t0 = time.monotonic()
    try:
        with pytest.raises(StoreReadError) as ei:
            step(tier, direct, 1, [BAD[1], 8])
        assert time.monotonic() - t0 < 2.0, "the timeout did not bound the wait"
        assert "(layer 2, expert 5)" in ei.value.problem and "no data after 2 attempts of 0.2 s" in ei.value.problem
        assert str(tier.path) in ei.value.problem
        health = tier.health()
        assert health["state"] == "fault" and health["retired_slots"] == 2
        # Two reader threads are stuck on the bad record; the third still serves everything else.
        step(tier, direct, 0, [1, 2, 3], seed=3)
        tier.check_invariants()
    finally:
        release.set()  # let the stuck reader threads go, so the fixture's close does not wait for them


def test_errors_are_store_errors_the_server_can_catch(tier, direct, monkeypatch):
    """The engine turns a StoreError into a request error and stays up: both failure classes are StoreErrors."""
    assert issubclass(StoreReadError, StoreError) and issubclass(StoreCorruptError, StoreError)
    Inject(monkeypatch, tier, flipped)
    with pytest.raises(StoreError):
        step(tier, direct, 1, [BAD[1]])
    assert tier.tiers.where[BAD] == Where.STORE
    tier.check_invariants()


def test_a_record_that_fails_at_warm_up_is_a_fault_not_a_failed_start(packed, monkeypatch):
    ck, store = packed
    from glm53.tiers import save_routing_stats
    from glm53.tiers.nvme import model_key
    from store.format import read_header

    counts = np.ones((2, EXPERTS))
    counts[BAD] = 100.0  # the bad record is the hottest of its layer: warm-up reads it first
    stats = ck.parent / "routing-faulty.json"
    save_routing_stats(stats, counts, model_key(read_header(store)))
    real = R.pread_into
    offset = read_header(store).entry(2, BAD[1]).offset
    monkeypatch.setattr(R, "pread_into", lambda fd, view, off: eio(0, real, fd, view, off) if off == offset
                        else real(fd, view, off))
    with open_nvme_tier(store, ck, nvme_plan(store, EXPERTS + 4, 0), stats_path=stats,
                        reader_options=PYTHON_READS) as tier:
        assert tier.tiers.where[BAD] == Where.STORE and (tier.tiers.where == Where.RAM).sum() == EXPERTS + 4 - 1
        assert tier.health()["faults"][0]["expert"] == BAD[1]
        tier.check_invariants()
