"""The speed forecast (glm53.planning.forecast): its terms on fake hosts, its rules against the CPU lane's planner
and judge, and the model against what docs/results.md measured.

The validation tests build the cost model's terms from recorded facts of a run (its link rate, its hit rate, its
stock step, its host time per layer step, its lane calibration) and compare the forecast with the decode rate the
same run measured, printing the ratio; none of the measured rates is an input.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from fakehost import IVYBRIDGE, RTX3090, HostSpec, write_host

from glm53.planning import forecast as F
from glm53.planning import host as H
from glm53.planning import plan as P
from glm53.planning import settings as S
from glm53.planning import shape as M

ROOT = Path(__file__).resolve().parent.parent
EXPERT = 9 * (1 << 20) + 36 * 1024   # one full-width EXL3 3 bpw routed expert (glm53.planning.shape)
TOLERANCE = 0.15                      # issue 38: within 15% of the measurement


def term(value: float, source: str = "recorded") -> F.Term:
    return F.Term(value, "", source)


def check(name: str, forecast: float, measured: float) -> None:
    ratio = forecast / measured
    print(f"{name}: forecast {forecast:.1f} tok/s, measured {measured:.1f}: ratio {ratio:.3f}")
    assert abs(ratio - 1) <= TOLERANCE, f"{name}: forecast {forecast:.1f} against {measured:.1f} ({ratio:.3f})"


# ---------------------------------------------------------------- against what was measured


def emulated_box_terms() -> F.Terms:
    """docs/results.md, twenty-first session: the 8-MoE-layer full-width fixture under `--emulate rtx3090-gen4`
    on the H200 machine. The recorded facts: the paced link over 9 MiB expert copies 24.45 GB/s, hit rate 0.391,
    stock exllamav3 298.0 tok/s (the GPU step), host time per MoE layer step 186-211 us, the lane's calibrated
    cost model 1,295 us per one-row expert (15 threads, AVX2). The lane's offering cost is the module's constant
    (measured in the fourth session, not in this run)."""
    return F.Terms(moe_layers=8, top_k=8, expert_bytes=EXPERT, hit_rate=term(0.391), gpu_step_ms=term(1000 / 298.0),
                   host_ms=term((0.186 + 0.211) / 2), link_GBps=term(24.45), lane_ms=term(1.295),
                   lane_offer_ms=term(F.LANE_OFFER_MS))


def test_the_emulated_consumer_box_is_forecast_within_15_percent():
    """Measured: exact 50.1 tok/s, fast 49.8 (the lane judge set the lane aside: steps offering it took 1.38x as
    long). The exact forecast's copies are the bench's own bytes: 352 MiB a token."""
    t = emulated_box_terms()
    fc = F.forecast(t, ("exact", "fast"))
    exact, fast = fc.modes["exact"], fc.modes["fast"]
    assert exact.misses_per_token == pytest.approx(8 * 8 * (1 - 0.391))
    assert exact.misses_per_token * EXPERT / 2**20 == pytest.approx(352, abs=1)  # the bench's 352 MiB/token H2D
    check("exact, emulated RTX 3090 + PCIe 4.0", exact.tok_s, 50.1)
    check("fast, emulated RTX 3090 + PCIe 4.0", fast.tok_s, 49.8)
    print(f"fast's lane: {fast.lane} (measured: set aside, on/off 1.38)")


BLOCKING_OFFER_MS = 0.67  # a layer step offering the lane, while the host blocked on its partial (twenty-seventh)


def grid_terms(link_GBps: float, lane_ms: float) -> F.Terms:
    """docs/results.md, twenty-fourth and twenty-seventh sessions: the 8-MoE-layer full-width fixture under
    `--emulate rtx3090-gen4` at 32 VRAM slots a layer: stock 288.8 tok/s, 211 misses a token at the real depth
    (hit rate 1 - 211/336), the link paced to `link_GBps`, the lane's calibration of that run (15 threads, AVX2),
    the module's host time and slow-down in decode, and the offering cost of the hand-off those runs had (the host
    blocking on the lane's partial). (The twenty-fourth session recorded exact's forecast, not each term: these
    terms give its 27.1 tok/s at 12 GB/s within 0.5%.)"""
    return F.Terms(moe_layers=8, top_k=8, expert_bytes=EXPERT, hit_rate=term(1 - 211 / 336),
                   gpu_step_ms=term(1000 / 288.8), host_ms=term(F.HOST_MS_PER_MOE_LAYER), link_GBps=term(link_GBps),
                   lane_ms=term(lane_ms), lane_offer_ms=term(BLOCKING_OFFER_MS), lane_decode=F.lane_decode_term())


@pytest.mark.parametrize(("link", "lane", "exact", "fast", "kept"), [
    (24.62, 0.497, 45.5, 47.6, False),   # twenty-seventh: the lane pinned, judge 1.078 (set aside)
    (12.0, 0.63, 24.2, 30.5, True),      # twenty-fourth: judge 0.733 (kept)
    (12.0, 1.08, 23.9, 24.8, None),      # twenty-fourth, again: judge 1.090 (set aside); the forecast's call is 0.97
])
def test_the_grid_under_the_preset_is_forecast_within_15_percent(link, lane, exact, fast, kept):
    """fast's forecast prices the lane at its time inside decode and the host's block on it: where the lane was
    priced at its idle time these points came out at 0.66-0.79 of the forecast."""
    fc = F.forecast(grid_terms(link, lane), ("exact", "fast"))
    check(f"exact at {link} GB/s", fc.modes["exact"].tok_s, exact)
    check(f"fast at {link} GB/s, lane {lane} ms idle", fc.modes["fast"].tok_s, fast)
    if kept is not None:
        assert ("kept" in fc.modes["fast"].lane) is kept, fc.modes["fast"].lane
    idle = replace(grid_terms(link, lane), lane_decode=None, lane_offer_ms=term(0.25))  # the old lane model
    if kept is False:
        with pytest.raises(AssertionError):
            check("fast with the lane at its idle time", F.forecast(idle, ("fast",)).modes["fast"].tok_s, fast)


def test_the_stream_ordered_hand_off_keeps_the_lane_and_is_forecast_within_15_percent():
    """docs/results.md, twenty-ninth session (H100 machine, the same fixture and preset at 25 GB/s, the lane's partial
    added in stream order): stock 281.0 tok/s, the link 24.47 GB/s, the lane 0.487 ms idle; exact 45.5 tok/s at hit
    rate 0.371, fast 48.2 at 0.388 with the lane kept (the module's offering cost is fitted to this run)."""
    def terms(hit: float) -> F.Terms:
        return F.Terms(moe_layers=8, top_k=8, expert_bytes=EXPERT, hit_rate=term(hit), gpu_step_ms=term(1000 / 281.0),
                       host_ms=term(F.HOST_MS_PER_MOE_LAYER), link_GBps=term(24.47), lane_ms=term(0.487),
                       lane_offer_ms=term(F.LANE_OFFER_MS), lane_decode=F.lane_decode_term())

    check("exact, stream-ordered hand-off run", F.forecast(terms(0.371), ("exact",)).modes["exact"].tok_s, 45.5)
    fast = F.forecast(terms(0.388), ("fast",)).modes["fast"]
    check("fast, stream-ordered hand-off run", fast.tok_s, 48.2)
    assert "kept" in fast.lane, fast.lane


def test_full_depth_exact_on_the_h200_is_forecast_within_15_percent():
    """docs/results.md, sixteenth session: the full-depth fixture (42 MoE layers x 48 experts), exact in a 24 GiB
    budget: stock 66.5 tok/s, 24% of the picks miss VRAM, the link ~51.8 GB/s over 9 MiB copies (the H200's, as
    the twenty-first session measured it). Measured: exact 29.6 tok/s at 0 history."""
    t = F.Terms(moe_layers=42, top_k=8, expert_bytes=EXPERT, hit_rate=term(1 - 0.24), gpu_step_ms=term(1000 / 66.5),
                host_ms=term(F.HOST_MS_PER_MOE_LAYER), link_GBps=term(51.8))
    check("exact, full depth, H200", F.forecast(t, ("exact",)).modes["exact"].tok_s, 29.6)


def prestage_run_terms(prestage: bool) -> F.Terms:
    """docs/results.md, thirty-first session (H100 machine, the same fixture and preset, the link paced to 24.4-24.8
    GB/s): the second pair of windows, this code with the prestage (stock 288.2 tok/s, exact 55.5) against f9d725d
    without it (stock 287.3, exact 48.0), hit rate 0.391 on both sides."""
    return F.Terms(moe_layers=8, top_k=8, expert_bytes=EXPERT, hit_rate=term(0.391), gpu_step_ms=term(1000 / 288.2),
                   host_ms=term(F.HOST_MS_PER_MOE_LAYER), link_GBps=term(24.6),
                   prestage=F.prestage_term() if prestage else None)


def test_the_prestage_run_and_its_baseline_are_forecast_within_15_percent():
    with_it = F.forecast(prestage_run_terms(True), ("exact",)).modes["exact"]
    without = F.forecast(prestage_run_terms(False), ("exact",)).modes["exact"]
    check("exact with the prestage", with_it.tok_s, 55.5)
    check("exact without it (f9d725d)", without.tok_s, 48.0)
    assert 0 < with_it.prestaged_per_token < 8 * 2 and without.prestaged_per_token == 0
    print(f"forecast with / without the prestage {with_it.tok_s / without.tok_s:.3f} (measured 1.130, paired)")


def test_the_prestage_saves_what_fits_in_the_idle_link_time_and_only_where_its_judge_would_keep_it():
    from glm53.step import prestage

    assert F.PRESTAGE_PER_PARITY == prestage.PER_PARITY
    for rows, k in [(24, 8), (12, 8), (11, 8), (8, 8)]:
        assert F.prestage_room(rows, k) == prestage.Prestage.room(rows, k)
    t = prestage_run_terms(True)
    idle = t.gpu_step_ms.value / 8 + t.host_ms.value
    assert t.prestaged(0.0) == pytest.approx(F.PRESTAGE_SAVED * idle / t.link_ms)  # under two copies fit at 25 GB/s
    fast_link = replace(t, link_GBps=term(100.0))
    assert fast_link.prestaged(0.0) == pytest.approx(F.PRESTAGE_SAVED * 2)  # at most its two rows a layer
    assert t.prestaged(5.0) == 0.0, "a layer waiting on the store longer than the link idles: its RAM misses cross then"
    assert replace(t, hit_rate=term(1.0)).prestaged(0.0) == 0.0
    weak = replace(t, prestage=term(0.01))  # saving under MARGIN of a layer step: the judge would turn it off
    assert weak.prestaged(0.0) == 0.0


def nvme_grid_terms(link: float, stock: float, hit: float, ram: float, store_GBps: float, extra: float) -> F.Terms:
    """docs/results.md, thirty-second session (H100 machine, the 8-MoE-layer fixture under the preset, the RAM tier
    0.47 of the experts, the prestage in every mode): one point's recorded terms, the store's rate measured beside
    the windows and its reads beyond the picks it served."""
    return F.Terms(moe_layers=8, top_k=8, expert_bytes=EXPERT, hit_rate=term(hit), gpu_step_ms=term(1000 / stock),
                   host_ms=term(F.HOST_MS_PER_MOE_LAYER), link_GBps=term(link), ram_rate=term(ram),
                   store_GBps=term(store_GBps), store_extra=term(extra), prestage=F.prestage_term())


@pytest.mark.parametrize(("link", "stock", "hit", "ram", "store", "extra", "exact", "nvme_exact"), [
    (50.0, 269.5, 0.373, 1 - 0.0957, 2.058, 0.256, 78.3, 18.87),   # 32 VRAM slots a layer
    (25.0, 283.2, 0.587, 1 - 0.0627, 1.857, 0.308, 69.9, 23.54),   # 64
    (25.0, 286.4, 0.397, 1.0, 1.996, 0.0, 57.0, 54.13),            # the gate: every expert in RAM
])
def test_the_nvme_grid_points_are_forecast_within_15_percent(link, stock, hit, ram, store, extra, exact, nvme_exact):
    """The store's reads include the lookahead's wrong guesses (0.26-0.31 of the picks' reads here), and a layer that
    waits on the store gains nothing from the prestage (its judge set it aside at both store-bound points, 1.060 and
    1.009): priced as the picks' reads alone with the prestage on, these points came out at 0.749 and 0.772."""
    t = nvme_grid_terms(link, stock, hit, ram, store, extra)
    fc = F.forecast(t, ("exact", "nvme-exact"))
    check(f"exact at {link} GB/s, hit {hit}", fc.modes["exact"].tok_s, exact)
    check(f"nvme-exact at {link} GB/s, hit {hit}, RAM {ram:.3f}", fc.modes["nvme-exact"].tok_s, nvme_exact)
    assert (fc.modes["nvme-exact"].prestaged_per_token > 0) is (ram == 1.0)
    if extra:  # the picks' reads alone: over 15% too fast
        with pytest.raises(AssertionError):
            check("nvme-exact without the wrong guesses' reads",
                  F.forecast(replace(t, store_extra=None), ("nvme-exact",)).modes["nvme-exact"].tok_s, nvme_exact)


def test_the_validation_can_fail():
    """The same run forecast with the unpaced Gen5 link (51.8 GB/s) instead of the paced one misses by far more."""
    fast_link = replace(emulated_box_terms(), link_GBps=term(51.8))
    with pytest.raises(AssertionError, match="exact at the unpaced link"):
        check("exact at the unpaced link", F.forecast(fast_link, ("exact",)).modes["exact"].tok_s, 50.1)


# ---------------------------------------------------------------- the cost model's rules


def test_lane_split_is_the_planners_decode_rule():
    """For one-row misses the forecast's split is the planner's own (glm53.cpu_lane.planner.assign), which the
    decision package may not import: same lane count, same makespan, over a grid of costs and counts."""
    from glm53.cpu_lane.planner import CostModel, CpuCost, PcieCost, assign

    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(0, 12))
        lane, link = float(rng.uniform(0.05, 2.0)), float(rng.uniform(0.05, 2.0))
        model = CostModel(CpuCost(serial=lane), PcieCost(expert=link), threads=1)
        got = assign([(e, 1) for e in range(n)], model)
        k, span = F.lane_split(n, lane, link)
        assert k == len(got.cpu) and span == pytest.approx(got.makespan), (n, lane, link)
    assert F.lane_split(5, 1.0, 1.0) == (2, 3.0)  # 2 | 3 and 3 | 2 tie: less work is equal, fewer on the lane


