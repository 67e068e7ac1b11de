"""EngineSpec: every size the engine runs with, decided once by the plan and passed down unchanged.

The plan (glm53.planning.plan) builds one from host facts, the model's shape and the settings; `glm53 plan` prints it,
and the engine, the tiers and the store reader take their numbers from it and from nowhere else, so what the
plan says is what loads. `engine_spec` holds the sizing rules that are not about the host (staging, the RAM
tier's rows, the split of VRAM slots by saved routing statistics): the plan uses it, and so do tests and
benchmarks that build an engine for a shape of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from glm53.planning.devices import DeviceShare, check_shares

ENGINES = ("stock", "exact", "fast", "nvme", "nvme-exact")
TIERED = ("exact", "fast", "nvme", "nvme-exact")
PAGE = 256                 # exllamav3's KV page: the cache is a whole number of pages
PREFILL_CHUNK = 2048       # prompt tokens per forward; exllamav3's default chunk
# exllamav3's default host budget for recurrent-state checkpoints: what lets a prompt that shares a prefix with an
# earlier one skip the KDA layers' prefill of it (one checkpoint of GLM-5.3-Flash's 34 KDA layers is ~70 MB).
RECURRENT_CACHE_BYTES = 4 << 30
# RAM rows beyond the experts VRAM does not hold: an admission's victim needs a free row before the admitted
# expert's row is freed (exclusive tiers), and a decode step can admit up to top_k of them.
RAM_SPARE_OF_TOP_K = 2
# nvme modes: RAM slots kept free after each decode step's launch, so that the next step's store reads need no victim
# search while the GPU waits (a batch-1 step reads under one record from the store; docs/results.md). A RAM tier
# that can hold every expert outside VRAM holds these too, or every step would drop one it needs again.
FREE_RAM_SLOTS = 4
DECODE_ROWS = 8            # exllamav3's fused decode kernels take up to this many rows (block_sparse_mlp.MAX_BSZN)


@dataclass(frozen=True)
class EngineSpec:
    engine: str                      # "stock" (plain exllamav3, every expert in VRAM) or a tiered mode
    device: str                      # cuda:N (cpu only under the fake exllamav3 in tests)
    vram_slots: tuple[int, ...]      # routed-expert slots in VRAM, per MoE layer (empty for stock)
    staging_slots: int               # staging ids per MoE layer: experts one step may stream without admission
    ram_slots: int                   # rows of the pinned RAM tier (records of the store in the nvme modes)
    cpu_threads: int                 # CPU-lane threads (fast, nvme; 0 elsewhere)
    store_threads: int               # store reads in flight (nvme modes; 0 elsewhere)
    store: str | None                # the expert store (nvme modes)
    allow_buffered: bool             # the store may be read through the page cache where O_DIRECT is refused
    kv_tokens: int                   # KV cache positions (whole pages)
    context: int                     # the longest sequence a request may have (prompt + completion)
    max_concurrency: int             # requests decoded together
    cache_sequences: int             # recurrent-state slots of the cache (one per concurrent sequence)
    prefill_chunk: int               # prompt tokens per forward
    recurrent_cache_bytes: int       # host RAM for exllamav3's recurrent-state checkpoints (prefix reuse of KDA layers)
    split: str                       # how the VRAM slots were divided among layers, for the plan's reasons
    # The layer split across GPUs (glm53.planning.devices), in layer order; empty: everything on `device` (one GPU).
    devices: tuple[DeviceShare, ...] = ()
    # Device rows of staging of their own (per card); the other staging_slots - staging_rows are borrowed from the
    # cache slots of other layers (`borrowed_rows`) by the steps that need them. None: all staging_slots.
    staging_rows: int | None = None
    vision: bool = True  # the checkpoint's vision tower loads, where it has one (GLM53_MAX_IMAGES=0: not)

    @property
    def dedicated_staging(self) -> int:
        return self.staging_slots if self.staging_rows is None else self.staging_rows

    @property
    def borrowed(self) -> tuple[tuple[int, int], ...]:
        """The (MoE layer, slot) cache slots the staging borrows (glm53.planning.spec.borrowed_rows)."""
        if not self.tiered:
            return ()
        return borrowed_rows(self.vram_slots, self.staging_slots - self.dedicated_staging,
                             link_of_layers(self.devices, len(self.vram_slots)))

    @property
    def tiered(self) -> bool:
        return self.engine in TIERED

    @property
    def nvme(self) -> bool:
        return self.engine in ("nvme", "nvme-exact")

    @property
    def lane(self) -> bool:
        return self.engine in ("fast", "nvme")

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["vram_slots"] = list(self.vram_slots)
        doc["devices"] = [d.to_json() for d in self.devices]
        return doc


def link_of_layers(devices: Sequence[DeviceShare], moe_layers: int) -> list[int]:
    """Each MoE layer's device share (0 for every layer on one GPU)."""
    if not devices:
        return [0] * moe_layers
    from glm53.planning.devices import moe_share_of

    return [int(x) for x in moe_share_of(devices, moe_layers)]


