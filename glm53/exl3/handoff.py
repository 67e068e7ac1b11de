"""The CPU lane's partial handed to the GPU in stream order: the engine thread never waits for the lane in a step.

A layer step that gives the lane experts would otherwise block the engine thread in the combine until the lane is
done, and only then launch the next layer; exllamav3's decode step is launch-bound, so the GPU would sit idle for
those launches after every such step. Instead the combine queues on the compute stream a wait for a flag word in
mapped host memory (exllamav3's `exl3_moe_flag_wait`: a stream memory operation, or a one-thread spin kernel where
the driver has none), the partial's copy from a pinned buffer and the add, and returns: the host goes on launching
the next layer while the lane computes. A resolver thread waits for the lane's ticket, writes the partial, then the
flag.

The resolver queues no device work, ever: while the compute stream waits on a flag, work queued on the device from
any stream may wait behind it (streams share the GPU's hardware queues), and a recompute's copy that waits for the
flag its own thread must write never runs. So a late lane is waited for rather than recomputed (glm53.cpu_lane.lane:
`recompute=False`), and a ticket the lane has already left to the exact path is resolved on the engine thread
before anything waits (the combine checks `needs_recompute`). A lane that fails or stalls with the GPU waiting fails
the step: the resolver writes NaN and the flag anyway (the GPU must not wait forever) and keeps the error; `check()`,
called after every generator iteration, raises it, so the request fails loudly and its tokens are never emitted.
The lane is disabled by then, so later steps take the exact path.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import weakref
from typing import Any

import numpy as np

from glm53.exl3.contract import MAX_BSZN

log = logging.getLogger("glm53.engine")

FLAG_WORDS = 16  # uint32 words a flag owns: one 64-byte line each, as exllamav3's own hand-off lays them out
RING = 2         # partial buffers in turn: a buffer is written again two hand-offs later, after its copy has run
REGISTER_PORTABLE_MAPPED = 0x03  # cudaHostRegisterPortable | cudaHostRegisterMapped


PAGE = 4096


def mapped_host(torch: Any, ext: Any, shape: tuple[int, ...]) -> tuple[Any, int]:
    """(uint8 host tensor of `shape`, its device alias): pages registered portable and mapped, as exllamav3's CPU
    hand-off registers its shared region, so a stream memory operation can wait on a word in them. Whole pages of
    their own: a page is registered once, and a small buffer would share its page with the heap's other bytes. The
    registration lasts as long as the returned tensor object (not merely its storage): keep that object."""
    nbytes = math.prod(shape)
    span = -(-nbytes // PAGE) * PAGE
    whole = torch.zeros(span + PAGE, dtype=torch.uint8)
    start = -whole.data_ptr() % PAGE
    ptr = whole.data_ptr() + start
    ext.cuda_host_register(ptr, span, REGISTER_PORTABLE_MAPPED)
    host = whole[start:start + nbytes].view(shape)
    host.whole = whole
    weakref.finalize(host, ext.cuda_host_unregister, ptr)
    return host, int(ext.cuda_host_get_device_pointer(ptr))


class LaneHandOffError(RuntimeError):
    """The lane's partial for a step could not be made (the lane failed or stalled): that step's output is wrong."""


class Cuda:
    """The torch.cuda calls the hand-off makes (the tests hand in a CPU stand-in whose flag wait blocks the host)."""

    def __init__(self) -> None:
        import torch

        self.Event = torch.cuda.Event
        self.set_device, self.current_device = torch.cuda.set_device, torch.cuda.current_device
        self.pin = True

    def current_stream(self, index: int) -> Any:
        from glm53.tiers.copier import compute_stream

        return compute_stream(index)


class StreamHandOff:
    """One device's hand-off: the flags, RING pinned partial buffers and their device twins, the resolver thread."""

    def __init__(self, device: Any, hidden: int, ext: Any, cuda: Any = None):
        import torch

        self.torch, self.ext, self.device = torch, ext, torch.device(device)
        self.cuda = Cuda() if cuda is None else cuda
        self.index = self.device.index if self.device.index is not None else self.cuda.current_device()
        words = (RING + 1) * FLAG_WORDS  # the last line: the abort word the spin-kernel fallback may write
        self._flag_mem, flag_dev = mapped_host(torch, ext, (words * 4,))
        self._flags = self._flag_mem.numpy().view(np.uint32)
        self._flag_dev = [flag_dev + 4 * FLAG_WORDS * s for s in range(RING)]
        self._abort_dev = flag_dev + 4 * FLAG_WORDS * RING
        self._host = torch.empty((RING, MAX_BSZN, hidden), dtype=torch.float32, pin_memory=self.cuda.pin)
        self._dev = torch.empty((RING, MAX_BSZN, hidden), dtype=torch.float32, device=self.device)
        self._copied: list[Any] = [None] * RING  # the event after each buffer's last copy to the device
        self._seq = 0
        self.error: BaseException | None = None
        self.handed = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._resolve_all, name="glm53-lane-handoff", daemon=True)
        self._thread.start()

    def enqueue(self, final: Any, ticket: Any, rows: int, shape: Any) -> Any:
        """final + the lane's partial for `rows` token rows, in stream order: returns at once."""
        cuda = self.cuda
        cur = cuda.current_stream(self.index)
        self._seq += 1
        seq, slot = self._seq, self._seq % RING
        self._queue.put((ticket, rows, slot, seq, self._copied[slot]))
        self.ext.exl3_moe_flag_wait(self._flag_dev[slot], seq, self._abort_dev)
        dev = self._dev[slot, :rows]
        dev.copy_(self._host[slot, :rows], non_blocking=True)
        copied = cuda.Event()
        copied.record(cur)
        self._copied[slot] = copied
        self.handed += 1
        return final + dev.view(shape).to(final.dtype)

    def check(self) -> None:
        """Raise the error a resolver met since the last check (the steps it spoiled are in the iteration just run),
        or a flag wait the spin-kernel fallback gave up on (it then let the GPU run on without the partial)."""
        err, self.error = self.error, None
        if err is not None:
            raise LaneHandOffError(f"the CPU lane's partial could not be made: {err!r}") from err
        if self._flags[RING * FLAG_WORDS]:
            self._flags[RING * FLAG_WORDS] = 0
            raise LaneHandOffError("the GPU gave up waiting for the CPU lane's partial (30 s): a step ran without it")

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10.0)

    # ---- the resolver thread ------------------------------------------------------------------------------------

    def _resolve_all(self) -> None:
        torch, cuda = self.torch, self.cuda
        cuda.set_device(self.index)
        with torch.inference_mode():  # the engine made the buffers in inference mode, which is per thread
            while (item := self._queue.get()) is not None:
                self._resolve(*item)

    def _resolve(self, ticket: Any, rows: int, slot: int, seq: int, copied: Any) -> None:
        """One step's partial into its buffer, then its flag, whatever happens: the GPU waits for that flag."""
        out = self._host[slot, :rows]
        try:
            if copied is not None:
                copied.synchronize()  # the GPU has read this buffer's last partial (a copy queued before any wait)
            out.copy_(self.torch.from_numpy(ticket.partial(rows, recompute=False)))
        except BaseException as exc:  # the engine raises it at its check; the step's output must not pass as right
            log.exception("CPU lane hand-off: the partial for layer %s failed", getattr(ticket, "layer", "?"))
            self.error = self.error or exc
            try:
                out.fill_(float("nan"))
            except BaseException:  # the device is gone too: the check still fails the iteration
                log.exception("CPU lane hand-off: could not mark the failed partial")
        finally:
            self._flags[slot * FLAG_WORDS] = seq & 0xFFFFFFFF  # after the partial: x86 stores stay in order
