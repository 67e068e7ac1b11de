"""`glm53 bench host-step --nvme`: the host's share of a decoded MoE layer step in the nvme modes.

The host side of a decode layer step costs more in the nvme modes than all-RAM, before any time blocked on disk
reads (docs/results.md): the nvme path's own bookkeeping (store reads in flight, prefetch guards, held RAM experts)
is what this measures. It packs a record store from a synthetic
expert checkpoint with the real model's counts where the bookkeeping scales with them (288 experts per layer,
top-k 8, 32 VRAM slots per layer, a RAM tier of ~0.47 of all experts as a 55 GiB cap gives the real model) but tiny
experts, opens an NvmeTier on it and replays decode steps through `MoeStepper.resolve()` followed by the next
layer's `ahead()` (the router lookahead the GPU engine runs in the nvme modes, where `MoeStepper.wants_ahead` says it
pays), guessing with a noisy copy of the next layer's real picks at the GPU engine's lookahead recall.
`ram_share` 1.0 is the whole RAM tier (`whole_ram`), every expert warmed: the case where nothing is read.

Copies are CPU copies whose tickets stay in flight until the next layer step begins, as the GPU's do (the engine
synchronises its stream before each step): with the plain CPU copier every ticket is done at issue, and the paths
that only run while copies are in flight (held RAM experts, moves landing in poll) would never run.

The time per layer step is resolve() plus ahead() plus the deferred admissions (`after_launch`, where the stepper has
it) minus the time resolve() spent blocked on store reads (`MoeStepper.host_seconds["store_wait"]`), reported
separately, as is resolve()'s own accounting (what the GPU bench's "host us / layer step" measures). The part
before launch (resolve() with what it runs inside) is what the GPU waits for; the rest runs while its kernels do.

With `--disk-ms-per-record` / `--gpu-ms-per-layer` (EmulationOptions) it also replays decode against an emulated
disk and GPU (`emulate`), to study store read scheduling on a machine whose store comes from the page cache: the
bench's emulated disk (glm53.bench.emulated_disk, a hook on the store's reads) gives every read in flight a share of one fixed rate,
set so that one of the bench store's (tiny) records takes the given ms, as a 9 MiB record takes ~6 ms on the GPU
machine's rate-capped disk; and after each layer step's launch the emulated GPU is busy for the given ms before the
next layer's router output exists (a sleep, while the host's work after launch and the store's reads go on). What
it reports is wall time per decode step (bsz tokens), store waits and GPU sleeps included, the store's busy share
and the guesses' fate, for the reader and stepper the engine runs (an earlier design to compare with runs from its own
commit's tree: `--baseline REV`).
"""

from __future__ import annotations

import cProfile
import inspect
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

EXPERT_HIDDEN = 16  # tiny experts: the bookkeeping does not depend on their size, the store's size and pack time do
EXPERT_INTER = 16
RANK_SPREAD = 0.45  # how much surer of its best guesses the lookahead is than of its last (0.80 .. 0.35 around 0.575)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostStepNvmeOptions:
    # RAM tier records as a share of all experts (55 GiB of the real model's 117 GiB); 1.0: the whole tier (whole_ram)
    ram_share: float = 0.47
    recall: float = 0.575  # mean share of a row's real picks the GPU engine's lookahead guesses
    store_threads: int = 4  # the store reader's threads (the plan's default)


@dataclass(frozen=True)
class EmulationOptions:
    """The emulated disk and GPU of `emulate` (0: not emulated)."""

    disk_ms_per_record: float = 0.0  # one record read alone takes this long (GPU machine: ~6 ms for 9 MiB)
    gpu_ms_per_layer: float = 0.0  # the GPU's time from a layer step's launch to the next router output (~0.6 ms)
    runs: int = 3  # timed runs of each reader, alternating

    @property
    def on(self) -> bool:
        return self.disk_ms_per_record > 0 or self.gpu_ms_per_layer > 0


SETTLE_STEPS = 10  # warm-up steps run emulated, after the rest at the page cache's speed


