"""`glm53 bench decode`: decode speed of the tiered modes next to stock exllamav3 and the PCIe bound, in one run.

One process loads the same full-width synthetic checkpoint once per mode: stock exllamav3 with every routed
expert in VRAM (the upper bound), and each tiered mode (`--modes`: exact, fast, nvme-exact, nvme) with a 24 GB
card's share of expert slots (the rest in the pinned RAM tier, or the record store with RAM as its cache). Decode
windows rotate through the modes (interleaved, never compared across runs). An earlier design is compared by
running its commit's code side by side (`--baseline REV`: glm53.bench.decode_baseline), not as a mode here. All sample with the same seed, so the exact modes
generate the same tokens as stock and route the same experts (fast mode is near-exact and may drift). The PCIe
bound is
    t_bound = (bytes that crossed host -> device per decoded token) / (measured pinned H2D rate) + t_stock,
i.e. what exact mode would take if every miss cost only its transfer at full PCIe speed on top of the all-in-VRAM
step. Stock `moe_cpu_split` is not run here: on the GPU machine every call into exllamav3's CPU MoE code
segfaults (docs/results.md), so it dies at load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from glm53.bench.emulate import CARD_FRACTION, Emulation, h2d_rate

SKEW = (0.11, 0.40)
REAL_MOE_LAYERS = 42  # GLM-5.3-Flash's: a fixture's misses per token scaled to the real depth


def register_bench(bench_sub: Any) -> None:
    p = bench_sub.add_parser("decode", help="exact-mode decode tok/s vs stock exllamav3 (all in VRAM) and the PCIe "
                                            "bound, on a full-width synthetic checkpoint (GPU)")
    p.add_argument("--model", metavar="DIR", help="existing EXL3 checkpoint (default: write a synthetic one)")
    p.add_argument("--moe-layers", type=int, default=8, help="MoE layers of the synthetic checkpoint (default 8)")
    p.add_argument("--skew", default=f"{SKEW[0]},{SKEW[1]}",
                   help="router skew: fraction of experts drawing a fraction of picks (default 0.11,0.40)")
    p.add_argument("--slots", type=int, help=f"VRAM slots per MoE layer (default {CARD_FRACTION * 100:.0f}%% of experts)")
    p.add_argument("--tokens", type=int, default=128, help="decoded tokens per window (default 128)")
    p.add_argument("--windows", type=int, default=2, help="A/B window pairs (default 2)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length, also timed as prefill (default 512)")
    p.add_argument("--work", metavar="DIR", help="where to write the synthetic checkpoint (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and store under --work, and "
                   "reuse them from there on the next run of the same shape (a warm GPU machine keeps /tmp)")
    p.add_argument("--modes", default="exact,fast",
                   help="tiered modes to run next to stock (default exact,fast; also nvme-exact, nvme)")
    p.add_argument("--cpu-threads", type=int, help="CPU-lane threads in fast mode (default: physical cores - 1)")
    p.add_argument("--ram-fraction", type=float, default=RAM_55G,
                   help=f"nvme modes: RAM tier share of all experts (default {RAM_55G}, what a 55 GiB cap gives the "
                        f"real model; 16 GiB gives {RAM_16G}). The store is packed from the checkpoint into --work")
    p.add_argument("--store-dir", metavar="DIR", help="nvme modes: pack the store in DIR, not --work (e.g. /dev/shm: "
                   "a RAM-backed store, read buffered where the filesystem refuses O_DIRECT, stands in for a disk "
                   "array far faster than this machine's)")
    p.add_argument("--emulate-disk-GBps", type=float, metavar="R",
                   help="nvme modes: read the store through an emulated disk of R GB/s (every read's bytes take their "
                        "time at R on one timeline all reads share; with --store-dir /dev/shm, what a drive of that "
                        "rate would give this engine); the own bound then uses R")
    p.add_argument("--devices", type=int, default=1, metavar="N",
                   help="also run each mode with the layers split across cuda:0..N-1, each card holding as many "
                        "expert slots as the one card (N x --slots per layer), paired with the one-card run "
                        "(default 1: no split)")
    from glm53.bench.emulate import add_arguments

    add_arguments(p)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="tokens each tiered mode decodes before the windows (default 16: the tiers start nearly "
                        "cold; a server's start warm from saved routing statistics)")
    p.add_argument("--profile", metavar="MODE", help="after the windows, decode one more window of MODE under "
                   "cProfile and print where the host's time went (the top functions by own time); with --json, the "
                   "whole profile is saved beside it (.prof)")
    p.add_argument("--host-delay-us", type=float, default=0, metavar="US",
                   help="also run the first mode with US more host time in every layer step (a busy wait before its "
                        "planning), windows paired with it: how much of each host microsecond reaches the token, "
                        "which says what taking the host out of the step could save (default 0: not run)")
    p.add_argument("--baseline", metavar="REV",
                   help="also run REV's code (a git worktree of it) on the same checkpoint, windows alternating "
                        "between this code and REV's, each in its own process; reports this / REV decode tok/s per "
                        "mode, the median of paired windows (glm53.bench.decode_baseline)")
    p.add_argument("--baseline-windows", type=int, default=4, metavar="N",
                   help="--baseline: paired windows, each one run of this code and one of REV's (default 4); with "
                        "--keep --work, windows already run there are reused")
    p.add_argument("--baseline-tree", metavar="DIR",
                   help="--baseline: REV's code unpacked in DIR (git archive REV | tar -x -C DIR), where this copy "
                        "has no git history (the GPU machine)")
    p.set_defaults(func=cmd_bench_decode)




MODES = ("exact", "fast", "nvme-exact", "nvme")
LANE_MODES = ("fast", "nvme")  # the modes that run the CPU lane
RAM_55G, RAM_16G = 0.47, 0.125  # RAM tier share of the real model's experts under a 55 / 16 GiB cap (bench nvme)


def window_line(w: int, name: str, prompt_tokens: int, res: dict) -> str:
    """One window's log line: speeds, and for a tiered mode its traffic, host time and store share."""
    line = (f"window {w} {name}: prefill {prompt_tokens} tok in {res['prefill_s']:.3f} s, decode "
            f"{res['decode_tok_s']:.1f} tok/s")
    if name != "stock":
        line += (f", hit rate {res['hit_rate']:.3f}, cpu picks {res['picks']['cpu']}, "
                 f"{res['h2d_bytes_per_token'] / 2**20:.0f} MiB/token H2D, "
                 f"{res['d2h_bytes_per_token'] / 2**20:.0f} MiB/token D2H, host "
                 f"{res['host_us_per_layer_step']:.0f} us/layer step; host ms/token "
                 + " ".join(f"{k} {v:.2f}" for k, v in res["host_ms_per_token"].items()))
    if "disk_Bps" in res:
        line += (f", {res['store_bytes_per_token'] / 2**20:.0f} MiB/token from the store "
                 f"({res['store_bytes_per_token'] / res['disk_Bps'] * res['decode_tok_s']:.2f} of the disk's "
                 f"time at the {res['disk_Bps'] / 1e9:.2f} GB/s it gave beside this window)")
    return line


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def own_bound_beside(rows: list[dict], mode: str, h2d_Bps: float) -> dict:
    """An nvme mode's speed over its own bound, window by window: the slower of the GPU side (stock's step in the
    same window plus this window's PCIe bytes at the pinned rate) and the disk (this window's store bytes at the
    raw rate measured beside it), lanes overlapping perfectly. The median of the windows' ratios, as paired_ratio
    takes, and the mean bound and disk rate for the report.

    Also the same speed over the two lanes one after the other (their sum): about what a token takes when a store
    read starts only once its layer's router has run and only that layer's PCIe copies overlap it. Near 1, the
    overlap left to win is what guesses read a layer or more ahead can give."""
    stock = {x["window"]: x["decode_tok_s"] for x in rows if x["name"] == "stock"}
    ratios, series, bounds, disks = [], [], [], []
    for x in rows:
        if x["name"] != mode or "disk_Bps" not in x or not stock.get(x["window"]):
            continue
        gpu_s = 1 / stock[x["window"]] + x["h2d_bytes_per_token"] / h2d_Bps
        disk_s = x["store_bytes_per_token"] / x["disk_Bps"]
        ratios.append(x["decode_tok_s"] * max(gpu_s, disk_s))
        series.append(x["decode_tok_s"] * (gpu_s + disk_s))
        bounds.append(1 / max(gpu_s, disk_s))
        disks.append(x["disk_Bps"])
    mean = (lambda v: sum(v) / len(v)) if ratios else (lambda v: float("nan"))
    return {"over_own_bound": _median(ratios), "over_lanes_in_series": _median(series),
            "bound_beside_tok_s": mean(bounds), "disk_GBps_beside": mean(disks) / 1e9}


