"""Faults under the nvme tier, and its read ordering, on real store files: short reads, I/O errors, checksum
mismatches, slow reads, made where the reader's native reads meet them (a copy of the store truncated or with a
byte flipped after the tier opened, a directory's fd in place of the store's, a task's fd or DELAY_NS field set
for one record's reads). Each is retried, then raised as an error naming the store path and the record; nothing
unverified is ever used; the tier reports the fault through health() and keeps serving every other record."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from nvme_support import (
    HIDDEN,
    Direct,
    check_bytes,
    check_wrong_guesses_dropped,
    make_store,
    nvme_spec,
    read_in_parts,
    slot_forward,
)
from step_layer import picks_of, step_layer, stepper_for
from test_nvme_tier import settle_reads
from test_store_reader import corrupt, needs_hash, slow_first, started, under_way

import store.reader as N
from glm53.planning.routing import save_routing_stats
from glm53.tiers import Where
from glm53.tiers.nvme import NvmeTier, model_key
from glm53.tiers.nvme_open import open_nvme_tier
from store.errors import StoreCorruptError, StoreError, StoreReadError
from store.format import read_header

EXPERTS = 16
BAD = (1, 15)  # tier layer 1 = store layer 2, expert 15: the store file's last record, so truncation hits it alone
NAMED = "(layer 2, expert 15)"
TIMEOUT = 0.2


def store_key(key: tuple[int, int]) -> tuple[int, int]:
    """(store layer, expert) of a (tier layer, expert): the store's layer 0 is dense, tier layer i is store i + 1."""
    return key[0] + 1, key[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("nvme-native"), layers=3, experts=EXPERTS)


@pytest.fixture(scope="module")
def direct(packed):
    return Direct(packed[0])


@dataclass
class Site:
    """A copy of the store for the test to damage (truncated even: check_bytes compares with `store`), a directory
    fd to put in place of the store's, and the tiers opened on the copy; all closed after the test, the fd last."""

    ck: Path
    store: Path  # the store as packed: what every readable expert's bytes must equal
    path: Path
    dirfd: int
    stack: ExitStack

    def open(self, *, threads: int = 3, ram: int = EXPERTS + 2, parts: int = 1, timeout_s: float = TIMEOUT,
             warm: bool = False, **kw) -> NvmeTier:
        with pytest.MonkeyPatch.context() as mp:
            read_in_parts(mp, parts)
            tier = self.stack.enter_context(open_nvme_tier(
                self.path, self.ck, nvme_spec(self.path, ram, 0, threads=threads, staging_slots=EXPERTS),
                timeout_s=timeout_s, warm=warm, **kw))
        assert tier.reader.pieces == parts
        return tier

    def entry(self, key=BAD):
        return read_header(self.store).entry(*store_key(key))


@pytest.fixture
def site(packed, tmp_path):
    ck, store = packed
    path = tmp_path / store.name
    shutil.copyfile(store, path)
    with ExitStack() as stack:
        dirfd = os.open(tmp_path, os.O_RDONLY)
        stack.callback(os.close, dirfd)
        yield Site(ck, store, path, dirfd, stack)


@pytest.fixture
def tier(site):
    return site.open()


class Steer:
    """Wraps ReadFuture.__init__: every native read of `key` (tier layer, expert) made from now on has its task
    changed by how(task, n), n counting that record's reads from 1 (a read's own retries reuse its task)."""

    def __init__(self, monkeypatch, key, how: Callable[[np.ndarray, int], object]):
        real, self.how, self.reads, self.on = N.ReadFuture.__init__, how, [], True
        record = store_key(key)

        def init(read, *a, **kw):
            real(read, *a, **kw)
            if self.on and (read.entry.layer, read.entry.expert) == record:
                self.reads.append(read)
                self.how(read.task, len(self.reads))

        monkeypatch.setattr(N.ReadFuture, "__init__", init)


def unreadable(dirfd: int):
    """A task reading from a directory: each attempt fails with EISDIR, an I/O error for that record alone."""

    def how(task, n):
        task[N.FD] = dirfd

    return how


