"""The plan: which mode to run and how big every tier is, as a pure function of host facts, model shape and settings.

plan(facts, shape, settings) returns a Plan or raises PlanError; it reads no files and runs nothing, so every
decision is testable on fake hosts. Each number carries a reason; each refusal and warning names the fact,
the threshold and the fix. `glm53 plan` prints it and `glm53 serve` obeys it. AUTO_RULES is the mode table;
docs/modes.md renders it and MODE_NEEDS from here (a test keeps them equal).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from glm53.planning.forecast import plan_forecast
from glm53.planning.host import Gpu, HostFacts
from glm53.planning.settings import AUTO_CONCURRENCY, Settings, concurrency_of
from glm53.planning.shape import DEFAULT_SHAPE, ModelShape
from glm53.planning.spec import (
    FREE_RAM_SLOTS,
    PAGE,
    PREFILL_CHUNK,
    RAM_SPARE_OF_TOP_K,
    RECURRENT_CACHE_BYTES,
    EngineSpec,
    borrowed_rows,
    can_lend,
    decode_staging,
    engine_spec,
    kv_cache_bytes,
    link_of_layers,
    split_slots,
)
from glm53.planning.split import CardsPlan, plan_cards, usable
from glm53.planning.units import GIB, MIB, gib, human

IMAGE = "glm53"
# The one-shot that writes the expert store (as in README); refusals print it with the store's path filled in.
PACK_STORE_COMMAND = ("docker run --rm -v /path/to/GLM-5.3-Flash-exl3:/model:ro -v /path/on/nvme:{dir} "
                      f"{IMAGE} pack-store --model /model --out {{path}}")

# Below this much VRAM the expert cache is too small to hold the decode hot set (the reference held ~1,300
# 9 MiB slots on a 24 GB card, serving ~40% of picks); performance collapses rather than degrading.
MIN_GPU_GIB = 20


# Device memory outside every tensor the plan counts (weights, KV, KDA state, staging, slots, a chunk's
# activations): the CUDA context and kernel images, exllamav3's captured graphs, allocator slack and whatever those
# counts miss. Measured as the peak device memory the driver reported for the process minus the counted tensors:
# `glm53 bench depth`, exact mode, full-depth fixture, GLM53_VRAM_BUDGET_GB=24, GLM53_CONTEXT=131072, 8 sequences, a
# 120,000-token prompt + 512 tokens (the run is in docs/results.md), rounded up to 64 MiB.
VRAM_RESERVE = 26 * 64 * MIB
VRAM_RESERVE_SOURCE = "bench depth on an H200, 2026-12-01: driver-seen peak minus the counted tensors, docs/results.md"
# The image the vision tower's activations are budgeted for (height, width): a laptop screenshot, what a coding
# agent pastes. GLM-5.3-Flash's tower cuts 14-pixel patches and merges 2 x 2 of them into one prompt token.
SCREENSHOT = (800, 1280)
VISION_MERGE = 2
VISION_FACTOR = 14 * VISION_MERGE
# Prefill activations, measured likewise: (bytes per chunk token, fixed bytes, source), from
# torch.cuda.max_memory_allocated() during a prefill minus memory_allocated() before it, at chunks of 2,048 and
# 4,096 (the difference is the per-token term). Applies to GLM-5.3-Flash's geometry; None: glm53.planning.shape's estimate.
PREFILL_MEASURED: tuple[int, int, str] | None = None
# The reference appliance keeps 1,376 of GLM-5.3-Flash's 12,096 experts in VRAM on a 24 GB card: the decode hot set
# the plan keeps before it spends VRAM on a longer prefill chunk or more concurrent sequences.
HOT_SET_SHARE = 1376 / 12096
# Prefill chunks the plan chooses from: exllamav3's default 2,048 up to the 2x3090 runtime's 8,192; 1,024 only to
# keep the hot set.
PREFILL_CHUNKS = (1024, 2048, 4096, 8192)
# Prefill compute rate with a chunk's experts on the device, for the chunk's cost model: the 2x3090 runtime's
# measured 1,100-1,155 tok/s (REFERENCE); an estimate for one 3090-class card until the GPU run measures it.
PREFILL_COMPUTE_TOKENS_PER_S = 1150
PREFILL_NEAR_BEST = 0.9
PCIE_GBPS_UNKNOWN = 12.6   # PCIe 3 x16 at 80%: the slowest link a 24 GB card is found on
# Fewer VRAM slots per MoE layer than top_k means every token misses in every layer.
MIN_SLOTS_PER_LAYER_OF_TOP_K = 1
# The plan lowers GLM53_CONTEXT to fit VRAM, but not below this; a shorter context is not worth serving.
MIN_KV_TOKENS = 4096
KV_ROUND = 256
# nvme modes need this much usable RAM: the process itself, NVMe staging, and a RAM tier big enough that
# most misses are not disk reads (the reference ran at a 16 GiB cap; below ~15 GiB it thrashed).
NVME_MIN_RAM_GIB = 15
# The memory cap to suggest for nvme mode: the reference's measured operating point (55 GiB: picks split
# ~39% VRAM / 54% RAM / 7% NVMe). Clamped to what the host has.
NVME_SUGGESTED_GIB = 55
# Below this much usable RAM the plan uses the small-host budget: a thinner margin, half the staging, fewer readers.
SMALL_HOST_GIB = 32
# What the process needs besides the tiers: torch and CUDA host state, tokenizer, request buffers, allocator slack.
RAM_MARGIN = 4 * GIB
RAM_MARGIN_SMALL = int(2.5 * GIB)
# The CPU lane's kernels need these instructions; without them only PCIe/NVMe lanes (the exact modes) remain.
CPU_LANE_FLAGS = ("avx2", "fma", "f16c")
# O_DIRECT reads are blocking preads of one 9 MiB record: this many keep an NVMe drive (or a RAID0) at its
# sequential rate. Readers sleep in the kernel, so they do not take cores from the CPU lane.
NVME_READERS = 8
NVME_READERS_SMALL = 4
RECORD_ALIGN = 4096
# In the nvme modes the recurrent checkpoints take at most this share of usable RAM (2 GiB under a 16 GiB cap).
RECURRENT_SHARE_OF_NVME_RAM = 8

MODES = ("fast", "exact", "nvme", "nvme-exact")


class PlanError(Exception):
    """A refusal: the message names the fact, the threshold and the fix."""

    def __init__(self, message: str, warnings: list[str] | None = None, reasons: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.warnings = list(warnings or [])
        self.reasons = dict(reasons or {})

    def to_json(self) -> dict[str, Any]:
        return {**{k: None for k in Plan.JSON_KEYS}, "error": self.message, "warnings": self.warnings,
                "reasons": ordered(self.reasons)}


# ---------------------------------------------------------------- the decision table


@dataclass(frozen=True)
class Rule:
    """One row of the auto table: conditions (None = any) -> mode ("refuse" = no mode fits)."""

    all_in_vram: bool | None
    fits_ram: bool | None
    nvme_ok: bool | None
    lane_ok: bool | None
    mode: str


# First match wins.
AUTO_RULES = (
    Rule(True, None, None, None, "exact"),    # no misses at all: nothing for a CPU lane to do, bit-exact for free
    Rule(False, True, None, True, "fast"),
    Rule(False, True, None, False, "exact"),
    Rule(False, False, True, True, "nvme"),
    Rule(False, False, True, False, "nvme-exact"),
    Rule(False, False, False, None, "refuse"),
)
CONDITIONS = {
    "all_in_vram": "every routed expert fits in the VRAM budget",
    "fits_ram": "the experts not in VRAM fit in usable RAM (after the margin)",
    "nvme_ok": f"a valid store (exists, O_DIRECT, full size) and usable RAM >= {NVME_MIN_RAM_GIB} GiB",
    "lane_ok": "CPU has " + "/".join(f.upper() for f in CPU_LANE_FLAGS) + ", glm53's CPU-lane kernel loads, and "
               "GLM53_EXACT=0",
}
# What an explicitly requested mode (GLM53_MODE=...) needs from the host.
MODE_NEEDS = {
    "fast": ("fits_ram", "lane_ok"),
    "exact": ("fits_ram",),
    "nvme": ("nvme_ok", "lane_ok"),
    "nvme-exact": ("nvme_ok",),
}


THRESHOLDS = {
    "GPU VRAM (total, free, or GLM53_VRAM_BUDGET_GB) at least": f"{MIN_GPU_GIB} GiB",
    "VRAM reserve (CUDA context, graphs, allocator slack; measured)": f"{VRAM_RESERVE / GIB:g} GiB",
    "VRAM expert slots kept before a longer prefill chunk or more sequences": f"{100 * HOT_SET_SHARE:.1f}% of experts "
                                                                              "(1,376 of GLM-5.3-Flash's 12,096)",
    "prefill chunks": " / ".join(str(c) for c in PREFILL_CHUNKS) + " tokens",
    "VRAM expert slots per MoE layer at least": "top_k (8 for GLM-5.3-Flash)",
    "context the plan may lower GLM53_CONTEXT to, at least": f"{MIN_KV_TOKENS} tokens",
    "usable RAM for nvme modes at least": f"{NVME_MIN_RAM_GIB} GiB",
    "small-host budget below": f"{SMALL_HOST_GIB} GiB usable RAM",
    "RAM margin kept free (normal / small host)": f"{RAM_MARGIN / GIB:g} GiB / {RAM_MARGIN_SMALL / GIB:g} GiB",
    "NVMe reader threads (normal / small host)": f"{NVME_READERS} / {NVME_READERS_SMALL}",
    "suggested --memory for nvme modes": f"{NVME_SUGGESTED_GIB}g (and an equal --memory-swap)",
}


def decide(all_in_vram: bool, fits_ram: bool, nvme_ok: bool, lane_ok: bool) -> str:
    facts = {"all_in_vram": all_in_vram, "fits_ram": fits_ram, "nvme_ok": nvme_ok, "lane_ok": lane_ok}
    for rule in AUTO_RULES:
        if all(getattr(rule, k) in (None, v) for k, v in facts.items()):
            return rule.mode
    raise AssertionError(f"AUTO_RULES do not cover {facts}")  # the table is total; a test walks every case


def render_decision_table() -> str:
    """AUTO_RULES and MODE_NEEDS as markdown; docs/modes.md embeds this text verbatim."""
    cell = {True: "yes", False: "no", None: "-"}
    names = list(CONDITIONS)
    lines = ["| " + " | ".join(names) + " | GLM53_MODE=auto picks |", "|" + "---|" * (len(names) + 1)]
    for r in AUTO_RULES:
        lines.append("| " + " | ".join(cell[getattr(r, n)] for n in names) + f" | {r.mode} |")
    lines += ["", "| condition | meaning |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in CONDITIONS.items()]
    lines += ["", "| GLM53_MODE= | needs |", "|---|---|"]
    lines += [f"| {m} | {', '.join(needs)} |" for m, needs in MODE_NEEDS.items()]
    lines += ["", "| threshold | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in THRESHOLDS.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the plan


@dataclass
class Plan:
    mode: str                       # fast | exact | nvme | nvme-exact | demo
    device: str                     # cuda:N or cpu
    gpu_index: int | None
    gpu_name: str | None
    vram_budget_bytes: int
    vram_slots: int                 # routed experts resident in VRAM, all layers together
    vram_slots_per_layer: int
    ram_slots: int                  # routed experts in the pinned RAM tier (exclusive of VRAM)
    ram_tier_bytes: int
    cpu_threads: int                # CPU-lane threads (0 in exact modes)
    nvme_threads: int               # store reader threads (0 outside nvme modes)
    kv_tokens: int
    budget: str                     # normal | small-host | demo
    store: str | None
    warnings: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    real_model: dict[str, Any] | None = None  # demo only: what GLM-5.3-Flash would get on this host
    engine: EngineSpec | None = None          # every size the engine runs with (None: the demo)
    # What the budgets hold, term by term, in bytes (the VRAM terms sum to at most vram_budget_bytes, every card's
    # together): what a GPU run compares its measured peak with.
    vram_accounting: dict[str, int] = field(default_factory=dict)
    ram_accounting: dict[str, int] = field(default_factory=dict)
    # Per card: index, name, vram_budget_bytes, layers [first, last], vram_slots (glm53.planning.devices.DeviceShare's
    # JSON); one entry on one GPU, none for the demo.
    devices: list[dict[str, Any]] = field(default_factory=list)
    # The decode speed each mode should reach here, every term with its source (glm53.planning.forecast's JSON);
    # None for the demo.
    forecast: dict[str, Any] | None = None

    JSON_KEYS = ("mode", "device", "gpu_index", "gpu_name", "vram_budget_bytes", "vram_slots",
                 "vram_slots_per_layer", "ram_slots", "ram_tier_bytes", "cpu_threads", "nvme_threads",
                 "kv_tokens", "budget", "store", "real_model", "engine", "vram_accounting", "ram_accounting",
                 "devices", "forecast")

    @property
    def exact(self) -> bool:
        return self.mode in ("exact", "nvme-exact")

    def to_json(self) -> dict[str, Any]:
        doc = {k: getattr(self, k) for k in self.JSON_KEYS}
        doc["engine"] = self.engine.to_json() if self.engine is not None else None
        doc["vram_accounting"], doc["ram_accounting"] = dict(self.vram_accounting), dict(self.ram_accounting)
        doc["devices"] = [dict(d) for d in self.devices]
        return {**doc, "warnings": list(self.warnings),
                "reasons": ordered(self.reasons), "error": None}


# The order decisions are shown in: the mode first, then where it runs, then each tier from fastest to slowest.
REASON_ORDER = ("mode", "real_model", "gpu", "vram_slots", "kv_tokens", "sequences", "prefill_chunk", "reserve",
                "vision", "ram_slots", "recurrent_cache", "cpu_threads", "nvme_threads", "store", "engine", "model")


def ordered(reasons: dict[str, str]) -> dict[str, str]:
    rank = {k: i for i, k in enumerate(REASON_ORDER)}
    return dict(sorted(reasons.items(), key=lambda kv: rank.get(kv[0], len(rank))))


def pack_store_command(store_path: str) -> str:
    path = store_path or "/nvx/experts.glm53"
    return PACK_STORE_COMMAND.format(dir=str(PurePosixPath(path).parent), path=path)


@dataclass(frozen=True)
class _Ram:
    usable: int          # min(cap - current, MemAvailable)
    margin: int
    small: bool
    what: str            # the binding fact, for messages: "memory cap 12 GiB" or "MemAvailable 11 GiB"
    capped: bool
    host_weights: int    # weights exllamav3 keeps in host RAM (the embedding table)

    @property
    def kept(self) -> int:
        """What the tiers and the recurrent checkpoints cannot use: the margin and the host-resident weights."""
        return self.margin + self.host_weights

    @property
    def kept_what(self) -> str:
        emb = f" and the {gib(self.host_weights)} embedding table exllamav3 keeps in RAM" if self.host_weights \
            else ""
        return f"a {gib(self.margin)} margin{emb}"


def _ram(facts: HostFacts, shape: ModelShape) -> _Ram:
    mem = facts.memory
    avail = mem.available if mem.available is not None else (mem.total or 0)
    candidates = [(avail, f"MemAvailable {gib(avail)}", False)]
    if mem.limit is not None:
        candidates.append((max(0, mem.limit - (mem.current or 0)),
                           f"memory cap {gib(mem.limit)}", True))
    usable, what, capped = min(candidates, key=lambda c: c[0])
    small = usable < SMALL_HOST_GIB * GIB
    return _Ram(usable, RAM_MARGIN_SMALL if small else RAM_MARGIN, small, what, capped, shape.host_bytes)


def _suggested_cap(facts: HostFacts) -> int:
    """GiB to suggest for --memory in nvme mode: the measured operating point, if the host has it."""
    total = facts.memory.total
    if total is None:
        return NVME_SUGGESTED_GIB
    return max(NVME_MIN_RAM_GIB + 1, min(NVME_SUGGESTED_GIB, int(total / GIB) - 4))


def budget_of(settings: Settings) -> Callable[[Gpu], int]:
    """Each card's VRAM budget: its free VRAM, capped by GLM53_VRAM_BUDGET_GB (0: no cap). The one place the plan
    reads the setting: the one card's budget and every card's of a layer split come from it."""
    cap = int(settings.vram_budget_gb * GIB) if settings.vram_budget_gb else None
    return lambda g: g.free_mib * MIB if cap is None else min(g.free_mib * MIB, cap)


def _pick_gpu(facts: HostFacts, settings: Settings, budget: Callable[[Gpu], int], reasons: dict[str, str]
              ) -> tuple[Gpu, int]:
    """The GPU to serve on and its byte budget, or a refusal naming the VRAM fact and the fix."""
    if not facts.gpus:
        raise PlanError(f"no NVIDIA GPU found: serving GLM-5.3-Flash needs one GPU with >= {MIN_GPU_GIB} GiB: "
                        "run the container with --gpus all (install the NVIDIA container toolkit on the host), "
                        "or leave GLM53_MODEL_DIR empty to serve the demo model on the CPU")
    # PCIe bandwidth first (every miss crosses it), then free VRAM, then the lowest index.
    ranked = sorted(facts.gpus, key=lambda g: (-(g.pcie_gbps or 0), -budget(g), g.index))
    eligible = [g for g in ranked if budget(g) >= MIN_GPU_GIB * GIB]
    if not eligible:
        g = max(facts.gpus, key=budget)
        if g.total_mib * MIB < MIN_GPU_GIB * GIB:
            raise PlanError(f"GPU {g.index} ({g.name}) has {gib(g.total_mib * MIB)} of VRAM < {MIN_GPU_GIB} GiB "
                            "needed for GLM-5.3-Flash: use a 24 GB GPU (RTX 3090/4090 class or larger), or leave "
                            "GLM53_MODEL_DIR empty to serve the demo model")
        if budget(g) < g.free_mib * MIB:  # GLM53_VRAM_BUDGET_GB is what binds
            raise PlanError(f"GLM53_VRAM_BUDGET_GB={settings.vram_budget_gb:g} < {MIN_GPU_GIB} GiB needed for "
                            f"GLM-5.3-Flash: raise it to at least {MIN_GPU_GIB}, or set 0 to use all free VRAM")
        raise PlanError(f"GPU {g.index} ({g.name}) has {gib(g.free_mib * MIB)} free of {gib(g.total_mib * MIB)}, "
                        f"< {MIN_GPU_GIB} GiB needed: stop the other processes using it (see nvidia-smi)")
    g = eligible[0]
    link = f"PCIe {g.pcie_gen or '?'} x{g.pcie_width or '?'}" + (f" ~{g.pcie_gbps:g} GB/s" if g.pcie_gbps else "")
    why = f"GPU {g.index} ({g.name}, {gib(g.free_mib * MIB)} free of {gib(g.total_mib * MIB)}, {link})"
    if len(facts.gpus) > 1:
        others = ", ".join(str(o.index) for o in facts.gpus if o is not g)
        why += (f"; {len(facts.gpus)} GPUs found, only this one has the VRAM for a share of the layers (GPU "
                f"{others} stay idle, see the warnings). Indices are nvidia-smi's, in PCI bus order, as CUDA's with "
                "CUDA_DEVICE_ORDER=PCI_BUS_ID (glm53 sets it). To choose the cards, expose only them: "
                "docker run --gpus '\"device=N,M\"'")
    if (g.pcie_gen or 0) and g.pcie_gen < 4:
        why += ("; the link reads below gen 4 (an idle GPU may downshift, so this is a floor): each 9 MiB "
                "admit costs more, so the planner favours the CPU lane for misses")
    reasons["gpu"] = why
    return g, budget(g)


@dataclass(frozen=True)
class _Vram:
    """What the VRAM budget holds: expert slots (all layers together), staging, KV tokens, cache sequences, the
    prefill chunk, and each term's bytes (the plan's accounting, shown by `glm53 plan`)."""

    slots: int
    staging: int          # staging ids per layer (one layer's experts); 0: every expert fits, stock exllamav3 serves
    staging_rows: int     # of them device rows of their own; the rest are borrowed cache slots
    kv_tokens: int
    sequences: int
    chunk: int
    accounting: dict[str, int]


STOCK_CHUNK_WHY = (f"{PREFILL_CHUNK} tokens (exllamav3's default): every expert is in VRAM, so a chunk streams "
                   "nothing over PCIe and a larger one would only take memory")


def _size_vram(shape: ModelShape, settings: Settings, gpu: Gpu, budget: int, reasons: dict, warnings: list) -> _Vram:
    """Weights, KV, staging, the reserve, the prefill chunk's activations and the KDA state of the cache's sequences
    first; expert slots get the rest. The sequences (not below 1), then the chunk (`_choose_chunk`) are lowered while
    the slots would fall below the decode hot set (`hot_set_floor`); the context only when not even top_k slots per
    layer fit beside a 2,048-token chunk and one sequence."""
    eb = shape.expert_bytes
    reserve, reserve_why = vram_reserve()
    tower, tower_why = vision_tower_bytes(shape, settings.max_images > 0)
    if tower_why:
        reasons["vision"] = tower_why
    act = lambda chunk: prefill_activation_bytes(shape, chunk)[0]  # noqa: E731
    kv_of = lambda tokens: kv_cache_bytes(tokens, shape.kv_bytes_per_token)  # noqa: E731
    seq = shape.state_bytes_per_seq
    want, auto = concurrency_of(settings)
    context = -(-settings.context // PAGE) * PAGE

    def account(kv_tokens: int, staging: int, chunk: int, sequences: int, slots: int) -> dict[str, int]:
        return {"always_used_weights": shape.always_used_bytes, "kv_cache": kv_of(kv_tokens),
                "kda_state": sequences * seq, "staging": staging * eb, "prefill_activations": act(chunk),
                "reserve": reserve, **({"vision_tower": tower} if tower else {}), "expert_slots": slots * eb}

    everything = account(context, 0, PREFILL_CHUNK, want, shape.experts)
    if sum(everything.values()) <= budget:
        reasons["vram_slots"] = (f"{shape.experts} slots of {human(eb)}: every routed expert fits in the budget "
                                 f"{gib(budget)} beside {_terms(everything, 'expert_slots')}: stock exllamav3 "
                                 "serves, no tiers")
        reasons["kv_tokens"] = _kv_reason(shape, context, kv_of(context))
        reasons["sequences"] = _seq_reason(shape, want, settings.max_concurrency, "")
        reasons["prefill_chunk"] = STOCK_CHUNK_WHY
        reasons["reserve"] = reserve_why
        return _Vram(shape.experts, 0, 0, context, want, PREFILL_CHUNK, everything)
    # A whole layer's experts of staging ids: exact prefill stages every picked expert of a layer, in id order. Only
    # a decode step's worth are rows of their own; a wider step borrows the rest from other layers' cache slots,
    # where they can lend it (glm53.planning.spec.can_lend).
    staging = shape.experts_per_layer
    min_slots = MIN_SLOTS_PER_LAYER_OF_TOP_K * shape.top_k * shape.moe_layers
    most = shape.moe_layers * (shape.experts_per_layer - 1)
    whole = [False]  # no loan: the slots cannot lend it (a budget this tight gives up the rows instead)

    def rows_of(sequences: int) -> int:
        own = decode_staging(shape.top_k, sequences, staging)
        return staging if whole[0] else own

    def slots_for(kv_tokens: int, chunk: int, sequences: int) -> int:
        spent = sum(account(kv_tokens, rows_of(sequences), chunk, sequences, 0).values())
        return min(most, (budget - spent) // eb)

    kv_tokens = context
    if slots_for(context, PREFILL_CHUNK, 1) < min_slots:
        whole[0] = not can_lend(min_slots, rows_of(1), staging)  # the fewest slots cannot lend a layer of staging
        room = budget - sum(account(0, rows_of(1), PREFILL_CHUNK, 1, min_slots).values()) + kv_of(0)
        fit = max(0, room // max(1, shape.kv_bytes_per_token) - PAGE) // KV_ROUND * KV_ROUND
        if fit < MIN_KV_TOKENS:
            need = account(MIN_KV_TOKENS, rows_of(1), PREFILL_CHUNK, 1, min_slots)
            raise PlanError(f"VRAM budget {gib(budget)} < {gib(sum(need.values()))} needed for "
                            f"{_terms(need, '')} ({shape.top_k} expert slots per MoE layer, {staging} staging "
                            f"slots, KV for {MIN_KV_TOKENS} tokens, one sequence): use a GPU with more free VRAM or "
                            "raise GLM53_VRAM_BUDGET_GB")
        warnings.append(f"GLM53_CONTEXT={settings.context} needs {gib(kv_of(context))} of KV cache but only "
                        f"{gib(room)} is left after the weights and {shape.top_k} expert slots per layer: context "
                        f"lowered to {fit} tokens; set GLM53_CONTEXT={fit} to silence this, or free VRAM")
        kv_tokens = fit
    floor = hot_set_floor(shape)
    # The sequences asked for come before a longer chunk: a request without a sequence slot waits for another to end.
    # Only the plan's own choice is lowered (GLM53_MAX_CONCURRENCY=0); a number the user gave is kept.
    sequences = want
    while auto and sequences > 1 and slots_for(kv_tokens, PREFILL_CHUNK, sequences) < floor:
        sequences -= 1
    chunk, chunk_why = _choose_chunk(shape, gpu, slots_for(kv_tokens, PREFILL_CHUNK, sequences),
                                     lambda c: slots_for(kv_tokens, c, sequences), floor)
    slots = slots_for(kv_tokens, chunk, sequences)
    if not can_lend(slots, rows_of(sequences), staging):
        whole[0] = True
        slots = slots_for(kv_tokens, chunk, sequences)
    rows = rows_of(sequences)
    acc = account(kv_tokens, rows, chunk, sequences, slots)
    reasons["kv_tokens"] = _kv_reason(shape, kv_tokens, kv_of(kv_tokens))
    lowered = f" for the {floor}-slot hot set beside a {PREFILL_CHUNK}-token chunk" if sequences < want else ""
    reasons["sequences"] = _seq_reason(shape, sequences, settings.max_concurrency, lowered)
    reasons["prefill_chunk"] = chunk_why
    reasons["reserve"] = reserve_why
    reasons["vram_slots"] = (f"{slots} slots of {human(eb)} ({100 * slots / shape.experts:.0f}% of experts, "
                             f"{slots // shape.moe_layers}-{-(-slots // shape.moe_layers)} per MoE layer): budget "
                             f"{gib(budget)} minus {_terms(acc, 'expert_slots')}; "
                             + (f"{rows} staging rows of their own (what a decode step of {sequences} "
                                f"sequence{'s' if sequences != 1 else ''} streams); a prefill stages all of a layer's "
                                f"picks in id order, borrowing the other {staging - rows} of its {staging} staging "
                                "rows from other layers' cache slots while it runs" if rows < staging else
                                f"{staging} staging rows, one layer's experts, since exact prefill stages every picked "
                                "expert of a layer in id order (too few slots to lend them)"))
    if slots < floor:
        warnings.append(f"{slots} VRAM expert slots < {floor} ({100 * HOT_SET_SHARE:.1f}% of experts, the decode hot "
                        f"set the reference appliance keeps on a 24 GB card): fewer picks hit VRAM; lower "
                        f"GLM53_CONTEXT (KV {gib(kv_of(kv_tokens))})"
                        + (f" or GLM53_MAX_CONCURRENCY ({sequences} sequences, {human(seq)} each)" if sequences > 1
                           else "") + " to raise it")
    return _Vram(slots, staging, rows, kv_tokens, sequences, chunk, acc)


def hot_set_floor(shape: ModelShape) -> int:
    """The expert slots the plan keeps before it spends VRAM on a longer prefill chunk or more sequences."""
    return min(shape.moe_layers * (shape.experts_per_layer - 1), math.ceil(HOT_SET_SHARE * shape.experts - 1e-9))


def vram_reserve() -> tuple[int, str]:
    """The reserve's bytes and where the figure comes from."""
    return VRAM_RESERVE, f"{gib(VRAM_RESERVE)}: measured ({VRAM_RESERVE_SOURCE})"


