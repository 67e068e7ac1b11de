"""A CPU stand-in for the CUDA side of glm53.exl3.handoff: the device is the host, every queued operation runs when it
is issued, and exllamav3's stream wait on a flag word (`exl3_moe_flag_wait`) blocks the calling thread until the word
reaches its value, as the compute stream would block. So the partial copied after the wait is exactly what the GPU
would read, and a hand-off that wrote its flag before its partial reads stale bytes here too."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time


class Event:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Stream:
    def __init__(self, device=None):
        self.waited: list[Event] = []

    def wait_event(self, event: Event) -> None:
        self.waited.append(event)


class Cuda:
    pin = False

    def __init__(self) -> None:
        self.local = threading.local()
        self.Event, self.Stream = Event, Stream
        self.compute = Stream()

    @contextlib.contextmanager
    def stream(self, s: Stream):
        prev = getattr(self.local, "stream", None)
        self.local.stream = s
        try:
            yield
        finally:
            self.local.stream = prev

    def active(self) -> Stream | None:
        """The stream the calling thread has set (None: the compute stream)."""
        return getattr(self.local, "stream", None)

    def set_device(self, index: int) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def current_stream(self, index: int) -> Stream:
        return self.compute


class Ext:
    """exllamav3's extension calls the hand-off makes; flag waits time out rather than hang a test."""

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self.waits = 0
        self.registered: dict[int, int] = {}  # start -> bytes: the device may read only these

    def cuda_host_register(self, ptr: int, nbytes: int, flags: int) -> None:
        assert ptr not in self.registered, "a page registered twice"
        self.registered[ptr] = nbytes

    def cuda_host_unregister(self, ptr: int) -> None:
        del self.registered[ptr]

    def mapped(self, addr: int) -> bool:
        return any(p <= addr < p + n for p, n in self.registered.items())

    def cuda_host_get_device_pointer(self, ptr: int) -> int:
        return ptr  # unified addressing: the device alias of a mapped host page is its host address

    def exl3_moe_flag_wait(self, flag: int, value: int, abort_flag: int) -> None:
        self.waits += 1
        if not (self.mapped(flag) and self.mapped(abort_flag)):  # on the GPU: an illegal address
            raise RuntimeError(f"flag wait on {flag:#x}: not in registered host memory")
        word = ctypes.c_uint32.from_address(flag)
        end = time.monotonic() + self.timeout_s
        while ((word.value - value) & 0xFFFFFFFF) >= 0x80000000:  # CUDA's cyclic GEQ: (int32)(*flag - value) >= 0
            if time.monotonic() > end:
                ctypes.c_uint32.from_address(abort_flag).value = 1
                raise TimeoutError(f"flag wait for {value} timed out at {word.value}")
            time.sleep(0.0002)