def delayed(seconds: float, first_only: bool = False):
    """A task whose worker sleeps `seconds` before reading (the record's first read only, or every one)."""

    def how(task, n):
        if n == 1 or not first_only:
            task[N.DELAY_NS] = int(seconds * 1e9)

    return how


def finished(fut) -> None:
    """Until the native side is over with the read's current attempt, without looking at it (no check, no retry)."""
    deadline = time.monotonic() + 10
    while int(fut.task[N.STATE]) != N.DONE:
        assert time.monotonic() < deadline, "the native read never finished"
        time.sleep(0.001)


def settle_retired(tier) -> None:
    deadline = time.monotonic() + 10
    while tier.tiers.ram.retired():
        assert time.monotonic() < deadline, "a retired slot was never reclaimed"
        tier.poll()
        time.sleep(0.005)


def step(tier, direct, layer, experts, seed=0) -> dict[str, int]:
    """One decode step of the real step (nvme=the tier) over `experts`, checked against the direct computation;
    returns the picks it counted per lane."""
    g = torch.Generator().manual_seed(seed)
    ids = np.array([experts])
    w, x = torch.rand(ids.shape, generator=g), torch.randn(1, HIDDEN, generator=g)
    before = picks_of(tier.tiers)
    stepper = stepper_for(tier.tiers, EXPERTS, nvme=tier)
    got, _ = step_layer(tier.tiers, stepper, layer, x, ids, w, slot_forward(tier.layout))
    assert torch.equal(got, direct.moe(tier.store_layers[layer], x, ids, w))
    return picks_of(tier.tiers, before)




class Disk:
    """Fault and repair of the copy under an open tier: the whole fd swapped for a directory's (every read fails,
    EISDIR), the bad record's tail cut off (short read), one of its bytes flipped (xxh3)."""

    def __init__(self, site: Site, tier: NvmeTier):
        self.site, self.fd, self.e = site, tier.reader.fd, site.entry()
        self.saved = os.dup(self.fd)
        site.stack.callback(os.close, self.saved)
        self.tail = site.path.read_bytes()[self.e.offset:]

    def break_(self, how: str) -> None:
        if how == "eio":
            os.dup2(self.site.dirfd, self.fd)
        elif how == "short":
            os.truncate(self.site.path, self.e.offset + 4096)
        else:
            corrupt(self.site.path, self.e.offset + 1000)

    def repair(self, how: str) -> None:
        if how == "eio":
            os.dup2(self.saved, self.fd)
        elif how == "short":
            with open(self.site.path, "r+b") as f:
                f.seek(self.e.offset)
                f.write(self.tail)
        else:
            corrupt(self.site.path, self.e.offset + 1000)


# -- a record that keeps failing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how, parts, cls, says", [
    ("eio", 1, StoreReadError, "I/O error: Is a directory"),
    ("short", 1, StoreReadError, "short read (4096 of 40960 bytes"),
    ("xxh3", 1, StoreCorruptError, "xxh3"),
    ("xxh3", 4, StoreCorruptError, "xxh3"),
], ids=["eio", "short", "xxh3", "xxh3-parts"])
def test_a_record_that_keeps_failing_is_an_error_and_the_tier_keeps_serving(site, direct, monkeypatch, how, parts,
                                                                            cls, says):
    tier = site.open(parts=parts)
    assert tier.reader.pieces == parts
    e = site.entry()
    if how == "eio":
        steer = Steer(monkeypatch, BAD, unreadable(site.dirfd))
    elif how == "short":
        os.truncate(site.path, e.offset + 4096)
    else:
        corrupt(site.path, e.offset + 1000)
    with pytest.raises(cls) as ei:
        step(tier, direct, 1, [2, BAD[1], 9])
    err = ei.value
    assert isinstance(err, StoreError)  # what the engine catches and answers as a request error
    assert str(site.path) in err.problem and NAMED in err.problem and says in err.problem
    assert "after 3 attempts" in err.problem and "glm53 verify-store" in err.fix and "pack-store" in err.fix
    rs = tier.reader.stats()
    assert (rs["retries"], rs["errors"]) == (2, 1)  # the reader's own retries (2) before giving up
    if how == "eio":
        assert len(steer.reads) == 1 and int(steer.reads[0].task[N.ERRNO]) != 0  # one read, retried natively
    assert tier.tiers.where[BAD] == Where.STORE, "a record that failed its read was kept"
    health = tier.health()
    assert health["state"] == "fault" and health["store"] == str(site.path)
    (fault,) = health["faults"]
    assert (fault["store_layer"], fault["expert"], fault["count"]) == (2, 15, 1) and says in fault["error"]
    # Every other record is still served, and correctly, in both layers; the failed step's other experts landed.
    assert tier.tiers.where[1, 2] == Where.RAM and tier.tiers.where[1, 9] == Where.RAM
    step(tier, direct, 1, [2, 9, 11], seed=1)
    step(tier, direct, 0, [5, 6, 15], seed=2)
    tier.check_invariants()
    check_bytes(tier, site.store)
    assert tier.stats.snapshot()["nvme"]["failed_reads"] == 1 and tier.reader.stats()["errors"] == 1
    with pytest.raises(cls):  # still failing when asked again: a second fault count, no stale bytes
        step(tier, direct, 1, [BAD[1]])
    assert tier.health()["faults"][0]["count"] == 2 and tier.tiers.where[BAD] == Where.STORE


