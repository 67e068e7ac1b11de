"""The host side of a layer step (glm53.step.stepper) on CPU tiers, with exllamav3's expert kernels emulated:
every pick's slot id must point at its own expert's bytes, the CPU lane's picks are masked and its partial makes
up the difference, store misses are read before use, and the next-layer lookahead moves (reads, prestages) and
scores predictions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nvme_support import make_store, nvme_spec, record
from test_cpu_lane import (
    HIDDEN,
    LANE_TOL,
    LAYOUT,
    NUM_EXPERTS,
    NUM_LAYERS,
    TOP_K,
    make_experts,
    reference_forward,
    rel_err,
)

from glm53.bench.copiers import GpuLikeCopier, HeldCopier
from glm53.cpu_lane.lane import CpuLane
from glm53.cpu_lane.planner import CpuSample, LiveFit, PcieSample
from glm53.step.stepper import FREE_RAM_SLOTS, MoeStepper, StepError, translate
from glm53.tiers import ExpertTiers, SlotLayout, Where

MAX_BSZN = 8  # exllamav3's decode row limit (checked by the adapter's contract)

# ---- translation ------------------------------------------------------------------------------------------------


def test_translate_maps_residents_staged_and_masked():
    slot_of = np.full(16, -1, np.int32)
    slot_of[[3, 7]] = [0, 1]
    ids = np.array([[3, 5, 7, 9], [9, 3, 11, 5]])
    out = translate(ids, slot_of, staged=[5, 9], staging_base=2, masked=[11], masked_id=99)
    assert out.tolist() == [[0, 2, 1, 3], [3, 0, 99, 2]]
    assert out.dtype == np.int64
    assert ids.tolist() == [[3, 5, 7, 9], [9, 3, 11, 5]]  # the input is not modified


def test_translate_refuses_a_pick_that_would_silently_vanish():
    slot_of = np.full(8, -1, np.int32)
    slot_of[1] = 0
    with pytest.raises(StepError, match=r"experts \[4\] are picked but neither resident nor staged"):
        translate(np.array([[1, 4]]), slot_of, staged=[], staging_base=1)
    with pytest.raises(StepError, match="both resident"):
        translate(np.array([[1]]), slot_of, staged=[1], staging_base=1)
    with pytest.raises(StepError, match="CPU lane but also resident"):
        translate(np.array([[1]]), slot_of, staged=[], staging_base=1, masked=[1], masked_id=9)


def test_translate_of_a_fully_staged_prefill_is_monotonic():
    # Prefill stages every picked expert in ascending id order: the id -> slot map preserves order, so exllamav3's
    # sort-by-expert paths group picks exactly as stock does.
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 288, (64, 8))
    uniq = np.unique(ids)
    out = translate(ids, np.full(288, -1, np.int32), staged=uniq.tolist(), staging_base=32)
    order_in, order_out = np.argsort(ids.ravel(), kind="stable"), np.argsort(out.ravel(), kind="stable")
    assert np.array_equal(order_in, order_out)


def test_the_sets_keep_free_is_handed_are_made_only_when_looked_up():
    from glm53.step.lookahead import LazySets

    made = []

    def maker(layer, experts):
        def make():
            made.append(layer)
            return set(experts)
        return make

    sets = LazySets({2: maker(2, [1, 5]), 7: maker(7, [])})
    assert len(sets) == 2 and sorted(sets) == [2, 7] and bool(sets) and made == []
    assert sets.get(3, ()) == () and sets.get(4) is None and made == []
    assert sets.get(2, ()) == {1, 5} and sets[2] == {1, 5} and sets.get(7) == set() and made == [2, 7]
    assert dict(sets) == {2: {1, 5}, 7: set()} and made == [2, 7]  # each made once
    with pytest.raises(KeyError):
        sets[3]


# ---- all-RAM tiers, exact ---------------------------------------------------------------------------------------


def _byte_tiers(num_layers=2, experts=16, slots=(3, 0), staging=16, copier=None):
    layout = SlotLayout.packed([("gate.trellis", torch.int16, (2, 2, 48)), ("gate.suh", torch.float16, (32,))])
    tiers = ExpertTiers(layout, experts, list(slots), num_layers * experts - sum(slots) + 4, device="cpu",
                        staging_slots=staging, pin=False, copier=copier)

    def fill(layer, e, out):  # every expert's image is distinct: byte b of (layer, e) = (layer*31 + e*7 + b) % 251
        out.copy_(torch.arange(out.numel(), dtype=torch.int64).add_(layer * 31 + e * 7).remainder_(251).to(torch.uint8))

    tiers.populate(fill)
    return tiers, fill


def slot_bytes(tiers, stepper: MoeStepper, li: int, s: int) -> torch.Tensor | None:
    """What exllamav3's kernel reads for slot id s of layer li: a cache slot, a staging slot, or nothing (masked)."""
    S = stepper.cache_slots[li]
    if s == stepper.masked_id(li):
        return None
    return tiers.vram[li].flat(s) if s < S else tiers.staging[s - S]


def test_every_pick_points_at_its_own_bytes():
    tiers, fill = _byte_tiers(copier=HeldCopier())
    stepper = MoeStepper(tiers, [3, 0], 16)
    rng = np.random.default_rng(3)
    want = torch.empty(tiers.layout.nbytes, dtype=torch.uint8)
    for step in range(200):
        li = step % 2
        rows = 1 if step % 5 else 12  # mostly decode (<= 8 rows), sometimes a prefill chunk
        ids = np.stack([rng.choice(16, 4, replace=False, p=np.r_[np.full(4, 0.15), np.full(12, 0.4 / 12)])
                        for _ in range(rows)])
        decode = rows <= MAX_BSZN
        step = stepper.resolve(li, ids, decode)
        slots = step.slots
        S = stepper.cache_slots[li]
        for e, s in zip(ids.ravel().tolist(), slots.ravel().tolist(), strict=True):
            fill(li, e, want)
            assert torch.equal(slot_bytes(tiers, stepper, li, s), want), f"step {step}: expert {e} -> slot {s}"
        if not decode:  # prefill: every pick staged in ascending id order
            assert (slots >= S).all()
            assert np.array_equal(np.argsort(ids.ravel(), kind="stable"), np.argsort(slots.ravel(), kind="stable"))
        tiers.check_invariants()
    snap = tiers.stats.snapshot()
    assert snap["admissions"] > 0 and snap["evictions"] > 0
    assert snap["picks"]["total"] == snap["picks"]["vram_hit"] + snap["picks"]["pcie"]
    assert snap["layers"][1]["hit_rate"] == 0  # no slots in layer 1: every pick crossed PCIe


