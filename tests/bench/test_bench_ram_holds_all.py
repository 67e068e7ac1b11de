"""bench decode's nvme modes with a RAM tier that holds every expert outside VRAM start with all of them in RAM
(the gate's measure: nvme-exact with no store reads), and with less start cold, as before."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from nvme_support import make_store, nvme_spec

from glm53.bench.decode import ram_holds_all


def test_a_ram_tier_for_every_expert_outside_vram_is_warmed_with_all_of_them(tmp_path):
    ck, store = make_store(tmp_path, layers=3, experts=16)  # 2 MoE layers of 16
    spec = nvme_spec(store, ram_records=32 - 4, vram_slots=[2, 2], mode="nvme-exact")
    counts = ram_holds_all(ck, spec)
    assert counts is not None and counts.shape == (2, 16) and (counts > 0).all()
    assert ram_holds_all(ck, replace(spec, ram_slots=27)) is None, "one row short: warmed by demand, as before"
    assert ram_holds_all(ck, replace(spec, engine="exact")) is None, "the all-RAM modes load every expert anyway"


def test_the_warm_fills_ram_with_every_expert_outside_vram(tmp_path):
    from glm53.tiers.nvme_open import open_nvme_tier
    from glm53.tiers.states import Where

    ck, store = make_store(tmp_path, layers=3, experts=16)
    spec = nvme_spec(store, ram_records=32 - 4 + 4, vram_slots=[2, 2], mode="nvme-exact")
    with open_nvme_tier(store, ck, spec, warm=False) as tier:
        tier.warm(ram_holds_all(ck, spec))
        where = tier.tiers.where
        assert not np.isin(where, [Where.STORE, Where.FROM_STORE]).any(), "an expert left to its first read"
