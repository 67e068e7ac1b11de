"""The CPU lane: a worker that computes one layer step's RAM-resident picks on the CPU while the GPU does the rest.

    lane = CpuLane(layout, threads=plan.cpu_threads, cpus=pick_cpus(plan.cpu_threads), stats=tiers.stats)
    ticket = lane.submit(layer, jobs, recompute=exact_path, deadline=lane.deadline_for(predicted_seconds))
    ...                                     # the GPU computes its hits and the PCIe picks meanwhile
    partial = ticket.partial(tokens)        # (tokens, hidden) float32: add it before the shared-expert merge

Failure semantics (never drop an expert's contribution, never a silent wrong token):
- a step that misses its deadline is cancelled; every job the kernel had not finished is recomputed on the exact
  path by the caller's `recompute` callback and counted; jobs it had finished are used (their outputs are
  complete: the kernel marks a job done only after its last write);
- a worker that raises disables the lane with one log line; that step's jobs are all recomputed (a failing
  worker's finished outputs are not trusted) and later steps go to the exact path (`alive` is False, so the
  planner assigns the lane nothing);
- a worker that does not stop within `grace` seconds of a cancelled deadline is treated as dead the same way.
A ticket the GPU already waits on (glm53.exl3.handoff: `partial(..., recompute=False)`) cannot be recomputed, since
the device work a recompute queues could wait behind that very wait: a late lane is waited for instead, up to `stall`
seconds past its deadline, and a job the lane did not finish (a failed, disabled or stalled worker) raises
LaneUnfinished, which fails that step loudly.
The caller must keep every job's slot bytes in place until its ticket resolves: only settled RAM-resident experts
are given to the lane, and the tier machinery neither frees nor rewrites the RAM slots of a step's picks.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .kernel import SWIGLU_LIMIT, CpuKernel, ExpertCall, ExpertGeometry, host_cpus
from .planner import Assignment, LiveFit

log = logging.getLogger("glm53.cpu_lane")

# Deadline policy (not a cost): a step may take this many times its predicted time, and never less than the floor,
# before its unfinished jobs go to the exact path. Generous, because a recompute costs PCIe time the planner
# meant to save; it exists to bound a stall, not to race the GPU.
DEADLINE_FACTOR = 4.0
DEADLINE_FLOOR_S = 0.02
GRACE_S = 1.0
# How long past its deadline a ticket the GPU waits on is still waited for before its worker counts as stalled: a
# lane job takes milliseconds, so this only ends a worker that has stopped.
STALL_S = 10.0


class LaneUnfinished(RuntimeError):
    """Jobs the lane did not finish, on a ticket that may not be recomputed (the GPU waits on it)."""


@dataclass
class LaneJob:
    """One expert for the lane: its slot image where it lies (read in place), and its rows."""

    expert: int
    slot: Any                               # np.ndarray / host torch.Tensor (uint8 slot image)
    x: np.ndarray                           # (rows, hidden) float32, C-contiguous
    token_rows: np.ndarray | None = None    # token index of each row, for partial()
    weights: np.ndarray | None = None       # routing weight of each row, for partial()

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])


# compute(jobs, outs, done, cancel): fill outs[j] and then set done[j] = 1 for each job in turn; return early once
# cancel[0] != 0. Raising means the worker failed.
Compute = Callable[[list[LaneJob], list[np.ndarray], np.ndarray, np.ndarray], None]
# recompute(job) -> (rows, hidden) float32: the same expert on the exact path (PCIe + GPU).
Recompute = Callable[[LaneJob], Any]


def kernel_compute(kernel: CpuKernel, layout: Any, swiglu_limit: float = SWIGLU_LIMIT) -> Compute:
    """The lane's compute on the C++ kernel: one call per step, so the pool wakes once per layer."""
    geo = ExpertGeometry.from_layout(layout)

    def compute(jobs: list[LaneJob], outs: list[np.ndarray], done: np.ndarray, cancel: np.ndarray) -> None:
        calls = [ExpertCall(j.slot, j.x, o) for j, o in zip(jobs, outs, strict=True)]
        kernel.run(calls, geo, swiglu_limit=swiglu_limit, cancel=cancel, done=done)

    return compute


