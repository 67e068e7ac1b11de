"""The one interface between the HTTP server and an engine (exllamav3 on the GPU, transformers on the CPU).

The server owns everything OpenAI-shaped (chat parsing, stop strings, n > 1, usage, SSE); an engine only
turns prompt token ids into a stream of sampled tokens. Keep this file small: every member is something
both engines implement.

Reasoning budget: the server sets `SamplingParams.reasoning_budget` (and `reasoning_end_ids`, e.g. the ids
of "</think>\\n") when the prompt ends inside an open <think> block. The engine counts generated tokens
until it samples `reasoning_end_ids[0]` itself; once `reasoning_budget` tokens were generated without that,
it forces `reasoning_end_ids` as the next tokens (emitted as normal TokenEvents with `forced=True`) and
samples on from there. Doing it inside the engine loop keeps the KV cache consistent with what the client
sees, costs no extra round trip, and works identically for streamed and non-streamed requests.

Grammar: `SamplingParams.grammar` is an llguidance grammar (lark, e.g. `start: %json {schema}`). When the
prompt ends inside an open <think> block, the reasoning is unconstrained and the grammar applies from the
token after the block closes. A generation whose grammar is complete ends with finish_reason "stop" on its
last content token (which carries text, unlike a stop token).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from glm53.engine.vision import PromptImage, VisionSpec


class EngineError(RuntimeError):
    """A generation failed inside the engine; the server reports it (mid-stream: an SSE `error` frame)."""


class ContextLengthExceeded(EngineError):
    """The prompt (plus at least one generated token) does not fit the context: maps to context_length_exceeded."""

    def __init__(self, prompt_tokens: int, context_length: int):
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        super().__init__(
            f"This model's maximum context length is {context_length} tokens, "
            f"but the prompt has {prompt_tokens} tokens."
        )


class QueueFull(EngineError):
    """Every decode slot is taken and the waiting queue is at its limit: the server answers 429 with Retry-After."""

    def __init__(self, waiting: int, limit: int):
        self.waiting, self.limit = waiting, limit
        super().__init__(f"{waiting} requests are already waiting for a decode slot (the limit, GLM53_MAX_QUEUE, is "
                         f"{limit}): retry shortly")


class EngineOutOfMemory(EngineError):
    """The device ran out of memory (loading, or running one request): the server answers 503, and the message
    names what to lower. The engine keeps serving the other requests."""

    KNOBS = "GLM53_CONTEXT, GLM53_MAX_CONCURRENCY or GLM53_VRAM_BUDGET_GB"

    def __init__(self, where: str, detail: object = ""):
        self.where = where
        tail = f" ({str(detail).splitlines()[0]})" if str(detail) else ""
        super().__init__(f"the device ran out of memory {where}{tail}: lower {self.KNOBS} and restart")


class EngineNotReady(EngineError):
    """The model is not loaded (yet, or any more): the server answers 503."""


class GrammarUnsupported(EngineError):
    """SamplingParams.grammar was set on an engine whose `supports_grammar` is False."""


@dataclass
class SamplingParams:
    """How to sample one completion. Defaults reproduce plain sampling from the model's distribution."""

    temperature: float = 1.0  # 0 = greedy (argmax); ties broken by the lowest token id
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0  # drop tokens below min_p * p(top token); 0 = off
    seed: int | None = None  # same seed + same prompt + same params -> same tokens; None = nondeterministic
    max_tokens: int | None = None  # generated-token limit; None = until the context is full
    stop_token_ids: list[int] = field(default_factory=list)  # sampling one ends the generation ("stop")
    min_tokens: int = 0  # stop_token_ids cannot be sampled before this many tokens were generated (vLLM's)
    logprobs: int | None = None  # None = off; n >= 0 = the sampled token's logprob plus the top-n alternatives
    reasoning_budget: int | None = None  # max tokens inside the open <think> block; None = unlimited
    reasoning_end_ids: list[int] = field(default_factory=list)  # forced when the budget runs out ("</think>\n")
    grammar: str | None = None  # llguidance grammar (e.g. JSON schema); only where Engine.supports_grammar