def test_the_judges_rule_is_the_lane_judges():
    from glm53.step import lane_judge

    assert (F.MARGIN, F.MIN_SHARE) == (lane_judge.MARGIN, lane_judge.MIN_SHARE)


def test_a_lane_slower_than_the_link_is_set_aside_and_fast_is_exact():
    t = replace(emulated_box_terms(), lane_ms=term(3.0))
    fc = F.forecast(t, ("exact", "fast"))
    assert "set aside" in fc.modes["fast"].lane and fc.modes["fast"].lane_per_token == 0
    assert fc.modes["fast"].ms_per_token == pytest.approx(fc.modes["exact"].ms_per_token)
    quick = F.forecast(replace(t, lane_ms=term(0.1), lane_offer_ms=term(0.0)), ("exact", "fast"))
    assert "kept" in quick.modes["fast"].lane and quick.modes["fast"].tok_s > 1.3 * quick.modes["exact"].tok_s


def test_each_term_moves_the_forecast_the_right_way():
    t = emulated_box_terms()

    def exact(**kw) -> float:
        return F.forecast(replace(t, **kw), ("exact",)).modes["exact"].tok_s

    base = exact()
    assert exact(link_GBps=term(50)) > base > exact(link_GBps=term(12))
    assert exact(hit_rate=term(0.6)) > base > exact(hit_rate=term(0.2))
    assert exact(host_ms=term(0.0)) > base > exact(host_ms=term(0.4))
    assert exact(gpu_step_ms=term(1.0)) > base
    # exact by hand: gpu step + layers x (host + misses x bytes / link)
    by_hand = 1000 / 298.0 + 8 * (0.1985 + 8 * (1 - 0.391) * EXPERT / 24.45e9 * 1e3)
    assert 1000 / base == pytest.approx(by_hand)
    # The admissions' write-backs cross the link in series with the misses; a layer's store wait hides them.
    back = exact(write_backs=term(0.25))
    assert 1000 / back - 1000 / base == pytest.approx(8 * 8 * (1 - 0.391) * 0.25 * EXPERT / 24.45e9 * 1e3)
    slow_store = replace(t, write_backs=term(0.25), ram_rate=term(0.5), store_GBps=term(2.0))
    assert F.forecast(slow_store, ("nvme-exact",)).modes["nvme-exact"].parts_ms["write_back"] == 0.0


