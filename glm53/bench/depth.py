"""`glm53 bench depth`: issue 25's proof run. One full-depth checkpoint, the plan for a 24 GB budget at 131,072
tokens of context, and per mode (each in its own process, so its memory figures are its own):

- the plan's sizes (VRAM slots, staging, RAM rows, KV tokens, sequences, prefill chunk, recurrent checkpoint
  bytes) next to what the engine really loaded, counted from the engine after load;
- time to first token for each prompt (deterministic pseudo-text ids: the checkpoint's tokenizer is irrelevant),
  and greedy decode tok/s at 0 history and after each prompt, counted from the generator's own results;
- peak device memory as the CUDA driver sees it (mem_get_info sampled every 20 ms on a thread, minus the device's
  use before this process touched it, measured by nvidia-smi) and torch's max_memory_allocated, through the longest
  prompt plus 512 decoded tokens; peak anonymous RSS and the tiers' pinned bytes;
- the greedy ids after the longest prompt, compared token for token with stock's by the parent process;
- where a decode step's time goes, per layer type, at 0 and at the longest history (LayerTimer below);
- with --checks, the engine's answers to a prompt longer than the context and to a request running into it.

Stock is plain exllamav3 with every routed expert in VRAM (the H200 holds them) on the exact plan's KV, context,
sequences and prefill chunk: the reference for tokens and for the ratios. A call measures any subset of modes and
writes its JSON as each mode finishes; --reference merges an earlier call's stock so a later call still prints
ratios (marked as from another call). The checkpoint (generated with `glm53 fixture --kind exl3 FIXTURE-ARGS`) and
the nvme modes' store stay under --work with --keep and are reused by the next call with the same arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from glm53.bench.decode import _made_once, _Releases

MODES = ("stock", "exact", "fast", "nvme-exact", "nvme")
EXACT_LIKE = ("exact", "nvme-exact")
# 48 routed experts per layer: with 32 every expert fits a 24 GB budget beside the always-used weights (nothing is
# tiered, and 42 x 32 = 1,344 slots cannot show the 1,376 the issue asks); with 64 the checkpoint and its store
# (~32 + ~25 GB) outgrow the GPU machine's 64 GB disk.
DEFAULT_FIXTURE = "--shape glm53 --dense-layers 3 --moe-layers 42 --experts 48"
DEFAULT_PROMPTS = "8192,32768,120000"
SHORT_PROMPT = 16          # the "0 history" decode: a prompt of a few tokens
PEAK_TOKENS = 512          # decoded after the longest prompt while peak memory is watched
REFERENCE_SLOTS = 1376     # the reference appliance's hot experts on a 24 GB card at 131,072 tokens (issue 25)
GREEDY_TOKENS = 256        # greedy ids after the longest prompt compared with stock's
SAMPLE_S = 0.02            # memory sampler period
TYPES = ("kda", "mla", "moe", "shared", "dense", "glue", "head", "embed")
TYPE_NAMES = {"kda": "KDA linear attention", "mla": "MLA + DSA indexer", "moe": "MoE (router + routed experts)",
              "shared": "shared expert", "dense": "dense MLP", "glue": "norms + hyper-connections",
              "head": "head (hc collapse, norm, lm_head)", "embed": "embedding"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.(.*))?$")
_NORM = re.compile(r"(?:^|\.)norm(?:\.|$)")


# ------------------------------------------------------------------------------------------------ pure helpers


def parse_modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"--modes: unknown {unknown or 'none given'}; choose from {', '.join(MODES)}")
    return modes


def parse_prompts(text: str, context: int) -> list[int]:
    try:
        prompts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--prompts wants token counts like {DEFAULT_PROMPTS}, got {text!r}") from None
    if not prompts or prompts[0] <= SHORT_PROMPT:
        raise ValueError(f"--prompts: each prompt must be longer than {SHORT_PROMPT} tokens, got {text!r}")
    if prompts[-1] + PEAK_TOKENS >= context:
        raise ValueError(f"--prompts: the longest prompt {prompts[-1]} plus {PEAK_TOKENS} decoded tokens does not fit "
                         f"the {context}-token context: shorten it or raise --context")
    return prompts


def prompt_ids(n: int, hi: int, seed: int) -> list[int]:
    """n token ids of deterministic pseudo-text in [0, hi): words of 1-3 ids from a 4,096-word lexicon drawn with
    Zipf frequencies, so words and phrases repeat as in text. Prefix-stable: a shorter prompt of the same seed is
    the start of a longer one (distinct seeds share no prefix, so no prompt is served from another's KV pages)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = 4096
    lengths = rng.integers(1, 4, size=words)
    lexicon = rng.integers(0, hi, size=(words, 3))
    p = 1.0 / np.arange(1, words + 1)
    p /= p.sum()
    out: list[int] = []
    while len(out) < n:
        for w in rng.choice(words, size=1024, p=p):
            out.extend(lexicon[w, : lengths[w]].tolist())
    return out[:n]


def layer_kinds(config: dict) -> tuple[list[str], list[str]]:
    """(attention kind per text layer, MLP kind per text layer) from a Glm5Next config.json, as exllamav3 reads it."""
    text = config.get("text_config", config)
    n = int(text["num_hidden_layers"])
    attn = list(text["layer_types"])[:n]
    dense = int(text.get("first_k_dense_replace", 3))
    mlp = list(text.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(n)])[:n]
    return attn, mlp


