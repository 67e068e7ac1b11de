"""The GPU engine: exllamav3's Generator and jobs, with the routed experts tiered by glm53 (every mode).

Modes: "exact" keeps `slots_per_layer` routed experts per MoE layer in VRAM and the rest in the pinned RAM tier;
every miss crosses PCIe and is computed by exllamav3's own kernels (glm53.exl3.tiered), so logits are
bit-identical to stock exllamav3 with all experts in VRAM. "fast" adds the CPU lane (calibrated at load) for
RAM-resident misses; "nvme-exact" and "nvme" do the same with the RAM tier as a cache of the record store
(GLM53_STORE, verified against the checkpoint at load). "stock" is plain exllamav3 (all experts in VRAM): what
the plan picks when everything fits, and the baseline the tests and `glm53 bench decode` compare against.

Threads: one worker thread owns the model, the cache and the generator; the request queue, the hand-off to asyncio
and the token events are glm53.engine.worker's, shared with the CPU reference engine. The worker runs
`Generator.iterate()` while any job is live: exllamav3 batches the running jobs' decode steps and chunks prompts
itself; glm53.exl3.runtime runs the generator and hands its results over as typed events
(glm53.exl3.events). Text is detokenized here (the HF tokenizer, as in the reference engine), so both engines emit the same
TokenEvents; exllamav3's own text stream is ignored.

KV cache: every job whose reply may exceed a page is given `max_rq_tokens`, so exllamav3 commits its pages a segment at a time (up to the next
recurrent-checkpoint boundary, 2048 tokens for GLM-5) instead of prompt + max_new_tokens up front, and requeues the
job at each boundary (its pages stay hashed in the cache, its recurrent state stashed there, so it resumes without
prefilling again); a job that cannot get its pages waits in the generator's pending queue, and is counted as
waiting. A reply is capped to what the cache holds (exllamav3 caps max_new_tokens the same way), so a request
that outgrows the cache ends with "length". The prefix reuse it reports (a job's cached pages) is the request's
usage.prompt_tokens_details.cached_tokens and the stats' prefix counters; the page table's and the recurrent
cache's eviction counters are in stats()["kv_cache"].

Images: a checkpoint with the vision tower loads it with the model (glm53.exl3.vision: exllamav3's own component,
preprocessing and embeddings); a request's images become their embeddings' placeholder ids in the job's prompt,
kept by content hash, so the page cache reuses a prefix only where it held the same images. Without the tower,
images are refused with the reason (the server's 400 images_unsupported).

Reasoning budget: when a request has spent its budget inside <think>, its job is cancelled, the close tokens
are emitted as forced events, and a continuation job (prompt + generated + forced) is enqueued; exllamav3's
page cache recognises the shared prefix, so only the tail is prefilled again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm53.engine.interface import EngineError, PromptProgress, TokenEvent
from glm53.engine.vision import EMBEDDINGS_KEPT
from glm53.engine.worker import END, Request, WorkerEngine, is_out_of_memory, out_of_memory_names_knobs
from glm53.exl3.events import Failed, Progress, Tokens
from glm53.planning.spec import PAGE, EngineSpec

log = logging.getLogger("glm53.engine")


@dataclass(eq=False, kw_only=True)
class _Exl3Request(Request):
    job: Any = None
    grammar_filter: Any = None  # compiled when the request arrived, for its first job (if the trigger still fits)
    grammar_filter_reasoning: bool = False
    jobs: int = 0  # jobs started for it (a reasoning-budget continuation is a second)
    tier_counts: dict | None = None  # the tiers' counts when its first job started (for its log line)


class Exl3Engine(WorkerEngine):
    """Engine (glm53.engine.interface) on exllamav3. Construct, then load() (blocking, from a worker thread)."""

    kind = "exllamav3"
    # Constrained decoding through exllamav3's own llguidance filter; decided at load (llguidance importable).
    supports_grammar = False
    no_grammar_reason = "constrained decoding needs llguidance, which this exllamav3 install lacks"

    def __init__(
        self,
        model_dir: Path,
        spec: EngineSpec,
        *,
        model_id: str = "glm-5.3-flash",
        routing_stats_dir: Path | None = None,
        admit: bool = True,
        on_tiers: Callable[[Any], None] | None = None,
    ) -> None:
        """spec: every size this engine runs with (glm53.planning.spec; the plan's, or engine_spec's for a shape of the
        caller's own). routing_stats_dir: where routing statistics are read at load (to warm the tiers) and
        saved at close. admit=False: misses are only streamed, never admitted into VRAM. on_tiers: see
        glm53.exl3.runtime.Runtime.load (a benchmark's emulated host)."""
        if spec.nvme and not spec.store:
            raise ValueError(f"{spec.engine} mode needs the expert store (GLM53_STORE)")
        super().__init__(model_dir, model_id=model_id, context_length=spec.context, max_running=spec.max_concurrency)
        self.set_kv_tokens(spec.kv_tokens, ledger=False)  # exllamav3's page table is the ledger
        self.spec = spec
        self.mode = spec.engine
        self.device = spec.device
        self.routing_stats_dir = Path(routing_stats_dir) if routing_stats_dir else None
        self.admit = admit
        self.on_tiers = on_tiers
        self.runtime: Any = None  # glm53.exl3.runtime.Runtime, once loaded
        self.tiered: Any = None
        self.load_seconds = 0.0

    # --- lifecycle ----------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.runtime is not None and self._worker_alive()

    def load(self) -> None:
        """Load the model (progress lines in the phrases launchers parse), fill the tiers, warm up, start serving."""
        if self.ready:
            return
        from glm53.exl3.contract import check_contract
        from glm53.exl3.runtime import Runtime, llguidance_filter

        t0 = time.perf_counter()
        check_contract()
        self._load_text()
        self._read_vision()
        if self.vision is not None and not self.spec.vision:
            self.vision = None
            self.no_vision_reason = ("images are off on this server (GLM53_MAX_IMAGES=0): describe the image in "
                                     "text, or restart the server without that setting")
        self.supports_grammar = llguidance_filter() is not None
        runtime = Runtime.open(self.model_dir)
        if runtime.cpu_split_set:
            raise EngineError("EXL3_MOE_CPU_SPLIT / EXL3_MOE_CPU_OFFLOAD are set: glm53 tiers the experts itself; "
                              "unset them")
        spec = self.spec
        # Out of memory here is the plan's sizes against this device: the message says which settings lower them.
        with out_of_memory_names_knobs("while loading the model"):
            runtime.load(spec, counts_for=self._saved_counts if self.routing_stats_dir is not None else None,
                         admit=self.admit, nvme_open=self._nvme_open(), on_tiers=self.on_tiers,
                         vision_kept=EMBEDDINGS_KEPT if self.vision is not None else 0)
        self.runtime, self.tiered = runtime, runtime.tiered
        if self.vision is not None and runtime.vision is None:
            self.vision = None
            self.no_vision_reason = (f"the model's vision tower failed to load on this server ({runtime.vision_error}; "
                                     "see the server log): describe the image in text")
        if self.supports_grammar:
            runtime.prepare_grammar()
        native = runtime.native_context or spec.kv_tokens
        if native < self.context_length:
            # The plan read max_position_embeddings from the same config.json, so only a hand-made spec gets here.
            log.warning("context %d lowered to the model's max_position_embeddings %d", self.context_length, native)
            self.context_length = native
        log.info("Loading weights took %.1f s", time.perf_counter() - t0)
        with out_of_memory_names_knobs("while warming up (the first prefill and decode)"):
            self._warmup()
        self._start_worker("glm53-exl3-engine")
        self.load_seconds = time.perf_counter() - t0
        log.info("exllamav3 engine (%s): ready in %.1f s (context %d)", self.mode, self.load_seconds,
                 self.context_length)

    def _nvme_open(self) -> Any:
        """The nvme modes' store opener for TieredMoE (verifies the store against this checkpoint first)."""
        if not self.spec.nvme:
            return None
        from glm53.tiers.nvme_open import open_nvme_tier

        spec, model_dir = self.spec, self.model_dir

        def open_() -> Any:
            return open_nvme_tier(spec.store, model_dir, spec, warm=False)

        return open_

    def _saved_counts(self, moe_layers: int, experts: int) -> Any:
        from glm53.planning.routing import saved_routing

        counts, reason = saved_routing(self.routing_stats_dir, self.model_dir, moe_layers, experts)
        log.info("routing statistics: %s", reason)
        return counts

    def _warmup(self) -> None:
        """Generations through both MoE paths (prefill > 8 rows, decode) before serving, first with a prompt of a
        full prefill chunk and a part of another (the KDA kernels are compiled and autotuned for the chunked path
        on first use), then every shape glm53.engine.warmup lists: the first user requests must not pay for
        compiling kernels."""
        from glm53.engine.warmup import warmup_shapes
        from glm53.exl3.contract import SMALL_QUERY_ROWS

        t0 = time.perf_counter()
        kernels = os.environ.get("TRITON_CACHE_DIR", "Triton's default cache")
        log.info("warm-up: running every prompt-tail and batch shape once, so that no request compiles a kernel "
                 "(the first start on a machine compiles them: minutes; later starts read them from %s)", kernels)
        n = min(self.spec.prefill_chunk + 24, max(24, self.spec.kv_tokens // 2))
        self._run_warm_jobs([self._warm_ids(n, 0)])
        shapes = warmup_shapes(small_rows=SMALL_QUERY_ROWS, max_batch=self.spec.max_concurrency,
                               kv_tokens=self.spec.kv_tokens, chunk=self.spec.prefill_chunk, page=PAGE,
                               sparse_topk=self.runtime.sparse_topk)
        salt, prefixes = 1, set()
        for shape in shapes:
            prefix = self._warm_ids(shape.prefix, 0)
            if shape.prefix and shape.prefix not in prefixes:  # its pages (and checkpoint) cached for the rest
                prefixes.add(shape.prefix)
                self._run_warm_jobs([prefix + self._warm_ids(1, salt)])
                salt += 1
            prompts = [prefix + self._warm_ids(shape.tail + 1, salt + b) for b in range(shape.batch)]
            salt += shape.batch
            self._run_warm_jobs(prompts)
        log.info("warm-up: %d shapes in %.1f s (kernels compile once per machine, into %s)", len(shapes) + 1,
                 time.perf_counter() - t0, kernels)

    def _warm_ids(self, n: int, salt: int) -> list[int]:
        """n token ids: the same for the same salt (a shared prefix), different across salts (so one job's prompt
        is not served from another's cached pages)."""
        v = max(1, self._n_vocab - 1)
        return [1 + (salt * 7919 + i) % v for i in range(n)]

    def _run_warm_jobs(self, prompts: list[list[int]]) -> None:
        import torch

        with torch.inference_mode():
            self.runtime.run(prompts, 2)

    def close(self) -> None:
        self._stop_worker(timeout=60)
        self._save_counts()
        if self.runtime is not None:
            self.runtime.close()
        self.runtime = self.tiered = None
        try:
            import torch

            torch.cuda.empty_cache()
        except Exception:  # best effort: a CUDA error on the way out must not mask the shutdown
            log.debug("torch.cuda.empty_cache failed on close", exc_info=True)

    def _save_counts(self) -> None:
        if self.tiered is None or self.routing_stats_dir is None or self.tiered.tiers is None:
            return
        from glm53.planning.routing import routing_key, routing_stats_path, save_routing_stats

        key = routing_key(self.model_dir)
        try:
            save_routing_stats(routing_stats_path(self.routing_stats_dir, key), self.tiered.routing_counts(), key,
                               steps=self.tiered.steps)
        except OSError as exc:
            log.warning("routing statistics not saved: %s", exc)

    # --- requests -----------------------------------------------------------------------------------------
    def _new_request(self, **fields: Any) -> _Exl3Request:
        req = _Exl3Request(**fields)
        if req.params.grammar is not None:
            # Compiled here, so a bad grammar is the caller's 400, not a failed step; the first job reuses it. (This
            # runs on the event loop: cheap, since load() built the vocabulary's matcher tables.)
            req.grammar_filter, req.grammar_filter_reasoning = self._grammar_filter(req), req.in_reasoning
        return req

    def _job_filter(self, req: _Exl3Request) -> Any:
        """The filter compiled at arrival if this is the first job and the think block is as it was then, else a
        fresh one (a continuation job after a forced </think> must not wait for another close)."""
        filt, req.grammar_filter = req.grammar_filter, None
        if filt is not None and req.grammar_filter_reasoning == req.in_reasoning:
            return filt
        return self._grammar_filter(req)

    def _grammar_filter(self, req: _Exl3Request) -> Any:
        """A fresh llguidance filter for the request's next job. Inside an open think block it waits for the
        block's close token: the grammar constrains the answer, never the reasoning (as in the reference engine).
        Completing the grammar ends the job (finish_reason "stop")."""
        trigger = req.reasoning_end if req.in_reasoning else None
        try:
            return self.runtime.grammar_filter(req.params.grammar, trigger)
        except ValueError as exc:
            raise ValueError(f"invalid grammar: {exc}") from None

    def fault(self) -> dict | None:
        tiered = self.tiered
        nvme = getattr(tiered, "nvme", None) if tiered is not None else None
        return nvme.health() if nvme is not None else None

    def _kv_stats(self) -> dict:
        """The worker's counts and exllamav3's page table (glm53.exl3.runtime.Runtime.kv_stats)."""
        doc = super()._kv_stats()
        if self.runtime is not None:
            doc.update(self.runtime.kv_stats())
        return doc

    def _stats_extra(self) -> dict:
        tower = self.runtime.vision if self.runtime is not None else None
        return {"vision": {"available": self.vision is not None, **(tower.stats() if tower is not None else {})}}

    def stats(self) -> dict:
        doc = {"kind": self.kind, "mode": self.mode, **super().stats()}  # "mode" second, as it always was
        tiered = self.tiered
        doc["tiers"] = tiered.snapshot() if tiered is not None else {}
        return doc

    # --- worker -------------------------------------------------------------------------------------------
    def _worker(self) -> None:
        import torch

        with torch.inference_mode():
            while (batch := self._admit()) is not None:
                try:
                    for req in batch.new:
                        try:
                            self._start(req)
                        except Exception as exc:  # its job could not be made or enqueued: this request alone fails
                            log.exception("exllamav3 engine: request %s could not start", req.request_id)
                            self._fail(req, exc, "while starting this request")
                    for req in batch.running:
                        if req.cancelled and not req.done:
                            self._stop_job(req)
                            self._retire(req, "requests_cancelled", END)
                    if self.runtime.busy():
                        for ev in self.runtime.step():
                            self._on_event(ev)
                    self._mark_kv_waiting()
                except Exception as exc:  # a failed step fails its requests loudly; the server stays up
                    log.exception("exllamav3 engine: generation step failed")
                    self._fail_all(exc)
            self._drop_jobs()

    def _start(self, req: _Exl3Request) -> None:
        """Enqueue the request's (next) job: the prompt plus everything emitted so far."""
        if req.budget_spent:
            self._force_close(req)
            if req.done:
                return
        left = req.max_new - len(req.generated)
        p = req.params
        seed = None if p.seed is None else (p.seed + len(req.generated)) & 0x7FFF_FFFF
        ids, embeddings = req.prompt + req.generated, []
        if req.images:  # each image's tokens become its embedding's ids (the same image: the same ids, its pages)
            ids, embeddings = self.runtime.vision.prompt(ids, req.images)
        req.job = self.runtime.start(
            req, ids, max_new=left, embeddings=embeddings, min_new=max(0, p.min_tokens - len(req.generated)),
            temperature=p.temperature, min_p=p.min_p, top_k=p.top_k, top_p=p.top_p, seed=seed,
            stop=sorted(req.stop_ids), logits=p.logprobs is not None,
            grammar=self._job_filter(req) if p.grammar is not None else None)
        req.jobs += 1
        if not req.generated:
            self._count_prompt(len(req.prompt))
        if req.tier_counts is None and self.tiered is not None:
            req.tier_counts = self.tiered.tier_counts()

    def _reset_for_resume(self, req: _Exl3Request) -> None:
        """A request yielding its slot: its job stops; the next one (prompt + generated) finds the pages it filled
        still hashed in the cache, so only the tail since the last recurrent checkpoint is prefilled again."""
        self._stop_job(req)

    def _stop_job(self, req: _Exl3Request) -> None:
        if req.job is not None:
            self.runtime.cancel(req.job)
            req.job = None

    def _force_close(self, req: _Exl3Request) -> None:
        """Emit the think-close tokens as forced events (the job producing reasoning must be stopped first)."""
        req.in_reasoning = False
        for t in req.params.reasoning_end_ids:
            if req.done:
                return
            self._emit_token(req, t, None, forced=True)

    def _on_event(self, ev: Progress | Tokens | Failed) -> None:
        req = ev.owner
        if not isinstance(req, _Exl3Request) or req.done or ev.job is not req.job:
            return  # a cancelled job's late result
        if isinstance(ev, Failed):
            log.error("exllamav3 engine: request %s failed: %r", req.request_id, ev.error)
            req.job = None
            error = ev.error
            self._fail(req, error if isinstance(error, BaseException) else EngineError(str(error)),
                       "while running this request")
        elif isinstance(ev, Progress):
            # A continuation job's prefill comes after the request's first tokens: progress is for the prompt only.
            if not req.generated and ev.total > self.spec.prefill_chunk:
                req.emit(PromptProgress(ev.done, ev.total))
        else:
            self._on_tokens(req, ev)

    def _on_tokens(self, req: _Exl3Request, ev: Tokens) -> None:
        # The page cache's reuse of the client's prompt (a job's cached pages, carried across its requeues), reported
        # on the request's last token. A continuation job reuses the request's own pages, which is no prefix-cache
        # hit for the client.
        cached = None
        if ev.ended:
            cached = ev.cached_tokens if req.jobs == 1 else req.cached_tokens
            self._log_job(req, ev, cached)
        if cached is not None:
            self._note_cached(req, cached)
        ids, logits = ev.reply()
        for i, t in enumerate(ids):
            if req.done:
                return
            row = logits[i, : self._n_vocab] if logits is not None and i < logits.shape[0] else None
            last = i == len(ids) - 1
            # A job that ends without a stop token ends on its last token: its grammar completed ("stop", like the
            # reference engine) or its max_new_tokens (capped by exllamav3 to the cache) ran out ("length").
            self._emit_token(req, t, row, end=ev.finish if last else None, cached=cached if last else None)
            if req.budget_spent and not req.done:
                # Budget reached mid-stream: stop this job, close the block, continue in a new job. The first
                # job's reuse of the prompt is read now: no end-of-job result will carry it.
                if req.jobs == 1:
                    self._note_cached(req, self.runtime.cached_tokens(req.job))
                self._stop_job(req)
                self._force_close(req)
                if not req.done:
                    self._start(req)
                return
        if ev.ended and not req.done:
            # The job ended with no token to end the request on (not expected from exllamav3): end it here.
            self._finish(req, ev.finish or "length")

    def _log_job(self, req: _Exl3Request, ev: Tokens, cached: int | None) -> None:
        """One line per finished job: where its time went (exllamav3's queue, prefill and generate times) and, in
        the tiered modes, where its picks were read from since the request started (slow agent turns are read
        from these lines)."""
        times = ev.times
        prompt, prefill_s = times.prompt_tokens, times.prefill_s
        new = prompt - int(cached or 0)
        line = (f"request {req.request_id} job {req.jobs}: prompt {prompt} tokens, {cached or 0} cached, {new} "
                f"prefilled in {prefill_s:.2f} s ({new / prefill_s if prefill_s > 0 else 0:.0f} tok/s), queued "
                f"{times.enqueued_s:.2f} s; {times.new_tokens or 0} tokens in {times.generate_s:.2f} s")
        if self.tiered is not None and req.tier_counts is not None:
            from glm53.tiers.stats import counts_delta, describe_counts

            line += "; " + describe_counts(counts_delta(req.tier_counts, self.tiered.tier_counts()))
        log.info(line)

    def _emit_token(self, req: _Exl3Request, token: int, row: Any, forced: bool = False, end: str | None = None,
                    cached: int | None = None) -> None:
        """end: the finish reason when this token ends the job (the request ends with it, on this event)."""
        # Forced tokens come with row=None: no logits for them, so no logprobs either.
        event = self._token_event(req, token, row, forced, grammar_done=end == "stop")
        if cached is not None:
            event.cached_tokens = req.cached_tokens
        if end is not None and event.finish_reason is None:
            event.finish_reason = end
            event.text += req.detok.flush()
        if event.finish_reason is not None:
            self._stop_job(req)
            self._retire(req, "requests_finished", event)
        else:
            req.emit(event)

    def _finish(self, req: _Exl3Request, reason: str) -> None:
        event = TokenEvent(token_id=req.generated[-1] if req.generated else 0, text=req.detok.flush(), token_text="",
                           finish_reason=reason)
        self._stop_job(req)
        self._retire(req, "requests_finished", event)

    def _release(self, req: _Exl3Request) -> None:
        req.job = None  # its generator job is cancelled by the caller where needed (_stop_job), not on failure

    def _mark_kv_waiting(self) -> None:
        """Running requests whose job exllamav3 holds back (no free pages for its next segment) are waiting."""
        pending = self.runtime.waiting()
        with self._cv:
            for req in self._running:
                req.kv_waiting = req.job is not None and id(req.job) in pending

    def _fail_all(self, exc: Exception) -> None:
        """A step that raised fails the requests it ran (exllamav3 cannot say which one it was)."""
        with self._cv:
            running = list(self._running)
        for req in running:
            if not req.done:
                self._fail(req, exc, "in a generation step")
        if is_out_of_memory(exc):
            import torch

            torch.cuda.empty_cache()
        try:
            self.runtime.clear()
            self.runtime.forget_pages()
        except Exception:  # the generator may be wedged by the failure; the next request will tell
            log.exception("exllamav3 engine: clearing the queue after a failure failed")

    def _drop_jobs(self) -> None:
        try:
            self.runtime.clear()
        except Exception:
            log.debug("clear_queue on shutdown failed", exc_info=True)
