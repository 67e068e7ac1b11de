"""What chat and completions share: server state, request checks, sampling parameters, a request's life
(ids, cancellation, metrics) and running a coroutine that a client disconnect cancels."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from glm53.engine.interface import Engine, EngineEvent, SamplingParams
from glm53.engine.vision import PromptImage
from glm53.server.chat_prompt import ReasoningMemory, TurnLayout, probe_layout
from glm53.server.errors import APIError, bad_request, context_exceeded, from_engine_error
from glm53.server.generation import Tally, open_events
from glm53.server.images import ImageLimits
from glm53.server.jsontext import JSONBody
from glm53.server.metrics import Metrics
from glm53.server.protocol import ResponseFormat, SamplingFields
from glm53.server.sse import SSEResponse, wait_for_disconnect

T = TypeVar("T")
PING_INTERVAL_S = 3.0
# A token is a few bytes of text; JSON's \\u escapes can make one character six bytes. Tool schemas and the
# envelope get the base allowance.
BODY_BASE_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 32


@dataclass
class ServerState:
    engine: Engine
    settings: Any
    metrics: Metrics
    model_id: str
    reasoning_budget: int  # 0 = unlimited
    reasoning_effort: str = "high"  # the default effort (GLM53_REASONING_EFFORT): none | low | high | max
    ping_interval: float = PING_INTERVAL_S
    load_error: str | None = None
    # Called once the load failed (glm53 serve stops the server then: the process exits with status 2).
    on_load_failure: Callable[[], None] | None = None
    reasoning_memory: ReasoningMemory = field(default_factory=ReasoningMemory)
    stopping: bool = False  # the server is shutting down: generations still running end with an error
    live: set[LiveRequest] = field(default_factory=set)  # requests being answered
    _layout: TurnLayout | None = None

    def stop_generations(self) -> int:
        """End every running generation (shutdown, after the drain): each reply ends with its API's error."""
        self.stopping = True
        answering = list(self.live)
        for live in answering:
            live.cancel()
        return len(answering)

    def stop_error(self) -> APIError | None:
        """The error a generation the server ended reports: only once it is shutting down."""
        return shutting_down() if self.stopping else None

    def max_body_bytes(self, images: bool = True) -> int:
        """The largest request body worth reading: room for a prompt filling the context, JSON-escaped, and (with
        `images`, where the engine reads them) for as many images as a request may carry, base64."""
        text = BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max(int(self.engine.context_length or 0), 0)
        if not images or getattr(self.engine, "vision", None) is None:
            return text
        limits = ImageLimits.of(self.settings)
        return text + limits.max_images * (limits.max_bytes * 4 // 3 + 64)

    def layout(self) -> TurnLayout:
        """How the checkpoint's template writes a turn (learned once, by rendering one)."""
        if self._layout is None:
            self._layout = probe_layout(self.engine)
        return self._layout


def check_unicode(text: str, param: str) -> None:
    """A lone surrogate (an escape pair cut in half) is no text: 400 naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"The {param} text is not valid Unicode: a lone surrogate ({text[exc.start]!r}) at "
                          f"character {exc.start}. Send UTF-8 text (escape pairs must be complete).",
                          param=param) from None


def check_model(state: ServerState, model: str | None) -> None:
    if model:
        check_unicode(model, "model")
    if model and model != state.model_id:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{state.model_id}`.",
                       param="model", code="model_not_found")


def check_ready(state: ServerState) -> None:
    if not state.engine.ready:
        if state.load_error:  # the message names the fix (e.g. --ulimit memlock=-1 for a RAM tier that cannot pin)
            raise APIError(503, f"The model could not be loaded: {state.load_error}. Fix that and restart the "
                                "server; the log has the details.", code="model_load_failed")
        raise APIError(503, "The model is still loading; retry shortly.", code="model_not_ready")


def check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    """Refuse ids outside the vocabulary (a tokenizer would decode them to nothing, silently)."""
    n = state.engine.vocab_size
    bad = next((i for i, t in enumerate(ids) if t >= n), None)
    if bad is not None:
        raise bad_request(f"{param}[{bad}] = {ids[bad]} is not a token id of this model (its ids run from 0 to "
                          f"{n - 1}).", param=f"{param}.{bad}")


def check_capacity(state: ServerState, choices: int, param: str) -> None:
    """Refuse a request that needs more generations at once than the engine ever takes: QueueFull's 429 "retry
    shortly" would be answered forever, on an idle server too."""
    most = state.engine.capacity
    if most is not None and choices > most:
        raise bad_request(f"This request needs {choices} generations at once, and this server takes at most {most} "
                          f"(its decode slots, GLM53_MAX_CONCURRENCY, plus the requests that may wait for one, "
                          f"GLM53_MAX_QUEUE), so it could never start. Ask for at most {most}, or raise those "
                          f"settings.", param=param, code="too_many_choices")


def check_unsupported(req: SamplingFields) -> None:
    """Refuse parameters this server cannot honour rather than silently ignoring them."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value:
            raise bad_request(f"{name} is not supported by this server (use 0 or leave it out).", param=name,
                              code="unsupported_parameter")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server.", param="logit_bias",
                          code="unsupported_parameter")


def grammar_for(engine: Engine, fmt: ResponseFormat | None) -> str | None:
    """An llguidance (lark) grammar for response_format, on engines that can enforce one; otherwise a clear
    400: output that merely *asks* the model for JSON is not what json_schema promises."""
    if fmt is None or fmt.type == "text":
        return None
    if not getattr(engine, "supports_grammar", False):
        raise bad_request(f"response_format {fmt.type!r} needs constrained decoding, which the {engine.kind} engine "
                          f"lacks. Leave response_format out (or use type 'text').", param="response_format",
                          code="unsupported_parameter")
    if fmt.type == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    else:
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema.",
                              param="response_format.json_schema")
        schema = fmt.json_schema.schema_
    if isinstance(schema, dict) and "x-guidance" not in schema:
        # Compact JSON, as OpenAI returns it. With flexible whitespace a weak or heavily quantized model can
        # spend its whole budget on spaces and newlines between tokens the grammar allows.
        schema = {"x-guidance": {"whitespace_flexible": False}, **schema}
    return "start: %json " + json.dumps(schema, separators=(",", ":"))


def tokenize_prompt(state: ServerState, text: str, add_special: bool = False, param: str = "messages") -> list[int]:
    """Prompt text -> ids, in a worker thread (the tokenizer releases the GIL on long texts). A text that cannot
    fit the context even at the vocabulary's longest token is refused before the tokenizer sees it."""
    engine = state.engine
    check_unicode(text, param)
    size = len(text.encode("utf-8"))
    longest = getattr(engine, "max_token_bytes", 0)
    if longest and size > longest * engine.context_length:
        raise context_exceeded(-(-size // longest), engine.context_length, param, at_least=True)
    try:
        return engine.tokenize(text, add_special)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"The {param} text could not be tokenized: {exc}", param=param) from None


def resolve_max_tokens(requested: int | None, prompt_tokens: int, context: int, param: str = "messages") -> int:
    """Default: the rest of the context. A larger request is clamped to what fits (the reply then ends with
    finish_reason "length"), since a desktop user cannot know the window the plan picked."""
    remaining = context - prompt_tokens
    if remaining < 1:
        raise context_exceeded(prompt_tokens, context, param)
    return remaining if requested is None else min(requested, remaining)


def sampling_params(req: SamplingFields, engine: Engine, *, max_tokens: int, index: int,
                    logprobs: int | None, grammar: str | None) -> SamplingParams:
    seed = req.seed
    if seed is not None:
        # n > 1 with a seed: distinct but reproducible choices. Negative seeds fold into the engine's range.
        seed = (seed + index) % (2**63)
    top_k = req.top_k or 0
    # The end-of-turn tokens are the stop tokens here: never stopping at them is holding them back to the end.
    min_tokens = max_tokens if req.ignore_eos else min(req.min_tokens, max_tokens)
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, top_k),
        min_p=req.min_p or 0.0,
        seed=seed,
        max_tokens=max_tokens,
        stop_token_ids=list(engine.eos_token_ids),
        min_tokens=min_tokens,
        logprobs=logprobs,
        grammar=grammar,
    )


