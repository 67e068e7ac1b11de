"""`glm53 bench store`: store throughput as ratios to the same disk's raw O_DIRECT read rate, one run.

Raw rates come from plain O_DIRECT loops over the very store file (and dd iflag=direct where dd exists), with
the same record size and thread count as the code measured. Raw and reader passes are interleaved for
`rounds` rounds and the medians are compared: numbers from different runs drift too much to compare.
"""

from __future__ import annotations

import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from store.directio import alloc_aligned, alloc_slots, open_for_read, pread_into
from store.errors import StoreError
from store.format import read_header
from store.pack import PackOptions, pack_store
from store.reader import Priority, StoreReader
from store.synth import write_expert_checkpoint
from store.verify import full_verify

# GLM-5.3-Flash width: a record is 9 MiB of trellis + 36 KiB of scales at K=3.
REAL = {"hidden": 4096, "moe_intermediate": 2048, "k_bits": 3}
REAL_RECORD = 9 * 2**20 + 36 * 2**10
TARGET = 0.9


@dataclass
class BenchOptions:
    path: Path | None = None
    model: Path | None = None
    workdir: Path = Path("bench-store")
    gb: float = 2.0
    threads: int = 4
    rounds: int = 3
    keep: bool = False
    allow_buffered: bool = False


@dataclass
class BenchResult:
    header: str
    raw: dict[str, float] = field(default_factory=dict)          # name -> bytes/s
    rows: list[tuple[str, float, str, float]] = field(default_factory=list)   # (name, bytes/s, raw key, ratio)
    notes: list[str] = field(default_factory=list)

    def add(self, name: str, rate: float, raw_key: str, ratio: float | None = None) -> None:
        self.rows.append((name, rate, raw_key, rate / self.raw[raw_key] if ratio is None else ratio))

    def ratio(self, prefix: str) -> float:
        return next(r for n, _, _, r in self.rows if n.startswith(prefix))

    def render(self) -> str:
        lines = [self.header]
        for name, rate in self.raw.items():
            lines.append(f"  raw  {name:44} {rate / 1e9:7.2f} GB/s")
        for name, rate, key, r in self.rows:
            target = f"  (target >= {TARGET:.2f}: {'met' if r >= TARGET else 'MISSED'})" if "reader" in name else ""
            lines.append(f"  {name:49} {rate / 1e9:7.2f} GB/s  {r:5.2f} x raw {key}{target}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def drop_cache(path: Path) -> None:
    """Evict a file's clean pages so a pass reads the disk, not RAM (no root or drop_caches needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_sequential(path: Path, start: int, end: int, block: int) -> float:
    """One thread, O_DIRECT, consecutive blocks over [start, end): the disk's streaming rate."""
    fd, _ = open_for_read(path, allow_buffered=True)
    buf = alloc_aligned(block)
    t0, pos, total = time.perf_counter(), start, 0
    try:
        while pos < end:
            n = min(block, end - pos)
            total += pread_into(fd, memoryview(buf[:n]), pos)
            pos += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - t0)


def raw_random(path: Path, extents: list[tuple[int, int]], bufs) -> float:
    """One plain O_DIRECT preadv loop per buffer, sharing one list of records: the reader's ceiling.
    Threads, the fd and the buffers (faulted in by the caller, as the engine's pinned arena is) are all set
    up before the clock starts, as the reader's are."""
    fd, _ = open_for_read(path, allow_buffered=True)
    lock, it, total, go = threading.Lock(), iter(extents), [0], threading.Event()

    def work(buf) -> None:
        go.wait()
        while True:
            with lock:
                nxt = next(it, None)
            if nxt is None:
                return
            got = pread_into(fd, memoryview(buf[:nxt[1]]), nxt[0])
            with lock:
                total[0] += got

    workers = [threading.Thread(target=work, args=(b,), daemon=True) for b in bufs]
    try:
        for t in workers:
            t.start()
        time.sleep(0.01)                        # let every thread reach go.wait()
        t0 = time.perf_counter()
        go.set()
        for t in workers:
            t.join()
        return total[0] / (time.perf_counter() - t0)
    finally:
        go.set()
        os.close(fd)


def reader_random(reader: StoreReader, keys: list[tuple[int, int]], arena) -> float:
    """Records through the reader, one demand read in flight per arena row (refilled as each lands)."""
    depth = len(arena)
    free, inflight, total, todo = list(range(depth)), {}, 0, iter(keys)
    t0 = time.perf_counter()
    while True:
        while free:
            k = next(todo, None)
            if k is None:
                break
            slot = free.pop()
            inflight[reader.read(k[0], k[1], arena[slot], priority=Priority.DEMAND)] = slot
        if not inflight:
            break
        done = [f for f in inflight if f.done()] or [next(iter(inflight))]  # none landed: wait for the oldest
        for f in done:
            total += f.result().data.nbytes
            free.append(inflight.pop(f))
    return total / (time.perf_counter() - t0)


