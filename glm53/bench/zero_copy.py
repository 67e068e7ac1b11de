"""`glm53 bench zero-copy`: is a miss cheaper read in place from pinned RAM by exllamav3's decode kernel, or copied
to VRAM first? One full-width MoE layer at bsz 1, three ways (issue 39; docs/decode-step-design.md):

  (i)   stock: every expert in VRAM, `BC_BlockSparseMLP.run_bszN` as exllamav3's forward calls it;
  (ii)  zero-copy: k of the step's picks re-pointed to pinned host copies of their bytes (the kernel's per-expert
        pointer tables, MultiLinear.ptrs_{trellis,suh,svh}, rewritten in place), the kernel reading them over PCIe;
  (iii) copy, then compute: those k experts copied H2D into a VRAM slot (one copy per expert, the tiers' slot
        image), the tables pointing at that slot, then the same kernel on one stream.

Per k (1, 2, 4, 8 by default): device ms per layer call (CUDA events over `--reps` calls, the median of
`--trials`), the ms over stock, the GB/s that extra time carried, the copy alone, and whether the layer's output is
bit-identical to (i). The host copies live in the RAM tier's kind of memory (ordinary pages registered with
cudaHostRegister, glm53.tiers.ram.pinned_empty). The zero-copy runs come last, after the copy runs are printed: if
the device cannot read mapped host memory the process dies there with the other figures already out.

GPU only: without torch with CUDA or exllamav3 1.6.5 it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glm53.exl3.handoff import mapped_host

PROJECTIONS = ("gate", "up", "down")
PARTS = ("trellis", "suh", "svh")
DEFAULT_KS = "1,2,4,8"
MAX_TOP_K = 8  # GLM-5.3-Flash's (and the fixture's) experts per token
ATTR_UNIFIED_ADDRESSING = 41  # cudaDevAttrUnifiedAddressing
ATTR_HOST_POINTER_FOR_REGISTERED = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
L2_FLUSH_BYTES = 256 << 20
# The consumer-box emulation paces copies with a spinning kernel on the copy stream (glm53.bench.emulate.LinkPacer).
# (iv) times stock's layer beside such a spin, each 2 ms (several layer calls): whether it holds the expert kernel
# back, which would put the emulated copies that ought to overlap compute (write-backs, prestage) in series with it.
SPIN_MS = 2.0
SPIN_DELAYS = 1.05  # stock beside the spin over stock alone, above which the spin is said to delay the kernel


def register_bench(bench_sub: Any) -> None:
    p = bench_sub.add_parser("zero-copy", help="one MoE layer at bsz 1: misses read in place from pinned RAM by the "
                                               "kernel vs copied to VRAM first vs all in VRAM (GPU)",
                             description=__doc__.split("\n\n")[0])
    p.add_argument("--model", metavar="DIR", help="existing EXL3 checkpoint (default: write a full-width one with one "
                   "MoE layer)")
    p.add_argument("--work", metavar="DIR", help="where the generated checkpoint goes (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoint under --work and reuse it")
    p.add_argument("--experts", type=int, default=288, help="routed experts of the generated layer (default 288)")
    p.add_argument("--ks", default=DEFAULT_KS, help=f"how many of the step's picks miss VRAM, a list (default "
                   f"{DEFAULT_KS})")
    p.add_argument("--reps", type=int, default=200, help="layer calls per timing (default 200)")
    p.add_argument("--trials", type=int, default=3, help="timings per figure, the median kept (default 3)")
    p.add_argument("--seed", type=int, default=0, help="the picks, weights and input (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.set_defaults(func=cmd_bench_zero_copy)


# ---- pure parts (CPU-tested) ---------------------------------------------------------------------------------


def parse_ks(text: str, top_k: int = MAX_TOP_K) -> list[int]:
    """The --ks list: distinct counts in 1..top_k, in the order given. ValueError says what is wrong."""
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--ks wants a comma-separated list of miss counts like {DEFAULT_KS}, got {text!r}") from None
    if not ks:
        raise ValueError(f"--ks is empty; give miss counts like {DEFAULT_KS}")
    bad = [k for k in ks if not 1 <= k <= top_k]
    if bad:
        raise ValueError(f"--ks {bad}: a step's misses are 1..{top_k} (its top-k picks)")
    if len(set(ks)) != len(ks):
        raise ValueError(f"--ks {ks} repeats a count")
    return ks


@dataclass(frozen=True)
class Timing:
    """One k's device times (ms per layer call) and bit-identity against the stock layer."""

    k: int
    copy_ms: float  # the k H2D copies alone
    memcpy_ms: float  # (iii): the copies, then the kernel on the VRAM copies
    memcpy_same: bool
    zero_copy_ms: float | None = None  # (ii): the kernel reading the k experts from pinned host memory
    zero_copy_same: bool | None = None


