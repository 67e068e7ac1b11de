"""Python side of the CPU expert kernel: load the library, describe experts to it, run it on a pinned pool.

The library (`_expert_kernel*.so`, built from kernel*.cpp by setup.py at `pip install`) computes one routed
expert's MLP for a few activation rows directly from the EXL3 bytes of its slot image, wherever those lie (the
RAM tier's arena, a store record, a numpy copy): nothing is copied or decoded ahead.

Two kernels per ISA. The exact one decodes every weight bit-identically to exllamav3's and runs Hadamard
transforms, sums and the clamped SwiGLU in fp32, so an expert's output is "near-exact" (relative error ~1e-6
against float64 maths). The integer one (kernel="int") takes each weight as the affine function of its hash's
byte sum that mul1 rounds to fp16, and dots the byte sums with the activations quantized to int16 per 128-block,
in integer arithmetic: ~3.5e-4 relative error, half a GPU-like fp16 computation's (~7.5e-4); measured in
tests/cpu_lane/test_cpu_lane_kernel.py. The lane serves with served_kernel(isa): the integer kernel on the ISAs
where this build has a tested one, the exact kernel elsewhere; the exact kernel stays the reference.

    kern = CpuKernel(threads=8, cpus=pick_cpus(8))
    y = kern.forward(slot_bytes, layout, x)          # x (rows, hidden) float32 -> y (rows, hidden) float32

Importing this module never fails: `available()` / `unavailable_reason()` say whether the library loaded and,
if not, why (not built, stale build, no compiler at install time...), and every call raises KernelUnavailable
with that reason.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from store.native import declare

from . import buildinfo

# The library's ISA codes (kernel_api.h), and the order best_isa() prefers them in: widest first.
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512vnni": 3, "avx2vnni": 4}
ISAS = ("scalar", "avx2", "avx2vnni", "avx512", "avx512vnni")  # narrowest first
ABI_VERSION = 1
KERNEL_INT = 0x100  # kernel_api.h's GLM53_KERNEL_INT, OR'ed into an ISA code: that ISA's integer kernel
KERNELS = ("exact", "int")
PROJECTIONS = ("gate", "up", "down")
SWIGLU_LIMIT = 10.0  # GLM-5.3-Flash's swiglu_limit (config.json); 0 disables the clamp
HERE = Path(__file__).resolve().parent
REBUILD = "pip install -e . (or `make clean test` in a checkout); it needs a C++ compiler (g++)"


class KernelUnavailable(RuntimeError):
    """The compiled kernel could not be loaded; the message says why and how to fix it."""


class KernelError(RuntimeError):
    """The kernel refused a call (bad shapes, unsupported ISA, out of memory)."""


class _Linear(ctypes.Structure):
    _fields_ = [("trellis", ctypes.c_void_p), ("suh", ctypes.c_void_p), ("svh", ctypes.c_void_p),
                ("in_features", ctypes.c_int32), ("out_features", ctypes.c_int32), ("k_bits", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class _Job(ctypes.Structure):
    _fields_ = [("gate", _Linear), ("up", _Linear), ("down", _Linear), ("x", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("rows", ctypes.c_int32), ("swiglu_limit", ctypes.c_float)]


def _bind(path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    """Open one build of the library and declare its functions; (None, why) if it cannot be used."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot load {path}: {exc}; rebuild it with {REBUILD}"
    vp, i32, f32p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_float)
    missing = declare(lib, (
        ("glm53_abi_version", i32, []),
        ("glm53_source_hash", ctypes.c_char_p, []),
        ("glm53_last_error", ctypes.c_char_p, []),
        ("glm53_isa_supported", i32, [i32]),
        ("glm53_pool_new", vp, [i32, ctypes.POINTER(ctypes.c_int32), i32, i32]),
        ("glm53_pool_free", None, [vp]),
        ("glm53_pool_threads", i32, [vp]),
        ("glm53_pool_pinned", i32, [vp]),
        ("glm53_run", i32, [vp, ctypes.POINTER(_Job), i32, i32, vp, vp]),
        ("glm53_decode_linear", i32, [vp, i32, i32, i32, i32, f32p]),
    ))
    if missing:
        return None, f"{path} lacks {missing}: a build of other sources; rebuild it with {REBUILD}"
    declare(lib, (("glm53_pool_profile", i32, [vp, ctypes.POINTER(ctypes.c_int64), i32]),))  # older builds lack it
    if lib.glm53_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI {lib.glm53_abi_version()}, this code wants {ABI_VERSION}; rebuild with {REBUILD}"
    return lib, None


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    found = [HERE / f"_expert_kernel{sfx}" for sfx in importlib.machinery.EXTENSION_SUFFIXES]
    found = [p for p in found if p.exists()]
    if not found:
        return None, f"not built (no {HERE.name}/_expert_kernel*.so for this Python); build it with {REBUILD}"
    lib, why = _bind(found[0])
    if lib is None:
        return None, why
    if all((HERE / n).exists() for n in buildinfo.SOURCES + buildinfo.HEADERS):  # a checkout, not a bare wheel
        built, now = lib.glm53_source_hash().decode(), buildinfo.source_hash()
        if built != now:
            return None, f"stale build: {found[0].name} was built from other sources ({built}, now {now}); " \
                         f"rebuild with {REBUILD}"
    return lib, None


