"""`glm53 bench store` and `glm53 bench stream`: their flags and commands, apart from the benchmarks themselves
(glm53.bench.store, glm53.bench.stream), which import numpy, the store, httpx and uvicorn at their top: the front
door registers every bench at every start."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register_store(bench_sub: Any) -> None:
    b = bench_sub.add_parser("store", help="store throughput (pack, full verify, reader) vs the disk's raw O_DIRECT",
                             description="Pack, full-verify and random-record reader throughput, each printed next "
                             "to the raw O_DIRECT read rate of the same disk measured in the same run.")
    b.add_argument("--path", type=Path, help="store file to read (default: pack a synthetic one in --workdir)")
    b.add_argument("--model", type=Path, help="checkpoint to pack for the pack figure (default: a synthetic one)")
    b.add_argument("--workdir", type=Path, help="where synthetic files go (default: GLM53_CACHE_DIR/bench-store); "
                   "must be on the disk you want to measure")
    b.add_argument("--gb", type=float, default=2.0, help="size of the synthetic checkpoint in GB (default 2)")
    b.add_argument("--threads", type=int, default=4, help="reader / packer threads (default 4)")
    b.add_argument("--rounds", type=int, default=3, help="interleaved raw/reader rounds (default 3)")
    b.add_argument("--keep", action="store_true", help="keep the synthetic files")
    b.set_defaults(func=cmd_bench_store)


def cmd_bench_store(args: argparse.Namespace) -> int:
    from glm53.bench.store import BenchOptions, run_bench
    from glm53.settings import load_or_exit
    from store.errors import StoreError

    settings = load_or_exit()
    workdir = args.workdir or Path(settings.cache_dir) / "bench-store"
    opts = BenchOptions(path=args.path, model=args.model, workdir=workdir, gb=args.gb, threads=args.threads,
                        rounds=args.rounds, keep=args.keep, allow_buffered=settings.allow_buffered_reads)
    try:
        print(run_bench(opts, log=lambda m: print(m, file=sys.stderr, flush=True)).render())
    except StoreError as exc:
        print(f"glm53 bench store: error: {exc.problem}", file=sys.stderr)
        if exc.fix:
            print(f"  fix: {exc.fix}", file=sys.stderr)
        return 1
    return 0


def register_stream(bench_sub: Any) -> None:
    p = bench_sub.add_parser("stream", help="engine tokens/s vs tokens/s delivered to a streaming client")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (overrides GLM53_MODEL_DIR)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per streamed request (default 256)")
    p.add_argument("--runs", type=int, default=3, help="measured requests (default 3)")
    p.set_defaults(func=cmd_bench_stream)


def cmd_bench_stream(args: argparse.Namespace) -> int:
    # The serve path's own settings and engine choice, so the bench streams from what `glm53 serve` would run.
    from glm53.serve.cli import settings_from_args, setup_logging, start_engine

    settings = settings_from_args(args)
    setup_logging(settings.log_level)
    if args.tokens < 4 or args.runs < 1:
        print("glm53: bench stream needs --tokens >= 4 and --runs >= 1", file=sys.stderr)
        return 2
    engine = start_engine(settings)
    engine.load()
    try:
        from glm53.bench.stream import report, run_stream_bench

        results = run_stream_bench(engine, settings, max_tokens=args.tokens, runs=args.runs)
    finally:
        engine.close()
    text, ok = report(results)
    print(text)
    return 0 if ok else 1


def register_depth(bench_sub: Any) -> None:
    from glm53.bench.depth import DEFAULT_FIXTURE, DEFAULT_PROMPTS, MODES

    p = bench_sub.add_parser("depth", help="full depth at a 24 GB budget and 131,072 tokens: the plan against what "
                                           "loads, TTFT, decode, peak device memory, stock's tokens (GPU)",
                             description="Issue 25's proof run on one full-depth checkpoint, each mode in its own "
                             "process (glm53.bench.depth).")
    p.add_argument("--model", metavar="DIR", help="existing EXL3 checkpoint (default: generate one with --fixture)")
    p.add_argument("--fixture", default=DEFAULT_FIXTURE, metavar="ARGS",
                   help=f"arguments of `glm53 fixture --kind exl3` for the generated checkpoint (default "
                        f"{DEFAULT_FIXTURE!r})")
    p.add_argument("--work", metavar="DIR", help="where the checkpoint, the store and each mode's figures go "
                   "(default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and store under --work, and reuse them "
                   "from there on the next call with the same --fixture")
    p.add_argument("--store-dir", metavar="DIR", help="nvme modes: pack the store in DIR, not --work")
    p.add_argument("--modes", default="stock,exact", help=f"modes to measure, each in its own process (default "
                   f"stock,exact; of {', '.join(MODES)}); stock is the reference")
    p.add_argument("--budget-gb", type=float, default=24.0, help="GLM53_VRAM_BUDGET_GB the plan is made for (default 24)")
    p.add_argument("--context", type=int, default=131072, help="GLM53_CONTEXT the plan is made for (default 131072)")
    p.add_argument("--memory-gib", type=float, default=55.0,
                   help="nvme modes: the memory cap the plan sizes the RAM tier for, and RSS + pinned is held against "
                        "(default 55; 16 for the small host)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help=f"prompt lengths in tokens, timed to the first token "
                   f"(default {DEFAULT_PROMPTS}); the longest is followed by 512 decoded tokens")
    p.add_argument("--tokens", type=int, default=128, help="decoded tokens timed at each history (default 128)")
    p.add_argument("--profile-tokens", type=int, default=32,
                   help="decode steps timed per layer type at history 0 and after the longest prompt (default 32; 0: "
                        "no profile)")
    p.add_argument("--checks", action="store_true", help="tiered modes: also check a prompt of the whole context "
                   "(refused) and one 8 tokens short of it (ends with length after 8 tokens)")
    p.add_argument("--reference", metavar="JSON", help="an earlier call's --json: its stock figures, for the ratios "
                   "and the token comparison when this call measures no stock")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON (after each mode, and at the end)")
    p.set_defaults(func=cmd_bench_depth)


def cmd_bench_depth(args: argparse.Namespace) -> int:
    from glm53.bench.depth import cmd_bench_depth as run

    return run(args)
