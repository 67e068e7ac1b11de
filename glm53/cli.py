"""`glm53 <command>`: one argparse front door.

Each command lives in the module that does the work; that module exposes `register(subparsers)` and
keeps its top-level imports light (torch and friends are imported inside the command), so `glm53 plan`
starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from glm53 import __version__

# Order is the order of `glm53 --help`.
COMMAND_MODULES = (
    "glm53.serve.cli",       # serve
    "glm53.bench",           # bench: every benchmark
    "glm53.plan_cli",        # plan, preflight
    "glm53.settings_cli",    # settings
    "glm53.fixture.cli",     # fixture
    "glm53.checkpoint",      # model verify / fetch
    "glm53.store_cli",       # pack-store, verify-store
)


BARE_SERVES = "`glm53` with no command runs `glm53 serve` (what the container does by default)."
EXIT_SIGPIPE = 141  # what a shell reports for a program ended by SIGPIPE (`glm53 plan --json | head`)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm53", description=__doc__.splitlines()[0], epilog=BARE_SERVES)
    parser.add_argument("--version", action="version", version=f"glm53 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = None
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "register_bench"):
            if bench is None:
                bp = sub.add_parser("bench", help="benchmarks that print ratios measured in one run")
                bench = bp.add_subparsers(dest="bench", metavar="WHAT", required=True)
            module.register_bench(bench)
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not getattr(args, "func", None):
        # Bare `glm53` serves: that is what the container does by default.
        args = parser.parse_args(["serve"])
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that went away is seen here, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader of stdout closed it (`| head`): nothing left to say and no one to say it to. Point stdout
        # at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_SIGPIPE
    except KeyboardInterrupt:
        print("glm53: interrupted", file=sys.stderr)
        return 130
