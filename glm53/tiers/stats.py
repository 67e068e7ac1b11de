"""Counters of the tier machinery, for /stats (the snapshot as JSON) and /metrics (counters and gauges).

Every pick of every token is counted once, in the lane that served it:
  vram_hit  the expert was resident in VRAM;
  pcie      it was in RAM and crossed PCIe (admitted into a slot, or streamed through a staging buffer);
  cpu       it was in RAM and the CPU lane computed it there;
  nvme      it was in neither and had to be read from the store first (then computed by either lane).
In the nvme modes the store reads are counted too: demand, prefetch and start-up (warm) reads, timeouts and failed
records (`nvme`), and the
prefetcher's effect (`prefetch`): an expert read ahead and then picked is a hit (late if its read was still in
flight), one read ahead and not picked is wasted, and a store pick no prefetch covered is a demand miss; recall
is hits / (hits + demand misses), the share of would-be store waits that prefetch took off the critical path.
The decode thread updates; the server thread snapshots: one lock keeps a snapshot self-consistent. The decode thread
updates on every layer step, so the counters it touches are plain Python ints (a numpy element update costs several
times more) and become arrays only in the snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np

LANES = ("vram_hit", "pcie", "cpu", "nvme")
# staging_to_vram: admissions copied on the device from the staging row their step streamed them into.
DIRECTIONS = ("ram_to_vram", "vram_to_ram", "store_to_ram", "ram_to_staging", "staging_to_vram")
PREFETCH = ("issued", "hits", "late", "late_under_way", "wasted", "demand_misses")
# promoted: prefetches that a step came to wait for while they were still queued, moved ahead of the other guesses;
# cancelled_prefetches: wrong guesses still queued when their layer ran, dropped unread
NVME = ("reads", "prefetch_reads", "warm_reads", "timeouts", "failed_reads", "promoted", "cancelled_prefetches")


class TierStats:
    def __init__(self, num_layers: int, vram_slots: Sequence[int], ram_slots: int = 0):
        self.num_layers = num_layers
        self._lock = threading.Lock()
        self._vram_slots = np.asarray(vram_slots, np.int64)
        self._ram_slots = int(ram_slots)
        self._picks = [[0] * len(LANES) for _ in range(num_layers)]
        self._admissions = [0] * num_layers
        self._evictions = [0] * num_layers
        self._ram_drops = 0  # nvme modes: RAM victims dropped (the store still has them)
        self._bytes = dict.fromkeys(DIRECTIONS, 0)
        self._wait = dict.fromkeys(LANES, 0.0)
        self._slots_in_use = [0] * num_layers
        self._ram_in_use = 0
        self._prefetch = dict.fromkeys(PREFETCH, 0)
        self._nvme = dict.fromkeys(NVME, 0)

    def add_picks(self, layer: int, counts: Mapping[str, int]) -> None:
        with self._lock:
            row = self._picks[layer]
            for lane, n in counts.items():
                row[LANES.index(lane)] += int(n)

    def add_lane_picks(self, layer: int, vram_hit: int, pcie: int, cpu: int, nvme: int) -> None:
        """add_picks for one layer step, every lane at once (the decode hot path: no mapping to build)."""
        with self._lock:
            row = self._picks[layer]
            row[0] += vram_hit
            row[1] += pcie
            row[2] += cpu
            row[3] += nvme

    def add_admission(self, layer: int) -> None:
        with self._lock:
            self._admissions[layer] += 1

    def add_eviction(self, layer: int) -> None:
        with self._lock:
            self._evictions[layer] += 1

    def add_ram_drop(self) -> None:
        with self._lock:
            self._ram_drops += 1

    def add_bytes(self, direction: str, n: int) -> None:
        if direction not in self._bytes:
            raise KeyError(direction)
        with self._lock:
            self._bytes[direction] += n

    def add_wait(self, lane: str, seconds: float) -> None:
        if lane not in self._wait:
            raise KeyError(lane)
        with self._lock:
            self._wait[lane] += seconds

    def add_prefetch(self, **counts: int) -> None:
        with self._lock:
            for key, n in counts.items():
                if key not in self._prefetch:
                    raise KeyError(key)
                self._prefetch[key] += n

    def add_nvme(self, key: str, n: int = 1) -> None:
        if key not in self._nvme:
            raise KeyError(key)
        with self._lock:
            self._nvme[key] += n

    def set_slots_in_use(self, layer: int, n: int) -> None:
        with self._lock:
            self._slots_in_use[layer] = n

    def set_ram_in_use(self, n: int) -> None:
        with self._lock:
            self._ram_in_use = n

    def set_gauges(self, layer: int, slots_in_use: int, ram_in_use: int) -> None:
        with self._lock:
            self._slots_in_use[layer] = slots_in_use
            self._ram_in_use = ram_in_use

    def snapshot(self) -> dict:
        """Everything as plain JSON-able types. Rates are None where nothing was counted yet."""
        with self._lock:
            picks = np.array(self._picks, np.int64).reshape(self.num_layers, len(LANES))
            adm, evi = np.array(self._admissions, np.int64), np.array(self._evictions, np.int64)
            used = np.array(self._slots_in_use, np.int64)
            doc = {
                "ram_drops": self._ram_drops,
                "bytes": dict(self._bytes),
                "wait_seconds": {k: round(v, 6) for k, v in self._wait.items()},
                "ram_slots": self._ram_slots,
                "ram_slots_in_use": self._ram_in_use,
                "nvme": dict(self._nvme),
            }
            pf = dict(self._prefetch)
        covered = pf["hits"] + pf["late"]
        pf["recall"] = round(covered / (covered + pf["demand_misses"]), 6) if covered + pf["demand_misses"] else None
        pf["precision"] = round(covered / (covered + pf["wasted"]), 6) if covered + pf["wasted"] else None
        doc["prefetch"] = pf
        totals = picks.sum(axis=0)
        total = int(totals.sum())
        hits = picks[:, LANES.index("vram_hit")]
        per_layer = picks.sum(axis=1)
        doc.update(
            picks={lane: int(n) for lane, n in zip(LANES, totals, strict=True)} | {"total": total},
            hit_rate=round(int(totals[0]) / total, 6) if total else None,
            admissions=int(adm.sum()),
            evictions=int(evi.sum()),
            vram_slots=int(self._vram_slots.sum()),
            vram_slots_in_use=int(used.sum()),
            layers=[
                {
                    "layer": layer,
                    "picks": int(per_layer[layer]),
                    "hit_rate": round(int(hits[layer]) / int(per_layer[layer]), 6) if per_layer[layer] else None,
                    "lanes": {lane: int(picks[layer, i]) for i, lane in enumerate(LANES)},
                    "admissions": int(adm[layer]),
                    "evictions": int(evi[layer]),
                    "slots": int(self._vram_slots[layer]),
                    "slots_in_use": int(used[layer]),
                }
                for layer in range(self.num_layers)
            ],
        )
        return doc


def counts_delta(was: dict[str, int], now: dict[str, int]) -> dict[str, int]:
    """What a span of work added to running counts (glm53.exl3.tiered.TieredMoE.tier_counts)."""
    return {k: v - was.get(k, 0) for k, v in now.items()}


def describe_counts(d: dict[str, int]) -> str:
    """A span's counts in words: where its picks were read from, and what left or entered VRAM."""
    picks = max(1, d.get("picks_total", 0))
    share = {k: 100 * d.get(f"picks_{k}", 0) / picks for k in ("vram_hit", "pcie", "cpu", "nvme")}
    return (f"picks {share['vram_hit']:.0f}% VRAM, {share['pcie']:.0f}% PCIe, {share['cpu']:.0f}% CPU, "
            f"{share['nvme']:.0f}% store of {d.get('picks_total', 0)}; {d.get('lent_out', 0)} left VRAM for borrowed "
            f"staging, {d.get('admissions', 0)} admitted, {d.get('ram_drops', 0)} RAM drops")
