"""`glm53 bench decode --baseline REV`: this code's decode speed over an earlier commit's, in paired windows.

The earlier design runs as it was, from a git worktree of REV with its own compiled library (glm53.bench.worktree),
not as a switch on the product's classes. Both sides decode the same checkpoint and store, made once under --work
(each side's `--keep --work` finds them); windows alternate between this code and REV's (this first, then REV first,
...), each a fresh process running that tree's `python -m glm53 bench decode ... --json`, so a drift of the machine
falls on both alike. The report: per mode (stock included), each side's decode tok/s and this / REV, the median over
the paired windows. Only flags REV's own bench decode has are passed (b38dea7's: see window_args).

Where the machine has no git history (the GPU machine gets a copy of the working tree), `--baseline-tree DIR` names
REV's code unpacked beside it (`git archive REV | tar -x -C DIR`). With `--keep`, a window whose JSON is already
under --work is reused, so one comparison can span several calls of a time-limited machine."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from glm53.bench import worktree

SIDES = ("current", "baseline")
# bench decode's own file in each layout (glm53/engine/ before glm53/bench/ held the benchmarks).
BENCH_FILES = ("glm53/bench/decode.py", "glm53/engine/bench.py")

# run(side, argv) -> the window's JSON doc: `side`'s code running `glm53 ARGV` (argv writes the doc to its --json).
WindowRunner = Callable[[str, list[str]], dict]


def window_args(args: argparse.Namespace, work: Path, json_path: Path) -> list[str]:
    """`glm53` arguments for one window: flags that bench decode had before this work (b38dea7) and has now, and the
    emulation's where given (a baseline from before the emulation refuses them by name)."""
    out = ["bench", "decode", "--skew", args.skew, "--tokens", str(args.tokens), "--windows", str(args.windows),
           "--prompt-tokens", str(args.prompt_tokens), "--modes", args.modes, "--ram-fraction", str(args.ram_fraction),
           "--warmup-tokens", str(args.warmup_tokens), "--work", str(work), "--keep", "--json", str(json_path)]
    out += ["--model", str(args.model)] if args.model else ["--moe-layers", str(args.moe_layers)]
    for flag, value in (("--slots", args.slots), ("--cpu-threads", args.cpu_threads), ("--store-dir", args.store_dir),
                        ("--emulate-disk-GBps", args.emulate_disk_GBps), ("--emulate", getattr(args, "emulate", None)),
                        ("--link-GBps", getattr(args, "link_GBps", None)), ("--lane-isa", getattr(args, "lane_isa", None))):
        if value is not None:
            out += [flag, str(value)]
    return out


