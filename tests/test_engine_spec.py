"""The plan is the only source of sizes: glm53.planning.spec's rules, the plan's EngineSpec, and an engine loaded from a plan
realising exactly the spec (under the fake exllamav3, on a generated checkpoint and a real store)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import fake_exllamav3 as F
import numpy as np
import pytest
from fakehost import HostSpec, write_host
from specs import packed_store

from glm53.fixture.exl3 import write_exl3_checkpoint
from glm53.planning import host as H
from glm53.planning import plan as P
from glm53.planning import settings as S
from glm53.planning import shape as M
from glm53.planning.spec import PAGE, engine_spec, split_slots, staging_for

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30


# ---- the sizing rules ---------------------------------------------------------------------------------------


def test_split_slots_follow_the_saved_skew_and_keep_the_total():
    rng = np.random.default_rng(0)
    flat = rng.uniform(9, 11, 64)
    skewed = np.r_[np.full(8, 200.0), np.full(56, 1.0)]
    counts = np.stack([flat, skewed, flat])
    got, how = split_slots(12, 3, 64, 4, counts)
    assert sum(got) == 36 and min(got) >= 4 and "saved routing statistics" in how
    # The skewed layer's 8 hot experts take 97% of its picks: 8 slots cover them, and its other slots buy more
    # hit rate in the flat layers.
    assert got == (14, 8, 14)
    assert split_slots(12, 3, 64, 4, None)[0] == (12, 12, 12)  # no statistics: uniform
    assert split_slots(2, 3, 64, 4, counts)[0] == (2, 2, 2)  # fewer slots than top_k: all even
    uniform, why = split_slots(12, 3, 64, 4, counts[:2])  # statistics of another shape are not used
    assert uniform == (12, 12, 12) and "not (3, 64)" in why


def test_engine_spec_applies_the_staging_and_ram_rules():
    spec = engine_spec("exact", moe_layers=3, experts_per_layer=16, top_k=4, vram_slots=[3, 5, 4], kv_tokens=5000)
    assert spec.staging_slots == 16 and spec.ram_slots == 48 - 12 + 2 * 4  # every other expert, plus the spare
    assert spec.kv_tokens == 4864 and spec.context == 4864 and spec.cache_sequences == spec.max_concurrency
    assert spec.cpu_threads == 0 and spec.store_threads == 0 and spec.store is None
    # A layer whose slots plus staging would be all its experts gets one staging row more (exllamav3's masking).
    assert staging_for([12, 4], 16, 4) == 5
    assert engine_spec("exact", moe_layers=2, experts_per_layer=16, top_k=4, vram_slots=[12, 4], kv_tokens=4096,
                       staging_slots=4).staging_slots == 5
    stock = engine_spec("stock", moe_layers=3, experts_per_layer=16, top_k=4, kv_tokens=4096)
    assert stock.vram_slots == () and stock.ram_slots == 0 and not stock.tiered
    with pytest.raises(ValueError, match="needs ram_slots"):
        engine_spec("nvme-exact", moe_layers=3, experts_per_layer=16, top_k=4, vram_slots=2, kv_tokens=4096)
    with pytest.raises(ValueError, match="at least 17"):
        engine_spec("nvme-exact", moe_layers=3, experts_per_layer=16, top_k=4, vram_slots=2, kv_tokens=4096,
                    ram_slots=16, store="/s")
    with pytest.raises(ValueError, match="cpu_threads >= 1"):
        engine_spec("fast", moe_layers=3, experts_per_layer=16, top_k=4, vram_slots=2, kv_tokens=4096)
    with pytest.raises(ValueError, match="3 MoE layers"):
        engine_spec("exact", moe_layers=3, experts_per_layer=16, top_k=4, vram_slots=[2, 2], kv_tokens=4096)


# ---- the plan's spec ----------------------------------------------------------------------------------------


def settings(**env: str) -> S.Settings:
    return S.load(environ={"GLM53_MODEL_DIR": "/model", **env}, dotenv=None)


def host(tmp_path, spec=HostSpec(), store: str | None = None) -> H.HostFacts:
    return H.read_host(write_host(tmp_path, spec), store=store)


def test_the_plan_splits_vram_by_saved_routing_statistics(tmp_path):
    facts, s, shape = host(tmp_path), settings(), M.DEFAULT_SHAPE
    uniform = P.plan(facts, shape, s)
    counts = np.ones((42, 288))
    counts[:21, :16] = 500.0  # half the layers route most picks to 16 experts
    split = P.plan(facts, shape, s, (counts, "saved"))
    a, b = uniform.engine, split.engine
    assert sum(b.vram_slots) == sum(a.vram_slots) == split.vram_slots  # the same budget, divided differently
    assert max(a.vram_slots) - min(a.vram_slots) <= 1 and max(b.vram_slots[21:]) > max(b.vram_slots[:21]) >= 8
    assert "saved routing statistics" in b.split and "saved routing statistics" in split.reasons["engine"]
    assert split.ram_slots == b.ram_slots == 42 * 288 - sum(b.vram_slots) + len(b.borrowed) + 16


def test_everything_in_vram_is_stock(tmp_path):
    small = replace(M.DEFAULT_SHAPE, moe_layers=2, always_used_bytes=GIB)
    p = P.plan(host(tmp_path), small, settings())
    assert p.mode == "exact" and p.engine.engine == "stock" and p.ram_slots == 0 and p.ram_tier_bytes == 0
    assert p.vram_slots == small.experts and "stock exllamav3 serves" in p.reasons["vram_slots"]


def test_plan_json_and_text_show_the_spec(tmp_path):
    root = write_host(tmp_path / "host", HostSpec())
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "GLM53_MODEL_DIR": "/model",
           "GLM53_CACHE_DIR": str(tmp_path / "cache")}
    run = [sys.executable, "-m", "glm53", "plan", "--host-root", str(root)]
    done = subprocess.run([*run, "--json"], capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    out = json.loads(done.stdout)
    spec = out["engine"]
    assert spec["engine"] == out["mode"] == "fast" and sum(spec["vram_slots"]) == out["vram_slots"]
    assert spec["ram_slots"] == out["ram_slots"] and spec["kv_tokens"] == out["kv_tokens"]
    assert spec["staging_slots"] == 288 and spec["cpu_threads"] == out["cpu_threads"]
    text = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, timeout=60, env=env).stdout
    slots = spec["vram_slots"]
    more = slots.count(slots[0])  # the uniform split's remainder: one slot more in the first layers
    runs = f"{slots[0]} x{more}" + (f", {slots[-1]} x{42 - more}" if more < 42 else "")
    assert f"fast: VRAM slots per MoE layer {runs}; staging 288" in text


# ---- what loads is what the plan says -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return write_exl3_checkpoint(tmp_path_factory.mktemp("spec") / "ck", router_skew=(0.25, 0.5))


@pytest.fixture(scope="module")
def store(ck, tmp_path_factory):
    return packed_store(ck, tmp_path_factory.mktemp("spec-store"))


def planned(tmp_path, ck, mode: str, routing=None, host_spec=HostSpec(), **env: str) -> P.Plan:
    """The plan on a fake 24 GB host for the tiny checkpoint, its experts weighed as 700 MiB each so that a few per
    layer fit in VRAM (the plan sizes bytes; the engine realises counts)."""
    shape = replace(M.from_checkpoint(ck), expert_bytes=700 << 20)
    s = S.load(environ={"GLM53_MODEL_DIR": str(ck), "GLM53_MODE": mode, "GLM53_CONTEXT": "8192",
                        "GLM53_MAX_CONCURRENCY": "3", "GLM53_CPU_THREADS": "1", **env}, dotenv=None)
    return P.plan(host(tmp_path, host_spec, s.store or None), shape, s, routing)


def realised(engine) -> dict:
    """The sizes a loaded engine runs with, read from what it built."""
    t = engine.tiered
    gen, cache = engine.runtime.generator, engine.runtime.cache
    out = {"kv_tokens": cache.max_num_tokens - PAGE, "cache_sequences": cache.max_batch_size,
           "max_concurrency": gen.max_batch_size, "prefill_chunk": gen.max_chunk_size,
           "context": engine.context_length}
    if t is not None:
        lane = t.stepper.lane
        out.update(vram_slots=tuple(layer.slots for layer in t.layers), staging_slots=t.staging_slots,
                   ram_slots=t.tiers.ram.num_slots, cpu_threads=lane.threads if lane is not None else 0)
    return out


def expected(spec) -> dict:
    keys = ("kv_tokens", "cache_sequences", "max_concurrency", "prefill_chunk", "context")
    out = {k: getattr(spec, k) for k in keys}
    if spec.tiered:
        out.update(vram_slots=spec.vram_slots, staging_slots=spec.staging_slots, ram_slots=spec.ram_slots,
                   cpu_threads=spec.cpu_threads)
    return out


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_a_loaded_engine_realises_the_plan(tmp_path, ck, mode):
    from glm53.engine.exl3_engine import Exl3Engine
    from glm53.serve.choice import engine_for_plan

    counts = np.ones((3, 16))
    counts[0, :2] = 100.0
    plan = planned(tmp_path, ck, mode, (counts, "saved"))
    spec = plan.engine
    assert spec.engine == mode and len(set(spec.vram_slots)) > 1  # split by the statistics
    chosen = engine_for_plan(ck, settings(), plan)
    assert chosen.spec is spec and chosen.forecast is plan.forecast and mode in plan.forecast["modes"]
    with F.installed():
        engine = Exl3Engine(ck, replace(spec, device="cpu"))
        engine.load()
        try:
            assert realised(engine) == expected(spec)
        finally:
            engine.close()


@pytest.mark.parametrize("buffered", [False, True])
def test_nvme_serves_the_store_the_plan_allowed(tmp_path, ck, store, monkeypatch, buffered):
    """GLM53_ALLOW_BUFFERED_READS=1 on a filesystem without O_DIRECT: the plan accepts the store, and so does the
    engine (it once opened the store without the setting and refused what the plan approved)."""
    import store.directio as D
    from glm53.engine.exl3_engine import Exl3Engine
    from glm53.tiers.nvme_open import StoreRefused
    from store.errors import DirectIOUnsupported

    def refuse(path, flags=0):
        raise DirectIOUnsupported("O_DIRECT refused (the test's filesystem)")

    fake_store = "/nvx/experts.glm53"
    spec_host = HostSpec(mem_cap_gib=40, swap_cap_gib=0, store=fake_store, store_bytes=48 * (700 << 20),
                         mounts=(("/", "overlay"), ("/nvx", "tmpfs"), ("/model", "ext4")))
    env = {"GLM53_STORE": fake_store, "GLM53_ALLOW_BUFFERED_READS": "1" if buffered else "0"}
    if not buffered:
        with pytest.raises(P.PlanError, match="O_DIRECT"):
            planned(tmp_path, ck, "nvme-exact", host_spec=spec_host, **env)
        plan_spec = replace(planned(tmp_path, ck, "nvme-exact", host_spec=spec_host, GLM53_STORE=fake_store,
                                    GLM53_ALLOW_BUFFERED_READS="1").engine, allow_buffered=False)
    else:
        plan_spec = planned(tmp_path, ck, "nvme-exact", host_spec=spec_host, **env).engine
        assert plan_spec.allow_buffered and plan_spec.ram_slots >= 17
    monkeypatch.setattr(D, "open_direct", refuse)
    with F.installed():
        engine = Exl3Engine(ck, replace(plan_spec, device="cpu", store=str(store)))
        if not buffered:
            with pytest.raises(StoreRefused):
                engine.load()
            return
        engine.load()
        try:
            assert realised(engine) == expected(engine.spec)
            assert engine.tiered.nvme is not None
        finally:
            engine.close()


def test_the_recurrent_checkpoints_are_budgeted_from_ram(tmp_path):
    """exllamav3 keeps recurrent-state checkpoints in host RAM (its prefix reuse for the KDA layers): the plan sizes
    them, counts them against a memory cap before the RAM tier, and the engine passes the size on."""
    roomy = P.plan(host(tmp_path / "a"), M.DEFAULT_SHAPE, settings())
    assert roomy.engine.recurrent_cache_bytes == 4 * GIB and "recurrent_cache" in roomy.reasons
    store = "/nvx/experts.glm53"
    capped = {cap: P.plan(host(tmp_path / str(cap), HostSpec(mem_cap_gib=cap, swap_cap_gib=0, store=store), store),
                          M.DEFAULT_SHAPE, settings(GLM53_STORE=store)) for cap in (16, 55)}
    small, big = capped[16].engine, capped[55].engine
    # an eighth of what a 16 GiB cap leaves usable
    assert capped[16].mode == "nvme" and 1.9 * GIB < small.recurrent_cache_bytes <= 2 * GIB
    assert big.recurrent_cache_bytes == 4 * GIB
    record = -(-M.DEFAULT_SHAPE.expert_bytes // 4096) * 4096
    for cap, spec in ((16, small), (55, big)):
        pinned = spec.ram_slots * record
        assert pinned + spec.recurrent_cache_bytes <= cap * GIB - 2 * GIB  # within the cap, the margin kept


def test_shape_estimates_follow_the_generated_config(ck):
    """The cache and state sizes the plan counts, from the config a generated checkpoint writes (the geometry
    exllamav3 reads), against exllamav3 1.6.5's layouts written out here by hand."""
    text = json.loads((ck / "config.json").read_text())["text_config"]
    lin = text["linear_attn_config"]
    shape = M.from_checkpoint(ck)
    mla = [i for i, t in enumerate(text["layer_types"]) if t == "deepseek_sparse_attention"]
    kda = text["num_hidden_layers"] - len(mla)
    assert text["qk_rope_head_dim"] == 0 and all(text["indexer_types"][i] == "full" for i in mla)
    d, pool = text["index_head_dim"], text["index_kpool"]
    # CacheLayer_MLA_fp16: latent (kv_lora_rank), no rope key, the [k || gate] plane and the pooled keys, fp16.
    assert shape.kv_bytes_per_token == len(mla) * (text["kv_lora_rank"] * 2 + 2 * d * 2 + d * 2 // pool)
    # GDNLayerState: 2 fp16 state rows per sequence slot, the bf16 conv ring and one row of staged scan inputs.
    h, hd, taps = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    qkv = 3 * h * hd
    assert shape.state_bytes_per_seq == kda * (2 * h * hd * hd * 2 + qkv * taps * 2 + qkv * 2 + h * 2 + h * hd * 4)
    assert shape.checkpoint_bytes == kda * (qkv * taps * 2 + h * hd * hd * 2)
    # The bf16 embedding is host RAM, the MTP layer is not loaded, the rest is VRAM.
    sizes = {}
    for f in ck.glob("*.safetensors"):
        sizes.update(M.read_safetensors_sizes(f))
    embed = sizes["model.language_model.embed_tokens.weight"]
    assert shape.host_bytes == embed == text["vocab_size"] * text["hidden_size"] * 2
    layers = text["num_hidden_layers"]
    vram = sum(n for k, n in sizes.items() if "embed_tokens" not in k and ".experts." not in k
               and not k.startswith(f"model.language_model.layers.{layers}."))
    assert shape.always_used_bytes == vram
    assert [p[0] for p in shape.prefill_phases] == ["KDA projections and conv", "KDA scan", "MoE", "MLA"]


# ---- on the GPU machine: the estimates against what a prefill holds -----------------------------------------


def _process_device_bytes() -> tuple[int, str]:
    """This process's device memory as the driver counts it (nvidia-smi's per-process figure), else the device's
    used memory (then other processes' use is included: said in the method)."""
    import os

    import torch

    done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=10)
    for line in done.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip() == str(os.getpid()) and mib.strip().isdigit():
            return int(mib) << 20, "nvidia-smi, this process"
    free, total = torch.cuda.mem_get_info()
    return total - free, "device used (nvidia-smi does not list this pid)"