def classify(key: str, attn: Sequence[str], mlp: Sequence[str]) -> str:
    """The layer type of a module key or tensor name: kda, mla (with its indexer), moe (router and routed experts),
    shared, dense, glue (a block's norms and hyper-connections), block (a whole decoder block), head, embed; mtp
    for layers past the text layers (not run in decode), other for anything else."""
    m = _LAYER.search(key)
    if m:
        i, rest = int(m[1]), m[2] or ""
        if i >= len(attn):
            return "mtp"
        if not rest:
            return "block"
        if rest.startswith("self_attn"):
            return "kda" if attn[i] == "linear_attention" else "mla"
        if rest == "mlp" or rest.startswith("mlp."):
            if mlp[i] == "dense":
                return "dense"
            return "shared" if rest.startswith("mlp.shared_experts") else "moe"
        return "glue"
    if "embed_tokens" in key or key.startswith("hc_expand"):
        return "embed"
    if key.startswith(("lm_head", "hc_head")) or _NORM.search(key):
        return "head"
    return "other"


def weight_bytes_per_token(model_dir: Path) -> dict[str, float]:
    """Checkpoint bytes each layer type reads per decoded token, from the safetensors headers: every weight of the
    always-used layers, top_k / experts of each MoE layer's routed experts (the router whole), one row of the
    embedding table."""
    from store.safetensors_header import read_safetensors_header

    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    attn, mlp = layer_kinds(config)
    top_k, experts = int(text["num_experts_per_tok"]), int(text["n_routed_experts"])
    out = dict.fromkeys(TYPES, 0.0)
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, t in read_safetensors_header(f).tensors.items():
            kind = classify(name, attn, mlp)
            if kind == "embed" and len(t.shape) == 2:
                out["embed"] += t.nbytes / t.shape[0]  # one row per token
            elif kind == "moe" and ".mlp.experts." in name:
                out["moe"] += t.nbytes * top_k / experts
            elif kind in out:
                out[kind] += t.nbytes
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a shorter list differs where it ends); None: identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _runs(res: dict) -> dict[int, dict]:
    return {int(r["prompt_tokens"]): r for r in res.get("runs", [])}


def finish(doc: dict, reference: dict | None = None, reference_path: str | None = None) -> dict:
    """The parent's comparisons on the modes measured so far: each mode's greedy ids against stock's, and its TTFT
    and decode tok/s over stock's at each prompt. Stock from this call, else from `reference` (an earlier call's
    doc), which is then marked as another call's."""
    stock, source = doc["modes"].get("stock"), "this call"
    if stock is not None and not stock.get("runs"):  # stock failed here: nothing to compare with
        stock = None
    if stock is None and reference is not None:
        stock = reference.get("modes", {}).get("stock")
        source = f"another call ({reference_path}, {reference.get('date', '?')})"
        doc["reference"] = {"path": reference_path, "date": reference.get("date"), "stock": stock}
    doc["stock_from"] = source if stock else None
    doc["comparison"], doc["ratios"] = {}, {}
    if not stock:
        return doc
    for mode, res in doc["modes"].items():
        if mode == "stock" or "greedy_ids" not in res:
            continue
        diff = first_difference(res["greedy_ids"], stock.get("greedy_ids", []))
        chunks = (res.get("spec", {}).get("prefill_chunk"), stock.get("spec", {}).get("prefill_chunk"))
        doc["comparison"][mode] = {"bit_identical": diff is None, "first_difference": diff,
                                   "compared": len(res["greedy_ids"]), "must_be_identical": mode in EXACT_LIKE,
                                   "same_prefill_chunk": chunks[0] == chunks[1]}
    s_runs = _runs(stock)
    for mode, res in doc["modes"].items():
        if mode == "stock":
            continue
        ttft, tok = {}, {}
        for p, r in _runs(res).items():
            s = s_runs.get(p)
            if s is None:
                continue
            if r.get("ttft_s") and s.get("ttft_s") and p > SHORT_PROMPT:
                ttft[str(p)] = r["ttft_s"] / s["ttft_s"]
            if r.get("decode_tok_s") and s.get("decode_tok_s"):
                tok[str(p)] = r["decode_tok_s"] / s["decode_tok_s"]
        doc["ratios"][mode] = {"ttft_over_stock": ttft, "decode_over_stock": tok, "stock_from": source}
    return doc