def paired_windows(store: Path, reader: StoreReader, threads: int, rounds: int, window: int, log):
    """Raw and reader passes over disjoint random windows of records, alternating which goes first, so that
    drift in the disk's speed (host caches, neighbours) hits both alike. Returns (raw rates, reader rates,
    per-pair ratios)."""
    head = reader.header
    raw, rdr, ratios = [], [], []
    # Raw gets as many concurrent reads as the reader keeps in flight (2 x threads): the stricter baseline.
    bufs = alloc_slots(2 * threads, head.max_extent)
    arena = alloc_slots(2 * threads, head.max_extent)
    bufs[:] = 1                     # fault the pages in now, not inside a timed pass
    arena[:] = 1
    for r in range(rounds):
        keys = sorted(head.index)
        random.shuffle(keys)
        chunks = [keys[i:i + window] for i in range(0, len(keys) - window + 1, window)]
        for j in range(0, len(chunks) - 1, 2):
            a, b = chunks[j], chunks[j + 1]
            ext = [(head.index[k].offset, head.index[k].extent) for k in a]
            if j // 2 % 2 == 0:
                x = raw_random(store, ext, bufs)
                y = reader_random(reader, b, arena)
            else:
                y = reader_random(reader, a, arena)
                x = raw_random(store, [(head.index[k].offset, head.index[k].extent) for k in b], bufs)
            raw.append(x)
            rdr.append(y)
            ratios.append(y / x)
        log(f"bench store: round {r + 1}: raw random {statistics.median(raw) / 1e9:.2f}, reader "
            f"{statistics.median(rdr) / 1e9:.2f} GB/s, ratio {statistics.median(ratios):.2f} (medians so far)")
    return raw, rdr, ratios


def _step_like(table: np.ndarray, ids: list[int]) -> None:
    """Python bookkeeping with short GIL-releasing calls in between, as the engine's main thread does while it
    plans a MoE layer step (there: torch and CUDA calls; here: numpy's take)."""
    counts: dict[int, int] = {}
    for i in range(40):
        table.take(ids)
        counts[i % 7] = counts.get(i % 7, 0) + 1


def main_thread_stall(store: Path, head, threads: int, log, steps: int = 300, rounds: int = 2) -> dict[str, float]:
    """How much longer a main thread's step-like work takes (mean, over idle) while the reader reads records at a
    decode-like pace (3 at a time, then 1.5 ms of nothing), per way of reading a record. Reader threads take the
    GIL back after each pread; each time, the main thread may wait for their bookkeeping. Idle and busy passes
    alternate, `rounds` times; the ratios are of the summed means."""
    ways = {"whole records": {"pieces": 1}, "4 parts in native code": {"pieces": 4}}
    keys = sorted(head.index)
    table, ids = np.arange(4096), [1, 5, 9, 33]
    arena = alloc_slots(3, head.max_extent)
    arena[:] = 1

    def mean_step() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            _step_like(table, ids)
        return (time.perf_counter() - t0) / steps

    idle, busy = 0.0, dict.fromkeys(ways, 0.0)
    for _ in range(rounds):
        for name, kw in ways.items():
            idle += mean_step() / len(ways)
            with StoreReader(store, threads=threads, header=head, verify=True, **kw) as reader:
                stop = threading.Event()

                def feed(reader=reader, stop=stop) -> None:
                    i = 0
                    while not stop.is_set():
                        futs = [reader.read(*keys[(i + j) % len(keys)], arena[j], priority=Priority.PREFETCH)
                                for j in range(3)]
                        for f in futs:
                            f.result()
                        i += 3
                        time.sleep(0.0015)

                feeder = threading.Thread(target=feed, daemon=True)
                feeder.start()
                try:
                    busy[name] += mean_step()
                finally:
                    stop.set()
                    feeder.join()
    out = {name: b / idle for name, b in busy.items()}
    log("bench store: the main thread's step-like work while records are read, x idle: "
        + ", ".join(f"{name} {r:.2f}" for name, r in out.items()))
    return out


def dd_direct(path: Path, block_mib: int = 9) -> float | None:
    dd = shutil.which("dd")
    if dd is None:
        return None
    t0 = time.perf_counter()
    proc = subprocess.run([dd, f"if={path}", "of=/dev/null", f"bs={block_mib}M", "iflag=direct"],
                          capture_output=True, text=True)
    dt = time.perf_counter() - t0
    m = re.search(r"^(\d+) bytes", proc.stderr, re.M)
    return int(m.group(1)) / dt if proc.returncode == 0 and m else None


@contextmanager
def scratch(workdir: Path, keep: bool) -> Iterator[list[Path]]:
    """A list a benchmark appends the files and folders it makes to; they are removed afterwards unless `keep`."""
    workdir.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    try:
        yield made
    finally:
        if not keep:
            for p in made:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def run_bench(opts: BenchOptions, log=print) -> BenchResult:
    with scratch(opts.workdir, opts.keep) as made:
        return _run(opts, log, made)


