"""One completion choice: engine token events -> the text it emits, with stop strings and logprobs.

The engine streams detokenized text per token. Stop strings are matched on that text, across token
boundaries: text that could still be the start of a stop string is held back until it cannot, and the stop
string itself is never released. When one matches, the engine request is cancelled at once so its slot and
KV cache are freed for others.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from glm53.engine.interface import Engine, EngineError, EngineEvent, PromptProgress, SamplingParams, TokenEvent
from glm53.engine.vision import PromptImage
from glm53.server.chat import split_at_tag
from glm53.server.errors import bad_request, from_engine_error


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class Emission:
    """What one choice releases at once: text no stop string can still claim, its tokens' logprobs, and the
    finish reason on the last."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    tokens: int = 0  # engine tokens consumed since the previous emission (its text may lag them: stop strings)
    stop_sequence: str | None = None  # the stop string that ended the choice (Anthropic's stop_sequence)


@dataclass
class Tally:
    """Per-choice counters that usage and the latency metrics are computed from."""

    completion_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those generated inside the think block (chat)
    cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache
    first_token_at: float | None = None
    last_token_at: float | None = None


class StopMatcher:
    """Hold back text that may be the beginning of a stop string; report the first full match."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = tuple(stops)
        self.buf = ""
        self.matched: str | None = None
        # (start, end, item) of each token's text inside buf, so logprobs leave together with their text.
        self.pending: list[tuple[int, int, Any]] = []

    def feed(self, text: str, item: Any = None) -> tuple[str, list[Any], bool]:
        start = len(self.buf)
        self.buf += text
        if item is not None:
            self.pending.append((start, len(self.buf), item))
        before, tag, rest = split_at_tag(self.buf, self.stops)
        if tag is not None:
            cut = len(before)
            items = [it for s, _, it in self.pending if s < cut]
            self.buf, self.pending, self.matched = "", [], tag
            return before, items, True
        cut = len(before)
        items = [it for _, e, it in self.pending if e <= cut]
        self.pending = [(s - cut, e - cut, it) for s, e, it in self.pending if e > cut]
        self.buf = rest
        return before, items, False

    def flush(self) -> tuple[str, list[Any]]:
        text, items = self.buf, [it for _, _, it in self.pending]
        self.buf, self.pending = "", []
        return text, items


def _logprob(ev: TokenEvent) -> TokenLogprob | None:
    if ev.logprob is None:
        # A token the engine inserted (the reasoning budget's `</think>`) without scoring it still belongs in the
        # client's logprobs list, one entry per token; it was emitted with certainty, hence log 1 = 0.
        return TokenLogprob(ev.token_text, 0.0, []) if ev.forced else None
    return TokenLogprob(ev.token_text, ev.logprob, list(ev.top_logprobs or []))


async def open_events(engine: Engine, prompt_ids: list[int], params: SamplingParams,
                      request_id: str, images: Sequence[PromptImage] = ()) -> AsyncIterator[EngineEvent]:
    """Start a generation now, so that what the engine rejects up front (prompt ids outside the vocabulary,
    a prompt over the context, an engine not loaded) becomes an HTTP error before a stream's 200 status
    line is sent. Engines validate synchronously before their first await, so one loop turn is enough."""
    events = engine.generate(prompt_ids, params, request_id, images)
    first = asyncio.ensure_future(anext(events))
    # If the caller never iterates (a stream whose client left at once), the request is cancelled by id and
    # this task ends unobserved: mark its outcome as seen so asyncio does not log it.
    first.add_done_callback(lambda t: t.cancelled() or t.exception())
    await asyncio.sleep(0)
    if first.done() and not first.cancelled() and first.exception() is not None:
        exc = first.exception()
        await events.aclose()
        if isinstance(exc, StopAsyncIteration):
            return _empty()
        raise start_error(exc)
    return _chain(first, events)


def start_error(exc: BaseException) -> BaseException:
    """Errors an engine raises before producing anything are about the request (or engine state)."""
    if isinstance(exc, ValueError):
        return bad_request(f"The engine rejected the request: {exc}")
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    return exc


async def _empty() -> AsyncIterator[EngineEvent]:
    return
    yield  # pragma: no cover - makes this an async generator


async def _chain(first: asyncio.Future, events: AsyncIterator[EngineEvent]) -> AsyncIterator[EngineEvent]:
    try:
        try:
            item = await first
        except StopAsyncIteration:
            return
        yield item
        async for item in events:
            yield item
    finally:
        if not first.done():
            # Cancelling the pending first step cancels the engine generator inside it (its finally frees
            # the request); only then may the generator be closed.
            first.cancel()
            with contextlib.suppress(BaseException):
                await first
        await events.aclose()


async def choice_emissions(engine: Engine, events: AsyncIterator[EngineEvent], request_id: str,
                           end_ids: frozenset[int], stops: list[str], tally: Tally,
                           stopped: Callable[[], BaseException | None]) -> AsyncIterator[Emission]:
    """Yield the emissions of one choice from opened `events`; the last carries finish_reason
    ("stop" | "length"). A generation that ends without one raises `stopped()` when that is an error (the server
    stopped it), else an engine error."""
    matcher = StopMatcher(stops) if stops else None
    engine_done = False  # the engine finished on its own; otherwise it is told to stop (stop string, error, client gone)
    pending = 0  # tokens not yet reported in an emission
    try:
        async for ev in events:
            if isinstance(ev, PromptProgress):
                continue
            now = time.perf_counter()
            if tally.first_token_at is None:
                tally.first_token_at = now
            if ev.cached_tokens is not None:
                tally.cached_tokens = ev.cached_tokens
            tally.last_token_at = now
            tally.completion_tokens += 1
            pending += 1
            # The end-of-turn token (<|user|>, <|endoftext|>...) ends the reply; it is not part of it.
            text = "" if ev.finish_reason == "stop" and ev.token_id in end_ids else ev.text
            lp = _logprob(ev)
            if matcher is None:
                em = Emission(text, [lp] if lp else [], ev.finish_reason, pending)
            else:
                released, items, matched = matcher.feed(text, lp)
                if matched:
                    yield Emission(released, items, "stop", pending, matcher.matched)
                    return
                em = Emission(released, items, ev.finish_reason, pending)
                if ev.finish_reason:
                    rest, more = matcher.flush()
                    em.text += rest
                    em.logprobs += more
            if em.finish_reason:
                engine_done = True
                yield em
                return
            if em.text or em.logprobs:
                pending = 0
                yield em
        raise stopped() or EngineError("the engine ended the generation without a finish reason")
    finally:
        if not engine_done:
            engine.cancel(request_id)
        await events.aclose()