def load_library(path: str | Path) -> ctypes.CDLL:
    """Another build of the kernel library, for CpuKernel(lib=...): e.g. an older commit's, that `glm53 bench
    cpu-lane --baseline-lib` times against this one. Its ABI must match; its sources are not checked."""
    lib, why = _bind(Path(path))
    if lib is None:
        raise KernelUnavailable(why)
    return lib


_LIB, _WHY = _load()


def available() -> bool:
    return _LIB is not None


def unavailable_reason() -> str | None:
    return _WHY


def _lib() -> ctypes.CDLL:
    if _LIB is None:
        raise KernelUnavailable(f"the CPU expert kernel is unavailable: {_WHY}")
    return _LIB


def _last_error() -> str:
    return _lib().glm53_last_error().decode(errors="replace")


def supported_isas() -> list[str]:
    """ISAs this CPU (and its OS) can run, slowest first. Empty when the library is not loaded."""
    if _LIB is None:
        return []
    return [name for name in ISAS if _LIB.glm53_isa_supported(ISA_CODES[name])]


def best_isa() -> str:
    """The widest supported ISA. calibrate.calibrate_cpu measures whether it is also the fastest here."""
    isas = supported_isas()
    if not isas:
        _lib()
    return isas[-1]


def kernel_supported(isa: str, kernel: str, lib: ctypes.CDLL | None = None) -> bool:
    """Whether `lib` (default this package's) runs `kernel` ("exact" or "int") on `isa` on this CPU. An older
    build has no integer kernel and says no."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r} (known: {', '.join(KERNELS)})")
    lib = lib or _LIB
    if lib is None or isa not in ISA_CODES:
        return False
    return bool(lib.glm53_isa_supported(ISA_CODES[isa] | (KERNEL_INT if kernel == "int" else 0)))


def served_kernel(isa: str | None = None, lib: ctypes.CDLL | None = None) -> str:
    """The kernel the lane serves with on `isa` (default the widest): "int" where the build has an integer kernel
    for it (every ISA path), else "exact"."""
    isa = best_isa() if isa is None else isa
    return "int" if kernel_supported(isa, "int", lib) else "exact"


def _isa_code(isa: str | None) -> int:
    isa = best_isa() if isa is None else isa
    if isa not in ISAS:
        raise ValueError(f"unknown ISA {isa!r} (known: {', '.join(ISAS)})")
    if isa not in supported_isas():
        raise KernelError(f"this CPU cannot run the {isa} path (it can: {', '.join(supported_isas())})")
    return ISA_CODES[isa]


# --------------------------------------------------------------------------------------------------------------
# Expert geometry from a slot layout


@dataclass(frozen=True)
class ExpertGeometry:
    """Where the nine tensors of one expert sit in its slot image, and the shapes the kernel needs."""

    hidden: int
    intermediate: int
    nbytes: int                       # bytes of the image a buffer must hold
    offsets: tuple[tuple[str, int], ...]
    k_bits: tuple[int, int, int]      # gate, up, down

    @classmethod
    def from_layout(cls, layout: Any) -> ExpertGeometry:
        """From a glm53.tiers SlotLayout (`fields`) or a store.format Layout (`segments`): same names, same order."""
        if isinstance(layout, ExpertGeometry):
            return layout
        items = getattr(layout, "fields", None) or getattr(layout, "segments", None)
        if not items:
            raise TypeError(f"expected a SlotLayout or a store Layout, got {type(layout).__name__}")
        by_name = {f.name: f for f in items}
        want = [f"{p}.{part}" for p in PROJECTIONS for part in ("trellis", "suh", "svh")]
        missing = [n for n in want if n not in by_name]
        if missing:
            raise ValueError(f"layout lacks {', '.join(missing)}: not an EXL3 expert slot")
        for n in want:
            kind = "int16" if n.endswith("trellis") else "float16"
            if not str(by_name[n].dtype).endswith(kind):
                raise ValueError(f"layout field {n} is {by_name[n].dtype}, expected {kind}")
        shapes = {n: tuple(int(d) for d in by_name[n].shape) for n in want}
        k = []
        for p in PROJECTIONS:
            tk, tn, words = shapes[f"{p}.trellis"]
            if words % 16 or not 1 <= words // 16 <= 8:
                raise ValueError(f"{p}.trellis tiles of {words} words: the kernel handles integer K = 1..8")
            k.append(words // 16)
            if shapes[f"{p}.suh"] != (16 * tk,) or shapes[f"{p}.svh"] != (16 * tn,):
                raise ValueError(f"{p}: suh/svh shapes {shapes[f'{p}.suh']}/{shapes[f'{p}.svh']} do not match the trellis")
        hidden, inter = 16 * shapes["gate.trellis"][0], 16 * shapes["gate.trellis"][1]
        if shapes["up.trellis"][:2] != shapes["gate.trellis"][:2] or shapes["down.trellis"][:2] != (inter // 16, hidden // 16):
            raise ValueError("gate/up/down trellis shapes do not chain (hidden -> intermediate -> hidden)")
        if hidden % 128 or inter % 128:
            raise ValueError(f"hidden {hidden} and intermediate {inter} must be multiples of 128 (the Hadamard block)")
        end = max(by_name[n].offset + int(np.prod(shapes[n])) * 2 for n in want)
        return cls(hidden, inter, end, tuple((n, int(by_name[n].offset)) for n in want), tuple(k))

    def offset(self, name: str) -> int:
        return dict(self.offsets)[name]


def _address(buf: Any, nbytes: int, what: str) -> int:
    """Host address of a contiguous buffer (numpy array or CPU torch tensor) of at least nbytes."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{what} must be contiguous")
        size, addr = buf.nbytes, buf.ctypes.data
    elif hasattr(buf, "data_ptr"):  # torch.Tensor, without importing torch here
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(f"{what} must be a contiguous host tensor (got {buf.device.type})")
        size, addr = buf.numel() * buf.element_size(), buf.data_ptr()
    else:
        raise TypeError(f"{what}: expected a numpy array or a torch tensor, got {type(buf).__name__}")
    if size < nbytes:
        raise ValueError(f"{what} holds {size} bytes, the expert needs {nbytes}")
    return addr


