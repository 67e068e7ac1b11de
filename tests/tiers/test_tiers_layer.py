"""The tiers' own rules: scores and victim searches, borrowing staging slots, the plans they refuse, the EXL3 layout.
(A layer stepped through the tiers is tested on the real step: tests/step/test_step_layer.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_lab import LruPolicy, use_policy
from tier_experts import LAYOUT, build, check_contents, make_experts

from glm53.tiers import ExpertTiers, TierError, Where, exl3_expert_layout
from glm53.tiers.policy import ScoredPolicy


def test_scores_follow_the_policies_and_are_the_callers_to_keep() -> None:
    """The stacked scores the victim searches use are kept current through observe(), and what scores() hands out
    is a copy: a caller writing into it changes no decision."""
    experts = make_experts(3, 6, 6)
    tiers = build(experts, [1, 1, 1], keep_all=False, ram_slots=7)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]), np.arange(18.0).reshape(3, 6) % 5)

    def stacked() -> np.ndarray:
        return np.stack([p.scores() for p in tiers.policies])

    s0 = tiers.scores()
    assert np.array_equal(s0, stacked())
    s0[:] = -1.0
    assert np.array_equal(tiers.scores(), stacked())
    rng = np.random.default_rng(0)
    for step in range(30):
        tiers.observe(step % 3, rng.choice(6, (2, 2)))
        assert np.array_equal(tiers.scores(), stacked())
        ok = rng.random((3, 6)) < 0.4
        if ok.any():
            want = np.unravel_index(np.argmin(np.where(ok, stacked(), np.inf)), ok.shape)
            assert tiers.weakest(ok) == tuple(int(i) for i in want)


def test_ties_between_victims_go_to_the_lowest_layer_then_id() -> None:
    experts = make_experts(2, 6, 8)
    tiers = build(experts, [0, 0], keep_all=False, ram_slots=7)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]))  # no statistics: every score is 0
    ok = np.zeros((2, 6), bool)
    ok[1, 2] = ok[0, 5] = ok[1, 0] = True
    assert tiers.weakest(ok) == (0, 5)
    ok[0, 5] = False
    assert tiers.weakest(ok) == (1, 0)
    tiers.ranking.current()[:] = np.inf  # every expert scored +inf (a policy that pins them): still one of `ok`
    ok[1, 0] = False
    assert tiers.weakest(ok) == (1, 2)


def test_a_store_read_drops_unguarded_experts_first_and_never_a_protected_one() -> None:
    experts = make_experts(2, 6, 9)
    tiers = build(experts, [0, 0], keep_all=False, ram_slots=7)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]), np.arange(12.0).reshape(2, 6))
    in_ram = {(int(a), int(b)) for a, b in zip(*np.nonzero(tiers.where == Where.RAM), strict=True)}
    assert tiers.ram.free_count() == 0 and in_ram == {(0, 5)} | {(1, e) for e in range(6)}
    tiers.guard(1, 0)  # read ahead for a step to come: dropped last
    assert tiers.begin_read(0, 0, protect=np.array([5])) is not None  # protect names layer 0's experts
    assert tiers.where[1, 1] == Where.STORE and tiers.where[1, 0] == Where.RAM and tiers.where[0, 5] == Where.RAM
    for e in range(2, 6):  # now every unguarded one is protected: the weakest guarded one goes
        tiers.guard(1, e)
    tiers.land_read(0, 0)
    assert tiers.begin_read(0, 1, protect=np.array([0, 5])) is not None
    assert tiers.where[1, 0] == Where.STORE and not tiers.ram_guard[1, 0]
    tiers.land_read(0, 1)
    assert tiers.begin_read(0, 2, protect=np.arange(6)) is not None  # layer 1's guarded experts are fair game
    assert tiers.where[1, 2] == Where.STORE
    tiers.check_invariants()


class Flag:
    """A copy in flight that lands when the test says (or when someone waits for it)."""

    def __init__(self) -> None:
        self.landed = False

    def done(self) -> bool:
        return self.landed

    def wait(self) -> None:
        self.landed = True


def reference_victim(tiers: ExpertTiers, held: dict, exclude: dict[int, set[int]],
                     guarded: bool) -> tuple[int, int] | None:
    """The RAM victim by brute force over every expert: in RAM, read by no copy in flight, not excluded; unguarded
    ones first (guarded ones only when `guarded` and no other may go); the lowest (score, layer, expert)."""
    ok = tiers.where == Where.RAM
    for key, flag in held.items():
        if not flag.done():
            ok[key] = False
    for layer, es in exclude.items():
        ok[layer, sorted(es)] = False
    unguarded = ok & ~tiers.ram_guard
    if unguarded.any():
        ok = unguarded
    elif not guarded or not ok.any():
        return None
    s = np.stack([p.scores() for p in tiers.policies])
    return min((float(s[layer, e]), int(layer), int(e)) for layer, e in zip(*np.nonzero(ok), strict=True))[1:]


VICTIM_OPS = ("read", "land", "abort", "drop", "guard", "unguard", "observe", "hold", "release", "admit", "evict",
              "poll", "drop_weakest")
VL, VE = 3, 24
VICTIM_EXPERTS = make_experts(VL, VE, 11)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lru=st.booleans(), ops=st.lists(st.tuples(st.sampled_from(VICTIM_OPS), st.integers(0, 3) | st.integers(0, 2**20),
                                                  st.integers(0, 2**VE - 1)), min_size=4, max_size=80))
def test_the_victim_search_picks_what_a_search_over_every_expert_picks(lru, ops) -> None:
    """The weakest RAM expert kept per layer (as RAM experts land, go, are guarded and as the policies learn) makes
    the victim search name the expert a brute-force search over every expert names, ties included (LRU scores tie
    a lot, across layers too), under copies in flight, guards and exclusions; _drop_weakest drops exactly the
    reference's victim, guarded ones included when nothing else may go."""
    experts = VICTIM_EXPERTS
    tiers = build(experts, [1, 2, 1], keep_all=False, ram_slots=2 * VE + 3)
    use_policy(tiers, LruPolicy if lru else ScoredPolicy)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]), np.arange(VL * VE).reshape(VL, VE) % 3)
    held: dict[tuple[int, int], Flag] = {}

    def live_held() -> np.ndarray:
        m = np.zeros((VL, VE), bool)
        for key, flag in held.items():
            m[key] = not flag.done()
        return m

    where = tiers.where
    # Each op acts on an expert in the state it needs, picked among all of those weakest first (pick 0, which
    # hypothesis favours, is the weakest: the one a layer keeps as its weakest RAM expert), so few ops are no-ops.
    needs = {"read": lambda: where == Where.STORE, "land": lambda: where == Where.FROM_STORE,
             "abort": lambda: where == Where.FROM_STORE, "drop": lambda: (where == Where.RAM) & ~live_held(),
             "guard": lambda: ((where == Where.RAM) | (where == Where.FROM_STORE)) & ~tiers.ram_guard,
             "unguard": lambda: tiers.ram_guard,
             "hold": lambda: where == Where.RAM, "admit": lambda: where == Where.RAM,
             "evict": lambda: where == Where.VRAM}
    for op, pick, bits in ops:
        some = {x for x in range(VE) if bits >> x & 1}
        layer, e = pick % VL, pick // VL % VE
        if op in needs:
            scores = np.stack([p.scores() for p in tiers.policies])
            cands = sorted((float(scores[lay, x]), int(lay), int(x)) for lay, x in np.argwhere(needs[op]()))
            if not cands:
                continue
            _, layer, e = cands[pick % len(cands)]
        if op == "read":
            tiers.begin_read(layer, e, np.array(sorted(some), np.int64))
        elif op == "land":
            tiers.land_read(layer, e)
        elif op == "abort":
            tiers.abort_read(layer, e)
        elif op == "drop":
            tiers.drop_ram(layer, e)
        elif op == "guard":
            tiers.guard(layer, e)
        elif op == "unguard":
            tiers.unguard(layer, e)
        elif op == "observe":
            tiers.observe(layer, np.array(sorted(some | {e}))[None, :])
        elif op == "hold":
            flag, keys = Flag(), [(layer, x) for x in sorted({e} | some) if where[layer, x] == Where.RAM]
            tiers.hold(layer, [x for _, x in keys], flag)
            held.update(dict.fromkeys(keys, flag))
        elif op == "release" and held:
            list(held.values())[pick % len(held)].wait()
        elif op == "admit":
            vl = tiers.vram[layer]
            residents = np.flatnonzero(vl.resident())
            if vl.free_count() or residents.size:
                try:
                    tiers.admit(layer, e, None if vl.free_count() else int(residents[0]), protect=np.array([e]))
                except TierError:  # no RAM room for the victim's write-back
                    pass
        elif op == "evict":
            try:
                tiers.evict(layer, e)
            except TierError:
                pass
        elif op == "poll":
            tiers.poll()
        elif op == "drop_weakest":
            want = reference_victim(tiers, held, {layer: some}, guarded=True)
            before = where == Where.RAM
            assert tiers._drop_weakest(layer, np.array(sorted(some), np.int64)) == (want is not None)
            gone = {(int(a), int(b)) for a, b in zip(*np.nonzero(before & (where == Where.STORE)), strict=True)}
            assert gone == ({want} if want is not None else set())
        tiers.check_invariants()  # includes: each layer's kept weakest RAM expert is its weakest
        other = {x for x in range(VE) if bits >> (VE - 1 - x) & 1}
        for ex in ({}, {layer: {e}}, {layer: some}, {layer: some, (layer + 1) % VL: other}):
            assert tiers.weakest_droppable(ex) == reference_victim(tiers, held, ex, guarded=False)


