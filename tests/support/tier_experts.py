"""Small fp16 SwiGLU experts for the tier and step tests: their slot layout, random images, routings, tiers over
them, and the check that every readable expert's bytes are its own."""

from __future__ import annotations

import numpy as np
import torch

from glm53.tiers import ExpertTiers, SlotLayout, Where

HIDDEN, INTER, LIMIT = 16, 8, 10.0
LAYOUT = SlotLayout.packed([("gate", torch.float16, (HIDDEN, INTER)), ("up", torch.float16, (HIDDEN, INTER)),
                            ("down", torch.float16, (INTER, HIDDEN))], align=64)


def swiglu(slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A SwiGLU expert whose fp16 weights are decoded from the slot image, clamped like GLM-5.3 (swiglu_limit)."""
    w = LAYOUT.views(slot.to(x.device))  # the CPU-lane stand-in: host bytes computed where x is
    gate = torch.nn.functional.silu(x @ w["gate"].float()).clamp(max=LIMIT)
    up = (x @ w["up"].float()).clamp(-LIMIT, LIMIT)
    return (gate * up) @ w["down"].float()


def make_experts(num_layers: int, num_experts: int, seed: int) -> torch.Tensor:
    """(layers, experts, nbytes) slot images with finite random fp16 weights (random bytes would make NaNs)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros((num_layers, num_experts, LAYOUT.nbytes), dtype=torch.uint8)
    for layer in range(num_layers):
        for e in range(num_experts):
            for t in LAYOUT.views(out[layer, e]).values():
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
    return out


def route(rng: np.random.Generator, tokens: int, num_experts: int, top_k: int, skew: float = 1.0):
    """Distinct top-k ids per token from a skewed popularity, and positive weights."""
    p = np.arange(1, num_experts + 1, dtype=np.float64) ** -skew
    p /= p.sum()
    ids = np.stack([rng.choice(num_experts, top_k, replace=False, p=p) for _ in range(tokens)])
    weights = torch.from_numpy(rng.random((tokens, top_k))).float()
    return ids, weights


def build(experts: torch.Tensor, vram: list[int], keep_all: bool, ram_slots: int | None = None, **kw) -> ExpertTiers:
    num_layers, num_experts, _ = experts.shape
    if ram_slots is None:
        ram_slots = num_layers * num_experts - sum(vram) + 1
    tiers = ExpertTiers(LAYOUT, num_experts, vram, ram_slots, keep_all=keep_all,
                        fetch=lambda lay, e, out: out.copy_(experts[lay, e]), **kw)
    return tiers


def check_contents(tiers: ExpertTiers, experts: torch.Tensor) -> None:
    """Every readable expert's bytes equal the source; every router-map entry points at its own bytes."""
    for layer in range(tiers.num_layers):
        for e in range(tiers.num_experts):
            if tiers.where[layer, e] in (Where.VRAM, Where.RAM, Where.TO_VRAM):
                assert torch.equal(tiers.bytes_of(layer, e).cpu(), experts[layer, e]), f"{layer}/{e} corrupt"
        vl = tiers.vram[layer]
        for e, slot in enumerate(vl.router_map.tolist()):
            if slot != vl.absent:
                assert torch.equal(vl.flat(slot).cpu(), experts[layer, e]), f"router map sends {layer}/{e} elsewhere"
