"""`glm53 bench nvme`: the nvme tier on a full-width record store, as ratios measured in one run (CPU only).

A synthetic store of 9 MiB GLM-5.3-Flash-width records (store.synth + pack-store), a RAM tier of a chosen share
of the experts and a VRAM share (warmed from routing statistics of an earlier stretch of the same trace), then,
in interleaved windows:
  raw      plain O_DIRECT reads of random records, `threads` in flight: the disk's rate in this run;
  stream   the same number of random records demanded through the tier, one layer's top-k at a time and nothing
           else to do: the tier's read path against raw;
  decode   a skewed routing trace decoded through the tier, each layer "computing" for --layer-ms (a sleep: the
           GPU's time), with prefetch off, with a perfect next-layer predictor, with perfect predictors for the next
           two and three layers (perfect-2, perfect-3: what reading further ahead could win when a record read
           takes several layers' compute) and with one of --recall (0.6, the router lookahead measured 0.55-0.75),
           its guesses read as the engine does, once the layer's own store reads are queued, and (realistic-after)
           as an earlier engine did: only once those have landed, and a guess still queued when its layer
           needs it left in its place behind the other guesses. Picks per tier, NVMe bytes/s, and tokens/s against the bound
           max(compute, NVMe bytes per token / raw rate) that perfect overlap would reach.
Every expert is computed "in place" (CPU lane, no admissions): this measures the store and RAM tiers, not PCIe.

The routing is the fixture's router (sigmoid noise + a calibrated popularity bias, glm53.fixture.exl3): 11% of a
layer's experts draw 40% of its picks and half of them ~90%, as published for GLM-5.3-Flash. A few hundred
records cannot hold 288 experts per layer in enough layers, so the default geometry keeps the real ratio of picks
to experts instead: 72 experts, top-2 (8 of 288), and a layer's compute scaled to its picks (1.2 ms for 8).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REAL = {"hidden": 4096, "moe_intermediate": 2048, "k_bits": 3}
MODES = ("off", "perfect", "perfect-2", "perfect-3", "realistic", "realistic-after")


@dataclass
class NvmeBenchOptions:
    workdir: Path = Path("bench-nvme")
    store: Path | None = None
    model: Path | None = None
    layers: int = 8
    experts: int = 72
    top_k: int = 2
    ram_fraction: float = 0.47  # what a 55 GiB cap gives the real model (16 GiB: 0.125)
    vram_fraction: float = 0.11  # a 24 GB card
    threads: int = 8
    tokens: int = 64
    rounds: int = 2
    layer_ms: float | None = None  # default: 1.2 ms per 8 picks
    recall: float = 0.6
    keep: bool = False
    seed: int = 0

    @property
    def compute_ms(self) -> float:
        return 1.2 * self.top_k / 8 if self.layer_ms is None else self.layer_ms


@dataclass
class Window:
    mode: str
    seconds: float
    tokens: int
    picks: dict
    nvme_bytes: int
    nvme_wait: float
    prefetch: dict
    compute: float = 0.0  # seconds slept as the layers' compute
    keys: list = field(default_factory=list)  # the records the window read, in order
    raw_replay: float = 0.0  # bytes/s of plain O_DIRECT reads of those same records, `threads` in flight

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class NvmeBenchResult:
    header: str
    raw: list[float] = field(default_factory=list)  # bytes/s per raw window
    stream: list[float] = field(default_factory=list)  # bytes/s per tier stream window
    windows: list[Window] = field(default_factory=list)
    compute_s_per_token: float = 0.0
    record_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    def of(self, mode: str) -> list[Window]:
        return [w for w in self.windows if w.mode == mode]

    def tok_s(self, mode: str) -> float:
        return statistics.median(w.tok_s for w in self.of(mode))

    def render(self) -> str:
        raw = statistics.median(self.raw)
        lines = [self.header,
                 f"  raw O_DIRECT random records               {raw / 1e9:7.2f} GB/s (median of {len(self.raw)})"]
        stream = statistics.median(self.stream)
        pairs = statistics.median(s / r for s, r in zip(self.stream, self.raw, strict=True))
        lines.append(f"  tier demand reads of the same records     {stream / 1e9:7.2f} GB/s  {pairs:5.2f} x raw "
                     "(median of per-round ratios)")
        off = self.of("off")
        picks = {k: sum(w.picks[k] for w in off) for k in ("vram_hit", "cpu", "nvme")}
        total = sum(picks.values())
        lines.append(f"  picks per tier (prefetch off)             VRAM {picks['vram_hit'] / total:.1%}  RAM "
                     f"{picks['cpu'] / total:.1%}  NVMe {picks['nvme'] / total:.1%}  ({total} picks)")
        base = self.tok_s("off")
        for mode in MODES:
            ws = self.of(mode)
            tok_s = self.tok_s(mode)
            per_token = statistics.median(w.nvme_bytes / w.tokens for w in ws)
            rate = statistics.median(w.nvme_bytes / w.seconds for w in ws)
            replay = statistics.median(w.raw_replay for w in ws)
            bound = statistics.median(w.tokens / max(self.compute_s_per_token * w.tokens, w.nvme_bytes / w.raw_replay)
                                      for w in ws)
            wait = statistics.median(w.nvme_wait / w.tokens for w in ws) * 1e3
            compute = statistics.median(w.compute / w.tokens for w in ws) * 1e3
            other = statistics.median((w.seconds - w.compute - w.nvme_wait) / w.tokens for w in ws) * 1e3
            recall = "" if mode == "off" else (f", recall {_mean(ws, 'recall'):.2f} precision "
                                               f"{_mean(ws, 'precision'):.2f}")
            lines.append(f"  decode, prefetch {mode:15} {tok_s:7.2f} tok/s = {tok_s / base:4.2f} x off = "
                         f"{tok_s / bound:4.2f} x bound ({bound:.2f}); {per_token / self.record_bytes:4.1f} "
                         f"records/token at {rate / 1e9:4.2f} GB/s = {rate / replay:4.2f} x raw replay "
                         f"({replay / 1e9:4.2f} GB/s); per token: compute {compute:4.1f} ms, NVMe wait {wait:4.1f} "
                         f"ms, tier + host {other:4.1f} ms{recall}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _mean(ws: list[Window], key: str) -> float:
    vals = [w.prefetch[key] for w in ws if w.prefetch.get(key) is not None]
    return statistics.mean(vals) if vals else float("nan")


# ---- the fixture ------------------------------------------------------------------------------------------------


def build_store(opts: NvmeBenchOptions, log, made: list[Path]) -> tuple[Path, Path]:
    """(checkpoint, store): the given ones, or a synthetic full-width pair written into the workdir."""
    from glm53.bench.store import drop_cache
    from store.pack import PackOptions, pack_store
    from store.synth import write_expert_checkpoint

    if opts.store is not None and opts.model is not None:
        return opts.model, opts.store
    model, store = opts.workdir / "synthetic-checkpoint", opts.workdir / "bench.glm53"
    gb = opts.layers * opts.experts * 9.04 * 2**20 / 1e9
    log(f"bench nvme: writing a synthetic checkpoint ({opts.layers} MoE layers x {opts.experts} experts of 9 MiB, "
        f"{gb:.1f} GB) in {model}, then packing {store}")
    shutil.rmtree(model, ignore_errors=True)
    store.unlink(missing_ok=True)
    made += [model, store]
    write_expert_checkpoint(model, layers=1 + opts.layers, dense_layers=1, experts=opts.experts, mtp_layers=0,
                            seed=opts.seed, **REAL)
    res = pack_store(PackOptions(model, store, threads=min(4, opts.threads), verify=False, progress=False),
                     log=lambda m: None)
    log(f"bench nvme: packed {res.records} records in {res.seconds:.1f} s")
    for f in model.glob("*.safetensors"):  # the checkpoint is only needed for the start-up verify now
        drop_cache(f)
    return model, store


def routing(opts: NvmeBenchOptions, steps: int, warm_steps: int = 1000):
    """Per layer: saved counts from an earlier stretch of the trace (the warm start), and the trace to decode.
    Each layer's picks: top-k of sigmoid(N(0, 1)) + beta * skew_profile, its own hot set per layer."""
    import numpy as np

    from glm53.fixture.exl3 import calibrate_router_skew, expert_rank_order, skew_profile

    beta = calibrate_router_skew(opts.experts, opts.top_k, 0.11, 0.40)
    rng = np.random.default_rng(opts.seed)
    warm, trace, lookahead = [], [], []
    for layer in range(opts.layers):
        bias = np.empty(opts.experts)
        bias[expert_rank_order(opts.seed, layer, opts.experts)] = beta * skew_profile(opts.experts)
        scores = 1.0 / (1.0 + np.exp(-rng.standard_normal((warm_steps + steps, opts.experts)))) + bias
        t = np.argpartition(-scores, opts.top_k - 1, axis=1)[:, : opts.top_k]
        warm.append(np.bincount(t[:warm_steps].reshape(-1), minlength=opts.experts).astype(np.float64))
        trace.append(t[warm_steps:])
        lookahead.append(scores[warm_steps:])
    return np.stack(warm), np.stack(trace), np.stack(lookahead)  # (L, E), (L, steps, top_k), (L, steps, E)


