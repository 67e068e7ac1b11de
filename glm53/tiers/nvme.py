"""The NVMe tier of the nvme modes: the RAM tier as a cache of the record store, fed by O_DIRECT reads.

Every expert is in the store; the RAM arena holds as many as the plan's RAM budget allows, exclusive of VRAM.
The arena is one block of 4 KiB-aligned rows, one per record (pinned where CUDA is), so a store read lands in
the very bytes that the CPU lane computes on and that the copy engines take to VRAM: no bounce, no second copy.

Reads run on the StoreReader's native threads; everything else (claiming a slot, landing, dropping) happens on the thread
that owns the tiers, so the tier state needs no lock (only what health() reads from the server's thread has one).
A read's expert is FROM_STORE while it is in flight and
becomes RAM only when the reader says its bytes are there and pass their xxh3 check (`ExpertTiers.land_read`).

  demand    the step's store misses, all queued at once at demand priority, then waited for one by one;
  prefetch  predicted (layer, expert) picks read ahead at prefetch priority, guarded until their layer runs and
            scored when it does (glm53.tiers.nvme_prefetch);
  victims   when RAM is full the weakest RAM expert by its layer's policy score is dropped (the store has it;
            glm53.tiers.ranking);
  warm-up   the tiers filled from saved routing statistics at start (glm53.tiers.nvme_warm);
  meter     the store's load, its idle time between decode steps, what a right guess saves (glm53.tiers.nvme_meter);
  faults    the reader retries I/O errors, short reads and checksum failures; a demanded read that is still not
            back after `timeout_s` is retried into a fresh slot (its old slot is retired until the slow read
            returns, since it may still write there). What still fails is raised as the reader's StoreReadError or
            StoreCorruptError, which name the store path and the record, and is kept as a fault for `health()`
            until that record reads cleanly. Nothing unverified is ever marked resident.

    tier = open_nvme_tier(store, model_dir, plan, stats_path=...)   # glm53.tiers.nvme_open: verify, size, warm
    stepper = MoeStepper(tier.tiers, slots, staging, nvme=tier)        # glm53.step.stepper: the real layer step
    step = stepper.resolve(layer, ids, decode)                         # misses read through the tier, slot ids back
    tier.prefetch([(layer + 1, e) for e in predicted])                 # router lookahead
    tier.health()                                                      # None, or the fault for /ready
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from glm53.planning.routing import save_routing_stats
from store.directio import alloc_aligned, alloc_slots
from store.errors import StoreError, StoreReadError
from store.format import SEGMENT_ALIGN, Layout, StoreHeader, align_up
from store.reader import Priority, StoreReader
from store.verify import pack_command

from .copier import Copier
from .layout import Field, SlotLayout
from .nvme_meter import StoreMeter
from .nvme_prefetch import Prefetch
from .nvme_warm import warm
from .ram import pin_host
from .tiers import FROM_STORE, STORE, ExpertTiers, TierError, Where

log = logging.getLogger("glm53.tiers.nvme")

DEFAULT_TIMEOUT_S = 5.0  # a 9 MiB O_DIRECT read takes milliseconds; seconds means a stalled or failing disk
TORCH_DTYPES = {"int16": torch.int16, "float16": torch.float16}
READABLE = (Where.VRAM, Where.RAM, Where.TO_VRAM)
# The per-step paths compare tier states as plain ints: a numpy int8 compared with an IntEnum member goes through
# the enum machinery's attribute lookups (~3 us a comparison in Python 3.11, against ~0.05 us for an int), and
# these run for every pick and every prefetched expert of every layer step.
_READABLE = frozenset(int(w) for w in READABLE)


def record_layout(lay: Layout) -> SlotLayout:
    """The tiers' slot image of one store record layout: the record payload, field for field."""
    fields = tuple(Field(s.name, TORCH_DTYPES[s.dtype], s.shape, s.offset) for s in lay.segments)
    return SlotLayout(fields, align_up(lay.length, SEGMENT_ALIGN))


