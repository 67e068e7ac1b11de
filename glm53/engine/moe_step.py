"""The host side of one MoE layer step under exllamav3's expert kernels: where every pick's bytes are read from.

exllamav3 routes, then calls the seam (glm53.exl3.tiered) with the picks; the seam hands them
here and gets back a slot id per pick. A slot id is one of the layer's S cache slots (a VRAM hit, or an expert
admitted this step), one of the P staging slots shared by all layers (a miss streamed over PCIe without
admission), or `masked` (S + P: outside the module's expert interval, so exllamav3's kernels add exact zeros
for it) for a pick the CPU lane computes; the lane's partial is added back at the seam's combine.

Nothing here imports exllamav3, so the decisions run on the CPU in tests with CPU tensors standing in for VRAM.

  all-RAM modes (exact, fast): every expert not in VRAM is in the pinned RAM tier.
  nvme modes: RAM caches the record store; a step's store misses are all put in flight first (demand reads),
  then waited for one by one, so their reads overlap each other.
  fast / nvme: the planner (glm53.cpu_lane.planner) splits each decode step's RAM-resident misses between the
  CPU lane and PCIe; exact / nvme-exact send every miss over PCIe.
  lookahead: the adapter may hand in the next layer's router run on this layer's input; its picks are read or
  admitted one layer ahead (reads and copies overlap this layer's experts and the next layer's attention), and
  how many of them the next layer really picks is counted (recall). In the nvme modes a guess is read only at
  ranks right often enough for the store's load (see guess_floor).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from glm53.engine.lookahead import RecallMeter
from glm53.planning.spec import FREE_RAM_SLOTS


class StepError(RuntimeError):
    """A step could not make its picks readable (configuration too small): fail loudly, never guess."""


def translate(ids: np.ndarray, slot_of: np.ndarray, staged: Sequence[int], staging_base: int,
              masked: Sequence[int] = (), masked_id: int = -1) -> np.ndarray:
    """Router ids -> slot ids: a resident expert's cache slot, `staging_base + i` for staged[i], `masked_id` for
    the experts in `masked` (computed elsewhere). Raises StepError if a pick is none of these: that pick would
    silently contribute zero, which is never allowed."""
    lut = np.asarray(slot_of, np.int64).copy()
    for i, e in enumerate(staged):
        if lut[e] >= 0:
            raise StepError(f"expert {e} is both resident (slot {lut[e]}) and staged")
        lut[e] = staging_base + i
    for e in masked:
        if lut[e] >= 0:
            raise StepError(f"expert {e} is given to the CPU lane but also resident or staged (slot {lut[e]})")
        lut[e] = masked_id
    out = lut[np.asarray(ids, np.int64)]
    if out.size and out.min() < 0:
        missing = sorted(set(np.asarray(ids)[out < 0].tolist()))
        raise StepError(f"experts {missing} are picked but neither resident nor staged")
    return out


def decode_slots(ids: np.ndarray, picks: list[int], uniq: np.ndarray, slot_of: np.ndarray, staged: Sequence[int],
                 staging_base: int, masked: Sequence[int] = (), masked_id: int = -1) -> np.ndarray:
    """translate() for a decode step's few picks (picks: ids as a list, uniq: its distinct ids): a dict over the
    step's experts instead of a num_experts lookup table. Whatever is not the plain case (a staged or masked
    expert resident or not picked, a pick with nowhere to be read) goes to translate(), which raises."""
    slot = dict(zip(uniq.tolist(), slot_of[uniq].tolist(), strict=True))  # -1: not resident
    plain = True
    for i, e in enumerate(staged):
        plain = plain and slot.get(e, 0) == -1
        slot[e] = staging_base + i
    for e in masked:
        plain = plain and slot.get(e, 0) == -1
        slot[e] = masked_id
    if not plain or -1 in slot.values():
        return translate(ids, slot_of, staged, staging_base, masked, masked_id)
    return np.array([slot[e] for e in picks], np.int64).reshape(ids.shape)


_NO_SLOTS = np.empty(0, np.int64)
_NO_SLOTS.flags.writeable = False
log = logging.getLogger(__name__)


@dataclass
class Step:
    """One resolved layer step."""

    slots: np.ndarray                       # (tokens, top_k) slot id per pick
    staged: list[int] = field(default_factory=list)  # misses streamed into staging (a decode step's admissions
    # come after launch, from these rows)
    cpu: list[int] = field(default_factory=list)   # experts the CPU lane computes (their picks are masked)
    ticket: Any = None                      # the lane's LaneTicket, or None: ticket.partial(tokens) at combine


# recompute(layer, expert, x_rows float32 (rows, hidden)) -> (rows, hidden): the exact path for a lane job it
# could not finish (deadline, dead worker).
Recompute = Callable[[int, int, np.ndarray], Any]


class _LazySets(Mapping[int, set[int]]):
    """{layer: experts}, each layer's set made when first looked up (make[layer]()): keep_free looks up only the
    layers of the victims it weighs, mostly none of the two or three named here, whose sets cost a few
    microseconds each to make."""

    def __init__(self, make: dict[int, Callable[[], set[int]]]):
        self._make = make
        self._made: dict[int, set[int]] = {}

    def __getitem__(self, layer: int) -> set[int]:
        got = self._made.get(layer)
        if got is None:
            got = self._made[layer] = self._make[layer]()
        return got

    def get(self, layer: int, default: Any = None) -> Any:  # the lookup the victim search makes: no KeyError raised
        return self[layer] if layer in self._make else default

    def __iter__(self) -> Iterator[int]:
        return iter(self._make)

    def __len__(self) -> int:
        return len(self._make)


class Guesses:
    """Guesses one layer ahead: each layer's guess until its step comes, and how often the guess at each rank (best first) was among the real picks, pooled over layers. A guess acted on costs its bytes
    whether or not it is picked and saves them only when it is, so only ranks right often enough are acted on
    (MoeStepper.guess_floor): calibrated live, starting from "yes"."""

    def __init__(self) -> None:
        self.meter = RecallMeter()
        self.pending: dict[int, np.ndarray] = {}  # layer -> the (rows, k) ids guessed for its next step
        self.hits: list[int] = []  # plain ints: updated per guess on the per-step path
        self.total: list[int] = []
        self.precision: list[float] = []  # (hits + 1) / (total + 2) per rank, refreshed when the counts change

    def score(self, li: int, ids: np.ndarray, decode: bool) -> None:
        """Score layer li's pending guess against its real picks `ids` (rows, top_k)."""
        pred = self.pending.pop(li, None)
        if pred is None or not decode or pred.shape[0] != ids.shape[0]:
            return  # no guess, or not for this step's rows (another batch shape came between)
        guesses, reals = pred.tolist(), ids.tolist()
        hits, total = self.hits, self.total
        k = len(guesses[0]) if guesses else 0
        if len(total) < k:
            hits.extend([0] * (k - len(hits)))
            total.extend([0] * (k - len(total)))
        n = len(guesses)
        for r in range(k):  # every row guesses k ranks (pred is one 2-D array)
            total[r] += n
        # The recall meter's counts (RecallMeter.update's) in the same pass over the rows.
        row_hits = picks = 0
        guessed: set[int] = set()
        picked: set[int] = set()
        for guess, real in zip(guesses, reals, strict=True):
            real_set, guess_set = set(real), set(guess)
            found = 0
            for r, e in enumerate(guess):
                if e in real_set:
                    hits[r] += 1
                    found += 1
            # The guesses found among the picks are the picks found among the guesses where neither row names an
            # expert twice (a router never does); else counted per pick, as the meter counts.
            if len(guess_set) != len(guess) or len(real_set) != len(real):
                found = sum(map(guess_set.__contains__, real))
            row_hits += found
            picks += len(real)
            guessed |= guess_set
            picked |= real_set
        self.meter.add(li, row_hits, picks, len(picked & guessed), len(picked))
        self.precision = [(h + 1) / (t + 2) for h, t in zip(hits, total, strict=True)]


