"""`glm53 bench decode`'s GPU-free parts: the report renders every mode's line, the nvme opener measures the store."""

from __future__ import annotations

from nvme_support import make_store

from glm53.bench import decode as B


def mode_doc(tok: float, nvme: bool = False) -> dict:
    doc = {"decode_tok_s": tok, "prefill_tok_s": 900.0, "over_stock": tok / 100, "over_bound": tok / 80,
           "hit_rate": 0.6, "cpu_pick_share": 0.2, "h2d_MiB_per_token": 300.0, "d2h_MiB_per_token": 40.0,
           "lookahead_recall": float("nan") if tok < 20 else 0.7, "host_us_per_layer_step": 40.0,
           "same_tokens_as_stock": True, "load_s": 3.0, "tiers": {}, "store_MiB_per_token": 120.0 if nvme else 0.0,
           "pick_shares": {"vram_hit": 0.6, "pcie": 0.2, "cpu": 0.15, "nvme": 0.05}}
    if nvme:
        doc.update(bound_decode_tok_s=30.0, over_own_bound_start_rate=tok / 30, over_own_bound=tok / 25,
                   bound_beside_tok_s=25.0, disk_GBps_beside=1.25,
                   over_lanes_in_series=0.93)
    return doc


def test_report_has_a_line_per_mode_and_the_targets():
    res = {"h2d_GBps": 50.0, "stock_decode_tok_s": 100.0, "stock_prefill_tok_s": 2000.0, "bound_decode_tok_s": 80.0,
           "h2d_MiB_per_token": 300.0, "slots_per_layer": 32, "same_tokens": True, "disk_GBps": 6.5,
           "ram_fraction": 0.47, "fast_over_exact": 1.6, "moe_cpu_split": "not run",
           "record_ms_by_pieces": {"1": 7.27, "4": 3.95}, "warmup_tokens": 192,
           "read_parts": 4, "read_ms_by_parts": {"1": 7.5, "2": 5.1, "4": 4.02},
           "modes": {"exact": mode_doc(50.0), "fast": mode_doc(30.0),
                     "nvme-exact": mode_doc(20.0, nvme=True), "nvme": mode_doc(25.0, nvme=True)}}
    res["modes"]["nvme-exact"]["tiers"] = {"store_reads": {"parts": 1}}
    res["modes"]["exact"]["lookahead_recall"] = float("nan")  # all in RAM: no lookahead
    res["modes"]["nvme"]["decode_store"] = {"picks_by_layer": [1.5, 0.25], "issued": 3.0, "hits": 2.0, "late": 0.5,
                                            "late_under_way": 0.25, "wasted": 0.5, "demand_misses": 1.25,
                                            "store_busy": 0.3, "guess_floor": 0.23, "guess_saving": 0.9,
                                            "idle_ms_after_layer": [1.25, 3.5]}
    res["modes"]["nvme"]["prefill_store"] = {"MiB": 1234.4, "busy": 0.61, "over_disk_bound": 0.705}
    res["modes"]["fast"]["tiers"] = {"cpu_lane": {"judge": {"kept": False, "ratio_on_over_off": 1.031,
                                                            "cpu_share": 0.039},
                                                  "jobs": 500, "kernel_seconds": 0.365,  # as JSON holds them:
                                                  "cost_model": {"cpu_expert_us": {"1": 497.3, "8": 1431.7},
                                                                 "pcie_expert_us": {"1": 391.2, "8": 391.2}}}}
    res["modes"]["nvme"]["tiers"] = {"cpu_lane": {"judge": {"kept": None, "ratio_on_over_off": None,
                                                            "cpu_share": None}}}
    res["read_contention"] = {"alone_s": 100e-6, "reader_s": 250e-6, "reader_over_alone": 2.5, "copies": 5,
                              "reads": 4, "parts": 8}
    res["host_probe"] = {"mode": "exact", "delay_us": 100.0, "paired_over_plain": 0.952,
                         "added_host_ms_per_token": 0.8, "critical_share": 0.61}
    text = B.report(res, 8)
    assert ("host on the critical path: exact with 100 us more host a layer step (0.80 ms a token) decodes at x 0.952 "
            "(paired); the token grew by 0.61 of the added host time") in text
    emulated = B.report({**res, "store_reads": B._store_reads(False, 6e9), "record_ms_by_pieces": {}}, 8)
    assert ("store: raw emulated (one fixed-rate timeline over the store's real reads) 6.50 GB/s at the start; RAM "
            "tier 0.470 of the experts\n") in emulated
    assert "100 us alone, 250 us beside 4 StoreReader reads in 8 part(s) (x 2.50)" in text
    assert ("CPU lane set aside (steps offering it took 1.031 of the others, 0.039 of picks); one expert: lane 0.50 ms "
            "idle, 0.73 ms a job in decode, link 0.39 ms (link / lane idle 0.79)") in text
    assert "CPU lane on trial" in text and text.count("CPU lane") == 2
    for mode in res["modes"]:
        assert f"  {mode} " in text, mode
    for what in ("PCIe bound", "fast / exact: 1.600, median of paired windows (target >= 1.5)", "raw O_DIRECT 6.50 GB/s at the start", "nvme / fast: 0.833",
                 "nvme picks per tier: vram_hit 0.600", "x the two lanes one after the other 0.930",
                 "reads each record in 4 part(s), timed as it opens (native pread, parts hashed): 7.50 ms in 1, 5.10 ms in 2, "
                 "4.02 ms in 4; the modes read in nvme-exact 1",
                 "one record alone: 7.27 ms in 1 piece(s), 3.95 ms in 4 piece(s)",
                 "per decoded token: store picks by layer 1.50 0.25; reads a step waited for but no guess started "
                 "1.25, guesses read 3.00 (in time 2.00, late 0.50 of which under way 0.25, wrong 0.50); store busy "
                 "0.30 of the decode, guess floor 0.23 (a right guess saving 0.90 of a read) at the windows' ends",
                 "store idle per decoded token after each layer's step, ms: 1.25; after the last (to the next "
                 "token's first MoE step) 3.50; 4.75 in all",
                 "    per prompt: 1234 MiB from the store, store busy 0.61 of the prefill; prefill x the disk's bound "
                 "0.705, median of windows",
                 "each tiered mode decoded 192 tokens before the windows",
                 "nvme-exact picks per tier", "(1.25 GB/s mean) 25.0 tok/s, x bound 1.000, median of "
                 "windows (target >= 0.8); at the start's rate 30.0 tok/s, x 0.833", "lookahead recall -"):
        assert what in text, what


