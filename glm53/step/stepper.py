"""The host side of one MoE layer step under exllamav3's expert kernels: where every pick's bytes are read from.

exllamav3 routes, then calls the seam (glm53.exl3.tiered) with the picks; the seam hands them
here (`MoeStepper.resolve`) and gets back a slot id per pick (glm53.step.slots); the lane's partial is added back at
the seam's combine, which first runs `after_launch`, the step's bookkeeping the kernels need not wait for.

A step reads top to bottom as `_decode_step` or `_prefill_step`: begin, make the picks' bytes readable (reads),
decide who computes each miss (lane), move the misses' bytes (copies), translate to slots.

  all-RAM modes (exact, fast): every expert not in VRAM is in the pinned RAM tier.
  nvme modes: RAM caches the record store; a step's store misses are all put in flight first (demand reads),
  then waited for one by one, so their reads overlap each other.
  fast / nvme: the planner (glm53.cpu_lane.planner) splits each decode step's RAM-resident misses between the
  CPU lane and PCIe; exact / nvme-exact send every miss over PCIe.
  lookahead: the adapter may hand in the next layer's router run on this layer's input; its store-only picks are
  read (nvme modes) and a few of its RAM-resident ones copied into staging (glm53.step.prestage) one layer ahead,
  so reads and copies overlap this layer's experts and the next layer's attention, and how many of them the next
  layer really picks is counted (recall). In the nvme modes a guess is read only at ranks right often enough for
  the store's load (see guess_floor); a layer is guessed for while the store works for it
  (glm53.step.ahead_gate) or the prestage's judge offers it (the caller asks `wants_ahead`); a step none of whose
  experts is in the store puts nothing in flight and settles only the guesses read ahead for it. The prestage's
  copies always go onto the copy stream behind the step's own: a guess made while a step's store reads are queued
  is copied once the step's copies are.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from glm53.planning.spec import FREE_RAM_SLOTS
from glm53.step.ahead_gate import AheadGate
from glm53.step.lane_judge import LaneJudge
from glm53.step.lookahead import Guesses, LazySets
from glm53.step.prestage import Prestage
from glm53.step.slots import NO_SLOTS, Resolution, StepError, decode_slots, translate
from glm53.step.timing import StepTimer

log = logging.getLogger(__name__)

# recompute(layer, expert, x_rows float32 (rows, hidden)) -> (rows, hidden): the exact path for a lane job it
# could not finish (deadline, dead worker).
Recompute = Callable[[int, int, np.ndarray], Any]
ReadAhead = Callable[[list[int]], Any]


class _Picks:
    """One step's picks as the step's parts read them: ids, their flat list, the distinct ids (sorted, as a list and
    as an array), the tier states of those, and which were read from the store."""

    __slots__ = ("li", "ids", "picks", "uniq_l", "uniq", "codes", "from_store")

    def __init__(self, li: int, ids: Any):
        self.li = li
        self.ids = np.asarray(ids)
        self.picks = self.ids.ravel().tolist()
        self.uniq_l = sorted(set(self.picks))
        self.uniq = np.array(self.uniq_l, np.int64)
        self.codes: list[int] = []
        self.from_store: set[int] = set()


class MoeStepper:
    """Decides, per layer step, which tier each pick is read from; owns no tensors of its own."""

    def __init__(self, tiers: Any, cache_slots: Sequence[int], staging_slots: int, *, admit: bool = True,
                 lane: Any = None, fit: Any = None, recompute: Recompute | None = None, nvme: Any = None,
                 lane_judge: LaneJudge | None = None, timer: StepTimer | None = None,
                 prestage: Prestage | None = None):
        """tiers: glm53.tiers.ExpertTiers (nvme modes: the NvmeTier's). cache_slots: S per layer. lane: a
        glm53.cpu_lane.CpuLane (fast / nvme modes) with `fit`, the planner's LiveFit, and `recompute`. nvme: the
        NvmeTier, for prefetch.
        A decode step streams every PCIe miss into staging, and its copies are ordered before the expert kernels on
        the GPU (a stream-side wait) instead of the host waiting for them (docs/results.md); the policy's learning
        and admissions run in `after_launch`, once exllamav3 has queued the step's kernels, each admitted expert
        copied on the device from the staging row it was just streamed into. The PCIe timings the planner refits
        from are then only the start-up ones.
        lane_judge: a glm53.step.lane_judge.LaneJudge (default: a new one on the wall clock), which decides from
        paired windows of decode steps whether offering the lane makes them faster. timer: the StepTimer the
        steps' host time goes through (default: a new one on the wall clock). prestage: a glm53.step.prestage.Prestage:
        the caller's guesses for the next layer (`ahead`) copy a few of its likely RAM-resident misses into
        reserved staging rows while the link would idle, as long as its judge finds steps faster (beside a lane it
        is judged first, the lane waiting, then between the lane judge's trials)."""
        if lane is not None and (fit is None or recompute is None):
            raise ValueError("a CPU lane needs the planner's cost model (fit) and the exact-path recompute")
        self.tiers = tiers
        self.cache_slots = [int(s) for s in cache_slots]
        self.staging_slots = int(staging_slots)
        self.admit = admit
        self.lane = lane
        self.fit = fit
        self.recompute = recompute
        self.nvme = nvme
        self.timer = StepTimer() if timer is None else timer
        self.host_seconds = self.timer.seconds
        # (layer, ids, uniq, pcie misses, staged, the next layers' reads held back or None, their busy experts)
        self._deferred: tuple | None = None  # awaiting after_launch
        self.num_experts = tiers.num_experts
        self._near = Guesses()
        self.lookahead = self._near.meter
        self.ahead_gate = AheadGate()  # nvme modes: which layers the lookahead runs for (wants_ahead)
        self.last_assignment: Any = None
        self.lane_judge = LaneJudge() if lane_judge is None else lane_judge
        self.prestage = prestage
        self._defer_prestage = False  # a guess made now is copied once the stepping layer's copies are queued
        self._queued_prestage: tuple[int, np.ndarray] | None = None
        self._prestage_timed = False  # the prestage's judge times the step under way
        self._lane_timed = False  # the lane's judge times it (not while the lane waits for the prestage's verdict)
        self._last_ticket: Any = None  # the last lane step's ticket, for the judge's late streak
        self.prefetched = 0  # reads (nvme) or prestage copies (all-RAM) started from a prediction
        self.lent_out = 0  # experts that left VRAM because a step borrowed their cache slot as staging
        self.copied_before_store_wait = 0  # RAM misses sent over PCIe while the step's store reads finished
        # nvme modes: a guess is read ahead only at ranks whose precision p beats the floor load / (1 + load), the
        # store's load being the share of time it is reading (NvmeTier.load). A wasted read costs a needed read its
        # time only when the store is busy (probability ~ load), and a right one saves about a read's wait: read
        # when p > (1 - p) * load. A disk that is the bottleneck (load ~1) reads at p > 0.5; a store that keeps up
        # reads nearly every guess.
        self.guess_floor = 0.5
        # The tier states as plain ints (an enum member lookup costs about a microsecond on the per-step path).
        from glm53.tiers.tiers import RAM, STORE, VRAM

        self._vram_code, self._ram_code, self._store_code = VRAM, RAM, STORE

    def lane_in_use(self) -> bool:
        """Whether the next decode step offers misses to the CPU lane (attached, alive, and offered by the judge)."""
        return self.lane is not None and self.lane.alive and not self._lane_waits() and self.lane_judge.offer()

    def _lane_waits(self) -> bool:
        """The lane waits, unjudged, for the prestage's first verdict: the lane is then judged against the step it
        would otherwise be (with the prestage where that pays), and the prestage against the plain step."""
        return self.prestage is not None and self.prestage.judge.trials == 0

    def wants_ahead(self, li: int) -> bool:
        """Whether the caller guesses layer li's picks for its coming decode step (the next layer's router run ahead,
        then `ahead`). nvme modes: while the guesses for the layer start store reads or its steps read from the
        store, and now and then to probe (AheadGate); with every expert the layer picks in RAM or VRAM the router
        run and its bookkeeping would only delay the GPU. Every mode: also while the prestage runs and its judge
        offers it. Asked once per decode step of the layer before it."""
        store = self.nvme is not None and self.ahead_gate.wants(li)  # asked every time: it counts skipped steps
        return store or (self._prestaging() and self.prestage.judge.offer())

    def _prestage_judged(self) -> bool:
        """Whether the prestage's judge times this step: beside a CPU lane only outside the lane judge's trials, so
        the two judges never time the same steps (a lane trial pauses the prestage's)."""
        lane = self.lane
        return self.prestage is not None and (lane is None or not lane.alive or self._lane_waits()
                                              or not self.lane_judge.in_trial)

    def _prestaging(self) -> bool:
        """Whether the prestage may run now: wherever its judge times the steps, and through a lane trial where
        its judge has kept it, so the lane is judged against the step it would otherwise be (a prestage still on
        trial stays off there)."""
        if self._prestage_judged():
            return True
        pre = self.prestage
        return pre is not None and not pre.judge.in_trial and bool(pre.judge.kept)

    def masked_id(self, li: int) -> int:
        """The slot id exllamav3's kernels ignore for layer li: the first one past its S + P slots."""
        return self.cache_slots[li] + self.staging_slots

    # ---- one step ---------------------------------------------------------------------------------------------

    def resolve(self, li: int, ids: np.ndarray, decode: bool, x: np.ndarray | None = None,
                weights: np.ndarray | None = None, next_guess: Sequence[int] | None = None,
                read_ahead: ReadAhead | None = None) -> Resolution:
        """Make every pick of layer li readable on the GPU (or give it to the CPU lane) and translate to slots.

        Decode steps (<= MAX_BSZN rows) teach the policy, admit the misses it wants and stream the rest through
        staging, or hand them to the CPU lane where the planner says so (x: the step's (tokens, hidden) float32
        input and weights: (tokens, top_k) routing weights, needed then). Prefill steps neither teach nor admit
        (they must not evict the decode hot set) and stage EVERY picked expert, residents included (a
        device-to-device copy), in ascending id order: the mapping id -> slot is then monotonic, so exllamav3's
        prefill paths, which sort and group picks by expert id, see exactly the stock order and stay
        bit-identical. next_guess (nvme modes, prefill): the next layer's experts its router, run ahead on this
        chunk, names; the store reads ahead only those instead of the whole layer (a short prompt picks a few).
        read_ahead(picks) (nvme modes, decode): the caller's lookahead for the layers after this one, run as soon as
        this step's own store reads are queued and before they are waited for, so the disk works on both; picks are
        this step's experts, which its reads must not drop.

        This runs between exllamav3's router and its expert kernels for every MoE layer of every token, with the
        GPU waiting: a decode step has at most a few dozen picks, so it works on Python lists and sets of them
        (numpy's per-call overhead exceeds the work at that size) and leaves each tier path alone unless it has
        something to do (no moves in flight, no store, no lane)."""
        if decode:
            return self._decode_step(li, ids, x, weights, read_ahead)
        return self._prefill_step(li, ids, next_guess)

    def _decode_step(self, li: int, ids: Any, x: np.ndarray | None, weights: np.ndarray | None,
                     read_ahead: ReadAhead | None) -> Resolution:
        """A decode step: every PCIe miss streams through staging, the GPU (not the host) waits for the copies, and
        the policy's learning and admissions wait for after_launch."""
        p = self._begin(li, ids, decode=True)
        ahead_rows, ahead_ticket = self._take_prestaged(p, decode=True)
        reading, ahead_later = self._decode_reads(p, read_ahead)
        hits, misses = self._split_hits(p)
        resolved = Resolution(slots=NO_SLOTS)
        # The misses copied ahead are on the GPU already: neither copied again nor offered to the lane.
        pre = {e: ahead_rows[e] for e in misses if e in ahead_rows} if ahead_rows else {}
        pcie = [e for e in misses if e not in pre] if pre else misses
        if self._lane_timed:  # fast / nvme: the planner's split of the misses, and the judge told of it
            self._judge_last_ticket()
            resolved.cpu, n_cpu = self._plan_lane(li, p.ids, pcie)
            self.lane_judge.done(p.ids.size, n_cpu, end_of_token=li == len(self.cache_slots) - 1)
            on_cpu = set(resolved.cpu)
            pcie = [e for e in pcie if e not in on_cpu] if on_cpu else pcie
        resolved.staged = list(pcie)
        if pre:
            self.prestage.used += len(pre)
        if self._prestage_timed:
            self._judge_prestage(p, pre)
        self._make_room(p, resolved.staged)
        self._count_picks(li, p.picks, hits, p.from_store, resolved.cpu)
        if resolved.cpu:
            reading = self._land_for_lane(p, reading, resolved.cpu)
            resolved.ticket = self._last_ticket = self._submit_lane(li, p.ids, x, weights, resolved.cpu)
        self.timer.phase(None)
        last = self._stream_decode(p, resolved, reading)
        if last is None and pre:  # only prestaged misses: the GPU waits for their copies (else the last covers them)
            last = ahead_ticket
        self._charge_copies(p, resolved.staged, hits)
        self._deferred = (li, p.ids, p.uniq, pcie + list(pre), resolved.staged, ahead_later, p.uniq_l, pre)
        if last is not None:  # the GPU waits for the copies, the host goes on
            self.tiers.stats.add_wait("pcie", self.timer.wait("copy_wait", self._order_after, li, resolved.staged, last))
        queued, self._queued_prestage = self._queued_prestage, None
        if queued is not None:  # the guess made while the step's store reads were queued: behind the step's copies
            self.prefetched += self._prestage(*queued)
        self.timer.phase("plan_copies")
        resolved.slots = decode_slots(p.ids, p.picks, p.uniq, self.tiers.vram[li].slot_of, resolved.staged,
                                      self.cache_slots[li], resolved.cpu, self.masked_id(li), prestaged=pre)
        self.timer.end()
        return resolved

    def _prefill_step(self, li: int, ids: Any, next_guess: Sequence[int] | None) -> Resolution:
        """A prefill step: every picked expert is staged in ascending id order (residents copied on the device), the
        host waits for the copies, and nothing is learned or admitted."""
        p = self._begin(li, ids, decode=False)
        self._take_prestaged(p, decode=False)  # a chunk's staging may use every row: any guess copied ahead is void
        self._count_lookahead(li, p.ids, False)
        self._prefill_reads(p, next_guess)
        hits, _ = self._split_hits(p)
        resolved = Resolution(slots=NO_SLOTS, staged=list(p.uniq_l))
        self._make_room(p, resolved.staged)
        self._count_picks(li, p.picks, hits, p.from_store, resolved.cpu)
        self.timer.phase(None)
        last = self._copy_staged(li, resolved.staged) if resolved.staged else None
        self._charge_copies(p, resolved.staged, hits)
        if last is not None:
            self.tiers.stats.add_wait("pcie", self.timer.wait("copy_wait", last.wait))
        self.timer.phase("plan_copies")
        resolved.slots = translate(p.ids, np.full(self.num_experts, -1, np.int32), resolved.staged,
                                   self.cache_slots[li], resolved.cpu, self.masked_id(li))
        self.timer.end()
        return resolved

    # ---- a step's parts, in the order a step runs them ----------------------------------------------------------

    def _begin(self, li: int, ids: Any, decode: bool) -> _Picks:
        """The last step's deferred bookkeeping (if nobody ran it), the tiers caught up, the step's picks."""
        if self._deferred is not None:  # the caller never ran it (no combine hook): now, before this step
            self.after_launch()
        self.timer.begin()
        self._queued_prestage = None  # a failed step's guess copies nothing
        tiers = self.tiers
        tiers.give_back_lent()  # the last step's kernels are queued: a copy into its borrowed slots now waits for them
        self._lane_timed = self.lane is not None and not self._lane_waits()
        if self._lane_timed:
            self.lane_judge.started(decode)
        self._prestage_timed = self._prestage_judged()  # decided once a step: a lane verdict inside it waits
        if self._prestage_timed:
            self.prestage.judge.started(decode)
        if self.nvme is not None:
            self.nvme.mark_step(li if decode else None)
        tiers.poll()
        return _Picks(li, ids)

    def _all_ram(self) -> bool:
        """The all-RAM modes never enter STORE: a step has no store read to start or wait for."""
        return self.tiers.store is None and self.tiers.keep_all

    def _settle(self, p: _Picks) -> None:
        """Every move in flight for the step's experts lands (a fill, a victim's write-back): the host waits."""
        w = self.tiers.settle_each(p.li, p.uniq_l)
        if w:
            self.tiers.stats.add_wait("pcie", w)

    def _decode_reads(self, p: _Picks, read_ahead: ReadAhead | None) -> tuple[list[int], ReadAhead | None]:
        """Every store miss of the step put in flight, not waited for (a decode step knows each miss's staging row
        before its read lands, so the RAM-resident misses cross PCIe meanwhile). Returns the experts still being
        read, and the next layers' reads when this step held them back for after launch."""
        self.timer.phase(None)
        if self._all_ram():
            self._settle(p)
            self.timer.phase("plan_reads")
            p.codes = self.tiers.where[p.li][p.uniq].tolist()
            return [], None
        where = self.tiers.where[p.li]
        codes = where[p.uniq].tolist()
        STORE = self._store_code
        from_store = max(codes, default=0) >= STORE  # STORE or FROM_STORE: the step reads from the store
        self.ahead_gate.stepped(p.li, from_store)
        if not from_store:
            return self._no_store_reads(p, codes, read_ahead)
        self.tiers.demand_reads(p.li, p.uniq, True)
        if read_ahead is not None:
            # The next layers' reads go in behind this step's (demand reads overtake prefetch in the reader's queue):
            # a record read takes several layers' GPU time, and waiting for this step's reads first would leave the
            # disk with one read at a time. A prestage copy would go ahead of this step's own: it waits for them.
            self._defer_prestage = True
            try:
                read_ahead(p.uniq_l)
            finally:
                self._defer_prestage = False
        # Nothing here waits for the store, and a move landing never makes an expert STORE or FROM_STORE: one look
        # at the states once the moves have settled names the store misses and, below, the hits.
        self._settle(p)
        p.codes = where[p.uniq].tolist()
        reading = [e for e, c in zip(p.uniq_l, p.codes, strict=True) if c >= STORE]  # STORE or FROM_STORE
        p.from_store.update(reading)
        self.timer.phase("plan_reads")
        return reading, None

    def _no_store_reads(self, p: _Picks, codes: list[int],
                        read_ahead: ReadAhead | None) -> tuple[list[int], ReadAhead | None]:
        """A step none of whose experts is in the store: no read to put in flight (demand would issue none), only
        the guesses read ahead for the layer settled. Its moves settle into VRAM or RAM, never the store, so it
        reads nothing; the next layers' reads wait for after launch, while the GPU runs the step's kernels."""
        if self.nvme is not None:
            self.nvme.settle_guesses(p.li, p.uniq_l, codes, True)
        else:  # a store source of the tiers' own (tests): as it was
            self.tiers.demand_reads(p.li, p.uniq, True)
        self._settle(p)
        p.codes = self.tiers.where[p.li][p.uniq].tolist()
        self.timer.phase("plan_reads")
        return [], read_ahead

    def _prefill_reads(self, p: _Picks, next_guess: Sequence[int] | None) -> None:
        """Every store miss of the chunk read into RAM, the host waiting; the next layer's reads started first."""
        tiers, li = self.tiers, p.li
        self.timer.phase(None)
        if self._all_ram():
            self._settle(p)
        else:
            tiers.demand_reads(li, p.uniq, False)
            if self.nvme is not None and li + 1 < len(self.cache_slots):
                # Start reading the next layer's experts now, so the store works while this layer's are read and
                # run: the ones the router run ahead names, else (no guess) the whole layer, as a long chunk picks
                # nearly all.
                named = None if next_guess is None else {li + 1: next_guess}
                self.prefetched += self.nvme.prefetch_prefill([li + 1], named, protect={li: p.uniq_l})
            where = tiers.where[li]
            for e in p.uniq_l:
                w = tiers.settle(li, e)
                if w:
                    tiers.stats.add_wait("pcie", w)
                if where[e] >= self._store_code:  # read again each time: waiting for one read may land another
                    p.from_store.add(e)
                    self.timer.wait("store_wait", tiers.fetch_to_ram, li, e, protect=p.uniq)
        self.timer.phase("plan_reads")
        # Indexing, not take(): take releases the GIL, and with store reads landing a reader thread then holds it
        # for a while (seen as ~5 us a take in the nvme bench, against 0.2 us alone).
        p.codes = tiers.where[li][p.uniq].tolist()

    def _split_hits(self, p: _Picks) -> tuple[set[int], list[int]]:
        """The step's VRAM hits, and its misses in ascending id order."""
        VRAM = self._vram_code
        hits = {e for e, c in zip(p.uniq_l, p.codes, strict=True) if c == VRAM}
        misses = [e for e, c in zip(p.uniq_l, p.codes, strict=True) if c != VRAM]
        return hits, misses

    def _make_room(self, p: _Picks, staged: list[int]) -> None:
        """Staging rows for every staged expert: past the dedicated rows, cache slots are borrowed (emptied)."""
        if len(staged) > self.staging_slots:
            raise StepError(f"layer {p.li}: {len(staged)} experts to stage in one step exceed the "
                            f"{self.staging_slots} staging slots; raise staging_slots (or lower the prefill chunk)")
        if len(staged) > self.tiers.staging_rows:
            self.lent_out += self.tiers.borrow(p.li, len(staged), keep=p.uniq_l)

    def _land_for_lane(self, p: _Picks, reading: list[int], cpu: list[int]) -> list[int]:
        """The lane computes from RAM: the store records it was given must land before it starts. Returns the
        experts still being read."""
        if not reading:
            return reading
        on_cpu = set(cpu)
        self.timer.wait("store_wait", self._land, p, [e for e in reading if e in on_cpu])
        return [e for e in reading if e not in on_cpu]

    def _land(self, p: _Picks, experts: list[int]) -> None:
        for e in experts:
            self.tiers.fetch_to_ram(p.li, e, protect=p.uniq)

    def _copy_staged(self, li: int, experts: list[int], rows: Sequence[int] | None = None) -> Any:
        """One copy ticket for experts[i] -> staging row rows[i] (default: row i)."""
        tiers = self.tiers
        rows = range(len(experts)) if rows is None else rows
        return tiers.copier_of(li).copy_many([(tiers.staging_slot(i, li), tiers.bytes_of(li, e))
                                              for i, e in zip(rows, experts, strict=True)])

    def _stream_decode(self, p: _Picks, resolved: Resolution, reading: list[int]) -> Any:
        """The staged misses cross PCIe: the RAM-resident ones first, while the store reads land, then the records
        read. Returns the last copy ticket (one fill stream: it covers the earlier ones), or None."""
        if not reading:
            return self._copy_staged(p.li, resolved.staged) if resolved.staged else None
        pending = set(reading)
        early = [(i, e) for i, e in enumerate(resolved.staged) if e not in pending]
        last = self._copy_staged(p.li, [e for _, e in early], [i for i, _ in early]) if early else None
        self.copied_before_store_wait += len(early)
        try:
            self.timer.wait("store_wait", self._land, p, reading)
        except BaseException:
            if last is not None:  # its RAM sources must not be dropped under the copy
                last.wait()
            if resolved.ticket is not None:  # nobody collects it now: stop the lane reading this step's RAM rows
                resolved.ticket.cancel[0] = 1
            raise
        late = [(i, e) for i, e in enumerate(resolved.staged) if e in pending]
        return self._copy_staged(p.li, [e for _, e in late], [i for i, _ in late]) if late else last

    def _charge_copies(self, p: _Picks, staged: list[int], hits: set[int]) -> None:
        """The step's store wait and the bytes its staged experts moved over PCIe (a resident one is copied on the
        device, prefill), into the tier stats."""
        tiers = self.tiers
        store_wait = self.timer.waited("store_wait")
        if store_wait:
            tiers.stats.add_wait("nvme", store_wait)
        crossed = len(staged) - len(hits.intersection(staged)) if hits else len(staged)
        if staged and crossed:
            tiers.stats.add_bytes("ram_to_staging", crossed * tiers.layout.nbytes)

    def _order_after(self, li: int, staged: list[int], last: Any) -> None:
        """The expert kernels wait for the copies on the GPU; nvme: no store read may reuse a slot being copied."""
        tiers = self.tiers
        tiers.copier_of(li).order_compute_after([last])
        if not tiers.keep_all:
            tiers.hold(li, staged, last)

    # ---- the CPU lane's share -----------------------------------------------------------------------------------

    def _judge_last_ticket(self) -> None:
        """Tell the judge whether the last lane step finished past its deadline (resolved by now: its partial was
        added before this step's router ran)."""
        t, self._last_ticket = self._last_ticket, None
        if t is not None and t.ready():
            self.lane_judge.lane_step(late=t.deadline_missed)

    def _plan_lane(self, li: int, ids: np.ndarray, misses: list[int]) -> tuple[list[int], int]:
        """The misses the CPU lane computes this step (the planner's split), and their picks."""
        if not self.lane_in_use():
            return [], 0
        cpu: list[int] = []
        n_cpu = 0
        if misses:
            from glm53.cpu_lane.planner import assign

            counts = Counter(ids.ravel().tolist())
            rows = [(e, counts[e]) for e in misses]
            self.last_assignment = assign(rows, self.fit.model(), cpu_ok=self.lane.alive)
            cpu = sorted(int(e) for e in self.last_assignment.cpu)
            n_cpu = sum(counts[e] for e in cpu)
        return cpu, n_cpu

    def _submit_lane(self, li: int, ids: np.ndarray, x: np.ndarray | None, weights: np.ndarray | None,
                     experts: list[int]) -> Any:
        from glm53.cpu_lane.lane import LaneJob

        if x is None or weights is None:
            raise StepError("a decode step with a CPU lane needs the step's input rows and routing weights")
        jobs = []
        for e in experts:
            tok, k = np.nonzero(ids == e)
            jobs.append(LaneJob(e, self.tiers.bytes_of(li, e).numpy(), np.ascontiguousarray(x[tok], np.float32),
                                token_rows=tok, weights=np.asarray(weights[tok, k], np.float32)))
        recompute = self.recompute

        def redo(job: Any) -> Any:
            return recompute(li, job.expert, job.x)

        deadline = self.lane.deadline_for(self.last_assignment.cpu_seconds)
        return self.lane.submit(li, jobs, redo, deadline, count_picks=False)

    def _count_picks(self, li: int, picks: list[int], hits: set[int], from_store: set[int], cpu: list[int]) -> None:
        """Picks by lane: a VRAM hit; else nvme if the step had to read it from the store; else cpu or pcie."""
        n_hit = n_store = n_cpu = 0
        on_cpu = set(cpu)
        for e in picks:
            if e in hits:
                n_hit += 1
            elif e in from_store:
                n_store += 1
            elif e in on_cpu:
                n_cpu += 1
        self.tiers.stats.add_lane_picks(li, n_hit, len(picks) - n_hit - n_store - n_cpu, n_cpu, n_store)

    # ---- after launch -------------------------------------------------------------------------------------------

    def after_launch(self) -> None:
        """The last decode step's bookkeeping the GPU need not wait for: the lookahead's guess
        for it is scored, the next layers' store reads start if the step held them back, the layer's policy
        learns the step's picks and admits the streamed misses it wants, each copied on the device from its
        staging row (no second PCIe crossing), and in the nvme modes a few RAM slots are freed for the next
        step's reads. exllamav3's combine calls this once the step's expert kernels
        are queued; the copy stream orders each admission after them, and a fill into a victim's slot after the
        victim's write-back. The next resolve() runs it first if nobody did."""
        d, self._deferred = self._deferred, None
        if d is None:
            return
        t0 = self.timer.clock()
        li, ids, uniq, pcie, staged, read_ahead, busy, pre = d
        if read_ahead is not None:  # the next layer's reads, held back by a step with no store read to wait for
            read_ahead(busy)  # first: every microsecond before it delays the disk
        self._count_lookahead(li, ids, True)
        self.tiers.observe(li, ids)
        if self.admit and staged:
            self._admit_streamed(li, uniq, pcie, staged, pre)
        if self.nvme is not None and self.tiers.ram.free_count() < FREE_RAM_SLOTS:
            self._keep_ram_free(li, busy)
        self.timer.since("after_launch", t0)

    def _admit_streamed(self, li: int, uniq: np.ndarray, pcie: list[int], staged: list[int],
                        pre: dict[int, int]) -> None:
        """The policy admits the streamed (or prestaged) misses it wants, each copied on the device from its staging
        row."""
        tiers = self.tiers
        row = {e: i for i, e in enumerate(staged)}
        row.update(pre)
        # Still in RAM: in the nvme modes the lookahead's store reads may have dropped one since (the tiers move an
        # expert into VRAM only from RAM).
        where, ram = tiers.where[li], self._ram_code
        candidates = [e for e in pcie if e in row and where[e] == ram]
        if candidates:
            tiers.try_admit(li, np.array(candidates, np.int64), uniq, source=lambda e: tiers.staging_slot(row[e], li))

    def _keep_ram_free(self, li: int, busy: list[int]) -> None:
        """A few RAM slots freed for the next step's reads: never one of this step's experts (the CPU lane may still
        be reading one, or recompute it from RAM if it misses its deadline) nor one the guesses for the coming
        layers named. (With the slots already free, keep_free drops nothing: the sets are not made.)"""
        pending = self._near.pending
        make: dict[int, Callable[[], set[int]]] = {la: partial(self._likely_set, g) for la, g in pending.items()}
        guess = pending.get(li)
        make[li] = lambda: (set() if guess is None else self._likely_set(guess)) | set(busy)
        self.nvme.keep_free(FREE_RAM_SLOTS, LazySets(make))

    # ---- the lookahead ------------------------------------------------------------------------------------------

    def ahead(self, li: int, predicted: np.ndarray, busy: Sequence[int] = ()) -> int:
        """Layer li, the one after the layer stepping now, is predicted to pick `predicted` (ids, any shape): read its
        store-only experts into RAM (nvme modes) and prestage a few of its RAM experts into staging (with a
        prestage that runs now), so their bytes move while the GPU is still busy with the layer before. busy:
        experts of the layer stepping now that must stay (the CPU lane's; all of the step's when called from inside
        resolve), never dropped for a prefetch. Returns the reads or copies started (a prestage queued behind the
        stepping layer's copies counts when it starts)."""
        if not 0 <= li < len(self.cache_slots):
            return 0
        predicted = np.array(predicted, np.int64, ndmin=2)  # a copy: the caller's buffer is reused
        self._near.pending[li] = predicted
        self._near.outside[li] = (self.tiers.where[li][predicted] != self._vram_code).tolist()
        started = self._read_ahead(li, predicted, busy) if self.nvme is not None else 0
        if self._defer_prestage:
            self._queued_prestage = (li, predicted)
        else:
            started += self._prestage(li, predicted)
        self.prefetched += started
        return started

    def _read_ahead(self, li: int, predicted: np.ndarray, busy: Sequence[int]) -> int:
        """nvme: the guessed store-only experts read into RAM, most likely first (the read window may fill), and
        only at ranks right often enough for the store's load: on a disk-bound host a wrong guess costs a whole
        record's read."""
        load = self.nvme.load()
        self.guess_floor = load / (1.0 + load) if 1.0 + load > 0 else 0.0
        protect = {li - 1: list(busy)} if li > 0 and len(busy) else None
        started = self.nvme.prefetch([(li, e) for e in self._likely(predicted)], protect=protect)
        if started:
            self.ahead_gate.guess_read(li)
        return started

    def _prestage(self, li: int, predicted: np.ndarray) -> int:
        """The best-ranked guessed experts in RAM copied into layer li's reserved staging rows, right behind the
        stepping layer's own copies (glm53.step.prestage); nvme modes: held in RAM until their copy lands. A step
        whose demand would reach the reserved rows copies nothing ahead."""
        pre = self.prestage
        if not self._prestaging() or not pre.fits(predicted.shape[0]):
            return 0
        where, ram = self.tiers.where[li], self._ram_code
        picked: list[int] = []
        for e in self._near.likely(predicted, 0.0):
            if where[e] == ram:
                picked.append(e)
                if len(picked) == pre.per_parity:
                    break
        if not picked:
            return 0
        rows = pre.rows_of(li)[: len(picked)]
        ticket = self._copy_staged(li, picked, rows)
        pre.put(li, predicted.shape[0], picked, ticket)
        if not self.tiers.keep_all:  # a store read must not take a RAM slot the copy still reads
            self.tiers.hold(li, picked, ticket)
        self.tiers.stats.add_bytes("ram_to_staging", len(picked) * self.tiers.layout.nbytes)
        return len(picked)

    def _take_prestaged(self, p: _Picks, decode: bool) -> tuple[dict[int, int], Any]:
        """The experts copied ahead for this step (expert -> staging row) and their copy ticket."""
        if self.prestage is None:
            return {}, None
        return self.prestage.take(p.li, decode, p.ids.shape[0])

    def _judge_prestage(self, p: _Picks, pre: dict[int, int]) -> None:
        """The prestage's judge told of the step's picks served by experts copied ahead."""
        served = sum(e in pre for e in p.picks) if pre else 0
        self.prestage.judge.done(p.ids.size, served, end_of_token=p.li == len(self.cache_slots) - 1)

    def rank_precision(self) -> list[float]:
        """Per guess rank (best first): (hits + 1) / (guesses + 2), the share of guesses the real picks contained."""
        return list(self._near.precision)

    def _likely(self, predicted: np.ndarray) -> list[int]:
        """The predicted experts guessed at a rank right more often than `guess_floor`, best rank first, each once."""
        return self._near.likely(predicted, self.guess_floor)

    def _likely_set(self, predicted: np.ndarray) -> set[int]:
        return set(self._likely(predicted))

    def _count_lookahead(self, li: int, ids: np.ndarray, decode: bool) -> None:
        self._near.score(li, ids, decode)

    # ---- stats --------------------------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        doc: dict = {"host_seconds": {k: round(v, 4) for k, v in self.host_seconds.items()},
                     "copied_before_store_wait": self.copied_before_store_wait,
                     "lent_out": self.lent_out,
                     "lookahead": {**self.lookahead.snapshot(), "prefetched": self.prefetched,
                                   "gate": self.ahead_gate.snapshot() if self.nvme is not None else None,
                                   "rank_precision": [round(p, 3) for p in self.rank_precision()],
                                   "outside_precision": [round(p, 3) for p in self._near.outside_precision()],
                                   "guess_floor": round(self.guess_floor, 3),
                                   "prestage": self.prestage.snapshot() if self.prestage is not None else None,
                                   "guess_saving": (round(self.nvme.guess_saving(), 3) if self.nvme is not None
                                                    else None)}}
        if self.lane is not None:
            judge = self.lane_judge
            doc["cpu_lane"] = {**self.lane.snapshot(), "set_aside": not judge.in_trial and not judge.kept,
                               "judge": judge.snapshot()}
            if self.last_assignment is not None:
                from glm53.cpu_lane.lane import assignment_json

                doc["last_assignment"] = assignment_json(self.last_assignment)
        return doc
