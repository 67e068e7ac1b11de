"""The speed forecast: the decode tok/s each mode should reach on this host, from a cost model small enough to
check by hand. Pure: the plan calls `plan_forecast` with what it decided, `glm53 plan` prints the result, and the
engine carries it to /stats beside the rate it measures.

One decoded token (one sequence, a short history) takes

    token = gpu_step + moe_layers x (host + store + experts + write_back)

    gpu_step  exllamav3's stock step: every non-expert weight and the picks VRAM holds, the slower of its floor
              per decoder layer and the bytes it reads at the GPU's memory bandwidth (or a measured stock step)
    host      the tiered step's host time per MoE layer, which the GPU waits for (none in stock)
    store     nvme modes: the layer's misses not in RAM, read from the store first at its read rate, and the
              lookahead's wrong guesses read beside them (a measured share of those reads)
    experts   the layer's misses, which its expert kernels wait for (the decode step is serialised per layer):
                exact: misses x expert bytes / link rate
                fast:  the CPU lane planner's split of the misses between the lane and the link, which run at
                       once so the layer waits for the slower (glm53.cpu_lane.planner's decode rule, `lane_split`),
                       the lane priced at what it takes inside decode (its idle cost x lane_decode: the planner
                       refits from live timings, so it splits at that cost too), plus the host's share of offering
                       the lane; and only where the lane judge would keep it (glm53.step.lane_judge: layer steps at
                       least MARGIN faster with it), else as exact
              less, in every tiered mode whose plan leaves the prestage its rows, the misses the prestage
              copied ahead while the link idled (glm53.step.prestage): its PER_PARITY copies a layer, as many as
              fit in the layer's idle link time (gpu_step / moe_layers + host), of which the share PRESTAGE_SAVED
              turned into demand copies saved; only where its judge would keep it (layer steps MARGIN faster)
              and the layer does not wait on the store longer than the link idles (its RAM misses then cross
              during that wait, and the judge set the prestage aside where that was measured)
    write_back the admissions' victims copied back to RAM (an expert lives in one tier), priced in series with
              the misses as the emulated runs measured it: write-backs per miss x misses x expert bytes / link
              rate, less what hides under the layer's store wait

Every term is a `Term`: its value and where it came from (a host fact, a measurement in docs/results.md, saved
routing statistics, or an assumption), so a forecast that is off says which term to measure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# The lane judge's rule (glm53.step.lane_judge; the decision package may not import it, a test keeps them equal):
# the lane is kept only if layer steps offering it are at least MARGIN faster, with at least MIN_SHARE of the picks.
MARGIN = 0.02
MIN_SHARE = 0.005

# ---------------------------------------------------------------- measured constants (docs/results.md)

# The tiered decode step's host time per MoE layer, which the GPU waits for (docs/results.md: the host time per
# layer step that `glm53 bench decode` reports).
HOST_MS_PER_MOE_LAYER = 0.20
HOST_SOURCE = ("the tiered step's host time, 186-211 us per MoE layer step on the H200 machine's Xeon "
               "(docs/results.md); a faster core takes less")
# The floor a stock step does not go below, per decoder layer: exllamav3's full-depth step is bound by kernel
# launches and the hyper-connections' small kernels, not by the bytes it reads (docs/results.md).
STOCK_FLOOR_MS_PER_LAYER = 1000 / 66.5 / 45
STOCK_FLOOR_SOURCE = ("exllamav3's floor: stock 66.5 tok/s at full depth on the H200 machine, 15.0 ms over 45 "
                      "layers (docs/results.md)")
# What offering the CPU lane costs a layer step that gives it experts, beyond the lane's own time: the step's input
# rows cross with the router's ids, the planner and the submit run on the host, the partial is copied in and added
# (glm53.exl3.handoff: in stream order, the host does not wait for the lane), and the lane's threads share the
# cores with the host's. The planner does not price it; the judge sees it.
LANE_OFFER_MS = 0.40
LANE_OFFER_SOURCE = ("fitted to fast at 1.058x exact (paired) at 25 GB/s, the lane at 0.71 ms a job in decode and 27% "
                     "of picks on it, the judge keeping it (docs/results.md)")
# The lane's kernel inside decode against its idle (calibrated) time: its threads share the cores' clock and caches
# with the host thread that feeds the GPU, the copy threads and torch's pool.
LANE_IN_DECODE = 1.47
LANE_IN_DECODE_SOURCE = ("0.73 ms a job inside decode against the calibrated 0.497 ms idle, 15 pinned threads with the "
                         "host's threads off their cores (docs/results.md)")
# The served (integer) lane kernel per one-row 9 MiB expert on the GPU machine's 16-core 2.1 GHz Xeon, per ISA:
# (threads, ms) at 15 threads, and AVX-512 VNNI's 2.926 ms on one thread for the thread scaling (docs/results.md,
# `bench cpu-lane --kernel int`, twenty-seventh session).
LANE_MEASURED = {"avx512vnni": (15, 0.422), "avx512": (15, 0.488), "avx2vnni": (15, 0.447), "avx2": (15, 0.453)}
LANE_SERIAL = (0.422 - 2.926 / 15) / (2.926 - 2.926 / 15)  # Amdahl's serial share of the 1 -> 15 thread scaling
# The prestage (glm53.step.prestage; the decision package may not import it, a test keeps them equal): PER_PARITY
# copies a layer into rows reserved at the top of the dedicated staging rows, so a plan needs top_k + 2 x PER_PARITY
# of them. PRESTAGE_SAVED: the demand copies it saved a layer step over what fits in the layer's idle link time, in
# a run where PRESTAGE_READ of its copies were read by their step (a right copy saves PRESTAGE_SAVED / PRESTAGE_READ).
PRESTAGE_PER_PARITY = 2
PRESTAGE_SAVED = 0.47
PRESTAGE_READ = 0.78
PRESTAGE_SOURCE = ("fitted to exact at 25 GB/s with the prestage against without (1.130x paired: 0.30 ms a layer "
                   "step saved of 1.68 copies' idle link time, 0.78 of the copied experts read; docs/results.md)")
LANE_FLAGS = {"avx512vnni": ("avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_vnni"),
              "avx512": ("avx512f", "avx512dq", "avx512bw", "avx512vl"),
              "avx2vnni": ("avx2", "avx_vnni"), "avx2": ("avx2", "fma", "f16c")}  # widest first
# nvme modes: what the lookahead's wrong guesses add to a token's store reads, as a share of the reads its picks need.
GUESS_WASTE = 0.3
GUESS_WASTE_SOURCE = ("the lookahead's reads beyond the picks served from the store: 0.26 and 0.29 of them at 50 GB/s "
                      "with 32 VRAM slots and 25 GB/s with 64 (docs/results.md)")
# The admissions' write-backs per miss (each admission into a full cache copies its victim back to RAM): measured at
# 11% of the experts in VRAM, the real model's share on a 24 GB card; twice as many admissions at 22%.
WRITE_BACKS_PER_MISS = 0.12
WRITE_BACKS_SOURCE = ("measured: 0.12 write-backs a miss with 32 of a layer's 288 experts in VRAM, 0.23 with 64, the "
                      "8-MoE-layer checkpoint under the preset (docs/results.md, thirty-third session)")
# The store's read rate when nothing measured it: a PCIe 4.0 NVMe drive (the emulated drive of docs/results.md).
STORE_GBPS_ASSUMED = 6.0
PCIE_GBPS_UNKNOWN = 12.6   # PCIe 3 x16 at 80%: the slowest link a 24 GB card is found on (as the plan assumes)
# GPU memory bandwidth in GB/s from the spec sheets, by a part of nvidia-smi's name (first match wins).
GPU_BANDWIDTH_GBPS = (
    ("RTX 3090 Ti", 1008), ("RTX 3090", 936), ("RTX 4090", 1008), ("RTX 5090", 1792), ("RTX 4080", 717),
    ("RTX 5080", 960), ("RTX 6000 Ada", 960), ("RTX PRO 6000", 1792), ("RTX A6000", 768), ("RTX A5000", 768),
    ("RTX A4000", 448), ("L40S", 864), ("L40", 864), ("A40", 696), ("A100-SXM4-80GB", 2039), ("A100 80GB", 1935),
    ("A100", 1555), ("H100 PCIe", 2000), ("H100 NVL", 3900), ("H100", 3350), ("H200", 4800),
)
# GLM-5.3-Flash's routing, published: the hottest 11.4% of a layer's experts (1,376 slots on a 24 GB card) serve
# ~40% of its picks (the reference appliance, ../shared/REFERENCE.md), half of them ~91% (DESIGN.md section 7).
# Cumulative share of picks over the hottest share of experts, linear between the points.
GLM53_POPULARITY = ((0.0, 0.0), (1376 / 12096, 0.40), (0.5, 0.91), (1.0, 1.0))
MODES = ("stock", "fast", "exact", "nvme", "nvme-exact")


@dataclass(frozen=True)
class Term:
    value: float
    unit: str
    source: str

    def text(self, name: str) -> str:
        return f"{name} {self.value:.3g} {self.unit}: {self.source}"

    def to_json(self) -> dict[str, Any]:
        return {"value": round(self.value, 4), "unit": self.unit, "source": self.source}


@dataclass(frozen=True)
class Terms:
    """Everything the cost model reads: the shape's few numbers and one Term per measured-or-derived quantity."""

    moe_layers: int
    top_k: int
    expert_bytes: int
    hit_rate: Term            # share of picks VRAM serves
    gpu_step_ms: Term         # the stock step of one token
    host_ms: Term             # the tiered step's host time per MoE layer
    link_GBps: Term           # host -> device copies
    lane_ms: Term | None = None       # one one-row expert on the CPU lane (None: no lane on this host)
    lane_offer_ms: Term | None = None  # the host's share of a layer step that gives the lane experts
    lane_decode: Term | None = None   # the lane's time inside decode over its idle lane_ms (None: 1)
    ram_rate: Term | None = None      # nvme modes: share of picks VRAM or RAM serves (the rest: the store)
    store_GBps: Term | None = None    # nvme modes: the store's read rate
    prestage: Term | None = None      # the share of the idle link time's copies the prestage saves (None: no rows)
    store_extra: Term | None = None   # nvme modes: wrong guesses' reads as a share of the picks' store reads
    write_backs: Term | None = None   # the admissions' victims copied back over the link, per miss

    def named(self) -> dict[str, Term]:
        names = ("hit_rate", "gpu_step_ms", "host_ms", "link_GBps", "lane_ms", "lane_offer_ms", "lane_decode",
                 "ram_rate", "store_GBps", "prestage", "store_extra", "write_backs")
        return {n: t for n in names if (t := getattr(self, n)) is not None}

    @property
    def misses(self) -> float:
        """Misses per MoE layer per token."""
        return self.top_k * (1 - self.hit_rate.value)

    @property
    def lane_decode_ms(self) -> float:
        """One one-row expert on the lane inside decode."""
        assert self.lane_ms is not None
        return self.lane_ms.value * (1.0 if self.lane_decode is None else self.lane_decode.value)

    @property
    def link_ms(self) -> float:
        """One expert over the link."""
        return self.expert_bytes / (self.link_GBps.value * 1e9) * 1e3

    def prestaged(self, store_ms: float) -> float:
        """Misses per MoE layer the prestage saves: its copies that fit in the layer's idle link time (the stock
        step's share and the host's), times PRESTAGE_SAVED; none where the layer waits on the store longer than
        that (its RAM misses cross during the wait) or the judge would not keep it (layer steps at least MARGIN
        faster)."""
        if self.prestage is None or self.misses <= 0:
            return 0.0
        idle = self.gpu_step_ms.value / self.moe_layers + self.host_ms.value
        if store_ms >= idle:
            return 0.0
        fits = min(float(PRESTAGE_PER_PARITY), idle / self.link_ms, self.misses)
        saved = self.prestage.value * fits
        step = idle + self.misses * self.link_ms
        return saved if saved * self.link_ms >= MARGIN * step else 0.0


