"""Start-up measurements for the CPU lane on the host it runs on: the kernel on synthetic experts, and RAM read bandwidth.

calibrate_cpu() times lane steps (1, 2, 4 experts of 1..8 rows) at a few thread counts on synthetic experts laid
out like the RAM tier (random trellis: any bits are a valid EXL3 weight), spread over more memory than the last
level cache so the bytes come from RAM as in service. It also times each SIMD path the CPU has and keeps the
fastest (AVX-512 lowers the clock on some cores). Each path is timed with the kernel the lane serves on it
(kernel.served_kernel: the integer kernel where the build has a tested one, else the exact one), so the
samples and the choice are those of what will serve. Its samples feed planner.calibrate; the throughputs are what
`glm53 bench cpu-lane` prints against ram_read_bandwidth().
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .kernel import (
    CpuKernel,
    ExpertCall,
    ExpertGeometry,
    KernelUnavailable,
    served_kernel,
    supported_isas,
    unavailable_reason,
)
from .planner import CpuSample

GIB = 1 << 30


def expert_geometry(hidden: int = 4096, intermediate: int = 2048, bits: int = 3) -> ExpertGeometry:
    """The slot layout of one GLM-5.3-Flash routed expert (glm53.tiers.exl3_expert_layout), as kernel geometry."""
    from glm53.tiers.layout import exl3_expert_layout

    return ExpertGeometry.from_layout(exl3_expert_layout(hidden, intermediate, bits))


def synthetic_experts(geo: ExpertGeometry, count: int, seed: int = 0) -> np.ndarray:
    """(count, nbytes) uint8 slot images: random trellis, suh/svh random signs at the fixture's scales (|suh| ~ 1,
    |svh| ~ 1/sqrt(in)), so activations stay O(1) and no value is NaN or inf."""
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, 256, (count, geo.nbytes), dtype=np.uint8)
    fan_in = {"gate": geo.hidden, "up": geo.hidden, "down": geo.intermediate}
    for name, off in geo.offsets:
        proj, part = name.split(".")
        if part == "trellis":
            continue
        n = fan_in[proj] if part == "suh" else (geo.intermediate if proj != "down" else geo.hidden)
        scale = 1.0 if part == "suh" else 1.0 / np.sqrt(fan_in[proj])
        vals = (np.where(rng.random((count, n)) < 0.5, -scale, scale)).astype("<f2")
        buf[:, off:off + 2 * n] = vals.view(np.uint8)
    return buf


def last_level_cache_bytes(sys_root: str | Path = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Largest cache size listed for CPU 0 (the L3 on x86), or 64 MiB if unreadable."""
    best = 0
    for d in Path(sys_root).glob("index*"):
        try:
            text = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 64 << 20


