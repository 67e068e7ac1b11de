"""A layer split across two devices through the adapter's glue, on the CPU (the fake exllamav3; issue 28).

Two device shares stand in for two cards: each has its own link (copy streams, staging rows) and its layers'
VRAM arenas, the RAM tier (and the store) is shared. The same checks as the one-device glue tests: exact and
nvme-exact bit-identical to stock, fast within 1e-5; and each layer's misses go over its own share's link.
"""

from __future__ import annotations

from types import SimpleNamespace

import fake_exllamav3 as F
import pytest
import torch
from specs import packed_store, split_spec
from test_exl3_adapter_glue import (
    SLOTS,
    bit_identical,
    drive,
    generous,
    lane_fit,
    masked_picks,
    near,
    schedule,
    stock_model,
)

from glm53.cpu_lane.lane import CpuLane
from glm53.engine import exl3_adapter as A
from glm53.fixture.exl3 import write_exl3_checkpoint


@pytest.fixture(scope="module", autouse=True)
def fake_exllamav3():
    with F.installed() as mods:
        yield mods


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """The one-device glue tests' checkpoint: 4 layers (1 dense, 3 MoE of 16 experts, top-4), skewed routers."""
    return write_exl3_checkpoint(tmp_path_factory.mktemp("split") / "ck", router_skew=(0.25, 0.5), layers=4,
                                 dense_layers=1, mtp_layers=0)


@pytest.fixture(scope="module")
def store(ck, tmp_path_factory):
    return packed_store(ck, tmp_path_factory.mktemp("split-store"))


def split_model(ck, spec, interm=torch.half, **kw) -> tuple[F.Model, A.TieredMoE]:
    """The engine's lifecycle with the layers placed by the spec's device shares."""
    model = F.Model.from_config(F.Config.from_directory(str(ck)), interm_dtype=interm)
    tiered = A.TieredMoE(model, ck, spec, **kw)
    tiered.install()
    undo = A.place_layers(model, spec)
    try:
        model.load("cpu")
    finally:
        undo()
    tiered.populate()
    return model, tiered


def check_links(tiered: A.TieredMoE, spec) -> dict:
    """Each layer's slots and staging on its own share's link; the per-device report adds up."""
    tiers = tiered.tiers
    assert len(tiers.links) == len(spec.devices) == 2
    assert tiered.link_of == [i for i, d in enumerate(spec.devices) for _ in range(d.moe_count)]
    a, b = (link.staging for link in tiers.links)
    assert a.data_ptr() != b.data_ptr() and tiers.links[0].copier is not tiers.links[1].copier
    for li, layer in enumerate(tiered.layers):
        staging = tiers.link(li).staging
        lin = layer.slot_linears[0][layer.slots]  # the first staging slot's gate Linear
        assert staging.data_ptr() <= lin.inner.trellis.data_ptr() < staging.data_ptr() + staging.nbytes
    snap = tiered.snapshot()
    per = snap["devices"]
    assert [d["moe_layers"] for d in per] == [[li for li, x in enumerate(tiered.link_of) if x == i] for i in (0, 1)]
    assert sum(d["picks"] for d in per) == snap["picks"]["total"]
    assert all(d["picks"] > 0 and d["link_bytes"] > 0 for d in per)
    # On the CPU every copy has host memory at both ends, so the links count all the tiers' copies, and the start-up
    # fill and prefill's on-device copies of resident experts besides.
    crossed = sum(n for k, n in snap["bytes"].items() if k != "store_to_ram")  # store reads land in RAM, not a link
    assert sum(d["link_bytes"] for d in per) >= crossed > 0
    return snap


def test_exact_split_is_bit_identical_and_each_share_copies_its_own(ck):
    spec = split_spec(ck, "exact", SLOTS)
    stock = stock_model(ck)
    model, tiered = split_model(ck, spec, lookahead=False)
    try:
        drive(stock, model, schedule(1, 40), 1, bit_identical, tiered)
        snap = check_links(tiered, spec)
        assert snap["picks"]["pcie"] > 0 and snap["admissions"] > 0 and snap["evictions"] > 0
        assert masked_picks(model, tiered) == 0
        tiered.check_invariants()
    finally:
        model.unload()
        tiered.close()


