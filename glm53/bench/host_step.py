"""`glm53 bench host-step`: the host's share of one decoded MoE layer step, in microseconds.

On the GPU every MoE layer of every decoded token stops in `MoeStepper.resolve()` between exllamav3's router and its
expert kernels, and the GPU waits for it: at 75 MoE layers, each microsecond here costs 75 per token. This replays
decode steps through `resolve()` on CPU tiers with the real model's counts (288 experts, top-k 8, 32 VRAM slots per
layer, 289 staging slots, the RAM tier holding the rest) and a slot image of a few hundred bytes: the real copies run
asynchronously on the copy engines, so what is left, and measured, is the Python and numpy bookkeeping. Routing is
Zipf-like with some token-to-token locality, so the VRAM hit rate (~70%) and the admission rate are realistic.

Reports the median and p90 per layer step, then where the time goes (a second, profiled replay of the same trace:
the profiler inflates everything, so its shares matter, not its microseconds). `--baseline REV` runs the same
benchmark from a git worktree of REV in the same run, so the ratio compares like with like on this machine;
`--baseline-driver this` runs this version's benchmark there instead of REV's own (REV's code, this driver).

`--nvme` measures the nvme modes' path instead (glm53.bench.host_step_nvme): a record store packed for the run,
the RAM tier as its cache, and the next layer's lookahead after each step the stepper runs it for, as the GPU engine
runs them. With `--disk-ms-per-record` / `--gpu-ms-per-layer` it then also decodes against an emulated rate-capped
disk and GPU (host_step_nvme.emulate).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glm53.bench import worktree

# The commit before the host path's optimisation: what `--baseline` compares with unless told otherwise.
BASELINE_REV = "c118cdc43d4c8f54eb3b1aa2ddd978d05fd9c51f"
JSON_FORMAT = 1


@dataclass(frozen=True)
class HostBenchOptions:
    layers: int = 8
    experts: int = 288
    top_k: int = 8
    slots: int = 32
    staging: int = 289
    bsz: tuple[int, ...] = (1, 4)
    steps: int = 300
    warmup: int = 100
    zipf: float = 1.1
    locality: float = 1.0
    seed: int = 0
    top: int = 8


def _build(opts: HostBenchOptions, bsz: int) -> tuple[Any, Any, list[np.ndarray]]:
    """Tiers warmed from the routing of a first stretch of the trace (as saved statistics warm a real start), the
    stepper, and per layer the (steps, bsz, top_k) picks to replay."""
    import torch

    from glm53.bench.routing_trace import zipf_trace
    try:
        from glm53.step.stepper import MoeStepper
    except ImportError:  # a baseline tree from before glm53/step (`--baseline-driver this`)
        from glm53.engine.moe_step import MoeStepper
    from glm53.tiers import ExpertTiers, SlotLayout

    layout = SlotLayout.packed([("w", torch.uint8, (256,))])
    total = opts.layers * opts.experts
    vram = [opts.slots] * opts.layers
    tiers = ExpertTiers(layout, opts.experts, vram, total - sum(vram) + 1 + opts.top_k, device="cpu",
                        staging_slots=opts.staging, pin=False)
    n = (opts.warmup + opts.steps) * bsz
    traces = [zipf_trace(n, opts.experts, opts.top_k, exponent=opts.zipf, locality=opts.locality,
                         seed=opts.seed * 1000 + li).reshape(-1, bsz, opts.top_k) for li in range(opts.layers)]
    counts = np.stack([np.bincount(t[: max(1, opts.warmup)].ravel(), minlength=opts.experts) for t in traces])
    tiers.populate(lambda layer, e, out: None, counts)
    return tiers, MoeStepper(tiers, vram, opts.staging), traces


def _replay(stepper: Any, traces: list[np.ndarray], steps: range, times: list[float] | None = None,
            after: list[float] | None = None) -> None:
    """Decode steps in model order: every layer of token t, then token t + 1. `times`: resolve(), what the GPU
    waits for. `after`: a stepper's after_launch (deferred admissions), which the engine runs from exllamav3's
    combine while the GPU computes: timed apart, off the GPU's critical path (a stepper without one has none)."""
    clock = time.perf_counter
    after_launch = getattr(stepper, "after_launch", None)
    for t in steps:
        for li, trace in enumerate(traces):
            ids = trace[t]
            t0 = clock()
            stepper.resolve(li, ids, decode=True)
            t1 = clock()
            if times is not None:
                times.append(t1 - t0)
            if after_launch is not None:
                after_launch()
                if after is not None:
                    after.append(clock() - t1)


