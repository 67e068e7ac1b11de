"""Synthetic routing traces: the skewed, drifting picks a cache policy is tuned and benchmarked on."""

from __future__ import annotations

import numpy as np


def zipf_trace(
    num_steps: int,
    num_experts: int = 288,
    top_k: int = 8,
    exponent: float = 0.8,
    drift_every: int = 200,
    drift_swaps: int = 2,
    hot_fraction: float = 0.11,
    locality: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """A synthetic routing trace: Zipf-like popularity over a drifting ranking, top-k distinct picks per step.

    Popularity of rank r is r ** -exponent (0.8 over 288 experts: the top 11% draw ~40% of picks, as published
    for GLM-5.3-Flash). Every `drift_every` steps, `drift_swaps` hot experts (rank < hot_fraction * experts)
    trade places with random others, so the hot set slowly changes as it does between topics. `locality` adds
    that log-bonus to the previous step's picks (consecutive tokens share experts more than chance). Picks are
    sampled without replacement in proportion to popularity (Gumbel top-k). Returns int64 (num_steps, top_k).
    """
    rng = np.random.default_rng(seed)
    logp = -exponent * np.log(np.arange(1, num_experts + 1))
    rank_of = rng.permutation(num_experts)  # rank_of[e]: e's popularity rank
    hot = max(1, int(hot_fraction * num_experts))
    out = np.empty((num_steps, top_k), np.int64)
    prev = np.empty(0, np.int64)
    for start in range(0, num_steps, drift_every):
        n = min(drift_every, num_steps - start)
        g = logp[rank_of][None, :] + rng.gumbel(size=(n, num_experts))
        if locality:
            for i in range(n):  # sequential: each step leans on the one before
                g[i, prev] += locality
                prev = out[start + i] = np.argpartition(-g[i], top_k - 1)[:top_k]
        else:
            out[start : start + n] = np.argpartition(-g, top_k - 1, axis=1)[:, :top_k]
        by_rank = np.argsort(rank_of)
        for _ in range(drift_swaps):
            a = by_rank[rng.integers(hot)]
            b = by_rank[rng.integers(num_experts)]
            rank_of[a], rank_of[b] = rank_of[b], rank_of[a]
            by_rank = np.argsort(rank_of)
    return out
