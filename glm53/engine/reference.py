"""The CPU reference engine: a Glm5Next checkpoint run with transformers, for the demo, CI and KL teachers.

One model, one worker thread. Requests wait in a FIFO queue; up to `max_running` are active at once and the
worker visits them round-robin, one unit of work each (one prompt chunk, one sampled token, or feeding that token
back), so every active request makes progress and a long prompt cannot stall the others' streams. Each request
keeps its own transformers cache (KDA recurrent + conv state, MLA latents, DSA indexer keys); batching across
requests would need padded recurrent states, and correctness matters more than throughput here.

With `kv_tokens` the caches share a budget of KV pages by the worker's rule (glm53.engine.worker): each unit of
work first takes the pages its positions need; a request that gets none waits, and the youngest holder yields.

Prefix reuse: two caches of the last request that ended are kept (their pages stay in the ledger, evicted first
when pages run short): the whole one (prompt + reply) and a copy taken when its prompt was done. A request whose
prompt starts with exactly the tokens one of them holds continues from the longer match and prefills only the
rest: the recurrent states cannot be rewound, so only a whole-cache match counts. An agent's next turn (history +
reply + new message) starts with the previous prompt even when the reply comes back tokenized another way.

The request queue, the worker thread's hand-off to asyncio and the token events are glm53.engine.worker's,
shared with the exllamav3 engine; cancellation is seen between units of work (a few ms apart), after which the
request's cache is dropped.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from glm53.engine import constrain, sampling
from glm53.engine.interface import PromptProgress
from glm53.engine.quiet import quiet_transformers
from glm53.engine.vision import EMBEDDINGS_KEPT, PromptImage
from glm53.engine.worker import END, Request, WorkerEngine, out_of_memory_names_knobs

log = logging.getLogger("glm53.engine")

# The ledger's holder names of the kept caches: the whole one, and the copy taken at its prompt's end.
_KEPT, _KEPT_PROMPT = "kept prefix cache", "kept prompt cache"


@dataclass(eq=False, kw_only=True)
class _ReferenceRequest(Request):
    gen: torch.Generator
    constraint: constrain.GrammarConstraint | None = None  # applies once the think block is closed
    cache: Any = None
    prompt_cache: Any = None  # a copy of the cache when the prompt was done (kept for the next turn)
    prefilled: int = 0  # positions of prompt + generated in the cache
    logits: torch.Tensor | None = None  # next-token logits once the prompt is processed
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


class ReferenceEngine(WorkerEngine):
    """Engine (glm53.engine.interface) on the CPU with transformers. Construct, then load() (blocking)."""

    kind = "reference-cpu"
    no_grammar_reason = "constrained decoding needs llguidance, which is not installed"

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
        kv_tokens: int | None = None,
    ) -> None:
        """kv_tokens: the KV budget every request shares, in tokens (the plan's; None: each request is bounded by
        the context only)."""
        super().__init__(model_dir, model_id=model_id, context_length=context_length, max_running=max_running)
        if kv_tokens:
            self.set_kv_tokens(kv_tokens, ledger=True)
        self.prefill_chunk = max(1, prefill_chunk)
        self.threads = threads
        # float32 by default: the checkpoint is bf16, but CPUs without bf16 matmul units run bf16 slower, and
        # an exact upcast keeps the reference a faithful teacher.
        self.dtype = dtype
        self._model: Any = None
        self._ll_tokenizer: Any = None  # llguidance's vocabulary view, when llguidance is installed
        self.supports_grammar = constrain.available()
        # holder -> (the tokens it holds, the (start, hash) of each image among them, a transformers cache)
        self._kept: dict[str, tuple[list[int], tuple, Any]] = {}
        self._embeddings: OrderedDict[str, torch.Tensor] = OrderedDict()  # content hash -> the tower's output
        self._vision_counts = {"images_encoded": 0, "image_embeddings_reused": 0}

    # --- lifecycle ----------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._model is not None and self._worker_alive()

    def load(self) -> None:
        if self.ready:
            return
        t0 = time.perf_counter()
        if self.threads:
            torch.set_num_threads(self.threads)
        log.info("reference engine: loading %s on the CPU (%s)", self.model_dir, str(self.dtype).replace("torch.", ""))
        text = self._load_text()
        self._read_vision()
        with quiet_transformers(), out_of_memory_names_knobs("while loading the model"):
            num_mtp = int(getattr(text, "num_nextn_predict_layers", 0) or 0)
            cls = _model_class(text.num_hidden_layers, num_mtp)
            model = cls.from_pretrained(self.model_dir, dtype=self.dtype).eval()
            if not self.context_length:
                self.context_length = int(text.max_position_embeddings)
            with torch.inference_mode():  # one prefill and one decode step: both code paths, before serving
                out = model(input_ids=torch.tensor([[0, 1]]), use_cache=True)
                model(input_ids=torch.tensor([[2]]), past_key_values=out.past_key_values, use_cache=True)
        self._model = model
        if self.supports_grammar:
            self._grammar_vocab()  # now, not on the event loop when the first response_format request arrives
        self._start_worker("glm53-reference-engine")
        log.info(
            "reference engine: ready in %.1f s (%d layers, %d experts, context %d)",
            time.perf_counter() - t0, text.num_hidden_layers, getattr(text, "n_routed_experts", 0), self.context_length,
        )  # fmt: skip

    def close(self) -> None:
        self._stop_worker(timeout=30)
        self._model = None
        self._kept = {}
        self._embeddings.clear()

    # --- text ---------------------------------------------------------------------------------------------
    def _grammar_vocab(self) -> Any:
        # Built at load: a grammar request compiles on the event loop (engines validate before their first
        # await), where building these tables (and importing llguidance.torch) would stall every stream.
        with self._cv:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = constrain.make_tokenizer(self._hf_tok, self._n_vocab, self._eos)
            return self._ll_tokenizer

    # --- requests -----------------------------------------------------------------------------------------
    def _new_request(self, **fields: Any) -> _ReferenceRequest:
        params = fields["params"]
        # A grammar only constrains the answer after an open think block closes (JSON inside the reasoning
        # would be wrong).
        constraint = None
        if params.grammar is not None:
            constraint = constrain.GrammarConstraint(self._grammar_vocab(), params.grammar)
        return _ReferenceRequest(**fields, gen=sampling.make_generator(params.seed), constraint=constraint)

    def _stats_extra(self) -> dict:
        return {"prefilling": sum(1 for r in self._running if r.prefilled < len(r.prompt)),
                "vision": {"available": self.vision is not None, **self._vision_counts,
                           "image_embeddings_kept": len(self._embeddings)}}

    # --- worker -------------------------------------------------------------------------------------------
    def _worker(self) -> None:
        with torch.inference_mode():
            while (batch := self._admit()) is not None:
                for req in batch.running:
                    if req.done:  # preempted earlier in this round, or retired
                        continue
                    if req.cancelled:
                        self._retire(req, "requests_cancelled", END)
                        continue
                    if req not in self._running:
                        continue
                    try:
                        self._step(req)
                    except Exception as exc:  # one broken request must not take the engine down
                        log.exception("reference engine: request %s failed", req.request_id)
                        req.cache = None  # not kept: a forward that raised may have left it half written
                        self._fail(req, exc, "while running this request")

    def _forward(self, req: _ReferenceRequest, ids: list[int]) -> torch.Tensor:
        out = self._model(
            input_ids=torch.tensor([ids], dtype=torch.long),
            past_key_values=req.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        req.cache = out.past_key_values
        return out.logits[0, -1, : self._n_vocab]

    def _prefill(self, req: _ReferenceRequest, start: int, end: int) -> torch.Tensor:
        """The logits after positions [start, end) of the request, images there taking their embeddings."""
        ids = self._tokens(req, start, end)
        embeds = self._image_embeds(req, torch.tensor([ids], dtype=torch.long), start)
        if embeds is None:
            return self._forward(req, ids)
        out = self._model(inputs_embeds=embeds, past_key_values=req.cache, use_cache=True, logits_to_keep=1)
        req.cache = out.past_key_values
        return out.logits[0, -1, : self._n_vocab]

    def _image_embeds(self, req: _ReferenceRequest, inputs: torch.Tensor, start: int) -> torch.Tensor | None:
        """Token embeddings of `inputs` with the tower's output at the image positions; None when no image
        overlaps them (the plain input_ids path)."""
        end = start + inputs.shape[1]
        overlapping = [im for im in req.images if im.start < end and im.end > start]
        if not overlapping:
            return None
        embeds = self._model.get_input_embeddings()(inputs).clone()
        for im in overlapping:
            rows = self._embedding(im)
            a, b = max(im.start, start), min(im.end, end)
            embeds[0, a - start:b - start] = rows[a - im.start:b - im.start].to(embeds.dtype)
        return embeds

    def _embedding(self, im: PromptImage) -> torch.Tensor:
        """The tower's output for one image (tokens x hidden), kept by content hash."""
        rows = self._embeddings.get(im.digest)
        if rows is not None:
            self._embeddings.move_to_end(im.digest)
            self._vision_counts["image_embeddings_reused"] += 1
            return rows
        pixels = torch.as_tensor(im.pixels, dtype=self.dtype)
        grid = torch.tensor([im.grid], dtype=torch.long)
        rows = self._model.get_image_features(pixels, grid).pooler_output[0]
        if rows.shape[0] != im.tokens:
            raise ValueError(f"the vision tower made {rows.shape[0]} embeddings for an image of {im.tokens} tokens")
        self._embeddings[im.digest] = rows
        self._vision_counts["images_encoded"] += 1
        while len(self._embeddings) > EMBEDDINGS_KEPT:
            self._embeddings.popitem(last=False)
        return rows

    @staticmethod
    def _tokens(req: _ReferenceRequest, a: int, b: int) -> list[int]:
        """Positions [a, b) of prompt + generated."""
        p = len(req.prompt)
        return req.prompt[a:min(b, p)] + req.generated[max(a - p, 0):max(b - p, 0)]

    def _step(self, req: _ReferenceRequest) -> None:
        """One unit of work for `req`: a chunk of prompt (or of what a preempted request had) into the cache, the
        last sampled token into the cache, or one token sampled. Waits (does nothing) while its pages are short."""
        total = len(req.prompt) + len(req.generated)
        if req.prefilled < total:
            if req.cached_tokens is None:
                self._start(req)
            end = min(req.prefilled + self.prefill_chunk, total)
            if not self._kv_reserve(req, end):
                return
            req.logits = self._prefill(req, req.prefilled, end)
            req.prefilled = end
            if end == len(req.prompt) and not req.generated:
                req.prompt_cache = copy.deepcopy(req.cache)
            if not req.generated and len(req.prompt) > self.prefill_chunk:
                req.emit(PromptProgress(req.prefilled, total))
            return

        token, forced, grammar_done = self._next_token(req)
        # Forced tokens get logprobs too: the logits of the position they were forced into.
        event = self._token_event(req, token, req.logits, forced, grammar_done)
        if event.finish_reason is not None:
            self._retire(req, "requests_finished", event)
            return
        req.emit(event)

    def _start(self, req: _ReferenceRequest) -> None:
        """Before the request's first chunk: count its prompt and what the prefix cache served of it."""
        if req.cached_tokens is None:  # what the client's usage reports (a resumed request is no new hit)
            self._count_prompt(len(req.prompt))
            self._note_cached(req, req.prefilled)

    def _suspend(self, req: _ReferenceRequest) -> None:
        """Yielding its slot, a request keeps its cache, logits and pages: resuming costs nothing (the pages go
        if another request runs short of them: WorkerEngine._drop_suspended_pages)."""

    def _claim_prefix(self, req: _ReferenceRequest) -> None:
        if req.cache is not None:  # resuming with its own cache (a yielded request)
            return
        total = len(req.prompt) + len(req.generated)
        matches = [(len(tokens), holder) for holder, (tokens, images, _) in self._kept.items()
                   if len(tokens) < total and self._tokens(req, 0, len(tokens)) == tokens
                   and _images_before(req, len(tokens)) == images]
        if not matches:
            return
        held, holder = max(matches)
        _, _, cache = self._kept.pop(holder)
        if self.kv is not None:
            self.kv.held[req] = self.kv.drop(holder)  # its pages go with it
        req.cache, req.prefilled = cache, held

    def _kv_evict_kept(self) -> bool:
        if not self._kept:
            return False
        holder = _KEPT_PROMPT if _KEPT_PROMPT in self._kept else _KEPT
        del self._kept[holder]
        if self.kv is not None:
            self.kv.evicted += self.kv.drop(holder)
        return True

    def _reset_for_resume(self, req: _ReferenceRequest) -> None:
        req.cache = req.logits = req.prompt_cache = None
        req.prefilled = 0

    def _next_token(self, req: _ReferenceRequest) -> tuple[int, bool, bool]:
        """(token, forced, grammar complete): sample, or take the next forced id of a budget-closed think block."""
        p = req.params
        if not req.forced and req.budget_spent:
            req.forced = list(p.reasoning_end_ids)
            req.in_reasoning = False
        if req.forced:
            return req.forced.pop(0), True, False
        constrained = req.constraint is not None and not req.in_reasoning
        logits = req.constraint.masked(req.logits) if constrained else req.logits
        if len(req.generated) < p.min_tokens:
            logits = sampling.suppressed(logits, req.stop_ids)
        token = sampling.sample(logits, p, req.gen)
        done = constrained and token not in req.stop_ids and req.constraint.advance(token)
        return token, False, done

    def _release(self, req: _ReferenceRequest) -> None:
        """Keep the ended request's cache for the next prompt that starts with what it holds (replacing, and so
        evicting, the one kept before)."""
        cache, held, prompt_cache = req.cache, req.prefilled, req.prompt_cache
        req.cache = req.logits = req.prompt_cache = None
        if cache is None or not held:
            return
        with self._cv:
            while self._kv_evict_kept():
                pass
            self._kept[_KEPT] = (self._tokens(req, 0, held), _images_before(req, held), cache)
            if prompt_cache is not None and len(req.prompt) < held:
                self._kept[_KEPT_PROMPT] = (list(req.prompt), _images_before(req, len(req.prompt)), prompt_cache)
            if self.kv is not None:  # the pages the request just gave back; a copy without room is not kept
                for holder, (tokens, _, _) in list(self._kept.items()):
                    if not self.kv.take(holder, len(tokens)):
                        del self._kept[holder]


def _images_before(req: Request, held: int) -> tuple:
    """The identity of the images among a request's first `held` positions: the same tokens with another image
    are another prefix (its image tokens are all alike)."""
    return tuple((im.start, im.tokens, im.digest) for im in req.images if im.start < held)
