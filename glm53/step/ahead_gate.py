"""Whether the next layer's router lookahead pays, per layer, judged from what the store did for that layer.

In the nvme modes each decode step may run the next layer's router on its own input and read that guess's
store-only experts ahead (glm53.step.stepper, MoeStepper.ahead). That only pays while the layer's experts come
from the store: with every expert it picks already in RAM or VRAM (a RAM tier that holds them all, a warm hot
set) the router run, the read-ahead and the scoring are host time the GPU waits for, and nothing is read.

So a layer's lookahead is switched off once `window` of its decode steps in a row saw no store work, and back on
as soon as one does. Store work for a layer is either a guess for it that started a store read, or a step of it
that read from the store (a pick the guess did not cover, or one the guess was not run for). While off, the
lookahead still runs now and then (a probe), after `first_probe` skipped steps, the gap doubling up to `max_probe`
while probes find nothing; any store work resets it. A step that must read from the store turns the lookahead
back on at once, so the probes are only a second way back.

Pure bookkeeping on counts: MoeStepper asks `wants(layer)` before a guess for `layer` is made, tells
`guess_read(layer)` when a guess started a store read, and `stepped(layer, read_store)` at each decode step of
`layer`.
"""

from __future__ import annotations

WINDOW = 32        # decode steps of a layer in a row without store work before its lookahead stops
FIRST_PROBE = 16   # skipped steps before the first probe of a stopped layer
MAX_PROBE = 512    # the longest gap between probes (the gap doubles while probes find nothing)


class _LayerGate:
    __slots__ = ("on", "quiet", "skipped", "gap", "probing", "read")

    def __init__(self, first_probe: int):
        self.on = True         # the lookahead runs at each step
        self.quiet = 0         # steps in a row without store work while on
        self.skipped = 0       # steps skipped since it stopped or last probed
        self.gap = first_probe  # skipped steps before the next probe
        self.probing = False   # the guess for the coming step is a probe
        self.read = False      # the guess for the coming step started a store read


class AheadGate:
    def __init__(self, window: int = WINDOW, first_probe: int = FIRST_PROBE, max_probe: int = MAX_PROBE):
        if window < 1 or first_probe < 1 or max_probe < first_probe:
            raise ValueError("need window >= 1 and 1 <= first_probe <= max_probe")
        self.window, self.first_probe, self.max_probe = int(window), int(first_probe), int(max_probe)
        self._layers: dict[int, _LayerGate] = {}
        self.skipped = 0  # guesses not made, over all layers
        self.probes = 0   # guesses made while stopped

    def _layer(self, layer: int) -> _LayerGate:
        st = self._layers.get(layer)
        if st is None:
            st = self._layers[layer] = _LayerGate(self.first_probe)
        return st

    def wants(self, layer: int) -> bool:
        """Whether to guess `layer`'s picks for its coming step (called once per such step, before the guess)."""
        st = self._layer(layer)
        if st.on:
            return True
        st.skipped += 1
        if st.skipped <= st.gap:
            self.skipped += 1
            return False
        st.skipped, st.probing = 0, True
        self.probes += 1
        return True

    def guess_read(self, layer: int) -> None:
        """The guess for `layer` started a store read."""
        self._layer(layer).read = True

    def stepped(self, layer: int, read_store: bool) -> None:
        """A decode step of `layer` ran; read_store: it read (or waited for) an expert from the store. A layer never
        asked about (the first) has nothing to decide."""
        st = self._layers.get(layer)
        if st is None:
            return
        work, st.read = st.read or read_store, False
        if work:
            st.on, st.quiet, st.skipped, st.gap, st.probing = True, 0, 0, self.first_probe, False
        elif st.on:
            st.quiet += 1
            if st.quiet >= self.window:
                st.on, st.quiet, st.skipped = False, 0, 0
        elif st.probing:  # a probe that found nothing: wait longer for the next
            st.probing, st.gap = False, min(2 * st.gap, self.max_probe)

    def running(self, layer: int) -> bool:
        """Whether `layer`'s lookahead is on (probes aside)."""
        st = self._layers.get(layer)
        return st is None or st.on

    def snapshot(self) -> dict:
        """The layers whose lookahead is off now, the guesses skipped and the probes made so far, for /stats."""
        return {"off_layers": sorted(la for la, st in self._layers.items() if not st.on),
                "skipped": self.skipped, "probes": self.probes}
