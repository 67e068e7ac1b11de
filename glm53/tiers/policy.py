"""Which experts deserve a VRAM slot: the per-layer cache policy and its admission rule.

Expert routing is skewed (about 11% of experts draw ~40% of picks) and drifts slowly with the text. LRU
reacts to every miss by evicting something, so a cold expert picked once pushes out a hot one that merely
skipped a few tokens, a weak policy for experts. Here every expert carries an
exponentially decayed pick count (frequency that forgets, so drift is followed) plus a short-lived recency
bonus (bursts are real), and a missed expert is admitted only when its score beats the weakest resident's by a
margin, so near-ties do not ping-pong 9 MiB copies across PCIe.

Everything here is pure numpy on per-layer arrays of `num_experts` entries: no torch, no devices. The same
`choose_admissions` drives both `ExpertTiers` and the tests' replay of a routing trace (tests/support/policy_lab.py),
so a replayed hit rate is the hit rate of the code that runs. The per-layer budgets (split_budget) and saved routing
statistics belong to the decision package: glm53.planning.spec, glm53.planning.routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Policy(Protocol):
    """A per-layer cache policy: it sees every step's picks and ranks experts for keeping."""

    num_experts: int

    def observe(self, ids: np.ndarray, weight: float = 1.0) -> None:
        """Record one routing step (all picks of all tokens of one forward of this layer)."""

    def scores(self) -> np.ndarray:
        """float64 (num_experts,): higher = more worth a slot. The weakest resident is the victim."""

    def admits(self, expert: int, victim: int) -> bool:
        """Whether missed `expert` should replace resident `victim` (called after observe of the miss)."""

    def counts(self) -> np.ndarray:
        """float64 (num_experts,): the pick statistics worth saving for the next start."""

    def seed(self, counts: np.ndarray) -> None:
        """Start from saved counts (warm start)."""


@dataclass
class ScoredPolicy:
    """Decayed frequency + recency, with margin-gated admission.

    score(e) = f(e) + recency_weight * 0.5 ** ((now - last(e)) / recency_half_life)
    where f(e) = sum over past picks of 0.5 ** (age / half_life), in picks; ages are in steps (decode tokens).
    The defaults are the best of a sweep over synthetic traces (glm53.bench.routing_trace.zipf_trace: drift every
    50-1000 steps, locality 0-2, seeds other than the test's): a half-life of 100 follows drift better than 200+
    and is steadier than 50; the recency bonus is worth ~1-2 points of hit rate when consecutive tokens share experts and costs nothing when they don't;
    a margin of 1 pick halves the slot swaps (each a write-back over PCIe) of margin 0.25 for <= 0.2 points of
    hit rate, and swaps ~20x less often than LRU.
    """

    num_experts: int
    half_life: float = 100.0
    recency_weight: float = 1.0
    recency_half_life: float = 2.0
    margin: float = 1.0

    def __post_init__(self) -> None:
        self._decay = 0.5 ** (1.0 / self.half_life)
        self._rdecay = 0.5 ** (1.0 / self.recency_half_life)
        self._freq = np.zeros(self.num_experts, np.float64)
        # 0.5 ** ((now - last) / recency_half_life), kept by the same per-step decay as the frequency (a pow over
        # every expert per step costs more than the rest of scoring); 0 means never picked.
        self._recent = np.zeros(self.num_experts, np.float64)
        self._now = 0
        self._scores: np.ndarray | None = None  # valid until the next observe/seed

    def observe(self, ids: np.ndarray, weight: float = 1.0) -> None:
        ids = np.asarray(ids).reshape(-1)
        self._now += 1
        # 288 multiplies per step is cheaper than lazy per-expert decay bookkeeping and exact at any age.
        self._freq *= self._decay
        # The same sums either way. A decode token's picks are distinct, and a fancy add then costs less than
        # np.add.at, which also releases the GIL (to the store reader threads, for a while) on the step's path.
        picks = ids.tolist()
        if len(set(picks)) == len(picks):
            self._freq[ids] += weight
        else:
            np.add.at(self._freq, ids, weight)
        self._recent *= self._rdecay
        self._recent[ids] = 1.0
        self._scores = None

    def scores(self) -> np.ndarray:
        """Read-only: computed once per step (choose_admissions and every admits() of a step share it)."""
        if self._scores is None:
            s = self._freq + self.recency_weight * self._recent
            s.flags.writeable = False
            self._scores = s
        return self._scores

    def admits(self, expert: int, victim: int) -> bool:
        s = self.scores()
        return bool(s[expert] > s[victim] + self.margin)

    def counts(self) -> np.ndarray:
        return self._freq.copy()

    def seed(self, counts: np.ndarray) -> None:
        counts = np.asarray(counts, np.float64)
        if counts.shape != (self.num_experts,):
            raise ValueError(f"seed counts have shape {counts.shape}, expected ({self.num_experts},)")
        self._freq = counts.copy()
        self._scores = None


def choose_admissions(
    policy: Policy, resident: np.ndarray, free_slots: int, misses: np.ndarray, protect: np.ndarray
) -> list[tuple[int, int | None]]:
    """Which missed experts to bring into VRAM this step, and whom each one displaces.

    resident: bool (num_experts,), landed residents of this layer. protect: experts the current step is using
    (they may not be evicted under the step that reads them). Misses are taken best-score first: free slots
    go first, then each miss is weighed against the weakest unprotected resident not yet displaced. When the
    best remaining miss cannot beat the weakest remaining victim, no lower miss can either, so we stop.
    Returns [(expert, victim or None)] in the order to issue the copies.
    """
    misses = np.asarray(misses, np.int64)
    if misses.size == 0:
        return []
    s = policy.scores()
    # A step misses a handful of experts: sorting them in Python beats numpy's per-call overhead. Best first;
    # equal scores keep their given order (sorted() stays stable with reverse=True).
    ids = misses.tolist()
    score = dict(zip(ids, s[misses].tolist(), strict=True))
    order = sorted(ids, key=score.__getitem__, reverse=True)
    take_free = min(free_slots, len(order))
    out: list[tuple[int, int | None]] = [(e, None) for e in order[:take_free]]
    rest = order[take_free:]
    if not rest:
        return out
    protect = np.asarray(protect, np.int64)
    # Most steps admit nothing: the best miss loses to the weakest victim. That one pair is an argmin, so decide
    # it before sorting every candidate (ties: the lower id first, as the stable sort below orders them).
    weak = np.where(resident, s, np.inf)
    weak[protect] = np.inf
    first = int(weak.argmin())
    if weak[first] < np.inf and not policy.admits(rest[0], first):
        return out
    eligible = resident.copy()
    eligible[protect] = False
    cand = np.flatnonzero(eligible)
    # Weakest first, the lower id among equals (as a stable argsort of the ascending ids; sorted() keeps the GIL).
    victims = [v for _, v in sorted(zip(s[cand].tolist(), cand.tolist(), strict=True))]
    for e, v in zip(rest, victims, strict=False):
        if not policy.admits(e, v):
            break
        out.append((e, v))
    return out


def hot_order(counts: np.ndarray) -> np.ndarray:
    """Experts of one layer, most picked first: the warm-start order (ties by lower id)."""
    return np.argsort(-np.asarray(counts, np.float64), kind="stable")
