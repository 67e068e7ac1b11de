"""A user's box on the GPU machine: a slower PCIe link, a consumer card's share of the experts, a narrower CPU lane.

The benchmarks serve through the same code as `glm53 serve`; the emulation only changes what the host is:
- the link: every host <-> device expert copy (staging, admissions, write-backs, the lane's PCIe calibration) is
  followed, on its own copy stream, by a device-side sleep of bytes x (1/R - 1/measured), so the stream delivers R
  bytes/s while the compute stream overlaps it exactly as it would overlap a slower link (glm53.tiers.copier's
  `pace` seam);
- the card: VRAM slots per MoE layer at the share of the experts a 24 GB card holds of the real model;
- the CPU: the lane's threads and kernel paths (a Zen 3 EPYC runs AVX2, not AVX-512).

What it cannot change is said with each figure: the host's Python speed (a desktop core at 5 GHz runs the step's
host work faster than this Xeon), the DRAM channels behind the lane, and cores the machine does not have.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

CARD_FRACTION = 0.11  # a 24 GB card holds ~11% of GLM-5.3-Flash's routed experts (the reference's 1,376 of 12,096)


@dataclass(frozen=True)
class Emulation:
    """What the benchmark pretends the host is; None keeps this machine's own."""

    name: str = "none"
    link_GBps: float | None = None  # host <-> device copy rate
    card_fraction: float | None = None  # VRAM expert slots per MoE layer, as a share of the layer's experts
    lane_threads: int | None = None  # CPU-lane threads (None: the lane's default, physical cores - 1)
    lane_isas: tuple[str, ...] | None = None  # the kernel paths the lane may calibrate among
    assumes: str = ""

    def describe(self) -> str:
        parts = [f"link {self.link_GBps:g} GB/s" if self.link_GBps else "this machine's link",
                 f"{self.card_fraction:.0%} of the experts in VRAM" if self.card_fraction else "the bench's slots",
                 f"lane {self.lane_threads or 'all'} threads"
                 + (f" ({'/'.join(self.lane_isas)})" if self.lane_isas else "")]
        return f"{self.name}: " + ", ".join(parts) + (f"; {self.assumes}" if self.assumes else "")


PRESETS = {
    "rtx3090-gen4": Emulation(
        name="rtx3090-gen4", link_GBps=25.0, card_fraction=CARD_FRACTION, lane_isas=("avx2",),
        assumes="an RTX 3090 on PCIe 4.0 x16 (~25 GB/s pinned) beside a 24-core Zen 3 EPYC (AVX2); the lane runs "
                "on this machine's cores, so its thread count is the machine's, not the EPYC's"),
}


def from_args(args: argparse.Namespace) -> Emulation:
    """The preset named by --emulate (if any), with --link-GBps / --cpu-threads / --lane-isa laid over it."""
    emu = PRESETS[args.emulate] if getattr(args, "emulate", None) else Emulation()
    if getattr(args, "link_GBps", None) is not None:
        emu = replace(emu, name=f"{emu.name}+link" if emu.name != "none" else "link", link_GBps=args.link_GBps)
    if getattr(args, "cpu_threads", None) is not None:  # the bench's --cpu-threads: the lane's threads
        emu = replace(emu, lane_threads=args.cpu_threads)
    if getattr(args, "lane_isa", None):
        emu = replace(emu, lane_isas=tuple(args.lane_isa.split(",")))
    return emu


def checked(args: argparse.Namespace) -> Emulation:
    """from_args, refused (ValueError naming why) where this machine cannot emulate it."""
    import os

    from glm53.cpu_lane import kernel

    emu = from_args(args)
    why = problem(emu, kernel.supported_isas(), os.cpu_count() or 1)
    if why:
        raise ValueError(f"--emulate: {why}")
    return emu


def to_json(emu: Emulation) -> dict[str, Any]:
    doc = asdict(emu)
    doc["lane_isas"] = list(emu.lane_isas) if emu.lane_isas is not None else None  # as JSON reads it back
    return doc


def from_json(doc: dict[str, Any] | None) -> Emulation:
    """The Emulation to_json wrote (a job file, a launcher's argument); None: this machine's own."""
    if not doc:
        return Emulation()
    isas = doc.get("lane_isas")
    return Emulation(**{**doc, "lane_isas": tuple(isas) if isas is not None else None})


def add_arguments(p: argparse.ArgumentParser, threads: bool = False) -> None:
    """The emulation's flags; threads: also --cpu-threads (benches that have no lane-threads flag of their own)."""
    p.add_argument("--emulate", choices=sorted(PRESETS), help="emulate a user's box: " + "; ".join(
        e.describe() for e in PRESETS.values()).replace("%", "%%"))
    if threads:
        p.add_argument("--cpu-threads", type=int, help="CPU-lane threads (default: the plan's)")
    p.add_argument("--link-GBps", type=float, metavar="R", help="pace host<->device expert copies to R GB/s "
                   "(a device-side sleep after each copy on its copy stream)")
    p.add_argument("--lane-isa", metavar="ISA[,ISA]", help="the CPU lane's kernel paths to choose among (e.g. avx2)")


def problem(emu: Emulation, supported_isas: list[str], cores: int) -> str | None:
    """Why this machine cannot emulate `emu`, or None."""
    if emu.link_GBps is not None and not emu.link_GBps > 0:
        return f"the link rate must be > 0 GB/s, got {emu.link_GBps:g}"
    if emu.card_fraction is not None and not 0 < emu.card_fraction < 1:
        return f"the card's share of the experts must be in (0, 1), got {emu.card_fraction:g}"
    if emu.lane_threads is not None and not 1 <= emu.lane_threads <= cores:
        return f"{emu.lane_threads} lane threads: this machine has {cores} cores (1..{cores})"
    missing = [i for i in emu.lane_isas or () if i not in supported_isas]
    if missing:
        return f"the lane kernel cannot run {missing} here (this CPU runs {supported_isas})"
    return None


