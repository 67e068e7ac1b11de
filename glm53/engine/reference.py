"""The CPU reference engine: a Glm5Next checkpoint run with transformers, for the demo, CI and KL teachers.

One model, one worker thread. Requests wait in a FIFO queue; up to `max_running` are active at once and the
worker visits them round-robin, one unit of work each (one prompt chunk, or one token), so every active
request makes progress and a long prompt cannot stall the others' streams. Each request keeps its own
transformers cache (KDA recurrent + conv state, MLA latents, DSA indexer keys); batching across requests
would need padded recurrent states, and correctness matters more than throughput here.

Threads: the worker thread owns the model; the asyncio side only enqueues and reads events. Events cross
with loop.call_soon_threadsafe into a per-request asyncio.Queue. Cancellation is a flag the worker checks
between units of work (a few ms apart), after which the request's cache is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glm53.engine import constrain, sampling
from glm53.engine.detok import IncrementalDetokenizer
from glm53.engine.interface import (
    ContextLengthExceeded,
    EngineError,
    EngineEvent,
    EngineNotReady,
    GrammarUnsupported,
    PromptProgress,
    SamplingParams,
    TokenEvent,
)
from glm53.engine.template import render_chat
from glm53.fixture.hf import quiet_transformers
from glm53.fixture.tokenizer import THINK_CLOSE, THINK_OPEN

log = logging.getLogger("glm53.engine")

_END = object()  # queue sentinel: the generation ended without a finish reason (cancelled)
RATE_WINDOW_S = 10.0  # tokens_per_s is averaged over this window


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_new: int
    stop_ids: frozenset[int]
    emit: Callable[[Any], None]
    gen: torch.Generator
    detok: IncrementalDetokenizer
    in_reasoning: bool
    reasoning_end: int | None  # the token that closes the think block when the model samples it
    constraint: constrain.GrammarConstraint | None = None  # applies once the think block is closed
    cancelled: bool = False
    cache: Any = None
    prefilled: int = 0
    logits: torch.Tensor | None = None  # next-token logits once the prompt is processed
    generated: int = 0
    reasoning_tokens: int = 0
    forced: list[int] = field(default_factory=list)


def _model_class(num_layers: int, num_mtp: int) -> type:
    """Glm5NextForConditionalGeneration that does not report the MTP head's tensors as unexpected.

    transformers only ignores MTP tensors at layer 45 (the real model's depth); smaller checkpoints put the
    head at their own depth.
    """
    from transformers import Glm5NextForConditionalGeneration as base

    mtp = "|".join(str(num_layers + i) for i in range(max(1, num_mtp)))
    ignore = [*(base._keys_to_ignore_on_load_unexpected or []), rf"language_model\.layers\.({mtp})\."]
    return type("Glm5NextReference", (base,), {"_keys_to_ignore_on_load_unexpected": ignore})


class ReferenceEngine:
    """Engine (glm53.engine.interface) on the CPU with transformers. Construct, then load() (blocking)."""

    kind = "reference-cpu"

    def __init__(
        self,
        model_dir: Path,
        *,
        model_id: str = "glm-5.3-flash",
        context_length: int | None = None,
        max_running: int = 8,
        prefill_chunk: int = 256,
        threads: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model_id = model_id
        self.context_length = context_length or 0  # set from config.json by load() when not given
        self.max_running = max(1, max_running)
        self.prefill_chunk = max(1, prefill_chunk)
        self.threads = threads
        # float32 by default: the checkpoint is bf16, but CPUs without bf16 matmul units run bf16 slower, and
        # an exact upcast keeps the reference a faithful teacher.
        self.dtype = dtype
        self._model: Any = None
        self._hf_tok: Any = None
        self._tok: Any = None  # tokenizers.Tokenizer (fast paths: encode/decode without the HF wrapper)
        self._n_vocab = 0  # real tokenizer entries; the model's padded logits beyond are never sampled
        self._eos: list[int] = []
        self._pieces: dict[int, str] = {}
        self._think_open: int | None = None
        self._think_close: int | None = None
        self._ll_tokenizer: Any = None  # llguidance's vocabulary view, when llguidance is installed
        self.supports_grammar = constrain.available()
        self._cv = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._by_id: dict[str, _Request] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._counters = {
            "requests_total": 0,
            "requests_finished": 0,
            "requests_cancelled": 0,
            "requests_failed": 0,
            "prompt_tokens": 0,
            "generated_tokens": 0,
        }
        self._rate: deque[tuple[float, int]] = deque()
        self._started = time.monotonic()

    # --- lifecycle ----------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._model is not None and self._thread is not None and self._thread.is_alive()

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    def load(self) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        if self.ready:
            return
        t0 = time.perf_counter()
        if self.threads:
            torch.set_num_threads(self.threads)
        log.info("reference engine: loading %s on the CPU (%s)", self.model_dir, str(self.dtype).replace("torch.", ""))
        with quiet_transformers():
            config = AutoConfig.from_pretrained(self.model_dir)
            text = config.get_text_config()
            self._hf_tok = AutoTokenizer.from_pretrained(self.model_dir)
            num_mtp = int(getattr(text, "num_nextn_predict_layers", 0) or 0)
            cls = _model_class(text.num_hidden_layers, num_mtp)
            model = cls.from_pretrained(self.model_dir, dtype=self.dtype).eval()
            self._tok = self._hf_tok.backend_tokenizer
            self._n_vocab = min(len(self._hf_tok), text.vocab_size)
            try:
                eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            except OSError:
                eos = text.eos_token_id
            eos = eos if eos is not None else self._hf_tok.eos_token_id
            self._eos = sorted({eos} if isinstance(eos, int) else set(eos or []))
            if not self.context_length:
                self.context_length = int(text.max_position_embeddings)
            self._think_open = self._tok.token_to_id(THINK_OPEN)
            self._think_close = self._tok.token_to_id(THINK_CLOSE)
            with torch.inference_mode():  # one prefill and one decode step: both code paths, before serving
                out = model(input_ids=torch.tensor([[0, 1]]), use_cache=True)
                model(input_ids=torch.tensor([[2]]), past_key_values=out.past_key_values, use_cache=True)
        self._model = model
        self._stopping = False
        self._thread = threading.Thread(target=self._worker, name="glm53-reference-engine", daemon=True)
        self._thread.start()
        log.info(
            "reference engine: ready in %.1f s (%d layers, %d experts, context %d)",
            time.perf_counter() - t0, text.num_hidden_layers, getattr(text, "n_routed_experts", 0), self.context_length,
        )  # fmt: skip

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._cv:
            pending = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._running.clear()
            self._by_id.clear()
        for req in pending:
            req.emit(EngineNotReady("the engine was shut down"))
        self._model = None
        self._thread = None

    # --- text ---------------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        self._need_tokenizer()
        return self._tok.encode(text, add_special_tokens=add_special).ids

    def detokenize(self, ids: list[int]) -> str:
        self._need_tokenizer()
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        self._need_tokenizer()
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        enable_thinking: bool = True,
        add_generation_prompt: bool = True,
    ) -> str:
        self._need_tokenizer()
        return render_chat(self._hf_tok, messages, tools, enable_thinking, add_generation_prompt)

    def _need_tokenizer(self) -> None:
        if self._tok is None:
            raise EngineNotReady("the model is not loaded yet")

    def _grammar_vocab(self) -> Any:
        # Built on first use: most deployments never see a grammar request, and it costs an import.
        with self._cv:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = constrain.make_tokenizer(self._hf_tok, self._n_vocab, self._eos)
            return self._ll_tokenizer

    def _piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return piece

    # --- requests -----------------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[EngineEvent]:
        if not self.ready:
            raise EngineNotReady("the model is not loaded yet")
        if params.grammar is not None and not self.supports_grammar:
            raise GrammarUnsupported("constrained decoding needs llguidance, which is not installed")
        sampling.validate(params)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.context_length:
            raise ContextLengthExceeded(len(prompt_ids), self.context_length)
        if any(not 0 <= t < self._n_vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self._n_vocab})")

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the consumer's loop is gone: nobody is listening any more
                req.cancelled = True

        room = self.context_length - len(prompt_ids)
        # A prompt that ends in an open <think> starts in reasoning: the budget counts from there, and a grammar
        # only constrains the answer after the block closes (JSON inside the reasoning would be wrong).
        reasoning = params.reasoning_budget is not None or prompt_ids[-1] == self._think_open
        constraint = None
        if params.grammar is not None:
            constraint = constrain.GrammarConstraint(self._grammar_vocab(), params.grammar)
        req = _Request(
            request_id=request_id,
            prompt=list(prompt_ids),
            params=params,
            max_new=min(params.max_tokens or room, room),
            stop_ids=frozenset(params.stop_token_ids),
            emit=emit,
            gen=sampling.make_generator(params.seed),
            detok=IncrementalDetokenizer(lambda ids: self._tok.decode(ids, skip_special_tokens=False)),
            in_reasoning=reasoning,
            reasoning_end=params.reasoning_end_ids[0] if params.reasoning_end_ids else self._think_close,
            constraint=constraint,
        )
        with self._cv:
            if request_id in self._by_id:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._by_id[request_id] = req
            self._waiting.append(req)
            self._counters["requests_total"] += 1
            self._cv.notify()
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, TokenEvent) and item.finish_reason is not None:
                    return
        finally:
            self._cancel(req)  # consumer stopped early (closed, cancelled, raised): free the slot

    def cancel(self, request_id: str) -> None:
        with self._cv:
            req = self._by_id.get(request_id)
        if req is not None:
            self._cancel(req)

    def _cancel(self, req: _Request) -> None:
        with self._cv:
            if self._by_id.get(req.request_id) is not req:  # finished already (its id may be reused since)
                return
            req.cancelled = True
            if req in self._waiting:  # never started: drop it now rather than when a slot frees up
                self._waiting.remove(req)
                self._forget(req, "requests_cancelled")
                req.emit(_END)
            self._cv.notify()

    def stats(self) -> dict:
        now = time.monotonic()
        with self._cv:
            self._trim_rate(now)
            window = min(RATE_WINDOW_S, max(now - self._started, 1e-9))
            rate = sum(n for _, n in self._rate) / window
            prefilling = sum(1 for r in self._running if r.prefilled < len(r.prompt))
            return {
                "kind": self.kind,
                "model_id": self.model_id,
                "context_length": self.context_length,
                "waiting": len(self._waiting),
                "running": len(self._running),
                "prefilling": prefilling,
                "max_running": self.max_running,
                **self._counters,
                "tokens_per_s": round(rate, 2),
                "uptime_s": round(now - self._started, 1),
                "tiers": {},
            }

    # --- worker -------------------------------------------------------------------------------------------
    def _worker(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._stopping and not self._waiting and not self._running:
                        self._cv.wait()
                    if self._stopping:
                        return
                    while self._waiting and len(self._running) < self.max_running:
                        self._running.append(self._waiting.popleft())
                    batch = list(self._running)
                for req in batch:
                    if req.cancelled:
                        self._retire(req, "requests_cancelled", _END)
                        continue
                    try:
                        self._step(req)
                    except Exception as exc:  # one broken request must not take the engine down
                        log.exception("reference engine: request %s failed", req.request_id)
                        self._retire(req, "requests_failed", EngineError(f"generation failed: {exc}"))

    def _forward(self, req: _Request, ids: list[int]) -> torch.Tensor:
        out = self._model(
            input_ids=torch.tensor([ids], dtype=torch.long),
            past_key_values=req.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        req.cache = out.past_key_values
        return out.logits[0, -1, : self._n_vocab]

    def _step(self, req: _Request) -> None:
        """One unit of work for `req`: a prompt chunk or one token."""
        total = len(req.prompt)
        if req.prefilled < total:
            chunk = req.prompt[req.prefilled : req.prefilled + self.prefill_chunk]
            req.logits = self._forward(req, chunk)
            req.prefilled += len(chunk)
            with self._cv:
                self._counters["prompt_tokens"] += len(chunk)
            if total > self.prefill_chunk:
                req.emit(PromptProgress(req.prefilled, total))
            return

        token, forced, grammar_done = self._next_token(req)
        req.generated += 1
        with self._cv:  # counted before the event leaves, so stats() never lags what a client has seen
            self._counters["generated_tokens"] += 1
            now = time.monotonic()
            self._rate.append((now, 1))
            self._trim_rate(now)
        event = TokenEvent(token_id=token, text="", token_text=self._piece(token), forced=forced)
        if req.params.logprobs is not None:
            lp, top = sampling.logprobs_of(req.logits, token, req.params.logprobs)
            event.logprob = lp
            event.top_logprobs = [(self._piece(t), v) for t, v in top]
        if token in req.stop_ids and not forced:
            event.finish_reason = "stop"
            event.text = req.detok.flush()  # text held back before the stop token; the stop token adds none
        else:
            event.text = req.detok.push(token)
            if grammar_done or req.generated >= req.max_new:
                event.finish_reason = "stop" if grammar_done else "length"
                event.text += req.detok.flush()
        if event.finish_reason is not None:
            self._retire(req, "requests_finished", event)
            return
        req.emit(event)
        req.logits = self._forward(req, [token])

    def _next_token(self, req: _Request) -> tuple[int, bool, bool]:
        """(token, forced, grammar complete): sample, or take the next forced id of a budget-closed think block."""
        p = req.params
        if (
            not req.forced
            and req.in_reasoning
            and p.reasoning_budget is not None
            and req.reasoning_tokens >= p.reasoning_budget
        ):
            req.forced = list(p.reasoning_end_ids)
            req.in_reasoning = False
        if req.forced:
            return req.forced.pop(0), True, False
        constrained = req.constraint is not None and not req.in_reasoning
        logits = req.constraint.masked(req.logits) if constrained else req.logits
        token = sampling.sample(logits, p, req.gen)
        if req.in_reasoning:
            if token == req.reasoning_end:
                req.in_reasoning = False
            else:
                req.reasoning_tokens += 1
        done = constrained and token not in req.stop_ids and req.constraint.advance(token)
        return token, False, done

    def _retire(self, req: _Request, counter: str, last: Any) -> None:
        """Remove a running request, free its cache, send its last item (final event, error or _END)."""
        with self._cv:
            if req in self._running:
                self._running.remove(req)
            self._forget(req, counter)
        req.cache = None
        req.logits = None
        req.emit(last)

    def _forget(self, req: _Request, counter: str) -> None:
        # Caller holds self._cv.
        if self._by_id.get(req.request_id) is req:
            del self._by_id[req.request_id]
        self._counters[counter] += 1

    def _trim_rate(self, now: float) -> None:
        while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
            self._rate.popleft()
