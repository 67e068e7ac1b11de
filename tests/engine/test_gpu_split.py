"""A layer split across devices, bit-identical to stock exllamav3 (GPU machine: pytest -m gpu tests/engine/test_gpu_split.py -s).

One GPU: the decoder layers split two ways onto the SAME card (two device shares, two budgets): each share has
its own slot arenas, staging rows and copy streams, and exllamav3 loads each layer through the placement hook,
so every piece of the per-card bookkeeping runs where only one GPU exists. Two GPUs (skipped with the reason
unless two CUDA devices are visible, e.g. nvidia-h200-x2): the same split onto cuda:0 and cuda:1, where each
layer's misses cross its own card's link. Each run: 256 greedy tokens for two prompts (batched decode, and a
prefill longer than 8 rows), every generated token's logits torch.equal to stock's.
"""

from __future__ import annotations

import pytest
from specs import split_spec
from test_gpu_engine import assert_bit_identical, greedy_runs, prompts_for
from test_gpu_modes import pack

from glm53.fixture.exl3 import write_exl3_checkpoint

pytestmark = pytest.mark.gpu

STEPS = 256


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


two_cards = pytest.mark.skipif(_cuda_devices() < 2, reason="needs two CUDA devices (a two-GPU machine such as "
                               "nvidia-h200-x2); on one GPU the same-card split tests cover the bookkeeping")


def tiny(tmp_path):
    # 8 layers (1 dense, 7 MoE of 16 experts, top-4): a split leaves 3 and 4 MoE layers on the two shares.
    return write_exl3_checkpoint(tmp_path / "tiny", router_skew=(0.25, 0.5), layers=8, dense_layers=1)


def _report(name: str, stock: dict, got: dict) -> None:
    s = got["stats"]
    per = "; ".join(f"{d['device']} MoE layers {d['moe_layers']}: picks {d['picks']} ({d['lanes']}), link "
                    f"{d['link_bytes'] / 2**20:.1f} MiB" for d in s["devices"])
    print(f"\n{name}: {STEPS} steps x {len(stock['tokens'])} prompts bit-identical; stock {stock['gen_s']:.2f} s, "
          f"split {got['gen_s']:.2f} s; {per}")


def check_split(stock: dict, got: dict, cards: int) -> None:
    assert_bit_identical(stock, got, STEPS)
    s = got["stats"]
    assert len(s["devices"]) == cards and s["picks"]["pcie"] > 0
    assert all(d["picks"] > 0 and d["lanes"]["pcie"] > 0 and d["link_bytes"] > 0 for d in s["devices"]), s["devices"]
    assert sum(d["picks"] for d in s["devices"]) == s["picks"]["total"]


def test_same_card_two_way_split_exact_bit_identical(tmp_path, exl3):
    path = tiny(tmp_path)
    prompts = prompts_for(200)
    stock = greedy_runs(path, prompts, STEPS)
    spec = split_spec(path, "exact", 2, device="cuda:0", index=0, budget=12 << 30)
    assert [d.device for d in spec.devices] == ["cuda:0", "cuda:0"]
    got = greedy_runs(path, prompts, STEPS, spec=spec)
    check_split(stock, got, 2)
    _report("tiny, two shares of cuda:0, 2 slots/layer", stock, got)


def test_same_card_two_way_split_glm53_width_exact_bit_identical(tmp_path, exl3):
    path = write_exl3_checkpoint(tmp_path / "glm53", shape="glm53", moe_layers=3, mtp_layers=0, shards=4,
                                 router_skew=(0.11, 0.40))
    prompts = prompts_for(150000)
    stock = greedy_runs(path, prompts, STEPS)
    got = greedy_runs(path, prompts, STEPS, spec=split_spec(path, "exact", 16, device="cuda:0", index=0))
    check_split(stock, got, 2)
    _report("glm53 x3, two shares of cuda:0, 16 slots/layer", stock, got)


def _nvme(store, path, spec):
    from glm53.tiers.nvme_open import open_nvme_tier

    def open_():
        return open_nvme_tier(store, path, spec, warm=False, pin=True)

    open_.spec = spec
    return open_