def _label(func: tuple[str, int, str]) -> str:
    filename, _, name = func
    if filename == "~":  # a builtin: pstats spells it "<method 'x' of 'y' objects>" or "<built-in method x>"
        return name.replace("<built-in method ", "<").replace(" objects>", ">")
    return f"{Path(filename).name}:{name}"


def _breakdown(stepper: Any, traces: list[np.ndarray], steps: range, top: int) -> dict:
    """Time inside resolve() by what resolve() called directly (cumulative), and the top functions by own time;
    each as a share of resolve()'s total and as profiled microseconds per layer step."""
    prof = cProfile.Profile()
    prof.enable()
    _replay(stepper, traces, steps)
    prof.disable()
    return profile_rows(prof, top)


# What a profiled replay spends blocked on store reads is charged here (resolve's call that waits for the reads, and
# the lock a Future.result() sleeps on): they lose it, so that the shares are of the host's own work.
_BLOCKED_CALLS = {("tiers.py", "fetch_to_ram"), ("timing.py", "wait")}  # the step's waits go through its timer
_BLOCKED_OWN = "<method 'acquire' of '_thread.lock' objects>"
_STEPS = ("_decode_step", "_prefill_step")


def profile_rows(prof: cProfile.Profile, top: int, roots: tuple[str, ...] = ("resolve",), blocked: float = 0.0) -> dict:
    """The breakdown of a profiled replay: time inside the MoeStepper `roots` (resolve first; one row per layer step)
    by what each called directly (cumulative; a later root's rows are prefixed with its name), and the top
    functions by own time, each as a share of the roots' total less `blocked` (seconds blocked on store reads) and
    as profiled microseconds per layer step."""
    st = pstats.Stats(prof).stats  # func -> (primitive calls, calls, own time, cumulative time, callers)
    found = {f[2]: f for f in st if f[2] in roots and f[0].endswith(("stepper.py", "moe_step.py"))}
    root_funcs = [found[name] for name in roots if name in found]
    n = st[root_funcs[0]][1]
    removed = 0.0  # what the rows lose to `blocked`, by the profiler's clock: the total loses the same
    callees: list[tuple[float, str]] = []
    for i, root in enumerate(root_funcs):
        prefix = "" if i == 0 else f"{root[2]} > "
        # resolve() dispatches to the decode or the prefill step: the breakdown is what those call.
        sources = [root] + ([f for f in st if f[2] in _STEPS and f[0].endswith("stepper.py")]
                            if root[2] == "resolve" else [])
        for src in sources:
            for f, (*_, callers) in st.items():
                if src in callers and f not in sources:
                    ct = callers[src][3]
                    label = _label(f)
                    if blocked and (Path(f[0]).name, f[2]) in _BLOCKED_CALLS:
                        cut = min(ct, max(0.0, blocked - removed))
                        ct, label, removed = ct - cut, f"{label} (less store_wait)", removed + cut
                    callees.append((ct, prefix + label))
        callees.append((sum(st[src][2] for src in sources), f"{root[2]} (own time)"))
    total = sum(st[f][3] for f in root_funcs) - removed
    own = []
    for f, (_, _, tt, _, _) in st.items():
        if f in root_funcs:
            continue
        label = _label(f)
        if blocked and f[2] == _BLOCKED_OWN:
            tt, label = max(0.0, tt - blocked), f"{label} (less store_wait)"
        own.append((tt, label))

    def rows(items: list[tuple[float, str]]) -> list[dict]:
        return [{"name": name, "share": sec / total, "us": sec / n * 1e6}
                for sec, name in sorted(items, reverse=True)[:top]]

    return {"profiled_us": total / n * 1e6, "by_call": rows(callees), "by_own_time": rows(own)}