# ---------------------------------------------------------------- the cost model


def lane_split(n: int, lane_ms: float, link_ms: float) -> tuple[int, float]:
    """The CPU lane planner's decode rule (glm53.cpu_lane.planner.assign for n one-row misses): k of them to the
    lane for the k in 0..n with the smallest makespan max(k x lane, (n - k) x link), ties to less total work, then
    to fewer on the lane. Returns (k, makespan ms)."""
    best: tuple[float, float, int] | None = None
    for k in range(n + 1):
        key = (max(k * lane_ms, (n - k) * link_ms), k * lane_ms + (n - k) * link_ms, k)
        if best is None or _better(key, best):
            best = key
    assert best is not None
    return best[2], best[0]


def _better(a: tuple[float, float, int], b: tuple[float, float, int]) -> bool:
    """The planner's order: lower makespan (equal within 1e-12 relative is a tie), less work, fewer lane experts."""
    if abs(a[0] - b[0]) > 1e-12 * max(a[0], b[0]):
        return a[0] < b[0]
    return (a[1], a[2]) < (b[1], b[2])


def lane_layer(misses: float, lane_ms: float, link_ms: float, offer_ms: float) -> tuple[float, float]:
    """(ms, lane experts) of one layer's misses with the lane offered: the planner's split at the two whole counts
    around `misses`, weighted to it; a step that gives the lane anything also pays offer_ms."""
    lo = math.floor(misses)
    w = misses - lo

    def at(n: int) -> tuple[float, int]:
        k, span = lane_split(n, lane_ms, link_ms)
        return span + (offer_ms if k else 0.0), k

    (t0, k0), (t1, k1) = at(lo), at(lo + 1)
    return (1 - w) * t0 + w * t1, (1 - w) * k0 + w * k1