def test_nvme_opener_measures_the_disk(tmp_path):
    ck, store = make_store(tmp_path, layers=3, experts=16)
    tier, rate, latency, share, (parts, timing) = B.nvme_opener(ck, store, 0.75, threads=2)
    assert share == 0.75  # 24 of the 2 MoE layers x 16 experts
    assert B.nvme_opener(ck, store, 0.1, threads=2)[3] == 17 / 32  # one layer's 16 experts plus one
    assert tier.ram_slots == 24 and tier.store == store and rate > 0
    assert set(latency) == {1, 4, 8} and all(t > 0 for t in latency.values())
    assert parts == 1 and all(t > 0 for t in timing.values())  # records under 1 MiB: one part


def test_paired_ratio_cancels_drift_between_windows():
    # The machine's speed moves 8x between windows; fast is 1.5x exact within each.
    rows = [{"name": n, "window": w, "decode_tok_s": v} for w, (e, f) in enumerate([(100, 150), (50, 75), (400, 600)])
            for n, v in (("exact", e), ("fast", f))]
    assert B.paired_ratio(rows, "fast", "exact") == 1.5
    rows.append({"name": "fast", "window": 3, "decode_tok_s": 10.0})  # no exact in window 3: not paired
    assert B.paired_ratio(rows, "fast", "exact") == 1.5
    assert B.paired_ratio(rows, "exact", "stock") != B.paired_ratio(rows, "exact", "stock")  # nan: nothing paired
    rows += [{"name": "exact", "window": 3, "decode_tok_s": 20.0}]  # a 0.5 outlier window: the median holds
    assert B.paired_ratio(rows, "fast", "exact") == 1.5
    rows[0]["decode_tok_s"] = 300  # window 0 now 0.5 too: ratios 0.5, 0.5, 1.5, 1.5 -> the middle two's mean
    assert B.paired_ratio(rows, "fast", "exact") == 1.0


def test_a_kept_checkpoint_or_store_is_made_once(tmp_path, capsys):
    made = []
    marker = tmp_path / "ckpt.complete"
    for _ in range(2):
        B._made_once(marker, lambda: made.append(1), "the checkpoint")
    assert made == [1] and marker.exists()
    out = capsys.readouterr().out
    assert "made the checkpoint in" in out and "reusing the checkpoint" in out
    failing = tmp_path / "store.complete"
    try:
        B._made_once(failing, lambda: 1 / 0, "the store")
    except ZeroDivisionError:
        pass
    assert not failing.exists(), "a half-made store must be made again next time"


