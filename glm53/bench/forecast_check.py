"""The speed forecast (glm53.planning.forecast) checked against a bench decode run: each mode forecast from the
terms this run measured (stock's step, the link's rate, the mode's share of picks served from VRAM / RAM, the
lane's calibrated cost, the admissions' write-backs, the share of the prestage's copies read) and the plan's
constants (host time per MoE layer, the lane's offer and its slow-down inside decode), next to the rate the mode
reached. What the ratio tests is the cost model's structure; the plan's own forecast differs only in where its terms
come from (host facts and published popularity instead of this run)."""

from __future__ import annotations

from typing import Any

from glm53.planning import forecast as F


def _measured(value: float, unit: str, what: str) -> F.Term:
    return F.Term(value, unit, f"measured in this run: {what}")


def run_terms(mode: dict[str, Any], *, moe_layers: int, top_k: int, expert_bytes: int, stock_tok_s: float,
              link_Bps: float, lane_ms: float | None, store_Bps: float | None) -> F.Terms:
    """A mode's Terms from one bench decode run (its result's mode entry; the prestage's term where the mode ran
    one through the windows)."""
    shares = mode["pick_shares"]
    ram_rate = _measured(1 - shares["nvme"], "", "picks not read from the store") if store_Bps else None
    demand_mib = shares["nvme"] * moe_layers * top_k * expert_bytes / 2**20  # a token's picks read from the store
    extra = _measured(max(0.0, mode.get("store_MiB_per_token", 0.0) / demand_mib - 1), "of the store's demand reads",
                      "the store's reads beyond the picks it served") if store_Bps and demand_mib > 0 else None
    return F.Terms(
        moe_layers=moe_layers, top_k=top_k, expert_bytes=expert_bytes,
        hit_rate=_measured(shares["vram_hit"], "", "picks VRAM served"),
        gpu_step_ms=_measured(1000 / stock_tok_s, "ms", "stock's decode step"),
        host_ms=F.Term(F.HOST_MS_PER_MOE_LAYER, "ms", F.HOST_SOURCE),
        link_GBps=_measured(link_Bps / 1e9, "GB/s", "the link's rate (paced where emulated)"),
        lane_ms=_measured(lane_ms, "ms", "the lane's one-row expert as start-up calibrated it (idle)") if lane_ms else None,
        lane_offer_ms=F.Term(F.LANE_OFFER_MS, "ms", F.LANE_OFFER_SOURCE) if lane_ms else None,
        lane_decode=F.lane_decode_term() if lane_ms else None,
        ram_rate=ram_rate, store_GBps=_measured(store_Bps / 1e9, "GB/s", "the store's raw reads") if store_Bps else None,
        store_extra=extra, write_backs=write_backs(mode, moe_layers * top_k, expert_bytes),
        prestage=prestage_term(((mode.get("tiers") or {}).get("lookahead") or {}).get("prestage")))


def write_backs(mode: dict[str, Any], picks: int, expert_bytes: int) -> F.Term | None:
    """The run's write-backs (its device -> host MiB a token) per miss; none where the run did not report them."""
    misses = picks * (1 - mode["pick_shares"]["vram_hit"])
    if "d2h_MiB_per_token" not in mode or misses <= 0:
        return None
    return _measured(mode["d2h_MiB_per_token"] * 2**20 / expert_bytes / misses, "a miss",
                     "the admissions' victims written back to RAM")


def prestage_term(prestage: dict[str, Any] | None) -> F.Term | None:
    """The prestage's term where it ran through the windows: none where the mode had none or its judge set it aside
    (then it stops before the windows), its saving scaled to the share of its copies read by their step."""
    if not prestage or (prestage.get("judge") or {}).get("kept") is False:
        return None
    return F.prestage_term(prestage["precision"] if prestage.get("staged") else None)


def checked(mode_name: str, mode: dict[str, Any], terms: F.Terms) -> dict[str, Any]:
    """The forecast for one measured mode and the measured rate over it."""
    kind = "nvme-exact" if mode_name.startswith("nvme-exact") else "nvme" if mode_name.startswith("nvme") else (
        "fast" if mode_name.startswith("fast") else "exact")
    if kind in ("fast", "nvme") and terms.lane_ms is None:
        kind = "exact" if kind == "fast" else "nvme-exact"  # no lane started: the mode runs as its exact twin
    got = F.mode_forecast(kind, terms)
    return {"as": kind, "tok_s": got.tok_s, "measured_over_forecast": mode["decode_tok_s"] / got.tok_s,
            "lane": got.lane, "terms": {n: t.to_json() for n, t in terms.named().items()}}


def line(mode_name: str, fc: dict[str, Any]) -> str:
    return (f"  {mode_name:<37}: forecast {fc['tok_s']:.1f} tok/s (as {fc['as']}), measured / forecast "
            f"{fc['measured_over_forecast']:.3f} (target 0.85-1.15)" + (f"; {fc['lane']}" if fc.get("lane") else ""))