@needs_hash
def test_a_record_damaged_since_it_was_read_is_caught_by_its_parts_hashes(site, direct):
    """Read once cleanly (checked whole, its parts' hashes kept), dropped from RAM, damaged on disk: the next read,
    checked by its parts, fails, as do its retries (checked whole); repaired, it is read and checked by parts."""
    tier = site.open(parts=4)
    step(tier, direct, 1, [BAD[1]])
    assert (2, 15) in tier.reader._parts_known
    tier.tiers.drop_ram(*BAD)
    e = site.entry()
    corrupt(site.path, e.offset + e.extent - 100)  # in the last part
    with pytest.raises(StoreCorruptError, match="xxh3"):
        step(tier, direct, 1, [BAD[1]])
    assert tier.health()["faults"][0]["expert"] == 15 and tier.reader.stats()["checked_by_parts"] == 0
    corrupt(site.path, e.offset + e.extent - 100)
    step(tier, direct, 1, [BAD[1], 4])
    assert tier.health() is None and tier.reader.stats()["checked_by_parts"] == 1


def test_a_record_that_fails_at_warm_up_is_a_fault_not_a_failed_start(site, monkeypatch):
    counts = np.ones((2, EXPERTS))
    counts[BAD] = 100.0  # the bad record is the hottest of its layer: warm-up reads it first
    stats = site.path.parent / "routing-faulty.json"
    save_routing_stats(stats, counts, model_key(read_header(site.path)))
    steer = Steer(monkeypatch, BAD, unreadable(site.dirfd))
    tier = site.open(ram=EXPERTS + 4, warm=True, stats_path=stats)
    assert len(steer.reads) == 1
    assert tier.tiers.where[BAD] == Where.STORE and (tier.tiers.where == Where.RAM).sum() == EXPERTS + 4 - 1
    assert tier.health()["faults"][0]["expert"] == BAD[1] and NAMED in tier.health()["faults"][0]["error"]
    tier.check_invariants()
    check_bytes(tier, site.store)


# -- transient faults -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("second", ["short", "xxh3"])
def test_a_transient_fault_is_retried_and_leaves_no_fault(site, tier, direct, second):
    """The first attempt fails with an I/O error, the second with `second`; the disk is whole again before the
    third: the step gets the record, with no fault left."""
    disk = Disk(site, tier)
    disk.break_("eio")
    tier.demand(BAD[0], np.array([BAD[1]]))
    fut = tier._reads[BAD].future
    finished(fut)
    disk.repair("eio")
    disk.break_(second)
    assert not fut.done()  # looked at: the I/O error is retried
    finished(fut)
    disk.repair(second)
    picks = step(tier, direct, 1, [BAD[1], 3])
    assert picks["nvme"] == 2 and tier.health() is None and tier.tiers.where[BAD] == Where.RAM
    assert fut.result(0).attempts == 3
    rs = tier.reader.stats()
    assert (rs["retries"], rs["errors"]) == (2, 0)
    tier.check_invariants()
    check_bytes(tier, site.store)


