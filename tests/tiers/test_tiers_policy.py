"""The cache policy against LRU on skewed drifting routing, per-layer budgets, and saved statistics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from policy_lab import LruPolicy, simulate

from glm53.bench.routing_trace import zipf_trace
from glm53.planning.routing import load_routing_stats, routing_stats_path, save_routing_stats
from glm53.planning.spec import split_budget
from glm53.tiers import (
    ExpertTiers,
    ScoredPolicy,
    SlotLayout,
    TierStats,
    choose_admissions,
)

EXPERTS, SLOTS = 288, 32  # 32 / 288 = 11%: the 24 GB card's share of GLM-5.3-Flash's experts


def top_share(trace: np.ndarray, k: int) -> float:
    c = np.bincount(trace.reshape(-1), minlength=EXPERTS)
    return float(np.sort(c)[::-1][:k].sum() / c.sum())


@pytest.mark.parametrize("locality", [0.0, 1.0])
def test_policy_beats_lru_on_skewed_drifting_routing(locality: float) -> None:
    trace = zipf_trace(8000, EXPERTS, top_k=8, exponent=0.8, drift_every=200, locality=locality, seed=0)
    if locality == 0.0:  # the published skew: ~11% of experts draw ~40% of picks
        assert 0.35 < top_share(trace, SLOTS) < 0.45
    lru = simulate(trace, LruPolicy(EXPERTS), SLOTS)
    ours = simulate(trace, ScoredPolicy(EXPERTS), SLOTS)
    print(f"locality {locality}: hit rate scored {ours.hit_rate:.3f} vs LRU {lru.hit_rate:.3f}; "
          f"swaps {ours.swaps} vs {lru.swaps}")
    assert ours.hit_rate > lru.hit_rate
    assert ours.swaps < lru.swaps  # and it moves fewer bytes doing it


def test_admission_needs_a_margin() -> None:
    p = ScoredPolicy(4, margin=1.0, recency_weight=0.0, half_life=float("inf"))  # exact counts
    for _ in range(3):
        p.observe(np.array([0]))
    p.observe(np.array([1, 1, 2]))  # 1 has 2 picks, 2 has 1; resident 0 has 3
    resident = np.array([True, False, False, False])
    assert choose_admissions(p, resident, 0, np.array([1, 2]), protect=np.array([1, 2])) == []
    p.observe(np.array([1, 1]))  # 1 now has 4 > 3 + 1? no: 4 is not > 4
    assert choose_admissions(p, resident, 0, np.array([1]), protect=np.array([1])) == []
    p.observe(np.array([1]))
    assert choose_admissions(p, resident, 0, np.array([1]), protect=np.array([1])) == [(1, 0)]
    # Free slots are taken without a contest, best miss first; protected residents are never victims.
    assert choose_admissions(p, resident, 1, np.array([2, 1]), protect=np.array([2, 1])) == [(1, None)]
    assert choose_admissions(p, resident, 0, np.array([1]), protect=np.array([0, 1])) == []


def test_decay_follows_drift() -> None:
    p = ScoredPolicy(3, half_life=10, recency_weight=0.0)
    for _ in range(50):
        p.observe(np.array([0]))
    for _ in range(40):
        p.observe(np.array([1]))
    s = p.scores()
    assert s[1] > s[0] > s[2] == 0.0  # 40 recent picks outweigh 50 old ones


def test_split_budget_follows_skew() -> None:
    """Slots go where the next one buys the most hits: a skewed layer's head first, then flat layers' uniform
    share beats the skewed layer's thin tail; identical layers split evenly."""
    zipf = np.arange(1, EXPERTS + 1) ** -1.2
    skewed, flat = zipf / zipf.sum(), np.full(EXPERTS, 1 / EXPERTS)
    assert split_budget(np.stack([flat, skewed]), 30).tolist() == [0, 30]  # head shares all beat 1/288
    b = split_budget(np.stack([flat, skewed]), 200)
    assert b[1] == int((skewed > 1 / EXPERTS).sum())  # the tail below 1/288 loses to the flat layer
    assert split_budget(np.stack([flat, flat, np.zeros(EXPERTS)]), 31).tolist() == [11, 10, 10]
    counts = np.stack([flat, skewed, skewed[::-1]])
    for total in (0, 17, 96, 500):
        b = split_budget(counts, total)
        assert b.sum() == total
        modeled = sum(np.sort(c)[::-1][:n].sum() for c, n in zip(counts, b, strict=True))
        even = sum(np.sort(c)[::-1][: total // 3].sum() for c in counts)
        assert modeled >= even - 1e-12
    b = split_budget(counts, 96, min_per_layer=8, max_per_layer=40)
    assert b.sum() == 96 and b.min() >= 8 and b.max() <= 40
    with pytest.raises(ValueError):
        split_budget(counts, 3 * EXPERTS + 1)
    with pytest.raises(ValueError):
        split_budget(counts, 10, min_per_layer=4)


def test_split_budget_beats_uniform_in_simulation() -> None:
    """Layers of different skew: budgets from the first half's statistics win on the second half."""
    traces = [zipf_trace(4000, EXPERTS, exponent=a, drift_every=10**6, seed=s) for s, a in enumerate([0.3, 0.8, 1.3])]
    counts = np.stack([np.bincount(t[:2000].reshape(-1), minlength=EXPERTS) for t in traces])
    budget = split_budget(counts, 16 * 3)

    def mean_hit_rate(slots) -> float:
        return float(np.mean([simulate(t[2000:], ScoredPolicy(EXPERTS), int(n)).hit_rate
                              for t, n in zip(traces, slots, strict=True)]))

    split, uniform = mean_hit_rate(budget), mean_hit_rate([16] * 3)
    print(f"budgets {budget.tolist()}: hit rate {split:.3f} vs uniform 16/layer {uniform:.3f}")
    assert split > uniform


def test_warm_start_helps_early_hits() -> None:
    trace = zipf_trace(4000, EXPERTS, drift_every=10_000, seed=3)
    saved = np.bincount(trace[:3000].reshape(-1), minlength=EXPERTS).astype(float)
    head = trace[3000:3100]
    cold = simulate(head, ScoredPolicy(EXPERTS), SLOTS)
    p = ScoredPolicy(EXPERTS)
    p.seed(saved / saved.sum() * 8 * p.half_life / np.log(2))  # scaled like live decayed counts
    warm = simulate(head, p, SLOTS, warm=np.argsort(-saved))
    assert warm.hit_rate > cold.hit_rate + 0.05


def test_routing_stats_round_trip(tmp_path) -> None:
    counts = np.random.default_rng(0).random((3, 8)) * 100
    path = routing_stats_path(tmp_path / "cache", "glm-5.3-flash/exl3 3.05bpw")
    assert path.parent == tmp_path / "cache" and "/" not in path.name
    save_routing_stats(path, counts, "m1", steps=42)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing left aside
    got, why = load_routing_stats(path, "m1", 3, 8)
    assert got is not None and np.allclose(got, counts, atol=1e-4) and "42 steps" in why
    assert load_routing_stats(path, "m2", 3, 8)[0] is None  # another model's routing
    assert load_routing_stats(path, "m1", 4, 8)[0] is None  # another shape
    assert "cold start" in load_routing_stats(tmp_path / "none.json", "m1", 3, 8)[1]
    path.write_text("{not json")
    assert "unreadable" in load_routing_stats(path, "m1", 3, 8)[1]
    doc = {"format": 1, "model": "m1", "counts": [[-1.0] * 8] * 3}
    path.write_text(json.dumps(doc))
    assert load_routing_stats(path, "m1", 3, 8)[0] is None


def test_tiers_save_and_warm_start(tmp_path) -> None:
    """Statistics gathered by one run's tiers warm the next run's VRAM and policies."""
    layout = SlotLayout.packed([("w", torch.float32, (2,))], align=8)
    experts = torch.arange(2 * 16 * layout.nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    experts = experts.reshape(2, 16, layout.nbytes)

    def load(lay, e, out):
        out.copy_(experts[lay, e])

    first = ExpertTiers(layout, 16, [3, 3], 2 * 16 - 6 + 1)
    first.populate(load)
    for step in zipf_trace(300, 16, top_k=4, exponent=1.2, seed=5):
        first.observe(0, step)
        first.observe(1, (step + 7) % 16)
    path = tmp_path / "routing.json"
    save_routing_stats(path, first.routing_counts(), "m")
    counts, _ = load_routing_stats(path, "m", 2, 16)
    second = ExpertTiers(layout, 16, [3, 3], 2 * 16 - 6 + 1)
    second.populate(load, counts)
    for layer in range(2):
        top = set(np.argsort(-counts[layer], kind="stable")[:3].tolist())
        assert set(np.flatnonzero(second.vram[layer].resident()).tolist()) == top
        assert np.allclose(second.policies[layer].counts(), counts[layer])
    second.check_invariants()


def test_stats_snapshot() -> None:
    s = TierStats(2, [4, 6], ram_slots=10)
    s.add_picks(0, {"vram_hit": 3, "pcie": 1})
    s.add_picks(1, {"cpu": 2, "nvme": 2})
    s.add_admission(0)
    s.add_eviction(0)
    s.add_bytes("ram_to_vram", 100)
    s.add_wait("pcie", 0.5)
    s.set_slots_in_use(1, 5)
    snap = json.loads(json.dumps(s.snapshot()))
    assert snap["picks"] == {"vram_hit": 3, "pcie": 1, "cpu": 2, "nvme": 2, "total": 8}
    assert snap["hit_rate"] == 3 / 8 and snap["layers"][0]["hit_rate"] == 0.75 and snap["layers"][1]["hit_rate"] == 0
    assert snap["vram_slots"] == 10 and snap["vram_slots_in_use"] == 5 and snap["layers"][1]["slots_in_use"] == 5
    assert snap["admissions"] == 1 and snap["evictions"] == 1 and snap["bytes"]["ram_to_vram"] == 100
    assert snap["wait_seconds"]["pcie"] == 0.5
    assert TierStats(1, [1]).snapshot()["hit_rate"] is None
    with pytest.raises(KeyError):
        s.add_bytes("sideways", 1)