class _DevicePeak:
    """Polls this process's device memory (10 times a second) while the block runs; .bytes is the highest seen."""

    def __enter__(self) -> _DevicePeak:
        import threading

        self.bytes, self.how, self._stop = 0, "", threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            nbytes, self.how = _process_device_bytes()
            self.bytes = max(self.bytes, nbytes)
            self._stop.wait(0.1)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _measure_prefill(ck: Path, shape: M.ModelShape, chunk: int) -> dict:
    """Load `ck` in exact mode (16 VRAM slots per layer, a layer of staging), prefill two chunks of `chunk` tokens
    and the last token's forward, and return what was allocated before, at the peak, and what the driver saw."""
    import gc

    import torch
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Job, Model, Tokenizer
    from specs import spec_for

    from glm53.exl3.tiered import TieredMoE

    config = Config.from_directory(str(ck))
    model = Model.from_config(config)
    spec = spec_for(ck, "exact", 16, device="cuda:0", kv_tokens=3 * chunk, max_concurrency=1, prefill_chunk=chunk)
    cache = Cache(model, max_num_tokens=spec.kv_tokens + PAGE, max_batch_size=spec.cache_sequences)
    tiered = TieredMoE(model, ck, spec)
    tiered.install()
    try:
        model.load(device=torch.device("cuda:0"))
        tiered.populate()
        gen = Generator(model=model, cache=cache, tokenizer=Tokenizer.from_config(config), max_batch_size=1,
                        max_chunk_size=chunk, recurrent_cache_size=spec.recurrent_cache_bytes)
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        vocab = shape.host_bytes // (2 * shape.hidden) or 150000
        prompt = [(7 * i + 3) % min(150000, vocab) for i in range(2 * chunk + 1)]
        with _DevicePeak() as device:
            gen.enqueue(Job(input_ids=torch.tensor([prompt], dtype=torch.long), max_new_tokens=4,
                            sampler=ArgmaxSampler(), stop_conditions=[]))
            while gen.num_remaining_jobs():
                gen.iterate()
            torch.cuda.synchronize()
        top = torch.cuda.max_memory_allocated()
        counted = (shape.always_used_bytes + (spec.kv_tokens + PAGE) * shape.kv_bytes_per_token
                   + spec.cache_sequences * shape.state_bytes_per_seq
                   + (sum(spec.vram_slots) + spec.staging_slots) * shape.expert_bytes)
        return {"static_allocated": static, "static_counted": counted, "activations": top - static,
                "activations_estimated": P.prefill_activation_bytes(shape, chunk)[0], "reserve": device.bytes - top,
                "device_peak": device.bytes, "device_how": device.how}
    finally:
        model.unload()
        tiered.close()
        del model, cache
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_prefill_memory_against_the_plan(tmp_path, exl3):
    """What a prefill really holds, against the plan's estimates: torch's peak allocated bytes over two chunks'
    forwards less what was allocated before (the activations), and this process's device memory at its peak less
    torch's peak allocated bytes (the reserve: CUDA context, kernel images, graphs, allocator slack). Chunks of 2,048
    and 4,096 give the per-token and fixed terms. Prints the figures glm53.planning.plan's VRAM_RESERVE and
    PREFILL_MEASURED take (and writes $OUT/plan-memory.json); fails where the plan counts less than a prefill uses.
    GLM53_MEMORY_CKPT: the checkpoint to measure (the full-depth fixture: its graphs and layer count make the
    reserve's real figure); default a generated full-width 4-layer one (dense + KDA, KDA + MoE, MLA + MoE)."""
    import os

    given = os.environ.get("GLM53_MEMORY_CKPT")
    ck = Path(given) if given else write_exl3_checkpoint(tmp_path / "w", shape="glm53", moe_layers=3, mtp_layers=0,
                                                          shards=4)
    shape = M.from_checkpoint(ck)
    got = {chunk: _measure_prefill(ck, shape, chunk) for chunk in (2048, 4096)}
    per_token = (got[4096]["activations"] - got[2048]["activations"]) // 2048
    fixed = got[2048]["activations"] - per_token * 2048
    reserve = max(g["reserve"] for g in got.values())
    report = {"checkpoint": str(ck), "layers": shape.layers, "chunks": got,
              "PREFILL_MEASURED": [per_token, fixed], "reserve": reserve, "VRAM_RESERVE": P.VRAM_RESERVE}
    print("\nplan memory: " + json.dumps(report))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "plan-memory.json").write_text(json.dumps(report, indent=2) + "\n")
    for chunk, g in got.items():
        # The static tensors are what the plan counts (weights, KV, KDA state, slots, staging), within 5%.
        assert abs(g["static_allocated"] - g["static_counted"]) <= 0.05 * g["static_counted"], (chunk, g)
        assert g["activations"] <= 1.1 * g["activations_estimated"], (chunk, g)
    if given:  # a 4-layer model's graphs and slack are not full depth's: only the full-depth figure is checked
        assert reserve <= 1.1 * P.VRAM_RESERVE, report


