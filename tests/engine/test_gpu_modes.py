"""fast, nvme-exact and nvme on the GPU machine (pytest -m gpu tests/engine/test_gpu_modes.py -s).

- nvme-exact: the experts come from a record store packed from the checkpoint, through a RAM tier smaller than
  the experts VRAM leaves out; greedy logits must be bit-identical to stock exllamav3 (all experts in VRAM).
- fast and nvme: the CPU lane computes some RAM-resident picks, so results are near-exact. Paired forwards on the
  same token windows, tiered vs stock: mean KL(stock || mode) and top-1 agreement over 1,000+ positions. Each
  window is one forward of 8 rows, which exllamav3 runs through the fused decode kernel (bsz <= 8): the path where
  the lane works. Targets (issue 6): mean KL <= 0.001, top-1 >= 0.99.
"""

from __future__ import annotations

import gc

import pytest
from forced_lane import failing_lane, force_lane, late_lane
from specs import spec_for
from test_gpu_engine import assert_bit_identical, greedy_runs, prompts_for

from glm53.exl3.handoff import LaneHandOffError
from glm53.fixture.exl3 import write_exl3_checkpoint

pytestmark = pytest.mark.gpu

WINDOW = 8  # rows per forward: exllamav3's fused decode kernel limit, where the CPU lane takes picks


def pack(model_dir, out):
    from store.pack import PackOptions, pack_store

    pack_store(PackOptions(model_dir, out, threads=4, progress=False), log=lambda m: None)
    return out


def nvme_open(store, model_dir, ram_records: int, mode: str, slots: int):
    """TieredMoE's nvme_open: the store through a RAM tier of `ram_records` records; `.spec` sizes both."""
    from glm53.tiers.nvme_open import open_nvme_tier

    spec = spec_for(model_dir, mode, slots, device="cuda:0", store=str(store), ram_slots=ram_records,
                    store_threads=4)

    def open_():
        return open_nvme_tier(store, model_dir, spec, warm=False, pin=True)

    open_.spec = spec
    return open_


def paired_logits(model_dir, windows, slots=None, lane_threads=None, nvme=None, forced_lane=False,
                  late_s=0.0, fail_after=None) -> tuple[list, dict]:
    """Logits of one forward per token window (no cache: each window is a fresh sequence of WINDOW rows). fail_after:
    the lane's worker fails at its step after that many; the hand-off check after each forward is in the stats
    (`handoff_errors`: the windows whose forward it failed)."""
    import torch
    from exllamav3 import Config, Model

    from glm53.exl3.tiered import TieredMoE

    model = Model.from_config(Config.from_directory(str(model_dir)))
    tiered = None
    if slots is not None:
        spec = nvme.spec if nvme is not None else spec_for(model_dir, "fast" if lane_threads else "exact", slots,
                                                            device="cuda:0", cpu_threads=lane_threads or 0)
        tiered = TieredMoE(model, model_dir, spec, nvme_open=nvme)
        tiered.install()
    model.load(device=torch.device("cuda:0"))
    try:
        if tiered is not None:
            tiered.populate()
            if lane_threads:
                tiered.start_lane(lane_threads)
            if forced_lane:
                force_lane(tiered)
            if late_s:
                late_lane(tiered, late_s)
            if fail_after is not None:
                failing_lane(tiered, fail_after)
        out, failed = [], []
        with torch.inference_mode():
            for i, w in enumerate(windows):
                ids = torch.tensor([w], dtype=torch.long)
                logits = model.forward(ids, {"attn_mode": "flash_attn_nc"})
                out.append(logits[0].float().cpu())
                if tiered is not None:
                    try:
                        tiered.check_handoff()
                    except LaneHandOffError:
                        failed.append(i)
        stats = tiered.snapshot() if tiered is not None else {}
        return out, {**stats, "handoff_errors": failed}
    finally:
        model.unload()
        if tiered is not None:
            tiered.close()
        del model
        gc.collect()
        torch.cuda.empty_cache()