@dataclass
class LaneCounters:
    steps: int = 0
    jobs: int = 0                 # experts computed by the CPU
    picks: int = 0                # their rows
    deadline_misses: int = 0      # steps cancelled at their deadline
    recomputed_jobs: int = 0      # experts recomputed on the exact path: deadline miss, failure, or lane disabled
    recomputed_picks: int = 0
    fallback_jobs: int = 0        # of those, experts submitted while the lane was already disabled
    failures: int = 0
    kernel_seconds: float = 0.0   # worker time in compute
    wait_seconds: float = 0.0     # consumer time blocked on the lane
    recompute_seconds: float = 0.0


class LaneTicket:
    """One submitted step. `outputs()` / `partial()` block until the lane finishes or the deadline passes, then
    resolve every job exactly once (lane result or recomputation); later calls return the same results."""

    def __init__(self, lane: CpuLane, layer: int, jobs: list[LaneJob], recompute: Recompute, deadline_at: float,
                 count_picks: bool):
        self.lane, self.layer, self.jobs = lane, layer, jobs
        self._recompute, self.deadline_at, self._count = recompute, deadline_at, count_picks
        self.outs = [np.empty_like(j.x) for j in jobs]
        self.done = np.zeros(max(1, len(jobs)), np.int32)
        self.cancel = np.zeros(1, np.int32)
        self.error: BaseException | None = None
        self.kernel_seconds = 0.0
        self.deadline_missed = False
        self.recomputed: list[int] = []     # experts that went to the exact path
        self._finished = threading.Event()
        self._results: dict[int, np.ndarray] | None = None
        self._resolve_lock = threading.Lock()

    def ready(self) -> bool:
        return self._finished.is_set()

    def needs_recompute(self) -> bool:
        """Whether the lane has already left some job to the exact path (it failed, or was disabled at submit)."""
        return self.ready() and (self.error is not None or self.deadline_missed or not self.done.all())

    def outputs(self, recompute: bool = True) -> dict[int, np.ndarray]:
        """expert -> (rows, hidden) float32 output, for every job of the step. recompute=False: the GPU waits on this
        ticket, so nothing goes to the exact path: a late lane is waited for (up to the lane's `stall` past the
        deadline) and a job it did not finish raises LaneUnfinished."""
        with self._resolve_lock:
            if self._results is None:
                self._results = self._resolve(recompute)
            return self._results

    def partial(self, tokens: int, recompute: bool = True) -> np.ndarray:
        """sum over jobs of weight * output, scattered to the jobs' token rows: (tokens, hidden) float32."""
        out = np.zeros((tokens, self.lane.geometry.hidden), np.float32)
        results = self.outputs(recompute)
        for job in self.jobs:
            if job.token_rows is None or job.weights is None:
                raise ValueError(f"job for expert {job.expert} has no token_rows/weights: partial() needs both")
            w = np.asarray(job.weights, np.float32).reshape(-1, 1)
            out[np.asarray(job.token_rows)] += w * results[job.expert]
        return out

    def _resolve(self, recompute: bool) -> dict[int, np.ndarray]:
        lane = self.lane
        t0 = time.perf_counter()
        finished = self._finished.wait(max(0.0, self.deadline_at - t0))
        if not finished:
            self.deadline_missed = True
            if not recompute:  # the GPU waits on this ticket: a late lane is still the fastest way to its partial
                finished = self._finished.wait(lane.stall)
        if not finished:
            self.cancel[0] = 1  # the kernel stops at its next work unit
            finished = self._finished.wait(lane.grace)
            if not finished:
                lane._disable(f"worker did not stop within {lane.grace:g} s of a missed deadline (layer {self.layer})")
        waited = time.perf_counter() - t0
        results: dict[int, np.ndarray] = {}
        cpu_picks = redo_picks = 0
        t1 = time.perf_counter()
        for j, job in enumerate(self.jobs):
            # done[] is written before _finished is set (or, for a stuck worker, per job after its last write):
            # a job marked done has a complete output. A worker that raised is trusted with nothing.
            if self.error is None and self.done[j]:
                results[job.expert] = self.outs[j]
                cpu_picks += job.rows
                continue
            if not recompute:
                lane._account(self, cpu_picks, 0, waited, 0.0)
                why = self.error or lane.disabled_reason or f"still running {waited:.1f} s after submit"
                raise LaneUnfinished(f"layer {self.layer}: the CPU lane did not finish expert {job.expert} ({why}), "
                                     "and the GPU waiting on it rules out recomputing it")
            y = np.asarray(_to_numpy(self._recompute(job)), np.float32)
            if y.shape != job.x.shape:
                raise ValueError(f"recompute for expert {job.expert} returned {y.shape}, expected {job.x.shape}")
            results[job.expert] = y
            self.recomputed.append(job.expert)
            redo_picks += job.rows
        lane._account(self, cpu_picks, redo_picks, waited, time.perf_counter() - t1)
        return results


