"""A device share's copy path: its staging rows and copy streams, one per card of a layer split.

With the layers split across GPUs (glm53.planning.devices), each MoE layer's VRAM slots live on its card, and its misses
are copied over that card's PCIe link into that card's staging rows: every share has its own `Link` (a Copier
with its fill and write-back streams, and the staging arena), while the RAM tier (and the store) is one, shared
by all. One device is one link: the single-GPU tiers are the one-link case of the same code.

`moved` counts the bytes each link carried that had host memory at one end (RAM to VRAM or staging, VRAM back
to RAM): what crossed that card's PCIe link, for the per-card traffic the engine reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .copier import Copier, Ticket
from .layout import SlotLayout


class Link:
    def __init__(self, layout: SlotLayout, device: torch.device | str, staging_slots: int,
                 copier: Copier | None = None):
        self.device = torch.device(device)
        self.copier = _Counting(copier or Copier(self.device), self)
        self.staging = torch.empty((staging_slots, layout.nbytes), dtype=torch.uint8, device=self.device)
        self.rows = list(self.staging)  # a row view per slot, made once: indexing a tensor is not free
        self.next = 0  # the staging row stage() hands out next
        self.moved = 0

    def take_row(self) -> torch.Tensor:
        """The next staging row, round robin (reused once the compute queued so far is done: the copier orders it)."""
        row = self.rows[self.next]
        self.next = (self.next + 1) % len(self.rows)
        return row


def _crossing(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return dst.device.type == "cpu" or src.device.type == "cpu"


class _Counting:
    """The link's Copier with its PCIe bytes counted; everything else is the Copier's own (tests inject copiers
    that defer or slow copies, and those keep working through this)."""

    __slots__ = ("inner", "link")

    def __init__(self, inner: Copier, link: Link):
        self.inner, self.link = inner, link

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Ticket | None = None) -> Ticket:
        if _crossing(dst, src):
            self.link.moved += dst.nbytes
        return self.inner.copy(dst, src, after=after)

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Ticket:
        self.link.moved += sum(d.nbytes for d, s in pairs if _crossing(d, s))
        return self.inner.copy_many(pairs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def link_plan(devices: Sequence[Any], moe_layers: int, device: str) -> tuple[list[str], list[int]]:
    """(each link's device, each MoE layer's link) for an EngineSpec's device shares (glm53.planning.devices.DeviceShare);
    no shares: one link on `device` for every layer. A spec on the CPU (the fake exllamav3 in CI) keeps every
    share on the CPU, each still with its own link."""
    if not devices:
        return [device], [0] * moe_layers
    from glm53.planning.devices import moe_share_of

    on = ["cpu"] * len(devices) if torch.device(device).type == "cpu" else [d.device for d in devices]
    return on, list(moe_share_of(devices, moe_layers))