class StoreFixture:
    """A synthetic expert checkpoint and its packed store in a temporary directory, removed on close."""

    def __init__(self, layers: int, experts: int, seed: int):
        from store.pack import PackOptions, pack_store
        from store.synth import write_expert_checkpoint

        self.root = Path(tempfile.mkdtemp(prefix="glm53-host-bench-nvme-"))
        try:
            # One dense layer first, as the real model: the store numbers its MoE layers 1..layers.
            self.checkpoint = write_expert_checkpoint(self.root / "ck", hidden=EXPERT_HIDDEN,
                                                      moe_intermediate=EXPERT_INTER, layers=layers + 1,
                                                      experts=experts, mtp_layers=0, seed=seed)
            self.store = self.root / "experts.glm53"
            pack_store(PackOptions(self.checkpoint, self.store, threads=2, progress=False, verify=False),
                       log=lambda m: None)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> StoreFixture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def guesses(trace: np.ndarray, num_experts: int, recall: float, seed: int) -> np.ndarray:
    """A lookahead's guesses of a layer's picks, (steps, rows, k) like `trace`: rank r keeps the real pick with a
    probability falling with r around `recall` (a router run one layer early is surest of its best picks), else
    names an expert the row did not pick, drawn by how often the layer picks it (a near miss is a popular expert)."""
    rng = np.random.default_rng(seed)
    k = trace.shape[-1]
    keep_p = np.clip(recall + RANK_SPREAD * (0.5 - np.arange(k) / max(1, k - 1)), 0.0, 1.0)
    popularity = np.bincount(trace.ravel(), minlength=num_experts) + 1.0
    popularity /= popularity.sum()
    out = trace.copy()
    for t, row, r in zip(*np.nonzero(rng.random(trace.shape) >= keep_p), strict=True):
        taken = set(trace[t, row].tolist()) | set(out[t, row].tolist())
        e = int(rng.choice(num_experts, p=popularity))
        while e in taken:
            e = int(rng.choice(num_experts, p=popularity))
        out[t, row, r] = e
    return out


@dataclass
class NvmeRig:
    tier: Any
    stepper: Any
    copier: Any
    traces: list[np.ndarray]  # per layer: (steps, rows, k) picks
    guesses: list[np.ndarray]  # per layer: the lookahead's (steps, rows, k) guesses of those picks

    def close(self) -> None:
        self.tier.close()


def build(opts: Any, nopts: HostStepNvmeOptions, store: Path, bsz: int,
          prefetch_at_once: int | None = None) -> NvmeRig:
    """The nvme tier on `store` warmed from the routing of a first stretch of the trace (as saved statistics warm a
    real start), its stepper as the engine makes it in the nvme modes, and the trace and guesses to replay.
    prefetch_at_once: the guess reads under way at once, as open_nvme_tier calibrates it (None: the reader's default)."""
    from glm53.bench.copiers import StepCopier
    from glm53.bench.routing_trace import zipf_trace
    try:
        from glm53.step.stepper import MoeStepper
    except ImportError:  # a baseline tree from before glm53/step (`--baseline-driver this`)
        from glm53.engine.moe_step import MoeStepper
    from glm53.tiers.nvme import NvmeTier
    from store.reader import StoreReader

    total = opts.layers * opts.experts
    vram = [opts.slots] * opts.layers
    whole = nopts.ram_share >= 1.0
    ram = whole_ram(opts) if whole else max(opts.experts + 1, min(total - sum(vram), round(nopts.ram_share * total)))
    n = (opts.warmup + opts.steps) * bsz
    traces = [zipf_trace(n, opts.experts, opts.top_k, exponent=opts.zipf, locality=opts.locality,
                         seed=opts.seed * 1000 + li).reshape(-1, bsz, opts.top_k) for li in range(opts.layers)]
    guessed = [guesses(t, opts.experts, nopts.recall, opts.seed * 1000 + 500 + li) for li, t in enumerate(traces)]
    counts = np.stack([np.bincount(t[: max(1, opts.warmup)].ravel(), minlength=opts.experts) for t in traces])
    copier = StepCopier()
    # Buffered reads where the filesystem refuses O_DIRECT (tmpfs): the time blocked on reads is not measured here.
    reader = StoreReader(store, threads=nopts.store_threads, allow_buffered=True, verify=True, warn=log.debug,
                         **({} if prefetch_at_once is None else {"prefetch_at_once": prefetch_at_once}))
    tier = NvmeTier(reader, opts.experts, vram, ram, copier=copier, staging_slots=opts.staging, pin=False)
    try:
        # The whole tier starts with every expert (a tier that has served a while has read each once): none the
        # warm-up did not pick is left to be read in the timed steps.
        tier.warm(np.maximum(counts, 0.5) if whole else counts)
        stepper = MoeStepper(tier.tiers, vram, opts.staging, nvme=tier)
    except BaseException:
        tier.close()
        raise
    return NvmeRig(tier, stepper, copier, traces, guessed)