def measure(opts: HostBenchOptions, bsz: int) -> dict:
    tiers, stepper, traces = _build(opts, bsz)
    _replay(stepper, traces, range(opts.warmup))
    before = tiers.stats.snapshot()["picks"]
    times: list[float] = []
    after: list[float] = []
    _replay(stepper, traces, range(opts.warmup, opts.warmup + opts.steps), times, after)
    picks = tiers.stats.snapshot()["picks"]
    hits, total = picks["vram_hit"] - before["vram_hit"], picks["total"] - before["total"]
    us = np.asarray(times) * 1e6
    # The breakdown replays the same steps on fresh tiers, so the profiler's overhead never touches the timings.
    _, prof_stepper, _ = _build(opts, bsz)
    _replay(prof_stepper, traces, range(opts.warmup))
    breakdown = _breakdown(prof_stepper, traces, range(opts.warmup, opts.warmup + opts.steps), opts.top)
    doc = {"bsz": bsz, "layer_steps": len(times), "median_us": float(np.median(us)),
           "p90_us": float(np.percentile(us, 90)), "mean_us": float(us.mean()),
           "hit_rate": hits / total if total else None, "breakdown": breakdown}
    if after:
        a = np.asarray(after) * 1e6
        doc["after_launch"] = {"median_us": float(np.median(a)), "p90_us": float(np.percentile(a, 90))}
    return doc


def run_bench(opts: HostBenchOptions, nvme: Any = None, emulation: Any = None) -> dict:
    """nvme: glm53.bench.host_step_nvme.HostStepNvmeOptions to measure the nvme path instead (on a record store
    packed for the run); its options are then under "nvme" and each run carries the nvme figures. emulation (with
    nvme): host_step_nvme.EmulationOptions, an emulated disk and GPU to decode against after the host figures;
    its options are then under "emulation" and each run carries `host_step_nvme.emulate`'s figures as
    "emulated"."""
    if nvme is None:
        return {"format": JSON_FORMAT, "options": asdict(opts), "runs": [measure(opts, b) for b in opts.bsz]}
    from glm53.bench import host_step_nvme

    def breakdown(prof: cProfile.Profile, blocked: float) -> dict:
        return profile_rows(prof, opts.top, ("resolve", "ahead", "after_launch"), blocked)

    emulated = emulation is not None and emulation.on
    with host_step_nvme.StoreFixture(opts.layers, opts.experts, opts.seed) as fx:
        runs = [host_step_nvme.measure(opts, nvme, fx.store, b, breakdown) for b in opts.bsz]
        if emulated:
            for run in runs:
                run["emulated"] = host_step_nvme.emulate(opts, nvme, emulation, fx.store, run["bsz"])
    doc = {"format": JSON_FORMAT, "options": asdict(opts), "nvme": asdict(nvme), "runs": runs}
    if emulated:
        doc["emulation"] = asdict(emulation)
    return doc


# ---- the baseline, from a worktree of another revision ---------------------------------------------------------------


def _cli_args(opts: HostBenchOptions, nvme: Any = None) -> list[str]:
    args = ["--layers", str(opts.layers), "--experts", str(opts.experts), "--top-k", str(opts.top_k),
            "--slots", str(opts.slots), "--staging", str(opts.staging), "--bsz", ",".join(map(str, opts.bsz)),
            "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--zipf", str(opts.zipf),
            "--locality", str(opts.locality), "--seed", str(opts.seed), "--top", str(opts.top)]
    if nvme is not None:
        args += ["--nvme", "--ram-share", str(nvme.ram_share), "--recall", str(nvme.recall), "--store-threads",
                 str(nvme.store_threads)]
    return args