def exit_status(doc: dict) -> int:
    """1 when a mode failed, an exact mode left stock's tokens, or a check failed; else 0."""
    bad = any(r.get("error") for r in doc["modes"].values())
    bad |= any(c["must_be_identical"] and not c["bit_identical"] for c in doc["comparison"].values())
    bad |= any(not c.get("ok") for r in doc["modes"].values() for c in r.get("checks", {}).values())
    return 1 if bad else 0


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def report(doc: dict) -> str:
    s = doc["settings"]
    lines = [f"glm53 bench depth: {doc['checkpoint']['what']}; plan for GLM53_VRAM_BUDGET_GB={s['vram_budget_gb']:g} "
             f"GLM53_CONTEXT={s['context']}" + (f", nvme modes under a {s['memory_gib']:g} GiB cap" if
                                                 s.get("memory_gib") else "")]
    for mode, r in doc["modes"].items():
        if r.get("error"):
            lines.append(f"  {mode}: FAILED: {r['error']}")
        if "loaded" not in r:
            continue
        pl, ld = r["planned"], r["loaded"]
        lines.append(f"  {mode} ({r['engine']}): loaded in {_f(r.get('load_s'))} s; plan / loaded: " + ", ".join(
            f"{k} {pl.get(k, '-')}/{ld.get(k, '-')}" + ("" if r["matches"].get(k, True) else " MISMATCH")
            for k in ld))
        if r["engine"] != "stock":
            lines.append(f"    VRAM expert slots loaded: {ld['vram_slots']} (issue 25 asks >= {REFERENCE_SLOTS} at 131,072 "
                         f"tokens in 24 GB)")
        for p, run in sorted(_runs(r).items()):
            what = "history 0" if p <= SHORT_PROMPT else f"{p:>6}-token prompt: TTFT {_f(run.get('ttft_s'), '.2f')} s,"
            lines.append(f"    {what} decode {_f(run.get('decode_tok_s'))} tok/s over {run.get('decoded', 0)} tokens")
        mem = r.get("memory", {})
        if mem:
            peak = mem.get("peak_long_bytes")
            budget = s["vram_budget_gb"] * 2**30
            verdict = "" if peak is None else (" (within the budget)" if peak <= budget else " OVER THE BUDGET")
            lines.append(f"    device memory (driver): {_gib(mem.get('after_load_bytes'))} after load, peak "
                         f"{_gib(peak)} through the longest prompt + {mem.get('peak_after_tokens')} tokens{verdict}, "
                         f"{_gib(mem.get('peak_bytes'))} over the whole run; torch max allocated "
                         f"{_gib(mem.get('max_allocated_long_bytes'))}; CUDA context {_gib(mem.get('context_bytes'))}")
            host = f"    host: peak anonymous RSS {_gib(mem.get('rss_peak_bytes'))}, pinned {_gib(mem.get('pinned_bytes'))}"
            cap = s.get("memory_gib") if mode.startswith("nvme") else None
            if cap and mem.get("rss_peak_bytes") is not None:
                total = mem["rss_peak_bytes"] + (mem.get("pinned_bytes") or 0)
                host += (f"; RSS + pinned {_gib(total)} against the {cap:g} GiB cap: "
                         + ("within" if total <= cap * 2**30 else "OVER"))
            lines.append(host)
        for hist, prof in (r.get("profile") or {}).items():
            lines.append(f"    decode step at history {hist}: {_f(prof['step_ms'], '.2f')} ms/token profiled "
                         f"({_f(prof['perturbation'], '.3f')} of the unprofiled step's speed), per type host / device "
                         f"ms per token, MB read per token:")
            for t in TYPES:
                x = prof["types"].get(t)
                if x is not None:
                    lines.append(f"      {TYPE_NAMES[t]:<36} {_f(x['host_ms'], '6.3f')} / {_f(x['device_ms'], '6.3f')}"
                                 f"  {_f(x.get('bytes', 0) / 1e6, '8.1f')}" + (f"  ({x['note']})" if x.get("note") else ""))
            lines.append(f"      {'outside the modules (generator, sampling)':<36} {_f(prof['outside_ms'], '6.3f')}")
        for name, c in r.get("checks", {}).items():
            lines.append(f"    check {name}: {'ok' if c['ok'] else 'FAILED'}: {c['got']}")
    for mode, c in doc.get("comparison", {}).items():
        said = "bit-identical" if c["bit_identical"] else f"first differs at token {c['first_difference']}"
        lines.append(f"  {mode} vs stock over {c['compared']} greedy tokens after the longest prompt: {said}"
                     + ("" if c["bit_identical"] or not c["must_be_identical"] else " (MUST be identical)")
                     + ("" if c.get("same_prefill_chunk", True) else " (prefill chunks differ from stock's)"))
    for mode, rt in doc.get("ratios", {}).items():
        lines.append(f"  {mode} / stock (stock from {rt['stock_from']}): TTFT "
                     + ", ".join(f"{p} {v:.3f}" for p, v in rt["ttft_over_stock"].items())
                     + "; decode " + ", ".join(f"{'h0' if int(p) <= SHORT_PROMPT else p} {v:.3f}"
                                               for p, v in rt["decode_over_stock"].items()))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ GPU measurement


