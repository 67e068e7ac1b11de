"""The lookahead's gate (glm53.step.ahead_gate): per layer, the next layer's router runs ahead only while the store
works for that layer, and is probed now and then once it stops."""

import pytest

from glm53.step.ahead_gate import AheadGate


def steps(gate: AheadGate, layer: int, n: int, *, read_store: bool = False, guess_reads: bool = False) -> list[bool]:
    """n decode steps of `layer` as the stepper runs them: asked, guessed (a guess may start a store read), stepped.
    Returns what `wants` said at each."""
    asked = []
    for _ in range(n):
        want = gate.wants(layer)
        asked.append(want)
        if want and guess_reads:
            gate.guess_read(layer)
        gate.stepped(layer, read_store)
    return asked


def test_the_lookahead_stops_after_a_window_of_steps_without_store_work():
    gate = AheadGate(window=4, first_probe=100)
    assert steps(gate, 1, 4) == [True] * 4
    assert not gate.running(1) and gate.snapshot()["off_layers"] == [1]
    assert steps(gate, 1, 10) == [False] * 10
    assert gate.snapshot() == {"off_layers": [1], "skipped": 10, "probes": 0}


def test_store_work_in_the_window_keeps_it_on():
    gate = AheadGate(window=4, first_probe=100)
    for _ in range(5):  # three quiet steps, then one whose guess started a read: the count starts again
        steps(gate, 1, 3)
        steps(gate, 1, 1, guess_reads=True)
        assert gate.running(1)
    for _ in range(5):  # ... or one that read from the store itself
        steps(gate, 1, 3)
        steps(gate, 1, 1, read_store=True)
        assert gate.running(1)
    steps(gate, 1, 4)
    assert not gate.running(1)


def test_a_guess_read_counts_for_its_own_step_only():
    gate = AheadGate(window=2, first_probe=100)
    gate.wants(1)
    gate.guess_read(1)
    gate.stepped(1, False)
    assert steps(gate, 1, 2) == [True, True] and not gate.running(1)


def test_layers_are_judged_apart_and_a_layer_never_asked_about_has_no_say():
    gate = AheadGate(window=3, first_probe=100)
    for _ in range(6):
        steps(gate, 1, 1)
        steps(gate, 2, 1, guess_reads=True)
        gate.stepped(0, False)  # the first layer: never guessed for
    assert not gate.running(1) and gate.running(2)
    assert gate.snapshot()["off_layers"] == [1]


def test_a_step_reading_from_the_store_turns_it_back_on_at_once():
    gate = AheadGate(window=3, first_probe=100)
    steps(gate, 1, 3)
    assert steps(gate, 1, 5) == [False] * 5
    steps(gate, 1, 1, read_store=True)  # skipped, but the step had to read: the store serves the layer again
    assert gate.running(1)
    assert steps(gate, 1, 3) == [True] * 3 and not gate.running(1)


def test_probes_back_off_while_they_find_nothing_and_one_that_reads_turns_it_on():
    gate = AheadGate(window=2, first_probe=3, max_probe=12)
    steps(gate, 1, 2)
    asked = steps(gate, 1, 3 + 1 + 6 + 1 + 12 + 1 + 12 + 1)
    probes = [i for i, a in enumerate(asked) if a]
    # gaps of 3, 6, 12 skipped steps, then the gap stays at max_probe
    assert probes == [3, 3 + 1 + 6, 3 + 1 + 6 + 1 + 12, 3 + 1 + 6 + 1 + 12 + 1 + 12]
    assert gate.snapshot()["probes"] == 4 and not gate.running(1)
    assert steps(gate, 1, 12) == [False] * 12
    assert steps(gate, 1, 1, guess_reads=True) == [True]  # the probe's guess started a read
    assert gate.running(1)
    steps(gate, 1, 2)
    assert steps(gate, 1, 4) == [False, False, False, True], "back to the first gap once it has run again"


def test_nonsense_settings_are_refused():
    for kw in ({"window": 0}, {"first_probe": 0}, {"first_probe": 8, "max_probe": 4}):
        with pytest.raises(ValueError):
            AheadGate(**kw)
