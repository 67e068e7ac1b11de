"""TieredMoE: routed experts of every MoE layer of an exllamav3 model through glm53.tiers.

glm53.exl3.contract checks every exllamav3 internal this relies on at start-up. The CPU tests run this glue end to
end against a fake exllamav3 that imitates these hooks (tests/support/fake_exllamav3.py, tests/exl3/test_exl3_tiered_glue.py)
on a CPU device, where host buffers are not pinned and there is no stream to synchronise.

How a layer is shrunk (before `model.load()`), for each `BlockSparseMLP`:
- Its gate/up/down expert lists are replaced by S + P *slot* Linears: S cache slots of this layer (a
  `VramLayer` arena of glm53.tiers) and P staging slots shared by all layers (`ExpertTiers.staging`). A slot
  Linear's `load` is replaced so its `LinearEXL3` is built directly on typed views into those arenas: no expert
  is read from the checkpoint by exllamav3, and the tensors exllamav3 bakes into its pointer tables (MultiLinear,
  BC_BlockSparseMLP, per-linear BC objects) are the arenas themselves. Refilling a slot later is a `.copy_()`
  into those bytes (glm53.tiers' Copier), never a new tensor, so every baked pointer stays valid.
- `num_local_experts`, `routing_first`, `routing_last` describe the S + P slots (the expert-interval machinery
  exllamav3 uses for TP shards and its own CPU split): any id outside them contributes exact zeros.
- After load, `cpu_split_first` is set and the instance's `cpu_split_submit` replaced: exllamav3's forward calls
  it right after routing and before any expert kernel (the stock CPU-split seam). The hook reads the picks,
  makes every picked expert readable on the GPU (VRAM hit; admission into a slot; or a copy into a staging
  slot), and rewrites the router ids IN PLACE into slot ids (the bsz-1 routing buffers live at fixed addresses).
  In exact modes it returns no CPU partial, so the combine is the stock identity. With a CPU lane (fast, nvme),
  the picks it computes get a masked slot id (exact zeros on the GPU) and the seam returns a pending ticket; the
  instance's `cpu_split_combine`, called after the GPU kernels are queued, adds the lane's partial.
- With lookahead on, each decode step also queues the next MoE layer's router on this step's input, so the
  next layer's likely experts start moving (nvme: store reads; every mode: a few RAM-resident ones copied into
  reserved staging rows) while this layer computes: the store reads only for the layers whose experts the store
  still serves, the copies only while the prestage's judge finds steps faster (MoeStepper.wants_ahead).
- `_split_saved` holds the original lists, so stock `cpu_unload()` (called by `unload()`) restores the module.

Why this is bit-identical to stock exllamav3 with every expert in VRAM: the stock kernels run on the same
inputs, with every pick's weights byte-identical (raw checkpoint bytes, copied whole), in the same per-token
k order (the fused decode kernel and the prefill gather both reduce in k order; slot ids only change which
pointer a pick reads and how picks of one expert are grouped, which is a bijective relabelling per step).

Nothing here decides placement: glm53.step and glm53.tiers do (MoeStepper, ExpertTiers, policy). Only the host marks an expert
resident, after its copy's ticket says the bytes landed (ExpertTiers.settle / poll).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from glm53.exl3.contract import MAX_BSZN
from glm53.exl3.placement import decoder_layer, moe_modules
from glm53.exl3.tensors import SafetensorsIndex
from glm53.planning.spec import EngineSpec, staging_for
from glm53.step.prestage import Prestage
from glm53.step.stepper import MoeStepper

log = logging.getLogger("glm53.engine")

PROJECTIONS = ("gate", "up", "down")


class Exl3TierError(RuntimeError):
    """A step could not make its picks readable on the GPU (configuration too small): fail loudly, never guess."""


LANE_TAG = "glm53-cpu-lane"  # marks our cpu_pending: (LANE_TAG, LaneTicket, rows)


def staging_needed(rows: int, top_k: int, num_experts: int) -> int:
    """Staging slots that cover any step of `rows` token rows: every distinct pick may be a miss."""
    return min(num_experts, rows * top_k)



@dataclass
class _Layer:
    module: Any  # exllamav3 BlockSparseMLP
    keys: list[tuple[str, str, str]]  # per expert: gate, up, down Linear keys
    slots: int  # S: cache slots of this layer
    saved: tuple  # the module's original (gates, ups, downs, modules, num_local_experts, routing_first, routing_last)
    slot_linears: tuple[list, list, list] | None = None
    ids_host: Any = None  # pinned int64: the step's router ids
    out_host: Any = None  # pinned int64: the step's slot ids
    x_host: Any = None  # pinned fp16 (MAX_BSZN, hidden): a decode step's input, for the CPU lane
    w_host: Any = None  # pinned fp16 (MAX_BSZN, top_k): its routing weights
    next_host: Any = None  # pinned int64 (MAX_BSZN, top_k): the next layer's predicted picks
    guess_host: Any = None  # pinned bool (experts,): the next layer's experts a prompt chunk's router run names

    @classmethod
    def of(cls, module: Any, slots: int) -> _Layer:
        """The layer as exllamav3 built it: its experts' Linear keys, and what `close` puts back."""
        m = module
        return cls(m, [(g.key, u.key, d.key) for g, u, d in zip(m.gates, m.ups, m.downs, strict=True)], slots,
                   (m.gates, m.ups, m.downs, m.modules, m.num_local_experts, m.routing_first, m.routing_last))


