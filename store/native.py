"""The store's native library (store/_native*.so, built from store/csrc by setup.py at `pip install`): the parallel
pread that reads one record as several parts at once, the read queue that store.reader's reads run on, and the
read hook a bench may install. No glm53 here: the store tools run in a bare container.

Importing this module never fails: `available()` / `unavailable_reason()` say whether the library loaded and, if
not, why (not built, a stale build, no compiler at install time...); every call that needs it raises
NativeUnavailable with that reason and the command that rebuilds it.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
from pathlib import Path

import numpy as np

from store import native_build
from store.errors import StoreError

ABI_VERSION = 1
HERE = Path(__file__).resolve().parent
REBUILD = "pip install -e . (or `make clean test` in a checkout); it needs a C++ compiler (g++)"
NAME = native_build.EXTENSION.rpartition(".")[2]  # _native


class NativeUnavailable(StoreError, RuntimeError):
    """The store's native library could not be loaded; the message says why and how to fix it."""


def declare(lib: ctypes.CDLL, signatures) -> str | None:
    """Set each (name, restype, argtypes) of `signatures` on the library's function of that name; the first name
    the library lacks (a build of other sources), or None. glm53's CPU kernel binds its library with it too."""
    for name, res, args in signatures:
        fn = getattr(lib, name, None)
        if fn is None:
            return name
        fn.restype, fn.argtypes = res, args
    return None


def _bind(path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """Open one build of the library and declare its functions; (None, why) if it cannot be used."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot load {path}: {exc}"
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    missing = declare(lib, (
        ("glm53_store_abi_version", i32, []),
        ("glm53_store_source_hash", ctypes.c_char_p, []),
        ("glm53_store_set_read_hook", vp, [vp]),
        ("glm53_pread_parts", i64, [i32, vp, i64, i64, i32, i32, ctypes.POINTER(i32), vp, vp, ctypes.POINTER(i32)]),
        ("glm53_rq_wait", i64, [vp, vp, i64]),
        ("glm53_rq_close", i64, [vp]),
        ("glm53_rq_free", None, [vp]),
    ))
    if missing:
        return None, f"{path} lacks {missing}: a build of other sources"
    if lib.glm53_store_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI {lib.glm53_store_abi_version()}, this code wants {ABI_VERSION}"
    return lib, None


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    found = [p for p in (HERE / f"{NAME}{sfx}" for sfx in importlib.machinery.EXTENSION_SUFFIXES) if p.exists()]
    if not found:
        return None, f"not built (no {HERE.name}/{NAME}*.so for this Python)"
    lib, why = _bind(found[0])
    if lib is None:
        return None, why
    src = native_build.HERE
    if all((src / n).exists() for n in native_build.SOURCES + native_build.HEADERS):  # a checkout, not a bare wheel
        built, now = lib.glm53_store_source_hash().decode(), native_build.source_hash()
        if built != now:
            return None, f"stale build: {found[0].name} was built from other sources ({built}, now {now})"
    return lib, None


_LIB, _WHY = _load()
_HELD: list[ctypes.PyDLL] = []  # the same library bound to keep the GIL (queue_calls), made once
_XXH3: list[int] = []  # the address of xxhash's C XXH3_64bits, or 0, looked up once


def available() -> bool:
    return _LIB is not None


def unavailable_reason() -> str | None:
    """Why the library is not loaded, and the command that builds it; None when it is."""
    return None if _WHY is None else f"{_WHY}; build it with {REBUILD}"


def library() -> ctypes.CDLL:
    """The loaded library (ctypes handle); raises NativeUnavailable naming why it is not there."""
    if _LIB is None:
        raise NativeUnavailable(f"the store's native library (store reads) is unavailable: {_WHY}",
                                f"build it with {REBUILD}")
    return _LIB


def library_path() -> Path:
    """The loaded library's file, for a bench that binds it itself."""
    return Path(library()._name)


def queue_calls() -> tuple[ctypes.PyDLL, ctypes.CDLL]:
    """(held, released): the library bound twice, its non-blocking queue calls keeping the GIL (a submit or a
    cancel then costs no GIL hand-off) and its blocking ones (glm53_rq_wait, _close, _free, on `released`)
    releasing it. Raises NativeUnavailable."""
    lib = library()
    if not _HELD:
        held = ctypes.PyDLL(lib._name)
        vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
        declare(held, (
            ("glm53_rq_new", vp, [i32]), ("glm53_rq_submit", i32, [vp, vp]), ("glm53_rq_cancel", i32, [vp, vp]),
            ("glm53_rq_promote", i32, [vp, vp]), ("glm53_rq_busy", ctypes.c_double, [vp]),
            ("glm53_rq_queued", i64, [vp]), ("glm53_rq_state", i64, [vp]),
            ("glm53_rq_set_prefetch_cap", i32, [vp, i32]),
        ))
        _HELD.append(held)
    return _HELD[0], lib


def pread_parts(fd: int, buf: np.ndarray, offset: int, parts: int, align: int, hash: int = 0,
                hashes: np.ndarray | None = None) -> tuple[int, int]:
    """Fill the uint8 array `buf` from `offset` as `parts` pieces (parts-1 of an `align`-multiple size, the last
    takes the rest) read at once on native threads, with the GIL released for the whole call. Returns (bytes read,
    fewer only at EOF; parts used: 1 where the range is too short to split); raises OSError with a failing part's
    errno. hash (a C function's address, uint64 hash(const void*, size_t); 0: none) with hashes (a uint64 array of
    `parts` entries): each part read whole is hashed by the thread that read it into hashes[i]."""
    if hashes is not None and (hashes.dtype != np.uint64 or hashes.size < max(1, parts)
                               or not hashes.flags.c_contiguous):
        raise ValueError(f"hashes must be a contiguous uint64 array of at least {parts} entries")
    err, used = ctypes.c_int32(0), ctypes.c_int32(0)
    got = library().glm53_pread_parts(fd, buf.ctypes.data, buf.nbytes, offset, parts, align, ctypes.byref(err),
                                      hash if hashes is not None and hash else None,
                                      hashes.ctypes.data if hashes is not None and hash else None,
                                      ctypes.byref(used))
    if got < 0:
        raise OSError(err.value, os.strerror(err.value))
    return got, used.value


def set_read_hook(address: int) -> int:
    """Install the C function at `address` (void hook(int64_t bytes, int64_t began_ns); 0: none) as the read hook,
    called on the read thread after each part's pread loop with the bytes it read and the steady_clock ns at which
    that part's read began, before the part counts as done (store_api.h). Returns the previous hook's address (0:
    none). For benches and tests; the product never installs one. The caller keeps the function alive (its
    library loaded) until it has put the previous hook back."""
    return int(library().glm53_store_set_read_hook(address or None) or 0)


def xxh3_address() -> int:
    """The address of the xxhash library's own C XXH3_64bits (the one the xxhash package wraps), for the per-part
    hashes of native reads; 0 where the package does not export it or it disagrees with the package's own result
    on a test buffer (then records are checked whole, in Python)."""
    if not _XXH3:
        address = 0
        try:
            import xxhash
            from xxhash import _xxhash

            fn = ctypes.CDLL(_xxhash.__file__).XXH3_64bits
            fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
            probe = np.frombuffer(b"glm53 part hash probe" * 300, np.uint8)
            if fn(probe.ctypes.data, probe.nbytes) == xxhash.xxh3_64_intdigest(probe):
                address = ctypes.cast(fn, ctypes.c_void_p).value or 0
        except (ImportError, OSError, AttributeError):
            pass
        _XXH3.append(address)
    return _XXH3[0]
