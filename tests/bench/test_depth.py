"""bench depth without a GPU: its pure parts on real inputs (a generated checkpoint in the real 45-layer pattern),
and one mode's whole measurement on the CPU through Exl3Engine and the fake exllamav3, stock and exact compared
token for token, merged with an earlier call's stock as the GPU machine's second call does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import fake_exllamav3 as F
import pytest
from fakehost import HostSpec, write_host
from specs import spec_for

from glm53.bench import depth as D
from glm53.bench import depth_measure as M
from glm53.bench import depth_parts as P
from glm53.cli import build_parser
from glm53.fixture.exl3 import write_exl3_checkpoint
from store.safetensors_header import read_safetensors_header


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Path:
    """The real layer pattern at a tiny width: 45 layers, 3 dense then 42 MoE, KDA where i % 4 != 3."""
    return write_exl3_checkpoint(tmp_path_factory.mktemp("depth") / "ck", layers=45, dense_layers=3, experts=16,
                                 top_k=4, router_skew=(0.25, 0.5))


def kinds(ck: Path) -> tuple[list[str], list[str]]:
    return P.layer_kinds(json.loads((ck / "config.json").read_text()))


def test_the_prompt_maker_is_deterministic_prefix_stable_and_text_like():
    a = P.prompt_ids(5000, 1000, seed=3)
    assert a == P.prompt_ids(5000, 1000, seed=3) and len(a) == 5000
    assert P.prompt_ids(1234, 1000, seed=3) == a[:1234]  # a shorter prompt is the start of a longer one
    assert all(0 <= t < 1000 for t in a)
    other = P.prompt_ids(5000, 1000, seed=4)
    assert P.first_difference(a, other) is not None and P.first_difference(a, other) < 8  # no shared prefix
    bigrams = list(zip(a, a[1:], strict=False))
    assert len(set(bigrams)) < 0.7 * len(bigrams)  # words repeat, as in text (uniform ids would not)


def test_every_tensor_of_a_full_depth_pattern_checkpoint_has_its_layer_type(ck):
    attn, mlp = kinds(ck)
    assert len(attn) == 45 and attn.count("linear_attention") == 34 and mlp.count("dense") == 3
    names = [n for f in ck.glob("*.safetensors") for n in read_safetensors_header(f).tensors]
    by = {}
    for n in names:
        by.setdefault(P.classify(n, attn, mlp), set()).add(n)
    assert "other" not in by, sorted(by.get("other", ()))[:5]
    layer = lambda n: int(re.search(r"layers\.(\d+)\.", n)[1])  # noqa: E731
    assert {layer(n) for n in by["kda"]} == {i for i in range(45) if i % 4 != 3}
    assert {layer(n) for n in by["mla"]} == {i for i in range(45) if i % 4 == 3}
    assert any(".indexer." in n for n in by["mla"])  # the DSA indexer is MLA's
    assert {layer(n) for n in by["dense"]} == {0, 1, 2}
    assert {layer(n) for n in by["moe"]} == set(range(3, 45)) == {layer(n) for n in by["shared"]}
    assert all(".mlp.experts." in n or ".mlp.gate" in n for n in by["moe"])
    assert any("hc_attn" in n for n in by["glue"]) and any("layernorm" in n for n in by["glue"])
    assert {"lm_head.weight"} <= by["head"] and any(n.endswith("language_model.norm.weight") for n in by["head"])
    assert all("embed_tokens" in n for n in by["embed"])
    assert {layer(n) for n in by.get("mtp", ())} == {45}  # the MTP head's layer: not run in decode
    # exllamav3's module keys
    p = "model.language_model"
    assert [P.classify(k, attn, mlp) for k in (f"{p}.layers.7", f"{p}.layers.6.self_attn", f"{p}.layers.11.self_attn",
                                               f"{p}.layers.1.mlp", f"{p}.layers.9.mlp",
                                               f"{p}.layers.9.mlp.shared_experts", "hc_expand", f"{p}.embed_tokens",
                                               "hc_head", f"{p}.norm", "lm_head")] == [
        "block", "kda", "mla", "dense", "moe", "shared", "embed", "embed", "head", "head", "head"]


def test_bytes_per_token_read_every_always_used_weight_and_top_k_of_the_experts(ck):
    got = P.weight_bytes_per_token(ck)
    attn, mlp = kinds(ck)
    sizes = {n: (t.nbytes, t.shape) for f in ck.glob("*.safetensors") for n, t in read_safetensors_header(f).tensors.items()}
    text = {n: v for n, v in sizes.items() if P.classify(n, attn, mlp) != "mtp"}  # the MTP layer is not decoded
    experts = sum(nb for n, (nb, _) in text.items() if ".mlp.experts." in n)
    router = sum(nb for n, (nb, _) in sizes.items() if ".mlp.gate" in n and P.classify(n, attn, mlp) == "moe")
    assert got["moe"] == pytest.approx(router + experts * 4 / 16)
    (emb, shape), = [v for n, v in sizes.items() if n.endswith("embed_tokens.weight")]
    assert got["embed"] == emb / shape[0]
    for kind in ("kda", "mla", "dense", "shared", "head", "glue"):
        assert got[kind] == sum(nb for n, (nb, _) in sizes.items() if P.classify(n, attn, mlp) == kind) > 0


def test_token_lists_compare_at_their_first_difference():
    assert P.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert P.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert P.first_difference([1, 2], [1, 2, 3]) == 2
    assert P.first_difference([], []) is None


@pytest.mark.parametrize("argv, message", [
    (["--modes", "stock,turbo"], "unknown ['turbo']"),
    (["--prompts", "8192,131000"], "does not fit the 131072-token context"),
    (["--prompts", "8k"], "wants token counts"),
    (["--tokens", "2"], "--tokens must be at least 8"),
    (["--reference", "/nonexistent/depth.json"], "--reference /nonexistent/depth.json"),
    (["--emulate", "rtx3090-gen4", "--cpu-threads", "100000"], "--emulate: 100000 lane threads: this machine has"),
    (["--link-GBps", "0"], "--emulate: the link rate must be > 0 GB/s"),
])
def test_bad_arguments_are_refused_before_any_work(argv, message, capsys, tmp_path):
    args = build_parser().parse_args(["bench", "depth", "--work", str(tmp_path), *argv])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_reference_without_stock_is_refused(tmp_path):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"modes": {"exact": {"runs": []}}}))
    with pytest.raises(ValueError, match="holds no stock figures"):
        D.load_reference(str(ref))


# The GPU run's 512 / 256 tokens after the longest prompt, shortened: the fake computes every expert in numpy.
JOB = {"prompts": [40, 100], "tokens": 8, "profile_tokens": 4, "checks": True, "peak_tokens": 24, "greedy_tokens": 16}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """The same pattern, 8 layers (KDA, KDA, KDA, MLA, ...; one dense): what the fake runs in seconds."""
    return write_exl3_checkpoint(tmp_path_factory.mktemp("depth-small") / "ck", layers=8, dense_layers=1, experts=16,
                                 top_k=4, router_skew=(0.25, 0.5))


@pytest.fixture(scope="module")
def measured(small) -> dict:
    """stock and exact measured on the CPU, each as the child process would (spec given whole: no host to plan)."""
    out = {}
    with F.installed():
        for mode, slots in (("stock", 0), ("exact", 3)):
            spec = spec_for(small, mode, slots, kv_tokens=512, prefill_chunk=256, max_concurrency=2)
            saves = []
            out[mode] = M.measure({**JOB, "mode": mode, "model": str(small)}, spec, None, saves.append)
            out[mode]["saves"] = len(saves)
    return out


def test_a_mode_measures_what_loaded_its_prompts_and_where_a_step_goes(measured):
    ex = measured["exact"]
    assert ex["engine"] == "exact" and ex["saves"] >= 4  # written as phases finish, not only at the end
    assert ex["loaded"]["vram_slots"] == 7 * 3 and ex["loaded"]["staging"] == ex["planned"]["staging"] >= 4
    assert all(ex["matches"].values()), ex["matches"]
    assert measured["stock"]["loaded"]["vram_slots"] == 7 * 16 and all(measured["stock"]["matches"].values())
    assert [r["prompt_tokens"] for r in ex["runs"]] == [P.SHORT_PROMPT, 40, 100]
    assert all(r["ttft_s"] > 0 and r["decode_tok_s"] > 0 for r in ex["runs"])
    assert ex["runs"][0]["decoded"] == 7  # 8 tokens: the first release's, then 7 timed
    # Each run's tier counts: every pick read from somewhere, the prompts' prefill borrowing no slot here (the
    # staging is a whole layer of its own at 3 slots per layer).
    for r in ex["runs"]:
        t = r["tiers"]
        assert t["picks_total"] > 0 and t["picks_total"] == t["picks_vram_hit"] + t["picks_pcie"]
        assert t["lent_out"] == 0
    assert measured["stock"]["runs"][0]["tiers"] == {}
    assert len(ex["greedy_ids"]) == JOB["greedy_tokens"]
    assert ex["memory"]["rss_peak_bytes"] > 0 and ex["memory"]["peak_long_bytes"] is None  # no device on the CPU
    for hist in ("0", "100"):
        prof = ex["profile"][hist]
        assert prof["steps"] == 4
        assert {"moe", "head", "embed"} <= set(prof["types"])  # what the fake model runs
        assert prof["types"]["moe"]["host_ms"] > 0 and prof["types"]["moe"]["bytes"] > 0
        in_modules = sum(x["host_ms"] for x in prof["types"].values())  # the fake's timed modules do not nest
        assert prof["outside_ms"] == pytest.approx(prof["step_ms"] - in_modules, rel=0.05)
    assert ex["checks"]["context_exceeded"]["ok"], ex["checks"]
    assert ex["checks"]["length_at_edge"]["ok"], ex["checks"]
    assert "checks" not in measured["stock"]  # stock is the reference: the engine's edges are checked in its modes


def test_exact_is_compared_with_stock_and_a_later_call_takes_stock_from_the_first(measured, tmp_path):
    first = {"date": "2026-12-01 10:00", "settings": {"vram_budget_gb": 24.0, "context": 131072},
             "checkpoint": {"what": "the test's"}, "modes": {m: measured[m] for m in ("stock", "exact")}}
    D.finish(first)
    assert first["comparison"]["exact"] == {"bit_identical": True, "first_difference": None,
                                            "compared": JOB["greedy_tokens"], "must_be_identical": True,
                                            "same_prefill_chunk": True}
    rt = first["ratios"]["exact"]
    assert rt["stock_from"] == "this call" and set(rt["ttft_over_stock"]) == {"40", "100"}
    assert set(rt["decode_over_stock"]) == {str(P.SHORT_PROMPT), "40", "100"}
    assert D.exit_status(first) == 0
    text = D.report(first)
    assert "exact vs stock over 16 greedy tokens after the longest prompt: bit-identical" in text
    assert "decode step at history 100" in text

    ref = tmp_path / "first.json"
    ref.write_text(json.dumps(first))
    tampered = json.loads(json.dumps(measured["exact"]))
    tampered["greedy_ids"][11] += 1
    second = {"date": "2026-12-01 10:20", "settings": first["settings"], "checkpoint": first["checkpoint"],
              "modes": {"nvme-exact": tampered}}
    D.finish(second, D.load_reference(str(ref)), str(ref))
    assert second["stock_from"].startswith(f"another call ({ref}")
    assert second["comparison"]["nvme-exact"]["first_difference"] == 11
    assert second["ratios"]["nvme-exact"]["stock_from"] == second["stock_from"]
    assert D.exit_status(second) == 1  # an exact mode that left stock's tokens fails the call
    assert "first differs at token 11 (MUST be identical)" in D.report(second)


def test_the_child_records_why_a_mode_failed(small, tmp_path):
    missing = tmp_path / "no-such-store.glm53"
    job = {**JOB, "mode": "nvme-exact", "model": str(small), "out": str(tmp_path / "nvme-exact.json"),
           "spec": spec_for(small, "nvme-exact", 3, kv_tokens=512, ram_slots=40, store=str(missing),
                            store_threads=2).to_json()}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    with F.installed(), pytest.raises(Exception):  # noqa: B017 - whatever the engine raises, it is recorded
        D.child(path)
    got = json.loads((tmp_path / "nvme-exact.json").read_text())
    assert got["mode"] == "nvme-exact" and str(missing) in got["error"]
    doc = D.finish({"modes": {"nvme-exact": got}})
    assert D.exit_status(doc) == 1


def test_an_emulated_mode_loads_the_card_share_of_the_slots_and_says_what_it_emulated(small, tmp_path):
    """The job's emulation reaches the child: the plan's 3 slots a layer become the consumer card's 11% of 16
    experts (2), the tiers get the engine's on_tiers before they serve, and the figures carry the emulation."""
    from glm53.bench.emulate import PRESETS, to_json

    emu = to_json(PRESETS["rtx3090-gen4"])
    job = {**JOB, "mode": "exact", "model": str(small), "out": str(tmp_path / "exact.json"), "emulation": emu,
           "spec": spec_for(small, "exact", 3, kv_tokens=512, prefill_chunk=256, max_concurrency=2).to_json()}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    with F.installed():
        assert D.child(path) == 0
    got = json.loads((tmp_path / "exact.json").read_text())
    assert got.get("error") is None and got["emulation"] == emu
    assert got["spec"]["vram_slots"] == [2] * 7 and got["loaded"]["vram_slots"] == got["planned"]["vram_slots"]
    doc = {"checkpoint": {"what": "small"}, "modes": {"exact": got},
           "settings": {"vram_budget_gb": 24, "context": 131072, "emulation": emu}}
    assert "emulated host (tiered modes): rtx3090-gen4: link 25 GB/s, 11% of the experts in VRAM" in D.report(doc)


