"""The VRAM slot arena of one MoE layer, and its router-id -> slot map.

S slots are allocated once as one (S, nbytes) uint8 tensor on the device; a slot's field views are made
once and never replaced, because exllamav3 bakes slot pointers into device tables and graphs. The router map
is an int32 device tensor of num_experts entries, updated in place: the slot of a landed resident, or
`absent` (>= S: exllamav3 makes such ids contribute exact zeros) for everything else. The decode seam
translates ids to slots on the host (glm53.step.stepper), so nothing reads the device map on the hot path:
it is brought up to date when `router_map` is read, in one copy, instead of one device write per land or
release (each a kernel launch on CUDA, on the host's critical path of every layer step).

This class is bookkeeping only: it never copies. ExpertTiers issues the copies and calls `land` when the
copy's ticket says the bytes are there; that is the only way an expert becomes visible in the router map.
"""

from __future__ import annotations

import numpy as np
import torch

from .layout import SlotLayout

FREE, LENT = -1, -2  # owner values besides an expert id: a free slot, one lent to staging (VramLayer.lend)


class VramLayer:
    def __init__(
        self,
        layout: SlotLayout,
        num_experts: int,
        num_slots: int,
        device: torch.device | str = "cpu",
        storage: torch.Tensor | None = None,
        absent: int | None = None,
    ):
        """storage: an existing (num_slots, nbytes) uint8 tensor to adopt (e.g. one whose rows the engine made
        exllamav3's slot tensors view into); else one is allocated. absent: the router-map value of a
        non-resident expert, -1 or >= num_slots (default num_slots)."""
        if not 0 <= num_slots <= num_experts:
            raise ValueError(f"num_slots {num_slots} outside [0, {num_experts}]")
        self.layout = layout
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.device = torch.device(device)
        if storage is None:
            storage = torch.empty((num_slots, layout.nbytes), dtype=torch.uint8, device=self.device)
        elif storage.shape != (num_slots, layout.nbytes) or storage.dtype != torch.uint8 or not storage.is_contiguous():
            raise ValueError(f"storage must be contiguous uint8 ({num_slots}, {layout.nbytes}), got {tuple(storage.shape)}")
        self.storage = storage
        self.absent = num_slots if absent is None else absent
        if not (self.absent == -1 or self.absent >= num_slots):
            raise ValueError(f"absent marker {self.absent} would alias slot {self.absent}")
        self._router_map = torch.full((num_experts,), self.absent, dtype=torch.int32, device=self.device)
        self._map_stale = False
        # Host mirrors, so lookups never read the device map (a sync per read on CUDA).
        self.slot_of = np.full(num_experts, -1, np.int32)  # landed residents only
        self.owner = np.full(num_slots, -1, np.int32)  # expert whose bytes the slot holds or is receiving
        self.pending = np.zeros(num_slots, bool)  # owner's bytes still in flight: not in the router map yet
        self._held = np.full(num_experts, -1, np.int32)  # owner's inverse: the slot an expert holds or receives
        self._used = 0  # owned slots: a counter, since the gauges ask on every move
        self._flat = [storage[s] for s in range(num_slots)]
        self._views = [layout.views(f) for f in self._flat]

    def flat(self, slot: int) -> torch.Tensor:
        return self._flat[slot]

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        return self._views[slot]

    @property
    def router_map(self) -> torch.Tensor:
        """The device map id -> slot (int32, in place: same tensor for the life of the layer), current as of now."""
        if self._map_stale:
            host = np.where(self.slot_of >= 0, self.slot_of, self.absent).astype(np.int32)
            self._router_map.copy_(torch.from_numpy(host))
            self._map_stale = False
        return self._router_map

    def resident(self) -> np.ndarray:
        """bool (num_experts,): landed residents."""
        return self.slot_of >= 0

    def free_slots(self) -> np.ndarray:
        return np.flatnonzero(self.owner == FREE)

    def free_count(self) -> int:
        return self.num_slots - self._used

    def first_free(self) -> int:
        """The lowest free slot (call only when free_count() > 0)."""
        return int(np.argmax(self.owner == FREE))

    def in_use(self) -> int:
        return self._used

    def reserve(self, slot: int, expert: int) -> None:
        """Claim a free slot for `expert` whose bytes are about to be copied in. Not visible to the router."""
        if self.owner[slot] != FREE:
            raise RuntimeError(f"slot {slot} is " + ("lent to staging" if self.owner[slot] == LENT else
                                                     f"owned by expert {self.owner[slot]}"))
        if self._held[expert] >= 0:
            raise RuntimeError(f"expert {expert} already has a slot")
        self.owner[slot] = expert
        self.pending[slot] = True
        self._held[expert] = slot
        self._used += 1

    def lend(self, slot: int) -> None:
        """A free slot serves as another layer's staging row until `give_back`: nothing is admitted into it (an
        admission's copy is queued before the borrowing step's kernels, which still read the slot)."""
        if self.owner[slot] != FREE:
            raise RuntimeError(f"slot {slot} is not free to lend (owner {self.owner[slot]})")
        self.owner[slot] = LENT
        self._used += 1

    def give_back(self, slot: int) -> None:
        if self.owner[slot] != LENT:
            raise RuntimeError(f"slot {slot} is not lent")
        self.owner[slot] = FREE
        self._used -= 1

    def land(self, slot: int) -> int:
        """The bytes of the slot's owner have landed: make it resident (and, from now on, in the router map)."""
        expert = int(self.owner[slot])
        if expert < 0 or not self.pending[slot]:
            raise RuntimeError(f"slot {slot} has no copy in flight")
        self.pending[slot] = False
        self.slot_of[expert] = slot
        self._map_stale = True
        return expert

    def release(self, expert: int) -> int:
        """Unmap a landed resident and free its slot; returns the slot.

        The slot's bytes stay intact for the write-back issued next (ExpertTiers makes the slot's next fill wait
        for it), and no later translation selects it: slot_of (and the router map, when read) no longer names it.
        """
        slot = int(self.slot_of[expert])
        if slot < 0:
            raise RuntimeError(f"expert {expert} is not resident")
        self._map_stale = True
        self.slot_of[expert] = -1
        self.owner[slot] = FREE
        self._held[expert] = -1
        self._used -= 1
        return slot

    def check_invariants(self) -> None:
        owned = self.owner[self.owner >= 0]
        assert len(set(owned.tolist())) == owned.size, "an expert owns two slots"
        for slot in range(self.num_slots):
            e = int(self.owner[slot])
            if e >= 0 and not self.pending[slot]:
                assert self.slot_of[e] == slot, f"landed slot {slot} of expert {e} missing from slot_of"
            else:
                assert e < 0 or self.slot_of[e] == -1, f"expert {e} resident before its bytes landed"
            assert e >= 0 or not self.pending[slot], f"free slot {slot} marked pending"
        for e in np.flatnonzero(self.slot_of >= 0):
            s = self.slot_of[e]
            assert self.owner[s] == e and not self.pending[s], f"slot_of[{e}]={s} disagrees with its slot"
        held = np.full(self.num_experts, -1, np.int32)
        held[owned] = np.flatnonzero(self.owner >= 0)
        assert np.array_equal(held, self._held), "the slot-holder index disagrees with the slots"
        assert self._used == owned.size + int((self.owner == LENT).sum()), "the slots-in-use count disagrees with the slots"
        expect = np.where(self.slot_of >= 0, self.slot_of, self.absent).astype(np.int32)
        actual = self.router_map.cpu().numpy()
        assert np.array_equal(actual, expect), "router map disagrees with the landed residents"
