"""Token sampling from one row of logits: greedy, temperature, top-k, top-p, min-p, seeded; plus logprobs.

Pure torch on the CPU. Every random draw goes through the request's own torch.Generator, so a request's
tokens depend only on its prompt, params and seed, never on what else the engine is serving.
"""

from __future__ import annotations

import torch

from glm53.engine.interface import SamplingParams

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MIN_TEMPERATURE = 1e-3


def validate(params: SamplingParams) -> None:
    """Raise ValueError for values no sampler can honour (the server validates too; this guards other callers)."""
    if not params.temperature >= 0:
        raise ValueError("temperature must be >= 0")
    if not 0 < params.top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")
    if params.top_k < 0:
        raise ValueError("top_k must be >= 0")
    if not 0 <= params.min_p <= 1:
        raise ValueError("min_p must be in [0, 1]")
    if params.max_tokens is not None and params.max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    if params.min_tokens < 0:
        raise ValueError("min_tokens must be >= 0")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
    if params.reasoning_budget is not None:
        if params.reasoning_budget < 0:
            raise ValueError("reasoning_budget must be >= 0")
        if not params.reasoning_end_ids:
            raise ValueError("reasoning_budget needs reasoning_end_ids (the ids of the think-close text)")


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()  # nondeterministic, from the OS
    else:
        gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (float32, 1-D, sums to 1). temperature > 0."""
    # Below MIN_TEMPERATURE the division overflows float32 to inf (and softmax to nan); the draw is greedy there anyway.
    scores = logits.float() / max(params.temperature, MIN_TEMPERATURE)
    if params.top_k and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays in).
        drop_sorted = (torch.cumsum(sorted_p, 0) - sorted_p) >= params.top_p
        drop_sorted[0] = False  # the most likely token always stays, however small top_p is (5e-324 rounds to 0 in float32)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def suppressed(logits: torch.Tensor, ids: frozenset[int] | set[int] | list[int]) -> torch.Tensor:
    """logits with `ids` made impossible (min_tokens holds the stop tokens back), unless nothing else is left
    (a grammar that allows only them): then they stay, since some token must be sampled."""
    ids = sorted(t for t in ids if 0 <= t < logits.numel())
    if not ids:
        return logits
    out = logits.clone()
    out[ids] = float("-inf")
    return out if bool(torch.isfinite(out).any()) else logits


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token id from a 1-D row of logits (already restricted to the real vocabulary)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))  # first maximum: ties go to the lowest id
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=gen))


def logprobs_of(logits: torch.Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) and the top_n (id, logprob) under the model's unmodified distribution."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = torch.topk(logp, top_n)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return float(logp[token]), top