def _smi_used(index: int) -> int | None:
    """The device's used bytes by nvidia-smi (None without it): read before this process creates a CUDA context."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                              str(index)], capture_output=True, text=True, timeout=30)
        return int(out.stdout.strip().splitlines()[0]) << 20 if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def _rss_anon() -> int:
    """Resident bytes not backed by files (statm: resident - shared), i.e. what the process itself allocated."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """Device bytes in use as the driver sees them (cuda: total - free of mem_get_info) and anonymous RSS, sampled
    every SAMPLE_S on a thread; peaks over the whole run and since the last mark(). Device figures are over the
    device's use before this process touched it: nvidia-smi's figure read before the CUDA context exists, put in
    mem_get_info's terms by reading both once the context exists (the difference is the context itself)."""

    def __init__(self, device: str):
        self.index = int(device.split(":")[1]) if device.startswith("cuda") else None
        self.baseline = self.context = None
        before = _smi_used(self.index) if self.index is not None else None
        if self.index is not None:
            import torch

            free, total = torch.cuda.mem_get_info(self.index)
            now_smi = _smi_used(self.index)
            self.context = now_smi - before if before is not None and now_smi is not None else None
            self.baseline = (total - free) - (self.context or 0)
        self.peak = self.phase = self.rss_peak = self.rss_phase = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="glm53-depth-sampler", daemon=True)
        self._thread.start()

    def used(self) -> int | None:
        if self.index is None:
            return None
        import torch

        free, total = torch.cuda.mem_get_info(self.index)
        return total - free - self.baseline

    def _loop(self) -> None:
        if self.index is not None:
            import torch

            torch.cuda.set_device(self.index)
        while not self._stop.is_set():
            dev, rss = self.used() or 0, _rss_anon()
            with self._lock:
                self.peak, self.phase = max(self.peak, dev), max(self.phase, dev)
                self.rss_peak, self.rss_phase = max(self.rss_peak, rss), max(self.rss_phase, rss)
            self._stop.wait(SAMPLE_S)

    def mark(self) -> tuple[int | None, int]:
        """(device peak, RSS peak) since the last mark, and a new phase from now."""
        with self._lock:
            out = (self.phase if self.index is not None else None, self.rss_phase)
            self.phase = self.rss_phase = 0
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class _Clock:
    """Stamps on the device's stream (CUDA events: what the GPU reached when the host got there) or, on the CPU,
    perf_counter; elapsed(a, b) in seconds once synchronised."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def elapsed(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class LayerTimer:
    """Where a decode step's time goes, per layer type. exllamav3 1.6.5 runs a model forward as a Python loop over
    its top-level modules (model_ls.forward_ls), each decoder block calling its attention and MLP modules; the CUDA
    graphs of its decode paths are per module (a KDA layer, an MLA block, a dense MLP, the fused MoE kernel with its
    shared expert), never across modules. So each module's forward is wrapped (an instance attribute, removed by
    close()) with a CUDA event before and after on the compute stream and the host's perf_counter around the call:
    the device figure is the stream's span between the events, which includes any time the GPU waited for the host
    inside the module (the tiered MoE's routing sync and planning), the host figure is the call's wall time
    (launches, graph replays, syncs). The wrappers exist only for the profiled steps (measure() installs them when
    a job reaches its profiled tokens), so the timed runs are untouched. Graphs stay on; what this perturbs is a few
    microseconds of host time per module call (two event records and a Python frame), reported as the profiled
    step's speed over the unprofiled one's in the same job. The shared expert runs fused inside the routed kernel at decode (bc_sh_exp), so its
    time is inside MoE's; shared_estimate times the same module alone."""

    def __init__(self, model: Any, attn: Sequence[str], mlp: Sequence[str], clock: _Clock):
        self.clock, self.on, self.calls, self._depth = clock, False, [], 0
        self._wrapped: list[tuple[Any, Any]] = []
        for top in model.modules:
            self._wrap(top, attn, mlp)
            for sub in getattr(top, "modules", ()):  # a block's attention and MLP (not its norms, not the experts)
                if sub.key.endswith((".self_attn", ".mlp")):
                    self._wrap(sub, attn, mlp)
                    for shared in getattr(sub, "modules", ()):
                        if shared.key.endswith(".mlp.shared_experts"):
                            self._wrap(shared, attn, mlp)
        if not any(getattr(m, "key", None) == "lm_head" for m, _ in self._wrapped):
            raise RuntimeError("LayerTimer: no lm_head module found: decode steps cannot be counted")

    def _wrap(self, mod: Any, attn: Sequence[str], mlp: Sequence[str]) -> None:
        if not callable(getattr(mod, "forward", None)):  # a container that is never called
            return
        kind, orig, head = classify(mod.key, attn, mlp), mod.forward, mod.key == "lm_head"

        def forward(*args: Any, **kw: Any) -> Any:
            if not self.on:
                return orig(*args, **kw)
            outer = self._depth == 0  # not inside another timed module: its time is the step's own
            a = self.clock.stamp()
            t0 = time.perf_counter()
            self._depth += 1
            try:
                out = orig(*args, **kw)
            finally:
                self._depth -= 1
            t1 = time.perf_counter()
            self.calls.append((kind, head, outer, t1 - t0, a, self.clock.stamp()))
            return out

        self._wrapped.append((mod, mod.__dict__.get("forward")))
        mod.forward = forward

    def close(self) -> None:
        for mod, prev in self._wrapped:
            if prev is None:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = prev
        self._wrapped = []

    def summary(self, wall_s: float) -> dict:
        """Per type host and device ms per decode step over the calls recorded; wall_s: the steps' wall time."""
        self.clock.sync()
        steps = max(1, sum(1 for c in self.calls if c[1]))
        host: dict[str, float] = {}
        dev: dict[str, float] = {}
        top = 0.0
        for kind, _, outer, h, a, b in self.calls:
            host[kind] = host.get(kind, 0.0) + h
            dev[kind] = dev.get(kind, 0.0) + self.clock.elapsed(a, b)
            top += h if outer else 0.0
        inner = ("kda", "mla", "moe", "dense")
        for d in (host, dev):
            if "block" in d:  # a block's own work beside its attention and MLP modules
                d["glue"] = d.pop("block") - sum(d.get(k, 0.0) for k in inner)
            if "shared" in d and "moe" in d:  # called on its own (not fused): inside the MLP module's span
                d["moe"] -= d["shared"]
        types = {k: {"host_ms": 1e3 * host[k] / steps, "device_ms": 1e3 * dev[k] / steps} for k in host}
        return {"steps": steps, "step_ms": 1e3 * wall_s / steps, "outside_ms": 1e3 * (wall_s - top) / steps,
                "types": types}


def shared_estimate(model: Any, clock: _Clock, reps: int = 20) -> tuple[float | None, str]:
    """ms per decode step of the shared experts, timed alone: one MoE layer's shared expert on a one-token input,
    `reps` times, times the number of MoE layers. (ms or None, how it was measured or why not)."""
    mods = [m.mlp.shared_experts for m in model.modules
            if getattr(getattr(m, "mlp", None), "shared_experts", None) is not None]
    if not mods:
        return None, "no shared expert modules"
    import torch

    m = mods[0]
    try:
        x = (torch.randn(1, 1, m.hidden_size, device=m.device) * 0.1).half()
        m.forward(x, {})
        clock.sync()
        a = clock.stamp()
        for _ in range(reps):
            m.forward(x, {})
        b = clock.stamp()
        clock.sync()
    except Exception as exc:  # a module that cannot run on its own: said, not guessed
        return None, f"not measurable alone ({type(exc).__name__}: {exc})"
    return (1e3 * clock.elapsed(a, b) / reps * len(mods),
            f"one layer's shared expert alone x {len(mods)} layers; fused into the MoE kernel in the step")


class _Track(_Releases):
    """A job's releases with their times, so a rate can be taken over any span of its tokens."""

    def __init__(self, t0: float):
        super().__init__(t0, lambda: None)
        self.marks: list[tuple[float, int]] = []

    def add(self, r: dict) -> None:
        n = len(self.ids)
        super().add(r)
        if len(self.ids) != n:
            self.marks.append((time.perf_counter(), len(self.ids)))

    def rate(self, upto: int) -> tuple[float | None, int]:
        """(tok/s from the first release to the first release holding token `upto`, tokens in between)."""
        if not self.marks:
            return None, 0
        t0, n0 = self.marks[0]
        t1, n1 = next(((t, n) for t, n in self.marks if n >= upto), self.marks[-1])
        return ((n1 - n0) / (t1 - t0) if n1 > n0 and t1 > t0 else None), n1 - n0


def _run(gen: Any, prompt: list[int], max_new: int, on_tokens: Callable[[int], None] | None = None) -> _Track:
    """One greedy job, iterated to its end; on_tokens(count) after each iterate()."""
    import exllamav3 as exl
    import torch

    job = exl.Job(input_ids=torch.tensor([prompt], dtype=torch.long), max_new_tokens=max_new,
                  sampler=exl.ArgmaxSampler(), stop_conditions=[])
    track = _Track(time.perf_counter())
    gen.enqueue(job)
    while gen.num_remaining_jobs():
        for r in gen.iterate():
            track.add(r)
        if on_tokens is not None:
            on_tokens(len(track.ids))
    track.done()
    return track


def _tensor_bytes(objs: Any) -> int:
    """Bytes of the distinct device tensors the given objects hold as attributes (cache layers, recurrent states)."""
    import torch

    seen, total = set(), 0
    for obj in objs:
        for v in vars(obj).values():
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.untyped_storage().nbytes()
    return total


def planned_sizes(spec: Any) -> dict:
    from glm53.spec import PAGE

    return {"vram_slots": sum(spec.vram_slots) if spec.tiered else "all", "staging": spec.staging_slots, "ram_rows": spec.ram_slots,
            "kv_tokens": spec.kv_tokens + PAGE,  # the engine's cache has one page more than the plan's KV
            "sequences": spec.cache_sequences, "prefill_chunk": spec.prefill_chunk,
            "recurrent_cache_bytes": spec.recurrent_cache_bytes}


def loaded_sizes(engine: Any) -> dict:
    """What the engine holds after load, counted from it (not from its spec)."""
    from glm53.engine.exl3_adapter import moe_modules

    tiered, cache, gen = engine.tiered, engine.cache, engine.generator
    if tiered is not None:
        slots, staging, ram = sum(layer.slots for layer in tiered.layers), tiered.staging_slots, tiered.tiers.ram.num_slots
    else:
        slots, staging, ram = sum(int(m.num_local_experts) for m in moe_modules(engine.model)), 0, 0
    return {"vram_slots": slots, "staging": staging, "ram_rows": ram, "kv_tokens": int(cache.max_num_tokens),
            "sequences": int(getattr(cache, "num_slots", getattr(cache, "max_batch_size", 0))),
            "prefill_chunk": int(gen.max_chunk_size),
            **({"recurrent_cache_bytes": int(gen.recurrent_cache_size)} if hasattr(gen, "recurrent_cache_size") else {})}


def _pinned_bytes(engine: Any) -> int:
    """The pinned host bytes the tiers hold (the RAM arena; the per-layer step buffers are a few KiB)."""
    tiers = getattr(engine.tiered, "tiers", None)
    ram = getattr(tiers, "ram", None)
    return int(ram.storage.numel() * ram.storage.element_size()) if ram is not None and ram.pinned else 0


def _checks(engine: Any, context: int, hi: int, long_seed: int) -> dict:
    """The engine's answers at the context's edge, through its public generate(): a prompt of `context` tokens is
    refused (context_length_exceeded), and a prompt 8 tokens short of it, asked for 64, ends with "length" after 8
    (it shares the longest prompt's prefix, so exllamav3's page cache may serve most of it)."""
    from glm53.engine.interface import ContextLengthExceeded, SamplingParams

    async def collect(prompt: list[int], max_tokens: int, rid: str) -> list:
        return [ev async for ev in engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), rid)]

    out = {}
    try:
        asyncio.run(collect(prompt_ids(context, hi, seed=7), 4, "depth-over"))
        out["context_exceeded"] = {"ok": False, "got": "a prompt of the whole context was accepted"}
    except ContextLengthExceeded as exc:
        out["context_exceeded"] = {"ok": True, "got": f"refused: {exc}"}
    except Exception as exc:  # any other failure is the finding
        out["context_exceeded"] = {"ok": False, "got": f"{type(exc).__name__}: {exc}"}
    t0 = time.perf_counter()
    try:
        events = asyncio.run(collect(prompt_ids(context - 8, hi, seed=long_seed), 64, "depth-edge"))
        tokens = [e for e in events if hasattr(e, "finish_reason")]
        end = tokens[-1].finish_reason if tokens else None
        out["length_at_edge"] = {"ok": end == "length" and len(tokens) == 8,
                                 "got": f"{len(tokens)} tokens, finish_reason {end!r}, in {time.perf_counter() - t0:.1f} s"}
    except Exception as exc:
        out["length_at_edge"] = {"ok": False, "got": f"{type(exc).__name__}: {exc}"}
    return out