def test_nvme_adds_the_store_reads_for_misses_not_in_ram():
    t = replace(emulated_box_terms(), ram_rate=term(0.9), store_GBps=term(6.0))
    fc = F.forecast(t, ("exact", "nvme-exact", "nvme"))
    store = 8 * 8 * (1 - 0.9)
    assert fc.modes["nvme-exact"].store_reads_per_token == pytest.approx(store)
    assert fc.modes["nvme-exact"].ms_per_token - fc.modes["exact"].ms_per_token == pytest.approx(
        store * EXPERT / 6e9 * 1e3)
    assert fc.modes["nvme"].ms_per_token <= fc.modes["nvme-exact"].ms_per_token
    with pytest.raises(ValueError, match="ram_rate"):
        F.forecast(emulated_box_terms(), ("nvme-exact",))


def test_a_fractional_miss_count_weighs_the_two_whole_ones():
    ms, k = F.lane_layer(4.5, 1.0, 0.4, 0.25)
    lo, hi = F.lane_layer(4.0, 1.0, 0.4, 0.25), F.lane_layer(5.0, 1.0, 0.4, 0.25)
    assert ms == pytest.approx((lo[0] + hi[0]) / 2) and k == pytest.approx((lo[1] + hi[1]) / 2)


# ---------------------------------------------------------------- the terms from host facts