def _to_numpy(y: Any) -> np.ndarray:
    if hasattr(y, "detach"):  # a torch tensor, possibly on the GPU
        y = y.detach().float().cpu().numpy()
    return np.asarray(y)


@dataclass
class HostPin:
    """The thread that starts a pinned lane (the one that goes on to feed the GPU, and every thread it starts
    later: Linux threads inherit the mask) moved onto the CPUs the lane leaves free, and torch's CPU pool bounded to
    as many threads, for the lane's life. Unpinned, they share the lane workers' cores and the lane's kernel runs
    slower inside decode than its calibration measured."""

    tid: int
    cpus: list[int]
    before: set[int]
    torch_threads: int | None

    @classmethod
    def take(cls, lane_cpus: Sequence[int]) -> HostPin | None:
        """None where there is nothing to do: no affinity API, or no CPU left outside the lane."""
        if not hasattr(os, "sched_setaffinity"):
            return None
        free = host_cpus(lane_cpus)
        if not free:
            return None
        tid = threading.get_native_id()
        pin = cls(tid, free, os.sched_getaffinity(tid), _torch_threads(len(free)))
        os.sched_setaffinity(tid, free)
        return pin

    def release(self) -> None:
        try:
            os.sched_setaffinity(self.tid, self.before)
        except OSError:  # the thread has ended: nothing holds the mask any more
            pass
        if self.torch_threads is not None:
            _torch_threads(self.torch_threads)