def vision_tower_bytes(shape: ModelShape, images: bool = True) -> tuple[int, str]:
    """VRAM the vision tower holds (0 without one, or with images off) and why: resident, its weights and the
    activations of one screenshot-sized image. Loading it only when an image arrives would give those bytes back to
    expert slots at the cost of a load per image; resident is the choice until that trade is measured."""
    if not shape.vision_bytes:
        return 0, ""
    if not images:
        return 0, (f"images off (GLM53_MAX_IMAGES=0): the vision tower is not loaded, its {gib(shape.vision_bytes)} "
                   "stay with the expert slots")
    h, w = SCREENSHOT
    patches = VISION_MERGE**2 * math.ceil(h / VISION_FACTOR) * math.ceil(w / VISION_FACTOR)
    act = patches * shape.vision_bytes_per_patch
    return shape.vision_bytes + act, (
        f"{gib(shape.vision_bytes + act)}: the vision tower is resident (its weights {gib(shape.vision_bytes)}, and "
        f"{gib(act)} of activations for a {w}x{h} screenshot: {patches} patches at {human(shape.vision_bytes_per_patch)} "
        "each, estimated from exllamav3 1.6.5's tower); a larger image takes more while it is encoded")


def prefill_activation_bytes(shape: ModelShape, chunk: int) -> tuple[int, str]:
    """Device bytes one prefill chunk's forward allocates at its peak, and what that figure is."""
    if PREFILL_MEASURED is not None and shape.prefill_phases == DEFAULT_SHAPE.prefill_phases:
        per_token, fixed, source = PREFILL_MEASURED
        return per_token * chunk + fixed, f"measured ({source})"
    nbytes, phase = shape.prefill_bytes(chunk)
    return nbytes, (f"estimated from exllamav3 1.6.5's temporaries, at their peak in the {phase} (glm53.planning.shape; "
                    "the GPU run's measurement replaces it)")


