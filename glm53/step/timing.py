"""StepTimer: the one place a layer step's host time is measured and charged.

A step is a run of phases (reads, lane, copies, slots); the time it spends blocked (on the store's reads, on its
copies) is charged to the wait's own key and left out of the phase it fell in and out of "plan", so "plan" is the
host's own work on the step, the number the benches compare. The stepper marks phases and waits through this
object and nowhere else; /stats reads `seconds` (as the stepper's `host_seconds`), and a bench may give the
stepper a timer on its own clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# plan: a step's host time less its waits; plan_reads / plan_copies / plan_slots: parts of plan (the store's reads
# queued and settled; the copies queued and ordered; the slot ids), so a profile-free run says where a step's host
# time goes; copy_wait / store_wait: blocked on copies / on store reads; after_launch: the deferred bookkeeping.
KEYS = ("plan", "copy_wait", "store_wait", "after_launch", "plan_reads", "plan_copies", "plan_slots")


class StepTimer:
    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.seconds = dict.fromkeys(KEYS, 0.0)
        self._start = self._mark = 0.0
        self._blocked = self._blocked_phase = 0.0
        self._waits: dict[str, float] = {}

    def begin(self) -> None:
        """A step starts: its first phase runs from now."""
        self._start = self._mark = self.clock()
        self._blocked = self._blocked_phase = 0.0
        self._waits = {}

    def phase(self, name: str | None) -> None:
        """The phase since the last mark ends: its time less its waits is charged to `name` (None: to plan only)."""
        now = self.clock()
        if name is not None:
            self.seconds[name] += now - self._mark - self._blocked_phase
        self._mark, self._blocked_phase = now, 0.0

    def wait(self, key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
        """Run fn(*args, **kwargs), a wait of the step's: its time is charged to `key`. Returns the seconds."""
        t0 = self.clock()
        fn(*args, **kwargs)
        seconds = self.clock() - t0
        self.seconds[key] += seconds
        self._waits[key] = self._waits.get(key, 0.0) + seconds
        self._blocked += seconds
        self._blocked_phase += seconds
        return seconds

    def waited(self, key: str) -> float:
        """The seconds this step has waited on `key` so far."""
        return self._waits.get(key, 0.0)

    def end(self) -> None:
        """The step ends with its slots phase: its time less all its waits is charged to plan."""
        self.phase("plan_slots")
        self.seconds["plan"] += self._mark - self._start - self._blocked

    def since(self, key: str, t0: float) -> None:
        """Charge the time from t0 (this timer's clock) to `key`: work outside a step (after launch)."""
        self.seconds[key] += self.clock() - t0