def kl_top1(stock: list, other: list) -> tuple[float, float, int]:
    import torch

    a = torch.cat(stock).double()
    b = torch.cat(other).double()
    lp, lq = a.log_softmax(-1), b.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (a.argmax(-1) == b.argmax(-1)).double()
    return float(kl.mean()), float(top1.mean()), int(a.shape[0])


def windows_for(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(WINDOW)] for _ in range(n)]


def _near_exact(name, stock, got, stats, kl_max=1e-3, top1_min=0.99):
    kl, top1, n = kl_top1(stock, got)
    lane = stats["cpu_lane"]
    print(f"\n{name}: {n} positions, mean KL {kl:.2e}, top-1 {top1:.4f}; picks {stats['picks']}; lane jobs "
          f"{lane['jobs']}, recomputed {lane['recomputed_jobs']}, isa {lane['isa']}; cost model "
          f"{lane.get('cost_model', {}).get('cpu_expert_us')} us CPU vs "
          f"{lane.get('cost_model', {}).get('pcie_expert_us')} us PCIe per expert")
    assert n >= 1000
    # The lane's own count: in nvme mode a pick read from the store counts as "nvme" in picks, whoever computes it.
    assert lane["picks"] > 0, "the lane took no picks: nothing was measured"
    assert kl <= kl_max and top1 >= top1_min, f"{name}: KL {kl:.2e}, top-1 {top1:.4f}"


def test_tiny_fast_mode_kl_and_top1(tmp_path, exl3):
    path = write_exl3_checkpoint(tmp_path / "tiny", router_skew=(0.25, 0.5), layers=4, dense_layers=1)
    windows = windows_for(200, 160)
    stock, _ = paired_logits(path, windows)
    fast, stats = paired_logits(path, windows, slots=3, lane_threads=4)
    _near_exact("tiny fast, 3 slots/layer", stock, fast, stats)


def test_glm53_width_fast_mode_kl_and_top1(tmp_path, exl3):
    path = write_exl3_checkpoint(tmp_path / "glm53", shape="glm53", moe_layers=2, mtp_layers=0, shards=4,
                                 router_skew=(0.11, 0.40))
    windows = windows_for(150000, 130)
    stock, _ = paired_logits(path, windows)
    fast, stats = paired_logits(path, windows, slots=32, lane_threads=8)
    _near_exact("glm53 x2 fast, 32 slots/layer", stock, fast, stats)


def test_glm53_width_lane_on_every_cold_pick(tmp_path, exl3):
    # Issue 40's accuracy panel: the lane computes every pick that misses VRAM (PCIe priced out of the planner,
    # the judge always offering it), with the kernel the lane serves on this host; full width, paired against stock.
    path = write_exl3_checkpoint(tmp_path / "glm53", shape="glm53", moe_layers=2, mtp_layers=0, shards=4,
                                 router_skew=(0.11, 0.40))
    windows = windows_for(150000, 130)
    stock, _ = paired_logits(path, windows)
    forced, stats = paired_logits(path, windows, slots=32, lane_threads=15, forced_lane=True)
    lane, picks = stats["cpu_lane"], stats["picks"]
    cold = picks["total"] - picks["vram_hit"]
    print(f"lane kernel {lane.get('kernel')} on {lane['isa']}: {lane['picks']} lane picks of {cold} that missed VRAM")
    assert lane["recomputed_jobs"] <= 0.02 * max(1, lane["jobs"]), "late lane jobs recomputed: the panel is flattered"
    assert lane["picks"] >= 0.9 * cold, f"the lane did not take the cold picks: {picks}"
    _near_exact("glm53 x2, the lane on every cold pick", stock, forced, stats, kl_max=2e-3)


def forced_lane_run(tmp_path, n: int, **kw) -> tuple[list, list, dict]:
    """Stock's logits and those with the lane on every cold pick (kw: late_s or fail_after) on n windows of a
    2-MoE-layer full-width checkpoint."""
    path = write_exl3_checkpoint(tmp_path / "glm53", shape="glm53", moe_layers=2, mtp_layers=0, shards=4,
                                 router_skew=(0.11, 0.40))
    windows = windows_for(150000, n)
    stock, _ = paired_logits(path, windows)
    got, stats = paired_logits(path, windows, slots=32, lane_threads=8, forced_lane=True, **kw)
    return stock, got, stats


