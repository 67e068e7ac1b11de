"""The Copier's batch of copies on the CPU (the CUDA paths: tests/tiers/test_tiers_gpu.py)."""

from __future__ import annotations

import torch

from glm53.tiers.copier import DONE, Copier


def test_copy_many_copies_every_pair_in_one_call_into_torch(monkeypatch):
    calls = []
    real = torch._foreach_copy_

    def counting(dsts, srcs, **kw):
        calls.append(len(dsts))
        return real(dsts, srcs, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    copier = Copier("cpu")
    src = torch.randint(0, 255, (5, 4096), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    assert copier.copy_many([(dst[i], src[i]) for i in range(5)]) is DONE
    assert torch.equal(dst, src)
    assert calls == [5]
    assert copier.copy_many([(dst[0], src[1])]) is DONE and torch.equal(dst[0], src[1])  # one pair: plain copy_
    assert calls == [5]
    assert copier.copy_many([]) is DONE