def whole_ram(opts: Any) -> int:
    """The RAM tier the plan sizes when the cap holds every expert outside VRAM (glm53.planning.plan): those, the
    admissions' spare rows and the rows each decode step keeps free, so that nothing is read from the store once
    warm (a tier of exactly the outside experts keeps dropping ones it reads again)."""
    from glm53.planning.spec import FREE_RAM_SLOTS, RAM_SPARE_OF_TOP_K

    return opts.layers * (opts.experts - opts.slots) + RAM_SPARE_OF_TOP_K * opts.top_k + FREE_RAM_SLOTS


def replay(rig: NvmeRig, steps: range, times: dict[str, list[float]] | None = None, gpu_s: float = 0.0) -> None:
    """Decode steps in model order as the engine runs each: resolve() and the next layer's lookahead at the seam,
    then, once the expert kernels are queued, the stepper's `after_launch` where it has one (the deferred
    admissions). times: per layer step, appended to "host" (all three, less store_wait), "before_launch" (what
    the GPU waits for: resolve() with whatever it ran inside, less store_wait), "resolve" (its plan seconds, less
    the lookahead it ran inside), "ahead" (wherever it ran), "after_launch" and "store_wait". gpu_s: an emulated
    GPU, busy that long from each launch (the end of resolve()) until the next layer's router output exists: the
    next step waits for it (the work after launch runs meanwhile)."""
    clock = time.perf_counter
    stepper, copier = rig.stepper, rig.copier
    after_launch = getattr(stepper, "after_launch", None)  # a stepper from before deferred admissions has none
    # The engine queues the lookahead's reads inside resolve(), behind the step's own; an earlier commit's stepper
    # (--baseline) takes them after it.
    inside = "read_ahead" in inspect.signature(stepper.resolve).parameters
    # The engine asks whether to guess the next layer at all before running its router; an earlier commit's stepper
    # guesses at every step.
    wants = getattr(stepper, "wants_ahead", None)
    spent = stepper.host_seconds
    last = len(rig.traces) - 1
    during_resolve = [False]
    for t in steps:
        for li, trace in enumerate(rig.traces):
            copier.step_begins()  # the engine synchronised its stream: the copies of the steps before have landed
            plan0, wait0 = spent["plan"], spent["store_wait"]
            ahead_s = ahead_inside = 0.0

            def read_ahead(busy: Any, li: int = li, t: int = t) -> None:
                nonlocal ahead_s, ahead_inside
                a0 = clock()
                stepper.ahead(li + 1, rig.guesses[li + 1][t], busy=busy)
                ahead_s += clock() - a0
                if during_resolve[0]:
                    ahead_inside += clock() - a0

            during_resolve[0] = True
            t0 = clock()
            guess = li < last and (wants is None or wants(li + 1))
            if inside and guess:
                step = stepper.resolve(li, trace[t], decode=True, read_ahead=read_ahead)
            else:
                step = stepper.resolve(li, trace[t], decode=True)
                during_resolve[0] = False  # an older stepper's lookahead, called after resolve() returned
                if guess and not inside:
                    read_ahead(step.cpu)
            t2 = clock()
            during_resolve[0] = False  # a stepper may start the reads ahead after launch (no store read to wait for)
            if after_launch is not None:
                after_launch()
            t3 = clock()
            if gpu_s > 0:
                _busy_until(t2 + gpu_s)
            if times is not None:
                waited = spent["store_wait"] - wait0
                times["host"].append(t3 - t0 - waited)
                times["before_launch"].append(t2 - t0 - waited)
                # resolve()'s own accounting includes the lookahead when it runs inside: report it apart.
                times["resolve"].append(spent["plan"] - plan0 - ahead_inside)
                times["ahead"].append(ahead_s)
                times["after_launch"].append(t3 - t2)
                times["store_wait"].append(waited)


def _busy_until(deadline: float) -> None:
    """Wait for perf_counter() to reach `deadline`: a sleep (which overshoots by ~0.1 ms), then a short spin."""
    left = deadline - time.perf_counter()
    if left > 3e-4:
        time.sleep(left - 2e-4)
    while time.perf_counter() < deadline:
        pass


def profile(rig: NvmeRig, steps: range) -> tuple[cProfile.Profile, float]:
    """A profiled replay; returns the profile and the seconds resolve() was blocked on store reads in it."""
    wait0 = rig.stepper.host_seconds["store_wait"]
    prof = cProfile.Profile()
    prof.enable()
    replay(rig, steps)
    prof.disable()
    return prof, rig.stepper.host_seconds["store_wait"] - wait0