def test_own_bound_uses_the_disk_rate_beside_each_window():
    # Stock's step is 10 ms, the pinned rate 1 GB/s. Window 0: the GPU side is 10 ms + 10 MB = 20 ms, the disk
    # 30 MB at 1 GB/s = 30 ms: the disk bounds, 25 tok/s is 0.75 of it. Window 1: the disk gave 0.5 GB/s, 60 ms,
    # and 15 tok/s is 0.9 of that; at one rate for the run it would read as 0.45.
    rows = [{"name": "stock", "window": 0, "decode_tok_s": 100.0}, {"name": "stock", "window": 1, "decode_tok_s": 100.0},
            {"name": "nvme", "window": 0, "decode_tok_s": 25.0, "h2d_bytes_per_token": 1e7,
             "store_bytes_per_token": 3e7, "disk_Bps": 1e9},
            {"name": "nvme", "window": 1, "decode_tok_s": 15.0, "h2d_bytes_per_token": 1e7,
             "store_bytes_per_token": 3e7, "disk_Bps": 0.5e9},
            {"name": "nvme", "window": 2, "decode_tok_s": 99.0, "h2d_bytes_per_token": 1e7,
             "store_bytes_per_token": 3e7, "disk_Bps": 1e9}]  # no stock in window 2: not counted
    got = B.own_bound_beside(rows, "nvme", 1e9)
    assert abs(got["over_own_bound"] - (25 * 0.03 + 15 * 0.06) / 2) < 1e-9  # 0.75 and 0.9: the median of two
    assert abs(got["bound_beside_tok_s"] - (1 / 0.03 + 1 / 0.06) / 2) < 1e-9
    assert abs(got["disk_GBps_beside"] - 0.75) < 1e-12
    # In series: window 0 takes 20 + 30 = 50 ms at best, so 25 tok/s is 1.25 of it; window 1, 20 + 60 ms: 1.2.
    assert abs(got["over_lanes_in_series"] - (25 * 0.05 + 15 * 0.08) / 2) < 1e-9
    rows[2]["store_bytes_per_token"] = 1e6  # the GPU side bounds window 0 now: 20 ms
    assert abs(B.own_bound_beside(rows, "nvme", 1e9)["over_own_bound"] - (25 * 0.02 + 15 * 0.06) / 2) < 1e-9
    assert B.own_bound_beside(rows, "nvme-exact", 1e9)["over_own_bound"] != 0.0  # nan: no windows


def test_the_nvme_forecast_takes_the_disk_rate_beside_the_windows():
    assert B._disk_beside({"disk_GBps_beside": 0.75}, 2e9) == 0.75e9  # the disk slowed during the run
    assert B._disk_beside({"disk_GBps_beside": float("nan")}, 2e9) == 2e9  # no window measured it: the start's
    assert B._disk_beside({}, None) is None


def test_prefill_is_judged_by_the_disk_time_its_store_bytes_take():
    # Window 0: 1 GB from the store at 2 GB/s is 0.5 s of disk time, the prefill took 1 s: 0.5 of the bound.
    # Window 1: 0.9 GB at 1 GB/s over a 1 s prefill: 0.9. Window 2 read nothing from the store: no ratio.
    rows = [{"name": "nvme", "prefill_s": 1.0, "prefill_store_bytes": 1e9, "prefill_store_busy": 0.4, "disk_Bps": 2e9},
            {"name": "nvme", "prefill_s": 1.0, "prefill_store_bytes": 0.9e9, "prefill_store_busy": 0.8,
             "disk_Bps": 1e9},
            {"name": "nvme", "prefill_s": 0.5, "prefill_store_bytes": 0, "prefill_store_busy": 0.0, "disk_Bps": 1e9},
            {"name": "fast", "prefill_s": 0.3}]
    got = B.prefill_store(rows, "nvme")
    assert abs(got["over_disk_bound"] - 0.7) < 1e-12  # the median of 0.5 and 0.9
    assert abs(got["MiB"] - 1.9e9 / 3 / 2**20) < 1e-9 and abs(got["busy"] - 0.4) < 1e-12
    assert B.prefill_store(rows, "fast") == {}