@pytest.mark.parametrize("how, cls", [("eio", StoreReadError), ("short", StoreReadError),
                                      ("xxh3", StoreCorruptError)])
def test_a_fault_clears_once_the_record_reads_cleanly(site, tier, direct, how, cls):
    disk = Disk(site, tier)
    disk.break_(how)
    with pytest.raises(cls, match=r"layer 2, expert 15"):
        step(tier, direct, 1, [BAD[1]])
    assert tier.health()["state"] == "fault"
    disk.repair(how)  # the disk recovered (or the sector was remapped)
    step(tier, direct, 1, [BAD[1]])
    assert tier.health() is None and tier.tiers.where[BAD] == Where.RAM
    tier.check_invariants()


def test_a_failed_prefetch_raises_nothing_but_is_reported(site, tier, direct, monkeypatch):
    Steer(monkeypatch, BAD, unreadable(site.dirfd))
    assert tier.prefetch([BAD, (1, 6)]) == 2
    settle_reads(tier)
    assert tier.tiers.where[BAD] == Where.STORE and tier.tiers.where[1, 6] == Where.RAM
    (fault,) = tier.health()["faults"]
    assert fault["expert"] == BAD[1] and "I/O error" in fault["error"]
    with pytest.raises(StoreReadError, match="expert 15"):  # a step that needs it still gets a clear error
        step(tier, direct, 1, [6, BAD[1]])
    tier.check_invariants()


# -- slow and stalled reads (the task's DELAY_NS: its worker sleeps that long before reading) ------------------------


def test_a_slow_read_times_out_and_is_retried_into_a_fresh_slot(site, tier, direct, monkeypatch):
    """The first read of the record stalls past the timeout: the record is read again into another slot and the
    step goes on; the stalled read's slot stays out of use until that read returns, then is reclaimed."""
    steer = Steer(monkeypatch, BAD, delayed(0.8, first_only=True))
    picks = step(tier, direct, 1, [BAD[1], 4])
    assert picks["nvme"] == 2
    slow, retry = steer.reads
    assert slow.key[2] != retry.key[2], "the retry went into the stalled read's slot"
    assert not slow.done() and retry.result(0).attempts == 1
    snap = tier.stats.snapshot()
    assert snap["nvme"]["timeouts"] == 1 and snap["nvme"]["failed_reads"] == 0
    assert tier.tiers.ram.retired() == 1 and tier.health()["state"] == "degraded"
    assert tier.health()["retired_slots"] == 1
    tier.check_invariants()
    settle_retired(tier)
    assert slow.done() and slow.exception() is None
    assert tier.health() is None
    tier.check_invariants()
    check_bytes(tier, site.store)


def test_a_prefetch_stalled_past_the_timeout_is_not_a_fault_until_a_step_waits(site, tier, monkeypatch):
    """A guess read ahead that no step waits for may take longer than the timeout: /ready must not flip for it.
    Once a step waits for it, the timeout counts from then."""
    Steer(monkeypatch, BAD, delayed(1.2))
    assert tier.prefetch([BAD]) == 1
    time.sleep(TIMEOUT * 2)
    assert tier.health() is None
    tier.demand(BAD[0], np.array([BAD[1]]))  # a step now needs it: the clock starts
    time.sleep(TIMEOUT * 1.5)
    health = tier.health()
    assert health is not None and health["state"] == "degraded" and health["stalled_reads"] == 1
    settle_reads(tier)
    assert tier.health() is None and tier.tiers.where[BAD] == Where.RAM
    tier.check_invariants()


