"""The stream-ordered CPU-lane hand-off (glm53.exl3.handoff) on a CPU stand-in for CUDA (tests/support/fake_handoff.py):
the combine returns final + the lane's partial without the engine thread waiting on the ticket, a late partial is
still the one added, buffers are reused in turn, and a partial that fails releases the device and fails the next
check instead of hanging or passing a wrong step. With the real lane: a late lane is waited for and nothing is
recomputed while the device waits (device work would queue behind the wait), and a failed or stalled lane fails
the step loudly."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch
from fake_handoff import Cuda, Ext

from glm53.cpu_lane.lane import CpuLane, LaneJob
from glm53.exl3.handoff import LaneHandOffError, StreamHandOff
from glm53.tiers import exl3_expert_layout

HIDDEN = 256  # the lane layout's below, so one hand-off serves the stand-in tickets and the real lane


class Ticket:
    """A lane ticket whose partial arrives after `delay` seconds (or raises)."""

    def __init__(self, value: float, delay: float = 0.0, fail: bool = False):
        self.layer, self.value, self.delay, self.fail = 3, value, delay, fail
        self.recompute: bool | None = None

    def partial(self, rows: int, recompute: bool = True) -> np.ndarray:
        self.recompute = recompute
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("recompute failed")
        return np.full((rows, HIDDEN), self.value, np.float32) + np.arange(rows, dtype=np.float32)[:, None]


@pytest.fixture
def handoff():
    cuda, ext = Cuda(), Ext()
    with torch.inference_mode():  # as the engine makes it, at its first lane step: views keep no base, and the
        h = StreamHandOff("cpu", HIDDEN, ext, cuda=cuda)  # buffers are inference tensors
    gc.collect()  # whatever the hand-off does not hold on to is gone: its registered pages must not be
    yield h
    h.close()


def expect(rows: int, value: float, base: torch.Tensor) -> torch.Tensor:
    return base + (value + torch.arange(rows, dtype=torch.float32)[:, None]).to(base.dtype)


@torch.inference_mode()  # as the engine thread runs
def test_each_step_gets_its_own_late_partial_through_the_ring(handoff):
    for step in range(7):  # more steps than buffers: each buffer is written again after its copy ran
        rows = 1 + step % 3
        final = torch.full((rows, HIDDEN), float(step), dtype=torch.float16)
        got = handoff.enqueue(final, Ticket(10.0 * step, delay=0.01 * (step % 2)), rows, final.shape)
        assert torch.equal(got, expect(rows, 10.0 * step, final)), step
    assert handoff.ext.waits == 7 and handoff.handed == 7
    handoff.check()  # nothing failed


@torch.inference_mode()  # as the engine thread runs
def test_the_engine_thread_does_not_run_the_ticket(handoff):
    """The resolver thread waits for the ticket, and asks it for a partial without recomputing anything."""
    ticket = Ticket(1.0)
    final = torch.zeros((1, HIDDEN))
    seen: list[str] = []
    orig = ticket.partial

    def partial(rows: int, recompute: bool = True) -> np.ndarray:
        seen.append(threading.current_thread().name)
        return orig(rows, recompute)

    ticket.partial = partial
    handoff.enqueue(final, ticket, 1, final.shape)
    assert seen == ["glm53-lane-handoff"] and ticket.recompute is False


@torch.inference_mode()  # as the engine thread runs
def test_a_failed_partial_releases_the_device_and_fails_the_check_once(handoff, caplog):
    final = torch.zeros((2, HIDDEN))
    got = handoff.enqueue(final, Ticket(5.0, fail=True), 2, final.shape)
    assert torch.isnan(got).all()  # the step is spoiled, not passed off as right ...
    with pytest.raises(LaneHandOffError, match="recompute failed"):
        handoff.check()  # ... and the iteration that ran it fails
    handoff.check()  # raised once
    assert "hand-off" in caplog.text
    ok = handoff.enqueue(final, Ticket(2.0), 2, final.shape)
    assert torch.equal(ok, expect(2, 2.0, final))


def test_close_ends_the_resolver(handoff):
    handoff.close()
    assert not handoff._thread.is_alive()


def test_a_wait_the_gpu_gave_up_on_fails_the_check(handoff):
    """The spin-kernel fallback writes the abort word after 30 s and lets the GPU run on without the partial."""
    handoff._flags[2 * 16] = 1
    with pytest.raises(LaneHandOffError, match="gave up waiting"):
        handoff.check()
    handoff.check()


def test_the_registration_lasts_as_long_as_the_hand_off():
    ext = Ext()
    with torch.inference_mode():
        h = StreamHandOff("cpu", HIDDEN, ext, cuda=Cuda())
    gc.collect()
    assert len(ext.registered) == 1 and all(n % 4096 == 0 for n in ext.registered.values())
    h.close()
    del h
    gc.collect()
    assert ext.registered == {}


# ---- the real lane behind the hand-off: nothing is recomputed while the device waits --------------------------------

LAYOUT = exl3_expert_layout(HIDDEN, 128, 3)
WEIGHTS = np.array([1.0, 0.5], np.float32)


def lane_step(lane: CpuLane, ext: Ext, deadline: float = 0.01):
    """One step of one expert on two rows, whose exact-path recompute is device work."""

    def recompute(job: LaneJob) -> np.ndarray:
        ext.device_work()
        return np.full_like(job.x, -1.0)

    x = np.ones((2, HIDDEN), np.float32)
    job = LaneJob(5, np.zeros(LAYOUT.nbytes, np.uint8), x, token_rows=np.array([0, 1]), weights=WEIGHTS)
    return lane.submit(3, [job], recompute, deadline=deadline)


def late(value: float, delay: float):
    def compute(jobs, outs, done, cancel):
        end = time.monotonic() + delay  # past the deadline: a slow pool, not a dead one
        while time.monotonic() < end:
            if cancel[0]:  # as the kernel does: it stops at its next unit, the job left undone
                return
            time.sleep(0.001)
        outs[0][:] = value
        done[0] = 1

    return compute


@torch.inference_mode()
def test_a_late_lane_is_waited_for_and_nothing_is_recomputed_while_the_device_waits(handoff):
    with CpuLane(LAYOUT, threads=1, compute=late(3.0, 0.15)) as lane:
        final = torch.zeros((2, HIDDEN))
        got = handoff.enqueue(final, lane_step(lane, handoff.ext), 2, final.shape)
        handoff.check()
        snap = lane.snapshot()
    assert torch.equal(got, (3.0 * torch.from_numpy(WEIGHTS))[:, None].expand(2, HIDDEN))
    assert handoff.ext.device_works == 0 and snap["recomputed_jobs"] == 0 and snap["deadline_misses"] == 1
    assert snap["alive"]


@torch.inference_mode()
def test_a_lane_that_fails_while_the_device_waits_fails_the_step_and_is_disabled(handoff, caplog):
    def broken(jobs, outs, done, cancel):
        time.sleep(0.05)
        raise RuntimeError("pool gone")

    with CpuLane(LAYOUT, threads=1, compute=broken) as lane:
        final = torch.zeros((2, HIDDEN))
        got = handoff.enqueue(final, lane_step(lane, handoff.ext, deadline=5.0), 2, final.shape)
        assert torch.isnan(got).all()
        with pytest.raises(LaneHandOffError, match="did not finish expert 5.*pool gone"):
            handoff.check()
        assert not lane.alive and handoff.ext.device_works == 0


@torch.inference_mode()
def test_a_stalled_lane_fails_the_step_instead_of_holding_the_device_forever(handoff):
    release = threading.Event()

    def stuck(jobs, outs, done, cancel):
        release.wait(10)  # ignores the cancel

    lane = CpuLane(LAYOUT, threads=1, compute=stuck, grace=0.05, stall=0.05)
    try:
        final = torch.zeros((2, HIDDEN))
        t0 = time.monotonic()
        got = handoff.enqueue(final, lane_step(lane, handoff.ext), 2, final.shape)
        assert time.monotonic() - t0 < 2.0 and torch.isnan(got).all()
        with pytest.raises(LaneHandOffError, match="did not stop"):
            handoff.check()
        assert not lane.alive and handoff.ext.device_works == 0
    finally:
        release.set()
        lane.close()


@torch.inference_mode()
def test_a_step_queued_past_its_deadline_is_still_computed_for_the_waiting_device(handoff):
    # The lane's thread is descheduled (here: busy with the step before) until this step's deadline has passed: the
    # worker still computes it, since the device waits for it and nothing can recompute it there.
    with CpuLane(LAYOUT, threads=1, compute=late(2.0, 0.1)) as lane:
        first = lane.submit(3, [LaneJob(1, np.zeros(LAYOUT.nbytes, np.uint8), np.ones((2, HIDDEN), np.float32),
                                        token_rows=np.array([0, 1]), weights=WEIGHTS)], lambda job: None, deadline=5.0)
        final = torch.zeros((2, HIDDEN))
        got = handoff.enqueue(final, lane_step(lane, handoff.ext, deadline=0.01), 2, final.shape)
        handoff.check()
        first.outputs()
    assert torch.equal(got, (2.0 * torch.from_numpy(WEIGHTS))[:, None].expand(2, HIDDEN))
    assert handoff.ext.device_works == 0