def _torch_threads(n: int) -> int | None:
    """Set torch's intra-op pool to `n` threads; the previous count, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    return before


class CpuLane:
    """The CPU lane's worker thread, its kernel pool, and its counters."""

    def __init__(self, layout: Any, threads: int, *, cpus: Sequence[int] | None = None, isa: str | None = None,
                 stats: Any = None, swiglu_limit: float = SWIGLU_LIMIT, compute: Compute | None = None,
                 fit: LiveFit | None = None, grace: float = GRACE_S, stall: float = STALL_S,
                 name: str = "glm53-cpu-lane", codebook: str = "mul1", kernel: str | None = None):
        """stats: a glm53.tiers.TierStats (picks by lane, time waited), or None. compute: replaces the kernel (tests
        inject slow or failing ones). fit: a LiveFit fed with every clean step's timing, so the planner's model
        follows the host. isa: calibrate.calibrate_cpu's choice (default: the widest path); kernel: "int" or
        "exact", default the one served on that path (kernel.served_kernel, what calibration timed). codebook: the
        experts' EXL3 codebook (the store identity's quantization.codebook.kind); the kernel decodes mul1 only, and any
        other would give wrong numbers without an error, so it is refused here."""
        if codebook != "mul1":
            raise ValueError(f"the CPU lane decodes EXL3 mul1 experts only; these use {codebook!r}: serve them in "
                             "exact mode (GLM53_MODE=exact or nvme-exact)")
        self.geometry = ExpertGeometry.from_layout(layout)
        self.kernel: CpuKernel | None = None
        self.host_pin: HostPin | None = None
        if compute is None:
            self.kernel = CpuKernel(threads, cpus, isa=isa, kernel=kernel)
            compute = kernel_compute(self.kernel, self.geometry, swiglu_limit)
            if self.kernel.pinned and cpus:
                self.host_pin = HostPin.take(cpus)
        self.threads = threads
        self.stats = stats
        self.fit = fit
        self.grace = grace
        self.stall = stall
        self.counters = LaneCounters()
        self.disabled_reason: str | None = None
        self._compute = compute
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[LaneTicket | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._worker, name=name, daemon=True)
        self._thread.start()

    # ---- state ----------------------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.disabled_reason is None and self._thread.is_alive()

    def deadline_for(self, predicted_seconds: float) -> float:
        """Seconds a step predicted to take `predicted_seconds` may run before its leftovers are recomputed."""
        return max(DEADLINE_FLOOR_S, DEADLINE_FACTOR * predicted_seconds)

    def snapshot(self) -> dict:
        """For /stats."""
        with self._lock:
            doc = asdict(self.counters)
        doc.update(alive=self.alive, disabled_reason=self.disabled_reason, threads=self.threads,
                   isa=self.kernel.isa if self.kernel else None, pinned=self.kernel.pinned if self.kernel else 0,
                   host_cpus=self.host_pin.cpus if self.host_pin else None,
                   kernel=self.kernel.kernel if self.kernel else None)
        if self.fit is not None:
            doc["cost_model"] = self.fit.model().to_json()
        return doc

    # ---- work -----------------------------------------------------------------------------------------------

    def submit(self, layer: int, jobs: Sequence[LaneJob], recompute: Recompute, deadline: float,
               count_picks: bool = True) -> LaneTicket:
        """Queue one layer step's jobs; `deadline` is in seconds from now. count_picks: add the step's picks to
        stats (False when the caller counts them, as the step does)."""
        jobs = list(jobs)
        experts = [j.expert for j in jobs]
        if len(set(experts)) != len(experts):
            raise ValueError(f"layer {layer}: an expert appears twice in one step: {sorted(experts)}")
        for j in jobs:
            if j.x.dtype != np.float32 or j.x.ndim != 2 or j.x.shape[1] != self.geometry.hidden:
                raise ValueError(f"expert {j.expert}: x must be (rows, {self.geometry.hidden}) float32")
        ticket = LaneTicket(self, layer, jobs, recompute, time.perf_counter() + deadline, count_picks)
        if not jobs:
            ticket._finished.set()
        elif not self.alive:
            with self._lock:
                self.counters.fallback_jobs += len(jobs)
            ticket.error = RuntimeError(f"CPU lane disabled: {self.disabled_reason}")
            ticket._finished.set()
        else:
            self._queue.put(ticket)
        return ticket

    def close(self) -> None:
        """Stop the worker after the queued steps; free the kernel's pool."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=max(self.grace, 5.0))
        if self.kernel is not None and not self._thread.is_alive():
            self.kernel.close()
        if self.host_pin is not None:
            self.host_pin.release()
            self.host_pin = None

    def __enter__(self) -> CpuLane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _worker(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            if self.disabled_reason is not None:
                ticket.error = RuntimeError(f"CPU lane disabled: {self.disabled_reason}")
            elif ticket.cancel[0]:
                # Cancelled in the queue behind a slow step: all of it is recomputed. A ticket merely past its deadline
                # is still computed: the GPU may be waiting on it (recompute=False), and a consumer that is not
                # cancels it at once.
                ticket.deadline_missed = True
            else:
                t0 = time.perf_counter()
                try:
                    self._compute(ticket.jobs, ticket.outs, ticket.done, ticket.cancel)
                except BaseException as exc:  # any failure of the worker: the lane is done for, the server is not
                    ticket.error = exc
                    self._disable(f"worker failed: {exc!r}")
                ticket.kernel_seconds = time.perf_counter() - t0
            ticket._finished.set()

    def _disable(self, reason: str) -> None:
        with self._lock:
            if self.disabled_reason is not None:
                return
            self.disabled_reason = reason
            self.counters.failures += 1
        log.error("CPU lane disabled: %s; RAM-tier misses are served over PCIe (exact path) from now on", reason)

    def _account(self, t: LaneTicket, cpu_picks: int, redo_picks: int, waited: float, recompute_s: float) -> None:
        with self._lock:
            c = self.counters
            c.steps += 1
            c.jobs += len(t.jobs) - len(t.recomputed)
            c.picks += cpu_picks
            c.recomputed_jobs += len(t.recomputed)
            c.recomputed_picks += redo_picks
            c.deadline_misses += int(t.deadline_missed)
            c.kernel_seconds += t.kernel_seconds
            c.wait_seconds += waited
            c.recompute_seconds += recompute_s
        if t.recomputed:
            log.warning("CPU lane: layer %d: %d of %d experts recomputed on the exact path (%s)", t.layer,
                        len(t.recomputed), len(t.jobs), "deadline missed" if t.deadline_missed else
                        f"lane disabled: {self.disabled_reason}")
        if self.stats is not None and t._count:
            self.stats.add_picks(t.layer, {"cpu": cpu_picks, "pcie": redo_picks})
            self.stats.add_wait("cpu", waited)
        if self.fit is not None and not t.recomputed and t.error is None and t.jobs:
            self.fit.add_cpu([j.rows for j in t.jobs], t.kernel_seconds, self.threads)


def assignment_json(a: Assignment) -> dict:
    """An Assignment for logs and /stats."""
    return {"cpu": list(a.cpu), "pcie": list(a.pcie), "cpu_us": round(a.cpu_seconds * 1e6, 1),
            "pcie_us": round(a.pcie_seconds * 1e6, 1), "makespan_us": round(a.makespan * 1e6, 1), "exact": a.exact}


def start_lane(layout: Any, pcie_samples: Sequence[Any], threads: int, *, cpus: Sequence[int] | None = None,
               stats: Any = None, codebook: str = "mul1", isas: Sequence[str] | None = None) -> tuple[CpuLane, LiveFit]:
    """Calibrate the CPU kernel on this host for `layout`'s experts and start the lane with a LiveFit that begins
    from that calibration and the engine's measured PCIe samples (fast and nvme modes, at start-up). isas: the
    kernel paths calibration may choose from (default: every one this host runs; a benchmark emulating another
    CPU narrows them)."""
    from .calibrate import calibrate_cpu

    if codebook != "mul1":  # refused before a second of calibration is spent (CpuLane says the same)
        raise ValueError(f"the CPU lane decodes EXL3 mul1 experts only; these use {codebook!r}: serve them in "
                         "exact mode (GLM53_MODE=exact or nvme-exact)")
    if cpus is None:  # one worker per physical core, away from CPU 0 (the thread feeding the GPU)
        from .kernel import pick_cpus

        cpus = pick_cpus(threads)
    cal = calibrate_cpu(threads, cpus, geo=ExpertGeometry.from_layout(layout), isas=isas)
    fit = LiveFit(cal.samples, list(pcie_samples), threads)
    lane = CpuLane(layout, threads, cpus=cpus, isa=cal.isa, stats=stats, fit=fit, codebook=codebook,
                   kernel=cal.kernel)
    host = lane.host_pin.cpus if lane.host_pin else None
    log.info("CPU lane: %d threads (CPUs %s), %s %s kernel, %.0f us per one-row expert; PCIe %.0f us per expert; "
             "the GPU's feeder and torch's pool on CPUs %s", threads, ",".join(map(str, cpus)) if cpus else "unpinned",
             cal.isa, cal.kernel, fit.model().cpu_expert(1) * 1e6, fit.model().pcie.expert_cost(1) * 1e6,
             ",".join(map(str, host)) if host else "shared with the lane")
    return lane, fit

