"""The nvme tier on a real store packed from a generated checkpoint, CPU tensors standing in for VRAM: results of the
real step (glm53.step.stepper.MoeStepper with nvme=the tier, through tests/support/step_layer.py) equal the direct
computation from the checkpoint, prefetch lands before demand, start-up verifies and warms, budgets hold."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from nvme_support import (
    HIDDEN,
    Direct,
    check_bytes,
    make_store,
    nvme_spec,
    read_in_parts,
    route,
    slot_forward,
)
from step_layer import picks_of, step_layer, stepper_for

import store.read_timing as T
from glm53.planning.spec import FREE_RAM_SLOTS
from glm53.tiers import Where, exl3_expert_layout
from glm53.tiers.nvme import NvmeTier, model_key, record_layout
from glm53.tiers.nvme_open import StoreRefused, open_nvme_tier
from store.format import Layout, read_header
from store.reader import StoreReader

LAYERS, EXPERTS, TOP_K = 3, 16, 4  # 2 MoE layers (store layers 1, 2) of 16 experts


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("nvme"), layers=LAYERS, experts=EXPERTS)


@pytest.fixture(scope="module")
def direct(packed):
    return Direct(packed[0])


def settle_reads(tier: NvmeTier, timeout: float = 10.0) -> None:
    """Poll until no store read is in flight (the reader's threads finish on their own)."""
    deadline = time.monotonic() + timeout
    while tier._reads:
        assert time.monotonic() < deadline, "store reads did not land"
        tier.poll()
        time.sleep(0.001)


@pytest.mark.parametrize("seed, parts", [(s, None) for s in range(6)] + [(1, 4), (2, 1), (3, 4)])
def test_tiered_through_the_store_equals_direct(packed, direct, monkeypatch, seed, parts):
    """Random budgets (VRAM per layer, RAM records), warm or cold, decode and prefill steps, admissions, prefetches
    of predictions right or wrong: every layer output equals the direct computation bit for bit, every readable
    expert holds its record's bytes, and the arena never grows past the plan. parts: each record in that many parts
    (None: the count timed fastest at open)."""
    ck, store = packed
    rng = np.random.default_rng(seed)
    ram = int(rng.integers(EXPERTS + 1, EXPERTS + 6))  # a RAM tier smaller than the experts VRAM leaves out
    vram = int(rng.integers(0, 2 * EXPERTS // 2))
    plan = nvme_spec(store, ram, vram, staging_slots=EXPERTS)  # a step may stream up to a whole layer
    stats = None
    if seed % 2:
        stats = ck.parent / f"routing-{seed}.json"
        from glm53.planning.routing import save_routing_stats
        save_routing_stats(stats, rng.random((2, EXPERTS)) * 5, model_key(read_header(store)))
    if parts is not None:
        read_in_parts(monkeypatch, parts)
    with open_nvme_tier(store, ck, plan, stats_path=stats) as tier:
        assert tier.reader.pieces == (parts or 1)
        assert tier.budget_bytes <= plan.ram_slots * tier.stride
        tier.check_invariants()
        forward = slot_forward(tier.layout)
        stepper = stepper_for(tier.tiers, plan.staging_slots, nvme=tier)
        prefill_share = rng.random() / 2
        for _ in range(12):
            layer = int(rng.integers(2))
            ids, w = route(rng, int(rng.integers(1, 4)), EXPERTS, TOP_K)
            x = torch.from_numpy(rng.standard_normal((len(ids), HIDDEN)).astype(np.float32))
            stepper.admit = bool(rng.random() < 0.7)
            got, _ = step_layer(tier.tiers, stepper, layer, x, ids, w, forward,
                                decode=bool(rng.random() >= prefill_share))
            assert torch.equal(got, direct.moe(tier.store_layers[layer], x, ids, w))
            tier.check_invariants()
            nxt = 1 - layer
            guess = rng.choice(EXPERTS, TOP_K, replace=False)
            tier.prefetch([(nxt, int(e)) for e in guess])
            tier.check_invariants()
        settle_reads(tier)
        tier.check_invariants()
        check_bytes(tier, store)
        snap = tier.stats.snapshot()
        json.dumps(snap)
        nvme = snap["nvme"]
        landed = (nvme["reads"] + nvme["prefetch_reads"] + nvme["warm_reads"] - nvme["failed_reads"]
                  - nvme["cancelled_prefetches"])
        assert snap["bytes"]["store_to_ram"] == landed * tier.layout.nbytes
        assert tier.health() is None and tier.read_summary()["errors"] == 0


def test_record_layout_is_the_vram_slot_image():
    """At GLM-5.3-Flash width the store record's payload is exactly the tiers' EXL3 slot image, so a record read
    into RAM is one contiguous copy away from a VRAM slot."""
    assert record_layout(Layout.build(4096, 2048, (3, 3, 3))) == exl3_expert_layout()


def test_prefetch_lands_before_demand(packed, direct):
    ck, store = packed
    with open_nvme_tier(store, ck, nvme_spec(store, 2 * EXPERTS, 0, staging_slots=EXPERTS)) as tier:
        forward = slot_forward(tier.layout)
        stepper = stepper_for(tier.tiers, EXPERTS, nvme=tier)
        ids = np.array([[3, 5, 7, 11], [5, 7, 13, 2]])
        w = torch.rand(2, 4)
        x = torch.randn(2, HIDDEN)
        assert tier.prefetch([(1, int(e)) for e in np.unique(ids)]) == 6
        assert all(tier.tiers.where[1, e] in (Where.FROM_STORE, Where.RAM) for e in np.unique(ids))
        settle_reads(tier)
        reads, before = tier.reader.stats()["reads"], picks_of(tier.tiers)
        got, _ = step_layer(tier.tiers, stepper, 1, x, ids, w, forward)
        picks = picks_of(tier.tiers, before)  # no VRAM slots: every pick a RAM miss over PCIe, none a store read
        assert picks["nvme"] == 0 and picks["pcie"] == ids.size
        assert tier.reader.stats()["reads"] == reads, "the step read the store although every pick was prefetched"
        assert torch.equal(got, direct.moe(2, x, ids, w))
        pf = tier.stats.snapshot()["prefetch"]
        assert pf["hits"] == 6 and pf["demand_misses"] == 0 and pf["recall"] == 1.0


def test_recall_and_waste_of_a_partial_predictor(packed):
    ck, store = packed
    with open_nvme_tier(store, ck, nvme_spec(store, 2 * EXPERTS, 0, staging_slots=EXPERTS)) as tier:
        forward = slot_forward(tier.layout)
        tier.prefetch([(0, e) for e in (1, 2, 3, 4, 9)])  # right: 1 2 3 4; wrong: 9
        settle_reads(tier)
        step_layer(tier.tiers, stepper_for(tier.tiers, EXPERTS, nvme=tier), 0, torch.randn(1, HIDDEN),
                   np.array([[1, 2, 3, 4, 5, 6]]), torch.rand(1, 6), forward)
        pf = tier.stats.snapshot()["prefetch"]
        assert (pf["issued"], pf["hits"], pf["wasted"], pf["demand_misses"]) == (5, 4, 1, 2)
        assert pf["recall"] == pytest.approx(4 / 6) and pf["precision"] == pytest.approx(4 / 5)
        assert not tier.tiers.ram_guard.any(), "guards outlived the layer they were for"
        tier.check_invariants()


def test_prefetch_respects_window_guards_and_protection(packed):
    ck, store = packed
    with open_nvme_tier(store, ck, nvme_spec(store, EXPERTS + 1, 0)) as tier:
        t = tier.tiers
        assert tier.prefetch([(0, e) for e in range(EXPERTS)], window=5) == 5
        settle_reads(tier)
        assert tier.prefetch([(1, e) for e in range(EXPERTS)]) == 17 - 5
        settle_reads(tier)
        # RAM is full: 17 slots, all guarded prefetches. Nothing may be dropped for another guess.
        assert t.ram.free_count() == 0 and tier.prefetch([(1, 15)]) == 0
        # A step of layer 0 ends layer 0's guards: its unused prefetches (1-4) become droppable, and after launch the
        # step drops them to keep room for the next step's reads; never its own expert 0, nor layer 1's guesses.
        step_layer(t, stepper_for(t, 2, nvme=tier), 0, torch.randn(1, HIDDEN), np.array([[0]]), torch.ones(1, 1),
                   slot_forward(tier.layout))
        assert [Where(t.where[0, e]) for e in range(5)] == [Where.RAM] + [Where.STORE] * 4
        assert t.ram.free_count() == FREE_RAM_SLOTS and all(t.where[1, e] == Where.RAM for e in range(12))
        # RAM full again, of layer 1's guesses and layer 0's expert 0, the one unguarded: a guess may drop it only
        # where it is not protected.
        assert tier.prefetch([(1, e) for e in range(12, 16)]) == FREE_RAM_SLOTS
        settle_reads(tier)
        assert t.ram.free_count() == 0
        assert tier.prefetch([(0, 5)], protect={0: [0, 1, 2, 3, 4]}) == 0
        assert t.where[0, 5] == Where.STORE and t.where[0, 0] == Where.RAM
        assert tier.prefetch([(0, 5)]) == 1 and t.where[0, 0] == Where.STORE
        tier.check_invariants()


def fill_ram(tier):
    """RAM (EXPERTS + 1 records) full of unguarded experts: all of layer 0's and layer 1's expert 0."""
    t = tier.tiers
    t.demand_reads(0, np.arange(EXPERTS))
    t.demand_reads(1, np.array([0]))
    settle_reads(tier)
    assert t.ram.free_count() == 0 and not t.ram_guard.any()
    return t


def test_a_prefetch_drops_the_weakest_expert_that_is_neither_its_own_pick_nor_protected(packed):
    """RAM full of unguarded experts, the weakest of them this prefetch's own picks and one a lane is reading: each
    read drops the weakest of the others (ties: the lowest layer, then the lowest id)."""
    ck, store = packed
    with open_nvme_tier(store, ck, nvme_spec(store, EXPERTS + 1, 0)) as tier:
        t = fill_ram(tier)
        t.observe(0, np.arange(4, EXPERTS)[None, :])  # experts 0-3 of layer 0 stay the weakest
        t.observe(1, np.array([[0]]))  # as strong as layer 0's 4-15
        assert tier.prefetch([(1, 9), (0, 0), (1, 10), (0, 2)], protect={0: [1]}) == 2
        dropped = {(int(a), int(b)) for a, b in zip(*np.nonzero(t.where == Where.STORE), strict=True)}
        assert dropped >= {(0, 3), (0, 4)} and not dropped & {(0, 0), (0, 1), (0, 2), (1, 0)}
        assert len([k for k in dropped if k[0] == 0]) == 2
        assert t.where[1, 9] != Where.STORE and t.where[1, 10] != Where.STORE
        tier.check_invariants()


def test_keep_free_drops_the_weakest_experts_not_kept_guarded_or_held(packed):
    ck, store = packed
    with open_nvme_tier(store, ck, nvme_spec(store, EXPERTS + 1, 0)) as tier:
        t = fill_ram(tier)
        t.observe(0, np.arange(5, EXPERTS)[None, :])  # experts 0-4 of layer 0 are the weakest
        t.observe(1, np.array([[0]]))
        t.guard(0, 0)

        class Busy:
            def done(self):
                return False

        t.hold(0, [1], Busy())  # a copy in flight still reads expert 1
        assert tier.keep_free(2, {0: {2}}) == 2
        assert t.ram.free_count() == 2
        assert {e for e in range(EXPERTS) if t.where[0, e] == Where.STORE} == {3, 4}
        assert tier.keep_free(2) == 0  # already free: nothing more goes
        t.unguard(0, 0)  # guards are the prefetch's; this test set one by hand
        tier.check_invariants()


def test_prefill_prefetch_reads_upcoming_layers_without_touching_the_hot_set(packed):
    ck, store = packed
    stats = ck.parent / "routing-prefill.json"
    counts = np.zeros((2, EXPERTS))
    counts[:, :4] = 50.0  # a decode hot set: experts 0-3 of both layers
    from glm53.planning.routing import save_routing_stats
    save_routing_stats(stats, counts, model_key(read_header(store)))
    with open_nvme_tier(store, ck, nvme_spec(store, EXPERTS + 4, 0), stats_path=stats) as tier:
        t = tier.tiers
        hot = [(layer, e) for layer in range(2) for e in range(4)]
        assert all(t.where[k] == Where.RAM for k in hot)
        n = tier.prefetch_prefill([0, 1], window=EXPERTS)
        settle_reads(tier)
        assert n > 0 and all(t.where[k] == Where.RAM for k in hot), "prefill reads evicted the decode hot set"
        tier.check_invariants()


def test_start_up_warms_vram_and_ram_from_saved_statistics(packed):
    ck, store = packed
    key = model_key(read_header(store))
    counts = np.zeros((2, EXPERTS))
    counts[0, [5, 6, 7]] = [9, 8, 7]
    counts[1, [1, 2]] = [6, 5]
    path = ck.parent / "routing-warm.json"
    from glm53.planning.routing import save_routing_stats
    save_routing_stats(path, counts, key)
    # The plan's split of two VRAM slots by these statistics (glm53.planning.spec.split_slots): both to layer 1, whose top
    # two draw the larger share of its picks.
    from glm53.planning.spec import split_slots

    assert split_slots(1, 2, EXPERTS, 0, counts)[0] == (0, 2)
    with open_nvme_tier(store, ck, nvme_spec(store, EXPERTS + 1, [0, 2]), stats_path=path) as tier:
        t = tier.tiers
        # The statistics warm the VRAM slots with each layer's hottest and RAM with the rest of what was picked.
        assert sorted(np.flatnonzero(t.vram[1].resident()).tolist()) == [1, 2] and t.vram[0].num_slots == 0
        ram = {(lay, int(e)) for lay, e in zip(*np.nonzero(t.where == Where.RAM), strict=True)}
        assert ram == {(0, 5), (0, 6), (0, 7)}
        assert np.allclose(t.routing_counts(), counts)
        check_bytes(tier, store)
        tier.save_routing_stats(path, steps=3)
        assert json.loads(path.read_text())["model"] == key
    with open_nvme_tier(store, ck, nvme_spec(store, EXPERTS + 1, 2)) as cold:  # no statistics: RAM fills by demand
        assert (cold.tiers.where == Where.RAM).sum() == 0 and cold.tiers.vram[0].num_slots == 1


def test_a_store_of_another_checkpoint_is_refused_with_the_pack_command(packed, tmp_path):
    ck, store = packed
    other, _ = make_store(tmp_path, layers=LAYERS, experts=EXPERTS, seed=1)
    with pytest.raises(StoreRefused) as ei:
        open_nvme_tier(store, other, nvme_spec(store, EXPERTS + 1, 0))
    assert ei.value.fix == f"glm53 pack-store --model {other} --out {store}"
    assert str(store) in ei.value.problem and "different checkpoint" in ei.value.problem


@pytest.mark.parametrize("where", ["record", "header"])
def test_a_damaged_store_is_refused_with_the_pack_command(packed, tmp_path, where):
    ck, store = packed
    bad = tmp_path / "damaged.glm53"
    data = bytearray(store.read_bytes())
    head = read_header(store)
    offset = head.entries[-1].offset + 100 if where == "record" else 200  # quick verify always reads the tail
    data[offset] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(StoreRefused) as ei:
        open_nvme_tier(bad, ck, nvme_spec(store, EXPERTS + 1, 0))
    assert ei.value.fix == f"glm53 pack-store --model {ck} --out {bad}"
    assert f"glm53 pack-store --model {ck} --out {bad}" in str(ei.value)


def test_plans_the_tier_cannot_serve_are_refused(packed):
    ck, store = packed
    with pytest.raises(ValueError, match="at least 17"):
        nvme_spec(store, EXPERTS, 0)  # the spec cannot even be made
    with pytest.raises(ValueError, match="engine is fast"):
        open_nvme_tier(store, ck, nvme_spec(store, EXPERTS + 1, 0, mode="fast"))


def test_the_arena_is_the_plan_budget_never_more(packed):
    """The spec's RAM rows are spent exactly (the plan caps them at the experts VRAM leaves out), in aligned rows of
    one record extent, and reads never take the tier past them."""
    ck, store = packed
    extent = read_header(store).max_extent
    plan = nvme_spec(store, EXPERTS + 3, 0)
    with open_nvme_tier(store, ck, plan) as tier:
        assert tier.budget_bytes == plan.ram_slots * tier.stride == (EXPERTS + 3) * extent
        assert all(tier.arena[r].ctypes.data % 4096 == 0 for r in range(tier.tiers.ram.num_slots))
        rng = np.random.default_rng(0)
        for _ in range(60):
            layer = int(rng.integers(2))
            es = rng.choice(EXPERTS, 6, replace=False)
            tier.tiers.demand_reads(layer, es)
            for e in es:
                tier.tiers.fetch_to_ram(layer, int(e), protect=es)
            tier.prefetch([(1 - layer, int(e)) for e in rng.choice(EXPERTS, 4, replace=False)])
            assert tier.resident_bytes() <= tier.budget_bytes
        settle_reads(tier)
        tier.check_invariants()


def test_reader_geometry_matches_the_tier(packed):
    ck, store = packed
    with StoreReader(store, threads=1) as r:
        tier = NvmeTier(r, EXPERTS, [0, 0], EXPERTS + 1)
        assert tier.store_layers == [1, 2] and tier.layer_index(2) == 1
        assert tier.stride == r.max_extent and tier.arena.shape == (EXPERTS + 1, r.max_extent)


def test_bench_nvme_runs_and_prints_ratios(packed, tmp_path):
    """`glm53 bench nvme` end to end on the small store (the real run uses 9 MiB records; see docs/results.md)."""
    from glm53.bench.nvme import NvmeBenchOptions, run_bench
    from glm53.cli import build_parser

    ck, store = packed
    args = build_parser().parse_args(["bench", "nvme", "--tokens", "4"])
    assert args.func.__name__ == "cmd_bench_nvme" and args.tokens == 4
    opts = NvmeBenchOptions(workdir=tmp_path, store=store, model=ck, ram_fraction=0.6, threads=2, tokens=6, rounds=1,
                            layer_ms=0.1)
    res = run_bench(opts, log=lambda m: None)
    text = res.render()
    for what in ("raw O_DIRECT", "x raw", "picks per tier", "prefetch off", "prefetch perfect", "prefetch realistic",
                 "prefetch perfect-2", "prefetch perfect-3", "prefetch realistic-after", "x off", "x bound", "recall"):
        assert what in text, what
    assert len(res.windows) == 6 and all(w.tokens == 6 for w in res.windows)
    assert [w.mode for w in res.windows] == ["off", "perfect", "perfect-2", "perfect-3", "realistic", "realistic-after"]
    assert store.exists() and ck.exists(), "the bench removed files it did not make"


def test_the_engine_can_fix_vram_slots_and_hand_in_its_slot_tensors(packed):
    ck, store = packed
    from glm53.tiers.nvme import slot_layout

    layout = slot_layout(read_header(store), [1, 2])
    arenas = [torch.zeros((s, layout.nbytes), dtype=torch.uint8) for s in (3, 1)]
    with open_nvme_tier(store, ck, nvme_spec(store, EXPERTS + 1, [3, 1]), vram_storage=arenas) as tier:
        assert [v.num_slots for v in tier.tiers.vram] == [3, 1]
        assert all(v.storage.data_ptr() == a.data_ptr() for v, a in zip(tier.tiers.vram, arenas, strict=True))
        check_bytes(tier, store)


def test_the_tier_reads_through_the_store_reader_and_refuses_to_open_without_its_native_library(packed, monkeypatch):
    from store import native

    ck, store = packed
    plan = nvme_spec(store, 2 * EXPERTS, 0, threads=2)
    with open_nvme_tier(store, ck, plan) as tier:
        assert type(tier.reader) is StoreReader and tier.reader.threads == 2  # the plan's
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_WHY", "not built (no store/_native*.so for this Python)")
    with pytest.raises(native.NativeUnavailable) as ei:
        open_nvme_tier(store, ck, plan)
    assert "not built" in ei.value.problem and "pip install -e ." in ei.value.fix


def test_the_tier_reads_in_the_part_count_it_timed_fastest_when_it_opened(packed, monkeypatch, caplog):
    import glm53.tiers.nvme_open as nvme_mod

    ck, store = packed
    plan = nvme_spec(store, 2 * EXPERTS, 0)
    with open_nvme_tier(store, ck, plan) as tier:  # records under 1 MiB here: one part is all there is to time
        assert list(tier.read_timing) == [1] and tier.reader.pieces == 1
    seen = []

    def timed(path, header, keys, choices, allow_buffered=False):
        seen.append((len(set(keys)), len(keys), tuple(choices)))
        return {1: 8.8e-3, 2: 6.0e-3, 4: 4.4e-3, 8: 8.7e-3}

    monkeypatch.setattr(nvme_mod, "time_pieces", timed)
    with caplog.at_level("INFO", logger=nvme_mod.log.name), open_nvme_tier(store, ck, plan) as tier:
        assert tier.reader.pieces == 4 and tier.read_timing[4] == 4.4e-3
        n = min(nvme_mod.PIECE_SAMPLE * len(nvme_mod.PIECE_CHOICES), len(tier.reader.header.index))
        assert seen == [(n, n, nvme_mod.PIECE_CHOICES)]  # distinct records, each read once
    assert "4 parallel part(s) per record" in caplog.text and "4: 4.40 ms" in caplog.text
    summary = tier.read_summary()
    assert summary["parts"] == 4 and summary["timed_ms_by_parts"] == {"1": 8.8, "2": 6.0, "4": 4.4, "8": 8.7}
    assert {"reads", "retries", "errors", "checked_by_parts"} <= set(summary)
    monkeypatch.setattr(nvme_mod, "time_pieces", lambda *a, **k: {})  # no read came back while timing
    with caplog.at_level("INFO", logger=nvme_mod.log.name), open_nvme_tier(store, ck, plan) as tier:
        assert tier.reader.pieces == nvme_mod.READ_PIECES and tier.read_timing == {}
    assert "nothing timed" in caplog.text


def test_the_tier_caps_guess_reads_at_once_by_what_two_reads_at_once_gained_when_it_opened(packed, monkeypatch,
                                                                                             caplog):
    import glm53.tiers.nvme_open as nvme_mod

    ck, store = packed
    plan = nvme_spec(store, 2 * EXPERTS, 0, threads=4)
    with open_nvme_tier(store, ck, plan) as tier:  # timed for real on this store's records
        gain = tier.two_at_once_gain
        assert gain is None or gain > 0
        assert tier.reader.prefetch_at_once == T.pick_prefetch_at_once(gain, tier.reader.threads)
        assert tier.read_summary()["prefetch_at_once"] == tier.reader.prefetch_at_once
    for timed, want in ((1.05, 1), (1.8, plan.store_threads - 1)):
        monkeypatch.setattr(nvme_mod, "time_two_at_once", lambda *a, timed=timed, **k: timed)
        with caplog.at_level("INFO", logger=nvme_mod.log.name), open_nvme_tier(store, ck, plan) as tier:
            assert tier.reader.prefetch_at_once == want and tier.read_summary()["two_at_once_gain"] == timed
        assert f"up to {want} guess read(s) at once" in caplog.text and f"{timed:.2f}x" in caplog.text


def test_the_store_load_is_the_share_of_recent_time_it_was_reading(packed, monkeypatch):
    """load(): 1 until measured; then, each span of at least LOAD_SPAN_S, smoothed toward the share of the span
    the reader was busy; a span longer than LOAD_IDLE_S (an idle server) leaves it as it was. The real reader's
    busy clock moves it too, and /stats shows both."""
    import glm53.tiers.nvme_meter as nvme_mod

    ck, store = packed
    plan = nvme_spec(store, 2 * EXPERTS, 0)
    with open_nvme_tier(store, ck, plan) as tier:
        assert tier.load() == 1.0
        busy = [0.0]
        monkeypatch.setattr(tier.reader, "busy_seconds", lambda: busy[0])

        def span(share, seconds=nvme_mod.LOAD_SPAN_S * 1.2):
            t0 = time.perf_counter()
            time.sleep(seconds)
            busy[0] += share * (time.perf_counter() - t0)
            return tier.load()

        assert tier.load() == 1.0  # the first call only marks the start
        assert span(0.0) == pytest.approx(0.5, abs=0.02)
        assert span(0.0) == pytest.approx(0.25, abs=0.02)
        assert span(1.0) == pytest.approx(0.625, abs=0.03)
        monkeypatch.setattr(nvme_mod, "LOAD_IDLE_S", nvme_mod.LOAD_SPAN_S * 2)
        assert span(0.0, nvme_mod.LOAD_SPAN_S * 3) == pytest.approx(0.625, abs=0.03), "an idle gap is skipped"
        monkeypatch.undo()
        before = tier.reader.busy_seconds()
        tier.tiers.fetch_to_ram(0, 3)  # a real read moves the real clock
        assert tier.reader.busy_seconds() > before
        assert tier.read_summary()["busy_s"] >= 0 and 0 <= tier.read_summary()["load"] <= 1
