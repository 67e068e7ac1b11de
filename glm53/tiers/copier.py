"""Copies between tiers, and the tickets that say when their bytes have landed.

On CUDA tier moves run on the copy engines (not SMs: the reference lost 28% of its time to an SM-driven
gather), on two streams: fills (host -> device) and write-backs (device -> host). They cross PCIe in opposite
directions, so on two streams they overlap; on one stream each write-back would stall the fills behind it.
Ordering is explicit instead of by issue order: a copy may name `after`, a ticket it must wait for (a fill
into a slot waits for the write-back still reading that slot). Before each copy its stream also waits for
the work already queued on the compute stream, so a slot is never refilled under a kernel that still reads it.

On a CPU device `copy_` is synchronous: the ticket is done when `copy` returns.

`pace` (None unless a benchmark emulates a slower link, glm53.bench.emulate) is called on the copy's stream after
each copy that crosses PCIe, with its bytes: whatever it queues there delays that copy's ticket and every copy
behind it on the stream, as a slower link would, while the compute stream runs on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Ticket:
    """One issued copy. `done()` never blocks; `wait()` blocks the host until the bytes have landed."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event | None = None):
        self.event = event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


DONE = Ticket()

_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def compute_stream(index: int) -> torch.cuda.Stream:
    """torch.cuda.current_stream(index) for a device index, without its cost: in torch 2.11 that call spends
    ~30 us in Python (device-index normalisation, a new wrapper object), and a decode layer step needs the
    current stream several times, a third of the host's step. The raw lookup is one C call; the wrapper for each
    stream seen is made once."""
    raw = getattr(torch._C, "_cuda_getCurrentStream", None)
    if raw is None:  # a torch without the private lookup: the public call, at its price
        return torch.cuda.current_stream(index)
    sid, dev, dtype = raw(index)
    stream = _STREAMS.get((dev, sid))
    if stream is None:
        stream = _STREAMS[(dev, sid)] = torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=dtype)
    return stream


class _On:
    """`with torch.cuda.stream(s)` for the copy streams, restoring the compute stream without looking it up again
    (the stock context manager looks up the current stream twice per use). Setting a stream also makes its device
    current: with the layers split across cards, a copy for another card's layer must not leave that card current
    for exllamav3's code that follows, so the current device is put back too."""

    __slots__ = ("stream", "prev", "device")

    def __init__(self, stream: torch.cuda.Stream, prev: torch.cuda.Stream):
        self.stream, self.prev = stream, prev

    def __enter__(self) -> None:
        self.device = torch.cuda.current_device()
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self.prev)
        if self.prev.device_index != self.device:
            torch.cuda.set_device(self.device)


class Copier:
    """Issues tier copies on `device` (the VRAM stand-in). Replace to inject slow or deferred copies."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if self.cuda else -1
        self._fill = torch.cuda.Stream(self.device) if self.cuda else None
        self._write_back = torch.cuda.Stream(self.device) if self.cuda else None
        self.pace: Callable[[int], None] | None = None  # bytes crossing the link

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Ticket | None = None) -> Ticket:
        """dst.copy_(src), asynchronously where the device allows, once `after` (if any) has landed."""
        if not self.cuda:
            dst.copy_(src)
            return DONE
        stream = self._fill if dst.is_cuda else self._write_back
        cur = compute_stream(self.index)
        stream.wait_stream(cur)
        if after is not None and after.event is not None:
            stream.wait_event(after.event)
        with _On(stream, cur):
            dst.copy_(src, non_blocking=True)
            if self.pace is not None and not (dst.is_cuda and src.is_cuda):
                self.pace(dst.nbytes)
            event = torch.cuda.Event()
            event.record(stream)
        # The caching allocator must not recycle a device buffer while the copy stream still uses it. Slots are
        # long-lived arenas, but a caller may hand in a temporary.
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(stream)
        return Ticket(event)

    def order_compute_after(self, tickets: list) -> None:
        """Make the work queued next on the compute stream wait for these copies, without blocking the host (a
        stream-side wait on their events). Where a ticket has no event the host waits for it instead (CPU, or a
        test copier whose tickets land when waited for)."""
        cur = compute_stream(self.index) if self.cuda else None
        for t in tickets:
            event = getattr(t, "event", None)
            if cur is not None and isinstance(t, Ticket) and event is not None:
                cur.wait_event(event)
            else:
                t.wait()

    def copy_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Ticket:
        """Several copies into device buffers (a step's staging), in order; the returned ticket lands with the
        last, hence with all of them. One stream hand-off and one event for the batch: per copy those cost more
        host time than issuing the copy itself, and a layer step stages a few. The buffers must outlive the
        copies (slot arenas, allocated once): unlike copy(), no record_stream per buffer on this per-step path."""
        if not pairs:
            return DONE
        if type(self).copy is not Copier.copy or not all(d.is_cuda == self.cuda for d, _ in pairs):
            last = DONE  # a copier that overrides copy (tests defer copies), or a write-back: one by one, its way
            for dst, src in pairs:
                last = self.copy(dst, src)
            return last
        if not self.cuda:
            self._copy_all(pairs)
            return DONE
        stream = self._fill
        cur = compute_stream(self.index)
        stream.wait_stream(cur)
        with _On(stream, cur):
            self._copy_all(pairs)
            if self.pace is not None:
                crossing = sum(d.nbytes for d, s in pairs if not s.is_cuda)
                if crossing:
                    self.pace(crossing)
            event = torch.cuda.Event()
            event.record(stream)
        return Ticket(event)

    def _copy_all(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The pairs' copies queued on the current stream, in order, in one call into torch (its list copy copies
        pair by pair, each as copy_ would, across devices too): each copy_ call lets go of the GIL, and in the nvme
        modes a store reader thread waiting for it may then run before the planning thread gets it back, which
        makes each copy queued one by one cost the nvme modes a multiple of fast mode's host time."""
        if len(pairs) > 1:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs], non_blocking=True)
        else:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
