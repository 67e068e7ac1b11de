"""The lane planner: per layer and step, which missed picks the CPU computes and which cross PCIe. Pure.

A pick that missed VRAM but sits in the RAM tier can be served two ways: the CPU lane computes it in place, or it
crosses PCIe (admitted into a VRAM slot or streamed through staging) and the GPU computes it. The two lanes run
at the same time, so a step takes as long as the slower one; `assign` picks the split that minimises that
makespan under a cost model:

    CPU lane:  cpu.step + sum over its experts of  serial + serial_row*r + (parallel + parallel_row*r) / threads
    PCIe lane: gpu_busy + pcie.step + sum over its experts of  expert + row*r
    (r = rows of that expert this step; a lane with no expert costs nothing, step included)

Nothing here is a hand-set constant: `calibrate` fits every coefficient by non-negative least squares from
measured step timings (calibrate.calibrate_cpu at start-up, the engine's PCIe copies), and LiveFit re-fits from
a moving window of live timings so the model follows the host as it runs.

Experts with the same row count cost the same on either lane, so the exact search only chooses how many of each
row count go to the CPU: at decode (one row each) that is top_k + 1 candidates, and any step whose choices number
at most `max_combos` is solved exactly. Larger steps (prefill) take the best split of the experts sorted by
CPU/PCIe cost ratio, improved by single moves.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

Miss = tuple[int, int]  # (expert id, rows it is picked by this step)


@dataclass(frozen=True)
class CpuCost:
    step: float = 0.0          # once per step that uses the lane: wake-up, activations in, partial out
    serial: float = 0.0        # per expert, not helped by threads (memory-bound share, per-expert sync)
    serial_row: float = 0.0    # per expert-row, not helped by threads
    parallel: float = 0.0      # per expert, divided over threads (the trellis decode)
    parallel_row: float = 0.0  # per expert-row, divided over threads (the FMAs)

    def expert(self, rows: int, threads: int) -> float:
        return self.serial + self.serial_row * rows + (self.parallel + self.parallel_row * rows) / max(1, threads)


@dataclass(frozen=True)
class PcieCost:
    step: float = 0.0    # once per step that sends anything over PCIe (launch, synchronisation)
    expert: float = 0.0  # per expert: its slot image at the measured host->device rate, plus per-copy overhead
    row: float = 0.0     # per expert-row of GPU compute on the streamed expert

    def expert_cost(self, rows: int) -> float:
        return self.expert + self.row * rows


@dataclass(frozen=True)
class CostModel:
    cpu: CpuCost
    pcie: PcieCost
    threads: int                 # CPU-lane threads the CPU costs are evaluated at
    samples: int = 0             # timings behind the fit
    residual: float = 0.0        # RMS of the fit's residuals (seconds)

    def cpu_expert(self, rows: int) -> float:
        return self.cpu.expert(rows, self.threads)

    def to_json(self) -> dict:
        """For /stats: the fitted costs in microseconds, and the per-expert times at 1 and 8 rows."""
        us = 1e6
        return {
            "threads": self.threads,
            "cpu_us": {k: round(v * us, 3) for k, v in asdict(self.cpu).items()},
            "pcie_us": {k: round(v * us, 3) for k, v in asdict(self.pcie).items()},
            "cpu_expert_us": {str(r): round(self.cpu_expert(r) * us, 1) for r in (1, 8)},
            "pcie_expert_us": {str(r): round(self.pcie.expert_cost(r) * us, 1) for r in (1, 8)},
            "samples": self.samples,
            "residual_us": round(self.residual * us, 3),
        }


@dataclass(frozen=True)
class Assignment:
    cpu: tuple[int, ...]          # experts the CPU lane computes
    pcie: tuple[int, ...]         # experts that cross PCIe
    cpu_seconds: float
    pcie_seconds: float           # includes gpu_busy
    exact: bool = True            # False: the heuristic for large steps

    @property
    def makespan(self) -> float:
        return max(self.cpu_seconds, self.pcie_seconds)


# --------------------------------------------------------------------------------------------------------------
# Assignment


def lane_seconds(rows_cpu: Iterable[int], rows_pcie: Iterable[int], model: CostModel,
                 gpu_busy: float = 0.0) -> tuple[float, float]:
    """(CPU lane, PCIe lane) seconds of one split, by the formula in the module docstring."""
    rc, rp = list(rows_cpu), list(rows_pcie)
    cpu = (model.cpu.step + sum(model.cpu_expert(r) for r in rc)) if rc else 0.0
    pcie = gpu_busy + ((model.pcie.step + sum(model.pcie.expert_cost(r) for r in rp)) if rp else 0.0)
    return cpu, pcie


def assign(misses: Sequence[Miss], model: CostModel, *, gpu_busy: float = 0.0, cpu_ok: bool = True,
           max_combos: int = 4096) -> Assignment:
    """Split one layer step's RAM-resident misses between the CPU lane and PCIe to minimise the makespan.

    misses: (expert, rows) per distinct expert. gpu_busy: GPU time of this step that the PCIe lane's work queues
    behind. cpu_ok=False (lane disabled or absent): everything crosses PCIe. Ties go to the split with less total
    work, then to fewer CPU experts (PCIe results are the bit-exact ones)."""
    misses = [(int(e), int(r)) for e, r in misses]
    if not misses or not cpu_ok:
        cpu_s, pcie_s = lane_seconds([], [r for _, r in misses], model, gpu_busy)
        return Assignment((), tuple(e for e, _ in misses), cpu_s, pcie_s)
    classes: dict[int, list[int]] = {}
    for e, r in misses:
        classes.setdefault(r, []).append(e)
    rows = sorted(classes)
    combos = math.prod(len(classes[r]) + 1 for r in rows)
    if combos <= max_combos:
        return _exact(classes, rows, model, gpu_busy)
    return _heuristic(misses, model, gpu_busy)


def _exact(classes: dict[int, list[int]], rows: list[int], model: CostModel, gpu_busy: float) -> Assignment:
    if len(rows) == 1:
        return _exact_one_class(classes[rows[0]], rows[0], model, gpu_busy)
    counts = np.array([len(classes[r]) for r in rows])
    c = np.array([model.cpu_expert(r) for r in rows])
    p = np.array([model.pcie.expert_cost(r) for r in rows])
    # Every choice of how many experts of each row count go to the CPU, as rows of k.
    k = np.array(list(itertools.product(*(range(n + 1) for n in counts))), dtype=np.int64).reshape(-1, len(rows))
    n_cpu, n_pcie = k.sum(axis=1), (counts - k).sum(axis=1)
    t_cpu = np.where(n_cpu > 0, model.cpu.step + k @ c, 0.0)
    t_pcie = gpu_busy + np.where(n_pcie > 0, model.pcie.step + (counts - k) @ p, 0.0)
    span = np.maximum(t_cpu, t_pcie)
    best = np.lexsort((n_cpu, t_cpu + t_pcie, _quantise(span)))[0]
    cpu, pcie = [], []
    for r, kk in zip(rows, k[best].tolist(), strict=True):
        cpu += classes[r][:kk]
        pcie += classes[r][kk:]
    return Assignment(tuple(sorted(cpu)), tuple(sorted(pcie)), float(t_cpu[best]), float(t_pcie[best]))


def _exact_one_class(experts: list[int], rows: int, model: CostModel, gpu_busy: float) -> Assignment:
    """Every expert with the same rows (decode: one each): k to the CPU for k = 0..n, in plain Python (this runs for
    every layer of every token; numpy's per-call overhead would be most of the cost)."""
    n, c, p = len(experts), model.cpu_expert(rows), model.pcie.expert_cost(rows)
    best = None
    for k in range(n + 1):
        tc = model.cpu.step + k * c if k else 0.0
        tp = gpu_busy + (model.pcie.step + (n - k) * p if k < n else 0.0)
        key = (max(tc, tp), tc + tp, k)
        if best is None or _better(key, best[0]):
            best = (key, k, tc, tp)
    _, k, tc, tp = best
    return Assignment(tuple(sorted(experts[:k])), tuple(sorted(experts[k:])), tc, tp)


def _better(a: tuple[float, float, int], b: tuple[float, float, int]) -> bool:
    """Lower makespan (equal within 1e-12 relative counts as a tie), then less total work, then fewer CPU experts."""
    if abs(a[0] - b[0]) > 1e-12 * max(a[0], b[0]):
        return a[0] < b[0]
    return (a[1], a[2]) < (b[1], b[2])


def _quantise(span: np.ndarray) -> np.ndarray:
    # Makespans equal up to float noise count as ties, so the tie-breaks decide between them.
    return np.round(span / max(float(span.max()), 1e-30) * 1e12)


def _heuristic(misses: list[Miss], model: CostModel, gpu_busy: float) -> Assignment:
    """Best prefix of the experts ordered by CPU/PCIe cost (the fractional relaxation's order), then single moves
    between the lanes while any lowers the makespan."""
    cost = {e: (model.cpu_expert(r), model.pcie.expert_cost(r)) for e, r in misses}
    rows = dict(misses)
    order = sorted(cost, key=lambda e: (cost[e][0] / max(cost[e][1], 1e-30), e))

    def span(cpu_set: set[int]) -> tuple[float, float, float]:
        tc, tp = lane_seconds([rows[e] for e in cpu_set], [rows[e] for e in rows if e not in cpu_set], model, gpu_busy)
        return max(tc, tp), tc, tp

    best_set, best = set(), span(set())
    for i in range(1, len(order) + 1):
        s = set(order[:i])
        v = span(s)
        if v[0] < best[0]:
            best_set, best = s, v
    improved = True
    while improved:
        improved = False
        for e in order:
            s = best_set ^ {e}
            v = span(s)
            if v[0] < best[0] * (1 - 1e-12):
                best_set, best, improved = s, v, True
    cpu = tuple(sorted(best_set))
    return Assignment(cpu, tuple(sorted(set(rows) - best_set)), best[1], best[2], exact=False)


# --------------------------------------------------------------------------------------------------------------
# Calibration


@dataclass(frozen=True)
class CpuSample:
    """One measured CPU-lane step: the rows of each expert it computed, the thread count, the seconds it took."""

    rows: tuple[int, ...]
    threads: int
    seconds: float


@dataclass(frozen=True)
class PcieSample:
    """One measured PCIe-lane step: the rows of each expert that crossed PCIe, the seconds until their results."""

    rows: tuple[int, ...]
    seconds: float


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 100) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set). Costs cannot be negative: an unconstrained
    fit of noisy timings would happily trade a negative overhead for a larger slope."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0))) * max(1.0, float(np.abs(b).max(initial=0.0)))
    for _ in range(iters * n):
        grad = a.T @ (b - a @ x)
        if passive.all() or grad[~passive].max(initial=-np.inf) <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