def measure(job: dict, spec: Any, plan_doc: dict | None, save: Callable[[dict], None]) -> dict:
    """Load the engine for `spec` and measure everything for one mode; save(res) after each phase."""
    import torch

    from glm53.engine.exl3_engine import Exl3Engine

    model_dir = Path(job["model"])
    config = json.loads((model_dir / "config.json").read_text())
    attn, mlp = layer_kinds(config)
    hi = min(int(config.get("text_config", config)["vocab_size"]), 150000)
    prompts, tokens, profile_tokens = job["prompts"], job["tokens"], job["profile_tokens"]
    peak_tokens, greedy_tokens = job.get("peak_tokens", PEAK_TOKENS), job.get("greedy_tokens", GREEDY_TOKENS)
    res: dict[str, Any] = {"mode": job["mode"], "engine": spec.engine, "spec": spec.to_json(), "plan": plan_doc,
                           "runs": [], "memory": {}, "profile": {}}
    cuda = spec.device.startswith("cuda")
    sampler = Sampler(spec.device)
    clock = _Clock(cuda)
    engine = Exl3Engine(model_dir, spec, model_id="glm-5.3-flash")
    timer = None
    try:
        t0 = time.perf_counter()
        engine.load()
        res["load_s"] = time.perf_counter() - t0
        hi = min(hi, getattr(engine, "_n_vocab", hi))  # ids the engine's generate() accepts (its tokenizer's)
        res["planned"], res["loaded"] = planned_sizes(spec), loaded_sizes(engine)
        res["matches"] = {k: res["planned"][k] in (v, "all") for k, v in res["loaded"].items()}
        dev, rss = sampler.mark()
        res["memory"].update(after_load_bytes=sampler.used(), load_peak_bytes=dev, context_bytes=sampler.context,
                             pinned_bytes=_pinned_bytes(engine))
        cache_layers = list(getattr(engine.cache, "layers", {}).values())
        recurrent = list(getattr(engine.cache, "recurrent_layers", {}).values())
        kv_per_token = _tensor_bytes(cache_layers) / max(1, res["loaded"]["kv_tokens"])
        state_per_seq = _tensor_bytes(recurrent) / max(1, res["loaded"]["sequences"])
        res["cache"] = {"kv_bytes_per_token": kv_per_token, "kda_state_bytes_per_sequence": state_per_seq}
        save(res)
        gen = engine.generator
        weights = weight_bytes_per_token(model_dir)

        def profiled(track: _Track, plain: int, wall0: list[float], history: int, snap0: Any) -> dict:
            nonlocal timer
            prof = timer.summary(time.perf_counter() - wall0[0])
            timer.close()
            timer = None
            for t, x in prof["types"].items():
                x["bytes"] = weights.get(t, 0.0)
            prof["types"].setdefault("moe", {"host_ms": 0.0, "device_ms": 0.0, "bytes": weights["moe"]})
            if "mla" in prof["types"]:
                prof["types"]["mla"]["bytes"] += history * kv_per_token
                prof["types"]["mla"]["note"] = f"weights + {history} positions of KV read whole (DSA reads fewer)"
            if "kda" in prof["types"]:  # the pool keeps two rows per sequence: one read, one written per step
                prof["types"]["kda"]["bytes"] += state_per_seq
                prof["types"]["kda"]["note"] = "weights + the sequence's state as allocated, read and written"
            ms, how = shared_estimate(engine.model, clock)
            if ms is not None and "shared" not in prof["types"]:
                prof["types"]["shared"] = {"host_ms": None, "device_ms": ms, "bytes": weights["shared"], "note": how}
                prof["types"]["moe"]["note"] = "routed + the fused shared expert"
            plain_rate, _ = track.rate(plain)
            step_rate = 1e3 / prof["step_ms"] if prof["step_ms"] else None
            prof["perturbation"] = step_rate / plain_rate if plain_rate and step_rate else None
            if snap0 is not None and engine.tiered is not None:  # the tiers' own host seconds per profiled step
                snap1 = engine.tiered.snapshot()
                prof["tier_host_ms"] = {k: 1e3 * (v - snap0["host_seconds"].get(k, 0.0)) / prof["steps"]
                                        for k, v in snap1.get("host_seconds", {}).items()}
            return prof

        def job_with_profile(prompt: list[int], plain: int, history: int, peak_at: int | None = None) -> tuple:
            wall0: list[float] = [0.0]
            snap = [None]
            peak: dict = {}

            def on_tokens(n: int) -> None:
                if peak_at is not None and n >= peak_at and not peak:
                    dev, rss = sampler.mark()
                    peak.update(peak_long_bytes=dev, rss_long_bytes=rss, max_allocated_long_bytes=
                                torch.cuda.max_memory_allocated() if cuda else None)
                nonlocal timer
                if n >= plain and timer is None and profile_tokens:  # wrapped only for the profiled steps
                    snap[0] = engine.tiered.snapshot() if engine.tiered is not None else None
                    timer = LayerTimer(engine.model, attn, mlp, clock)
                    timer.on, wall0[0] = True, time.perf_counter()

            sampler.mark()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            track = _run(gen, prompt, plain + profile_tokens, on_tokens)
            return track, profiled(track, plain, wall0, history, snap[0]) if profile_tokens else None, peak

        with torch.inference_mode():
            # Unmeasured: a fresh process compiles and autotunes kernels on its first long prefill and decode.
            _run(gen, prompt_ids(min(4 * spec.prefill_chunk, prompts[-1]), hi, seed=99), 4)
            track, prof, _ = job_with_profile(prompt_ids(SHORT_PROMPT, hi, seed=1), tokens, 0)
            rate, n = track.rate(tokens)
            res["runs"].append({"prompt_tokens": SHORT_PROMPT, "ttft_s": track.prefill_s(), "decode_tok_s": rate,
                                "decoded": n})
            if prof:
                res["profile"]["0"] = prof
            save(res)
            for p in prompts[:-1]:
                track = _run(gen, prompt_ids(p, hi, seed=p), tokens)
                rate, n = track.rate(tokens)
                res["runs"].append({"prompt_tokens": p, "ttft_s": track.prefill_s(), "decode_tok_s": rate,
                                    "decoded": n})
                save(res)
            longest = prompts[-1]
            plain = max(peak_tokens, greedy_tokens, tokens)
            track, prof, peak = job_with_profile(prompt_ids(longest, hi, seed=longest), plain, longest,
                                                 peak_at=peak_tokens)
            rate, n = track.rate(tokens)
            res["runs"].append({"prompt_tokens": longest, "ttft_s": track.prefill_s(), "decode_tok_s": rate,
                                "decoded": n, "decode_tok_s_over_peak_tokens": track.rate(peak_tokens)[0]})
            res["greedy_ids"] = track.ids[:greedy_tokens]
            res["memory"].update(peak, peak_after_tokens=peak_tokens)
            if prof:
                res["profile"][str(longest)] = prof
        res["memory"].update(peak_bytes=sampler.peak if cuda else None, rss_peak_bytes=sampler.rss_peak)
        save(res)
        if job.get("checks") and spec.engine != "stock":
            res["checks"] = _checks(engine, spec.context, hi, long_seed=longest)
            save(res)
    finally:
        if timer is not None:
            timer.close()
        engine.close()
        sampler.close()
    return res


