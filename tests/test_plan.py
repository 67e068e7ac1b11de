"""The plan on fake hosts: the right mode or refusal, with reasons, for every host in issue 2 (item 6).

Most cases call the pure function; a few go through `python -m glm53 plan --host-root DIR --json`, the way a
user (or the container's entrypoint) runs it.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from fakehost import BROADWELL_2S, FULL_STORE_BYTES, IVYBRIDGE, RTX3090, RTX4080, HostSpec, write_host
from safetensors.numpy import save_file

from glm53.planning import host as H
from glm53.planning import plan as P
from glm53.planning import settings as S
from glm53.planning import shape as M
from glm53.planning import units as U

ROOT = Path(__file__).resolve().parent.parent
STORE = "/nvx/experts.glm53"
NVME_55 = HostSpec(mem_cap_gib=55, swap_cap_gib=0, store=STORE)


def settings(**env: str) -> S.Settings:
    return S.load(environ={"GLM53_MODEL_DIR": "/model", **env}, dotenv=None)


def run(tmp_path, spec=HostSpec(), shape=M.DEFAULT_SHAPE, **env: str) -> P.Plan:
    s = settings(**env)
    return P.plan(H.read_host(write_host(tmp_path, spec), store=s.store or None), shape, s)


def refused(tmp_path, spec=HostSpec(), **env: str) -> P.PlanError:
    with pytest.raises(P.PlanError) as info:
        run(tmp_path, spec, **env)
    return info.value


def cli(root: Path, *args: str, **env: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "glm53", "plan", "--host-root", str(root), "--json", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env})
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


# ---------------------------------------------------------------- the decision table


def test_auto_table_is_total_and_matches_design():
    for combo in itertools.product((False, True), repeat=4):
        assert P.decide(*combo) in (*P.MODES, "refuse")
    assert P.decide(False, True, False, True) == "fast"
    assert P.decide(False, True, True, False) == "exact"        # fits in RAM wins over a store
    assert P.decide(False, False, True, True) == "nvme"
    assert P.decide(False, False, True, False) == "nvme-exact"
    assert P.decide(False, False, False, True) == "refuse"
    assert P.decide(True, False, False, True) == "exact"        # all in VRAM: no misses to serve


def test_docs_embed_the_code_table():
    assert P.render_decision_table() in (ROOT / "docs" / "modes.md").read_text()


# ---------------------------------------------------------------- the hosts of issue 2


def test_3090_epyc_256g_is_fast(tmp_path):
    p = run(tmp_path)
    assert p.mode == "fast" and p.device == "cuda:0" and p.budget == "normal"
    assert p.cpu_threads == 23 and p.nvme_threads == 0 and p.kv_tokens == 131072
    # The hot set's 1,376 9 MiB slots on a 24 GB card at 131,072 tokens (the reference held 1,300-1,376): staging
    # keeps rows of its own only for a decode step and borrows the rest of a layer's from the cache slots, and the
    # plan takes as many sequences as keep the hot set; spread evenly without saved routing statistics.
    assert 1376 <= p.vram_slots <= 1500 and max(p.engine.vram_slots) - min(p.engine.vram_slots) <= 1
    spec = p.engine
    assert spec.engine == "fast" and sum(spec.vram_slots) == p.vram_slots and spec.staging_slots == 288
    assert spec.dedicated_staging == 8 * spec.cache_sequences < 288 and len(spec.borrowed) >= 288 - 8 * 7
    assert p.vram_slots_per_layer == p.vram_slots // 42 == min(spec.vram_slots)
    # exclusive tiers: every other expert in RAM, no second copy; the lent slots' experts; the admissions' spare
    assert p.ram_slots == spec.ram_slots == 42 * 288 - p.vram_slots + len(spec.borrowed) + 2 * 8
    assert spec.cpu_threads == p.cpu_threads and spec.kv_tokens == spec.context == 131072
    assert set(p.reasons) >= {"mode", "gpu", "vram_slots", "ram_slots", "cpu_threads", "nvme_threads", "kv_tokens",
                              "sequences", "prefill_chunk", "reserve", "recurrent_cache"}
    assert "SMT siblings unused" in p.reasons["cpu_threads"]


# ---------------------------------------------------------------- full depth on a 24 GB card (issue 25)


def _accounted(p: P.Plan) -> dict[str, int]:
    """The plan's VRAM terms, checked against the shape's sizes and the spec's numbers."""
    acc, spec, d = p.vram_accounting, p.engine, M.DEFAULT_SHAPE
    assert acc["kv_cache"] == (spec.kv_tokens + 256) * d.kv_bytes_per_token  # one page past the context
    assert acc["kda_state"] == spec.cache_sequences * d.state_bytes_per_seq  # what the Cache allocates
    assert acc["staging"] == spec.dedicated_staging * d.expert_bytes  # the rows of its own; the rest are lent slots
    assert spec.staging_slots == 288 and spec.dedicated_staging == min(288, 8 * min(8, spec.cache_sequences))
    assert acc["expert_slots"] == sum(spec.vram_slots) * d.expert_bytes
    assert acc["prefill_activations"] == P.prefill_activation_bytes(d, spec.prefill_chunk)[0]
    assert acc["reserve"] == P.vram_reserve()[0] and acc["always_used_weights"] == d.always_used_bytes
    # Everything counted fits the budget, and what is left would not hold one more expert slot.
    assert 0 <= p.vram_budget_bytes - sum(acc.values()) < d.expert_bytes
    assert spec.max_concurrency == spec.cache_sequences
    return acc


