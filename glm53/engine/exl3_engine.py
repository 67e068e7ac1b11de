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

Reasoning budget: when a request has spent its budget inside <think>, its job is cancelled, the close tokens
are emitted as forced events, and a continuation job (prompt + generated + forced) is enqueued; exllamav3's
page cache recognises the shared prefix, so only the tail is prefilled again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glm53.engine.interface import EngineError, PromptProgress, SamplingParams, TokenEvent
from glm53.engine.worker import END, Request, WorkerEngine

log = logging.getLogger("glm53.engine")

PAGE = 256  # exllamav3's KV page: cache sizes are whole pages

EXL3_DEMO_DIR = "demo-model-exl3"
EXL3_DEMO_MARKER = ".glm53-demo-exl3.json"
# Bump when the fixture writer's output changes, so cached demo checkpoints are rebuilt.
EXL3_DEMO_RECIPE = {"recipe": 1, "seed": 0, "router_skew": [0.25, 0.5], "kind": "tiny-exl3"}


@dataclass(eq=False, kw_only=True)
class _Request(Request):
    job: Any = None
    grammar_filter: Any = None  # compiled when the request arrived, for its first job (if the trigger still fits)
    grammar_filter_reasoning: bool = False


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


def model_key(model_dir: Path) -> str:
    """Identity of a checkpoint for saved routing statistics: directory name + config.json hash."""
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()[:16]
    return f"{Path(model_dir).name}-{digest}"


TIERED_MODES = ("exact", "fast", "nvme", "nvme-exact")


def _llguidance_filter() -> Any:
    """exllamav3's LLGuidanceFilter class, or None without llguidance (the engine then refuses grammars)."""
    try:
        from exllamav3.generator.filter import LLGuidanceFilter
        from exllamav3.generator.filter.llguidance import llguidance_available
    except ImportError:
        return None
    return LLGuidanceFilter if llguidance_available else None


def layer_slots(slots: int | list[int], counts: Any, top_k: int) -> int | list[int]:
    """VRAM slots per MoE layer: the plan's uniform count, or, with routing statistics saved by an earlier run,
    the same total split where each slot buys the most hit rate (skewed layers get more, flat ones fewer; every
    layer keeps at least top_k, or its uniform share if that is smaller). An explicit per-layer list is kept."""
    if counts is None or not isinstance(slots, int | np.integer):
        return slots
    from glm53.tiers.policy import split_budget

    counts = np.asarray(counts, np.float64)
    num_layers, num_experts = counts.shape
    per_layer = split_budget(counts, int(slots) * num_layers, min_per_layer=min(top_k, int(slots)))
    return [int(s) for s in np.minimum(per_layer, num_experts)]


def slots_from_plan(plan: Any, shape: Any, staging_slots: int | None = None) -> tuple[str, int, int]:
    """(mode, slots per layer, staging slots) for a Plan: stock when every expert fits, else exact.

    The plan reserves 2 x top_k staging experts; exact mode stages a whole layer's worth by default (any prefill
    chunk fits and stays bit-exact), so the extra staging comes out of the per-layer cache slots."""
    experts = shape.experts_per_layer
    if plan.vram_slots_per_layer >= experts:
        return "stock", experts, 0
    staging = experts if staging_slots is None else staging_slots
    extra = max(0, staging - 2 * shape.top_k)
    per_layer = max(0, plan.vram_slots_per_layer - math.ceil(extra / max(1, shape.moe_layers)))
    return "exact", per_layer, staging


