"""glm53.exl3's glue (TieredMoE, the layer placement) end to end on the CPU, against a fake exllamav3 (tests/support/fake_exllamav3.py).

TieredMoE shrinks every FakeBlockSparseMLP of a model built from a generated EXL3 checkpoint to slot Linears on
the tier arenas (install, load, populate), then each forward goes through its seam (step: ids to the host, the
stepper's decision, slot ids written back in place; the lane's combine) and the fake's kernels, which compute
from whatever bytes the slots hold. Every layer output is compared with the same fake module holding all experts
(stock): exact and nvme-exact bit for bit, fast and nvme (the CPU lane) within LANE_TOL. close() must give the
modules back as they were."""

from __future__ import annotations

import fake_exllamav3 as F
import numpy as np
import pytest
import torch
from specs import packed_store, spec_for, split_spec

from glm53.exl3.contract import check_contract
from glm53.exl3.placement import place_layers, wrap_load_progress
from glm53.exl3.tiered import Exl3TierError, TieredMoE
from glm53.fixture.exl3 import write_exl3_checkpoint

HIDDEN = 256
NUM_EXPERTS, TOP_K = 16, 4
SLOTS = [2, 3, 4]  # VRAM slots of the 3 MoE layers: most picks miss, admissions evict
SWIGLU_LIMIT = 10.0


@pytest.fixture(scope="module", autouse=True)
def fake_exllamav3():
    with F.installed() as mods:
        yield mods


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """4 layers (1 dense, 3 MoE of 16 experts, top-4), skewed routers so some experts are hot."""
    return write_exl3_checkpoint(tmp_path_factory.mktemp("glue") / "ck", router_skew=(0.25, 0.5), layers=4,
                                 dense_layers=1, mtp_layers=0)


@pytest.fixture(scope="module")
def store(ck, tmp_path_factory):
    return packed_store(ck, tmp_path_factory.mktemp("glue-store"))


_stock: dict = {}


def stock_model(ck, interm=torch.half) -> F.Model:
    """The fake model with every expert loaded from the checkpoint: the reference (one per dtype, shared)."""
    key = (str(ck), interm)
    if key not in _stock:
        m = F.Model.from_config(F.Config.from_directory(str(ck)), interm_dtype=interm)
        m.load("cpu")
        _stock[key] = m
    return _stock[key]


def tiered_model(ck, interm=torch.half, slots=SLOTS, staging_slots=None, nvme_open=None, staging_rows=None,
                 **kw) -> tuple[F.Model, TieredMoE]:
    """The fake model with TieredMoE installed and populated (the engine's lifecycle); sized by nvme_open's spec in
    the nvme modes, else by an exact-mode spec of `slots` per layer (staging_rows: its own staging rows, the rest
    borrowed cache slots)."""
    model = F.Model.from_config(F.Config.from_directory(str(ck)), interm_dtype=interm)
    spec = nvme_open.spec if nvme_open is not None else spec_for(ck, "exact", slots, staging_slots=staging_slots,
                                                                 staging_rows=staging_rows)
    tiered = TieredMoE(model, ck, spec, nvme_open=nvme_open, **kw)
    tiered.install()
    model.load("cpu")
    tiered.populate()
    return model, tiered


def rms(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).half()


