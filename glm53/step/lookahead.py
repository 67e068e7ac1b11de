"""Next-layer router lookahead: guess layer l+1's expert picks from layer l's MoE input, to prefetch them.

The residual stream changes little from one layer to the next, so running layer l's router input through
layer l+1's router gives most of layer l+1's picks one layer early: enough lead time to start their
RAM -> VRAM (or NVMe -> RAM) copies while layer l's experts run. `RecallMeter` keeps score of how often the
guess is right, `Guesses` holds each layer's guess until its step and how often each rank is right, which is what
the stepper reads ahead by. Pure torch: it runs on the serving path and in the CPU tests alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()  # a selection, never differentiated; router weights are Parameters that would record a graph
def predict_topk(
    z: torch.Tensor,
    router_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
) -> torch.Tensor:
    """The expert ids a GLM-5 / DeepSeek-V3 `noaux_tc` router picks for rows `z`: (tokens, top_k) int64.

    Same selection as transformers' Glm5NextTextTopkRouter / DeepseekV3TopkRouter: fp32 logits, sigmoid,
    `e_score_correction_bias` added (it steers selection only; the gate weights use the unbiased scores, so
    `norm_topk_prob` and `routed_scaling_factor` never change which ids win), then, with groups, only the
    `topk_group` groups whose two best biased scores sum highest stay eligible. Ids come best first (the
    transformers gate returns them unsorted), so a caller prefetching less than top_k takes a prefix.
    """
    # fp32 as the gate does: bf16 logits would reorder near-ties that the real router resolves in fp32.
    logits = F.linear(z.reshape(-1, z.shape[-1]).float(), router_weight.float())
    scores = logits.sigmoid() + bias.float()
    if n_group > 1:
        grouped = scores.unflatten(-1, (n_group, -1))
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # two best per group, as DeepSeek-V3 ranks them
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(-1, group_scores.topk(topk_group, dim=-1).indices, True)
        scores = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
    return scores.topk(top_k, dim=-1).indices


def _rows(x: Any) -> list[list[int]]:
    if isinstance(x, list) and x and isinstance(x[0], list):
        return x  # already rows of ids (the stepper's per-step path): no round trip through numpy
    rows = np.asarray(x, np.int64)
    return np.atleast_2d(rows).tolist()  # a 1-D list is one row


class RecallMeter:
    """Per layer: how many of the experts actually picked were predicted.

    Row recall = sum over token rows of |pred ∩ actual| / sum of |actual|: what a per-token prefetch would
    have had ready. Expert recall takes each `update` as one step and compares distinct experts: what a
    per-step prefetch (one copy per expert, however many rows want it) would have had ready. Both are pooled
    over all updates (hit and total counts), so long steps weigh more than short ones. Updates run on the
    serving path once per layer step (a few rows of top-8): plain sets, no tensor ops.
    """

    def __init__(self) -> None:
        # The engine thread updates while the server thread snapshots for /stats.
        self._lock = threading.Lock()
        self._layers: dict[int, list[int]] = {}

    def update(self, layer: int, predicted: Any, actual: Any) -> None:
        """One step of `layer`: predicted (rows, any k) and actual (rows, top_k) expert ids, row for row."""
        pred, act = _rows(predicted), _rows(actual)
        if len(pred) != len(act):
            raise ValueError(f"predicted has {len(pred)} rows, actual {len(act)}")
        # A router never picks an expert twice for one row, so counting matches per actual id is |pred ∩ actual|.
        row_hits = picks = 0
        pred_all: set[int] = set()
        act_all: set[int] = set()
        for p, a in zip(pred, act, strict=True):
            ps = set(p)
            row_hits += sum(map(ps.__contains__, a))
            picks += len(a)
            pred_all |= ps
            act_all.update(a)
        self.add(layer, row_hits, picks, len(act_all & pred_all), len(act_all))

    def add(self, layer: int, row_hits: int, picks: int, step_hits: int, experts: int) -> None:
        """One step of `layer` already counted (as `update` counts it): for a caller that goes over the same rows
        for counts of its own, and so counts these in the same pass."""
        layer = int(layer)
        with self._lock:
            c = self._layers.get(layer)
            if c is None:
                c = self._layers[layer] = [0, 0, 0, 0, 0]
            c[0] += row_hits
            c[1] += picks
            c[2] += step_hits
            c[3] += experts
            c[4] += 1

    def snapshot(self) -> dict:
        """{"layers": {layer: {recall, expert_recall, picks, steps}}, "recall", "expert_recall"} (means over layers),
        plus the pooled counts (hits, picks, expert_hits, experts, steps) a caller can difference over a window."""
        with self._lock:
            counts = {layer: list(c) for layer, c in sorted(self._layers.items())}
        layers = {
            layer: {
                "recall": hits / total if total else None,
                "expert_recall": s_hits / s_total if s_total else None,
                "picks": total,
                "steps": steps,
            }
            for layer, (hits, total, s_hits, s_total, steps) in counts.items()
        }

        def mean(key: str) -> float | None:
            vals = [v[key] for v in layers.values() if v[key] is not None]
            return sum(vals) / len(vals) if vals else None

        totals = [sum(c[i] for c in counts.values()) for i in range(5)]
        return {"layers": layers, "recall": mean("recall"), "expert_recall": mean("expert_recall"),
                "hits": totals[0], "picks": totals[1], "expert_hits": totals[2], "experts": totals[3],
                "steps": totals[4]}

    def reset(self) -> None:
        with self._lock:
            self._layers.clear()


class Guesses:
    """Guesses one layer ahead: each layer's guess until its step comes, and how often the guess at each rank (best
    first) was among the real picks, pooled over layers. A guess acted on costs its bytes whether or not it is picked
    and saves them only when it is, so only ranks right often enough are acted on (MoeStepper.guess_floor):
    calibrated live, starting from "yes"."""

    def __init__(self) -> None:
        self.meter = RecallMeter()
        self.pending: dict[int, np.ndarray] = {}  # layer -> the (rows, k) ids guessed for its next step
        self.outside: dict[int, list[list[bool]]] = {}  # layer -> which of those were outside VRAM when guessed
        self.hits: list[int] = []  # plain ints: updated per guess on the per-step path
        self.total: list[int] = []
        self.precision: list[float] = []  # (hits + 1) / (total + 2) per rank, refreshed when the counts change
        # The same for the guesses outside VRAM, by their order among those in a row: what a prestage of a row's
        # first few outside guesses would have had right (docs/decode-step-design.md, item 3).
        self.outside_hits: list[int] = []
        self.outside_total: list[int] = []

    def score(self, li: int, ids: np.ndarray, decode: bool) -> None:
        """Score layer li's pending guess against its real picks `ids` (rows, top_k)."""
        pred, outside = self.pending.pop(li, None), self.outside.pop(li, None)
        if pred is None or not decode or pred.shape[0] != ids.shape[0]:
            return  # no guess, or not for this step's rows (another batch shape came between)
        guesses, reals = pred.tolist(), ids.tolist()
        if outside is not None:
            self._score_outside(guesses, reals, outside)
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

    def _score_outside(self, guesses: list[list[int]], reals: list[list[int]], outside: list[list[bool]]) -> None:
        hits, total = self.outside_hits, self.outside_total
        for guess, real, out in zip(guesses, reals, outside, strict=True):
            real_set, j = set(real), 0
            for e, o in zip(guess, out, strict=True):
                if not o:
                    continue
                if j == len(total):
                    hits.append(0)
                    total.append(0)
                total[j] += 1
                hits[j] += e in real_set
                j += 1

    def outside_precision(self) -> list[float]:
        """Per order among a row's guesses outside VRAM (first first): the share the real picks contained."""
        return [h / t for h, t in zip(self.outside_hits, self.outside_total, strict=True) if t]

    def likely(self, predicted: np.ndarray, floor: float) -> list[int]:
        """The predicted experts guessed at a rank right more often than `floor` (live precision; a rank not yet
        scored counts as right), best rank first, each once."""
        precision = self.precision
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


class LazySets(Mapping[int, set[int]]):
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