def ram_read_bandwidth(nbytes: int | None = None, threads: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (a sum over a buffer far bigger than the caches), best of `repeats`.

    torch's sum on `threads` intra-op threads where torch is installed (it reads at close to the memory
    controllers' rate), else numpy's single-threaded sum. The buffer is 512 MiB, or less on a small host."""
    if nbytes is None:
        avail = _mem_available() or 4 * GIB
        nbytes = int(min(512 << 20, max(64 << 20, avail // 8)))
    n = nbytes // 4
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        old = torch.get_num_threads()
        try:
            torch.set_num_threads(max(1, threads or old))
            a = torch.ones(n, dtype=torch.float32)
            a.sum()  # fault the pages in, warm the threads
            best = min(_timed(a.sum) for _ in range(repeats))
        finally:
            torch.set_num_threads(old)
        return n * 4 / best
    b = np.ones(n, np.float32)
    b.sum()
    return n * 4 / min(_timed(b.sum) for _ in range(repeats))


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass
class CpuCalibration:
    isa: str                                   # the fastest path here
    isa_seconds: dict[str, float]              # one expert, 1 row, at the lane's threads, per path
    samples: list[CpuSample] = field(default_factory=list)
    expert_bytes: int = 0
    kernel: str = "exact"                      # the kernel timed (and served) on `isa`: "int" or "exact"
    isa_kernels: dict[str, str] = field(default_factory=dict)  # the kernel timed on each path

    def bytes_per_second(self, rows: int, threads: int) -> float | None:
        """Expert bytes/s measured for single-expert steps of `rows` rows at `threads` threads (best sample)."""
        times = [s.seconds for s in self.samples if s.rows == (rows,) and s.threads == threads]
        return self.expert_bytes / min(times) if times else None


class _Pool:
    """Synthetic experts spread over more than the last-level cache, handed out round-robin."""

    def __init__(self, geo: ExpertGeometry, seed: int):
        count = int(min(64, max(4, 2 * last_level_cache_bytes() // geo.nbytes + 1)))
        self.slots = synthetic_experts(geo, count, seed)
        self.next = 0

    def take(self, n: int) -> list[np.ndarray]:
        out = [self.slots[(self.next + i) % len(self.slots)] for i in range(n)]
        self.next = (self.next + n) % len(self.slots)
        return out


def time_step(kern: CpuKernel, geo: ExpertGeometry, slots: Sequence[np.ndarray], rows: Sequence[int],
              rng: np.random.Generator) -> float:
    """Seconds for one kernel call computing len(rows) experts, expert i over rows[i] activation rows."""
    calls = []
    for slot, r in zip(slots, rows, strict=True):
        x = rng.standard_normal((r, geo.hidden), dtype=np.float32)
        calls.append(ExpertCall(slot, x, np.empty_like(x)))
    t0 = time.perf_counter()
    kern.run(calls, geo)
    return time.perf_counter() - t0


def calibrate_cpu(threads: int, cpus: Sequence[int] | None = None, *, geo: ExpertGeometry | None = None,
                  rows: Sequence[int] = (1, 2, 4, 8), experts: Sequence[int] = (1, 2, 4),
                  thread_counts: Sequence[int] | None = None, repeats: int = 3, isas: Sequence[str] | None = None,
                  seed: int = 0) -> CpuCalibration:
    """Measure the kernel on this host. thread_counts defaults to {1, threads/2, threads}: three points pin the
    serial and parallel shares of the cost model. Each sample is the best of `repeats` (noise on a shared host only
    ever adds time). Takes about a second on a many-core host, a few on a small one."""
    geo = geo or expert_geometry()
    pool = _Pool(geo, seed)
    rng = np.random.default_rng(seed + 1)
    candidates = list(isas or supported_isas())
    if not candidates:
        raise KernelUnavailable(unavailable_reason() or "the CPU expert kernel supports no ISA on this CPU")
    # Which path: one-row experts (the decode case) at the lane's threads. Scalar only if nothing else runs.
    simd = [i for i in candidates if i != "scalar"] or candidates
    isa_seconds, isa_kernels = {}, {}
    for isa in simd:
        with CpuKernel(threads, cpus, isa=isa, kernel=served_kernel(isa)) as kern:
            isa_kernels[isa] = kern.kernel
            time_step(kern, geo, pool.take(1), (1,), rng)  # warm-up: page faults, thread start
            isa_seconds[isa] = min(time_step(kern, geo, pool.take(2), (1, 1), rng) / 2 for _ in range(repeats))
    best = min(isa_seconds, key=isa_seconds.__getitem__)
    counts = sorted({int(t) for t in (thread_counts or (1, max(1, threads // 2), threads)) if 1 <= t <= threads})
    samples = []
    for t in counts:
        with CpuKernel(t, list(cpus)[:t] if cpus else None, isa=best, kernel=isa_kernels[best]) as kern:
            time_step(kern, geo, pool.take(1), (1,), rng)
            for n in experts:
                for r in rows:
                    sec = min(time_step(kern, geo, pool.take(n), (r,) * n, rng) for _ in range(repeats))
                    samples.append(CpuSample((r,) * n, t, sec))
    return CpuCalibration(best, isa_seconds, samples, geo.nbytes, isa_kernels[best], isa_kernels)


def default_threads() -> int:
    """Physical cores we may use, minus one for the server (the plan's rule), at least 1."""
    from .kernel import physical_cores

    cores = len(physical_cores()) or (os.cpu_count() or 1)
    return max(1, cores - 1)