@dataclass(frozen=True)
class ModeForecast:
    mode: str
    ms_per_token: float
    parts_ms: dict[str, float]        # gpu_step, host, store, experts: per token
    misses_per_token: float
    store_reads_per_token: float = 0.0
    lane_per_token: float = 0.0       # misses the lane computes
    lane: str = ""                    # fast modes: whether the judge would keep the lane, and why
    prestaged_per_token: float = 0.0  # misses the prestage copied ahead while the link idled

    @property
    def tok_s(self) -> float:
        return 1000 / self.ms_per_token

    def to_json(self) -> dict[str, Any]:
        return {"tok_s": round(self.tok_s, 2), "ms_per_token": round(self.ms_per_token, 3),
                "parts_ms": {k: round(v, 3) for k, v in self.parts_ms.items()},
                "misses_per_token": round(self.misses_per_token, 1),
                "store_reads_per_token": round(self.store_reads_per_token, 1),
                "lane_per_token": round(self.lane_per_token, 1), "lane": self.lane,
                "prestaged_per_token": round(self.prestaged_per_token, 1)}

    def line(self) -> str:
        parts = " + ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in self.parts_ms.items() if v)
        text = f"{self.tok_s:.1f} tok/s = 1000 / {self.ms_per_token:.1f} ms a token ({parts} ms)"
        if self.mode != "stock":
            text += f"; {self.misses_per_token:.0f} misses a token"
        if self.store_reads_per_token:
            text += f", {self.store_reads_per_token:.0f} of them read from the store"
        if self.prestaged_per_token:
            text += f", {self.prestaged_per_token:.0f} copied ahead while the link idled"
        return text + (f"; {self.lane}" if self.lane else "")


