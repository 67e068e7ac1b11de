"""The store meter: how busy the store is, where decode leaves it idle, and what a right guess saves.

These are the figures the step's guesses are weighed by (glm53.step.stepper, glm53.step.lookahead): reading a
guess ahead costs a store that keeps up little, and saves the step that needs it as much of the read as was done by
the time its layer ran. Measured on the thread that owns the tiers, from the reader's busy clock where it has one.
"""

from __future__ import annotations

import time

GUESS_SAVING_PRIOR = 4.0  # right guesses the starting value (all read in time) counts as
GUESS_SAVING_DECAY = 0.998  # per decode layer step: the last ~500 layer steps count
GUESS_SAVING_TRICKLE = 0.002  # "saved whole" added per decode layer step: a weight of 1 guess when nothing else
# The store's load: the share of wall time it had a read under way, measured over spans of at least LOAD_SPAN_S and
# smoothed; a span longer than LOAD_IDLE_S (the server idle between requests) says nothing of decode and is skipped.
LOAD_SPAN_S = 0.05
LOAD_IDLE_S = 1.0
# mark_step: a gap between two decode layer steps longer than this is not one token's way from a layer to the next
# (a layer step takes milliseconds; this is a request ending and the next beginning) and is not charged.
STEP_GAP_S = 0.25


class StoreMeter:
    def __init__(self, reader, num_layers: int):
        """reader: the store reader, asked for `busy_seconds` (a reader without it leaves load and idle unmeasured)."""
        self._reader = reader
        # A right guess's saving, decayed sums (saved, right guesses): see guess_saving. The prior counts as a few
        # guesses all read in time, so a tier starts with the rule that holds until it is measured.
        self._saving = [GUESS_SAVING_PRIOR, GUESS_SAVING_PRIOR]
        self._load = 1.0  # until measured, as if the store were always busy
        self._load_mark: tuple[float, float] | None = None  # (perf_counter, reader busy seconds) at the span's start
        # Decode: the seconds the store sat idle from each layer's step to the next step (see mark_step).
        self.idle_after = [0.0] * num_layers
        self._step_mark: tuple[int, float, float] | None = None  # (layer, perf_counter, busy seconds) of the last step

    def load(self) -> float:
        """The share of recent wall time the store had a read under way, 0..1 (1 until measured, or for a reader
        without a busy clock). A store that keeps up sits well under 1, and a guess read ahead then costs it little;
        a disk that is the decode's bottleneck sits near 1, where every wasted read delays one that is needed."""
        busy_seconds = getattr(self._reader, "busy_seconds", None)
        if busy_seconds is None:
            return self._load
        now = time.perf_counter()
        mark = self._load_mark
        if mark is not None and now - mark[0] < LOAD_SPAN_S:
            return self._load  # asked every layer step: the reader's clock only once a span is over
        busy = busy_seconds()
        if mark is None:
            self._load_mark = (now, busy)
            return self._load
        t0, b0 = mark
        span = now - t0
        if span >= LOAD_SPAN_S:
            if span <= LOAD_IDLE_S:
                self._load = 0.5 * self._load + 0.5 * min(1.0, (busy - b0) / span)
            self._load_mark = (now, busy)
        return self._load

    def mark_step(self, layer: int | None) -> None:
        """A decode step of `layer` begins (None: a prompt's step, which ends the chain). The store's idle time since
        the step before is charged to that step's layer: after the last layer it is the token's end (the head,
        sampling, the next token's layers up to its first MoE router), elsewhere the GPU's and the host's work from
        one layer's reads to the next one's, less what guesses kept the store reading. Where the idle sits says
        which reads could fill it. A gap over STEP_GAP_S (between requests) is skipped. A prompt short enough to run
        as decode steps (MoeStepper's caller decides by rows) counts as decode."""
        busy_seconds = getattr(self._reader, "busy_seconds", None)
        if busy_seconds is None:
            return
        if layer is None:
            self._step_mark = None
            return
        now, busy = time.perf_counter(), busy_seconds()
        mark, self._step_mark = self._step_mark, (layer, now, busy)
        if mark is not None and now - mark[1] <= STEP_GAP_S:
            self.idle_after[mark[0]] += max(0.0, (now - mark[1]) - (busy - mark[2]))

    def guess_saving(self) -> float:
        """The share of a store read that a right guess has recently saved the step that needed it, 0..1: 1 for a
        guess read in time, the share done for one still being read, 0 for one still queued (over the last ~500
        decode layer steps; 1 until measured, and drifting back to 1 while no guess is read). Near 1 on a store
        that keeps up. On a disk where a read takes several layers' time, most right guesses are still queued or
        being read when their layer runs, and each saves only part of a read while a wrong one costs a whole one."""
        saved, right = self._saving
        return saved / right if right > 0 else 1.0

    def count_guesses(self, hits: int, saved: float, late: int) -> None:
        """A decode layer step ran: its guesses read in time (hits), the share of a read the late ones saved
        (saved) and how many were late. Read in time: the whole read saved; under way: the share of it done; still
        queued: nothing yet. Every decode layer step also adds a trickle of "saved whole": with no guess read for a
        long while (a floor above every rank), the saving drifts back towards 1 and guesses are tried, and
        measured, again."""
        sums = self._saving
        sums[0] = GUESS_SAVING_DECAY * sums[0] + hits + saved + GUESS_SAVING_TRICKLE
        sums[1] = GUESS_SAVING_DECAY * sums[1] + hits + late + GUESS_SAVING_TRICKLE

    def summary(self) -> dict:
        """The load (see `load`), the reader's busy seconds so far and the decode's idle seconds after each layer's
        step (see `mark_step`), for /stats."""
        busy = getattr(self._reader, "busy_seconds", None)
        return {"load": round(self._load, 3), "busy_s": None if busy is None else round(busy(), 4),
                "idle_after_layer_s": [round(v, 4) for v in self.idle_after]}
