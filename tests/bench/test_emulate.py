"""The consumer-box emulation's arithmetic and options (glm53.bench.emulate), on the CPU; the paced link itself is
measured on the GPU (test_paced_link_delivers_the_target_rate)."""

from __future__ import annotations

import argparse

import pytest

from glm53.bench import emulate
from glm53.bench.emulate import Emulation, LinkPacer, pace_seconds


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    emulate.add_arguments(p)
    p.add_argument("--cpu-threads", type=int)
    return p.parse_args(list(argv))


def test_a_copy_is_held_back_by_the_time_the_slower_link_adds() -> None:
    nbytes = 9 << 20
    held = pace_seconds(nbytes, 25e9, 50e9)
    assert held == pytest.approx(nbytes / 25e9 - nbytes / 50e9)
    # What the copy then takes in all is its time at the target rate.
    assert nbytes / 50e9 + held == pytest.approx(nbytes / 25e9)
    assert pace_seconds(nbytes, 60e9, 50e9) == 0.0  # a target above the real link is not emulated
    assert pace_seconds(0, 25e9, 50e9) == 0.0


def test_the_pacer_sleeps_on_the_device_for_the_held_time(monkeypatch) -> None:
    import torch

    slept: list[int] = []
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)
    pacer = LinkPacer(25e9, 50e9, cycles_per_s=1.5e9)
    pacer(9 << 20)
    pacer(9 << 20)
    want = pace_seconds(9 << 20, 25e9, 50e9)
    assert slept == [int(want * 1.5e9)] * 2
    assert pacer.paced_bytes == 2 * (9 << 20) and pacer.held_s == pytest.approx(2 * want)
    LinkPacer(60e9, 50e9, 1.5e9)(1 << 20)  # nothing to hold: no sleep queued
    assert len(slept) == 2


def test_the_preset_and_the_flags_laid_over_it() -> None:
    emu = emulate.from_args(parse("--emulate", "rtx3090-gen4"))
    assert emu.link_GBps == 25.0 and emu.card_fraction == emulate.CARD_FRACTION and emu.lane_isas == ("avx2",)
    emu = emulate.from_args(parse("--emulate", "rtx3090-gen4", "--link-GBps", "12", "--cpu-threads", "8",
                                  "--lane-isa", "avx2,avx512"))
    assert (emu.link_GBps, emu.lane_threads, emu.lane_isas) == (12.0, 8, ("avx2", "avx512"))
    assert emu.card_fraction == emulate.CARD_FRACTION
    assert emulate.from_args(parse()) == Emulation()
    assert "25 GB/s" in emulate.PRESETS["rtx3090-gen4"].describe()
    with pytest.raises(SystemExit):
        parse("--emulate", "rtx9090")


def test_the_card_share_sets_the_slots() -> None:
    assert emulate.slots_for(emulate.PRESETS["rtx3090-gen4"], 288, default=5) == 32  # 11% of a layer's 288
    assert emulate.slots_for(Emulation(), 288, default=5) == 5
    assert emulate.slots_for(Emulation(card_fraction=0.001), 48, default=5) == 1


@pytest.mark.parametrize(("emu", "words"), [
    (Emulation(link_GBps=0.0), "link rate"),
    (Emulation(card_fraction=1.5), "share of the experts"),
    (Emulation(lane_threads=64), "has 16 cores"),
    (Emulation(lane_isas=("avx512",)), "cannot run ['avx512']"),
])
def test_what_this_machine_cannot_emulate_is_named(emu: Emulation, words: str) -> None:
    assert words in emulate.problem(emu, ["scalar", "avx2"], cores=16)


def test_what_it_can_is_not_refused() -> None:
    assert emulate.problem(emulate.PRESETS["rtx3090-gen4"], ["scalar", "avx2", "avx512"], cores=16) is None


def test_misses_per_token_pool_the_windows() -> None:
    from glm53.bench.decode import misses_per_token

    rows = [{"decoded_tokens": 10, "picks": {"total": 640, "vram_hit": 240}},
            {"decoded_tokens": 30, "picks": {"total": 1920, "vram_hit": 800}}]
    assert misses_per_token(rows) == pytest.approx((400 + 1120) / 40)


