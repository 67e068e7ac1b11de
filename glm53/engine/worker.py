"""What both engines share: the request queue, the worker thread's hand-off to asyncio, and token events.

The reference engine (transformers, CPU) and the exllamav3 engine differ in how they run the model, not in how a
request travels: validated and queued by generate(), admitted by the worker up to `max_running`, answered with
TokenEvents that count, detokenize and finish the same way, cancelled by a flag. Keeping that path in one place
means the two engines cannot drift apart on it, and the CPU suite, which runs against the reference engine,
checks the code the GPU engine serves with.

Threads: the worker thread owns the model; the asyncio side only enqueues and reads events. Events cross with
loop.call_soon_threadsafe into a per-request asyncio.Queue. Cancellation is a flag the worker checks between units
of work, after which the engine drops what the request holds (`_release`).

A subclass supplies `ready`, `load`, `close` (around `_start_worker` / `_stop_worker`), `_new_request` (its
Request subclass, with its own per-request state) and `_worker`, a loop over `_admit()`.

KV cache, one rule for both engines: a request never reserves its whole reply up front; it holds the pages
(PAGE tokens) its positions fill so far and takes the next as it grows, so requests without max_tokens share the
cache. A reply is capped to what the cache holds alone (min(context, kv_tokens) - prompt), so the oldest request
always finishes: when a page is missing, the youngest request holding pages yields them (it goes back to the
waiting queue, keeping what it generated, and prefills that again when pages free up), and a request that is
itself the youngest waits. A request waiting for pages counts as waiting. The reference engine keeps that ledger
here (`KvPages`); the exllamav3 engine's is exllamav3's page table, its jobs given `max_rq_tokens` (pages committed
a segment at a time, the job requeued at each boundary: exllamav3 1.6.5 generator/job.py).

Decode slots, time-sliced: when a request waits for a slot and every slot is held, the running request whose slice
is spent longest (it has held its slot a slice and generated since it got it) yields: it goes to the back of the
queue keeping what it generated, and prefills that again when its turn comes (the exllamav3 engine's page cache
serves most of it). So a new request waits about one slice, whatever the others' lengths. The slice calibrates
itself: SLICE_RESUMES times the median cost of a resume (admission to its first new token, less a decode gap), at
least SLICE_FLOOR_S, which bounds what yielding costs the throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from glm53.engine import sampling
from glm53.engine.detok import IncrementalDetokenizer
from glm53.engine.interface import (
    ContextLengthExceeded,
    EngineError,
    EngineEvent,
    EngineNotReady,
    EngineOutOfMemory,
    GrammarUnsupported,
    QueueFull,
    SamplingParams,
    TokenEvent,
)
from glm53.engine.template import render_chat
from glm53.engine.vision import NoVision, PromptImage, VisionSpec, read_vision_spec
from glm53.planning.spec import PAGE

log = logging.getLogger("glm53.engine")

END = object()  # queue sentinel: the generation ended without a finish reason (cancelled)
RATE_WINDOW_S = 10.0  # tokens_per_s is averaged over this window
DECODE_GAPS = 256  # the measured decode rate per stream: the last this many gaps between a request's sampled tokens
SLICE_FLOOR_S = 2.0  # a decode slot's time slice at least ...
SLICE_RESUMES = 10  # ... and this many times what resuming a yielded request costs (so yielding costs under 10%)
RESUMES_TIMED = 32  # the slice follows the median of this many latest resumes
LONG_TEXT_CHARS = 1 << 14  # from here on tokenize() releases the GIL (encode_batch); below, encode is faster


@dataclass(eq=False)  # identity, not field equality: requests are looked up in the queues with `in` / remove()
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_new: int
    stop_ids: frozenset[int]
    emit: Callable[[Any], None]  # thread-safe: hands one item to the consumer's event loop
    detok: IncrementalDetokenizer
    in_reasoning: bool
    reasoning_end: int | None  # the token that closes the think block when the model samples it
    cancelled: bool = False
    done: bool = False  # retired: anything the model still produces for it is stale
    arrival: int = 0  # order of arrival: the youngest request is the one that yields KV pages
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache, once the engine knows
    kv_waiting: bool = False  # admitted, but waiting for KV pages (counted as waiting, not running)
    generated: list[int] = field(default_factory=list)  # every token emitted so far (sampled and forced)
    reasoning_tokens: int = 0
    last_token_at: float | None = None  # monotonic time of its last emitted token (the decode rate's gaps)
    admitted_at: float | None = None  # monotonic time it last got a decode slot (its slice runs from there)
    generated_at_admit: int = 0  # len(generated) then: a slice counts as spent only once it generated something
    resuming: bool = False  # a yielded request has its slot back (since admitted_at) and no new token yet
    images: tuple[PromptImage, ...] = ()  # the prompt's images, in order (their spans hold the image token)

    @property
    def budget_spent(self) -> bool:
        """Still inside <think> with the reasoning budget used up: the close tokens must be forced now."""
        b = self.params.reasoning_budget
        return self.in_reasoning and b is not None and self.reasoning_tokens >= b


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's device out-of-memory error (a class CPU torch has too), without importing torch here."""
    return any(c.__name__ == "OutOfMemoryError" and c.__module__.startswith("torch") for c in type(exc).__mro__)


