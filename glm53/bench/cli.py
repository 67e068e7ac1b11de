"""`glm53 bench store`, `stream`, `agent` and `serve`: their flags and commands, apart from the benchmarks
themselves (glm53.bench.store, stream, agent, serve_bench), which import numpy, the store, httpx, uvicorn or the
openai client at their top: the front door registers every bench at every start."""

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
    from glm53.planning.settings import load_or_exit
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


def _server_flags(p: Any) -> None:
    g = p.add_argument_group("the server", "--url for a running server; without it the bench starts `glm53 serve` "
                             "itself (a free loopback port), waits for /ready and stops it at the end")
    g.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000 (default: start one)")
    g.add_argument("--api-key", help="its API key (default: GLM53_API_KEY)")
    g.add_argument("--model", metavar="DIR", help="checkpoint for the started server (default: GLM53_MODEL_DIR, "
                   "else the demo model)")
    g.add_argument("--mode", help="GLM53_MODE for the started server (exact, nvme-exact, fast, nvme)")
    g.add_argument("--store", metavar="FILE", help="GLM53_STORE for the started server (the nvme modes)")
    g.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for /ready (default 900)")
    g.add_argument("--log-dir", type=Path, help="where the started server's log goes (default: a temp dir)")
    from glm53.bench.emulate import add_arguments

    add_arguments(g, threads=True)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def _serve_options(args: argparse.Namespace) -> Any:
    import os

    from glm53.bench.emulate import checked, to_json
    from glm53.bench.served import ServeOptions

    try:
        emulation = checked(args)
    except ValueError as exc:
        raise SystemExit(f"glm53 bench: {exc}") from None
    if args.url and (args.model or args.mode or args.store or emulation.name != "none"):
        raise SystemExit("glm53 bench: --model, --mode, --store and the emulation flags configure a started server; "
                         "with --url the server is already running (leave them out)")
    key = args.api_key if args.api_key is not None else os.environ.get("GLM53_API_KEY", "")
    return ServeOptions(url=args.url, api_key=key, model=args.model, mode=args.mode, store=args.store,
                        emulation=to_json(emulation) if emulation.name != "none" else None,
                        ready_timeout_s=args.ready_timeout, log_dir=args.log_dir)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def register_agent(bench_sub: Any) -> None:
    p = bench_sub.add_parser("agent", help="a scripted coding-agent session over HTTP: prefix reuse and TTFT per turn",
                             description="Replays a coding-agent session (system prompt with tools, then tool "
                             "steps growing the prompt to --target-tokens) through the openai client; per turn "
                             "prompt / cached tokens, TTFT and decode tok/s; then the cached share and each turn's "
                             "TTFT against its new tokens' time at the cold prefill rate of the same run.")
    p.add_argument("--target-tokens", type=int, default=60_000, help="prompt size of the last turn (default 60000)")
    p.add_argument("--turns", type=int, default=16, help="requests in the session (default 16)")
    p.add_argument("--reply-tokens", type=int, default=64, help="max_tokens of each reply (default 64; half of it "
                   "may be reasoning)")
    p.add_argument("--system-tokens", type=int, help="system prompt size before the tools (default target / 10)")
    p.add_argument("--cold-tokens", type=int, help="size of the cold prompt the prefill rate is measured on "
                   "(default target / 2)")
    p.add_argument("--keep-reasoning", action="store_true", help="send each reply's reasoning back "
                   "(reasoning_content), instead of dropping it as most clients do")
    p.add_argument("--reasoning-tokens", type=int, help="each reply's max_reasoning_tokens (default half the reply: "
                   "a random-weight model's thinking never ends by itself; 0: leave it to the server's budget)")
    p.add_argument("--seed", type=int, default=1, help="the session's text (a second run on the same server needs "
                   "another seed to start cold; default 1)")
    _server_flags(p)
    p.set_defaults(func=cmd_bench_agent)


def _run_http_bench(name: str, args: argparse.Namespace, run: Any, render: Any, to_json: Any) -> int:
    """Serve (or reach), run, print, and write the JSON: what every HTTP bench does around its measurement."""
    from glm53.bench.agent import write_json
    from glm53.bench.served import BenchError, served

    opts = _serve_options(args)
    try:
        with served(opts, log=_stderr) as server:
            result = run(server, log=_stderr)
    except BenchError as exc:
        _stderr(f"glm53 bench {name}: error: {exc}")
        return 1
    print(render(result))
    if opts.emulation:
        from glm53.bench.emulate import from_json

        print(f"emulated host: {from_json(opts.emulation).describe()} (the server's log has its slots and pace)")
    if args.json:
        write_json(args.json, {**to_json(result), "emulation": opts.emulation})
    return 0