def mode_spec(job: dict) -> tuple[Any, dict]:
    """The EngineSpec a mode runs with and the plan it came from: the plan of this host for the job's budget,
    context and mode (stock: the exact plan's KV, context, sequences and chunk with every expert in VRAM). Raises
    ValueError naming why a mode cannot be measured."""
    from glm53 import planning_cli
    from glm53 import settings as S
    from glm53.plan import GIB

    mode = job["mode"]
    env = {"GLM53_MODEL_DIR": job["model"], "GLM53_VRAM_BUDGET_GB": str(job["vram_budget_gb"]),
           "GLM53_CONTEXT": str(job["context"]), "GLM53_MODE": "exact" if mode == "stock" else mode,
           "GLM53_CACHE_DIR": job["cache_dir"], "GLM53_STORE": job.get("store") or "",
           "GLM53_ALLOW_BUFFERED_READS": "1" if job.get("buffered") else "0"}
    inp = planning_cli.inputs(S.load(environ=env, dotenv=None), job.get("host_root", "/"))
    if mode.startswith("nvme") and job.get("memory_gib"):  # the cap the nvme modes are planned for
        mem = replace(inp.facts.memory, limit=int(job["memory_gib"] * GIB), current=0)
        inp = replace(inp, facts=replace(inp.facts, memory=mem))
    plan, doc = planning_cli.make_plan(inp)
    if plan is None:
        raise ValueError(f"the plan refused {mode}: {doc['error']}")
    doc.pop("facts", None)
    spec = plan.engine
    if mode == "stock":
        spec = replace(spec, engine="stock", vram_slots=(), staging_slots=0, ram_slots=0, cpu_threads=0,
                       store_threads=0, store=None, split="every expert in VRAM (the reference)")
    elif spec.engine != mode:
        raise ValueError(f"the plan for {mode} runs {spec.engine} ({spec.split}): with this checkpoint every routed "
                         "expert fits the budget, so nothing is tiered; generate one with more experts per layer "
                         "(--fixture '... --experts N') or lower --budget-gb")
    return spec, doc