def schedule(seed: int, steps: int, prefill_every: int = 7) -> list[int]:
    """Rows per forward: mostly one (decode), some 2..8 (batched decode), every few a prefill chunk (9..24)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(steps):
        if prefill_every and i % prefill_every == prefill_every - 1:
            out.append(int(rng.integers(9, 25)))
        else:
            out.append(1 if rng.random() < 0.5 else int(rng.integers(2, 9)))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# The CPU lane serves with its integer kernel (scalar/AVX2): ~2-6e-4 off float64 maths, within a GPU-like fp16
# computation's ~1e-3 (tests/cpu_lane/test_cpu_lane_kernel.py; the exact kernel would be ~5e-7 off).
LANE_TOL = 1e-3


def drive(stock: F.Model, model: F.Model, rows: list[int], seed: int, check, tiered: TieredMoE | None = None):
    """Forward the same inputs through both models, layer by layer (the next layer's input is the stock output
    added to the residual and normalised, so a router run ahead sees a related input); check(step, layer, rows,
    got, want) per layer; invariants every few steps."""
    rng = np.random.default_rng(seed)
    for step, n in enumerate(rows):
        x = rms(torch.from_numpy(rng.standard_normal((1, n, HIDDEN))))
        for li, (ms, mt) in enumerate(zip(stock.moe(), model.moe(), strict=True)):
            want = ms.forward(x, {}).clone()
            got = mt.forward(x, {}).clone()
            assert got.shape == want.shape == (1, n, HIDDEN) and got.dtype == torch.float
            check(step, li, n, got, want)
            x = rms(x.float() + want)
        if tiered is not None and step % 4 == 0:
            tiered.check_invariants()


def bit_identical(step, li, n, got, want):
    assert torch.equal(got, want), f"step {step} layer {li} ({n} rows): differs by {float((got - want).abs().max())}"


def near(tol):
    def check(step, li, n, got, want):
        assert rel_err(got, want) < tol, f"step {step} layer {li} ({n} rows): rel err {rel_err(got, want):.2e}"

    return check


def lane_fit():
    """Costs under which the CPU lane takes a share of most decode steps (as in tests/step/test_stepper.py)."""
    from glm53.cpu_lane.planner import CpuSample, LiveFit, PcieSample

    cpu = [CpuSample((1,) * n, 2, n * 0.5e-3) for n in (1, 2, 4)] + [CpuSample((1,), 1, 1e-3)]
    pcie = [PcieSample((1,) * n, n * 0.4e-3) for n in (1, 2, 4)]
    return LiveFit(cpu, pcie, threads=2)


def generous(lane):
    """A lane whose steps never miss their deadline on a loaded CI host: a recompute rounds the activation to fp16
    (exllamav3's torch path does), which the LANE_TOL comparisons against fp32 intermediates could see. The
    deadline path has its own tests (test_cpu_lane, test_recompute_gives_the_exact_path_numbers here)."""
    lane.deadline_for = lambda predicted_seconds: 60.0
    return lane


def nvme_opener(store, ck, ram_records: int, mode: str, slots=SLOTS, staging_slots=None, staging_rows=None):
    """TieredMoE's nvme_open on the CPU: the store through a RAM tier of `ram_records` records; `.spec` sizes both."""
    from glm53.tiers.nvme_open import open_nvme_tier

    spec = spec_for(ck, mode, slots, staging_slots=staging_slots, store=str(store), ram_slots=ram_records,
                    store_threads=2, staging_rows=staging_rows)

    def open_():
        return open_nvme_tier(store, ck, spec, warm=False, pin=False)

    open_.spec = spec
    return open_


def masked_picks(model: F.Model, tiered: TieredMoE) -> int:
    """Picks the fake kernels masked; and every slot id they saw was a slot or the layer's masked id."""
    total = 0
    for li, m in enumerate(model.moe()):
        masked_id = tiered.stepper.masked_id(li)
        for ids in m.fake_stats["slot_ids"]:
            assert ids.min() >= 0 and ids.max() <= masked_id, f"layer {li}: slot ids {ids} past {masked_id}"
        total += m.fake_stats["masked"]
    return total


# ---- the fake itself ------------------------------------------------------------------------------------------


def test_the_fake_satisfies_the_contract_and_computes_the_reference(ck):
    from glm53.exl3ref import expert_forward, read_exl3_linear

    check_contract()  # through sys.modules: what TieredMoE's imports see
    m = stock_model(ck).moe()[0]
    x = rms(torch.from_numpy(np.random.default_rng(0).standard_normal((1, 1, HIDDEN))))
    y = m.forward(x, {}).clone()
    ids, w = m.routing_cfg.selected_experts_bsz1[0].tolist(), m.routing_cfg.routing_weights_bsz1[0].float()
    want = np.zeros(HIDDEN, np.float32)
    for k, e in enumerate(ids):
        lins = [read_exl3_linear(ck, f"{m.key}.experts.{e}.{p}_proj") for p in ("gate", "up", "down")]
        want += np.float32(w[k]) * expert_forward(x[0].double().numpy(), *lins, swiglu_limit=SWIGLU_LIMIT)[0]
    assert torch.equal(y[0, 0], torch.from_numpy(want))
    # The prefill (torch) path computes the same picks: a row alone and inside a chunk agree to float rounding.
    xs = torch.cat([x, rms(torch.from_numpy(np.random.default_rng(1).standard_normal((1, 11, HIDDEN))))], dim=1)
    assert rel_err(m.forward(xs, {})[0, 0], y[0, 0]) < 1e-6


# ---- exact: bit-identical to all experts in "VRAM" ----------------------------------------------------------


def test_exact_mode_is_bit_identical_to_stock(ck):
    stock = stock_model(ck)
    model, tiered = tiered_model(ck, lookahead=False)
    try:
        assert not any(".experts." in k for k in model.config.stc.reads), "exllamav3 read an expert from disk"
        for li, m in enumerate(model.moe()):
            assert m.num_local_experts == SLOTS[li] + tiered.staging_slots != NUM_EXPERTS
            assert (m.routing_first, m.routing_last) == (0, m.num_local_experts)
            assert m.experts_cfg.min_expert == 0  # the interval is baked: masking is on
        drive(stock, model, schedule(1, 40), 1, bit_identical, tiered)
        snap = tiered.snapshot()
        assert snap["mode"] == "exact" and snap["layer_steps"] == 40 * 3
        picks = snap["picks"]
        assert picks["vram_hit"] > 0 and picks["pcie"] > 0 and picks["cpu"] == 0
        assert snap["admissions"] > 0 and snap["evictions"] > 0
        # After launch (exllamav3's combine ran it), admissions are device copies from the staging rows.
        moved = snap["admissions"] * tiered.layout.nbytes
        assert (snap["bytes"]["staging_to_vram"], snap["bytes"]["ram_to_vram"]) == (moved, 0)
        assert masked_picks(model, tiered) == 0
        tiered.check_invariants()
    finally:
        model.unload()
        tiered.close()


def test_exact_mode_borrowing_cache_slots_for_staging_is_bit_identical(ck):
    """Staging of TOP_K rows of its own: every prefill chunk and wide decode step borrows cache slots of the other
    layers (writing their experts back first), stages its picks there in id order, and stays bit-identical; decode
    admits into the emptied slots again."""
    stock = stock_model(ck)
    slots = [6, 7, 8]
    model, tiered = tiered_model(ck, slots=slots, staging_rows=TOP_K, lookahead=True)
    try:
        tiers = tiered.tiers
        assert tiers.staging_rows == TOP_K and tiers.staging.shape[0] == TOP_K and tiered.staging_slots == NUM_EXPERTS
        lent = set(tiers.lent)
        for li in range(3):  # each layer's staging: its own rows, then other layers' cache slots
            rows = [tiers.staging_slot(i, li).data_ptr() for i in range(NUM_EXPERTS)]
            assert len(set(rows)) == NUM_EXPERTS
            theirs = {tiers.vram[lay].flat(s).data_ptr(): lay for lay, s in lent}
            assert all(theirs.get(p, li) != li for p in rows[TOP_K:]) and all(p in theirs for p in rows[TOP_K:])
        drive(stock, model, schedule(11, 40), 11, bit_identical, tiered)
        snap = tiered.snapshot()
        assert snap["lent_out"] > 0 and snap["borrowed_slots"] == len(lent)
        assert snap["admissions"] > 0 and snap["picks"]["vram_hit"] > 0
        tiered.check_invariants()
    finally:
        model.unload()
        tiered.close()


def test_lookahead_prestages_bit_identically_and_reports_its_recall(ck):
    """Exact: each decode step's guess for the next layer copies a few of its misses ahead into reserved staging
    rows, read from there by the step they were made for; tokens stay stock's."""
    stock = stock_model(ck)
    model, tiered = tiered_model(ck, lookahead=True)
    try:
        drive(stock, model, schedule(2, 40, prefill_every=10), 2, bit_identical, tiered)
        snap = tiered.snapshot()
        la = snap["lookahead"]
        assert tiered.lookahead, "lookahead switched itself off"
        assert la["steps"] > 0 and la["picks"] > 0 and 0.0 <= la["recall"] <= 1.0
        assert 0.0 <= la["expert_recall"] <= 1.0 and la["prefetched"] > 0, "no prestage started from a prediction"
        assert la["prestage"]["used"] > 0, "no step read an expert copied ahead"
        assert set(la["layers"]) == {1, 2}  # layer 0 is never predicted
        print(f"\nlookahead recall {la['recall']:.3f} (expert recall {la['expert_recall']:.3f}) over {la['steps']} "
              f"steps, {la['prefetched']} experts prestaged, {la['prestage']['used']} read by their step")
    finally:
        model.unload()
        tiered.close()


def test_nvme_exact_prestages_from_ram_with_no_store_reads_bit_identically(ck, store):
    """nvme-exact with every expert outside VRAM in RAM: the store's lookahead gate stops, yet the prestage still
    copies the next layer's likely misses ahead from RAM in the windows its judge gives it; tokens stay stock's."""
    from glm53.planning.spec import FREE_RAM_SLOTS, RAM_SPARE_OF_TOP_K

    stock = stock_model(ck)
    slots = [2, 2, 2]
    whole = 3 * NUM_EXPERTS - sum(slots) + RAM_SPARE_OF_TOP_K * TOP_K + FREE_RAM_SLOTS
    model, tiered = tiered_model(ck, slots=slots, lookahead=True, counts=np.ones((3, NUM_EXPERTS)),
                                 nvme_open=nvme_opener(store, ck, whole, "nvme-exact", slots))
    try:
        drive(stock, model, schedule(2, 60, prefill_every=20), 4, bit_identical, tiered)
        snap = tiered.snapshot()
        la = snap["lookahead"]
        assert snap["picks"]["nvme"] == 0 and la["gate"]["off_layers"] == [1, 2], "the store's gate stopped"
        assert la["prestage"]["staged"] > 0 and la["prestage"]["used"] > 0, la["prestage"]
        tiered.nvme.check_invariants()
    finally:
        model.unload()
        tiered.close()


# ---- fast: the CPU lane at the seam ---------------------------------------------------------------------------


def quick_prestage_verdict(tiered) -> None:
    """The lane waits for the prestage's first verdict: a judge of one pair of two-step windows gives it within a
    token or two, so a short drive still offers the lane."""
    from glm53.step.prestage import PrestageJudge

    assert tiered.stepper.prestage is not None
    tiered.stepper.prestage.judge = PrestageJudge(window=2, pairs=1)


def test_fast_mode_lane_takes_picks_masked_and_added_back(ck):
    from glm53.cpu_lane.lane import CpuLane

    stock = stock_model(ck, torch.float)  # fp32 intermediates: what the lane computes
    # Layer 0 has no VRAM slot: with the default 16 staging slots its S + P would be all 16 experts, an interval
    # exllamav3 treats as "no split" (no masking), so the adapter must take one staging slot more.
    model, tiered = tiered_model(ck, torch.float, slots=[0, 3, 4], lookahead=True)
    try:
        lane = generous(CpuLane(tiered.layout, threads=2, stats=tiered.tiers.stats, codebook=tiered.codebook))
        tiered.enable_lane(lane, lane_fit())
        quick_prestage_verdict(tiered)
        drive(stock, model, schedule(3, 32), 3, near(LANE_TOL), tiered)
        assert tiered.staging_slots == NUM_EXPERTS + 1 and model.moe()[0].experts_cfg.min_expert == 0
        snap = tiered.snapshot()
        assert snap["mode"] == "fast"
        picks = snap["picks"]
        assert picks["cpu"] > 0 and picks["pcie"] > 0
        assert picks["total"] == sum(picks[k] for k in ("vram_hit", "pcie", "cpu", "nvme"))
        assert masked_picks(model, tiered) == picks["cpu"], "exactly the lane's picks are masked on the GPU side"
        assert snap["cpu_lane"]["jobs"] > 0 and snap["cpu_lane"]["recomputed_jobs"] == 0
    finally:
        model.unload()
        tiered.close()
    assert not lane.alive  # closed with the TieredMoE


def test_fast_mode_with_borrowed_staging_recomputes_in_its_own_row(ck):
    """The lane beside borrowed staging: near stock, and a recompute streams into the last staging row of the
    layer's own, never a borrowed cache slot (which another layer's expert may occupy)."""
    from glm53.cpu_lane.lane import CpuLane

    stock = stock_model(ck, torch.float)
    model, tiered = tiered_model(ck, torch.float, slots=[6, 7, 8], staging_rows=TOP_K, lookahead=True)
    try:
        lane = generous(CpuLane(tiered.layout, threads=2, stats=tiered.tiers.stats, codebook=tiered.codebook))
        tiered.enable_lane(lane, lane_fit())
        drive(stock, model, schedule(13, 32), 13, near(LANE_TOL), tiered)
        snap = tiered.snapshot()
        assert snap["picks"]["cpu"] > 0 and snap["lent_out"] > 0
        tiers = tiered.tiers
        before = {k: tiers.vram[k[0]].flat(k[1]).clone() for k in tiers.lent}
        x = rms(torch.from_numpy(np.random.default_rng(3).standard_normal((2, HIDDEN)))).float().numpy()
        e = int(np.flatnonzero(tiers.where[0] != 0)[0])
        tiered._recompute(0, e, x)
        assert all(torch.equal(b, tiers.vram[k[0]].flat(k[1])) for k, b in before.items())
        assert torch.equal(tiers.staging_slot(TOP_K - 1, 0), tiers.bytes_of(0, e))
        tiered.check_invariants()
    finally:
        model.unload()
        tiered.close()


def test_start_lane_calibrates_and_attaches(ck):
    stock = stock_model(ck, torch.float)
    model, tiered = tiered_model(ck, torch.float, lookahead=False)
    try:
        samples = tiered.measure_pcie(repeats=1)
        assert [len(s.rows) for s in samples] == [1, 2, 4] and all(s.seconds > 0 for s in samples)
        tiered.start_lane(threads=1)
        assert tiered.stepper.lane is not None and tiered.stepper.lane.alive
        generous(tiered.stepper.lane)
        drive(stock, model, schedule(4, 8, prefill_every=4), 4, near(LANE_TOL), tiered)
        snap = tiered.snapshot()
        assert snap["mode"] == "fast" and "cost_model" in snap["cpu_lane"]
        assert masked_picks(model, tiered) == snap["picks"]["cpu"]
    finally:
        model.unload()
        tiered.close()


def test_recompute_gives_the_exact_path_numbers(ck):
    """A lane whose kernel raises: that step's jobs go through _recompute (the expert streamed into the last staging
    slot, run through the slot Linears like exllamav3's torch path) and the layer still equals stock; the lane is
    off afterwards. With fp16 intermediates the recompute is the very maths of the fake's kernels."""
    from glm53.cpu_lane.lane import CpuLane
    from glm53.exl3ref import expert_forward, read_exl3_linear
    from glm53.tiers import Where

    def broken(jobs, outs, done, cancel):
        raise RuntimeError("simulated kernel fault")

    stock = stock_model(ck)
    model, tiered = tiered_model(ck, lookahead=False)
    try:
        lane = CpuLane(tiered.layout, threads=1, compute=broken, stats=tiered.tiers.stats)
        tiered.enable_lane(lane, lane_fit())
        drive(stock, model, [1, 2, 1, 3, 1, 1], 5, near(LANE_TOL), tiered)
        snap = tiered.snapshot()
        assert not lane.alive and "simulated kernel fault" in lane.disabled_reason
        assert snap["cpu_lane"]["recomputed_jobs"] > 0 and snap["cpu_lane"]["jobs"] == 0
        assert masked_picks(model, tiered) == snap["cpu_lane"]["recomputed_picks"]
        # Directly: a RAM expert's recompute equals the reference on the checkpoint's own tensors.
        li = 1
        e = int(np.flatnonzero(tiered.tiers.where[li] == Where.RAM)[0])
        x = rms(torch.from_numpy(np.random.default_rng(6).standard_normal((3, HIDDEN)))).float().numpy()
        got = tiered._recompute(li, e, x)
        key = model.moe()[li].key
        lins = [read_exl3_linear(ck, f"{key}.experts.{e}.{p}_proj") for p in ("gate", "up", "down")]
        want = expert_forward(x.astype(np.float64), *lins, swiglu_limit=SWIGLU_LIMIT, half_intermediate=True)
        assert got.dtype == torch.float and got.shape == (3, HIDDEN)
        np.testing.assert_array_equal(got.numpy(), want)
        tiered.check_invariants()
        drive(stock, model, [1, 12, 1], 7, bit_identical, tiered)  # the lane is off: exact again
    finally:
        model.unload()
        tiered.close()


# ---- nvme modes: misses through a record store packed from the checkpoint ----------------------------------------


def test_nvme_exact_is_bit_identical_to_stock(ck, store):
    stock = stock_model(ck)
    # 48 experts, 6 in VRAM; RAM holds 20 of the other 42: constant store reads and drops.
    model, tiered = tiered_model(ck, slots=[2, 2, 2], lookahead=True,
                                 nvme_open=nvme_opener(store, ck, 20, "nvme-exact", [2, 2, 2]))
    try:
        drive(stock, model, schedule(8, 30), 8, bit_identical, tiered)
        snap = tiered.snapshot()
        assert snap["mode"] == "nvme-exact"
        assert snap["picks"]["nvme"] > 0 and snap["picks"]["cpu"] == 0 and snap["ram_drops"] > 0
        assert snap["nvme_fault"] is None or not snap["nvme_fault"].get("faults")
        assert snap["copied_before_store_wait"] > 0, "no RAM miss crossed PCIe while the step's store reads landed"
        assert snap["lookahead"]["prefetched"] > 0
        tiered.nvme.check_invariants()
    finally:
        model.unload()
        tiered.close()


def test_nvme_lookahead_stops_while_every_expert_is_in_ram_and_resumes_when_the_store_is_needed(ck, store):
    """nvme-exact with a RAM tier that holds every expert outside VRAM (as the plan sizes it when the cap allows),
    warmed with all of them: no step reads from the store, so once a window of steps found no store work the next
    layer's router no longer runs ahead. When a layer's experts are dropped to the store (as a squeeze of the RAM
    tier would), its steps read again and its lookahead comes back (and reads ahead), while the layer whose
    experts stayed in RAM stays without. Every output stays bit-identical to stock."""
    from glm53.planning.spec import FREE_RAM_SLOTS, RAM_SPARE_OF_TOP_K
    from glm53.step.ahead_gate import AheadGate
    from glm53.tiers import Where

    stock = stock_model(ck)
    slots = [2, 2, 2]
    whole = 3 * NUM_EXPERTS - sum(slots) + RAM_SPARE_OF_TOP_K * TOP_K + FREE_RAM_SLOTS
    model, tiered = tiered_model(ck, slots=slots, lookahead=True, counts=np.ones((3, NUM_EXPERTS)),
                                 nvme_open=nvme_opener(store, ck, whole, "nvme-exact", slots))
    window = 6
    # No probes within the test (their rules are tests/step/test_ahead_gate.py's): only store work turns it on. No
    # prestage: its judge's windows would run the router for their own sake (the next test).
    tiered.stepper.ahead_gate = AheadGate(window=window, first_probe=1000, max_probe=1000)
    tiered.stepper.prestage = None
    guessed: list[int] = []
    real_predict = tiered._predict_next

    def predict_next(li, y, out):
        guessed.append(li)
        return real_predict(li, y, out)

    tiered._predict_next = predict_next
    try:
        tiers = tiered.tiers
        assert not (tiers.where == Where.STORE).any(), "warmed with every expert"

        def run(tokens: int, seed: int) -> list[int]:
            guessed.clear()
            drive(stock, model, [1] * tokens, seed, bit_identical, tiered)
            return list(guessed)

        first = run(window + 4, 21)
        assert first == [1, 2] * window, "the router ran ahead for the first window only"
        snap = tiered.snapshot()
        assert snap["picks"]["nvme"] == 0 and snap["lookahead"]["prefetched"] == 0
        assert snap["lookahead"]["gate"]["off_layers"] == [1, 2]
        assert run(12, 22) == []
        steps = snap["lookahead"]["steps"]
        assert tiered.snapshot()["lookahead"]["steps"] == steps, "a step with no guess was scored"

        for e in np.flatnonzero(tiers.where[2] == Where.RAM).tolist():  # layer 2's RAM experts back to the store
            tiers.drop_ram(2, e)
        again = run(12, 23)
        snap = tiered.snapshot()
        assert 2 in again and 1 not in again, "only the layer whose experts left RAM is guessed for again"
        assert snap["picks"]["nvme"] > 0 and snap["lookahead"]["prefetched"] > 0, "its guesses read ahead"
        assert snap["lookahead"]["steps"] == steps + again.count(2), "only the steps guessed for are scored"
        tiered.nvme.check_invariants()

        for e in np.flatnonzero(tiers.where[2] >= Where.STORE).tolist():  # the rest of layer 2 read back
            tiers.fetch_to_ram(2, e)
        assert run(window + 6, 24).count(2) <= window
        assert run(6, 25) == [], "stopped again once the store had nothing more to give"
        tiered.nvme.check_invariants()
    finally:
        model.unload()
        tiered.close()


def test_nvme_exact_borrowing_cache_slots_is_bit_identical(ck, store):
    """nvme-exact with staging of TOP_K rows of its own: a borrowed slot's expert is written back to RAM, which
    drops its weakest expert for it (never one the borrowing step picked), and the layers stay bit-identical."""
    stock = stock_model(ck)
    slots = [6, 6, 6]
    model, tiered = tiered_model(ck, slots=slots, lookahead=True,
                                 nvme_open=nvme_opener(store, ck, 20, "nvme-exact", slots, staging_rows=TOP_K))
    try:
        assert tiered.tiers.staging_rows == TOP_K
        drive(stock, model, schedule(12, 30), 12, bit_identical, tiered)
        snap = tiered.snapshot()
        assert snap["lent_out"] > 0 and snap["picks"]["nvme"] > 0
        assert snap["bytes"]["vram_to_ram"] > 0 and snap["ram_drops"] > 0  # written back, the weakest RAM dropped
        tiered.nvme.check_invariants()
    finally:
        model.unload()
        tiered.close()


def test_nvme_prefill_reads_ahead_only_what_the_router_run_ahead_names(tmp_path_factory):
    """A short prompt chunk picks a few of a layer's experts: with the next layer's router run ahead on the chunk,
    the store reads ahead those (and demand-reads what it missed) instead of the whole layer, and the result is
    still stock's, bit for bit."""
    from store.pack import PackOptions, pack_store

    wide = write_exl3_checkpoint(tmp_path_factory.mktemp("glue-wide") / "ck", router_skew=(0.25, 0.5), layers=4,
                                 dense_layers=1, mtp_layers=0, experts=64, top_k=2)
    wide_store = wide.parent / "experts.glm53"
    pack_store(PackOptions(wide, wide_store, threads=2, progress=False, verify=False), log=lambda m: None)
    stock = stock_model(wide)
    rows = [9, 12, 10, 16, 9, 11]  # prompt chunks only (more rows than a decode step), ~20 of 64 experts each
    reads = {}
    for guess in (False, True):
        model, tiered = tiered_model(wide, slots=[2, 2, 2], lookahead=guess,
                                     nvme_open=nvme_opener(wide_store, wide, 70, "nvme-exact", [2, 2, 2]))
        try:
            drive(stock, model, rows, 4, bit_identical, tiered)
            snap = tiered.snapshot()
            reads[guess] = snap["nvme"]["reads"] + snap["nvme"]["prefetch_reads"]
            tiered.nvme.check_invariants()
        finally:
            model.unload()
            tiered.close()
    print(f"\nstore records read over {len(rows)} prompt chunks: {reads[False]} reading whole layers ahead, "
          f"{reads[True]} reading the router's guess ({reads[True] / reads[False]:.2f}x)")
    assert reads[True] < 0.7 * reads[False]


def test_nvme_mode_with_the_lane(ck, store):
    from glm53.cpu_lane.lane import CpuLane

    stock = stock_model(ck, torch.float)
    model, tiered = tiered_model(ck, torch.float, slots=[2, 2, 2], lookahead=True,
                                 nvme_open=nvme_opener(store, ck, 24, "nvme", [2, 2, 2]))
    try:
        # A cold start (no routing statistics): RAM holds no expert yet, and the lane's PCIe calibration must run.
        assert tiered.tiers.ram.in_use() == 0
        assert len(tiered.measure_pcie(repeats=1)) == 3
        tiered.enable_lane(generous(CpuLane(tiered.layout, threads=2, stats=tiered.tiers.stats)), lane_fit())
        quick_prestage_verdict(tiered)
        drive(stock, model, schedule(9, 24), 9, near(LANE_TOL), tiered)
        snap = tiered.snapshot()
        assert snap["mode"] == "nvme" and snap["picks"]["cpu"] > 0 and snap["picks"]["nvme"] > 0
        # A pick the step had to read from the store counts as "nvme" in picks even when the lane computes it.
        lane = snap["cpu_lane"]
        assert masked_picks(model, tiered) == lane["picks"] + lane["recomputed_picks"] > snap["picks"]["cpu"]
    finally:
        model.unload()
        tiered.close()


# ---- teardown -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["unload-then-close", "close-then-unload", "installed-only", "load-failed"])
def test_close_restores_the_modules(ck, order):
    """Both teardown orders of a running TieredMoE, and a start-up abandoned after install() (before load) or
    after model.load() (populate never ran, so the seam never opened and unload() alone cannot restore)."""
    stock = stock_model(ck)
    model = F.Model.from_config(F.Config.from_directory(str(ck)))
    before = [(m.gates, m.ups, m.downs, list(m.modules)) for m in model.moe()]
    tiered = TieredMoE(model, ck, spec_for(ck, "exact", SLOTS), lookahead=False)
    tiered.install()
    if order == "installed-only":
        tiered.close()
    elif order == "load-failed":
        model.load("cpu")
        tiered.close()
        model.unload()
    else:
        model.load("cpu")
        tiered.populate()
        drive(stock, model, [1, 10], 10, bit_identical, tiered)
        if order == "unload-then-close":
            model.unload()
            tiered.close()
        else:
            tiered.close()
            model.unload()
    for m, (gates, ups, downs, modules) in zip(model.moe(), before, strict=True):
        assert m.gates is gates and m.ups is ups and m.downs is downs and m.modules == modules
        assert m.num_local_experts == NUM_EXPERTS and m.routing_first is None and m.routing_last is None
        assert m.cpu_split_first is None
        assert "cpu_split_submit" not in vars(m) and "cpu_split_combine" not in vars(m)
    # Loaded again, the module is stock exllamav3: every expert from the checkpoint, no seam.
    model.config.stc.reads.clear()
    model.load("cpu")
    assert sum(".experts." in k for k in model.config.stc.reads) == 3 * NUM_EXPERTS * 3 * 3
    for m in model.moe():
        m.fake_stats["slot_ids"].clear()
    drive(stock, model, [1, 3, 12], 11, bit_identical)
    model.unload()


def test_load_progress_reports_each_top_level_module(ck):
    model = F.Model.from_config(F.Config.from_directory(str(ck)))
    seen = []
    undo = wrap_load_progress(model, lambda done, total: seen.append((done, total)))
    model.load("cpu")
    n = len(model.modules)
    assert seen == [(i, n) for i in range(1, n + 1)]
    undo()
    assert all("load" not in vars(m) for m in model.modules)
    model.unload()


# ---- a layer split across two devices (issue 28): two shares on the CPU stand in for two cards ------------------
# Each share has its own link (copy streams, staging rows) and its layers' VRAM arenas, the RAM tier (and the store)
# is shared: exact and nvme-exact stay bit-identical, fast within LANE_TOL, and each layer's copies use its own link.


def split_model(ck, spec, interm=torch.half, **kw) -> tuple[F.Model, TieredMoE]:
    """The engine's lifecycle with the layers placed by the spec's device shares."""
    model = F.Model.from_config(F.Config.from_directory(str(ck)), interm_dtype=interm)
    tiered = TieredMoE(model, ck, spec, **kw)
    tiered.install()
    undo = place_layers(model, spec)
    try:
        model.load("cpu")
    finally:
        undo()
    tiered.populate()
    return model, tiered


def check_links(tiered: TieredMoE, spec) -> dict:
    """Each layer's slots and staging on its own share's link; the per-device report adds up."""
    tiers = tiered.tiers
    assert len(tiers.links) == len(spec.devices) == 2
    assert tiered.link_of == [i for i, d in enumerate(spec.devices) for _ in range(d.moe_count)]
    a, b = (link.staging for link in tiers.links)
    assert a.data_ptr() != b.data_ptr() and tiers.links[0].copier is not tiers.links[1].copier
    for li, layer in enumerate(tiered.layers):
        staging = tiers.link(li).staging
        lin = layer.slot_linears[0][layer.slots]  # the first staging slot's gate Linear
        assert staging.data_ptr() <= lin.inner.trellis.data_ptr() < staging.data_ptr() + staging.nbytes
    snap = tiered.snapshot()
    per = snap["devices"]
    assert [d["moe_layers"] for d in per] == [[li for li, x in enumerate(tiered.link_of) if x == i] for i in (0, 1)]
    assert sum(d["picks"] for d in per) == snap["picks"]["total"]
    assert all(d["picks"] > 0 and d["link_bytes"] > 0 for d in per)
    # On the CPU every copy has host memory at both ends, so the links count all the tiers' copies, and the start-up
    # fill and prefill's on-device copies of resident experts besides.
    crossed = sum(n for k, n in snap["bytes"].items() if k != "store_to_ram")  # store reads land in RAM, not a link
    assert sum(d["link_bytes"] for d in per) >= crossed > 0
    return snap


@pytest.mark.parametrize("lookahead", [False, True])
def test_exact_split_is_bit_identical_and_each_share_copies_its_own(ck, lookahead):
    """lookahead=True: the next layer's router runs ahead within a card, never across the boundary."""
    spec = split_spec(ck, "exact", SLOTS)
    stock = stock_model(ck)
    model, tiered = split_model(ck, spec, lookahead=lookahead)
    try:
        drive(stock, model, schedule(1, 40), 1, bit_identical, tiered)
        snap = check_links(tiered, spec)
        assert snap["picks"]["pcie"] > 0 and snap["admissions"] > 0 and snap["evictions"] > 0
        assert masked_picks(model, tiered) == 0
        tiered.check_invariants()
    finally:
        model.unload()
        tiered.close()


def test_fast_split_lane_serves_both_shares(ck):
    spec = split_spec(ck, "fast", SLOTS, cpu_threads=2)
    stock = stock_model(ck, torch.float)  # fp32 intermediates: what the lane computes
    model, tiered = split_model(ck, spec, torch.float, lookahead=False)
    from glm53.cpu_lane.lane import CpuLane

    lane = generous(CpuLane(tiered.layout, threads=2, stats=tiered.tiers.stats, codebook=tiered.codebook))
    tiered.enable_lane(lane, lane_fit())
    try:
        drive(stock, model, schedule(3, 40), 3, near(LANE_TOL), tiered)
        snap = check_links(tiered, spec)
        assert all(d["lanes"]["cpu"] > 0 for d in snap["devices"]), snap["devices"]
    finally:
        model.unload()
        tiered.close()


def test_nvme_exact_split_shares_the_ram_tier_and_store(ck, store):
    from glm53.tiers.nvme_open import open_nvme_tier

    spec = split_spec(ck, "nvme-exact", SLOTS, store=str(store), ram_slots=20, store_threads=2)
    stock = stock_model(ck)
    model, tiered = split_model(ck, spec, lookahead=False,
                                nvme_open=lambda: open_nvme_tier(store, ck, spec, warm=False, pin=False))
    try:
        assert tiered.tiers.ram.num_slots == 20  # one RAM tier for both shares
        drive(stock, model, schedule(4, 40), 4, bit_identical, tiered)
        snap = check_links(tiered, spec)
        assert snap["store_reads"] and snap["picks"]["nvme"] > 0
    finally:
        model.unload()
        tiered.close()


def test_a_spec_for_another_checkpoint_is_refused(ck):
    from specs import spec_for

    from glm53.planning.devices import DeviceShare

    # Shares that cover the MoE layers but put MoE layer 2 (decoder layer 3) with decoder layers 0-2.
    shares = (DeviceShare(0, "a", 1, 0, 2, 0, 3, sum(SLOTS)), DeviceShare(0, "b", 1, 3, 3, 3, 0, 0))
    model = F.Model.from_config(F.Config.from_directory(str(ck)))
    with pytest.raises(Exl3TierError, match=r"layers\.3\.mlp is MoE layer 2"):
        TieredMoE(model, ck, spec_for(ck, "exact", SLOTS, devices=shares))


def test_place_layers_puts_each_module_on_its_share():
    """Modules load onto their decoder layer's share (embedding first, head last); a CPU-kept module stays."""
    from types import SimpleNamespace

    from glm53.planning.devices import DeviceShare
    from glm53.planning.spec import engine_spec

    loads: dict[str, torch.device] = {}

    class Mod:
        def __init__(self, key):
            self.key = key

        def load(self, device, **kw):
            loads[self.key] = torch.device(device)

    keys = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(6)), "model.norm", "lm_head"]
    model = SimpleNamespace(modules=[Mod(k) for k in keys])
    shares = (DeviceShare(0, "a", 1, 0, 2, 0, 2, 4), DeviceShare(1, "b", 1, 3, 5, 2, 3, 6))
    spec = engine_spec("exact", moe_layers=5, experts_per_layer=8, top_k=2, vram_slots=2, kv_tokens=1024,
                       device="cuda:0", devices=shares)
    undo = place_layers(model, spec)
    for m in model.modules:
        m.load(torch.device("cuda:0"))
    model.modules[0].load(torch.device("cpu"))  # exllamav3 keeps an unquantized embedding on the CPU
    undo()
    assert {k: str(d) for k, d in loads.items()} == {
        "model.embed_tokens": "cpu", "model.layers.0": "cuda:0", "model.layers.1": "cuda:0",
        "model.layers.2": "cuda:0", "model.layers.3": "cuda:1", "model.layers.4": "cuda:1",
        "model.layers.5": "cuda:1", "model.norm": "cuda:1", "lm_head": "cuda:1"}
    assert all("load" not in vars(m) for m in model.modules)  # undone
    one = engine_spec("exact", moe_layers=5, experts_per_layer=8, top_k=2, vram_slots=2, kv_tokens=1024)
    place_layers(model, one)()
    assert all("load" not in vars(m) for m in model.modules)  # no shares: nothing wrapped
