"""The CPU lane's judge: paired windows of decode steps on a clock decide whether the lane stays on."""

import pytest

from glm53.engine.lane_judge import IDLE_GAP_S, LaneJudge


def drive(judge: LaneJudge, now: list[float], steps: int, on_s: float, off_s: float, cpu_share: float = 0.1,
          decode: bool = True) -> list[bool]:
    """Run `steps` layer steps: each offers the lane or not as the judge says, and takes on_s or off_s."""
    offered = []
    for _ in range(steps):
        on = judge.offer()
        offered.append(on)
        judge.started(decode)
        if decode:
            judge.done(100, int(100 * cpu_share) if on else 0)
        now[0] += on_s if on else off_s
    return offered


@pytest.mark.parametrize("on_s,kept", [(0.9e-3, True), (1.1e-3, False), (0.99e-3, False)])
def test_faster_with_the_lane_keeps_it_slower_sets_it_aside_ties_go_to_the_exact_path(on_s, kept):
    now = [0.0]
    judge = LaneJudge(clock=lambda: now[0], window=8, pairs=3)
    offered = drive(judge, now, 48 + 40, on_s, 1e-3)
    assert offered[:16] == [True] * 8 + [False] * 8
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
