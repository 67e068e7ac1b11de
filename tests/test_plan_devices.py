"""The plan on fake multi-GPU hosts (issue 28): the layer split across cards, each card's slots and budget.

A split is checked against what it must hold: contiguous layers covering the model, every card's share fitting
its budget, the fewest slots per MoE layer as large as any split allows (brute force on two cards), and the
context the settings ask for (262,144 tokens on two 24 GB cards). One GPU keeps today's plan.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from fakehost import A6000, DUAL_3090, MIXED_3090_4090, QUAD_3090, RTX3090, WITH_SMALL, HostSpec, write_host
from test_plan import cli, run, settings

from glm53.planning import devices as D
from glm53.planning import host as H
from glm53.planning import plan as P
from glm53.planning import shape as M
from glm53.planning import split as X
from glm53.planning import units as U
from glm53.planning.spec import PAGE, engine_spec

H200 = ("NVIDIA H200", 143771, 142000, 5, 16)
FULL = {"GLM53_CONTEXT": "262144"}


def check_split(p: P.Plan, shape: M.ModelShape = M.DEFAULT_SHAPE) -> None:
    """The invariants every multi-card plan keeps (shares cover the model in order; slots add up)."""
    spec = p.engine
    D.check_shares(spec.devices, shape.layers, shape.moe_layers, spec.vram_slots or None)
    assert [d["layers"] for d in p.devices] == [[s.first_layer, s.last_layer] for s in spec.devices]
    assert p.vram_slots == sum(d["vram_slots"] for d in p.devices)
    assert p.device == spec.device == spec.devices[0].device


def test_one_gpu_keeps_its_plan_and_lists_one_device(tmp_path):
    p = run(tmp_path)
    # The reference box's numbers of the one-card plan (staging borrowing cache slots: tests/test_plan.py).
    assert (p.mode, p.vram_slots, p.vram_slots_per_layer, p.kv_tokens, p.ram_slots) == ("fast", 1391, 33, 131072,
                                                                                         10992)
    assert p.engine.devices == () and p.engine.to_json()["devices"] == []
    assert p.devices == [{"index": 0, "name": RTX3090[0], "vram_budget_bytes": p.vram_budget_bytes,
                          "layers": [0, 44], "vram_slots": 1391}]


def test_two_3090s_split_the_layers_and_reach_the_full_context(tmp_path):
    one = run(tmp_path / "one", **FULL)
    two = run(tmp_path / "two", HostSpec(gpus=DUAL_3090), **FULL)
    check_split(two)
    assert two.kv_tokens == 262144 and two.engine.context == 262144 and not two.warnings
    assert one.kv_tokens < 262144 or one.vram_slots_per_layer < two.vram_slots_per_layer
    assert [d["index"] for d in two.devices] == [0, 1] and two.devices[1]["device"] == "cuda:1"
    assert two.devices[0]["layers"][0] == 0 and two.devices[1]["layers"][1] == 44
    # Each card pays its own staging and reserve, and still holds more than twice one card's slots per layer.
    assert two.vram_slots_per_layer > 2 * one.vram_slots_per_layer
    assert two.vram_budget_bytes == 2 * one.vram_budget_bytes
    assert "2 GPUs, the decoder layers split" in two.reasons["gpu"] and "GPU 1 (" in two.reasons["gpu"]
    # Each card keeps a decode step's staging rows and lends its prefill the rest from its own cache slots.
    spec = two.engine
    assert spec.staging_slots == 288 and spec.dedicated_staging == 8 * spec.max_concurrency < 288
    lent = spec.borrowed
    assert {lay < 21 for lay, _ in lent} == {True, False}  # both cards lend
    assert two.mode == "fast" and two.ram_slots == M.DEFAULT_SHAPE.experts - two.vram_slots + len(lent) + 16


def test_each_card_pays_the_plans_accounting(tmp_path):
    """The split prices every card with the one-card plan's terms: the embedding in host RAM, main's KV per token,
    the KDA state of the cache's sequences, and per card the reserve, the vision tower, the chunk's activations and
    its staging."""
    shape = M.DEFAULT_SHAPE
    p = run(tmp_path, HostSpec(gpus=DUAL_3090), **FULL)
    acc, n, spec = p.vram_accounting, len(p.devices), p.engine
    assert acc == {"always_used_weights": shape.always_used_bytes,
                   "kv_cache": (p.kv_tokens + PAGE) * shape.kv_bytes_per_token,
                   "kda_state": spec.max_concurrency * shape.state_bytes_per_seq,
                   "staging": n * spec.dedicated_staging * shape.expert_bytes,
                   "prefill_activations": n * P.prefill_activation_bytes(shape, spec.prefill_chunk)[0],
                   "reserve": n * P.vram_reserve()[0], "vision_tower": n * P.vision_tower_bytes(shape)[0],
                   "expert_slots": p.vram_slots * shape.expert_bytes}
    assert sum(acc.values()) <= p.vram_budget_bytes and p.ram_accounting["host_weights"] == shape.host_bytes
    assert spec.prefill_chunk in P.PREFILL_CHUNKS and "tokens: each chunk stages" in p.reasons["prefill_chunk"]
    assert "on each of the 2 cards" in p.reasons["reserve"] and p.reasons["sequences"].startswith(f"{spec.max_concurrency} ")
    costs = X.layer_costs(shape, spec.max_concurrency)
    assert sum(costs.kv_per_token) == shape.kv_bytes_per_token
    assert sum(costs.state) == spec.max_concurrency * shape.state_bytes_per_seq


def test_mixed_cards_get_uneven_shares(tmp_path):
    p = run(tmp_path / "a", HostSpec(gpus=(RTX3090, A6000)), **FULL)
    check_split(p)
    small, big = p.devices
    layers = [d["layers"][1] - d["layers"][0] + 1 for d in p.devices]
    assert layers[1] > layers[0] and big["vram_slots"] > 1.5 * small["vram_slots"]
    assert big["vram_budget_bytes"] > 2 * small["vram_budget_bytes"] - 1 * U.GIB
    # A 3090 beside a 4090: both serve, each with its own free VRAM as its budget.
    q = run(tmp_path / "b", HostSpec(gpus=MIXED_3090_4090), **FULL)
    check_split(q)
    assert [d["vram_budget_bytes"] for d in q.devices] == [24135 * U.MIB, 24080 * U.MIB]
    assert q.kv_tokens == 262144 and "NVIDIA GeForce RTX 4090" in q.reasons["gpu"]


def test_four_3090s(tmp_path):
    p = run(tmp_path, HostSpec(gpus=QUAD_3090), **FULL)
    check_split(p)
    assert len(p.devices) == 4 and p.kv_tokens == 262144
    per_layer = [d["vram_slots"] / (d["moe_layers"][1] - d["moe_layers"][0] + 1) for d in p.devices]
    # Balanced: equal cards get near-equal shares (whole layers: 10 or 11 MoE layers a card, so a card's share per
    # layer moves by ~1/10, and the first card's dense layers and the last's head differ too).
    assert max(per_layer) - min(per_layer) <= min(per_layer) / 6


def test_a_card_below_the_minimum_is_left_out_with_a_warning(tmp_path):
    p = run(tmp_path, HostSpec(gpus=WITH_SMALL))
    assert p.mode == "fast" and p.device == "cuda:0" and len(p.devices) == 1 and p.engine.devices == ()
    assert any("GPU 1 (NVIDIA GeForce RTX 4080" in w and "left out" in w for w in p.warnings)
    # Three cards, one small: the two big ones split, the small one is left out.
    q = run(tmp_path / "b", HostSpec(gpus=(RTX3090, ("NVIDIA GeForce RTX 4080", 16376, 15992, 4, 16), RTX3090)))
    check_split(q)
    assert [d["index"] for d in q.devices] == [0, 2] and any("GPU 1 (" in w for w in q.warnings)


def test_cuda_visible_devices_picks_the_cards(tmp_path):
    p = run(tmp_path, HostSpec(gpus=(RTX3090, RTX3090, A6000), cuda_visible="2,0"), **FULL)
    check_split(p)
    # CUDA's ordinals (what the engine opens), not nvidia-smi's: the A6000 is cuda:0 here.
    assert [d["index"] for d in p.devices] == [0, 1] and p.devices[0]["name"] == A6000[0]
    single = run(tmp_path / "one", HostSpec(gpus=(RTX3090, RTX3090), cuda_visible="1"))
    assert single.device == "cuda:0" and single.gpu_index == 1 and single.engine.devices == ()


def test_per_card_budget_and_stock_across_cards(tmp_path):
    p = run(tmp_path / "a", HostSpec(gpus=(H200, H200)), GLM53_VRAM_BUDGET_GB="24", **FULL)
    check_split(p)
    assert [d["vram_budget_bytes"] for d in p.devices] == [24 * U.GIB] * 2 and p.kv_tokens == 262144
    # Two whole H200s hold every expert: stock exllamav3, split by layers, no tiers.
    q = run(tmp_path / "b", HostSpec(gpus=(H200, H200)), **FULL)
    assert q.mode == "exact" and q.engine.engine == "stock" and q.ram_slots == 0 and len(q.engine.devices) == 2
    assert q.vram_slots == M.DEFAULT_SHAPE.experts and q.engine.staging_slots == 0


def test_context_lowered_when_the_cards_cannot_hold_it(tmp_path):
    p = run(tmp_path, HostSpec(gpus=DUAL_3090), GLM53_VRAM_BUDGET_GB="20", GLM53_CONTEXT="2000000")
    check_split(p)
    assert 4096 <= p.kv_tokens < 2000000 and p.kv_tokens % 256 == 0
    assert any("context lowered to" in w for w in p.warnings) and p.vram_slots_per_layer >= 8


def test_split_by_routing_statistics_within_each_card(tmp_path):
    shape = M.DEFAULT_SHAPE
    counts = np.random.default_rng(0).gamma(0.3, size=(shape.moe_layers, shape.experts_per_layer))
    facts = H.read_host(write_host(tmp_path, HostSpec(gpus=DUAL_3090)))
    plain = P.plan(facts, shape, settings(**FULL))
    stats = P.plan(facts, shape, settings(**FULL), routing=(counts, "saved"))
    check_split(stats)
    assert [d["vram_slots"] for d in stats.devices] == [d["vram_slots"] for d in plain.devices]
    assert len(set(stats.engine.vram_slots)) > 2 and "within each card" in stats.engine.split


def test_cli_json_has_devices(tmp_path):
    rc, out = cli(write_host(tmp_path, HostSpec(gpus=DUAL_3090)), GLM53_MODEL_DIR="/model", **FULL)
    assert rc == 0 and out["kv_tokens"] == 262144 and len(out["devices"]) == 2
    for d in out["devices"]:
        assert {"index", "name", "vram_budget_bytes", "layers", "vram_slots"} <= set(d)
    assert out["engine"]["devices"] == out["devices"]
    assert [g["cuda"] for g in out["facts"]["gpus"]] == [0, 1]


# ---------------------------------------------------------------- the split itself (pure)


def _brute(cards, costs, **kw):
    """Every contiguous split of two cards, priced the same way: the best fewest-slots-per-layer."""
    n, best = len(costs.weights), None
    sums = X._Sums(costs)
    for cut in range(1, n):
        a = sums.card(cards[0], 0, cut - 1, kw["tokens"], kw["overhead"], kw["eb"], kw["cap"])
        b = sums.card(cards[1], cut, n - 1, kw["tokens"], kw["overhead"], kw["eb"], kw["cap"])
        if a and b:
            lo = min(c.slots_per_layer for c in (a, b) if c.moe)
            best = lo if best is None else max(best, lo)
    return best


@pytest.mark.parametrize(("a", "b"), list(itertools.product((20, 24, 31, 48), (20, 24, 80))))
def test_split_fits_every_card_and_is_best(a, b):
    shape = M.DEFAULT_SHAPE
    costs = X.layer_costs(shape, 8)
    cards = [X.Card(0, "a", a * U.GIB), X.Card(1, "b", b * U.GIB)]
    eb, staging = shape.expert_bytes, shape.experts_per_layer
    overhead = P.vram_reserve()[0] + P.prefill_activation_bytes(shape, 2048)[0]  # what the plan charges each card
    s = X.best_split(cards, costs, tokens=131072, expert_bytes=eb, staging=staging, overhead=overhead,
                     cap=shape.experts_per_layer - 1)
    assert s is not None
    for c in s.cards:
        assert c.fixed + c.slots_per_layer * c.moe * eb <= c.card.budget
        assert c.slots_per_layer < shape.experts_per_layer
    assert [c.first for c in s.cards] == [0, s.cards[0].last + 1] and s.cards[-1].last == shape.layers - 1
    assert sum(c.moe for c in s.cards) == shape.moe_layers
    want = _brute(cards, costs, tokens=131072, overhead=overhead + staging * eb, eb=eb,
                  cap=shape.experts_per_layer - 1)
    assert min(s.slots_per_layer) == want
    # The KV of every MLA layer is priced once, on its own card.
    assert sum(c.kv for c in s.cards) == (131072 + PAGE) * shape.kv_bytes_per_token


def test_layer_costs_from_a_checkpoints_headers(tmp_path):
    from glm53.fixture.exl3 import write_exl3_checkpoint

    path = write_exl3_checkpoint(tmp_path / "ck", layers=4, dense_layers=1)
    shape = M.from_checkpoint(path)
    assert len(shape.layer_bytes) == shape.layers and shape.moe_layer_ids == tuple(range(1, shape.layers))
    costs = X.layer_costs(shape, 2)
    assert "from the checkpoint headers" in costs.how and costs.moe == (False, True, True, True)
    assert sum(costs.weights) + costs.edge == shape.always_used_bytes and costs.edge > 0


def test_engine_spec_refuses_shares_that_do_not_cover_the_model():
    share = D.DeviceShare(0, "g", 1 << 34, 0, 1, 0, 2, 8)
    ok = engine_spec("exact", moe_layers=4, experts_per_layer=16, top_k=4, vram_slots=4, kv_tokens=1024,
                     devices=(share, D.DeviceShare(0, "g", 1 << 34, 2, 3, 2, 2, 8)))
    assert [d.moe_first for d in ok.devices] == [0, 2] and D.moe_share_of(ok.devices, 4) == (0, 0, 1, 1)
    with pytest.raises(ValueError, match="in order without gaps"):
        engine_spec("exact", moe_layers=4, experts_per_layer=16, top_k=4, vram_slots=4, kv_tokens=1024,
                    devices=(share, D.DeviceShare(0, "g", 1 << 34, 3, 3, 2, 2, 8)))
    with pytest.raises(ValueError, match="holds 9 slots"):
        engine_spec("exact", moe_layers=4, experts_per_layer=16, top_k=4, vram_slots=4, kv_tokens=1024,
                    devices=(share, D.DeviceShare(0, "g", 1 << 34, 2, 3, 2, 2, 9)))
    with pytest.raises(ValueError, match="MoE layer 1"):
        engine_spec("exact", moe_layers=4, experts_per_layer=16, top_k=4, vram_slots=4, kv_tokens=1024,
                    devices=(share,))
