"""The GPU engine: exllamav3's Generator and jobs, with the routed experts tiered by glm53 (every mode).

Modes: "exact" keeps `slots_per_layer` routed experts per MoE layer in VRAM and the rest in the pinned RAM tier;
every miss crosses PCIe and is computed by exllamav3's own kernels (glm53.engine.exl3_adapter), so logits are
bit-identical to stock exllamav3 with all experts in VRAM. "fast" adds the CPU lane (calibrated at load) for
RAM-resident misses; "nvme-exact" and "nvme" do the same with the RAM tier as a cache of the record store
(GLM53_STORE, verified against the checkpoint at load). "stock" is plain exllamav3 (all experts in VRAM): what
the plan picks when everything fits, and the baseline the tests and `glm53 bench decode` compare against.

Threads: one worker thread owns the model, the cache and the generator; the request queue, the hand-off to asyncio
and the token events are glm53.engine.worker's, shared with the CPU reference engine. The worker runs
`Generator.iterate()` while any job is live: exllamav3 batches the running jobs' decode steps and chunks prompts
itself. Text is detokenized here (the HF tokenizer, as in the reference engine), so both engines emit the same
TokenEvents; exllamav3's own text stream is ignored.

KV cache: every job whose reply may exceed a page is given `max_rq_tokens`, so exllamav3 commits its pages a segment at a time (up to the next
recurrent-checkpoint boundary, 2048 tokens for GLM-5) instead of prompt + max_new_tokens up front, and requeues the
job at each boundary (its pages stay hashed in the cache, its recurrent state stashed there, so it resumes without
prefilling again); a job that cannot get its pages waits in the generator's pending queue, and is counted as
waiting. A reply is capped to what the cache holds (exllamav3 caps max_new_tokens the same way), so a request
that outgrows the cache ends with "length". The prefix reuse it reports (a job's cached pages) is the request's
usage.prompt_tokens_details.cached_tokens and the stats' prefix counters; the page table's and the recurrent
cache's eviction counters are in stats()["kv_cache"].

Reasoning budget: when a request has spent its budget inside <think>, its job is cancelled, the close tokens
are emitted as forced events, and a continuation job (prompt + generated + forced) is enqueued; exllamav3's
page cache recognises the shared prefix, so only the tail is prefilled again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm53.engine.interface import EngineError, PromptProgress, SamplingParams, TokenEvent
from glm53.engine.worker import END, Request, WorkerEngine, is_out_of_memory, out_of_memory_names_knobs
from glm53.settings import concurrency_of
from glm53.spec import PAGE, EngineSpec, engine_spec

log = logging.getLogger("glm53.engine")


EXL3_DEMO_DIR = "demo-model-exl3"
EXL3_DEMO_MARKER = ".glm53-demo-exl3.json"
# Bump when the fixture writer's output changes, so cached demo checkpoints are rebuilt.
EXL3_DEMO_RECIPE = {"recipe": 2, "seed": 0, "router_skew": [0.25, 0.5], "kind": "tiny-exl3"}


@dataclass(eq=False, kw_only=True)
class _Request(Request):
    job: Any = None
    grammar_filter: Any = None  # compiled when the request arrived, for its first job (if the trigger still fits)
    grammar_filter_reasoning: bool = False
    jobs: int = 0  # jobs started for it (a reasoning-budget continuation is a second)
    tier_counts: dict | None = None  # the tiers' counts when its first job started (for its log line)


def ensure_exl3_demo_model(cache_dir: Path) -> Path:
    """The tiny synthetic EXL3 demo checkpoint under `cache_dir` (generated once, atomically, like demo.py's)."""
    from glm53.fixture.exl3 import write_exl3_checkpoint

    cache_dir = Path(cache_dir)
    final = cache_dir / EXL3_DEMO_DIR

    def complete(path: Path) -> bool:
        try:
            return json.loads((path / EXL3_DEMO_MARKER).read_text()) == EXL3_DEMO_RECIPE
        except (OSError, ValueError):
            return False

    if complete(final):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("demo: generating the synthetic EXL3 demo model into %s (once)", final)
    work = Path(tempfile.mkdtemp(prefix=f".{EXL3_DEMO_DIR}-", dir=cache_dir))
    work.chmod(0o755)
    try:
        write_exl3_checkpoint(work, seed=EXL3_DEMO_RECIPE["seed"], router_skew=tuple(EXL3_DEMO_RECIPE["router_skew"]))
        (work / EXL3_DEMO_MARKER).write_text(json.dumps(EXL3_DEMO_RECIPE))
        if final.exists():
            if complete(final):  # another process finished first
                shutil.rmtree(work, ignore_errors=True)
                return final
            shutil.rmtree(final)
        os.replace(work, final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return final


def gpu_engine_available() -> bool:
    """exllamav3 importable (not imported here: that JIT-loads CUDA code) and a CUDA device present."""
    import importlib.util

    if importlib.util.find_spec("exllamav3") is None:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()




def _llguidance_filter() -> Any:
    """exllamav3's LLGuidanceFilter class, or None without llguidance (the engine then refuses grammars)."""
    try:
        from exllamav3.generator.filter import LLGuidanceFilter
        from exllamav3.generator.filter.llguidance import llguidance_available
    except ImportError:
        return None
    return LLGuidanceFilter if llguidance_available else None


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
    ) -> None:
        """spec: every size this engine runs with (glm53.spec; the plan's, or engine_spec's for a shape of the
        caller's own). routing_stats_dir: where routing statistics are read at load (to warm the tiers) and
        saved at close. admit=False: misses are only streamed, never admitted into VRAM."""
        if spec.nvme and not spec.store:
            raise ValueError(f"{spec.engine} mode needs the expert store (GLM53_STORE)")
        super().__init__(model_dir, model_id=model_id, context_length=spec.context, max_running=spec.max_concurrency)
        self.set_kv_tokens(spec.kv_tokens, ledger=False)  # exllamav3's page table is the ledger
        self.spec = spec
        self.mode = spec.engine
        self.device = spec.device
        self.routing_stats_dir = Path(routing_stats_dir) if routing_stats_dir else None
        self.admit = admit
        self.model: Any = None
        self.cache: Any = None
        self.generator: Any = None
        self.tiered: Any = None
        self._exl: Any = None
        self.load_seconds = 0.0

    # --- lifecycle ----------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.generator is not None and self._worker_alive()

    def load(self) -> None:
        """Load the model (progress lines in the phrases launchers parse), fill the tiers, warm up, start serving."""
        if self.ready:
            return
        from glm53.engine import exl3_adapter as A

        t0 = time.perf_counter()
        A.check_contract()
        import exllamav3 as exl

        self._exl = exl
        self._load_text()
        self.supports_grammar = _llguidance_filter() is not None
        config = exl.Config.from_directory(str(self.model_dir))
        if config.infer_params.moe_cpu_split or config.infer_params.moe_cpu_offload:
            raise EngineError("EXL3_MOE_CPU_SPLIT / EXL3_MOE_CPU_OFFLOAD are set: glm53 tiers the experts itself; "
                              "unset them")
        spec = self.spec
        tokenizer = exl.Tokenizer.from_config(config)
        # Out of memory here is the plan's sizes against this device: the message says which settings lower them.
        with out_of_memory_names_knobs("while loading the model"):
            self._load_model(exl, config)
            self.generator = exl.Generator(model=self.model, cache=self.cache, tokenizer=tokenizer,
                                           max_batch_size=spec.max_concurrency, max_chunk_size=spec.prefill_chunk,
                                           recurrent_cache_size=spec.recurrent_cache_bytes)
        if self.supports_grammar:
            # llguidance's tables for this vocabulary (about a second for 150k tokens), built now rather than on the
            # event loop when the first response_format request arrives; exllamav3 caches them per tokenizer.
            from exllamav3.generator.filter.llguidance import create_ll_tokenizer

            create_ll_tokenizer(tokenizer)
        native = int(getattr(config, "max_position_embeddings", 0) or 0) or spec.kv_tokens
        if native < self.context_length:
            # The plan read max_position_embeddings from the same config.json, so only a hand-made spec gets here.
            log.warning("context %d lowered to the model's max_position_embeddings %d", self.context_length, native)
            self.context_length = native
        log.info("Loading weights took %.1f s", time.perf_counter() - t0)
        with out_of_memory_names_knobs("while warming up (the first prefill and decode)"):
            self._warmup(config)
        self._start_worker("glm53-exl3-engine")
        self.load_seconds = time.perf_counter() - t0
        log.info("exllamav3 engine (%s): ready in %.1f s (context %d)", self.mode, self.load_seconds,
                 self.context_length)

    def _load_model(self, exl: Any, config: Any) -> None:
        """The model, its cache and the tiers, on the device (self.model, self.cache, self.tiered)."""
        import torch

        from glm53.engine import exl3_adapter as A

        model = exl.Model.from_config(config)
        spec = self.spec
        # One page more than the context: exllamav3 reserves a position past a job's last token (a job needs
        # prompt + max_new_tokens + 1 positions), so without it the last token of the context is cut ("length" a
        # token early) and a prompt of context_length - 1 tokens cannot be enqueued at all.
        cache = exl.Cache(model, max_num_tokens=spec.kv_tokens + PAGE, max_batch_size=spec.cache_sequences)
        tiered = None
        if spec.tiered:
            counts = self._saved_counts(model)
            tiered = A.TieredMoE(model, self.model_dir, spec, counts=counts, admit=self.admit,
                                 nvme_open=self._nvme_open())
            tiered.install()
            log.info("%s mode: VRAM slots per MoE layer %s (%s), %d staging per layer (%d rows of their own, the "
                     "rest borrowed from %d cache slots), %d experts in the pinned RAM tier (%.1f GiB)%s", self.mode,
                     list(spec.vram_slots), spec.split, tiered.staging_slots, tiered.tiers.staging_rows,
                     len(tiered.tiers.lent), tiered.tiers.ram.num_slots, tiered.tiers.ram.num_slots * tiered.layout.nbytes / 2**30,
                     f", the rest read from {spec.store}" if tiered.nvme is not None else "")

        def shards(done: int, total: int) -> None:
            log.info("Loading safetensors checkpoint shards: %d%% Completed | %d/%d", 100 * done // total, done, total)

        undo = A.wrap_load_progress(model, shards)
        unplace = A.place_layers(model, spec)  # a split across GPUs: each layer onto its card (spec.devices)
        for d in spec.devices:
            log.info("layer split: decoder layers %d-%d on %s (%s), %d expert slots, budget %.1f GiB", d.first_layer,
                     d.last_layer, d.device, d.name, d.vram_slots, d.vram_budget_bytes / 2**30)
        try:
            with torch.inference_mode():
                model.load(device=torch.device(self.device))
            if tiered is not None:
                self._fill_tiers(tiered)
        except BaseException:
            # A failed load must not leave the lane's threads, the store reader or the pinned arena behind.
            model.unload()
            if tiered is not None:
                tiered.close()
            raise
        finally:
            undo()
            unplace()
        self.model, self.cache, self.tiered = model, cache, tiered

    def _fill_tiers(self, tiered: Any) -> None:
        t1 = time.perf_counter()

        def experts(done: int, total: int) -> None:
            log.info("Loading routed experts into the tiers: %d%% Completed | %d/%d", 100 * done // total, done, total)

        tiered.populate(experts)
        log.info("routed experts placed in %.1f s", time.perf_counter() - t1)
        if self.spec.lane:
            tiered.start_lane(self.spec.cpu_threads)

    def _nvme_open(self) -> Any:
        """The nvme modes' store opener for TieredMoE (verifies the store against this checkpoint first)."""
        if not self.spec.nvme:
            return None
        from glm53.tiers.nvme_open import open_nvme_tier

        spec, model_dir = self.spec, self.model_dir

        def open_() -> Any:
            return open_nvme_tier(spec.store, model_dir, spec, warm=False)

        return open_

    def _saved_counts(self, model: Any) -> Any:
        if self.routing_stats_dir is None:
            return None
        from glm53.engine.exl3_adapter import moe_modules
        from glm53.tiers.routing_stats import saved_routing

        mods = moe_modules(model)
        if not mods:
            return None
        counts, reason = saved_routing(self.routing_stats_dir, self.model_dir, len(mods), mods[0].num_experts)
        log.info("routing statistics: %s", reason)
        return counts

    def _warmup(self, config: Any) -> None:
        """Generations through both MoE paths (prefill > 8 rows, decode) before serving, first with a prompt of a
        full prefill chunk and a part of another (the KDA kernels are compiled and autotuned for the chunked path
        on first use), then every shape glm53.engine.warmup lists: the first user requests must not pay for
        compiling kernels."""
        from glm53.engine import exl3_adapter as A
        from glm53.engine.warmup import warmup_shapes

        t0 = time.perf_counter()
        kernels = os.environ.get("TRITON_CACHE_DIR", "Triton's default cache")
        log.info("warm-up: running every prompt-tail and batch shape once, so that no request compiles a kernel "
                 "(the first start on a machine compiles them: minutes; later starts read them from %s)", kernels)
        n = min(self.spec.prefill_chunk + 24, max(24, self.spec.kv_tokens // 2))
        self._run_warm_jobs([self._warm_ids(n, 0)])
        shapes = warmup_shapes(small_rows=A.SMALL_QUERY_ROWS, max_batch=self.spec.max_concurrency,
                               kv_tokens=self.spec.kv_tokens, chunk=self.spec.prefill_chunk, page=PAGE,
                               sparse_topk=getattr(config, "index_topk", None))
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

        exl = self._exl
        jobs = [exl.Job(input_ids=torch.tensor([ids], dtype=torch.long), max_new_tokens=2,
                        sampler=exl.ArgmaxSampler(), stop_conditions=[]) for ids in prompts]
        with torch.inference_mode():
            self.generator.enqueue(jobs)
            while self.generator.num_remaining_jobs():
                self.generator.iterate()

    def close(self) -> None:
        self._stop_worker(timeout=60)
        self._save_counts()
        if self.model is not None:
            self.model.unload()
        if self.tiered is not None:
            self.tiered.close()
        self.generator = self.cache = self.model = self.tiered = None
        try:
            import torch

            torch.cuda.empty_cache()
        except Exception:  # best effort: a CUDA error on the way out must not mask the shutdown
            log.debug("torch.cuda.empty_cache failed on close", exc_info=True)

    def _save_counts(self) -> None:
        if self.tiered is None or self.routing_stats_dir is None or self.tiered.tiers is None:
            return
        from glm53.tiers import routing_stats_path, save_routing_stats
        from glm53.tiers.routing_stats import routing_key

        key = routing_key(self.model_dir)
        try:
            save_routing_stats(routing_stats_path(self.routing_stats_dir, key), self.tiered.routing_counts(), key,
                               steps=self.tiered.steps)
        except OSError as exc:
            log.warning("routing statistics not saved: %s", exc)

    # --- requests -----------------------------------------------------------------------------------------
    def _new_request(self, **fields: Any) -> _Request:
        req = _Request(**fields)
        if req.params.grammar is not None:
            # Compiled here, so a bad grammar is the caller's 400, not a failed step; the first job reuses it. (This
            # runs on the event loop: cheap, since load() built the vocabulary's matcher tables.)
            req.grammar_filter, req.grammar_filter_reasoning = self._grammar_filter(req), req.in_reasoning
        return req

    def _job_filter(self, req: _Request) -> Any:
        """The filter compiled at arrival if this is the first job and the think block is as it was then, else a
        fresh one (a continuation job after a forced </think> must not wait for another close)."""
        filt, req.grammar_filter = req.grammar_filter, None
        if filt is not None and req.grammar_filter_reasoning == req.in_reasoning:
            return filt
        return self._grammar_filter(req)

    def _grammar_filter(self, req: _Request) -> Any:
        """A fresh llguidance filter for the request's next job. Inside an open think block it waits for the
        block's close token: the grammar constrains the answer, never the reasoning (as in the reference engine).
        Completing the grammar ends the job (finish_reason "stop")."""
        make = _llguidance_filter()
        trigger = req.reasoning_end if req.in_reasoning else None
        try:
            return make(self.generator.tokenizer, trigger_token=trigger, lark_grammar=req.params.grammar,
                        eos_after_completed=True)
        except ValueError as exc:
            raise ValueError(f"invalid grammar: {exc}") from None

    def fault(self) -> dict | None:
        tiered = self.tiered
        nvme = getattr(tiered, "nvme", None) if tiered is not None else None
        return nvme.health() if nvme is not None else None

    def _kv_stats(self) -> dict:
        """exllamav3's page table: pages in use by jobs, cached pages lost to eviction, pages served from the prompt
        cache; recurrent checkpoints dropped from the RAM cache (generator/pagetable.py, cache/recurrent.py)."""
        doc = super()._kv_stats()
        gen = self.generator
        pages = getattr(gen, "pagetable", None)
        if pages is not None:
            m = pages.metrics
            doc.update(pages=pages.max_pages, pages_used=pages.max_pages - pages.num_unreferenced_pages(),
                       pages_evicted=m["evictions_live"], pages_reused=m["alloc_cached_pages"])
        recurrent = getattr(gen, "recurrent_cache", None)
        if recurrent is not None:
            doc["recurrent_checkpoints_evicted"] = recurrent.metrics["stash_evictions"]
        return doc

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
                    if self.generator.num_remaining_jobs():
                        for r in self.generator.iterate():
                            self._on_result(r)
                    self._mark_kv_waiting()
                except Exception as exc:  # a failed step fails its requests loudly; the server stays up
                    log.exception("exllamav3 engine: generation step failed")
                    self._fail_all(exc)
            self._drop_jobs()

    def _sampler(self, p: SamplingParams) -> Any:
        exl = self._exl
        if p.temperature == 0:
            return exl.ArgmaxSampler()
        return exl.ComboSampler(temperature=p.temperature, min_p=p.min_p, top_k=p.top_k, top_p=p.top_p)

    def _start(self, req: _Request) -> None:
        """Enqueue the request's (next) job: the prompt plus everything emitted so far."""
        import torch

        if req.budget_spent:
            self._force_close(req)
            if req.done:
                return
        ids = req.prompt + req.generated
        left = req.max_new - len(req.generated)
        p = req.params
        seed = None if p.seed is None else (p.seed + len(req.generated)) & 0x7FFF_FFFF
        req.job = self._exl.Job(
            input_ids=torch.tensor([ids], dtype=torch.long),
            max_new_tokens=left,
            sampler=self._sampler(p),
            seed=seed,
            stop_conditions=sorted(req.stop_ids),
            identifier=req,
            # Pages are committed a segment at a time (exllamav3 aligns this to its recurrent-checkpoint interval)
            # and the job requeued at each boundary, so a reply without max_tokens does not reserve the cache. A
            # reply of a page or less reserves just itself (a segment would reserve up to the boundary).
            max_rq_tokens=PAGE if left > PAGE else None,
            return_logits=p.logprobs is not None,
            decode_special_tokens=True,
            filters=[self._job_filter(req)] if p.grammar is not None else None,
        )
        self.generator.enqueue(req.job)
        req.jobs += 1
        if not req.generated:
            self._count_prompt(len(req.prompt))
        if req.tier_counts is None and self.tiered is not None:
            req.tier_counts = self.tiered.tier_counts()

    def _stop_job(self, req: _Request) -> None:
        if req.job is not None:
            self.generator.cancel(req.job)
            req.job = None

    def _force_close(self, req: _Request) -> None:
        """Emit the think-close tokens as forced events (the job producing reasoning must be stopped first)."""
        req.in_reasoning = False
        for t in req.params.reasoning_end_ids:
            if req.done:
                return
            self._emit_token(req, t, None, forced=True)

    def _on_result(self, r: dict) -> None:
        if r.get("stage") == "error":
            # exllamav3 contained a failure of this job alone (reap_failed_job: its prefill or page allocation
            # raised) and dropped it; the result carries no "identifier", only the job.
            req = getattr(r.get("job"), "identifier", None)
            if isinstance(req, _Request) and not req.done and r.get("job") is req.job:
                log.error("exllamav3 engine: request %s failed: %r", req.request_id, r.get("error"))
                req.job = None
                error = r.get("error")
                self._fail(req, error if isinstance(error, BaseException) else EngineError(str(error)),
                           "while running this request")
            return
        req = r.get("identifier")
        if not isinstance(req, _Request) or req.done or r.get("job") is not req.job:
            return  # a cancelled job's late result
        if r.get("stage") == "prefill":
            # A continuation job's prefill comes after the request's first tokens: progress is for the prompt only.
            if not req.generated and r.get("max_progress", 0) > self.spec.prefill_chunk:
                req.emit(PromptProgress(int(r["curr_progress"]), int(r["max_progress"])))
            return
        if r.get("stage") != "streaming":
            return
        tokens, logits = r.get("token_ids"), r.get("logits")
        stop_token = r.get("eos_triggering_token_id") if r.get("eos_reason") == "stop_token" else None
        if stop_token is not None:
            held = r.get("held", {})
            tokens, logits = held.get("token_ids", tokens), held.get("logits", logits)
        ids = tokens[0].tolist() if tokens is not None else []
        # A job that ends without a stop token ends on its last token: its grammar completed ("stop", like the
        # reference engine) or its max_new_tokens (capped by exllamav3 to the cache) ran out ("length").
        end = None
        if r.get("eos") and stop_token is None:
            end = "stop" if r.get("eos_reason") == "end_filter" else "length"
        # The page cache's reuse of the client's prompt (a job's cached pages, carried across its requeues), reported
        # on the request's last token. A continuation job reuses the request's own pages, which is no prefix-cache
        # hit for the client.
        cached = None
        if r.get("eos"):
            cached = r.get("cached_tokens") if req.jobs == 1 else req.cached_tokens
            self._log_job(req, r, cached)
        if cached is not None:
            self._note_cached(req, cached)
        for i, t in enumerate(ids):
            if req.done:
                return
            row = logits[0, i, : self._n_vocab] if logits is not None and i < logits.shape[1] else None
            last = i == len(ids) - 1
            self._emit_token(req, t, row, end=end if last else None, cached=cached if last else None)
            if req.budget_spent and not req.done:
                # Budget reached mid-stream: stop this job, close the block, continue in a new job. The first
                # job's reuse of the prompt is read now: no end-of-job result will carry it.
                if req.jobs == 1:
                    self._note_cached(req, _job_cached_tokens(req.job))
                self._stop_job(req)
                self._force_close(req)
                if not req.done:
                    self._start(req)
                return
        if r.get("eos") and not req.done:
            # The job ended with no token to end the request on (not expected from exllamav3): end it here.
            self._finish(req, end or "length")

    def _log_job(self, req: _Request, r: dict, cached: int | None) -> None:
        """One line per finished job: where its time went (exllamav3's queue, prefill and generate times) and, in
        the tiered modes, where its picks were read from since the request started (slow agent turns are read
        from these lines)."""
        prompt = int(r.get("prompt_tokens") or 0)
        prefill_s = float(r.get("time_prefill") or 0.0)
        new = prompt - int(cached or 0)
        line = (f"request {req.request_id} job {req.jobs}: prompt {prompt} tokens, {cached or 0} cached, {new} "
                f"prefilled in {prefill_s:.2f} s ({new / prefill_s if prefill_s > 0 else 0:.0f} tok/s), queued "
                f"{float(r.get('time_enqueued') or 0.0):.2f} s; {int(r.get('new_tokens') or 0)} tokens in "
                f"{float(r.get('time_generate') or 0.0):.2f} s")
        if self.tiered is not None and req.tier_counts is not None:
            from glm53.tiers.stats import counts_delta, describe_counts

            line += "; " + describe_counts(counts_delta(req.tier_counts, self.tiered.tier_counts()))
        log.info(line)

    def _emit_token(self, req: _Request, token: int, row: Any, forced: bool = False, end: str | None = None,
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

    def _finish(self, req: _Request, reason: str) -> None:
        event = TokenEvent(token_id=req.generated[-1] if req.generated else 0, text=req.detok.flush(), token_text="",
                           finish_reason=reason)
        self._stop_job(req)
        self._retire(req, "requests_finished", event)

    def _release(self, req: _Request) -> None:
        req.job = None  # its generator job is cancelled by the caller where needed (_stop_job), not on failure

    def _mark_kv_waiting(self) -> None:
        """Running requests whose job exllamav3 holds back (no free pages for its next segment) are waiting."""
        pending = set(map(id, self.generator.pending_jobs))
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
            self.generator.clear_queue()
        except Exception:  # the generator may be wedged by the failure; the next request will tell
            log.exception("exllamav3 engine: clearing the queue after a failure failed")

    def _drop_jobs(self) -> None:
        try:
            self.generator.clear_queue()
        except Exception:
            log.debug("clear_queue on shutdown failed", exc_info=True)


def engine_for_plan(model_dir: Path, settings: Any, plan: Any) -> Exl3Engine:
    """The engine `glm53 serve` runs for an EXL3 checkpoint on this host's plan: exactly the plan's EngineSpec."""
    if plan.engine is None:
        raise ValueError(f"a {plan.mode} plan has no engine spec")
    return Exl3Engine(model_dir, plan.engine, model_id=settings.model_id,
                      routing_stats_dir=Path(settings.cache_dir).expanduser())


def demo_spec(model_dir: Path, settings: Any, device: str = "cuda:0") -> EngineSpec:
    """The no-model demo on a GPU: the tiny EXL3 fixture in exact mode with a quarter of its experts in VRAM, so
    the demo exercises the tiers and the PCIe lane like the real model does."""
    from glm53.plan import DEMO_CONTEXT
    from glm53.shape import from_checkpoint

    shape = from_checkpoint(model_dir)
    return engine_spec("exact", moe_layers=shape.moe_layers, experts_per_layer=shape.experts_per_layer,
                       top_k=shape.top_k, vram_slots=max(1, shape.experts_per_layer // 4),
                       kv_tokens=min(settings.context, DEMO_CONTEXT["gpu"]),
                       context=min(settings.context, shape.max_context or settings.context),
                       max_concurrency=concurrency_of(settings)[0], device=device, split="a quarter of each layer")


def demo_engine(cache_dir: Path, settings: Any) -> tuple[Exl3Engine, Path]:
    model_dir = ensure_exl3_demo_model(Path(cache_dir).expanduser())
    return Exl3Engine(model_dir, demo_spec(model_dir, settings), model_id=settings.model_id), model_dir


def _job_cached_tokens(job: Any) -> int:
    """Prompt tokens a running exllamav3 job took from the page cache (what its end-of-job result would report:
    carried across requeues in rq_cached)."""
    carried = getattr(job, "rq_cached", None)
    if carried is not None:
        return int(carried[1])
    return int(job.cached_pages) * PAGE + int(job.cached_tokens)