@dataclass
class TokenEvent:
    """One generated token, in order. The last event of a generation carries finish_reason."""

    token_id: int  # the sampled (or forced) token
    text: str  # incremental detokenized text; "" while a multi-byte character is incomplete, and for a stop token
    token_text: str  # this token alone, decoded (for OpenAI logprobs' `token`; may hold U+FFFD for partial bytes)
    logprob: float | None = None  # log p(token) under the unmodified distribution; set when params.logprobs is not None
    top_logprobs: list[tuple[str, float]] | None = None  # top-n (token text, logprob), most likely first
    finish_reason: str | None = None  # "stop" (stop token) | "length" (max_tokens or context full) | None
    forced: bool = False  # True for tokens the engine injected (reasoning budget), not sampled
    # How many prompt tokens were served from a prefix cache, on any one event of a generation (the exllamav3
    # engine knows it at the end); None on the others, and everywhere on an engine without one (usage says 0).
    cached_tokens: int | None = None


@dataclass
class PromptProgress:
    """Yielded by generate() while a long prompt is processed (before the first TokenEvent): SSE keep-alive."""

    processed: int  # prompt tokens done so far
    total: int  # prompt tokens in all


EngineEvent = TokenEvent | PromptProgress


@runtime_checkable
class Engine(Protocol):
    """What the server calls. Thread-safety: every method may be called from the asyncio loop thread."""

    model_id: str  # the id served in /v1/models and echoed in responses
    context_length: int  # max prompt + generated tokens of one request
    kind: str  # "reference-cpu" | "exllamav3"
    supports_grammar: bool  # whether SamplingParams.grammar is honoured
    vision: VisionSpec | None  # what the checkpoint's vision tower takes (set by load()); None: no images
    no_vision_reason: str  # why vision is None, naming what is missing

    @property
    def ready(self) -> bool:
        """True once the model is loaded and generate() can be called."""
        ...

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end an assistant turn (<|endoftext|>, <|user|>, <|observation|>); default stop_token_ids."""
        ...

    @property
    def capacity(self) -> int | None:
        """Generations the engine takes at once, running plus waiting (more are refused with QueueFull); None
        when the waiting queue has no limit."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to vocab_size - 1 (the tokenizer's entries); 0 until the model is loaded."""
        ...

    def load(self) -> None:
        """Blocking: load the model (call from a worker thread); logs progress; sets ready."""
        ...

    def fault(self) -> dict | None:
        """A degraded tier for /ready (the nvme modes' store: failed or stalled reads), or None when healthy."""
        ...

    def close(self) -> None:
        """Stop the worker, fail in-flight generations with EngineNotReady, free the model."""
        ...

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Text -> ids; special-token strings in the text map to their single ids."""
        ...

    def detokenize(self, ids: list[int]) -> str:
        """Ids -> text, special tokens included verbatim."""
        ...

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary token (e.g. THINK_CLOSE), or None if it is not a single token."""
        ...

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        enable_thinking: bool = True,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
    ) -> str:
        """Render OpenAI-style messages (and tool JSON schemas) into the GLM prompt text; `template_kwargs` are
        further template variables (reasoning_effort, clear_thinking), ignored by a template that lacks them."""
        ...

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 images: Sequence[PromptImage] = ()) -> AsyncIterator[EngineEvent]:
        """Async generator of events for one completion. `images`: the prompt's images in order, each taking the
        run of image tokens at its span (their embeddings replace those tokens'; a prefix cache is reused only
        where the images it holds are the same, by content hash). Errors surface on the first iteration, before any
        event (so pull one event before sending response headers): ContextLengthExceeded if the prompt leaves
        no room for a token, ValueError for an empty prompt, out-of-range params or a request_id already in
        flight, EngineNotReady before load(). Closing the iterator (or cancelling the task consuming it)
        frees the request's slot and KV cache promptly; so does cancel(request_id)."""
        ...

    def cancel(self, request_id: str) -> None:
        """Stop a generation from anywhere (idempotent; unknown ids are ignored); its iterator just ends."""
        ...

    def stats(self) -> dict:
        """JSON-able counters: waiting (queued, or admitted and waiting for KV pages: waiting_for_kv), running,
        prompt_tokens (prompt_tokens_cached of them from the prefix cache, in prefix_cache_hits requests),
        generated_tokens, tokens_per_s; the KV cache's pages under "kv_cache" (pages, pages_used, pages_evicted,
        and recurrent_checkpoints_evicted where there is such a cache); engine tier counters under "tiers" (empty
        for the reference engine); under "decode" the measured decode rate of one stream (tok_s_per_stream) beside
        the plan's forecast for the engine's mode (forecast_tok_s, measured_over_forecast, and the whole forecast,
        glm53.planning.forecast's JSON, when the composition handed one over)."""
        ...
