"""GPU-session diagnostic: tests/gpu/session.sh puts this directory on PYTHONPATH for a served process when
DIAGNOSE is set, with GLM53_DIAG=<path prefix>. It writes, to set against a slow request's time:
  <prefix>-compiles.log  one line per Triton compile: "<epoch end> <seconds> <kernel>" (disk-cache hits too)
  <prefix>-gc.log        each garbage collection over 20 ms: "<epoch end> <seconds> gen <n>"
  <prefix>-stacks.log    every 20 ms, each busy thread's innermost frames: "<epoch> <thread> <frame;frame;...>"
Nothing here changes what the process computes; any failure to install leaves a '#' line and goes on."""
import os
import sys
import threading
import time

_prefix = os.environ.get("GLM53_DIAG")


def _note(kind: str, line: str) -> None:
    with open(f"{_prefix}-{kind}.log", "a") as f:
        f.write(line + "\n")


def _hook_compiles() -> None:
    import triton
    import triton.compiler as tc
    import triton.compiler.compiler as tcc

    inner = tcc.compile

    def timed(src, *args, **kwargs):
        t0 = time.time()
        try:
            return inner(src, *args, **kwargs)
        finally:
            name = getattr(getattr(src, "fn", None), "__name__", None) or type(src).__name__
            _note("compiles", f"{time.time():.3f} {time.time() - t0:.3f} {name}")

    tcc.compile = timed
    tc.compile = timed  # JITFunction binds `from ..compiler import compile` at its first launch
    triton.compile = timed  # exllamav3's captured kernels call triton.compile


def _hook_gc() -> None:
    import gc

    started = {}

    def cb(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            d = time.perf_counter() - started.pop("t")
            if d > 0.02:
                _note("gc", f"{time.time():.3f} {d:.3f} gen {info.get('generation')}")

    gc.callbacks.append(cb)


def _sample_stacks(period: float = 0.02, depth: int = 14) -> None:
    me = threading.get_ident()
    with open(f"{_prefix}-stacks.log", "a") as f:
        while True:
            time.sleep(period)
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.time()
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                frames = []
                while frame is not None and len(frames) < depth:
                    code = frame.f_code
                    frames.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
                    frame = frame.f_back
                idle = ("threading.py:wait", "threading.py:_wait_for_tstate_lock", "selectors.py", "queue.py:get",
                        "thread.py:_worker")
                if frames and not frames[0].startswith(idle):
                    f.write(f"{now:.3f} {names.get(ident, ident)} {';'.join(frames)}\n")
            f.flush()


if _prefix:
    for hook in (_hook_compiles, _hook_gc):
        try:
            hook()
        except Exception as exc:
            _note("compiles", f"# {hook.__name__} not installed: {exc!r}")
    threading.Thread(target=_sample_stacks, name="glm53-diag-sampler", daemon=True).start()
