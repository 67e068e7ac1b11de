"""A routed-expert MoE layer computed through the tiers (the tiers' tests and the nvme bench), and its direct twin.

Both functions group picks by expert, run `expert_forward(slot_image, x_rows)` once per expert in ascending
id order, and combine with `combine` (per token, picks summed in top-k order). Given the same bytes, the
tiered result is therefore bit-identical to the direct one, whichever tier each expert was read from: the
tiers decide only where the bytes come from, never how the sum is formed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .stats import LANES
from .tiers import ExpertTiers, Where

ExpertForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (slot image uint8, x rows) -> y rows
LaneFor = Callable[[int, int], str]  # (layer, expert) -> "pcie" | "cpu", for an expert found in RAM


def admit_always(layer: int, expert: int) -> str:
    return "pcie"


@dataclass
class LayerResult:
    y: torch.Tensor
    picks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LANES, 0))  # per lane, as in stats
    admitted: int = 0  # experts whose copy into a slot started this step
    staged: int = 0  # experts streamed through staging without admission


def group_picks(ids: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """[(expert, token rows, top-k positions)] in ascending expert order."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")  # stable: rows of one expert stay in token order
    experts, starts = np.unique(flat[order], return_index=True)
    out = []
    for i, e in enumerate(experts):
        sel = order[starts[i] : starts[i + 1] if i + 1 < len(starts) else len(order)]
        out.append((int(e), sel // ids.shape[1], sel % ids.shape[1]))
    return out


def combine(x: torch.Tensor, weights: torch.Tensor, ids: np.ndarray, outputs: dict[int, torch.Tensor]) -> torch.Tensor:
    """sum_k weights[t, k] * y_{ids[t, k]}[t], added in k order so the rounding never depends on the tiers."""
    tokens, top_k = ids.shape
    parts = torch.zeros((top_k, tokens, x.shape[1]), dtype=x.dtype, device=x.device)
    for e, rows, ks in group_picks(ids):
        y = outputs[e].to(x.device, x.dtype)
        r, k = torch.from_numpy(rows).to(x.device), torch.from_numpy(ks).to(x.device)
        parts[k, r] = y * weights[r, k].to(x.dtype).unsqueeze(1)
    out = parts[0].clone()
    for k in range(1, top_k):
        out += parts[k]
    return out


def direct_moe(
    x: torch.Tensor,
    ids: torch.Tensor | np.ndarray,
    weights: torch.Tensor,
    expert_bytes: Callable[[int], torch.Tensor],
    expert_forward: ExpertForward,
) -> torch.Tensor:
    """The reference: every expert's bytes from `expert_bytes(e)` (e.g. the checkpoint), no tiers."""
    ids = _ids_np(ids)
    outputs = {}
    for e, rows, _ in group_picks(ids):
        outputs[e] = expert_forward(expert_bytes(e), x[torch.from_numpy(rows).to(x.device)])
    return combine(x, weights, ids, outputs)


def tiered_moe(
    tiers: ExpertTiers,
    layer: int,
    x: torch.Tensor,
    ids: torch.Tensor | np.ndarray,
    weights: torch.Tensor,
    expert_forward: ExpertForward,
    lane_for: LaneFor = admit_always,
    observe: bool = True,
    admit: bool = True,
) -> LayerResult:
    """One MoE layer's routed experts through the tiers.

    Per picked expert: VRAM hit -> compute from its slot; in RAM -> `lane_for` says "cpu" (compute from the RAM
    arena in place) or "pcie" (admit into a slot when the policy agrees, else stream through staging); only in
    the store -> read into RAM first, then as RAM (with a store source attached, every such read of the step is
    in flight before the first wait, and a prefetch still in flight counts as a store pick). All of the step's
    admissions are issued before any compute so their copies overlap. observe=False keeps the picks from the policy
    (they still count in stats); admit=False streams every PCIe miss: prefill uses both, so it never evicts the
    decode hot set.
    `expert_forward` gets the slot image where it lies: a device tensor (VRAM, staging) or a host tensor (RAM,
    for the CPU lane); it must compute the same function from either.
    """
    ids = _ids_np(ids)
    tiers.poll()
    groups = group_picks(ids)
    used = np.array([e for e, _, _ in groups], np.int64)
    tiers.demand_reads(layer, used)
    res = LayerResult(y=x)
    label: dict[int, str] = {}  # the lane each expert's picks are counted in
    route: dict[int, str] = {}  # for experts not in VRAM: "cpu" or "pcie"
    for e in used.tolist():
        # A move in flight (a prefetch's fill, an old victim's write-back) must land before we read anything.
        tiers.stats.add_wait("pcie", tiers.settle(layer, e))
        from_store = tiers.where[layer, e] in (Where.STORE, Where.FROM_STORE)
        if from_store:
            tiers.stats.add_wait("nvme", _timed(lambda e=e: tiers.fetch_to_ram(layer, e, protect=used)))
        if tiers.where[layer, e] == Where.VRAM:
            label[e] = "vram_hit"
            continue
        route[e] = lane_for(layer, e)
        if route[e] not in ("cpu", "pcie"):
            raise ValueError(f"lane_for returned {route[e]!r}; expected 'cpu' or 'pcie'")
        label[e] = "nvme" if from_store else route[e]
    if observe:
        tiers.observe(layer, ids)
    pcie = np.array([e for e, r in route.items() if r == "pcie"], np.int64)
    admitted = tiers.try_admit(layer, pcie, used) if admit and pcie.size else {}
    outputs = {}
    for e, rows, _ in groups:
        if e in admitted:
            tiers.stats.add_wait("pcie", tiers.settle(layer, e))
            src = tiers.bytes_of(layer, e)
        elif label[e] == "vram_hit" or route[e] == "cpu":
            src = tiers.bytes_of(layer, e)
        else:
            t0 = time.perf_counter()
            src = tiers.stage(layer, e)
            tiers.stats.add_wait("pcie", time.perf_counter() - t0)
            res.staged += 1
        t0 = time.perf_counter()
        outputs[e] = expert_forward(src, x[torch.from_numpy(rows).to(x.device)])
        if route.get(e) == "cpu":  # the host waits on the CPU lane for as long as it computes
            tiers.stats.add_wait("cpu", time.perf_counter() - t0)
        res.picks[label[e]] += len(rows)
    res.admitted = len(admitted)
    res.y = combine(x, weights, ids, outputs)
    tiers.stats.add_picks(layer, res.picks)
    return res


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _ids_np(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    ids = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be (tokens, top_k), got shape {ids.shape}")
    return ids.astype(np.int64)