def test_admissions_after_launch_copy_from_staging_and_every_pick_reads_its_bytes():
    """A decode step streams every PCIe miss, the GPU reads the staging rows,
    and only then (exllamav3's combine) are admissions chosen and copied on the device from those rows. Copies
    run in issue order and read their source when they run, as on a CUDA stream, so an admission chained on a
    staging copy still in flight, or a staging row refilled under a pending admission, shows in the bytes."""
    copier = GpuLikeCopier()
    tiers, fill = _byte_tiers(copier=copier)
    stepper = MoeStepper(tiers, [3, 0], 16)
    rng = np.random.default_rng(8)
    want = torch.empty(tiers.layout.nbytes, dtype=torch.uint8)
    for n in range(240):
        li = n % 2
        ids = np.stack([rng.choice(16, 4, replace=False, p=np.r_[np.full(4, 0.15), np.full(12, 0.4 / 12)])
                        for _ in range(int(rng.integers(1, 4)))])
        admissions = tiers.stats.snapshot()["admissions"]
        step = stepper.resolve(li, ids, True)
        assert tiers.stats.snapshot()["admissions"] == admissions, "nothing is admitted before the kernels are queued"
        copier.gpu_runs()  # the expert kernels: they wait for the step's copies, then read
        for e, s in zip(ids.ravel().tolist(), step.slots.ravel().tolist(), strict=True):
            fill(li, e, want)
            assert torch.equal(slot_bytes(tiers, stepper, li, s), want), f"step {n}: expert {e} -> slot {s}"
        stepper.after_launch()  # exllamav3's combine
        tiers.check_invariants()
    tiers.settle_all()
    for e in range(16):  # every resident's slot holds its own image
        s = int(tiers.vram[0].slot_of[e])
        if s >= 0:
            fill(0, e, want)
            assert torch.equal(tiers.vram[0].flat(s), want), f"resident {e} in slot {s}"
    snap = tiers.stats.snapshot()
    assert snap["admissions"] > 0 and snap["evictions"] > 0 and snap["picks"]["vram_hit"] > 0
    assert snap["bytes"]["ram_to_vram"] == 0, "an admission crossed PCIe a second time"
    assert snap["bytes"]["staging_to_vram"] == snap["admissions"] * tiers.layout.nbytes
    assert stepper.snapshot()["host_seconds"]["after_launch"] > 0


def test_more_misses_than_staging_slots_is_refused():
    tiers, _ = _byte_tiers(slots=(0, 0), staging=4)
    stepper = MoeStepper(tiers, [0, 0], 4, admit=False)
    with pytest.raises(StepError, match="exceed the 4 staging slots"):
        stepper.resolve(0, np.array([[0, 1, 2, 3], [4, 5, 6, 7]]), decode=True)


def _guess(rng, real: np.ndarray, right: float) -> np.ndarray:
    """A guess of the next step's picks: each real pick kept with probability `right`, else a random other id."""
    out = real.copy()
    for r in range(out.shape[0]):
        for k in range(out.shape[1]):
            if rng.random() >= right:
                others = [e for e in range(16) if e not in out[r]]
                out[r, k] = rng.choice(others)
    return out


def test_prestage_copies_guesses_ahead_into_rows_no_running_step_reads():
    """Exact with a prestage: each decode step guesses the next layer's picks and copies up to two of its misses
    into that layer's parity rows; the next step reads those from there instead of copying them. The copy stream
    is run to its end before every check (the worst case: it raced past the kernels), so a prestage into a row the
    stepping layer reads shows in the bytes. A prefill chunk between voids the guess."""
    from glm53.step.prestage import Prestage

    copier = GpuLikeCopier()
    tiers, fill = _byte_tiers(num_layers=3, slots=(3, 2, 2), copier=copier)
    pre = Prestage(dedicated_rows=16, top_k=4)  # demand rows 0-11, even layers' rows 12-13, odd layers' 14-15
    stepper = MoeStepper(tiers, [3, 2, 2], 16, prestage=pre)
    rng = np.random.default_rng(5)
    want = torch.empty(tiers.layout.nbytes, dtype=torch.uint8)

    def picks(rows):
        return np.stack([rng.choice(16, 4, replace=False) for _ in range(rows)])

    nxt = picks(1)
    saved = 0
    for n in range(300):
        li = n % 3
        ids, decode = nxt, n not in (100, 202)
        if not decode:
            ids = picks(12)  # a prompt chunk: its staging may use every row
        nxt = picks(1 if n % 7 else 3)
        pending = pre._pending[2] if pre._pending and pre._pending[0] == li else {}
        step = stepper.resolve(li, ids, decode)
        if decode:
            assert not set(pending) & set(step.staged), "a prestaged miss was copied again"
        if decode and li < 2 and nxt.shape[0] == ids.shape[0]:
            stepper.ahead(li + 1, _guess(rng, nxt, 0.6))
        copier.run_to(len(copier.queue) - 1)
        for e, s in zip(ids.ravel().tolist(), step.slots.ravel().tolist(), strict=True):
            fill(li, e, want)
            assert torch.equal(slot_bytes(tiers, stepper, li, s), want), f"step {n}: expert {e} -> slot {s}"
            saved += decode and s - stepper.cache_slots[li] in (12, 13, 14, 15)
        stepper.after_launch()
        tiers.check_invariants()
    snap = stepper.snapshot()["lookahead"]["prestage"]
    assert snap["staged"] > 0 and snap["used"] > 0 and snap["dropped"] > 0, snap
    assert saved >= snap["used"] > 0, "the prestaged experts a step picked are read from their reserved rows"
    la = stepper.snapshot()["lookahead"]
    assert la["steps"] > 0 and la["prefetched"] == snap["staged"]


def test_exact_guesses_ahead_only_while_the_prestage_judge_offers_it():
    """All-RAM modes run the next layer's router only for the prestage, in the windows its judge gives it; the
    judge times every decode step, and a verdict against it stops the guesses."""
    from glm53.step.prestage import Prestage, PrestageJudge

    tiers, _ = _byte_tiers(num_layers=2, slots=(3, 2))
    assert not MoeStepper(tiers, [3, 2], 16).wants_ahead(1), "no prestage: no router run ahead"
    now = [0.0]
    pre = Prestage(16, 4, judge=PrestageJudge(clock=lambda: now[0], window=2, pairs=1))
    stepper = MoeStepper(tiers, [3, 2], 16, prestage=pre)
    rng = np.random.default_rng(2)
    offered = []
    for n in range(12):
        li = n % 2
        if li == 0:
            offered.append(stepper.wants_ahead(1))
        stepper.resolve(li, rng.choice(16, (1, 4), replace=False), decode=True)
        if li == 0 and offered[-1]:
            stepper.ahead(1, rng.choice(16, (1, 4), replace=False))
        stepper.after_launch()
        now[0] += 2e-3 if offered[-1] else 1e-3  # steps with the prestage are slower here
    assert offered[:2] == [True, False] and pre.judge.trials == 1 and pre.judge.kept is False
    assert offered[2:] == [False] * 4 and pre.judge.last_ratio == pytest.approx(2.0)