def _cpu_features(s: CpuSample) -> list[float]:
    n, r, t = len(s.rows), float(sum(s.rows)), max(1, s.threads)
    return [1.0, n, r, n / t, r / t]


def _pcie_features(s: PcieSample) -> list[float]:
    return [1.0, len(s.rows), float(sum(s.rows))]


def _fit(features: list[list[float]], seconds: list[float], weights: list[float]) -> tuple[np.ndarray, float]:
    """Least squares in relative error (each residual over its sample's time): in absolute seconds the slow
    samples (one thread, eight rows: tens of ms) outweigh the decode steps the planner prices (a fraction of a
    ms), and an absolute fit misses the decode point several times further than a relative one (docs/results.md)."""
    a = np.array(features, np.float64)
    b = np.array(seconds, np.float64)
    w = np.sqrt(np.array(weights, np.float64)) / np.maximum(b, 1e-9)
    # Scale columns to unit norm so the active-set tolerances mean the same for every coefficient.
    scale = np.linalg.norm(a * w[:, None], axis=0)
    scale[scale == 0] = 1.0
    x = nnls(a * w[:, None] / scale, b * w) / scale
    resid = a @ x - b
    return x, float(np.sqrt(np.average(resid ** 2, weights=weights)))  # the RMS reported stays in seconds