def mode_forecast(mode: str, t: Terms) -> ModeForecast:
    """One mode's decode time per token, term by term (the module docstring's formula)."""
    L = t.moe_layers
    gpu = t.gpu_step_ms.value
    if mode == "stock":
        return ModeForecast(mode, gpu, {"gpu_step": gpu}, 0.0)
    misses = t.misses
    store = 0.0
    if mode in ("nvme", "nvme-exact"):
        if t.ram_rate is None or t.store_GBps is None:
            raise ValueError(f"{mode} needs ram_rate and store_GBps")
        store = t.top_k * (1 - t.ram_rate.value)
    waste = 1.0 + (t.store_extra.value if t.store_extra is not None else 0.0)
    store_ms = store * waste * t.expert_bytes / (t.store_GBps.value * 1e9) * 1e3 if store else 0.0
    ahead = t.prestaged(store_ms)
    link = (misses - ahead) * t.link_ms
    back = max(0.0, misses * t.write_backs.value * t.link_ms - store_ms) if t.write_backs is not None else 0.0
    parts = {"gpu_step": gpu, "host": L * t.host_ms.value, "store": L * store_ms, "experts": L * link,
             "write_back": L * back}
    if mode in ("exact", "nvme-exact"):
        return ModeForecast(mode, sum(parts.values()), parts, L * misses, L * store, prestaged_per_token=L * ahead)
    if t.lane_ms is None or t.lane_offer_ms is None:
        raise ValueError(f"{mode} needs the lane's terms (lane_ms, lane_offer_ms)")
    on, k = lane_layer(misses - ahead, t.lane_decode_ms, t.link_ms, t.lane_offer_ms.value)
    base = gpu / L + t.host_ms.value + store_ms + back  # the judge times whole layer steps
    ratio = (base + on) / (base + link)
    share = k / t.top_k
    kept = ratio < 1 - MARGIN and share >= MIN_SHARE
    if kept:
        parts["experts"] = L * on
        lane = (f"lane kept: {k:.1f} of a layer's {misses:.1f} misses on it, layer steps {ratio:.3f} of the time "
                "without it")
    else:
        lane = (f"lane set aside (runs as exact): layer steps offering it would take {ratio:.3f} of the time "
                f"without it ({k:.1f} of {misses:.1f} misses a layer)")
    return ModeForecast(mode, sum(parts.values()), parts, L * misses, L * store, L * k if kept else 0.0, lane,
                        L * ahead)


