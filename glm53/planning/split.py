"""The layer split across GPUs: which decoder layers each card runs, and how many expert slots and tokens fit.

Pure, like glm53.planning.plan (which calls it when more than one card is usable, and gives it its own accounting: the
reserve, a prefill chunk's activations and the chunk's cost model). Each card holds a contiguous run of decoder
layers, exllamav3's layer split: their always-used VRAM weights (the embedding stays in host RAM), their MLA
layers' share of the KV cache and their KDA layers' state for the cache's sequences, plus per card the plan's
reserve, the activations of a prefill chunk (every card runs every chunk through its layers) and, in the tiered
modes, its own staging rows (a miss of a layer is copied over that layer's card's link). What is left on a card
buys routed-expert slots for its MoE layers. The split maximises the fewest slots any MoE layer gets (then the
total), so unequal cards get unequal runs of layers; the context is the one the settings ask for, lowered only
when no split leaves top_k slots per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from glm53.planning.devices import DeviceShare
from glm53.planning.settings import Settings, concurrency_of
from glm53.planning.shape import ModelShape
from glm53.planning.spec import PAGE, PREFILL_CHUNK, can_lend, decode_staging, kv_cache_bytes, split_slots
from glm53.planning.units import gib


@dataclass(frozen=True)
class Card:
    cuda: int            # CUDA ordinal
    name: str
    budget: int          # bytes this card may use


@dataclass(frozen=True)
class LayerCosts:
    """What each decoder layer puts on its card, the routed experts aside."""

    weights: tuple[int, ...]      # always-used bytes per layer
    moe: tuple[bool, ...]
    kv_per_token: tuple[int, ...]  # KV bytes per token per layer (0 for the KDA layers)
    state: tuple[int, ...]        # KDA state bytes per layer, the cache's sequences together (0 for MLA layers)
    edge: int                     # the head (and final norm): on the card holding the last layer
    how: str                      # where the per-layer sizes came from, for the reasons


def layer_costs(shape: ModelShape, sequences: int) -> LayerCosts:
    """Per-layer costs from the shape's per-layer facts, or, where the shape lacks them (the built-in defaults),
    GLM's layout: dense layers first, an MLA layer every fourth, the always-used weights spread evenly."""
    n = shape.layers
    moe_ids = set(shape.moe_layer_ids) or set(range(n - shape.moe_layers, n))
    mla_ids = set(shape.mla_layer_ids)
    if not mla_ids and shape.mla_layers:
        every4 = [i for i in range(n) if i % 4 == 3]
        mla_ids = set(every4) if len(every4) == shape.mla_layers else \
            {round((k + 1) * n / shape.mla_layers) - 1 for k in range(shape.mla_layers)}
    if len(shape.layer_bytes) == n:
        weights, edge = tuple(shape.layer_bytes), max(0, shape.always_used_bytes - sum(shape.layer_bytes))
        how = "per-layer sizes from the checkpoint headers; the head on the last card"
    else:
        each = shape.always_used_bytes // n
        weights, edge = (each,) * n, shape.always_used_bytes - each * n
        how = "per-layer sizes not read (no checkpoint headers): the always-used weights spread evenly"
    kda = [i for i in range(n) if i not in mla_ids]
    kv = _spread(shape.kv_bytes_per_token, sorted(mla_ids), n)
    state = _spread(shape.state_bytes_per_seq * sequences, kda, n)
    return LayerCosts(weights, tuple(i in moe_ids for i in range(n)), kv, state, edge, how)


def _spread(total: int, ids: Sequence[int], n: int) -> tuple[int, ...]:
    """`total` bytes over the layers `ids` (of n), evenly to the byte: the per-layer parts sum to the shape's."""
    each, extra = divmod(total, max(1, len(ids)))
    part = {i: each + (k < extra) for k, i in enumerate(ids)}
    return tuple(part.get(i, 0) for i in range(n))


@dataclass(frozen=True)
class CardPlan:
    card: Card
    first: int                    # decoder layers first..last
    last: int
    moe: int                      # MoE layers among them
    slots_per_layer: int
    fixed: int                    # bytes besides the expert slots: weights, KV, state, staging, the overhead
    kv: int
    weights: int                  # its layers' always-used bytes (and the head's, on the last card)
    state: int                    # its KDA layers' state