def child(job_path: Path) -> int:
    """One mode in this process (python -m glm53.bench.depth JOB.json): its figures to job['out'] as they come."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    job = json.loads(job_path.read_text())
    out = Path(job["out"])

    def save(res: dict) -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(out)

    try:
        if job.get("spec"):  # a spec given whole (tests: the fake exllamav3 on the CPU)
            from glm53.spec import EngineSpec

            spec, plan_doc = EngineSpec(**{**job["spec"], "vram_slots": tuple(job["spec"]["vram_slots"])}), None
        else:
            spec, plan_doc = mode_spec(job)
        measure(job, spec, plan_doc, save)
    except Exception as exc:
        prior = json.loads(out.read_text()) if out.exists() else {"mode": job["mode"]}
        save({**prior, "error": f"{type(exc).__name__}: {exc}"})
        if not isinstance(exc, ValueError):  # a refusal is said in one line; anything else with its traceback
            raise
        print(f"glm53 bench depth ({job['mode']}): {exc}", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------------ the parent


def _fixture_dir(work: Path, fixture: list[str]) -> Path:
    return work / ("glm53-depth-" + hashlib.sha256(" ".join(fixture).encode()).hexdigest()[:10])


def checkpoint(args: argparse.Namespace, work: Path) -> tuple[Path, str]:
    """The checkpoint to measure and what it is: --model, or `glm53 fixture --kind exl3 ARGS` made once under
    --work (reused there by the next --keep call with the same ARGS)."""
    if args.model:
        return Path(args.model), f"checkpoint {args.model}"
    fixture = shlex.split(args.fixture)
    home = _fixture_dir(work, fixture)
    home.mkdir(parents=True, exist_ok=True)
    ckpt = home / "ckpt"

    def make() -> None:
        shutil.rmtree(ckpt, ignore_errors=True)
        cmd = [sys.executable, "-m", "glm53", "fixture", "--kind", "exl3", "--out", str(ckpt), *fixture]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(f"the fixture failed: {shlex.join(cmd)}")

    _made_once(home / "ckpt.complete", make, f"the checkpoint {ckpt} (glm53 fixture --kind exl3 {args.fixture})")
    return ckpt, f"glm53 fixture --kind exl3 {args.fixture}"


def store_for(model_dir: Path, home: Path) -> tuple[Path, bool]:
    """The nvme modes' store, packed from the checkpoint into `home` once; (path, read buffered)."""
    from store.directio import dir_supports_direct
    from store.pack import PackOptions, pack_store

    home.mkdir(parents=True, exist_ok=True)
    buffered = not dir_supports_direct(home)
    store = home / "experts.glm53"
    _made_once(home / "experts.complete",
               lambda: pack_store(PackOptions(model_dir, store, threads=8, progress=False, allow_buffered=buffered),
                                  log=lambda m: None), f"the expert store {store}")
    return store, buffered