def subprocess_runner(root: Path, tree: Path) -> WindowRunner:
    """Each window in its own process: this code from `root`, the baseline's from `tree`."""

    def run(side: str, argv: list[str]) -> dict:
        where = root if side == "current" else tree
        proc = subprocess.run([sys.executable, "-m", "glm53", *argv], cwd=where, env=worktree.tree_env(where),
                              capture_output=True, text=True)
        sys.stderr.write(proc.stdout[-4000:])
        out = Path(argv[argv.index("--json") + 1])
        if proc.returncode not in (0, 1) or not out.exists():  # 1: ran, but an exact mode left stock's tokens
            raise RuntimeError(f"{side} window failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        return json.loads(out.read_text())

    return run


def speeds(doc: dict) -> dict[str, float]:
    """A window's decode tok/s per mode, stock's too."""
    return {"stock": doc["stock_decode_tok_s"], **{m: d["decode_tok_s"] for m, d in doc["modes"].items()}}


def paired(run: WindowRunner, args: argparse.Namespace, work: Path, pairs: int, log=print) -> dict:
    """`pairs` windows of each side, alternating which goes first; per mode the medians and this / baseline. With
    args.keep, a window's JSON already under `work` (an earlier call's) is reused."""
    rows: list[dict[str, dict]] = []
    same = True
    for i in range(pairs):
        row: dict[str, dict] = {}
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            done = work / f"window-{i}-{side}.json"
            if args.keep and done.exists():
                log(f"pair {i} {side}: reusing {done}")
                doc = json.loads(done.read_text())
            else:
                doc = run(side, window_args(args, work, done))
            row[side] = speeds(doc)
            same = same and bool(doc.get("same_tokens", True))
            log(f"pair {i} {side}: " + ", ".join(f"{m} {v:.1f}" for m, v in row[side].items()) + " tok/s")
        rows.append(row)
    modes = [m for m in rows[0]["current"] if all(m in r[s] for r in rows for s in SIDES)]
    out: dict[str, Any] = {"pairs": rows, "same_tokens": same, "modes": {}}
    for m in modes:
        ratios = [r["current"][m] / r["baseline"][m] for r in rows if r["baseline"][m] > 0]
        # Each process's speed over its own stock run: stock is the same code on both sides, so this cancels what
        # the machine gave that process (from process to process, stock alone moves by several percent).
        of_stock = [(r["current"][m] / r["current"]["stock"]) / (r["baseline"][m] / r["baseline"]["stock"])
                    for r in rows if m != "stock" and min(r["baseline"][m], r["baseline"]["stock"],
                                                          r["current"]["stock"]) > 0]
        out["modes"][m] = {"current_tok_s": statistics.median(r["current"][m] for r in rows),
                           "baseline_tok_s": statistics.median(r["baseline"][m] for r in rows),
                           "over_baseline": statistics.median(ratios) if ratios else float("nan"), "ratios": ratios,
                           "over_baseline_of_stock": statistics.median(of_stock) if of_stock else None,
                           "ratios_of_stock": of_stock}
    return out


def report(res: dict, rev: str) -> str:
    lines = [f"glm53 bench decode --baseline {rev} ({res['commit'][:10]}): {len(res['pairs'])} paired windows, this "
             f"code's and {rev}'s alternating, each in its own process; exact modes generate stock's tokens on both "
             f"sides: {res['same_tokens']}"]
    for m, d in res["modes"].items():
        lines.append(f"  {m:<12}: this {d['current_tok_s']:8.1f} tok/s, {rev} {d['baseline_tok_s']:8.1f} tok/s; "
                     f"this / {rev} {d['over_baseline']:.3f}, median of paired windows ("
                     + ", ".join(f"{x:.3f}" for x in d["ratios"]) + ")"
                     + ("" if d.get("over_baseline_of_stock") is None else
                        f"; over each process's stock {d['over_baseline_of_stock']:.3f} ("
                        + ", ".join(f"{x:.3f}" for x in d["ratios_of_stock"]) + ")"))
    return "\n".join(lines)


def cmd_bench_decode_baseline(args: argparse.Namespace, run: WindowRunner | None = None) -> int:
    """bench decode --baseline: run is the per-window runner (default: subprocesses of each tree)."""
    if args.baseline_windows < 1:
        print("glm53: --baseline-windows must be at least 1", file=sys.stderr)
        return 2
    root = worktree.repo_root()
    given = Path(args.baseline_tree).resolve() if args.baseline_tree else None
    if given is not None:
        if not any((given / f).is_file() for f in BENCH_FILES):
            print(f"glm53: --baseline-tree {given} holds no glm53 with `bench decode` (unpack REV there: git archive "
                  f"{args.baseline} | tar -x -C {given})", file=sys.stderr)
            return 2
        commit = worktree.resolve(args.baseline, root) or args.baseline  # no git history here: the name given
    else:
        commit = worktree.resolve(args.baseline, root)
        if commit is None:
            print(f"glm53: --baseline {args.baseline}: not a commit of {root} (without git history, unpack it and "
                  "pass --baseline-tree)", file=sys.stderr)
            return 2
        if worktree.first_file(commit, BENCH_FILES, root) is None:
            print(f"glm53: --baseline {args.baseline} has no `glm53 bench decode`", file=sys.stderr)
            return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="glm53-bench-paired-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if run is not None:
            res = paired(run, args, work, args.baseline_windows)
        elif given is not None:
            built = worktree.baseline_library(root, given)
            if built:
                raise worktree.BaselineError(built)
            res = paired(subprocess_runner(root, given), args, work, args.baseline_windows)
        else:
            with worktree.baseline_tree(commit, root) as tree:
                res = paired(subprocess_runner(root, tree), args, work, args.baseline_windows)
    except (worktree.BaselineError, RuntimeError) as exc:
        print(f"glm53: --baseline {args.baseline}: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    res.update(rev=args.baseline, commit=commit)
    print(report(res, args.baseline))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["same_tokens"] else 1