@dataclass(frozen=True)
class Split:
    cards: tuple[CardPlan, ...]
    staging: int                  # staging rows per card (0: every expert in VRAM, stock exllamav3)
    kv_tokens: int
    overhead: int                 # per card besides its layers and staging: the reserve and prefill activations

    @property
    def slots_per_layer(self) -> tuple[int, ...]:
        """Each MoE layer's slots, in layer order (uniform within a card)."""
        return tuple(c.slots_per_layer for c in self.cards for _ in range(c.moe))

    def shares(self, vram_slots: Sequence[int] | None = None) -> tuple[DeviceShare, ...]:
        """The DeviceShares the EngineSpec carries; vram_slots: per MoE layer, if re-split by routing statistics."""
        slots = list(self.slots_per_layer if vram_slots is None else vram_slots)
        out, moe = [], 0
        for c in self.cards:
            out.append(DeviceShare(c.card.cuda, c.card.name, c.card.budget, c.first, c.last, moe, c.moe,
                                   sum(slots[moe:moe + c.moe])))
            moe += c.moe
        return tuple(out)


class _Sums:
    """Prefix sums of the per-layer costs, so a run of layers costs O(1) to price."""

    def __init__(self, costs: LayerCosts):
        self.n, self.edge = len(costs.weights), costs.edge
        self.weights, self.state, self.kv, self.moe = [0], [0], [0], [0]
        for w, s, kv, moe in zip(costs.weights, costs.state, costs.kv_per_token, costs.moe, strict=True):
            self.weights.append(self.weights[-1] + w)
            self.state.append(self.state[-1] + s)
            self.kv.append(self.kv[-1] + kv)
            self.moe.append(self.moe[-1] + int(moe))

    def card(self, card: Card, first: int, last: int, tokens: int, overhead: int, eb: int, cap: int
             ) -> CardPlan | None:
        """`card` running layers first..last: its slots per MoE layer (None: the layers do not fit). overhead: the
        card's bytes besides its layers (the reserve, prefill activations and staging)."""
        kv = kv_cache_bytes(tokens, self.kv[last + 1] - self.kv[first])
        weights = self.weights[last + 1] - self.weights[first] + (self.edge if last == self.n - 1 else 0)
        state = self.state[last + 1] - self.state[first]
        fixed = overhead + kv + weights + state
        moe = self.moe[last + 1] - self.moe[first]
        free = card.budget - fixed
        if free < 0:
            return None
        per = cap if moe == 0 else min(cap, free // eb // moe)
        return CardPlan(card, first, last, moe, per, fixed, kv, weights, state)


def best_split(cards: Sequence[Card], costs: LayerCosts, *, tokens: int, expert_bytes: int, staging: int,
               overhead: int, cap: int) -> Split | None:
    """The contiguous split of the layers over `cards` (in order, each at least one layer) that maximises the
    fewest slots any MoE layer gets, then the total; None if no split fits the layers at all. cap: the most slots
    a layer may get (experts - 1 when tiered, so that it keeps a miss path; experts for stock). overhead: each
    card's bytes besides its layers and staging."""
    n, k = len(costs.weights), len(cards)
    if k > n:
        return None
    per_card = overhead + staging * expert_bytes
    sums = _Sums(costs)
    # best[c][j]: the best (min slots, total slots, plans) for cards 0..c-1 running layers 0..j-1.
    best: list[dict[int, tuple[int, int, tuple[CardPlan, ...]]]] = [{0: (cap + 1, 0, ())}]
    for c, card in enumerate(cards):
        row: dict[int, tuple[int, int, tuple[CardPlan, ...]]] = {}
        for i, (lo, total, plans) in best[c].items():
            for j in range(i + 1, n - (k - c - 1) + 1):
                cp = sums.card(card, i, j - 1, tokens, per_card, expert_bytes, cap)
                if cp is None:
                    break  # more layers only cost more
                cand = (min(lo, cp.slots_per_layer if cp.moe else lo), total + cp.slots_per_layer * cp.moe,
                        plans + (cp,))
                if j not in row or cand[:2] > row[j][:2]:
                    row[j] = cand
        best.append(row)
    if n not in best[k]:
        return None
    return Split(best[k][n][2], staging, tokens, overhead)


def fit_split(cards: Sequence[Card], costs: LayerCosts, *, context: int, expert_bytes: int, experts: int,
              staging: int, overhead: int, min_slots: int, min_tokens: int, kv_round: int) -> Split | None:
    """The best split at `context` tokens if it leaves every MoE layer `min_slots`; else at the most tokens (a
    multiple of kv_round, at least min_tokens) that does; None when not even min_tokens fit."""
    def at(tokens: int) -> Split | None:
        s = best_split(cards, costs, tokens=tokens, expert_bytes=expert_bytes, staging=staging, overhead=overhead,
                       cap=experts - 1)
        return s if s is not None and min(s.slots_per_layer, default=min_slots) >= min_slots else None

    got = at(context)
    if got is not None:
        return got
    lo, hi = min_tokens // kv_round, context // kv_round
    if lo > hi or at(lo * kv_round) is None:
        return None
    while lo < hi:  # the most tokens that fit: fewer tokens never fit worse
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if at(mid * kv_round) is not None else (lo, mid - 1)
    return at(lo * kv_round)


def stock_split(cards: Sequence[Card], costs: LayerCosts, *, context: int, expert_bytes: int,
                experts: int, overhead: int) -> Split | None:
    """A split holding every routed expert in VRAM at `context` tokens (stock exllamav3, no staging), or None."""
    s = best_split(cards, costs, tokens=context, expert_bytes=expert_bytes, staging=0, overhead=overhead,
                   cap=experts)
    return s if s is not None and min(s.slots_per_layer, default=experts) >= experts else None


# ---------------------------------------------------------------- the plan's use of it


@dataclass(frozen=True)
class CardsPlan:
    split: Split
    vram_slots: tuple[int, ...]   # per MoE layer (re-split within each card by routing statistics if saved)
    how: str                      # how the slots were divided, for the spec
    shares: tuple[DeviceShare, ...]
    chunk: int                    # the prefill chunk every card's activations are sized for
    chunk_why: str                # the plan's choice of it ("" for stock: exllamav3's default)
    accounting: dict[str, int]    # the plan's VRAM terms, every card's together
    reasons: dict[str, str]
    warnings: tuple[str, ...]


def usable(gpus: Sequence, budget_of, min_bytes: int) -> tuple[list, list[str]]:
    """The GPUs with at least `min_bytes` of budget, in CUDA order, and a warning for each card left out."""
    ok = [g for g in gpus if budget_of(g) >= min_bytes]
    warnings = [f"GPU {g.index} ({g.name}, {budget_of(g) / 2**30:.1f} GiB usable) left out: below the "
                f"{min_bytes / 2**30:g} GiB a card needs to hold its share of the layers and an expert cache; "
                f"the model runs on GPU {', '.join(str(o.index) for o in ok)}"
                for g in gpus if g not in ok] if ok else []
    return sorted(ok, key=lambda g: g.cuda if g.cuda is not None else g.index), warnings


def plan_cards(gpus: Sequence, budget_of, shape: ModelShape, settings: Settings, *, reserve: int,
               activations: Callable[[int], int], vision: int = 0, choose_chunk: Callable[[int, Callable[[int], int]], tuple[int, str]],
               min_slots: int, min_tokens: int, kv_round: int, counts=None, counts_why: str = "") -> CardsPlan:
    """Split the model over `gpus` (two or more usable cards, CUDA order), each card paying `reserve` and
    `activations(chunk)` for the prefill chunk. The context is fitted beside exllamav3's 2,048-token chunk; then
    choose_chunk(total slots at 2,048, total slots at a chunk) picks the chunk (glm53.planning.plan's cost model). Raises
    ValueError naming the shortfall and the fix when no split leaves every MoE layer `min_slots` slots and
    `min_tokens` of context. vision: the vision tower's bytes, paid by every card beside the reserve (the split does
    not place the tower)."""
    own_reserve, reserve = reserve, reserve + vision
    cards = [Card(g.cuda if g.cuda is not None else g.index, g.name, budget_of(g)) for g in gpus]
    sequences = concurrency_of(settings)[0]
    costs = layer_costs(shape, sequences)
    eb, experts = shape.expert_bytes, shape.experts_per_layer
    want = min(settings.context, shape.max_context or settings.context)
    context = -(-want // PAGE) * PAGE
    warnings: list[str] = []
    chunk, chunk_why = PREFILL_CHUNK, ""
    split = stock_split(cards, costs, context=context, expert_bytes=eb, experts=experts,
                        overhead=reserve + activations(chunk))
    if split is None:
        # Each card keeps a decode step's staging rows and its prefill borrows the rest of a layer's from the card's
        # cache slots (glm53.planning.spec.borrowed_rows) where they can lend it; else a layer of rows per card.
        rows = decode_staging(shape.top_k, sequences, experts)
        for staging in (rows, experts) if rows < experts else (experts,):
            split, chunk, chunk_why, warnings = _fit_cards(cards, costs, context, eb, experts, staging, reserve,
                                                           activations, choose_chunk, min_slots, min_tokens,
                                                           kv_round, settings)
            if all(can_lend(c.slots_per_layer * c.moe, staging, experts) for c in split.cards if c.moe):
                break
    slots, how = list(split.slots_per_layer), "every expert in VRAM" if not split.staging else "uniform per card"
    if split.staging and counts is not None:
        parts, moe = [], 0
        for c in split.cards:
            got, _ = split_slots(c.slots_per_layer, c.moe, experts, shape.top_k, counts[moe:moe + c.moe])
            parts.extend(got)
            moe += c.moe
        slots, how = parts, f"by saved routing statistics within each card ({min(parts)}-{max(parts)} per layer)"
    elif split.staging:
        how += f"; {counts_why}" if counts_why else ""
    per_card = []
    for c, share in zip(split.cards, split.shares(slots), strict=True):
        per_card.append(f"GPU {c.card.cuda} ({c.card.name}, budget {gib(c.card.budget)}): layers {c.first}-{c.last} "
                        f"({c.moe} MoE) with {gib(c.weights)} of always-used weights, {gib(c.state)} of KDA state, "
                        f"{gib(c.kv)} of KV, {split.staging} staging rows, the {gib(own_reserve)} reserve"
                        + (f", {gib(vision)} for the vision tower" if vision else "") + ", "
                        f"{gib(split.overhead - reserve)} of prefill activations, and {share.vram_slots} expert "
                        f"slots ({c.slots_per_layer} per MoE layer)")
    n = len(split.cards)
    accounting = {"always_used_weights": sum(c.weights for c in split.cards),
                  "kv_cache": sum(c.kv for c in split.cards), "kda_state": sum(c.state for c in split.cards),
                  "staging": n * split.staging * eb, "prefill_activations": n * (split.overhead - reserve),
                  "reserve": n * own_reserve, **({"vision_tower": n * vision} if vision else {}),
                  "expert_slots": sum(slots) * eb}
    reasons = {
        "gpu": (f"{len(cards)} GPUs, the decoder layers split across them (exllamav3's layer split: each layer's "
                "weights, cache and expert slots on its card, its misses over that card's PCIe link), chosen so "
                "the fewest slots any MoE layer gets is the most: " + "; ".join(per_card)
                + f". Per-layer costs: {costs.how}"),
        "vram_slots": (f"{sum(slots)} slots of {eb / 2**20:.1f} MiB across {len(cards)} cards "
                       f"({100 * sum(slots) / shape.experts:.0f}% of experts), {how}"),
        "kv_tokens": (f"{split.kv_tokens} tokens: each card caches its own MLA layers' KV (one page more than the "
                      f"context), {sum(c.kv for c in split.cards) / 2**30:.2f} GiB in all, plus the KDA state of "
                      f"{sequences} sequences (GLM53_MAX_CONCURRENCY) on its KDA layers"),
    }
    return CardsPlan(split, tuple(slots), how, split.shares(slots), chunk, chunk_why, accounting, reasons,
                     tuple(warnings))


def _fit_cards(cards, costs, context: int, eb: int, experts: int, staging: int, reserve: int, activations,
               choose_chunk, min_slots: int, min_tokens: int, kv_round: int, settings: Settings) -> tuple:
    """The tiered split with `staging` rows per card: the context fitted beside a 2,048-token chunk, then the chunk
    the plan's cost model picks. Returns (split, chunk, chunk_why, warnings)."""
    warnings: list[str] = []
    chunk = PREFILL_CHUNK
    split = fit_split(cards, costs, context=context, expert_bytes=eb, experts=experts, staging=staging,
                      overhead=reserve + activations(chunk), min_slots=min_slots, min_tokens=min_tokens,
                      kv_round=kv_round)
    if split is None:
        total = sum(c.budget for c in cards)
        raise ValueError(f"{len(cards)} GPUs with {gib(total)} together cannot hold the layers split across "
                         f"them with {min_slots} expert slots per MoE layer, {staging} staging rows, the "
                         f"{gib(reserve)} reserve and {gib(activations(chunk))} of prefill activations per card "
                         f"and KV for {min_tokens} tokens: use cards with more free VRAM or raise "
                         "GLM53_VRAM_BUDGET_GB")
    if split.kv_tokens < context:
        warnings.append(f"GLM53_CONTEXT={settings.context} does not fit beside {min_slots} expert slots per "
                        f"MoE layer on every card: context lowered to {split.kv_tokens} tokens; set "
                        f"GLM53_CONTEXT={split.kv_tokens} to silence this, or free VRAM")
    tokens = split.kv_tokens

    def at(c: int) -> Split | None:
        s = best_split(cards, costs, tokens=tokens, expert_bytes=eb, staging=staging,
                       overhead=reserve + activations(c), cap=experts - 1)
        return s if s is not None and min(s.slots_per_layer, default=min_slots) >= min_slots else None

    chunk, chunk_why = choose_chunk(sum(split.slots_per_layer),
                                    lambda c: sum(s.slots_per_layer) if (s := at(c)) is not None else 0)
    return at(chunk) or split, chunk, chunk_why, warnings  # the chunk leaves the floor, or the 2,048 fitted beside
