"""The engine's store reader: O_DIRECT reads of (layer, expert) records into caller-provided aligned buffers.

A pool of threads serves one priority queue: demand reads (a token is waiting) before prefetch reads (a
guess), first come first served within a priority. Re-asking for a queued prefetch as a demand promotes it.
Every request returns a concurrent.futures.Future; cancelling a prefetch that is still queued drops it.
os.preadv releases the GIL, so a few Python threads keep an NVMe queue full. With pieces > 1 a record is read
as that many aligned parts at once: in one call to glm53's compiled parallel pread where it is built (no GIL
taken between the parts), else by whichever reader threads are idle (see StoreReader.__init__).

    reader = StoreReader(path, threads=4, allow_buffered=settings.allow_buffered_reads)
    arena = alloc_slots(64, reader.max_extent)              # pin it with cudaHostRegister if you like
    fut = reader.read(3, 17, arena[0], priority=Priority.DEMAND)
    views = reader.views(3, fut.result().data)              # views.gate.trellis, views.down.svh, ...
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np
import xxhash

from store.directio import open_for_read, pread_into
from store.errors import StoreCorruptError, StoreReadError
from store.format import ALIGN, DTYPES, PROJECTIONS, Layout, RecordEntry, StoreHeader, align_up, read_header
from store.verify import pack_command

log = logging.getLogger("glm53.store")


MIN_PIECE = 1 << 20  # a record's parts are at least this large: large reads on any disk


class Priority(IntEnum):
    DEMAND = 0
    PREFETCH = 1


@dataclass(frozen=True)
class Linear:
    trellis: np.ndarray      # int16 (in/16, out/16, 16*K)
    suh: np.ndarray          # float16 (in,)
    svh: np.ndarray          # float16 (out,)


@dataclass(frozen=True)
class SlotViews:
    gate: Linear
    up: Linear
    down: Linear


def slot_views(layout: Layout, buf: np.ndarray) -> SlotViews:
    """Typed views (no copies) of one record's tensors inside buf, per the v1 segment layout."""
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous or buf.nbytes < layout.length:
        raise ValueError(f"slot_views needs a contiguous 1-D uint8 buffer of at least {layout.length} bytes")
    views = {}
    for seg in layout.segments:
        views[seg.name] = buf[seg.offset:seg.offset + seg.nbytes].view(DTYPES[seg.dtype]).reshape(seg.shape)
    return SlotViews(*(Linear(views[f"{p}.trellis"], views[f"{p}.suh"], views[f"{p}.svh"]) for p in PROJECTIONS))


@dataclass(frozen=True)
class ReadDone:
    layer: int
    expert: int
    data: np.ndarray         # the caller's buffer, sliced to the record extent (payload + zero padding)
    attempts: int
    seconds: float


class _Task:
    """One record read. A task split into parts stays at the head of the heap until its last part is handed out
    (`taken`), so its parts keep the task's place in the priority order; `left` counts parts not yet landed,
    `running` parts handed out and still reading (a failed read resolves only when none is: until then a part may
    still write into the caller's buffer)."""
    __slots__ = ("entry", "out", "future", "verify", "priority", "taken", "key",
                 "parts", "next", "left", "failed", "t0", "attempts", "running", "error")

    def __init__(self, entry: RecordEntry, out: np.ndarray, verify: bool, priority: int, key: tuple,
                 parts: list[tuple[int, int]] | None = None):
        self.entry, self.out, self.verify, self.priority, self.key = entry, out, verify, priority, key
        self.future: Future = Future()
        self.taken = False
        self.parts = parts          # (start, length) inside the extent; None: one pread, the unsplit path
        self.next, self.left, self.failed = 0, len(parts or ()), False
        self.t0, self.attempts, self.running = 0.0, 1, 0
        self.error: BaseException | None = None


_NATIVE: list = []  # [glm53's parallel pread or None], looked up once


def _native():
    """glm53's compiled parallel pread, or None (not built, or the store package used without glm53)."""
    if not _NATIVE:
        try:
            from glm53.cpu_lane.kernel import parallel_pread
        except ImportError:
            _NATIVE.append(None)
        else:
            _NATIVE.append(parallel_pread())
    return _NATIVE[0]