def _rate(nbytes: float, ms: float | None) -> float | None:
    """GB/s of nbytes moved in ms (None where the time is not positive: nothing measurable)."""
    return nbytes / (ms * 1e-3) / 1e9 if ms is not None and ms > 0 else None


def summarize(stock_ms: float, timings: Sequence[Timing], expert_bytes: int) -> list[dict]:
    """Per k: the three ways' ms, the ms each adds to stock, the GB/s those extra ms carried (k experts' bytes over
    them), the copy engine's own GB/s, zero-copy over copy-then-compute, and what a copy issued a layer ahead could
    reach (the slower of the copy and the stock kernel: they would overlap)."""
    rows = []
    for t in timings:
        nbytes = t.k * expert_bytes
        zc_extra = None if t.zero_copy_ms is None else t.zero_copy_ms - stock_ms
        mc_extra = t.memcpy_ms - stock_ms
        rows.append({
            "k": t.k, "bytes": nbytes, "stock_ms": stock_ms,
            "zero_copy_ms": t.zero_copy_ms, "zero_copy_extra_ms": zc_extra, "zero_copy_GBps": _rate(nbytes, zc_extra),
            "memcpy_ms": t.memcpy_ms, "memcpy_extra_ms": mc_extra, "memcpy_GBps": _rate(nbytes, mc_extra),
            "copy_ms": t.copy_ms, "copy_GBps": _rate(nbytes, t.copy_ms),
            "zero_copy_over_memcpy": t.zero_copy_ms / t.memcpy_ms if t.zero_copy_ms is not None and t.memcpy_ms > 0
            else None,
            "ahead_bound_ms": max(stock_ms, t.copy_ms),
            "memcpy_same": t.memcpy_same, "zero_copy_same": t.zero_copy_same,
        })
    return rows


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _same(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "NO"


def render(result: dict) -> str:
    """The report: what was measured, one line per k, and the verdict lines the design choice reads."""
    rows = result["rows"]
    head = [f"zero-copy bench: one MoE layer of {result['experts']} experts, top-{result['top_k']}, bsz 1, expert "
            f"image {result['expert_bytes'] / 2**20:.2f} MiB; {result['reps']} calls a timing, median of "
            f"{result['trials']}; {result.get('device', '?')}",
            f"host memory: {result.get('host_memory', '?')}; device alias == host pointer: "
            f"{result.get('alias_is_host_pointer', '?')}; shared expert fused: {result.get('shared_coop', '?')}",
            f"(i) stock, every expert in VRAM: {result['stock_ms']:.4f} ms a layer call"
            f" (repeat bit-identical: {_same(result.get('stock_repeat_same'))})",
            f"one pinned H2D copy of {result['top_k']} experts: {_f(result.get('h2d_GBps'), '.1f')} GB/s",
            "   k | (ii) zero-copy ms  +ms   GB/s  same | (iii) copy+kernel ms  +ms   GB/s  same | copy alone ms  GB/s"
            " | zc/(iii) | ahead bound ms"]
    for r in rows:
        head.append(
            f"{r['k']:>4} | {_f(r['zero_copy_ms'], '17.4f')} {_f(r['zero_copy_extra_ms'], '5.3f')} "
            f"{_f(r['zero_copy_GBps'], '6.1f')} {_same(r['zero_copy_same']):>5} | {r['memcpy_ms']:20.4f} "
            f"{r['memcpy_extra_ms']:5.3f} {_f(r['memcpy_GBps'], '6.1f')} {_same(r['memcpy_same']):>5} | "
            f"{r['copy_ms']:13.4f} {_f(r['copy_GBps'], '5.1f')} | {_f(r['zero_copy_over_memcpy'], '8.3f')} | "
            f"{r['ahead_bound_ms']:.4f}")
    done = [r for r in rows if r["zero_copy_ms"] is not None]
    if done:
        wins = [r["k"] for r in done if r["zero_copy_over_memcpy"] is not None and r["zero_copy_over_memcpy"] < 1]
        head.append(f"zero-copy is faster than copy-then-compute at k = {wins or 'none'} of {[r['k'] for r in done]}")
    beside = result.get("stock_beside_spin_ms")
    if beside is not None:
        ratio = beside / result["stock_ms"]
        head.append(f"(iv) stock beside the emulation's pacing spin on another stream: {beside:.4f} ms a layer call "
                    f"(x stock {ratio:.3f}): the spin {'delays' if ratio > SPIN_DELAYS else 'does not delay'} the "
                    "expert kernel")
    head.append(f"outputs bit-identical to stock in every run: {'yes' if outputs_same(result) else 'NO'}")
    if result.get("note"):
        head.append(result["note"])
    return "\n".join(head)


def outputs_same(result: dict) -> bool:
    """Every timed run's output bit-identical to stock's (a run not made counts as same)."""
    return (result.get("stock_repeat_same") is not False
            and result.get("stock_beside_spin_same") is not False
            and all(r["memcpy_same"] and r["zero_copy_same"] is not False for r in result["rows"]))


def all_identical(result: dict) -> bool:
    return outputs_same(result) and result.get("repoint_effective") is not False


# ---- the command -------------------------------------------------------------------------------------------------


def _refuse(message: str) -> int:
    print(f"glm53: bench zero-copy: {message}", file=sys.stderr)
    return 2


def cmd_bench_zero_copy(args: argparse.Namespace) -> int:
    try:
        ks = parse_ks(args.ks)
    except ValueError as exc:
        return _refuse(str(exc))
    if args.reps < 1 or args.trials < 1:
        return _refuse("--reps and --trials must be at least 1")
    if args.experts < MAX_TOP_K:
        return _refuse(f"--experts must be at least the top-k ({MAX_TOP_K})")
    try:
        import torch
    except ImportError:
        return _refuse("needs torch with CUDA (torch is not installed)")
    if not torch.cuda.is_available():
        return _refuse("needs a CUDA GPU (torch sees none): it times exllamav3's decode kernel on the device")
    from glm53.exl3.contract import Exl3ContractError, check_contract

    try:
        check_contract()
    except Exl3ContractError as exc:
        return _refuse(str(exc))

    work, model_dir = _checkpoint(args)
    try:
        result = run_bench(model_dir, ks, args.reps, args.trials, args.seed,
                           log=lambda m: print(m, file=sys.stderr, flush=True),
                           partial=lambda r: _write(args.json, r))
    finally:
        if work is not None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["date"] = time.strftime("%Y-%m-%d")
    print(render(result), flush=True)
    _write(args.json, result)
    return 0 if all_identical(result) else 1


def _write(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


def _checkpoint(args: argparse.Namespace) -> tuple[Path | None, Path]:
    """(the directory to remove afterwards or None, the checkpoint): --model, or a generated one-MoE-layer
    full-width checkpoint (reused under --work with --keep)."""
    if args.model:
        return None, Path(args.model)
    from glm53.fixture.exl3 import write_exl3_checkpoint

    if args.keep and args.work:
        work = Path(args.work) / f"glm53-zero-copy-{args.experts}e"
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="glm53-zero-copy-", dir=args.work))
    model_dir, marker = work / "ckpt", work / "ckpt.complete"
    if marker.exists():
        print(f"reusing {model_dir}", file=sys.stderr, flush=True)
    else:
        shutil.rmtree(model_dir, ignore_errors=True)
        t0 = time.perf_counter()
        write_exl3_checkpoint(model_dir, shape="glm53", moe_layers=1, mtp_layers=0, shards=2, experts=args.experts,
                              workers=min(16, os.cpu_count() or 1))
        marker.touch()
        print(f"wrote {model_dir} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return work, model_dir


# ---- the measurement (GPU) ---------------------------------------------------------------------------------------


def _linear(m: Any, proj: str, expert: int) -> Any:
    return {"gate": m.gates, "up": m.ups, "down": m.downs}[proj][expert]


def expert_fields(m: Any, expert: int) -> list[tuple[str, Any, tuple[int, ...], Any]]:
    """(field name, dtype, shape, the loaded VRAM tensor) of one expert, in the tiers' slot-image order: the three
    trellises, then each projection's suh and svh (glm53.tiers.layout.exl3_expert_layout)."""
    out = []
    for p in PROJECTIONS:
        t = _linear(m, p, expert).inner.trellis
        out.append((f"{p}.trellis", t.dtype, tuple(t.shape), t))
    for p in PROJECTIONS:
        for s in ("suh", "svh"):
            t = getattr(_linear(m, p, expert).inner, s)
            out.append((f"{p}.{s}", t.dtype, tuple(t.shape), t))
    return out


def pointer_tables(m: Any) -> dict[str, Any]:
    """Field name -> the int64 device table the fused decode kernel reads that field's per-expert address from:
    MultiLinear.ptrs_* of the module's gate/up/down, whose storage BC_BlockSparseMLP bakes into its parameter block
    (exl3_moe_coop_prepare) and reads entry by entry at every launch."""
    multi = {"gate": m.multi_gate, "up": m.multi_up, "down": m.multi_down}
    return {f"{p}.{s}": getattr(multi[p], f"ptrs_{s}") for p in PROJECTIONS for s in PARTS}


def host_rows(torch: Any, ext: Any, shape: tuple[int, int], pinned_empty: Callable[..., Any]) -> tuple[Any, int, str]:
    """(uint8 host rows, their device alias, what memory they are): the RAM tier's kind (ordinary pages registered
    with cudaHostRegister flags 0, mapped wherever the device has unified addressing) where the driver gives those a
    device alias, else pages registered portable and mapped explicitly (what exllamav3's CPU hand-off does)."""
    host = pinned_empty(shape, pin=True)
    try:
        return host, int(ext.cuda_host_get_device_pointer(host.data_ptr())), "the RAM tier's (cudaHostRegister flags 0)"
    except RuntimeError as exc:
        why = str(exc).splitlines()[0]
    del host  # its registration goes with it (pinned_empty's finalizer)
    host, alias = mapped_host(torch, ext, shape)
    return host, alias, f"cudaHostRegister portable|mapped (flags 0: {why})"


class _ZeroCopyLayer:
    """The loaded MoE module with its tables, the step's picks and the copies the variants re-point to."""

    def __init__(self, torch: Any, ext: Any, m: Any, ks: list[int], seed: int):
        from glm53.tiers.layout import SlotLayout
        from glm53.tiers.ram import pinned_empty

        self.torch, self.ext, self.m = torch, ext, m
        if m.bc is None or m.multi_gate is None or m.multi_up is None or m.multi_down is None or not m.gated:
            raise RuntimeError(f"{m.key}: exllamav3 built no fused gated decode path (bc / multi_* missing)")
        self.top_k, self.experts = m.num_experts_per_tok, m.num_experts
        if max(ks) > self.top_k:
            raise RuntimeError(f"--ks {ks}: the layer picks {self.top_k} experts a token")
        self.dev = m.gates[0].inner.trellis.device
        g = torch.Generator().manual_seed(seed)
        self.picks = torch.randperm(self.experts, generator=g)[: self.top_k].tolist()
        w = torch.rand(self.top_k, generator=g) + 0.5
        self.sel = torch.tensor([self.picks], dtype=torch.long, device=self.dev)
        self.rw = (w / w.sum()).half().view(1, -1).to(self.dev)
        self.y = torch.randn((1, m.hidden_size), generator=g).half().to(self.dev)
        fields = expert_fields(m, self.picks[0])
        self.layout = SlotLayout.packed([(name, dt, shape) for name, dt, shape, _ in fields])
        self.offset = {f.name: f.offset for f in self.layout.fields}
        self.expert_bytes = self.layout.nbytes
        self.tables = pointer_tables(m)
        self.orig = {name: t.cpu().clone() for name, t in self.tables.items()}
        for e in self.picks:  # the tables are what the Linear objects say, before anything is rewritten
            for name, dt, shape, t in expert_fields(m, e):
                if (dt, shape) != next((f.dtype, f.shape) for f in self.layout.fields if f.name == name):
                    raise RuntimeError(f"expert {e} {name} is {dt}{list(shape)}: mixed expert shapes")
                if not t.is_contiguous() or int(self.orig[name][e]) != t.data_ptr():
                    raise RuntimeError(f"{m.key} expert {e} {name}: the pointer table does not hold its tensor's "
                                       "address (another exllamav3 layout?)")
        n = len(self.picks)
        # Pinned host copies and VRAM slots, one row an expert.
        self.host, self.host_alias, self.host_memory = host_rows(torch, ext, (n, self.expert_bytes), pinned_empty)
        self.alias_is_host_pointer = self.host_alias == self.host.data_ptr()
        self.stage = torch.zeros((n, self.expert_bytes), dtype=torch.uint8, device=self.dev)
        self.l2 = torch.ones(L2_FLUSH_BYTES, dtype=torch.uint8, device=self.dev)
        for j, e in enumerate(self.picks):
            views = self.layout.views(self.host[j])
            for name, _, _, t in expert_fields(m, e):
                views[name].copy_(t)
        torch.cuda.synchronize()

    def host_row(self, j: int) -> int:
        return self.host_alias + j * self.expert_bytes

    def stage_row(self, j: int) -> int:
        return self.stage[j].data_ptr()

    def repoint(self, rows: dict[int, int]) -> None:
        """Table entries of picks[j] -> the slot image at address rows[j]; every other entry as loaded."""
        for name, t in self.tables.items():
            new = self.orig[name].clone()
            for j, base in rows.items():
                new[self.picks[j]] = base + self.offset[name]
            t.copy_(new)
        self.torch.cuda.synchronize()

    def restore(self) -> None:
        for name, t in self.tables.items():
            t.copy_(self.orig[name])
        self.torch.cuda.synchronize()

    def call(self) -> None:
        self.m.bc.run_bszN(self.y, self.sel, self.rw)

    def flush(self) -> None:
        """Read a buffer several times the L2 (H200: 60 MiB), so the next call finds none of its bytes there."""
        self._flushed = self.l2.view(self.torch.int32).amax()

    def out(self) -> Any:
        return self.m.experts_cfg.out_bszn[:1].clone()

    def copies(self, k: int) -> None:
        for j in range(k):
            self.stage[j].copy_(self.host[j], non_blocking=True)


def bit_equal(torch: Any, a: Any, b: Any) -> bool:
    """Bitwise identity of two fp32 tensors (NaN-safe, unlike torch.equal)."""
    return a.shape == b.shape and bool(torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)))


