"""Whether a decode-step option makes decode layer steps faster, judged from the steps' own wall time.

Some options of a decode step cost every step a share of host or link time and pay only on some hosts (the CPU
lane, the prestage): a cost model cannot price those shares, so they are judged by outcome. During a trial, windows
of decode layer steps alternate between using the option and not, and it stays on only if the steps with it were
faster, by the median of the paired windows' ratios, and it served at least MIN_SHARE of their picks. Ties go to
the plain step. A decided option is re-tried after REJUDGE windows, since the batch mix moves the balance.

What keeps the comparison fair: a window ends only at a token's end (a step is timed up to the next one, so the
last MoE layer's step also carries the token's head, sampling and dense layers: a window holding one more of
those than its partner would decide the verdict); pairs alternate which window comes first (on-off, off-on, ...)
so a steady trend, such as a cache still warming, cancels; an interval far longer than the steps so far is a
pause between requests, not a step, and is not charged.

Pure bookkeeping on a clock: the stepper calls `started(decode)` as each layer step begins and
`done(picks, served, end_of_token)` once a decode step's decision is made; `offer()` says whether the next decode
step uses the option."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

WINDOW = 64          # decode layer steps per window at least (then up to the token's end)
PAIRS = 4            # on / off window pairs per trial
MARGIN = 0.02        # the option is kept only if it makes a layer step at least this much faster
MIN_SHARE = 0.005    # ... and it served at least this share of the on-windows' picks
REJUDGE = 256        # windows between the end of one trial and the start of the next
IDLE_GAP_S = 0.5     # a longer interval between two decode steps is a pause between requests, not a step ...
IDLE_FACTOR = 50     # ... and so is one over this many times the typical step (with a floor of IDLE_FLOOR_S)
IDLE_FLOOR_S = 0.02


class PairedJudge:
    what = "option"  # the option's name in log lines

    def __init__(self, clock: Callable[[], float] = time.perf_counter, window: int = WINDOW, pairs: int = PAIRS,
                 rejudge: int = REJUDGE):
        self.clock = clock
        self.window, self.pairs, self.rejudge = int(window), int(pairs), int(rejudge)
        self.trials = 0
        self.kept: bool | None = None        # the last trial's verdict (None before the first ends)
        self.last_ratio: float | None = None  # median on / off step time of the last trial
        self.last_share: float | None = None  # the option's share of the on-windows' picks in the last trial
        self._typical: float | None = None    # a running mean of charged intervals (for the pause test)
        self._start_trial()

    def _start_trial(self) -> None:
        self.in_trial = True
        self._arm = True             # pair p uses the option in its first window when p is even, else its second
        self._steps = 0              # decode steps done in the current window
        self._window_index = 0       # windows 2p and 2p + 1 form pair p
        self._time = [0.0] * (2 * self.pairs)
        self._count = [0] * (2 * self.pairs)
        self._picks = self._served = 0
        self._last: tuple[float, int] | None = None  # (start, window index) of the previous decode step

    def offer(self) -> bool:
        """Whether the next decode step uses the option."""
        return self._arm if self.in_trial else bool(self.kept)

    def started(self, decode: bool) -> None:
        """A layer step begins: the previous decode step's interval is charged to its window."""
        now = self.clock()
        last, self._last = self._last, None
        if last is not None and decode:
            dt = now - last[0]
            limit = IDLE_GAP_S if self._typical is None else \
                min(IDLE_GAP_S, max(IDLE_FLOOR_S, IDLE_FACTOR * self._typical))
            if dt <= limit:
                self._time[last[1]] += dt
                self._count[last[1]] += 1
                self._typical = dt if self._typical is None else 0.95 * self._typical + 0.05 * dt
        if decode and self.in_trial:
            self._last = (now, self._window_index)

    def done(self, picks: int, served: int, end_of_token: bool = True) -> None:
        """A decode step's decision is made (picks: the step's picks; served: those the option served;
        end_of_token: this was the last MoE layer's step, where windows may end)."""
        self._steps += 1
        if not self.in_trial:
            if self._steps >= self.rejudge * self.window and end_of_token:
                self._start_trial()
            return
        if self._arm:
            self._picks += picks
            self._served += served
        if self._steps < self.window or not end_of_token:
            return
        self._steps = 0
        self._window_index += 1
        pair, second = divmod(self._window_index, 2)
        self._arm = (pair % 2 == 0) != bool(second)
        if self._window_index == 2 * self.pairs:
            self._verdict()

    def set_aside(self) -> None:
        """Off until the next trial (ending one under way), counted from now."""
        self.kept = False
        self._end_trial()

    def _verdict(self) -> None:
        ratios = []
        for p in range(self.pairs):
            on, off = (2 * p, 2 * p + 1) if p % 2 == 0 else (2 * p + 1, 2 * p)
            t_on, t_off, n_on, n_off = self._time[on], self._time[off], self._count[on], self._count[off]
            if n_on and n_off and t_off > 0:
                ratios.append((t_on / n_on) / (t_off / n_off))
        self.last_ratio = statistics.median(ratios) if ratios else None
        self.last_share = self._served / self._picks if self._picks else 0.0
        kept = (self.last_ratio is not None and self.last_ratio < 1 - MARGIN and self.last_share >= MIN_SHARE)
        if kept != self.kept:
            self._announce(kept, "no timed pairs" if self.last_ratio is None else f"{self.last_ratio:.3f}")
        self.kept = kept
        self.trials += 1
        self._end_trial()

    def _end_trial(self) -> None:
        self.in_trial = False
        self._steps = 0
        self._last = None

    def _announce(self, kept: bool, ratio: str) -> None:
        log.info("%s %s: decode layer steps with it took %s of the time of those without (median of %d paired "
                 "windows); it served %.1f%% of their picks (tried again later)", self.what,
                 "on" if kept else "off", ratio, self.pairs, 100 * (self.last_share or 0.0))

    def snapshot(self) -> dict:
        return {"in_trial": self.in_trial, "offer": self.offer(), "trials": self.trials, "kept": self.kept,
                "ratio_on_over_off": None if self.last_ratio is None else round(self.last_ratio, 4),
                "share": None if self.last_share is None else round(self.last_share, 4)}