def test_same_card_two_way_split_nvme_exact_bit_identical(tmp_path, exl3):
    path = tiny(tmp_path)
    store = pack(path, tmp_path / "experts.glm53")
    prompts = prompts_for(200)
    stock = greedy_runs(path, prompts, STEPS)
    # 7 MoE layers x 16 experts, 2 VRAM slots each; one RAM tier of 40 records for both shares: store reads.
    spec = split_spec(path, "nvme-exact", 2, device="cuda:0", index=0, store=str(store), ram_slots=40,
                      store_threads=4)
    got = greedy_runs(path, prompts, STEPS, spec=spec, nvme=_nvme(store, path, spec))
    check_split(stock, got, 2)
    assert got["stats"]["picks"]["nvme"] > 0
    _report("tiny nvme-exact, two shares of cuda:0", stock, got)


@two_cards
def test_two_cards_exact_bit_identical(tmp_path, exl3):
    path = write_exl3_checkpoint(tmp_path / "glm53", shape="glm53", moe_layers=3, mtp_layers=0, shards=4,
                                 router_skew=(0.11, 0.40))
    prompts = prompts_for(150000)
    stock = greedy_runs(path, prompts, STEPS)
    got = greedy_runs(path, prompts, STEPS, spec=split_spec(path, "exact", 16, device="cuda:0", index=(0, 1)))
    check_split(stock, got, 2)
    _report("glm53 x3 on cuda:0 + cuda:1, 16 slots/layer", stock, got)


@two_cards
def test_two_cards_nvme_exact_bit_identical(tmp_path, exl3):
    path = tiny(tmp_path)
    store = pack(path, tmp_path / "experts.glm53")
    prompts = prompts_for(200)
    stock = greedy_runs(path, prompts, STEPS)
    spec = split_spec(path, "nvme-exact", 2, device="cuda:0", index=(0, 1), store=str(store), ram_slots=40,
                      store_threads=4)
    got = greedy_runs(path, prompts, STEPS, spec=spec, nvme=_nvme(store, path, spec))
    check_split(stock, got, 2)
    _report("tiny nvme-exact on cuda:0 + cuda:1", stock, got)


@two_cards
def test_two_cards_long_prompt_within_budgets(tmp_path, exl3):
    """A 250,000-token prompt prefills and decodes with the layers split over two cards, each held to a 24 GiB
    budget (torch's per-process memory fraction), on the full-width fixture."""
    import torch
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Job, Model, Tokenizer

    from glm53.exl3.placement import place_layers
    from glm53.exl3.tiered import TieredMoE

    path = write_exl3_checkpoint(tmp_path / "glm53", shape="glm53", moe_layers=3, mtp_layers=0, shards=4,
                                 router_skew=(0.11, 0.40))
    tokens = 250_000
    budget = 24 << 30
    for i in (0, 1):
        torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(i).total_memory, i)
    spec = split_spec(path, "exact", 32, device="cuda:0", index=(0, 1), kv_tokens=tokens + 512, budget=budget,
                      max_concurrency=1)
    config = Config.from_directory(str(path))
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=spec.kv_tokens + 256, max_batch_size=1)
    tiered = TieredMoE(model, path, spec)
    tiered.install()
    unplace = place_layers(model, spec)
    try:
        model.load(device=torch.device("cuda:0"))
    finally:
        unplace()
    tiered.populate()
    try:
        gen = Generator(model=model, cache=cache, tokenizer=Tokenizer.from_config(config), max_batch_size=1,
                        max_chunk_size=2048)
        prompt = torch.tensor([[(7 * i + 3) % 150000 for i in range(tokens)]], dtype=torch.long)
        gen.enqueue(Job(input_ids=prompt, max_new_tokens=32, sampler=ArgmaxSampler(), stop_conditions=[]))
        out = []
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r.get("stage") == "streaming" and "token_ids" in r:
                    out += r["token_ids"][0].tolist()
        assert len(out) == 32
        peaks = [torch.cuda.max_memory_allocated(i) for i in (0, 1)]
        print(f"\n{tokens}-token prompt on two cards: peaks {[round(p / 2**30, 2) for p in peaks]} GiB of "
              f"{budget / 2**30:.0f} each; {tiered.snapshot()['devices']}")
        assert all(p <= budget for p in peaks)
    finally:
        model.unload()
        tiered.close()
        for i in (0, 1):
            torch.cuda.set_per_process_memory_fraction(1.0, i)

