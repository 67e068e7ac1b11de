"""Copies between tiers, and the tickets that say when their bytes have landed.

On CUDA every tier move goes through one dedicated copy stream (the copy engines, not SMs: the reference lost
28% of its time to an SM-driven gather). One stream means moves land in issue order, which the tiers rely on:
a victim's write-back is issued before the newcomer's fill of the same slot, so the fill cannot overwrite
bytes not yet read. Before each copy the copy stream waits for the work already queued on the compute stream,
so a slot is never refilled under a kernel that still reads it.

On a CPU device `copy_` is synchronous: the ticket is done when `copy` returns.
"""

from __future__ import annotations

import torch


class Ticket:
    """One issued copy. `done()` never blocks; `wait()` blocks the host until the bytes have landed."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event | None = None):
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


DONE = Ticket()


class Copier:
    """Issues tier copies on `device` (the VRAM stand-in). Subclass or replace to inject slow or deferred copies."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        """dst.copy_(src), asynchronously where the device allows; both are whole contiguous slot images."""
        if self._stream is None:
            dst.copy_(src)
            return DONE
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        # The caching allocator must not recycle either buffer while the copy stream still uses it. Slots are
        # long-lived arenas, but a caller may hand in a temporary.
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(self._stream)
        return Ticket(event)