class TieredMoE:
    """Routed experts of an exllamav3 model in glm53.tiers: S VRAM slots per MoE layer, the rest in the pinned RAM
    tier (or, with `nvme_open`, in the record store with RAM as its cache), misses over PCIe into admitted or
    staging slots and computed by exllamav3's own kernels (exact, nvme-exact), or, once `enable_lane` attached a
    CPU lane, split per decode step between the lane and PCIe by the calibrated planner (fast, nvme). Which tier
    each pick is read from is decided in glm53.step; this class only connects that to exllamav3.

    Lifecycle: construct (after Model.from_config, before load) -> install() -> model.load() -> populate() ->
    [enable_lane()] -> forwards ... -> close() (after model.unload() or before; both orders restore the modules)."""

    # The kernel paths the CPU lane calibrates among: None, every one this host runs (a benchmark emulating
    # another CPU narrows it before the lane starts).
    lane_isas: tuple[str, ...] | None = None

    def __init__(
        self,
        model: Any,
        model_dir: str | os.PathLike,
        spec: EngineSpec,
        *,
        counts: np.ndarray | None = None,
        admit: bool = True,
        read_threads: int = 8,
        nvme_open: Callable[[], Any] | None = None,
        lookahead: bool | None = None,
    ):
        """spec: the sizes (glm53.planning.spec.EngineSpec): VRAM slots per MoE layer, the staging slots shared by every
        layer, the RAM tier's rows, the device (a CPU device, under the fake exllamav3 in the CPU tests, gets
        unpinned host buffers and no stream synchronisation, and is otherwise the same code). counts: saved routing
        statistics (num_moe_layers, num_experts) to warm the VRAM cache and the policies. admit=False: misses are
        only streamed. nvme_open() -> NvmeTier: the nvme modes (glm53.tiers.nvme_open.open_nvme_tier with
        warm=False, bound to the store and the spec). lookahead: run the next MoE layer's router on each decode step's
        input where the stepper wants its guess (MoeStepper.wants_ahead): the nvme modes start the store reads of the
        predicted experts one layer ahead, and a few of them in RAM are prestaged into staging rows reserved for it
        where the dedicated rows leave room (glm53.step.prestage); default on. A decode step's copies
        are waited for by the GPU, not the host, and its admissions are decided and copied (device to device, from
        staging) once its kernels are queued (glm53.step)."""
        import torch

        self.model = model
        self.model_dir = Path(model_dir)
        self.spec = spec
        self.device = torch.device(spec.device)
        self.pin = self.device.type == "cuda"  # page-locked host buffers (async copies) only where there is CUDA
        self.admit = admit
        self.counts = counts
        self.index = SafetensorsIndex(self.model_dir)
        self.read_threads = max(1, read_threads)
        mods = _alike_moe_modules(model)
        self.num_experts = mods[0].num_experts
        self.top_k = mods[0].num_experts_per_tok
        self.staging_slots = spec.staging_slots
        budgets = _checked_slots(spec, len(mods), self.num_experts, self.top_k)
        self.layers = [_Layer.of(m, s) for m, s in zip(mods, budgets, strict=True)]
        self.link_devices, self.link_of = _links(spec, mods)
        self.layout = self._layout()
        self.nvme_open = nvme_open
        self.lookahead = True if lookahead is None else lookahead
        self.tiers: Any = None
        self.nvme: Any = None
        self.stepper: MoeStepper | None = None
        self.populated = False
        self._installed = False
        self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="glm53-expert-read")
        self.step_time = {"sync": 0.0}
        self.steps = 0
        self.handoffs: dict[Any, Any] = {}  # device -> glm53.exl3.handoff.StreamHandOff, made at a lane step's combine

    # ---- set-up -------------------------------------------------------------------------------------------

    def _layout(self):
        """The slot image from the checkpoint headers; every routed expert of every MoE layer must match it."""
        import torch

        from glm53.tiers import SlotLayout

        dt = {"I16": torch.int16, "F16": torch.float16}
        first = self.layers[0].keys[0]
        fields: list[tuple[str, Any, tuple[int, ...]]] = []
        for p, key in zip(PROJECTIONS, first, strict=True):
            e = self.index.entry(f"{key}.trellis")
            fields.append((f"{p}.trellis", dt.get(e.dtype), e.shape))
        for p, key in zip(PROJECTIONS, first, strict=True):
            for s in ("suh", "svh"):
                e = self.index.entry(f"{key}.{s}")
                fields.append((f"{p}.{s}", dt.get(e.dtype), e.shape))
        want = {"trellis": "I16", "suh": "F16", "svh": "F16"}
        for name, dtype, _ in fields:
            if dtype is None:
                raise Exl3TierError(f"routed expert tensor {first[0]}... {name}: only int16 trellis and fp16 suh/svh "
                                    "are supported by the tier loader")
        layout = SlotLayout.packed(fields)
        spec = {f.name: f for f in layout.fields}
        for layer in self.layers:
            for keys in layer.keys:
                for p, key in zip(PROJECTIONS, keys, strict=True):
                    for s in ("trellis", "suh", "svh"):
                        e = self.index.entry(f"{key}.{s}")
                        f = spec[f"{p}.{s}"]
                        if e.dtype != want[s] or e.shape != f.shape:
                            raise Exl3TierError(f"{key}.{s} is {e.dtype}{list(e.shape)}; every routed expert must be "
                                                f"{want[s]}{list(f.shape)} like the first one (mixed widths unsupported)")
                    if (f"{key}.mcg" in self.index) != (f"{first[0]}.mcg" in self.index) or \
                            (f"{key}.mul1" in self.index) != (f"{first[0]}.mul1" in self.index):
                        raise Exl3TierError(f"{key}: codebook marker differs from {first[0]}'s (mixed codebooks)")
        return layout

    def install(self) -> None:
        """Allocate the tiers and shrink every MoE layer to its slots. Call before model.load()."""

        from glm53.tiers import ExpertTiers

        if self._installed:
            raise RuntimeError("install() runs once")
        slots = [layer.slots for layer in self.layers]
        if self.nvme_open is not None:
            self.nvme = self.nvme_open()
            self.tiers = self.nvme.tiers
            self._adopt_store_layout(self.nvme.layout)
        else:
            self.tiers = ExpertTiers(
                self.layout, self.num_experts, slots, self.spec.ram_slots,
                keep_all=True, device=self.device,
                staging_slots=self.staging_slots, staging_rows=self.spec.dedicated_staging, pin=self.pin,
                link_devices=self.link_devices, link_of=self.link_of,
            )
        for li, layer in enumerate(self.layers):
            self._shrink(li, layer)
            self._grow(layer, MAX_BSZN * self.top_k)
        self._installed = True

    def _adopt_store_layout(self, store_layout: Any) -> None:
        """The store's record image must be the checkpoint's slot image field for field (a store packed from this
        checkpoint is): then a record read from NVMe is copied to VRAM as is."""
        mine = [(f.name, f.dtype, f.shape, f.offset) for f in self.layout.fields]
        theirs = [(f.name, f.dtype, f.shape, f.offset) for f in store_layout.fields]
        if mine != theirs:
            raise Exl3TierError(f"the store's record layout {theirs} differs from this checkpoint's expert layout "
                                f"{mine}: the store was packed from another checkpoint (re-run pack-store)")
        self.layout = store_layout

    def _grow(self, layer: _Layer, n: int) -> None:
        """Host buffers (pinned on CUDA) for a step's ids and slot ids (one pair per layer: a layer's H2D write of
        the previous step has completed before its next step rewrites the buffer, since every step syncs first)."""
        import torch

        layer.ids_host = torch.empty(n, dtype=torch.long, pin_memory=self.pin)
        layer.out_host = torch.empty(n, dtype=torch.long, pin_memory=self.pin)

    def _marker(self, key: str, name: str):
        from exllamav3.modules.quant.exl3_lib.quantize import codebook_mcg_mult, codebook_mul1_mult

        if f"{key}.{name}" not in self.index:
            return None
        mult = codebook_mcg_mult if name == "mcg" else codebook_mul1_mult
        return self.layers[0].module.config.stc.get_codebook_marker(f"{key}.{name}", mult)

    def _shrink(self, li: int, layer: _Layer) -> None:
        m = layer.module
        gates, ups, downs = layer.saved[0], layer.saved[1], layer.saved[2]
        n_local = layer.slots + self.staging_slots
        vl, tiers = self.tiers.vram[li], self.tiers
        markers = {p: (self._marker(k, "mcg"), self._marker(k, "mul1")) for p, k in zip(PROJECTIONS, layer.keys[0],
                                                                                        strict=True)}
        new: tuple[list, list, list] = ([], [], [])
        for i in range(n_local):
            views = vl.views(i) if i < layer.slots else tiers.layout.views(tiers.staging_slot(i - layer.slots, li))
            for j, (p, src) in enumerate(zip(PROJECTIONS, (gates, ups, downs), strict=True)):
                lin = copy.copy(src[i % len(src)])
                lin.lora_a_tensors, lin.lora_b_tensors = {}, {}
                lin.caps = dict(lin.caps)
                lin.modules = []
                lin.inner, lin.quant_type = None, None
                lin.load = _slot_loader(lin, views[f"{p}.trellis"], views[f"{p}.suh"], views[f"{p}.svh"], *markers[p])
                new[j].append(lin)
        originals = {id(x) for x in (*gates, *ups, *downs)}
        m.modules = [x for x in m.modules if id(x) not in originals] + [x for trio in zip(*new, strict=True) for x in trio]
        m.gates, m.ups, m.downs = new
        m.num_local_experts = n_local
        m.routing_first, m.routing_last = 0, n_local
        layer.slot_linears = new

    def populate(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Place every expert once (VRAM: each layer's hottest by `counts`, else lowest ids; RAM: the rest, or in
        the nvme modes as much as the RAM tier holds, read from the store), then open the seam. Call after
        model.load()."""
        import torch

        if not self._installed:
            raise RuntimeError("populate() needs install() and model.load() first")
        total = len(self.layers) * self.num_experts
        done = [0]

        def load(layer: int, expert: int, out) -> None:
            self._read_expert(layer, expert, out)
            done[0] += 1
            if progress is not None and (done[0] % 64 == 0 or done[0] == total):
                progress(done[0], total)

        if self.nvme is not None:
            self.nvme.warm(self.counts)
        else:
            self.tiers.populate(load, self.counts)
        prestage = None
        if self.lookahead and Prestage.room(self.spec.dedicated_staging, self.top_k):
            prestage = Prestage(self.spec.dedicated_staging, self.top_k)
        self.stepper = MoeStepper(self.tiers, [layer.slots for layer in self.layers], self.staging_slots,
                                  admit=self.admit, nvme=self.nvme, prestage=prestage)
        hidden = self.layers[0].module.hidden_size
        for li, layer in enumerate(self.layers):
            m = layer.module
            where = getattr(m, "device", None)
            if where is not None and torch.device(where) != self.tiers.link(li).device:
                raise Exl3TierError(f"{m.key} loaded on {where}, its slots are on {self.tiers.link(li).device}: the "
                                    "layers were not placed as the spec's devices say (place_layers before load)")
            if m.bc is None:
                raise Exl3TierError(f"{m.key}: exllamav3 built no fused expert path (BC_BlockSparseMLP) on the slots")
            m._split_perm = None
            m._split_saved = layer.saved
            m.cpu_split_submit = _seam(self, li)
            m.cpu_split_combine = _combine(m, self)
            m.cpu_split_first = m.num_local_experts
            rows = MAX_BSZN
            layer.x_host = torch.empty((rows, hidden), dtype=torch.half, pin_memory=self.pin)
            layer.w_host = torch.empty((rows, self.top_k), dtype=torch.half, pin_memory=self.pin)
            layer.next_host = torch.empty((rows, self.top_k), dtype=torch.long, pin_memory=self.pin)
            layer.guess_host = torch.empty(self.num_experts, dtype=torch.bool, pin_memory=self.pin)
        self.populated = True

    @property
    def codebook(self) -> str:
        """The routed experts' EXL3 codebook ("mul1", "mcg" or "3inst"): the CPU lane decodes mul1 only."""
        first = self.layers[0].keys[0][0]
        return "mcg" if f"{first}.mcg" in self.index else "mul1" if f"{first}.mul1" in self.index else "3inst"

    def start_lane(self, threads: int, cpus: Sequence[int] | None = None, isas: Sequence[str] | None = None) -> None:
        """fast / nvme modes: calibrate the CPU kernel (among `isas`, default `lane_isas`) and this machine's PCIe
        copies (the first card's link, in a split across cards), start the lane, attach it."""
        from glm53.cpu_lane.lane import start_lane

        lane, fit = start_lane(self.layout, self.measure_pcie(), threads, cpus=cpus, stats=self.tiers.stats,
                               codebook=self.codebook, isas=isas if isas is not None else self.lane_isas)
        self.enable_lane(lane, fit)

    def enable_lane(self, lane: Any, fit: Any) -> None:
        """Attach the CPU lane (fast / nvme modes): from the next decode step on, the planner may give it misses.
        The lane is closed with this object."""
        if self.stepper is None:
            raise RuntimeError("enable_lane() needs populate() first")
        self.stepper.lane, self.stepper.fit, self.stepper.recompute = lane, fit, self._recompute

    def measure_pcie(self, repeats: int = 3) -> list:
        """PCIe-lane samples for the planner's calibration: 1, 2, 4 and top_k slot images streamed from the RAM tier's
        arena into staging, each the best of `repeats` (the start-up half of the cost model; live steps refine it).

        The sources are arena rows whatever they hold (a copy costs its size, not its bytes): in the nvme modes a
        cold start (no routing statistics) has no expert in RAM yet, which must not stop the lane from starting.
        Rows that a store read may still be writing (pending, retired) are skipped."""
        from glm53.cpu_lane.planner import PcieSample
        from glm53.tiers.ram import RETIRED

        ram, link = self.tiers.ram, self.tiers.links[0]
        rows = [r for r in range(ram.num_slots) if not ram.pending[r] and ram.owner[r] != RETIRED]
        rows = rows[: max(8, self.top_k)]
        samples = []
        for n in sorted({1, 2, 4, self.top_k}):
            if n > min(len(rows), self.tiers.staging_rows):
                break
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                last = None
                for i, r in enumerate(rows[:n]):
                    last = link.copier.copy(link.staging[i], ram.flat(r))
                last.wait()
                best = min(best, time.perf_counter() - t0)
            samples.append(PcieSample((1,) * n, best))
        if not samples:
            raise Exl3TierError(f"no RAM tier row to time PCIe copies from ({ram.num_slots} RAM slots)")
        return samples

    def _read_expert(self, layer: int, expert: int, out) -> None:
        """The expert's slot image into `out` (contiguous uint8 CPU tensor): raw checkpoint bytes, parallel reads."""
        buf = out.numpy()
        keys = self.layers[layer].keys[expert]
        jobs = []
        chunk = 4 << 20
        for f in self.layout.fields:
            p, s = f.name.split(".")
            name = f"{keys[PROJECTIONS.index(p)]}.{s}"
            for start in range(0, f.nbytes, chunk):
                n = min(chunk, f.nbytes - start)
                dst = buf[f.offset + start : f.offset + start + n]
                jobs.append(self._pool.submit(self.index.read_into, name, dst, start, n))
        for j in jobs:
            j.result()

    # ---- the seam -------------------------------------------------------------------------------------------

    def step(self, li: int, y: Any, bsz: int, selected: Any, weights: Any) -> tuple[None, Any]:
        """Called by exllamav3 after layer li's routing: make the picks readable, rewrite ids to slots in place.
        Returns exllamav3's (cpu_partial, cpu_pending): (None, (LANE_TAG, ticket, rows)) when the CPU lane computes
        some picks (our combine adds its partial), else (None, None)."""
        from glm53.tiers.copier import compute_stream

        layer = self.layers[li]
        stepper = self.stepper
        n = selected.numel()
        if n > layer.ids_host.numel():
            self._grow(layer, n)  # a prefill chunk larger than any before: safe, the stream is synced below
        decode = bsz <= MAX_BSZN
        lane = decode and stepper.lane_in_use()
        # The next layer's router runs on this layer's input: only where both are on one card.
        ahead = li + 1 < len(self.layers) and self.link_devices[self.link_of[li]] == self.link_devices[self.link_of[li + 1]]
        # nvme modes: only while guessing the next layer pays (the stepper's AheadGate), asked last, once a step.
        predict = decode and self.lookahead and ahead and stepper.wants_ahead(li + 1)
        t0 = time.perf_counter()
        stream = compute_stream(selected.device.index) if selected.is_cuda else None  # CPU: copies are done
        host = layer.ids_host[:n]
        host.copy_(selected.reshape(-1), non_blocking=True)
        if lane:  # the lane's input rows and weights cross in the same synchronisation
            layer.x_host[:bsz].copy_(y.view(bsz, -1), non_blocking=True)
            layer.w_host[:bsz].copy_(weights.view(bsz, -1), non_blocking=True)
        guess = not decode and self.lookahead and self.nvme is not None and ahead
        if predict:
            predict = self._predict_next(li + 1, y.view(bsz, -1), layer.next_host[:bsz])
        if guess:
            guess = self._predict_next(li + 1, y.reshape(-1, y.shape[-1]), layer.guess_host)
        if stream is not None:
            stream.synchronize()
        t1 = time.perf_counter()
        ids = host.numpy().reshape(selected.shape).copy()
        x = layer.x_host[:bsz].numpy().astype(np.float32) if lane else None
        w = layer.w_host[:bsz].numpy().astype(np.float32) if lane else None

        def read_ahead(busy: Any) -> None:
            if predict:
                stepper.ahead(li + 1, layer.next_host[:bsz].numpy(), busy=busy)

        # nvme modes: the guesses' store reads are queued inside resolve, right behind this step's own. Elsewhere
        # the lookahead admits into VRAM, which waits until this step's own copies are decided, so it never delays
        # this step's kernels.
        early = self.nvme is not None and predict
        resolved = stepper.resolve(li, ids, decode, x, w,
                                   next_guess=np.flatnonzero(layer.guess_host.numpy()).tolist() if guess else None,
                                   read_ahead=read_ahead if early else None)
        if not early:
            read_ahead(resolved.cpu)
        out = layer.out_host[:n]
        out.numpy()[:] = resolved.slots.reshape(-1)
        selected.copy_(out.view(selected.shape), non_blocking=True)
        self.step_time["sync"] += t1 - t0
        self.steps += 1
        return None, ((LANE_TAG, resolved.ticket, bsz) if resolved.ticket is not None else None)

    def handoff(self, like: Any) -> Any:
        """The stream-ordered lane hand-off of `like`'s device (made on first use), or None where it cannot be made
        (the lane's partial is then waited for on the host, as on a CPU device)."""
        if like.device in self.handoffs:
            return self.handoffs[like.device]
        from glm53.exl3.handoff import StreamHandOff
        from glm53.exl3.stock import ext

        try:
            h = StreamHandOff(like.device, like.shape[-1], ext())
        except Exception as exc:  # a driver without mapped registration: slower, still right
            log.warning("CPU lane: no stream-ordered hand-off on %s (%r); the host waits for the lane's partial",
                        like.device, exc)
            h = None
        self.handoffs[like.device] = h
        return h

    def _made_handoffs(self) -> list[Any]:
        return [h for h in self.handoffs.values() if h is not None]

    def check_handoff(self) -> None:
        """Raise what a lane hand-off met since the last check (glm53.exl3.handoff: after every iteration)."""
        for h in self._made_handoffs():
            h.check()

    def _predict_next(self, li: int, y: Any, out: Any) -> bool:
        """Enqueue layer li's router on this step's input y (rows, hidden) and a copy of its top-k ids into `out`
        (pinned): glm53.step.lookahead.predict_topk, GLM's selection rule (sigmoid scores plus the selection
        bias, group-limited where the config says so) on exllamav3's loaded router. A guess for prefetching,
        scored against the real picks. `out` of shape (experts,) and dtype bool gets the set of experts any row
        names instead (a prompt chunk: its rows can outnumber any fixed buffer, its set cannot). Returns False
        (and turns lookahead off with a log line) when the next layer's router is not reachable."""
        import torch

        from glm53.step.lookahead import predict_topk

        m = self.layers[li].module
        cfg = getattr(m, "routing_cfg", None)
        gate = getattr(cfg, "gate_tensor", None)
        if gate is None:
            log.warning("router lookahead off: %s has no loaded router (routing_cfg.gate_tensor)", m.key)
            self.lookahead = False
            return False
        bias = cfg.e_score_correction_bias
        if bias is None:
            bias = torch.zeros(gate.shape[1], device=gate.device)
        z = m.router_pre_norm.forward(y, {}, out_dtype=torch.half) if m.router_pre_norm else y
        ids = predict_topk(z, gate.t(), bias, self.top_k, n_group=cfg.n_group or 1, topk_group=cfg.topk_group or 1)
        if out.dtype == torch.bool:
            named = torch.zeros(out.shape, dtype=torch.bool, device=ids.device)
            named[ids.reshape(-1)] = True
            ids = named
        out.copy_(ids, non_blocking=True)
        return True

    def _recompute(self, li: int, expert: int, x_rows: np.ndarray) -> Any:
        """The exact path for a CPU-lane job the lane could not finish: stream the expert into the last staging row
        of the layer's own (never a borrowed cache slot; the copy stream waits for the kernels already queued on it)
        and run that slot's linears like exllamav3's torch expert path."""
        import torch

        layer, tiers, link = self.layers[li], self.tiers, self.tiers.link(li)
        s = tiers.staging_rows - 1
        link.copier.copy(link.staging[s], tiers.bytes_of(li, expert)).wait()
        tiers.stats.add_bytes("ram_to_staging", self.layout.nbytes)
        m, idx = layer.module, layer.slots + s
        gates, ups, downs = layer.slot_linears
        xc = torch.from_numpy(np.ascontiguousarray(x_rows)).to(link.device, torch.half)
        u = ups[idx].forward(xc, {})
        g = gates[idx].forward(xc, {})
        a = u if m.interm_dtype == torch.half else torch.empty_like(u, dtype=torch.half)
        m.activation_fn_call(g, u, a, m.act_limit)
        return downs[idx].forward(a, {}).float()

    # ---- reporting / teardown -------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        if self.tiers is None:
            return {}
        doc = self.tiers.stats.snapshot()
        lane = self.stepper is not None and self.stepper.lane is not None
        mode = ("nvme" if lane else "nvme-exact") if self.nvme is not None else ("fast" if lane else "exact")
        doc.update(
            mode=mode,
            expert_bytes=self.layout.nbytes,
            staging_slots=self.staging_slots,
            staging_rows=self.tiers.staging_rows,
            borrowed_slots=len(self.tiers.lent),
            moe_layers=len(self.layers),
            experts_per_layer=self.num_experts,
            layer_steps=self.steps,
        )
        if self.stepper is not None:
            doc.update(self.stepper.snapshot())
            doc["host_seconds"].update({k: round(v, 4) for k, v in self.step_time.items()})
            if "cpu_lane" in doc:  # lane partials added in stream order (glm53.exl3.handoff)
                doc["cpu_lane"]["stream_handoffs"] = sum(h.handed for h in self._made_handoffs())
        if len(self.tiers.links) > 1:
            doc["devices"] = self.device_snapshot(doc)
        if self.nvme is not None:
            doc["nvme_fault"] = self.nvme.health()
            doc["store_reads"] = self.nvme.read_summary()
        return doc

    def tier_counts(self) -> dict[str, int]:
        """The running counts a span of work is read against (a request, a bench run): picks by where they were
        read from, experts that left VRAM for borrowed staging, admissions, evictions, RAM drops (nvme modes)."""
        snap = self.tiers.stats.snapshot()
        out = {f"picks_{k}": int(v) for k, v in snap.get("picks", {}).items() if isinstance(v, (int, float))}
        out.update({k: int(snap[k]) for k in ("admissions", "evictions", "ram_drops")
                    if isinstance(snap.get(k), (int, float))})
        out["lent_out"] = self.stepper.lent_out if self.stepper is not None else 0
        return out

    def device_snapshot(self, doc: dict | None = None) -> list[dict]:
        """Per device share (link): its MoE layers, their picks by lane, and the bytes its PCIe link carried."""
        doc = self.tiers.stats.snapshot() if doc is None else doc
        out = []
        for i, link in enumerate(self.tiers.links):
            mine = [row for li, row in enumerate(doc["layers"]) if self.link_of[li] == i]
            lanes: dict[str, int] = {}
            for row in mine:
                for lane, n in row["lanes"].items():
                    lanes[lane] = lanes.get(lane, 0) + n
            out.append({"device": str(link.device), "moe_layers": [li for li in range(len(self.layers))
                                                                   if self.link_of[li] == i],
                        "picks": sum(row["picks"] for row in mine), "lanes": lanes, "link_bytes": link.moved})
        return out

    def routing_counts(self) -> np.ndarray:
        return self.tiers.routing_counts()

    def check_invariants(self) -> None:
        self.tiers.check_invariants()
        for li, layer in enumerate(self.layers):
            vl, tiers = self.tiers.vram[li], self.tiers
            for i, (g, u, d) in enumerate(zip(*layer.slot_linears, strict=True)):
                views = vl.views(i) if i < layer.slots else tiers.layout.views(tiers.staging_slot(i - layer.slots, li))
                for p, lin in zip(PROJECTIONS, (g, u, d), strict=True):
                    assert lin.inner.trellis.data_ptr() == views[f"{p}.trellis"].data_ptr(), "slot tensor replaced"

    def close(self) -> None:
        """Restore the modules (if unload() has not already) and drop the arenas. Also after install() alone (a
        model.load() or populate() that failed): the seam is not open then, so unload() would not restore them."""
        for handoff in self._made_handoffs():  # first: a resolver may still wait on the lane
            handoff.close()
        self.handoffs = {}
        for layer in self.layers:
            m = layer.module
            m.__dict__.pop("cpu_split_submit", None)
            m.__dict__.pop("cpu_split_combine", None)
            if layer.slot_linears is not None and m.gates is layer.slot_linears[0]:  # still shrunk to our slots
                (m.gates, m.ups, m.downs, m.modules, m.num_local_experts, m.routing_first, m.routing_last) = layer.saved
                m.cpu_split_first = None
            layer.slot_linears = None
        if self.stepper is not None and self.stepper.lane is not None:
            self.stepper.lane.close()
        if self.tiers is not None:
            self.tiers.settle_all()
        if self.nvme is not None:
            self.nvme.close()
        self.tiers = self.nvme = self.stepper = None
        self._pool.shutdown(wait=True)
        self.index.close()


def _alike_moe_modules(model: Any) -> list[Any]:
    """The model's MoE modules, each whole and shaped like the first: one slot image, one staging pool and one
    router width serve every layer, and a module exllamav3 already sliced (TP, its own CPU split) has no room
    for our expert interval."""
    mods = moe_modules(model)
    if not mods:
        raise Exl3TierError("the model has no BlockSparseMLP (MoE) layer to tier")
    num_experts, top_k = mods[0].num_experts, mods[0].num_experts_per_tok
    for m in mods:
        if m.num_experts != num_experts or m.num_experts_per_tok != top_k:
            raise Exl3TierError(f"{m.key}: {m.num_experts} experts / top-{m.num_experts_per_tok} differs from "
                                f"the first MoE layer's {num_experts} / top-{top_k}")
        if m.num_local_experts != m.num_experts or m.routing_first is not None:
            raise Exl3TierError(f"{m.key}: already an expert slice (TP or CPU split); not supported with tiers")
        if not m.gated or len(m.gates) != m.num_experts:
            raise Exl3TierError(f"{m.key}: expected gated experts (gate/up/down per expert)")
    return mods


def _checked_slots(spec: EngineSpec, moe_layers: int, num_experts: int, top_k: int) -> list[int]:
    """The spec's VRAM slots per MoE layer, refused unless they fit this model and its staging slots serve them
    (a spec planned for another checkpoint fails here, before any memory is allocated)."""
    budgets = list(spec.vram_slots)
    if len(budgets) != moe_layers:
        raise Exl3TierError(f"the spec has VRAM slots for {len(budgets)} MoE layers, the model {moe_layers}: the "
                            "plan was made for another checkpoint")
    if any(not 0 <= s <= num_experts for s in budgets):
        raise Exl3TierError(f"VRAM slots per layer must be in [0, {num_experts}], got {budgets}")
    staging = spec.staging_slots
    if staging < top_k or staging_for(budgets, num_experts, staging) != staging:
        raise Exl3TierError(f"{staging} staging slots cannot serve VRAM slots {budgets} of "
                            f"{num_experts} experts, top-{top_k} (glm53.planning.spec.staging_for)")
    return budgets


def _links(spec: EngineSpec, mods: Sequence[Any]) -> tuple[list[str], list[int]]:
    """Each link's device and each MoE module's link, from the spec's device shares; every module's decoder layer
    must lie in its share's layers (else the plan was made for another checkpoint)."""
    from glm53.tiers.links import link_plan

    devices, link_of = link_plan(spec.devices, len(mods), spec.device)
    for m, i in zip(mods, link_of, strict=True):
        layer = decoder_layer(m.key)
        if spec.devices and layer is not None and not spec.devices[i].first_layer <= layer <= spec.devices[i].last_layer:
            raise Exl3TierError(f"{m.key} is MoE layer {mods.index(m)}, which the spec's device shares put on "
                                f"{spec.devices[i].device} with decoder layers {spec.devices[i].first_layer}-"
                                f"{spec.devices[i].last_layer}: the plan was made for another checkpoint")
    return devices, link_of



def _slot_loader(lin: Any, trellis: Any, suh: Any, svh: Any, mcg: Any, mul1: Any) -> Callable[..., None]:
    """A replacement `Linear.load` that builds the LinearEXL3 on arena views instead of checkpoint tensors."""

    def load(device: Any, **kwargs: Any) -> None:
        from exllamav3.modules.quant.exl3 import LinearEXL3

        lin.device = device
        lin.used_alt_key = False
        lin.inner = LinearEXL3(lin.config, lin.in_features, lin.out_features, None, None, None, suh, svh, trellis, mcg,
                               mul1, None, lin.out_dtype, key=lin.key)
        lin.quant_type = "exl3"

    return load


def _seam(tiered: TieredMoE, li: int) -> Callable[..., tuple[None, Any]]:
    def cpu_split_submit(y: Any, bsz: int, selected_experts: Any, routing_weights: Any) -> tuple[None, Any]:
        return tiered.step(li, y, bsz, selected_experts, routing_weights)

    return cpu_split_submit


def _combine(module: Any, tiered: TieredMoE) -> Callable[..., Any]:
    """The module's combine with the CPU lane's partial added: exllamav3 calls it after it queued the GPU expert
    kernels, so the host does the step's deferred bookkeeping (MoeStepper.after_launch) while the GPU works. On CUDA
    the partial is added in stream order (glm53.exl3.handoff): the host does not wait for the lane here. A ticket the
    lane has already left to the exact path is recomputed here instead, on this thread, before anything on the GPU
    waits (a recompute behind a flag wait could wait for that flag). On a CPU device (the fake exllamav3 in the
    tests) the host waits for the lane; the partial lands before the post norms."""
    stock = module.cpu_split_combine

    def cpu_split_combine(final_hidden_states: Any, cpu_partial: Any, cpu_pending: Any, shape: Any) -> Any:
        import torch

        tiered.stepper.after_launch()
        if isinstance(cpu_pending, tuple) and len(cpu_pending) == 3 and cpu_pending[0] == LANE_TAG:
            _, ticket, rows = cpu_pending
            stream_order = final_hidden_states.is_cuda and not ticket.needs_recompute()
            handoff = tiered.handoff(final_hidden_states) if stream_order else None
            if handoff is not None:
                return handoff.enqueue(final_hidden_states, ticket, rows, shape)
            partial = torch.from_numpy(ticket.partial(rows)).to(final_hidden_states.device)
            return final_hidden_states + partial.view(shape).to(final_hidden_states.dtype)
        return stock(final_hidden_states, cpu_partial, cpu_pending, shape)

    return cpu_split_combine
