"""ExpertTiers: where every routed expert lives, and the only code that moves one.

Each (layer, expert) is in exactly one state:
  VRAM     landed in a slot of its layer and visible in the router map;
  RAM      in the RAM tier, readable;
  TO_VRAM  being copied RAM -> VRAM: still owns (and is readable from) its RAM slot until the copy lands;
  TO_RAM   being written back VRAM -> RAM after eviction: readable nowhere until it lands;
  STORE    only in the NVMe store (nvme modes; in the all-RAM modes this state is never entered);
  FROM_STORE  being read from the store into its (pending) RAM slot: readable nowhere until the read lands.
So no expert is ever resident in both tiers, none is lost, and an expert becomes resident only in `_land`,
after its copy's ticket says the bytes are there. Fills and write-backs run on separate copy streams, so the
one ordering that matters is made explicit: a fill into a slot waits for the write-back still reading it.
A RAM slot is reused only after the copies touching it have landed (host-confirmed), so it needs none.

Store reads are asynchronous in the nvme modes: a `StoreSource` (glm53.tiers.nvme) attached as `store` claims a
RAM slot with `begin_read`, reads into it on its own threads, and calls `land_read` (or `abort_read`) from the
thread that owns these tiers. Without one, `fetch` reads synchronously.

The parts it keeps, each on its own: the VRAM slot arenas (glm53.tiers.vram) and the RAM arena (glm53.tiers.ram),
which only keep books; who leaves RAM (glm53.tiers.ranking: the policies, the guards, each layer's weakest expert);
the staging rows lent by other layers' slots (glm53.tiers.lending); one copy link per card (glm53.tiers.links);
the RAM experts a copy in flight still reads (glm53.tiers.holds).
What stays here is the state of each expert and every move between the tiers, since each move changes several
parts at once and must keep them agreeing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from glm53.planning.spec import borrowed_rows

from .copier import Copier, Ticket
from .holds import Holds
from .layout import SlotLayout
from .lending import Lending
from .links import Link
from .policy import choose_admissions, hot_order
from .ram import RamTier
from .ranking import Ranking
from .states import FROM_STORE, RAM, STORE, TO_RAM, TO_VRAM, VRAM, Where
from .stats import TierStats
from .vram import LENT, VramLayer

# fill(layer, expert, out): write the expert's slot image into `out` (a contiguous uint8 host tensor).
Loader = Callable[[int, int, torch.Tensor], None]


class StoreSource(Protocol):
    """Asynchronous store reads behind the RAM tier (nvme modes). Called only from the thread owning the tiers."""

    def demand(self, layer: int, experts: np.ndarray, decode: bool = True) -> None:
        """The step about to run uses `experts` of `layer`: start reading those only in the store, all at once.
        decode: a decode step (a prompt chunk's reads ahead are no guide to what decode's guesses save)."""

    def wait(self, layer: int, expert: int, protect: np.ndarray | None) -> None:
        """Block until the expert (STORE or FROM_STORE) is readable in RAM; raise a StoreError if it cannot be."""

    def poll(self) -> int:
        """Land the reads that have finished (never blocks); returns how many landed."""


class TierError(RuntimeError):
    """A tier operation that cannot be done without breaking an invariant (the caller's bug or a bad plan)."""


@dataclass
class _Move:
    ticket: Ticket
    to_vram: bool
    slot: int  # destination: the VRAM slot (to_vram) or the RAM slot (write-back)


def _check_ram_slots(ram_slots: int, vram_slots: Sequence[int], num_experts: int, lent: int, keep_all: bool,
                     fetch: Loader | None) -> None:
    """Refuse a RAM tier too small for its mode before anything is allocated. All-RAM: every expert not in VRAM,
    those whose slots are lent to staging, and one spare for a write-back in flight. A cache of the store: `fetch`,
    and one layer's experts plus one."""
    total, in_vram = len(vram_slots) * num_experts, int(sum(vram_slots))
    if keep_all and ram_slots < total - in_vram + lent + 1:
        raise ValueError(
            f"all-RAM tiers need ram_slots >= {total - in_vram + lent + 1} "
            f"({total} experts - {in_vram} VRAM slots + {lent} lent to staging + 1 spare for write-backs), "
            f"got {ram_slots}"
        )
    if not keep_all and fetch is None:
        raise ValueError("a RAM tier that caches the store needs `fetch` to read records")
    if not keep_all and ram_slots < num_experts + 1:
        # One step of one layer may pick all of its experts, each must sit in RAM at once (CPU lane, PCIe
        # source) while a victim's write-back needs one more slot.
        raise ValueError(f"a RAM tier that caches the store needs >= {num_experts + 1} slots, got {ram_slots}")


class ExpertTiers:
    def __init__(
        self,
        layout: SlotLayout,
        num_experts: int,
        vram_slots: Sequence[int],
        ram_slots: int,
        *,
        keep_all: bool = True,
        device: torch.device | str = "cpu",
        fetch: Loader | None = None,
        copier: Copier | None = None,
        staging_slots: int = 2,
        staging_rows: int | None = None,
        pin: bool | None = None,
        vram_storage: Sequence[torch.Tensor] | None = None,
        ram_storage: torch.Tensor | None = None,
        link_devices: Sequence[torch.device | str] | None = None,
        link_of: Sequence[int] | None = None,
    ):
        """vram_slots: slots per MoE layer (e.g. from glm53.planning.spec.split_budget). keep_all: the all-RAM modes, where
        RAM must hold every expert not in VRAM plus at least one spare slot for a write-back in flight; else
        RAM is a cache of the store and `fetch` reads a record into it. staging_slots: device buffers for
        misses streamed over PCIe without admission, per layer: staging_rows of them (default all) device rows of
        their own on each link, the rest cache slots of other layers on the same link that a step borrows
        (glm53.planning.spec.borrowed_rows; see `borrow`). vram_storage: per-layer (slots, nbytes) tensors to adopt.
        ram_storage: a (ram_slots, stride >= nbytes) host tensor to adopt as the RAM arena (the nvme tier's
        4 KiB-aligned rows, which O_DIRECT reads land in). link_devices, link_of: a layer split across devices
        (glm53.tiers.links.link_plan): each link's device, each layer's link; every link gets its own copier and
        staging_slots staging rows, each layer's slots live on its link's device (default: one link on `device`)."""
        self.layout = layout
        self.num_layers = len(vram_slots)
        self.num_experts = num_experts
        self.keep_all = keep_all
        self.device = torch.device(device)
        self.staging_rows = staging_slots if staging_rows is None else int(staging_rows)
        if not 0 < self.staging_rows <= staging_slots:
            raise ValueError(f"staging_rows {self.staging_rows} must be in [1, staging_slots {staging_slots}]")
        self.link_of = [0] * self.num_layers if link_of is None else [int(x) for x in link_of]
        lent = borrowed_rows(vram_slots, staging_slots - self.staging_rows,
                             self.link_of if len(self.link_of) == self.num_layers else None)
        _check_ram_slots(ram_slots, vram_slots, num_experts, len(lent), keep_all, fetch)
        devices = self._link_devices(link_devices, copier)
        self._build_parts(devices, vram_slots, ram_slots, staging_slots, lent, copier, pin, vram_storage, ram_storage)
        self.fetch = fetch
        self.store: StoreSource | None = None  # set by the nvme tier: async store reads replace `fetch`
        self._held = Holds()  # RAM experts a copy in flight still reads: they stay until it lands
        self.stats = TierStats(self.num_layers, vram_slots, ram_slots)
        self._moves: dict[tuple[int, int], _Move] = {}  # insertion order = issue order
        self._slot_reader: dict[tuple[int, int], Ticket] = {}  # (layer, VRAM slot) -> write-back reading it
        self._populated = False

    def _link_devices(self, link_devices: Sequence[torch.device | str] | None,
                      copier: Copier | None) -> list[torch.device]:
        """Each link's device, once every layer names one of them (self.link_of); an injected copier (a test's,
        a pacing bench's) serves one link only, since each link's copies run on their own streams."""
        devices = [self.device] if link_devices is None else [torch.device(d) for d in link_devices]
        if len(self.link_of) != self.num_layers or not all(0 <= x < len(devices) for x in self.link_of):
            raise ValueError(f"link_of {self.link_of} must name one of {len(devices)} links for each of "
                             f"{self.num_layers} layers")
        if copier is not None and len(devices) > 1:
            raise ValueError("an injected copier serves one link; a split across devices makes one per link")
        return devices

    def _build_parts(self, devices: list[torch.device], vram_slots: Sequence[int], ram_slots: int,
                     staging_slots: int, lent: Sequence[tuple[int, int]], copier: Copier | None, pin: bool | None,
                     vram_storage: Sequence[torch.Tensor] | None, ram_storage: torch.Tensor | None) -> None:
        """The parts that keep books for the moves here: one link per card, each layer's VRAM arena on its link's
        device, the staging rows lent by other layers' slots, the RAM arena, and who leaves RAM. Every expert
        starts in the store (`populate` places them)."""
        self.links = [Link(self.layout, d, self.staging_rows, copier if i == 0 else None)
                      for i, d in enumerate(devices)]
        self.vram = [
            VramLayer(self.layout, self.num_experts, s, devices[self.link_of[i]],
                      None if vram_storage is None else vram_storage[i])
            for i, s in enumerate(vram_slots)
        ]
        self.lending = Lending(lent, staging_slots - self.staging_rows, self.staging_rows, self.link_of, self.links,
                               self.vram)
        self.lent = self.lending.lent
        self.ram = RamTier(self.layout, self.num_layers, self.num_experts, ram_slots, pin, storage=ram_storage)
        self.where = np.full((self.num_layers, self.num_experts), Where.STORE, np.int8)
        self.ranking = Ranking(self.where)  # who leaves RAM: the policies, the guards, each layer's weakest
        self.policies = self.ranking.policies
        self.ram_guard = self.ranking.ram_guard
        self.copier = self.links[0].copier  # the first link's (the only one on one device)
        self.staging = self.links[0].staging  # the first link's own rows

    # ---- start-up -------------------------------------------------------------------------------------------

    def populate(self, load: Loader, counts: np.ndarray | None = None, fill_ram: bool = True) -> None:
        """Place every expert once, at start. counts: saved routing statistics (num_layers, num_experts), or None.

        VRAM gets each layer's most-picked experts; RAM the next best across layers (all of the rest in the
        all-RAM modes); the policies start from the same counts, so the warm set is not evicted at once.
        Without counts the order is by id, interleaved across layers. fill_ram=False places VRAM only (the nvme
        tier fills RAM itself, with reads in flight together, in `warm_ram_order`).
        """
        if self._populated:
            raise TierError("populate() runs once, on empty tiers")
        self._populated = True
        counts = np.zeros((self.num_layers, self.num_experts)) if counts is None else np.asarray(counts, np.float64)
        bounce = torch.empty(self.layout.nbytes, dtype=torch.uint8, pin_memory=self.ram.pinned)
        for layer, vl in enumerate(self.vram):
            self.ranking.seed(layer, counts[layer])
            order = hot_order(counts[layer])
            for slot, e in enumerate(order[: vl.num_slots]):
                load(layer, int(e), bounce)
                self.copier_of(layer).copy(vl.flat(slot), bounce).wait()
                vl.reserve(slot, int(e))
                vl.land(slot)
                self.where[layer, e] = Where.VRAM
        if fill_ram:
            for layer, e in self.warm_ram_order(counts)[: self.ram.num_slots - (1 if self.keep_all else 0)]:
                r = self.ram.alloc(layer, e, pending=False)
                load(layer, e, self.ram.flat(r))
                self.where[layer, e] = Where.RAM
        self._refresh_gauges()

    def warm_ram_order(self, counts: np.ndarray | None) -> list[tuple[int, int]]:
        """Experts not in VRAM, best first for the RAM tier: by saved count, then by rank within their layer (so
        without statistics the layers interleave), then by layer."""
        counts = np.zeros((self.num_layers, self.num_experts)) if counts is None else np.asarray(counts, np.float64)
        rest = []
        for layer in range(self.num_layers):
            order = [int(e) for e in hot_order(counts[layer]) if self.where[layer, e] != Where.VRAM]
            rest.extend((-counts[layer, e], rank, layer, e) for rank, e in enumerate(order))
        rest.sort()
        return [(layer, e) for _, _, layer, e in rest]

    # ---- reading ----------------------------------------------------------------------------------------------

    def bytes_of(self, layer: int, expert: int) -> torch.Tensor:
        """The slot image of a readable expert (VRAM or RAM); settle or fetch it first if it is moving or absent."""
        w = int(self.where[layer, expert])
        if w == VRAM:
            return self.vram[layer].flat(int(self.vram[layer].slot_of[expert]))
        if w == RAM or w == TO_VRAM:  # a fill in flight still reads from (so leaves intact) the RAM slot
            return self.ram.flat(int(self.ram.slot_of[layer, expert]))
        raise TierError(f"expert {layer}/{expert} is {Where(w).name}: not readable")

    def link(self, layer: int) -> Link:
        """The link (device, copier, staging rows) the layer's copies go over."""
        return self.links[self.link_of[layer]]

    def copier_of(self, layer: int) -> Copier:
        return self.links[self.link_of[layer]].copier

    def staging_slot(self, i: int, layer: int) -> torch.Tensor:
        """The layer's staging row i: its link's own rows first, then the cache slots it borrows (`borrow` them
        first)."""
        return self.lending.row(layer, i)

    def borrow(self, layer: int, n: int, keep: Collection[int] = ()) -> int:
        """Make the layer's first n staging rows writable: each borrowed cache slot among them that holds (or is
        receiving) an expert of its own layer gives it up, written back to RAM (and waited for). In the nvme modes
        RAM makes room by dropping its weakest expert, never one of `keep` (the borrowing step's own picks, which it
        may be about to copy from RAM); where nothing may go, the expert is dropped instead (the store has it). The
        slot stays lent until `give_back_lent`; decode admits into it again, and the next step that borrows it
        empties it again. Returns how many experts left VRAM."""
        gone, waits = 0, []
        protect = {layer: set(keep)}
        for lay, slot in self.lending.to_borrow(layer, n):
            vl = self.vram[lay]
            e = int(vl.owner[slot])
            if e == LENT:  # lent already, by this step
                continue
            if e >= 0:
                if vl.pending[slot]:  # an admission in flight into it: land it, then give it up
                    self.settle(lay, e)
                if self.keep_all or self._room_for_lent(protect):
                    self._write_back(lay, e, None)
                else:
                    vl.release(e)
                    self.where[lay, e] = STORE
                    self.stats.add_eviction(lay)
                gone += 1
            reader = self._slot_reader.pop((lay, slot), None)  # a write-back still reading it (this one's too)
            if reader is not None:
                waits.append(reader)
            self.lending.lend(lay, slot)
        for t in waits:  # the staging copies into these slots come next, on the other stream
            t.wait()
        if gone or waits:
            self.poll()
            self._refresh_gauges()
        return gone

    def _room_for_lent(self, protect: Mapping[int, Collection[int]]) -> bool:
        """nvme modes: a free RAM row, dropping the weakest RAM expert that may go (not held by a copy in flight,
        not guarded, not in `protect`) if none is free. False when none may go."""
        if self.ram.free_count():
            return True
        victim = self.weakest_droppable(protect)
        if victim is None:
            return False
        self.drop_ram(*victim)
        return self.ram.free_count() > 0

    def give_back_lent(self) -> None:
        """The slots lent to staging are free again: call once the borrowing steps' kernels are queued (the next
        step's copies wait for those)."""
        self.lending.give_back()

    def stage(self, layer: int, expert: int) -> torch.Tensor:
        """Stream a RAM expert to a staging buffer of its layer's link without admitting it (PCIe, no eviction).
        The buffer is reused by the link's next stage() call, after the compute queued so far (the copier orders
        that)."""
        src = self.bytes_of(layer, expert)
        link = self.links[self.link_of[layer]]
        dst = link.take_row()
        link.copier.copy(dst, src).wait()
        self.stats.add_bytes("ram_to_staging", self.layout.nbytes)
        return dst

    # ---- moving -----------------------------------------------------------------------------------------------

    def poll(self) -> int:
        """Land every move whose bytes have arrived (never blocks); returns how many landed."""
        done = [key for key, mv in self._moves.items() if mv.ticket.done()] if self._moves else ()
        for key in done:
            self._land(key)
        return len(done) + (self.store.poll() if self.store is not None else 0)

    def settle(self, layer: int, expert: int) -> float:
        """Block until the expert's move (if any) has landed; returns seconds waited."""
        mv = self._moves.get((layer, expert))
        if mv is None:
            return 0.0
        t0 = time.perf_counter()
        mv.ticket.wait()
        self._land((layer, expert))
        return time.perf_counter() - t0

    def settle_each(self, layer: int, experts: Sequence[int]) -> float:
        """settle() each of a layer's experts; returns the seconds waited in all."""
        moves = self._moves
        if not moves:
            return 0.0
        waited = 0.0
        for e in experts:
            if (layer, e) in moves:
                waited += self.settle(layer, e)
        return waited

    def settle_all(self) -> None:
        for layer, expert in list(self._moves):
            self.settle(layer, expert)

    def demand_reads(self, layer: int, experts: np.ndarray, decode: bool = True) -> None:
        """Tell the attached store source which experts the coming step uses, so that all of its store reads are
        in flight before the first wait. A no-op without one (synchronous `fetch`)."""
        if self.store is not None:
            self.store.demand(layer, np.asarray(experts, np.int64), decode)

    def fetch_to_ram(self, layer: int, expert: int, protect: np.ndarray | None = None) -> int:
        """Make a STORE (or FROM_STORE) expert readable in RAM, dropping the weakest RAM expert if full; returns
        its RAM slot. Through the attached store source if any, else a synchronous `fetch`."""
        if self.store is not None:
            self.store.wait(layer, expert, protect)
            return int(self.ram.slot_of[layer, expert])
        if self.where[layer, expert] != Where.STORE:
            raise TierError(f"expert {layer}/{expert} is {Where(self.where[layer, expert]).name}, not STORE")
        r = self.begin_read(layer, expert, protect)
        if r is None:
            raise TierError(f"RAM tier full ({self.ram.num_slots} slots) of experts in use: cannot read "
                            f"{layer}/{expert}")
        try:
            self.fetch(layer, expert, self.ram.flat(r))
        except BaseException:
            self.abort_read(layer, expert)
            raise
        self.land_read(layer, expert)
        return r

    # ---- store reads (the seam for an asynchronous StoreSource) -------------------------------------------------

    def begin_read(self, layer: int, expert: int, protect: np.ndarray | None = None) -> int | None:
        """Claim a RAM slot for reading a STORE expert from the store (dropping the weakest unprotected RAM expert
        if full): the expert becomes FROM_STORE, readable nowhere until `land_read`. None when RAM has no room."""
        if self.where[layer, expert] != STORE:
            raise TierError(f"read {layer}/{expert}: it is {Where(self.where[layer, expert]).name}, not STORE")
        if not self._ram_room(layer, protect):
            return None
        r = self.ram.alloc(layer, expert, pending=True)
        self.where[layer, expert] = FROM_STORE
        self.stats.set_ram_in_use(self.ram.in_use())
        return r

    def land_read(self, layer: int, expert: int) -> None:
        """The read's bytes are in the RAM slot (and checked): only now is the expert resident."""
        if self.where[layer, expert] != FROM_STORE:
            raise TierError(f"land {layer}/{expert}: it is {Where(self.where[layer, expert]).name}, not FROM_STORE")
        self.ram.land(int(self.ram.slot_of[layer, expert]))
        self.where[layer, expert] = RAM
        self.ranking.rank(layer, expert)
        self.stats.add_bytes("store_to_ram", self.layout.nbytes)
        self.stats.set_ram_in_use(self.ram.in_use())

    def abort_read(self, layer: int, expert: int, retire: bool = False) -> int:
        """A read failed or was given up: the expert is STORE again; returns the RAM slot it had. retire=True when
        the read may still be writing into the slot (a timeout): the slot stays out of use until `reclaim`."""
        if self.where[layer, expert] != FROM_STORE:
            raise TierError(f"abort {layer}/{expert}: it is {Where(self.where[layer, expert]).name}, not FROM_STORE")
        r = self.ram.retire(layer, expert) if retire else self.ram.free(layer, expert)
        self.where[layer, expert] = STORE
        self.ranking.forget_guard(layer, expert)
        self.stats.set_ram_in_use(self.ram.in_use())
        return r

    def reclaim(self, slot: int) -> None:
        """A retired RAM slot's late read has finished: the slot is free again."""
        self.ram.reclaim(slot)
        self.stats.set_ram_in_use(self.ram.in_use())

    def hold(self, layer: int, experts: int | Sequence[int], ticket: Ticket | None) -> None:
        """A copy (`ticket`) still reads these RAM experts' bytes: they are not dropped before the copy lands.
        One ticket for many experts is checked once (on the GPU each check is an event query)."""
        self._held.hold(layer, experts, ticket)

    def droppable(self) -> np.ndarray:
        """(num_layers, num_experts): RAM experts no copy in flight reads (the candidates for dropping)."""
        ok = self.where == RAM
        for key in self._held.live():
            ok[key] = False
        return ok

    def drop_ram(self, layer: int, expert: int) -> None:
        """Drop a RAM expert (nvme modes: the store still has it)."""
        if self.keep_all or self.where[layer, expert] != RAM:
            raise TierError(f"drop {layer}/{expert}: it is {Where(self.where[layer, expert]).name}"
                            + (" (all-RAM mode)" if self.keep_all else ", not RAM"))
        if self._held.reads(layer, expert):
            raise TierError(f"drop {layer}/{expert}: a copy in flight still reads it")
        self.ranking.unrank(layer, expert)
        self.ram.free(layer, expert)
        self.where[layer, expert] = STORE
        self.ranking.forget_guard(layer, expert)
        self.stats.add_ram_drop()
        self.stats.set_ram_in_use(self.ram.in_use())

    def guard(self, layer: int, expert: int) -> None:
        """Drop (layer, expert) only when nothing unguarded can go (read ahead for a step still to come)."""
        self.ranking.guard(layer, expert)

    def unguard(self, layer: int, expert: int) -> None:
        """End the guard (its layer ran, or the expert went): it is dropped by its score again."""
        self.ranking.unguard(layer, expert)

    def weakest_droppable(self, exclude: Mapping[int, Collection[int]] | None = None) -> tuple[int, int] | None:
        """The weakest RAM expert that may go now: not read by a copy in flight, not guarded, not in `exclude`
        ({layer: experts}); None when none is (Ranking.weakest_droppable)."""
        return self.ranking.weakest_droppable(self._held.live(), exclude)

    def scores(self) -> np.ndarray:
        """(num_layers, num_experts) policy scores: the keep-worthiness the RAM tier ranks victims by (a new
        array, the caller's to keep)."""
        return self.ranking.current().copy()

    def weakest(self, ok: np.ndarray) -> tuple[int, int]:
        """The lowest-scored (layer, expert) where `ok` holds (Ranking.weakest)."""
        return self.ranking.weakest(ok)

    def admit(self, layer: int, expert: int, victim: int | None = None, protect: np.ndarray | None = None,
              src: Any = None) -> int:
        """Start copying a RAM expert into a VRAM slot of its layer: a free one, else `victim`'s (written back
        first). Returns the slot; the expert becomes resident when the copy lands (poll/settle). src: a device
        buffer already holding the expert's image (the staging row a step just streamed it into), copied from
        instead of the RAM row: no second PCIe crossing."""
        if self.where[layer, expert] != RAM:
            raise TierError(f"admit {layer}/{expert}: it is {Where(self.where[layer, expert]).name}, not RAM")
        vl = self.vram[layer]
        if vl.free_count():
            slot = vl.first_free()
        elif victim is None:
            raise TierError(f"admit {layer}/{expert}: no free slot and no victim")
        else:
            slot = self._write_back(layer, victim, protect, also=expert)
        vl.reserve(slot, expert)
        self.ranking.unrank(layer, expert)
        self.ranking.forget_guard(layer, expert)  # in use now: the guard's job is done
        from_ram = src is None
        if from_ram:
            src = self.ram.flat(int(self.ram.slot_of[layer, expert]))
        ticket = self.copier_of(layer).copy(vl.flat(slot), src, after=self._slot_reader.pop((layer, slot), None))
        self._moves[(layer, expert)] = _Move(ticket, True, slot)
        self.where[layer, expert] = TO_VRAM
        self.stats.add_admission(layer)
        self.stats.add_bytes("ram_to_vram" if from_ram else "staging_to_vram", self.layout.nbytes)
        self._refresh_gauges(layer)
        return slot

    def evict(self, layer: int, expert: int, protect: np.ndarray | None = None) -> int:
        """Write a resident back to RAM and free its slot; returns the freed slot."""
        slot = self._write_back(layer, expert, protect)
        self._refresh_gauges(layer)
        return slot

    def move_ticket(self, layer: int, expert: int) -> Ticket | None:
        """The ticket of the expert's copy in flight (an admission or a write-back), or None."""
        mv = self._moves.get((layer, expert))
        return None if mv is None else mv.ticket

    def try_admit(self, layer: int, misses: np.ndarray, protect: np.ndarray,
                  source: Callable[[int], Any] | None = None) -> dict[int, int]:
        """Admit the misses the layer's policy wants (free slots first, then beating the weakest unprotected
        resident by its margin); returns {expert: slot} of the copies started. Call after observe(). Where RAM has
        no room for a victim's write-back the rest are not admitted (they stream instead): never an error.
        source(expert): a device buffer holding its image to copy from instead of RAM, or None (see admit)."""
        vl = self.vram[layer]
        plan = choose_admissions(self.policies[layer], vl.resident(), vl.free_count(), misses, protect)
        started = {}
        for e, v in plan:
            if v is not None and not self._ram_room(layer, protect, also=e):
                break
            started[e] = self.admit(layer, e, v, protect, None if source is None else source(e))
        return started

    def observe(self, layer: int, ids: np.ndarray, weight: float = 1.0) -> None:
        self.ranking.observe(layer, ids, weight)

    def routing_counts(self) -> np.ndarray:
        """(num_layers, num_experts) statistics to save for the next start's warm-up."""
        return self.ranking.counts()

    # ---- internals --------------------------------------------------------------------------------------------

    def _write_back(self, layer: int, expert: int, protect: np.ndarray | None, also: int | None = None) -> int:
        if self.where[layer, expert] != VRAM:
            raise TierError(f"evict {layer}/{expert}: it is {Where(self.where[layer, expert]).name}, not VRAM")
        if not self._ram_room(layer, protect, also):  # refused before any state changed
            raise TierError(f"RAM tier full ({self.ram.num_slots} slots): no room to write {layer}/{expert} back")
        r = self.ram.alloc(layer, expert, pending=True)
        slot = self.vram[layer].release(expert)
        ticket = self.copier_of(layer).copy(self.ram.flat(r), self.vram[layer].flat(slot))
        self._slot_reader[(layer, slot)] = ticket  # the slot's next fill must wait for this read
        self._moves[(layer, expert)] = _Move(ticket, False, r)
        self.where[layer, expert] = TO_RAM
        self.stats.add_eviction(layer)
        self.stats.add_bytes("vram_to_ram", self.layout.nbytes)
        return slot

    def _ram_room(self, layer: int, protect: np.ndarray | None, also: int | None = None) -> bool:
        """Make one RAM slot free if possible. Fills in flight free their RAM source when they land, so wait for the
        oldest; in the nvme modes dropping the weakest RAM expert (the store has it) is cheaper than waiting.
        False when neither can help: the all-RAM modes keep just enough spare for swaps, and a bare eviction
        beyond it would need a second copy's worth of RAM. `also`: one more expert to protect."""
        while self.ram.free_count() == 0:
            if also is not None:  # built only here: RAM is rarely full, and the common case must not allocate
                protect = np.append(np.asarray([] if protect is None else protect, np.int64), also)
                also = None
            if not self.keep_all and self._drop_weakest(layer, protect):
                continue
            # A landed fill frees its RAM source; in the nvme modes a landed write-back becomes a droppable RAM
            # expert (RAM full of write-backs in flight is reachable: evictions only ever add them).
            waitable = [key for key, mv in self._moves.items() if mv.to_vram or not self.keep_all]
            if waitable:
                self.stats.add_wait("pcie", self.settle(*waitable[0]))
                continue
            if self._held:  # every droppable expert is read by a copy in flight: wait for the oldest copy
                self.stats.add_wait("pcie", self._held.wait_oldest())
                continue
            return False
        return True

    def _drop_weakest(self, layer: int, protect: np.ndarray | None) -> bool:
        victim = self.weakest_droppable(None if protect is None else {layer: set(np.asarray(protect).tolist())})
        if victim is None:  # nothing unguarded may go: the search over the full masks
            ok = self.droppable()
            if protect is not None:
                ok[layer, np.asarray(protect, np.int64)] = False
            unguarded = ok > self.ram_guard  # ok and not guarded
            if unguarded.any():  # guarded experts (prefetched for a step still to come) go only when nothing else can
                ok = unguarded
            elif not ok.any():
                return False
            victim = self.weakest(ok)
        self.drop_ram(*victim)
        return True

    def _land(self, key: tuple[int, int]) -> None:
        layer, expert = key
        mv = self._moves.pop(key)
        if mv.to_vram:
            self.vram[layer].land(mv.slot)
            self.ram.free(layer, expert)  # exclusivity: the RAM copy goes the moment the VRAM one is real
            self.where[layer, expert] = VRAM
        else:
            self.ram.land(mv.slot)
            self.where[layer, expert] = RAM
            self.ranking.rank(layer, expert)
        self._refresh_gauges(layer)

    def _refresh_gauges(self, layer: int | None = None) -> None:
        if layer is not None:
            self.stats.set_gauges(layer, self.vram[layer].in_use(), self.ram.in_use())
            return
        for lay in range(self.num_layers):
            self.stats.set_slots_in_use(lay, self.vram[lay].in_use())
        self.stats.set_ram_in_use(self.ram.in_use())

    # ---- invariants -------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the tier rules; cheap enough for tests and a debug endpoint, not for every step."""
        self.ram.check_invariants()
        for vl in self.vram:
            vl.check_invariants()
        if self.keep_all:
            assert not (self.where == Where.STORE).any(), "an expert was lost (all-RAM mode, in neither tier)"
        self.ranking.check_invariants()
        for (layer, e), mv in self._moves.items():
            want = Where.TO_VRAM if mv.to_vram else Where.TO_RAM
            assert self.where[layer, e] == want, f"move of {layer}/{e} but state {Where(self.where[layer, e]).name}"
        for layer, vl in enumerate(self.vram):
            w = self.where[layer]
            in_vram_slot = np.zeros(self.num_experts, bool)
            in_vram_slot[vl.owner[vl.owner >= 0]] = True
            ram_slot = self.ram.slot_of[layer]
            for e in range(self.num_experts):
                s, r, moving = w[e], ram_slot[e], (layer, e) in self._moves
                if s == Where.VRAM:
                    ok = vl.slot_of[e] >= 0 and r < 0 and not moving
                elif s == Where.RAM:
                    ok = not in_vram_slot[e] and self.ram.holds(layer, e) and not moving
                elif s == Where.TO_VRAM:
                    mv = self._moves.get((layer, e))
                    ok = mv is not None and vl.owner[mv.slot] == e and vl.pending[mv.slot] and self.ram.holds(layer, e)
                elif s == Where.TO_RAM:
                    mv = self._moves.get((layer, e))
                    ok = mv is not None and not in_vram_slot[e] and r == mv.slot and self.ram.pending[r]
                elif s == Where.FROM_STORE:
                    ok = not in_vram_slot[e] and r >= 0 and self.ram.pending[r] and not moving
                else:
                    ok = not in_vram_slot[e] and r < 0 and not moving
                assert ok, f"expert {layer}/{e} in state {Where(s).name} disagrees with the tiers"