class Exl3Engine(WorkerEngine):
    """Engine (glm53.engine.interface) on exllamav3. Construct, then load() (blocking, from a worker thread)."""

    kind = "exllamav3"
    # Constrained decoding through exllamav3's own llguidance filter; decided at load (llguidance importable).
    supports_grammar = False
    no_grammar_reason = "constrained decoding needs llguidance, which this exllamav3 install lacks"

    def __init__(
        self,
        model_dir: Path,
        *,
        model_id: str = "glm-5.3-flash",
        mode: str = "exact",
        slots_per_layer: int | list[int] | None = None,
        staging_slots: int | None = None,
        kv_tokens: int = 131072,
        context_length: int | None = None,
        max_running: int = 8,
        prefill_chunk: int = 2048,
        device: str = "cuda:0",
        routing_stats_dir: Path | None = None,
        admit: bool = True,
        cpu_threads: int = 0,
        plan: Any = None,
    ) -> None:
        """mode: "stock" (every expert in VRAM) or a tiered mode (TIERED_MODES). cpu_threads: the CPU lane's threads
        in fast and nvme modes (0: physical cores - 1). plan: the nvme modes' Plan (its store and RAM budget)."""
        if mode not in ("stock", *TIERED_MODES):
            raise ValueError(f"mode must be 'stock' or one of {TIERED_MODES}, got {mode!r}")
        if mode != "stock" and slots_per_layer is None:
            raise ValueError(f"{mode} mode needs slots_per_layer (VRAM expert slots per MoE layer)")
        if mode.startswith("nvme") and (plan is None or not getattr(plan, "store", None)):
            raise ValueError(f"{mode} mode needs the plan with its expert store (GLM53_STORE)")
        super().__init__(model_dir, model_id=model_id, context_length=context_length, max_running=max_running)
        self.mode = mode
        self.slots_per_layer = slots_per_layer
        self.staging_slots = staging_slots
        self.kv_tokens = max(PAGE, kv_tokens // PAGE * PAGE)
        self.prefill_chunk = max(PAGE, prefill_chunk // PAGE * PAGE)
        self.device = device
        self.routing_stats_dir = Path(routing_stats_dir) if routing_stats_dir else None
        self.admit = admit
        self.cpu_threads = cpu_threads
        self.plan = plan
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
        import torch

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
        model = exl.Model.from_config(config)
        # One page more than the context: exllamav3 reserves a position past a job's last token (a job needs
        # prompt + max_new_tokens + 1 positions), so without it the last token of the context is cut ("length" a
        # token early) and a prompt of context_length - 1 tokens cannot be enqueued at all.
        cache = exl.Cache(model, max_num_tokens=self.kv_tokens + PAGE, max_batch_size=max(16, self.max_running))
        tiered = None
        if self.mode != "stock":
            counts = self._saved_counts(model)
            mods = A.moe_modules(model)
            slots = layer_slots(self.slots_per_layer, counts, mods[0].num_experts_per_tok) if mods else \
                self.slots_per_layer
            tiered = A.TieredMoE(model, self.model_dir, slots, staging_slots=self.staging_slots,
                                 device=self.device, counts=counts, admit=self.admit, nvme_open=self._nvme_open())
            tiered.install()
            log.info("%s mode: %s VRAM slots per MoE layer x %d layers, %d shared staging slots, %d experts in "
                     "the pinned RAM tier (%.1f GiB)%s", self.mode, self.slots_per_layer, len(tiered.layers),
                     tiered.staging_slots, tiered.tiers.ram.num_slots,
                     tiered.tiers.ram.num_slots * tiered.layout.nbytes / 2**30,
                     f", the rest read from {self.plan.store}" if tiered.nvme is not None else "")

        def shards(done: int, total: int) -> None:
            log.info("Loading safetensors checkpoint shards: %d%% Completed | %d/%d", 100 * done // total, done, total)

        undo = A.wrap_load_progress(model, shards)
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
        self.model, self.cache, self.tiered = model, cache, tiered
        tokenizer = exl.Tokenizer.from_config(config)
        self.generator = exl.Generator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=self.max_running,
                                       max_chunk_size=self.prefill_chunk)
        if self.supports_grammar:
            # llguidance's tables for this vocabulary (about a second for 150k tokens), built now rather than on the
            # event loop when the first response_format request arrives; exllamav3 caches them per tokenizer.
            from exllamav3.generator.filter.llguidance import create_ll_tokenizer

            create_ll_tokenizer(tokenizer)
        native = int(getattr(config, "max_position_embeddings", 0) or 0) or self.kv_tokens
        limit = min(self.kv_tokens, native)
        self.context_length = min(self.context_length, limit) if self.context_length else limit
        log.info("Loading weights took %.1f s", time.perf_counter() - t0)
        self._warmup()
        self._start_worker("glm53-exl3-engine")
        self.load_seconds = time.perf_counter() - t0
        log.info("exllamav3 engine (%s): ready in %.1f s (context %d)", self.mode, self.load_seconds,
                 self.context_length)

    def _fill_tiers(self, tiered: Any) -> None:
        t1 = time.perf_counter()

        def experts(done: int, total: int) -> None:
            log.info("Loading routed experts into the tiers: %d%% Completed | %d/%d", 100 * done // total, done, total)

        tiered.populate(experts)
        log.info("routed experts placed in %.1f s", time.perf_counter() - t1)
        if self.mode in ("fast", "nvme"):
            from glm53.cpu_lane.calibrate import default_threads

            tiered.start_lane(self.cpu_threads or default_threads())

    def _nvme_open(self) -> Any:
        """The nvme modes' store opener for TieredMoE (verifies the store against this checkpoint first)."""
        if not self.mode.startswith("nvme"):
            return None
        from glm53.tiers.nvme_open import open_nvme_tier

        plan, model_dir, device = self.plan, self.model_dir, self.device

        def open_(slots: list[int], staging: int) -> Any:
            return open_nvme_tier(plan.store, model_dir, plan, device=device, vram_slots=slots,
                                  staging_slots=staging, warm=False)

        return open_

    def _saved_counts(self, model: Any) -> Any:
        if self.routing_stats_dir is None:
            return None
        from glm53.engine.exl3_adapter import moe_modules
        from glm53.tiers import load_routing_stats, routing_stats_path

        mods = moe_modules(model)
        if not mods:
            return None
        key = model_key(self.model_dir)
        counts, reason = load_routing_stats(routing_stats_path(self.routing_stats_dir, key), key, len(mods),
                                            mods[0].num_experts)
        log.info("routing statistics: %s", reason)
        return counts

    def _warmup(self) -> None:
        """One short generation through both MoE paths (prefill > 8 rows, decode), before serving."""
        import torch

        exl = self._exl
        ids = torch.tensor([[i % max(1, self._n_vocab) for i in range(1, 24)]], dtype=torch.long)
        job = exl.Job(input_ids=ids, max_new_tokens=2, sampler=exl.ArgmaxSampler(), stop_conditions=[])
        with torch.inference_mode():
            self.generator.enqueue(job)
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

        key = model_key(self.model_dir)
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
                            self._retire(req, "requests_failed", EngineError(f"generation failed: {exc}"))
                    for req in batch.running:
                        if req.cancelled and not req.done:
                            self._stop_job(req)
                            self._retire(req, "requests_cancelled", END)
                    if self.generator.num_remaining_jobs():
                        for r in self.generator.iterate():
                            self._on_result(r)
                except Exception as exc:  # a failed step fails its requests loudly; the server stays up
                    log.exception("exllamav3 engine: generation step failed")
                    self._fail_all(EngineError(f"generation failed: {exc}"))
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
            return_logits=p.logprobs is not None,
            decode_special_tokens=True,
            filters=[self._job_filter(req)] if p.grammar is not None else None,
        )
        self.generator.enqueue(req.job)
        if not req.generated:
            self._count_prompt(len(req.prompt))

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
                self._retire(req, "requests_failed", EngineError(f"generation failed: {r.get('error')}"))
            return
        req = r.get("identifier")
        if not isinstance(req, _Request) or req.done or r.get("job") is not req.job:
            return  # a cancelled job's late result
        if r.get("stage") == "prefill":
            # A continuation job's prefill comes after the request's first tokens: progress is for the prompt only.
            if not req.generated and r.get("max_progress", 0) > self.prefill_chunk:
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
        for i, t in enumerate(ids):
            if req.done:
                return
            row = logits[0, i, : self._n_vocab] if logits is not None and i < logits.shape[1] else None
            self._emit_token(req, t, row, end=end if i == len(ids) - 1 else None)
            if req.budget_spent and not req.done:
                # Budget reached mid-stream: stop this job, close the block, continue in a new job.
                self._stop_job(req)
                self._force_close(req)
                if not req.done:
                    self._start(req)
                return
        if r.get("eos") and not req.done:
            # The job ended with no token to end the request on (not expected from exllamav3): end it here.
            self._finish(req, end or "length")

    def _emit_token(self, req: _Request, token: int, row: Any, forced: bool = False, end: str | None = None) -> None:
        """end: the finish reason when this token ends the job (the request ends with it, on this event)."""
        # Forced tokens come with row=None: no logits for them, so no logprobs either.
        event = self._token_event(req, token, row, forced, grammar_done=end == "stop")
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

    def _fail_all(self, exc: Exception) -> None:
        with self._cv:
            running = list(self._running)
        for req in running:
            if not req.done:
                self._retire(req, "requests_failed", exc)
        try:
            self.generator.clear_queue()
        except Exception:  # the generator may be wedged by the failure; the next request will tell
            log.exception("exllamav3 engine: clearing the queue after a failure failed")

    def _drop_jobs(self) -> None:
        try:
            self.generator.clear_queue()
        except Exception:
            log.debug("clear_queue on shutdown failed", exc_info=True)


def engine_for_plan(model_dir: Path, settings: Any, plan: Any, shape: Any) -> Exl3Engine:
    """The engine `glm53 serve` runs for an EXL3 checkpoint on this host's plan: the plan's mode, or stock when
    every expert fits in VRAM."""
    fits, per_layer, staging = slots_from_plan(plan, shape)
    mode = "stock" if fits == "stock" else plan.mode
    return Exl3Engine(
        model_dir,
        model_id=settings.model_id,
        mode=mode,
        slots_per_layer=per_layer if mode != "stock" else None,
        staging_slots=staging if mode != "stock" else None,
        cpu_threads=plan.cpu_threads,
        plan=plan,
        kv_tokens=plan.kv_tokens,
        context_length=settings.context,
        max_running=settings.max_concurrency,
        device=plan.device if str(plan.device).startswith("cuda") else "cuda:0",
        routing_stats_dir=Path(settings.cache_dir).expanduser(),
    )


def demo_engine(cache_dir: Path, settings: Any) -> tuple[Exl3Engine, Path]:
    """The no-model demo on a GPU: the tiny EXL3 fixture, exact mode with a quarter of the experts in VRAM, so the
    demo exercises the tiers and PCIe lane like the real model does."""
    from glm53.plan import DEMO_CONTEXT

    model_dir = ensure_exl3_demo_model(Path(cache_dir).expanduser())
    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    experts = int(text.get("n_routed_experts") or text.get("num_experts") or 16)
    engine = Exl3Engine(model_dir, model_id=settings.model_id, mode="exact", slots_per_layer=max(1, experts // 4),
                        kv_tokens=min(settings.context, DEMO_CONTEXT["gpu"]), max_running=settings.max_concurrency)
    return engine, model_dir
