"""`glm53 bench serve --concurrency 1,2,4,8`: decode tokens/s through HTTP with N streams at once, per stream and
in aggregate, each level's aggregate against one stream's, next to the reference appliance's 1.21x at four.

Each level starts its N streamed /v1/completions requests together (a barrier), every prompt the same number
of tokens (token ids cut from distinct generated texts, so no stream reuses another's prefix) and the same
max_tokens; tokens are counted from usage. A stream's rate is its tokens after the first over the time after
its first; the aggregate is all streams' tokens after their first over the span from the earliest first token
to the latest last one, so a stream that starts late or ends late counts against it.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from glm53.bench.agent_script import Script
from glm53.bench.served import BenchError, Server, Streamed, stream_completion

# The reference appliance, fast mode: 34.0 tok/s aggregate at four streams against 28.2 at one (REFERENCE.md).
REFERENCE_STREAMS, REFERENCE_RATIO = 4, 34.0 / 28.2


@dataclass
class ConcurrencyOptions:
    levels: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    prompt_tokens: int = 256
    max_tokens: int = 128
    rounds: int = 1
    seed: int = 1
    request_timeout_s: float = 900.0

    def check(self, context: int) -> None:
        if not self.levels or min(self.levels) < 1:
            raise BenchError("--concurrency needs stream counts of at least 1, e.g. 1,2,4,8")
        if self.max_tokens < 4 or self.prompt_tokens < 8 or self.rounds < 1:
            raise BenchError("bench serve needs --max-tokens >= 4, --prompt-tokens >= 8 and --rounds >= 1")
        if context and self.prompt_tokens + self.max_tokens > context:
            raise BenchError(f"--prompt-tokens {self.prompt_tokens} + --max-tokens {self.max_tokens} exceed the "
                             f"server's context of {context} tokens")


@dataclass
class StreamedReply:
    first_at: float  # perf_counter of the first generated text
    last_at: float  # perf_counter of the finish
    tokens: int
    finish_reason: str | None
    prompt_tokens: int

    @property
    def tps(self) -> float:
        span = self.last_at - self.first_at
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else 0.0


@dataclass
class Level:
    streams: int
    runs: list[StreamedReply]

    @property
    def aggregate_tps(self) -> float:
        span = max(r.last_at for r in self.runs) - min(r.first_at for r in self.runs)
        return sum(max(0, r.tokens - 1) for r in self.runs) / span if span > 0 else 0.0

    @property
    def per_stream_tps(self) -> float:
        return statistics.median(r.tps for r in self.runs)

    @property
    def slowest_tps(self) -> float:
        return min(r.tps for r in self.runs)

    def ended_early(self, max_tokens: int) -> int:
        return sum(1 for r in self.runs if r.tokens < max_tokens)


def _prompt(server: Server, script: Script, tokens: int, salt: str) -> str | list[int]:
    """Exactly `tokens` token ids where the server tokenizes (/tokenize), else text of about that size."""
    text = script.cold_text(tokens * 6, salt=salt)
    ids = server.tokenize({"prompt": text, "add_special_tokens": False})
    if ids is None:
        return text[: int(tokens * 3.5)]
    if len(ids) < tokens:
        raise BenchError(f"a generated prompt came to only {len(ids)} tokens (asked {tokens})")
    return ids[:tokens]


def run_level(server: Server, client: Any, prompts: list[str | list[int]], opts: ConcurrencyOptions) -> Level:
    barrier = threading.Barrier(len(prompts))
    runs: list[StreamedReply | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            barrier.wait()
            t0 = time.perf_counter()
            got: Streamed = stream_completion(client, model=server.model_id, prompt=prompts[i],
                                              max_tokens=opts.max_tokens, temperature=0)
            runs[i] = StreamedReply(t0 + got.ttft_s, t0 + got.last_s, got.completion_tokens, got.finish_reason,
                              got.prompt_tokens)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(i,), name=f"glm53-bench-stream-{i}") for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise BenchError(f"a stream failed: {(real or errors)[0]}")
    return Level(len(prompts), [r for r in runs if r is not None])


@dataclass
class ConcurrencyResult:
    options: ConcurrencyOptions
    model_id: str
    max_running: int | None
    levels: list[Level] = field(default_factory=list)

    def ratio(self, level: Level) -> float:
        base = next((x for x in self.levels if x.streams == 1), None)
        return level.aggregate_tps / base.aggregate_tps if base and base.aggregate_tps else 0.0


def run_concurrency(server: Server, opts: ConcurrencyOptions, log: Any = print) -> ConcurrencyResult:
    opts.check(server.context_length)
    script = Script(opts.seed)
    stats = server.stats() or {}
    result = ConcurrencyResult(opts, server.model_id, stats.get("max_running"))
    client = server.client(opts.request_timeout_s)
    # First-request costs belong to no level.
    stream_completion(client, model=server.model_id, prompt=_prompt(server, script, 32, "warm-up"), max_tokens=4,
                      temperature=0)
    for n in opts.levels:
        best: Level | None = None
        for r in range(opts.rounds):
            salt = f"serve:{n}:{r}:{time.time_ns()}"
            prompts = [_prompt(server, script, opts.prompt_tokens, f"{salt}:{i}") for i in range(n)]
            level = run_level(server, client, prompts, opts)
            if best is None or level.aggregate_tps > best.aggregate_tps:
                best = level
        assert best is not None
        result.levels.append(best)
        log(_level_line(result, best))
    return result


HEADER = (f"{'streams':>7} {'aggregate tok/s':>15} {'per stream (median / slowest)':>30} {'vs 1 stream':>11} "
          f"{'short':>5}")


def _level_line(result: ConcurrencyResult, level: Level) -> str:
    note = ""
    if level.streams == REFERENCE_STREAMS:
        note = f"  reference appliance: {REFERENCE_RATIO:.2f}x at {REFERENCE_STREAMS} (fast mode)"
    if result.max_running and level.streams > result.max_running:
        note += f"  ({level.streams - result.max_running} wait: the server decodes {result.max_running} at once)"
    per = f"{level.per_stream_tps:.1f} / {level.slowest_tps:.1f}"
    ratio = result.ratio(level)
    return (f"{level.streams:>7} {level.aggregate_tps:>15.1f} {per:>30} {ratio:>10.2f}x "
            f"{level.ended_early(result.options.max_tokens):>5}{note}")


def render(result: ConcurrencyResult) -> str:
    o = result.options
    lines = [f"bench serve: {result.model_id}, prompts of {o.prompt_tokens} tokens, max_tokens {o.max_tokens}, "
             f"best of {o.rounds} round(s) per level; server decodes at most {result.max_running or '?'} at once",
             HEADER, *(_level_line(result, x) for x in result.levels),
             "short: streams that ended before max_tokens (an end-of-turn token); their rates still count"]
    return "\n".join(lines)


def to_json(result: ConcurrencyResult) -> dict[str, Any]:
    return {"bench": "serve", "model": result.model_id, "options": asdict(result.options),
            "max_running": result.max_running,
            "reference": {"streams": REFERENCE_STREAMS, "ratio": REFERENCE_RATIO},
            "levels": [{"streams": x.streams, "aggregate_tok_s": x.aggregate_tps, "per_stream_tok_s": x.per_stream_tps,
                        "slowest_tok_s": x.slowest_tps, "ratio_to_one": result.ratio(x),
                        "ended_early": x.ended_early(result.options.max_tokens),
                        "streams_detail": [asdict(r) | {"tok_s": r.tps} for r in x.runs]} for x in result.levels]}
