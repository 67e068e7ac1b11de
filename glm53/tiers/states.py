"""Where an expert is: the one state each (layer, expert) of the tiers is in (glm53.tiers.tiers explains each)."""

from __future__ import annotations

from enum import IntEnum


class Where(IntEnum):
    VRAM = 0
    RAM = 1
    TO_VRAM = 2
    TO_RAM = 3
    STORE = 4
    FROM_STORE = 5


# The states as plain ints for the per-step paths: an IntEnum member lookup goes through the enum machinery
# (about a microsecond each in Python 3.11), and these run several times per expert of every layer step. Worse, a
# numpy value compared with a member (`where[l, e] != Where.STORE`) costs ~3 us, against ~0.05 us with an int.
VRAM, RAM, TO_VRAM, TO_RAM, STORE, FROM_STORE = (int(w) for w in Where)
