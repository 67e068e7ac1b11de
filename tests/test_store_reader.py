"""The engine's reader: priorities, promotion, cancellation, retries, errors, buffers, fallback, split reads."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import threading
import time

import numpy as np
import pytest
from test_nvme_tier_support import Gate, reference, small_store

import store.reader as R
from store.directio import alloc_aligned, alloc_slots
from store.errors import DirectIOUnsupported, StoreCorruptError, StoreReadError
from store.format import read_header
from store.reader import Priority, StoreReader


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return small_store(tmp_path_factory.mktemp("reader"))


def test_demand_reads_go_before_queued_prefetches(store, monkeypatch):
    gate = Gate(monkeypatch)
    with StoreReader(store, threads=1) as r:
        arena = alloc_slots(5, r.max_extent)
        first = r.read(1, 0, arena[0], priority=Priority.PREFETCH)
        assert gate.entered.wait(10)                        # the only worker is busy with it
        pre = r.read_many([(1, 1, arena[1]), (1, 2, arena[2])], priority=Priority.PREFETCH)
        dem = r.read(2, 7, arena[3], priority=Priority.DEMAND)
        gate.release.set()
        for f in [first, *pre, dem]:
            f.result(10)
        h = r.header
        assert gate.order == [h.entry(*k).offset for k in [(1, 0), (2, 7), (1, 1), (1, 2)]]


def test_asking_again_as_demand_promotes_a_queued_prefetch(store, monkeypatch):
    gate = Gate(monkeypatch)
    with StoreReader(store, threads=1) as r:
        arena = alloc_slots(4, r.max_extent)
        r.read(1, 0, arena[0], priority=Priority.PREFETCH)
        assert gate.entered.wait(10)
        a = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
        b = r.read(1, 2, arena[2], priority=Priority.PREFETCH)
        b2 = r.read(1, 2, arena[2], priority=Priority.DEMAND)
        assert b2 is b                                       # one read, not two
        gate.release.set()
        a.result(10), b.result(10)
        h = r.header
        assert gate.order == [h.entry(1, 0).offset, h.entry(1, 2).offset, h.entry(1, 1).offset]
        assert r.stats()["reads"] == 3


def test_a_cancelled_prefetch_is_never_read(store, monkeypatch):
    gate = Gate(monkeypatch)
    with StoreReader(store, threads=1) as r:
        arena = alloc_slots(3, r.max_extent)
        r.read(1, 0, arena[0])
        assert gate.entered.wait(10)
        doomed = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
        kept = r.read(1, 2, arena[2], priority=Priority.PREFETCH)
        assert doomed.cancel()
        gate.release.set()
        kept.result(10)
        assert r.header.entry(1, 1).offset not in gate.order


def test_reads_fill_the_callers_buffer_and_return_views(store):
    with StoreReader(store, threads=2, verify=True) as r:
        arena = alloc_slots(16, r.max_extent)
        futs = r.read_many([(layer, e, arena[i]) for i, (layer, e) in enumerate(r.keys())])
        for (layer, e), f in zip(r.keys(), futs, strict=True):
            done = f.result(10)
            assert (done.layer, done.expert) == (layer, e)
            assert done.data.ctypes.data % 4096 == 0
            assert done.data.tobytes() == reference(store, layer, e)
        v = r.views(2, arena[15])
        seg = r.layout(2).segment("down.svh")
        assert v.down.svh.tobytes() == arena[15][seg.offset:seg.offset + seg.nbytes].tobytes()


def test_a_failed_read_is_retried(store, monkeypatch):
    real, calls = R.pread_into, [0]

    def flaky(fd, view, offset):
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(errno.EIO, "Input/output error")
        if calls[0] == 2:
            return 4096                                    # a short read
        return real(fd, view, offset)

    monkeypatch.setattr(R, "pread_into", flaky)
    with StoreReader(store, threads=1, retries=2) as r:
        buf = alloc_aligned(r.max_extent)
        done = r.read(1, 3, buf).result(10)
        assert done.attempts == 3 and r.stats()["retries"] == 2
        assert done.data.tobytes() == reference(store, 1, 3)


def test_a_read_that_keeps_failing_names_the_store_and_the_record(store, monkeypatch):
    def broken(fd, view, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(R, "pread_into", broken)
    with StoreReader(store, threads=1, retries=1) as r:
        with pytest.raises(StoreReadError) as ei:
            r.read(2, 6, alloc_aligned(r.max_extent)).result(10)
        assert str(store) in ei.value.problem and "(layer 2, expert 6)" in ei.value.problem
        assert "Input/output error" in ei.value.problem and "after 2 attempts" in ei.value.problem
        assert "glm53 verify-store" in ei.value.fix
        assert r.stats()["errors"] == 1


def test_a_store_truncated_under_the_reader_gives_a_short_read_error(store, tmp_path):
    p = tmp_path / "s.glm53"
    p.write_bytes(store.read_bytes())
    with StoreReader(p, threads=1, retries=0) as r:
        last = r.keys()[-1]
        os.truncate(p, r.header.entry(*last).offset + 4096)
        with pytest.raises(StoreReadError, match="short read"):
            r.read(*last, alloc_aligned(r.max_extent)).result(10)


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


def test_close_cancels_what_is_queued(store, monkeypatch):
    gate = Gate(monkeypatch)
    r = StoreReader(store, threads=1)
    arena = alloc_slots(3, r.max_extent)
    running = r.read(1, 0, arena[0])
    assert gate.entered.wait(10)
    queued = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
    threading.Timer(0.05, gate.release.set).start()
    r.close()
    assert running.result(10).expert == 0 and queued.cancelled()
    assert r.stats()["cancelled"] == 1 and r.stats()["reads"] == 1
    with pytest.raises(RuntimeError, match="closed"):
        r.read(1, 2, arena[2])


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


def test_threads_read_concurrently(store):
    with StoreReader(store, threads=4) as r:
        arena = alloc_slots(64, r.max_extent)
        keys = r.keys() * 4
        futs = r.read_many([(layer, e, arena[i]) for i, (layer, e) in enumerate(keys)])
        assert all(f.result(10).data.tobytes() == reference(store, *k) for k, f in zip(keys, futs, strict=True))
        assert r.stats()["reads"] == 64 and r.stats()["queued"] == 0


# -- split reads (pieces > 1): the test store's records are 40 KiB, so min_piece=4096 splits them in four --------
# (on the reader's own threads here; native split reads, one call per record, are tested further down)

SPLIT = {"pieces": 4, "min_piece": 4096, "native": False}  # the reader threads read the parts


def parts(r, layer, expert):
    """File offsets of the parts a split reader reads (layer, expert) in."""
    e = r.header.entry(layer, expert)
    return [e.offset + start for start, _ in r._split(e.extent)]


class Faults:
    """Wraps pread_into: records every (offset, length); `how(call, real, fd, view, offset)` handles the reads
    that cover the byte at `target` (the other reads go through)."""

    def __init__(self, monkeypatch, target, how):
        self.real, self.target, self.how, self.calls, self.seen = R.pread_into, target, how, 0, []
        monkeypatch.setattr(R, "pread_into", self)

    def __call__(self, fd, view, offset):
        self.seen.append((offset, len(view)))
        if not offset <= self.target < offset + len(view):
            return self.real(fd, view, offset)
        self.calls += 1
        return self.how(self.calls, self.real, fd, view, offset)


def test_split_reads_land_the_same_bytes_in_aligned_parts(store, monkeypatch):
    rec = Faults(monkeypatch, -1, None)
    with StoreReader(store, threads=4, verify=True, **SPLIT) as r, StoreReader(store, threads=2) as whole:
        keys = r.keys()
        arena, ref = alloc_slots(len(keys), r.max_extent), alloc_slots(len(keys), r.max_extent)
        futs = r.read_many([(layer, e, arena[i]) for i, (layer, e) in enumerate(keys)])
        refs = whole.read_many([(layer, e, ref[i]) for i, (layer, e) in enumerate(keys)])
        for k, f, g in zip(keys, futs, refs, strict=True):
            done = f.result(10)
            assert (done.layer, done.expert, done.attempts) == (*k, 1) and done.seconds >= 0
            assert done.data.tobytes() == g.result(10).data.tobytes() == reference(store, *k)
        h = r.header
        assert r.stats()["reads"] == len(keys) and r.stats()["bytes"] == sum(h.entry(*k).extent for k in keys)
        split = [(o, n) for o, n in rec.seen if n < r.max_extent]
        assert len(split) == 4 * len(keys) and all(o % 4096 == 0 and n % 4096 == 0 for o, n in split)
        for k in keys:                                   # each record's parts tile its extent exactly
            e = h.entry(*k)
            mine = sorted((o, n) for o, n in split if e.offset <= o < e.offset + e.extent)
            assert mine[0][0] == e.offset and sum(n for _, n in mine) == e.extent
            assert all(a + m == b for (a, m), (b, _) in zip(mine, mine[1:], strict=False))
    assert r._split(40960) == [(0, 8192), (8192, 8192), (16384, 8192), (24576, 16384)]


def test_records_below_two_min_pieces_stay_one_read(store, monkeypatch):
    rec = Faults(monkeypatch, -1, None)
    with StoreReader(store, threads=2, pieces=4) as r:                # min_piece 1 MiB: the 40 KiB records stay whole
        assert r.read(1, 3, alloc_aligned(r.max_extent)).result(10).data.tobytes() == reference(store, 1, 3)
        assert rec.seen == [(r.header.entry(1, 3).offset, r.max_extent)]


def test_split_demand_parts_go_before_queued_prefetch_parts(store, monkeypatch):
    gate = Gate(monkeypatch)
    with StoreReader(store, threads=1, **SPLIT) as r:
        arena = alloc_slots(4, r.max_extent)
        first = r.read(1, 0, arena[0], priority=Priority.PREFETCH)
        assert gate.entered.wait(10)                        # the only worker holds the first part of (1, 0)
        pre = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
        dem = r.read(2, 7, arena[2], priority=Priority.DEMAND)
        gate.release.set()
        for f, k in [(first, (1, 0)), (pre, (1, 1)), (dem, (2, 7))]:
            assert f.result(10).data.tobytes() == reference(store, *k)
        a, b, d = parts(r, 1, 0), parts(r, 1, 1), parts(r, 2, 7)
        assert gate.order == a[:1] + d + a[1:] + b


def test_asking_again_as_demand_promotes_a_queued_split_prefetch(store, monkeypatch):
    gate = Gate(monkeypatch)
    with StoreReader(store, threads=1, **SPLIT) as r:
        arena = alloc_slots(3, r.max_extent)
        first = r.read(1, 0, arena[0], priority=Priority.PREFETCH)
        assert gate.entered.wait(10)
        a = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
        b = r.read(1, 2, arena[2], priority=Priority.PREFETCH)
        assert r.read(1, 2, arena[2], priority=Priority.DEMAND) is b
        assert r.read(1, 0, arena[0], priority=Priority.DEMAND) is first   # its parts not yet taken move up too
        gate.release.set()
        for f in (first, a, b):
            f.result(10)
        assert gate.order == parts(r, 1, 0)[:1] + parts(r, 1, 2) + parts(r, 1, 0)[1:] + parts(r, 1, 1)
        assert r.stats()["reads"] == 3


def test_a_queued_split_read_can_be_cancelled_but_not_one_under_way(store, monkeypatch):
    gate = Gate(monkeypatch)
    with StoreReader(store, threads=1, **SPLIT) as r:
        arena = alloc_slots(3, r.max_extent)
        running = r.read(1, 0, arena[0], priority=Priority.PREFETCH)
        assert gate.entered.wait(10)
        doomed = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
        kept = r.read(1, 2, arena[2], priority=Priority.PREFETCH)
        assert doomed.cancel() and not running.cancel()
        gate.release.set()
        assert running.result(10).data.tobytes() == reference(store, 1, 0)
        kept.result(10)
        assert not set(parts(r, 1, 1)) & set(gate.order)
        assert r.stats()["cancelled"] == 1 and r.stats()["reads"] == 2


def test_close_finishes_a_split_read_under_way_and_cancels_the_queued_ones(store, monkeypatch):
    gate = Gate(monkeypatch)
    r = StoreReader(store, threads=1, **SPLIT)
    arena = alloc_slots(2, r.max_extent)
    running = r.read(1, 0, arena[0])
    assert gate.entered.wait(10)
    queued = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
    threading.Timer(0.05, gate.release.set).start()
    r.close()
    assert running.result(10).data.tobytes() == reference(store, 1, 0) and queued.cancelled()


def test_a_failed_part_is_retried_in_place(store, monkeypatch):
    def flaky(n, real, fd, view, offset):
        if n == 1:
            raise OSError(errno.EIO, "Input/output error")
        if n == 2:
            return 4096                                    # a short read
        return real(fd, view, offset)

    with StoreReader(store, threads=2, retries=2, verify=True, **SPLIT) as r:
        target = parts(r, 1, 3)[2]
        faults = Faults(monkeypatch, target, flaky)
        done = r.read(1, 3, alloc_aligned(r.max_extent)).result(10)
        assert done.attempts == 3 and r.stats()["retries"] == 2 and r.stats()["reads"] == 1
        assert done.data.tobytes() == reference(store, 1, 3)
        assert [o for o, _ in faults.seen].count(target) == 3       # only that part was read again
        assert len(faults.seen) == 6


def test_a_part_that_keeps_failing_fails_the_record_and_skips_the_rest(store, monkeypatch):
    def broken(n, real, fd, view, offset):
        raise OSError(errno.EIO, "Input/output error")

    with StoreReader(store, threads=1, retries=1, **SPLIT) as r:
        p = parts(r, 2, 6)
        faults = Faults(monkeypatch, p[2], broken)
        with pytest.raises(StoreReadError) as ei:
            r.read(2, 6, alloc_aligned(r.max_extent)).result(10)
        assert str(store) in ei.value.problem and "(layer 2, expert 6)" in ei.value.problem
        assert "Input/output error" in ei.value.problem and "after 2 attempts" in ei.value.problem
        assert "glm53 verify-store" in ei.value.fix
        assert [o for o, _ in faults.seen] == [p[0], p[1], p[2], p[2]]   # the last part is never read
        assert r.stats()["errors"] == 1 and r.stats()["queued"] == 0
        assert r.read(2, 5, alloc_aligned(r.max_extent)).result(10).data.tobytes() == reference(store, 2, 5)


def test_a_truncated_store_gives_a_short_read_error_with_split_reads(store, tmp_path):
    p = tmp_path / "s.glm53"
    p.write_bytes(store.read_bytes())
    with StoreReader(p, threads=2, retries=0, **SPLIT) as r:
        last = r.keys()[-1]
        os.truncate(p, r.header.entry(*last).offset + 4096)
        with pytest.raises(StoreReadError, match="short read"):
            r.read(*last, alloc_aligned(r.max_extent)).result(10)


def flip_once(n, real, fd, view, offset):
    got = real(fd, view, offset)
    if n == 1:
        view[1000] = (view[1000] + 1) % 256                # the disk returned a wrong byte, once
    return got


def flip_always(n, real, fd, view, offset):
    got = real(fd, view, offset)
    view[1000] = (view[1000] + 1) % 256
    return got


def test_a_checksum_mismatch_in_a_part_rereads_the_whole_record(store, monkeypatch):
    with StoreReader(store, threads=2, verify=True, **SPLIT) as r:
        e = r.header.entry(1, 4)
        faults = Faults(monkeypatch, parts(r, 1, 4)[1] + 1000, flip_once)
        done = r.read(1, 4, alloc_aligned(r.max_extent)).result(10)
        assert done.data.tobytes() == reference(store, 1, 4) and done.attempts == 2
        assert faults.seen[-1] == (e.offset, e.extent)             # the re-read is one whole-record pread
        assert r.stats()["retries"] == 1 and r.stats()["reads"] == 1 and r.stats()["errors"] == 0


def test_a_checksum_mismatch_that_persists_is_a_corrupt_record(store, monkeypatch):
    with StoreReader(store, threads=2, verify=True, retries=2, **SPLIT) as r:
        Faults(monkeypatch, parts(r, 2, 1)[3] + 1000, flip_always)
        with pytest.raises(StoreCorruptError) as ei:
            r.read(2, 1, alloc_aligned(r.max_extent)).result(10)
        assert "(layer 2, expert 1)" in ei.value.problem and "xxh3" in ei.value.problem
        assert "after 3 attempts" in ei.value.problem and "glm53 verify-store" in ei.value.fix
        assert r.stats()["errors"] == 1 and r.stats()["retries"] == 2


def test_a_failed_split_read_resolves_only_once_no_part_is_still_writing(store, monkeypatch):
    """The owner frees (and may reuse) a read's buffer as soon as its future fails, so a sibling part still in
    its pread must finish before the failure is reported."""
    real = R.pread_into
    release, slow_in = threading.Event(), threading.Event()
    with StoreReader(store, threads=4, retries=0, **SPLIT) as r:
        p = parts(r, 1, 3)

        def fake(fd, view, offset):
            if offset == p[2]:
                assert slow_in.wait(10)
                raise OSError(errno.EIO, "Input/output error")
            if offset == p[1]:  # a slow part, still reading
                slow_in.set()
                assert release.wait(10)
            return real(fd, view, offset)

        monkeypatch.setattr(R, "pread_into", fake)
        others = [(2, i, alloc_aligned(r.max_extent)) for i in range(3)]  # wake every thread, whatever the waking
        fut = r.read_many([(1, 3, alloc_aligned(r.max_extent)), *others], priority=Priority.DEMAND)[0]
        assert slow_in.wait(10)
        time.sleep(0.2)  # the failing part has long given up by now
        assert not fut.done(), "the failure was reported while part 1 could still write into the buffer"
        release.set()
        with pytest.raises(StoreReadError, match="I/O error"):
            fut.result(10)
        assert r.stats()["errors"] == 1


def test_a_lone_split_read_is_read_by_several_threads_at_once(store, monkeypatch):
    real = R.pread_into
    live, peak, lock = [0], [0], threading.Lock()

    def slow(fd, view, offset):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.05)  # a disk read's latency
        with lock:
            live[0] -= 1
        return real(fd, view, offset)

    with StoreReader(store, threads=4, **SPLIT) as r:
        time.sleep(0.1)  # the workers idle, waiting, as between decode steps
        monkeypatch.setattr(R, "pread_into", slow)
        buf = alloc_aligned(r.max_extent)
        r.read(1, 3, buf).result(10)
        assert bytes(buf[:r.extent(1, 3)]) == reference(store, 1, 3)
    assert peak[0] == 4, f"its 4 parts were read at most {peak[0]} at a time"


@pytest.mark.parametrize("split", [{}, SPLIT])
def test_asking_again_after_cancelling_a_queued_read_reads_it(store, monkeypatch, split):
    gate = Gate(monkeypatch)
    with StoreReader(store, threads=1, **split) as r:
        arena = alloc_slots(2, r.max_extent)
        first = r.read(1, 0, arena[0])
        assert gate.entered.wait(10)
        doomed = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
        assert doomed.cancel()
        again = r.read(1, 1, arena[1], priority=Priority.PREFETCH)
        assert again is not doomed and not again.cancelled()
        # The cancelled read's leftover is skipped without forgetting the new one: asking a third time promotes it.
        assert r.read(1, 1, arena[1], priority=Priority.DEMAND) is again
        gate.release.set()
        first.result(10)
        assert bytes(again.result(10).data) == reference(store, 1, 1)
        assert r.stats()["reads"] == 2


# -- native split reads: each record's parts read in one call to glm53's compiled parallel pread ----------------

NATIVE = {"pieces": 4, "min_piece": 4096}
needs_native = pytest.mark.skipif(R._native() is None, reason="glm53's native library is not built (pip install -e .)")


@needs_native
def test_the_native_parallel_pread_reads_whole_ranges_stops_at_eof_and_names_errors(tmp_path):
    data = os.urandom(5 * 4096 + 123)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for parts in (1, 2, 4, 7):  # 7: more parts than 4 KiB blocks in a part's share -> fewer, or one
            buf = np.zeros(len(data), np.uint8)
            assert R.pread_parts(fd, buf, 0, parts) == len(data) and buf.tobytes() == data
        tail = np.zeros(8 * 4096, np.uint8)  # past the end of the file: the bytes there are, no more
        assert R.pread_parts(fd, tail, 4096, 4) == len(data) - 4096
        assert tail[:len(data) - 4096].tobytes() == data[4096:] and not tail[len(data) - 4096:].any()
    finally:
        os.close(fd)
    with pytest.raises(OSError) as ei:
        R.pread_parts(fd, np.zeros(4 * 4096, np.uint8), 0, 4)  # closed: every part fails
    assert ei.value.errno == errno.EBADF


@needs_native
@pytest.mark.parametrize("hashed", [False, pytest.param(True, marks=pytest.mark.skipif(
    not R._part_hash(), reason="the xxhash package does not export XXH3_64bits"))])
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
                    got = R.pread_parts(fd, buf, offset, parts)
                    if got != length or buf.tobytes() != want:
                        failures.append((t, k, parts, offset, length, got))
                    continue
                hashes = np.zeros(parts, np.uint64)
                got, used = R.pread_parts(fd, buf, offset, parts, hashes)
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
        assert R.pread_parts(fd, tail, len(data) - 5000, 8) == 5000 and tail[:5000].tobytes() == data[-5000:]
    finally:
        os.close(fd)
    for parts in (2, 4, 8):  # closed: every part fails, on the pool's threads as on the caller's
        with pytest.raises(OSError) as ei:
            R.pread_parts(fd, np.zeros(8 * 4096, np.uint8), 0, parts)
        assert ei.value.errno == errno.EBADF


@needs_native
def test_native_split_reads_land_the_same_bytes_one_call_per_record(store, monkeypatch):
    calls, real = [], R.pread_parts

    def spy(fd, buf, offset, parts, hashes=None):
        calls.append((offset, len(buf), parts))
        return real(fd, buf, offset, parts, hashes)

    def no_python_parts(fd, view, offset):
        raise AssertionError(f"a Python-level pread at {offset}: the parts should have been read natively")

    monkeypatch.setattr(R, "pread_parts", spy)
    monkeypatch.setattr(R, "pread_into", no_python_parts)
    with StoreReader(store, threads=4, verify=True, **NATIVE) as r:
        assert r.native
        keys = r.keys()
        arena = alloc_slots(len(keys), r.max_extent)
        futs = r.read_many([(layer, e, arena[i]) for i, (layer, e) in enumerate(keys)])
        for k, f in zip(keys, futs, strict=True):
            done = f.result(10)
            assert (done.layer, done.expert, done.attempts) == (*k, 1)
            assert done.data.tobytes() == reference(store, *k)
        h = r.header
        assert sorted(calls) == sorted((h.entry(*k).offset, h.entry(*k).extent, 4) for k in keys)
        assert r.stats()["reads"] == len(keys) and r.stats()["bytes"] == sum(h.entry(*k).extent for k in keys)
    with StoreReader(store, threads=2, pieces=4, native=False) as r:
        assert not r.native
    with StoreReader(store, threads=2) as r:  # pieces=1: one pread per record, nothing to split
        assert not r.native


@needs_native
@pytest.mark.parametrize("fault, first_only", [("eio", True), ("short", True), ("flip", True),
                                               ("eio", False), ("short", False), ("flip", False)])
def test_native_split_read_faults_are_retried_then_named(store, monkeypatch, fault, first_only):
    real, seen = R.pread_parts, []
    with StoreReader(store, threads=2, verify=True, retries=2, **NATIVE) as r:
        e = r.header.entry(2, 5)

        def fake(fd, buf, offset, parts, hashes=None):
            if offset != e.offset or (first_only and seen):
                return real(fd, buf, offset, parts, hashes)
            seen.append(parts)
            if fault == "eio":
                raise OSError(errno.EIO, "Input/output error")
            got = real(fd, buf, offset, parts, hashes)
            if fault == "short":
                return (got[0] - 4096, got[1]) if hashes is not None else got - 4096
            buf[3000] ^= 0xFF  # the disk returned a wrong byte
            return got

        monkeypatch.setattr(R, "pread_parts", fake)
        fut = r.read(2, 5, alloc_aligned(r.max_extent), priority=Priority.DEMAND)
        if first_only:  # a transient fault: the second attempt reads it
            done = fut.result(10)
            assert done.data.tobytes() == reference(store, 2, 5) and done.attempts == 2 and seen == [4]
            assert r.stats()["retries"] == 1 and r.stats()["errors"] == 0
            return
        error, words = {"eio": (StoreReadError, "I/O error"), "short": (StoreReadError, "short read"),
                        "flip": (StoreCorruptError, "xxh3")}[fault]
        with pytest.raises(error) as ei:
            fut.result(10)
        assert words in ei.value.problem and "(layer 2, expert 5)" in ei.value.problem
        assert "after 3 attempts" in ei.value.problem and seen == [4, 4, 4]
        assert r.stats()["errors"] == 1 and r.stats()["retries"] == 2


def _corrupt(path, offset: int) -> bytes:
    """Flip one byte of the file at offset; returns the byte that was there."""
    with open(path, "r+b") as f:
        f.seek(offset)
        was = f.read(1)
        f.seek(offset)
        f.write(bytes([was[0] ^ 0xFF]))
    return was


def _restore(path, offset: int, was: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(was)


@needs_native
@pytest.mark.skipif(not R._part_hash(), reason="the xxhash package does not export XXH3_64bits")
def test_a_record_read_again_is_checked_by_its_parts_hashes_and_a_bad_part_is_caught(store, tmp_path):
    path = tmp_path / "s.glm53"
    shutil.copyfile(store, path)
    with StoreReader(path, threads=2, verify=True, retries=1, **NATIVE) as r:
        assert r.part_hashes
        e = r.header.entry(1, 3)
        buf = alloc_aligned(r.max_extent)
        for n in (1, 2):  # the first read is checked whole and keeps its parts' hashes; the second by them
            done = r.read(1, 3, buf).result(10)
            assert done.data.tobytes() == reference(store, 1, 3) and done.attempts == 1
            assert r.stats()["checked_by_parts"] == n - 1
        _corrupt(path, e.offset + e.extent - 100)  # in the record's last part, which its own thread hashes
        with pytest.raises(StoreCorruptError) as ei:
            r.read(1, 3, buf, priority=Priority.DEMAND).result(10)
        assert "xxh3" in ei.value.problem and "(layer 1, expert 3)" in ei.value.problem
        assert r.stats()["checked_by_parts"] == 1 and r.stats()["retries"] == 1
    with StoreReader(path, threads=2, verify=True, part_hashes=False, **NATIVE) as r:
        assert not r.part_hashes


@needs_native
@pytest.mark.skipif(not R._part_hash(), reason="the xxhash package does not export XXH3_64bits")
def test_a_transient_bad_part_on_a_read_checked_by_parts_is_read_again_and_checked_whole(store, tmp_path, monkeypatch):
    path = tmp_path / "s.glm53"
    shutil.copyfile(store, path)
    real, seen = R.pread_parts, []
    with StoreReader(path, threads=2, verify=True, retries=2, **NATIVE) as r:
        e = r.header.entry(2, 6)
        buf = alloc_aligned(r.max_extent)
        r.read(2, 6, buf).result(10)  # its parts' hashes are known from here on

        def flaky(fd, b, offset, parts, hashes=None):
            if seen:
                return real(fd, b, offset, parts, hashes)
            seen.append(hashes is not None)
            was = _corrupt(path, e.offset + 5000)  # the disk gives one wrong byte, once
            try:
                return real(fd, b, offset, parts, hashes)
            finally:
                _restore(path, e.offset + 5000, was)

        monkeypatch.setattr(R, "pread_parts", flaky)
        buf[:] = 0
        done = r.read(2, 6, buf, priority=Priority.DEMAND).result(10)
        assert done.data.tobytes() == reference(store, 2, 6) and done.attempts == 2 and seen == [True]
        assert r.stats()["retries"] == 1 and r.stats()["errors"] == 0 and r.stats()["checked_by_parts"] == 0


def test_pick_pieces_takes_the_fewest_parts_about_as_fast_as_the_fastest():
    assert R.pick_pieces({1: 8.8e-3, 4: 4.4e-3, 8: 8.7e-3}) == 4  # the machine's virtual disk
    assert R.pick_pieces({1: 1.9e-3, 2: 1.0e-3, 4: 0.40e-3, 8: 0.39e-3}) == 4  # 8 is not 5% faster
    assert R.pick_pieces({1: 1.9e-3, 2: 1.0e-3, 4: 0.60e-3, 8: 0.39e-3}) == 8
    assert R.pick_pieces({}) == 1


@needs_native
def test_time_pieces_times_each_part_count_a_record_allows_on_records_read_once(store, monkeypatch):
    head = read_header(store)
    keys = sorted(head.index)[:8]
    tiny = R.time_pieces(store, head, keys, (1, 2, 4, 8))  # records under 1 MiB: no part count but 1
    assert list(tiny) == [1] and tiny[1] > 0
    real, reads = R.pread_parts, []

    def spy(fd, buf, offset, parts, hashes=None):
        reads.append((offset, parts))
        if offset == head.entry(*keys[1]).offset:
            raise OSError(errno.EIO, "Input/output error")  # a bad record: left out, the rest still timed
        return real(fd, buf, offset, parts, hashes)

    monkeypatch.setattr(R, "pread_parts", spy)
    timing = R.time_pieces(store, head, keys, (1, 2, 4, 8), min_piece=4096)
    assert sorted(timing) == [1, 2, 4, 8] and all(t > 0 for t in timing.values())
    assert len({o for o, _ in reads}) == len(reads) == 8  # each record read once
    assert [n for _, n in reads] == [1, 2, 4, 8] * 2  # the counts take turns


def test_guesses_read_one_at_a_time_where_a_second_read_at_once_adds_little():
    assert R.pick_prefetch_at_once(1.02, 8) == 1  # one record's parts keep the disk busy
    assert R.pick_prefetch_at_once(1.24, 8) == 1
    assert R.pick_prefetch_at_once(1.9, 8) == 7  # reads at once add up: all workers but one, kept for demand
    assert R.pick_prefetch_at_once(None, 8) == 7 and R.pick_prefetch_at_once(3.0, 1) == 1


@needs_native
def test_time_two_at_once_reads_each_record_once_both_ways(store, monkeypatch):
    head = read_header(store)
    keys = sorted(head.index)[:9]
    real, reads = R.pread_parts, []

    def spy(fd, buf, offset, parts, hashes=None):
        reads.append((offset, parts, threading.current_thread() is threading.main_thread()))
        return real(fd, buf, offset, parts, hashes)

    monkeypatch.setattr(R, "pread_parts", spy)
    gain = R.time_two_at_once(store, head, keys, 2)
    assert gain is not None and gain > 0
    assert len(reads) == 8 and len({o for o, _, _ in reads}) == 8  # two pairs of 4 records, each read once
    assert {n for _, n, _ in reads} == {2} and [m for _, _, m in reads].count(False) == 2  # one beside, per pair
    assert R.time_two_at_once(store, head, keys[:3], 2) is None  # not one pair's records


@needs_native
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Python 3.12 warns of fork() with threads running
def test_a_child_forked_while_the_read_pool_is_busy_reads_with_its_own_pool(tmp_path):
    # The parent's pool threads do not exist in a child and may hold its lock at the fork: a child that used the
    # parent's pool could hang forever (it did, half the time, before the child made its own).
    data = os.urandom(16 * 4096)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    stop = threading.Event()

    def hammer():
        buf = np.zeros(len(data), np.uint8)
        while not stop.is_set():
            R.pread_parts(fd, buf, 0, 8)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        hung = 0
        for _ in range(30):
            pid = os.fork()
            if pid == 0:  # the child: a few reads under an alarm, then out without running any cleanup
                signal.alarm(5)
                buf = np.zeros(len(data), np.uint8)
                ok = all(R.pread_parts(fd, buf, 0, 8) == len(data) and buf.tobytes() == data for _ in range(5))
                os._exit(0 if ok else 3)
            _, status = os.waitpid(pid, 0)
            assert not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3), "a child read wrong bytes"
            hung += os.WIFSIGNALED(status)
        assert hung == 0, f"{hung} of 30 forked children hung in the read pool"
    finally:
        stop.set()
        for t in threads:
            t.join()
        os.close(fd)


@needs_native
@pytest.mark.skipif(not R._part_hash(), reason="the xxhash package does not export XXH3_64bits")
def test_parts_hashes_are_kept_only_from_a_read_that_had_its_buffer_to_itself(store, tmp_path, monkeypatch):
    # Read A's parts are hashed over bytes the disk got wrong; read B, into the same buffer, then lands the right
    # bytes before A's whole check, which passes. A's parts' hashes must not be kept: they are of the wrong bytes,
    # and would pass those same wrong bytes on a later read.
    path = tmp_path / "s.glm53"
    shutil.copyfile(store, path)
    real, state = R.pread_parts, {}
    with StoreReader(path, threads=2, verify=True, retries=1, **NATIVE) as r:
        e = r.header.entry(1, 4)
        buf = alloc_aligned(r.max_extent)

        def wrong_once(fd, b, offset, parts, hashes=None):
            if offset != e.offset or state.get("a"):
                return real(fd, b, offset, parts, hashes)
            state["a"] = True
            was = _corrupt(path, e.offset + 100)
            try:
                got = real(fd, b, offset, parts, hashes)
            finally:
                _restore(path, e.offset + 100, was)
            state["b"] = r.read(1, 4, buf).result(10)  # B: the right bytes, over A's wrong ones
            return got

        monkeypatch.setattr(R, "pread_parts", wrong_once)
        a = r.read(1, 4, buf).result(10)
        assert a.data.tobytes() == reference(store, 1, 4) and state["b"].attempts == 1
        assert (1, 4) not in r._parts_known and r._into == {}
        state.clear()  # the disk gets the same byte wrong once more: the read is checked whole, and read again
        monkeypatch.setattr(R, "pread_parts", lambda fd, b, offset, parts, hashes=None: (
            real(fd, b, offset, parts, hashes) if offset != e.offset or state.get("c")
            else _flaky(state, path, e.offset + 100, lambda: real(fd, b, offset, parts, hashes))))
        c = r.read(1, 4, alloc_aligned(r.max_extent)).result(10)
        assert c.data.tobytes() == reference(store, 1, 4) and c.attempts == 2
        assert (1, 4) in r._parts_known  # that read had its buffer to itself


def _flaky(state, path, offset, read):
    state["c"] = True
    was = _corrupt(path, offset)
    try:
        return read()
    finally:
        _restore(path, offset, was)


@pytest.mark.parametrize("options", [{}, SPLIT], ids=["whole", "split"])
def test_the_busy_clock_counts_time_with_a_read_under_way_once(store, monkeypatch, options):
    """busy_seconds: wall time with at least one read (or part) under way; idle time and overlapping reads add
    nothing. Here one read is held 0.2 s while a second runs beside it, then the reader idles 0.2 s."""
    gate = Gate(monkeypatch)
    with StoreReader(store, threads=2, **options) as r:
        assert r.busy_seconds() == 0.0
        arena = alloc_slots(2, r.max_extent)
        t0 = time.perf_counter()
        held = r.read(1, 0, arena[0])
        assert gate.entered.wait(10)
        r.read(1, 1, arena[1]).result(10)  # beside the held one: no extra busy time
        time.sleep(0.2)
        gate.release.set()
        held.result(10)
        held_for = time.perf_counter() - t0
        time.sleep(0.05)  # a split read's last part ends its clock just after its future resolves
        busy = r.busy_seconds()
        assert 0.2 <= busy <= held_for + 0.05
        time.sleep(0.2)
        assert r.busy_seconds() == busy, "an idle reader's clock stands still"
