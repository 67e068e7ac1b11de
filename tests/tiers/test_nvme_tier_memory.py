"""Memory discipline of the nvme tier: its resident bytes never exceed the plan's RAM budget, its O_DIRECT reads
add nothing to the page cache, and the process stays within budget + a fixed margin over a long run of random
reads, measured from /proc/self/status and, where this machine lets us make one, under a real memory cgroup cap
(v2 memory.max, or v1 memory.limit_in_bytes + memsw: what `docker run --memory X --memory-swap X` sets)."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from nvme_support import make_store, nvme_spec

from glm53.bench.store import drop_cache
from glm53.tiers.nvme import NvmeTier
from glm53.tiers.nvme_open import open_nvme_tier
from store.format import read_header

MIB = 1 << 20
EXPERTS, RAM_RECORDS, READS = 32, 40, 1500
MARGIN = 32 * MIB  # interpreter, futures, numpy temporaries, thread stacks: what the tier does not account


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """160 records of ~0.6 MiB (hidden 1024): a 97 MB store, 4 times the RAM budget of 40 records, and well over
    what the capped run may add (the tier + the margin): the buffered control's page cache must run into the cap
    even when a few records' pages are never read (guesses dropped unread) or reclaimed early."""
    return make_store(tmp_path_factory.mktemp("nvme-mem"), layers=6, experts=EXPERTS, hidden=1024, inter=512)


