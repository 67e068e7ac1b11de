"""Holds: the RAM experts a copy in flight still reads.

A staging or prestaging copy the host did not wait for reads its source RAM rows until its ticket lands, so those
experts are neither dropped nor their rows handed to a store read before then. A hard rule, unlike the ranking's
guards (glm53.tiers.ranking), which only put an expert last in line. ExpertTiers keeps one Holds and asks it before
any RAM expert goes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .copier import Ticket


class Holds(dict[tuple[int, int], Ticket]):
    """(layer, expert) -> the ticket of the copy still reading it, oldest first (insertion order)."""

    def hold(self, layer: int, experts: int | Sequence[int], ticket: Ticket | None) -> None:
        """A copy (`ticket`) still reads these RAM experts' bytes. A copy that has landed holds nothing."""
        if ticket is None or ticket.done():
            return
        for e in [experts] if isinstance(experts, int) else experts:
            self[(layer, e)] = ticket

    def reads(self, layer: int, expert: int) -> bool:
        """Whether a copy in flight still reads the expert."""
        held = self.get((layer, expert))
        return held is not None and not held.done()

    def live(self) -> list[tuple[int, int]]:
        """The held experts whose copy is still in flight; forgets the others. Each ticket is asked once: a step's
        staged experts share one, and on the GPU each ask is an event query that also lets go of the GIL."""
        if not self:
            return []
        busy: dict[int, bool] = {}
        live, landed = [], []
        for key, ticket in self.items():
            b = busy.get(id(ticket))
            if b is None:
                b = busy[id(ticket)] = not ticket.done()
            (live if b else landed).append(key)
        for key in landed:
            del self[key]
        return live

    def wait_oldest(self) -> float:
        """Block until the oldest hold's copy lands, and forget that hold; returns the seconds waited."""
        key, ticket = next(iter(self.items()))
        t0 = time.perf_counter()
        ticket.wait()
        waited = time.perf_counter() - t0
        del self[key]
        return waited
