"""Which GPU each part of the model lives on: the per-card shares of a layer split, as the plan decided them.

A `DeviceShare` is one card's contiguous run of decoder layers (with their always-used weights, KV cache and KDA
state), the MoE layers among them (as tier ordinals, the order glm53.tiers numbers them) and the expert slots
it holds. The plan (glm53.planning.split) makes them, the EngineSpec carries them (empty: one device, today's engine),
and the engine and the tiers read them through the helpers here. Torch-free, like glm53.planning.spec.

Two shares may name the same card: a split onto one GPU with two budgets runs the per-card bookkeeping (its own
slot arenas, staging and copy streams per share) where only one GPU exists, which is how it is tested.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceShare:
    index: int                # CUDA ordinal: the share runs on cuda:<index>
    name: str                 # the card's name, for messages
    vram_budget_bytes: int    # what the plan let this share use
    first_layer: int          # decoder layers first_layer..last_layer (inclusive) run here
    last_layer: int
    moe_first: int            # its MoE layers, as tier ordinals moe_first .. moe_first + moe_count - 1
    moe_count: int
    vram_slots: int           # routed-expert slots in this share's arenas, its MoE layers together

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "vram_budget_bytes": self.vram_budget_bytes,
                "layers": [self.first_layer, self.last_layer], "vram_slots": self.vram_slots,
                "moe_layers": [self.moe_first, self.moe_first + self.moe_count - 1] if self.moe_count else [],
                "device": self.device}


def check_shares(shares: Sequence[DeviceShare], layers: int | None, moe_layers: int,
                 vram_slots: Sequence[int] | None = None) -> None:
    """Raise ValueError unless the shares cover decoder layers 0..layers-1 (layers None: any count) and MoE
    ordinals 0..moe_layers-1 in order, without gaps or overlaps, and (given the per-MoE-layer slots) each share's
    slot count is its layers'."""
    if not shares:
        return
    layer, moe = 0, 0
    for s in shares:
        if s.first_layer != layer or s.last_layer < s.first_layer or s.moe_first != moe or s.moe_count < 0:
            raise ValueError(f"device shares must cover the decoder layers and MoE layers 0..{moe_layers - 1} "
                             f"in order without gaps: {[x.to_json() for x in shares]}")
        if vram_slots is not None and sum(vram_slots[s.moe_first:s.moe_first + s.moe_count]) != s.vram_slots:
            raise ValueError(f"share on {s.device} (layers {s.first_layer}-{s.last_layer}) holds {s.vram_slots} "
                             f"slots, its MoE layers {sum(vram_slots[s.moe_first:s.moe_first + s.moe_count])}")
        layer, moe = s.last_layer + 1, s.moe_first + s.moe_count
    if (layers is not None and layer != layers) or moe != moe_layers:
        raise ValueError(f"device shares end at layer {layer - 1} / MoE layer {moe - 1}, the model has {layers} "
                         f"layers and {moe_layers} MoE layers: the plan was made for another checkpoint")


def moe_share_of(shares: Sequence[DeviceShare], moe_layers: int) -> tuple[int, ...]:
    """For each MoE layer (tier ordinal), the index of the share it lives in (all 0 without shares)."""
    if not shares:
        return (0,) * moe_layers
    return tuple(i for i, s in enumerate(shares) for _ in range(s.moe_count))


def share_of_layer(shares: Sequence[DeviceShare], layer: int) -> int:
    """The share holding decoder layer `layer`; layers past the last (the MTP head) go with the last share."""
    for i, s in enumerate(shares):
        if layer <= s.last_layer:
            return i
    return len(shares) - 1


def even_shares(layers: int, moe_layer_ids: Sequence[int], vram_slots: Sequence[int], indices: Sequence[int],
                budget: int = 0, name: str = "") -> tuple[DeviceShare, ...]:
    """Shares splitting the MoE layers as evenly as whole layers allow over the CUDA ordinals `indices` (the same
    one repeated: a split onto one card), each MoE layer holding its `vram_slots`. For benchmarks and tests, which
    size by slots rather than by a host's VRAM: the plan's split is glm53.planning.split's."""
    moe, n = list(moe_layer_ids), len(indices)
    if len(moe) < n or len(vram_slots) != len(moe):
        raise ValueError(f"{len(moe)} MoE layers ({len(vram_slots)} slot counts) cannot be split {n} ways")
    bounds = [round(i * len(moe) / n) for i in range(n + 1)]  # the MoE ordinal each share starts at
    shares, first = [], 0
    for i, index in enumerate(indices):
        lo, hi = bounds[i], bounds[i + 1]
        last = layers - 1 if i == n - 1 else moe[hi] - 1
        shares.append(DeviceShare(index, name or f"share {i} of cuda:{index}", budget, first, last, lo, hi - lo,
                                  sum(vram_slots[lo:hi])))
        first = last + 1
    return tuple(shares)