def _disk_beside(mode: dict, start_Bps: float | None) -> float | None:
    """The store's raw rate for a mode's forecast: measured beside its windows where it was (a virtual disk drifts
    within a run), else at the start."""
    beside = mode.get("disk_GBps_beside")
    return beside * 1e9 if beside is not None and math.isfinite(beside) and beside > 0 else start_Bps


def prefill_store(rows: list[dict], mode: str) -> dict:
    """An nvme mode's prompts and the store, over its windows: MiB read from the store per prompt, the disk's busy
    share of the prefill, and prefill tok/s over the bound the disk alone sets (the prompt's store bytes at the raw
    rate measured beside the window), the median of windows. Near 1: the prompt is read as fast as the disk reads;
    well under it with the disk idle much of the time: the reads wait on each other or on the GPU."""
    got = [x for x in rows if x["name"] == mode and "prefill_store_bytes" in x]
    if not got:
        return {}
    ratios = [x["prefill_store_bytes"] / x["disk_Bps"] / x["prefill_s"]  # the disk's time for the bytes / the time
              for x in got if x.get("disk_Bps") and x["prefill_store_bytes"]]
    return {"MiB": sum(x["prefill_store_bytes"] for x in got) / len(got) / 2**20,
            "busy": sum(x["prefill_store_busy"] for x in got) / len(got),
            "over_disk_bound": _median(ratios) if ratios else float("nan")}


def _disk_probe(store: Path, records: int = 96, threads: int = 8):
    """A callable giving the store disk's raw random-read rate (bytes/s) now, over a fresh random sample of records
    each time (no pass re-reads what a disk cache may hold from the last)."""
    import random

    from glm53.bench.nvme import raw_pass
    from store.format import read_header

    keys, rng = sorted(read_header(store).index), random.Random(2)
    return lambda: raw_pass(store, rng.sample(keys, min(len(keys), records)), threads)


def _disk_as_it_is(emulated_Bps: float | None) -> Any:
    """A block in which the emulated disk (if the bench turned it on) is off."""
    if not emulated_Bps:
        return contextlib.nullcontext()
    from glm53.bench.emulated_disk import emulated_disk

    return emulated_disk(0.0)


def _lone_record(ms_by_pieces: dict) -> str:
    """The report's clause on one record read alone (none where the disk is emulated: its rate says it)."""
    if not ms_by_pieces:
        return ""
    return "; one record alone: " + ", ".join(f"{t:.2f} ms in {n} piece(s)" for n, t in ms_by_pieces.items())


def _store_reads(buffered: bool, emulated_Bps: float | None) -> str:
    if emulated_Bps:
        return "emulated (one fixed-rate timeline over the store's real reads)"
    return "buffered" if buffered else "O_DIRECT"


def paired_ratio(rows: list[dict], mode: str, ref: str) -> float:
    """Median over windows of mode's decode speed over ref's in the same window. Windows interleave the modes,
    and the whole machine's speed drifts between windows (stock alone by up to a quarter): a ratio within
    a window cancels that drift, a ratio of means does not."""
    speed = {(x["name"], x["window"]): x["decode_tok_s"] for x in rows}
    ratios = sorted(speed[(mode, w)] / speed[(ref, w)] for (name, w) in speed
                    if name == mode and (ref, w) in speed and speed[(ref, w)] > 0)
    if not ratios:
        return float("nan")
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def delay_planning(stepper: Any, us: float) -> None:
    """Make every layer step of this stepper spend `us` more on the host, a busy wait before its planning, as a
    slower host would (the probe of `host_probe`)."""
    plan = stepper.resolve

    def slower(*args: Any, **kwargs: Any) -> Any:
        end = time.perf_counter() + us / 1e6
        while time.perf_counter() < end:
            pass
        return plan(*args, **kwargs)

    stepper.resolve = slower


def host_probe(rows: list[dict], mode: str, probe: str, us: float, layer_steps: int) -> dict:
    """What `us` more host time in each of a token's `layer_steps` did to the token, window by window against the
    plain mode: the paired speed ratio and the share of the added host time that the token took longer by (1: every
    host microsecond reaches the token, so the host is on the step's critical path; 0: it hides behind the device)."""
    speed = {(x["name"], x["window"]): x["decode_tok_s"] for x in rows}
    shares = sorted((1 / speed[(probe, w)] - 1 / speed[(mode, w)]) / (us * 1e-6 * layer_steps)
                    for (name, w) in speed if name == probe and (mode, w) in speed)
    mid = len(shares) // 2
    share = float("nan") if not shares else shares[mid] if len(shares) % 2 else (shares[mid - 1] + shares[mid]) / 2
    return {"mode": mode, "delay_us": us, "paired_over_plain": paired_ratio(rows, probe, mode),
            "added_host_ms_per_token": us * layer_steps / 1e3, "critical_share": share}


class _Releases:
    """What one job's streamed results say of its tokens and times. exllamav3 releases a job's tokens in batches: it
    holds them while their text ends in an incomplete character (multi-byte text, a byte-level tokenizer), and an
    ending job's last tokens (a stop token among them) come in the final result's "held". So tokens are counted from
    each result's token_ids and the final result's counts, never one per result: the decode is timed from the first
    release to the last, over the tokens sampled after the first release's."""

    def __init__(self, t0: float, snapshot: Any):
        self.t0, self.snapshot = t0, snapshot
        self.ids: list[int] = []
        self.first = self.last = None
        self.first_count = 0  # tokens out by the first release: sampled before the decode's clock starts
        self.snap0: Any = None
        self.final: Any = None  # the job's last result (glm53.exl3.events.Tokens)

    def add(self, ev: Any) -> None:
        """One of the job's events (glm53.exl3.events): only its Tokens count."""
        from glm53.exl3.events import Tokens

        if not isinstance(ev, Tokens):
            return
        got = ev.token_ids
        if got:
            now = time.perf_counter()
            if self.first is None:
                self.first, self.first_count, self.snap0 = now, len(got), self.snapshot()
            self.ids += got
            self.last = now
        if ev.ended:
            if ev.held is not None:
                self.ids += ev.held
            self.final = ev
            if self.first is None:  # nothing released before the end: one release, untimed decode
                self.first = self.last = time.perf_counter()
                self.first_count, self.snap0 = len(self.ids), self.snapshot()

    def done(self) -> tuple[list[int], float, float, int, Any]:
        """(token ids, first release time, last release time, tokens decoded in between, the snapshot at the first)."""
        if self.final is None:
            raise RuntimeError("the job ended without a final result (eos)")
        said = self.final.times.new_tokens
        total = len(self.ids) if said is None else said
        return self.ids, self.first, self.last, max(0, total - self.first_count), self.snap0

    def prefill_s(self) -> float:
        """Enqueue to the first token; where the first release held several tokens, exllamav3's own prefill time
        (when it gives one), as the release came only after those tokens' decode steps."""
        reported = self.final.times.prefill_s if self.final else 0.0
        return reported if self.first_count > 1 and reported > 0 else self.first - self.t0