@dataclass(eq=False)  # a request is itself: held in ServerState.live by identity
class LiveRequest:
    """One HTTP request being answered (in ServerState.live until it finishes): its generations' ids to cancel,
    per-choice tallies, metrics on completion."""

    state: ServerState
    kind: str  # "chatcmpl" | "cmpl"
    arrived: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""
    request_ids: list[str] = field(default_factory=list)
    tallies: list[Tally] = field(default_factory=list)
    prompt_tokens: int = 0
    image_tokens: list[int] = field(default_factory=list)  # each image's prompt tokens, in order
    recorded: bool = False

    def __post_init__(self) -> None:
        self.id = f"{self.kind}-{uuid.uuid4().hex}"
        self.state.live.add(self)

    def new_choice(self) -> tuple[str, Tally]:
        rid = f"{self.id}-{len(self.request_ids)}"
        tally = Tally()
        self.request_ids.append(rid)
        self.tallies.append(tally)
        return rid, tally

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.tallies)

    def usage(self) -> dict[str, Any]:
        # cached_tokens: prompt tokens the engine served from its prefix cache (0 where it has none); each
        # choice prefills the same prompt, so the first choice's count is the request's.
        cached = self.tallies[0].cached_tokens if self.tallies else 0
        details: dict[str, Any] = {"cached_tokens": cached}
        if self.image_tokens:  # counted in prompt_tokens; per image, in the order they were sent
            details.update(image_tokens=sum(self.image_tokens), image_tokens_per_image=list(self.image_tokens))
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": details,
                "completion_tokens_details": {"reasoning_tokens": sum(t.reasoning_tokens for t in self.tallies)}}

    def cancel(self) -> None:
        for rid in self.request_ids:
            self.state.engine.cancel(rid)

    def client_gone(self) -> None:
        self.cancel()
        self.state.metrics.observe_disconnect()

    def finish(self) -> None:
        """The reply is complete or abandoned: stop whatever still runs (idempotent; finished ids are
        ignored by the engine) and record the metrics."""
        self.cancel()
        self.record()

    def record(self) -> None:
        self.state.live.discard(self)
        if self.recorded:
            return
        self.recorded = True
        firsts = [t.first_token_at for t in self.tallies if t.first_token_at is not None]
        lasts = [t.last_token_at for t in self.tallies if t.last_token_at is not None]
        self.state.metrics.observe_generation(
            arrived=self.arrived, prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            first_token_at=min(firsts) if firsts else None, last_token_at=max(lasts) if lasts else None)