def test_prestage_takes_only_the_step_it_was_made_for():
    from glm53.step.prestage import Prestage

    assert not Prestage.room(8, 8) and Prestage.room(12, 8)
    with pytest.raises(ValueError, match="no room"):
        Prestage(8, 8)
    pre = Prestage(dedicated_rows=24, top_k=8)
    assert pre.rows_of(0) == [20, 21] and pre.rows_of(1) == [22, 23] and pre.rows_of(4) == [20, 21]
    assert pre.fits(2) and not pre.fits(3)
    pre.put(3, 1, [7, 9, 11], "ticket")  # more guesses than rows: the first two
    assert pre.take(3, True, 1) == ({7: 22, 9: 23}, "ticket")
    assert pre.take(3, True, 1) == ({}, None), "taken once"
    for layer, decode, rows in [(4, True, 1), (3, False, 1), (3, True, 2), (3, True, 3)]:
        pre.put(3, 1, [7], "t")
        assert pre.take(layer, decode, rows) == ({}, None)
    assert pre.snapshot()["staged"] == 6 and pre.dropped == 4


# ---- fast mode: the CPU lane at the seam -----------------------------------------------------------------------


def lane_fit() -> LiveFit:
    """Costs under which the CPU lane takes a share of most steps (a CPU expert as dear as 1.25 PCIe experts)."""
    cpu = [CpuSample((1,) * n, 2, n * 0.5e-3) for n in (1, 2, 4)] + [CpuSample((1,), 1, 1e-3)]
    pcie = [PcieSample((1,) * n, n * 0.4e-3) for n in (1, 2, 4)]
    return LiveFit(cpu, pcie, threads=2)


def exl3_tiers(experts: torch.Tensor, vram: int) -> ExpertTiers:
    total = NUM_LAYERS * NUM_EXPERTS
    tiers = ExpertTiers(LAYOUT, NUM_EXPERTS, [vram] * NUM_LAYERS, total - vram * NUM_LAYERS + 2, keep_all=True,
                        staging_slots=NUM_EXPERTS + 1, pin=False)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]))
    return tiers


def emulate_layer(tiers, stepper: MoeStepper, li: int, x: torch.Tensor, ids: np.ndarray, w: torch.Tensor,
                  with_lane: bool = True) -> tuple[torch.Tensor, object]:
    """One decode step as exllamav3 runs it with our seam: route -> resolve -> GPU kernels over the slot ids
    (masked picks add exact zeros) -> combine adds the lane's partial."""
    step = stepper.resolve(li, ids, True, x.numpy(), w.numpy()) if with_lane else stepper.resolve(li, ids, True)
    y = torch.zeros((len(ids), HIDDEN), dtype=torch.float64)
    for t in range(len(ids)):
        for k in range(ids.shape[1]):
            src = slot_bytes(tiers, stepper, li, int(step.slots[t, k]))
            if src is None:
                assert int(ids[t, k]) in step.cpu
                continue
            y[t] += float(w[t, k]) * reference_forward(src, x[t : t + 1]).double()[0]
    if step.ticket is not None:
        y += torch.from_numpy(step.ticket.partial(len(ids))).double()
    return y, step


def direct(experts, li, x, ids, w) -> torch.Tensor:
    y = torch.zeros((len(ids), HIDDEN), dtype=torch.float64)
    for t in range(len(ids)):
        for k in range(ids.shape[1]):
            y[t] += float(w[t, k]) * reference_forward(experts[li, int(ids[t, k])], x[t : t + 1]).double()[0]
    return y


def recompute_with(experts):
    calls = []

    def recompute(li, e, x_rows):  # the exact path's stand-in: the reference from the expert's bytes
        calls.append((li, e))
        return reference_forward(experts[li, e], torch.from_numpy(x_rows)).float()

    return recompute, calls


def test_fast_mode_masks_the_lane_picks_and_adds_its_partial():
    experts = make_experts(4)
    tiers = exl3_tiers(experts, vram=3)
    recompute, calls = recompute_with(experts)
    rng = np.random.default_rng(5)
    with CpuLane(LAYOUT, threads=2, stats=tiers.stats) as lane:
        stepper = MoeStepper(tiers, [3] * NUM_LAYERS, NUM_EXPERTS + 1, lane=lane, fit=lane_fit(), recompute=recompute)
        lane_steps = 0
        for step in range(16):
            li = step % NUM_LAYERS
            rows = int(rng.integers(1, 4))
            ids = np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(rows)])
            x = torch.from_numpy(rng.standard_normal((rows, HIDDEN))).float()
            w = torch.from_numpy(rng.random((rows, TOP_K))).float()
            y, st = emulate_layer(tiers, stepper, li, x, ids, w)
            assert rel_err(y, direct(experts, li, x, ids, w)) < LANE_TOL, f"step {step}"
            masked = st.slots == stepper.masked_id(li)
            assert np.array_equal(masked, np.isin(ids, st.cpu)), "exactly the lane's picks are masked"
            for e in st.cpu:  # the lane only gets RAM experts, never one also staged or admitted
                assert tiers.where[li, e] == Where.RAM and e not in st.staged
            lane_steps += bool(st.cpu)
            tiers.check_invariants()
        snap = stepper.snapshot()
    assert lane_steps > 0
    picks = tiers.stats.snapshot()["picks"]
    assert picks["cpu"] > 0 and picks["pcie"] > 0 and picks["total"] == sum(picks[k] for k in ("vram_hit", "pcie",
                                                                                                  "cpu", "nvme"))
    assert snap["cpu_lane"]["jobs"] + snap["cpu_lane"]["recomputed_jobs"] > 0 and "last_assignment" in snap
    assert len(calls) == snap["cpu_lane"]["recomputed_jobs"]