def test_glm53_width_late_lane_waited_for_behind_the_stream_handoff(tmp_path, exl3):
    # The lane's partial is added in stream order (glm53.exl3.handoff): the engine thread queues the next layer while
    # the resolver waits for the ticket. Here every lane step is past its deadline; with the GPU already waiting on
    # the step's flag nothing may be recomputed on it, so the resolver waits for the lane and then releases the GPU.
    # The logits are then the lane's own: as near stock as the lane panel's (every cold pick on the lane, on time).
    stock, late, stats = forced_lane_run(tmp_path, 24, late_s=0.15)
    lane = stats["cpu_lane"]
    kl, top1, n = kl_top1(stock, late)
    print(f"\nlate lane: {n} positions, mean KL {kl:.2e}, top-1 {top1:.4f}; {lane['stream_handoffs']} hand-offs, "
          f"{lane['deadline_misses']} deadlines missed, {lane['recomputed_jobs']} jobs recomputed, {lane['jobs']} on "
          "the lane")
    assert lane["stream_handoffs"] >= 2 * len(late) and lane["deadline_misses"] > 0
    assert lane["recomputed_jobs"] == 0 and lane["alive"] and stats["handoff_errors"] == [], lane
    assert kl <= 2e-3 and top1 >= 0.99, f"KL {kl:.2e}, top-1 {top1:.4f}"


def test_glm53_width_failed_lane_fails_its_forward_behind_the_stream_handoff(tmp_path, exl3):
    # The lane's worker dies at its third step while the GPU waits on that step's flag: the resolver writes NaN and
    # the flag, the check after that forward fails it, the lane is disabled, and every later window is stock's again.
    stock, got, stats = forced_lane_run(tmp_path, 8, fail_after=2)
    failed = stats["handoff_errors"]
    later = [i for i in range(len(got)) if i > failed[0]] if failed else []
    kl, top1, _ = kl_top1([stock[i] for i in later], [got[i] for i in later]) if later else (float("nan"), 0.0, 0)
    print(f"\nfailed lane: forwards failed {failed}, lane alive {stats['cpu_lane']['alive']}; after it KL {kl:.2e}, "
          f"top-1 {top1:.4f}")
    assert len(failed) == 1 and not stats["cpu_lane"]["alive"] and later
    assert kl <= 1e-4 and top1 >= 0.99


def test_tiny_nvme_exact_bit_identical(tmp_path, exl3):
    path = write_exl3_checkpoint(tmp_path / "tiny", router_skew=(0.25, 0.5), layers=4, dense_layers=1)
    store = pack(path, tmp_path / "experts.glm53")
    steps = 256
    prompts = prompts_for(200)
    stock = greedy_runs(path, prompts, steps)
    # 3 MoE layers x 16 experts, 2 VRAM slots each; RAM holds 17 of the 42 others: constant store reads.
    got = greedy_runs(path, prompts, steps, slots=2, nvme=nvme_open(store, path, 17, "nvme-exact", 2))
    assert_bit_identical(stock, got, steps)
    s = got["stats"]
    assert s["mode"] == "nvme-exact" and s["picks"]["nvme"] > 0 and s["ram_drops"] > 0
    print(f"\ntiny nvme-exact: {steps} steps bit-identical; picks {s['picks']}, lookahead {s['lookahead']}, "
          f"prefetch {s['prefetch']}")


def test_tiny_nvme_mode_kl_and_top1(tmp_path, exl3):
    path = write_exl3_checkpoint(tmp_path / "tiny", router_skew=(0.25, 0.5), layers=4, dense_layers=1)
    store = pack(path, tmp_path / "experts.glm53")
    windows = windows_for(200, 160)
    stock, _ = paired_logits(path, windows)
    got, stats = paired_logits(path, windows, slots=2, lane_threads=4, nvme=nvme_open(store, path, 20, "nvme", 2))
    assert stats["mode"] == "nvme"
    _near_exact("tiny nvme, 2 slots/layer, 20 RAM records", stock, got, stats)
