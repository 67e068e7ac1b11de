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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from store.directio import alloc_aligned, alloc_slots, open_for_read, pread_into
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
    rows: list[tuple[str, float, str]] = field(default_factory=list)   # (name, bytes/s, raw key)
    notes: list[str] = field(default_factory=list)

    def ratio(self, name: str) -> float:
        for n, rate, key in self.rows:
            if n == name:
                return rate / self.raw[key]
        raise KeyError(name)

    def render(self) -> str:
        lines = [self.header]
        for name, rate in self.raw.items():
            lines.append(f"  raw  {name:44} {rate / 1e9:7.2f} GB/s")
        for name, rate, key in self.rows:
            r = rate / self.raw[key]
            target = f"  (target >= {TARGET:.2f}: {'met' if r >= TARGET else 'MISSED'})" if "reader" in name else ""
            lines.append(f"  {name:49} {rate / 1e9:7.2f} GB/s  {r:5.2f} x raw {key}{target}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _drop_cache(path: Path) -> None:
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


def raw_random(path: Path, extents: list[tuple[int, int]], threads: int) -> float:
    """`threads` plain O_DIRECT preadv loops over the records in a random order: the reader's ceiling."""
    order = extents[:]
    random.shuffle(order)
    fd, _ = open_for_read(path, allow_buffered=True)
    lock, it, total = threading.Lock(), iter(order), [0]

    def work() -> None:
        buf = alloc_aligned(max(n for _, n in extents))
        while True:
            with lock:
                nxt = next(it, None)
            if nxt is None:
                return
            got = pread_into(fd, memoryview(buf[:nxt[1]]), nxt[0])
            with lock:
                total[0] += got

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            for f in [pool.submit(work) for _ in range(threads)]:
                f.result()
    finally:
        os.close(fd)
    return total[0] / (time.perf_counter() - t0)


def reader_random(reader: StoreReader, keys: list[tuple[int, int]], depth: int) -> float:
    """Every record once, random order, `depth` requests in flight through the reader's priority queue."""
    order = keys[:]
    random.shuffle(order)
    arena = alloc_slots(depth, reader.max_extent)
    inflight, total = [], 0
    t0 = time.perf_counter()
    for i, (layer, expert) in enumerate(order):
        if len(inflight) == depth:
            done = inflight.pop(0).result()
            total += done.data.nbytes
        inflight.append(reader.read(layer, expert, arena[i % depth], priority=Priority.DEMAND))
    for f in inflight:
        total += f.result().data.nbytes
    return total / (time.perf_counter() - t0)


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


def run_bench(opts: BenchOptions, log=print) -> BenchResult:
    opts.workdir.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    try:
        return _run(opts, log, made)
    finally:
        if not opts.keep:
            for p in made:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _run(opts: BenchOptions, log, made: list[Path]) -> BenchResult:
    pack_rate = None
    store = opts.path
    if store is None or opts.model is not None:
        model = opts.model
        if model is None:
            model = opts.workdir / "synthetic-checkpoint"
            n = max(16, int(opts.gb * 1e9 / REAL_RECORD))
            per_layer = min(n, 288)
            layers = -(-n // per_layer)
            log(f"bench store: writing a synthetic checkpoint ({layers} x {per_layer} experts of 9 MiB) in {model}")
            shutil.rmtree(model, ignore_errors=True)
            made.append(model)
            write_expert_checkpoint(model, layers=1 + layers, dense_layers=1, experts=per_layer, mtp_layers=0,
                                    **REAL)
        for f in model.glob("*.safetensors"):
            _drop_cache(f)
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
    rand_key = f"random-record read ({opts.threads} threads)"
    seq, rnd, rdr = [], [], []
    with StoreReader(store, threads=opts.threads, allow_buffered=opts.allow_buffered, header=head) as reader:
        if not reader.direct:
            result.notes.append("the store's filesystem refuses O_DIRECT: every figure is a buffered read")
        for r in range(opts.rounds):
            seq.append(raw_sequential(store, head.data_offset, head.file_size, rec))
            rnd.append(raw_random(store, extents, opts.threads))
            rdr.append(reader_random(reader, reader.keys(), depth=2 * opts.threads))
            log(f"bench store: round {r + 1}: raw seq {seq[-1] / 1e9:.2f}, raw random {rnd[-1] / 1e9:.2f}, "
                f"reader {rdr[-1] / 1e9:.2f} GB/s")
    result.raw[seq_key] = statistics.median(seq)
    result.raw[rand_key] = statistics.median(rnd)
    dd = dd_direct(store)
    if dd:
        result.notes.append(f"dd if=STORE of=/dev/null bs=9M iflag=direct: {dd / 1e9:.2f} GB/s (whole file)")
    ver = full_verify(store, None, threads=opts.threads, allow_buffered=opts.allow_buffered)
    if not ver.ok:
        result.notes.append(f"full verify found problems: {ver.problems[0].what}")
    if pack_rate is not None:
        result.rows.append(("pack-store (read checkpoint, hash, write)", pack_rate, seq_key))
    result.rows.append((f"verify-store full (xxh3 + sha256, {opts.threads} threads)", ver.rate, seq_key))
    result.rows.append((f"reader random records ({opts.threads} threads)", statistics.median(rdr), rand_key))
    return result