def test_lookahead_stops_at_the_card_boundary(ck):
    spec = split_spec(ck, "exact", SLOTS)
    stock = stock_model(ck)
    model, tiered = split_model(ck, spec, lookahead=True)
    try:
        drive(stock, model, schedule(2, 30), 2, bit_identical, tiered)
        check_links(tiered, spec)
    finally:
        model.unload()
        tiered.close()


def test_fast_split_lane_serves_both_shares(ck):
    spec = split_spec(ck, "fast", SLOTS, cpu_threads=2)
    stock = stock_model(ck, torch.float)  # fp32 intermediates: what the lane computes
    model, tiered = split_model(ck, spec, torch.float, lookahead=False)
    lane = generous(CpuLane(tiered.layout, threads=2, stats=tiered.tiers.stats, codebook=tiered.codebook))
    tiered.enable_lane(lane, lane_fit())
    try:
        drive(stock, model, schedule(3, 40), 3, near(1e-5), tiered)
        snap = check_links(tiered, spec)
        assert all(d["lanes"]["cpu"] > 0 for d in snap["devices"]), snap["devices"]
    finally:
        model.unload()
        tiered.close()


def test_nvme_exact_split_shares_the_ram_tier_and_store(ck, store):
    from glm53.tiers.nvme_open import open_nvme_tier

    spec = split_spec(ck, "nvme-exact", SLOTS, store=str(store), ram_slots=20, store_threads=2)
    stock = stock_model(ck)
    model, tiered = split_model(ck, spec, lookahead=False,
                                nvme_open=lambda: open_nvme_tier(store, ck, spec, warm=False, pin=False))
    try:
        assert tiered.tiers.ram.num_slots == 20  # one RAM tier for both shares
        drive(stock, model, schedule(4, 40), 4, bit_identical, tiered)
        snap = check_links(tiered, spec)
        assert snap["store_reads"] and snap["picks"]["nvme"] > 0
    finally:
        model.unload()
        tiered.close()


def test_a_spec_for_another_checkpoint_is_refused(ck):
    from specs import spec_for

    from glm53.devices import DeviceShare
    from glm53.engine.exl3_adapter import Exl3TierError

    # Shares that cover the MoE layers but put MoE layer 2 (decoder layer 3) with decoder layers 0-2.
    shares = (DeviceShare(0, "a", 1, 0, 2, 0, 3, sum(SLOTS)), DeviceShare(0, "b", 1, 3, 3, 3, 0, 0))
    model = F.Model.from_config(F.Config.from_directory(str(ck)))
    with pytest.raises(Exl3TierError, match=r"layers\.3\.mlp is MoE layer 2"):
        A.TieredMoE(model, ck, spec_for(ck, "exact", SLOTS, devices=shares))


def test_place_layers_puts_each_module_on_its_share():
    """Modules load onto their decoder layer's share (embedding first, head last); a CPU-kept module stays."""
    from glm53.devices import DeviceShare
    from glm53.spec import engine_spec

    loads: dict[str, torch.device] = {}

    class Mod:
        def __init__(self, key):
            self.key = key

        def load(self, device, **kw):
            loads[self.key] = torch.device(device)

    keys = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(6)), "model.norm", "lm_head"]
    model = SimpleNamespace(modules=[Mod(k) for k in keys])
    shares = (DeviceShare(0, "a", 1, 0, 2, 0, 2, 4), DeviceShare(1, "b", 1, 3, 5, 2, 3, 6))
    spec = engine_spec("exact", moe_layers=5, experts_per_layer=8, top_k=2, vram_slots=2, kv_tokens=1024,
                       device="cuda:0", devices=shares)
    undo = A.place_layers(model, spec)
    for m in model.modules:
        m.load(torch.device("cuda:0"))
    model.modules[0].load(torch.device("cpu"))  # exllamav3 keeps an unquantized embedding on the CPU
    undo()
    assert {k: str(d) for k, d in loads.items()} == {
        "model.embed_tokens": "cpu", "model.layers.0": "cuda:0", "model.layers.1": "cuda:0",
        "model.layers.2": "cuda:0", "model.layers.3": "cuda:1", "model.layers.4": "cuda:1",
        "model.layers.5": "cuda:1", "model.norm": "cuda:1", "lm_head": "cuda:1"}
    assert all("load" not in vars(m) for m in model.modules)  # undone
    one = engine_spec("exact", moe_layers=5, experts_per_layer=8, top_k=2, vram_slots=2, kv_tokens=1024)
    A.place_layers(model, one)()
    assert all("load" not in vars(m) for m in model.modules)  # no shares: nothing wrapped
