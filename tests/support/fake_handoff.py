"""A CPU stand-in for the CUDA side of glm53.exl3.handoff: the device is the host, every queued operation runs when it
is issued, and exllamav3's stream wait on a flag word (`exl3_moe_flag_wait`) blocks the calling thread until the word
reaches its value, as the compute stream would block. So the partial copied after the wait is exactly what the GPU
would read, and a hand-off that wrote its flag before its partial reads stale bytes here too.

`Ext.device_work()` stands for any work queued on the device (a copy, a kernel, on whatever stream): while a flag wait
is pending it waits behind it, as work on the GPU may (streams share its hardware queues), and gives up with a
TimeoutError instead of hanging a test."""

from __future__ import annotations

import ctypes
import time


class Event:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Cuda:
    pin = False

    def __init__(self) -> None:
        self.Event = Event
        self.compute = object()

    def set_device(self, index: int) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def current_stream(self, index: int) -> object:
        return self.compute


class Ext:
    """exllamav3's extension calls the hand-off makes; flag waits time out rather than hang a test."""

    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self.waits = 0
        self.pending = 0  # flag waits the device is blocked in
        self.device_works = 0
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
        self.pending += 1
        try:
            while ((word.value - value) & 0xFFFFFFFF) >= 0x80000000:  # CUDA's cyclic GEQ: (int32)(*flag - value) >= 0
                if time.monotonic() > end:
                    ctypes.c_uint32.from_address(abort_flag).value = 1
                    raise TimeoutError(f"flag wait for {value} timed out at {word.value}")
                time.sleep(0.0002)
        finally:
            self.pending -= 1

    def device_work(self, timeout_s: float = 2.0) -> None:
        """Work queued on the device: it runs once no flag wait is pending (or raises after `timeout_s`)."""
        self.device_works += 1
        end = time.monotonic() + timeout_s
        while self.pending:
            if time.monotonic() > end:
                raise TimeoutError("device work queued behind a pending flag wait never ran")
            time.sleep(0.0002)