def can_lend(slots: int, rows: int, staging: int) -> bool:
    """Whether `slots` cache slots (one card's) can lend a layer of `staging` ids beside `rows` of its own: twice a
    layer, the most one layer may hold plus the loan."""
    return slots + rows >= 2 * staging


def decode_staging(top_k: int, max_concurrency: int, experts_per_layer: int) -> int:
    """Staging rows a steady decode step can fill: top_k picks for each row of the largest batch exllamav3's decode
    kernels take (DECODE_ROWS), never more rows than sequences. A step that needs more (a prompt's short last chunk,
    a prefill) borrows cache slots (`borrowed_rows`)."""
    return min(experts_per_layer, top_k * max(1, min(DECODE_ROWS, int(max_concurrency))))


def borrowable(vram_slots: Sequence[int], link_of: Sequence[int] | None = None) -> int:
    """The most staging rows every layer can borrow: the cache slots on its card outside its own layer."""
    link_of = [0] * len(vram_slots) if link_of is None else list(link_of)
    total: dict[int, int] = {}
    for s, k in zip(vram_slots, link_of, strict=True):
        total[k] = total.get(k, 0) + int(s)
    return min((total[k] - int(s) for s, k in zip(vram_slots, link_of, strict=True)), default=0)


def borrowed_rows(vram_slots: Sequence[int], need: int,
                  link_of: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
    """The cache slots (MoE layer, slot) that staging borrows: on each card, enough that every layer there finds
    `need` of them in other layers, taken from every layer's last slots in turn, so each layer gives up few and the
    ones populate fills with its coldest experts. A step that stages more experts than the dedicated rows hold
    empties the borrowed slots it uses (glm53.tiers.ExpertTiers.borrow); exact prefill stages a whole layer's picks
    this way in id order, so a separate layer of staging need not sit idle in VRAM during decode.
    Raises ValueError when a layer cannot find `need` (more than `borrowable`)."""
    link_of = [0] * len(vram_slots) if link_of is None else list(link_of)
    need = int(need)
    if need <= 0:
        return ()
    if need > borrowable(vram_slots, link_of):
        raise ValueError(f"staging cannot borrow {need} cache slots for every layer from VRAM slots {list(vram_slots)}: "
                         f"at most {borrowable(vram_slots, link_of)}")
    rows: list[tuple[int, int]] = []
    for k in sorted(set(link_of)):
        layers = [li for li, x in enumerate(link_of) if x == k]
        taken = dict.fromkeys(layers, 0)
        count, depth = 0, 0
        while count - max(taken.values()) < need:
            for li in layers:
                if count - max(taken.values()) >= need:
                    break
                if vram_slots[li] > depth:
                    rows.append((li, int(vram_slots[li]) - 1 - depth))
                    taken[li] += 1
                    count += 1
            depth += 1
    return tuple(sorted(rows))


def kv_cache_bytes(tokens: int, per_token: int) -> int:
    """The MLA cache for `tokens` of context: one page more, since exllamav3 reserves a position past a job's last
    token."""
    return (tokens + PAGE) * per_token


def staging_for(vram_slots: Sequence[int], experts_per_layer: int, staging: int) -> int:
    """The staging rows a layout needs: `staging`, raised past any layer where slots + staging == experts.

    exllamav3 masks router ids outside a layer's local interval only when that interval is not all of its
    experts (block_sparse_mlp: "maxe - mine == num_experts" means no split); a layer whose local slots (its VRAM
    slots plus the shared staging rows) equal the expert count would index the CPU lane's masked picks past its
    slot tables."""
    while any(s + staging == experts_per_layer for s in vram_slots):
        staging += 1
    return staging


def split_budget(counts: np.ndarray, total_slots: int, min_per_layer: int = 0, max_per_layer: int | None = None) -> np.ndarray:
    """Split `total_slots` VRAM slots across layers where each slot buys the most hit rate.

    counts: (num_layers, num_experts) pick statistics. Under a frequency policy the k-th slot of layer l gains
    about the k-th largest share of l's picks; shares sorted descending are concave, so handing out slots by
    the largest next marginal gain (equivalently: the globally largest shares) is optimal. A skewed layer
    gets many slots, a flat one few. Layers with no statistics count as uniform. Returns int64 (num_layers,).
    """
    counts = np.asarray(counts, np.float64)
    num_layers, num_experts = counts.shape
    cap = num_experts if max_per_layer is None else min(max_per_layer, num_experts)
    if not 0 <= min_per_layer <= cap:
        raise ValueError(f"min_per_layer {min_per_layer} outside [0, {cap}]")
    if total_slots > cap * num_layers:
        raise ValueError(f"{total_slots} slots exceed {num_layers} layers x {cap} slots per layer")
    if total_slots < min_per_layer * num_layers:
        raise ValueError(f"{total_slots} slots cannot give {num_layers} layers {min_per_layer} each")
    totals = counts.sum(axis=1, keepdims=True)
    shares = np.where(totals > 0, counts / np.where(totals > 0, totals, 1), 1.0 / num_experts)
    # gains[l, k]: the hit rate the (k+1)-th slot of layer l adds. Rounded so that equal statistics computed
    # two ways (1/288 vs c/sum(c)) tie exactly instead of by their last bit.
    gains = np.round(-np.sort(-shares, axis=1)[:, :cap], 12)
    budgets = np.full(num_layers, min_per_layer, np.int64)
    rest = gains[:, min_per_layer:]
    left = total_slots - budgets.sum()
    if left > 0:
        # Equal gains go to the lower slot index first, so layers with identical statistics (or none) share
        # evenly instead of the first layer taking every tie; then to the lower layer: deterministic.
        layer_idx, k_idx = np.indices(rest.shape)
        order = np.lexsort((layer_idx.reshape(-1), k_idx.reshape(-1), -rest.reshape(-1)))[:left]
        budgets += np.bincount(layer_idx.reshape(-1)[order], minlength=num_layers)
    return budgets


def split_slots(per_layer: int, layers: int, experts_per_layer: int, top_k: int,
                counts: np.ndarray | None, total: int | None = None) -> tuple[tuple[int, ...], str]:
    """VRAM slots per MoE layer, `total` of them (default per_layer x layers): without saved routing statistics
    per_layer each and the remainder one more each in the first layers; with them, split where each slot buys the
    most hit rate (skewed layers get more, flat ones fewer; each keeps at least top_k, or per_layer if that is
    smaller). Returns (slots, how)."""
    total = per_layer * layers if total is None else int(total)
    base, extra = divmod(total, layers)
    even = tuple(min(experts_per_layer, base + (i < extra)) for i in range(layers))
    how = f"uniform ({base} per layer" + (f", {base + 1} in the first {extra}" if extra else "") + ")"
    if counts is None:
        return even, how
    counts = np.asarray(counts, np.float64)
    if counts.shape != (layers, experts_per_layer):
        return even, f"{how}: saved statistics are {counts.shape}, not {(layers, experts_per_layer)}"
    got = split_budget(counts, total, min_per_layer=min(top_k, base))
    slots = tuple(int(s) for s in np.minimum(got, experts_per_layer))
    return slots, f"by saved routing statistics ({min(slots)}-{max(slots)} per layer)"


def engine_spec(
    engine: str,
    *,
    moe_layers: int,
    experts_per_layer: int,
    top_k: int,
    vram_slots: int | Sequence[int] = 0,
    kv_tokens: int,
    context: int | None = None,
    max_concurrency: int = 8,
    device: str = "cuda:0",
    staging_slots: int | None = None,
    staging_rows: int | None = None,
    ram_slots: int | None = None,
    cpu_threads: int = 0,
    store_threads: int = 0,
    store: str | None = None,
    allow_buffered: bool = False,
    prefill_chunk: int = PREFILL_CHUNK,
    recurrent_cache_bytes: int = RECURRENT_CACHE_BYTES,
    split: str = "uniform",
    devices: Sequence[DeviceShare] = (),
    vision: bool = True,
) -> EngineSpec:
    """An EngineSpec with the sizing rules applied: staging defaults to one layer of experts (any prefill chunk
    fits, and exact modes stay bit-exact), raised by `staging_for`; of it, `staging_rows` (default: what a decode
    step fills, `decode_staging`, or all where the cache slots are under twice a layer) are device rows of their own
    and the rest borrowed cache slots (`borrowed_rows`). The RAM tier outside the nvme modes holds every expert VRAM
    does not, the borrowed slots' experts (written back while a step borrows them) and the admission spare
    (`ram_slots` is required in the nvme modes: there the memory cap sizes it). devices: the layer split across GPUs (glm53.planning.devices; `device` is then the first
    share's). Refuses sizes the engine could not run with, naming them."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    devices = tuple(devices)
    kv = max(PAGE, int(kv_tokens) // PAGE * PAGE)
    ctx = min(kv, int(context)) if context else kv
    chunk = max(PAGE, int(prefill_chunk) // PAGE * PAGE)
    common = dict(device=device, kv_tokens=kv, context=ctx, max_concurrency=int(max_concurrency),
                  cache_sequences=int(max_concurrency), prefill_chunk=chunk, allow_buffered=bool(allow_buffered),
                  recurrent_cache_bytes=max(0, int(recurrent_cache_bytes)), devices=devices, vision=bool(vision))
    if engine == "stock":
        check_shares(devices, None, moe_layers)
        return EngineSpec("stock", vram_slots=(), staging_slots=0, ram_slots=0, cpu_threads=0, store_threads=0,
                          store=None, split="every expert in VRAM", **common)
    slots = (int(vram_slots),) * moe_layers if np.isscalar(vram_slots) else tuple(int(s) for s in vram_slots)
    if len(slots) != moe_layers:
        raise ValueError(f"{len(slots)} VRAM slot counts for {moe_layers} MoE layers")
    if any(not 0 <= s <= experts_per_layer for s in slots):
        raise ValueError(f"VRAM slots per layer must be in [0, {experts_per_layer}], got {list(slots)}")
    check_shares(devices, None, moe_layers, slots)
    staging = staging_for(slots, experts_per_layer, experts_per_layer if staging_slots is None else staging_slots)
    if staging < top_k:
        raise ValueError(f"staging_slots {staging} < top_k {top_k}: a decode step could not run")
    link_of = link_of_layers(devices, moe_layers)
    if staging_rows is None:  # a decode step's rows, where the slots can lend the rest
        own = decode_staging(top_k, max_concurrency, experts_per_layer)
        if not can_lend(sum(slots), own, staging):
            own = staging
    else:
        own = int(staging_rows)
    own = min(staging, max(own, top_k, staging - borrowable(slots, link_of)))
    lent = len(borrowed_rows(slots, staging - own, link_of))
    total = moe_layers * experts_per_layer
    nvme = engine in ("nvme", "nvme-exact")
    if nvme:
        if ram_slots is None or not store:
            raise ValueError(f"{engine} needs ram_slots (sized from the memory cap) and the store")
        if ram_slots < experts_per_layer + 1:
            raise ValueError(f"{ram_slots} RAM rows: the nvme tier needs at least {experts_per_layer + 1} (one "
                             f"layer's {experts_per_layer} experts plus one)")
        rows = int(ram_slots)
    else:
        rows = total - sum(slots) + lent + RAM_SPARE_OF_TOP_K * top_k if ram_slots is None else int(ram_slots)
    lane = engine in ("fast", "nvme")
    if lane and cpu_threads < 1:
        raise ValueError(f"{engine} mode needs cpu_threads >= 1 for its CPU lane")
    return EngineSpec(engine, vram_slots=slots, staging_slots=staging, ram_slots=rows,
                      cpu_threads=int(cpu_threads) if lane else 0, store_threads=int(store_threads) if nvme else 0,
                      store=store if nvme else None, split=split, staging_rows=own, **common)