def prefill_rate(shape: ModelShape, gpu: Gpu, slots_per_layer: int, chunk: int) -> tuple[float, float]:
    """(prompt tokens/s, PCIe seconds per chunk) of tiered prefill: each chunk stages, in every MoE layer, each picked
    expert not resident (expected distinct picks of `chunk` tokens x top_k over the layer's experts) across PCIe,
    then computes; the two do not overlap (a layer's experts run once its staging has landed)."""
    e, k = shape.experts_per_layer, shape.top_k
    picked = (e - slots_per_layer) * (1 - (1 - k / e) ** chunk)
    link = (gpu.pcie_gbps or PCIE_GBPS_UNKNOWN) * 1e9
    stream = shape.moe_layers * picked * shape.expert_bytes / link
    return chunk / (stream + chunk / PREFILL_COMPUTE_TOKENS_PER_S), stream


def _choose_chunk(shape: ModelShape, gpu: Gpu, slots_at_default: int, slots_at, floor: int) -> tuple[int, str]:
    """The prefill chunk: the smallest of PREFILL_CHUNKS (from exllamav3's 2,048 up) whose modelled prefill rate is
    within PREFILL_NEAR_BEST of the best, then the largest at or below it whose activations still leave `floor`
    expert slots (2,048 when none does: a smaller chunk costs prefill rate and does not reach the floor either)."""
    per_layer = slots_at_default // shape.moe_layers
    rates = {c: prefill_rate(shape, gpu, per_layer, c) for c in PREFILL_CHUNKS}
    best = max(r for r, _ in rates.values())
    target = min(c for c in PREFILL_CHUNKS if c >= PREFILL_CHUNK and rates[c][0] >= PREFILL_NEAR_BEST * best)
    keeps = [c for c in PREFILL_CHUNKS if c <= target and slots_at(c) >= floor]
    chunk = max(keeps) if keeps else PREFILL_CHUNK
    link = f"{gpu.pcie_gbps:g} GB/s" if gpu.pcie_gbps else f"{PCIE_GBPS_UNKNOWN:g} GB/s assumed (link unknown)"
    table = ", ".join(f"{c}: {rates[c][0]:.0f} tok/s" for c in PREFILL_CHUNKS)
    why = (f"{chunk} tokens: each chunk stages every picked non-resident expert of each MoE layer over PCIe "
           f"({link}: {rates[chunk][1]:.1f} s a chunk at {per_layer} slots per layer) besides "
           f"{PREFILL_COMPUTE_TOKENS_PER_S} tok/s of compute (an estimate), so the modelled prefill is {table}; "
           f"{target} is the smallest within {100 * PREFILL_NEAR_BEST:.0f}% of the best")
    if chunk < target:
        why += f", lowered to {chunk} so that its activations leave {floor} expert slots" if keeps else (
            f", but no chunk's activations leave {floor} expert slots, so exllamav3's {PREFILL_CHUNK}")
    act, what = prefill_activation_bytes(shape, chunk)
    return chunk, why + f"; its activations take {gib(act)} ({what})"


