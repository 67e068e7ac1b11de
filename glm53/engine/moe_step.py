"""The host side of one MoE layer step under exllamav3's expert kernels: where every pick's bytes are read from.

exllamav3 routes, then calls the adapter's seam (glm53.engine.exl3_adapter) with the picks; the seam hands them
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
  how many of them the next layer really picks is counted (recall).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


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


@dataclass
class Step:
    """One resolved layer step."""

    slots: np.ndarray                       # (tokens, top_k) slot id per pick
    staged: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)   # experts the CPU lane computes (their picks are masked)
    ticket: Any = None                      # the lane's LaneTicket, or None: ticket.partial(tokens) at combine


@dataclass
class LookaheadCounts:
    """Next-layer prediction quality: of the experts a step really picked, how many were predicted one layer ahead."""

    steps: int = 0
    predicted: int = 0   # distinct experts predicted
    actual: int = 0      # distinct experts picked
    hits: int = 0        # picked and predicted
    prefetched: int = 0  # reads (nvme) or admissions (all-RAM) started from a prediction

    def recall(self) -> float | None:
        return self.hits / self.actual if self.actual else None

    def snapshot(self) -> dict:
        r = self.recall()
        return {"steps": self.steps, "predicted": self.predicted, "actual": self.actual, "hits": self.hits,
                "prefetched": self.prefetched, "recall": None if r is None else round(r, 4)}


# recompute(layer, expert, x_rows float32 (rows, hidden)) -> (rows, hidden): the exact path for a lane job it
# could not finish (deadline, dead worker).
Recompute = Callable[[int, int, np.ndarray], Any]


class MoeStepper:
    """Decides, per layer step, which tier each pick is read from; owns no tensors of its own."""

    def __init__(self, tiers: Any, cache_slots: Sequence[int], staging_slots: int, *, admit: bool = True,
                 lane: Any = None, fit: Any = None, recompute: Recompute | None = None, nvme: Any = None):
        """tiers: glm53.tiers.ExpertTiers (nvme modes: the NvmeTier's). cache_slots: S per layer. lane: a
        glm53.cpu_lane.CpuLane (fast / nvme modes) with `fit`, the planner's LiveFit, and `recompute`. nvme: the
        NvmeTier, for prefetch."""
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
        self.num_experts = tiers.num_experts
        self.last_assignment: Any = None
        self.lookahead = LookaheadCounts()
        self._predicted: dict[int, np.ndarray] = {}
        self.host_seconds = {"plan": 0.0, "copy_wait": 0.0, "store_wait": 0.0}

    def masked_id(self, li: int) -> int:
        """The slot id exllamav3's kernels ignore for layer li: the first one past its S + P slots."""
        return self.cache_slots[li] + self.staging_slots

    # ---- one step ---------------------------------------------------------------------------------------------

    def resolve(self, li: int, ids: np.ndarray, decode: bool, x: np.ndarray | None = None,
                weights: np.ndarray | None = None) -> Step:
        """Make every pick of layer li readable on the GPU (or give it to the CPU lane) and translate to slots.

        Decode steps (<= MAX_BSZN rows) teach the policy, admit the misses it wants and stream the rest through
        staging, or hand them to the CPU lane where the planner says so (x: the step's (tokens, hidden) float32
        input and weights: (tokens, top_k) routing weights, needed then). Prefill steps neither teach nor admit
        (they must not evict the decode hot set) and stage EVERY picked expert, residents included (a
        device-to-device copy), in ascending id order: the mapping id -> slot is then monotonic, so exllamav3's
        prefill paths, which sort and group picks by expert id, see exactly the stock order and stay
        bit-identical."""
        from glm53.tiers import Where

        t_start = time.perf_counter()
        tiers = self.tiers
        tiers.poll()
        uniq = np.unique(ids)
        self._count_lookahead(li, uniq, decode)
        tiers.demand_reads(li, uniq)  # nvme: every store miss of the step in flight before the first wait
        from_store = np.zeros(self.num_experts, bool)
        store_wait = 0.0
        for e in uniq.tolist():
            w = tiers.settle(li, e)
            if w:
                tiers.stats.add_wait("pcie", w)
            if tiers.where[li, e] in (Where.STORE, Where.FROM_STORE):
                from_store[e] = True
                t0 = time.perf_counter()
                tiers.fetch_to_ram(li, e, protect=uniq)
                store_wait += time.perf_counter() - t0
        if store_wait:
            tiers.stats.add_wait("nvme", store_wait)
            self.host_seconds["store_wait"] += store_wait
        hit = tiers.where[li] == Where.VRAM
        misses = uniq[~hit[uniq]]
        step = Step(slots=np.empty(0))
        if decode:
            tiers.observe(li, ids)
            step.cpu = self._plan_lane(li, ids, misses)
            pcie = np.array([e for e in misses.tolist() if e not in set(step.cpu)], np.int64)
            if self.admit and pcie.size:
                step.admitted = list(tiers.try_admit(li, pcie, uniq))
            step.staged = [int(e) for e in pcie.tolist() if e not in step.admitted]
        else:
            step.staged = [int(e) for e in uniq.tolist()]
        if len(step.staged) > self.staging_slots:
            raise StepError(f"layer {li}: {len(step.staged)} experts to stage in one step exceed the "
                            f"{self.staging_slots} staging slots; raise staging_slots (or lower the prefill chunk)")
        self._count_picks(li, ids, hit, from_store, step.cpu)
        if step.cpu:
            step.ticket = self._submit_lane(li, ids, x, weights, step.cpu)
        t_copy = time.perf_counter()
        last = None
        nbytes = tiers.layout.nbytes
        for i, e in enumerate(step.staged):
            last = tiers.copier.copy(tiers.staging[i], tiers.bytes_of(li, e))
            if not hit[e]:
                tiers.stats.add_bytes("ram_to_staging", nbytes)
        t0 = time.perf_counter()
        for e in step.admitted:
            tiers.settle(li, e)
        if last is not None:
            last.wait()
        waited = time.perf_counter() - t0
        pcie_n = len(step.admitted) + sum(1 for e in step.staged if not hit[e])
        if step.admitted or step.staged:
            tiers.stats.add_wait("pcie", waited)
            self.host_seconds["copy_wait"] += waited
            if self.fit is not None and decode and pcie_n:
                self.fit.add_pcie([int((ids == e).sum()) for e in misses.tolist() if e not in set(step.cpu)],
                                  time.perf_counter() - t_copy)
        slot_of = tiers.vram[li].slot_of if decode else np.full(self.num_experts, -1, np.int32)
        step.slots = translate(ids, slot_of, step.staged, self.cache_slots[li], step.cpu, self.masked_id(li))
        self.host_seconds["plan"] += time.perf_counter() - t_start - waited - store_wait
        return step

    def ahead(self, li: int, predicted: np.ndarray, busy: Sequence[int] = ()) -> int:
        """The next layer (li) is predicted to pick `predicted` (ids, any shape): read its store-only experts into
        RAM (nvme modes), or admit its RAM experts the policy wants (all-RAM modes, when admitting), so their
        bytes move while the GPU is still busy with the layer before. busy: experts of layer li - 1 the CPU lane is
        reading right now (never dropped for a prefetch). Returns the reads or admissions started."""
        from glm53.tiers import Where

        if not 0 <= li < len(self.cache_slots):
            return 0
        uniq = np.unique(np.asarray(predicted, np.int64))
        self._predicted[li] = uniq
        tiers = self.tiers
        started = 0
        if self.nvme is not None:
            protect = {li - 1: list(busy)} if li > 0 and len(busy) else None
            started = self.nvme.prefetch([(li, int(e)) for e in uniq.tolist()], protect=protect)
        elif self.admit:
            tiers.poll()
            ram = np.array([e for e in uniq.tolist() if tiers.where[li, e] == Where.RAM], np.int64)
            if ram.size:
                started = len(tiers.try_admit(li, ram, uniq))
        self.lookahead.prefetched += started
        return started

    # ---- parts ------------------------------------------------------------------------------------------------

    def _plan_lane(self, li: int, ids: np.ndarray, misses: np.ndarray) -> list[int]:
        if self.lane is None or not misses.size:
            return []
        from glm53.cpu_lane.planner import assign

        rows = [(int(e), int((ids == e).sum())) for e in misses.tolist()]
        self.last_assignment = assign(rows, self.fit.model(), cpu_ok=self.lane.alive)
        return sorted(int(e) for e in self.last_assignment.cpu)

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

    def _count_picks(self, li: int, ids: np.ndarray, hit: np.ndarray, from_store: np.ndarray,
                     cpu: list[int]) -> None:
        """Picks by lane: a VRAM hit; else nvme if the step had to read it from the store; else cpu or pcie."""
        on_cpu = np.zeros(self.num_experts, bool)
        on_cpu[cpu] = True
        n_hit = int(hit[ids].sum())
        n_store = int((from_store[ids] & ~hit[ids]).sum())
        n_cpu = int((on_cpu[ids] & ~from_store[ids]).sum())
        self.tiers.stats.add_picks(li, {"vram_hit": n_hit, "nvme": n_store, "cpu": n_cpu,
                                        "pcie": int(ids.size) - n_hit - n_store - n_cpu})

    def _count_lookahead(self, li: int, uniq: np.ndarray, decode: bool) -> None:
        pred = self._predicted.pop(li, None)
        if pred is None or not decode:
            return
        c = self.lookahead
        c.steps += 1
        c.predicted += len(pred)
        c.actual += len(uniq)
        c.hits += int(np.isin(uniq, pred).sum())

    def snapshot(self) -> dict:
        doc: dict = {"host_seconds": {k: round(v, 4) for k, v in self.host_seconds.items()},
                     "lookahead": self.lookahead.snapshot()}
        if self.lane is not None:
            doc["cpu_lane"] = self.lane.snapshot()
            if self.last_assignment is not None:
                from glm53.cpu_lane.lane import assignment_json

                doc["last_assignment"] = assignment_json(self.last_assignment)
        return doc
