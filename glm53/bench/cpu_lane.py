"""`glm53 bench cpu-lane`: the CPU expert kernel's expert-bytes/s against this host's RAM read bandwidth.

For 1..N threads (pinned one per physical core) and 1, 4 and 8 rows per expert, the time of a lane step of four
GLM-5.3-Flash-sized experts (synthetic, spread over more memory than the caches hold), as expert bytes/s, next
to the RAM read bandwidth measured in the same run with the same thread count (a torch sum over 512 MiB). The
ratio says how close the lane comes to reading experts as fast as memory can deliver them (the issue's target is
0.5 of the host's RAM read bandwidth). First, the start-up calibration the lane runs: which SIMD path is fastest
here, and the CPU cost model fitted from its timings, as the planner would use it.

Each point times the kernel the lane serves on that path (the integer kernel where the build has one, see
glm53.cpu_lane.kernel) and, beside it, the exact kernel, their steps alternating so that both see the same host:
milliseconds per expert (the median of the repeats; the JSON also has the best), the speed-up, and the cost in
thread-cycles per weight at the clock /proc/cpuinfo reports (or --ghz).

--baseline-lib times another build of the library (an older commit's, say) in the same run, its steps alternating
with this build's, so that both see the same host; build one with e.g.
    git worktree add /tmp/base <commit> && (cd /tmp/base && python setup.py build_ext --inplace)
and pass /tmp/base/glm53/cpu_lane/_expert_kernel*.so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

import numpy as np


def register_bench(bench_sub: Any) -> None:
    p = bench_sub.add_parser("cpu-lane", help="CPU expert kernel: expert bytes/s at 1/4/8 rows and 1..N threads vs "
                                              "the measured RAM read bandwidth")
    p.add_argument("--threads", type=int, help="most threads to try (default: every physical core)")
    p.add_argument("--thread-list", help="comma-separated thread counts (default: 1, 2, 4, ... and the maximum)")
    p.add_argument("--rows", default="1,4,8", help="rows per expert (default 1,4,8)")
    p.add_argument("--experts", type=int, default=4, help="experts per timed lane step (default 4)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per point; the best counts (default 5)")
    p.add_argument("--isa", help="SIMD path (default: the fastest measured here)")
    p.add_argument("--kernel", choices=("int", "exact"), help="the kernel timed (default: the one served on that "
                                                              "path); the exact one is timed beside an integer one")
    p.add_argument("--ghz", type=float, help="clock for the cycles-per-weight column (default: /proc/cpuinfo's)")
    p.add_argument("--no-pin", action="store_true", help="do not pin worker threads to cores")
    p.add_argument("--gap-us", type=int, default=0, help="idle microseconds before each timed call, as decode "
                   "calls the lane once a MoE layer step (default 0: back to back)")
    p.add_argument("--spin-us", type=int, help="how long idle workers spin before they sleep (default: the lane's)")
    p.add_argument("--hidden", type=int, default=4096, help="expert geometry (default GLM-5.3-Flash: 4096)")
    p.add_argument("--intermediate", type=int, default=2048, help="(default 2048)")
    p.add_argument("--bits", type=int, default=3, help="EXL3 K of the trellis (default 3)")
    p.add_argument("--baseline-lib", metavar="SO", help="another build of the kernel library (e.g. an older commit's "
                                                        "_expert_kernel*.so), timed in the same run, interleaved")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=cmd_bench_cpu_lane)


def _thread_list(max_threads: int, spec: str | None) -> list[int]:
    if spec:
        out = sorted({int(t) for t in spec.split(",") if t.strip()})
        if not out or out[0] < 1:
            raise ValueError("--thread-list takes positive integers")
        return out
    out, t = [], 1
    while t < max_threads:
        out.append(t)
        t *= 2
    return out + [max_threads]


def run_bench(args: argparse.Namespace, log=print) -> dict:
    from glm53.cpu_lane import kernel as K
    from glm53.cpu_lane.calibrate import _Pool, calibrate_cpu, expert_geometry, ram_read_bandwidth, time_step
    from glm53.cpu_lane.planner import fit_cpu

    if not K.available():
        raise K.KernelUnavailable(f"the CPU expert kernel is unavailable: {K.unavailable_reason()}")
    cores = K.physical_cores()
    max_threads = args.threads or len(cores) or 1
    threads = _thread_list(max_threads, args.thread_list)
    rows_list = [int(r) for r in args.rows.split(",")]
    geo = expert_geometry(args.hidden, args.intermediate, args.bits)
    pin = not args.no_pin

    def cpus(t: int) -> list[int] | None:
        return K.pick_cpus(t) if pin else None

    log(f"glm53 bench cpu-lane: {_cpu_model()}; {len(cores) or '?'} physical cores; paths: "
        f"{', '.join(K.supported_isas())}; expert {geo.nbytes / 2**20:.2f} MiB "
        f"({geo.hidden}x{geo.intermediate}, K={geo.k_bits[0]})")
    # The start-up calibration, as the lane runs it: the fastest path here and the planner's CPU cost model.
    cal = calibrate_cpu(max_threads, cpus(max_threads), geo=geo, repeats=args.repeats,
                        isas=[args.isa] if args.isa else None)
    isa = cal.isa
    log("path, 1 row at " + f"{max_threads} threads: " + "  ".join(
        f"{k} ({cal.isa_kernels.get(k, '?')}) {v * 1e3:.2f} ms"
        for k, v in sorted(cal.isa_seconds.items(), key=lambda kv: kv[1])) + f"  -> {isa}")
    cost, rms = fit_cpu(cal.samples)
    log("calibrated CPU cost (us): " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in cost.__dict__.items())
        + f"; RMS residual {rms * 1e6:.1f} us over {len(cal.samples)} steps")

    pool = _Pool(geo, seed=0)
    rng = np.random.default_rng(1)
    base_lib = K.load_library(args.baseline_lib) if args.baseline_lib else None
    kernel = args.kernel or cal.isa_kernels.get(isa) or K.served_kernel(isa)
    with_exact = kernel != "exact"
    ghz = args.ghz or _cpu_ghz()
    weights = 3 * geo.hidden * geo.intermediate
    results, ram = [], {}
    log(f"kernel: {kernel} on {isa}" + (", the exact kernel beside it" if with_exact else "")
        + (f"; {args.gap_us} us idle before each call" if args.gap_us else "")
        + (f"; workers spin {args.spin_us} us before sleeping" if args.spin_us is not None else "")
        + f"; ms per expert: medians of {args.repeats}; c/w: thread-cycles per weight at "
        + (f"{ghz:.2f} GHz" if ghz else "an unknown clock"))
    head = f"{'threads':>7} {'rows':>4} {'ms/expert':>9} {'c/w':>5} {'expert GB/s':>11} {'RAM GB/s':>8} {'ratio':>6}"
    if with_exact:
        head += f" {'exact ms':>8} {'c/w':>5} {'speed-up':>8}"
    if base_lib is not None:
        log(f"baseline: {args.baseline_lib} (its steps alternate with this build's)")
        head += f" {'base ms':>8} {'base ratio':>10} {'vs base':>7}"
    log(head)

    def cycles(per: float, t: int) -> float | None:
        return per * ghz * 1e9 * t / weights if ghz else None

    def cw(per: float, t: int) -> str:
        c = cycles(per, t)
        return f"{c:>5.2f}" if c is not None else f"{'?':>5}"

    for t in threads:
        ram[t] = ram_read_bandwidth(threads=t)
        with contextlib.ExitStack() as stack:
            spin = {} if args.spin_us is None else {"spin_us": args.spin_us}
            kerns = {"": stack.enter_context(K.CpuKernel(t, cpus(t), isa=isa, kernel=kernel, **spin))}
            if with_exact:
                kerns["exact"] = stack.enter_context(K.CpuKernel(t, cpus(t), isa=isa, kernel="exact", **spin))
            base_kernel = None
            if base_lib is not None:  # an older build: the kernel timed here if it has it, else its exact one
                base_kernel = kernel if K.kernel_supported(isa, kernel, base_lib) else "exact"
                kerns["baseline"] = stack.enter_context(K.CpuKernel(t, cpus(t), isa=isa, lib=base_lib,
                                                                    kernel=base_kernel, **spin))
            for k in kerns.values():
                time_step(k, geo, pool.take(1), (1,), rng)
            for r in rows_list:
                rows = (r,) * args.experts
                secs: dict[str, list[float]] = {name: [] for name in kerns}
                profiles = []
                for _ in range(args.repeats):
                    for name, k in kerns.items():
                        if args.gap_us:
                            time.sleep(args.gap_us * 1e-6)
                        secs[name].append(time_step(k, geo, pool.take(args.experts), rows, rng) / args.experts)
                        if name == "":
                            profiles.append(k.profile())
                med = {name: float(np.median(v)) for name, v in secs.items()}
                per = med[""]
                bps = geo.nbytes / per
                res = {"threads": t, "rows": r, "kernel": kernel, "seconds_per_expert": per,
                       "best_seconds_per_expert": min(secs[""]), "cycles_per_weight": cycles(per, t),
                       "expert_bytes_per_s": bps, "ram_bytes_per_s": ram[t], "ratio": bps / ram[t],
                       "pinned": kerns[""].pinned}
                line = (f"{t:>7} {r:>4} {per * 1e3:>9.3f} {cw(per, t)} {bps / 1e9:>11.2f} {ram[t] / 1e9:>8.1f} "
                        f"{bps / ram[t]:>6.3f}")
                if with_exact:
                    ex = med["exact"]
                    res.update(exact_seconds_per_expert=ex, exact_best_seconds_per_expert=min(secs["exact"]),
                               exact_cycles_per_weight=cycles(ex, t), speedup_vs_exact=ex / per)
                    line += f" {ex * 1e3:>8.3f} {cw(ex, t)} {ex / per:>7.2f}x"
                if base_lib is not None:
                    base_per = med["baseline"]
                    res.update(baseline_kernel=base_kernel, baseline_seconds_per_expert=base_per,
                               baseline_best_seconds_per_expert=min(secs["baseline"]),
                               baseline_ratio=geo.nbytes / base_per / ram[t])
                    line += f" {base_per * 1e3:>8.3f} {geo.nbytes / base_per / ram[t]:>10.3f} {base_per / per:>6.2f}x"
                results.append(res)
                log(line)
                if profiles and profiles[0] is not None:
                    phases = _phases(profiles, args.experts)
                    res["phases_us_per_expert"] = phases
                    log("        phases, us per expert (median call, mean of threads): "
                        + " ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    host_ram = max(ram.values())
    best = max(results, key=lambda x: x["expert_bytes_per_s"])  # (medians: the best point of the run)
    log(f"best: {best['expert_bytes_per_s'] / 1e9:.2f} GB/s of experts ({best['threads']} threads, {best['rows']} "
        f"row{'s' if best['rows'] > 1 else ''}) = {best['expert_bytes_per_s'] / host_ram:.3f} of the host's RAM read "
        f"bandwidth ({host_ram / 1e9:.1f} GB/s)")
    return {"cpu": _cpu_model(), "isa": isa, "kernel": kernel, "ghz": ghz, "isa_seconds": cal.isa_seconds,
            "isa_kernels": cal.isa_kernels, "expert_bytes": geo.nbytes,
            "experts_per_step": args.experts, "gap_us": args.gap_us, "spin_us": args.spin_us, "results": results,
            "ram_bytes_per_s": {str(k): v for k, v in ram.items()}, "host_ram_bytes_per_s": host_ram,
            "best_ratio": best["expert_bytes_per_s"] / host_ram, "cost_us": {k: v * 1e6 for k, v in cost.__dict__.items()},
            "baseline_lib": args.baseline_lib}


def _phases(profiles: list, experts: int) -> dict[str, float]:
    """The median-wall call's profile per expert in microseconds: each phase's mean over threads, the slowest
    thread's gate_up + down (the parallel work's critical path), the caller's wake-up and the wall time."""
    from glm53.cpu_lane.kernel import PHASES

    p = sorted(profiles, key=lambda q: q.wall)[len(profiles) // 2]
    out = {k: v * 1e6 / experts for k, v in p.mean().items()}
    work = p.per_thread[:, [PHASES.index("gate_up"), PHASES.index("down")]].sum(axis=1)
    out["work_max"] = float(work.max()) * 1e6 / experts
    out["caller_wake"] = p.caller_wake * 1e6 / experts
    out["wall"] = p.wall * 1e6 / experts
    return out


def _cpu_ghz() -> float | None:
    """The clock /proc/cpuinfo gives for the first CPU (in a VM often the nominal one), in GHz."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("cpu MHz"):
                return float(line.split(":", 1)[1]) / 1e3
    except (OSError, ValueError):
        pass
    return None


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def cmd_bench_cpu_lane(args: argparse.Namespace) -> int:
    from glm53.cpu_lane.kernel import KernelError, KernelUnavailable

    try:
        doc = run_bench(args)
    except (KernelUnavailable, KernelError, ValueError) as exc:
        print(f"glm53 bench cpu-lane: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0
