"""Ranking: who leaves the RAM tier. Each layer's cache policy, the guards, and the weakest RAM expert of each layer.

The policies score every expert (glm53.tiers.policy); the RAM tier drops its weakest unguarded expert when it needs a
row (nvme modes: the store still has it). Guarded experts (read ahead for a step still to come) go last. The searches
run several times a layer step, so the ranking keeps, per layer, its weakest candidate and every candidate's score
up to date in place instead of searching all layers' experts each time: a drop costs about the same at 75 layers as
at 8.

The ranking reads the tiers' state array (`where`, shared with ExpertTiers) and never changes it: ExpertTiers tells
it when an expert becomes (`rank`) or stops being (`unrank`) a candidate.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from .policy import Policy, ScoredPolicy
from .states import FROM_STORE, RAM


class Ranking:
    def __init__(self, where: np.ndarray):
        """where: the tiers' (num_layers, num_experts) state array, read in place."""
        self.where = where
        num_layers, num_experts = where.shape
        self.num_experts = num_experts
        self.policies: list[Policy] = [ScoredPolicy(num_experts) for _ in range(num_layers)]
        # RAM experts to drop last (prefetched, not used yet): a soft guard, so a demand read is never refused.
        # Read-only outside: set with guard() and unguard(), which keep the victim orders below current.
        self._guard = np.zeros((num_layers, num_experts), bool)
        self.ram_guard = self._guard.view()
        self.ram_guard.flags.writeable = False
        # Every layer's policy scores stacked, for the victim searches (several a step, each needing all of them):
        # kept up to date in place, only the layers whose policy learned since being read again.
        self._scores: np.ndarray | None = None
        self._stale_scores: set[int] = set()
        # Each layer's weakest unguarded RAM expert (lowest score, then id) and its score (inf: none), kept as RAM
        # experts come, and found again (one pass over the layer) when the layer's policy learned or that expert went.
        self._victim = [-1] * num_layers
        self._victim_score = np.full(num_layers, np.inf)
        self._stale_victims: set[int] = set(range(num_layers))
        # Each unguarded RAM expert's score, inf for every other expert: what the victim passes take the argmin of.
        # Kept in place where an expert becomes or stops being a candidate, and rebuilt only for the layers whose
        # policy learned (_stale_rows, a subset of _stale_victims): a drop, several a step, then costs its layer one
        # argmin instead of building the masks again.
        self._cand = np.full((num_layers, num_experts), np.inf)
        self._stale_rows: set[int] = set(range(num_layers))

    # ---- learning -------------------------------------------------------------------------------------------

    def use_policies(self, policies: Sequence[Policy]) -> None:
        """Rank by these policies (one per layer) from now on: every layer's scores are read again."""
        self.policies[:] = policies
        self._scores = None
        for layer in range(len(self.policies)):
            self.changed(layer)

    def seed(self, layer: int, counts: np.ndarray) -> None:
        self.policies[layer].seed(counts)
        self.changed(layer)

    def observe(self, layer: int, ids: np.ndarray, weight: float = 1.0) -> None:
        self.policies[layer].observe(ids, weight)
        self.changed(layer)

    def counts(self) -> np.ndarray:
        """(num_layers, num_experts) statistics to save for the next start's warm-up."""
        return np.stack([p.counts() for p in self.policies])

    def changed(self, layer: int) -> None:
        """The layer's policy learned: its scores and weakest RAM expert are found again when next needed."""
        self._stale_scores.add(layer)
        self._stale_rows.add(layer)
        self._stale_victims.add(layer)

    def current(self) -> np.ndarray:
        """Every layer's scores, stacked once and then kept up to date in place: the policies learn only through
        the ranking (observe, seed), which notes the layers to read again. Stacking every layer for each victim
        search would cost more than the search itself."""
        s = self._scores
        if s is None:
            s = self._scores = np.stack([p.scores() for p in self.policies])
        else:
            for layer in self._stale_scores:
                s[layer] = self.policies[layer].scores()
        self._stale_scores.clear()
        return s

    # ---- candidates -----------------------------------------------------------------------------------------

    def rank(self, layer: int, expert: int) -> None:
        """A RAM expert became a candidate victim (landed, or unguarded): is it its layer's weakest now?"""
        if self._guard[layer, expert]:
            return
        if layer not in self._stale_rows:  # else the row is rebuilt, from scores that may not be read yet
            self._cand[layer, expert] = self._scores[layer, expert]
        if layer in self._stale_victims:
            return
        s, weakest = self._scores[layer, expert], self._victim_score[layer]
        if s < weakest or (s == weakest and expert < self._victim[layer]):
            self._victim[layer], self._victim_score[layer] = expert, s

    def unrank(self, layer: int, expert: int) -> None:
        """A RAM expert stops being a candidate victim (dropped, admitted, guarded): if it was its layer's weakest,
        the layer's next weakest is found at the next search."""
        self._cand[layer, expert] = np.inf
        if self._victim[layer] == expert:
            self._stale_victims.add(layer)

    def guard(self, layer: int, expert: int) -> None:
        """Drop (layer, expert) only when nothing unguarded can go (read ahead for a step still to come)."""
        if not self._guard[layer, expert]:
            self._guard[layer, expert] = True
            if self.where[layer, expert] == RAM:
                self.unrank(layer, expert)

    def unguard(self, layer: int, expert: int) -> None:
        """End the guard (its layer ran, or the expert went): it is dropped by its score again."""
        if self._guard[layer, expert]:
            self._guard[layer, expert] = False
            if self.where[layer, expert] == RAM:
                self.rank(layer, expert)

    def forget_guard(self, layer: int, expert: int) -> None:
        """The expert left RAM, or is in use now (unranked already): the guard's job is done."""
        self._guard[layer, expert] = False

    # ---- victims --------------------------------------------------------------------------------------------

    def weakest_droppable(self, live: Sequence[tuple[int, int]],
                          exclude: Mapping[int, Collection[int]] | None = None) -> tuple[int, int] | None:
        """The RAM expert to drop while an unguarded one may go: the one `weakest` picks (lowest score, then
        layer, then id) among those not in `live` (read by a copy in flight), not guarded and not in `exclude`
        ({layer: experts}). None when there is none, or only ones scored +inf: then `weakest` over the full masks
        decides. Reads each layer's weakest candidate, kept current, rather than every layer's experts."""
        held = set(live)
        exclude = exclude or {}
        self._fresh_victims()
        score = self._victim_score
        instead: dict[int, int] = {}  # layer -> its weakest candidate that may go, where the kept one may not
        while True:
            # Each layer's entry is a lower bound of the score of its weakest candidate that may go, exact for the
            # layers in `instead` and where the kept one may go: the first lowest entry, once exact, is the victim.
            layer = int(score.argmin())
            if score[layer] == np.inf:
                return None
            if layer in instead:
                return layer, instead[layer]
            e, es = self._victim[layer], exclude.get(layer, ())
            if (layer, e) not in held and e not in es:
                return layer, e
            if not instead:
                score = score.copy()
            instead[layer], score[layer] = self._layer_weakest(layer, {x for lay, x in live if lay == layer}.union(es))

    def weakest(self, ok: np.ndarray) -> tuple[int, int]:
        """The (layer, expert) with the lowest score where `ok` (num_layers, num_experts) holds, the first in layer
        then expert order among equals; `ok` must hold somewhere. Searched among the `ok` ones only: where all of
        them score +inf, an argmin over the masked scores would name the first expert, ok or not."""
        flat = np.flatnonzero(ok)
        return divmod(int(flat[self.current().ravel()[flat].argmin()]), self.num_experts)

    def _fresh_victims(self) -> None:
        """Find the weakest RAM expert again in each layer whose scores changed or that lost it."""
        if self._stale_victims:
            if self._stale_rows:
                s = self.current()
                for layer in self._stale_rows:
                    self._cand[layer] = np.where((self.where[layer] == RAM) > self._guard[layer], s[layer], np.inf)
                self._stale_rows.clear()
            for layer in self._stale_victims:
                self._victim[layer], self._victim_score[layer] = self._layer_weakest(layer)
            self._stale_victims.clear()

    def _layer_weakest(self, layer: int, skip: Collection[int] = ()) -> tuple[int, float]:
        """The layer's unguarded RAM expert of lowest score (the lowest id among equals), none of `skip`, and its
        score: inf when there is none. Reads the layer's candidate scores, which must be current."""
        s = self._cand[layer]
        if skip:
            s = s.copy()
            s[list(skip)] = np.inf
        e = int(s.argmin())
        return e, float(s[e])

    # ---- invariants -------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The kept candidates and weakest experts agree with the scores and the states they were kept from."""
        where, guard = self.where, self.ram_guard
        assert not (guard & (where != RAM) & (where != FROM_STORE)).any(), \
            "a guard on an expert that is not (being read) in RAM"
        assert self._stale_rows <= self._stale_victims, "a layer's candidate scores outlived its kept victim"
        num_layers = where.shape[0]
        for layer in set(range(num_layers)) - self._stale_rows:
            want = np.where((where[layer] == RAM) & ~guard[layer], self._scores[layer], np.inf)
            assert np.array_equal(self._cand[layer], want), f"layer {layer}'s candidate scores are not current"
        for layer in set(range(num_layers)) - self._stale_victims:  # each kept weakest RAM expert is it
            assert layer not in self._stale_scores, f"layer {layer}'s weakest RAM expert outlived its scores"
            s = self._scores[layer]
            ram = np.flatnonzero((where[layer] == RAM) & ~guard[layer]).tolist()
            want = min([(s[e], e) for e in ram if s[e] < np.inf], default=(np.inf, None))
            got = (self._victim_score[layer], self._victim[layer] if self._victim_score[layer] < np.inf else None)
            assert got == want, f"layer {layer}'s weakest RAM expert is kept as {got}, not {want}"
