"""Whether offering decode steps to the CPU lane makes them faster: a paired judge (glm53.step.paired_judge).

The planner's cost model prices a lane job by its kernel time, but offering the lane also costs every step a
host-side share (the step's input rows cross with the ids, the GPU waits for the partial and adds it); on a host
whose PCIe outruns its CPU the lane's picks buy less than that (docs/results.md). So the lane is judged by outcome:
paired windows of decode layer steps with and without it, the picks it served being those the planner gave it.

A lane that keeps finishing past its deadlines (LATE_STREAK steps in a row: its cores taken by other work, say) is
set aside at once rather than at the next trial: where the GPU waits on the lane in stream order a late step is
waited for, so a slowed lane would slow every step until then."""

from __future__ import annotations

import logging

from glm53.step.paired_judge import IDLE_GAP_S, MARGIN, MIN_SHARE, PairedJudge

__all__ = ["IDLE_GAP_S", "LATE_STREAK", "MARGIN", "MIN_SHARE", "LaneJudge"]

log = logging.getLogger(__name__)

LATE_STREAK = 4      # lane steps in a row past their deadlines that set the lane aside until the next trial


class LaneJudge(PairedJudge):
    what = "CPU lane"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.late_streak = 0     # lane steps in a row past their deadlines
        self.set_aside_late = 0  # times a late streak set the lane aside

    def lane_step(self, late: bool) -> None:
        """A lane step resolved, past its deadline or not: LATE_STREAK late ones in a row set the lane aside until
        the next trial (ending one under way), counted from now."""
        self.late_streak = self.late_streak + 1 if late else 0
        if self.late_streak < LATE_STREAK or not (self.in_trial or self.kept):
            return
        log.warning("CPU lane set aside: %d lane steps in a row finished past their deadlines (its cores are busy "
                    "or slow); decode runs as the exact mode does (tried again later)", self.late_streak)
        self.set_aside_late += 1
        self.late_streak = 0
        self.set_aside()

    def _announce(self, kept: bool, ratio: str) -> None:
        share = 100 * (self.last_share or 0.0)
        if kept:
            log.info("CPU lane on: decode layer steps offering it took %s of the time of those without "
                     "(median of %d paired windows); it had %.1f%% of their picks", ratio, self.pairs, share)
        else:
            log.info("CPU lane set aside: decode layer steps offering it took %s of the time of those without "
                     "(median of %d paired windows) with %.1f%% of their picks: PCIe serves this host's misses "
                     "at least as fast; decode runs as the exact mode does (tried again later)", ratio, self.pairs,
                     share)

    def snapshot(self) -> dict:
        doc = super().snapshot()
        doc["cpu_share"] = doc.pop("share")
        return {**doc, "set_aside_late": self.set_aside_late}