@pytest.mark.parametrize("lane_step_s,kept", [(0.8e-3, True), (1.2e-3, False)])
def test_the_lane_stays_on_only_if_steps_offering_it_are_faster(lane_step_s, kept):
    """The judge times decode steps on a clock: windows offering the lane alternate with windows that do not; the
    lane stays on only when its steps were faster (here: 0.8 or 1.2 ms against 1 ms), and a set-aside lane's steps
    are exact-path steps (no lane picks, the input rows not needed)."""
    from glm53.step.lane_judge import LaneJudge

    experts = make_experts(4)
    tiers = exl3_tiers(experts, vram=3)
    recompute, _ = recompute_with(experts)
    fit = LiveFit([CpuSample((1,) * n, 2, n * 0.5e-3) for n in (1, 2, 4)] + [CpuSample((1,), 1, 1e-3)],
                  [PcieSample((1,) * n, n * 0.4e-3) for n in (1, 2, 4)], threads=2)
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=4, pairs=2)
    rng = np.random.default_rng(6)
    with CpuLane(LAYOUT, threads=2, stats=tiers.stats) as lane:
        stepper = MoeStepper(tiers, [3] * NUM_LAYERS, NUM_EXPERTS + 1, lane=lane, fit=fit, recompute=recompute,
                             lane_judge=judge)
        offered = []
        for step in range(40):
            li = step % NUM_LAYERS
            on = stepper.lane_in_use()
            offered.append(on)
            ids = np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(2)])
            x = torch.from_numpy(rng.standard_normal((2, HIDDEN))).float()
            w = torch.from_numpy(rng.random((2, TOP_K))).float()
            y, st = emulate_layer(tiers, stepper, li, x, ids, w, with_lane=on)
            assert rel_err(y, direct(experts, li, x, ids, w)) < LANE_TOL, f"step {step}"
            assert on or not st.cpu, "a step not offering the lane gives it nothing"
            now[0] += lane_step_s if on else 1e-3
        assert offered[:16] == [True] * 4 + [False] * 8 + [True] * 4, "the trial alternates windows (pairs: on-off, off-on)"
        assert all(o is kept for o in offered[16:]), "then the verdict holds"
        assert lane.alive, "set aside, not failed: the lane itself is fine"
        doc = stepper.snapshot()["cpu_lane"]
        assert doc["set_aside"] is not kept and doc["judge"]["kept"] is kept and doc["judge"]["trials"] == 1
        assert doc["judge"]["ratio_on_over_off"] == pytest.approx(lane_step_s / 1e-3)


def test_beside_the_lane_the_prestage_is_judged_first_and_its_experts_skip_the_lane():
    """Fast mode with a prestage: the prestage's first trial runs before the lane is offered (the lane's judge is not
    fed meanwhile), so the lane is then judged against the step with the prestage it kept; no guess is timed by both
    judges; a miss copied ahead is neither offered to the lane nor copied again. Every step's output stays the
    reference's."""
    from glm53.step.lane_judge import LaneJudge
    from glm53.step.prestage import Prestage, PrestageJudge

    experts = make_experts(4)
    tiers = exl3_tiers(experts, vram=3)
    recompute, _ = recompute_with(experts)
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=4, pairs=1)
    # 13 rows: demand in rows 0-8, steps of up to 2 token rows
    pre = Prestage(NUM_EXPERTS + 1, TOP_K, judge=PrestageJudge(clock=lambda: now[0], window=4, pairs=1))
    rng = np.random.default_rng(9)

    def picks():
        return np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(2)])

    with CpuLane(LAYOUT, threads=2, stats=tiers.stats) as lane:
        stepper = MoeStepper(tiers, [3] * NUM_LAYERS, NUM_EXPERTS + 1, lane=lane, fit=lane_fit(), recompute=recompute,
                             lane_judge=judge, prestage=pre)
        nxt, seen = picks(), []
        for step in range(80):
            li = step % NUM_LAYERS
            ids, nxt = nxt, picks()
            on = stepper.lane_in_use()
            state = (pre.judge.trials, judge.in_trial, judge._steps, judge.trials)
            guess = li + 1 < NUM_LAYERS and stepper.wants_ahead(li + 1)
            pending = set(pre._pending[2]) if pre._pending and pre._pending[0] == li else set()
            x = torch.from_numpy(rng.standard_normal((2, HIDDEN))).float()
            w = torch.from_numpy(rng.random((2, TOP_K))).float()
            y, st = emulate_layer(tiers, stepper, li, x, ids, w, with_lane=on)
            assert rel_err(y, direct(experts, li, x, ids, w)) < LANE_TOL, f"step {step}"
            assert not pending & (set(st.cpu) | set(st.staged)), "a miss copied ahead went to the lane or the link"
            if guess:
                stepper.ahead(li + 1, nxt)  # a perfect guess
            if state[0] == 0:
                assert not on and (judge._steps, judge.trials) == state[2:], "the lane ran before the prestage's verdict"
            seen.append((state[0], state[1], on, guess))
            stepper.after_launch()
            now[0] += 1e-3 - (0.2e-3 if on else 0.0) - (0.1e-3 if guess else 0.0)  # both pay: both kept
    assert pre.judge.trials >= 1 and pre.judge.kept and judge.kept
    assert any(t == 0 and g for t, _, _, g in seen), "the prestage's first trial guessed"
    assert any(t >= 1 and lt and on for t, lt, on, _ in seen), "the lane's trial came after it"
    assert any(t >= 1 and lt and g for t, lt, _, g in seen), "the kept prestage ran through the lane's trial"
    assert pre.used > 0 and tiers.stats.snapshot()["picks"]["cpu"] > 0


def test_a_kept_prestage_runs_through_the_lanes_later_trials_without_being_timed_there():
    """Once the prestage's judge has kept it, a trial of the lane's judge runs with it (the lane is judged against the
    step it would otherwise be), while the prestage's own judge is not fed during that trial; a prestage on a later
    trial of its own stays off through a lane trial."""
    from glm53.step.lane_judge import LaneJudge
    from glm53.step.prestage import Prestage, PrestageJudge

    experts = make_experts(4)
    tiers = exl3_tiers(experts, vram=3)
    recompute, _ = recompute_with(experts)
    now = [0.0]
    lane_judge = LaneJudge(clock=lambda: now[0], window=4, pairs=1, rejudge=3)
    pre = Prestage(NUM_EXPERTS + 1, TOP_K, judge=PrestageJudge(clock=lambda: now[0], window=4, pairs=1, rejudge=1000))
    rng = np.random.default_rng(3)

    def picks():
        return np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(2)])

    seen = []
    with CpuLane(LAYOUT, threads=2, stats=tiers.stats) as lane:
        stepper = MoeStepper(tiers, [3] * NUM_LAYERS, NUM_EXPERTS + 1, lane=lane, fit=lane_fit(), recompute=recompute,
                             lane_judge=lane_judge, prestage=pre)
        nxt = picks()
        for step in range(240):
            li = step % NUM_LAYERS
            ids, nxt = nxt, picks()
            on = stepper.lane_in_use()
            state = (lane_judge.in_trial and pre.judge.trials > 0, pre.judge.in_trial, pre.judge.kept)  # a lane trial
            fed = (pre.judge._steps, pre.judge._window_index, pre.judge.trials)
            guess = li + 1 < NUM_LAYERS and stepper.wants_ahead(li + 1)
            x = torch.from_numpy(rng.standard_normal((2, HIDDEN))).float()
            w = torch.from_numpy(rng.random((2, TOP_K))).float()
            y, _ = emulate_layer(tiers, stepper, li, x, ids, w, with_lane=on)
            assert rel_err(y, direct(experts, li, x, ids, w)) < LANE_TOL, f"step {step}"
            if guess:
                stepper.ahead(li + 1, nxt)  # a perfect guess
            stepper.after_launch()
            if state[0]:
                assert (pre.judge._steps, pre.judge._window_index, pre.judge.trials) == fed, \
                    "the prestage's judge was fed during a lane trial"
            seen.append((*state, guess))
            now[0] += 1e-3 - (0.2e-3 if on else 0.0) - (0.2e-3 if guess else 0.0)  # both pay: both kept
    assert lane_judge.trials >= 2 and pre.judge.kept
    assert any(lt and kept and not pt and g for lt, pt, kept, g in seen), "no prestage in a later lane trial"
    assert not any(lt and (pt or not kept) and g for lt, pt, kept, g in seen), "an undecided prestage ran in a lane trial"


