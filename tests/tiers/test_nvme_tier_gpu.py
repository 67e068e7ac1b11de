"""The nvme tier with real VRAM (GPU machine: pytest -m gpu): the 4 KiB-aligned arena is pinned in place, store reads
land in it, misses stream over PCIe into staging and admissions copy from there on the device, write-backs cross
PCIe on the copy streams, and every output of the real step (nvme=the tier) equals the direct one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nvme_support import HIDDEN, Direct, check_bytes, make_store, nvme_spec, route, slot_forward
from step_layer import step_layer, stepper_for

from glm53.tiers import Where
from glm53.tiers.nvme_open import open_nvme_tier

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
EXPERTS = 16


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("nvme-gpu"), layers=3, experts=EXPERTS)


def test_pinned_arena_and_vram_equal_direct(packed):
    ck, store = packed
    direct = Direct(ck)
    rng = np.random.default_rng(0)
    with open_nvme_tier(store, ck, nvme_spec(store, EXPERTS + 4, 8, device="cuda", staging_slots=EXPERTS)) as tier:
        t = tier.tiers
        assert t.ram.pinned and t.ram.flat(0).is_pinned() and t.ram.storage.is_pinned()
        assert t.vram[0].storage.is_cuda
        forward = slot_forward(tier.layout)
        stepper = stepper_for(t, EXPERTS, nvme=tier)
        for step in range(40):
            layer = step % 2
            ids, w = route(rng, int(rng.integers(1, 4)), EXPERTS, 4)
            x = torch.from_numpy(rng.standard_normal((len(ids), HIDDEN)).astype(np.float32))
            got, _ = step_layer(t, stepper, layer, x.cuda(), ids, w.cuda(), forward)
            assert torch.equal(got.cpu(), direct.moe(tier.store_layers[layer], x, ids, w))
            tier.prefetch([(1 - layer, int(e)) for e in rng.choice(EXPERTS, 4, replace=False)])
            tier.check_invariants()
        t.settle_all()
        tier.poll()
        snap = tier.stats.snapshot()
        assert snap["admissions"] > 0 and snap["evictions"] > 0 and snap["picks"]["nvme"] > 0
        assert (t.where == Where.VRAM).sum() == 8
        check_bytes(tier, store)
