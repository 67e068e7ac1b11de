"""Exact mode is bit-identical to stock exllamav3 (GPU machine: pytest -m gpu tests/engine/test_gpu_engine.py -s).

Each test runs the same greedy generations twice through exllamav3's Generator: once stock (every routed expert
in VRAM), once with the experts tiered by glm53 (a few VRAM slots per MoE layer, the rest in the pinned RAM tier,
misses over PCIe), and asserts torch.equal on every generated token's logits. Two prompts run concurrently, so
decode steps are batched (bsz 2 through the fused decode kernel), and one prompt is long enough for a prefill
forward of more than 8 rows (the sorted/grouped prefill path).
"""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
from specs import spec_for

from glm53.fixture.exl3 import write_exl3_checkpoint

pytestmark = pytest.mark.gpu


def greedy_runs(model_dir, prompts, steps, slots=None, staging=None, admit=True, chunk=2048, nvme=None,
                spec=None) -> dict:
    """Generate `steps` greedy tokens for every prompt in one generator; returns tokens, logits (CPU), stats.
    spec: a tiered spec of the caller's own (a layer split across devices: its layers are placed by its shares)."""
    import torch
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Job, Model, Tokenizer

    from glm53.exl3.placement import place_layers
    from glm53.exl3.tiered import TieredMoE

    config = Config.from_directory(str(model_dir))
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=4096)
    tiered = None
    if slots is not None or spec is not None:
        spec = spec or (nvme.spec if nvme is not None else spec_for(model_dir, "exact", slots, staging_slots=staging,
                                                                     device="cuda:0"))
        tiered = TieredMoE(model, model_dir, spec, admit=admit, nvme_open=nvme)
        tiered.install()
    t0 = time.perf_counter()
    unplace = place_layers(model, spec) if spec is not None else (lambda: None)
    try:
        model.load(device=torch.device("cuda:0"))
    finally:
        unplace()
    if tiered is not None:
        tiered.populate()
    load_s = time.perf_counter() - t0
    try:
        gen = Generator(model=model, cache=cache, tokenizer=Tokenizer.from_config(config), max_batch_size=len(prompts),
                        max_chunk_size=chunk)
        tokens = {i: [] for i in range(len(prompts))}
        logits = {i: [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            gen.enqueue(Job(input_ids=torch.tensor([p], dtype=torch.long), max_new_tokens=steps,
                            sampler=ArgmaxSampler(), stop_conditions=[], identifier=i, return_logits=True))
        t1 = time.perf_counter()
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r.get("stage") != "streaming":
                    continue
                if "token_ids" in r:
                    tokens[r["identifier"]] += r["token_ids"][0].tolist()
                if "logits" in r:
                    logits[r["identifier"]].append(r["logits"][0].float().cpu())
        gen_s = time.perf_counter() - t1
        out = {"tokens": tokens, "logits": {i: torch.cat(v) for i, v in logits.items()}, "load_s": load_s,
               "gen_s": gen_s}
        if tiered is not None:
            tiered.check_invariants()
            out["stats"] = tiered.snapshot()
        return out
    finally:
        model.unload()
        if tiered is not None:
            tiered.close()
        del model, cache
        gc.collect()
        torch.cuda.empty_cache()


def assert_bit_identical(stock: dict, exact: dict, steps: int) -> None:
    import torch

    for i, want in stock["tokens"].items():
        got = exact["tokens"][i]
        assert len(want) == len(got) == steps, f"prompt {i}: {len(want)} vs {len(got)} tokens"
        a, b = stock["logits"][i], exact["logits"][i]
        assert a.shape == b.shape
        for t in range(a.shape[0]):
            if not torch.equal(a[t], b[t]):
                diff = (a[t] - b[t]).abs().max().item()
                raise AssertionError(f"prompt {i}: logits differ at generated token {t} (max |diff| {diff:.3e}); "
                                     f"tokens so far equal: {want[:t] == got[:t]}")
        assert want == got


def prompts_for(vocab: int) -> list[list[int]]:
    # One prompt of 40 tokens (a prefill forward of 39 rows: the > 8-row path), one of 6 (the fused decode path).
    return [[(7 * i + 3) % vocab for i in range(40)], [(11 * i + 5) % vocab for i in range(6)]]


def _report(name: str, stock: dict, exact: dict, steps: int) -> None:
    s = exact["stats"]
    print(f"\n{name}: {steps} steps x {len(stock['tokens'])} prompts bit-identical; stock {stock['gen_s']:.2f} s, "
          f"exact {exact['gen_s']:.2f} s; picks {s['picks']}, hit rate {s['hit_rate']}, admissions "
          f"{s['admissions']}, evictions {s['evictions']}, bytes {s['bytes']}")


def test_tiny_exact_bit_identical(tmp_path, exl3):
    path = write_exl3_checkpoint(tmp_path / "tiny", router_skew=(0.25, 0.5), layers=4, dense_layers=1)
    steps = 300
    prompts = prompts_for(200)
    stock = greedy_runs(path, prompts, steps)
    # 2 slots per layer (< top_k 4): every step misses, admits (evicting) and stages. The GPU waits for the copies,
    # and admissions are copied from staging once the step's kernels are queued.
    exact = greedy_runs(path, prompts, steps, slots=2)
    assert_bit_identical(stock, exact, steps)
    s = exact["stats"]
    assert s["picks"]["pcie"] > 0 and s["evictions"] > 0 and s["bytes"]["ram_to_staging"] > 0
    assert s["bytes"]["staging_to_vram"] > 0 and s["bytes"]["ram_to_vram"] == 0
    _report("tiny, 2 slots/layer", stock, exact, steps)
    # No VRAM cache at all: every pick streamed through staging.
    stream = greedy_runs(path, prompts, steps, slots=0, admit=False)
    assert_bit_identical(stock, stream, steps)
    assert stream["stats"]["picks"]["vram_hit"] == 0
    _report("tiny, 0 slots (all staged)", stock, stream, steps)
    # Staging of top_k rows of its own: the 39-row prefill and the two-row decode steps (8 picks) borrow the other
    # layers' cache slots, writing their experts back first (glm53.planning.spec.borrowed_rows, ExpertTiers.borrow).
    lent = greedy_runs(path, prompts, steps, spec=spec_for(path, "exact", 6, staging_rows=4, device="cuda:0"))
    assert_bit_identical(stock, lent, steps)
    assert lent["stats"]["staging_rows"] == 4 and lent["stats"]["lent_out"] > 0
    _report("tiny, 6 slots/layer, 4 staging rows, the rest borrowed", stock, lent, steps)


@pytest.mark.parametrize("moe_layers", [2, 3])
def test_glm53_width_exact_bit_identical(tmp_path, exl3, moe_layers):
    path = write_exl3_checkpoint(tmp_path / "glm53", shape="glm53", moe_layers=moe_layers, mtp_layers=0, shards=4,
                                 router_skew=(0.11, 0.40))
    steps = 256
    prompts = prompts_for(150000)
    stock = greedy_runs(path, prompts, steps)
    # 16 of 288 experts per layer in VRAM (5.6%): constant misses, admissions and evictions.
    exact = greedy_runs(path, prompts, steps, slots=16)
    assert_bit_identical(stock, exact, steps)
    s = exact["stats"]
    assert s["picks"]["pcie"] > 0 and s["evictions"] > 0
    _report(f"glm53 x{moe_layers}, 16 slots/layer", stock, exact, steps)


def test_engine_serves_exact_mode(tmp_path, exl3):
    """Exl3Engine end to end on the tiny checkpoint: events, seeded sampling, stop tokens, stats with tiers."""
    from glm53.engine.exl3_engine import Exl3Engine
    from glm53.engine.interface import SamplingParams, TokenEvent

    path = write_exl3_checkpoint(tmp_path / "tiny", router_skew=(0.25, 0.5))
    engine = Exl3Engine(path, spec_for(path, "exact", 3, device="cuda:0"))
    engine.load()
    try:
        prompt = engine.tokenize("Hello there, how are you?")

        async def run(params: SamplingParams, rid: str) -> list[TokenEvent]:
            return [ev async for ev in engine.generate(prompt, params, rid) if isinstance(ev, TokenEvent)]

        async def main():
            greedy = SamplingParams(temperature=0, max_tokens=24)
            seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, logprobs=2)
            return await asyncio.gather(run(greedy, "a"), run(greedy, "b"), run(seeded, "c"), run(seeded, "d"))

        a, b, c, d = asyncio.run(main())
        assert [e.token_id for e in a] == [e.token_id for e in b] and len(a) == 24
        assert a[-1].finish_reason == "length"
        assert [e.token_id for e in c] == [e.token_id for e in d]
        assert all(e.logprob is not None and len(e.top_logprobs) == 2 for e in c)
        stop = a[5].token_id

        async def stopped():
            return await run(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop]), "e")

        e = asyncio.run(stopped())
        assert e[-1].finish_reason == "stop" and e[-1].token_id == stop
        st = engine.stats()
        assert st["kind"] == "exllamav3" and st["generated_tokens"] >= 4 * 24
        assert st["tiers"]["picks"]["total"] > 0
        print(f"\nengine: loaded in {engine.load_seconds:.1f} s; stats tiers hit rate {st['tiers']['hit_rate']}")
    finally:
        engine.close()
