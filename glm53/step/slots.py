"""Router ids -> slot ids, and the Resolution that carries them back to the adapter.

A slot id is one of the layer's S cache slots (a VRAM hit, or an expert admitted this step), one of the P staging
slots shared by all layers (a miss streamed over PCIe without admission, or copied a step ahead by the prestage), or
`masked` (S + P: outside the module's
expert interval, so exllamav3's kernels add exact zeros for it) for a pick the CPU lane computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np


class StepError(RuntimeError):
    """A step could not make its picks readable (configuration too small): fail loudly, never guess."""


NO_SLOTS = np.empty(0, np.int64)
NO_SLOTS.flags.writeable = False
EMPTY: Mapping[int, int] = MappingProxyType({})


@dataclass
class Resolution:
    """What `MoeStepper.resolve` decided for one layer step: the slot each pick is read from, the misses it
    staged, and the experts the CPU lane computes with the lane's ticket."""

    slots: np.ndarray                       # (tokens, top_k) slot id per pick
    staged: list[int] = field(default_factory=list)  # misses streamed into staging (a decode step's admissions
    # come after launch, from these rows)
    cpu: list[int] = field(default_factory=list)   # experts the CPU lane computes (their picks are masked)
    ticket: Any = None                      # the lane's LaneTicket, or None: ticket.partial(tokens) at combine


def translate(ids: np.ndarray, slot_of: np.ndarray, staged: Sequence[int], staging_base: int,
              masked: Sequence[int] = (), masked_id: int = -1, prestaged: Mapping[int, int] = EMPTY) -> np.ndarray:
    """Router ids -> slot ids: a resident expert's cache slot, `staging_base + i` for staged[i],
    `staging_base + row` for a prestaged expert (expert -> its staging row), `masked_id` for the experts in
    `masked` (computed elsewhere). Raises StepError if a pick is none of these: that pick would silently contribute
    zero, which is never allowed."""
    lut = np.asarray(slot_of, np.int64).copy()
    for i, e in [*enumerate(staged), *((r, e) for e, r in prestaged.items())]:
        if lut[e] >= 0:
            raise StepError(f"expert {e} is both resident or staged (slot {lut[e]}) and staged")
        lut[e] = staging_base + i
    for e in masked:
        if lut[e] >= 0:
            raise StepError(f"expert {e} is given to the CPU lane but also resident or staged (slot {lut[e]})")
        lut[e] = masked_id
    out = lut[np.asarray(ids, np.int64)]
    if out.size and out.min() < 0:
        missing = sorted(set(np.asarray(ids)[out < 0].tolist()))
        raise StepError(f"experts {missing} are picked but neither resident nor staged")
    return out


def decode_slots(ids: np.ndarray, picks: list[int], uniq: np.ndarray, slot_of: np.ndarray, staged: Sequence[int],
                 staging_base: int, masked: Sequence[int] = (), masked_id: int = -1,
                 prestaged: Mapping[int, int] = EMPTY) -> np.ndarray:
    """translate() for a decode step's few picks (picks: ids as a list, uniq: its distinct ids): a dict over the
    step's experts instead of a num_experts lookup table. Whatever is not the plain case (a staged or masked
    expert resident or not picked, a pick with nowhere to be read) goes to translate(), which raises."""
    slot = dict(zip(uniq.tolist(), slot_of[uniq].tolist(), strict=True))  # -1: not resident
    plain = True
    for i, e in [*enumerate(staged), *((r, e) for e, r in prestaged.items())]:
        plain = plain and slot.get(e, 0) == -1
        slot[e] = staging_base + i
    for e in masked:
        plain = plain and slot.get(e, 0) == -1
        slot[e] = masked_id
    if not plain or -1 in slot.values():
        return translate(ids, slot_of, staged, staging_base, masked, masked_id, prestaged)
    return np.array([slot[e] for e in picks], np.int64).reshape(ids.shape)