@dataclass(frozen=True)
class Forecast:
    terms: Terms
    modes: dict[str, ModeForecast]
    planned: str | None = None            # the mode the plan chose
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"planned_mode": self.planned, "modes": {m: f.to_json() for m, f in self.modes.items()},
                "terms": {n: t.to_json() for n, t in self.terms.named().items()}, "notes": list(self.notes)}


def forecast(terms: Terms, modes: Sequence[str], planned: str | None = None,
             notes: Sequence[str] = ()) -> Forecast:
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"no forecast for {unknown} (modes: {', '.join(MODES)})")
    return Forecast(terms, {m: mode_forecast(m, terms) for m in modes}, planned, tuple(notes))


# ---------------------------------------------------------------- the terms from host facts and the plan


def link_term(gpu: Any) -> Term:
    """The host -> device rate: the GPU's PCIe link from host facts (80% of its nominal rate), or PCIe 3 x16."""
    if gpu is None or not gpu.pcie_gbps:
        return Term(PCIE_GBPS_UNKNOWN, "GB/s", "PCIe link unknown: assumed PCIe 3.0 x16 at 80%")
    nominal = gpu.pcie_gbps / 0.8
    return Term(gpu.pcie_gbps, "GB/s", f"PCIe {gpu.pcie_gen}.0 x{gpu.pcie_width} from host facts: 80% of its "
                                       f"nominal {nominal:.1f} GB/s (nvidia-smi reports the current link: an idle "
                                       "GPU may downshift)")


def gpu_bandwidth(name: str | None) -> int | None:
    for part, gbps in GPU_BANDWIDTH_GBPS:
        if name and part in name:
            return gbps
    return None