def fit_cpu(samples: Sequence[CpuSample], weights: Sequence[float] | None = None) -> tuple[CpuCost, float]:
    """CpuCost from step timings (at least 5, spanning several expert counts, row counts and thread counts for
    every coefficient to be pinned down; a coefficient the data cannot see comes out 0). Returns (cost, RMS)."""
    if not samples:
        raise ValueError("fit_cpu needs timings")
    x, rms = _fit([_cpu_features(s) for s in samples], [s.seconds for s in samples],
                  list(weights) if weights is not None else [1.0] * len(samples))
    return CpuCost(*map(float, x)), rms


def fit_pcie(samples: Sequence[PcieSample], weights: Sequence[float] | None = None) -> tuple[PcieCost, float]:
    if not samples:
        raise ValueError("fit_pcie needs timings")
    x, rms = _fit([_pcie_features(s) for s in samples], [s.seconds for s in samples],
                  list(weights) if weights is not None else [1.0] * len(samples))
    return PcieCost(*map(float, x)), rms


def calibrate(cpu_samples: Sequence[CpuSample], pcie_samples: Sequence[PcieSample], threads: int,
              cpu_weights: Sequence[float] | None = None, pcie_weights: Sequence[float] | None = None) -> CostModel:
    """The cost model from measured timings, evaluated for a CPU lane of `threads` threads."""
    cpu, rc = fit_cpu(cpu_samples, cpu_weights)
    pcie, rp = fit_pcie(pcie_samples, pcie_weights)
    n = len(cpu_samples) + len(pcie_samples)
    return CostModel(cpu, pcie, threads, n, math.sqrt((rc ** 2 * len(cpu_samples) + rp ** 2 * len(pcie_samples)) / n))


