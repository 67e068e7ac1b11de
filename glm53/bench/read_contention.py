"""How much the store's reads slow the thread that plans each decode step.

In the nvme modes that thread queues a step's copies while the step's store reads run, and on the GPU machine it
spends longer per copy than in fast mode (docs/results.md), with nothing else to tell apart.
Two suspects: Python threads taking the GIL each time a read lands, and the native read pool's threads taking the
cores and the memory bandwidth. This times one piece of the planning thread's kind of work (a step's copies of
slot-sized pinned buffers to the device, queued through the tiers' Copier, and a little Python bookkeeping) alone,
beside a StoreReader's reads (queued, read and finished by native threads), and beside the same reads handed
straight to the native pread by a plain thread pool (the cores and memory as busy, a Python thread per read).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

COPIES = 5  # a decode step's misses sent over PCIe: about half its 8 picks
READS = 4  # store reads in flight beside it (a step's demand reads and the next layer's guesses)


def _work(copier, pairs: list, rng: random.Random) -> float:
    """One step's worth of planning-thread work; returns the seconds it took (the copies queued, not landed)."""
    t0 = time.perf_counter()
    ids = [rng.randrange(288) for _ in range(8)]
    uniq = sorted(set(ids))
    slots = {e: i for i, e in enumerate(uniq)}
    ticket = copier.copy_many(pairs)
    copier.order_compute_after([ticket])
    _ = [slots[e] for e in ids]
    return time.perf_counter() - t0


def read_contention(store: Path, parts: int, *, device: str = "cuda", reps: int = 40, seed: int = 0) -> dict:
    """Median seconds of the work alone, beside StoreReader reads and beside bare native reads, and the ratios.
    parts: the record's parts (the tier's choice)."""
    from glm53.tiers.copier import Copier
    from glm53.tiers.ram import pin_host
    from store import native
    from store.directio import alloc_slots, open_for_read
    from store.format import ALIGN, read_header
    from store.reader import Priority, StoreReader

    head = read_header(store)
    keys = sorted(head.index)
    rng = random.Random(seed)
    n = head.max_extent
    src = alloc_slots(COPIES, n)
    src[:] = 1
    src_t = torch.from_numpy(src)
    if device != "cpu":
        pin_host(src_t)
    dst = torch.empty((COPIES, n), dtype=torch.uint8, device=device)
    pairs = [(dst[i], src_t[i]) for i in range(COPIES)]
    copier = Copier(device)
    arena = alloc_slots(READS, n)
    arena[:] = 1

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    def alone() -> float:
        sync()
        return _work(copier, pairs, rng)

    def beside(start, finish) -> float:
        sync()
        pending = start()
        t = _work(copier, pairs, rng)
        finish(pending)
        return t

    out: dict = {}
    with StoreReader(store, threads=READS, pieces=parts, verify=True) as reader:  # as the tier reads
        def reader_start():
            return reader.read_many([(*rng.choice(keys), arena[i]) for i in range(READS)], priority=Priority.DEMAND)

        def reader_finish(futures) -> None:
            for f in futures:
                f.result(30)

        for _ in range(4):  # warm: first copies, first reads (the parts' hashes kept)
            alone()
            beside(reader_start, reader_finish)
        times = {"alone": [], "reader": []}
        for _ in range(reps):  # interleaved, so drift falls on all
            times["alone"].append(alone())
            times["reader"].append(beside(reader_start, reader_finish))
    if parts > 1:
        fd, _ = open_for_read(store, allow_buffered=True)
        hashes = [np.zeros(parts, np.uint64) for _ in range(READS)]
        try:
            with ThreadPoolExecutor(READS) as pool:
                def bare_start() -> list:
                    return [pool.submit(native.pread_parts, fd, arena[i][:e.extent], e.offset, parts, ALIGN,
                                        native.xxh3_address(), hashes[i])
                            for i, e in enumerate(head.index[rng.choice(keys)] for _ in range(READS))]

                beside(bare_start, reader_finish)
                times["native"] = [beside(bare_start, reader_finish) for _ in range(reps)]
        finally:
            os.close(fd)
    for k, v in times.items():
        out[f"{k}_s"] = statistics.median(v)
    for k in ("reader", "native"):
        if f"{k}_s" in out:
            out[f"{k}_over_alone"] = out[f"{k}_s"] / out["alone_s"]
    out.update(copies=COPIES, reads=READS, parts=parts, reps=reps)
    return out


def line(res: dict) -> str:
    """The report's line for read_contention's result."""
    text = (f"planning-thread work ({res['copies']} slot copies queued, a little bookkeeping): "
            f"{res['alone_s'] * 1e6:.0f} us alone, {res['reader_s'] * 1e6:.0f} us beside {res['reads']} StoreReader "
            f"reads in {res['parts']} part(s) (x {res['reader_over_alone']:.2f})")
    if "native_s" in res:
        text += (f", {res['native_s'] * 1e6:.0f} us beside the same reads through a plain thread pool "
                 f"(x {res['native_over_alone']:.2f})")
    return text