JUDGE_LIMIT_TOKENS = 2048  # warm-up tokens a lane mode decodes at most for its judge's first verdict


class _Runner:
    """One loaded model (stock, or a tiered mode) with its generator."""

    def __init__(self, model_dir: Path, slots: int | None, cache_tokens: int, mode: str = "exact",
                 cpu_threads: int | None = None, store_tier: StoreTier | None = None, cards: int = 1,
                 pacer: Any = None, lane_isas: Sequence[str] | None = None):
        from glm53.exl3.placement import place_layers
        from glm53.exl3.runtime import Runtime
        from glm53.exl3.tiered import TieredMoE

        t0 = time.perf_counter()
        self.runtime = rt = Runtime.open(model_dir)
        self.model = rt.build_model()
        rt.build_cache(-(-cache_tokens // 256) * 256)  # whole KV pages
        self.tiered = spec = None
        if slots is not None:
            spec = bench_spec(model_dir, mode, slots, cache_tokens, cpu_threads, store_tier, cards)
            self.tiered = TieredMoE(self.model, model_dir, spec, counts=ram_holds_all(model_dir, spec),
                                    nvme_open=store_tier.opener(model_dir, spec) if spec.nvme else None)
            self.tiered.install()
        rt.tiered = self.tiered
        unplace = place_layers(self.model, spec) if spec is not None else (lambda: None)
        try:
            rt.load_weights("cuda:0")
        finally:
            unplace()
        if self.tiered is not None:
            self.tiered.populate()
            from glm53.bench.emulate import Emulation, tiers_hook

            # After the load's copies, before the lane times the link: what the engine's on_tiers does in serving.
            tiers_hook(Emulation(lane_isas=tuple(lane_isas) if lane_isas else None), pacer)(self.tiered)
            if self.tiered.spec.lane:
                self.tiered.start_lane(self.tiered.spec.cpu_threads)
        rt.build_generator(max_batch_size=1)
        self.load_s = time.perf_counter() - t0

    def run(self, prompt: list[int], tokens: int, seed: int) -> dict:
        """One job: prefill time, decode tok/s (first to last token), and the tier counters over the decode."""
        before = self.tiered.snapshot() if self.tiered is not None else None  # the prompt's store reads
        t0 = time.perf_counter()
        timing = _Releases(t0, lambda: self.tiered.snapshot() if self.tiered else None)

        def on_step(events: list) -> None:
            for ev in events:
                timing.add(ev)

        self.runtime.run([prompt], tokens, temperature=1.0, seed=seed, on_step=on_step)
        ids, first, last, n, snap0 = timing.done()
        out = {"prefill_s": timing.prefill_s(), "tokens": ids, "decoded_tokens": n,
               "decode_tok_s": n / (last - first) if n > 0 and last > first else float("nan")}
        if self.tiered is not None:
            snap1 = self.tiered.snapshot()
            n = max(1, n)
            h2d = sum(snap1["bytes"][k] - snap0["bytes"][k] for k in ("ram_to_vram", "ram_to_staging"))
            d2h = snap1["bytes"]["vram_to_ram"] - snap0["bytes"]["vram_to_ram"]
            picks = {k: snap1["picks"][k] - snap0["picks"][k] for k in ("vram_hit", "pcie", "cpu", "nvme", "total")}
            la0, la1 = snap0["lookahead"], snap1["lookahead"]
            hits, actual = la1["hits"] - la0["hits"], la1["picks"] - la0["picks"]
            store = snap1["bytes"]["store_to_ram"] - snap0["bytes"]["store_to_ram"]
            if getattr(self.tiered, "nvme", None) is not None:  # the decode's own store picks, not the prompt's
                out["store_picks_by_layer"] = [b["lanes"]["nvme"] - a["lanes"]["nvme"]
                                               for a, b in zip(snap0["layers"], snap1["layers"], strict=True)]
                out["guesses"] = {k: snap1["prefetch"][k] - snap0["prefetch"][k]
                                  for k in ("issued", "hits", "late", "late_under_way", "wasted", "demand_misses")}
                r0, r1 = snap0.get("store_reads", {}), snap1.get("store_reads", {})
                if r1.get("busy_s") is not None:  # the share of the decode the store spent reading
                    out["store_busy"] = (r1["busy_s"] - r0["busy_s"]) / max(last - first, 1e-9)
                    out["store_idle_after_layer_s"] = [b - a for a, b in zip(r0["idle_after_layer_s"],
                                                                             r1["idle_after_layer_s"], strict=True)]
                    # The prompt's: its store bytes (what a prefill's disk bound is made of) and the disk's busy
                    # share of it (prefill reads most of every layer's experts not held in RAM or VRAM).
                    rb = before.get("store_reads", {})
                    out["prefill_store_bytes"] = snap0["bytes"]["store_to_ram"] - before["bytes"]["store_to_ram"]
                    out["prefill_store_busy"] = (r0["busy_s"] - rb.get("busy_s", 0.0)) / max(first - t0, 1e-9)
                out["guess_floor"] = snap1["lookahead"].get("guess_floor")
                out["guess_saving"] = snap1["lookahead"].get("guess_saving")
            if "devices" in snap1:  # a layer split: each card's picks and the bytes over its link, per token
                out["devices"] = [{"device": b["device"], "picks": b["picks"] - a["picks"],
                                   "pcie": b["lanes"]["pcie"] - a["lanes"]["pcie"],
                                   "link_MiB_per_token": (b["link_bytes"] - a["link_bytes"]) / n / 2**20}
                                  for a, b in zip(snap0["devices"], snap1["devices"], strict=True)]
            out.update(h2d_bytes_per_token=h2d / n, d2h_bytes_per_token=d2h / n, store_bytes_per_token=store / n,
                       hit_rate=picks["vram_hit"] / max(1, picks["total"]), picks=picks,
                       lookahead_recall=hits / actual if actual else None,
                       host_us_per_layer_step=1e6 * (snap1["host_seconds"]["plan"] - snap0["host_seconds"]["plan"])
                       / max(1, snap1["layer_steps"] - snap0["layer_steps"]),
                       # Where a decoded token's host time went (the GPU idles through all of it but the lane's):
                       # planning (and three of its parts: the store's reads, the copies, the slot ids), waiting
                       # for the routing ids, for copies, for store reads, and the work after launch.
                       host_ms_per_token={k: 1e3 * (snap1["host_seconds"][k] - snap0["host_seconds"].get(k, 0.0)) / n
                                          for k in ("plan", "plan_reads", "plan_copies", "plan_slots", "sync",
                                                    "copy_wait", "store_wait", "after_launch")
                                          if k in snap1["host_seconds"]})
        return out

    def judged(self, prompt: list[int], tokens: int, limit: int) -> int | None:
        """Decodes `tokens` at a time until the CPU lane's judge and then the prestage's have ruled, at most `limit`
        tokens; returns the tokens it took (None: no judge here). A trial gives the option half its windows whatever
        the verdict, and it recurs only every REJUDGE windows, so windows timed inside the first one measure the
        trial, not the mode."""
        stepper = self.tiered.stepper if self.tiered is not None else None
        if stepper is None or (stepper.lane is None and stepper.prestage is None):
            return None

        def in_trial() -> bool:
            return (stepper.lane is not None and stepper.lane_judge.in_trial) or \
                (stepper.prestage is not None and stepper.prestage.judge.in_trial)

        spent = 0
        while in_trial() and spent < limit:
            self.run(prompt, tokens, seed=spent)
            spent += tokens
        return spent

    def close(self) -> None:
        import torch

        self.runtime.close()  # the model unloaded, then the tiers closed
        self.model = self.runtime = self.tiered = None
        gc.collect()
        torch.cuda.empty_cache()


def even_warmup(spent: dict[str, int | None]) -> dict[str, int]:
    """The tokens each tiered mode still decodes so that all start their windows after as many warm-up tokens as the
    longest judging took (None: a tiered mode without a judge, 0 more so far): a longer warm-up leaves a warmer
    cache, which would flatter the mode whose judges took longest (2-5 points of hit rate in a grid point)."""
    most = max((n or 0 for n in spent.values()), default=0)
    return {name: most - (n or 0) for name, n in spent.items() if most - (n or 0) > 0}


@dataclass(frozen=True)
class StoreTier:
    """The nvme modes' store and RAM tier, as the bench sizes them (not from a host's plan)."""
    store: Path
    ram_slots: int
    threads: int
    allow_buffered: bool

    def opener(self, model_dir: Path, spec: Any) -> Any:
        from glm53.tiers.nvme_open import open_nvme_tier

        return lambda: open_nvme_tier(self.store, model_dir, spec, warm=False)


def ram_holds_all(model_dir: Path, spec: Any) -> Any:
    """nvme modes whose RAM tier has rows for every expert outside VRAM: routing counts that warm it with all of
    them, as a server warms its RAM from saved statistics and the all-RAM modes load it (the bench has no saved
    statistics, and a cold RAM tier would read each expert from the store on its first pick); else None."""
    import numpy as np

    from glm53.planning.shape import from_checkpoint

    if not spec.nvme:
        return None
    layers, per_layer = len(spec.vram_slots), from_checkpoint(model_dir).experts_per_layer
    outside = layers * per_layer - sum(spec.vram_slots)
    return np.ones((layers, per_layer)) if spec.ram_slots >= outside else None


def bench_spec(model_dir: Path, mode: str, slots: int, cache_tokens: int, cpu_threads: int | None,
               store_tier: StoreTier | None, cards: int = 1) -> Any:
    """The EngineSpec of a tiered mode at `slots` VRAM slots per layer: the plan's sizing rules (glm53.planning.spec) on
    the checkpoint's shape, with the bench's RAM tier in the nvme modes. cards > 1: the layers split across
    cuda:0..cards-1 (glm53.planning.devices.even_shares)."""
    from glm53.cpu_lane.calibrate import default_threads
    from glm53.planning.devices import even_shares
    from glm53.planning.shape import from_checkpoint
    from glm53.planning.spec import engine_spec

    shape = from_checkpoint(model_dir)
    nvme = mode.startswith("nvme")
    devices = even_shares(shape.layers, shape.moe_layer_ids, [slots] * shape.moe_layers, range(cards)) \
        if cards > 1 else ()
    return engine_spec(mode, moe_layers=shape.moe_layers, experts_per_layer=shape.experts_per_layer,
                       top_k=shape.top_k, vram_slots=slots, kv_tokens=cache_tokens, max_concurrency=1,
                       device="cuda:0", cpu_threads=cpu_threads or default_threads(),
                       ram_slots=store_tier.ram_slots if nvme else None, store_threads=store_tier.threads if nvme else 0,
                       store=str(store_tier.store) if nvme else None,
                       allow_buffered=store_tier.allow_buffered if nvme else False, devices=devices)


def split_modes(modes: Sequence[str], cards: int) -> list[str]:
    """The runner names of the split runs: each mode with "@N" (N cards), none without a split."""
    return [f"{m}@{cards}" for m in modes] if cards > 1 else []


def split_result(rows: list[dict], modes: Sequence[str], cards: int, slots: int, split_slots: int) -> dict:
    """Each mode on `cards` cards against one card, paired window by window, with each card's share of the picks
    and of the link traffic (what the issue's >= 1.6x on the 8-MoE-layer fixture is judged by)."""
    out = {}
    for mode in modes:
        name = f"{mode}@{cards}"
        mine = [x for x in rows if x["name"] == name]
        picks = [sum(x["devices"][i]["picks"] for x in mine) for i in range(cards)]
        out[mode] = {
            "cards": cards, "slots_per_layer": split_slots, "one_card_slots_per_layer": slots,
            "decode_tok_s": sum(x["decode_tok_s"] for x in mine) / max(1, len(mine)),
            "paired_over_one_card": paired_ratio(rows, name, mode),
            "pick_share_by_card": [p / max(1, sum(picks)) for p in picks],
            "link_MiB_per_token_by_card": [sum(x["devices"][i]["link_MiB_per_token"] for x in mine) / max(1, len(mine))
                                           for i in range(cards)],
            "host_ms_per_token": {k: sum(x["host_ms_per_token"].get(k, 0.0) for x in mine) / max(1, len(mine))
                                  for k in (mine[0]["host_ms_per_token"] if mine else {})},
        }
    return out


def nvme_opener(model_dir: Path, store: Path, ram_fraction: float, threads: int = 8,
                allow_buffered: bool = False) -> tuple[StoreTier, float, dict, float, tuple[int, dict]]:
    """The nvme modes' store tier for a RAM tier of `ram_fraction` of all experts, the store's raw O_DIRECT
    random-read rate (bytes/s) measured now over a layer's worth of its records, and the median seconds one record
    read alone takes, by how many parallel pieces it is read in (Python threads, no check: the disk's own figure),
    the RAM tier's share it gave, and the tier's own choice of parts with its timings (calibrate_pieces)."""
    import random

    from glm53.bench.nvme import record_latency
    from glm53.tiers.nvme_open import calibrate_pieces
    from store.format import read_header

    head = read_header(store)
    keys = sorted(head.index)
    # The tier needs one layer's experts plus one in RAM (a prefill streams a whole layer); a few-layer checkpoint
    # at the 16 GiB fraction falls just under that, so it gets that minimum (printed as the fraction it is).
    per_layer = max(sum(1 for k in keys if k[0] == layer) for layer in {k[0] for k in keys})
    ram = max(round(ram_fraction * len(keys)), per_layer + 1)
    rate = _disk_probe(store, records=288, threads=threads)()  # the same pass as beside each window
    lone = random.Random(1).sample(keys, min(len(keys), 24))
    latency = {parts: record_latency(store, lone, parts) for parts in (1, 4, 8)}
    # What the tier does when it opens (each mode's open times it again): through the native pread, parts hashed.
    read_parts = calibrate_pieces(store, head, allow_buffered)

    return StoreTier(store, ram, threads, allow_buffered), rate, latency, ram / len(keys), read_parts


def bench_decode(model_dir: Path, slots: int, tokens: int, windows: int, prompt_tokens: int,
                 modes: tuple[str, ...] = MODES, cpu_threads: int | None = None, log=print,
                 store: Path | None = None, ram_fraction: float = RAM_55G, profile: str | None = None,
                 profile_dump: Path | None = None,
                 warmup_tokens: int = 16, buffered_store: bool = False, emulated_disk_Bps: float | None = None,
                 cards: int = 1, emulation: Emulation = Emulation(), host_delay_us: float = 0) -> dict:
    import torch

    measured = rate = h2d_rate()
    log(f"pinned host->device: {rate / 1e9:.1f} GB/s")
    pacer = None
    if emulation.link_GBps:
        from glm53.bench.emulate import link_pacer
        from glm53.planning.shape import from_checkpoint

        pacer = link_pacer(emulation, from_checkpoint(model_dir).expert_bytes, log)
        measured, rate = pacer.measured_Bps, pacer.target_Bps
    if emulation.name != "none":
        log(f"emulating {emulation.describe()}")
    nvme_open, disk_rate, latency, disk_probe, engine_parts = None, None, {}, None, (None, {})
    if any(m.startswith("nvme") for m in modes):
        nvme_open, disk_rate, latency, ram_fraction, engine_parts = nvme_opener(model_dir, store, ram_fraction,
                                                                                allow_buffered=buffered_store)
        if emulated_disk_Bps:  # the caller's emulated disk sets the rate: the raw passes read around it
            disk_rate, latency = emulated_disk_Bps, {}
            disk_probe = lambda: emulated_disk_Bps  # noqa: E731
        else:
            disk_probe = _disk_probe(store)
        log(f"store {store}: raw random {_store_reads(buffered_store, emulated_disk_Bps)} reads {disk_rate / 1e9:.2f} "
            f"GB/s; RAM tier {ram_fraction:.3f} of the experts" + _lone_record({n: t * 1e3 for n, t in latency.items()}))
    cache_tokens = prompt_tokens + tokens + 512
    runners: dict[str, _Runner] = {}
    try:
        runners["stock"] = _Runner(model_dir, None, cache_tokens)
        log(f"stock exllamav3 (all experts in VRAM) loaded in {runners['stock'].load_s:.1f} s, "
            f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")
        for mode in modes:
            mem0 = torch.cuda.memory_allocated()
            runners[mode] = _Runner(model_dir, slots, cache_tokens, mode, cpu_threads, nvme_open, pacer=pacer,
                                    lane_isas=emulation.lane_isas)
            log(f"{mode} ({slots} slots/layer) loaded in {runners[mode].load_s:.1f} s, "
                f"{(torch.cuda.memory_allocated() - mem0) / 2**30:.1f} GiB allocated")
        from glm53.planning.shape import from_checkpoint

        split_slots = min(from_checkpoint(model_dir).experts_per_layer - 1, cards * slots)  # each card holds what the one card held
        for mode, name in zip(modes, split_modes(modes, cards), strict=False):
            runners[name] = _Runner(model_dir, split_slots, cache_tokens, mode, cpu_threads, nvme_open, cards,
                                    pacer=pacer, lane_isas=emulation.lane_isas)
            log(f"{name} ({split_slots} slots/layer over {cards} cards) loaded in {runners[name].load_s:.1f} s")
        probe = f"{modes[0]}+host{host_delay_us:g}us" if host_delay_us > 0 and modes else None
        if probe is not None:
            runners[probe] = _Runner(model_dir, slots, cache_tokens, modes[0], cpu_threads, nvme_open, pacer=pacer,
                                     lane_isas=emulation.lane_isas)
            delay_planning(runners[probe].tiered.stepper, host_delay_us)
            log(f"{probe}: {modes[0]} with {host_delay_us:g} us more host time a layer step")
        paced = None
        if pacer is not None:  # the validation: expert-sized copies through a paced Copier deliver the target rate
            from glm53.bench.emulate import paced_rate

            layout = next(r.tiered.layout for r in runners.values() if r.tiered is not None)
            paced = paced_rate(pacer.fresh(), layout.nbytes)
            log(f"paced link: {paced / 1e9:.2f} GB/s over expert-sized copies ({layout.nbytes / 2**20:.1f} MiB each; "
                f"target {rate / 1e9:.2f}, unpaced {measured / 1e9:.1f})")
        vocab = 150000
        prompt = [(13 * i + 7) % vocab for i in range(prompt_tokens)]
        # Warm-up at the measured prompt length: a fresh process spends over a minute setting up the first prefill
        # of a new shape. Decoding longer in it starts the windows with tiers that have learnt
        # the routing, as a server's are (it warms them from the routing statistics saved at its last shutdown).
        spent: dict[str, int | None] = {}
        for name, r in runners.items():
            r.run(prompt, warmup_tokens if r.tiered is not None else 16, seed=0)
            judged = r.judged(prompt, max(16, warmup_tokens), JUDGE_LIMIT_TOKENS)
            if r.tiered is not None:  # stock has no cache to warm
                spent[name] = judged
            if judged is not None:
                stepper = r.tiered.stepper
                judges = [(what, j) for what, j in (("CPU lane", stepper.lane_judge if stepper.lane else None),
                                                    ("prestage", stepper.prestage.judge if stepper.prestage else None))
                          if j is not None]
                verdicts = ", ".join(f"{what} {'still in its trial' if j.in_trial else 'kept' if j.kept else 'set aside'}"
                                     for what, j in judges)
                log(f"{name}: the judges ruled after {judged} more warm-up tokens: {verdicts}")
        for name, more in even_warmup(spent).items():
            runners[name].run(prompt, more, seed=1)
            log(f"{name}: {more} more warm-up tokens, as many as the longest judging took")
        rows: list[dict] = []
        for w in range(windows):
            # A virtual disk's rate drifts within a run, so each nvme window's bound uses the disk's raw rate measured just before and just after it.
            disk_before = disk_probe() if disk_probe else None
            for name, r in runners.items():
                res = r.run(prompt, tokens, seed=1000 + w)
                res["name"], res["window"] = name, w
                if disk_probe and name.startswith("nvme"):
                    disk_after = disk_probe()
                    res["disk_Bps"], disk_before = (disk_before + disk_after) / 2, disk_after
                rows.append(res)
                log(window_line(w, name, prompt_tokens, res))

        if profile in runners:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            runners[profile].run(prompt, tokens, seed=999)
            prof.disable()
            if profile_dump is not None:  # the whole profile, for a look beyond the lines printed
                prof.dump_stats(profile_dump)
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            stats.sort_stats("tottime").print_stats(30)
            # glm53's own functions by time including what they call: where the host's step time goes by call
            stats.sort_stats("cumulative").print_stats(r"glm53|store/", 40)
            log(f"profile of one {profile} window ({tokens} tokens, prefill included):\n{buf.getvalue()}")
        contention = None
        if nvme_open is not None:  # what the store's reads cost the planning thread, for the next change to aim at
            from glm53.bench.read_contention import line, read_contention

            with _disk_as_it_is(emulated_disk_Bps):  # what reads cost the planning thread, not how fast they come
                contention = read_contention(store, engine_parts[0] or 1)
            log(line(contention))

        def mean(name: str, key: str) -> float:
            vals = [x[key] for x in rows if x["name"] == name and x.get(key) is not None]
            return sum(vals) / len(vals) if vals else float("nan")

        stock_tok = mean("stock", "decode_tok_s")
        h2d = mean("exact", "h2d_bytes_per_token") if "exact" in runners else mean(modes[0], "h2d_bytes_per_token")
        bound_s = h2d / rate + 1 / stock_tok
        stock_rows = [x for x in rows if x["name"] == "stock"]
        shape = from_checkpoint(model_dir)
        result = {
            "h2d_GBps": rate / 1e9,
            "measured_h2d_GBps": measured / 1e9,
            "emulation": {**emulation.__dict__, "paced_GBps": None if paced is None else paced / 1e9},
            "stock_decode_tok_s": stock_tok,
            "stock_prefill_tok_s": prompt_tokens / mean("stock", "prefill_s"),
            "bound_decode_tok_s": 1 / bound_s,
            "h2d_MiB_per_token": h2d / 2**20,
            "slots_per_layer": slots,
            "stock_load_s": runners["stock"].load_s,
            "modes": {},
            "windows": [{k: v for k, v in x.items() if k != "tokens"} for x in rows],
            "moe_cpu_split": "not run: exllamav3's CPU MoE code segfaults on the GPU machine (docs/results.md)",
            "disk_GBps": None if disk_rate is None else disk_rate / 1e9,
            "store_reads": None if disk_rate is None else _store_reads(buffered_store, emulated_disk_Bps),
            "record_ms_by_pieces": {str(n): t * 1e3 for n, t in latency.items()},
            "read_parts": engine_parts[0],
            "read_ms_by_parts": {str(n): t * 1e3 for n, t in engine_parts[1].items()},
            "ram_fraction": ram_fraction if nvme_open is not None else None,
            "read_contention": contention,
        }
        for mode in modes:
            m_rows = [x for x in rows if x["name"] == mode]
            tok = mean(mode, "decode_tok_s")
            result["modes"][mode] = {
                "decode_tok_s": tok,
                "prefill_tok_s": prompt_tokens / mean(mode, "prefill_s"),
                "over_stock": tok / stock_tok,
                "over_bound": tok * bound_s,
                "paired_over_stock": paired_ratio(rows, mode, "stock"),
                "paired_over_exact": paired_ratio(rows, mode, "exact") if "exact" in modes else float("nan"),
                "hit_rate": mean(mode, "hit_rate"),
                "misses_per_token": misses_per_token(m_rows),
                "misses_per_token_at_real_depth": misses_per_token(m_rows) * REAL_MOE_LAYERS / shape.moe_layers,
                "top_k": shape.top_k,
                "cpu_pick_share": sum(x["picks"]["cpu"] for x in m_rows) / max(1, sum(x["picks"]["total"]
                                                                                       for x in m_rows)),
                "store_MiB_per_token": mean(mode, "store_bytes_per_token") / 2**20,
                "pick_shares": {k: sum(x["picks"][k] for x in m_rows) / max(1, sum(x["picks"]["total"] for x in m_rows))
                                for k in ("vram_hit", "pcie", "cpu", "nvme")},
                "h2d_MiB_per_token": mean(mode, "h2d_bytes_per_token") / 2**20,
                "d2h_MiB_per_token": mean(mode, "d2h_bytes_per_token") / 2**20,
                "lookahead_recall": mean(mode, "lookahead_recall"),
                "host_us_per_layer_step": mean(mode, "host_us_per_layer_step"),
                "same_tokens_as_stock": all(a["tokens"] == b["tokens"] for a, b in zip(stock_rows, m_rows, strict=True)),
                "load_s": runners[mode].load_s,
                "tiers": runners[mode].tiered.snapshot(),
            }
            if all("guesses" in x for x in m_rows):  # nvme modes: per decoded token, the windows pooled
                n_tok = max(1, sum(x["decoded_tokens"] for x in m_rows))
                result["modes"][mode]["decode_store"] = {
                    "picks_by_layer": [sum(col) / n_tok for col in zip(*(x["store_picks_by_layer"] for x in m_rows),
                                                                       strict=True)],
                    **{k: sum(x["guesses"][k] for x in m_rows) / n_tok for k in m_rows[0]["guesses"]},
                    "store_busy": mean(mode, "store_busy"), "guess_floor": mean(mode, "guess_floor"),
                    "idle_ms_after_layer": [1e3 * sum(col) / n_tok for col in zip(
                        *(x.get("store_idle_after_layer_s", []) for x in m_rows), strict=True)],
                    "guess_saving": mean(mode, "guess_saving")}
                result["modes"][mode]["prefill_store"] = prefill_store(rows, mode)
        for mode in modes:
            if mode.startswith("nvme") and disk_rate:
                m = result["modes"][mode]
                # The lanes overlapping perfectly: the GPU side (stock step + this mode's PCIe bytes) or the disk,
                # whichever is slower, per token.
                gpu_s = 1 / stock_tok + m["h2d_MiB_per_token"] * 2**20 / rate
                disk_s = m["store_MiB_per_token"] * 2**20 / disk_rate
                m["bound_decode_tok_s"] = 1 / max(gpu_s, disk_s)
                m["over_own_bound_start_rate"] = m["decode_tok_s"] * max(gpu_s, disk_s)
                m.update(own_bound_beside(rows, mode, rate))
        for mode in modes:  # the speed forecast's cost model on this run's own terms
            from glm53.bench.forecast_check import checked, run_terms

            fit = getattr(runners[mode].tiered.stepper, "fit", None)
            result["modes"][mode]["forecast"] = checked(mode, result["modes"][mode], run_terms(
                result["modes"][mode], moe_layers=shape.moe_layers, top_k=shape.top_k, expert_bytes=shape.expert_bytes,
                stock_tok_s=stock_tok, link_Bps=rate, lane_ms=fit.start_model().cpu_expert(1) * 1e3 if fit else None,
                store_Bps=_disk_beside(result["modes"][mode], disk_rate) if mode.startswith("nvme") else None))
        if cards > 1:
            result["split"] = split_result(rows, modes, cards, slots, split_slots)
            for mode in modes:
                mine = [x for x in rows if x["name"] == f"{mode}@{cards}"]
                result["split"][mode]["same_tokens_as_stock"] = all(
                    a["tokens"] == b["tokens"] for a, b in zip(stock_rows, mine, strict=True))
        exact_like = [m for m in modes if m.startswith(("exact", "nvme-exact"))]
        result["same_tokens"] = all(result["modes"][m]["same_tokens_as_stock"] for m in exact_like) and all(
            result.get("split", {}).get(m, {}).get("same_tokens_as_stock", True) for m in exact_like)
        if "fast" in modes and "exact" in modes:
            result["fast_over_exact"] = result["modes"]["fast"]["paired_over_exact"]
        if probe is not None:
            result["host_probe"] = host_probe(rows, modes[0], probe, host_delay_us, shape.moe_layers)
        return result
    finally:
        for r in runners.values():
            r.close()


def misses_per_token(rows: list[dict]) -> float:
    """Picks served from outside VRAM per decoded token, the windows pooled."""
    tokens = sum(x["decoded_tokens"] for x in rows)
    return sum(x["picks"]["total"] - x["picks"]["vram_hit"] for x in rows) / max(1, tokens)


def _judged(m: dict) -> str:
    """The CPU lane's or the prestage's verdict in a mode that has one: whether decode steps with it were faster."""
    pre = (((m.get("tiers") or {}).get("lookahead") or {}).get("prestage"))
    out = ""
    if pre:
        judge, ratio = pre["judge"], pre["judge"]["ratio_on_over_off"]
        verdict = "on trial" if judge["kept"] is None else "kept" if judge["kept"] else "set aside"
        out = (f"; prestage {verdict} (steps with it took {'-' if ratio is None else f'{ratio:.3f}'} of the others; "
               f"{pre['used']} of {pre['staged']} copied ahead read by their step)")
    return _lane_judged(m) + out


def _lane_judged(m: dict) -> str:
    judge = (m.get("tiers") or {}).get("cpu_lane", {}).get("judge")
    if not judge:
        return ""
    if judge["kept"] is None:
        return "; CPU lane on trial"
    ratio = judge["ratio_on_over_off"]
    return (f"; CPU lane {'kept' if judge['kept'] else 'set aside'} (steps offering it took "
            f"{'-' if ratio is None else f'{ratio:.3f}'} of the others, {judge['cpu_share']:.3f} of picks)"
            + _lane_vs_link(m["tiers"]["cpu_lane"]))


def _lane_vs_link(lane: dict) -> str:
    """One one-row expert on the lane (calibrated idle, and its kernel's mean inside decode) beside one over the
    link: the lane can only speed decode up where it is not slower than the link per expert."""
    model = lane.get("cost_model") or {}

    def one_row(table: dict | None) -> float | None:
        table = table or {}
        return table.get(1, table.get("1"))

    cpu_us, link_us = one_row(model.get("cpu_expert_us")), one_row(model.get("pcie_expert_us"))
    if not cpu_us or not link_us:
        return ""
    jobs = lane.get("jobs") or 0
    in_decode = f", {lane['kernel_seconds'] / jobs * 1e3:.2f} ms a job in decode" if jobs else ""
    return (f"; one expert: lane {cpu_us / 1e3:.2f} ms idle{in_decode}, link {link_us / 1e3:.2f} ms "
            f"(link / lane idle {link_us / cpu_us:.2f})")


def report(res: dict, moe_layers: int | None) -> str:
    lines = [
        f"glm53 bench decode: {moe_layers or '?'} full-width MoE layers, {res['slots_per_layer']} VRAM slots/layer, "
        f"exact modes generate stock's tokens: {res['same_tokens']}"
        + (f"; each tiered mode decoded {res['warmup_tokens']} tokens before the windows" if "warmup_tokens" in res
           else ""),
        f"  stock exllamav3, all experts in VRAM : {res['stock_decode_tok_s']:8.1f} tok/s decode, "
        f"{res['stock_prefill_tok_s']:8.1f} tok/s prefill",
    ]
    for mode, m in res["modes"].items():
        recall = "-" if m["lookahead_recall"] != m["lookahead_recall"] else f"{m['lookahead_recall']:.2f}"
        outside = ((m.get("tiers") or {}).get("lookahead") or {}).get("outside_precision")
        if outside and recall != "-":  # what a prestage of a row's first guesses outside VRAM would have had right
            recall += " (outside VRAM by order: " + ", ".join(f"{p:.2f}" for p in outside[:3]) + ")"
        paired = m.get("paired_over_exact", float("nan"))  # nan == nan is False: not measured
        lines.append(f"  {mode:<37}: {m['decode_tok_s']:8.1f} tok/s decode, {m['prefill_tok_s']:8.1f} tok/s prefill; "
                     f"x stock {m['over_stock']:.3f}, x bound {m['over_bound']:.3f}"
                     + (f", x exact {paired:.3f} (paired)" if mode != "exact" and paired == paired else "")
                     + f"; hit rate {m['hit_rate']:.3f}"
                     + (f" ({m['misses_per_token_at_real_depth']:.0f} misses a token at the real model's depth)"
                        if "misses_per_token_at_real_depth" in m else "") + ", "
                     f"CPU-lane share {m['cpu_pick_share']:.3f}, lookahead recall {recall}, host "
                     f"{m['host_us_per_layer_step']:.0f} us/layer step" + _judged(m))
    lines.append(f"  PCIe bound ({res['h2d_MiB_per_token']:.0f} MiB/token at {res['h2d_GBps']:.1f} GB/s + stock step): "
                 f"{res['bound_decode_tok_s']:8.1f} tok/s (exact target >= 0.85 of it)")
    if "fast_over_exact" in res:
        lines.append(f"  fast / exact: {res['fast_over_exact']:.3f}, median of paired windows (target >= 1.5)")
    if res.get("host_probe"):
        hp = res["host_probe"]
        lines.append(f"  host on the critical path: {hp['mode']} with {hp['delay_us']:g} us more host a layer step "
                     f"({hp['added_host_ms_per_token']:.2f} ms a token) decodes at x {hp['paired_over_plain']:.3f} "
                     f"(paired); the token grew by {hp['critical_share']:.2f} of the added host time")
    from glm53.bench.forecast_check import line

    lines += [line(mode, m["forecast"]) for mode, m in res["modes"].items() if m.get("forecast")]
    if res.get("disk_GBps") is not None:
        lines.append(f"  store: raw {res.get('store_reads', 'O_DIRECT')} {res['disk_GBps']:.2f} GB/s at the start; RAM tier "
                     f"{res['ram_fraction']:.3f} of the experts" + _lone_record(res.get("record_ms_by_pieces", {})))
        if res.get("read_ms_by_parts"):
            used = {m: d["tiers"]["store_reads"]["parts"] for m, d in res["modes"].items()
                    if "store_reads" in d.get("tiers", {})}  # each mode's open timed them again
            lines.append(f"  the tier reads each record in {res['read_parts']} part(s), timed as it opens (native pread, "
                         "parts hashed): " + ", ".join(f"{t:.2f} ms in {n}" for n, t in
                                                        res["read_ms_by_parts"].items())
                         + ("; the modes read in " + ", ".join(f"{m} {n}" for m, n in used.items()) if used else ""))
        for mode in ("nvme-exact", "nvme"):
            if mode in res["modes"]:
                sh = res["modes"][mode]["pick_shares"]
                m = res["modes"][mode]
                lines.append(f"  {mode} picks per tier: " + ", ".join(f"{k} {v:.3f}" for k, v in sh.items())
                             + f"; {m['store_MiB_per_token']:.0f} MiB/token from the store; bound (GPU side or "
                             f"disk, overlapped) at the disk's rate beside each window "
                             f"({m['disk_GBps_beside']:.2f} GB/s mean) {m['bound_beside_tok_s']:.1f} tok/s, x bound "
                             f"{m['over_own_bound']:.3f}, median of windows (target >= 0.8); at the start's rate "
                             f"{m['bound_decode_tok_s']:.1f} tok/s, x {m['over_own_bound_start_rate']:.3f}; x the "
                             f"two lanes one after the other {m['over_lanes_in_series']:.3f}")
                ds = m.get("decode_store")
                if ds:
                    lines.append("    per decoded token: store picks by layer "
                                 + " ".join(f"{v:.2f}" for v in ds["picks_by_layer"])
                                 + f"; reads a step waited for but no guess started {ds['demand_misses']:.2f}, "
                                 f"guesses read {ds['issued']:.2f} (in time {ds['hits']:.2f}, late {ds['late']:.2f} "
                                 f"of which under way {ds['late_under_way']:.2f}, wrong {ds['wasted']:.2f}); store "
                                 f"busy {ds['store_busy']:.2f} of the decode, guess floor {ds['guess_floor']:.2f} "
                                 f"(a right guess saving {ds['guess_saving']:.2f} of a read) at the windows' ends")
                    if ds.get("idle_ms_after_layer"):
                        idle = ds["idle_ms_after_layer"]
                        lines.append("    store idle per decoded token after each layer's step, ms: "
                                     + " ".join(f"{v:.2f}" for v in idle[:-1])
                                     + f"; after the last (to the next token's first MoE step) {idle[-1]:.2f}; "
                                     f"{sum(idle):.2f} in all")
                ps = m.get("prefill_store")
                if ps:
                    lines.append(f"    per prompt: {ps['MiB']:.0f} MiB from the store, store busy {ps['busy']:.2f} of "
                                 f"the prefill; prefill x the disk's bound {ps['over_disk_bound']:.3f}, median of "
                                 f"windows")
        if res.get("read_contention"):
            from glm53.bench.read_contention import line

            lines.append("  " + line(res["read_contention"]))
        if "nvme" in res["modes"] and "fast" in res["modes"]:
            lines.append(f"  nvme / fast: {res['modes']['nvme']['decode_tok_s'] / res['modes']['fast']['decode_tok_s']:.3f}"
                         f" (target >= 0.7 at the 55 GiB fraction)")
    for mode, m in res.get("split", {}).items():
        host = ", ".join(f"{k} {v:.2f}" for k, v in m["host_ms_per_token"].items())
        lines.append(f"  {mode} on {m['cards']} cards ({m['slots_per_layer']} slots/layer, each card as many slots as "
                     f"the one card's {m['one_card_slots_per_layer']}/layer): {m['decode_tok_s']:8.1f} tok/s decode, "
                     f"x one card {m['paired_over_one_card']:.3f} (paired; target >= 1.6 on the 8-MoE-layer fixture); "
                     f"stock's tokens: {m['same_tokens_as_stock']}")
        lines.append("    per card: picks " + ", ".join(f"{v:.3f}" for v in m["pick_share_by_card"]) + "; link MiB/token "
                     + ", ".join(f"{v:.1f}" for v in m["link_MiB_per_token_by_card"]) + f"; host ms/token: {host}")
    emu = res.get("emulation") or {}
    if emu.get("name", "none") != "none":
        lines.append(f"  emulated host: {emu['name']}" + (f"; the link paced to {emu['link_GBps']:g} GB/s measured "
                     f"{emu['paced_GBps']:.2f} GB/s over expert copies" if emu.get("paced_GBps") else "")
                     + f" (unpaced {res['measured_h2d_GBps']:.1f} GB/s); not emulated: this host's Python speed, "
                     "its DRAM channels and core count behind the lane")
    lines.append(f"  stock moe_cpu_split: {res['moe_cpu_split']}")
    return "\n".join(lines)


def _made_once(marker: Path, make: Any, what: str) -> None:
    """make() unless `marker` says an earlier run finished it (a --keep run on a warm machine)."""
    if marker.exists():
        print(f"reusing {what}")
        return
    t0 = time.perf_counter()
    make()
    marker.touch()
    print(f"made {what} in {time.perf_counter() - t0:.0f} s")


def emulation_problem(gbps: float, modes: Sequence[str]) -> str | None:
    """Why the bench cannot run `modes` on an emulated disk of `gbps` GB/s, or None. Only reads through the native
    pread are paced, so a mode reading on Python threads would compare an unpaced store with paced ones."""
    if gbps <= 0:
        return f"the rate must be above 0 GB/s, got {gbps:g}"
    if not any(m.startswith("nvme") for m in modes):
        return "no nvme mode in --modes: only the nvme modes read the store"
    from glm53.bench.emulated_disk import problem

    return problem()


def emulation_for(emulation: Emulation, modes: Sequence[str]) -> Emulation:
    """The emulation as these modes run it: without the lane's kernel paths where none of them runs the lane, so an
    exact-only run needs no lane build."""
    return emulation if any(m in LANE_MODES for m in modes) else replace(emulation, lane_isas=None)


def cmd_bench_decode(args: argparse.Namespace) -> int:
    if args.baseline:  # this process only orchestrates: each window runs in its own (decode_baseline)
        from glm53.bench.decode_baseline import cmd_bench_decode_baseline

        return cmd_bench_decode_baseline(args)
    try:
        import torch
    except ImportError:
        print("glm53: bench decode needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("glm53: bench decode needs a CUDA GPU", file=sys.stderr)
        return 2
    from glm53.exl3.contract import Exl3ContractError, check_contract

    try:
        check_contract()
    except Exl3ContractError as exc:
        print(f"glm53: {exc}", file=sys.stderr)
        return 2
    try:
        skew = tuple(float(x) for x in args.skew.split(","))
        if len(skew) != 2:
            raise ValueError
    except ValueError:
        print(f"glm53: --skew wants two fractions like 0.11,0.40, got {args.skew!r}", file=sys.stderr)
        return 2
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"glm53: --modes: unknown {unknown}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    from glm53.bench.emulate import from_args, problem, slots_for
    from glm53.cpu_lane import kernel

    emulation = emulation_for(from_args(args), modes)
    why = problem(emulation, kernel.supported_isas(), os.cpu_count() or 1)
    if why:
        print(f"glm53: --emulate: {why}", file=sys.stderr)
        return 2
    work = None
    if args.model:
        model_dir = Path(args.model)
        experts = json.loads((model_dir / "config.json").read_text()).get("text_config", {}).get("n_routed_experts", 288)
    else:
        from glm53.fixture.exl3 import write_exl3_checkpoint

        if args.keep and args.work:  # a fixed place, so the next run of this shape finds it
            work = Path(args.work) / f"glm53-bench-{args.moe_layers}L-{skew[0]}-{skew[1]}"
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(tempfile.mkdtemp(prefix="glm53-bench-", dir=args.work))
        model_dir = work / "ckpt"

        def write() -> None:
            shutil.rmtree(model_dir, ignore_errors=True)
            write_exl3_checkpoint(model_dir, shape="glm53", moe_layers=args.moe_layers, mtp_layers=0,
                                  shards=max(2, args.moe_layers), router_skew=skew)

        _made_once(work / "ckpt.complete", write, f"the {args.moe_layers}-MoE-layer full-width checkpoint {model_dir}")
        experts = 288
    slots = args.slots if args.slots is not None else slots_for(emulation, experts, round(CARD_FRACTION * experts))
    if args.devices > 1 and torch.cuda.device_count() < args.devices:
        print(f"glm53: --devices {args.devices} needs {args.devices} CUDA devices, {torch.cuda.device_count()} visible "
              "(a two-card machine: nvidia-h200-x2)", file=sys.stderr)
        return 2
    if args.emulate_disk_GBps is not None:
        problem = emulation_problem(args.emulate_disk_GBps, modes)
        if problem:
            print(f"glm53: --emulate-disk-GBps: {problem}", file=sys.stderr)
            return 2
    store, buffered = None, False
    if any(m.startswith("nvme") for m in modes):
        from store.directio import dir_supports_direct
        from store.pack import PackOptions, pack_store

        if work is None:
            work = Path(tempfile.mkdtemp(prefix="glm53-bench-", dir=args.work))
        home = Path(args.store_dir) / work.name if args.store_dir else work
        home.mkdir(parents=True, exist_ok=True)
        buffered = not dir_supports_direct(home)
        if buffered:
            print(f"{home} refuses O_DIRECT: the store there is written and read buffered")
        store = home / "experts.glm53"
        _made_once(home / "experts.complete",
                   lambda: pack_store(PackOptions(model_dir, store, threads=8, progress=False, allow_buffered=buffered),
                                      log=lambda m: None),
                   f"the expert store {store}")
    emulated = args.emulate_disk_GBps * 1e9 if args.emulate_disk_GBps else None
    if emulated is not None:
        from glm53.bench.emulated_disk import emulated_disk

        disk = emulated_disk(1 / emulated)  # process-wide: only the store's reads go through the native pread
    else:
        disk = contextlib.nullcontext()
    try:
        with disk:
            res = bench_decode(model_dir, slots, args.tokens, args.windows, args.prompt_tokens, modes,
                               args.cpu_threads, store=store, ram_fraction=args.ram_fraction, profile=args.profile,
                               profile_dump=Path(args.json).with_suffix(".prof") if args.json else None,
                               warmup_tokens=args.warmup_tokens, buffered_store=buffered, emulated_disk_Bps=emulated,
                               cards=args.devices, emulation=emulation, host_delay_us=args.host_delay_us)
    finally:
        if work is not None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if store is not None:
                shutil.rmtree(store.parent, ignore_errors=True)
    res.update(moe_layers=None if args.model else args.moe_layers, skew=list(skew), tokens=args.tokens,
               warmup_tokens=args.warmup_tokens, date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name())
    print(report(res, res["moe_layers"]))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["same_tokens"] else 1
