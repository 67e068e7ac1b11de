"""How this store's reads are best made, timed on it when the nvme tier opens: the parts a record is read in
(time_pieces, pick_pieces) and how many guess reads may be under way at once (time_two_at_once,
pick_prefetch_at_once). Reads here go through the native pread as the reader makes them, each part hashed by the
thread that read it.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from store import native
from store.directio import alloc_aligned, open_for_read
from store.format import ALIGN, StoreHeader, align_up
from store.reader import MIN_PIECE

log = logging.getLogger("glm53.store")


def time_pieces(path: str | Path, header: StoreHeader, keys, choices=(1, 2, 4, 8), *, allow_buffered: bool = False,
                min_piece: int = MIN_PIECE) -> dict[int, float]:
    """Median seconds one record read alone takes in each number of parallel parts (of `choices`, those its extent
    allows at `min_piece`), as the reader reads it: the native pread, each part hashed by the thread that read it.
    Each record of `keys` is read once, by one part count, the counts taking turns: a record read twice would come
    the second time from whatever cache the first read filled (the page cache of a buffered fd, a virtual disk's
    host), and time the cache. On a buffered fd the record's cached pages are dropped before the read, for the
    same reason, and after it (tmpfs has nothing to drop: its pages are the store). A read that fails or comes back
    short is left out; {} where nothing was timed. Raises NativeUnavailable where the native library is not built."""
    native.library()
    if not keys:
        return {}
    extent = max(header.entry(*k).extent for k in keys)
    counts = sorted({1, *(n for n in choices if n >= 1 and extent // align_up(max(1, min_piece)) >= n)})
    buf = alloc_aligned(header.max_extent)
    hashes = np.zeros(max(counts), np.uint64)
    times: dict[int, list[float]] = {n: [] for n in counts}
    try:
        fd, direct = open_for_read(path, allow_buffered)
    except OSError as exc:
        log.warning("store %s: cannot time its reads (%s)", path, exc)
        return {}
    try:
        for i, k in enumerate(keys):
            e, n = header.entry(*k), counts[i % len(counts)]
            if not direct:
                os.posix_fadvise(fd, e.offset, e.extent, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            try:
                got, _ = native.pread_parts(fd, buf[:e.extent], e.offset, n, ALIGN, native.xxh3_address(), hashes)
            except OSError as exc:
                log.warning("store %s: %s failed while timing reads (%s)", path, e.where(), exc)
                continue
            if got == e.extent:
                times[n].append(time.perf_counter() - t0)
            if not direct:  # and leave nothing in it: under a memory cap the page cache counts against the process
                os.posix_fadvise(fd, e.offset, e.extent, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return {n: sorted(ts)[len(ts) // 2] for n, ts in times.items() if ts}


def time_two_at_once(path: str | Path, header: StoreHeader, keys, pieces: int, *,
                     allow_buffered: bool = False) -> float | None:
    """How much faster two records come in read at once than one after the other, each in `pieces` parallel parts
    as the reader reads them: the median over pairs of (time for two, one after the other) / (time for two at
    once). Near 1: one record's parts already keep the store busy, and a second read beside it only takes a share
    of the same rate. Each record of `keys` (4 per pair) is read once, the two ways taking turns, for the reason
    time_pieces gives. None where nothing was timed. Raises NativeUnavailable where the native library is not
    built."""
    native.library()
    if len(keys) < 4:
        return None
    bufs = [alloc_aligned(header.max_extent) for _ in range(2)]
    hashes = [np.zeros(max(1, pieces), np.uint64) for _ in range(2)]
    try:
        fd, direct = open_for_read(path, allow_buffered)
    except OSError as exc:
        log.warning("store %s: cannot time its reads (%s)", path, exc)
        return None

    def read(i: int, k) -> None:
        e = header.entry(*k)
        if not direct:
            os.posix_fadvise(fd, e.offset, e.extent, os.POSIX_FADV_DONTNEED)
        got, _ = native.pread_parts(fd, bufs[i][:e.extent], e.offset, pieces, ALIGN, native.xxh3_address(), hashes[i])
        if got != e.extent:
            raise OSError(0, f"short read of {e.where()}")

    gains = []
    try:
        with ThreadPoolExecutor(1) as other:
            other.submit(int).result()  # the thread made before any timing
            for j in range(len(keys) // 4):
                a, b, c, d = keys[4 * j:4 * j + 4]
                beside = None
                try:
                    t0 = time.perf_counter()
                    read(0, a)
                    read(0, b)
                    t1 = time.perf_counter()
                    beside = other.submit(read, 1, d)
                    read(0, c)
                    beside.result()
                    t2 = time.perf_counter()
                except OSError as exc:
                    if beside is not None:
                        beside.exception()  # done before the next pair is timed
                    log.warning("store %s: a read failed while timing reads at once (%s)", path, exc)
                    continue
                gains.append((t1 - t0) / max(t2 - t1, 1e-9))
    finally:
        if not direct:
            for k in keys:
                e = header.entry(*k)
                os.posix_fadvise(fd, e.offset, e.extent, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return sorted(gains)[len(gains) // 2] if gains else None


def pick_prefetch_at_once(gain: float | None, threads: int, enough: float = 1.25) -> int:
    """How many prefetch (guess) reads a reader of `threads` workers may run at once: one where two records read
    at once come in less than `enough` times as fast as one after the other (the store is kept busy by one; each
    further guess read would take its share of the rate from a demand read arriving beside it), else all workers
    but one, which stays free for a demand read. All but one too where nothing was timed."""
    threads = max(1, threads)
    if gain is not None and gain < enough:
        return 1
    return max(1, threads - 1)


def pick_pieces(times: dict[int, float], slack: float = 0.05) -> int:
    """The fewest parts whose time is within `slack` of the fastest (fewer parts: fewer requests for the same
    bytes, and the threads free for other reads); 1 when nothing was timed."""
    if not times:
        return 1
    best = min(times.values())
    return min(n for n, t in times.items() if t <= best * (1 + slack))
