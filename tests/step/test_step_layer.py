"""A layer through the real step (resolve, the kernels over its slot ids, the combine, after_launch) equals the
direct all-experts computation, bit for bit in the exact modes, under random budgets and routings; hits, PCIe and
CPU-lane picks are counted where they were read from, lane picks move no bytes, prefill evicts nothing, and the
store's misses are read before use."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from step_layer import random_steps, step_layer
from test_cpu_lane import HIDDEN as EXL3_HIDDEN
from test_cpu_lane import LANE_TOL, reference_forward, rel_err
from test_cpu_lane import LAYOUT as EXL3_LAYOUT
from test_cpu_lane import make_experts as make_exl3_experts
from tier_experts import HIDDEN, build, check_contents, make_experts, swiglu

from glm53.bench.copiers import HeldCopier
from glm53.cpu_lane.lane import CpuLane
from glm53.cpu_lane.planner import CpuSample, LiveFit, PcieSample
from glm53.step.stepper import MoeStepper
from glm53.tiers import ExpertTiers, Where, direct_moe


@pytest.mark.parametrize("seed", range(6))
def test_the_step_equals_direct(seed: int) -> None:
    random_steps(seed, "cpu")


def test_hits_and_misses_are_counted_and_a_miss_admits_into_a_free_slot_first() -> None:
    experts = make_experts(1, 8, 0)
    tiers = build(experts, [2], keep_all=True, staging_slots=4)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]))  # no stats: experts 0, 1 in VRAM
    assert tiers.vram[0].router_map.tolist() == [0, 1, 2, 2, 2, 2, 2, 2]
    stepper = MoeStepper(tiers, [2], 4)
    x, w = torch.randn(1, HIDDEN), torch.ones(1, 3)
    ids = np.array([[0, 4, 5]])
    y, resolved = step_layer(tiers, stepper, 0, x, ids, w, swiglu)
    assert torch.equal(y, direct_moe(x, ids, w, lambda e: experts[0, e], swiglu))
    snap = tiers.stats.snapshot()
    assert snap["picks"]["vram_hit"] == 1 and snap["picks"]["pcie"] == 2 and resolved.staged == [4, 5]
    assert snap["bytes"]["ram_to_vram"] == 0, "an admission crossed PCIe a second time"
    # Free every slot but 0's: a miss then takes the free slot without displacing anyone.
    tiers.settle_all()
    for e in range(1, 8):
        if tiers.where[0, e] == Where.VRAM:
            tiers.evict(0, e)
    tiers.settle_all()
    evictions, admissions = tiers.stats.snapshot()["evictions"], tiers.stats.snapshot()["admissions"]
    ids = np.array([[0, 6, 7]])
    y, resolved = step_layer(tiers, stepper, 0, x, ids, w, swiglu)
    assert torch.equal(y, direct_moe(x, ids, w, lambda e: experts[0, e], swiglu))
    snap = tiers.stats.snapshot()
    assert resolved.staged == [6, 7] and snap["admissions"] > admissions and snap["evictions"] == evictions
    tiers.settle_all()
    assert tiers.where[0, 0] == Where.VRAM and tiers.where[0, 1] == Where.RAM
    assert (tiers.where[0] == Where.VRAM).sum() == 2
    tiers.check_invariants()
    check_contents(tiers, experts)


def test_lane_picks_move_no_bytes_and_are_counted_as_cpu(monkeypatch) -> None:
    experts = make_exl3_experts(6)
    num_layers, num_experts = experts.shape[:2]
    tiers = ExpertTiers(EXL3_LAYOUT, num_experts, [2] * num_layers, num_layers * num_experts, keep_all=True,
                        staging_slots=num_experts + 1, pin=False)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]))  # no stats: experts 0, 1 in VRAM
    fit = LiveFit([CpuSample((1,), 1, 1e-3)], [PcieSample((1,), 1e-3)], threads=1)
    with CpuLane(EXL3_LAYOUT, threads=1) as lane:
        stepper = MoeStepper(tiers, [2] * num_layers, num_experts + 1, lane=lane, fit=fit,
                             recompute=lambda li, e, x_rows: reference_forward(experts[li, e], torch.from_numpy(x_rows)))

        def plan_lane(li, ids, misses):  # every RAM miss to the lane
            stepper.last_assignment = types.SimpleNamespace(cpu=list(misses), cpu_seconds=1.0)
            return list(misses), sum(int((ids == e).sum()) for e in misses)

        monkeypatch.setattr(stepper, "_plan_lane", plan_lane)
        x = torch.from_numpy(np.random.default_rng(0).standard_normal((1, EXL3_HIDDEN))).float()
        w = torch.ones(1, 3)
        ids = np.array([[0, 4, 5]])
        y, resolved = step_layer(tiers, stepper, 0, x, ids, w, reference_forward)
    want = direct_moe(x, ids, w, lambda e: experts[0, e], reference_forward)
    assert resolved.cpu == [4, 5] and resolved.staged == []
    assert rel_err(y.double(), want.double()) < LANE_TOL
    snap = tiers.stats.snapshot()
    assert snap["picks"]["vram_hit"] == 1 and snap["picks"]["cpu"] == 2 and snap["picks"]["pcie"] == 0
    assert snap["bytes"]["ram_to_vram"] == 0 and snap["bytes"]["ram_to_staging"] == 0
    assert tiers.where[0, 4] == Where.RAM and tiers.where[0, 5] == Where.RAM, "a lane expert was admitted"


def test_prefill_streams_without_evicting() -> None:
    experts = make_experts(1, 8, 1)
    tiers = build(experts, [3], keep_all=True, staging_slots=8)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]), np.array([[9.0, 8, 7, 0, 0, 0, 0, 0]]))
    stepper = MoeStepper(tiers, [3], 8)
    ids, w = np.array([[3, 4, 5], [5, 6, 7]]), torch.rand(2, 3)
    x = torch.randn(2, HIDDEN)
    y, resolved = step_layer(tiers, stepper, 0, x, ids, w, swiglu, decode=False)
    assert resolved.staged == [3, 4, 5, 6, 7] and tiers.stats.snapshot()["admissions"] == 0
    assert sorted(np.flatnonzero(tiers.vram[0].resident()).tolist()) == [0, 1, 2]
    assert torch.equal(y, direct_moe(x, ids, w, lambda e: experts[0, e], swiglu))


def test_store_misses_are_read_before_use() -> None:
    experts = make_experts(2, 6, 2)
    tiers = build(experts, [1, 1], keep_all=False, ram_slots=7, staging_slots=6)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]))
    assert (tiers.where == Where.STORE).sum() == 2 * 6 - 2 - 7
    stepper = MoeStepper(tiers, [1, 1], 6)
    ids, w = np.array([[0, 2, 3, 4], [1, 3, 4, 5]]), torch.rand(2, 4)
    x = torch.randn(2, HIDDEN)
    y, _ = step_layer(tiers, stepper, 1, x, ids, w, swiglu)
    assert torch.equal(y, direct_moe(x, ids, w, lambda e: experts[1, e], swiglu))
    assert tiers.stats.snapshot()["picks"]["nvme"] >= 2 and tiers.stats.snapshot()["ram_drops"] >= 1
    tiers.settle_all()
    tiers.check_invariants()
    check_contents(tiers, experts)


def test_a_store_read_with_ram_full_of_write_backs_finds_room() -> None:
    """Evictions only ever add write-backs: with RAM full of them (none landed), a further eviction and a store
    read must still find room by letting the oldest land and dropping it."""
    experts = make_experts(2, 6, 5)
    tiers = build(experts, [5, 3], keep_all=False, ram_slots=7, copier=HeldCopier(), staging_slots=4)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]))
    for layer, e in [(1, 0), (1, 1), (1, 2), (0, 4), (0, 0), (0, 1), (0, 2)]:
        tiers.evict(layer, e)
    assert tiers.ram.free_count() == 0 and not (tiers.where == Where.RAM).any()
    tiers.evict(0, 3)
    stepper = MoeStepper(tiers, [5, 3], 4, admit=False)
    ids, w = np.array([[0, 3]]), torch.rand(1, 2)
    x = torch.randn(1, HIDDEN)
    y, _ = step_layer(tiers, stepper, 1, x, ids, w, swiglu)
    assert torch.equal(y, direct_moe(x, ids, w, lambda e: experts[1, e], swiglu))
    tiers.settle_all()
    tiers.check_invariants()
    check_contents(tiers, experts)