@dataclass
class ExpertCall:
    """One expert over some rows: its slot image where it lies, the rows (float32), and where the result goes."""

    slot: Any             # np.ndarray / torch.Tensor: the slot image (uint8), read in place
    x: np.ndarray         # (rows, hidden) float32, C-contiguous
    out: np.ndarray       # (rows, hidden) float32, C-contiguous


def _as_rows(x: Any, hidden: int) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if x.ndim != 2 or x.shape[1] != hidden or x.shape[0] < 1:
        raise ValueError(f"x must be (rows >= 1, {hidden}), got {x.shape}")
    return x


# --------------------------------------------------------------------------------------------------------------
# The pool


PHASES = ("wake", "prep", "wait1", "gate_up", "wait2", "down")


@dataclass(frozen=True)
class CallProfile:
    """One kernel call's time in seconds: the wall time from the caller's start to its return, the caller's own
    wake-up after the call's last output was written, and per worker (rows) the seconds of each phase in PHASES, summed over
    the call's experts: wake (the call's start to the worker's), each phase's work (prep: input transforms;
    gate_up: the gate and up GEMVs with the mid steps; down: the down GEMV with the output transforms) and the
    waits between them (wait1: for the input transforms and the previous expert's outputs; wait2: for the gate/up
    units)."""
    wall: float
    caller_wake: float
    per_thread: np.ndarray

    def mean(self) -> dict[str, float]:
        return dict(zip(PHASES, self.per_thread.mean(axis=0).tolist(), strict=True))


