"""The store disk's raw O_DIRECT random-record rate by reads in flight, whole records and quarter records, in one
run: does the disk give more than the reader's 8 outstanding reads take from it? Also what RAM-backed filesystems
the machine has (a store there reads buffered, as a fast NVMe array would). Usage:
    glm53 bench disk-sweep STORE [--depths 1,2,4,8,16,32] [--records 288]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
from pathlib import Path
from typing import Any

# The store and its reader are imported by the command, not here: the front door registers every bench at every start.


def pieces(extents: list[tuple[int, int]], parts: int) -> list[tuple[int, int]]:
    """Each (offset, extent) cut into `parts` aligned reads."""
    from store.directio import ALIGN

    out = []
    for off, ext in extents:
        step = -(-ext // parts // ALIGN) * ALIGN
        out += [(off + o, min(step, ext - o)) for o in range(0, ext, step)]
    return out


def register_bench(bench_sub: Any) -> None:
    b = bench_sub.add_parser("disk-sweep", help="the store disk's raw O_DIRECT random-record rate by reads in flight",
                             description=__doc__.split("\n\n")[0])
    b.add_argument("store", type=Path, help="a packed store file on the disk to measure")
    b.add_argument("--depths", default="1,2,4,8,16,32", help="reads in flight, comma-separated (default "
                   "1,2,4,8,16,32)")
    b.add_argument("--records", type=int, default=288, help="random records per pass (default 288)")
    b.set_defaults(func=cmd_bench_disk_sweep)


def cmd_bench_disk_sweep(a: argparse.Namespace) -> int:
    from glm53.bench.store import raw_random
    from store.directio import alloc_slots
    from store.format import read_header

    head = read_header(a.store)
    keys = sorted(head.index)
    rng = random.Random(0)
    for depth in [int(d) for d in a.depths.split(",")]:
        for parts in (1, 4):
            # A fresh random window each pass, so no pass re-reads what the disk's own cache may hold.
            sample = rng.sample(keys, min(len(keys), a.records))
            ext = pieces([(head.index[k].offset, head.index[k].extent) for k in sample], parts)
            bufs = alloc_slots(depth, max(e for _, e in ext))
            bufs[:] = 1
            rate = raw_random(a.store, ext, bufs)
            print(f"in flight {depth:3d}, records in {parts} part(s): {rate / 1e9:6.2f} GB/s", flush=True)
    print(subprocess.run(["df", "-h", "/dev/shm", "/tmp", str(a.store.parent)], capture_output=True,
                         text=True).stdout)
    print(open("/proc/meminfo").read().split("\n")[:3])
    print("cpus", os.cpu_count())
    return 0
