"""bench decode's forecast check (glm53.bench.forecast_check): a run's own terms into the speed forecast's cost
model, the measured rate over it. On the twenty-first session's emulated consumer box (docs/results.md)."""

from __future__ import annotations

import pytest

from glm53.bench.decode import report
from glm53.bench.forecast_check import checked, run_terms
from glm53.planning import forecast as F

EXPERT = 9 * (1 << 20) + 36 * 1024


def mode(tok_s: float, vram: float, nvme: float = 0.0) -> dict:
    return {"decode_tok_s": tok_s, "pick_shares": {"vram_hit": vram, "pcie": 1 - vram - nvme, "cpu": 0.0,
                                                   "nvme": nvme}}


def terms(m: dict, lane_ms: float | None = None, store_Bps: float | None = None) -> F.Terms:
    return run_terms(m, moe_layers=8, top_k=8, expert_bytes=EXPERT, stock_tok_s=298.0, link_Bps=24.45e9,
                     lane_ms=lane_ms, store_Bps=store_Bps)


def test_the_emulated_box_exact_run_is_within_15_percent_of_its_forecast() -> None:
    exact = mode(50.1, 0.391)
    got = checked("exact", exact, terms(exact))
    print(f"exact: forecast {got['tok_s']:.1f}, measured / forecast {got['measured_over_forecast']:.3f}")
    assert got["as"] == "exact" and abs(got["measured_over_forecast"] - 1) <= 0.15
    assert got["terms"]["hit_rate"]["source"] == "measured in this run: picks VRAM served"
    assert got["terms"]["host_ms"]["source"] == F.HOST_SOURCE  # the plan's constant, not this run's
    # The measured rate is no input: another rate at the same terms moves only the ratio.
    assert checked("exact", mode(25.05, 0.391), terms(exact))["measured_over_forecast"] == pytest.approx(
        got["measured_over_forecast"] / 2)


def test_a_fast_mode_without_a_lane_is_forecast_as_exact_and_nvme_reads_the_store() -> None:
    fast = mode(49.8, 0.391)
    assert checked("fast", fast, terms(fast))["as"] == "exact"
    lane = checked("fast", fast, terms(fast, lane_ms=1.295))
    assert lane["as"] == "fast" and "lane" in lane["lane"]
    nv = mode(30.0, 0.391, nvme=0.2)
    with_store = checked("nvme-exact", nv, terms(nv, store_Bps=6e9))
    assert with_store["as"] == "nvme-exact" and with_store["tok_s"] < checked("exact", nv, terms(nv))["tok_s"]


def test_the_report_prints_each_modes_forecast_line() -> None:
    exact = {**mode(50.1, 0.391), "prefill_tok_s": 1.0, "over_stock": 0.17, "over_bound": 0.9,
             "hit_rate": 0.391, "cpu_pick_share": 0.0, "lookahead_recall": float("nan"),
             "host_us_per_layer_step": 200.0}
    exact["forecast"] = checked("exact", exact, terms(exact))
    res = {"same_tokens": True, "slots_per_layer": 32, "stock_decode_tok_s": 298.0, "stock_prefill_tok_s": 1.0,
           "modes": {"exact": exact}, "h2d_MiB_per_token": 352.0, "h2d_GBps": 24.45, "bound_decode_tok_s": 55.2,
           "moe_cpu_split": "not run"}
    text = report(res, 8)
    assert f"forecast {exact['forecast']['tok_s']:.1f} tok/s (as exact), measured / forecast" in text