def test_the_victim_search_follows_each_change_of_the_ram_tier() -> None:
    """Each way an expert becomes or stops being a candidate victim (guard, unguard, drop, a store read landing, an
    admission, a write-back landing, the policy learning) moves the search to the expert a full search names."""
    experts = make_experts(2, 6, 12)
    tiers = build(experts, [1, 1], keep_all=False, ram_slots=7)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]), np.array([[5.0, 4, 3, 2, 1, 0]] * 2))

    def victim() -> tuple[int, int] | None:
        tiers.check_invariants()
        got = tiers.weakest_droppable()
        assert got == reference_victim(tiers, {}, {}, guarded=False)
        return got

    assert victim() == (0, 4)  # RAM: 1-3 of both layers and (0, 4); VRAM: expert 0 of each
    tiers.guard(0, 4)
    assert victim() == (0, 3)
    tiers.unguard(0, 4)
    assert victim() == (0, 4)
    tiers.drop_ram(0, 4)
    assert victim() == (0, 3)
    assert tiers.begin_read(1, 5) is not None  # into the slot (0, 4) left
    tiers.land_read(1, 5)
    assert victim() == (1, 5)  # score 0
    tiers.admit(1, 5, victim=0)  # expert 0 of layer 1 is written back: (0, 3) made room for it
    assert tiers.where[0, 3] == Where.STORE and victim() == (1, 3)
    for _ in range(3):  # experts 1-5 picked: expert 0 (score 5 when it lands in RAM) is the weakest of each layer
        tiers.observe(0, np.arange(1, 6)[None, :])
        tiers.observe(1, np.arange(1, 6)[None, :])
    assert victim() == (1, 3)  # scores changed, their order did not
    tiers.evict(0, 0)  # (1, 3) made room for it
    assert tiers.where[1, 3] == Where.STORE
    tiers.poll()  # both write-backs land, and the admission
    assert tiers.where[0, 0] == Where.RAM and tiers.where[1, 0] == Where.RAM and tiers.where[1, 5] == Where.VRAM
    assert victim() == (0, 0)  # ties with (1, 0): the lower layer