def pread_parts(fd: int, buf: np.ndarray, offset: int, parts: int, hashes: np.ndarray | None = None):
    """Fill buf from offset as `parts` ALIGN-sized pieces (the last takes the rest) read at once in native code;
    returns the bytes read (fewer only at EOF), raises OSError. hashes (uint64, `parts` entries): each part read
    whole is xxh3-64 hashed by the thread that read it into hashes[i]; the return is then (bytes, parts used)."""
    if hashes is None:
        return _native()(fd, buf, offset, parts, ALIGN)
    if not _part_hash():
        raise RuntimeError("per-part hashes asked for, but the xxhash package exports no XXH3_64bits (see _part_hash)")
    return _native()(fd, buf, offset, parts, ALIGN, _part_hash(), hashes)


_PART_HASH: list = []  # [the address of xxhash's C XXH3_64bits, or 0], looked up once


def _part_hash() -> int:
    """The address of the xxhash library's own C XXH3_64bits (the one the xxhash package wraps), for the native
    reader's per-part hashes; 0 where the package does not export it or it disagrees with the package's own
    result on a test buffer (then records are checked whole, as always)."""
    if not _PART_HASH:
        address = 0
        try:
            import ctypes

            from xxhash import _xxhash

            fn = ctypes.CDLL(_xxhash.__file__).XXH3_64bits
            fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
            probe = np.frombuffer(b"glm53 part hash probe" * 300, np.uint8)
            if fn(probe.ctypes.data, probe.nbytes) == xxhash.xxh3_64_intdigest(probe):
                address = ctypes.cast(fn, ctypes.c_void_p).value or 0
        except (ImportError, OSError, AttributeError):
            pass
        _PART_HASH.append(address)
    return _PART_HASH[0]


