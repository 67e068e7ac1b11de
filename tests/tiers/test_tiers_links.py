"""The tiers split across two devices (CPU tensors standing in): one link per device share, one RAM tier.

Each layer's VRAM slots, staging rows and copies belong to its layer's link; every output of the real step
(tests/support/step_layer.py) still equals the direct all-experts computation, and every copy a link issues lands in
its own layers' arenas, its own staging rows, or the shared RAM tier (write-backs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from step_layer import step_layer, stepper_for
from tier_experts import HIDDEN, LAYOUT, build, check_contents, make_experts, route, swiglu

from glm53.bench.copiers import HeldCopier
from glm53.tiers import direct_moe
from glm53.tiers.links import link_plan

LINK_OF = [0, 0, 1, 1]


def _inside(t: torch.Tensor, arena: torch.Tensor) -> bool:
    return arena.data_ptr() <= t.data_ptr() < arena.data_ptr() + arena.numel() * arena.element_size()


def watch(tiers) -> list[tuple[int, torch.Tensor]]:
    """Record (link, destination) of every copy each link's copier issues."""
    seen: list[tuple[int, torch.Tensor]] = []
    for i, link in enumerate(tiers.links):
        inner = link.copier.inner
        copy, many = inner.copy, inner.copy_many

        def rec_copy(dst, src, after=None, _i=i, _copy=copy):
            seen.append((_i, dst))
            return _copy(dst, src, after=after)

        def rec_many(pairs, _i=i, _many=many):
            seen.extend((_i, d) for d, _ in pairs)
            return _many(pairs)

        inner.copy, inner.copy_many = rec_copy, rec_many
    return seen


@pytest.mark.parametrize("seed", range(4))
def test_two_links_equal_direct_and_keep_their_copies_apart(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layers, experts_n, top_k = len(LINK_OF), 12, 4
    experts = make_experts(layers, experts_n, seed)
    keep_all = seed % 2 == 0
    vram = [int(v) for v in rng.integers(1, experts_n, layers)]
    ram = None if keep_all else experts_n + 1 + int(rng.integers(0, 12))
    # Staging for a whole layer: a decode step streams every miss (up to 4 tokens x top-4 of 12 experts).
    tiers = build(experts, vram, keep_all, ram, link_devices=["cpu", "cpu"], link_of=LINK_OF, staging_slots=experts_n)
    seen = watch(tiers)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]), rng.random((layers, experts_n)) if seed else None)
    assert len(tiers.links) == 2 and tiers.links[0].staging.data_ptr() != tiers.links[1].staging.data_ptr()
    stepper = stepper_for(tiers, experts_n)
    for _ in range(40):
        layer = int(rng.integers(layers))
        ids, w = route(rng, int(rng.integers(1, 5)), experts_n, top_k)
        x = torch.randn(len(ids), HIDDEN, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
        want = direct_moe(x, ids, w, lambda e, layer=layer: experts[layer, e], swiglu)
        stepper.admit = bool(rng.random() < 0.8)
        got, _ = step_layer(tiers, stepper, layer, x, ids, w, swiglu)
        assert torch.equal(got, want)
        tiers.check_invariants()
        check_contents(tiers, experts)
    ram_arena = tiers.ram.storage  # shared: write-backs from either link land here
    for i, dst in seen:
        mine = [tiers.vram[li].storage for li in range(layers) if LINK_OF[li] == i] + [tiers.links[i].staging]
        theirs = [tiers.vram[li].storage for li in range(layers) if LINK_OF[li] != i] + [tiers.links[1 - i].staging]
        assert not any(_inside(dst, a) for a in theirs if a.numel()), f"link {i} copied into another link's arena"
        assert any(_inside(dst, a) for a in mine if a.numel()) or _inside(dst, ram_arena)
    assert all(link.moved > 0 for link in tiers.links)
    assert sum(link.moved for link in tiers.links) == len(seen) * LAYOUT.nbytes  # CPU: every copy counts


def test_one_link_is_the_single_device_case() -> None:
    experts = make_experts(2, 8, 3)
    tiers = build(experts, [2, 2], keep_all=True)
    assert len(tiers.links) == 1 and tiers.link_of == [0, 0] and tiers.copier is tiers.links[0].copier
    assert tiers.staging is tiers.links[0].staging and tiers.staging_slot(1, 1) is tiers.links[0].rows[1]
    assert link_plan((), 2, "cuda:0") == (["cuda:0"], [0, 0])


def test_bad_link_maps_are_refused() -> None:
    experts = make_experts(2, 8, 4)
    with pytest.raises(ValueError, match="must name one of 2 links"):
        build(experts, [2, 2], keep_all=True, link_devices=["cpu", "cpu"], link_of=[0, 2])
    with pytest.raises(ValueError, match="must name one of 1 links"):
        build(experts, [2, 2], keep_all=True, link_of=[0])
    with pytest.raises(ValueError, match="an injected copier serves one link"):
        build(experts, [2, 2], keep_all=True, link_devices=["cpu", "cpu"], link_of=[0, 1], copier=HeldCopier())


def test_link_plan_from_device_shares() -> None:
    from glm53.planning.devices import DeviceShare

    shares = (DeviceShare(0, "a", 1, 0, 4, 0, 3, 9), DeviceShare(1, "b", 1, 5, 9, 3, 2, 6))
    assert link_plan(shares, 5, "cuda:0") == (["cuda:0", "cuda:1"], [0, 0, 0, 1, 1])
    assert link_plan(shares, 5, "cpu") == (["cpu", "cpu"], [0, 0, 0, 1, 1])  # the fake exllamav3's CPU runs


def test_each_layer_borrows_staging_only_from_its_own_links_layers():
    """Staging of 2 rows of its own per link and 8 ids per layer: a layer's other 6 are cache slots of the other
    layer on its own card, never of the other card's."""
    experts = make_experts(4, 8, 9)
    vram = [6, 6, 6, 6]
    tiers = build(experts, vram, True, ram_slots=32 - 24 + 24 + 1, staging_slots=8, staging_rows=2,
                  link_devices=["cpu", "cpu"], link_of=LINK_OF)
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]))
    assert all(link.staging.shape[0] == 2 for link in tiers.links)
    for li in range(4):
        other = [la for la in range(4) if la != li and LINK_OF[la] == LINK_OF[li]]
        rows = [tiers.staging_slot(i, li) for i in range(8)]
        assert all(_inside(r, tiers.link(li).staging) for r in rows[:2])
        assert all(any(_inside(r, tiers.vram[la].storage) for la in other) for r in rows[2:])
    tiers.borrow(0, 8)
    assert {lay for lay, _ in tiers.lending.lent_now} == {1}
    tiers.give_back_lent()
    check_contents(tiers, experts)
    tiers.check_invariants()
