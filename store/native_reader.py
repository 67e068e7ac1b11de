"""A store reader whose reads never land on a Python thread: NativeStoreReader, StoreReader's interface.

StoreReader's reader threads take the GIL for every read that lands (its bookkeeping, resolving its future), and
on a busy host each of those hand-offs can hold up the engine's main thread, which plans every decode step while
the GPU waits. Here a read is queued, taken, read (in parts on glm53's native pool, each part hashed by the thread
that read it), hashed whole when it is a record's first read, and marked finished by native threads
(glm53/cpu_lane/read_queue.cpp). Python submits, polls a task's state from a numpy view, or waits in native code
with the GIL released; the checks (short read, I/O error, xxh3 whole or by parts) and retries run on whichever
Python thread first looks at a finished read, through its future's done() / result() / exception() / cancel().

    reader = NativeStoreReader(path, threads=4, verify=True, pieces=4)
    fut = reader.read(3, 17, arena[0], priority=Priority.DEMAND)
    views = reader.views(3, fut.result().data)
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import weakref
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np
import xxhash

from store.directio import open_for_read
from store.format import ALIGN, RecordEntry, StoreHeader
from store.reader import MIN_PIECE, Priority, ReadDone, StoreReader, _io_problem, _part_hash, _short, log

# A task's fields (read_queue.cpp's enum), then one uint64 per part for the parts' hashes.
(STATE, FD, BUF, LEN, OFF, PARTS, ALIGN_AT, HASH, WANT_WHOLE, DELAY_NS, LEVEL, RESULT, ERRNO, USED, WHOLE, T_START,
 T_END, FIELDS) = range(18)
IDLE, QUEUED, RUNNING, DONE, CANCELLED = range(5)
RETRY_DELAY_NS = 5_000_000  # times the attempt number, as StoreReader sleeps before a retry

_LIB: list = []  # [(held, released) ctypes handles, or None], bound once
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


def queue_library():
    """(held, released): glm53's library bound twice, its non-blocking queue calls keeping the GIL (a submit or a
    cancel then costs no GIL hand-off) and its blocking ones (wait, close) releasing it; None where glm53's library
    is not built or predates the read queue."""
    if not _LIB:
        try:
            from glm53.cpu_lane import kernel
        except ImportError:
            kernel = None
        lib = getattr(kernel, "_LIB", None)
        if lib is None or getattr(lib, "glm53_rq_new", None) is None:
            _LIB.append(None)
        else:
            held = ctypes.PyDLL(lib._name)
            vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
            for handle, name, res, args in (
                (held, "glm53_rq_new", vp, [i32]), (held, "glm53_rq_submit", i32, [vp, vp]),
                (held, "glm53_rq_cancel", i32, [vp, vp]), (held, "glm53_rq_promote", i32, [vp, vp]),
                (held, "glm53_rq_busy", ctypes.c_double, [vp]), (held, "glm53_rq_queued", i64, [vp]),
                (held, "glm53_rq_state", i64, [vp]), (held, "glm53_rq_set_prefetch_cap", i32, [vp, i32]),
                (lib, "glm53_rq_wait", i64, [vp, vp, i64]), (lib, "glm53_rq_close", i64, [vp]),
                (lib, "glm53_rq_free", None, [vp]),
            ):
                fn = getattr(handle, name)
                fn.restype, fn.argtypes = res, args
            _LIB.append((held, lib))
    return _LIB[0]


class NativeRead:
    """The future of one NativeStoreReader read: concurrent.futures.Future's done / result / exception / cancel /
    cancelled / running, as far as NvmeTier uses them. The task array lives here, and the reader keeps this object
    until the native side is done with it."""

    __slots__ = ("reader", "entry", "out", "verify", "key", "task", "at", "attempt", "known", "alone", "epoch",
                 "final", "value", "error", "was_cancelled", "last_problem")

    def __init__(self, reader: NativeStoreReader, entry: RecordEntry, out: np.ndarray, verify: bool, level: int,
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


class NativeStoreReader:
    """StoreReader's interface and semantics (priorities, promotion, cancellation of queued reads, retries, errors,
    checks whole or by parts) with the reads served by native threads; see the module doc."""

    # Geometry and buffer checks are StoreReader's own: they only read the header and these attributes.
    max_extent = StoreReader.max_extent
    extent, layout, views, keys = StoreReader.extent, StoreReader.layout, StoreReader.views, StoreReader.keys
    _setup, _split, _check_buffer = StoreReader._setup, StoreReader._split, StoreReader._check_buffer

    def __init__(self, path: str | Path, *, threads: int = 4, allow_buffered: bool = False, verify: bool = False,
                 retries: int = 2, header: StoreHeader | None = None, warn=None, pieces: int = 1,
                 min_piece: int = MIN_PIECE, native: bool = True, part_hashes: bool = True,
                 prefetch_at_once: int | None = None):
        """StoreReader's options; `native` is accepted for the same call and ignored (reads here are always
        native). prefetch_at_once: at most that many prefetch reads under way at once (None: as many as there are
        threads); demand reads are never held back. Raises RuntimeError where glm53's library is not built with
        the read queue."""
        bound = queue_library()
        if bound is None:
            raise RuntimeError("the native store reader needs glm53's compiled library with its read queue "
                               "(pip install -e . rebuilds it)")
        self._held, released = bound
        self._setup(path, header, verify, retries, pieces, min_piece)
        self.native = True
        self.hash = _part_hash()  # 0: every record is checked whole in Python after its read
        self.part_hashes = part_hashes and self.hash != 0
        self._parts_known: dict[tuple[int, int], bytes] = {}  # as StoreReader's
        self._into: dict[int, list[int]] = {}  # buffer address -> [live reads into it, reads into it since]
        self.fd, self.direct = open_for_read(self.path, allow_buffered, warn or log.warning)
        self.threads = max(1, threads)  # native worker threads reading
        self._q = self._held.glm53_rq_new(self.threads)
        if not self._q:
            os.close(self.fd)
            raise RuntimeError("the native store reader could not start a single thread")
        self._wait_native, self._close_native = released.glm53_rq_wait, released.glm53_rq_close
        self.prefetch_at_once = self.threads if prefetch_at_once is None else max(1, min(self.threads,
                                                                                         int(prefetch_at_once)))
        self._held.glm53_rq_set_prefetch_cap(self._q, self.prefetch_at_once)
        # Freed only once neither the reader nor any of its futures is left: a future may still wait on the queue.
        # Never at exit (atexit=False): the exit hook closes instead, and the queue stays valid for later callers.
        self._finalizer = weakref.finalize(self, released.glm53_rq_free, self._q)
        self._finalizer.atexit = False
        self._lock = threading.Lock()
        self._live: dict[int, NativeRead] = {}  # id -> read the native side may still touch, or not yet looked at
        self._queued: dict[tuple[int, int, int], NativeRead] = {}  # (layer, expert, address): the latest read
        self._submitted = 0
        self._closed = False
        self.typical_read_s: float | None = None  # a read's time under way lately (first attempts that passed)
        self._stats = {"reads": 0, "bytes": 0, "retries": 0, "errors": 0, "cancelled": 0, "checked_by_parts": 0}
        _READERS.add(self)

    # -- requests -------------------------------------------------------------------------------------------
    def read(self, layer: int, expert: int, out: np.ndarray, *, priority: Priority = Priority.DEMAND,
             verify: bool | None = None) -> NativeRead:
        return self.read_many([(layer, expert, out)], priority=priority, verify=verify)[0]

    def read_many(self, requests, *, priority: Priority = Priority.PREFETCH,
                  verify: bool | None = None) -> list[NativeRead]:
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
                known = self._parts_known.get((entry.layer, entry.expert)) if parts > 1 and self.part_hashes and verify else None
                fut = NativeRead(self, entry, out, verify, level, key, parts, known)
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
        a read under way (or finished, not yet looked at) is marked so that a retry of it queues as demand
        (StoreReader retries at once on the same thread: a step must not wait behind guesses for a retry)."""
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
    def _look(self, fut: NativeRead) -> bool:
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
                    self._stats["errors"] += 1                         # it was retrying, as StoreReader raises it
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

    def _check(self, fut: NativeRead) -> tuple[str, bool] | None:
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
                if (t[HASH] and self.part_hashes and parts > 1 and used == parts and fut.alone
                        and self._into[fut.key[2]][1] == fut.epoch):
                    self._parts_known[(e.layer, e.expert)] = hashes
        self._stats["reads"] += 1
        self._stats["bytes"] += got
        self._stats["checked_by_parts"] += by_parts
        return None

    def _retry(self, fut: NativeRead, failed: tuple[str, bool]) -> bool:
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

    def _resolve(self, fut: NativeRead) -> None:
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

    def _cancel(self, fut: NativeRead) -> bool:
        if fut.done():
            return fut.was_cancelled
        with self._lock:
            if fut.final or fut.attempt > 1 or not self._held.glm53_rq_cancel(self._q, fut.at):
                return fut.final and fut.was_cancelled
            fut.was_cancelled = True
            self._stats["cancelled"] += 1
            self._resolve(fut)
            return True

    def _wait(self, fut: NativeRead, timeout_ns: int) -> None:
        self._wait_native(self._q, fut.at, timeout_ns)

    def _error(self, e: RecordEntry, problem: str, corrupt: bool, *, attempts: int) -> Exception:
        exc = StoreReader._error(self, e, problem, corrupt)
        if attempts != self.retries + 1:  # cut short by close(): say how many were made
            exc.problem = exc.problem.replace(f"after {self.retries + 1} attempts", f"after {attempts} attempts")
            exc.args = (exc.problem + (f"\n  fix: {exc.fix}" if exc.fix else ""),)
        return exc

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

    def __enter__(self) -> NativeStoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
