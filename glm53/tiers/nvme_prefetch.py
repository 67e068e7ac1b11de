"""Guesses read ahead: predicted experts read from the store before their layer runs, and scored when it does.

The router lookahead predicts the next layer's picks, prefill's upcoming layers pick nearly all of theirs: those
only in the store are read at prefetch priority (demand reads overtake them in the reader's queue), guarded (dropped
last) until their layer runs, at most `window` outstanding. When the layer runs each guess is settled: a hit, late
(still being read: the share done counts as saved), or wasted; a wrong guess whose read is still queued is cancelled
unread. A prefetch never waits and never drops a guarded expert, one a lane reads now, or another of its picks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from store.reader import Priority

from .policy import hot_order
from .states import FROM_STORE, RAM, STORE, TO_VRAM, VRAM

if TYPE_CHECKING:
    from .nvme import NvmeTier

_READABLE = frozenset((VRAM, RAM, TO_VRAM))  # plain ints: compared for every pick of every layer step


class Prefetch:
    def __init__(self, tier: NvmeTier):
        self.tier = tier
        self.outstanding: set[tuple[int, int]] = set()  # read ahead, their layer has not run since

    def read(self, picks: Iterable[tuple[int, int]], *, protect: Mapping[int, Iterable[int]] | None = None,
             window: int | None = None) -> int:
        """Read predicted (layer, expert) picks ahead, in the given order (most likely first); returns the number of
        reads started. Only experts in the store alone are read; a prefetch never waits, never drops a guarded
        expert, one in `protect` ({layer: experts a lane is reading now}) or another of these picks, and stops
        when `window` prefetched experts are outstanding or RAM has nothing it may drop."""
        self.tier.poll()
        window = self.tier.window if window is None else window
        picks = picks if isinstance(picks, list) else list(picks)
        self._prune()
        where, ram = self.tier.tiers.where, self.tier.tiers.ram
        keep: dict[int, set[int]] | None = None  # made when RAM is first found full: most calls never need it
        started = 0
        for layer, e in picks:
            if where[layer, e] != STORE:
                continue
            layer, e = int(layer), int(e)  # plain ints from here (numpy ones would reach the reads and /stats)
            if len(self.outstanding) >= window:
                break
            if not ram.free_count():
                if keep is None:
                    keep = self._keep(picks, protect)
                if not self._room_without_waiting(keep):
                    break
            self.tier._issue(layer, e, None, Priority.PREFETCH, demanded=False, may_wait=False)
            self.tier.tiers.guard(layer, e)
            self.outstanding.add((layer, e))
            started += 1
        if started:
            self.tier.stats.add_prefetch(issued=started)
        return started

    @staticmethod
    def _keep(picks: list[tuple[int, int]], protect: Mapping[int, Iterable[int]] | None) -> dict[int, set[int]]:
        """{layer: experts} a prefetch may not drop: its own picks and `protect`."""
        # Only looked up (a numpy integer finds the equal int): no conversions, and no set made per pick.
        keep: dict[int, set[int]] = {}
        for layer, e in picks:
            mine = keep.get(layer)
            if mine is None:
                mine = keep[layer] = set()
            mine.add(e)
        for layer, es in (protect or {}).items():
            mine = keep.get(layer)
            if mine is None:
                keep[layer] = set(es)
            else:
                mine.update(es)
        return keep

    def read_prefill(self, layers: Sequence[int], picks: Mapping[int, Iterable[int]] | None = None, *,
                     protect: Mapping[int, Iterable[int]] | None = None, window: int | None = None) -> int:
        """Prefill's upcoming layers, nearest first: the experts `picks` names per layer (the router run ahead on
        the prompt), else every expert of the layer (a long prompt picks nearly all), most popular first.
        window defaults to one layer's experts: prefill reads drop the weakest RAM experts, which after the first
        layer are mostly prefill's own earlier reads (prefill does not raise scores), never the decode hot set
        first."""
        window = self.tier.num_experts if window is None else window
        order = []
        for layer in layers:
            es = hot_order(self.tier.tiers.scores()[layer])
            if picks is not None and layer in picks:
                named = {int(e) for e in picks[layer]}
                es = [e for e in es if int(e) in named]
            order.extend((layer, int(e)) for e in es)
        return self.read(order, protect=protect, window=window)

    def _room_without_waiting(self, keep: dict[int, set[int]]) -> bool:
        """A free RAM slot, or one made by dropping the weakest RAM expert that is neither guarded nor kept."""
        t = self.tier.tiers
        if t.ram.free_count():
            return True
        victim = t.weakest_droppable(keep)
        if victim is None:  # none, or only ones scored +inf: the search over the full masks
            kept = np.zeros_like(t.ram_guard)
            for layer, es in keep.items():
                kept[layer, list(es)] = True
            ok = t.droppable() > (t.ram_guard | kept)  # droppable, neither guarded nor kept
            if not ok.any():
                return False
            victim = t.weakest(ok)
        t.drop_ram(*victim)
        return True

    def settle(self, layer: int, experts: list[int], codes: list[int], decode: bool = True) -> None:
        """The layer runs: settle what was read ahead for it (hit, late, wasted) and count the store misses no
        prefetch covered (codes: the experts' tier states). Its guards end here either way. decode: a decode step,
        whose right guesses' savings count towards guess_saving."""
        hits = late = under_way = wasted = cancelled = 0
        saved = 0.0
        mine = [k for k in self.outstanding if k[0] == layer] if self.outstanding else ()
        if mine:
            used = set(experts)
            where = self.tier.tiers.where[layer]
            for key in mine:
                self.outstanding.discard(key)
                e = key[1]
                w = int(where[e])
                if w == RAM or w == FROM_STORE:
                    self.tier.tiers.unguard(layer, e)
                if e not in used:
                    wasted += 1
                    if w == FROM_STORE:
                        cancelled += self._cancel_queued(key)
                elif w in _READABLE:
                    hits += 1
                elif w == FROM_STORE:
                    late += 1
                    fut = self.tier._reads[key].future if key in self.tier._reads else None
                    if fut is not None and fut.done():  # landed since demand's poll: in time after all, unless failed
                        saved += not fut.cancelled() and fut.exception() is None
                    elif fut is not None and fut.running():
                        under_way += 1
                        share = getattr(fut, "share_done", None)  # a test double's future may not say
                        saved += share() if share is not None else 0.5
        misses = codes.count(STORE)
        if decode:
            self.tier.meter.count_guesses(hits, saved, late)
        if hits or late or wasted or misses:  # most layer steps have nothing to count: no lock taken for it
            self.tier.stats.add_prefetch(hits=hits, late=late, late_under_way=under_way, wasted=wasted,
                                    demand_misses=misses)
        if cancelled:
            self.tier.stats.add_nvme("cancelled_prefetches", cancelled)

    def _cancel_queued(self, key: tuple[int, int]) -> int:
        """A wrong guess whose layer has run and whose read has not started: drop it from the reader's queue and
        free its RAM slot (a queued guess would still cost the disk a record). 1 if cancelled."""
        r = self.tier._reads.get(key)
        if r is None or r.demanded or not r.future.cancel():
            return 0
        with self.tier._lock:
            del self.tier._reads[key]
        self.tier.tiers.abort_read(*key)
        return 1

    def _prune(self) -> None:
        """Prefetched experts dropped again before their layer ran no longer count against the window."""
        where = self.tier.tiers.where
        gone = {k for k in self.outstanding if where[k] == STORE}
        if gone:
            self.outstanding -= gone
            self.tier.stats.add_prefetch(wasted=len(gone))