@dataclass
class LiveFit:
    """The cost model, re-fitted from live timings in a moving window on top of the start-up calibration.

    Live steps are mostly decode (one row per expert, one thread count), which alone cannot pin every coefficient,
    so the start-up samples stay in every fit; live ones weigh `live_weight` times more, so where they disagree
    (the host got busier, a tier got hotter) they win. Refits happen every `refit_every` new samples."""

    base_cpu: Sequence[CpuSample]
    base_pcie: Sequence[PcieSample]
    threads: int
    window: int = 512
    live_weight: float = 4.0
    refit_every: int = 32
    _cpu: deque = field(init=False, repr=False)
    _pcie: deque = field(init=False, repr=False)
    _pending: int = field(init=False, default=0, repr=False)
    _model: CostModel | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.base_cpu or not self.base_pcie:
            raise ValueError("LiveFit starts from calibration samples of both lanes")
        self._cpu = deque(maxlen=self.window)
        self._pcie = deque(maxlen=self.window)

    def add_cpu(self, rows: Sequence[int], seconds: float, threads: int | None = None) -> None:
        if rows:
            self._cpu.append(CpuSample(tuple(int(r) for r in rows), threads or self.threads, float(seconds)))
            self._pending += 1

    def add_pcie(self, rows: Sequence[int], seconds: float) -> None:
        if rows:
            self._pcie.append(PcieSample(tuple(int(r) for r in rows), float(seconds)))
            self._pending += 1

    @property
    def live_samples(self) -> int:
        return len(self._cpu) + len(self._pcie)

    def start_model(self) -> CostModel:
        """The start-up calibration alone: the lane's idle cost, before decode's live timings move it."""
        return calibrate(self.base_cpu, self.base_pcie, self.threads)

    def model(self) -> CostModel:
        if self._model is None or self._pending >= self.refit_every:
            cpu = list(self.base_cpu) + list(self._cpu)
            pcie = list(self.base_pcie) + list(self._pcie)
            self._model = calibrate(
                cpu, pcie, self.threads,
                [1.0] * len(self.base_cpu) + [self.live_weight] * len(self._cpu),
                [1.0] * len(self.base_pcie) + [self.live_weight] * len(self._pcie))
            self._pending = 0
        return self._model
