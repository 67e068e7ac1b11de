"""EngineSpecs for test checkpoints and stores: the plan's sizing rules (glm53.planning.spec.engine_spec) applied to a
shape read from the files, as the plan would read it, without a host to plan for."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from glm53.planning.shape import from_checkpoint
from glm53.planning.spec import EngineSpec, engine_spec, split_budget
from store.format import read_header


def spec_for(ck: str | Path, engine: str = "exact", vram_slots: int | list[int] = 0, *, device: str = "cpu",
             kv_tokens: int = 4096, max_concurrency: int = 4, **kw) -> EngineSpec:
    """The spec of `engine` for checkpoint `ck` with `vram_slots` per MoE layer (the rest as the plan sizes it)."""
    shape = from_checkpoint(ck)
    kw.setdefault("context", min(kv_tokens, shape.max_context or kv_tokens))
    if engine in ("fast", "nvme"):
        kw.setdefault("cpu_threads", 1)
    return engine_spec(engine, moe_layers=shape.moe_layers, experts_per_layer=shape.experts_per_layer,
                       top_k=shape.top_k, vram_slots=vram_slots, kv_tokens=kv_tokens,
                       max_concurrency=max_concurrency, device=device, **kw)


def store_spec(store: str | Path, ram_records: int, vram_slots: int | list[int], *, threads: int = 2,
               engine: str = "nvme", device: str = "cpu", staging_slots: int = 2, **kw) -> EngineSpec:
    """An nvme-mode spec for a packed store: `ram_records` RAM rows, `vram_slots` VRAM slots per layer (a list),
    or in all (an int, split evenly as the plan splits without routing statistics)."""
    head = read_header(store)
    layers = sorted({e.layer for e in head.entries})
    experts = sum(1 for e in head.entries if e.layer == layers[0])
    if isinstance(vram_slots, int):
        vram_slots = [int(s) for s in split_budget(np.zeros((len(layers), experts)), vram_slots)]
    return engine_spec(engine, moe_layers=len(layers), experts_per_layer=experts, top_k=min(2, experts),
                       vram_slots=vram_slots, kv_tokens=4096, device=device, staging_slots=staging_slots,
                       ram_slots=ram_records, cpu_threads=1, store_threads=threads, store=str(store), **kw)


def packed_store(ck: str | Path, where: Path) -> Path:
    """The record store packed from checkpoint `ck` into the folder `where`."""
    from store.pack import PackOptions, pack_store

    out = Path(where) / "experts.glm53"
    pack_store(PackOptions(ck, out, threads=2, progress=False, verify=False), log=lambda m: None)
    return out


def split_spec(ck: str | Path, engine: str = "exact", vram_slots: int | list[int] = 0, *, cards: int = 2,
               index: int | tuple[int, ...] = 0, device: str = "cpu", budget: int = 12 << 30, **kw) -> EngineSpec:
    """`spec_for` with the decoder layers split `cards` ways, the MoE layers as evenly as whole layers allow
    (glm53.planning.devices.even_shares), every share on cuda:`index` with `budget` bytes (a split onto one card, two
    budgets), on cuda:index[i] (a tuple: one card per share), or on the CPU (device="cpu": the fake exllamav3)."""
    from glm53.planning.devices import even_shares

    shape = from_checkpoint(ck)
    slots = [vram_slots] * shape.moe_layers if isinstance(vram_slots, int) else list(vram_slots)
    indices = index if isinstance(index, tuple) else (index,) * cards
    shares = even_shares(shape.layers, shape.moe_layer_ids, slots, indices, budget)
    return spec_for(ck, engine, slots, device=device, devices=shares, **kw)