def test_a_failing_lane_is_recomputed_then_bypassed():
    experts = make_experts(6)
    tiers = exl3_tiers(experts, vram=2)
    recompute, calls = recompute_with(experts)

    def broken(jobs, outs, done, cancel):
        raise RuntimeError("simulated kernel fault")

    rng = np.random.default_rng(7)
    with CpuLane(LAYOUT, threads=1, compute=broken) as lane:
        stepper = MoeStepper(tiers, [2] * NUM_LAYERS, NUM_EXPERTS + 1, lane=lane, fit=lane_fit(), recompute=recompute)
        outcomes = []
        for _ in range(6):
            ids = np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _row in range(2)])
            x = torch.from_numpy(rng.standard_normal((2, HIDDEN))).float()
            w = torch.from_numpy(rng.random((2, TOP_K))).float()
            y, st = emulate_layer(tiers, stepper, 0, x, ids, w)
            assert rel_err(y, direct(experts, 0, x, ids, w)) < LANE_TOL, "a failed lane step still adds every expert"
            outcomes.append(bool(st.cpu))
        assert not lane.alive and "simulated kernel fault" in lane.disabled_reason
    first = outcomes.index(True)
    assert not any(outcomes[first + 1 :]), "after the failure every miss goes over PCIe"
    assert calls, "the failed step's jobs were recomputed on the exact path"


def test_a_lane_needs_costs_and_the_exact_path():
    tiers, _ = _byte_tiers()
    with pytest.raises(ValueError, match="cost model"):
        MoeStepper(tiers, [3, 0], 16, lane=object())


# ---- nvme modes: misses through the record store -----------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("moe-step"), layers=3, experts=16)


def small_nvme_tier(packed):
    """The packed store's 2 MoE layers behind a 17-record RAM tier, 2 VRAM slots per layer and 16 staging rows."""
    from glm53.tiers.nvme_open import open_nvme_tier

    ck, store = packed
    plan = nvme_spec(store, ram_records=17, vram_slots=[2, 2], mode="nvme-exact", staging_slots=16)
    return open_nvme_tier(store, ck, plan, warm=False)


def test_nvme_exact_reads_store_misses_before_use_and_prefetches_ahead(packed):
    with small_nvme_tier(packed) as tier:
        tier.warm(None)
        tiers = tier.tiers
        stepper = MoeStepper(tiers, [2, 2], 16, nvme=tier)
        rng = np.random.default_rng(11)
        for step in range(40):
            li = step % 2
            rows = 1 if step % 4 else 10
            ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(rows)])
            decode = rows <= MAX_BSZN
            slots = stepper.resolve(li, ids, decode).slots
            for e, s in zip(ids.ravel().tolist(), slots.ravel().tolist(), strict=True):
                want = record(packed[1], tier.store_layers[li], e)
                got = slot_bytes(tiers, stepper, li, s).numpy().tobytes()
                assert got[: len(want)] == want, f"step {step}: expert {e} -> slot {s} holds other bytes"
            if decode and li == 0:  # guess layer 1's picks from nothing better than a coin: recall is scored
                stepper.ahead(1, rng.choice(16, 4, replace=False)[None, :])
            tier.check_invariants()
        snap = tiers.stats.snapshot()
        assert snap["picks"]["nvme"] > 0 and snap["picks"]["cpu"] == 0
        la = stepper.snapshot()["lookahead"]
        assert snap["prefetch"]["issued"] > 0 and la["steps"] > 0
        assert 0.0 <= la["recall"] <= 1.0
        assert la["prefetched"] == snap["prefetch"]["issued"]


def recording_prefetch(tier) -> list[list[tuple[int, int]]]:
    """Make `tier.prefetch` record each call's (layer, expert) list (then do it); returns the record."""
    asked: list[list[tuple[int, int]]] = []
    real_prefetch = tier.prefetch

    def prefetch(picks, **kw):
        asked.append(list(picks))
        return real_prefetch(asked[-1], **kw)

    tier.prefetch = prefetch
    return asked


def test_nvme_decode_steps_charge_the_store_idle_time_to_the_layer_before(packed, monkeypatch):
    """Each decode step marks the store's busy clock: the time since the step before, less what the store spent
    reading, is charged to that step's layer (after the last layer: the token's end). A prompt's step ends the
    chain, and a gap longer than STEP_GAP_S (between requests) is not charged. /stats shows the sums."""
    import time

    import glm53.tiers.nvme_meter as nvme_mod

    with small_nvme_tier(packed) as tier:
        tier.warm(None)
        busy = [0.0]
        monkeypatch.setattr(tier.reader, "busy_seconds", lambda: busy[0])
        stepper = MoeStepper(tier.tiers, [2, 2], 16, nvme=tier)
        ids = np.array([[0, 1]])
        for li in (0, 1):  # read once, so the steps below wait for nothing
            stepper.resolve(li, ids, True)
            stepper.after_launch()

        def gap(seconds: float, reading: float) -> None:
            t0 = time.perf_counter()
            time.sleep(seconds)
            busy[0] += reading * (time.perf_counter() - t0)

        tier.idle_after[:] = [0.0, 0.0]
        stepper.resolve(0, ids, False)  # a prompt's step: no gap is charged across it
        stepper.resolve(0, ids, True)
        stepper.after_launch()
        gap(0.08, 0.25)  # layer 0's step to layer 1's: the store idle 3/4 of it
        stepper.resolve(1, ids, True)
        stepper.after_launch()
        gap(0.08, 1.0)  # the token's end: the store reading throughout
        stepper.resolve(0, ids, True)
        stepper.after_launch()
        assert tier.idle_after[0] == pytest.approx(0.06, abs=0.015)
        assert tier.idle_after[1] == pytest.approx(0.0, abs=0.01)
        monkeypatch.setattr(nvme_mod, "STEP_GAP_S", 0.05)
        gap(0.08, 0.0)  # longer than STEP_GAP_S: between requests, not charged
        stepper.resolve(1, ids, True)
        stepper.after_launch()
        assert tier.idle_after[0] == pytest.approx(0.06, abs=0.015)
        assert tier.read_summary()["idle_after_layer_s"] == [round(v, 4) for v in tier.idle_after]