def test_default_shape_is_the_real_model():
    d = M.DEFAULT_SHAPE
    # NoPE MLA on 11 layers: the fp16 512-wide latent, each layer's full indexer plane ([k || gate], 2 x 128) and
    # its pooled keys (128 per 16 tokens); no rope key.
    assert d.kv_bytes_per_token == 11 * (512 * 2 + 256 * 2 + 128 * 2 // 16) == 17072
    # 34 KDA layers x 64 heads x 128 x 128: two fp16 state rows per sequence slot, the conv ring of q|k|v (4 taps,
    # bf16) and one row of staged scan inputs.
    qkv = 3 * 64 * 128
    assert d.state_bytes_per_seq == 34 * (2 * 64 * 128 * 128 * 2 + qkv * 4 * 2 + qkv * 2 + 64 * 2 + 64 * 128 * 4)
    assert d.checkpoint_bytes == 34 * (qkv * 4 * 2 + 64 * 128 * 128 * 2)
    assert d.host_bytes == 154880 * 4096 * 2  # the embedding table, in host RAM
    # A 2,048-token chunk peaks in the KDA scan, a short one in the MoE's fixed reconstruct scratch; the scan runs in
    # 2,048-token sub-ranges, so a longer chunk peaks in the MoE's fp32 slot scratch (chunk x top_k x hidden).
    assert d.prefill_bytes(2048)[1] == "KDA scan" and d.prefill_bytes(512)[1] == "MoE"
    big, small = d.prefill_bytes(8192)[0], d.prefill_bytes(4096)[0]
    assert d.prefill_bytes(8192)[1] == "MoE" and big - small == 4096 * (88 + 8 * 16 + 40) * 1024


def test_3090_at_131072_counts_everything(tmp_path):
    p = run(tmp_path, GLM53_CONTEXT="131072")
    spec, acc = p.engine, _accounted(p)
    assert spec.kv_tokens == spec.context == 131072 and spec.staging_slots == 288
    # Issue 25's target: the hot set stays in VRAM at 131,072 tokens. The plan's own choice of sequences
    # (GLM53_MAX_CONCURRENCY=0) is as many as keep it, each holding 145 MiB of KDA state (16 expert slots) and
    # 8 staging rows.
    assert p.vram_slots >= P.hot_set_floor(M.DEFAULT_SHAPE) == 1376 and 1 < spec.cache_sequences < 8
    assert not any("VRAM expert slots <" in w for w in p.warnings)
    assert "borrowing the other" in p.reasons["vram_slots"] and "cache slots lent" in p.reasons["engine"]
    assert acc["prefill_activations"] > 700 * U.MIB and "measured" in p.reasons["reserve"]
    # One sequence: its rows and state go to slots or to a longer chunk beside the hot set.
    one = run(tmp_path / "one", GLM53_CONTEXT="131072", GLM53_MAX_CONCURRENCY="1")
    assert one.engine.cache_sequences == 1 and one.engine.dedicated_staging == 8
    assert one.vram_slots >= P.hot_set_floor(M.DEFAULT_SHAPE) and one.engine.prefill_chunk >= spec.prefill_chunk
    assert one.vram_slots > p.vram_slots or one.engine.prefill_chunk > spec.prefill_chunk
    # A number the user gave is kept: eight sequences take the state and staging rows of the extra ones, and the
    # chunk shrinks to keep the hot set.
    many = run(tmp_path / "many", GLM53_CONTEXT="131072", GLM53_MAX_CONCURRENCY="8")
    d, extra, acc8 = M.DEFAULT_SHAPE, 8 - spec.cache_sequences, _accounted(many)
    assert many.engine.cache_sequences == 8 and many.engine.dedicated_staging == 64
    assert acc8["kda_state"] - acc["kda_state"] == extra * d.state_bytes_per_seq
    assert acc8["staging"] - acc["staging"] == extra * 8 * d.expert_bytes
    # With the vision tower resident the auto plan's chunk is already exllamav3's 2,048: eight sequences cost slots
    # below the hot set instead, and the plan says so.
    assert many.engine.prefill_chunk <= spec.prefill_chunk and many.vram_slots < p.vram_slots
    assert many.vram_slots >= 1376 or any("VRAM expert slots < 1376" in w for w in many.warnings)


def test_3090_at_65536_keeps_the_hot_set(tmp_path):
    p = run(tmp_path, GLM53_CONTEXT="65536")
    spec, acc = p.engine, _accounted(p)
    assert spec.kv_tokens == spec.context == 65536 and acc["kv_cache"] < 1.1 * U.GIB
    # The KV saved buys the hot set and every sequence the plan would choose.
    assert p.vram_slots >= 1376 and spec.cache_sequences == 8
    more = P.plan(H.read_host(write_host(tmp_path / "h2")), M.DEFAULT_SHAPE,
                  settings(GLM53_CONTEXT="65536", GLM53_MAX_CONCURRENCY="16"))
    assert more.engine.cache_sequences == 16  # given by the user: kept, at the hot set's cost
    assert more.engine.dedicated_staging == 64  # exllamav3 decodes at most 8 rows in one step
    assert more.vram_slots < 1376 <= p.vram_slots
    assert not any("VRAM expert slots <" in w for w in p.warnings)


def test_prefill_chunk_follows_the_link_and_the_budget(tmp_path):
    d = M.DEFAULT_SHAPE
    gpu = H.read_host(write_host(tmp_path / "a")).gpus[0]
    rates = [P.prefill_rate(d, gpu, 32, c)[0] for c in P.PREFILL_CHUNKS]
    assert rates == sorted(rates)  # every chunk streams the whole layer: bigger chunks amortize it
    assert P.prefill_rate(d, gpu, 32, 2048)[1] > 3.5  # ~94 GiB of non-resident experts over PCIe 4 x16
    # A 48 GB card keeps the hot set with room for the 2x3090 runtime's 8,192-token chunk.
    big = run(tmp_path / "b", HostSpec(gpus=(("NVIDIA RTX 6000 Ada Generation", 49140, 48500, 4, 16),)))
    assert big.engine.prefill_chunk == 8192 and big.vram_slots > 2 * 1376
    assert big.vram_accounting["prefill_activations"] == P.prefill_activation_bytes(d, 8192)[0]
    # Every expert in VRAM: nothing streams, so exllamav3's default chunk.
    small = replace(d, moe_layers=2, always_used_bytes=U.GIB)
    stock = run(tmp_path / "c", shape=small)
    assert stock.engine.engine == "stock" and stock.engine.prefill_chunk == 2048
    assert "streams nothing" in stock.reasons["prefill_chunk"]


def test_16g_cap_counts_the_recurrent_cache_and_the_embedding(tmp_path):
    p = run(tmp_path, NVME_55.but(mem_cap_gib=16), GLM53_STORE=STORE)
    ram = p.ram_accounting
    usable = 16 * U.GIB - 180 * U.MIB  # the cap minus what the cgroup holds already
    assert ram["recurrent_cache"] == p.engine.recurrent_cache_bytes == usable // 8  # its share of a small cap
    assert ram["host_weights"] == M.DEFAULT_SHAPE.host_bytes
    record = -(-M.DEFAULT_SHAPE.expert_bytes // 4096) * 4096
    assert sum(ram.values()) <= usable < sum(ram.values()) + record  # the rest would not hold one more record
    assert "2 GiB of host RAM for recurrent-state checkpoints" in p.reasons["recurrent_cache"]
    assert "27 checkpoints" in p.reasons["recurrent_cache"] and "embedding" in p.reasons["ram_slots"]


def test_55g_cap_with_store_is_nvme(tmp_path):
    p = run(tmp_path, NVME_55, GLM53_STORE=STORE)
    assert p.mode == "nvme" and p.budget == "normal" and p.nvme_threads == P.NVME_READERS
    # RAM tier from the cap: 55 GiB minus the margin and staging, in 9 MiB records.
    assert 5000 < p.ram_slots < 6000 and p.ram_slots + p.vram_slots < 42 * 288
    assert p.cpu_threads == 23 and not [w for w in p.warnings if w.startswith(("memory cap", "small host", "RLIMIT"))]
    assert "ext4" in p.reasons["store"]


def test_16g_cap_is_nvme_with_small_host_budget(tmp_path):
    p = run(tmp_path, NVME_55.but(mem_cap_gib=16), GLM53_STORE=STORE)
    assert p.mode == "nvme" and p.budget == "small-host" and p.nvme_threads == P.NVME_READERS_SMALL
    assert 1000 < p.ram_slots < 1600
    assert any(w.startswith("small host") for w in p.warnings)


def test_12g_cap_is_refused_naming_threshold_and_fix(tmp_path):
    err = refused(tmp_path, NVME_55.but(mem_cap_gib=12), GLM53_STORE=STORE)
    assert "memory cap 12 GiB < 15 GiB needed for nvme mode" in err.message
    assert "--memory 55g --memory-swap 55g" in err.message


def test_cpu_without_avx2_gets_exact_and_nvme_exact(tmp_path):
    p = run(tmp_path / "a", HostSpec(cpu=IVYBRIDGE))
    assert p.mode == "exact" and p.cpu_threads == 0
    assert "lacks AVX2/FMA" in p.reasons["mode"]
    p = run(tmp_path / "b", NVME_55.but(cpu=IVYBRIDGE), GLM53_STORE=STORE)
    assert p.mode == "nvme-exact" and p.cpu_threads == 0 and p.nvme_threads > 0


def test_a_cpu_lane_kernel_that_cannot_run_gives_the_exact_modes(tmp_path):
    from dataclasses import replace

    s = settings()
    facts = replace(H.read_host(write_host(tmp_path, HostSpec())), lane_kernel_error="_expert_kernel.so not built")
    p = P.plan(facts, M.DEFAULT_SHAPE, s)
    assert p.mode == "exact" and p.cpu_threads == 0
    assert "CPU-lane kernel cannot run here (_expert_kernel.so not built)" in p.reasons["mode"]


def test_glm53_exact_prefers_bit_exact(tmp_path):
    assert run(tmp_path, GLM53_EXACT="1").mode == "exact"


def test_memlock_64k_is_a_warning(tmp_path):
    p = run(tmp_path, HostSpec(memlock=65536))
    assert p.mode == "fast"
    assert any(w.startswith("RLIMIT_MEMLOCK 64 KiB") and "--ulimit memlock=-1" in w for w in p.warnings)


def test_cap_without_swap_cap_is_a_warning(tmp_path):
    p = run(tmp_path, NVME_55.but(swap_cap_gib=None), GLM53_STORE=STORE)
    assert p.mode == "nvme"
    (w,) = [w for w in p.warnings if "swap" in w]
    assert "memory cap 55 GiB without an equal swap cap" in w and "--memory-swap 55g" in w
    # Without swap on the host there is nothing to leak into.
    p = run(tmp_path / "noswap", NVME_55.but(swap_cap_gib=None, swap_total_gib=0), GLM53_STORE=STORE)
    assert not [w for w in p.warnings if "swap" in w]


def test_cgroup_v1_cap_without_memsw_warns(tmp_path):
    p = run(tmp_path, NVME_55.but(cgroup="v1", swap_cap_gib=None), GLM53_STORE=STORE)
    assert p.mode == "nvme" and any("without an equal swap cap" in w for w in p.warnings)


def test_no_gpu_refused_for_the_real_model(tmp_path):
    err = refused(tmp_path, HostSpec(gpus=()))
    assert "no NVIDIA GPU" in err.message and "--gpus all" in err.message and "demo" in err.message


def test_no_gpu_and_no_model_serves_the_demo_on_cpu(tmp_path):
    s = S.load(environ={}, dotenv=None)
    p = P.plan(H.read_host(write_host(tmp_path, HostSpec(gpus=()))), M.DEFAULT_SHAPE, s)
    assert p.mode == "demo" and p.device == "cpu" and p.cpu_threads == 23
    assert p.real_model["mode"] is None and "no NVIDIA GPU" in p.real_model["error"]


def test_16gb_gpu_refused(tmp_path):
    err = refused(tmp_path, HostSpec(gpus=(RTX4080,)))
    assert "16 GiB of VRAM < 20 GiB" in err.message and "24 GB GPU" in err.message


def test_busy_gpu_refused_naming_free_vram(tmp_path):
    err = refused(tmp_path, HostSpec(gpus=(("NVIDIA GeForce RTX 3090", 24576, 9000, 4, 16),)))
    assert "free of 24 GiB" in err.message and "other processes" in err.message


def test_vram_budget_emulates_a_smaller_card(tmp_path):
    h200 = HostSpec(gpus=(("NVIDIA H200", 143771, 142000, 5, 16),))
    big = run(tmp_path / "a", h200)
    assert big.mode == "exact" and big.ram_slots == 0  # every expert fits in 139 GiB: no misses at all
    small = run(tmp_path / "b", h200, GLM53_VRAM_BUDGET_GB="24")
    assert small.mode == "fast" and small.vram_budget_bytes == 24 * U.GIB and small.vram_slots < 1700
    err = refused(tmp_path / "c", h200, GLM53_VRAM_BUDGET_GB="16")
    assert "GLM53_VRAM_BUDGET_GB=16 < 20 GiB" in err.message


def test_two_gpus_one_too_small_uses_one_and_says_which(tmp_path):
    p = run(tmp_path, HostSpec(gpus=(RTX4080, RTX3090)))
    assert p.mode == "fast" and p.gpu_index == 1 and p.device == "cuda:1"
    assert "2 GPUs found" in p.reasons["gpu"] and "GPU 0 stay idle" in p.reasons["gpu"]
    assert any("GPU 0 (NVIDIA GeForce RTX 4080" in w and "left out" in w for w in p.warnings)


def test_dual_socket_broadwell_pcie3(tmp_path):
    spec = HostSpec(cpu=BROADWELL_2S, numa_nodes=2, mem_total_gib=125.8, mem_available_gib=120,
                    gpus=(("NVIDIA GeForce RTX 3090", 24576, 24135, 3, 16),))
    p = run(tmp_path, spec)
    assert p.mode == "fast" and p.cpu_threads == 43
    assert "2 NUMA nodes" in p.reasons["cpu_threads"] and "88 logical" in p.reasons["cpu_threads"]
    assert "PCIe 3 x16" in p.reasons["gpu"] and "CPU lane" in p.reasons["gpu"]


def test_store_missing_names_pack_store(tmp_path):
    err = refused(tmp_path, NVME_55.but(store=None), GLM53_STORE=STORE)
    assert f"store {STORE} not found: run the pack-store container first: docker run" in err.message
    assert f"pack-store --model /model --out {STORE}" in err.message


def test_no_store_configured_names_pack_store(tmp_path):
    err = refused(tmp_path, NVME_55.but(store=None))
    assert "GLM53_STORE is empty" in err.message and "pack-store" in err.message


def test_store_on_tmpfs_names_o_direct(tmp_path):
    spec = NVME_55.but(mounts=(("/", "overlay"), ("/nvx", "tmpfs")))
    err = refused(tmp_path, spec, GLM53_STORE=STORE)
    assert "/nvx is on tmpfs, which does not support O_DIRECT: put the store on ext4 or xfs" in err.message
    p = run(tmp_path / "b", spec, GLM53_STORE=STORE, GLM53_ALLOW_BUFFERED_READS="1")
    assert p.mode == "nvme" and any("page cache" in w for w in p.warnings)


def test_truncated_store_refused(tmp_path):
    err = refused(tmp_path, NVME_55.but(store_bytes=FULL_STORE_BYTES // 2), GLM53_STORE=STORE)
    assert "truncated" in err.message and "pack-store" in err.message


def test_cpu_quota_limits_lane_threads(tmp_path):
    p = run(tmp_path, HostSpec(extra={"/sys/fs/cgroup/cpu.max": "800000 100000\n"}))
    assert p.cpu_threads == 7 and "docker --cpus" in p.reasons["cpu_threads"]


def test_context_lowered_with_a_warning_when_it_does_not_fit(tmp_path):
    heavy_kv = M.DEFAULT_SHAPE.__class__(**{**M.DEFAULT_SHAPE.__dict__, "kv_bytes_per_token": 200_000})
    p = run(tmp_path, shape=heavy_kv)
    assert p.kv_tokens < 131072 and p.kv_tokens % P.KV_ROUND == 0
    assert p.vram_slots_per_layer == heavy_kv.top_k
    assert any("context lowered to" in w and "GLM53_CONTEXT" in w for w in p.warnings)


def test_explicit_modes_are_validated(tmp_path):
    assert run(tmp_path / "a", GLM53_MODE="exact").mode == "exact"
    err = refused(tmp_path / "b", HostSpec(cpu=IVYBRIDGE), GLM53_MODE="fast")
    assert "GLM53_MODE=fast refused" in err.message and "AVX2" in err.message and "exact" in err.message
    err = refused(tmp_path / "c", NVME_55, GLM53_STORE=STORE, GLM53_MODE="fast")
    assert "GLM53_MODE=fast refused" in err.message and "usable RAM" in err.message
    err = refused(tmp_path / "d", GLM53_MODE="nvme")
    assert "GLM53_MODE=nvme refused" in err.message and "GLM53_STORE is empty" in err.message
    p = run(tmp_path / "e", HostSpec(store=STORE), GLM53_STORE=STORE, GLM53_MODE="nvme-exact")
    assert p.mode == "nvme-exact" and p.cpu_threads == 0


def test_refusal_json_has_every_key(tmp_path):
    out = refused(tmp_path, HostSpec(gpus=())).to_json()
    assert out["error"] and out["mode"] is None and isinstance(out["warnings"], list)
    assert set(P.Plan.JSON_KEYS) <= set(out)


# ---------------------------------------------------------------- through the command line


# Every fake host of issue 2 (item 6), the way a user runs it: `glm53 plan --host-root DIR --json`.
# (name, host, settings, expected mode or None for a refusal, a phrase the error / a warning / a reason must hold)
ISSUE2_HOSTS = [
    ("3090 + 24-core EPYC + 256 GiB", HostSpec(), {}, "fast", "SMT siblings unused"),
    ("55 GiB cap and a store", NVME_55, {"GLM53_STORE": STORE}, "nvme", "the store is valid"),
    ("16 GiB cap", NVME_55.but(mem_cap_gib=16), {"GLM53_STORE": STORE}, "nvme", "small host: usable RAM"),
    ("12 GiB cap", NVME_55.but(mem_cap_gib=12), {"GLM53_STORE": STORE}, None,
     "memory cap 12 GiB < 15 GiB needed for nvme mode: run with --memory 55g --memory-swap 55g"),
    ("CPU without AVX2", HostSpec(cpu=IVYBRIDGE), {}, "exact", "lacks AVX2/FMA"),
    ("CPU without AVX2, 55 GiB cap and a store", NVME_55.but(cpu=IVYBRIDGE), {"GLM53_STORE": STORE}, "nvme-exact",
     "lacks AVX2/FMA"),
    ("memlock 64 KiB", HostSpec(memlock=65536), {}, "fast", "RLIMIT_MEMLOCK 64 KiB"),
    ("a cap without a swap cap", NVME_55.but(swap_cap_gib=None), {"GLM53_STORE": STORE}, "nvme",
     "memory cap 55 GiB without an equal swap cap"),
    ("no GPU", HostSpec(gpus=()), {}, None, "no NVIDIA GPU found"),
    ("a 16 GB GPU", HostSpec(gpus=(RTX4080,)), {}, None, "16 GiB of VRAM < 20 GiB needed"),
    ("two GPUs", HostSpec(gpus=(RTX3090, RTX3090)), {}, "fast", "2 GPUs, the decoder layers split across them"),
    ("dual-socket 44-core Broadwell, PCIe 3",
     HostSpec(cpu=BROADWELL_2S, numa_nodes=2, mem_total_gib=125.8, mem_available_gib=120,
              gpus=(("NVIDIA GeForce RTX 3090", 24576, 24135, 3, 16),)), {}, "fast", "2 NUMA nodes"),
    ("store missing", NVME_55.but(store=None), {"GLM53_STORE": STORE}, None,
     f"store {STORE} not found: run the pack-store container first: docker run"),
    ("store on a filesystem without O_DIRECT", NVME_55.but(mounts=(("/", "overlay"), ("/nvx", "tmpfs"))),
     {"GLM53_STORE": STORE}, None, "/nvx is on tmpfs, which does not support O_DIRECT: put the store on ext4 or xfs"),
]


@pytest.mark.parametrize(("spec", "env", "mode", "phrase"), [case[1:] for case in ISSUE2_HOSTS],
                         ids=[case[0] for case in ISSUE2_HOSTS])
def test_cli_every_issue2_host(tmp_path, spec, env, mode, phrase):
    rc, out = cli(write_host(tmp_path, spec), GLM53_MODEL_DIR="/model", **env)
    assert out["reasons"], "every answer, refusal or not, carries its reasons"
    said = [out["error"] or "", *out["warnings"], *out["reasons"].values()]
    assert any(phrase in text for text in said), said
    if mode is None:
        assert rc == 2 and out["mode"] is None and phrase in out["error"]
    else:
        assert rc == 0 and out["error"] is None and out["mode"] == mode and out["reasons"]["mode"].startswith(mode)
        for key in ("vram_slots", "ram_slots", "cpu_threads"):
            assert isinstance(out[key], int) and key in out["reasons"]


def test_cli_fast_json(tmp_path):
    rc, out = cli(write_host(tmp_path), GLM53_MODEL_DIR="/model")
    assert rc == 0 and out["mode"] == "fast" and out["error"] is None
    for key in ("vram_slots", "ram_slots", "cpu_threads", "nvme_threads", "kv_tokens", "warnings", "reasons"):
        assert key in out
    assert out["facts"]["cpu"]["physical_cores"] == 24 and out["shape"]["experts"] == 12096


def test_cli_refusal_exits_2_with_error(tmp_path):
    rc, out = cli(write_host(tmp_path, NVME_55.but(mem_cap_gib=12)), "--store", STORE, "--model", "/model")
    assert rc == 2 and "15 GiB" in out["error"] and out["mode"] is None


def test_cli_nvme_and_memlock_warning(tmp_path):
    rc, out = cli(write_host(tmp_path, NVME_55.but(memlock=65536)), "--store", STORE, GLM53_MODEL_DIR="/model")
    assert rc == 0 and out["mode"] == "nvme"
    assert any("RLIMIT_MEMLOCK 64 KiB" in w for w in out["warnings"])


def test_cli_demo_without_model_and_text_table(tmp_path):
    root = write_host(tmp_path, HostSpec(gpus=()))
    rc, out = cli(root)
    assert rc == 0 and out["mode"] == "demo" and out["device"] == "cpu" and out["real_model"]["error"]
    done = subprocess.run([sys.executable, "-m", "glm53", "plan", "--host-root", str(root)], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "mode          demo" in done.stdout and "real_model" in done.stdout


def test_cli_reads_the_model_under_the_host_root(tmp_path):
    root = write_host(tmp_path / "host")
    _tiny_checkpoint(root / "model", nested=True)
    rc, out = cli(root, "--model", "/model")
    assert rc == 0 and out["shape"]["experts"] == 4 and str(root / "model") in out["reasons"]["model"]
    assert out["mode"] == "exact" and out["vram_slots"] == 4  # a tiny model fits in VRAM: no misses


def test_cli_unreadable_checkpoint_is_a_refusal(tmp_path):
    root = write_host(tmp_path / "host")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{not json")
    rc, out = cli(root, "--model", "/model")
    assert rc == 2 and "is not valid JSON" in out["error"] and "glm53 model verify" in out["error"]


def test_cli_preflight_on_this_machine(tmp_path):
    # No GPU here (or none needed): the demo plan, with the live checks reported, skipped where they cannot run.
    blob = tmp_path / "not-a-store"
    blob.write_bytes(b"\0" * 8192)
    done = subprocess.run([sys.executable, "-m", "glm53", "preflight", "--json", "--store", str(blob)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    out = json.loads(done.stdout)
    # A store the user named is checked as if it were served: without a model it is unused, and this one is junk.
    assert out["mode"] == "demo" and done.returncode == 2 and out["blocked"] is True
    checks = {c["name"]: c for c in out["checks"]}
    assert set(checks) == {"pin", "store_fs", "o_direct", "store"}
    assert checks["o_direct"]["detail"].startswith("probe:")
    assert checks["store_fs"]["blocks"] and "GLM53_MODEL_DIR is empty" in checks["store_fs"]["detail"]
    assert checks["store"]["status"] == "fail" and checks["store"]["blocks"]
    assert "preflight: store_fs: GLM53_STORE=" in done.stderr and "preflight: store: " in done.stderr


# ---------------------------------------------------------------- the pin proof (preflight and start-up)


class _FakeBuffer:
    def fill_(self, value):
        return self

    def copy_(self, other, non_blocking=False):
        return self


def _fake_torch(pin_error: str | None):
    """Just enough of torch for check_pinning: a CUDA device whose pinned allocation fails with `pin_error`."""
    import types

    def empty(size, dtype=None, pin_memory=False, device=None):
        if pin_memory and pin_error:
            raise RuntimeError(pin_error + "\nCUDA kernel errors might be asynchronously reported")
        return _FakeBuffer()

    cuda = types.SimpleNamespace(is_available=lambda: True, synchronize=lambda device=None: None,
                                 mem_get_info=lambda device=None: (23 * U.GIB, 24 * U.GIB))
    return types.SimpleNamespace(empty=empty, uint8="uint8", cuda=cuda)


@pytest.mark.parametrize("pin_error", [None, "CUDA error: out of memory"])
def test_pin_proof_refuses_with_the_fix_only_when_pinning_fails(tmp_path, monkeypatch, pin_error):
    from glm53 import plan_cli

    facts = H.read_host(write_host(tmp_path, HostSpec(memlock=65536)))
    p = P.plan(facts, M.DEFAULT_SHAPE, settings())
    assert any(w.startswith("RLIMIT_MEMLOCK 64 KiB") for w in p.warnings)  # the plan only warns
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(pin_error))
    check = plan_cli.check_pinning(p, facts)
    if pin_error is None:
        # Pinned past the limit anyway (some drivers pin without RLIMIT_MEMLOCK): no refusal, and it says so.
        assert check.status == "ok" and "works despite RLIMIT_MEMLOCK 64 KiB" in check.detail
    else:
        assert check.status == "fail" and check.blocks
        assert "out of memory" in check.detail and check.detail.endswith("add --ulimit memlock=-1")


# ---------------------------------------------------------------- the container's entrypoint


def _entrypoint(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "entrypoint.sh"), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GLM53_PYTHON": python,
                                           "GLM53_MODEL_DIR": "/model"})


def test_entrypoint_only_dispatches(tmp_path):
    echo = "/bin/echo"  # as the interpreter: shows what the entrypoint would run, runs nothing
    assert _entrypoint(python=echo).stdout == "-m glm53 serve\n"  # no command: serve
    for cmd in ("serve", "plan", "preflight", "pack-store", "verify-store", "bench"):
        assert _entrypoint(cmd, "--x", python=echo).stdout == f"-m glm53 {cmd} --x\n"
    assert _entrypoint("--port", "8000", python=echo).stdout == "-m glm53 serve --port 8000\n"
    assert _entrypoint("printf", "as-is").stdout == "as-is"  # anything else is exec'd as is
    done = _entrypoint("plan", "--host-root", str(write_host(tmp_path, NVME_55.but(mem_cap_gib=12))), "--json")
    assert done.returncode == 2 and "15 GiB" in json.loads(done.stdout)["error"]


# ---------------------------------------------------------------- the model's shape


def _tiny_checkpoint(root: Path, nested: bool) -> Path:
    """2 layers + an MTP layer: layer 0 dense, layer 1 MoE with 4 experts; headers are what matters."""
    text = {"num_hidden_layers": 2, "hidden_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse"],
            "layer_types": ["linear_attention", "deepseek_sparse_attention"], "num_nextn_predict_layers": 1}
    config = {"architectures": ["Glm5NextForConditionalGeneration"], "text_config": text} if nested else text
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    tensors = {"model.language_model.embed_tokens.weight": np.zeros((10, 64), np.float16),
               "model.language_model.layers.0.mlp.gate_proj.weight": np.zeros((32, 64), np.float16)}
    for e in range(4):
        for proj, (i, o) in (("gate", (64, 32)), ("up", (64, 32)), ("down", (32, 64))):
            pre = f"model.language_model.layers.1.mlp.experts.{e}.{proj}_proj"
            tensors[f"{pre}.trellis"] = np.zeros((i // 16, o // 16, 48), np.int16)
            tensors[f"{pre}.suh"] = np.zeros(i, np.float16)
            tensors[f"{pre}.svh"] = np.zeros(o, np.float16)
    save_file({k: v for k, v in tensors.items() if "experts.3" not in k}, str(root / "a.safetensors"))
    # The last expert sits in a file a broken index would omit: shape reads what is on disk.
    save_file({k: v for k, v in tensors.items() if "experts.3" in k}, str(root / "kpool_aux.safetensors"))
    mtp = {f"model.language_model.layers.2.mlp.experts.{e}.up_proj.trellis": np.zeros((4, 2, 48), np.int16)
           for e in range(4)}
    save_file({**mtp, "model.language_model.layers.2.hnorm.weight": np.zeros(64, np.float16)},
              str(root / "mtp.safetensors"))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    return root


@pytest.mark.parametrize("nested", [True, False])
def test_shape_from_checkpoint_headers(tmp_path, nested):
    s = M.from_checkpoint(_tiny_checkpoint(tmp_path / "m", nested))
    per_expert = 3 * (4 * 2 * 48 * 2) + 3 * 2 * (64 + 32)  # trellis int16 + fp16 suh/svh of 3 projections
    assert (s.layers, s.moe_layers, s.experts_per_layer, s.top_k, s.mla_layers, s.mtp_layer) == (2, 1, 4, 2, 1, 2)
    assert s.expert_bytes == per_expert and s.experts == 4
    assert s.always_used_bytes == 32 * 64 * 2  # the MTP layer's tensors are not counted
    assert s.host_bytes == 10 * 64 * 2  # the unquantized embedding stays in host RAM (exllamav3's prefer_cpu)
    # NoPE MLA (transformers' default qk_rope_head_dim 0): the fp16 latent, the full indexer's [k || gate] plane and
    # its pooled keys (128 dims per 16 tokens).
    assert s.kv_bytes_per_token == 512 * 2 + 256 * 2 + 128 * 2 // 16


def test_shape_errors(tmp_path):
    with pytest.raises(M.ShapeError, match="no config.json"):
        M.from_checkpoint(tmp_path)
    root = _tiny_checkpoint(tmp_path / "m", True)
    (root / "kpool_aux.safetensors").unlink()
    with pytest.raises(M.ShapeError, match="3 experts on disk, config says 4"):
        M.from_checkpoint(root)


def test_default_shape_matches_design():
    d = M.DEFAULT_SHAPE
    assert d.experts == 12096 and d.expert_bytes == 9 * (1 << 20) + 36 * 1024
    assert 106 * U.GIB < d.all_experts_bytes < 107 * U.GIB


def test_current_plan_for_serve():
    # What `glm53 serve` calls: this machine, these settings. With no model configured it is always the demo.
    from glm53.planning.inputs import current_plan

    plan, inp = current_plan(S.load(environ={}, dotenv=None))
    assert plan.mode == "demo" and inp.facts.root == "/" and plan.real_model is not None


def test_nvme_ram_tier_that_can_hold_the_rest_also_holds_the_rows_kept_free(tmp_path):
    """A cap large enough for every expert outside VRAM: the tier takes those, the experts of the slots staging
    borrows, the admissions' spare rows and the rows each decode step keeps free (glm53.planning.spec.FREE_RAM_SLOTS), not
    one more; without the last two a warm tier keeps dropping experts it reads again
    (tests/step/test_stepper.py)."""
    from glm53.planning.spec import FREE_RAM_SLOTS

    shape = replace(M.DEFAULT_SHAPE, moe_layers=6)
    p = run(tmp_path, NVME_55, shape=shape, GLM53_STORE=STORE, GLM53_MODE="nvme-exact")
    spec = p.engine
    assert p.mode == "nvme-exact" and spec.engine == "nvme-exact"
    spare = 2 * shape.top_k  # the admissions' victims, as in the all-RAM modes
    assert spec.ram_slots == shape.experts - sum(spec.vram_slots) + len(spec.borrowed) + spare + FREE_RAM_SLOTS
    assert "nothing is read from the store once warm" in p.reasons["ram_slots"]
    full = run(tmp_path / "real", NVME_55, GLM53_STORE=STORE)  # the real model: the cap binds, as before
    assert full.engine.ram_slots < M.DEFAULT_SHAPE.experts - full.vram_slots


# ---------------------------------------------------------------- the vision tower


def test_the_vision_tower_is_budgeted_resident_beside_the_experts(tmp_path):
    """A checkpoint with the tower: its weights (read from the headers) and a screenshot's activations come out of
    the budget, before the expert slots, and the reason says so; the same shape without it gives them to slots."""
    import dataclasses

    p = run(tmp_path / "with")
    tower, why = P.vision_tower_bytes(M.DEFAULT_SHAPE)
    assert p.vram_accounting["vision_tower"] == tower == M.DEFAULT_SHAPE.vision_bytes + 5336 * (
        M.DEFAULT_SHAPE.vision_bytes_per_patch)
    assert "resident" in p.reasons["vision"] and "1280x800 screenshot" in p.reasons["vision"]
    assert sum(p.vram_accounting.values()) <= p.vram_budget_bytes
    one = run(tmp_path / "one", GLM53_MAX_CONCURRENCY="1")
    bare = run(tmp_path / "bare", shape=dataclasses.replace(M.DEFAULT_SHAPE, vision_bytes=0), GLM53_MAX_CONCURRENCY="1")
    assert "vision_tower" not in bare.vram_accounting and "vision" not in bare.reasons
    assert bare.vram_slots > one.vram_slots
    off = run(tmp_path / "off", GLM53_MAX_CONCURRENCY="1", GLM53_MAX_IMAGES="0")  # images off: the slots get it back
    assert "vision_tower" not in off.vram_accounting and "GLM53_MAX_IMAGES=0" in off.reasons["vision"]
    assert off.vram_slots == bare.vram_slots and not off.engine.vision and one.engine.vision


def test_the_shape_reads_the_tower_from_the_checkpoint(tmp_path):
    from glm53.fixture.exl3 import VISUAL, write_exl3_checkpoint

    with_tower = M.from_checkpoint(write_exl3_checkpoint(tmp_path / "v", vision=True))
    text_only = M.from_checkpoint(write_exl3_checkpoint(tmp_path / "t"))
    sizes = {}
    for f in (tmp_path / "v").glob("*.safetensors"):
        sizes.update(M.read_safetensors_sizes(f))
    assert with_tower.vision_bytes == sum(n for k, n in sizes.items() if k.startswith(VISUAL + ".")) > 0
    assert with_tower.vision_bytes_per_patch > 0 and with_tower.always_used_bytes == text_only.always_used_bytes
    assert text_only.vision_bytes == 0 == text_only.vision_bytes_per_patch