async def open_runs(engine: Engine, prompt_ids: list[int] | list[list[int]], params: list[SamplingParams],
                    live: LiveRequest, images: Sequence[PromptImage] = ()
                    ) -> list[tuple[str, Tally, AsyncIterator[EngineEvent]]]:
    """Start every choice's generation (see generation.open_events); on a failure, stop the ones started."""
    runs = []
    try:
        for i, p in enumerate(params):
            rid, tally = live.new_choice()
            ids = prompt_ids[i] if prompt_ids and isinstance(prompt_ids[0], list) else prompt_ids
            runs.append((rid, tally, await open_events(engine, ids, p, rid, images)))  # type: ignore[arg-type]
    except BaseException:
        live.cancel()
        for _, _, events in runs:
            await events.aclose()
        raise
    return runs


class ClientGone(Exception):
    """The client disconnected before a non-streamed reply was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T], live: LiveRequest) -> T:
    """Await `work`, but cancel it (and the engine requests) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            live.client_gone()
            task.cancel()
        watch.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def respond(request: Request, live: LiveRequest, stream: bool, frames: Callable[[], AsyncIterator[bytes]],
                  collect: Callable[[], Awaitable[dict[str, Any]]]) -> Response:
    """The reply of a completion route: an SSE stream, or the collected body unless the client left first."""
    if stream:
        return SSEResponse(frames(), on_disconnect=live.client_gone)
    try:
        body = await unless_disconnected(request, collect(), live)
    except ClientGone:
        return Response(status_code=499)
    return JSONBody(body)


def stream_usage_requested(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down, so this reply was cut short: retry once it is back.",
                    code="server_shutting_down", headers={"Retry-After": "10"})


def error_frame_body(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, APIError):
        return exc.body()
    return from_engine_error(exc).body()