def test_nvme_reads_ahead_only_the_guess_ranks_that_are_usually_right(packed):
    """On a store that is the bottleneck (busy all the time), prefetch spends the time needed reads wait for: once
    the live precision says ranks 2 and 3 of the guess are usually wrong, only ranks 0 and 1 are read ahead, most
    likely first. The less busy the store, the lower the precision a rank needs: load / (1 + load)."""
    with small_nvme_tier(packed) as tier:
        load = [1.0]
        tier.load = lambda: load[0]
        tier.guess_saving = lambda: 1.0  # every right guess read in time (the next test varies it)
        stepper = MoeStepper(tier.tiers, [2, 2], 16, nvme=tier)
        asked = recording_prefetch(tier)
        rng = np.random.default_rng(3)
        for step in range(12):  # ranks 0, 1 always right; rank 2 every third step; rank 3 never
            guess = rng.choice(16, 4, replace=False)
            stepper.ahead(1, guess[None, :])
            others = [e for e in range(16) if e not in guess]
            real = np.array([[guess[0], guess[1], guess[2] if step % 3 == 0 else others[0], others[1]]])
            stepper.resolve(1, real, True)
            stepper.after_launch()
            tier.check_invariants()
        assert [round(p, 2) for p in stepper.rank_precision()] == [0.93, 0.93, 0.36, 0.07]
        for load[0], ranks in ((1.0, 2), (0.25, 3), (0.0, 4)):
            asked.clear()
            stepper.ahead(1, np.array([[9, 4, 7, 2]]))
            assert asked == [[(1, e) for e in (9, 4, 7, 2)[:ranks]]], f"store load {load[0]}"
            assert stepper.snapshot()["lookahead"]["guess_floor"] == pytest.approx(load[0] / (1 + load[0]), abs=1e-3)


def test_nvme_decode_queues_the_lookahead_reads_before_waiting_for_its_own(packed):
    """A record read takes several layers' GPU time: the next layer's guessed reads are queued while this step's
    own store reads are still in flight (not after they land), and never drop this step's experts."""
    from glm53.tiers.nvme_open import open_nvme_tier
    from glm53.tiers.tiers import FROM_STORE

    ck, store = packed
    plan = nvme_spec(store, ram_records=17, vram_slots=[2, 2], mode="nvme-exact", staging_slots=16)
    with open_nvme_tier(store, ck, plan, warm=False) as tier:
        stepper = MoeStepper(tier.tiers, [2, 2], 16, nvme=tier)
        seen = []

        def read_ahead(busy):
            where = tier.tiers.where[0]
            seen.append((sorted(busy), [int(where[e]) for e in busy]))
            stepper.ahead(1, np.array([[5, 6, 7, 8]]), busy=busy)

        step = stepper.resolve(0, np.array([[0, 1, 2, 3]]), True, read_ahead=read_ahead)  # a cold tier: all reads
        assert seen == [([0, 1, 2, 3], [int(FROM_STORE)] * 4)], "called once, with this step's reads in flight"
        assert stepper.prefetched > 0 and step.slots.size == 4
        assert all(int(tier.tiers.where[0][e]) != int(FROM_STORE) for e in range(4)), "its own reads landed"
        tier.check_invariants()
        # The plan's parts: each counted, none beyond the whole. (Whether the step then waited on the store depends
        # on the reader threads: on a loaded host the reads can land before the step looks, so it is not asserted.)
        hs = stepper.host_seconds
        parts = [hs["plan_reads"], hs["plan_copies"], hs["plan_slots"]]
        assert all(p > 0 for p in parts) and sum(parts) <= hs["plan"]


def test_after_launch_frees_ram_for_the_next_reads_but_never_the_steps_own_experts(tmp_path):
    """The step's experts may still be read from RAM after launch (the CPU lane's, or a lane job recomputed on
    the GPU): the weakest of them survives the RAM room made for the next step."""
    from glm53.tiers.nvme_open import open_nvme_tier

    ck, store = make_store(tmp_path, layers=3, experts=16)  # 2 MoE layers
    plan = nvme_spec(store, ram_records=17, vram_slots=[1, 1], mode="nvme-exact", staging_slots=16)
    with open_nvme_tier(store, ck, plan, warm=False) as tier:
        t = tier.tiers
        for e in range(16):
            t.fetch_to_ram(0, e)
        t.fetch_to_ram(1, 0)
        assert t.ram.free_count() == 0
        for _ in range(4):  # expert 0 of layer 0 is the weakest RAM expert
            t.observe(0, np.array([list(range(1, 9)), list(range(8, 16))]))
            t.observe(1, np.array([[0]]))
        stepper = MoeStepper(t, [1, 1], 16, nvme=tier, admit=False)
        stepper.resolve(0, np.array([[0]]), True)
        stepper.after_launch()
        assert t.ram.free_count() == FREE_RAM_SLOTS
        assert t.where[0, 0] == Where.RAM, "the step's own expert was dropped"
        tier.check_invariants()


def test_after_launch_keeps_the_steps_experts_and_the_guessed_ones_for_the_coming_layers(tmp_path):
    """The sets keep_free is handed after launch, each made as it is looked up, are what making them all at once
    gives: each pending guess's likely experts, and the step's own experts. Nothing is handed (and no set made)
    when the slots are already free."""
    from glm53.tiers.nvme_open import open_nvme_tier

    ck, store = make_store(tmp_path, layers=4, experts=16)  # 3 MoE layers
    plan = nvme_spec(store, ram_records=17, vram_slots=[1, 1, 1], mode="nvme-exact", staging_slots=16)
    with open_nvme_tier(store, ck, plan, warm=False) as tier:
        t = tier.tiers
        stepper = MoeStepper(t, [1, 1, 1], 16, nvme=tier, admit=False)
        real_keep_free, step_experts, handed = tier.keep_free, {}, []

        def keep_free(n, keep=None):
            assert t.ram.free_count() < n, "asked to make room where there is room"
            li, experts = step_experts["now"]
            want = {la: set(stepper._likely(g)) for la, g in stepper._near.pending.items()}
            want[li] = want.get(li, set()) | set(experts)
            assert dict(keep) == want
            handed.append(len(want))
            return real_keep_free(n, keep)

        tier.keep_free = keep_free
        rng = np.random.default_rng(3)
        for step in range(40):
            li = step % 3
            ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(2)])
            step_experts["now"] = (li, np.unique(ids).tolist())
            stepper.resolve(li, ids, True)
            if li + 1 < 3:  # the lookahead for the next layer, as the engine runs it before the bookkeeping
                stepper.ahead(li + 1, rng.choice(16, (2, 4)), busy=step_experts["now"][1])
            stepper.after_launch()
        assert 2 in handed  # the step's experts and a pending guess's


