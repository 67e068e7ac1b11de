"""EngineSpec: every size the engine runs with, decided once by the plan and passed down unchanged.

The plan (glm53.plan) builds one from host facts, the model's shape and the settings; `glm53 plan` prints it,
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

from glm53.devices import DeviceShare, check_shares

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


@dataclass(frozen=True)
class EngineSpec:
    engine: str                      # "stock" (plain exllamav3, every expert in VRAM) or a tiered mode
    device: str                      # cuda:N (cpu only under the fake exllamav3 in tests)
    vram_slots: tuple[int, ...]      # routed-expert slots in VRAM, per MoE layer (empty for stock)
    staging_slots: int               # device rows for misses streamed without admission, shared by all layers
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
    # The layer split across GPUs (glm53.devices), in layer order; empty: everything on `device` (one GPU).
    devices: tuple[DeviceShare, ...] = ()

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
    from glm53.tiers.policy import split_budget

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
    ram_slots: int | None = None,
    cpu_threads: int = 0,
    store_threads: int = 0,
    store: str | None = None,
    allow_buffered: bool = False,
    prefill_chunk: int = PREFILL_CHUNK,
    recurrent_cache_bytes: int = RECURRENT_CACHE_BYTES,
    split: str = "uniform",
    devices: Sequence[DeviceShare] = (),
) -> EngineSpec:
    """An EngineSpec with the sizing rules applied: staging defaults to one layer of experts (any prefill chunk
    fits, and exact modes stay bit-exact), raised by `staging_for`; the RAM tier outside the nvme modes holds
    every expert VRAM does not, plus the admission spare (`ram_slots` is required in the nvme modes: there the
    memory cap sizes it). devices: the layer split across GPUs (glm53.devices; `device` is then the first
    share's). Refuses sizes the engine could not run with, naming them."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    devices = tuple(devices)
    kv = max(PAGE, int(kv_tokens) // PAGE * PAGE)
    ctx = min(kv, int(context)) if context else kv
    chunk = max(PAGE, int(prefill_chunk) // PAGE * PAGE)
    common = dict(device=device, kv_tokens=kv, context=ctx, max_concurrency=int(max_concurrency),
                  cache_sequences=int(max_concurrency), prefill_chunk=chunk, allow_buffered=bool(allow_buffered),
                  recurrent_cache_bytes=max(0, int(recurrent_cache_bytes)), devices=devices)
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
        rows = total - sum(slots) + RAM_SPARE_OF_TOP_K * top_k if ram_slots is None else int(ram_slots)
    lane = engine in ("fast", "nvme")
    if lane and cpu_threads < 1:
        raise ValueError(f"{engine} mode needs cpu_threads >= 1 for its CPU lane")
    return EngineSpec(engine, vram_slots=slots, staging_slots=staging, ram_slots=rows,
                      cpu_threads=int(cpu_threads) if lane else 0, store_threads=int(store_threads) if nvme else 0,
                      store=store if nvme else None, split=split, **common)
