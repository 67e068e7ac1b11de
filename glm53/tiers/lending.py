"""Lending: the staging rows a step streams its misses into, beyond its link's own rows borrowed cache slots.

A layer's staging ids cover a whole layer's experts (exact prefill stages every pick), but only a decode step's
worth are device rows of their own; the others are cache slots of other layers on the same link
(glm53.spec.borrowed_rows), built into exllamav3's slot Linears at install like every slot. A step that stages
past its own rows borrows them (ExpertTiers.borrow empties them first); they stay lent, so that no admission
queued before the step's kernels lands in them, until the borrowing steps' kernels are queued (`give_back`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .links import Link
from .vram import VramLayer


class Lending:
    def __init__(self, lent: Sequence[tuple[int, int]], spare: int, own_rows: int, link_of: Sequence[int],
                 links: Sequence[Link], vram: Sequence[VramLayer]):
        """lent: every (layer, slot) lent to staging (borrowed_rows); spare: the staging rows of each layer that are
        borrowed slots; own_rows: the rows each link has of its own."""
        self.lent = list(lent)
        self.own_rows = own_rows
        self._vram = vram
        # Each layer's borrowed cache slots (of other layers on its link), as (layer, slot), and its staging rows:
        # its link's own, then those slots' rows.
        self.borrowed = [[(lay, slot) for lay, slot in self.lent if lay != li and link_of[lay] == link_of[li]][:spare]
                         for li in range(len(vram))]
        self._rows = [links[link_of[li]].rows + [vram[lay].flat(slot) for lay, slot in b]
                      for li, b in enumerate(self.borrowed)]
        self.lent_now: list[tuple[int, int]] = []  # lent by the steps whose kernels may not be queued yet

    def row(self, layer: int, i: int) -> torch.Tensor:
        return self._rows[layer][i]

    def to_borrow(self, layer: int, n: int) -> list[tuple[int, int]]:
        """The borrowed (layer, slot)s among the layer's first n staging rows."""
        return self.borrowed[layer][: max(0, n - self.own_rows)]

    def lend(self, layer: int, slot: int) -> None:
        """The (emptied) slot serves as a staging row until `give_back`."""
        self._vram[layer].lend(slot)
        self.lent_now.append((layer, slot))

    def give_back(self) -> None:
        if self.lent_now:
            for lay, slot in self.lent_now:
                self._vram[lay].give_back(slot)
            self.lent_now.clear()
