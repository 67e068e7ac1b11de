"""exllamav3 loaded and running: its model, paged cache and Generator, with glm53's tiers under the MoE layers.

The engine (glm53.engine.exl3_engine) starts jobs through `Runtime.start`, runs `step()` while `busy()`, and reads
the results as glm53.exl3.events; it never sees exllamav3's result dicts, jobs' attributes or page table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from glm53.exl3.events import Event, event_of
from glm53.planning.spec import PAGE, EngineSpec

log = logging.getLogger("glm53.engine")


def llguidance_filter() -> Any:
    """exllamav3's LLGuidanceFilter class, or None without llguidance (the engine then refuses grammars)."""
    try:
        from exllamav3.generator.filter import LLGuidanceFilter
        from exllamav3.generator.filter.llguidance import llguidance_available
    except ImportError:
        return None
    return LLGuidanceFilter if llguidance_available else None


class Runtime:
    """One checkpoint under exllamav3. open() reads its config; load() builds the model, the cache, the tiers (a
    tiered spec) and the generator; close() unloads them."""

    def __init__(self, model_dir: Path, exl: Any, config: Any) -> None:
        self.model_dir = Path(model_dir)
        self.exl, self.config = exl, config
        self.tokenizer: Any = None
        self.model: Any = None
        self.cache: Any = None
        self.generator: Any = None
        self.tiered: Any = None
        self.vision: Any = None  # glm53.exl3.vision.VisionTower, when loaded
        self.vision_error: str | None = None  # why a checkpoint's tower did not load

    @classmethod
    def open(cls, model_dir: Path) -> Runtime:
        """The checkpoint's exllamav3 config (nothing loaded yet)."""
        import exllamav3 as exl

        return cls(model_dir, exl, exl.Config.from_directory(str(model_dir)))

    @property
    def cpu_split_set(self) -> bool:
        """EXL3_MOE_CPU_SPLIT / EXL3_MOE_CPU_OFFLOAD: exllamav3's own expert offload, which the tiers replace."""
        params = self.config.infer_params
        return bool(params.moe_cpu_split or params.moe_cpu_offload)

    @property
    def native_context(self) -> int:
        """The model's max_position_embeddings (0: not given)."""
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    @property
    def sparse_topk(self) -> int | None:
        """The DSA indexer's top-k, where the model has a sparse attention regime."""
        return getattr(self.config, "index_topk", None)

    def build_model(self) -> Any:
        """The model's modules, nothing loaded (TieredMoE shrinks them, place_layers places them, before
        load_weights)."""
        self.model = self.exl.Model.from_config(self.config)
        return self.model

    def build_cache(self, max_num_tokens: int, max_batch_size: int | None = None) -> Any:
        """The paged KV cache of `max_num_tokens` (whole pages) for up to `max_batch_size` sequences."""
        kw = {} if max_batch_size is None else {"max_batch_size": max_batch_size}
        self.cache = self.exl.Cache(self.model, max_num_tokens=max_num_tokens, **kw)
        return self.cache

    def load_weights(self, device: str) -> None:
        """The checkpoint's weights onto `device` (module by module, each where place_layers sent it)."""
        import torch

        self.model.load(device=torch.device(device))

    def build_generator(self, max_batch_size: int, max_chunk_size: int | None = None,
                        recurrent_cache_size: int | None = None) -> Any:
        """exllamav3's Generator on the model and cache (the tokenizer read from the config where none is yet)."""
        if self.tokenizer is None:
            self.tokenizer = self.exl.Tokenizer.from_config(self.config)
        kw: dict[str, Any] = {}
        if max_chunk_size is not None:
            kw.update(max_chunk_size=max_chunk_size, recurrent_cache_size=recurrent_cache_size)
        self.generator = self.exl.Generator(model=self.model, cache=self.cache, tokenizer=self.tokenizer,
                                            max_batch_size=max_batch_size, **kw)
        return self.generator

    def load(self, spec: EngineSpec, *, counts_for: Callable[[int, int], Any] | None = None, admit: bool = True,
             nvme_open: Callable[[], Any] | None = None, on_tiers: Callable[[Any], None] | None = None,
             vision_kept: int = 0) -> None:
        """The tokenizer, model, cache, tiers and generator for `spec`. counts_for(moe_layers, experts): saved
        routing statistics to warm the tiers with (or None). on_tiers(tiered): called once the tiers hold their
        experts, before the CPU lane times the link (a benchmark emulating another host paces the link there).
        vision_kept > 0: the vision tower too (resident, on the first card), keeping that many images'
        embeddings."""
        self.tokenizer = self.exl.Tokenizer.from_config(self.config)
        self._load_model(spec, counts_for, admit, nvme_open, on_tiers)
        if vision_kept > 0:
            try:
                self.load_vision(spec.device, vision_kept)
            except Exception as exc:  # text still serves: images are refused with this reason (vision_error)
                self._drop_vision(exc)
            except BaseException:
                self.close()  # the text model, tiers and pinned arena must not outlive a failed load
                raise
        self.build_generator(spec.max_concurrency, spec.prefill_chunk, spec.recurrent_cache_bytes)

    def _drop_vision(self, exc: Exception) -> None:
        import torch

        log.error("the vision tower did not load (%s: %s): serving text only, images are refused", type(exc).__name__,
                  exc)
        if self.vision is not None:
            self.vision.close()
        self.vision, self.vision_error = None, f"{type(exc).__name__}: {exc}"
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def load_vision(self, device: str, kept: int) -> Any:
        """The checkpoint's vision component onto `device` (glm53.exl3.vision), warmed by one small image."""
        import torch

        from glm53.exl3.vision import VisionTower

        if self.tokenizer is None:
            self.tokenizer = self.exl.Tokenizer.from_config(self.config)
        with torch.inference_mode():
            self.vision = VisionTower.load(self.exl, self.config, self.tokenizer, device, kept)
            self.vision.warm()
        return self.vision

    def _load_model(self, spec: EngineSpec, counts_for: Callable[[int, int], Any] | None, admit: bool,
                    nvme_open: Callable[[], Any] | None, on_tiers: Callable[[Any], None] | None = None) -> None:
        import torch

        from glm53.exl3.placement import moe_modules, place_layers, wrap_load_progress
        from glm53.exl3.tiered import TieredMoE

        model = self.build_model()
        # One page more than the context: exllamav3 reserves a position past a job's last token (a job needs
        # prompt + max_new_tokens + 1 positions), so without it the last token of the context is cut ("length" a
        # token early) and a prompt of context_length - 1 tokens cannot be enqueued at all.
        self.build_cache(spec.kv_tokens + PAGE, spec.cache_sequences)
        tiered = None
        if spec.tiered:
            mods = moe_modules(model)
            counts = counts_for(len(mods), mods[0].num_experts) if counts_for is not None and mods else None
            tiered = TieredMoE(model, self.model_dir, spec, counts=counts, admit=admit, nvme_open=nvme_open)
            tiered.install()
            _log_tiers(spec, tiered)

        def shards(done: int, total: int) -> None:
            log.info("Loading safetensors checkpoint shards: %d%% Completed | %d/%d", 100 * done // total, done, total)

        undo = wrap_load_progress(model, shards)
        unplace = place_layers(model, spec)  # a split across GPUs: each layer onto its card (spec.devices)
        for d in spec.devices:
            log.info("layer split: decoder layers %d-%d on %s (%s), %d expert slots, budget %.1f GiB", d.first_layer,
                     d.last_layer, d.device, d.name, d.vram_slots, d.vram_budget_bytes / 2**30)
        try:
            with torch.inference_mode():
                self.load_weights(spec.device)
            if tiered is not None:
                _fill_tiers(tiered, spec, on_tiers)
        except BaseException:
            # A failed load must not leave the lane's threads, the store reader or the pinned arena behind.
            model.unload()
            if tiered is not None:
                tiered.close()
            self.model = self.cache = None
            raise
        finally:
            undo()
            unplace()
        self.tiered = tiered

    def prepare_grammar(self) -> None:
        """llguidance's tables for this vocabulary (about a second for 150k tokens), built now rather than when the
        first grammar arrives; exllamav3 caches them per tokenizer."""
        from exllamav3.generator.filter.llguidance import create_ll_tokenizer

        create_ll_tokenizer(self.tokenizer)

    def grammar_filter(self, grammar: str, trigger: int | None) -> Any:
        """An llguidance filter for one job: it waits for `trigger` (when given) and ends the job on completion."""
        return llguidance_filter()(self.tokenizer, trigger_token=trigger, lark_grammar=grammar,
                                   eos_after_completed=True)

    # --- jobs ---------------------------------------------------------------------------------------------
    def start(self, owner: Any, ids: Sequence[int], *, max_new: int, temperature: float, min_p: float = 0.0,
              top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: Sequence[int] = (),
              logits: bool = False, grammar: Any = None, min_new: int = 0, embeddings: Sequence[Any] = ()) -> Any:
        """Enqueue a job for `owner` on prompt `ids` (greedy at temperature 0); returns its handle. min_new: the
        stop tokens are held back until the job generated that many (exllamav3 masks them, across requeues).
        embeddings: the MMEmbeddings whose placeholder ids `ids` holds (VisionTower.prompt)."""
        import torch

        exl = self.exl
        sampler = exl.ArgmaxSampler() if temperature == 0 else exl.ComboSampler(
            temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p)
        job = exl.Job(
            input_ids=torch.tensor([list(ids)], dtype=torch.long),
            max_new_tokens=max_new,
            min_new_tokens=min_new,
            sampler=sampler,
            seed=seed,
            stop_conditions=list(stop),
            identifier=owner,
            # Pages are committed a segment at a time (exllamav3 aligns this to its recurrent-checkpoint interval)
            # and the job requeued at each boundary, so a reply without max_tokens does not reserve the cache. A
            # reply of a page or less reserves just itself (a segment would reserve up to the boundary).
            max_rq_tokens=PAGE if max_new > PAGE else None,
            return_logits=logits,
            decode_special_tokens=True,
            filters=[grammar] if grammar is not None else None,
            embeddings=list(embeddings) or None,
        )
        self.generator.enqueue(job)
        return job

    def busy(self) -> bool:
        """Jobs are queued or running."""
        return bool(self.generator.num_remaining_jobs())

    def step(self) -> list[Event]:
        """One generator iteration (a batch of decode steps, or a prompt chunk), its results as events."""
        results = self.generator.iterate()
        if self.tiered is not None:  # a CPU-lane partial that failed spoiled this iteration: fail, emit nothing
            self.tiered.check_handoff()
        return [ev for ev in map(event_of, results) if ev is not None]

    def cancel(self, job: Any) -> None:
        self.generator.cancel(job)

    def clear(self) -> None:
        """Drop every job (after a failed step, and at shutdown)."""
        self.generator.clear_queue()

    def forget_pages(self) -> None:
        """After a failed step, with every job dropped: no page is reused as a prompt's prefix again. The failed
        forward may have written wrong keys and values (a spoiled lane partial, an expert that could not be read)
        into a page it completed, and a retried request would resume from that page. exllamav3 gives every page a
        fresh hash, so nothing matches it, and a recurrent checkpoint needs its chain of pages to resume."""
        self.generator.pagetable.reset_page_table()

    def waiting(self) -> set[int]:
        """id() of the jobs exllamav3 holds back: no free pages for their next segment."""
        return set(map(id, self.generator.pending_jobs))

    def cached_tokens(self, job: Any) -> int:
        """Prompt tokens a running job took from the page cache (what its end-of-job result would report: carried
        across requeues in rq_cached)."""
        carried = getattr(job, "rq_cached", None)
        if carried is not None:
            return int(carried[1])
        return int(job.cached_pages) * PAGE + int(job.cached_tokens)

    def run(self, prompts: Sequence[Sequence[int]], max_new: int, *, temperature: float | None = None,
            seed: int | None = None, on_step: Callable[[list[Event]], None] | None = None) -> None:
        """Jobs on `prompts` with no stop condition (greedy, or sampled at `temperature`), run together to their end;
        on_step(events) after each iteration."""
        import torch

        exl = self.exl
        jobs = [exl.Job(input_ids=torch.tensor([list(ids)], dtype=torch.long), max_new_tokens=max_new,
                        sampler=exl.ArgmaxSampler() if temperature is None else exl.ComboSampler(
                            temperature=temperature), **({} if seed is None else {"seed": seed}),
                        stop_conditions=[]) for ids in prompts]
        self.generator.enqueue(jobs)
        while self.generator.num_remaining_jobs():
            events = self.step()
            if on_step is not None:
                on_step(events)

    # --- reports ------------------------------------------------------------------------------------------
    def kv_stats(self) -> dict:
        """exllamav3's page table: pages in use by jobs, cached pages lost to eviction, pages served from the prompt
        cache; recurrent checkpoints dropped from the RAM cache (generator/pagetable.py, cache/recurrent.py)."""
        doc: dict = {}
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

    def sizes(self) -> dict:
        """What exllamav3 was built with, counted from its objects: the experts the MoE layers hold, the cache's
        tokens and sequences, the generator's prefill chunk and recurrent cache."""
        from glm53.exl3.placement import moe_modules

        cache, gen = self.cache, self.generator
        out = {"experts": sum(int(m.num_local_experts) for m in moe_modules(self.model)),
               "kv_tokens": int(cache.max_num_tokens),
               "sequences": int(getattr(cache, "num_slots", getattr(cache, "max_batch_size", 0))),
               "prefill_chunk": int(gen.max_chunk_size)}
        if hasattr(gen, "recurrent_cache_size"):
            out["recurrent_cache_bytes"] = int(gen.recurrent_cache_size)
        return out

    def close(self) -> None:
        """Unload the model and drop the tiers (the modules are restored either way)."""
        if self.vision is not None:
            self.vision.close()
        if self.model is not None:
            self.model.unload()
        if self.tiered is not None:
            self.tiered.close()
        self.generator = self.cache = self.model = self.tiered = self.vision = None


def _log_tiers(spec: EngineSpec, tiered: Any) -> None:
    tiers = tiered.tiers
    log.info("%s mode: VRAM slots per MoE layer %s (%s), %d staging per layer (%d rows of their own, the "
             "rest borrowed from %d cache slots), %d experts in the pinned RAM tier (%.1f GiB)%s", spec.engine,
             list(spec.vram_slots), spec.split, tiered.staging_slots, tiers.staging_rows,
             len(tiers.lent), tiers.ram.num_slots, tiers.ram.num_slots * tiered.layout.nbytes / 2**30,
             f", the rest read from {spec.store}" if tiered.nvme is not None else "")


def _fill_tiers(tiered: Any, spec: EngineSpec, on_tiers: Callable[[Any], None] | None = None) -> None:
    t1 = time.perf_counter()

    def experts(done: int, total: int) -> None:
        log.info("Loading routed experts into the tiers: %d%% Completed | %d/%d", 100 * done // total, done, total)

    tiered.populate(experts)
    log.info("routed experts placed in %.1f s", time.perf_counter() - t1)
    if on_tiers is not None:
        on_tiers(tiered)
    if spec.lane:
        tiered.start_lane(spec.cpu_threads)