def gpu_step_term(gpu_name: str | None, layers: int, nbytes: float) -> Term:
    """The stock step: the slower of exllamav3's floor per decoder layer and `nbytes` (the weights a token reads
    in VRAM) at the GPU's memory bandwidth."""
    floor = layers * STOCK_FLOOR_MS_PER_LAYER
    bw = gpu_bandwidth(gpu_name)
    if bw is None:
        return Term(floor, "ms", f"{STOCK_FLOOR_SOURCE}; this GPU's memory bandwidth is not in glm53's table")
    read = nbytes / (bw * 1e9) * 1e3
    what = f"{nbytes / 1e9:.2f} GB a token read at {gpu_name}'s {bw} GB/s (spec sheet): {read:.1f} ms"
    if read >= floor:
        return Term(read, "ms", f"{what}, above {STOCK_FLOOR_SOURCE}")
    return Term(floor, "ms", f"{STOCK_FLOOR_SOURCE}; above {what}")


def lane_isa(flags: frozenset[str]) -> str | None:
    """The widest CPU-lane kernel path the CPU's flags allow (None: no AVX2/FMA/F16C)."""
    for isa, need in LANE_FLAGS.items():
        if all(f in flags for f in need) and all(f in flags for f in LANE_FLAGS["avx2"]):
            return isa
    return None


def lane_estimate(isa: str, threads: int) -> Term:
    """The lane's ms per one-row expert from host facts: the kernel's measured time on the GPU machine's Xeon at
    15 threads on this ISA, scaled to `threads` by the measured thread scaling (Amdahl, serial share LANE_SERIAL)."""
    at, ms = LANE_MEASURED[isa]

    def amdahl(n: int) -> float:
        return LANE_SERIAL + (1 - LANE_SERIAL) / max(1, n)

    value = ms * amdahl(threads) / amdahl(at)
    return Term(value, "ms", f"estimated from {threads} threads {isa.upper()}: glm53's integer kernel took {ms:g} ms "
                             f"on {at} threads of the GPU machine's 2.1 GHz Xeon (docs/results.md), scaled by its "
                             "measured thread scaling; a faster core is faster, and start-up calibrates it")


def prestage_room(dedicated_rows: int, top_k: int) -> bool:
    """Whether a plan's dedicated staging rows leave the prestage its reserved rows beside one row's demand."""
    return dedicated_rows - 2 * PRESTAGE_PER_PARITY >= top_k


def prestage_term(read: float | None = None) -> Term:
    """The prestage's saving per copy that fits in the idle link time: the fitted run's, or scaled to `read`, the
    share of its copies a run measured read by their step (fewer misses a layer: its guesses are right less often)."""
    if read is None:
        return Term(PRESTAGE_SAVED, "of the idle link time's copies", PRESTAGE_SOURCE)
    return Term(PRESTAGE_SAVED * read / PRESTAGE_READ, "of the idle link time's copies",
                f"measured in this run: {read:.2f} of its copies read by their step, against {PRESTAGE_READ} where "
                f"{PRESTAGE_SAVED} was fitted")


def lane_decode_term() -> Term:
    return Term(LANE_IN_DECODE, "x its idle time", LANE_IN_DECODE_SOURCE)


def popularity(counts: np.ndarray | None, slots: Sequence[int], experts_per_layer: int, top_k: int,
               ram_rows: int = 0) -> tuple[float, float, str]:
    """(share of picks VRAM serves, share VRAM or RAM serves, source). With saved routing statistics each layer's
    VRAM slots hold its most-picked experts and the RAM rows the most-picked of the rest; without them GLM-5.3-
    Flash's published popularity (288 experts, top-8), or picks spread evenly over the experts (any other shape)."""
    layers, total = len(slots), len(slots) * experts_per_layer
    if counts is not None and np.shape(counts) == (layers, experts_per_layer):
        share = np.asarray(counts, np.float64)
        share = share / np.maximum(share.sum(axis=1, keepdims=True), 1e-30)
        ranked = -np.sort(-share, axis=1)
        hit = float(np.mean([ranked[li, :s].sum() for li, s in enumerate(slots)]))
        rest = np.sort(np.concatenate([ranked[li, s:] for li, s in enumerate(slots)]))[::-1]
        ram = hit + float(rest[:max(0, ram_rows)].sum()) / layers
        return hit, min(1.0, ram), "saved routing statistics"
    f_vram = sum(slots) / total
    f_ram = min(1.0, (sum(slots) + max(0, ram_rows)) / total)
    if experts_per_layer == 288 and top_k == 8:
        xs, ys = zip(*GLM53_POPULARITY, strict=True)
        return (float(np.interp(f_vram, xs, ys)), float(np.interp(f_ram, xs, ys)),
                "GLM-5.3-Flash's published popularity (the hottest 11.4% of a layer's experts serve 40% of its picks, "
                "half of them 91%); no routing statistics saved")
    return f_vram, f_ram, "picks spread evenly over the experts (no routing statistics saved)"


