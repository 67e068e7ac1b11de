"""A routed-expert MoE layer computed directly from each expert's bytes (the tests' reference), and the combine.

`direct_moe` groups picks by expert, runs `expert_forward(slot_image, x_rows)` once per expert in ascending id
order, and combines with `combine` (per token, picks summed in top-k order). The real step's tests
(tests/support/step_layer.py) emulate the expert kernels over the step's slot ids the same way, so given the same
bytes an exact step is bit-identical to the direct computation, whichever tier each expert was read from: the
tiers decide only where the bytes come from, never how the sum is formed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

ExpertForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (slot image uint8, x rows) -> y rows


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


def _ids_np(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    ids = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be (tokens, top_k), got shape {ids.shape}")
    return ids.astype(np.int64)
