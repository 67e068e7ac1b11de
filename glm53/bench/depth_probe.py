"""The full-depth fixture in stock exllamav3: write it, load it all in VRAM, greedy-decode 32 tokens after a short
and after an 8,192-token prompt; print load time, prefill and decode time, tok/s and device memory.

GPU machine (tests/gpu/session.sh step depthprobe): glm53 bench depth-probe [--experts 8] [--work /tmp]
Exit status nonzero when any part fails. The checkpoint is kept under --work and reused by the next call.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any


def write_fixture(model_dir: Path, experts: int) -> float:
    from glm53.fixture.exl3 import FULL_DEPTH, write_exl3_checkpoint

    done = model_dir / ".complete"
    if done.exists():
        return 0.0
    shutil.rmtree(model_dir, ignore_errors=True)
    t0 = time.monotonic()
    write_exl3_checkpoint(model_dir, shape="glm53", experts=experts, shards=16, workers=os.cpu_count(),
                          **FULL_DEPTH)
    done.touch()
    return time.monotonic() - t0


def mem(torch) -> dict:
    free, total = torch.cuda.mem_get_info()
    return {"max_allocated_bytes": torch.cuda.max_memory_allocated(), "device_used_bytes": total - free}


def greedy(torch, gen, ids: list[int], tokens: int) -> dict:
    from glm53.exl3 import stock

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    stamps, out, first_n = stock.greedy(gen, ids, tokens)
    torch.cuda.synchronize()
    if len(out) < tokens:
        raise RuntimeError(f"{len(ids)}-token prompt: generated {len(out)} tokens, expected {tokens}")
    decode_s = stamps[-1] - stamps[0]
    return {"prompt_tokens": len(ids), "new_tokens": len(out), "first_token_s": stamps[0] - t0,
            "prefill_tok_s": len(ids) / (stamps[0] - t0), "decode_s": decode_s,
            "decode_tok_s": (len(out) - first_n) / decode_s if decode_s > 0 else None,
            "total_s": stamps[-1] - t0, "tokens_head": out[:8], **mem(torch)}


def register_bench(bench_sub: Any) -> None:
    ap = bench_sub.add_parser("depth-probe", help="the full-depth fixture in stock exllamav3: load, TTFT, decode "
                              "tok/s and device memory after a short and a long prompt (GPU)",
                              description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (default 8)")
    ap.add_argument("--work", type=Path, default=Path("/tmp"), help="where the checkpoint is written and kept "
                    "(default /tmp)")
    ap.add_argument("--long", type=int, default=8192, help="the long prompt's tokens (default 8192)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens decoded after each prompt (default 32)")
    ap.add_argument("--prompts", default="", help="prompt lengths to run in order (default: 16 and --long)")
    ap.add_argument("--profile", action="store_true", help="cProfile the last prompt, top 40 by cumulative time")
    ap.add_argument("--json", type=Path, help="also write the report as JSON")
    ap.set_defaults(func=cmd_bench_depth_probe)


def cmd_bench_depth_probe(args: argparse.Namespace) -> int:
    import torch

    from glm53.exl3 import stock

    model_dir = args.work / f"glm53-depth-{args.experts}e" / "ckpt"
    report: dict = {"model_dir": str(model_dir), "experts_per_layer": args.experts,
                    "write_s": write_fixture(model_dir, args.experts)}
    report["disk_bytes"] = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    print(f"fixture: {report['disk_bytes'] / 1e9:.2f} GB, written in {report['write_s']:.0f} s (0: reused)", flush=True)
    lengths = [int(x) for x in args.prompts.split(",") if x] or [16, args.long]
    cache_tokens = -(-(max(lengths) + args.tokens + 256) // 256) * 256
    t0 = time.perf_counter()
    tokenizer, gen = stock.load(model_dir, cache_tokens)
    report["load_s"] = time.perf_counter() - t0
    report["after_load"] = mem(torch)
    report["cache_tokens"] = cache_tokens
    print(f"loaded in {report['load_s']:.1f} s: {json.dumps(report['after_load'])}", flush=True)
    text = tokenizer.encode("The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 1200)[0].tolist()
    if len(text) < max(lengths):
        text = (text * (max(lengths) // len(text) + 1))
    report["runs"] = []
    for i, n in enumerate(lengths):
        # Each run starts at a different offset, so the page cache cannot serve one run's prompt from another's.
        ids = text[i * 7:i * 7 + n]
        if args.profile and i == len(lengths) - 1:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            r = prof.runcall(greedy, torch, gen, ids, args.tokens)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
        else:
            r = greedy(torch, gen, ids, args.tokens)
        report["runs"].append(r)
        print(f"{n}-token prompt: first token {r['first_token_s']:.2f} s ({r['prefill_tok_s']:.0f} tok/s), "
              f"{r['new_tokens']} tokens decoded at {r['decode_tok_s']:.1f} tok/s; peak allocated "
              f"{r['max_allocated_bytes'] / 2**30:.2f} GiB, device used {r['device_used_bytes'] / 2**30:.2f} GiB",
              flush=True)
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