def settings(**env: str) -> S.Settings:
    return S.load(environ={"GLM53_MODEL_DIR": "/model", **env}, dotenv=None)


def planned(tmp_path, spec=HostSpec(), shape=M.DEFAULT_SHAPE, routing=None, **env) -> P.Plan:
    s = settings(**env)
    return P.plan(H.read_host(write_host(tmp_path, spec), store=s.store or None), shape, s, routing)


def test_the_reference_box_gets_a_forecast_for_fast_and_exact(tmp_path):
    """RTX 3090 (PCIe 4.0 x16) + 24-core EPYC 7443P, 256 GiB: fast planned; both modes forecast, every term sourced."""
    p = planned(tmp_path)
    fc = p.forecast
    assert p.mode == "fast" and fc["planned_mode"] == "fast" and list(fc["modes"]) == ["fast", "exact"]
    terms = fc["terms"]
    assert terms["link_GBps"]["value"] == 25.2 and "PCIe 4.0 x16 from host facts" in terms["link_GBps"]["source"]
    assert terms["lane_ms"]["source"].startswith("estimated from 23 threads AVX2")
    assert terms["hit_rate"]["value"] == pytest.approx(0.40, abs=0.01) and "published" in terms["hit_rate"]["source"]
    assert "936 GB/s" in terms["gpu_step_ms"]["source"] and terms["host_ms"]["value"] == F.HOST_MS_PER_MOE_LAYER
    assert all(t["source"] for t in terms.values())
    fast, exact = fc["modes"]["fast"], fc["modes"]["exact"]
    assert 5 < exact["tok_s"] <= fast["tok_s"] < 30
    assert exact["misses_per_token"] == pytest.approx(336 * 0.6, rel=0.02)  # the issue's ~200-215
    assert terms["prestage"]["value"] == F.PRESTAGE_SAVED and exact["prestaged_per_token"] > 0
    assert terms["write_backs"]["value"] == F.WRITE_BACKS_PER_MISS and exact["parts_ms"]["write_back"] > 0
    assert sum(exact["parts_ms"].values()) == pytest.approx(exact["ms_per_token"], abs=0.01)
    json.dumps(fc)