class CpuKernel:
    """The kernel on a pool of `threads` worker threads, pinned one per CPU in `cpus` when given.

    Calls are serialised (one expert list at a time); run them from one thread, e.g. the CPU lane's worker.
    spin_us: how long idle workers spin for the next call before sleeping (a layer step's call follows the
    previous one within tens of microseconds; longer gaps sleep, so an idle lane costs no CPU). lib: another build
    of the library (load_library), for benchmarks; default this package's. kernel: "exact" or "int"; default the
    one served on that ISA (served_kernel)."""

    def __init__(self, threads: int, cpus: Sequence[int] | None = None, isa: str | None = None, spin_us: int = 50,
                 lib: ctypes.CDLL | None = None, kernel: str | None = None):
        if threads < 1:
            raise ValueError("threads must be >= 1")
        self.isa = isa or best_isa()
        self._isa = _isa_code(self.isa)
        if lib is not None and not lib.glm53_isa_supported(self._isa):
            raise KernelError(f"that build of the kernel cannot run the {self.isa} path here")
        self.kernel = kernel or served_kernel(self.isa, lib)
        if not kernel_supported(self.isa, self.kernel, lib or _lib()):
            raise KernelError(f"{'that' if lib is not None else 'this'} build has no {self.kernel} kernel for "
                              f"the {self.isa} path")
        if self.kernel == "int":
            self._isa |= KERNEL_INT
        self._lib = lib = lib or _lib()
        cpu_arr = (ctypes.c_int32 * len(cpus))(*cpus) if cpus else None
        self._pool = lib.glm53_pool_new(int(threads), cpu_arr, len(cpus or ()), int(spin_us))
        if not self._pool:
            raise KernelError(lib.glm53_last_error().decode(errors="replace"))
        self.threads = lib.glm53_pool_threads(self._pool)
        self.pinned = lib.glm53_pool_pinned(self._pool)
        self.cpus = list(cpus or ())
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self._pool:
                self._lib.glm53_pool_free(self._pool)
                self._pool = None

    def __enter__(self) -> CpuKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass

    def run(self, calls: Sequence[ExpertCall], layout: Any, *, swiglu_limit: float = SWIGLU_LIMIT,
            cancel: np.ndarray | None = None, done: np.ndarray | None = None) -> bool:
        """Compute every call into its `out`, in order. cancel: an int32 array whose element 0 going non-zero
        stops the call at the next work unit (from another thread); done: int32 array, done[j] = 1 once call j's
        output is complete. Returns False if cancelled. The GIL is released while the kernel runs."""
        geo = ExpertGeometry.from_layout(layout)
        jobs = (_Job * len(calls))()
        for j, c in enumerate(calls):
            base = _address(c.slot, geo.nbytes, f"call {j}: slot")
            x = _as_rows(c.x, geo.hidden)
            if x is not c.x:
                raise ValueError(f"call {j}: x must already be a C-contiguous float32 (rows, hidden) array")
            if not (isinstance(c.out, np.ndarray) and c.out.dtype == np.float32 and c.out.flags.c_contiguous
                    and c.out.shape == x.shape):
                raise ValueError(f"call {j}: out must be a C-contiguous float32 array of shape {x.shape}")
            job = jobs[j]
            for p, (fin, fout), k in zip(PROJECTIONS, ((geo.hidden, geo.intermediate),) * 2 +
                                         ((geo.intermediate, geo.hidden),), geo.k_bits, strict=True):
                lin = getattr(job, p)
                lin.trellis = base + geo.offset(f"{p}.trellis")
                lin.suh = base + geo.offset(f"{p}.suh")
                lin.svh = base + geo.offset(f"{p}.svh")
                lin.in_features, lin.out_features, lin.k_bits = fin, fout, k
            job.x, job.out, job.rows = x.ctypes.data, c.out.ctypes.data, x.shape[0]
            job.swiglu_limit = float(swiglu_limit)
        for arr, name, n in ((cancel, "cancel", 1), (done, "done", len(calls))):
            if arr is not None and (arr.dtype != np.int32 or arr.size < n or not arr.flags.c_contiguous):
                raise ValueError(f"{name} must be a contiguous int32 array of at least {n} elements")
        with self._lock:
            if not self._pool:
                raise KernelError("the kernel's pool is closed")
            rc = self._lib.glm53_run(self._pool, jobs, len(calls), self._isa,
                                     None if cancel is None else cancel.ctypes.data,
                                     None if done is None else done.ctypes.data)
        if rc < 0:
            raise KernelError(self._lib.glm53_last_error().decode(errors="replace"))
        return rc == 0

    def profile(self) -> CallProfile | None:
        """Where the last call's time went (CallProfile); None from a build without the profile."""
        fn = getattr(self._lib, "glm53_pool_profile", None)
        with self._lock:
            if fn is None or not self._pool:
                return None
            need = fn(self._pool, None, 0)
            buf = (ctypes.c_int64 * need)()
            fn(self._pool, buf, need)
        raw = np.frombuffer(buf, dtype=np.int64)
        secs = raw.astype(np.float64) * 1e-9
        return CallProfile(wall=float(secs[0]), caller_wake=float(secs[1]),
                           per_thread=secs[3:].reshape(-1, int(raw[2])))

    def forward(self, slot: Any, layout: Any, x: Any, *, swiglu_limit: float = SWIGLU_LIMIT) -> np.ndarray:
        """One expert: x (rows, hidden) or (hidden,) -> the same shape, float32."""
        geo = ExpertGeometry.from_layout(layout)
        x = np.asarray(x, dtype=np.float32)
        rows = _as_rows(x.reshape(1, -1) if x.ndim == 1 else x, geo.hidden)
        out = np.empty_like(rows)
        self.run([ExpertCall(slot, rows, out)], geo, swiglu_limit=swiglu_limit)
        return out.reshape(x.shape)