def test_rejects_plans_that_break_the_rules() -> None:
    with pytest.raises(ValueError, match="spare"):
        ExpertTiers(LAYOUT, 8, [2], 6, keep_all=True)  # 8 - 2 = 6 leaves no slot for a write-back
    with pytest.raises(ValueError, match="fetch"):
        ExpertTiers(LAYOUT, 8, [2], 9, keep_all=False)
    with pytest.raises(ValueError, match="needs >= 9"):
        ExpertTiers(LAYOUT, 8, [2], 8, keep_all=False, fetch=lambda lay, e, out: None)
    experts = make_experts(1, 4, 3)
    tiers = build(experts, [1], keep_all=True)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]))
    with pytest.raises(TierError):
        tiers.admit(0, 2)  # the only slot is taken and no victim was named
    with pytest.raises(TierError):
        tiers.admit(0, 0)  # already in VRAM
    with pytest.raises(TierError):
        tiers.evict(0, 3)  # not in VRAM
    with pytest.raises(TierError):
        tiers.populate(lambda lay, e, out: None)


def test_exl3_layout_matches_the_model() -> None:
    layout = exl3_expert_layout()
    assert layout.nbytes == 9 * 2**20 + 36 * 2**10  # 9 MiB of 3-bit trellis + 36 KiB suh/svh, 256-aligned
    views = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
    assert views["gate.trellis"].shape == (256, 128, 48) and views["down.trellis"].shape == (128, 256, 48)
    assert views["down.svh"].dtype == torch.float16 and views["down.svh"].shape == (4096,)