def test_a_step_with_no_store_read_starts_its_reads_ahead_after_launch_and_makes_room(tmp_path):
    """RAM full, the step's picks already in RAM: nothing to wait for, so the next layer's reads start after launch,
    where a few RAM slots are freed for the next step's reads, never the step's own experts nor the ones the guess
    for the next layer named."""
    from glm53.tiers.nvme_open import open_nvme_tier

    ck, store = make_store(tmp_path, layers=4, experts=16)  # 3 MoE layers
    plan = nvme_spec(store, ram_records=17, vram_slots=[1, 1, 1], mode="nvme-exact", staging_slots=16)
    with open_nvme_tier(store, ck, plan, warm=False) as tier:
        t = tier.tiers
        for e in range(4):
            t.fetch_to_ram(0, e)  # this step's picks, already in RAM
        for e in range(13):
            t.fetch_to_ram(1, e)  # RAM now full (17 records)
        assert t.ram.free_count() == 0
        stepper = MoeStepper(t, [1, 1, 1], 16, nvme=tier)
        near = np.array([[0, 1, 2, 3]])  # layer 1's guess: all in RAM already
        called = []

        def read_ahead(busy):  # what TieredMoE.step's closure does
            called.append(sorted(busy))
            stepper.ahead(1, near, busy=busy)

        stepper.resolve(0, np.array([[0, 1, 2, 3]]), True, read_ahead=read_ahead)
        assert called == [], "no store read to wait for: the reads ahead start after launch"
        stepper.after_launch()
        assert called == [[0, 1, 2, 3]]
        assert t.ram.free_count() == FREE_RAM_SLOTS, "room made for the next step's reads"
        assert all(t.where[0, e] < Where.STORE for e in range(4)), "the step's own experts were dropped"
        assert all(t.where[1, e] == Where.RAM for e in range(4)), "the guess's experts were dropped"
        tier.check_invariants()


def test_a_step_with_nothing_in_the_store_queues_no_read_but_settles_the_guesses_read_ahead_for_it(packed):
    """A decode step none of whose experts is in the store has no read to put in flight: the tier's demand is not
    asked, yet the guesses read ahead for its layer are settled as demand settles them (hits counted, guards
    released). A step that does need the store still goes through demand."""
    import time

    with small_nvme_tier(packed) as tier:
        tier.warm(None)
        t = tier.tiers
        stepper = MoeStepper(t, [2, 2], 16, nvme=tier)
        guess = [4, 5, 6, 7]
        assert all(t.where[1, e] == Where.STORE for e in guess + [8])
        assert stepper.ahead(1, np.array([guess])) == 4
        deadline = time.monotonic() + 10
        while any(t.where[1, e] != Where.RAM for e in guess) and time.monotonic() < deadline:
            tier.poll()
            time.sleep(0.001)
        demanded = []
        real_demand = tier.demand

        def demand(layer, experts, decode=True):
            demanded.append((layer, sorted(np.asarray(experts).tolist())))
            return real_demand(layer, experts, decode)

        tier.demand = demand
        stepper.resolve(1, np.array([guess]), True)
        stepper.after_launch()
        assert demanded == []
        assert t.stats.snapshot()["prefetch"]["hits"] == 4 and not tier.guesses.outstanding
        assert not t.ram_guard[1].any()
        tier.check_invariants()
        stepper.resolve(1, np.array([[4, 8]]), True)
        assert demanded == [(1, [4, 8])] and t.where[1, 8] == Where.RAM
        tier.check_invariants()


def test_nvme_prefill_reads_the_next_layer_ahead(packed):
    from glm53.tiers.nvme_open import open_nvme_tier

    ck, store = packed
    rng = np.random.default_rng(0)
    prompt = [np.stack([rng.permutation(16)[:4] for _ in range(10)]) for _ in range(2)]  # 10-row prefill chunks
    plan = nvme_spec(store, ram_records=24, vram_slots=[1, 1], mode="nvme-exact", staging_slots=16)
    with open_nvme_tier(store, ck, plan, warm=False) as tier:
        stepper = MoeStepper(tier.tiers, [1, 1], 16, nvme=tier)
        stepper.resolve(0, prompt[0], decode=False)
        assert stepper.prefetched > 0 and tier.tiers.stats.snapshot()["prefetch"]["issued"] == stepper.prefetched
        stepper.resolve(1, prompt[1], decode=False)  # its store reads were already under way
        pf = tier.tiers.stats.snapshot()["prefetch"]
        assert pf["hits"] + pf["late"] > 0
        tier.check_invariants()


def test_nvme_overlap_never_drops_a_ram_expert_a_copy_still_reads(packed, tmp_path):
    from glm53.tiers.nvme import NvmeTier
    from store.reader import StoreReader

    ck, store = packed
    copier = GpuLikeCopier()
    with NvmeTier(StoreReader(store, threads=2, verify=True, allow_buffered=True), 16, [1, 1], 17, layers=[1, 2],
                  copier=copier, staging_slots=16) as tier:
        tier.warm(None)
        stepper = MoeStepper(tier.tiers, [1, 1], 16, nvme=tier)
        rng = np.random.default_rng(4)
        held_seen = 0
        for step in range(60):
            li = step % 2
            ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(int(rng.integers(1, 3)))])
            st = stepper.resolve(li, ids, True)
            held = dict(tier.tiers._held)
            if st.staged:  # this step's staging copies are in flight: their sources are held
                assert all((li, e) in held for e in st.staged)
            # Before the "GPU" runs the step's copies, the host moves on: the next layer's prefetch makes room in RAM,
            # and must not take the slots those copies read from.
            stepper.ahead(1 - li, rng.choice(16, 6, replace=False)[None, :])
            for key, ticket in held.items():
                if not ticket.done():
                    assert tier.tiers.where[key] == Where.RAM, f"{key} dropped while a copy still reads it"
            held_seen += len(held)
            copier.gpu_runs()
            for e, s in zip(ids.ravel().tolist(), st.slots.ravel().tolist(), strict=True):
                got = slot_bytes(tier.tiers, stepper, li, s).numpy().tobytes()
                want = record(store, tier.store_layers[li], e)
                assert got[: len(want)] == want, f"step {step}: expert {e} -> slot {s}"
            tier.check_invariants()
        assert held_seen > 0


