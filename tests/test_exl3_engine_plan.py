"""The GPU engine's pure decisions (no exllamav3 needed): VRAM slots per layer from saved routing statistics."""

from __future__ import annotations

import numpy as np

from glm53.engine.exl3_engine import layer_slots


def test_layer_slots_follow_the_saved_skew_and_keep_the_total():
    rng = np.random.default_rng(0)
    flat = rng.uniform(9, 11, 64)
    skewed = np.r_[np.full(8, 200.0), np.full(56, 1.0)]
    counts = np.stack([flat, skewed, flat])
    got = layer_slots(12, counts, top_k=4)
    assert sum(got) == 36 and min(got) >= 4
    # The skewed layer's 8 hot experts take 97% of its picks: 8 slots cover them, and its other slots buy more
    # hit rate in the flat layers.
    assert got == [14, 8, 14]
    assert layer_slots(12, None, top_k=4) == 12  # no statistics: the plan's uniform count
    assert layer_slots([3, 4, 5], counts, top_k=4) == [3, 4, 5]  # an explicit split is kept
    assert layer_slots(2, counts, top_k=4) == [2, 2, 2]  # fewer slots than top_k: all even