# ---- staging that borrows cache slots (glm53.spec.borrowed_rows, ExpertTiers.borrow) --------------------------


@pytest.mark.parametrize("keep_all", [True, False])
def test_borrow_empties_lent_slots_keeps_the_experts_and_lends_them_until_given_back(keep_all):
    """all-RAM (keep_all) and nvme tiers: the experts of the borrowed slots go back to RAM."""
    experts = make_experts(3, 8, 5)
    vram = [4, 4, 4]
    need = 8 - 2  # a whole layer of 8 staging ids, 2 rows of their own
    ram = 24 - 12 + 9 + 1 if keep_all else 10
    tiers = build(experts, vram, keep_all, ram_slots=ram, staging_slots=8, staging_rows=2)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]))
    assert len(tiers.lent) == 9 and tiers.staging.shape[0] == 2
    rows0 = [tiers.staging_slot(i, 0) for i in range(8)]
    own = {tiers.vram[0].flat(s).data_ptr() for s in range(4)}
    assert not own & {r.data_ptr() for r in rows0[2:]}, "layer 0 borrowed its own cache slot"
    residents = {(lay, int(tiers.vram[lay].owner[s])) for lay, s in tiers.lending.borrowed[0][:need]}
    keep = [int(e) for e in np.flatnonzero(tiers.where[0] == Where.RAM)]  # layer 0's step copies these from RAM
    assert tiers.borrow(0, 8, keep=keep) == len(residents) == need
    for lay, e in residents:  # gone from VRAM into RAM (nvme: RAM dropped its weakest for each)
        assert tiers.where[lay, e] == Where.RAM
    assert all(tiers.where[0, e] == Where.RAM for e in keep), "RAM dropped an expert the borrowing step needs"
    for lay, s in tiers.lending.borrowed[0][:need]:  # lent: no admission may land in them while layer 0's kernels read
        assert tiers.vram[lay].owner[s] == -2 and tiers.vram[lay].free_count() < 4
    tiers.check_invariants()
    for i, r in enumerate(rows0):  # staging writes do not touch any resident
        r.copy_(experts[0, i])
    check_contents(tiers, experts)
    tiers.give_back_lent()
    assert all(tiers.vram[lay].owner[s] == -1 for lay, s in tiers.lending.borrowed[0][:need])
    assert tiers.borrow(0, 8) == 0  # emptied already: nothing to give up
    tiers.give_back_lent()
    tiers.check_invariants()


def test_nvme_borrow_drops_the_expert_itself_when_ram_may_drop_nothing():
    experts = make_experts(3, 8, 7)
    tiers = build(experts, [4, 4, 4], False, ram_slots=9, staging_slots=8, staging_rows=2)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]))
    ram = [(int(lay), int(e)) for lay, e in zip(*np.nonzero(tiers.where == Where.RAM), strict=True)]
    assert tiers.ram.free_count() == 0 and len(ram) == 9
    keep = {lay: {e for la, e in ram if la == lay} for lay in range(3)}  # every RAM expert is needed
    residents = {(lay, int(tiers.vram[lay].owner[s])) for lay, s in tiers.lending.borrowed[0][:6]}
    for lay in (1, 2):  # guard the other layers' RAM experts (prefetched for a coming step): soft, but enough here
        for e in keep[lay]:
            tiers.guard(lay, e)
    tiers.borrow(0, 8, keep=keep[0])
    assert sorted(ram) == sorted((int(lay), int(e)) for lay, e in zip(*np.nonzero(tiers.where == Where.RAM),
                                                                          strict=True))
    assert all(tiers.where[lay, e] == Where.STORE for lay, e in residents)
    tiers.give_back_lent()
    tiers.check_invariants()


def test_all_ram_tiers_need_room_for_the_lent_slots_experts():
    experts = make_experts(3, 8, 6)
    with pytest.raises(ValueError, match="lent to staging"):
        build(experts, [4, 4, 4], True, ram_slots=24 - 12 + 1, staging_slots=8, staging_rows=2)
