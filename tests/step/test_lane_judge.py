"""The CPU lane's judge: paired windows of decode steps on a clock decide whether the lane stays on."""

import pytest

from glm53.step.lane_judge import IDLE_GAP_S, LaneJudge


def drive(judge: LaneJudge, now: list[float], steps: int, on_s: float, off_s: float, cpu_share: float = 0.1,
          decode: bool = True, layers: int = 1, token_s: float = 0.0, trend: float = 0.0) -> list[bool]:
    """Run `steps` layer steps of a model with `layers` MoE layers: each offers the lane or not as the judge says
    and takes on_s or off_s, the last layer's also token_s (the token's head and sampling); trend: each step
    takes this much less than the one before (a cache warming)."""
    offered = []
    for i in range(steps):
        on = judge.offer()
        offered.append(on)
        judge.started(decode)
        last = i % layers == layers - 1
        if decode:
            judge.done(100, int(100 * cpu_share) if on else 0, end_of_token=last)
        now[0] += (on_s if on else off_s) + (token_s if last else 0.0) - trend * len(offered)
    return offered


@pytest.mark.parametrize("on_s,kept", [(0.9e-3, True), (1.1e-3, False), (0.99e-3, False)])
def test_faster_with_the_lane_keeps_it_slower_sets_it_aside_ties_go_to_the_exact_path(on_s, kept):
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=8, pairs=3)
    offered = drive(judge, now, 48 + 40, on_s, 1e-3)
    assert offered[:32] == [True] * 8 + [False] * 16 + [True] * 8, "pairs alternate: on-off, off-on, on-off"
    assert judge.trials == 1 and judge.kept is kept and all(o is kept for o in offered[48:])
    assert judge.last_ratio == pytest.approx(on_s / 1e-3)


def test_a_lane_the_planner_gives_almost_nothing_is_set_aside_even_if_its_windows_were_faster():
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=4, pairs=2)
    drive(judge, now, 16, 0.5e-3, 1e-3, cpu_share=0.0)
    assert judge.kept is False and judge.last_share == 0.0


def test_pauses_and_prompt_steps_are_not_charged_to_a_window():
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=4, pairs=1)
    drive(judge, now, 3, 1e-3, 1e-3)
    now[0] += 10 * IDLE_GAP_S  # the client went away between two requests, inside a lane-on window
    drive(judge, now, 1, 1e-3, 1e-3)
    drive(judge, now, 1, 1e-3, 1e-3, decode=False)  # a prompt chunk: not a decode step, breaks the interval
    drive(judge, now, 4, 1e-3, 1e-3)
    assert judge.trials == 1 and judge.last_ratio == pytest.approx(1.0), "the pause did not make the lane look slow"


def test_a_decided_lane_is_tried_again_after_rejudge_windows():
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=4, pairs=1, rejudge=3)
    drive(judge, now, 8, 2e-3, 1e-3)
    assert judge.kept is False and not judge.in_trial
    offered = drive(judge, now, 12, 0.5e-3, 1e-3)  # 3 windows set aside, then a new trial begins
    assert offered == [False] * 12 and judge.in_trial and judge.offer()
    drive(judge, now, 8, 0.5e-3, 1e-3)  # the host changed: the lane now pays
    assert judge.trials == 2 and judge.kept is True


def test_windows_end_at_token_ends_so_the_token_costs_fall_evenly():
    """A step is timed to the next one, so the last MoE layer's step carries the token's head and sampling. Windows
    of 8 steps over a 3-layer model would hold two or three of those by chance; ending windows at token ends
    (here every 9 steps) gives every window three, and a lane with no effect is judged a tie."""
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=8, pairs=3)
    offered = drive(judge, now, 54, 1e-3, 1e-3, layers=3, token_s=6e-3)
    assert offered[:18] == [True] * 9 + [False] * 9
    assert judge.trials == 1 and judge.last_ratio == pytest.approx(1.0) and judge.kept is False


def test_alternating_pair_order_cancels_a_steady_trend():
    """Steps getting faster as the cache warms: with the lane always first in its pair it would look slower in
    every pair; alternating the order cancels the trend, so a lane 3% faster is kept."""
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=8, pairs=4)
    drive(judge, now, 64, 0.97e-3, 1e-3, trend=2e-6)
    assert judge.kept is True and judge.last_ratio < 0.98


def test_a_pause_far_longer_than_the_steps_so_far_is_not_charged():
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=4, pairs=1)
    drive(judge, now, 2, 1e-3, 1e-3)
    now[0] += 0.2  # under IDLE_GAP_S, but 200 steps' worth
    drive(judge, now, 6, 1e-3, 1e-3)
    assert judge.trials == 1 and judge.last_ratio == pytest.approx(1.0)


def test_a_lane_late_step_after_step_is_set_aside_at_once_and_tried_again_later():
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=4, pairs=1, rejudge=3)
    drive(judge, now, 8, 0.5e-3, 1e-3)
    assert judge.kept is True
    for late in (True, True, False, True, True, True):  # a step on time breaks a streak
        judge.lane_step(late)
    assert judge.offer() and judge.set_aside_late == 0
    judge.lane_step(True)  # the fourth late step in a row
    assert judge.kept is False and not judge.offer() and judge.set_aside_late == 1
    assert judge.snapshot()["set_aside_late"] == 1
    offered = drive(judge, now, 12, 0.5e-3, 1e-3)  # the rejudge countdown runs from the streak, then a trial
    assert offered == [False] * 12 and judge.in_trial


def test_a_late_streak_ends_a_trial_under_way():
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=4, pairs=2)
    drive(judge, now, 2, 0.5e-3, 1e-3)
    for _ in range(4):
        judge.lane_step(True)
    assert not judge.in_trial and judge.kept is False and judge.trials == 0
