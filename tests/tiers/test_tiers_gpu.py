"""The tier machinery on a real CUDA device: asynchronous landing, copy/compute ordering, copy-engine throughput.

Run on the GPU machine: pytest -m gpu tests/tiers/test_tiers_gpu.py -s
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from step_layer import random_steps

from glm53.tiers import Copier, ExpertTiers, Where, exl3_expert_layout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("seed", range(6))
def test_tiered_equals_direct_on_cuda(seed: int) -> None:
    random_steps(seed, "cuda")


@functools.cache
def source(num_experts: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (num_experts, nbytes), dtype=torch.uint8, generator=g).pin_memory()


def full_width(num_experts: int, slots: int, copier: Copier | None = None) -> tuple[ExpertTiers, torch.Tensor]:
    """One layer of real-size (9 MiB) EXL3 expert slots; each expert's bytes are a distinct pattern."""
    layout = exl3_expert_layout()
    src = source(num_experts, layout.nbytes)
    tiers = ExpertTiers(layout, num_experts, [slots], num_experts - slots + 8, device="cuda", copier=copier)
    assert tiers.ram.storage.is_pinned()
    tiers.populate(lambda lay, e, out: out.copy_(src[e]))
    return tiers, src


class OneStreamCopier(Copier):
    """The single-copy-stream design, for comparison: write-backs queue behind fills and vice versa."""

    def __init__(self, device):
        super().__init__(device)
        self._write_back = self._fill


def swap_rate(copier: Copier) -> float:
    """GiB/s of experts swapped (one fill in, one write-back out each) with up to 8 swaps in flight."""
    tiers, src = full_width(64, 16, copier)
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
    for newcomer in range(24, 64):  # 40 more, cycling the slots; RAM's 8 spares bound the flight
        victim = int(vl.owner[newcomer % 16])
        tiers.settle(0, victim)  # the slot's owner may itself still be landing from the previous cycle
        tiers.admit(0, newcomer, victim)
    tiers.settle_all()
    dt = time.perf_counter() - t0
    tiers.check_invariants()
    for e in range(64):  # every expert intact, wherever it ended up
        assert torch.equal(tiers.bytes_of(0, e).cpu(), src[e])
    return tiers.stats.snapshot()["admissions"] * tiers.layout.nbytes / 2**30 / dt


def test_swaps_land_asynchronously_and_overlap() -> None:
    rates = {}
    for _ in range(2):  # interleaved A/B, best of two each
        for name, cls in (("one stream", OneStreamCopier), ("two streams", Copier)):
            rates[name] = max(rates.get(name, 0.0), swap_rate(cls("cuda")))
    print("\nexpert swaps (9.04 MiB fill + write-back each): "
          + ", ".join(f"{k} {v:.1f} GiB/s each way" for k, v in rates.items()))


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


def test_a_batch_of_copies_lands_in_order_after_queued_compute() -> None:
    """copy_many from pinned host rows into device rows, in one call into torch: the bytes land,
    after the compute already queued that reads the destination, and the ticket covers them all."""
    copier = Copier("cuda")
    src = torch.randint(0, 255, (6, 1 << 20), dtype=torch.uint8).pin_memory()
    dst = torch.zeros((6, 1 << 20), dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(100_000_000)
    before = dst[0].sum(dtype=torch.int64)  # queued on the compute stream ahead of the copies: must read zeros
    ticket = copier.copy_many([(dst[i], src[i]) for i in range(6)])
    ticket.wait()
    assert before.item() == 0
    assert torch.equal(dst.cpu(), src)