def plan_forecast(*, gpu: Any, cpu: Any, lane_ok: bool, lane_threads: int, shape: Any, spec: Any,
                  planned: str, counts: np.ndarray | None) -> Forecast:
    """The forecast for what the plan decided: its VRAM slots per layer and RAM rows, this host's link, GPU and
    CPU. Modes: stock when every expert fits; else the planned mode and its sibling (fast and exact, or nvme and
    nvme-exact), the lane's modes only where the lane can run."""
    L, k, eb = shape.moe_layers, shape.top_k, shape.expert_bytes
    stock = spec.engine == "stock"
    slots = [shape.experts_per_layer] * L if stock else list(spec.vram_slots)
    nvme = planned in ("nvme", "nvme-exact")
    pinned = spec.ram_slots if nvme else shape.experts
    hit, served, why = (1.0, 1.0, "every expert in VRAM") if stock else \
        popularity(counts, slots, shape.experts_per_layer, k, pinned)
    nbytes = shape.always_used_bytes + L * k * hit * eb
    isa = lane_isa(cpu.flags) if lane_ok else None
    terms = Terms(
        moe_layers=L, top_k=k, expert_bytes=eb,
        hit_rate=Term(hit, "of picks", f"{sum(slots)} VRAM slots; {why}"),
        gpu_step_ms=gpu_step_term(getattr(gpu, "name", None), shape.layers, nbytes),
        host_ms=Term(0.0 if stock else HOST_MS_PER_MOE_LAYER, "ms per MoE layer",
                     "stock exllamav3: no tiered step" if stock else HOST_SOURCE),
        link_GBps=link_term(gpu),
        lane_ms=lane_estimate(isa, lane_threads) if isa else None,
        lane_offer_ms=Term(LANE_OFFER_MS, "ms per layer step", LANE_OFFER_SOURCE) if isa else None,
        lane_decode=lane_decode_term() if isa else None,
        ram_rate=Term(served, "of picks", f"{sum(slots)} VRAM slots and {pinned} RAM rows; {why}")
        if nvme else None,
        store_GBps=Term(STORE_GBPS_ASSUMED, "GB/s", "assumed: a PCIe 4.0 NVMe drive (`glm53 bench store` "
                                                     "measures this store)") if nvme else None,
        store_extra=Term(GUESS_WASTE, "of the store's demand reads", GUESS_WASTE_SOURCE) if nvme else None,
        prestage=prestage_term() if not stock and prestage_room(spec.dedicated_staging, k) else None,
        write_backs=None if stock else Term(WRITE_BACKS_PER_MISS, "a miss", WRITE_BACKS_SOURCE),
    )
    if stock:
        modes: tuple[str, ...] = ("stock",)
    elif nvme:
        modes = ("nvme", "nvme-exact") if isa else ("nvme-exact",)
    else:
        modes = ("fast", "exact") if isa else ("exact",)
    notes = ("decode of one sequence at a short history; prefill, batching and a long context's attention are "
             "not modelled",)
    if getattr(spec, "devices", ()):
        notes += (f"a layer split over {len(spec.devices)} cards is priced as the first card's link and GPU",)
    return forecast(terms, modes, planned, notes)
