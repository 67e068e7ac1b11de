"""The RAM tier: one host arena of R expert slots shared by all layers.

Pinned (page-locked) when CUDA is available, so host->device copies run on the copy engines asynchronously
and the CPU lane computes on the same bytes in place. In the all-RAM modes (fast, exact) it holds every
expert not in VRAM plus a few spare slots for write-backs in flight; in the nvme modes it is a cache of the
store sized by the memory cap. Like VramLayer this is bookkeeping and storage; ExpertTiers moves bytes.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from .layout import SlotLayout


def pinned_empty(shape: tuple[int, ...], pin: bool) -> torch.Tensor:
    """A uint8 host tensor, page-locked when `pin`, costing exactly its size.

    torch's pinned allocator (pin_memory=True) rounds every block up to a power of two, so a 100 GiB arena
    would lock 128 GiB and blow the memory cap the plan sized it for. Instead allocate ordinary pages and
    register exactly those with the driver; the registration is undone when the tensor is freed.
    """
    t = torch.empty(shape, dtype=torch.uint8)
    if pin:
        pin_host(t)
    return t


def pin_host(t: torch.Tensor) -> None:
    """Page-lock an existing contiguous host tensor's bytes in place (e.g. the nvme tier's 4 KiB-aligned arena);
    the registration is undone when the tensor is freed."""
    if t.numel() == 0:
        return
    cudart = torch.cuda.cudart()
    nbytes = t.numel() * t.element_size()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise MemoryError(f"could not pin {nbytes / 2**30:.1f} GiB for the RAM tier (CUDA error {int(err)}): raise "
                          f"RLIMIT_MEMLOCK (docker run --ulimit memlock=-1) or lower the memory the plan may use")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())


RETIRED = -2  # owner of a slot that a timed-out store read may still write into: neither usable nor free


class RamTier:
    def __init__(self, layout: SlotLayout, num_layers: int, num_experts: int, num_slots: int, pin: bool | None = None,
                 storage: torch.Tensor | None = None):
        """storage: an existing (num_slots, stride >= layout.nbytes) uint8 host tensor to use as the arena (its
        rows may be padded, e.g. to the store's 4 KiB record extent); `pin` then says whether it is pinned."""
        self.layout = layout
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.num_slots = num_slots
        pin = torch.cuda.is_available() if pin is None else pin
        self.pinned = pin
        if storage is None:
            storage = pinned_empty((num_slots, layout.nbytes), pin)
        elif (storage.dtype != torch.uint8 or storage.dim() != 2 or storage.shape[0] != num_slots
              or storage.shape[1] < layout.nbytes or storage.stride(1) != 1):
            raise ValueError(f"RAM storage must be uint8 ({num_slots}, >= {layout.nbytes}) with contiguous rows, "
                             f"got {storage.dtype} {tuple(storage.shape)}")
        self.storage = storage
        self.slot_of = np.full((num_layers, num_experts), -1, np.int32)  # owned slot, landed or receiving
        self.owner = np.full(num_slots, -1, np.int64)  # layer * num_experts + expert, or -1
        self.pending = np.zeros(num_slots, bool)  # bytes still on their way in (write-back, store read)
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: low slots first, for reproducible layouts
        self._flat = [self.storage[r, : layout.nbytes] for r in range(num_slots)]

    def flat(self, slot: int) -> torch.Tensor:
        return self._flat[slot]

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        return self.layout.views(self._flat[slot])

    def free_count(self) -> int:
        return len(self._free)

    def in_use(self) -> int:
        return self.num_slots - len(self._free)

    def holds(self, layer: int, expert: int) -> bool:
        """True when the expert's bytes are in the arena and readable (no write-back in flight)."""
        r = self.slot_of[layer, expert]
        return r >= 0 and not self.pending[r]

    def alloc(self, layer: int, expert: int, pending: bool) -> int:
        """Give (layer, expert) a free slot; `pending` while bytes are still on their way into it."""
        if not self._free:
            raise RuntimeError("RAM tier has no free slot")
        if self.slot_of[layer, expert] >= 0:
            raise RuntimeError(f"expert {layer}/{expert} already has RAM slot {self.slot_of[layer, expert]}")
        r = self._free.pop()
        self.slot_of[layer, expert] = r
        self.owner[r] = layer * self.num_experts + expert
        self.pending[r] = pending
        return r

    def land(self, slot: int) -> None:
        if self.owner[slot] < 0 or not self.pending[slot]:
            raise RuntimeError(f"RAM slot {slot} has no write-back in flight")
        self.pending[slot] = False

    def retire(self, layer: int, expert: int) -> int:
        """Take the expert's slot away from it without freeing the slot: a read that may still write into it was
        given up on. The slot is neither usable nor free until `reclaim`."""
        r = int(self.slot_of[layer, expert])
        if r < 0:
            raise RuntimeError(f"expert {layer}/{expert} has no RAM slot")
        self.slot_of[layer, expert] = -1
        self.owner[r] = RETIRED
        self.pending[r] = False
        return r

    def reclaim(self, slot: int) -> None:
        if self.owner[slot] != RETIRED:
            raise RuntimeError(f"RAM slot {slot} is not retired")
        self.owner[slot] = -1
        self._free.append(slot)

    def retired(self) -> int:
        return int((self.owner == RETIRED).sum())

    def free(self, layer: int, expert: int) -> int:
        r = int(self.slot_of[layer, expert])
        if r < 0:
            raise RuntimeError(f"expert {layer}/{expert} has no RAM slot")
        self.slot_of[layer, expert] = -1
        self.owner[r] = -1
        self.pending[r] = False
        self._free.append(r)
        return r

    def check_invariants(self) -> None:
        owned = np.flatnonzero(self.owner >= 0)
        retired = np.flatnonzero(self.owner == RETIRED)
        assert len(owned) + len(retired) + len(self._free) == self.num_slots, "RAM slots leaked or double-freed"
        assert not set(owned.tolist()) & set(self._free), "a RAM slot is both owned and free"
        assert not set(retired.tolist()) & set(self._free), "a retired RAM slot is on the free list"
        assert not self.pending[retired].any(), "a retired RAM slot is marked pending"
        keys = self.owner[owned]
        assert len(set(keys.tolist())) == keys.size, "an expert owns two RAM slots"
        for r, key in zip(owned, keys, strict=True):
            layer, expert = divmod(int(key), self.num_experts)
            assert self.slot_of[layer, expert] == r, f"RAM slot {r} disagrees with slot_of"
        assert int((self.slot_of >= 0).sum()) == owned.size, "slot_of names a slot its owner does not hold"
        assert not self.pending[self.owner == -1].any(), "a free RAM slot is marked pending"