@contextlib.contextmanager
def out_of_memory_names_knobs(where: str) -> Iterator[None]:
    """Turn torch's out-of-memory error inside the block into EngineOutOfMemory, which says what to lower."""
    try:
        yield
    except Exception as exc:
        if is_out_of_memory(exc):
            raise EngineOutOfMemory(where, exc) from exc
        raise


def kv_pages(tokens: int) -> int:
    return -(-max(0, tokens) // PAGE)


class KvPages:
    """The KV cache as `total` pages of PAGE tokens; who holds how many. Holders are requests, or a kept prefix
    cache (evictable)."""

    def __init__(self, total: int) -> None:
        self.total = max(1, total)
        self.held: dict[Any, int] = {}
        self.evicted = 0  # pages of kept prefix caches dropped for room

    @property
    def free(self) -> int:
        return self.total - sum(self.held.values())

    def missing(self, holder: Any, tokens: int) -> int:
        """Pages `holder` still needs to hold `tokens` positions, beyond what is free."""
        return max(0, kv_pages(tokens) - self.held.get(holder, 0) - self.free)

    def take(self, holder: Any, tokens: int) -> bool:
        if self.missing(holder, tokens):
            return False
        self.held[holder] = max(self.held.get(holder, 0), kv_pages(tokens))
        return True

    def drop(self, holder: Any) -> int:
        return self.held.pop(holder, 0)


class Batch(NamedTuple):
    new: list  # admitted by this call
    running: list  # every admitted request, the new ones included


class WorkerEngine(ABC):
    """The shared half of an Engine (glm53.engine.interface): text, queue, worker thread, events, stats."""

    kind: str
    supports_grammar: bool
    no_grammar_reason: str  # GrammarUnsupported's message when supports_grammar is False
    vision: VisionSpec | None = None  # what the engine's vision tower takes; None: it takes no images
    no_vision_reason: str = "this engine does not run the vision tower"

    def __init__(self, model_dir: Path, *, model_id: str, context_length: int | None, max_running: int) -> None:
        self.model_dir = Path(model_dir)
        self.model_id = model_id
        self.context_length = context_length or 0  # set from the checkpoint by load() when not given
        self.max_running = max(1, max_running)
        self.max_waiting = 0  # requests that may wait for a slot (0: no limit); beyond it generate() raises QueueFull
        self.kv_tokens = 0  # KV cache positions shared by every request (whole pages); 0: only the context bounds
        self.kv: KvPages | None = None  # the ledger, for an engine that keeps it here (set_kv_tokens)
        self._arrivals = 0
        self._hf_tok: Any = None
        self._tok: Any = None  # tokenizers.Tokenizer (fast paths: encode/decode without the HF wrapper)
        self._n_vocab = 0  # real tokenizer entries; the model's padded logits beyond are never sampled
        self._eos: list[int] = []
        self._pieces: dict[int, str] = {}
        self._think_open: int | None = None
        self._think_close: int | None = None
        self._max_token_bytes = 0
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._counters = dict.fromkeys(("requests_total", "requests_finished", "requests_cancelled", "requests_failed",
                                        "requests_refused_queue_full", "requests_failed_out_of_memory",
                                        "requests_preempted", "requests_yielded", "prompt_tokens", "prompt_tokens_cached",
                                        "prefix_cache_hits", "generated_tokens"), 0)
        self._rate: deque[tuple[float, int]] = deque()
        self._gaps: deque[float] = deque(maxlen=DECODE_GAPS)
        self.slice_floor_s = SLICE_FLOOR_S
        self._resumes: deque[float] = deque(maxlen=RESUMES_TIMED)
        self._started = time.monotonic()
        # The plan's speed forecast (glm53.planning.forecast's JSON), handed over by the composition (glm53.serve);
        # stats()["decode"] shows it beside the measured rate. None: nothing forecast (the demo, tests).
        self.forecast: dict | None = None

    # --- lifecycle ----------------------------------------------------------------------------------------
    def set_kv_tokens(self, tokens: int, ledger: bool) -> None:
        """The KV cache's size in tokens (rounded down to pages); ledger: keep the page ledger here."""
        self.kv_tokens = max(PAGE, int(tokens) // PAGE * PAGE)
        self.kv = KvPages(self.kv_tokens // PAGE) if ledger else None

    @property
    def request_limit(self) -> int:
        """Prompt plus reply positions one request may fill: the context, or the whole KV cache if smaller."""
        return min(self.context_length, self.kv_tokens) if self.kv_tokens else self.context_length

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def capacity(self) -> int | None:
        return self.max_running + self.max_waiting if self.max_waiting else None

    def _start_worker(self, name: str) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._worker, name=name, daemon=True)
        self._thread.start()

    def _worker_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _stop_worker(self, timeout: float) -> None:
        """Stop the worker, then fail what was still queued or running with EngineNotReady."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        with self._cv:
            pending = list(self._waiting) + list(self._running)
            self._waiting.clear()
            self._running.clear()
            self._by_id.clear()
        for req in pending:
            req.emit(EngineNotReady("the engine was shut down"))
        self._thread = None

    def _read_vision(self) -> None:
        """The checkpoint's vision tower, if it has one; otherwise images are refused with the reason."""
        try:
            self.vision = read_vision_spec(self.model_dir)
        except NoVision as exc:
            self.vision = None
            self.no_vision_reason = (f"{exc}: serve a checkpoint that includes the vision tower (GLM-5.3-Flash "
                                     "ships it), or send text only")
            log.info("%s engine: images are refused (%s)", self.kind, exc)

    # --- text ---------------------------------------------------------------------------------------------
    def _load_text(self) -> Any:
        """Tokenizer, eos ids and think tokens from the checkpoint's HF files; returns its text config."""
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        from glm53.engine.quiet import quiet_transformers
        from glm53.markup import THINK_CLOSE, THINK_OPEN

        with quiet_transformers():
            self._hf_tok = AutoTokenizer.from_pretrained(self.model_dir)
            text = AutoConfig.from_pretrained(self.model_dir).get_text_config()
            try:
                eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            except OSError:
                eos = text.eos_token_id
        self._tok = self._hf_tok.backend_tokenizer
        self._n_vocab = min(len(self._hf_tok), text.vocab_size)
        eos = eos if eos is not None else self._hf_tok.eos_token_id
        self._eos = sorted({eos} if isinstance(eos, int) else set(eos or []))
        self._think_open = self._tok.token_to_id(THINK_OPEN)
        self._think_close = self._tok.token_to_id(THINK_CLOSE)
        return text

    @property
    def max_token_bytes(self) -> int:
        """Bytes of the vocabulary's longest token: a text of B bytes has at least B / this many tokens."""
        self._need_tokenizer()
        if not self._max_token_bytes:
            # Byte-level vocabularies spell each byte as one character; added tokens are plain text.
            self._max_token_bytes = max(len(t.encode()) for t in self._tok.get_vocab(with_added_tokens=True))
        return self._max_token_bytes

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        self._need_tokenizer()
        if not isinstance(text, str):
            raise TypeError(f"tokenize needs text, got {type(text).__name__}")
        try:
            if len(text) < LONG_TEXT_CHARS:
                return self._tok.encode(text, add_special_tokens=add_special).ids
            # encode() holds the GIL for its whole run (a 5 MB text stalls every other thread for seconds);
            # encode_batch releases it, so long prompts never pause the engine's thread or other streams.
            return self._tok.encode_batch([text], add_special_tokens=add_special)[0].ids
        except TypeError as exc:  # text the tokenizer cannot take (e.g. a lone surrogate): the caller's error
            raise ValueError(f"the text cannot be tokenized: {exc}") from None

    def detokenize(self, ids: list[int]) -> str:
        self._need_tokenizer()
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        self._need_tokenizer()
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, enable_thinking: bool = True,
                            add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
        self._need_tokenizer()
        return render_chat(self._hf_tok, messages, tools, enable_thinking, add_generation_prompt, template_kwargs)

    def _need_tokenizer(self) -> None:
        if self._tok is None:
            raise EngineNotReady("the model is not loaded yet")

    def _piece(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return piece

    # --- requests (asyncio side) --------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, images: Sequence[PromptImage] = ()
    ) -> AsyncIterator[EngineEvent]:
        if not self.ready:
            raise EngineNotReady("the model is not loaded yet")
        if params.grammar is not None and not self.supports_grammar:
            raise GrammarUnsupported(self.no_grammar_reason)
        sampling.validate(params)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.request_limit:
            raise ContextLengthExceeded(len(prompt_ids), self.request_limit)
        if any(not 0 <= t < self._n_vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self._n_vocab})")
        if images:
            self._check_images(prompt_ids, images)

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the consumer's loop is gone: nobody is listening any more
                req.cancelled = True

        room = self.request_limit - len(prompt_ids)
        req = self._new_request(
            request_id=request_id,
            prompt=list(prompt_ids),
            params=params,
            max_new=min(params.max_tokens or room, room),
            stop_ids=frozenset(params.stop_token_ids),
            emit=emit,
            detok=IncrementalDetokenizer(lambda ids: self._tok.decode(ids, skip_special_tokens=False)),
            # A prompt that ends in an open <think> starts in reasoning: the budget counts from there.
            in_reasoning=params.reasoning_budget is not None or prompt_ids[-1] == self._think_open,
            reasoning_end=params.reasoning_end_ids[0] if params.reasoning_end_ids else self._think_close,
            images=tuple(images),
        )
        with self._cv:
            if request_id in self._by_id:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            # Counted against the slots too: a burst arriving before the worker admits any must not be refused
            # while slots are free.
            if self.max_waiting and len(self._waiting) + len(self._running) >= self.max_running + self.max_waiting:
                self._counters["requests_refused_queue_full"] += 1
                raise QueueFull(len(self._waiting), self.max_waiting)
            self._by_id[request_id] = req
            self._arrivals += 1
            req.arrival = self._arrivals
            self._waiting.append(req)
            self._counters["requests_total"] += 1
            self._cv.notify()
        try:
            while True:
                item = await queue.get()
                if item is END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, TokenEvent) and item.finish_reason is not None:
                    return
        finally:
            self._cancel(req)  # consumer stopped early (closed, cancelled, raised): free the slot

    def _check_images(self, prompt_ids: list[int], images: Sequence[PromptImage]) -> None:
        """An image needs the tower, and a span of image tokens of its own in the prompt, in order."""
        if self.vision is None:
            raise ValueError(f"this model takes no images: {self.no_vision_reason}")
        token, after = self.vision.image_token_id, 0
        for i, im in enumerate(images):
            if im.start < after or im.end > len(prompt_ids) or im.tokens < 1 \
                    or any(t != token for t in prompt_ids[im.start:im.end]):
                raise ValueError(f"image {i}'s span [{im.start}, {im.end}) is not a run of image tokens of its own "
                                 "in the prompt")
            after = im.end

    def cancel(self, request_id: str) -> None:
        with self._cv:
            req = self._by_id.get(request_id)
        if req is not None:
            self._cancel(req)

    def _cancel(self, req: Request) -> None:
        with self._cv:
            if self._by_id.get(req.request_id) is not req:  # finished already (its id may be reused since)
                return
            req.cancelled = True
            if req in self._waiting:  # never started: drop it now rather than when a slot frees up
                self._waiting.remove(req)
                self._forget(req, "requests_cancelled")
                req.emit(END)
            self._cv.notify()

    def fault(self) -> dict | None:
        return None

    def stats(self) -> dict:
        now = time.monotonic()
        with self._cv:
            self._trim_rate(now)
            window = min(RATE_WINDOW_S, max(now - self._started, 1e-9))
            rate = sum(n for _, n in self._rate) / window
            kv_waiting = sum(1 for r in self._running if r.kv_waiting)
            return {
                "kind": self.kind,
                "model_id": self.model_id,
                "context_length": self.context_length,
                # Admitted requests waiting for KV pages wait like the queued ones (their slot does nothing yet).
                "waiting": len(self._waiting) + kv_waiting,
                "running": len(self._running) - kv_waiting,
                "waiting_for_kv": kv_waiting,
                **self._stats_extra(),
                "max_running": self.max_running,
                "max_waiting": self.max_waiting,
                "slice_s": round(self.slice_s, 3),
                **self._counters,
                "tokens_per_s": round(rate, 2),
                "uptime_s": round(now - self._started, 1),
                "kv_cache": self._kv_stats(),
                "decode": self._decode_stats(),
                "tiers": {},
            }

    def _decode_stats(self) -> dict:
        """The measured decode rate of one stream (the last DECODE_GAPS gaps between a request's consecutive
        sampled tokens: a batched step counts once per stream) beside the plan's forecast for this engine's mode;
        called with self._cv held."""
        spent = sum(self._gaps)
        measured = len(self._gaps) / spent if self._gaps and spent > 0 else None
        doc: dict = {"tok_s_per_stream": None if measured is None else round(measured, 2),
                     "gaps_timed": len(self._gaps), "forecast_mode": None, "forecast_tok_s": None,
                     "measured_over_forecast": None, "forecast": self.forecast}
        modes = (self.forecast or {}).get("modes") or {}
        mode = getattr(self, "mode", None)
        mode = mode if mode in modes else (self.forecast or {}).get("planned_mode")
        if mode in modes:
            expected = modes[mode]["tok_s"]
            doc.update(forecast_mode=mode, forecast_tok_s=expected,
                       measured_over_forecast=None if measured is None or not expected else round(measured / expected, 3))
        return doc

    def _stats_extra(self) -> dict:
        """Engine-specific queue fields for stats(); called with self._cv held."""
        return {}

    def _kv_stats(self) -> dict:
        """The KV cache's pages and what was dropped from it; called with self._cv held."""
        kv = self.kv
        if kv is None:
            return {"page_tokens": PAGE, "pages": self.kv_tokens // PAGE}
        return {"page_tokens": PAGE, "pages": kv.total, "pages_used": kv.total - kv.free,
                "pages_evicted": kv.evicted}

    # --- worker side --------------------------------------------------------------------------------------
    def _admit(self) -> Batch | None:
        """Wait for work, then move waiting requests into free running slots; None once the worker must stop."""
        with self._cv:
            while not self._stopping and not self._waiting and not self._running:
                self._cv.wait()
            if self._stopping:
                return None
            new = []
            now = time.monotonic()
            while self._waiting and (len(self._running) < self.max_running or self._yield_slot(now)) \
                    and self._kv_admits(self._waiting[0]):
                req = self._waiting.popleft()
                self._running.append(req)
                new.append(req)
                req.admitted_at, req.generated_at_admit = now, len(req.generated)
                if req.generated:
                    req.resuming = True
            return Batch(new, list(self._running))

    @property
    def slice_s(self) -> float:
        """A decode slot's time slice: SLICE_RESUMES x the median resume, at least slice_floor_s."""
        resume = statistics.median_high(self._resumes) if self._resumes else 0.0
        return max(self.slice_floor_s, SLICE_RESUMES * resume)

    def _yield_slot(self, now: float) -> bool:
        """Every slot is held and a request waits: the running request whose slice is spent longest yields its slot
        (to the back of the queue, keeping what it generated). False when none has spent its slice, or pages, not
        slots, are what is short. Caller holds self._cv."""
        if any(r.kv_waiting for r in self._running):
            return False
        limit = self.slice_s
        spent = [r for r in self._running if not (r.done or r.cancelled) and r.admitted_at is not None
                 and now - r.admitted_at >= limit and len(r.generated) > r.generated_at_admit]
        if not spent:
            return False
        req = min(spent, key=lambda r: r.admitted_at)
        self._running.remove(req)
        self._suspend(req)
        req.admitted_at = req.last_token_at = None  # the wait in the queue is no decode gap
        self._waiting.append(req)
        self._counters["requests_yielded"] += 1
        return True

    def _kv_admits(self, req: Request) -> bool:
        """FIFO admission by pages: the head of the queue starts with its first page (a kept prefix cache it
        continues from is handed over; another is evicted for room) while nobody running waits for pages. Caller
        holds self._cv."""
        if self.kv is not None and any(r.kv_waiting for r in self._running):
            return False
        self._claim_prefix(req)
        if self.kv is None:
            return True
        while not self.kv.take(req, 1):
            if not (self._kv_evict_kept() or self._drop_suspended_pages(but=req)):
                return False
        return True

    def _kv_reserve(self, req: Request, tokens: int) -> bool:
        """Pages for `req` to hold `tokens` positions (the ledger's rule, module docstring). False: it waits."""
        kv = self.kv
        if kv is None:
            return True
        with self._cv:
            while not kv.take(req, tokens):
                if self._kv_evict_kept():
                    continue
                if self._drop_suspended_pages():
                    continue
                younger = [r for r in self._running if r is not req and r.arrival > req.arrival and kv.held.get(r)]
                if not younger:
                    req.kv_waiting = True
                    return False
                self._preempt(max(younger, key=lambda r: r.arrival))
            req.kv_waiting = False
            return True

    def _preempt(self, req: Request) -> None:
        """Take `req` out of running, its pages freed: it waits (in arrival order) to prefill what it has again.
        Caller holds self._cv."""
        self._running.remove(req)
        if self.kv is not None:
            self.kv.drop(req)
        req.kv_waiting = False
        self._reset_for_resume(req)
        at = next((i for i, w in enumerate(self._waiting) if w.arrival > req.arrival), len(self._waiting))
        self._waiting.insert(at, req)
        self._counters["requests_preempted"] += 1

    def _suspend(self, req: Request) -> None:
        """A request yielding its slot: by default it lets go of its pages and model state and prefills prompt +
        generated again on resuming; an engine that can keep the state overrides this. Caller holds self._cv."""
        if self.kv is not None:
            self.kv.drop(req)
        self._reset_for_resume(req)

    def _drop_suspended_pages(self, but: Request | None = None) -> bool:
        """Pages are short: a waiting request (other than `but`) that kept its pages when it yielded lets go of them
        (it prefills again on resuming), the latest in the queue first. False when none holds any. Caller holds
        self._cv."""
        kv = self.kv
        if kv is None:
            return False
        holders = [r for r in self._waiting if r is not but and kv.held.get(r)]
        if not holders:
            return False
        req = holders[-1]
        kv.drop(req)
        self._reset_for_resume(req)
        self._counters["requests_preempted"] += 1
        return True

    def _claim_prefix(self, req: Request) -> None:  # noqa: B027 - only an engine keeping prefix caches here
        """Hand a kept prefix cache that `req` continues from (and its pages) to `req`. Caller holds self._cv."""

    def _kv_evict_kept(self) -> bool:
        """Drop a kept prefix cache to free pages; False when there is none. Caller holds self._cv."""
        return False

    def _reset_for_resume(self, req: Request) -> None:  # noqa: B027 - only engines with a ledger preempt
        """Drop the model state of a preempted request so that it prefills prompt + generated again."""

    def _count_prompt(self, n: int) -> None:
        with self._cv:
            self._counters["prompt_tokens"] += n

    def _note_cached(self, req: Request, tokens: int) -> None:
        """The engine's account of how many of the request's prompt tokens its prefix cache served (once)."""
        if req.cached_tokens is not None:
            return
        req.cached_tokens = tokens = max(0, min(int(tokens), len(req.prompt)))
        with self._cv:
            self._counters["prompt_tokens_cached"] += tokens
            self._counters["prefix_cache_hits"] += tokens > 0

    def _fail(self, req: Request, exc: BaseException, what: str) -> None:
        """Retire `req` with the error that ended it: out of memory names what to lower, anything else is a
        failed generation. The engine goes on with the other requests."""
        if is_out_of_memory(exc):
            with self._cv:
                self._counters["requests_failed_out_of_memory"] += 1
            self._retire(req, "requests_failed", EngineOutOfMemory(what, exc))
        else:
            self._retire(req, "requests_failed", EngineError(f"generation failed: {exc}"))

    def _token_event(self, req: Request, token: int, logits: Any, forced: bool = False,
                     grammar_done: bool = False) -> TokenEvent:
        """Account for one emitted token and build its event; finish_reason is set when it ends the request.

        `logits`: the distribution the token came from (for logprobs), or None where the engine has none."""
        req.generated.append(token)
        if not forced and req.in_reasoning:
            if token == req.reasoning_end:
                req.in_reasoning = False
            else:
                req.reasoning_tokens += 1
        with self._cv:  # counted before the event leaves, so stats() never lags what a client has seen
            self._counters["generated_tokens"] += 1
            now = time.monotonic()
            self._rate.append((now, 1))
            self._trim_rate(now)
            if not forced and req.last_token_at is not None:
                self._gaps.append(now - req.last_token_at)
            req.last_token_at = now
            if req.resuming:  # its first token since it got its slot back: beyond a decode gap, the resume's cost
                gap = statistics.median_high(self._gaps) if self._gaps else 0.0
                self._resumes.append(max(0.0, now - req.admitted_at - gap))
                req.resuming = False
        event = TokenEvent(token_id=token, text="", token_text=self._piece(token), forced=forced,
                           cached_tokens=req.cached_tokens if len(req.generated) == 1 else None)
        if req.params.logprobs is not None and logits is not None:
            lp, top = sampling.logprobs_of(logits, token, req.params.logprobs)
            event.logprob = lp
            event.top_logprobs = [(self._piece(t), v) for t, v in top]
        if token in req.stop_ids and not forced:
            event.finish_reason = "stop"
            event.text = req.detok.flush()  # text held back before the stop token; the stop token adds none
        else:
            event.text = req.detok.push(token)
            if grammar_done or len(req.generated) >= req.max_new:
                event.finish_reason = "stop" if grammar_done else "length"
                event.text += req.detok.flush()
        return event

    def _retire(self, req: Request, counter: str, last: Any) -> None:
        """Remove a running request, free what it holds, send its last item (final event, error or END)."""
        req.done = True
        with self._cv:
            if req in self._running:
                self._running.remove(req)
            if self.kv is not None:
                self.kv.drop(req)
            self._forget(req, counter)
        self._release(req)
        req.emit(last)

    def _forget(self, req: Request, counter: str) -> None:
        # Caller holds self._cv.
        if self._by_id.get(req.request_id) is req:
            del self._by_id[req.request_id]
        self._counters[counter] += 1

    def _trim_rate(self, now: float) -> None:
        while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
            self._rate.popleft()

    # --- what an engine supplies --------------------------------------------------------------------------
    @property
    @abstractmethod
    def ready(self) -> bool: ...

    @abstractmethod
    def _new_request(self, **fields: Any) -> Request:
        """The engine's Request (subclass) from the shared fields; may raise to refuse the request."""

    @abstractmethod
    def _worker(self) -> None:
        """The worker thread: `while (batch := self._admit()) is not None:` run the batch's requests."""

    def _release(self, req: Request) -> None:  # noqa: B027 - optional: engines with nothing to drop skip it
        """Drop what a retired request holds in the engine (its cache, its job)."""