_SHARED: dict[tuple[int, str], CpuKernel] = {}
_SHARED_LOCK = threading.Lock()


def expert_forward(slot_bytes: Any, layout: Any, x: Any, threads: int = 1, isa: str | None = None,
                   swiglu_limit: float = SWIGLU_LIMIT, kernel: str | None = None) -> np.ndarray:
    """One expert's MLP on x (rows, hidden) float32 from its EXL3 slot image; a shared unpinned pool per
    (threads, isa, kernel), the kernel by default the one served on that ISA. For tests and tools; the CPU lane
    owns a pinned CpuKernel."""
    isa = isa or best_isa()
    key = (int(threads), isa, kernel or served_kernel(isa))
    with _SHARED_LOCK:
        kern = _SHARED.get(key)
        if kern is None:
            kern = _SHARED[key] = CpuKernel(key[0], isa=key[1], kernel=key[2])
    return kern.forward(slot_bytes, layout, x, swiglu_limit=swiglu_limit)


def decode_linear(trellis: np.ndarray, isa: str | None = None) -> np.ndarray:
    """The inner weight W^ (in, out) of one trellis (in/16, out/16, 16K) as float32 (exact fp16 values), decoded
    by the given ISA's tile decoder. For tests: it must equal exl3ref.decode_trellis bit for bit."""
    t = np.ascontiguousarray(trellis, dtype=np.int16)
    if t.ndim != 3 or t.shape[2] % 16:
        raise ValueError(f"trellis must be (in/16, out/16, 16K), got {t.shape}")
    w = np.empty((16 * t.shape[0], 16 * t.shape[1]), np.float32)
    rc = _lib().glm53_decode_linear(t.ctypes.data, w.shape[0], w.shape[1], t.shape[2] // 16, _isa_code(isa),
                                    w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    if rc < 0:
        raise KernelError(_last_error())
    return w


# --------------------------------------------------------------------------------------------------------------
# Which CPUs to pin to


def physical_cores(sys_root: str | Path = "/sys/devices/system/cpu", allowed: set[int] | None = None) -> list[int]:
    """One logical CPU (the lowest-numbered) per physical core among `allowed` (default: this process's affinity
    mask, which a container's cpuset restricts), in core order. Empty if the topology is unreadable (then the pool
    runs unpinned)."""
    if allowed is None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores: dict[tuple[str, str], int] = {}
    for cpu in sorted(allowed):
        topo = Path(sys_root) / f"cpu{cpu}" / "topology"
        try:
            key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            return []
        cores.setdefault(key, cpu)
    return sorted(cores.values())


def host_cpus(lane_cpus: Sequence[int], sys_root: str | Path = "/sys/devices/system/cpu",
              allowed: set[int] | None = None) -> list[int]:
    """The CPUs a pinned lane leaves to the rest of the process (the thread feeding the GPU, torch's CPU pool, the
    event loop): every allowed CPU on a physical core no lane worker runs on; if the lane holds every core, the
    allowed CPUs it does not name (SMT siblings); empty when it names them all."""
    if allowed is None:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    lane = set(lane_cpus)

    def core(cpu: int) -> tuple[str, str] | None:
        topo = Path(sys_root) / f"cpu{cpu}" / "topology"
        try:
            return (topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()
        except OSError:
            return None

    busy = {core(c) for c in lane}
    free = [c for c in sorted(allowed) if c not in lane and core(c) not in busy]
    return free or sorted(set(allowed) - lane)


def _cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def performance_cpus(devices_root: str | Path = "/sys/devices") -> set[int] | None:
    """On a hybrid Intel CPU, the logical CPUs of its performance cores (the kernel lists them in cpu_core/cpus;
    the efficiency cores, in cpu_atom, usually carry the highest numbers). None on other CPUs."""
    try:
        return _cpu_list((Path(devices_root) / "cpu_core" / "cpus").read_text())
    except (OSError, ValueError):
        return None


def pick_cpus(threads: int, sys_root: str | Path = "/sys/devices/system/cpu",
              allowed: set[int] | None = None, perf: set[int] | None = None) -> list[int] | None:
    """CPUs for a pool of `threads`: distinct physical cores, the highest-numbered ones, so that CPU 0 (interrupts,
    the server's event loop, the thread feeding the GPU) stays free; on a hybrid CPU, performance cores first
    (pass perf=set() to treat every core alike; default: performance_cpus()). None when there are fewer
    physical cores than threads or no topology: pinning two workers to one core would only make them take turns."""
    cores = physical_cores(sys_root, allowed)
    if len(cores) < threads or threads < 1:
        return None
    perf = performance_cpus() if perf is None else perf
    fast = [c for c in cores if perf and c in perf]
    slow = [c for c in cores if not (perf and c in perf)]
    if len(fast) >= threads:
        return fast[-threads:]
    return sorted(fast + slow[len(slow) - (threads - len(fast)):])
