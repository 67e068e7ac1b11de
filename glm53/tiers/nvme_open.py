"""Opening the nvme tier: the store checked against the mounted checkpoint, its reads timed on this disk, the tiers
sized by the plan's EngineSpec and warmed from saved routing statistics. glm53.tiers.nvme is the tier once open.

    tier = open_nvme_tier(store, model_dir, spec, stats_path=...)   # or StoreRefused, naming the pack-store fix
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from glm53.planning.routing import load_routing_stats
from glm53.planning.spec import EngineSpec
from store import native
from store.errors import StoreError
from store.format import StoreHeader, read_header
from store.read_timing import pick_pieces, pick_prefetch_at_once, time_pieces, time_two_at_once
from store.reader import StoreReader
from store.verify import pack_command, quick_verify

from .links import link_plan
from .nvme import DEFAULT_TIMEOUT_S, NvmeTier, model_key

log = logging.getLogger("glm53.tiers.nvme")  # one log for the tier, opening or open

# A demand read is on the decode's critical path, usually alone, and how many parallel parts read one record fastest
# depends on the disk: a virtual disk may read a lone record as 4 parts in about half the time of one pread, and
# slower again as 8; a RAM-backed store keeps gaining from more parts (figures: docs/results.md). So the tier times a
# few records alone in each of these part counts when it opens, and reads in the fastest (parts of at least 1 MiB stay
# large reads on any disk). READ_PIECES: where nothing could be timed.
READ_PIECES = 4
PIECE_CHOICES = (1, 2, 4, 8)
PIECE_SAMPLE = 6  # records timed in each part count, each read once: about 0.2 s on a 1.5 GB/s disk
AT_ONCE_PAIRS = 4  # pairs timed read at once and one after the other: 16 records, about 0.1 s on such a disk


class StoreRefused(StoreError):
    """The store cannot serve the mounted checkpoint (another checkpoint's, damaged, unreadable)."""


def open_nvme_tier(
    store_path: str | Path,
    model_dir: str | Path,
    spec: EngineSpec,
    *,
    stats_path: str | Path | None = None,
    verify_sample: int = 8,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pin: bool | None = None,
    warm: bool = True,
    vram_storage: Sequence[torch.Tensor] | None = None,
) -> NvmeTier:
    """Verify the store against the mounted checkpoint, size the tiers as the spec says (glm53.planning.spec: VRAM slots per
    layer, staging rows, RAM rows, reader threads, the device, whether buffered reads are allowed), warm them from
    saved routing statistics. Raises StoreRefused (with the exact pack-store command) for another checkpoint's or
    a damaged store, NativeUnavailable (naming the rebuild command) where the store's native library is not built,
    ValueError for a spec that is not an nvme mode's or does not fit the store. vram_storage: the engine's
    per-layer slot tensors to adopt. Each record is read in the count of parallel parts that reads one alone
    fastest here, and at most the count of guess reads at once that does not slow a demand read, both timed now
    (`tier.read_timing`, `tier.two_at_once_gain`)."""
    if not spec.nvme:
        raise ValueError(f"the spec's engine is {spec.engine}: the nvme tier serves the nvme and nvme-exact modes")
    native.library()  # NativeUnavailable before any work: the store is read only through the native queue
    allow_buffered = spec.allow_buffered
    store_path, model_dir = Path(store_path), Path(model_dir)
    rep = quick_verify(store_path, model_dir, sample=verify_sample, allow_buffered=allow_buffered)
    if not rep.ok:
        raise _refusal(rep, store_path, model_dir)
    header = read_header(store_path)
    layers, num_experts = _store_shape(header, spec, store_path, model_dir)
    read_pieces, timing = calibrate_pieces(store_path, header, allow_buffered)
    n_threads = spec.store_threads or 4
    at_once, at_once_gain = calibrate_prefetch(store_path, header, allow_buffered, read_pieces, n_threads)
    reader = StoreReader(store_path, allow_buffered=allow_buffered, verify=True, header=header, pieces=read_pieces,
                         threads=n_threads, prefetch_at_once=at_once)
    try:
        counts, why = (None, "no routing statistics path given (cold start)")
        if stats_path is not None:
            counts, why = load_routing_stats(stats_path, model_key(header), len(layers), num_experts)
        log.info("nvme tier: %s", why)
        link_devices, link_of = link_plan(spec.devices, len(layers), spec.device)
        tier = NvmeTier(reader, num_experts, list(spec.vram_slots), spec.ram_slots, layers=layers,
                        device=spec.device, pin=pin, timeout_s=timeout_s,
                        vram_storage=vram_storage, staging_slots=spec.staging_slots,
                        staging_rows=spec.dedicated_staging, link_devices=link_devices,
                        link_of=link_of)
    except BaseException:
        reader.close()
        raise
    tier.read_timing = timing
    tier.two_at_once_gain = at_once_gain
    if warm:
        report = tier.warm(counts)
        log.info("nvme tier: warmed %d VRAM and %d RAM experts in %.1f s (%d unreadable)", report["vram"],
                 report["ram"], report["seconds"], report["failed"])
    return tier


def _store_shape(header: StoreHeader, spec: EngineSpec, store_path: Path, model_dir: Path) -> tuple[list[int], int]:
    """The store's MoE layers and experts per layer, refused where its layers differ (a damaged or foreign store)
    and where the spec does not fit it (planned for another checkpoint, or RAM rows below one layer's experts plus
    one, which a step picking a whole layer needs)."""
    layers = sorted({e.layer for e in header.entries})
    per_layer = {layer: sum(1 for e in header.entries if e.layer == layer) for layer in layers}
    num_experts = per_layer[layers[0]]
    if set(per_layer.values()) != {num_experts}:
        raise _refusal_text(store_path, model_dir, f"the store's layers hold different numbers of experts: {per_layer}")
    if len(spec.vram_slots) != len(layers) or spec.ram_slots < num_experts + 1:
        raise ValueError(f"the spec (VRAM slots for {len(spec.vram_slots)} layers, {spec.ram_slots} RAM rows) does "
                         f"not fit the store's {len(layers)} layers of {num_experts} experts (at least "
                         f"{num_experts + 1} RAM rows: one layer's experts plus one)")
    return layers, num_experts


def calibrate_pieces(store_path: Path, header: StoreHeader, allow_buffered: bool) -> tuple[int, dict[int, float]]:
    """How many parallel parts to read each record in: the fewest that read a record alone about as fast as any
    count of PIECE_CHOICES, timed now on this store, each on different records (READ_PIECES where nothing could be
    timed); and the timings."""
    import random

    keys = random.Random().sample(sorted(header.index), min(PIECE_SAMPLE * len(PIECE_CHOICES), len(header.index)))
    timing = time_pieces(store_path, header, keys, PIECE_CHOICES, allow_buffered=allow_buffered)
    if not timing:
        log.info("store reads: %d parallel parts per record (nothing timed: no read came back)", READ_PIECES)
        return READ_PIECES, {}
    pieces = pick_pieces(timing)
    log.info("store reads: %d parallel part(s) per record, the fastest for a record read alone here (%s)", pieces,
             ", ".join(f"{n}: {t * 1e3:.2f} ms" for n, t in sorted(timing.items())))
    return pieces, timing


def calibrate_prefetch(store_path: Path, header: StoreHeader, allow_buffered: bool, pieces: int,
                       threads: int) -> tuple[int, float | None]:
    """How many guess reads may be under way at once (see pick_prefetch_at_once), from two records read at once
    against one after the other, timed now on this store; and that gain (None where nothing was timed)."""
    import random

    keys = random.Random().sample(sorted(header.index), min(4 * AT_ONCE_PAIRS, len(header.index)))
    gain = time_two_at_once(store_path, header, keys, pieces, allow_buffered=allow_buffered)
    at_once = pick_prefetch_at_once(gain, threads)
    if gain is None:
        log.info("store reads: up to %d guess reads at once (nothing timed)", at_once)
    else:
        log.info("store reads: up to %d guess read(s) at once, of %d readers: two records read at once came in "
                 "%.2fx as fast as one after the other%s", at_once, threads, gain,
                 " (one read keeps this store busy: a guess beside a needed read would slow it)" if at_once == 1
                 else "")
    return at_once, gain


def _refusal(rep, store_path: Path, model_dir: Path) -> StoreRefused:
    problems = "\n".join(f"  - {p.what}\n    fix: {p.fix}" for p in rep.problems)
    return StoreRefused(f"the store {store_path} cannot serve the checkpoint {model_dir}:\n{problems}",
                        pack_command(store_path, model_dir))


def _refusal_text(store_path: Path, model_dir: Path, what: str) -> StoreRefused:
    return StoreRefused(f"the store {store_path} cannot serve the checkpoint {model_dir}: {what}",
                        pack_command(store_path, model_dir))