def test_a_baseline_window_carries_the_emulation_flags(tmp_path) -> None:
    from glm53.bench.decode_baseline import window_args

    ns = argparse.Namespace(skew="0.11,0.40", tokens=8, windows=1, prompt_tokens=16, modes="exact", ram_fraction=0.47,
                            warmup_tokens=4, model=None, moe_layers=2, slots=None, cpu_threads=None, store_dir=None,
                            emulate_disk_GBps=None, emulate="rtx3090-gen4", link_GBps=None, lane_isa=None)
    argv = window_args(ns, tmp_path, tmp_path / "w.json")
    assert argv[argv.index("--emulate") + 1] == "rtx3090-gen4" and "--link-GBps" not in argv


@pytest.mark.gpu
def test_paced_link_delivers_the_target_rate() -> None:
    """Expert-sized copies through a paced Copier arrive at the target rate (within 10%), unpaced at the real one."""
    from glm53.bench.emulate import h2d_rate

    nbytes = 9 << 20
    measured = h2d_rate(nbytes, repeats=21)
    got = emulate.paced_rate(LinkPacer(25e9, measured, emulate.sleep_cycles_per_s()), nbytes, copies=64)
    print(f"\npaced link: {got / 1e9:.2f} GB/s (target 25, unpaced expert copies {measured / 1e9:.1f} GB/s)")
    assert got == pytest.approx(25e9, rel=0.1)


def test_the_served_engine_loads_on_the_emulated_host(tmp_path) -> None:
    """glm53.bench.emulated_serve on the engine `glm53 serve` chose: before it loads, its spec gets the card's share
    of the slots and the lane's threads, and once its tiers hold their experts the hook narrows the lane's paths."""
    import fake_exllamav3 as F
    from specs import spec_for

    from glm53.bench.emulated_serve import emulated
    from glm53.engine.exl3_engine import Exl3Engine
    from glm53.fixture.exl3 import write_exl3_checkpoint

    ck = write_exl3_checkpoint(tmp_path / "ck", layers=4, dense_layers=1, experts=16, top_k=4)
    from glm53.cpu_lane import kernel

    isa = kernel.supported_isas()[-1]  # one path of those this CPU runs
    emu = Emulation(name="box", card_fraction=0.25, lane_threads=1, lane_isas=(isa,))
    with F.installed():
        engine = emulated(Exl3Engine(ck, spec_for(ck, "fast", 6, kv_tokens=512, cpu_threads=2)), emu)
        assert engine.spec.vram_slots == (4, 4, 4) and engine.spec.cpu_threads == 1
        engine.load()
        try:
            assert engine.tiered.lane_isas == (isa,)
            assert [m.num_slots for m in engine.tiered.tiers.vram] == [4, 4, 4]
        finally:
            engine.close()


def test_bench_serve_starts_the_emulated_server(hf_model_dir, tmp_path, monkeypatch, capsys) -> None:
    """--emulate starts the server through glm53.bench.emulated_serve; on a model that tiers nothing it serves
    as `glm53 serve` does, and its log and the figures say the emulation changed nothing."""
    import json

    from glm53.cli import main

    monkeypatch.setenv("GLM53_CACHE_DIR", str(tmp_path))
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--model", str(hf_model_dir), "--concurrency", "1", "--prompt-tokens", "16",
                 "--max-tokens", "4", "--emulate", "rtx3090-gen4", "--log-dir", str(tmp_path / "logs"),
                 "--json", str(out)]) == 0
    log = (tmp_path / "logs" / "serve.log").read_text()
    assert "emulating rtx3090-gen4: this engine tiers no experts" in log and "glm53 ready" in log
    assert json.loads(out.read_text())["emulation"]["name"] == "rtx3090-gen4"
    assert "emulated host: rtx3090-gen4: link 25 GB/s" in capsys.readouterr().out


def test_a_run_without_the_lane_needs_no_lane_build() -> None:
    """bench decode with exact modes only drops the preset's lane paths, so a machine without the lane's kernel
    runs it; with fast among the modes the missing paths are still refused."""
    from glm53.bench.decode import emulation_for

    preset = emulate.PRESETS["rtx3090-gen4"]
    exact = emulation_for(preset, ("exact", "nvme-exact"))
    assert exact.lane_isas is None and exact.link_GBps == preset.link_GBps
    assert emulate.problem(exact, [], 4) is None
    assert "cannot run ['avx2']" in emulate.problem(emulation_for(preset, ("exact", "fast")), [], 4)