def test_a_cpu_without_avx2_forecasts_exact_only(tmp_path):
    fc = planned(tmp_path, HostSpec(cpu=IVYBRIDGE)).forecast
    assert list(fc["modes"]) == ["exact"] and "lane_ms" not in fc["terms"]


def test_an_older_link_and_an_unknown_gpu(tmp_path):
    gen3 = ("NVIDIA GeForce RTX 3090", 24576, 24135, 3, 16)
    fc = planned(tmp_path / "a", HostSpec(gpus=(gen3,))).forecast
    assert fc["terms"]["link_GBps"]["value"] == 12.6
    slower = planned(tmp_path / "b").forecast
    assert fc["modes"]["exact"]["tok_s"] < slower["modes"]["exact"]["tok_s"]
    odd = ("NVIDIA Mystery 24G", 24576, 24135, 4, 16)
    fc = planned(tmp_path / "c", HostSpec(gpus=(odd,))).forecast
    assert "not in glm53's table" in fc["terms"]["gpu_step_ms"]["source"]


def test_every_expert_in_vram_forecasts_stock(tmp_path):
    small = replace(M.DEFAULT_SHAPE, experts_per_layer=8)
    p = planned(tmp_path, shape=small)
    assert p.engine.engine == "stock"
    fc = p.forecast
    assert list(fc["modes"]) == ["stock"] and fc["terms"]["hit_rate"]["value"] == 1.0
    assert fc["modes"]["stock"]["parts_ms"]["gpu_step"] == fc["modes"]["stock"]["ms_per_token"]