def test_disk_probe_reads_a_fresh_sample_each_time(tmp_path):
    ck, store = make_store(tmp_path, layers=3, experts=16)
    probe = B._disk_probe(store, records=8, threads=2)
    assert probe() > 0 and probe() > 0


def test_window_line_names_the_traffic_host_time_and_disk_share():
    assert B.window_line(0, "stock", 512, {"prefill_s": 0.06, "decode_tok_s": 280.0}) == \
        "window 0 stock: prefill 512 tok in 0.060 s, decode 280.0 tok/s"
    res = {"prefill_s": 0.6, "decode_tok_s": 40.0, "hit_rate": 0.4, "picks": {"cpu": 0},
           "h2d_bytes_per_token": 345 * 2**20, "d2h_bytes_per_token": 30 * 2**20, "host_us_per_layer_step": 550.0,
           "host_ms_per_token": {"plan": 4.4, "store_wait": 8.0}, "store_bytes_per_token": 50e6, "disk_Bps": 25e9}
    line = B.window_line(2, "nvme", 512, res)
    assert line.startswith("window 2 nvme: prefill 512 tok in 0.600 s, decode 40.0 tok/s, hit rate 0.400")
    assert "345 MiB/token H2D" in line and "host 550 us/layer step; host ms/token plan 4.40 store_wait 8.00" in line
    assert line.endswith("(0.08 of the disk's time at the 25.00 GB/s it gave beside this window)")


def test_an_emulated_disk_is_refused_without_a_rate_an_nvme_mode_or_the_hook():
    """--emulate-disk-GBps: a rate above 0, an nvme mode to read the store, and the bench's emulator with the store's
    read hook (glm53.bench.emulated_disk) to pace its reads."""
    from glm53.bench import emulated_disk as E

    assert "above 0" in B.emulation_problem(0, ("nvme-exact",))
    assert "no nvme mode" in B.emulation_problem(6, ("exact", "fast"))
    assert B.emulation_problem(6, ("fast", "nvme-exact", "nvme")) == E.problem()


def test_deleted_variant_modes_are_gone():
    assert B.MODES == ("exact", "fast", "nvme-exact", "nvme")
    assert not hasattr(B, "VARIANTS") and not hasattr(B, "set_path")


def test_split_result_pairs_two_cards_with_one_and_reports_each_card():
    def row(name, w, tok, devices=None):
        r = {"name": name, "window": w, "decode_tok_s": tok, "host_ms_per_token": {"plan": 2.0, "sync": 1.0}}
        if devices:
            r["devices"] = [{"device": f"cuda:{i}", "picks": p, "pcie": p // 2, "link_MiB_per_token": m}
                            for i, (p, m) in enumerate(devices)]
        return r

    rows = [row("exact", 0, 10.0), row("exact@2", 0, 17.0, [(300, 40.0), (100, 20.0)]),
            row("exact", 1, 20.0), row("exact@2", 1, 34.0, [(100, 20.0), (100, 20.0)])]
    got = B.split_result(rows, ["exact"], 2, 32, 64)["exact"]
    assert got["paired_over_one_card"] == 1.7 and got["decode_tok_s"] == 25.5
    assert got["pick_share_by_card"] == [400 / 600, 200 / 600] and got["link_MiB_per_token_by_card"] == [30.0, 20.0]
    assert got["host_ms_per_token"] == {"plan": 2.0, "sync": 1.0} and B.split_modes(["exact"], 2) == ["exact@2"]
    assert B.split_modes(["exact"], 1) == []
    res = {"h2d_GBps": 50.0, "stock_decode_tok_s": 100.0, "stock_prefill_tok_s": 2000.0, "bound_decode_tok_s": 80.0,
           "h2d_MiB_per_token": 300.0, "slots_per_layer": 32, "same_tokens": True, "moe_cpu_split": "not run",
           "modes": {"exact": mode_doc(20.0)}, "split": {"exact": {**got, "same_tokens_as_stock": True}}}
    text = B.report(res, 8)
    assert ("exact on 2 cards (64 slots/layer, each card as many slots as the one card's 32/layer):     25.5 tok/s "
            "decode, x one card 1.700 (paired; target >= 1.6 on the 8-MoE-layer fixture); stock's tokens: True") in text
    assert "per card: picks 0.667, 0.333; link MiB/token 30.0, 20.0; host ms/token: plan 2.00, sync 1.00" in text