def _run(opts: BenchOptions, log, made: list[Path]) -> BenchResult:
    pack_rate = None
    store = opts.path
    if store is None or opts.model is not None:
        model = opts.model
        if model is None:
            model = opts.workdir / "synthetic-checkpoint"
            n = max(16, int(opts.gb * 1e9 / REAL_RECORD))
            layers = -(-n // 288)
            per_layer = -(-n // layers)
            log(f"bench store: writing a synthetic checkpoint ({layers} x {per_layer} experts of 9 MiB) in {model}")
            shutil.rmtree(model, ignore_errors=True)
            made.append(model)
            write_expert_checkpoint(model, layers=1 + layers, dense_layers=1, experts=per_layer, mtp_layers=0,
                                    **REAL)
        for f in model.glob("*.safetensors"):
            drop_cache(f)
        store = opts.workdir / "bench.glm53"
        store.unlink(missing_ok=True)
        made.append(store)
        res = pack_store(PackOptions(model, store, threads=opts.threads, verify=False, progress=False,
                                     allow_buffered=opts.allow_buffered), log=log)
        pack_rate = res.rate
    head = read_header(store)
    extents = [(e.offset, e.extent) for e in head.entries]
    size = head.file_size - head.data_offset
    rec = head.max_extent
    result = BenchResult(f"glm53 bench store, {time.strftime('%Y-%m-%d %H:%M %Z')}, {platform.node()}, "
                         f"{os.cpu_count()} CPUs; {store} ({size / 1e9:.2f} GB of records, {len(extents)} records "
                         f"of {rec / 2**20:.2f} MiB); {opts.threads} threads, {opts.rounds} interleaved rounds")
    seq_key = f"sequential read (1 thread, {rec / 2**20:.1f} MiB blocks)"
    rand_key = f"random-record read ({2 * opts.threads} in flight)"
    if len(extents) < 2:
        raise StoreError(f"{store} holds {len(extents)} record(s); the reader/raw comparison needs at least 2",
                         "bench a bigger store: raise --gb, or pass --path to a store of more records")
    # Raw and reader passes take disjoint windows, so at least two windows must fit in the store.
    window = min(max(4 * opts.threads, min(64, len(extents) // 8)), len(extents) // 2)
    seq = []
    with StoreReader(store, threads=opts.threads, allow_buffered=opts.allow_buffered, header=head) as reader:
        if not reader.direct:
            result.notes.append("the store's filesystem refuses O_DIRECT: every figure is a buffered read")
        seq.append(raw_sequential(store, head.data_offset, head.file_size, rec))
        raw, rdr, ratios = paired_windows(store, reader, opts.threads, opts.rounds, window, log)
        seq.append(raw_sequential(store, head.data_offset, head.file_size, rec))
    # The engine's reader reads each record as parallel parts, 4 here.
    with StoreReader(store, threads=opts.threads, allow_buffered=opts.allow_buffered, header=head, pieces=4) as split:
        how = "native"
        raw_s, rdr_s, ratios_s = paired_windows(store, split, opts.threads, opts.rounds, window, log)
    raw += raw_s
    result.raw[seq_key] = statistics.median(seq)
    result.raw[rand_key] = statistics.median(raw)
    result.notes.append(f"reader vs raw: {len(ratios)} paired windows of {window} records; median of per-pair "
                        f"ratios {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
    stall = main_thread_stall(store, head, opts.threads, log)
    result.notes.append("the main thread's step-like work (Python with short GIL-releasing calls, as when it plans a "
                        "MoE layer step) while the reader reads records 3 at a time every 1.5 ms, x its time idle: "
                        + ", ".join(f"{name} {r:.2f}" for name, r in stall.items()))
    dd = dd_direct(store)
    if dd:
        result.notes.append(f"dd if=STORE of=/dev/null bs=9M iflag=direct: {dd / 1e9:.2f} GB/s (whole file)")
    ver = full_verify(store, None, threads=opts.threads, allow_buffered=opts.allow_buffered)
    if not ver.ok:
        result.notes.append(f"full verify found problems: {ver.problems[0].what}")
    if pack_rate is not None:
        result.add("pack-store (read checkpoint, hash, write)", pack_rate, seq_key)
    result.add(f"verify-store full (xxh3 + sha256, {opts.threads} threads)", ver.rate, seq_key)
    # The reader's ratio is the median of per-window paired ratios: robust to the disk's drift.
    result.add(f"reader random records ({opts.threads} threads)", statistics.median(rdr), rand_key,
               statistics.median(ratios))
    result.add(f"reader random records ({opts.threads} threads, 4 {how} parts each, as the engine reads)",
               statistics.median(rdr_s), rand_key, statistics.median(ratios_s))
    best = max([*result.raw.values(), dd or 0.0])
    result.notes.append(f"reader median {statistics.median(rdr) / 1e9:.2f} GB/s = {statistics.median(rdr) / best:.2f} x "
                        f"the best raw rate of this run ({best / 1e9:.2f} GB/s)")
    return result