def test_nvme_modes_forecast_the_store(tmp_path):
    store = "/nvx/experts.glm53"
    p = planned(tmp_path, HostSpec(mem_cap_gib=55, swap_cap_gib=0, store=store), GLM53_STORE=store)
    fc = p.forecast
    assert p.mode == "nvme" and list(fc["modes"]) == ["nvme", "nvme-exact"]
    assert fc["terms"]["store_GBps"]["value"] == F.STORE_GBPS_ASSUMED and "assumed" in fc["terms"]["store_GBps"]["source"]
    hit, ram = fc["terms"]["hit_rate"]["value"], fc["terms"]["ram_rate"]["value"]
    assert hit < ram < 1 and fc["modes"]["nvme-exact"]["store_reads_per_token"] == pytest.approx(336 * (1 - ram), abs=0.1)


def test_saved_routing_statistics_give_the_hit_rate(tmp_path):
    shape = M.DEFAULT_SHAPE
    counts = np.ones((shape.moe_layers, shape.experts_per_layer))
    counts[:, :40] = 50.0  # 40 hot experts per layer take 2,000 of 2,248 picks
    p = planned(tmp_path, routing=(counts, "saved"))
    t = p.forecast["terms"]["hit_rate"]
    assert t["source"].endswith("saved routing statistics")
    per_layer = p.engine.vram_slots
    expect = np.mean([min(s, 40) * 50 + max(0, s - 40) for s in per_layer]) / (40 * 50 + 248)
    assert t["value"] == pytest.approx(expect, abs=1e-4) and t["value"] > 0.7  # published: 0.40


def test_popularity_without_statistics():
    hit, ram, why = F.popularity(None, [32] * 8, 288, 8, ram_rows=0)
    assert hit == pytest.approx(np.interp(32 / 288, *zip(*F.GLM53_POPULARITY, strict=True))) and "published" in why
    hit, ram, why = F.popularity(None, [4] * 2, 16, 4, ram_rows=8)
    assert (hit, ram) == (0.25, 0.5) and "evenly" in why
    assert math.isclose(F.popularity(None, [1376 // 42] * 42, 288, 8)[0], 0.40, abs_tol=0.01)


def test_lane_estimate_scales_with_threads_and_isa():
    for isa, (at, ms) in F.LANE_MEASURED.items():  # where each was measured: the figure itself
        assert F.lane_estimate(isa, at).value == pytest.approx(ms)
    assert F.lane_estimate("avx512vnni", 1).value == pytest.approx(2.926)  # the one-thread end of the scaling
    assert F.lane_estimate("avx2", 23).value < F.lane_estimate("avx2", 15).value < F.lane_estimate("avx2", 4).value
    assert set(F.LANE_MEASURED) == set(F.LANE_FLAGS)  # every path lane_isa can pick has its own figure
    assert F.lane_isa(frozenset({"avx2", "fma", "f16c"})) == "avx2"
    assert F.lane_isa(frozenset({"avx", "f16c"})) is None
    assert F.lane_isa(frozenset("avx2 fma f16c avx512f avx512dq avx512bw avx512vl avx512_vnni".split())) == "avx512vnni"


# ---------------------------------------------------------------- glm53 plan --shape glm53


def cli(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glm53", "plan", "--host-root", str(root), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_plan_shape_glm53_prints_the_forecast_without_a_checkpoint(tmp_path):
    root = write_host(tmp_path, HostSpec(gpus=(RTX3090,)))
    done = cli(root, "--shape", "glm53")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    section = text[text.index("\nforecast "):]
    for needle in ("  fast ", "  exact ", "(planned)", "term        link 25.2 GB/s: PCIe 4.0 x16",
                   "term        lane ", "estimated from 23 threads AVX2", "term        hit rate 0.4",
                   "term        gpu step", "term        host 0.2 ms per MoE layer"):
        assert needle in section, needle
    assert "mode          fast" in text
    done = cli(root, "--shape", "glm53", "--json")
    out = json.loads(done.stdout)
    assert out["mode"] == "fast" and out["forecast"]["planned_mode"] == "fast"
    assert set(out["forecast"]["modes"]) == {"fast", "exact"}
    # Without --shape (and no GLM53_MODEL_DIR) the demo is planned, and nothing is forecast for it.
    out = json.loads(cli(root, "--json").stdout)
    assert out["mode"] == "demo" and out["forecast"] is None