def test_the_emulated_spec_caps_slots_sets_lane_threads_and_leaves_stock_alone(small):
    from dataclasses import replace

    from glm53.bench.emulate import Emulation, emulated_spec
    from glm53.planning.devices import DeviceShare

    emu = Emulation(name="box", card_fraction=0.25, lane_threads=3)
    fast = spec_for(small, "fast", 6, kv_tokens=512, cpu_threads=8)
    got = emulated_spec(fast, emu, 16)
    assert got.vram_slots == (4,) * len(fast.vram_slots) and got.cpu_threads == 3
    assert emulated_spec(spec_for(small, "exact", 2, kv_tokens=512), emu, 16).vram_slots[0] == 2  # below the cap
    stock = spec_for(small, "stock", 0, kv_tokens=512)
    assert emulated_spec(stock, emu, 16) == stock
    share = DeviceShare(0, "card", 1 << 30, 0, 3, 0, 3, 12)
    with pytest.raises(ValueError, match="of one card; this plan splits the layers across 2 GPUs"):
        emulated_spec(replace(fast, devices=(share, replace(share, index=1))), emu, 16)


H200 = ("NVIDIA H200", 143771, 143000, 5, 16)


def test_a_mode_runs_the_plan_of_the_host_for_the_budget_and_context(tmp_path):
    """The plan on a fake H200 host, with the model inside its tree: a checkpoint whose experts all fit 24 GB leaves
    nothing to tier, which is said; stock takes the plan's KV, context and sequences with every expert in VRAM."""
    root = write_host(tmp_path / "host", HostSpec(gpus=(H200,)))
    write_exl3_checkpoint(root / "models" / "ck", layers=8, dense_layers=1, experts=16, top_k=4)
    job = {"model": "/models/ck", "vram_budget_gb": 24.0, "context": 131072, "cache_dir": str(tmp_path / "cache"),
           "host_root": str(root)}
    spec, doc = D.mode_spec({**job, "mode": "stock"})
    assert spec.engine == "stock" and spec.vram_slots == () and spec.ram_slots == 0
    assert spec.context == doc["engine"]["context"] and spec.kv_tokens == doc["kv_tokens"]
    assert doc["vram_budget_bytes"] == 24 << 30 and "facts" not in doc
    with pytest.raises(ValueError, match="every routed expert fits the budget"):
        D.mode_spec({**job, "mode": "exact"})
    with pytest.raises(ValueError, match="the plan refused nvme-exact: .*GLM53_STORE is empty"):
        D.mode_spec({**job, "mode": "nvme-exact", "memory_gib": 16})


def test_the_parent_runs_each_mode_in_its_own_process_and_reports_its_failure(small, tmp_path, capsys):
    """On this GPU-less machine each mode's process plans for the host and is refused: the call still writes its
    JSON with the reason per mode, prints it, and fails."""
    out = tmp_path / "depth.json"
    args = build_parser().parse_args(["bench", "depth", "--model", str(small), "--modes", "stock,exact", "--work",
                                      str(tmp_path / "work"), "--prompts", "40", "--json", str(out)])
    assert args.func(args) == 1
    doc = json.loads(out.read_text())
    assert list(doc["modes"]) == ["stock", "exact"]
    for mode in ("stock", "exact"):
        assert f"the plan refused {mode}: no NVIDIA GPU" in doc["modes"][mode]["error"]
    assert doc["stock_from"] is None and doc["ratios"] == {}
    text = capsys.readouterr().out
    assert "stock: FAILED: ValueError: the plan refused stock: no NVIDIA GPU found" in text
    assert "/ stock" not in text  # no ratios without stock's figures
    assert (tmp_path / "work" / "depth-exact.job.json").exists()