def _us(xs: list[float]) -> dict:
    us = np.asarray(xs) * 1e6
    return {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90)), "mean_us": float(us.mean())}


def measure(opts: Any, nopts: HostStepNvmeOptions, store: Path, bsz: int,
            breakdown: Any) -> dict:
    """One batch size: the timed replay's figures, and `breakdown(profile, blocked, rows)` of a profiled replay of
    the same steps on a fresh rig (the profiler's overhead never touches the timings)."""
    rig = build(opts, nopts, store, bsz)
    try:
        replay(rig, range(opts.warmup))
        snap0, la0 = rig.tier.stats.snapshot(), rig.stepper.snapshot()["lookahead"]
        times: dict[str, list[float]] = {"host": [], "before_launch": [], "resolve": [], "ahead": [],
                                         "after_launch": [], "store_wait": []}
        replay(rig, range(opts.warmup, opts.warmup + opts.steps), times)
        snap1, la1 = rig.tier.stats.snapshot(), rig.stepper.snapshot()["lookahead"]
        direct = bool(rig.tier.reader.direct)
        deferred = getattr(rig.stepper, "after_launch", None) is not None
    finally:
        rig.close()
    rig = build(opts, nopts, store, bsz)
    try:
        replay(rig, range(opts.warmup))
        prof, blocked = profile(rig, range(opts.warmup, opts.warmup + opts.steps))
    finally:
        rig.close()
    n = len(times["host"])
    run = {"bsz": bsz, "layer_steps": n, **_us(times["host"]), "hit_rate": _delta_rate(snap0, snap1),
           "before_launch": _us(times["before_launch"]), "resolve": _us(times["resolve"]), "ahead": _us(times["ahead"]),
           "store_wait": {**_us(times["store_wait"]), "steps_waiting": sum(1 for w in times["store_wait"] if w > 0)},
           "store": _store_figures(snap0, snap1, n), "lookahead_recall": _recall(la0, la1), "direct_io": direct,
           "breakdown": breakdown(prof, blocked)}
    if deferred:  # a stepper from before deferred admissions makes them inside resolve()
        run["after_launch"] = _us(times["after_launch"])
    return run


def _delta_rate(snap0: dict, snap1: dict) -> float | None:
    hits = snap1["picks"]["vram_hit"] - snap0["picks"]["vram_hit"]
    total = snap1["picks"]["total"] - snap0["picks"]["total"]
    return hits / total if total else None


def _store_figures(snap0: dict, snap1: dict, layer_steps: int) -> dict:
    """Per layer step: store reads (demand, prefetch), picks read from the store, and the prefetch's counters."""
    nv0, nv1 = snap0["nvme"], snap1["nvme"]
    pf0, pf1 = snap0["prefetch"], snap1["prefetch"]
    per = max(1, layer_steps)
    return {"demand_reads_per_step": (nv1["reads"] - nv0["reads"]) / per,
            "prefetch_reads_per_step": (nv1["prefetch_reads"] - nv0["prefetch_reads"]
                                        - nv1["cancelled_prefetches"] + nv0["cancelled_prefetches"]) / per,
            "store_picks_per_step": (snap1["picks"]["nvme"] - snap0["picks"]["nvme"]) / per,
            "prefetch": {k: pf1[k] - pf0[k]
                         for k in ("issued", "hits", "late", "late_under_way", "wasted", "demand_misses")}}


def _recall(la0: dict, la1: dict) -> float | None:
    picks = la1["picks"] - la0["picks"]
    return (la1["hits"] - la0["hits"]) / picks if picks else None


# ---- an emulated disk and GPU ------------------------------------------------------------------------------------


def emulated_rate(store: Path, disk_ms_per_record: float) -> tuple[float, int]:
    """(seconds per byte, record bytes): the emulated disk's rate that makes one of the store's records (their mean
    extent: the bench's are all one size) take `disk_ms_per_record` ms read alone; 0 for 0."""
    from store.format import read_header

    extents = [e.extent for e in read_header(store).entries]
    record = round(sum(extents) / len(extents))
    return (disk_ms_per_record * 1e-3 / record if disk_ms_per_record > 0 else 0.0), record