def device_ms(torch: Any, fn: Callable[[], None], reps: int, trials: int, before: Callable[[], None] | None = None,
              warmup: int = 5) -> float:
    """Device ms per fn() call, the median of `trials`. Each trial times `reps` calls, each between its own pair of
    CUDA events on the current stream, with before() (the L2 flush) queued ahead of each call outside its events:
    a layer's weights are not in L2 when decode reaches it (42 layers of experts pass through between its calls),
    and a loop over one layer would otherwise serve repeats of its bytes, host-resident ones too, from L2."""
    got = []
    for _ in range(trials):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        pairs = []
        for _ in range(reps):
            if before is not None:
                before()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            pairs.append((a, b))
        pairs[-1][1].synchronize()
        got.append(sum(a.elapsed_time(b) for a, b in pairs) / reps)
    return statistics.median(got)


def run_bench(model_dir: Path, ks: list[int], reps: int, trials: int, seed: int, *,
              log: Callable[[str], None] = print, partial: Callable[[dict], None] = lambda r: None) -> dict:
    import torch

    from glm53.exl3 import stock

    ext = stock.ext()
    from glm53.exl3.placement import moe_modules

    t0 = time.perf_counter()
    _, gen = stock.load(model_dir, 4096)  # the cache size the GPU fixture tests load this shape with; no attention runs
    torch.cuda.synchronize()
    mods = moe_modules(gen.model)
    if not mods:
        raise RuntimeError(f"{model_dir}: no BlockSparseMLP layer")
    log(f"loaded {model_dir} in {time.perf_counter() - t0:.1f} s; timing {mods[0].key}")
    with torch.inference_mode():  # exllamav3 loads under it: its tables are inference tensors, written only inside
        return _measure(torch, ext, mods[0], ks, reps, trials, seed, log, partial, spin=pacer_spin(torch))