def load_reference(path: str) -> dict:
    try:
        ref = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--reference {path}: {exc}") from None
    if "runs" not in ref.get("modes", {}).get("stock", {}):
        raise ValueError(f"--reference {path} holds no stock figures (run a call with --modes stock,... first)")
    return ref


def cmd_bench_depth(args: argparse.Namespace) -> int:
    try:
        modes = parse_modes(args.modes)
        prompts = parse_prompts(args.prompts, args.context)
        if args.tokens < 8 or args.profile_tokens < 0:
            raise ValueError("--tokens must be at least 8 and --profile-tokens at least 0")
        reference = load_reference(args.reference) if args.reference else None
    except ValueError as exc:
        print(f"glm53 bench depth: {exc}", file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="glm53-depth-"))
    work.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"bench": "depth", "date": time.strftime("%Y-%m-%d %H:%M"), "modes": {},
                           "settings": {"vram_budget_gb": args.budget_gb, "context": args.context,
                                        "memory_gib": args.memory_gib, "prompts": prompts, "tokens": args.tokens,
                                        "profile_tokens": args.profile_tokens}}
    made: list[Path] = []
    try:
        model_dir, what = checkpoint(args, work)
        if not args.model:
            made.append(model_dir.parent)
        doc["checkpoint"] = {"path": str(model_dir), "what": what}
        store, buffered = None, False
        if any(m.startswith("nvme") for m in modes):
            home = Path(args.store_dir) / model_dir.parent.name if args.store_dir else model_dir.parent
            store, buffered = store_for(model_dir, home)
            made.append(home)
            doc["store"] = {"path": str(store), "buffered": buffered}
        for mode in modes:
            out = work / f"depth-{mode}.json"
            out.unlink(missing_ok=True)
            job = {"mode": mode, "model": str(model_dir), "vram_budget_gb": args.budget_gb, "context": args.context,
                   "memory_gib": args.memory_gib, "store": str(store) if store else None, "buffered": buffered,
                   "cache_dir": str(work / f"cache-{mode}"), "prompts": prompts, "tokens": args.tokens,
                   "profile_tokens": args.profile_tokens, "checks": args.checks, "out": str(out)}
            shutil.rmtree(job["cache_dir"], ignore_errors=True)  # every mode starts from no saved routing
            job_path = work / f"depth-{mode}.job.json"
            job_path.write_text(json.dumps(job))
            t0 = time.perf_counter()
            print(f"--- {mode}", flush=True)
            rc = subprocess.run([sys.executable, "-m", "glm53.bench.depth", str(job_path)]).returncode
            res = json.loads(out.read_text()) if out.exists() else {"mode": mode}
            if rc != 0 and not res.get("error"):
                res["error"] = f"the mode's process exited {rc}"
            res["wall_s"] = time.perf_counter() - t0
            doc["modes"][mode] = res
            finish(doc, reference, args.reference)
            if args.json:  # partial: each mode as it finishes
                Path(args.json).write_text(json.dumps(doc, indent=1))
            print(f"--- {mode} done in {res['wall_s']:.0f} s" + (f": {res['error']}" if res.get("error") else ""),
                  flush=True)
    except (RuntimeError, OSError) as exc:
        print(f"glm53 bench depth: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            for p in made:
                shutil.rmtree(p, ignore_errors=True)
            if not args.work:
                shutil.rmtree(work, ignore_errors=True)
    finish(doc, reference, args.reference)
    print(report(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return exit_status(doc)


if __name__ == "__main__":
    sys.exit(child(Path(sys.argv[1])))