def time_pieces(path: str | Path, header: StoreHeader, keys, choices=(1, 2, 4, 8), *, allow_buffered: bool = False,
                min_piece: int = MIN_PIECE, hashed: bool = True) -> dict[int, float]:
    """Median seconds one record read alone takes in each number of parallel parts (of `choices`, those its extent
    allows at `min_piece`), as the reader reads it: glm53's native pread, each part hashed by its thread (`hashed`).
    Each record of `keys` is read once, by one part count, the counts taking turns: a record read twice would come
    the second time from whatever cache the first read filled (the page cache of a buffered fd, a virtual disk's
    host), and time the cache. On a buffered fd the record's cached pages are dropped before the read, for the
    same reason, and after it (tmpfs has nothing to drop: its pages are the store). A read that fails or comes back
    short is left out; {} where nothing was timed, or the native pread is not built (the parts would then run on
    Python threads, a path with costs of its own)."""
    if _native() is None or not keys:
        return {}
    extent = max(header.entry(*k).extent for k in keys)
    counts = sorted({1, *(n for n in choices if n >= 1 and extent // align_up(max(1, min_piece)) >= n)})
    from store.directio import alloc_aligned

    buf = alloc_aligned(header.max_extent)
    hashes = np.zeros(max(counts), np.uint64) if hashed and _part_hash() else None
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
                got = pread_parts(fd, buf[:e.extent], e.offset, n, hashes)
            except OSError as exc:
                log.warning("store %s: %s failed while timing reads (%s)", path, e.where(), exc)
                continue
            if (got[0] if hashes is not None else got) == e.extent:
                times[n].append(time.perf_counter() - t0)
            if not direct:  # and leave nothing in it: under a memory cap the page cache counts against the process
                os.posix_fadvise(fd, e.offset, e.extent, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return {n: sorted(ts)[len(ts) // 2] for n, ts in times.items() if ts}


def time_two_at_once(path: str | Path, header: StoreHeader, keys, pieces: int, *, allow_buffered: bool = False,
                     hashed: bool = True) -> float | None:
    """How much faster two records come in read at once than one after the other, each in `pieces` parallel parts
    as the reader reads them: the median over pairs of (time for two, one after the other) / (time for two at
    once). Near 1: one record's parts already keep the store busy, and a second read beside it only takes a share
    of the same rate. Each record of `keys` (4 per pair) is read once, the two ways taking turns, for the reason
    time_pieces gives. None where nothing was timed or the native pread is not built."""
    if _native() is None or len(keys) < 4:
        return None
    from store.directio import alloc_aligned

    bufs = [alloc_aligned(header.max_extent) for _ in range(2)]
    hashes = [np.zeros(max(1, pieces), np.uint64) if hashed and _part_hash() else None for _ in range(2)]
    try:
        fd, direct = open_for_read(path, allow_buffered)
    except OSError as exc:
        log.warning("store %s: cannot time its reads (%s)", path, exc)
        return None

    def read(i: int, k) -> None:
        e = header.entry(*k)
        if not direct:
            os.posix_fadvise(fd, e.offset, e.extent, os.POSIX_FADV_DONTNEED)
        got = pread_parts(fd, bufs[i][:e.extent], e.offset, pieces, hashes[i])
        if (got[0] if hashes[i] is not None else got) != e.extent:
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


def _io_problem(exc: OSError) -> tuple[str, bool]:
    return f"I/O error: {exc.strerror or exc}", False


def _short(got: int, e: RecordEntry) -> tuple[str, bool]:
    return f"short read ({got} of {e.extent} bytes; the file may be truncated)", False


class StoreReader:
    def __init__(self, path: str | Path, *, threads: int = 4, allow_buffered: bool = False, verify: bool = False,
                 retries: int = 2, header: StoreHeader | None = None, warn=None, pieces: int = 1,
                 min_piece: int = MIN_PIECE, native: bool = True, part_hashes: bool = True):
        """Open a store for reading. Raises StoreFormatError for a bad header and DirectIOUnsupported when the
        filesystem refuses O_DIRECT and allow_buffered is False (pass settings.allow_buffered_reads).

        pieces: read each record as up to this many equal 4 KiB-aligned parts (none smaller than min_piece) that
        idle threads read at once. A lone large pread on a virtual disk can run far below the disk's aggregate
        rate, and a step that waits on one record waits on that lone read; splitting it puts several requests in
        flight. 1 (the default) reads a record with one pread, as before. native: read the parts in one call to
        glm53's compiled parallel pread when it is built (False: always on the reader's own threads). Its parts
        never take the GIL; reader threads reading parts take it back after each one, and on a busy host each
        such hand-off can hold up the engine's main thread, which plans every MoE layer step while the GPU
        waits. part_hashes: with native split reads, check a record read again by its parts' hashes (see
        _read); False: always by the whole record's xxh3 after the read."""
        self._setup(path, header, verify, retries, pieces, min_piece)
        self.native = native and self.pieces > 1 and _native() is not None
        # A record's part hashes, kept from its first read that passed the whole-record xxh3: a later read of it
        # is checked part by part, each hashed on the native thread that read it (parallel, and in cache), and
        # one that fails is read again and checked whole. {(layer, expert): the uint64 hashes as bytes, parts as
        # _split}.
        self.part_hashes = part_hashes and self.native and _part_hash() != 0
        self._parts_known: dict[tuple[int, int], bytes] = {}  # bytes: compared in well under a microsecond
        self._into: dict[int, list[int]] = {}  # buffer address -> [reads into it now, reads into it since]
        self.fd, self.direct = open_for_read(self.path, allow_buffered, warn or log.warning)
        self._heap: list[tuple[int, int, _Task]] = []
        self._queued: dict[tuple, _Task] = {}
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._stats = {"reads": 0, "bytes": 0, "retries": 0, "errors": 0, "cancelled": 0, "checked_by_parts": 0}
        # The busy clock: wall time with at least one read (or part) under way, so a caller can tell a store that
        # keeps up (idle most of the time: a guess costs little) from one that is the bottleneck.
        self._active = 0
        self._busy = 0.0
        self._busy_from = 0.0
        self._threads = [threading.Thread(target=self._worker, name=f"glm53-store-reader-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def _setup(self, path, header, verify: bool, retries: int, pieces: int, min_piece: int) -> None:
        """The options every reader of a store keeps (store.native_reader's too)."""
        self.path = Path(path)
        self.header = header or read_header(self.path)
        self.verify = verify
        self.retries = max(0, retries)
        self.pieces = max(1, pieces)
        self.min_piece = align_up(max(1, min_piece))

    # -- geometry -------------------------------------------------------------------------------------------
    @property
    def max_extent(self) -> int:
        """Buffer size that fits any record of this store."""
        return self.header.max_extent

    def extent(self, layer: int, expert: int) -> int:
        return self.header.entry(layer, expert).extent

    def layout(self, layer: int) -> Layout:
        return self.header.layout(layer)

    def views(self, layer: int, buf: np.ndarray) -> SlotViews:
        return slot_views(self.header.layout(layer), buf)

    def keys(self) -> list[tuple[int, int]]:
        return sorted(self.header.index)

    # -- requests -------------------------------------------------------------------------------------------
    def read(self, layer: int, expert: int, out: np.ndarray, *, priority: Priority = Priority.DEMAND,
             verify: bool | None = None) -> Future:
        """Queue one read of (layer, expert) into out; the future resolves to a ReadDone or raises
        StoreReadError / StoreCorruptError naming the store and the record."""
        return self.read_many([(layer, expert, out)], priority=priority, verify=verify)[0]

    def read_many(self, requests, *, priority: Priority = Priority.PREFETCH, verify: bool | None = None) -> list[Future]:
        """Queue a batch of (layer, expert, out) under one lock; returns one future per request, in order."""
        prepared = []
        for layer, expert, out in requests:
            entry = self.header.entry(layer, expert)
            prepared.append((entry, out, self._check_buffer(out, entry)))
        futures, wake = [], 0
        with self._cv:
            if self._closed:
                raise RuntimeError(f"store reader for {self.path} is closed")
            for entry, out, address in prepared:
                key = (entry.layer, entry.expert, address)
                task = self._queued.get(key)
                if task is not None and not task.taken and not task.future.cancelled():  # a cancelled one: anew
                    if int(priority) < task.priority:      # promote a queued prefetch to demand
                        task.priority = int(priority)
                        heapq.heappush(self._heap, (task.priority, next(self._seq), task))
                    futures.append(task.future)
                    wake += 1
                    continue
                task = _Task(entry, out, self.verify if verify is None else verify, int(priority), key,
                             self._split(entry.extent) if self.pieces > 1 and not self.native else None)
                self._queued[key] = task
                heapq.heappush(self._heap, (task.priority, next(self._seq), task))
                futures.append(task.future)
                wake += len(task.parts or ()) or 1
            # One wake-up per part: idle threads each take one, so a lone record's parts are read at once.
            self._cv.notify(wake)
        return futures

    def promote(self, layer: int, expert: int, out: np.ndarray) -> bool:
        """Move a queued read of (layer, expert) into `out` ahead of every prefetch, as a demand read; never starts
        a read (asking again with read() would start a second one into the same buffer once the first is under
        way). False when no such read waits in the queue (under way, done, cancelled or never asked)."""
        with self._cv:
            task = self._queued.get((layer, expert, out.ctypes.data))
            if task is None or task.taken or task.future.cancelled():
                return False
            if task.priority > Priority.DEMAND:
                task.priority = int(Priority.DEMAND)
                heapq.heappush(self._heap, (task.priority, next(self._seq), task))
            return True

    def _split(self, extent: int) -> list[tuple[int, int]] | None:
        """Parts of one extent (an ALIGN multiple): n-1 of an aligned size, the last takes the remainder."""
        n = min(self.pieces, extent // self.min_piece)
        if n < 2:
            return None
        size = extent // n // ALIGN * ALIGN
        return [(i * size, size if i < n - 1 else extent - i * size) for i in range(n)]

    def _check_buffer(self, out: np.ndarray, entry: RecordEntry) -> int:
        """Refuse a buffer the read cannot land in; returns its address (looking it up costs about a microsecond,
        and a decode step queues its reads one by one)."""
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 1 \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("store reads need a writable, contiguous 1-D uint8 numpy buffer "
                             "(store.directio.alloc_aligned / alloc_slots make them)")
        if out.nbytes < entry.extent:
            raise ValueError(f"buffer of {out.nbytes} bytes is too small for {entry.where()}")
        address = out.ctypes.data
        if self.direct and address % ALIGN:
            raise ValueError(f"O_DIRECT reads need a {ALIGN}-byte aligned buffer (use store.directio.alloc_aligned)")
        return address

    # -- workers --------------------------------------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                task = self._heap[0][2]
                if task.taken:
                    heapq.heappop(self._heap)
                    continue                # a stale heap item left behind by a promotion, cancel or failure
                if task.parts is not None:
                    part = self._take_part(task)
                    if part is None:
                        continue
                else:
                    heapq.heappop(self._heap)
                    task.taken = True
                    self._unqueue(task)
                    self._began()
            if task.parts is not None:
                self._read_part(task, part)
                continue
            done = failed = None
            try:
                if not task.future.set_running_or_notify_cancel():
                    self._count("cancelled")
                    continue
                try:
                    done = self._read(task)
                except BaseException as exc:   # the caller gets every failure through its future
                    self._count("errors")
                    failed = exc
            finally:
                with self._cv:  # before the future resolves: whoever it wakes sees the read over
                    self._ended()
            if failed is not None:
                task.future.set_exception(failed)
            else:
                task.future.set_result(done)

    def _began(self) -> None:
        """A read or part starts (the caller holds the lock)."""
        if not self._active:
            self._busy_from = time.perf_counter()
        self._active += 1

    def _ended(self) -> None:
        """A read or part is over (the caller holds the lock)."""
        self._active -= 1
        if not self._active:
            self._busy += time.perf_counter() - self._busy_from

    def busy_seconds(self) -> float:
        """Wall seconds so far with at least one read under way (reads overlapping each other count once)."""
        with self._cv:
            return self._busy + (time.perf_counter() - self._busy_from if self._active else 0.0)

    def _unqueue(self, task: _Task) -> None:
        """Forget a task's key (the caller holds the lock), unless a newer read of the same key replaced it (a read
        asked again after its queued one was cancelled)."""
        if self._queued.get(task.key) is task:
            del self._queued[task.key]

    def _count(self, key: str, n: int = 1) -> None:
        with self._cv:
            self._stats[key] += n

    def _read(self, task: _Task, first: int = 1, problem: str = "", corrupt: bool = False,
              t0: float | None = None) -> ReadDone:
        """Read and check the whole record. A split read whose bytes failed the check comes back here as attempt 2,
        with the problem so far (and its start time)."""
        e = task.entry
        view = task.out[:e.extent]
        parts = len(self._split(e.extent) or ()) if self.native else 0
        t0 = time.perf_counter() if t0 is None else t0
        if parts > 1 and task.verify and self.part_hashes:
            return self._read_by_parts(task, view, parts, first, problem, corrupt, t0)

        def once(attempt: int) -> tuple[str, bool] | None:
            try:
                got = (pread_parts(self.fd, view, e.offset, parts) if parts > 1
                       else pread_into(self.fd, memoryview(view), e.offset))
            except OSError as exc:
                return _io_problem(exc)
            if got < e.extent:
                return _short(got, e)
            if task.verify and xxhash.xxh3_64_intdigest(memoryview(view)) != e.xxh3:
                return "the bytes fail the record's xxh3 check", True
            with self._cv:
                self._stats["reads"] += 1
                self._stats["bytes"] += got
            return None

        return self._attempts(e, view, first, problem, corrupt, t0, once)

    def _attempts(self, e: RecordEntry, view: np.ndarray, first: int, problem: str, corrupt: bool, t0: float,
                  once: Callable[[int], tuple[str, bool] | None]) -> ReadDone:
        """Run `once(attempt)` (None: read and checked; else (problem, corrupt)) until it succeeds or the retries
        are spent, then raise the last problem naming the record."""
        for attempt in range(first, self.retries + 2):
            if attempt > 1:
                self._count("retries")
                time.sleep(0.005 * attempt)
            failed = once(attempt)
            if failed is None:
                return ReadDone(e.layer, e.expert, view, attempt, time.perf_counter() - t0)
            problem, corrupt = failed
        raise self._error(e, problem, corrupt)

    def _read_by_parts(self, task: _Task, view: np.ndarray, parts: int, first: int, problem: str, corrupt: bool,
                       t0: float) -> ReadDone:
        """_read for native split reads with part hashes: a record read before is checked by its parts' hashes;
        a first read, or a retry, is checked whole, and its parts' hashes kept when it passes. Kept only from a read
        that had its buffer to itself from start to check: a second read into the same buffer (the reader runs one
        whenever asked while another is under way) could land the right bytes over wrong ones between the parts'
        hashing and the whole check."""
        e = task.entry
        key, address = (e.layer, e.expert), task.key[2]
        with self._cv:
            mine = self._into.setdefault(address, [0, 0])  # [reads into it now, reads into it ever]
            alone = mine[0] == 0
            mine[0] += 1
            mine[1] += 1
            epoch = mine[1]

        def once(attempt: int) -> tuple[str, bool] | None:
            hashes = np.zeros(parts, np.uint64)
            try:
                got, used = pread_parts(self.fd, view, e.offset, parts, hashes)
            except OSError as exc:
                return _io_problem(exc)
            if got < e.extent:
                return _short(got, e)
            # Only a read that never failed a check trusts the parts: a retry is checked whole.
            known = self._parts_known.get(key) if attempt == 1 and used == parts else None
            if known is not None:
                if hashes.tobytes() != known:
                    return "the bytes fail the record's xxh3 check (by parts)", True
            elif xxhash.xxh3_64_intdigest(memoryview(view)) != e.xxh3:
                return "the bytes fail the record's xxh3 check", True
            with self._cv:
                if known is None and used == parts and alone and self._into[address][1] == epoch:
                    self._parts_known[key] = hashes.tobytes()  # the checked bytes are the ones the parts' hashes saw
                self._stats["reads"] += 1
                self._stats["bytes"] += got
                self._stats["checked_by_parts"] += known is not None
            return None

        try:
            return self._attempts(e, view, first, problem, corrupt, t0, once)
        finally:
            with self._cv:
                mine[0] -= 1
                if mine[0] == 0 and self._into.get(address) is mine:
                    del self._into[address]

    def _error(self, e: RecordEntry, problem: str, corrupt: bool) -> Exception:
        cls = StoreCorruptError if corrupt else StoreReadError
        return cls(f"store {self.path}: {e.where()}: {problem}, after {self.retries + 1} attempts",
                   f"run glm53 verify-store {self.path}; if it fails (or the disk reports errors in dmesg), "
                   f"repack: {pack_command(self.path, self.header.source_hint)}")

    # -- split reads ----------------------------------------------------------------------------------------
    def _take_part(self, task: _Task) -> int | None:
        """Hand out the next part of the task at the heap head (the caller holds the lock). The future turns
        running under the lock, with the first part: no other thread may write into a cancelled read's buffer."""
        part = task.next
        task.next += 1
        if task.next == len(task.parts):
            heapq.heappop(self._heap)
            task.taken = True
            self._unqueue(task)
        if part == 0:
            if not task.future.set_running_or_notify_cancel():
                task.taken = True           # its other parts, if any are left, become stale heap items
                self._unqueue(task)
                self._stats["cancelled"] += 1
                return None
            task.t0 = time.perf_counter()
        task.running += 1
        self._began()
        if not task.taken:
            self._cv.notify()               # more parts of it wait: another idle thread takes the next
        return part

    def _read_part(self, task: _Task, part: int) -> None:
        """Read one part with today's retries; the thread that lands the last part checks and resolves the record,
        and a failed record is resolved by the last of its parts to stop."""
        try:
            self._read_part_inner(task, part)
        finally:
            with self._cv:
                task.running -= 1
                self._ended()
                fail = task.failed and task.running == 0 and task.error is not None
                error, task.error = (task.error, None) if fail else (None, task.error)
            if error is not None:
                task.future.set_exception(error)

    def _read_part_inner(self, task: _Task, part: int) -> None:
        e = task.entry
        start, n = task.parts[part]
        try:
            view = memoryview(task.out[start:start + n])
            problem = ""
            for attempt in range(1, self.retries + 2):
                if task.failed:
                    return                  # another part gave up: the future already holds the error
                if attempt > 1:
                    self._count("retries")
                    time.sleep(0.005 * attempt)
                try:
                    got = pread_into(self.fd, view, e.offset + start)
                except OSError as exc:
                    problem = f"I/O error: {exc.strerror or exc}"
                    continue
                if got < n:
                    problem = (f"short read ({got} of {n} bytes at +{start} of {e.extent}; "
                               "the file may be truncated)")
                    continue
                break
            else:
                raise self._error(e, problem, False)
            with self._cv:
                task.attempts = max(task.attempts, attempt)
                task.left -= 1
                if task.left:
                    return
            record = task.out[:e.extent]
            if task.verify and xxhash.xxh3_64_intdigest(memoryview(record)) != e.xxh3:
                done = self._read(task, 2, "the bytes fail the record's xxh3 check", True, task.t0)
            else:
                with self._cv:
                    self._stats["reads"] += 1
                    self._stats["bytes"] += e.extent
                done = ReadDone(e.layer, e.expert, record, task.attempts, time.perf_counter() - task.t0)
            task.future.set_result(done)
        except BaseException as exc:       # the caller gets every failure through its future, once
            with self._cv:
                if task.failed:
                    return
                task.failed = task.taken = True     # no further part is handed out
                task.error = exc                    # resolved by the last running part (_read_part)
                self._unqueue(task)                 # once all parts are out, the key may name a newer read
                self._stats["errors"] += 1

    def stats(self) -> dict:
        with self._cv:
            return dict(self._stats, queued=len(self._queued))

    # -- lifetime -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel queued reads, let running ones finish, close the file."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for task in self._queued.values():
                if task.next:
                    continue                # a split read under way: its future resolves once its parts are read
                task.taken = True
                if task.future.cancelled() or task.future.cancel():  # cancelled by the caller, or now
                    self._stats["cancelled"] += 1
            self._queued.clear()
            self._heap = [item for item in self._heap if not item[2].taken]
            heapq.heapify(self._heap)
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        os.close(self.fd)

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
