"""The cache policy's lab: a baseline policy and a replay of routing traces, for tests only.

LruPolicy is the baseline the scored policy must beat; `simulate` replays a trace through the same
`choose_admissions` that ExpertTiers runs. `use_policy` gives built tiers another policy (the product always
runs glm53.tiers.policy.ScoredPolicy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from glm53.tiers.policy import Policy, choose_admissions


@dataclass
class LruPolicy:
    """Least recently used, always admitting: the baseline the scored policy must beat."""

    num_experts: int

    def __post_init__(self) -> None:
        self._last = np.full(self.num_experts, -1.0)
        self._picks = np.zeros(self.num_experts, np.float64)
        self._now = 0

    def observe(self, ids: np.ndarray, weight: float = 1.0) -> None:
        ids = np.asarray(ids).reshape(-1)
        self._now += 1
        self._last[ids] = self._now
        np.add.at(self._picks, ids, weight)

    def scores(self) -> np.ndarray:
        return self._last.copy()

    def admits(self, expert: int, victim: int) -> bool:
        return True

    def counts(self) -> np.ndarray:
        return self._picks.copy()

    def seed(self, counts: np.ndarray) -> None:
        self._picks = np.asarray(counts, np.float64).copy()


@dataclass(frozen=True)
class SimResult:
    hit_rate: float  # picks whose expert was resident at the start of their step / all picks
    admissions: int  # experts copied into a slot (each one PCIe copy)
    swaps: int  # admissions that displaced a resident (each also a write-back)


def simulate(trace: np.ndarray, policy: Policy, num_slots: int, warm: np.ndarray | None = None) -> SimResult:
    """Replay a routing trace (steps x picks, expert ids) against `policy` with `num_slots` slots.

    A pick hits when its expert was resident at the start of its step; misses are admitted by the same
    `choose_admissions` that ExpertTiers runs. `warm`: experts resident at the start, best first.
    """
    trace = np.asarray(trace)
    resident = np.zeros(policy.num_experts, bool)
    if warm is not None:
        resident[np.asarray(warm, np.int64)[:num_slots]] = True
    hits = admissions = swaps = 0
    for step in trace:
        hits += int(resident[step].sum())
        policy.observe(step)
        uniq = np.unique(step)
        misses = uniq[~resident[uniq]]
        free = num_slots - int(resident.sum())
        for e, v in choose_admissions(policy, resident, free, misses, uniq):
            if v is not None:
                resident[v] = False
                swaps += 1
            resident[e] = True
            admissions += 1
    return SimResult(hits / trace.size if trace.size else 0.0, admissions, swaps)


def use_policy(tiers, make: Callable[[int], Policy]) -> None:
    """Give freshly built ExpertTiers (before populate) one policy of make(num_experts) per layer."""
    tiers.ranking.use_policies([make(tiers.num_experts) for _ in range(tiers.num_layers)])