def cmd_bench_agent(args: argparse.Namespace) -> int:
    from glm53.bench import agent

    opts = agent.AgentOptions(target_tokens=args.target_tokens, turns=args.turns, reply_tokens=args.reply_tokens,
                              system_tokens=args.system_tokens, cold_tokens=args.cold_tokens,
                              keep_reasoning=args.keep_reasoning, reasoning_tokens=args.reasoning_tokens,
                              seed=args.seed)
    return _run_http_bench("agent", args, lambda server, log: agent.run_agent(server, opts, log=log), agent.render,
                           agent.to_json)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of stream counts, e.g. 1,2,4,8") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("stream counts must be at least 1, e.g. 1,2,4,8")
    return levels


def register_serve(bench_sub: Any) -> None:
    p = bench_sub.add_parser("serve", help="decode tok/s through HTTP at 1, 2, 4, 8 concurrent streams",
                             description="Starts N streamed completions together per level (same prompt length, "
                             "same max_tokens, tokens from usage): aggregate and per-stream decode tok/s and the "
                             "aggregate's ratio to one stream, next to the reference appliance's 1.21x at four.")
    p.add_argument("--concurrency", type=_levels, default=[1, 2, 4, 8], help="stream counts (default 1,2,4,8)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens per stream (default 256)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per stream (default 128)")
    p.add_argument("--rounds", type=int, default=1, help="runs per level, the best kept (default 1)")
    _server_flags(p)
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from glm53.bench import serve_bench

    opts = serve_bench.ConcurrencyOptions(levels=args.concurrency, prompt_tokens=args.prompt_tokens,
                                          max_tokens=args.max_tokens, rounds=args.rounds)
    return _run_http_bench("serve", args, lambda server, log: serve_bench.run_concurrency(server, opts, log=log),
                           serve_bench.render, serve_bench.to_json)
def register_fairness(bench_sub: Any) -> None:
    p = bench_sub.add_parser("fairness", help="a short request's wait while replies without max_tokens hold the "
                             "decode slots (HTTP)",
                             description="Times a short request alone, then beside N streamed replies without "
                             "max_tokens (ignore_eos), each from send to its whole answer; the server's slice and "
                             "the slots yielded meanwhile from /stats. GLM53_MAX_CONCURRENCY sets a started "
                             "server's slots.")
    p.add_argument("--unbounded", type=int, default=8, help="replies without max_tokens (default 8)")
    p.add_argument("--short-tokens", type=int, default=5, help="max_tokens of the short request (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="short requests timed alone and beside (default 3)")
    _server_flags(p)
    p.set_defaults(func=cmd_bench_fairness)


def cmd_bench_fairness(args: argparse.Namespace) -> int:
    from glm53.bench import fairness

    opts = fairness.FairnessOptions(unbounded=args.unbounded, short_tokens=args.short_tokens, rounds=args.rounds)
    return _run_http_bench("fairness", args, lambda server, log: fairness.run_fairness(server, opts, log=log),
                           fairness.render, fairness.to_json)


def register_depth(bench_sub: Any) -> None:
    from glm53.bench.depth_parts import DEFAULT_FIXTURE, DEFAULT_PROMPTS, MODES

    p = bench_sub.add_parser("depth", help="full depth at a 24 GB budget and 131,072 tokens: the plan against what "
                                           "loads, TTFT, decode, peak device memory, stock's tokens (GPU)",
                             description="The full-depth proof run on one checkpoint, each mode in its own "
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
    p.add_argument("--concurrency", type=int, default=0, help="GLM53_MAX_CONCURRENCY the plan is made for (default 0: "
                   "the plan's choice; 1 keeps 8 staging rows, so every prefill borrows cache slots)")
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
    from glm53.bench.emulate import add_arguments

    add_arguments(p, threads=True)
    p.set_defaults(func=cmd_bench_depth)


def cmd_bench_depth(args: argparse.Namespace) -> int:
    from glm53.bench.depth import cmd_bench_depth as run

    return run(args)