# This benchmark's file in each layout (glm53/engine/ before glm53/bench/ held the benchmarks).
BENCH_FILES = ("glm53/bench/host_step.py", "glm53/engine/host_bench.py")
# `--baseline-driver this` runs this version's benchmark package on the baseline's code, through main() below.
DRIVER = "import sys; from glm53.bench.host_step import main; sys.exit(main(sys.argv[1:]))"


def run_baseline(rev: str, opts: HostBenchOptions, nvme: Any = None, driver: str = "own") -> tuple[dict | None, str]:
    """This benchmark as `rev` runs it, from a temporary git worktree; (its JSON or None, what happened).
    driver="this": this version's benchmark package is copied into the worktree and run there, so the same driver
    measures rev's code (for a rev from before a benchmark mode existed; what it calls must exist in rev)."""
    root = worktree.repo_root()
    commit = worktree.resolve(rev, root)
    if commit is None:
        return None, f"baseline {rev}: not a commit of {root}"
    who = f"baseline {rev} ({commit[:10]})"
    own = worktree.first_file(commit, BENCH_FILES, root)
    if own is None:
        return None, f"{who} lacks `glm53 bench host-step`: only this version's numbers"
    if driver == "this":
        who += " measured by this version's benchmark"
    elif nvme is not None and '"--nvme"' not in worktree.show(commit, own, root):
        return None, (f"{who} lacks `bench host-step --nvme`: only this version's numbers (`--baseline-driver this` "
                      "runs this version's benchmark on its code)")
    args = ["--json", "--baseline", "none", *_cli_args(opts, nvme)]
    try:
        with worktree.baseline_tree(commit, root) as tree:
            if driver == "this":
                shutil.rmtree(tree / "glm53" / "bench", ignore_errors=True)
                shutil.copytree(root / "glm53" / "bench", tree / "glm53" / "bench",
                                ignore=shutil.ignore_patterns("__pycache__", "*.so"))
                proc = subprocess.run([sys.executable, "-c", DRIVER, *args], cwd=tree, env=worktree.tree_env(tree),
                                      capture_output=True, text=True)
            else:
                proc = worktree.run_glm53(tree, ["bench", "host-step", *args])
    except worktree.BaselineError as exc:
        return None, f"{who}: {exc}"
    if proc.returncode:
        return None, f"{who} failed: {proc.stderr.strip()[-2000:]}"
    return json.loads(proc.stdout), who


# ---- the command ----------------------------------------------------------------------------------------------------


def _print_run(run: dict, who: str, log) -> None:
    hr = "n/a" if run["hit_rate"] is None else f"{run['hit_rate']:.3f}"
    log(f"{who} bsz {run['bsz']}: median {run['median_us']:.1f} us, p90 {run['p90_us']:.1f} us per layer step "
        f"({run['layer_steps']} layer steps, VRAM hit rate {hr})")
    if "store_wait" in run:
        _print_nvme(run, log)
    elif "after_launch" in run:
        al = run["after_launch"]
        log(f"  plus, off the GPU's critical path, after launch (deferred admissions): median {al['median_us']:.1f} "
            f"us, p90 {al['p90_us']:.1f}")
    b = run["breakdown"]
    roots = "resolve, ahead and after_launch" if "store_wait" in run else "resolve"
    log(f"  by call from {roots} (profiled {b['profiled_us']:.1f} us per layer step):")
    for row in b["by_call"]:
        log(f"    {100 * row['share']:5.1f}%  {row['us']:8.1f} us  {row['name']}")
    log("  by own time:")
    for row in b["by_own_time"]:
        log(f"    {100 * row['share']:5.1f}%  {row['us']:8.1f} us  {row['name']}")


