"""The RAM victim search (weakest_droppable) against a brute force over every expert, on random tier states.

Scores come from a small set with +inf, so ties within and across layers are common; holds share tickets (as a
step's staged experts share its copy's), some landed and some not; guards and exclusions are random too.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_lab import use_policy

from glm53.tiers import ExpertTiers, SlotLayout, Where

LAYERS, EXPERTS = 3, 12
LAYOUT = SlotLayout.packed([("w", torch.float32, (2,))], align=16)
SCORES = (0.0, 1.0, 2.0, np.inf)


class SetPolicy:
    """observe(ids, weight) sets those experts' scores to `weight`: any scores, ties and +inf included."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._s = np.zeros(num_experts)

    def observe(self, ids: np.ndarray, weight: float = 1.0) -> None:
        self._s = self._s.copy()
        self._s[np.asarray(ids).reshape(-1)] = weight

    def scores(self) -> np.ndarray:
        return self._s

    def admits(self, expert: int, victim: int) -> bool:
        return False

    def counts(self) -> np.ndarray:
        return self._s.copy()

    def seed(self, counts: np.ndarray) -> None:
        self._s = np.asarray(counts, np.float64).copy()


class Ticket:
    """A copy in flight that counts how often it is asked whether it landed."""

    def __init__(self, landed: bool):
        self.landed, self.asked = landed, 0

    def done(self) -> bool:
        self.asked += 1
        return self.landed

    def wait(self) -> None:
        self.landed = True


def reference(tiers: ExpertTiers, holds: dict, exclude: dict[int, set[int]]) -> tuple[int, int] | None:
    """The lowest (score, layer, expert) among unguarded RAM experts no unlanded copy reads and not excluded;
    None when there is none or only ones scored +inf."""
    s = np.stack([p.scores() for p in tiers.policies])
    best = None
    for layer, e in zip(*np.nonzero((tiers.where == Where.RAM) & ~tiers.ram_guard), strict=True):
        layer, e = int(layer), int(e)
        t = holds.get((layer, e))
        if (t is not None and not t.landed) or e in exclude.get(layer, ()) or s[layer, e] == np.inf:
            continue
        if best is None or (s[layer, e], layer, e) < best:
            best = (float(s[layer, e]), layer, e)
    return None if best is None else best[1:]


ops = st.lists(st.tuples(st.sampled_from(("read", "land", "drop", "guard", "unguard", "observe", "hold", "release")),
                         st.integers(0, LAYERS - 1), st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=5),
                         st.sampled_from(SCORES)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, excludes=st.lists(st.dictionaries(st.integers(0, LAYERS - 1), st.sets(st.integers(0, EXPERTS - 1)),
                                                  max_size=LAYERS), min_size=1, max_size=3),
       seed=st.lists(st.sampled_from(SCORES), min_size=LAYERS * EXPERTS, max_size=LAYERS * EXPERTS))
def test_the_victim_search_names_what_a_brute_force_names(ops, excludes, seed) -> None:
    """After every operation and for each exclusion: the same victim as the reference, each distinct ticket asked at
    most once a search (a step's staged experts share one; on the GPU each ask is an event query), the holds of
    landed copies forgotten, and the victim can be dropped."""
    tiers = ExpertTiers(LAYOUT, EXPERTS, [2] * LAYERS, 2 * EXPERTS, keep_all=False, fetch=lambda lay, e, out: None)
    use_policy(tiers, SetPolicy)
    tiers.populate(lambda lay, e, out: None, np.array(seed).reshape(LAYERS, EXPERTS))
    holds: dict[tuple[int, int], Ticket] = {}
    where = tiers.where
    for i, (op, layer, es, score) in enumerate(ops):
        if op == "read":
            for e in es:
                if where[layer, e] == Where.STORE and tiers.begin_read(layer, e) is None:
                    break
        elif op == "land":
            for e in es:
                if where[layer, e] == Where.FROM_STORE:
                    tiers.land_read(layer, e)
        elif op == "drop":
            for e in es:
                t = holds.get((layer, e))
                if where[layer, e] == Where.RAM and (t is None or t.landed):
                    tiers.drop_ram(layer, e)
        elif op == "guard":
            for e in es:
                if where[layer, e] in (Where.RAM, Where.FROM_STORE):
                    tiers.guard(layer, e)
        elif op == "unguard":
            for e in es:
                tiers.unguard(layer, e)
        elif op == "observe":
            tiers.observe(layer, np.array(es), score)
        elif op == "hold":
            ram = [e for e in es if where[layer, e] == Where.RAM]
            t = Ticket(landed=i % 3 == 0)  # some copies have landed by the time anyone asks
            tiers.hold(layer, ram, t)
            if not t.landed:
                holds.update(dict.fromkeys(((layer, e) for e in ram), t))
        elif op == "release" and holds:
            next(iter(holds.values())).wait()
        tiers.check_invariants()
        for ex in excludes:
            want = reference(tiers, holds, ex)
            tickets = {id(t): t for t in tiers._held.values()}.values()
            before = {id(t): t.asked for t in tickets}
            assert tiers.weakest_droppable(ex) == want
            assert all(t.asked - before[id(t)] <= 1 for t in tickets), "a ticket was asked twice in one search"
            assert not any(t.landed for t in tiers._held.values()), "a landed copy's hold was kept"
        if want is not None and i % 4 == 0:
            tiers.drop_ram(*want)
            tiers.check_invariants()