def test_a_read_that_stays_stalled_is_an_error_naming_the_record(site, tier, direct, monkeypatch):
    """Every read of the record stalls: after the timeout retry it is an error, in about two timeouts; the other
    worker serves everything else; once the disk answers again the slots come back and the record reads."""
    steer = Steer(monkeypatch, BAD, delayed(1.0))
    t0 = time.monotonic()
    with pytest.raises(StoreReadError) as ei:
        step(tier, direct, 1, [BAD[1], 8])
    assert time.monotonic() - t0 < 0.9, "the timeout did not bound the wait"
    assert NAMED in ei.value.problem and "no data after 2 attempts of 0.2 s" in ei.value.problem
    assert str(site.path) in ei.value.problem and len(steer.reads) == 2
    health = tier.health()
    assert health["state"] == "fault" and health["retired_slots"] == 2
    # Two native workers sleep in the bad record's reads; the third still serves everything else.
    step(tier, direct, 0, [1, 2, 3], seed=3)
    tier.check_invariants()
    steer.on = False
    settle_retired(tier)
    step(tier, direct, 1, [BAD[1]], seed=4)
    assert tier.health() is None
    tier.check_invariants()


# -- ordering on one native worker, its first read held back by DELAY_NS ---------------------------------------------


def test_a_prefetch_still_in_flight_is_waited_for_not_read_twice(site, direct, monkeypatch):
    tier = site.open(threads=1, ram=2 * EXPERTS, timeout_s=5.0)
    slow_first(monkeypatch, 0.2)
    tier.prefetch([(0, 6)])
    fut = tier._reads[(0, 6)].future
    assert tier.tiers.where[0, 6] == Where.FROM_STORE
    picks = step(tier, direct, 0, [6, 8])
    assert picks["nvme"] == 2 and tier.reader.stats()["reads"] == 2
    assert fut.result(0).attempts == 1 and tier.tiers.where[0, 6] == Where.RAM
    assert tier.stats.snapshot()["prefetch"]["late"] == 1
    assert tier.stats.snapshot()["nvme"]["reads"] == 1  # the step's only demand read: expert 8


def test_demand_reads_overtake_queued_prefetches(site, monkeypatch):
    tier = site.open(threads=1, ram=2 * EXPERTS, timeout_s=5.0)
    slow_first(monkeypatch, 0.2)
    tier.prefetch([(1, e) for e in (0, 1, 2)])
    pre = [tier._reads[(1, e)].future for e in (0, 1, 2)]
    under_way(pre[0])  # the only worker holds the first prefetch
    tier.demand(0, np.array([9]))  # layer 0 runs before the guesses' layer 1
    dem = tier._reads[(0, 9)].future
    settle_reads(tier)
    assert started(pre[0]) < started(dem) < started(pre[1]) < started(pre[2])
    assert all(tier.tiers.where[1, e] == Where.RAM for e in (0, 1, 2)) and tier.tiers.where[0, 9] == Where.RAM
    assert tier.reader.stats()["reads"] == 4
    check_bytes(tier, site.store)


def test_when_its_layer_runs_a_needed_queued_guess_goes_first_and_wrong_ones_are_dropped_unread(site, monkeypatch):
    tier = site.open(threads=1, ram=2 * EXPERTS, timeout_s=5.0)
    slow_first(monkeypatch, 0.2)
    tier.prefetch([(1, e) for e in (0, 1, 2, 3)])
    futs = [tier._reads[(1, e)].future for e in (0, 1, 2, 3)]
    under_way(futs[0])  # the only worker holds the first guess; 1, 2, 3 wait in the queue
    in_use = tier.tiers.ram.in_use()
    tier.demand(1, np.array([0, 3]))  # the step needs the last guess: read next, and only once; 1, 2 were wrong
    assert [Where(tier.tiers.where[1, e]) for e in (1, 2)] == [Where.STORE] * 2
    assert tier.tiers.ram.in_use() == in_use - 2  # their RAM slots are free again
    assert futs[1].cancelled() and futs[2].cancelled()
    assert tier._reads[(1, 3)].future is futs[3]  # the queued guess itself, not a second read
    settle_reads(tier)
    assert started(futs[0]) < started(futs[3]) and started(futs[1]) == started(futs[2]) == 0
    rs = tier.reader.stats()
    assert (rs["reads"], rs["cancelled"]) == (2, 2)
    check_wrong_guesses_dropped(tier)
    check_bytes(tier, site.store)