def pacer_spin(torch: Any) -> Callable[[], None]:
    """One LinkPacer-style spin (`torch.cuda._sleep`, SPIN_MS long) queued on a side stream of its own."""
    from glm53.bench.emulate import sleep_cycles_per_s

    cycles = max(1, int(SPIN_MS / 1e3 * sleep_cycles_per_s()))
    side = torch.cuda.Stream()

    def spin() -> None:
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)

    return spin


def _measure(torch: Any, ext: Any, m: Any, ks: list[int], reps: int, trials: int, seed: int,
             log: Callable[[str], None], partial: Callable[[dict], None],
             spin: Callable[[], None] | None = None) -> dict:
    L = _ZeroCopyLayer(torch, ext, m, ks, seed)
    dev = L.dev.index or 0
    result: dict = {
        "device": torch.cuda.get_device_name(dev), "experts": L.experts, "top_k": L.top_k, "picks": L.picks,
        "expert_bytes": L.expert_bytes, "reps": reps, "trials": trials, "shared_coop": bool(L.m.bc.sh_coop),
        "host_memory": L.host_memory,
        "alias_is_host_pointer": L.alias_is_host_pointer,
        "unified_addressing": int(ext.cuda_device_get_attribute(ATTR_UNIFIED_ADDRESSING, dev)),
        "host_pointer_for_registered": int(ext.cuda_device_get_attribute(ATTR_HOST_POINTER_FOR_REGISTERED, dev)),
        "rows": [],
    }
    try:
        L.restore()
        L.call()
        ref = L.out()
        result["stock_finite"] = bool(torch.isfinite(ref).all())
        result["stock_ms"] = device_ms(torch, L.call, reps, trials, L.flush)
        result["stock_repeat_same"] = bit_equal(torch, L.out(), ref)
        log(f"(i) stock: {result['stock_ms']:.4f} ms a layer call")
        if spin is not None:  # (iv): a spin queued beside every call, so its side stream runs through them all
            def flush_and_spin() -> None:
                L.flush()
                spin()

            result["stock_beside_spin_ms"] = device_ms(torch, L.call, reps, trials, flush_and_spin)
            result["stock_beside_spin_same"] = bit_equal(torch, L.out(), ref)
            log(f"(iv) stock beside the pacing spin: {result['stock_beside_spin_ms']:.4f} ms a layer call")

        # The tables are what the kernel reads: pointing every pick at the zeroed VRAM slots changes the output.
        L.repoint({j: L.stage_row(j) for j in range(L.top_k)})
        L.call()
        result["repoint_effective"] = not bit_equal(torch, L.out(), ref)
        L.restore()
        if not result["repoint_effective"]:
            result["note"] = ("re-pointing the tables did not change the output: the kernel does not read them; "
                              "nothing below measures what it claims")
            log(result["note"])

        big = torch.empty((L.top_k, L.expert_bytes), dtype=torch.uint8, device=L.dev)
        result["h2d_GBps"] = _rate(L.top_k * L.expert_bytes,
                                   device_ms(torch, lambda: big.copy_(L.host, non_blocking=True), reps, trials, L.flush))

        timings: dict[int, dict] = {}
        for k in ks:  # (iii) and the copies alone, every k before any zero-copy run
            L.stage.zero_()
            L.repoint({j: L.stage_row(j) for j in range(k)})
            copy_ms = device_ms(torch, lambda k=k: L.copies(k), reps, trials, L.flush)
            L.stage.zero_()

            def copy_then_compute(k: int = k) -> None:
                L.copies(k)
                L.call()

            memcpy_ms = device_ms(torch, copy_then_compute, reps, trials, L.flush)
            same = bit_equal(torch, L.out(), ref)
            L.restore()
            timings[k] = {"k": k, "copy_ms": copy_ms, "memcpy_ms": memcpy_ms, "memcpy_same": same}
            log(f"(iii) k={k}: copies {copy_ms:.4f} ms, copies + kernel {memcpy_ms:.4f} ms, bit-identical {same}")
        result["rows"] = summarize(result["stock_ms"], [Timing(**t) for t in timings.values()], L.expert_bytes)
        partial(result)

        for k in ks:  # (ii): the kernel reads the k experts from pinned host memory
            L.repoint({j: L.host_row(j) for j in range(k)})
            zc = device_ms(torch, L.call, reps, trials, L.flush)
            same = bit_equal(torch, L.out(), ref)
            L.restore()
            timings[k].update(zero_copy_ms=zc, zero_copy_same=same)
            log(f"(ii) k={k}: zero-copy {zc:.4f} ms, bit-identical {same}")
        result["rows"] = summarize(result["stock_ms"], [Timing(**t) for t in timings.values()], L.expert_bytes)
    finally:
        L.restore()
    return result