def slot_layout(header: StoreHeader, layers: Sequence[int]) -> SlotLayout:
    """The slot image of the store's MoE layers, which must share one record layout."""
    layouts = {header.layout(layer) for layer in layers}
    if len(layouts) != 1:
        raise ValueError(f"the store's MoE layers have {len(layouts)} different record layouts; the tiers need one")
    return record_layout(layouts.pop())


@dataclass
class _Read:
    layer: int  # tier layer index
    expert: int
    slot: int
    future: Future
    since: float  # the clock its timeout runs from: issue, or demand for a prefetch being waited on
    demanded: bool  # a step waits for it (retried on timeout); else a prefetch or warm-up read (a guess)
    timeouts: int = 0


class NvmeTier:
    def __init__(
        self,
        reader: StoreReader,
        num_experts: int,
        vram_slots: Sequence[int],
        ram_slots: int,
        *,
        layers: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        pin: bool | None = None,
        copier: Copier | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        timeout_retries: int = 1,
        window: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        vram_storage: Sequence[torch.Tensor] | None = None,
        staging_slots: int = 2,
        staging_rows: int | None = None,
        link_devices: Sequence[torch.device | str] | None = None,
        link_of: Sequence[int] | None = None,
    ):
        """reader: a StoreReader (or anything with its read/header/path/max_extent). layers: the store's layer
        number of each tier layer index (default: every layer in the store, ascending). ram_slots: the RAM arena
        in records of `reader.max_extent` bytes; the caller sizes it from the plan. window: prefetched records
        outstanding at most (default two layers' worth of top-8 picks, as the plan's staging). vram_storage:
        per-layer (slots, nbytes) device tensors to adopt (the engine's slot arenas under exllamav3). link_devices,
        link_of: a layer split across devices (ExpertTiers); the RAM arena and the store stay one, shared."""
        self.reader = reader
        self.read_timing: dict[int, float] = {}  # open_nvme_tier: seconds a record alone took by parts, when timed
        self.two_at_once_gain: float | None = None  # open_nvme_tier: two records at once over one after the other
        header = reader.header
        self.store_layers = list(layers) if layers is not None else sorted({e.layer for e in header.entries})
        self.layout = slot_layout(header, self.store_layers)
        self.stride = reader.max_extent
        self.timeout_s = timeout_s
        self.timeout_retries = timeout_retries
        self.window = 32 if window is None else window
        self.clock = clock
        pin = torch.cuda.is_available() if pin is None else pin
        self.arena = alloc_slots(ram_slots, self.stride)  # each row 4 KiB-aligned: O_DIRECT reads land in place
        storage = torch.from_numpy(self.arena)
        if pin and ram_slots:
            pin_host(storage)
        self.tiers = ExpertTiers(
            self.layout, num_experts, vram_slots, ram_slots, keep_all=False, device=device, pin=pin,
            fetch=self._read_sync, copier=copier, ram_storage=storage,
            vram_storage=vram_storage, staging_slots=staging_slots, staging_rows=staging_rows,
            link_devices=link_devices, link_of=link_of,
        )
        self.tiers.store = self
        self.stats = self.tiers.stats
        self._reads: dict[tuple[int, int], _Read] = {}
        self._retired: dict[int, Future] = {}  # RAM slot -> the timed-out read that may still write into it
        self.guesses = Prefetch(self)  # reads ahead of the layers that need them
        self._faults: dict[tuple[int, int], dict] = {}
        self._lock = threading.Lock()  # health() runs on the server's thread; the rest on the tiers' owner
        self._bounce: np.ndarray | None = None
        self.meter = StoreMeter(reader, len(self.store_layers))  # the store's load and idle, what guesses save
        self.idle_after = self.meter.idle_after

    # ---- geometry -------------------------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return Path(self.reader.path)

    @property
    def num_layers(self) -> int:
        return self.tiers.num_layers

    @property
    def num_experts(self) -> int:
        return self.tiers.num_experts

    @property
    def budget_bytes(self) -> int:
        """The RAM tier's whole arena: what the tier may ever hold (in flight and retired slots included)."""
        return self.arena.nbytes

    def resident_bytes(self) -> int:
        """Arena bytes in use: landed experts, reads in flight, retired slots. Never above `budget_bytes`."""
        return self.tiers.ram.in_use() * self.stride

    def layer_index(self, store_layer: int) -> int:
        """The tier layer index of a model layer number (as the store and the checkpoint number them)."""
        return self.store_layers.index(store_layer)

    # ---- the step's misses (StoreSource) -----------------------------------------------------------------------

    def demand(self, layer: int, experts: np.ndarray, decode: bool = True) -> None:
        """Queue reads of every expert of this step that is only in the store, before anything waits. decode: what
        the guesses read ahead for it saved counts towards guess_saving (a prompt's reads ahead, most of a layer
        still queued when it runs, say nothing of decode's)."""
        self.poll()
        experts = np.asarray(experts, np.int64)
        where = self.tiers.where[layer]
        es = experts.tolist()
        codes = where[experts].tolist() if es else []
        self.guesses.settle(layer, es, codes, decode)
        now = self.clock()
        for e, c in zip(es, codes, strict=True):
            # Only an expert in (or being read from) the store may need a read: issuing one never drops this step's
            # experts (they are its protect) and only reads in flight land or fail, so the others stay as they are.
            if c < STORE:
                continue
            w = int(where[e])  # read again each time: a read issued for one expert may land or drop others
            if w == STORE:
                self._issue(layer, e, experts, Priority.DEMAND, demanded=True)
            elif w == FROM_STORE:
                r = self._reads[(layer, e)]
                if not r.demanded:  # a prefetch still in flight: from now on a step waits for it
                    r.demanded, r.since = True, now
                    self._promote(r)

    def settle_guesses(self, layer: int, experts: list[int], codes: list[int], decode: bool = True) -> None:
        """A step of `layer` none of whose `experts` (tier states `codes`) is in the store: what `demand` does for
        it, which is only settling the guesses read ahead for the layer (it has no read to issue)."""
        self.guesses.settle(layer, experts, codes, decode)

    def wait(self, layer: int, expert: int, protect: np.ndarray | None = None) -> None:
        """Block until the expert is readable in RAM (reading it if it is only in the store). Raises StoreError
        naming the store and the record when its read fails or stays stalled after the retries."""
        protect = np.asarray([expert] if protect is None else protect, np.int64)
        while True:
            w = int(self.tiers.where[layer, expert])
            if w in _READABLE:
                return
            if w == STORE:
                self._issue(layer, expert, protect, Priority.DEMAND, demanded=True)
                continue
            if w != FROM_STORE:  # TO_RAM: a write-back the caller settles, not a store read
                raise TierError(f"expert {layer}/{expert} is {Where(w).name}: settle its move first")
            r = self._reads[(layer, expert)]
            if not r.demanded:
                r.demanded = True
                self._promote(r)
            error = self._await(r, protect)
            if error is not None:
                raise error

    def poll(self) -> int:
        """Land every finished read, reclaim retired slots whose late read is over; never blocks."""
        landed = 0
        if self._reads:  # polled several times a layer step, mostly with nothing in flight
            for key, r in list(self._reads.items()):
                if r.future.done():
                    landed += self._finish(key) is None
        if self._retired:
            for slot, fut in list(self._retired.items()):
                if fut.done():
                    with self._lock:
                        del self._retired[slot]
                    self.tiers.reclaim(slot)
        return landed

    # ---- prefetch ---------------------------------------------------------------------------------------------

    def prefetch(self, picks: Iterable[tuple[int, int]], *, protect: Mapping[int, Iterable[int]] | None = None,
                 window: int | None = None) -> int:
        """Read predicted (layer, expert) picks ahead, most likely first; returns the reads started (Prefetch.read)."""
        return self.guesses.read(picks, protect=protect, window=window)

    def prefetch_prefill(self, layers: Sequence[int], picks: Mapping[int, Iterable[int]] | None = None, *,
                         protect: Mapping[int, Iterable[int]] | None = None, window: int | None = None) -> int:
        """Read prefill's upcoming layers ahead, nearest first (Prefetch.read_prefill)."""
        return self.guesses.read_prefill(layers, picks, protect=protect, window=window)

    # ---- start-up ---------------------------------------------------------------------------------------------

    def warm(self, counts: np.ndarray | None, depth: int = 16) -> dict:
        """Place experts from saved routing statistics, `depth` reads in flight (glm53.tiers.nvme_warm.warm)."""
        return warm(self, counts, depth)

    def save_routing_stats(self, path: str | Path, steps: int = 0) -> None:
        """Save the per-layer pick statistics for the next start's warm-up."""
        save_routing_stats(path, self.tiers.routing_counts(), self.model_key, steps)

    @property
    def model_key(self) -> str:
        return model_key(self.reader.header)

    # ---- health -----------------------------------------------------------------------------------------------

    def health(self) -> dict | None:
        """None while the store serves cleanly; else what /ready should report: records that failed (the tier
        keeps serving every other record), reads a step waits for stalled past the timeout, slots held by reads
        given up on."""
        now = self.clock()
        with self._lock:
            faults = [dict(f) for f in self._faults.values()]
            # Only reads a step waits for: a prefetch may queue behind demand reads on a busy disk for longer than
            # the timeout, which is a guess waiting, not a disk fault.
            stalled = sum(r.demanded and now - r.since > self.timeout_s for r in self._reads.values())
            retired = len(self._retired)
        if not faults and not stalled and not retired:
            return None
        faults.sort(key=lambda f: (f["layer"], f["expert"]))
        return {"state": "fault" if faults else "degraded", "store": str(self.path), "faults": faults,
                "stalled_reads": stalled, "retired_slots": retired}

    def load(self) -> float:
        """The store's recent load, 0..1 (StoreMeter.load)."""
        return self.meter.load()

    def mark_step(self, layer: int | None) -> None:
        """A decode step of `layer` begins, None a prompt's (StoreMeter.mark_step)."""
        self.meter.mark_step(layer)

    def guess_saving(self) -> float:
        """The share of a store read a right guess recently saved, 0..1 (StoreMeter.guess_saving)."""
        return self.meter.guess_saving()

    def read_summary(self) -> dict:
        """How the store is read, for /stats: parts per record, the timings that chose it (ms by parts, when the
        tier timed them as it opened), how much faster two records came in read at once than one after the other
        (timed as it opened; it sets the guess reads allowed at once), the store's load (see `load`) and its busy
        seconds so far, and the reader's counts (reads, bytes, retries, errors, cancelled, reads checked by their
        parts' hashes, queued; the guess reads allowed at once), and the decode's idle seconds
        after each layer's step (see `mark_step`)."""
        return {"parts": getattr(self.reader, "pieces", 1), **self.meter.summary(),
                "timed_ms_by_parts": {str(n): round(t * 1e3, 3) for n, t in sorted(self.read_timing.items())},
                "two_at_once_gain": None if self.two_at_once_gain is None else round(self.two_at_once_gain, 3),
                **self.reader.stats()}

    # ---- lifetime ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the reader (queued reads are cancelled, running ones finish) and detach from the tiers."""
        self.reader.close()
        self.tiers.store = None

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- invariants -------------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The tier rules plus this tier's: every store read in flight owns a pending RAM slot of its expert,
        retired slots are exactly the given-up reads', guards only on prefetched experts, bytes within budget."""
        t = self.tiers
        t.check_invariants()
        reading = {(int(a), int(b)) for a, b in zip(*np.nonzero(t.where == Where.FROM_STORE), strict=True)}
        assert reading == set(self._reads), "FROM_STORE experts and reads in flight disagree"
        for (layer, e), r in self._reads.items():
            assert t.ram.slot_of[layer, e] == r.slot and t.ram.pending[r.slot], f"read of {layer}/{e} lost its slot"
        retired = set(np.flatnonzero(t.ram.owner == -2).tolist())
        assert retired == set(self._retired), "retired RAM slots disagree with the reads given up on"
        guarded = {(int(a), int(b)) for a, b in zip(*np.nonzero(t.ram_guard), strict=True)}
        assert guarded <= self.guesses.outstanding, "a guard on an expert that was not prefetched"
        assert self.resident_bytes() <= self.budget_bytes, "the RAM tier outgrew its budget"

    # ---- internals --------------------------------------------------------------------------------------------

    def _issue(self, layer: int, e: int, protect: np.ndarray | None, priority: Priority, demanded: bool,
               may_wait: bool = True, timeouts: int = 0, kind: str | None = None) -> _Read:
        """Claim a RAM slot (dropping the weakest unprotected RAM expert, or waiting for reads in flight to land
        when nothing can be dropped) and queue the read into it."""
        while True:
            slot = self.tiers.begin_read(layer, e, protect)
            if slot is not None:
                break
            if may_wait and self._wait_oldest(protect):
                continue
            if self._retired:  # the disk, not the plan: reads given up on still hold the slots
                err = StoreReadError(f"store {self.path}: {self._where((layer, e))} cannot be read: "
                                     f"{len(self._retired)} of the RAM tier's {self.tiers.ram.num_slots} slots are "
                                     "held by reads that stalled (the disk is stalled or failing)", self._fix())
                self._fault((layer, e), err)
                raise err
            raise TierError(f"RAM tier full ({self.tiers.ram.num_slots} slots) of experts in use: cannot read "
                            f"{layer}/{e}")
        fut = self.reader.read(self.store_layers[layer], e, self.arena[slot], priority=priority)
        r = _Read(layer, e, slot, fut, self.clock(), demanded, timeouts)
        with self._lock:
            self._reads[(layer, e)] = r
        self.stats.add_nvme(kind or ("reads" if demanded else "prefetch_reads"))
        return r

    def _promote(self, r: _Read) -> None:
        """A prefetch a step now waits for goes ahead of the other guesses still queued (a guess one layer ahead
        is often still queued when its layer runs, behind that layer's wrong guesses)."""
        promote = getattr(self.reader, "promote", None)  # test doubles of the reader may lack it
        if promote is not None and promote(self.store_layers[r.layer], r.expert, self.arena[r.slot]):
            self.stats.add_nvme("promoted")

    def _wait_oldest(self, protect: np.ndarray | None) -> bool:
        """Wait for the oldest read in flight to land or fail (freeing or filling a slot); False if there is none.
        Reads a step waits for are all of that step's layer, so its `protect` is the right one for a retry."""
        if not self._reads:
            return False
        self._await(next(iter(self._reads.values())), protect)
        return True

    def _await(self, r: _Read, protect: np.ndarray | None) -> StoreError | None:
        """Wait for one read until its deadline; land it, or handle its failure or timeout. Returns the error
        that ended a failed read (already recorded as a fault), None when it landed or was retried."""
        key = (r.layer, r.expert)
        try:
            r.future.result(timeout=max(0.0, r.since + self.timeout_s - self.clock()))
        except FutureTimeout:
            return self._timed_out(r, protect)
        except (Exception, CancelledError):  # noqa: BLE001 - the reader's error is taken from the future below
            pass
        return self._finish(key)

    def _finish(self, key: tuple[int, int]) -> StoreError | None:
        """A read's future is done: land it, or put the expert back in the store and keep the fault."""
        with self._lock:
            r = self._reads.pop(key)
        exc = _exception(r.future)
        if exc is None:
            self.tiers.land_read(r.layer, r.expert)
            if key in self._faults:  # only this thread adds faults: no lock needed to look
                with self._lock:
                    del self._faults[key]
            return None
        self.tiers.abort_read(r.layer, r.expert)  # the reader is done with the slot: free it
        self.guesses.outstanding.discard(key)
        self.stats.add_nvme("failed_reads")
        if not isinstance(exc, StoreError):
            exc = StoreReadError(f"store {self.path}: {self._where(key)}: {type(exc).__name__}: {exc}", self._fix())
        self._fault(key, exc)
        return exc

    def _timed_out(self, r: _Read, protect: np.ndarray | None) -> StoreError | None:
        """Give the slow read up: retire its slot (it may still write there) and, for a demanded read, read the
        record again into a fresh slot, up to `timeout_retries` times; then it is a fault."""
        key = (r.layer, r.expert)
        with self._lock:
            del self._reads[key]
        slot = self.tiers.abort_read(r.layer, r.expert, retire=True)
        with self._lock:
            self._retired[slot] = r.future
        self.guesses.outstanding.discard(key)
        self.stats.add_nvme("timeouts")
        if not r.demanded:
            return None  # a guess that did not come back: the store still has the expert
        if r.timeouts < self.timeout_retries:
            self._issue(r.layer, r.expert, protect, Priority.DEMAND, demanded=True, timeouts=r.timeouts + 1)
            return None
        err = StoreReadError(f"store {self.path}: {self._where(key)}: no data after {r.timeouts + 1} attempts of "
                             f"{self.timeout_s:g} s each (the disk is stalled or failing)", self._fix())
        self._fault(key, err)
        return err

    def keep_free(self, n: int, keep: Mapping[int, Collection[int]] | None = None) -> int:
        """Drop the weakest droppable RAM experts (neither guarded, nor read by a copy in flight, nor in `keep`,
        {layer: experts}; the store has them) until n RAM slots are free, so that a decode step's demand reads claim
        slots without a victim search while the GPU waits. Returns the number dropped."""
        t, dropped = self.tiers, 0
        while t.ram.free_count() < n:
            victim = t.weakest_droppable(keep)
            if victim is None:
                break
            t.drop_ram(*victim)
            dropped += 1
        return dropped

    def _fault(self, key: tuple[int, int], exc: StoreError) -> None:
        now = time.time()
        with self._lock:
            f = self._faults.get(key)
            if f is None:
                f = self._faults[key] = {"layer": key[0], "store_layer": self.store_layers[key[0]], "expert": key[1],
                                         "record": self._where(key), "count": 0, "first": now}
            f.update(error=exc.problem, fix=exc.fix, count=f["count"] + 1, last=now)
        log.error("%s", exc)

    def _where(self, key: tuple[int, int]) -> str:
        return self.reader.header.entry(self.store_layers[key[0]], key[1]).where()

    def _fix(self) -> str:
        return (f"run glm53 verify-store {self.path}; if it fails (or the disk reports errors in dmesg), repack: "
                f"{pack_command(self.path, self.reader.header.source_hint)}")

    def _read_sync(self, layer: int, e: int, out: torch.Tensor) -> None:
        """A blocking read into any host tensor (through one aligned bounce row): ExpertTiers' `fetch`."""
        if self._bounce is None:
            self._bounce = alloc_aligned(self.stride)
        try:
            done = self.reader.read(self.store_layers[layer], e, self._bounce).result(self.timeout_s * 4)
        except FutureTimeout:
            self._bounce = None  # the stalled read may still write into it: the next read gets a new one
            raise StoreReadError(f"store {self.path}: {self._where((layer, e))}: no data after "
                                 f"{self.timeout_s * 4:g} s (the disk is stalled or failing)", self._fix()) from None
        out.copy_(torch.from_numpy(done.data[: self.layout.nbytes]))


def _exception(fut: Future) -> BaseException | None:
    if fut.cancelled():
        return CancelledError("the read was cancelled (the store reader closed)")
    return fut.exception()


def model_key(header: StoreHeader) -> str:
    """The identity routing statistics are saved under: the checkpoint's config hash, as the store records it."""
    return "glm53-" + str(header.identity.get("config_sha256", "unknown"))[:16]