def rss_bytes() -> int:
    """VmRSS from /proc/self/status. Pinned pages (cudaHostRegister, on a CUDA host) are resident pages of this
    process, so they are inside VmRSS already; VmPin/VmLck only say how much of it is locked."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def cached_record_bytes(store: Path) -> int:
    """Bytes of the store's record region in the page cache (mincore over a mapping that is never touched). The
    header is read once, before: its buffered read brings in a little readahead of the first records."""
    head = _HEADERS.get(store) or _HEADERS.setdefault(store, read_header(store))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size = head.file_size
    fd = os.open(store, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), "mmap failed"
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        try:
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    first = head.data_offset // mmap.PAGESIZE
    return sum(1 for b in vec[first:] if b & 1) * mmap.PAGESIZE


_HEADERS: dict = {}
# Opening a store reads its header buffered (and the kernel reads a little ahead into the first records); that is
# a constant, not a growth.
HEADER_READAHEAD = 256 * 1024


def random_reads(tier: NvmeTier, n: int, seed: int, sample=None) -> None:
    """A long decode-like run: each step demands 8 random experts of a layer and prefetches 8 guesses of the next."""
    rng = np.random.default_rng(seed)
    for i in range(n // 8):
        layer = i % tier.num_layers
        es = rng.choice(tier.num_experts, 8, replace=False)
        tier.tiers.demand_reads(layer, es)
        for e in es:
            tier.tiers.fetch_to_ram(layer, int(e), protect=es)
        tier.prefetch([((layer + 1) % tier.num_layers, int(e)) for e in rng.choice(tier.num_experts, 8, replace=False)])
        if sample is not None and i % 8 == 0:
            sample()


def tier_host_bytes(tier: NvmeTier) -> int:
    """Host memory the tier owns on this CPU-only run: the RAM arena plus the CPU stand-ins of VRAM and staging."""
    t = tier.tiers
    return tier.budget_bytes + sum(v.storage.numel() for v in t.vram) + t.staging.numel()


def test_rss_stays_within_budget_and_reads_leave_no_page_cache(packed):
    ck, store = packed
    plan = nvme_spec(store, RAM_RECORDS, 0)
    cached_record_bytes(store)
    drop_cache(store)
    assert cached_record_bytes(store) == 0, "could not empty the page cache of the store"
    base = rss_bytes()
    peak, worst = [base], [0]

    with open_nvme_tier(store, ck, plan) as tier:
        assert tier.budget_bytes <= plan.ram_slots * tier.stride
        cached = cached_record_bytes(store)
        assert cached <= HEADER_READAHEAD

        def sample():
            peak[0] = max(peak[0], rss_bytes())
            worst[0] = max(worst[0], tier.resident_bytes())

        random_reads(tier, READS, 0, sample)
        sample()
        reads = tier.stats.snapshot()["nvme"]
        allowed = tier_host_bytes(tier) + MARGIN
        assert reads["reads"] + reads["prefetch_reads"] > 4 * RAM_RECORDS  # far more than the tier can hold
        assert worst[0] <= tier.budget_bytes
    assert peak[0] - base <= allowed, f"RSS grew {(peak[0] - base) / MIB:.1f} MiB > {allowed / MIB:.1f} MiB"
    print(f"\nVmRSS grew {(peak[0] - base) / MIB:.1f} MiB over {READS} reads (allowed: tier "
          f"{(allowed - MARGIN) / MIB:.1f} MiB + margin {MARGIN / MIB:.0f} MiB); store records in the page cache: "
          f"{cached} B before and after")
    assert cached_record_bytes(store) == cached, "O_DIRECT reads left store records in the page cache"


# ---- under a real memory cgroup -------------------------------------------------------------------------------


def _our_cgroup(controller: str | None) -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if (controller is None and ctrls == "") or (controller and controller in ctrls.split(",")):
            return path
    return None


def make_memory_cgroup(name: str) -> tuple[Path, str] | None:
    """A child memory cgroup of ours: (directory, "v2" | "v1"), or None where this machine does not allow one."""
    v2 = _our_cgroup(None)
    for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):  # unified, or hybrid's v2 half
        parent = mount / (v2 or "").lstrip("/")
        controllers = parent / "cgroup.controllers"
        if v2 is None or not controllers.exists() or "memory" not in controllers.read_text().split():
            continue
        child = parent / name
        try:
            child.mkdir()
            # Fails (EBUSY) where our own cgroup holds processes: v2 allows controllers only on leaves' parents.
            (parent / "cgroup.subtree_control").write_text("+memory")
        except OSError:
            if child.exists():
                child.rmdir()
            continue
        if (child / "memory.max").exists():
            return child, "v2"
        child.rmdir()
    v1 = _our_cgroup("memory")
    if v1 is not None:
        child = Path("/sys/fs/cgroup/memory") / v1.lstrip("/") / name
        try:
            child.mkdir()
        except OSError:
            return None
        if (child / "memory.limit_in_bytes").exists():
            return child, "v1"
        child.rmdir()
    return None


CHILD = """
import json, sys
sys.path[:0] = [{tests!r}, {support!r}, {root!r}]
from test_nvme_tier_memory import child_main
child_main(*sys.argv[1:])
"""


def child_main(store: str, ck: str, buffered: str) -> None:
    """In the capped cgroup: open the tier, say READY (the parent then sets the cap), run the reads on GO."""
    if buffered == "1":  # the control: the same reads through the page cache
        import store.directio as D
        from store.errors import DirectIOUnsupported

        def refuse(path, flags=os.O_RDONLY):
            raise DirectIOUnsupported("O_DIRECT refused for the control run")

        D.open_direct = refuse
    store_path = Path(store)
    with open_nvme_tier(store_path, Path(ck), nvme_spec(store_path, RAM_RECORDS, 0, allow_buffered=buffered == "1"),
                        warm=False) as tier:
        print("READY", json.dumps({"tier_bytes": tier_host_bytes(tier)}), flush=True)
        assert sys.stdin.readline().strip() == "GO"
        random_reads(tier, READS, 1)
        print("DONE", json.dumps({"resident": tier.resident_bytes(), "budget": tier.budget_bytes}), flush=True)


def run_capped(cg: Path, version: str, store: Path, ck: Path, buffered: bool) -> dict:
    procs = cg / "cgroup.procs"
    usage = cg / ("memory.current" if version == "v2" else "memory.usage_in_bytes")
    here = Path(__file__).resolve().parent
    code = CHILD.format(tests=str(here), support=str(here.parent / "support"), root=str(here.parents[1]))
    child = subprocess.Popen([sys.executable, "-c", code, str(store), str(ck), "1" if buffered else "0"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             preexec_fn=lambda: procs.write_text(str(os.getpid())))
    try:
        line = child.stdout.readline()
        assert line.startswith("READY"), f"child failed before READY: {line!r}"
        tier_bytes = json.loads(line.split(" ", 1)[1])["tier_bytes"]
        base = int(usage.read_text())
        # Everything the process holds now, plus what the tier may still fault in, plus the fixed margin.
        cap = base + tier_bytes + MARGIN
        if version == "v2":
            (cg / "memory.max").write_text(str(cap))
            if (cg / "memory.swap.max").exists():
                (cg / "memory.swap.max").write_text("0")
        else:
            memsw = cg / "memory.memsw.limit_in_bytes"  # v1 wants limit <= memsw limit at every write
            if memsw.exists():
                memsw.write_text("-1")
            (cg / "memory.limit_in_bytes").write_text(str(cap))
            if memsw.exists():
                memsw.write_text(str(cap))
            for f in ("memory.max_usage_in_bytes", "memory.failcnt", "memory.memsw.max_usage_in_bytes",
                      "memory.memsw.failcnt"):
                if (cg / f).exists():
                    (cg / f).write_text("0")
        child.stdin.write("GO\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=120)
        rc = child.returncode
        if version == "v2":
            events = dict(line.split() for line in (cg / "memory.events").read_text().splitlines())
            peak_file = cg / "memory.peak"
            peak = int(peak_file.read_text()) if peak_file.exists() else None
            hit = int(events.get("max", 0)) + int(events.get("oom_kill", 0))
        else:
            peak = int((cg / "memory.max_usage_in_bytes").read_text())
            # With the memsw limit equal to the limit, a charge may meet the memsw limit first: count both.
            counters = [cg / f for f in ("memory.failcnt", "memory.memsw.failcnt")]
            hit = sum(int(f.read_text()) for f in counters if f.exists())
        return {"rc": rc, "out": out, "base": base, "cap": cap, "peak": peak, "hit_cap": hit}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def reached_cap(run: dict) -> bool:
    """The kernel pushed back: a charge failed (failcnt / memory.events max), or the peak sat at the cap (page cache
    reclaimed at the limit does not always count as a failure on v1)."""
    return run["hit_cap"] > 0 or (run["peak"] is not None and run["peak"] >= run["cap"] - MIB)


def test_under_a_real_memory_cap(packed):
    """The same long run in a child process under a memory cgroup capped at what it holds + the tier + the margin:
    with O_DIRECT it never touches the cap; the control (identical reads through the page cache) runs into it."""
    ck, store = packed
    made = make_memory_cgroup(f"glm53-nvme-test-{os.getpid()}")
    if made is None:
        pytest.skip("no memory cgroup can be made here (cgroup v2 memory.max or v1 memory.limit_in_bytes); the RSS "
                    "and page-cache test covers the accounting")
    cg, version = made
    try:
        drop_cache(store)
        direct = run_capped(cg, version, store, ck, buffered=False)
        assert direct["rc"] == 0, f"the capped run died (rc {direct['rc']}): {direct['out']}"
        assert not reached_cap(direct), f"O_DIRECT run reached the cap: {direct}"
        drop_cache(store)
        control = run_capped(cg, version, store, ck, buffered=True)
        assert control["rc"] == 0, f"the buffered control died (rc {control['rc']}): {control['out']}"
        assert reached_cap(control), f"the buffered control never reached the cap: the test proves nothing: {control}"
        grow = "?" if direct["peak"] is None else f"{(direct['peak'] - direct['base']) / MIB:.1f}"
        cap = (direct["cap"] - direct["base"]) / MIB
        print(f"\ncgroup {version} cap = base + {cap:.1f} MiB: O_DIRECT run peaked at "
              f"base + {grow} MiB, never at the cap; the buffered control ran into it")
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.1)
