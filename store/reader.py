"""The engine's store reader: O_DIRECT reads of (layer, expert) records into caller-provided aligned buffers.

Two priorities: demand reads (a token is waiting) before prefetch reads (a guess), first come first served within
each; re-asking for a queued prefetch as a demand promotes it, and cancelling a read still queued drops it. A read
never lands on a Python thread: it is queued, taken, read (in parallel parts on the store library's pool, each
part hashed by the thread that read it), hashed whole when it is a record's first read, and marked finished by
native threads (store/csrc/read_queue.cpp). A Python thread that lands reads takes the GIL for each one, and on a
busy host each such hand-off can hold up the engine's main thread, which plans every decode step while the GPU
waits. Python submits, polls a task's state from a numpy view, or waits in native code with the GIL released; the
checks (short read, I/O error, xxh3 whole or by parts) and retries run on whichever Python thread first looks at a
finished read, through its future's done() / result() / exception() / cancel().

    reader = StoreReader(path, threads=4, allow_buffered=settings.allow_buffered_reads, verify=True, pieces=4)
    arena = alloc_slots(64, reader.max_extent)              # pin it with cudaHostRegister if you like
    fut = reader.read(3, 17, arena[0], priority=Priority.DEMAND)
    views = reader.views(3, fut.result().data)              # views.gate.trellis, views.down.svh, ...
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np
import xxhash

from store import native
from store.directio import open_for_read
from store.errors import StoreCorruptError, StoreReadError
from store.format import ALIGN, DTYPES, PROJECTIONS, Layout, RecordEntry, StoreHeader, align_up, read_header
from store.verify import pack_command

log = logging.getLogger("glm53.store")

# A task's fields (read_queue.cpp's enum), then one uint64 per part for the parts' hashes.
(STATE, FD, BUF, LEN, OFF, PARTS, ALIGN_AT, HASH, WANT_WHOLE, DELAY_NS, LEVEL, RESULT, ERRNO, USED, WHOLE, T_START,
 T_END, FIELDS) = range(18)
IDLE, QUEUED, RUNNING, DONE, CANCELLED = range(5)

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


def _io_problem(exc: OSError) -> tuple[str, bool]:
    return f"I/O error: {exc.strerror or exc}", False


def _short(got: int, e: RecordEntry) -> tuple[str, bool]:
    return f"short read ({got} of {e.extent} bytes; the file may be truncated)", False


RETRY_DELAY_NS = 5_000_000  # times the attempt number: a retry waits a little longer each time

_READERS: weakref.WeakSet = weakref.WeakSet()  # the live readers, for the fork and exit hooks below


def _close_all_at_exit() -> None:
    """At interpreter exit, close (join the workers of) every live reader, but never free a queue: an exit hook that
    runs later, or a daemon thread, may still call a reader, and a closed queue answers it."""
    for reader in list(_READERS):
        reader.close()


def _forget_all_in_child() -> None:
    """A child of fork() has the readers but not their worker threads: they answer as closed there."""
    for reader in list(_READERS):
        reader._forked()


atexit.register(_close_all_at_exit)
os.register_at_fork(after_in_child=_forget_all_in_child)


class ReadFuture:
    """The future of one StoreReader read: concurrent.futures.Future's done / result / exception / cancel /
    cancelled / running, as far as NvmeTier uses them. The task array lives here, and the reader keeps this object
    until the native side is done with it."""

    __slots__ = ("reader", "entry", "out", "verify", "key", "task", "at", "attempt", "known", "alone", "epoch",
                 "final", "value", "error", "was_cancelled", "last_problem")

    def __init__(self, reader: StoreReader, entry: RecordEntry, out: np.ndarray, verify: bool, level: int,
                 key: tuple[int, int, int], parts: int, known: bytes | None):
        self.reader, self.entry, self.out, self.verify, self.key = reader, entry, out, verify, key
        t = self.task = np.zeros(FIELDS + parts, np.int64)
        self.at = t.ctypes.data  # the task's address, looked up once (each lookup costs about a microsecond)
        t[FD], t[BUF], t[LEN], t[OFF], t[PARTS], t[ALIGN_AT], t[LEVEL] = (
            reader.fd, key[2], entry.extent, entry.offset, parts, ALIGN, level)
        if verify and reader.hash:
            t[HASH] = reader.hash
            t[WANT_WHOLE] = known is None
        self.attempt, self.known, self.alone, self.epoch = 1, known, True, 0
        self.final = self.was_cancelled = False
        self.value: ReadDone | None = None
        self.error: BaseException | None = None
        self.last_problem: tuple[str, bool] | None = None  # what the attempt before a queued retry found

    def done(self) -> bool:
        return self.final or self.reader._look(self)

    def running(self) -> bool:
        return not self.done() and (self.attempt > 1 or int(self.task[STATE]) == RUNNING)

    def share_done(self) -> float:
        """About how much of the read is done, 0..1: 0 while queued, 1 once finished, and while under way the time
        since it started over the reader's typical read (0.5 before any read has been timed)."""
        state = int(self.task[STATE])
        if self.final or state in (DONE, CANCELLED):
            return 1.0
        if state != RUNNING or self.attempt > 1 or int(self.task[T_START]) == 0:
            return 0.0  # queued; or a retry, which reads the record anew (its T_START is the first attempt's)
        typical = self.reader.typical_read_s
        if typical is None:
            return 0.5
        return min(1.0, (time.monotonic_ns() - int(self.task[T_START])) * 1e-9 / typical)

    def cancelled(self) -> bool:
        return self.done() and self.was_cancelled

    def cancel(self) -> bool:
        """Drop the read if it still waits in the queue (a retry waiting there counts as under way)."""
        return self.reader._cancel(self)

    def result(self, timeout: float | None = None) -> ReadDone:
        self._wait(timeout)
        if self.error is not None:
            raise self.error
        return self.value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self.error

    def _wait(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            left = -1 if deadline is None else int((deadline - time.monotonic()) * 1e9)
            if deadline is not None and left <= 0:
                raise FutureTimeout()
            self.reader._wait(self, left)
        if self.was_cancelled:
            raise CancelledError()


class StoreReader:
    """A store's records read by native threads, checked and retried here; see the module doc."""

    def __init__(self, path: str | Path, *, threads: int = 4, allow_buffered: bool = False, verify: bool = False,
                 retries: int = 2, header: StoreHeader | None = None, warn=None, pieces: int = 1,
                 min_piece: int = MIN_PIECE, prefetch_at_once: int | None = None):
        """Open a store for reading. Raises StoreFormatError for a bad header, DirectIOUnsupported when the
        filesystem refuses O_DIRECT and allow_buffered is False (pass settings.allow_buffered_reads), and
        NativeUnavailable (naming the rebuild command) where the store's native library is not built.

        pieces: read each record as up to this many equal 4 KiB-aligned parts (none smaller than min_piece), read
        at once: a lone large pread on a virtual disk can run far below the disk's aggregate rate, and a step that
        waits on one record waits on that lone read. prefetch_at_once: at most that many prefetch reads under way
        at once (None: as many as there are threads; nvme_open.calibrate_prefetch times it on the store); demand
        reads are never held back."""
        self._held, released = native.queue_calls()
        self.path = Path(path)
        self.header = header or read_header(self.path)
        self.verify = verify
        self.retries = max(0, retries)
        self.pieces = max(1, pieces)
        self.min_piece = align_up(max(1, min_piece))
        self.hash = native.xxh3_address()  # 0: every record is checked whole in Python after its read
        # A record's part hashes, kept from its first read that passed the whole-record xxh3: a later read of it
        # is checked part by part, each hashed on the native thread that read it (parallel, and in cache), and
        # one that fails is read again and checked whole. {(layer, expert): the uint64 hashes as bytes}.
        self._parts_known: dict[tuple[int, int], bytes] = {}
        self._into: dict[int, list[int]] = {}  # buffer address -> [live reads into it, reads into it since]
        self.fd, self.direct = open_for_read(self.path, allow_buffered, warn or log.warning)
        self.threads = max(1, threads)  # native worker threads reading
        self._q = self._held.glm53_rq_new(self.threads)
        if not self._q:
            os.close(self.fd)
            raise RuntimeError("the store reader could not start a single thread")
        self._wait_native, self._close_native = released.glm53_rq_wait, released.glm53_rq_close
        self.prefetch_at_once = self.threads if prefetch_at_once is None else max(1, min(self.threads,
                                                                                         int(prefetch_at_once)))
        self._held.glm53_rq_set_prefetch_cap(self._q, self.prefetch_at_once)
        # Freed only once neither the reader nor any of its futures is left: a future may still wait on the queue.
        # Never at exit (atexit=False): the exit hook closes instead, and the queue stays valid for later callers.
        self._finalizer = weakref.finalize(self, released.glm53_rq_free, self._q)
        self._finalizer.atexit = False
        self._lock = threading.Lock()
        self._live: dict[int, ReadFuture] = {}  # id -> read the native side may still touch, or not yet looked at
        self._queued: dict[tuple[int, int, int], ReadFuture] = {}  # (layer, expert, address): the latest read
        self._submitted = 0
        self._closed = False
        self.typical_read_s: float | None = None  # a read's time under way lately (first attempts that passed)
        self._stats = {"reads": 0, "bytes": 0, "retries": 0, "errors": 0, "cancelled": 0, "checked_by_parts": 0}
        _READERS.add(self)

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

    # -- requests -------------------------------------------------------------------------------------------
    def read(self, layer: int, expert: int, out: np.ndarray, *, priority: Priority = Priority.DEMAND,
             verify: bool | None = None) -> ReadFuture:
        return self.read_many([(layer, expert, out)], priority=priority, verify=verify)[0]

    def read_many(self, requests, *, priority: Priority = Priority.PREFETCH,
                  verify: bool | None = None) -> list[ReadFuture]:
        """Queue a batch of (layer, expert, out); one future per request, in order. A read of the same record into
        the same buffer still queued is not read twice: its future comes back (promoted, when asked as demand)."""
        prepared = []
        for layer, expert, out in requests:
            entry = self.header.entry(layer, expert)
            prepared.append((entry, out, self._check_buffer(out, entry)))
        level = 0 if int(priority) <= Priority.DEMAND else 1
        verify = self.verify if verify is None else verify
        futures = []
        with self._lock:
            if self._closed:
                raise RuntimeError(f"store reader for {self.path} is closed")
            for entry, out, address in prepared:
                key = (entry.layer, entry.expert, address)
                fut = self._queued.get(key)
                if fut is not None and not fut.final and fut.attempt == 1 and int(fut.task[STATE]) == QUEUED:
                    if level == 0:
                        self._held.glm53_rq_promote(self._q, fut.at)
                    futures.append(fut)
                    continue
                parts = len(self._split(entry.extent) or ()) or 1
                known = self._parts_known.get((entry.layer, entry.expert)) if parts > 1 and self.hash and verify else None
                fut = ReadFuture(self, entry, out, verify, level, key, parts, known)
                mine = self._into.setdefault(address, [0, 0])
                fut.alone = mine[0] == 0
                mine[0] += 1
                mine[1] += 1
                fut.epoch = mine[1]
                self._live[id(fut)] = fut
                self._queued[key] = fut
                if self._held.glm53_rq_submit(self._q, fut.at) != 0:  # open (close() takes the lock
                    self._resolve(fut)                                              # first): out of memory
                    raise MemoryError(f"store reader for {self.path}: no memory to queue {entry.where()}")
                futures.append(fut)
            self._submitted += len(prepared)
            sweep = self._submitted % 256 < len(prepared)
        if sweep:  # reads nobody looks at again (a dropped future): their checks, and memory, are settled here
            for fut in list(self._live.values()):
                fut.done()
        return futures

    def promote(self, layer: int, expert: int, out: np.ndarray) -> bool:
        """A queued read of (layer, expert) into `out` goes ahead of every prefetch; never starts a read. False when
        no such read waits in the queue. A retry waiting in the queue is promoted too: a step may wait for it; and
        a read under way (or finished, not yet looked at) is marked so that a retry of it queues as demand (a step
        must not wait behind guesses for a retry)."""
        with self._lock:
            fut = self._queued.get((layer, expert, out.ctypes.data))
            if fut is None or fut.final:
                return False
            if self._held.glm53_rq_promote(self._q, fut.at):
                return True
            if int(self._held.glm53_rq_state(fut.at)) in (RUNNING, DONE):
                fut.task[LEVEL] = 0  # read only when the task is submitted again, always under this lock
            return False

    # -- looking at a read ----------------------------------------------------------------------------------
    def _look(self, fut: ReadFuture) -> bool:
        """Whether the read is resolved: a read the native side finished is checked here, once, and sent back to
        the queue when it failed with retries left."""
        if int(fut.task[STATE]) < DONE:  # no lock for a read still under way: polled many times a step
            return False
        with self._lock:
            if fut.final:
                return True
            state = self._held.glm53_rq_state(fut.at)
            if state == CANCELLED:
                if fut.attempt > 1 and fut.last_problem is not None:  # a retry cut short by close(): the failure
                    self._stats["errors"] += 1                         # it was retrying is what it raises
                    self._stats["cancelled"] -= 1  # close() counted it cancelled: one read, counted once
                    fut.error = self._error(fut.entry, *fut.last_problem, attempts=fut.attempt - 1)
                else:
                    fut.was_cancelled = True
                self._resolve(fut)
                return True
            if state != DONE:
                return False
            failed = self._check(fut)
            if failed is None:
                e, t = fut.entry, fut.task
                fut.value = ReadDone(e.layer, e.expert, fut.out[:e.extent], fut.attempt,
                                     float(t[T_END] - t[T_START]) * 1e-9)
                if fut.attempt == 1:
                    took, typical = fut.value.seconds, self.typical_read_s
                    self.typical_read_s = took if typical is None else 0.9 * typical + 0.1 * took
            elif fut.attempt <= self.retries and self._retry(fut, failed):
                return False
            else:
                self._stats["errors"] += 1
                fut.error = self._error(fut.entry, *failed, attempts=fut.attempt)
            self._resolve(fut)
            return True

    def _check(self, fut: ReadFuture) -> tuple[str, bool] | None:
        """None when the finished read is whole and passes its check; else (problem, corrupt). Under the lock."""
        e, t = fut.entry, fut.task
        got = int(t[RESULT])
        if got < 0:
            return _io_problem(OSError(int(t[ERRNO]), os.strerror(int(t[ERRNO]))))
        if got < e.extent:
            return _short(got, e)
        by_parts = False
        if fut.verify:
            parts, used = int(t[PARTS]), int(t[USED])
            hashes = t[FIELDS:FIELDS + parts].tobytes()
            if fut.known is not None and fut.attempt == 1 and used == parts:
                if hashes != fut.known:
                    return "the bytes fail the record's xxh3 check (by parts)", True
                by_parts = True
            else:
                whole = (int(t.view(np.uint64)[WHOLE]) if t[HASH] and t[WANT_WHOLE]
                         else xxhash.xxh3_64_intdigest(memoryview(fut.out[:e.extent])))
                if whole != e.xxh3:
                    return "the bytes fail the record's xxh3 check", True
                # Kept only from a read that had its buffer to itself from submit to check: a second read into
                # it could land the right bytes over wrong ones between the parts' hashing and the whole hash.
                if (t[HASH] and parts > 1 and used == parts and fut.alone
                        and self._into[fut.key[2]][1] == fut.epoch):
                    self._parts_known[(e.layer, e.expert)] = hashes
        self._stats["reads"] += 1
        self._stats["bytes"] += got
        self._stats["checked_by_parts"] += by_parts
        return None

    def _retry(self, fut: ReadFuture, failed: tuple[str, bool]) -> bool:
        """Queue the read again, checked whole, after a short native delay; False once the reader is closed."""
        t = fut.task
        fut.last_problem = failed
        fut.attempt += 1
        t[DELAY_NS] = RETRY_DELAY_NS * fut.attempt
        t[WANT_WHOLE] = 1
        if self._closed or self._held.glm53_rq_submit(self._q, fut.at) != 0:
            fut.attempt -= 1  # not tried again: the error names the attempts made
            return False
        self._stats["retries"] += 1
        return True

    def _resolve(self, fut: ReadFuture) -> None:
        """The native side is done with the read and its result is set (under the lock)."""
        fut.final = True
        self._live.pop(id(fut), None)
        if self._queued.get(fut.key) is fut:
            del self._queued[fut.key]
        mine = self._into.get(fut.key[2])
        if mine is not None:
            mine[0] -= 1
            if mine[0] == 0:
                del self._into[fut.key[2]]

    def _cancel(self, fut: ReadFuture) -> bool:
        if fut.done():
            return fut.was_cancelled
        with self._lock:
            if fut.final or fut.attempt > 1 or not self._held.glm53_rq_cancel(self._q, fut.at):
                return fut.final and fut.was_cancelled
            fut.was_cancelled = True
            self._stats["cancelled"] += 1
            self._resolve(fut)
            return True

    def _wait(self, fut: ReadFuture, timeout_ns: int) -> None:
        self._wait_native(self._q, fut.at, timeout_ns)

    def _error(self, e: RecordEntry, problem: str, corrupt: bool, *, attempts: int) -> Exception:
        cls = StoreCorruptError if corrupt else StoreReadError
        return cls(f"store {self.path}: {e.where()}: {problem}, after {attempts} attempts",
                   f"run glm53 verify-store {self.path}; if it fails (or the disk reports errors in dmesg), "
                   f"repack: {pack_command(self.path, self.header.source_hint)}")

    # -- state ----------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats, queued=int(self._held.glm53_rq_queued(self._q)),
                        prefetch_at_once=self.prefetch_at_once)

    def busy_seconds(self) -> float:
        """Wall seconds so far with at least one read under way (overlapping reads count once)."""
        return float(self._held.glm53_rq_busy(self._q))

    def close(self) -> None:
        """Cancel queued reads, let running ones finish, close the file."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        cancelled = self._close_native(self._q)  # GIL released: running reads finish
        with self._lock:
            self._stats["cancelled"] += cancelled
        os.close(self.fd)

    def _forked(self) -> None:
        """In a child of fork(): closed, its unfinished reads cancelled, its queue (the parent's) never freed here."""
        self._finalizer.detach()
        self._lock = threading.Lock()  # a parent thread may have held it at the fork
        self._closed = True
        for fut in list(self._live.values()):
            if not fut.final:
                fut.was_cancelled = True
                self._resolve(fut)

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
