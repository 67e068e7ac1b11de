"""`glm53 bench fairness`: how long a short request waits while replies that never stop hold the decode slots.

Issue 41's figure: a 5-token request alone, then the same request while N streamed replies without max_tokens
(ignore_eos: each runs to the end of the context) hold the slots; each timed from send to its whole answer, over
HTTP. The server time-slices its decode slots (glm53.engine.worker), so the short request's wait should be about
one slice (`slice_s` in /stats), whatever the long replies' lengths. The long replies are cut (their streams closed)
at the end; the report says whether they were all still running when each short answer came.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from glm53.bench.served import BenchError, Server


@dataclass
class FairnessOptions:
    unbounded: int = 8  # streamed replies without max_tokens
    short_tokens: int = 5
    rounds: int = 3  # short requests timed alone, and again beside the unbounded
    prompt_tokens: int = 16
    start_timeout_s: float = 300.0


@dataclass
class FairnessResult:
    options: FairnessOptions
    alone_s: list[float] = field(default_factory=list)  # whole answers
    beside_s: list[float] = field(default_factory=list)
    alone_first_s: list[float] = field(default_factory=list)  # first tokens: the wait for a slot and the prefill
    beside_first_s: list[float] = field(default_factory=list)
    long_running: list[bool] = field(default_factory=list)  # every unbounded reply still streaming at each answer
    slice_s: float | None = None
    yielded: int = 0  # requests_yielded during the beside rounds
    max_running: int | None = None


def _short(server: Server, opts: FairnessOptions, i: int) -> tuple[float, float]:
    """(first token, whole answer) seconds of one streamed short request, from its send."""
    body = {"prompt": [11 + i, 12, 13], "max_tokens": opts.short_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens = None, 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers(), timeout=3600) as r:
        if r.status_code != 200:
            raise BenchError(f"the short request failed: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            frame = json.loads(line[6:])
            if frame.get("choices") and first is None:
                first = time.perf_counter() - t0
            if frame.get("usage"):
                tokens = frame["usage"]["completion_tokens"]
    if tokens != opts.short_tokens or first is None:
        raise BenchError(f"the short request got {tokens} tokens, not {opts.short_tokens}")
    return first, time.perf_counter() - t0


class _Unbounded:
    """N streamed replies without max_tokens, read in threads until stop() closes them (which cancels them)."""

    def __init__(self, server: Server, opts: FairnessOptions):
        self.stop_event = threading.Event()
        self.live = [False] * opts.unbounded
        self.ended = [0] * opts.unbounded  # text frames of a reply that ended on its own (the context's end)
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(server, opts, i), daemon=True)
                        for i in range(opts.unbounded)]

    def _run(self, server: Server, opts: FairnessOptions, i: int) -> None:
        body = {"prompt": [1000 + 97 * i + j for j in range(opts.prompt_tokens)], "ignore_eos": True,
                "temperature": 0, "stream": True}
        frames = 0
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers(),
                              timeout=3600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"text"' in line:
                        self.live[i] = True
                        frames += 1
                    if self.stop_event.is_set():
                        break
                    if line == "data: [DONE]":
                        self.ended[i] = max(1, frames)
                        break
        except httpx.HTTPError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.live[i] = False

    def too_short(self, live: int) -> str:
        """Why the figure cannot be taken: a reply reached the end of the context before the rest were streaming
        (a fast engine, or the cache holding one context's pages for all of them, so they run in turn)."""
        return (f"an unbounded reply reached the end of the context ({max(self.ended)} streamed frames) while only "
                f"{live} of the {len(self.live)} were streaming: they must hold the slots while the short requests "
                "run; serve a longer context (GLM53_CONTEXT)")

    def __enter__(self) -> _Unbounded:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=60)


def run_fairness(server: Server, opts: FairnessOptions, log: Any = print) -> FairnessResult:
    if opts.unbounded < 1 or opts.short_tokens < 1 or opts.rounds < 1:
        raise BenchError("bench fairness needs --unbounded, --short-tokens and --rounds of at least 1")
    res = FairnessResult(opts)
    _short(server, opts, 0)  # warm-up: first-request costs are not waiting
    for i in range(opts.rounds):
        first, whole = _short(server, opts, i)
        res.alone_first_s.append(first)
        res.alone_s.append(whole)
    log(f"alone: {statistics.median(res.alone_s):.2f} s (median of {opts.rounds})")
    stats0 = server.stats() or {}
    res.max_running = stats0.get("max_running")
    with _Unbounded(server, opts) as longs:
        deadline = time.time() + opts.start_timeout_s
        while sum(longs.live) < min(opts.unbounded, res.max_running or opts.unbounded):
            if any(longs.ended):
                raise BenchError(longs.too_short(sum(longs.live)))
            if time.time() > deadline or longs.errors:
                raise BenchError(f"the unbounded replies did not all start streaming: {longs.errors[:1]}")
            time.sleep(0.05)
        for i in range(opts.rounds):
            first, whole = _short(server, opts, i)
            res.beside_first_s.append(first)
            res.beside_s.append(whole)
            res.long_running.append(all(longs.live[:res.max_running or opts.unbounded]))
            log(f"beside {opts.unbounded} unbounded: first token {first:.2f} s, answer {whole:.2f} s")
        stats1 = server.stats() or {}
    res.slice_s = stats1.get("slice_s")
    res.yielded = int(stats1.get("requests_yielded", 0)) - int(stats0.get("requests_yielded", 0))
    return res


def render(res: FairnessResult) -> str:
    o = res.options

    def line(name: str, firsts: list[float], wholes: list[float]) -> str:
        return (f"  {name:6s}  first token median {statistics.median(firsts):.2f} s, max {max(firsts):.2f}; "
                f"answer median {statistics.median(wholes):.2f} s, max {max(wholes):.2f}")

    ratio = statistics.median(res.beside_s) / statistics.median(res.alone_s)
    return "\n".join([
        f"bench fairness: a {o.short_tokens}-token request alone and beside {o.unbounded} replies without max_tokens "
        f"({res.max_running} decode slots, slice {res.slice_s} s)",
        line("alone:", res.alone_first_s, res.alone_s),
        line("beside:", res.beside_first_s, res.beside_s) + f"; answer {ratio:.1f}x alone",
        f"  slots yielded meanwhile: {res.yielded}; the unbounded replies all still running at each answer: "
        f"{'yes' if all(res.long_running) else 'no'}",
    ])


def to_json(res: FairnessResult) -> dict:
    return asdict(res)