def _terms(acc: dict[str, int], skip: str) -> str:
    names = {"always_used_weights": "always-used weights", "kv_cache": "KV cache", "kda_state": "KDA state",
             "staging": "staging", "prefill_activations": "prefill activations", "reserve": "the reserve",
             "vision_tower": "the vision tower", "expert_slots": "expert slots"}
    return ", ".join(f"{names[k]} {gib(v)}" for k, v in acc.items() if k != skip and v)


def _kv_reason(shape: ModelShape, tokens: int, kv: int) -> str:
    return (f"{tokens} tokens: {gib(kv)} of MLA cache ({shape.mla_layers} layers, {shape.kv_bytes_per_token} "
            "B/token: fp16 latent, rope key and the indexer's key planes; one page more than the context)")


def _seq_reason(shape: ModelShape, sequences: int, asked: int, lowered: str) -> str:
    given = f"GLM53_MAX_CONCURRENCY={asked}" if asked else f"GLM53_MAX_CONCURRENCY=0: the plan's, at most {AUTO_CONCURRENCY}"
    return (f"{sequences} ({given}{', lowered' + lowered if lowered else ''}): the cache's "
            f"recurrent-state slots, one per sequence decoded together, each {human(shape.state_bytes_per_seq)} of "
            f"KDA state in VRAM ({gib(sequences * shape.state_bytes_per_seq)} in all)")


