"""Start-up: the tiers filled from saved routing statistics, at the disk's rate rather than one read's latency.

VRAM gets each layer's most-picked experts, read ahead through a few bounce rows (`_ReadAhead`, the loader that
ExpertTiers.populate calls in order); RAM the next best across layers, read into their slots through the tier's own
read queue, several in flight.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import numpy as np
import torch

from store.directio import alloc_slots
from store.errors import StoreReadError
from store.reader import Priority

from .policy import hot_order
from .states import Where

if TYPE_CHECKING:
    from .nvme import NvmeTier, _Read


def warm(tier: NvmeTier, counts: np.ndarray | None, depth: int = 16) -> dict:
    """Place experts from saved routing statistics: each layer's most-picked in VRAM, the next best across
    layers in RAM (only experts that were picked at all: without statistics RAM fills by demand). VRAM loads
    read ahead through a few bounce rows; RAM reads land in their slots, `depth` in flight (a deeper queue would
    only make its tail look stalled). A record that cannot be read is left in the store and kept as a fault;
    start-up goes on."""
    t0 = time.perf_counter()
    counts = None if counts is None else np.asarray(counts, np.float64)
    zeros = np.zeros((tier.num_layers, tier.num_experts))
    vram_order = [(layer, int(e)) for layer, vl in enumerate(tier.tiers.vram)
                  for e in hot_order((zeros if counts is None else counts)[layer])[: vl.num_slots]]
    ahead = _ReadAhead(tier, vram_order, depth=depth)
    try:
        tier.tiers.populate(ahead, counts, fill_ram=False)
    finally:
        ahead.close()
    ram_order = [] if counts is None else [k for k in tier.tiers.warm_ram_order(counts) if counts[k] > 0]
    issued = ram_order[: tier.tiers.ram.free_count()]
    queue: deque[_Read] = deque()
    for i, (layer, e) in enumerate(issued):
        queue.append(tier._issue(layer, e, None, Priority.PREFETCH, demanded=False, may_wait=False,
                                 kind="warm_reads"))
        while queue and (len(queue) >= depth or i == len(issued) - 1):
            r = queue.popleft()
            if tier._reads.get((r.layer, r.expert)) is r:  # not landed by a poll meanwhile
                tier._await(r, None)
    landed = sum(tier.tiers.where[k] == Where.RAM for k in issued)
    return {"vram": len(vram_order), "ram": int(landed), "failed": len(issued) - int(landed),
            "seconds": round(time.perf_counter() - t0, 3)}


class _ReadAhead:
    """A `populate` loader that keeps `depth` reads of the expected order in flight through bounce rows, so the
    VRAM warm-up runs at the disk's rate rather than one record's latency at a time."""

    def __init__(self, tier: NvmeTier, order: list[tuple[int, int]], depth: int):
        self.tier = tier
        self.todo = deque(order)
        self.rows = alloc_slots(max(1, min(depth, len(order))), tier.stride) if order else None
        self.free = list(range(0 if self.rows is None else len(self.rows)))
        self.inflight: deque[tuple[tuple[int, int], int, Future]] = deque()
        self._fill()

    def _fill(self) -> None:
        while self.free and self.todo:
            layer, e = self.todo.popleft()
            row = self.free.pop()
            fut = self.tier.reader.read(self.tier.store_layers[layer], e, self.rows[row], priority=Priority.DEMAND)
            self.inflight.append(((layer, e), row, fut))

    def __call__(self, layer: int, e: int, out: torch.Tensor) -> None:
        if not self.inflight or self.inflight[0][0] != (layer, e):
            self.tier._read_sync(layer, e, out)  # not the expected order: correct, just not read ahead
            return
        _, row, fut = self.inflight.popleft()
        try:
            done = fut.result(self.tier.timeout_s * 4)
        except FutureTimeout:
            raise StoreReadError(f"store {self.tier.path}: {self.tier._where((layer, e))}: no data after "
                                 f"{self.tier.timeout_s * 4:g} s (the disk is stalled or failing)",
                                 self.tier._fix()) from None
        out.copy_(torch.from_numpy(done.data[: self.tier.layout.nbytes]))
        self.free.append(row)
        self._fill()

    def close(self) -> None:
        # Reads still running keep their row's mapping alive (the reader holds the array), so no waiting here.
        for _, _, fut in self.inflight:
            fut.cancel()
        self.inflight.clear()
        self.rows = None