def _print_nvme(run: dict, log) -> None:
    r, a, w, s = run["resolve"], run["ahead"], run["store_wait"], run["store"]
    recall = "n/a" if run["lookahead_recall"] is None else f"{run['lookahead_recall']:.3f}"
    log(f"  resolve (plan) median {r['median_us']:.1f} us, p90 {r['p90_us']:.1f}; ahead median {a['median_us']:.1f} "
        f"us, p90 {a['p90_us']:.1f}; blocked on reads (not counted) mean {w['mean_us']:.1f} us, in "
        f"{w['steps_waiting']} of {run['layer_steps']} steps")
    if "after_launch" in run:
        al = run["after_launch"]
        log(f"  after launch (deferred admissions) median {al['median_us']:.1f} us, p90 {al['p90_us']:.1f}")
    if "before_launch" in run:
        bl = run["before_launch"]
        log(f"  host work before launch (the GPU waits for it; store waits not counted) median "
            f"{bl['median_us']:.1f} us, p90 {bl['p90_us']:.1f}")
    log(f"  per layer step: {s['demand_reads_per_step']:.2f} demand and {s['prefetch_reads_per_step']:.2f} prefetch "
        f"reads, {s['store_picks_per_step']:.2f} picks from the store; lookahead recall {recall}; "
        f"{'O_DIRECT' if run['direct_io'] else 'buffered'} reads")


def _print_emulated(runs: list[dict], log) -> None:
    """The emulated disk and GPU's figures per batch size."""
    first = runs[0]["emulated"]
    log(f"emulated disk and GPU: a record ({first['record_bytes']} B) takes {first['disk_ms_per_record']:g} ms read "
        f"alone, reads in flight sharing that rate; the GPU busy {first['gpu_ms_per_layer']:g} ms per layer step; "
        f"{first['runs']} timed runs, {first['steps']} decode steps each")
    for run in runs:
        em = run["emulated"]
        for name, r in em["readers"].items():
            g = r["guesses"]
            gain = "" if r["two_at_once_gain"] is None else f", two at once {r['two_at_once_gain']:.2f}x as fast"
            at_once = "n/a" if r["prefetch_at_once"] is None else f"{r['prefetch_at_once']:g}"
            busy = "n/a" if r["store_busy"] is None else f"{r['store_busy']:.2f}"
            log(f"  bsz {run['bsz']} {name} ({at_once} guess reads at once{gain}): {r['step_ms']:.2f} ms per step "
                f"(store waits {r['store_wait_ms']:.2f}, host before launch {r['host_ms']:.2f}, GPU "
                f"{r['gpu_ms']:.2f}); store busy {busy}, load {r['store_load']:.2f}, a right guess saving "
                f"{r['guess_saving']:.2f} of a read, guess floor {r['guess_floor']:.2f}")
            log(f"    per step: {r['demand_reads']:.2f} demand and {r['prefetch_reads']:.2f} guess reads; guesses "
                f"issued {g['issued']:.2f}, in time {g['hits']:.2f}, late {g['late']:.2f} (under way "
                f"{g['late_under_way']:.2f}), wasted {g['wasted']:.2f}; demand misses {g['demand_misses']:.2f}")