def slots_for(emu: Emulation, experts_per_layer: int, default: int) -> int:
    """VRAM slots per MoE layer: the card's share of the layer's experts, at least one."""
    if emu.card_fraction is None:
        return default
    return max(1, round(emu.card_fraction * experts_per_layer))


def h2d_rate(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Pinned host -> device bytes/s on one copy stream (median of `repeats`)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    times = sorted(times[1:])
    del src, dst
    return nbytes / times[len(times) // 2]


def pace_seconds(nbytes: int, target_Bps: float, measured_Bps: float) -> float:
    """How long a copy of `nbytes` must be held back so that the link delivers target_Bps: the time it takes at
    the target less the time it took at the measured rate; 0 where the target is not slower."""
    if target_Bps >= measured_Bps:
        return 0.0
    return nbytes * (1.0 / target_Bps - 1.0 / measured_Bps)


class LinkPacer:
    """The Copier's `pace`: a device-side sleep on the current (copy) stream, cycles per second calibrated once."""

    def __init__(self, target_Bps: float, measured_Bps: float, cycles_per_s: float):
        self.target_Bps, self.measured_Bps, self.cycles_per_s = target_Bps, measured_Bps, cycles_per_s
        self.paced_bytes = 0
        self.held_s = 0.0

    def __call__(self, nbytes: int) -> None:
        import torch

        s = pace_seconds(nbytes, self.target_Bps, self.measured_Bps)
        self.paced_bytes += nbytes
        if s > 0:
            self.held_s += s
            torch.cuda._sleep(max(1, int(s * self.cycles_per_s)))

    def fresh(self) -> LinkPacer:
        """A pacer like this one with nothing counted (the bench's validation copies are not the run's)."""
        return LinkPacer(self.target_Bps, self.measured_Bps, self.cycles_per_s)


def sleep_cycles_per_s(device: Any = None, cycles: int = 50_000_000) -> float:
    """GPU clock cycles `torch.cuda._sleep` spins per second on this device (best of three, timed by events)."""
    import torch

    best = float("inf")
    for _ in range(4):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return cycles / best


def install(tiered: Any, pacer: LinkPacer | None) -> None:
    """Pace every link of a TieredMoE's tiers (each link's Copier, under the byte-counting wrapper)."""
    for link in tiered.tiers.links:
        copier = link.copier
        getattr(copier, "inner", copier).pace = pacer


def paced_rate(pacer: LinkPacer, nbytes: int, copies: int = 32, device: str = "cuda:0") -> float:
    """Bytes/s that expert-sized copies achieve through a paced Copier (the validation: it should be the target)."""
    import torch

    from glm53.tiers.copier import Copier

    copier = Copier(device)
    copier.pace = pacer
    src = torch.empty((copies, nbytes), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty((4, nbytes), dtype=torch.uint8, device=device)
    copier.copy(dst[0], src[0]).wait()  # the first copy sets the stream up
    t0 = time.perf_counter()
    last = None
    for i in range(copies):
        last = copier.copy(dst[i % 4], src[i])
    last.wait()
    return copies * nbytes / (time.perf_counter() - t0)


def emulated_spec(spec: Any, emu: Emulation, experts_per_layer: int) -> Any:
    """The plan's EngineSpec on the emulated host: VRAM slots per MoE layer capped at the card's share of each
    layer's experts, the lane's threads the emulation's. A stock or untiered spec is returned as it is."""
    if not spec.tiered:
        return spec
    if len(spec.devices) > 1:
        raise ValueError("the consumer-box emulation is of one card; this plan splits the layers across "
                         f"{len(spec.devices)} GPUs")
    if emu.card_fraction is not None:
        cap = slots_for(emu, experts_per_layer, 0)
        slots = tuple(min(s, cap) for s in spec.vram_slots)
        devices = tuple(replace(d, vram_slots=sum(slots)) for d in spec.devices)
        spec = replace(spec, vram_slots=slots, devices=devices)
    if emu.lane_threads is not None and spec.lane:
        spec = replace(spec, cpu_threads=emu.lane_threads)
    return spec


def link_pacer(emu: Emulation, expert_bytes: int,
               log: Callable[[str], None] = print) -> LinkPacer | None:
    """The pacer for the emulated link, set against expert-sized copies' own rate on this machine (below a 1 GiB
    copy's), so what remains after each copy's sleep is the target; None where the link is this machine's."""
    if not emu.link_GBps:
        return None
    measured = h2d_rate(expert_bytes, repeats=21)
    target = min(emu.link_GBps * 1e9, measured)
    log(f"expert-sized copies unpaced: {measured / 1e9:.1f} GB/s; paced to {target / 1e9:.1f}")
    return LinkPacer(target, measured, sleep_cycles_per_s())


def tiers_hook(emu: Emulation, pacer: LinkPacer | None) -> Callable[[Any], None]:
    """The engine's on_tiers: once the tiers hold their experts (the load's copies unpaced), pace their links and
    narrow the lane's kernel paths, before the lane times the link."""
    def on_tiers(tiered: Any) -> None:
        install(tiered, pacer)
        tiered.lane_isas = emu.lane_isas

    return on_tiers
