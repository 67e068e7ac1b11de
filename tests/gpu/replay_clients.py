"""Replay the captured requests of the real agent CLIs (tests/data/clients) against a running server, as the
clients sent them (streamed, their headers), in order: per request the time to the first generated token, the
prompt tokens and the cached share from the reply's own usage. For the GPU machine, where the CLIs cannot be
installed (no network): the bytes are the clients' own.

    python3 tests/gpu/replay_clients.py URL [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

DATA = Path(__file__).resolve().parents[1] / "data" / "clients"
SESSIONS = {"claude-code": ["claude-code-2.1.332-turn1.json", "claude-code-2.1.332-turn2.json"],
            "codex": ["codex-0.171.0-turn1.json"]}
TOKEN_EVENTS = ("content_block_delta", "response.output_text.delta", "response.reasoning_summary_text.delta",
                "response.function_call_arguments.delta")


def replay(url: str, name: str) -> dict:
    capture = json.loads((DATA / name).read_text())
    headers = {k: v for k, v in capture["headers"].items() if k not in ("content-length", "accept-encoding")}
    t0 = time.perf_counter()
    first = None
    usage: dict = {}
    status = None
    with httpx.stream("POST", url + capture["path"], json=capture["body"], headers=headers, timeout=1800) as r:
        status = r.status_code
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                if first is None and event in TOKEN_EVENTS:
                    first = time.perf_counter() - t0
                doc = json.loads(line[6:])
                holder = doc.get("response") if isinstance(doc.get("response"), dict) else doc
                if isinstance(holder.get("usage"), dict):
                    usage = holder["usage"]
    total = time.perf_counter() - t0
    if "cache_read_input_tokens" in usage:  # Anthropic's: input_tokens excludes the cached part
        cached = usage["cache_read_input_tokens"]
        prompt = usage["input_tokens"] + cached
        out = usage["output_tokens"]
    else:
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        prompt, out = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
    return {"request": name, "status": status, "ttft_s": first, "total_s": total, "prompt_tokens": prompt,
            "cached_tokens": cached, "cached_share": cached / prompt if prompt else 0.0, "output_tokens": out}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--json")
    a = p.parse_args()
    results = []
    for session, names in SESSIONS.items():
        for name in names:
            row = {"session": session, **replay(a.url.rstrip("/"), name)}
            results.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["status"] == 200 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
