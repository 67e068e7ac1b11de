"""The CPU lane given every RAM-resident miss (issue 40's accuracy panel): PCIe priced out of the planner's cost
model and a judge that always offers the lane, so the measured KL is the lane kernel's alone."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from glm53.cpu_lane.planner import PcieCost
from glm53.step.lane_judge import LaneJudge

PRICED_OUT = PcieCost(step=1.0, expert=1.0, row=1.0)  # a second an expert: no split puts a miss on PCIe


class PcieOutFit:
    """The lane's LiveFit with its PCIe half priced out; the CPU half keeps learning (the lane's deadlines use it)."""

    def __init__(self, fit: Any):
        self.fit = fit

    def model(self):
        return replace(self.fit.model(), pcie=PRICED_OUT)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fit, name)


class AlwaysOffer(LaneJudge):
    def offer(self) -> bool:
        return True


def force_lane(tiered: Any) -> None:
    """After start_lane: every later decode step's RAM-resident misses go to the CPU lane."""
    stepper = tiered.stepper
    stepper.fit = PcieOutFit(stepper.fit)
    stepper.lane_judge = AlwaysOffer()
    stepper.prestage = None  # a miss copied ahead would skip the lane


def late_lane(tiered: Any, seconds: float) -> None:
    """Every lane step starts `seconds` late (past any deadline the planner sets): a step the GPU waits on is waited
    for; one the host resolves has its jobs recomputed exactly."""
    import time

    lane = tiered.stepper.lane
    compute = lane._compute

    def slow(jobs, outs, done, cancel):
        time.sleep(seconds)
        compute(jobs, outs, done, cancel)

    lane._compute = slow


def failing_lane(tiered: Any, after: int) -> None:
    """The lane's worker computes `after` steps, then raises (a dead pool) a moment into the next, so that the GPU
    is already waiting on that step's partial: the lane is disabled at that step."""
    import time

    lane = tiered.stepper.lane
    compute = lane._compute
    calls = [0]

    def dying(jobs, outs, done, cancel):
        calls[0] += 1
        if calls[0] > after:
            time.sleep(0.2)
            raise RuntimeError("the lane's pool died")
        compute(jobs, outs, done, cancel)

    lane._compute = dying