def lookahead_noise(scores, warm, resident: float, top_k: int, recall: float) -> float:
    """The noise on the router's scores for which top-k of the noisy scores names `recall` of the would-be misses:
    true picks outside each layer's warm set (its `resident` share of experts by saved counts), which is how the
    reference measured its router lookahead (0.55-0.75). The lookahead router sees the previous layer's hidden
    state, so it ranks the same experts a little wrongly: its wrong guesses are near misses, not random experts."""
    import numpy as np

    rng = np.random.default_rng(1)
    layers, steps, experts = scores.shape
    warm_set = np.zeros((layers, experts), bool)
    for layer in range(layers):
        warm_set[layer, np.argsort(-warm[layer], kind="stable")[: round(resident * experts)]] = True
    rows = min(steps, max(1, 4000 // layers))
    flat = scores[:, :rows].reshape(-1, experts)
    cold = np.repeat(~warm_set, rows, axis=0)
    truth = np.argpartition(-flat, top_k - 1, axis=1)[:, :top_k]
    want = np.zeros(flat.shape, bool)
    np.put_along_axis(want, truth, True, axis=1)
    want &= cold
    noise = rng.standard_normal(flat.shape)
    lo, hi = 0.0, 10.0
    for _ in range(30):  # common random numbers: the recall falls monotonically with sigma
        mid = 0.5 * (lo + hi)
        guess = np.zeros(flat.shape, bool)
        np.put_along_axis(guess, np.argpartition(-(flat + mid * noise), top_k - 1, axis=1)[:, :top_k], True, axis=1)
        got = (guess & want).sum() / max(1, want.sum())
        lo, hi = (mid, hi) if got > recall else (lo, mid)
    return 0.5 * (lo + hi)


def predict(actual, scores, mode: str, sigma: float, rng) -> list[int]:
    """The next layer's picks as the predictor names them: exact, or top-k of the router's scores plus noise."""
    import numpy as np

    if mode == "perfect":
        return [int(e) for e in actual]
    k = len(actual)
    return [int(e) for e in np.argpartition(-(scores + sigma * rng.standard_normal(scores.shape)), k - 1)[:k]]


# ---- the passes -------------------------------------------------------------------------------------------------


def plan_for(opts: NvmeBenchOptions, store: Path):
    """The nvme tier's EngineSpec for the bench's fractions: VRAM slots split evenly over the layers."""
    import numpy as np

    from glm53.planning.spec import engine_spec, split_budget

    total = opts.layers * opts.experts
    ram = max(opts.experts + 1, round(opts.ram_fraction * total))
    vram = split_budget(np.zeros((opts.layers, opts.experts)), round(opts.vram_fraction * total))
    return engine_spec("nvme", moe_layers=opts.layers, experts_per_layer=opts.experts, top_k=opts.top_k,
                       vram_slots=[int(s) for s in vram], kv_tokens=0, device="cpu", staging_slots=2, ram_slots=ram,
                       cpu_threads=1, store_threads=opts.threads, store=str(store))


def raw_pass(store: Path, keys, threads: int) -> float:
    from glm53.bench.store import raw_random
    from store.directio import alloc_slots
    from store.format import read_header

    head = read_header(store)
    bufs = alloc_slots(threads, head.max_extent)
    bufs[:] = 1  # fault the pages in before the clock starts, as the tier's arena is by then
    return raw_random(store, [(head.index[k].offset, head.index[k].extent) for k in keys], bufs)


def record_latency(store: Path, keys, parts: int) -> float:
    """Median seconds to read one record alone (nothing else in flight), as `parts` equal 4 KiB-aligned pieces
    read at once by as many threads: what a demand read waits when the disk is otherwise idle."""
    from concurrent.futures import ThreadPoolExecutor

    from store.directio import ALIGN, alloc_slots, open_for_read, pread_into
    from store.format import read_header

    head = read_header(store)
    buf = alloc_slots(1, head.max_extent)[0]
    buf[:] = 1
    fd, _ = open_for_read(store, allow_buffered=True)
    times = []
    try:
        with ThreadPoolExecutor(parts) as pool:
            for k in keys:
                e = head.index[k]
                step = -(-e.extent // parts // ALIGN) * ALIGN
                pieces = [(e.offset + o, buf[o:min(o + step, e.extent)]) for o in range(0, e.extent, step)]
                t0 = time.perf_counter()
                list(pool.map(lambda p: pread_into(fd, memoryview(p[1]), p[0]), pieces))
                times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return sorted(times)[len(times) // 2]


def stream_pass(store: Path, model: Path, plan, keys, top_k: int) -> float:
    """Random records demanded through a cold tier, one layer's top-k per step, nothing else going on."""
    import numpy as np

    from glm53.tiers.nvme_open import open_nvme_tier

    with open_nvme_tier(store, model, plan, warm=False, verify_sample=1) as tier:
        tier.arena[:] = 1  # fault the arena in first, as it is after warm-up in service
        layers = {sl: i for i, sl in enumerate(tier.store_layers)}
        by_layer: dict[int, list[int]] = {}
        for sl, e in keys:
            by_layer.setdefault(layers[sl], []).append(e)
        batches = [(layer, es[i:i + top_k]) for layer, es in by_layer.items() for i in range(0, len(es), top_k)]
        t0 = time.perf_counter()
        for layer, es in batches:
            ids = np.asarray(es, np.int64)
            tier.tiers.demand_reads(layer, ids)
            for e in es:  # distinct records of a cold tier: every one is a read
                tier.tiers.fetch_to_ram(layer, e, protect=ids)
        dt = time.perf_counter() - t0
        return tier.stats.snapshot()["nvme"]["reads"] * tier.stride / dt


def read_layer(tiers, layer: int, ids) -> None:
    """What a decode step of the layer asks of the store, and nothing else (no compute, no admission): its store
    misses all queued, then waited for one by one (the NVMe wait), each expert's move in flight settled, its picks
    counted by where they were found (VRAM hit, RAM as "cpu", store as "nvme") and taught to the layer's policy,
    which ranks the RAM experts a read drops."""
    import numpy as np

    from glm53.tiers import Where

    picks = ids.ravel().tolist()
    used = np.unique(ids)
    tiers.poll()
    tiers.demand_reads(layer, used)
    hits, store = set(), set()
    for e in used.tolist():
        tiers.stats.add_wait("pcie", tiers.settle(layer, e))
        if tiers.where[layer, e] in (Where.STORE, Where.FROM_STORE):
            store.add(e)
            t0 = time.perf_counter()
            tiers.fetch_to_ram(layer, e, protect=used)
            tiers.stats.add_wait("nvme", time.perf_counter() - t0)
        elif tiers.where[layer, e] == Where.VRAM:
            hits.add(e)
    tiers.observe(layer, ids)
    n_hit, n_store = sum(e in hits for e in picks), sum(e in store for e in picks)
    tiers.stats.add_lane_picks(layer, n_hit, 0, len(picks) - n_hit - n_store, n_store)


def decode_pass(store: Path, model: Path, plan, stats_path: Path, trace, scores, mode: str, opts: NvmeBenchOptions,
                sigma: float, seed: int) -> Window:
    import numpy as np

    from glm53.tiers.nvme_open import open_nvme_tier

    rng = np.random.default_rng(seed)

    with open_nvme_tier(store, model, plan, stats_path=stats_path, verify_sample=1) as tier:
        keys, read = [], tier.reader.read

        def logged(layer, e, out, **kw):  # the window's reads, for the raw replay (warm-up reads are done by now)
            fut = read(layer, e, out, **kw)
            keys.append(((layer, e), fut))
            return fut

        tier.reader.read = logged
        if mode.endswith("-after"):  # that earlier engine also left a needed guess in its queue place
            tier.reader.promote = lambda *a: False
        tokens, slept = trace.shape[1], 0.0
        t0 = time.perf_counter()
        for t in range(tokens):
            for layer in range(opts.layers):
                ids = trace[layer, t][None, :]
                kind, _, depth = mode.partition("-")
                after = depth == "after"
                if after:  # the layer's own store reads first, waited for; only then the guesses
                    read_layer(tier.tiers, layer, ids)
                else:  # as the engine: the layer's own reads queued first, the guesses right behind them
                    tier.tiers.demand_reads(layer, ids[0])
                for d in range(1, 2 if after else int(depth or 1) + 1) if mode != "off" else ():
                    if layer + d < opts.layers:
                        nxt = predict(trace[layer + d, t], scores[layer + d, t], kind, sigma, rng)
                        tier.prefetch([(layer + d, e) for e in nxt], protect={layer: ids[0].tolist()})
                if not after:
                    read_layer(tier.tiers, layer, ids)
                t1 = time.perf_counter()
                time.sleep(opts.compute_ms / 1e3)  # the layer's compute, during which reads go on
                slept += time.perf_counter() - t1
        dt = time.perf_counter() - t0
        snap = tier.stats.snapshot()
        nv = snap["nvme"]  # a guess cancelled before its read started cost the disk nothing
        nvme_bytes = (nv["reads"] + nv["prefetch_reads"] - nv["cancelled_prefetches"]) * tier.stride
        ran = [key for key, fut in keys if not fut.cancelled()]
        return Window(mode, dt, tokens, snap["picks"], nvme_bytes, snap["wait_seconds"]["nvme"], snap["prefetch"],
                      slept, ran)


# ---- the run ----------------------------------------------------------------------------------------------------


def run_bench(opts: NvmeBenchOptions, log=print) -> NvmeBenchResult:
    from glm53.bench.store import scratch

    with scratch(opts.workdir, opts.keep) as made:
        return _run(opts, log, made)


def _run(opts: NvmeBenchOptions, log, made: list[Path]) -> NvmeBenchResult:
    import numpy as np

    from glm53.planning.routing import save_routing_stats
    from glm53.tiers.nvme import model_key
    from store.format import read_header

    model, store = build_store(opts, log, made)
    head = read_header(store)
    layers = sorted({e.layer for e in head.entries})
    opts.layers, opts.experts = len(layers), len(head.entries) // len(layers)
    plan = plan_for(opts, store)
    warm, trace, scores = routing(opts, opts.tokens * opts.rounds * len(MODES))
    sigma = lookahead_noise(scores, warm, opts.ram_fraction + opts.vram_fraction, opts.top_k, opts.recall)
    stats_path = opts.workdir / "bench-nvme-routing.json"
    made.append(stats_path)
    save_routing_stats(stats_path, warm, model_key(head))
    total = opts.layers * opts.experts
    res = NvmeBenchResult(
        f"glm53 bench nvme, {time.strftime('%Y-%m-%d %H:%M %Z')}, {platform.node()}, {os.cpu_count()} CPUs; {store} "
        f"({len(head.entries)} records of {head.max_extent / 2**20:.2f} MiB, {opts.layers} layers x {opts.experts}); "
        f"RAM tier {plan.ram_slots} records ({plan.ram_slots / total:.0%}), VRAM {sum(plan.vram_slots)} "
        f"({sum(plan.vram_slots) / total:.0%}); {opts.threads} reader threads; top-{opts.top_k}; {opts.tokens} tokens per "
        f"window, {opts.rounds} interleaved rounds; {opts.compute_ms:g} ms compute per layer")
    res.compute_s_per_token = opts.layers * opts.compute_ms / 1e3
    res.record_bytes = head.max_extent
    rng = np.random.default_rng(opts.seed)
    keys = sorted(head.index)
    n = min(len(keys) // 2, 12 * opts.threads)
    seg = 0
    for r in range(opts.rounds):
        # The same records both ways: on this class of disk the rate depends on where the records lie (one random
        # set of records read at half the rate of another, again and again), so only a replay is a fair baseline.
        chosen = [keys[i] for i in rng.permutation(len(keys))[:n]]
        if r % 2 == 0:
            res.raw.append(raw_pass(store, chosen, opts.threads))
            res.stream.append(stream_pass(store, model, plan, chosen, opts.top_k))
        else:
            res.stream.append(stream_pass(store, model, plan, chosen, opts.top_k))
            res.raw.append(raw_pass(store, chosen, opts.threads))
        modes = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for mode in modes:
            span = slice(seg * opts.tokens, (seg + 1) * opts.tokens)
            seg += 1
            w = decode_pass(store, model, plan, stats_path, trace[:, span], scores[:, span], mode, opts, sigma,
                            opts.seed + seg)
            # The disk's rate for exactly these records, right after: on a VM disk the host may cache re-read
            # records, so a fresh random set would understate what the same reads cost raw.
            w.raw_replay = raw_pass(store, w.keys, opts.threads) if w.keys else float("inf")
            res.windows.append(w)
        log(f"bench nvme: round {r + 1}/{opts.rounds}: raw {res.raw[-1] / 1e9:.2f} GB/s, tier stream "
            f"{res.stream[-1] / 1e9:.2f} GB/s, decode " + ", ".join(
                f"{w.mode} {w.tok_s:.2f}" for w in res.windows[-len(MODES):]) + " tok/s")
    res.notes.append("each decode window decodes its own stretch of the trace from a fresh tier warmed from the same "
                     "statistics; modes alternate order between rounds")
    res.notes.append("bound = 1 / max(compute per token, NVMe bytes per token / raw replay rate): what perfect "
                     "overlap of compute and reads would give with this window's reads; raw replay = the same records "
                     "read with plain O_DIRECT preads, `threads` in flight, right after the window")
    return res


# ---- CLI ----------------------------------------------------------------------------------------------------------


def register_bench(bench_sub) -> None:
    b = bench_sub.add_parser("nvme", help="the nvme tier on a full-width record store: picks per tier, NVMe rate vs "
                             "raw O_DIRECT, prefetch off / perfect (1, 2, 3 layers ahead) / realistic",
                             description=__doc__.split("\n\n")[0])
    b.add_argument("--store", type=Path, help="an existing store (with --model); default: a synthetic one")
    b.add_argument("--model", type=Path, help="the store's checkpoint (start-up verifies against it)")
    b.add_argument("--workdir", type=Path, help="where synthetic files go (default: GLM53_CACHE_DIR/bench-nvme); "
                   "must be on the disk you want to measure")
    b.add_argument("--layers", type=int, default=8, help="MoE layers of the synthetic store (default 8)")
    b.add_argument("--experts", type=int, default=72, help="experts per layer of the synthetic store (default 72)")
    b.add_argument("--top-k", type=int, default=2, help="picks per layer and token (default 2: 72 experts, top-2 keep "
                   "the real 8-of-288 ratio)")
    b.add_argument("--ram-fraction", type=float, default=0.47, help="RAM tier share of all experts (default 0.47, "
                   "what a 55 GiB cap gives the real model; 16 GiB gives 0.125; at least one layer's experts + 1)")
    b.add_argument("--vram-fraction", type=float, default=0.11, help="VRAM share (default 0.11, a 24 GB card)")
    b.add_argument("--threads", type=int, default=8, help="store reader threads (default 8, the plan's)")
    b.add_argument("--tokens", type=int, default=64, help="decode tokens per window (default 64)")
    b.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    b.add_argument("--layer-ms", type=float, help="simulated compute per layer (default 1.2 ms per 8 picks: 42 "
                   "layers at ~20 tok/s)")
    b.add_argument("--recall", type=float, default=0.6, help="the realistic predictor's recall (default 0.6)")
    b.add_argument("--keep", action="store_true", help="keep the synthetic files")
    b.set_defaults(func=cmd_bench_nvme)


def cmd_bench_nvme(args: argparse.Namespace) -> int:
    from glm53.planning.settings import load_or_exit
    from store.errors import StoreError

    settings = load_or_exit()
    if (args.store is None) != (args.model is None):
        print("glm53 bench nvme: error: --store and --model go together", file=sys.stderr)
        return 2
    opts = NvmeBenchOptions(workdir=args.workdir or Path(settings.cache_dir) / "bench-nvme", store=args.store,
                            model=args.model, layers=args.layers, experts=args.experts, top_k=args.top_k,
                            ram_fraction=args.ram_fraction, vram_fraction=args.vram_fraction, threads=args.threads,
                            tokens=args.tokens, rounds=args.rounds, layer_ms=args.layer_ms, recall=args.recall,
                            keep=args.keep)
    try:
        print(run_bench(opts, log=lambda m: print(m, file=sys.stderr, flush=True)).render())
    except StoreError as exc:
        print(f"glm53 bench nvme: error: {exc.problem}\n  fix: {exc.fix}", file=sys.stderr)
        return 1
    return 0
