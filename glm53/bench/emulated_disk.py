"""The emulated drive: the store's native reads paced as by a disk of one fixed rate that all reads in flight share
(emulated_disk.cpp), through the store library's read hook (`glm53_store_set_read_hook`), which the product never
installs. For benches and tests on a machine whose store comes from a fast disk or the page cache.

    with emulated_disk(6e-3 / record_bytes):   # one record takes ~6 ms, two at once ~12 ms
        ...

Only reads through the store's native pread are paced (Python's own preads are not)."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path

LIB_GLOB = "_emulated_disk*.so"
REBUILD = "pip install -e . (builds glm53/bench/_emulated_disk)"
HOOK_SYMBOL = "glm53_store_set_read_hook"


class EmulatorUnavailable(RuntimeError):
    """The emulator's library is not built, or the store's native reads have no read hook."""


_LIB: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The emulator's own library (built by setup.py next to this file)."""
    global _LIB
    if _LIB is None:
        found = sorted(Path(__file__).parent.glob(LIB_GLOB))
        if not found:
            raise EmulatorUnavailable(f"the emulated disk's library is not built; run {REBUILD}")
        lib = ctypes.CDLL(str(found[0]))
        lib.glm53_bench_disk_hook.restype, lib.glm53_bench_disk_hook.argtypes = None, [ctypes.c_int64] * 2
        lib.glm53_bench_set_disk_rate.restype = ctypes.c_double
        lib.glm53_bench_set_disk_rate.argtypes = [ctypes.c_double]
        lib.glm53_bench_steady_ns.restype, lib.glm53_bench_steady_ns.argtypes = ctypes.c_int64, []
        _LIB = lib
    return _LIB


def hook_address() -> int:
    """The address of the pacing hook (a glm53_read_hook_fn)."""
    return ctypes.cast(library().glm53_bench_disk_hook, ctypes.c_void_p).value


def set_rate(seconds_per_byte: float) -> float:
    """The pacing rate (0: none); returns the rate before."""
    return float(library().glm53_bench_set_disk_rate(float(seconds_per_byte)))


def store_hook_setter() -> Callable[[int], int] | None:
    """set_read_hook(address) -> the previous address, for the store's native reads; None where they have none."""
    from store import native

    return native.set_read_hook if native.available() else None


def problem() -> str | None:
    """Why the emulated disk cannot pace the store's reads here, or None."""
    try:
        library()
    except EmulatorUnavailable as exc:
        return str(exc)
    if store_hook_setter() is None:
        return f"the store's native reads have no read hook ({HOOK_SYMBOL}); rebuild the store's library"
    return None


@contextlib.contextmanager
def emulated_disk(seconds_per_byte: float) -> Iterator[float]:
    """The store's native reads paced at `seconds_per_byte` inside the block (0 or less: not paced, whatever an
    outer block set), the hook and rate before put back after it; yields the rate set. Raises EmulatorUnavailable
    where the emulator or the store's hook is missing."""
    why = problem()
    if why:
        raise EmulatorUnavailable(why)
    set_hook = store_hook_setter()
    rate = max(0.0, float(seconds_per_byte))
    before_rate = set_rate(rate)
    before_hook = set_hook(hook_address() if rate > 0 else 0)
    try:
        yield rate
    finally:
        set_hook(before_hook)
        set_rate(before_rate)