def test_a_right_guess_saves_its_whole_read_in_time_half_under_way_and_nothing_queued(site, monkeypatch):
    import glm53.tiers.nvme_meter as nvme_mod

    tier = site.open(threads=1, ram=2 * EXPERTS, timeout_s=5.0)
    assert tier.guess_saving() == 1.0  # unmeasured: as if every right guess were read in time
    tier.prefetch([(1, 0)])
    settle_reads(tier)
    tier.demand(1, np.array([0]))  # read in time: a whole read saved
    assert tier.guess_saving() == 1.0 and tier.stats.snapshot()["prefetch"]["hits"] == 1
    slow_first(monkeypatch, 0.2)
    tier.prefetch([(0, e) for e in (1, 2, 3)])
    futs = [tier._reads[(0, e)].future for e in (1, 2, 3)]
    under_way(futs[0])  # the only worker holds the first; 2 and 3 wait in the queue
    assert [f.share_done() for f in futs[1:]] == [0.0, 0.0]  # queued: nothing of them read yet
    monkeypatch.setattr(N.ReadFuture, "share_done", lambda self: 0.25)  # the one under way: a quarter done
    saved, right = tier.meter._saving
    tier.demand(0, np.array([1, 2, 3]))  # all three right, none in time: a quarter of one read saved, of three
    d, trickle = nvme_mod.GUESS_SAVING_DECAY, nvme_mod.GUESS_SAVING_TRICKLE
    assert tier.meter._saving == pytest.approx([d * saved + 0.25 + trickle, d * right + 3 + trickle])
    low = tier.guess_saving()
    assert low == pytest.approx((d * saved + 0.25 + trickle) / (d * right + 3 + trickle)) and low < 1
    pf = tier.stats.snapshot()["prefetch"]
    assert (pf["late"], pf["late_under_way"]) == (3, 1)
    settle_reads(tier)
    check_bytes(tier, site.store)
    # A prompt's reads ahead (most of a layer, still queued when it runs) say nothing of decode's guesses.
    monkeypatch.undo()
    slow_first(monkeypatch, 0.2)
    tier.prefetch([(1, e) for e in (4, 5, 6)])
    under_way(tier._reads[(1, 4)].future)
    before = list(tier.meter._saving)
    tier.demand(1, np.array([4, 5, 6]), decode=False)
    assert tier.meter._saving == before and tier.stats.snapshot()["prefetch"]["late"] == 6  # counted, not scored
    settle_reads(tier)
    # With no guess read for a long while, the saving drifts back towards 1: guesses get tried again.
    for _ in range(2000):
        tier.demand(0, np.array([], np.int64))
    assert low < tier.guess_saving() < 1 and 1 - tier.guess_saving() < (1 - low) / 4


def test_a_guess_that_landed_just_after_the_steps_poll_saved_its_whole_read(site, monkeypatch):
    import glm53.tiers.nvme_meter as nvme_mod

    tier = site.open(threads=1, ram=2 * EXPERTS, timeout_s=5.0)
    tier.prefetch([(0, 4)])
    fut = tier._reads[(0, 4)].future
    real_poll = tier.poll

    def poll():  # the read finishes right after demand()'s poll looked
        n = real_poll()
        finished(fut)
        return n

    monkeypatch.setattr(tier, "poll", poll)
    saved, right = tier.meter._saving
    tier.demand(0, np.array([4]))
    d, trickle = nvme_mod.GUESS_SAVING_DECAY, nvme_mod.GUESS_SAVING_TRICKLE
    assert tier.meter._saving == pytest.approx([d * saved + 1 + trickle, d * right + 1 + trickle])
    settle_reads(tier)
    check_bytes(tier, site.store)


def test_a_guess_being_retried_has_none_of_its_read_done(site, monkeypatch):
    tier = site.open(threads=1, ram=2 * EXPERTS, timeout_s=5.0)
    tier.reader.typical_read_s = 1e-6  # any time under way would count as a whole read
    real = N.ReadFuture.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.task[N.FD] = site.dirfd  # the first attempt fails (EISDIR); the retry sleeps its delay, then reads

    monkeypatch.setattr(N.ReadFuture, "__init__", init)
    tier.prefetch([(1, 7)])
    fut = tier._reads[(1, 7)].future
    finished(fut)
    fut.task[N.FD] = tier.reader.fd
    assert not fut.done() and fut.attempt == 2  # looked at: failed, queued again with a delay
    assert fut.share_done() == 0.0
    settle_reads(tier)
    assert fut.share_done() == 1.0