def emulated_run(opts: Any, nopts: HostStepNvmeOptions, emu: EmulationOptions, store: Path, bsz: int) -> dict:
    """One timed replay on the emulated disk and GPU, the guess reads' cap calibrated as open_nvme_tier does (on the
    emulated disk). Warm-up at the page cache's speed, its last SETTLE_STEPS steps emulated (the tier's load
    settles to the disk's); then the timed steps, emulated."""
    from glm53.bench.emulated_disk import emulated_disk
    from glm53.tiers.nvme_open import calibrate_prefetch
    from store.format import read_header

    rate, _ = emulated_rate(store, emu.disk_ms_per_record)
    gpu_s = emu.gpu_ms_per_layer * 1e-3
    with emulated_disk(rate):
        at_once, gain = calibrate_prefetch(store, read_header(store), True, 1, nopts.store_threads)
    rig = build(opts, nopts, store, bsz, at_once)
    try:
        settle = min(SETTLE_STEPS, opts.warmup)
        replay(rig, range(opts.warmup - settle))
        busy = getattr(rig.tier.reader, "busy_seconds", None)
        with emulated_disk(rate):
            replay(rig, range(opts.warmup - settle, opts.warmup), gpu_s=gpu_s)
            snap0, busy0 = rig.tier.stats.snapshot(), busy() if busy else None
            times: dict[str, list[float]] = {"host": [], "before_launch": [], "resolve": [], "ahead": [],
                                             "after_launch": [], "store_wait": []}
            t0 = time.perf_counter()
            replay(rig, range(opts.warmup, opts.warmup + opts.steps), times, gpu_s=gpu_s)
            wall = time.perf_counter() - t0
            snap1, busy1, load = rig.tier.stats.snapshot(), busy() if busy else None, rig.tier.load()
            saving, floor = rig.tier.guess_saving(), rig.stepper.guess_floor
            at_once = getattr(rig.tier.reader, "prefetch_at_once", None)
    finally:
        rig.close()
    n = opts.steps
    store_figs = _store_figures(snap0, snap1, len(times["host"]))
    layers = len(times["host"]) / max(1, n)
    return {"step_ms": wall / n * 1e3, "store_wait_ms": sum(times["store_wait"]) / n * 1e3,
            "host_ms": sum(times["before_launch"]) / n * 1e3, "gpu_ms": gpu_s * layers * 1e3,
            "store_busy": None if busy is None else (busy1 - busy0) / wall, "store_load": load,
            "prefetch_at_once": at_once, "two_at_once_gain": gain, "guess_saving": saving, "guess_floor": floor,
            "demand_reads": store_figs["demand_reads_per_step"] * layers,
            "prefetch_reads": store_figs["prefetch_reads_per_step"] * layers,
            "guesses": {k: v / n for k, v in store_figs["prefetch"].items()}}


def emulate(opts: Any, nopts: HostStepNvmeOptions, emu: EmulationOptions, store: Path, bsz: int) -> dict:
    """The engine's reader and stepper on the emulated disk and GPU, `emu.runs` runs: the runs' mean figures (step_ms: wall ms per decode step of bsz tokens, store waits and
    GPU time included; of it store_wait_ms, host_ms (the host's work before each launch, store waits not counted:
    the work after launch overlaps the GPU's) and gpu_ms (the emulated GPU's, as set); store_busy: the share of the
    step time the store had a read under way; store_load: the tier's own measure of it, as the lookahead sees it at
    the end; guess_saving and guess_floor at the end; demand and guess reads per step; guesses per step: issued, in
    time (hits), late (of them under way), wasted, and demand misses)."""
    rate, record = emulated_rate(store, emu.disk_ms_per_record)
    runs = [emulated_run(opts, nopts, emu, store, bsz) for _ in range(max(1, emu.runs))]
    return {"disk_ms_per_record": emu.disk_ms_per_record, "gpu_ms_per_layer": emu.gpu_ms_per_layer,
            "record_bytes": record, "seconds_per_byte": rate, "runs": max(1, emu.runs), "steps": opts.steps,
            "readers": {"default": _mean_run(runs)}}


def _mean_run(runs: list[dict]) -> dict:
    """The mean of each figure over runs (None where a run has none), guesses by key."""

    def mean(xs: list) -> Any:
        return None if any(x is None for x in xs) else float(np.mean(xs))

    out = {k: mean([r[k] for r in runs]) for k in runs[0] if k != "guesses"}
    out["guesses"] = {k: mean([r["guesses"][k] for r in runs]) for k in runs[0]["guesses"]}
    out["step_ms_runs"] = [r["step_ms"] for r in runs]
    return out
