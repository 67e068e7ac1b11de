"""`glm53 bench stream` (moving to glm53/bench/); the engine comes from glm53.serve, like `glm53 serve`'s."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register_bench(bench_sub: Any) -> None:
    p = bench_sub.add_parser("stream", help="engine tokens/s vs tokens/s delivered to a streaming client")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (overrides GLM53_MODEL_DIR)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per streamed request (default 256)")
    p.add_argument("--runs", type=int, default=3, help="measured requests (default 3)")
    p.set_defaults(func=cmd_bench_stream)


def cmd_bench_stream(args: argparse.Namespace) -> int:
    from glm53.serve.cli import settings_from_args, setup_logging, start_engine

    settings = settings_from_args(args)
    setup_logging(settings.log_level)
    if args.tokens < 4 or args.runs < 1:
        print("glm53: bench stream needs --tokens >= 4 and --runs >= 1", file=sys.stderr)
        return 2
    engine = start_engine(settings)
    engine.load()
    try:
        from glm53.server.bench import report, run_stream_bench

        results = run_stream_bench(engine, settings, max_tokens=args.tokens, runs=args.runs)
    finally:
        engine.close()
    text, ok = report(results)
    print(text)
    return 0 if ok else 1