def _store_problem(facts: HostFacts, shape: ModelShape, settings: Settings, warnings: list[str]) -> str | None:
    """Why the store cannot serve an nvme mode (None = it can)."""
    path = settings.store
    cmd = pack_store_command(path)
    if not path:
        return f"no store configured (GLM53_STORE is empty): run the pack-store container first: {cmd}, then " \
               "set GLM53_STORE=/nvx/experts.glm53"
    st = facts.store
    if st is None or st.path != path:
        return f"store {path} was not inspected (host facts were read without it)"
    if not st.exists:
        return f"store {path} not found: run the pack-store container first: {cmd}"
    if st.odirect is False:
        where = st.mount_point or str(PurePosixPath(path).parent)
        probed = f" ({st.odirect_how})" if st.odirect_how.startswith("probe") else ""
        msg = (f"{where} is on {st.fstype or 'a filesystem'}, which does not support O_DIRECT{probed}: "
               "put the store on ext4 or xfs")
        if not settings.allow_buffered_reads:
            return msg + " (or set GLM53_ALLOW_BUFFERED_READS=1 to read through the page cache, slower)"
        warnings.append(msg + "; reading through the page cache because GLM53_ALLOW_BUFFERED_READS=1 (slower, "
                        "and the page cache counts against the memory cap)")
    elif st.odirect is None:
        warnings.append(f"O_DIRECT support for {path} unknown ({st.odirect_how}): `glm53 preflight` probes it")
    record = -(-shape.expert_bytes // RECORD_ALIGN) * RECORD_ALIGN
    need = shape.experts * record
    if st.size is not None and st.size < need:
        return (f"store {path} is {gib(st.size)} < {gib(need)} for {shape.experts} records of {human(record)}: "
                f"truncated or packed for another model; re-run the pack-store container: {cmd}")
    return None


def _auto_threads(facts: HostFacts) -> tuple[int, str]:
    """The CPU lane's threads when GLM53_CPU_THREADS=0: the cores we may use, minus one for the server."""
    cpu = facts.cpu
    cores = cpu.physical_cores
    limit = f"{cores} physical cores"
    if cpu.quota_cpus is not None and cpu.quota_cpus < cores:
        cores = max(1, math.floor(cpu.quota_cpus))
        limit = f"a CPU quota of {cpu.quota_cpus:g} (docker --cpus)"
    return max(1, cores - 1), limit


def _cpu_threads(facts: HostFacts, settings: Settings, mode: str, reasons: dict, warnings: list) -> int:
    cpu = facts.cpu
    if mode in ("exact", "nvme-exact"):
        if settings.cpu_threads:
            warnings.append(f"GLM53_CPU_THREADS={settings.cpu_threads} ignored: {mode} mode computes no expert "
                            "on the CPU")
        reasons["cpu_threads"] = f"0: {mode} mode serves misses over PCIe/NVMe only (bit-identical numerics)"
        return 0
    auto, limit = _auto_threads(facts)
    numa = (f"; {facts.numa_nodes} NUMA nodes: threads span them, so experts on the far node are read across "
            "the socket link") if facts.numa_nodes > 1 else ""
    if settings.cpu_threads:
        if settings.cpu_threads > auto:
            warnings.append(f"GLM53_CPU_THREADS={settings.cpu_threads} > {auto} ({limit} minus one for the "
                            "server): SMT siblings and the server thread compete with the lane; set 0 for auto")
        reasons["cpu_threads"] = f"{settings.cpu_threads}: GLM53_CPU_THREADS" + numa
        return settings.cpu_threads
    smt = f", SMT siblings unused ({cpu.logical} logical CPUs)" if cpu.smt_siblings > 1 else ""
    reasons["cpu_threads"] = f"{auto}: {limit} minus one for the server{smt}" + numa
    return auto


def plan(facts: HostFacts, shape: ModelShape, settings: Settings, routing: tuple[Any, str] | None = None) -> Plan:
    """Decide the mode and size every tier. Raises PlanError (with the fix) when this host cannot serve.

    routing: (counts or None, why): the routing statistics an earlier run saved for this checkpoint, which split
    the VRAM slots among layers (glm53.planning.spec.split_slots)."""
    if not settings.model_dir:
        return _demo_plan(facts, shape, settings)
    warnings: list[str] = []
    reasons: dict[str, str] = {"model": shape.source}
    try:
        return _plan_real(facts, shape, settings, warnings, reasons, routing)
    except PlanError as exc:
        exc.warnings = warnings + [w for w in exc.warnings if w not in warnings]
        exc.reasons = {**reasons, **exc.reasons}
        raise


@dataclass(frozen=True)
class _Fit:
    """The conditions of the decision table on this host, and the sentence that explains each failing one."""

    all_in_vram: bool
    fits_ram: bool
    nvme_ram_ok: bool
    store_problem: str | None
    lane_missing: tuple[str, ...]   # CPU-lane instructions the CPU lacks
    exact_wanted: bool              # GLM53_EXACT=1
    fast_msg: str                   # why (or how well) the non-VRAM experts fit in RAM
    nvme_ram_msg: str               # why usable RAM is too small for nvme, with the fix
    lane_msg: str

    @property
    def nvme_ok(self) -> bool:
        return self.store_problem is None and self.nvme_ram_ok

    @property
    def lane_ok(self) -> bool:
        return not self.lane_missing and not self.exact_wanted


def _fit(facts: HostFacts, shape: ModelShape, settings: Settings, slots: int, ram: _Ram, warnings: list[str]) -> _Fit:
    rest = (shape.experts - slots) * shape.expert_bytes  # what VRAM cannot hold
    in_use = f", {gib(facts.memory.current or 0)} in use" if ram.capped else ""
    fast_msg = (f"fast/exact mode needs {gib(rest + ram.kept)} of RAM for the {shape.experts - slots} experts not "
                f"in VRAM (with {ram.kept_what}); usable RAM is {gib(ram.usable)} ({ram.what}{in_use})")
    suggested = _suggested_cap(facts)
    fix = (f"run with --memory {suggested}g --memory-swap {suggested}g" if ram.capped
           else "free memory or use a host with more RAM")
    flags = tuple(f.upper() for f in CPU_LANE_FLAGS if f not in facts.cpu.flags)
    missing = flags or (("the CPU-lane kernel",) if facts.lane_kernel_error else ())
    return _Fit(
        all_in_vram=rest == 0,
        fits_ram=rest + ram.kept <= ram.usable,
        nvme_ram_ok=ram.usable >= NVME_MIN_RAM_GIB * GIB,
        store_problem=_store_problem(facts, shape, settings, warnings),
        lane_missing=missing,
        exact_wanted=bool(settings.exact),
        fast_msg=fast_msg,
        nvme_ram_msg=f"{ram.what} < {NVME_MIN_RAM_GIB} GiB needed for nvme mode: {fix}",
        lane_msg=(f"CPU ({facts.cpu.model}) lacks {'/'.join(flags)}, which the CPU lane needs" if flags
                  else f"the CPU-lane kernel cannot run here ({facts.lane_kernel_error})" if facts.lane_kernel_error
                  else ""),
    )


def _choose_mode(fit: _Fit, settings: Settings, reasons: dict[str, str], warnings: list[str]) -> str:
    """GLM53_MODE=auto walks AUTO_RULES; an explicit mode is checked against MODE_NEEDS."""
    if settings.mode == "auto":
        mode = decide(fit.all_in_vram, fit.fits_ram, fit.nvme_ok, fit.lane_ok)
        if mode == "refuse":
            problems = ([] if fit.nvme_ram_ok else [fit.nvme_ram_msg]) + [p for p in [fit.store_problem] if p]
            raise PlanError("; and ".join(problems) + f". (Why not fast: {fit.fast_msg}.)")
        exact_why = fit.lane_msg or "GLM53_EXACT=1 asks for bit-exact numerics"
        why = {"exact": "every expert fits in VRAM: no misses, so no CPU lane" if fit.all_in_vram
               else f"the experts fit in RAM, and {exact_why}",
               "fast": f"the experts not in VRAM fit in RAM ({fit.fast_msg}) and the CPU has AVX2/FMA/F16C",
               "nvme": f"{fit.fast_msg}; the store is valid and usable RAM >= {NVME_MIN_RAM_GIB} GiB",
               "nvme-exact": f"{fit.fast_msg}; the store is valid; and {exact_why}"}[mode]
        reasons["mode"] = f"{mode} (GLM53_MODE=auto): {why}"
        return mode
    mode = settings.mode
    if settings.exact:
        warnings.append(f"GLM53_EXACT=1 ignored: GLM53_MODE={mode} was set explicitly")
    problems = {"fits_ram": None if fit.fits_ram else f"{fit.fast_msg}: use GLM53_MODE=auto or nvme with a store",
                "lane_ok": f"{fit.lane_msg}: use GLM53_MODE=exact or nvme-exact (or auto)" if fit.lane_msg else None,
                "nvme_ok": fit.store_problem if fit.nvme_ram_ok else fit.nvme_ram_msg}
    for need in MODE_NEEDS[mode]:
        if problems[need]:
            raise PlanError(f"GLM53_MODE={mode} refused: {problems[need]}")
    reasons["mode"] = f"{mode} (GLM53_MODE={mode}; the host meets its needs: {', '.join(MODE_NEEDS[mode])})"
    return mode


@dataclass(frozen=True)
class _RamTier:
    slots: int
    staging_records: int
    nvme_threads: int
    budget: str
    record_bytes: int      # one RAM row: an expert's slot image, or a 4 KiB-aligned store record
    recurrent_cache: int   # host bytes for exllamav3's recurrent-state checkpoints


def _size_ram(facts: HostFacts, shape: ModelShape, settings: Settings, mode: str, fit: _Fit, vram: int, ram: _Ram,
              reasons: dict[str, str], warnings: list[str], lent: int = 0) -> _RamTier:
    """Exclusive RAM tier: every non-VRAM expert in fast/exact (and those of the `lent` cache slots staging may
    borrow, written back meanwhile); what the memory allows in the nvme modes (a borrowed slot's expert displaces
    the weakest RAM expert there), at most all of those."""
    eb = shape.expert_bytes
    spare = RAM_SPARE_OF_TOP_K * shape.top_k if vram < shape.experts else 0
    if mode not in ("nvme", "nvme-exact"):
        ram_slots = shape.experts - vram + lent + spare
        recurrent = max(0, min(RECURRENT_CACHE_BYTES, ram.usable - ram.kept - ram_slots * eb))
        reasons["ram_slots"] = (f"{ram_slots} slots ({gib(ram_slots * eb)}): every expert not in VRAM, exclusive "
                                f"of it, " + (f"{lent} for the experts of the cache slots a prefill borrows as "
                                              "staging, " if lent else "")
                                + f"plus {spare} spare rows for admissions' victims; usable RAM "
                                f"{gib(ram.usable)} ({ram.what})")
        reasons["recurrent_cache"] = _recurrent_reason(shape, recurrent,
                                                       f"what RAM has left after the tier and {ram.kept_what}")
        reasons["nvme_threads"] = f"0: {mode} mode keeps every expert in VRAM or RAM"
        if settings.store:
            reasons["store"] = f"{settings.store} not used in {mode} mode" + (
                f" ({fit.store_problem})" if fit.store_problem else "")
            if fit.store_problem:
                warnings.append(f"GLM53_STORE is set but unusable, and {mode} mode does not need it: "
                                f"{fit.store_problem}")
        return _RamTier(ram_slots, 0, 0, "normal", eb, recurrent)
    # The RAM tier's rows are store records, each 4 KiB-aligned for O_DIRECT. Prefetched records are budgeted as
    # two layers' picks, double-buffered (one layer on a small host).
    record = -(-eb // RECORD_ALIGN) * RECORD_ALIGN
    staging = (shape.top_k if ram.small else 2 * shape.top_k) * 2
    need = shape.experts_per_layer + 1
    # The checkpoints come out of the cap before the tier: a share, so that a small cap keeps most of it for experts.
    recurrent = min(RECURRENT_CACHE_BYTES, ram.usable // RECURRENT_SHARE_OF_NVME_RAM)
    reasons["recurrent_cache"] = _recurrent_reason(shape, recurrent, f"at most 1/{RECURRENT_SHARE_OF_NVME_RAM} of usable RAM "
                                                   "in the nvme modes")
    # Never more than every expert outside VRAM (those of the slots staging borrows too), the admissions' spare
    # rows and the rows each decode step keeps free for the next reads: beyond that a row would hold nothing, and
    # without the last two a warm tier keeps dropping experts it reads again.
    ram_slots = min(max(need, shape.experts - vram + lent + spare + FREE_RAM_SLOTS),
                    (ram.usable - ram.kept - recurrent - staging * record) // record)
    if ram_slots < need:
        raise PlanError(f"usable RAM {gib(ram.usable)} ({ram.what}) holds {max(0, ram_slots)} store records of "
                        f"{human(record)} after {ram.kept_what}; the nvme tier needs at least {need} "
                        f"(one layer's {shape.experts_per_layer} experts plus one): raise the memory cap")
    share = f"{100 * ram_slots / shape.experts:.0f}% of experts"
    whole = shape.experts - vram + lent + spare + FREE_RAM_SLOTS
    if ram_slots == whole > need:
        reasons["ram_slots"] = (f"{ram_slots} slots ({gib(ram_slots * record)}, {share}): every expert not in VRAM"
                                + (f", the {lent} of the cache slots a prefill borrows as staging" if lent else "")
                                + f", {spare} spare rows for admissions' victims and the {FREE_RAM_SLOTS} each decode "
                                f"step keeps free for the next reads; usable RAM {gib(ram.usable)} ({ram.what}) "
                                "would hold more: nothing is read from the store once warm")
    else:
        reasons["ram_slots"] = (f"{ram_slots} slots ({gib(ram_slots * record)}, {share}): usable RAM "
                                f"{gib(ram.usable)} ({ram.what}) minus {ram.kept_what}, {gib(recurrent)} of recurrent "
                                f"checkpoints and {staging} NVMe staging records; the rest are read from the store")
    readers = NVME_READERS_SMALL if ram.small else NVME_READERS
    reasons["nvme_threads"] = (f"{readers}: records read at once, each in the 1, 2, 4 or 8 parallel O_DIRECT parts "
                               "that read one fastest when the store opens"
                               + (" (small-host budget: half the readers and staging)" if ram.small else ""))
    st = facts.store
    reasons["store"] = f"{st.path} ({gib(st.size or 0)}) on {st.fstype} at {st.mount_point}; {st.odirect_how}"
    if ram.small:
        suggested = _suggested_cap(facts)
        more = (f"; --memory {suggested}g --memory-swap {suggested}g would hold far more"
                if ram.capped and facts.memory.limit is not None and suggested * GIB > facts.memory.limit else "")
        warnings.append(f"small host: usable RAM {gib(ram.usable)} < {SMALL_HOST_GIB} GiB, so the RAM tier holds "
                        f"{share} and decode is NVMe-bound{more}")
    return _RamTier(ram_slots, staging, readers, "small-host" if ram.small else "normal", record, recurrent)


def _recurrent_reason(shape: ModelShape, nbytes: int, why: str) -> str:
    held = (f", {nbytes // shape.checkpoint_bytes} checkpoints of {human(shape.checkpoint_bytes)}"
            if shape.checkpoint_bytes else "")
    return (f"{gib(nbytes)} of host RAM for recurrent-state checkpoints ({why}; exllamav3's default is "
            f"{gib(RECURRENT_CACHE_BYTES)}{held}): a prompt that repeats an earlier one's prefix skips its KDA "
            "prefill")


def _memory_warnings(facts: HostFacts, pinned: int, warnings: list[str]) -> None:
    mem = facts.memory
    if mem.memlock is not None and mem.memlock < pinned:
        # Only a warning: some drivers pin without RLIMIT_MEMLOCK. Start-up pins a test buffer and refuses if it fails.
        warnings.append(f"RLIMIT_MEMLOCK {human(mem.memlock)} < the {gib(pinned)} pinned RAM tier; pinned tiers "
                        "may fail: add --ulimit memlock=-1 (preflight pins a test buffer to check)")
    if mem.limit is not None and mem.swap_limit != 0 and mem.swap_total != 0:
        # `docker --memory X` alone allows X of swap on top: the kernel would swap the RAM tier out under pressure.
        allowed = "unlimited" if mem.swap_limit is None else gib(mem.swap_limit)
        cap = round(mem.limit / GIB)
        warnings.append(f"memory cap {gib(mem.limit)} without an equal swap cap (swap allowed: {allowed}): the RAM "
                        f"tier can be swapped out: run with --memory-swap equal to --memory "
                        f"(--memory {cap}g --memory-swap {cap}g)")


def _cuda(shares, gpu: Gpu) -> str:
    """The engine's (first) device: CUDA's ordinal, which CUDA_VISIBLE_DEVICES renumbers, not nvidia-smi's."""
    return f"cuda:{shares[0].index}" if shares else f"cuda:{gpu.index if gpu.cuda is None else gpu.cuda}"


def _plan_cards(facts: HostFacts, shape: ModelShape, settings: Settings, budget: Callable[[Gpu], int],
                warnings: list[str], reasons: dict[str, str], routing: Any) -> tuple[Gpu, CardsPlan, _Vram] | None:
    """Two or more usable GPUs: the layer split (glm53.planning.split), each card paying the reserve, the chunk's prefill
    activations and its staging beside its layers. None: one GPU (or none usable), the one-card plan; cards too
    small to hold a share are left out with a warning either way. The sequences asked for are kept."""
    cards, left_out = usable(facts.gpus, budget, MIN_GPU_GIB * GIB)
    warnings.extend(left_out)
    if len(cards) < 2:
        return None
    counts, why = routing if routing is not None else (None, "no routing statistics read")
    reserve, reserve_why = vram_reserve()
    tower, tower_why = vision_tower_bytes(shape, settings.max_images > 0)
    if tower_why:  # counted on every card: the split does not know which card the tower loads on (the first)
        reasons["vision"] = f"{tower_why}; counted on each of the {len(cards)} cards"
    floor = hot_set_floor(shape)
    try:
        cp = plan_cards(cards, budget, shape, settings, reserve=reserve, vision=tower,
                        activations=lambda chunk: prefill_activation_bytes(shape, chunk)[0],
                        choose_chunk=lambda default, at: _choose_chunk(shape, cards[0], default, at, floor),
                        min_slots=MIN_SLOTS_PER_LAYER_OF_TOP_K * shape.top_k, min_tokens=MIN_KV_TOKENS,
                        kv_round=KV_ROUND, counts=counts, counts_why=why)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    warnings.extend(cp.warnings)
    reasons.update(cp.reasons)
    want, _ = concurrency_of(settings)
    reasons["sequences"] = _seq_reason(shape, want, settings.max_concurrency, "")
    reasons["prefill_chunk"] = cp.chunk_why or STOCK_CHUNK_WHY
    reasons["reserve"] = f"{reserve_why}; on each of the {len(cards)} cards"
    staging = shape.experts_per_layer if cp.split.staging else 0  # per layer; the split's rows are each card's own
    return cards[0], cp, _Vram(sum(cp.vram_slots), staging, cp.split.staging, cp.split.kv_tokens, want,
                               cp.chunk, cp.accounting)


def _plan_real(facts: HostFacts, shape: ModelShape, settings: Settings, warnings: list[str], reasons: dict[str, str],
               routing: Any) -> Plan:
    budget_of_card = budget_of(settings)
    multi = _plan_cards(facts, shape, settings, budget_of_card, warnings, reasons, routing)
    if multi is not None:  # ---- several GPUs: the layer split decides slots, staging, KV and chunk (glm53.planning.split)
        gpu, cards, v = multi
        budget, shares, vram, split = sum(s.vram_budget_bytes for s in cards.shares), cards.shares, cards.vram_slots, \
            cards.how
        per_layer = min(vram)
    else:
        gpu, budget = _pick_gpu(facts, settings, budget_of_card, reasons)
        v = _size_vram(shape, settings, gpu, budget, reasons, warnings)
        counts, why = routing if routing is not None else (None, "no routing statistics read")
        per_layer = v.slots // shape.moe_layers
        if v.staging:
            vram, split = split_slots(per_layer, shape.moe_layers, shape.experts_per_layer, shape.top_k, counts,
                                      total=v.slots)
            split += f"; {why}" if counts is None else ""
        else:
            vram, split = (shape.experts_per_layer,) * shape.moe_layers, "every expert in VRAM"
        shares = ()
    staging, kv_tokens = v.staging, v.kv_tokens
    ram = _ram(facts, shape)
    lent = len(borrowed_rows(vram, staging - v.staging_rows, link_of_layers(shares, shape.moe_layers))) if staging else 0
    fit = _fit(facts, shape, settings, sum(vram) - lent, ram, warnings)  # a lent slot's expert needs RAM too
    mode = _choose_mode(fit, settings, reasons, warnings)
    tier = _size_ram(facts, shape, settings, mode, fit, sum(vram), ram, reasons, warnings, lent)
    pinned = (tier.slots + tier.staging_records) * tier.record_bytes
    _memory_warnings(facts, pinned, warnings)
    cpu_threads = _cpu_threads(facts, settings, mode, reasons, warnings)
    context = min(settings.context, shape.max_context or settings.context)
    spec = engine_spec(mode if staging else "stock", moe_layers=shape.moe_layers,
                       experts_per_layer=shape.experts_per_layer, top_k=shape.top_k, vram_slots=vram,
                       kv_tokens=kv_tokens, context=context, max_concurrency=v.sequences,
                       device=_cuda(shares, gpu), staging_slots=staging or None,
                       staging_rows=v.staging_rows or None, ram_slots=tier.slots,
                       cpu_threads=cpu_threads, store_threads=tier.nvme_threads, store=settings.store or None,
                       allow_buffered=settings.allow_buffered_reads, prefill_chunk=v.chunk,
                       recurrent_cache_bytes=tier.recurrent_cache, split=split, devices=shares,
                       vision=settings.max_images > 0)
    if not staging:
        tier = _RamTier(0, 0, 0, tier.budget, tier.record_bytes, tier.recurrent_cache)
        pinned = 0
    reasons["engine"] = (f"{spec.engine}: VRAM slots {split}; {spec.staging_slots} staging"
                         + (f" ({spec.dedicated_staging} rows of their own, {len(spec.borrowed)} cache slots lent)"
                            if spec.tiered and spec.dedicated_staging < spec.staging_slots else "")
                         + f", {spec.ram_slots} RAM "
                         f"rows, context {spec.context} of {spec.kv_tokens} KV tokens, {spec.max_concurrency} "
                         f"sequence{'s' if spec.max_concurrency != 1 else ''}, prefill chunks of {spec.prefill_chunk}")
    ram_acc = {"ram_tier": pinned, "recurrent_cache": tier.recurrent_cache, "host_weights": shape.host_bytes,
               "margin": ram.margin}
    devices = [d.to_json() for d in shares] or [
        {"index": gpu.index, "name": gpu.name, "vram_budget_bytes": budget, "layers": [0, shape.layers - 1],
         "vram_slots": sum(vram)}]
    speed = plan_forecast(gpu=gpu, cpu=facts.cpu, lane_ok=not fit.lane_missing,
                          lane_threads=cpu_threads or settings.cpu_threads or _auto_threads(facts)[0],
                          shape=shape, spec=spec, planned=mode,
                          counts=routing[0] if routing is not None else None)
    return Plan(mode, spec.device, gpu.index, gpu.name, budget, sum(vram), per_layer, tier.slots,
                pinned, cpu_threads, tier.nvme_threads, kv_tokens, tier.budget, settings.store or None, warnings,
                reasons, engine=spec, vram_accounting={**v.accounting, "expert_slots": sum(vram) * shape.expert_bytes},
                ram_accounting=ram_acc, devices=devices, forecast=speed.to_json())


# The demo checkpoints' windows: the CPU one (glm53.serve.demo's RECIPE, 131,072 positions: room for an agent's
# first request) and what glm53.serve.demo.demo_engine gives the synthetic EXL3 one. The demo serves
# min(GLM53_CONTEXT, this).
DEMO_CONTEXT = {"cpu": 131072, "gpu": 32768}


def _demo_plan(facts: HostFacts, shape: ModelShape, settings: Settings) -> Plan:
    """No model configured: serve the generated tiny model, and say what the real model would get here."""
    warnings: list[str] = []
    if settings.mode != "auto":
        warnings.append(f"GLM53_MODE={settings.mode} ignored: no model is configured (GLM53_MODEL_DIR is empty)")
    gpu = max(facts.gpus, key=lambda g: (g.free_mib, -g.index), default=None)
    device = f"cuda:{gpu.index}" if gpu else "cpu"
    threads = max(1, facts.cpu.physical_cores - 1) if gpu is None else 0
    try:
        real = plan(facts, shape, settings.with_overrides(model_dir="/model")).to_json()
        real_model = {"mode": real["mode"], "error": None, "warnings": real["warnings"]}
    except PlanError as exc:
        real_model = {"mode": None, "error": exc.message, "warnings": exc.warnings}
    reasons = {
        "mode": "demo: GLM53_MODEL_DIR is empty, so the generated random-weight demo model is served on "
                + (f"GPU {gpu.index} ({gpu.name})" if gpu else "the CPU (reference backend)")
                + "; to serve GLM-5.3-Flash mount it and set GLM53_MODEL_DIR "
                  "(docker run -v /path/to/GLM-5.3-Flash:/model:ro -e GLM53_MODEL_DIR=/model ...)",
        "real_model": ("with GLM-5.3-Flash mounted this host would run " + real_model["mode"]) if real_model["mode"]
        else f"with GLM-5.3-Flash mounted this host would be refused: {real_model['error']}",
    }
    if gpu is None:
        reasons["cpu_threads"] = f"{threads}: physical cores minus one, for the CPU reference backend"
    window = DEMO_CONTEXT["gpu" if gpu else "cpu"]
    kv_tokens = min(settings.context, window)
    reasons["kv_tokens"] = (f"{kv_tokens} tokens: GLM53_CONTEXT={settings.context}, capped by the demo "
                            f"checkpoint's {window}-token window")
    return Plan("demo", device, gpu.index if gpu else None, gpu.name if gpu else None, 0, 0, 0, 0, 0, threads, 0,
                kv_tokens, "demo", None, warnings, reasons, real_model)