def test_borrowed_rows_lend_each_layer_a_layer_of_staging_from_the_others():
    from glm53.planning.spec import borrowable, borrowed_rows

    slots = [33] * 42
    rows = borrowed_rows(slots, 280)
    # Taken from every layer's last slots in turn: each gives up 6 or 7, and each finds 280 in the others.
    per = np.bincount([lay for lay, _ in rows], minlength=42)
    assert per.max() - per.min() <= 1 and all(len(rows) - per[li] >= 280 for li in range(42))
    assert all(s >= 33 - per[lay] for lay, s in rows) and len(set(rows)) == len(rows)
    # Per card: a layer borrows only from layers on its own card.
    two = borrowed_rows(slots, 100, [0] * 21 + [1] * 21)
    assert {lay < 21 for lay, _ in two} == {True, False}
    assert borrowable([5, 0, 3]) == 3 and borrowed_rows([5, 0, 3], 0) == ()
    with pytest.raises(ValueError, match="at most 3"):
        borrowed_rows([5, 0, 3], 4)


def test_engine_spec_keeps_decode_rows_and_borrows_the_rest():
    common = dict(moe_layers=42, experts_per_layer=288, top_k=8, vram_slots=33, kv_tokens=4096)
    one = engine_spec("exact", max_concurrency=1, **common)
    assert (one.staging_slots, one.dedicated_staging, len(one.borrowed)) == (288, 8, 287)
    assert one.ram_slots == 42 * 288 - 42 * 33 + 287 + 16  # the lent slots' experts are written back to RAM
    eight = engine_spec("exact", max_concurrency=8, **common)
    assert eight.dedicated_staging == 64 and engine_spec("exact", max_concurrency=32, **common).dedicated_staging == 64
    # Too few slots to lend a layer of staging: the rows are its own, as before; rows asked for are raised to
    # what the slots can lend.
    tight = {**common, "vram_slots": 4, "moe_layers": 3}
    assert engine_spec("exact", max_concurrency=1, **tight).borrowed == ()
    asked = engine_spec("exact", max_concurrency=1, staging_rows=8, **tight)
    assert asked.dedicated_staging == 288 - 8 and len(asked.borrowed) == 12
    nvme = engine_spec("nvme-exact", max_concurrency=1, ram_slots=400, store="/s", **common)
    assert nvme.ram_slots == 400 and nvme.dedicated_staging == 8  # the store holds a dropped expert
