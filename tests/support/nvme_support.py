"""Shared helpers of the nvme tier tests (no tests here): a real store packed from a generated checkpoint, an
nvme plan of a chosen RAM budget, the EXL3 expert forward from slot bytes, and the direct computation from the
checkpoint's own tensors."""

from __future__ import annotations

import functools
from functools import cache
from pathlib import Path

import numpy as np
import torch
from specs import store_spec

import store.reader as R
from glm53.exl3ref import Exl3Linear, expert_forward, read_exl3_linear
from glm53.planning.spec import EngineSpec
from glm53.tiers import SlotLayout, Where, combine, group_picks
from store.format import read_header
from store.pack import PackOptions, pack_store
from store.synth import write_expert_checkpoint

HIDDEN, INTER = 256, 128
PREFIX = "model.language_model.layers"


def make_store(root: Path, *, layers: int = 3, experts: int = 16, seed: int = 0, hidden: int = HIDDEN,
               inter: int = INTER) -> tuple[Path, Path]:
    """A generated expert checkpoint (layers - 1 MoE layers after one dense) and its packed store."""
    ck = write_expert_checkpoint(root / "ck", hidden=hidden, moe_intermediate=inter, layers=layers, experts=experts,
                                 mtp_layers=0, seed=seed)
    out = root / "experts.glm53"
    pack_store(PackOptions(ck, out, threads=2, progress=False, verify=False), log=lambda m: None)
    return ck, out


def nvme_spec(store: Path, ram_records: int, vram_slots: int | list[int], threads: int = 2, mode: str = "nvme",
              **kw) -> EngineSpec:
    """An nvme-mode spec whose RAM tier is exactly `ram_records` records of this store, with `vram_slots` VRAM
    slots per layer (a list) or in all (split evenly, as the plan splits without routing statistics)."""
    return store_spec(store, ram_records, vram_slots, threads=threads, engine=mode, **kw)


def slot_forward(layout: SlotLayout):
    """expert_forward on the bytes of a slot image, wherever the tier served them from."""

    def forward(slot: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        v = {k: t.cpu().numpy() for k, t in layout.views(slot).items()}
        lin = [Exl3Linear(v[f"{p}.trellis"], v[f"{p}.suh"], v[f"{p}.svh"], "mul1") for p in ("gate", "up", "down")]
        return torch.from_numpy(expert_forward(x.cpu().numpy(), *lin))

    return forward


class Direct:
    """The reference: glm53.exl3ref.expert_forward on the checkpoint's tensors (not the store), combined in the
    same order as the tiers combine."""

    def __init__(self, ck: Path):
        self.ck = ck

    @cache  # noqa: B019 - one per test module, lives as long as the checkpoint
    def linears(self, store_layer: int, e: int) -> tuple[Exl3Linear, ...]:
        return tuple(read_exl3_linear(self.ck, f"{PREFIX}.{store_layer}.mlp.experts.{e}.{p}_proj")
                     for p in ("gate", "up", "down"))

    def moe(self, store_layer: int, x: torch.Tensor, ids: np.ndarray, w: torch.Tensor) -> torch.Tensor:
        outputs = {e: torch.from_numpy(expert_forward(x[torch.from_numpy(rows)].numpy(), *self.linears(store_layer, e)))
                   for e, rows, _ in group_picks(ids)}
        return combine(x, w, ids, outputs)


def route(rng: np.random.Generator, tokens: int, num_experts: int, top_k: int, skew: float = 1.0):
    p = np.arange(1, num_experts + 1, dtype=np.float64) ** -skew
    p /= p.sum()
    ids = np.stack([rng.choice(num_experts, top_k, replace=False, p=p) for _ in range(tokens)])
    return ids, torch.from_numpy(rng.random((tokens, top_k))).float()


def record(store: Path, layer: int, e: int) -> bytes:
    entry = read_header(store).entry(layer, e)
    with open(store, "rb") as f:
        f.seek(entry.offset)
        return f.read(entry.length)


def check_bytes(tier, store: Path) -> None:
    """Every readable expert's bytes in every tier equal its store record."""
    from glm53.tiers import Where

    t = tier.tiers
    for layer in range(t.num_layers):
        for e in range(t.num_experts):
            if t.where[layer, e] in (Where.VRAM, Where.RAM, Where.TO_VRAM):
                got = t.bytes_of(layer, e).cpu().numpy().tobytes()
                want = record(store, tier.store_layers[layer], e)
                assert got[: len(want)] == want, f"{layer}/{e} bytes differ from the store record"


def read_in_parts(monkeypatch, parts: int) -> None:
    """Tiers opened from now on read each record in `parts` parts, as if the open's timing had chosen that: the
    test stores' 40 KiB records are below the reader's least part (1 MiB), which is lowered to 4 KiB here."""
    import glm53.tiers.nvme_open as nvme_open

    monkeypatch.setattr(nvme_open, "calibrate_pieces", lambda *a, **k: (parts, {}))
    monkeypatch.setattr(nvme_open, "StoreReader", functools.partial(R.StoreReader, min_piece=4096))


def check_wrong_guesses_dropped(tier) -> None:
    """After a step of layer 1 needed guesses 0 and 3 of four queued (0..3): one promoted, two cancelled unread and
    counted wasted, nothing failed; the dropped two (1, 2) read later like any other read."""
    snap = tier.stats.snapshot()
    assert snap["nvme"]["promoted"] == 1 and snap["nvme"]["cancelled_prefetches"] == 2
    assert snap["nvme"]["failed_reads"] == 0 and snap["prefetch"]["wasted"] == 2
    tier.check_invariants()
    for e in (1, 2):
        tier.wait(1, e)
        assert Where(tier.tiers.where[1, e]) == Where.RAM


def small_store(root: Path) -> Path:
    """The readers' test store: 3 layers x 8 small experts, packed unverified under root."""
    ck = write_expert_checkpoint(root / "ck", layers=3, experts=8, mtp_layers=0)
    out = root / "s.glm53"
    pack_store(PackOptions(ck, out, threads=2, progress=False, verify=False), log=lambda m: None)
    return out


def reference(store: Path, layer: int, expert: int) -> bytes:
    """A record's bytes as the file holds them (read plainly, for comparing with what a reader landed)."""
    e = read_header(store).entry(layer, expert)
    with open(store, "rb") as f:
        f.seek(e.offset)
        return f.read(e.extent)