def test_a_store_read_failing_after_the_lane_started_cancels_the_lane_job(packed, monkeypatch):
    """nvme with the CPU lane, misses crossing PCIe before the store reads land: the lane's job is submitted before
    the step waits for its staged store misses. When one of those reads fails the step raises and nobody collects
    the lane's ticket, so it must be cancelled: left running, the lane would go on reading RAM rows that the
    following steps' store reads may reuse, and the next lane job would queue behind it."""
    import threading
    import types

    import store.reader as R
    from glm53.tiers.nvme import NvmeTier
    from store.errors import StoreError
    from store.reader import StoreReader

    ck, store = packed
    started, cancelled = threading.Event(), threading.Event()

    def compute(jobs, outs, done, cancel):  # a lane job that runs until it is told to stop
        started.set()
        for _ in range(500):
            if cancel[0]:
                cancelled.set()
                return
            threading.Event().wait(0.01)

    with NvmeTier(StoreReader(store, threads=2, verify=True, allow_buffered=True, retries=0), 16, [1, 1], 17,
                  layers=[1, 2], copier=GpuLikeCopier(), staging_slots=16) as tier, \
            CpuLane(tier.layout, threads=1, compute=compute) as lane:
        t = tier.tiers
        tier.warm(None)
        stepper = MoeStepper(t, [1, 1], 16, nvme=tier, lane=lane, fit=lane_fit(), recompute=lambda *a: None)
        to_lane: list[int] = []

        def plan_lane(li, ids, misses):  # the lane takes what the test says (first nothing), the rest cross PCIe
            stepper.last_assignment = types.SimpleNamespace(cpu=list(to_lane), cpu_seconds=1.0)
            return list(to_lane), len(to_lane)

        monkeypatch.setattr(stepper, "_plan_lane", plan_lane)
        stepper.resolve(0, np.array([[3, 4]]), True)
        stepper.after_launch()
        ram = next(e for e in range(16) if t.where[0, e] == Where.RAM)
        bad = next(e for e in range(16) if t.where[0, e] == Where.STORE)
        to_lane.append(ram)
        real = R.StoreReader._check

        def fail_bad(reader, fut):  # the read of `bad` is found failed once the lane job runs
            if (fut.entry.layer, fut.entry.expert) == (1, bad):
                started.wait(5)
                return "I/O error: Input/output error", False
            return real(reader, fut)

        monkeypatch.setattr(R.StoreReader, "_check", fail_bad)
        with pytest.raises(StoreError):
            stepper.resolve(0, np.array([[ram, bad]]), True, np.zeros((1, 256), np.float32),
                            np.ones((1, 2), np.float32))
        assert started.is_set() and cancelled.wait(2), "the failed step's lane job was left running"


@pytest.mark.parametrize("spare", [0, FREE_RAM_SLOTS, FREE_RAM_SLOTS + 2 * 4])
def test_a_ram_tier_holding_the_rest_reads_nothing_once_warm_only_with_the_spare_rows(tmp_path, spare):
    """nvme-exact with RAM for every expert outside VRAM: with the admissions' spare rows and the rows each decode
    step keeps free on top (what the plan sizes, glm53.planning.plan), steady decode reads nothing from the store; short of
    them, the room made for admissions' victims and the next reads drops experts that are soon read again."""
    from glm53.tiers.nvme_open import open_nvme_tier

    ck, store = make_store(tmp_path, layers=3, experts=16)  # 2 MoE layers
    slots = [4, 4]
    plan = nvme_spec(store, ram_records=32 - 8 + spare, vram_slots=slots, mode="nvme-exact", staging_slots=16)
    rng = np.random.default_rng(4)
    with open_nvme_tier(store, ck, plan, warm=False) as tier:
        stepper = MoeStepper(tier.tiers, slots, 16, nvme=tier)  # VRAM fills by admission (a cold start)

        def decode(steps: int) -> int:
            before = tier.stats.snapshot()["picks"]["nvme"]
            for _ in range(steps):
                for li in range(2):  # 4 picks a step
                    stepper.resolve(li, rng.choice(16, size=(1, 4), replace=False), True)
                    stepper.after_launch()
            return tier.stats.snapshot()["picks"]["nvme"] - before

        decode(40)  # every expert read once
        steady = decode(100)
        tier.check_invariants()
    assert (steady == 0) == (spare == FREE_RAM_SLOTS + 2 * 4), f"{steady} store reads in 100 warm steps, {spare} spare"


def test_nvme_prestage_copies_behind_the_steps_own_and_holds_its_ram_sources(tmp_path):
    """nvme-exact with a prestage: a guess made while the step's store reads are queued (inside resolve) is copied
    only once the step's own copies are queued, so it never delays them on the copy stream; a guess made after
    launch (a step with nothing to read) is copied then. While a prestage copy is in flight its RAM sources are
    held (a store read may not take their slots), and every pick reads its own record's bytes with the copy stream
    run to its end before each check."""
    from glm53.step.prestage import Prestage
    from glm53.tiers.nvme import NvmeTier
    from store.reader import StoreReader

    ck, store = make_store(tmp_path, layers=4, experts=16)  # 3 MoE layers
    copier = GpuLikeCopier()
    with NvmeTier(StoreReader(store, threads=2, verify=True, allow_buffered=True), 16, [2, 2, 2], 30,
                  layers=[1, 2, 3], copier=copier, staging_slots=16) as tier:
        tier.warm(None)
        t = tier.tiers
        pre = Prestage(dedicated_rows=16, top_k=4)  # demand rows 0-11, reserved rows 12-15
        stepper = MoeStepper(t, [2, 2, 2], 16, nvme=tier, prestage=pre)
        reserved = {t.staging_slot(r, 0).data_ptr() for r in range(12, 16)}
        rng = np.random.default_rng(8)
        nxt = rng.choice(16, (1, 4), replace=False)
        inside = after = 0
        for n in range(240):
            li = n % 3
            ids, nxt = nxt, rng.choice(16, (1, 4), replace=False)
            guess = _guess(rng, nxt, 0.7)
            called = []

            def read_ahead(busy, li=li, guess=guess, called=called):  # what TieredMoE.step's closure does
                called.append(stepper.ahead(li + 1, guess, busy=busy))

            q0, staged0 = len(copier.queue), pre.staged
            step = stepper.resolve(li, ids, True, read_ahead=read_ahead if li < 2 else None)
            queued = [copier.queue[i][0].data_ptr() in reserved for i in range(q0, len(copier.queue))]
            assert queued == sorted(queued), f"step {n}: a prestage copy went ahead of the step's own"
            inside += (pre.staged - staged0) if called else 0
            if pre._pending is not None and not pre._pending[3].done():
                assert all(t._held.reads(li + 1, e) for e in pre._pending[2]), "a prestage source is not held"
            staged1 = pre.staged
            stepper.after_launch()
            after += pre.staged - staged1
            copier.run_to(len(copier.queue) - 1)
            for e, s in zip(ids.ravel().tolist(), step.slots.ravel().tolist(), strict=True):
                want = record(store, tier.store_layers[li], e)
                got = slot_bytes(t, stepper, li, s).numpy().tobytes()
                assert got[: len(want)] == want, f"step {n}: expert {e} -> slot {s} holds other bytes"
            tier.check_invariants()
        snap = stepper.snapshot()["lookahead"]["prestage"]
        assert inside > 0 and after > 0, (inside, after)
        assert snap["used"] > 0 and snap["staged"] == inside + after, snap