def test_a_demanded_prefetch_being_retried_goes_ahead_of_queued_prefetches(site, monkeypatch):
    """A guess of layer 0 fails its first attempt (transiently) while guesses of layer 1 wait in the queue; layer 0
    then runs and needs it: its retry is a read a step waits for, and goes before the guesses still queued."""
    tier = site.open(threads=1, ram=2 * EXPERTS, timeout_s=5.0)
    steer = Steer(monkeypatch, (0, 4), lambda task, n: (task.__setitem__(N.FD, site.dirfd),
                                                        task.__setitem__(N.DELAY_NS, int(0.2e9))))
    for e in (0, 1, 2):  # slow guesses: the queue behind the failed read stays full while the step waits
        Steer(monkeypatch, (1, e), delayed(0.2))
    assert tier.prefetch([(0, 4)] + [(1, e) for e in (0, 1, 2)]) == 4
    pre = [tier._reads[(1, e)].future for e in (0, 1, 2)]
    (first,) = steer.reads
    finished(first)  # attempt 1 failed (EISDIR); nobody has looked at it yet
    first.task[N.FD] = tier.reader.fd  # the fault was transient: the retry will read cleanly
    tier.demand(0, np.array([4]))  # layer 0 runs: the failed guess is retried, and now a step waits for it
    tier.wait(0, 4)
    assert first.result(0).attempts == 2 and tier.health() is None and tier.tiers.where[0, 4] == Where.RAM
    settle_reads(tier)
    # Under way when the step came: (1, 0). Queued then, and a guess: (1, 1), (1, 2). The retry goes before them.
    assert int(first.task[N.T_END]) < started(pre[1]) < started(pre[2])


@pytest.mark.parametrize("timeout_s", [5.0, 0.5], ids=["waits", "within-timeout"])
def test_a_guess_demanded_while_under_way_is_retried_ahead_of_queued_guesses(site, monkeypatch, timeout_s):
    """The guess's first attempt is still under way when its layer runs (nothing queued to promote), then fails
    transiently: its retry is queued as demand, before the guesses still queued, so the step waits one retry's
    time; with a 0.5 s timeout the transient error never becomes a timeout (a retired slot, /ready degraded)."""
    tier = site.open(threads=1, ram=2 * EXPERTS, timeout_s=timeout_s)
    steer = Steer(monkeypatch, (0, 4), lambda task, n: n == 1 and (task.__setitem__(N.FD, site.dirfd),
                                                                   task.__setitem__(N.DELAY_NS, int(0.2e9))))
    for e in (0, 1, 2):
        Steer(monkeypatch, (1, e), delayed(0.2))
    assert tier.prefetch([(0, 4)] + [(1, e) for e in (0, 1, 2)]) == 4
    pre = [tier._reads[(1, e)].future for e in (0, 1, 2)]
    (first,) = steer.reads
    under_way(first)  # attempt 1 sleeps, then reads a directory
    tier.demand(0, np.array([4]))  # layer 0 runs and needs it: under way, nothing to promote yet
    finished(first)
    first.task[N.FD] = tier.reader.fd  # the fault was transient
    tier.wait(0, 4)
    assert first.result(0).attempts == 2 and tier.tiers.where[0, 4] == Where.RAM
    settle_reads(tier)
    assert int(first.task[N.T_END]) < started(pre[1]) < started(pre[2])
    assert tier.stats.snapshot()["nvme"]["timeouts"] == 0 and tier.health() is None


def test_errors_are_store_errors_the_server_can_catch(site, tier, direct):
    """The engine turns a StoreError into a request error and stays up: both failure classes are StoreErrors."""
    assert issubclass(StoreReadError, StoreError) and issubclass(StoreCorruptError, StoreError)
    Disk(site, tier).break_("xxh3")
    with pytest.raises(StoreError):
        step(tier, direct, BAD[0], [BAD[1]])
    assert tier.tiers.where[BAD] == Where.STORE
    tier.check_invariants()