class MoeStepper:
    """Decides, per layer step, which tier each pick is read from; owns no tensors of its own."""

    def __init__(self, tiers: Any, cache_slots: Sequence[int], staging_slots: int, *, admit: bool = True,
                 lane: Any = None, fit: Any = None, recompute: Recompute | None = None, nvme: Any = None,
                 lane_judge: Any = None):
        """tiers: glm53.tiers.ExpertTiers (nvme modes: the NvmeTier's). cache_slots: S per layer. lane: a
        glm53.cpu_lane.CpuLane (fast / nvme modes) with `fit`, the planner's LiveFit, and `recompute`. nvme: the
        NvmeTier, for prefetch.
        A decode step streams every PCIe miss into staging, and its copies are ordered before the expert kernels on
        the GPU (a stream-side wait) instead of the host waiting for them (1.05-1.17x the decode speed of the host
        waiting, H200, docs/results.md); the policy's learning and admissions run in `after_launch`, once exllamav3
        has queued the step's kernels, each admitted expert copied on the device from the staging row it was just
        streamed into. The PCIe timings the planner refits from are then only the start-up ones.
        lane_judge: a glm53.engine.lane_judge.LaneJudge (default: a new one on the wall clock), which decides from
        paired windows of decode steps whether offering the lane makes them faster."""
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
        # (layer, ids, uniq, pcie misses, staged, the next layers' reads held back or None, their busy experts)
        self._deferred: tuple | None = None  # awaiting after_launch
        self.num_experts = tiers.num_experts
        self._near = Guesses()
        self.lookahead = self._near.meter
        self.last_assignment: Any = None
        if lane_judge is None:
            from glm53.engine.lane_judge import LaneJudge

            lane_judge = LaneJudge()
        self.lane_judge = lane_judge
        self.prefetched = 0  # reads (nvme) or admissions (all-RAM) started from a prediction
        self.lent_out = 0  # experts that left VRAM because a step borrowed their cache slot as staging
        # plan_reads, plan_copies, plan_slots: parts of plan (the store's reads queued and settled; the copies
        # queued and ordered; the slot ids), so a profile-free run says where a step's host time goes.
        self.host_seconds = {"plan": 0.0, "copy_wait": 0.0, "store_wait": 0.0, "after_launch": 0.0,
                             "plan_reads": 0.0, "plan_copies": 0.0, "plan_slots": 0.0}
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
        t0 = time.perf_counter()
        li, ids, uniq, pcie, staged, read_ahead, busy = d
        if read_ahead is not None:  # the next layer's reads, held back by a step with no store read to wait for
            read_ahead(busy)  # first: every microsecond before it delays the disk
        self._count_lookahead(li, ids, True)
        tiers = self.tiers
        tiers.observe(li, ids)
        if self.admit and staged:
            row = {e: i for i, e in enumerate(staged)}
            # Still in RAM: in the nvme modes the lookahead's store reads may have dropped one since (the tiers
            # move an expert into VRAM only from RAM).
            where, ram = tiers.where[li], self._ram_code
            candidates = [e for e in pcie if e in row and where[e] == ram]
            if candidates:
                tiers.try_admit(li, np.array(candidates, np.int64), uniq,
                                source=lambda e: tiers.staging_slot(row[e], li))
        if self.nvme is not None and tiers.ram.free_count() < FREE_RAM_SLOTS:
            # Never one of this step's experts (the CPU lane may still be reading one, or recompute it from RAM if
            # it misses its deadline) nor one the guesses for the coming layers named. (With the slots already
            # free, keep_free drops nothing: the sets are not made.)
            pending = self._near.pending
            make: dict[int, Callable[[], set[int]]] = {la: partial(self._likely_set, g) for la, g in pending.items()}
            guess = pending.get(li)
            make[li] = lambda: (set() if guess is None else self._likely_set(guess)) | set(busy)
            self.nvme.keep_free(FREE_RAM_SLOTS, _LazySets(make))
        self.host_seconds["after_launch"] += time.perf_counter() - t0

    def lane_in_use(self) -> bool:
        """Whether the next decode step offers misses to the CPU lane (attached, alive, and offered by the judge)."""
        return self.lane is not None and self.lane.alive and self.lane_judge.offer()

    def masked_id(self, li: int) -> int:
        """The slot id exllamav3's kernels ignore for layer li: the first one past its S + P slots."""
        return self.cache_slots[li] + self.staging_slots

    # ---- one step ---------------------------------------------------------------------------------------------

    def resolve(self, li: int, ids: np.ndarray, decode: bool, x: np.ndarray | None = None,
                weights: np.ndarray | None = None, next_guess: Sequence[int] | None = None,
                read_ahead: Callable[[list[int]], Any] | None = None) -> Step:
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
        if self._deferred is not None:  # the caller never ran it (no combine hook): now, before this step
            self.after_launch()
        t_start = time.perf_counter()
        tiers = self.tiers
        tiers.give_back_lent()  # the last step's kernels are queued: a copy into its borrowed slots now waits for them
        if self.lane is not None:
            self.lane_judge.started(decode)
        VRAM, STORE = self._vram_code, self._store_code
        if self.nvme is not None:
            self.nvme.mark_step(li if decode else None)
        tiers.poll()
        ids = np.asarray(ids)
        picks = ids.ravel().tolist()
        uniq_l = sorted(set(picks))
        uniq = np.array(uniq_l, np.int64)
        if not decode:  # a decode step's are scored after launch: the guesses' counts need not hold up the kernels
            self._count_lookahead(li, ids, decode)
        where = tiers.where[li]
        from_store: set[int] = set()
        store_wait = 0.0
        # A decode step streams every miss through staging, so it knows each miss's staging row before its store
        # reads land: the RAM-resident misses cross PCIe while the store reads finish, and only the store's records
        # wait for them.
        reading: list[int] = []
        codes: list[int] | None = None  # the step's experts' tier states, where one look serves to the end
        ahead_later: Callable[[list[int]], Any] | None = None
        t_reads = time.perf_counter()
        if tiers.store is None and tiers.keep_all:  # the all-RAM modes never enter STORE
            w = tiers.settle_each(li, uniq_l)
            if w:
                tiers.stats.add_wait("pcie", w)
        else:
            tiers.demand_reads(li, uniq, decode)  # nvme: every store miss of the step in flight before the first wait
            # The next layers' reads go in behind them (demand reads overtake prefetch in the reader's queue): a
            # record read takes several layers' GPU time, and waiting for this step's reads first would leave the
            # disk with one read at a time. A step with no store read to wait for starts them after launch
            # instead, while the GPU runs its kernels.
            if read_ahead is not None and decode:
                if max(where[uniq].tolist(), default=VRAM) < STORE:
                    ahead_later = read_ahead
                else:
                    read_ahead(uniq_l)
            elif not decode and self.nvme is not None and li + 1 < len(self.cache_slots):
                # Start reading the next layer's experts now, so the store works while this layer's are read and
                # run: the ones the router run ahead names, else (no guess) the whole layer, as a long chunk
                # picks nearly all.
                named = None if next_guess is None else {li + 1: next_guess}
                self.prefetched += self.nvme.prefetch_prefill([li + 1], named, protect={li: uniq_l})
            if decode:
                # Nothing here waits for the store, and a move landing never makes an expert STORE or FROM_STORE:
                # one look at the states once the moves have settled names the store misses and, below, the hits.
                w = tiers.settle_each(li, uniq_l)
                if w:
                    tiers.stats.add_wait("pcie", w)
                codes = where[uniq].tolist()
                reading = [e for e, c in zip(uniq_l, codes, strict=True) if c >= STORE]  # STORE or FROM_STORE
                from_store.update(reading)
            else:
                for e in uniq_l:
                    w = tiers.settle(li, e)
                    if w:
                        tiers.stats.add_wait("pcie", w)
                    if where[e] >= STORE:  # read again each time: waiting for one read may land another
                        from_store.add(e)
                        t0 = time.perf_counter()
                        tiers.fetch_to_ram(li, e, protect=uniq)
                        store_wait += time.perf_counter() - t0
        self.host_seconds["plan_reads"] += time.perf_counter() - t_reads - store_wait
        # Indexing, not take(): take releases the GIL, and with store reads landing a reader thread then holds it
        # for a while (seen as ~5 us a take in the nvme bench, against 0.2 us alone).
        if codes is None:
            codes = where[uniq].tolist()
        hits = {e for e, c in zip(uniq_l, codes, strict=True) if c == VRAM}
        misses = [e for e, c in zip(uniq_l, codes, strict=True) if c != VRAM]
        step = Step(slots=_NO_SLOTS)
        if decode:  # every PCIe miss streams through staging; admissions come after launch
            step.cpu, n_cpu = self._plan_lane(li, ids, misses)
            if self.lane is not None:
                self.lane_judge.done(ids.size, n_cpu, end_of_token=li == len(self.cache_slots) - 1)
            on_cpu = set(step.cpu)
            pcie = [e for e in misses if e not in on_cpu] if on_cpu else misses
            step.staged = list(pcie)
        else:
            step.staged = list(uniq_l)
        if len(step.staged) > self.staging_slots:
            raise StepError(f"layer {li}: {len(step.staged)} experts to stage in one step exceed the "
                            f"{self.staging_slots} staging slots; raise staging_slots (or lower the prefill chunk)")
        if len(step.staged) > tiers.staging_rows:  # past the dedicated rows: empty the cache slots it borrows
            self.lent_out += tiers.borrow(li, len(step.staged), keep=uniq_l)
        self._count_picks(li, picks, hits, from_store, step.cpu)
        if reading and step.cpu:  # the lane computes from RAM: its records must land before it starts
            on_cpu = set(step.cpu)
            t0 = time.perf_counter()
            for e in reading:
                if e in on_cpu:
                    tiers.fetch_to_ram(li, e, protect=uniq)
            store_wait += time.perf_counter() - t0
            reading = [e for e in reading if e not in on_cpu]
        if step.cpu:
            step.ticket = self._submit_lane(li, ids, x, weights, step.cpu)
        t_copy = time.perf_counter()
        wait_before_copies = store_wait
        last = None
        # The staged experts not resident (each staged once); a resident one is copied on the device (prefill).
        crossed = len(step.staged) - len(hits.intersection(step.staged)) if hits else len(step.staged)
        if reading:
            pending = set(reading)
            early = [(tiers.staging_slot(i, li), tiers.bytes_of(li, e)) for i, e in enumerate(step.staged)
                     if e not in pending]
            last = tiers.copier_of(li).copy_many(early) if early else None
            self.copied_before_store_wait += len(early)
            t0 = time.perf_counter()
            try:
                for e in reading:
                    tiers.fetch_to_ram(li, e, protect=uniq)
            except BaseException:
                if last is not None:  # its RAM sources must not be dropped under the copy
                    last.wait()
                if step.ticket is not None:  # nobody collects it now: stop the lane reading this step's RAM rows
                    step.ticket.cancel[0] = 1
                raise
            store_wait += time.perf_counter() - t0
            late = [(tiers.staging_slot(i, li), tiers.bytes_of(li, e)) for i, e in enumerate(step.staged) if e in pending]
            if late:  # one fill stream: this ticket also covers the early copies
                last = tiers.copier_of(li).copy_many(late)
        elif step.staged:
            last = tiers.copier_of(li).copy_many([(tiers.staging_slot(i, li), tiers.bytes_of(li, e))
                                           for i, e in enumerate(step.staged)])
        if store_wait:
            tiers.stats.add_wait("nvme", store_wait)
            self.host_seconds["store_wait"] += store_wait
        if step.staged:
            if crossed:
                tiers.stats.add_bytes("ram_to_staging", crossed * tiers.layout.nbytes)
        if decode:
            self._deferred = (li, ids, uniq, pcie, step.staged, ahead_later, uniq_l)
        t0 = time.perf_counter()
        if decode:  # the GPU waits for the copies, the host goes on
            if last is not None:
                tiers.copier_of(li).order_compute_after([last])
                if not tiers.keep_all:  # nvme: no store read may reuse a slot being copied from
                    tiers.hold(li, step.staged, last)
        elif last is not None:
            last.wait()
        t_ordered = time.perf_counter()
        waited = t_ordered - t0
        self.host_seconds["plan_copies"] += t_ordered - t_copy - waited - (store_wait - wait_before_copies)
        if step.staged:
            tiers.stats.add_wait("pcie", waited)
            self.host_seconds["copy_wait"] += waited
        t_slots = time.perf_counter()
        if decode:
            step.slots = decode_slots(ids, picks, uniq, tiers.vram[li].slot_of, step.staged, self.cache_slots[li],
                                      step.cpu, self.masked_id(li))
        else:
            step.slots = translate(ids, np.full(self.num_experts, -1, np.int32), step.staged, self.cache_slots[li],
                                   step.cpu, self.masked_id(li))
        t_end = time.perf_counter()
        self.host_seconds["plan_slots"] += t_end - t_slots
        self.host_seconds["plan"] += t_end - t_start - waited - store_wait
        return step

    def ahead(self, li: int, predicted: np.ndarray, busy: Sequence[int] = ()) -> int:
        """Layer li, the one after the layer stepping now, is predicted to pick `predicted` (ids, any shape): read its
        store-only experts into RAM (nvme modes), or admit its RAM experts the policy wants (all-RAM modes, when
        admitting), so their bytes move while the GPU is still busy with the layer before. busy: experts of the
        layer stepping now that must stay (the CPU lane's; all of the step's when called from inside resolve),
        never dropped for a prefetch. Returns the reads or admissions started."""
        if not 0 <= li < len(self.cache_slots):
            return 0
        predicted = np.array(predicted, np.int64, ndmin=2)  # a copy: the caller's buffer is reused
        self._near.pending[li] = predicted
        if self.nvme is not None:
            load = self.nvme.load()
            self.guess_floor = load / (1.0 + load) if 1.0 + load > 0 else 0.0
            protect = {li - 1: list(busy)} if li > 0 and len(busy) else None
            # Most likely first (the read window may fill), and only ranks right often enough for the store's load:
            # on a disk-bound host a wrong guess costs a whole record's read (H200 bench: half the reads were
            # wasted when every rank was read).
            started = self.nvme.prefetch([(li, e) for e in self._likely(predicted)], protect=protect)
            self.prefetched += started
            return started
        tiers = self.tiers
        started = 0
        uniq_l = sorted(set(predicted.ravel().tolist()))
        uniq = np.array(uniq_l, np.int64)
        tiers.poll()
        codes = tiers.where[li][uniq].tolist()
        ram = [e for e, c in zip(uniq_l, codes, strict=True) if c == self._ram_code]
        if ram and self.admit:
            started = len(tiers.try_admit(li, np.array(ram, np.int64), uniq))
        self.prefetched += started
        return started

    def rank_precision(self) -> list[float]:
        """Per guess rank (best first): (hits + 1) / (guesses + 2), the share of guesses the real picks contained."""
        return list(self._near.precision)

    def _likely(self, predicted: np.ndarray) -> list[int]:
        """The predicted experts guessed at a rank right more often than `guess_floor` (live precision; a rank not
        yet scored counts as right), best rank first, each once."""
        precision = self._near.precision
        floor = self.guess_floor
        ranks = [r for r in range(predicted.shape[1]) if r >= len(precision) or precision[r] > floor]
        rows = predicted.tolist()  # one conversion, not a column slice and a list per rank
        out, seen = [], set()
        for r in ranks:
            for row in rows:
                e = row[r]
                if e not in seen:
                    seen.add(e)
                    out.append(e)
        return out

    def _likely_set(self, predicted: np.ndarray) -> set[int]:
        return set(self._likely(predicted))

    # ---- parts ------------------------------------------------------------------------------------------------

    def _plan_lane(self, li: int, ids: np.ndarray, misses: list[int]) -> tuple[list[int], int]:
        """The misses the CPU lane computes this step, and their picks."""
        if not self.lane_in_use():
            return [], 0
        n_cpu = 0
        cpu: list[int] = []
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

    def _count_lookahead(self, li: int, ids: np.ndarray, decode: bool) -> None:
        self._near.score(li, ids, decode)

    def snapshot(self) -> dict:
        doc: dict = {"host_seconds": {k: round(v, 4) for k, v in self.host_seconds.items()},
                     "copied_before_store_wait": self.copied_before_store_wait,
                     "lent_out": self.lent_out,
                     "lookahead": {**self.lookahead.snapshot(), "prefetched": self.prefetched,
                                   "rank_precision": [round(p, 3) for p in self.rank_precision()],
                                   "guess_floor": round(self.guess_floor, 3),
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
