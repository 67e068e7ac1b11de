"""One MoE layer step as exllamav3 runs it with the adapter's seam, on CPU (or CUDA) tiers: the real step
(glm53.step.stepper.MoeStepper) resolves the picks to slot ids, the expert kernels are emulated over those slots,
and the combine adds the CPU lane's partial, then runs the step's after-launch bookkeeping.

The emulated kernels compute each picked expert once, in ascending id order, from the bytes its slot id points
at, and sum the picks per token in top-k order (glm53.tiers.combine), as the direct reference does: an exact step
is then bit-identical to the direct computation whichever tier each expert was read from.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import torch
from tier_experts import HIDDEN, build, check_contents, make_experts, route, swiglu

from glm53.step.slots import Resolution
from glm53.step.stepper import MoeStepper
from glm53.tiers import combine, direct_moe, group_picks

MAX_BSZN = 8  # exllamav3's decode row limit (checked by the adapter's contract)


def slot_bytes(tiers, stepper: MoeStepper, li: int, s: int) -> torch.Tensor | None:
    """What exllamav3's kernel reads for slot id s of layer li: a cache slot, a staging slot, or nothing (masked)."""
    S = stepper.cache_slots[li]
    if s == stepper.masked_id(li):
        return None
    return tiers.vram[li].flat(s) if s < S else tiers.staging_slot(s - S, li)  # its link's rows, then borrowed ones


def stepper_for(tiers, staging_slots: int, **kw) -> MoeStepper:
    """The real step over these tiers, each layer's cache slots as the tiers hold them; staging_slots: the tiers'
    (their own rows and the borrowed ones). kw: MoeStepper's (admit, nvme=the NvmeTier in the nvme modes, lane)."""
    return MoeStepper(tiers, [v.num_slots for v in tiers.vram], staging_slots, **kw)


def picks_of(tiers, before: dict | None = None) -> dict[str, int]:
    """The tier stats' picks per lane, less those of `before` (an earlier picks_of): what the steps between counted."""
    now = dict(tiers.stats.snapshot()["picks"])
    return now if before is None else {k: v - before[k] for k, v in now.items()}


def step_layer(tiers, stepper: MoeStepper, li: int, x: torch.Tensor, ids: np.ndarray, w: torch.Tensor,
               expert_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               decode: bool | None = None) -> tuple[torch.Tensor, Resolution]:
    """resolve -> kernels over the slot ids (a masked pick adds exact zeros) -> combine (+ the lane's partial) ->
    after_launch. decode: by rows, as the adapter decides, unless given."""
    decode = len(ids) <= MAX_BSZN if decode is None else decode
    lane = decode and stepper.lane is not None
    x_np = x.detach().cpu().float().numpy() if lane else None
    w_np = w.detach().cpu().float().numpy() if lane else None
    resolved = stepper.resolve(li, ids, decode, x_np, w_np)
    outputs = {}
    for e, rows, ks in group_picks(ids):
        slots = {int(resolved.slots[r, k]) for r, k in zip(rows.tolist(), ks.tolist(), strict=True)}
        assert len(slots) == 1, f"expert {e}'s picks point at several slots {slots}"
        src = slot_bytes(tiers, stepper, li, slots.pop())
        x_rows = x[torch.from_numpy(rows).to(x.device)]
        outputs[e] = torch.zeros_like(x_rows) if src is None else expert_forward(src, x_rows)
    y = combine(x, w, ids, outputs)
    if resolved.ticket is not None:
        y = y + torch.from_numpy(resolved.ticket.partial(len(ids))).to(y.device, y.dtype)
    stepper.after_launch()  # exllamav3's combine
    return y, resolved


def random_steps(seed: int, device: str) -> None:
    """25 random layer steps (decode and prefill) under random budgets, modes and admission; every output
    bit-identical to the direct one, every readable expert's bytes its own."""
    rng = np.random.default_rng(seed)
    num_layers, num_experts, top_k = 2, 12, 4
    experts = make_experts(num_layers, num_experts, seed)
    keep_all = seed % 2 == 0
    vram = [int(v) for v in rng.integers(0, num_experts + 1, num_layers)]
    ram_slots = None if keep_all else int(rng.integers(num_experts + 1, num_layers * num_experts))
    tiers = build(experts, vram, keep_all, ram_slots, device=device, staging_slots=num_experts)
    counts = rng.random((num_layers, num_experts)) * 5 if seed % 3 else None
    tiers.populate(lambda lay, e, out: out.copy_(experts[lay, e]), counts)
    tiers.check_invariants()
    stepper = MoeStepper(tiers, vram, num_experts, admit=bool(rng.random() < 0.8))
    picks = 0
    for _ in range(25):
        layer = int(rng.integers(num_layers))
        ids, w = route(rng, int(rng.choice([1, 2, 3, 5, 12])), num_experts, top_k)
        g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
        x, w = torch.randn(len(ids), HIDDEN, generator=g).to(device), w.to(device)
        want = direct_moe(x, ids, w, lambda e, layer=layer: experts[layer, e], swiglu)
        got, _ = step_layer(tiers, stepper, layer, x, ids, w, swiglu)
        assert torch.equal(got, want), "the step's output differs from the direct computation"
        picks += ids.size
        tiers.settle_all()
        tiers.check_invariants()
        check_contents(tiers, experts)
    snap = tiers.stats.snapshot()
    json.dumps(snap)
    assert snap["picks"]["total"] == picks
    assert sum(layer["picks"] for layer in snap["layers"]) == picks
