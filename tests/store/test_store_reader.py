"""The store reader: priorities, promotion, the guess cap, cancellation, retries, errors, checks whole or by parts,
buffers, the buffered fallback, and the native parallel pread and calibration it reads with."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import pytest
from nvme_support import reference, small_store

import store.reader as R
from store import native
from store.directio import alloc_aligned, alloc_slots
from store.errors import DirectIOUnsupported, StoreCorruptError, StoreReadError
from store.format import read_header
from store.reader import Priority, StoreReader

needs_hash = pytest.mark.skipif(not native.xxh3_address(), reason="the xxhash package does not export XXH3_64bits")
SPLIT = {"pieces": 4, "min_piece": 4096}  # the test store's records are 40 KiB: four parts each


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return small_store(tmp_path_factory.mktemp("native-reader"))


def copy(store, tmp_path):
    path = tmp_path / "s.glm53"
    shutil.copyfile(store, path)
    return path


def corrupt(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        was = f.read(1)
        f.seek(offset)
        f.write(bytes([was[0] ^ 0xFF]))


def slow_first(monkeypatch, seconds: float, every: bool = False) -> None:
    """The next read made (every read made from now on, with `every`) sleeps `seconds` on its worker before
    reading: with one worker, what is queued after it waits behind it."""
    real = R.ReadFuture.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        if not every:
            monkeypatch.setattr(R.ReadFuture, "__init__", real)
        self.task[R.DELAY_NS] = int(seconds * 1e9)

    monkeypatch.setattr(R.ReadFuture, "__init__", init)


def under_way(fut) -> None:
    deadline = time.monotonic() + 10
    while not fut.running():
        assert time.monotonic() < deadline, "the read never started"
        time.sleep(0.001)


def held_first(r, monkeypatch, rows: int, priority=Priority.PREFETCH):
    """An arena of `rows` rows and a first read of (1, 0) into row 0, under way and held 0.2 s on the reader's one
    worker: what is queued next waits behind it."""
    arena = alloc_slots(rows, r.max_extent)
    slow_first(monkeypatch, 0.2)
    first = r.read(1, 0, arena[0], priority=priority)
    under_way(first)
    return arena, first


def started(fut) -> int:
    return int(fut.task[R.T_START])


@pytest.mark.parametrize("options", [{}, SPLIT], ids=["whole", "split"])
def test_reads_land_the_records_bytes_whole_or_in_parts(store, options):
    with R.StoreReader(store, threads=3, verify=True, **options) as r:
        keys = r.keys()
        arena = alloc_slots(len(keys), r.max_extent)
        futs = r.read_many([(layer, e, arena[i]) for i, (layer, e) in enumerate(keys)])
        for k, f in zip(keys, futs, strict=True):
            done = f.result(10)
            assert (done.layer, done.expert, done.attempts) == (*k, 1) and done.seconds >= 0
            assert done.data.ctypes.data % 4096 == 0 and done.data.tobytes() == reference(store, *k)
            assert f.done() and not f.running() and not f.cancelled() and f.exception() is None
        h = r.header
        assert r.stats()["reads"] == len(keys) and r.stats()["bytes"] == sum(h.entry(*k).extent for k in keys)
        assert r.stats()["queued"] == 0 and not r._live and not r._into
        if options:
            assert int(futs[0].task[R.USED]) == 4
        v = r.views(2, arena[-1])
        seg = r.layout(2).segment("down.svh")
        assert v.down.svh.tobytes() == arena[-1][seg.offset:seg.offset + seg.nbytes].tobytes()


def test_demand_reads_go_before_queued_prefetches(store, monkeypatch):
    with R.StoreReader(store, threads=1) as r:
        arena, first = held_first(r, monkeypatch, 4)
        pre = r.read_many([(1, 1, arena[1]), (1, 2, arena[2])], priority=Priority.PREFETCH)
        dem = r.read(2, 7, arena[3], priority=Priority.DEMAND)
        with pytest.raises(FutureTimeout):
            dem.result(0.01)
        for f in [first, *pre, dem]:
            f.result(10)
        assert started(first) < started(dem) < started(pre[0]) < started(pre[1])


def spans(futs) -> list[tuple[int, int]]:
    return [(int(f.task[R.T_START]), int(f.task[R.T_END])) for f in futs]


def most_at_once(intervals) -> int:
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda x: (x[0], x[1]))
    now = most = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


@pytest.mark.parametrize("cap", [1, 2])
def test_prefetches_read_at_most_their_cap_at_once_and_a_demand_read_never_waits_for_them(store, monkeypatch, cap):
    with R.StoreReader(store, threads=3, prefetch_at_once=cap) as r:
        assert r.prefetch_at_once == cap and r.stats()["prefetch_at_once"] == cap
        arena = alloc_slots(7, r.max_extent)
        slow_first(monkeypatch, 0.05, every=True)
        pre = r.read_many([(1, e, arena[e]) for e in range(6)], priority=Priority.PREFETCH)
        for f in pre[:cap]:
            under_way(f)
        dem = r.read(2, 7, arena[6], priority=Priority.DEMAND)
        dem.result(10)
        for f in pre:
            f.result(10)
        assert most_at_once(spans(pre)) == cap
        # A free worker took the demand read at once, beside the prefetches under way (not after one of them).
        running_then = sum(a <= started(dem) < b for a, b in spans(pre))
        assert running_then == cap and started(dem) < min(b for _, b in spans(pre))
        assert r.stats()["reads"] == 7


def test_a_reads_share_done_is_nothing_queued_its_time_over_a_typical_read_under_way_and_all_once_done(
        store, monkeypatch):
    with R.StoreReader(store, threads=1) as r:
        arena = alloc_slots(3, r.max_extent)
        assert r.typical_read_s is None
        r.read(1, 0, arena[0]).result(10)
        assert r.typical_read_s is not None and r.typical_read_s > 0  # timed from reads that passed
        r.typical_read_s = 5.0  # long beside the sleep below, so that a stalled CI core cannot reach it
        slow_first(monkeypatch, 2.0)
        first = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
        under_way(first)
        queued = r.read(1, 2, arena[2], priority=Priority.PREFETCH)
        assert queued.share_done() == 0.0
        time.sleep(0.2)
        assert 0.04 <= first.share_done() < 1.0  # 0.2 s (or a little more) of a typical 5 s: under way 2 s
        first.result(10)
        queued.result(10)
        assert first.share_done() == queued.share_done() == 1.0


def test_without_a_cap_every_worker_takes_prefetches(store, monkeypatch):
    with R.StoreReader(store, threads=3) as r:
        assert r.prefetch_at_once == 3
        arena = alloc_slots(6, r.max_extent)
        slow_first(monkeypatch, 0.05, every=True)
        pre = r.read_many([(1, e, arena[e]) for e in range(6)], priority=Priority.PREFETCH)
        for f in pre:
            f.result(10)
        assert most_at_once(spans(pre)) == 3


@pytest.mark.parametrize("how", ["promote", "ask again"])
def test_a_prefetch_held_back_by_the_cap_starts_at_once_when_promoted(store, monkeypatch, how):
    with R.StoreReader(store, threads=2, prefetch_at_once=1) as r:
        arena = alloc_slots(2, r.max_extent)
        slow_first(monkeypatch, 1.0)
        first = r.read(1, 0, arena[0], priority=Priority.PREFETCH)
        under_way(first)
        held = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
        time.sleep(0.05)
        assert not held.running()  # behind the cap, a worker idle
        if how == "promote":
            assert r.promote(1, 1, arena[1])
        else:
            assert r.read(1, 1, arena[1], priority=Priority.DEMAND) is held
        held.result(0.5)  # the idle worker took it: it did not wait for the slow read to end
        assert not first.done()
        first.result(10)


def test_a_promoted_running_prefetch_still_frees_its_place_under_the_cap(store, monkeypatch):
    with R.StoreReader(store, threads=2, prefetch_at_once=1) as r:
        arena = alloc_slots(3, r.max_extent)
        slow_first(monkeypatch, 0.1)
        first = r.read(1, 0, arena[0], priority=Priority.PREFETCH)
        under_way(first)
        r.promote(1, 0, arena[0])  # under way: marked demand for a retry, but it was taken as a prefetch
        rest = r.read_many([(1, 1, arena[1]), (1, 2, arena[2])], priority=Priority.PREFETCH)
        for f in (first, *rest):
            f.result(10)
        assert most_at_once(spans([first, *rest])) == 1


def test_asking_again_as_demand_or_promoting_moves_a_queued_prefetch_ahead(store, monkeypatch):
    with R.StoreReader(store, threads=1) as r:
        arena, first = held_first(r, monkeypatch, 5)
        a, b, c = r.read_many([(1, 1, arena[1]), (1, 2, arena[2]), (1, 3, arena[3])], priority=Priority.PREFETCH)
        assert r.read(1, 2, arena[2], priority=Priority.DEMAND) is b  # one read, not two
        assert r.promote(1, 3, arena[3]) and not r.promote(1, 0, arena[0]) and not r.promote(2, 0, arena[4])
        for f in (first, a, b, c):
            f.result(10)
        assert started(b) < started(c) < started(a)
        assert not r.promote(1, 3, arena[3])  # done: nothing to promote
        assert r.stats()["reads"] == 4


def test_a_cancelled_queued_read_is_never_read(store, monkeypatch):
    with R.StoreReader(store, threads=1) as r:
        arena, first = held_first(r, monkeypatch, 3, Priority.DEMAND)
        doomed = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
        kept = r.read(1, 2, arena[2], priority=Priority.PREFETCH)
        assert not first.cancel()  # under way
        assert doomed.cancel() and doomed.cancelled() and doomed.done() and doomed.cancel()
        with pytest.raises(CancelledError):
            doomed.result()
        kept.result(10)
        assert not kept.cancel() and started(doomed) == 0 and first.result().expert == 0
        assert r.stats()["cancelled"] == 1 and r.stats()["reads"] == 2
        again = r.read(1, 1, arena[1])  # asked again after its cancel: read anew
        assert again is not doomed and again.result(10).data.tobytes() == reference(store, 1, 1)


def test_close_cancels_what_is_queued_and_finishes_what_runs(store, monkeypatch):
    r = R.StoreReader(store, threads=1)
    arena = alloc_slots(3, r.max_extent)
    slow_first(monkeypatch, 0.1)
    running = r.read(1, 0, arena[0])
    under_way(running)
    queued = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
    r.close()
    assert running.done() and running.result(0).expert == 0 and queued.cancelled()
    assert r.stats()["cancelled"] == 1 and r.stats()["reads"] == 1
    with pytest.raises(RuntimeError, match="closed"):
        r.read(1, 2, arena[2])
    r.close()  # twice is fine


@pytest.mark.parametrize("options", [{}, SPLIT], ids=["whole", "split"])
def test_a_truncated_store_gives_a_short_read_error_naming_the_record(store, tmp_path, options):
    path = copy(store, tmp_path)
    with R.StoreReader(path, threads=1, retries=1, verify=True, **options) as r:
        last = r.keys()[-1]
        os.truncate(path, r.header.entry(*last).offset + 4096)
        fut = r.read(*last, alloc_aligned(r.max_extent))
        with pytest.raises(StoreReadError) as ei:
            fut.result(10)
        assert "short read" in ei.value.problem and f"(layer {last[0]}, expert {last[1]})" in ei.value.problem
        assert str(path) in ei.value.problem and "after 2 attempts" in ei.value.problem
        assert "glm53 verify-store" in ei.value.fix and fut.exception() is ei.value
        assert r.stats()["retries"] == 1 and r.stats()["errors"] == 1


def test_an_io_error_is_retried_then_named(store, tmp_path):
    with R.StoreReader(store, threads=1, retries=2) as r:
        dirfd = os.open(tmp_path, os.O_RDONLY)
        os.dup2(dirfd, r.fd)  # every pread now fails with EISDIR
        os.close(dirfd)
        with pytest.raises(StoreReadError) as ei:
            r.read(2, 6, alloc_aligned(r.max_extent)).result(10)
        assert "I/O error: Is a directory" in ei.value.problem and "(layer 2, expert 6)" in ei.value.problem
        assert "after 3 attempts" in ei.value.problem and r.stats()["retries"] == 2


@pytest.mark.parametrize("options", [{}, SPLIT], ids=["whole", "split"])
def test_a_corrupted_record_is_a_corrupt_error_after_the_retries(store, tmp_path, options):
    path = copy(store, tmp_path)
    with R.StoreReader(path, threads=2, verify=True, retries=2, **options) as r:
        corrupt(path, r.header.entry(1, 3).offset + 5000)
        bad, good = r.read_many([(1, 3, alloc_aligned(r.max_extent)), (1, 4, alloc_aligned(r.max_extent))])
        with pytest.raises(StoreCorruptError) as ei:
            bad.result(10)
        assert "xxh3" in ei.value.problem and "(layer 1, expert 3)" in ei.value.problem
        assert "after 3 attempts" in ei.value.problem
        assert good.result(10).data.tobytes() == reference(store, 1, 4)
        assert r.stats()["retries"] == 2 and r.stats()["errors"] == 1 and r.stats()["reads"] == 1


def test_a_transient_fault_is_read_again(store, tmp_path):
    path = copy(store, tmp_path)
    e = read_header(path).entry(2, 2)
    with R.StoreReader(path, threads=1, verify=True, retries=2, **SPLIT) as r:
        corrupt(path, e.offset + 100)
        fut = r.read(2, 2, alloc_aligned(r.max_extent))
        while int(fut.task[R.STATE]) != R.DONE:  # the native read is over; nobody has looked at it yet
            time.sleep(0.001)
        corrupt(path, e.offset + 100)  # the disk gives the right byte again
        done = fut.result(10)
        assert done.attempts == 2 and done.data.tobytes() == reference(store, 2, 2)
        assert r.stats()["retries"] == 1 and r.stats()["errors"] == 0


@needs_hash
def test_a_record_read_again_is_checked_by_its_parts_hashes_and_a_bad_part_is_caught(store, tmp_path):
    path = copy(store, tmp_path)
    with R.StoreReader(path, threads=2, verify=True, retries=1, **SPLIT) as r:
        assert r.hash
        e = r.header.entry(1, 3)
        buf = alloc_aligned(r.max_extent)
        for n in (1, 2):  # the first read is checked whole (hashed natively) and keeps its parts' hashes
            fut = r.read(1, 3, buf)
            done = fut.result(10)
            assert done.data.tobytes() == reference(store, 1, 3) and done.attempts == 1
            assert r.stats()["checked_by_parts"] == n - 1 and bool(fut.task[R.WANT_WHOLE]) == (n == 1)
        corrupt(path, e.offset + e.extent - 100)  # in the last part
        with pytest.raises(StoreCorruptError) as ei:
            r.read(1, 3, buf, priority=Priority.DEMAND).result(10)
        assert "xxh3" in ei.value.problem and "(layer 1, expert 3)" in ei.value.problem
        assert r.stats()["checked_by_parts"] == 1 and r.stats()["retries"] == 1


@needs_hash
def test_parts_hashes_are_kept_only_from_a_read_that_had_its_buffer_to_itself(store, monkeypatch):
    with R.StoreReader(store, threads=1, verify=True, **SPLIT) as r:
        buf = alloc_aligned(r.max_extent)
        slow_first(monkeypatch, 0.05)
        a = r.read(1, 5, buf)
        b = r.read(1, 6, buf)  # into the same buffer while the first is under way
        a.result(10), b.result(10)
        assert (1, 5) not in r._parts_known and (1, 6) not in r._parts_known
        r.read(1, 5, buf).result(10)
        assert (1, 5) in r._parts_known


def test_the_busy_clock_grows_while_reading_and_stands_still_idle(store, monkeypatch):
    with R.StoreReader(store, threads=2) as r:
        assert r.busy_seconds() == 0.0
        arena = alloc_slots(2, r.max_extent)
        t0 = time.perf_counter()
        slow_first(monkeypatch, 0.2)
        held = r.read(1, 0, arena[0])
        under_way(held)
        r.read(1, 1, arena[1]).result(10)  # beside the held one: no extra busy time
        mid = r.busy_seconds()
        assert 0 < mid < 0.2
        held.result(10)
        held_for = time.perf_counter() - t0
        busy = r.busy_seconds()
        assert 0.2 <= busy <= held_for
        time.sleep(0.1)
        assert r.busy_seconds() == busy, "an idle reader's clock stands still"


def test_many_python_threads_submit_and_wait_at_once(store):
    with R.StoreReader(store, threads=4, verify=True, **SPLIT) as r:
        keys, errors = r.keys(), []

        def client(i):
            try:
                arena = alloc_slots(len(keys), r.max_extent)
                for _ in range(3):
                    prio = Priority.DEMAND if i % 2 else Priority.PREFETCH
                    futs = r.read_many([(layer, e, arena[j]) for j, (layer, e) in enumerate(keys)], priority=prio)
                    for k, f in zip(keys, futs, strict=True):
                        assert f.result(10).data.tobytes() == reference(store, *k)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[0]
        s = r.stats()
        assert s["reads"] == 8 * 3 * len(keys) and s["errors"] == 0 and s["queued"] == 0 and not r._live


def test_a_dropped_future_still_has_its_read_settled(store):
    with R.StoreReader(store, threads=2, verify=True) as r:
        arena = alloc_slots(300, r.max_extent)
        for i in range(300):  # futures never looked at: the reader looks at them itself now and then
            r.read(1, i % 8, arena[i])
            if i == 254:
                time.sleep(0.2)  # the reads so far land, and the next submit sweeps them
        assert len(r._live) <= 300 - 250 and r.stats()["reads"] >= 250 and r.stats()["errors"] == 0


# -- the nvme tier on the native reader: tests/tiers/test_nvme_tier.py's core equality test, parametrized ------------------


def test_a_retry_cut_short_by_close_fails_with_what_it_was_retrying(store, tmp_path, monkeypatch):
    """A read whose first attempt failed its check has its retry queued when close() comes: the future raises the
    check's failure (as StoreReader's would), not CancelledError."""
    path = copy(store, tmp_path)
    e = read_header(path).entry(1, 3)
    corrupt(path, e.offset + 100)
    r = R.StoreReader(path, threads=1, allow_buffered=True, verify=True)
    arena = alloc_slots(2, r.max_extent)
    fut = r.read(1, 3, arena[0])
    deadline = time.monotonic() + 10
    while int(fut.task[R.STATE]) < R.DONE:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    # The retry's own delay is slept on the worker, under way: only a read holding the one worker keeps it queued.
    slow_first(monkeypatch, 0.3)
    slow = r.read(1, 1, arena[1])
    under_way(slow)
    assert not fut.done()  # the first attempt checked: its retry is queued, behind the slow read
    r.close()
    with pytest.raises(StoreCorruptError, match=r"layer 1, expert 3.*after 1 attempts"):
        fut.result(5)
    assert slow.result(1).expert == 1


def _run(script: str, tmp_path) -> None:
    """Run a script in a fresh interpreter with a 60 s limit: a hang fails the test instead of the suite."""
    import subprocess
    import sys

    src = tmp_path / "script.py"
    src.write_text(script)
    done = subprocess.run([sys.executable, str(src)], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_forked_child_sees_the_reader_closed_and_exits(store, tmp_path):
    """A child of fork() has the reader but not its worker threads: reads there fail as on a closed reader, and the
    child exits (the queue it inherited is never destroyed there: that would wait on the parent's threads)."""
    out = _run(f"""
import os, warnings
warnings.simplefilter("ignore")
from store.reader import StoreReader
from store.directio import alloc_slots
r = StoreReader({str(store)!r}, threads=2, allow_buffered=True, verify=True)
buf = alloc_slots(1, r.max_extent)[0]
r.read(1, 0, buf).result(10)
pid = os.fork()
if pid == 0:
    try:
        r.read(1, 1, buf)
        code = 3
    except RuntimeError as exc:
        code = 0 if "closed" in str(exc) else 4
    r.close()
    raise SystemExit(code)  # the exit hooks run: they must not hang
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
r.read(1, 2, buf).result(10)  # the parent's reader is untouched
print("ok")
""", tmp_path)
    assert out.strip() == "ok"


def test_a_reader_stays_answerable_after_the_exit_hook_closed_it(store, tmp_path):
    """At exit the module's hook closes every live reader but frees none: an exit hook that runs after it (registered
    before the module was imported) can still ask a reader for its stats and busy clock, and close it again."""
    out = _run(f"""
import atexit
state = {{}}

def late():
    r = state["r"]
    print(r.stats()["reads"], r.busy_seconds() >= 0)
    r.close()

atexit.register(late)  # before the import: runs after the module's own hook
from store.reader import StoreReader
from store.directio import alloc_slots
r = state["r"] = StoreReader({str(store)!r}, threads=1, allow_buffered=True, verify=True)
r.read(1, 0, alloc_slots(1, r.max_extent)[0]).result(10)
""", tmp_path)
    assert out.strip() == "1 True"


def test_a_retry_cut_short_by_close_is_counted_once(store, tmp_path, monkeypatch):
    """One read: its retry, queued behind a slow read when the reader closes, is an error, not also cancelled."""
    dirfd = os.open(tmp_path, os.O_RDONLY)
    real = R.ReadFuture.__init__

    def init(self, *a, **kw):  # the first read reads a directory: EISDIR
        real(self, *a, **kw)
        monkeypatch.setattr(R.ReadFuture, "__init__", real)
        self.task[R.FD] = dirfd

    monkeypatch.setattr(R.ReadFuture, "__init__", init)
    try:
        r = R.StoreReader(store, threads=1, verify=True)
        arena = alloc_slots(2, r.max_extent)
        bad = r.read(1, 0, arena[0], priority=Priority.PREFETCH)
        while int(bad.task[R.STATE]) != R.DONE:
            time.sleep(0.001)
        slow_first(monkeypatch, 0.3)  # the delay is set before the read is queued: it cannot finish unseen
        slow = r.read(1, 1, arena[1])
        under_way(slow)
        assert not bad.done()  # looked at: failed, its retry queued behind the slow read
        r.close()
        assert isinstance(bad.exception(1), StoreReadError)
        assert r.stats()["errors"] == 1 and r.stats()["cancelled"] == 0 and slow.result(1).expert == 1
    finally:
        os.close(dirfd)

def pread(fd: int, buf, offset: int, parts: int) -> int:
    """The native parallel pread in ALIGN-sized parts, unhashed: the bytes read."""
    return native.pread_parts(fd, buf, offset, parts, R.ALIGN)[0]


def test_bad_buffers_are_refused_up_front(store):
    with StoreReader(store) as r:
        ext = r.extent(1, 0)
        with pytest.raises(ValueError, match="too small"):
            r.read(1, 0, alloc_aligned(ext - 4096))
        with pytest.raises(ValueError, match="aligned"):
            r.read(1, 0, alloc_aligned(ext + 4096)[1:ext + 1])
        with pytest.raises(ValueError, match="uint8"):
            r.read(1, 0, np.zeros(ext // 2, np.int16))
        with pytest.raises(KeyError, match="layer 9, expert 0"):
            r.read(9, 0, alloc_aligned(ext))


def test_buffered_fallback_only_when_allowed_and_then_with_a_warning(store, monkeypatch, caplog):
    real = os.open

    def fake(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", fake)
    with pytest.raises(DirectIOUnsupported) as ei:
        StoreReader(store)
    assert "ext4 or xfs" in ei.value.fix and "GLM53_ALLOW_BUFFERED_READS=1" in ei.value.fix
    with caplog.at_level(logging.WARNING, logger="glm53.store"):
        with StoreReader(store, allow_buffered=True) as r:
            assert not r.direct
            buf = np.zeros(r.max_extent, np.uint8)               # any buffer will do when buffered
            assert r.read(1, 5, buf).result(10).data.tobytes() == reference(store, 1, 5)
    assert "GLM53_ALLOW_BUFFERED_READS" in caplog.text and "does not support O_DIRECT" in caplog.text


def test_the_native_parallel_pread_reads_whole_ranges_stops_at_eof_and_names_errors(tmp_path):
    data = os.urandom(5 * 4096 + 123)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for parts in (1, 2, 4, 7):  # 7: more parts than 4 KiB blocks in a part's share -> fewer, or one
            buf = np.zeros(len(data), np.uint8)
            assert pread(fd, buf, 0, parts) == len(data) and buf.tobytes() == data
        tail = np.zeros(8 * 4096, np.uint8)  # past the end of the file: the bytes there are, no more
        assert pread(fd, tail, 4096, 4) == len(data) - 4096
        assert tail[:len(data) - 4096].tobytes() == data[4096:] and not tail[len(data) - 4096:].any()
    finally:
        os.close(fd)
    with pytest.raises(OSError) as ei:
        pread(fd, np.zeros(4 * 4096, np.uint8), 0, 4)  # closed: every part fails
    assert ei.value.errno == errno.EBADF


@pytest.mark.parametrize("hashed", [False, pytest.param(True, marks=pytest.mark.skipif(
    not native.xxh3_address(), reason="the xxhash package does not export XXH3_64bits"))])
def test_the_native_parallel_pread_serves_many_python_threads_at_once_then_still_names_errors(tmp_path, hashed):
    import xxhash  # the store's own hash, for the parts' expected values

    data = os.urandom(64 * 4096 + 777)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    failures = []

    def reader(t: int) -> None:
        rng = np.random.default_rng(t)
        try:
            for k in range(50):  # every thread's calls overlap the others' in the shared native worker pool
                parts = (t + k) % 8 + 1
                offset = int(rng.integers(0, 8 * 4096))
                length = int(rng.integers(1, len(data) - offset + 1))
                buf = np.zeros(length, np.uint8)
                want = data[offset:offset + length]
                if not hashed:
                    got = pread(fd, buf, offset, parts)
                    if got != length or buf.tobytes() != want:
                        failures.append((t, k, parts, offset, length, got))
                    continue
                hashes = np.zeros(parts, np.uint64)
                got, used = native.pread_parts(fd, buf, offset, parts, R.ALIGN, native.xxh3_address(), hashes)
                size = length // parts // R.ALIGN * R.ALIGN if parts > 1 else 0
                expect = parts if size else 1  # a range too short to split is read (and hashed) as one part
                pieces = [want[i * size:(i + 1) * size if i < used - 1 else length] for i in range(used)]
                if got != length or buf.tobytes() != want or used != expect \
                        or [int(x) for x in hashes[:used]] != [xxhash.xxh3_64_intdigest(b) for b in pieces]:
                    failures.append((t, k, parts, offset, length, got, used))
        except Exception as exc:  # noqa: BLE001 - reported below with the thread it came from
            failures.append((t, repr(exc)))

    try:
        threads = [threading.Thread(target=reader, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads) and failures == []
        tail = np.zeros(8 * 4096, np.uint8)  # past the end of the file, with the pool running: the bytes there are
        assert pread(fd, tail, len(data) - 5000, 8) == 5000 and tail[:5000].tobytes() == data[-5000:]
    finally:
        os.close(fd)
    for parts in (2, 4, 8):  # closed: every part fails, on the pool's threads as on the caller's
        with pytest.raises(OSError) as ei:
            pread(fd, np.zeros(8 * 4096, np.uint8), 0, parts)
        assert ei.value.errno == errno.EBADF
