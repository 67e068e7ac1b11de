"""An emulated rate-capped disk for benches and tests, on the store library's read hook (store.native.set_read_hook).

Interim, for the benches that used the emulated disk the C++ read path carried until now: the bench package's own
compiled emulator replaces this module. Each part read, once its real pread is in, books its bytes on one timeline
shared by the process, from when the read began (the real read's own time counts towards its booking), and sleeps
until its booking ends: reads in flight share one fixed rate. The hook here is a ctypes callback, so each part read
takes the GIL once while it is on; the product never installs a hook.

    with emulated_disk(6e-3 / record_bytes):   # one record takes ~6 ms, two at once ~12 ms
        ...
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Iterator

from store import native

_lock = threading.Lock()
_state = {"seconds_per_byte": 0.0, "free_at": 0}  # free_at: monotonic ns when the last booking ends


def _pace(nbytes: int, began_ns: int) -> None:
    spb = _state["seconds_per_byte"]
    if spb <= 0.0 or nbytes <= 0:
        return
    with _lock:
        end = max(began_ns, _state["free_at"]) + int(nbytes * spb * 1e9)
        _state["free_at"] = end
    wait = (end - time.monotonic_ns()) * 1e-9  # steady_clock and time.monotonic are CLOCK_MONOTONIC on Linux
    if wait > 0:
        time.sleep(wait)


_HOOK = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64)(_pace)  # kept alive for the process's life
_ADDRESS = ctypes.cast(_HOOK, ctypes.c_void_p).value


def set_emulated_disk(seconds_per_byte: float) -> float:
    """Turn the emulated disk on at `seconds_per_byte` (0 or less: off) and return the rate it had before. Raises
    store.native.NativeUnavailable where the store's library is not built."""
    rate = max(0.0, float(seconds_per_byte))
    native.set_read_hook(_ADDRESS if rate > 0 else 0)
    before, _state["seconds_per_byte"] = _state["seconds_per_byte"], rate
    return before


@contextlib.contextmanager
def emulated_disk(seconds_per_byte: float) -> Iterator[float]:
    """The emulated disk on at `seconds_per_byte` inside the block (0: off), the rate before put back after it;
    yields the rate set."""
    before = set_emulated_disk(seconds_per_byte)
    try:
        yield max(0.0, float(seconds_per_byte))
    finally:
        set_emulated_disk(before)
