"""The tier machinery on a real CUDA device: asynchronous landing, copy/compute ordering, copy-engine throughput.

Run on the GPU machine: pytest -m gpu tests/test_tiers_gpu.py -s
"""

from __future__ import annotations

import time

import pytest
import torch
from test_tiers_layer import random_steps

from glm53.tiers import ExpertTiers, Where, exl3_expert_layout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("seed", range(6))
def test_tiered_equals_direct_on_cuda(seed: int) -> None:
    random_steps(seed, "cuda")


def full_width(num_experts: int, slots: int) -> tuple[ExpertTiers, torch.Tensor]:
    """One layer of real-size (9 MiB) EXL3 expert slots; each expert's bytes are a distinct pattern."""
    layout = exl3_expert_layout()
    src = torch.empty((num_experts, layout.nbytes), dtype=torch.uint8, pin_memory=True)
    for e in range(num_experts):
        src[e].copy_(torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(e)))
    tiers = ExpertTiers(layout, num_experts, [slots], num_experts - slots + 8, device="cuda")
    assert tiers.ram.storage.is_pinned()
    tiers.populate(lambda lay, e, out: out.copy_(src[e]))
    return tiers, src


def test_admission_lands_asynchronously_and_throughput() -> None:
    tiers, src = full_width(64, 16)
    vl = tiers.vram[0]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for newcomer in range(16, 24):  # 8 swaps in flight at once: no host wait between them
        victim = int(vl.owner[newcomer % 16])
        tiers.admit(0, newcomer, victim)
        assert vl.router_map[newcomer].item() == vl.absent  # never resident before its bytes landed
        assert tiers.where[0, newcomer] == Where.TO_VRAM and tiers.where[0, victim] == Where.TO_RAM
    tiers.settle_all()
    tiers.check_invariants()
    for newcomer in range(24, 56):  # 32 more, cycling the slots twice; RAM's 8 spares bound the flight
        victim = int(vl.owner[newcomer % 16])
        tiers.settle(0, victim)  # the slot's owner may itself still be landing from the previous cycle
        tiers.admit(0, newcomer, victim)
    tiers.settle_all()
    dt = time.perf_counter() - t0
    n = tiers.stats.snapshot()["admissions"]
    gib = n * tiers.layout.nbytes / 2**30
    print(f"\n{n} swaps of {tiers.layout.nbytes / 2**20:.2f} MiB in {dt * 1e3:.1f} ms: "
          f"{gib / dt:.1f} GiB/s each way (H2D fill + D2H write-back on one copy stream)")
    tiers.check_invariants()
    for e in range(64):  # every expert intact, wherever it ended up
        assert torch.equal(tiers.bytes_of(0, e).cpu(), src[e])


def test_refill_waits_for_queued_compute() -> None:
    """A slot refilled while a kernel that reads it is still queued: the kernel must see the old bytes."""
    tiers, src = full_width(24, 4)
    vl = tiers.vram[0]
    old = int(vl.owner[0])
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the read on the compute stream
    checksum = vl.flat(0).view(torch.int32).sum(dtype=torch.int64)  # queued, reads slot 0
    tiers.admit(0, 10, victim=old)  # overwrites slot 0 on the copy stream
    tiers.settle_all()
    assert checksum.item() == src[old].view(torch.int32).sum(dtype=torch.int64).item()
    assert torch.equal(vl.flat(0).cpu(), src[10])
    assert torch.equal(tiers.bytes_of(0, old).cpu(), src[old])  # the victim was written back intact