def report(doc: dict, base: dict | None, note: str | None, log=print) -> None:
    o = doc["options"]
    log(f"glm53 bench host-step: {o['layers']} MoE layers x {o['experts']} experts, top-k {o['top_k']}, "
        f"{o['slots']} VRAM slots per layer, {o['staging']} staging; {o['steps']} decode steps after {o['warmup']} "
        f"warm-up; Zipf {o['zipf']}, locality {o['locality']}")
    if "nvme" in doc:
        n = doc["nvme"]
        tier = "the whole tier" if n["ram_share"] >= 1 else f"{n['ram_share']} of all experts"
        log(f"nvme: RAM tier {tier}, record store of tiny experts, {n['store_threads']} "
            f"reader threads, lookahead guesses at recall {n['recall']}; per layer step: resolve + ahead + after "
            "launch, less the time blocked on store reads")
    for run in doc["runs"]:
        _print_run(run, "this", log)
    if any("emulated" in run for run in doc["runs"]):
        _print_emulated([run for run in doc["runs"] if "emulated" in run], log)
    if base is not None:
        for run in base["runs"]:
            _print_run(run, "baseline", log)
    if note:
        log(note)
    if base is None:
        return
    base_by_bsz = {r["bsz"]: r for r in base["runs"]}
    for run in doc["runs"]:
        b = base_by_bsz.get(run["bsz"])
        if b is not None:
            r = run["median_us"] / b["median_us"]
            log(f"ratio bsz {run['bsz']}: this / baseline = {run['median_us']:.1f} / {b['median_us']:.1f} us "
                f"= {r:.3f} ({1 / r:.2f}x fewer us per layer step)")
            if "before_launch" in run and "before_launch" in b:
                now, was = run["before_launch"], b["before_launch"]
                log(f"  host work before launch (store waits not counted): median {now['median_us']:.1f} / "
                    f"{was['median_us']:.1f} us = {now['median_us'] / was['median_us']:.3f}, mean "
                    f"{now['mean_us']:.1f} / {was['mean_us']:.1f} us = {now['mean_us'] / was['mean_us']:.3f}")


def _ints(spec: str) -> tuple[int, ...]:
    out = tuple(int(b) for b in spec.split(",") if b.strip())
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError("takes positive integers, comma-separated")
    return out


