"""The stream-ordered CPU-lane hand-off (glm53.exl3.handoff) on a CPU stand-in for CUDA (tests/support/fake_handoff.py):
the combine returns final + the lane's partial without the engine thread waiting on the ticket, a late partial is
still the one added, buffers are reused in turn, and a partial that fails releases the device and fails the next
check instead of hanging or passing a wrong step."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
import torch
from fake_handoff import Cuda, Ext

from glm53.exl3.handoff import LaneHandOffError, StreamHandOff

HIDDEN = 64


class Ticket:
    """A lane ticket whose partial arrives after `delay` seconds (or raises)."""

    def __init__(self, value: float, delay: float = 0.0, fail: bool = False, cuda: Cuda | None = None):
        self.layer, self.value, self.delay, self.fail, self.cuda = 3, value, delay, fail, cuda
        self.stream = None

    def partial(self, rows: int) -> np.ndarray:
        self.stream = self.cuda.active() if self.cuda is not None else None
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
    """The resolver thread waits for the ticket, on the side stream, after the step's kernels: a recompute there
    streams into a staging row only once this step's kernels are done with it."""
    ticket = Ticket(1.0, cuda=handoff.cuda)
    final = torch.zeros((1, HIDDEN))
    seen: list[str] = []
    orig = ticket.partial

    def partial(rows: int) -> np.ndarray:
        seen.append(threading.current_thread().name)
        return orig(rows)

    ticket.partial = partial
    handoff.enqueue(final, ticket, 1, final.shape)
    assert seen == ["glm53-lane-handoff"] and ticket.stream is handoff._side
    assert len(handoff._side.waited) == 1  # the event recorded behind the step's expert kernels


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