def register_bench(bench_sub: Any) -> None:
    from glm53.bench.host_step_nvme import EmulationOptions, HostStepNvmeOptions

    d, dn = HostBenchOptions(), HostStepNvmeOptions()
    p = bench_sub.add_parser("host-step", help="host microseconds per decoded MoE layer step (MoeStepper.resolve on "
                                               "CPU tiers) vs a baseline revision")
    p.add_argument("--layers", type=int, default=d.layers, help=f"MoE layers replayed (default {d.layers})")
    p.add_argument("--experts", type=int, default=d.experts, help=f"experts per layer (default {d.experts})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"picks per token (default {d.top_k})")
    p.add_argument("--slots", type=int, default=d.slots, help=f"VRAM slots per layer (default {d.slots})")
    p.add_argument("--staging", type=int, default=d.staging, help=f"staging slots (default {d.staging})")
    p.add_argument("--bsz", type=_ints, default=d.bsz, help="decode batch sizes, comma-separated (default 1,4)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"timed decode steps (default {d.steps})")
    p.add_argument("--warmup", type=int, default=d.warmup, help=f"untimed steps first (default {d.warmup})")
    p.add_argument("--zipf", type=float, default=d.zipf, help=f"popularity exponent (default {d.zipf})")
    p.add_argument("--locality", type=float, default=d.locality,
                   help=f"bonus for the previous token's picks (default {d.locality})")
    p.add_argument("--seed", type=int, default=d.seed, help="routing trace seed")
    p.add_argument("--top", type=int, default=d.top, help=f"breakdown rows (default {d.top})")
    p.add_argument("--baseline", default=BASELINE_REV, metavar="REV",
                   help=f"git revision to compare with, from a temporary worktree; 'none' skips (default "
                        f"{BASELINE_REV})")
    p.add_argument("--baseline-driver", choices=("own", "this"), default="own",
                   help="run the baseline's own benchmark (default), or this version's on the baseline's code (for a "
                        "baseline from before --nvme)")
    p.add_argument("--nvme", action="store_true",
                   help="the nvme modes' path: a record store packed for the run (tiny experts), the RAM tier as its "
                        "cache, the next layer's lookahead after each step; time blocked on reads is not counted")
    p.add_argument("--ram-share", type=float, default=dn.ram_share,
                   help=f"--nvme: RAM tier records as a share of all experts (default {dn.ram_share}); 1.0: every "
                        "expert outside VRAM plus the rows the plan adds, all warmed (nothing read from the store)")
    p.add_argument("--recall", type=float, default=dn.recall,
                   help=f"--nvme: share of the next layer's picks the lookahead guesses (default {dn.recall})")
    p.add_argument("--store-threads", type=int, default=dn.store_threads,
                   help=f"--nvme: store reader threads (default {dn.store_threads})")
    de = EmulationOptions()
    p.add_argument("--disk-ms-per-record", type=float, default=de.disk_ms_per_record, metavar="MS",
                   help="--nvme: then also decode against an emulated disk on which one of the bench store's records "
                        "takes MS ms read alone and reads in flight share that rate (GPU machine: ~6)")
    p.add_argument("--gpu-ms-per-layer", type=float, default=de.gpu_ms_per_layer, metavar="MS",
                   help="--nvme: then also decode with an emulated GPU, busy MS ms from each layer step's launch to "
                        "the next router output (GPU machine: ~0.6)")
    p.add_argument("--emulated-runs", type=int, default=de.runs, metavar="N",
                   help=f"timed runs on the emulated disk (default {de.runs})")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="write the results as JSON to FILE (bare --json: to stdout, instead of the report)")
    p.set_defaults(func=cmd_bench_host_step)


def _nvme_options(args: argparse.Namespace) -> Any:
    """The --nvme options, or None (not asked for, or out of range)."""
    from glm53.bench.host_step_nvme import HostStepNvmeOptions

    if not args.nvme or not (0 < args.ram_share <= 1 and 0 <= args.recall <= 1 and args.store_threads >= 1):
        return None
    return HostStepNvmeOptions(args.ram_share, args.recall, args.store_threads)


def _emulation_options(args: argparse.Namespace) -> Any:
    """The emulated disk and GPU's options, or None where neither is asked for."""
    from glm53.bench.host_step_nvme import EmulationOptions

    if not (args.disk_ms_per_record or args.gpu_ms_per_layer):
        return None
    return EmulationOptions(args.disk_ms_per_record, args.gpu_ms_per_layer, args.emulated_runs)


def main(argv: list[str]) -> int:
    """`bench host-step ARGV` alone (the baseline driver's entry on an older tree's code)."""
    parser = argparse.ArgumentParser(prog="glm53 bench")
    register_bench(parser.add_subparsers(dest="bench", required=True))
    return cmd_bench_host_step(parser.parse_args(["host-step", *argv]))


def cmd_bench_host_step(args: argparse.Namespace) -> int:
    opts = HostBenchOptions(args.layers, args.experts, args.top_k, args.slots, args.staging, tuple(args.bsz),
                            args.steps, args.warmup, args.zipf, args.locality, args.seed, args.top)
    if opts.slots > opts.experts or opts.top_k > opts.experts or opts.steps < 1:
        print("glm53 bench host-step: need slots <= experts, top-k <= experts and steps >= 1", file=sys.stderr)
        return 2
    nvme = _nvme_options(args)
    if args.nvme and nvme is None:
        print("glm53 bench host-step --nvme: need 0 < --ram-share <= 1, 0 <= --recall <= 1 and --store-threads >= 1",
              file=sys.stderr)
        return 2
    emulation = _emulation_options(args)
    if emulation is not None and (nvme is None or min(emulation.disk_ms_per_record, emulation.gpu_ms_per_layer) < 0
                                  or emulation.runs < 1):
        print("glm53 bench host-step: --disk-ms-per-record and --gpu-ms-per-layer need --nvme, take ms >= 0, and "
              "--emulated-runs >= 1", file=sys.stderr)
        return 2
    doc = run_bench(opts, nvme, emulation)
    base, note = ((None, None) if args.baseline.lower() == "none"
                  else run_baseline(args.baseline, opts, nvme, args.baseline_driver))
    if base is not None:
        doc["baseline"] = {"rev": args.baseline, "runs": base["runs"]}
    if args.json == "-":
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
        return 0
    report(doc, base, note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0
