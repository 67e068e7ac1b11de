"""One mode of `glm53 bench depth`, measured in its own process (glm53.bench.depth runs it): the engine loaded for
the plan's spec, the driver's view of device memory sampled on a thread, the prompts timed, the greedy ids kept,
and where a decode step's time goes per layer type (LayerTimer)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from glm53.bench.decode import _Releases
from glm53.bench.depth_parts import (
    GREEDY_TOKENS,
    PEAK_TOKENS,
    SAMPLE_S,
    SHORT_PROMPT,
    classify,
    layer_kinds,
    prompt_ids,
    weight_bytes_per_token,
)
from glm53.tiers.stats import counts_delta


def _smi_used(index: int) -> int | None:
    """The device's used bytes by nvidia-smi (None without it): read before this process creates a CUDA context."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                              str(index)], capture_output=True, text=True, timeout=30)
        return int(out.stdout.strip().splitlines()[0]) << 20 if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def _rss_anon() -> int:
    """Resident bytes not backed by files (statm: resident - shared), i.e. what the process itself allocated: the
    tiers' pinned arena too (ordinary pages registered with the driver in place, glm53.tiers.ram.pin_host)."""
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
        from glm53.exl3.probe import wrap_forwards

        self.clock, self.on, self.calls, self._depth = clock, False, [], 0
        self._keys: list[str] = []
        self._undo = wrap_forwards(model, lambda mod, orig: self._wrap(mod.key, orig, attn, mlp))
        if "lm_head" not in self._keys:
            self.close()
            raise RuntimeError("LayerTimer: no lm_head module found: decode steps cannot be counted")

    def _wrap(self, key: str, orig: Callable[..., Any], attn: Sequence[str], mlp: Sequence[str]) -> Callable[..., Any]:
        kind, head = classify(key, attn, mlp), key == "lm_head"
        self._keys.append(key)

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

        return forward

    def close(self) -> None:
        self._undo()

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
    from glm53.exl3.probe import shared_expert

    try:
        found = shared_expert(model)
        if found is None:
            return None, "no shared expert modules"
        call, layers = found
        call()
        clock.sync()
        a = clock.stamp()
        for _ in range(reps):
            call()
        b = clock.stamp()
        clock.sync()
    except Exception as exc:  # a module that cannot run on its own: said, not guessed
        return None, f"not measurable alone ({type(exc).__name__}: {exc})"
    return (1e3 * clock.elapsed(a, b) / reps * layers,
            f"one layer's shared expert alone x {layers} layers; fused into the MoE kernel in the step")


class _Track(_Releases):
    """A job's releases with their times, so a rate can be taken over any span of its tokens."""

    def __init__(self, t0: float):
        super().__init__(t0, lambda: None)
        self.marks: list[tuple[float, int]] = []

    def add(self, ev: Any) -> None:
        n = len(self.ids)
        super().add(ev)
        if len(self.ids) != n:
            self.marks.append((time.perf_counter(), len(self.ids)))

    def rate(self, upto: int) -> tuple[float | None, int]:
        """(tok/s from the first release to the first release holding token `upto`, tokens in between)."""
        if not self.marks:
            return None, 0
        t0, n0 = self.marks[0]
        t1, n1 = next(((t, n) for t, n in self.marks if n >= upto), self.marks[-1])
        return ((n1 - n0) / (t1 - t0) if n1 > n0 and t1 > t0 else None), n1 - n0


def _run(runtime: Any, prompt: list[int], max_new: int, on_tokens: Callable[[int], None] | None = None) -> _Track:
    """One greedy job, iterated to its end; on_tokens(count) after each iteration."""
    track = _Track(time.perf_counter())

    def on_step(events: list) -> None:
        for ev in events:
            track.add(ev)
        if on_tokens is not None:
            on_tokens(len(track.ids))

    runtime.run([prompt], max_new, on_step=on_step)
    track.done()
    return track


def tier_counts(engine: Any) -> dict[str, int]:
    """The tiers' running counts a run's figures are read against (glm53.exl3.tiered.TieredMoE.tier_counts;
    empty for stock)."""
    tiered = getattr(engine, "tiered", None)
    return {} if tiered is None else tiered.tier_counts()


def planned_sizes(spec: Any) -> dict:
    from glm53.planning.spec import PAGE

    return {"vram_slots": sum(spec.vram_slots) if spec.tiered else "all", "staging": spec.staging_slots,
            "staging_rows": spec.dedicated_staging if spec.tiered else 0, "ram_rows": spec.ram_slots,
            "kv_tokens": spec.kv_tokens + PAGE,  # the engine's cache has one page more than the plan's KV
            "sequences": spec.cache_sequences, "prefill_chunk": spec.prefill_chunk,
            "recurrent_cache_bytes": spec.recurrent_cache_bytes}


def loaded_sizes(engine: Any) -> dict:
    """What the engine holds after load, counted from it (not from its spec)."""
    tiered, built = engine.tiered, engine.runtime.sizes()
    if tiered is not None:
        slots, staging, ram = sum(layer.slots for layer in tiered.layers), tiered.staging_slots, tiered.tiers.ram.num_slots
        rows = int(tiered.tiers.staging.shape[0])
    else:
        slots, staging, ram = built["experts"], 0, 0
        rows = 0
    return {"vram_slots": slots, "staging": staging, "staging_rows": rows, "ram_rows": ram,
            "kv_tokens": built["kv_tokens"], "sequences": built["sequences"], "prefill_chunk": built["prefill_chunk"],
            **({"recurrent_cache_bytes": built["recurrent_cache_bytes"]} if "recurrent_cache_bytes" in built else {})}


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


def measure(job: dict, spec: Any, plan_doc: dict | None, save: Callable[[dict], None],
            on_tiers: Callable[[Any], None] | None = None) -> dict:
    """Load the engine for `spec` and measure everything for one mode; save(res) after each phase. on_tiers: the
    emulated host's hook (glm53.bench.emulate.tiers_hook), or None."""
    import torch

    from glm53.engine.exl3_engine import Exl3Engine
    from glm53.exl3.probe import cache_bytes

    model_dir = Path(job["model"])
    config = json.loads((model_dir / "config.json").read_text())
    attn, mlp = layer_kinds(config)
    hi = min(int(config.get("text_config", config)["vocab_size"]), 150000)
    prompts, tokens, profile_tokens = job["prompts"], job["tokens"], job["profile_tokens"]
    peak_tokens, greedy_tokens = job.get("peak_tokens", PEAK_TOKENS), job.get("greedy_tokens", GREEDY_TOKENS)
    res: dict[str, Any] = {"mode": job["mode"], "engine": spec.engine, "spec": spec.to_json(), "plan": plan_doc,
                           "runs": [], "memory": {}, "profile": {}, "emulation": job.get("emulation")}
    cuda = spec.device.startswith("cuda")
    sampler = Sampler(spec.device)
    clock = _Clock(cuda)
    engine = Exl3Engine(model_dir, spec, model_id="glm-5.3-flash", on_tiers=on_tiers)
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
        kv_bytes, state_bytes = cache_bytes(engine.runtime.cache)
        kv_per_token = kv_bytes / max(1, res["loaded"]["kv_tokens"])
        state_per_seq = state_bytes / max(1, res["loaded"]["sequences"])
        res["cache"] = {"kv_bytes_per_token": kv_per_token, "kda_state_bytes_per_sequence": state_per_seq}
        save(res)
        model, gen = engine.runtime.model, engine.runtime
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
            ms, how = shared_estimate(model, clock)
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
                    timer = LayerTimer(model, attn, mlp, clock)
                    timer.on, wall0[0] = True, time.perf_counter()

            sampler.mark()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            track = _run(gen, prompt, plain + profile_tokens, on_tokens)
            return track, profiled(track, plain, wall0, history, snap[0]) if profile_tokens else None, peak

        with torch.inference_mode():
            # Unmeasured: a fresh process compiles and autotunes kernels on its first long prefill and decode.
            _run(gen, prompt_ids(min(4 * spec.prefill_chunk, prompts[-1]), hi, seed=99), 4)
            counts = tier_counts(engine)
            track, prof, _ = job_with_profile(prompt_ids(SHORT_PROMPT, hi, seed=1), tokens, 0)
            rate, n = track.rate(tokens)
            counts, was = tier_counts(engine), counts
            res["runs"].append({"prompt_tokens": SHORT_PROMPT, "ttft_s": track.prefill_s(), "decode_tok_s": rate,
                                "decoded": n, "tiers": counts_delta(was, counts)})
            if prof:
                res["profile"]["0"] = prof
            save(res)
            for p in prompts[:-1]:
                track = _run(gen, prompt_ids(p, hi, seed=p), tokens)
                rate, n = track.rate(tokens)
                counts, was = tier_counts(engine), counts
                res["runs"].append({"prompt_tokens": p, "ttft_s": track.prefill_s(), "decode_tok_s": rate,
                                    "decoded": n, "tiers": counts_delta(was, counts)})
                save(res)
            longest = prompts[-1]
            plain = max(peak_tokens, greedy_tokens, tokens)
            track, prof, peak = job_with_profile(prompt_ids(longest, hi, seed=longest), plain, longest,
                                                 peak_at=peak_tokens)
            rate, n = track.rate(tokens)
            counts, was = tier_counts(engine), counts
            res["runs"].append({"prompt_tokens": longest, "ttft_s": track.prefill_s(), "decode_tok_s": rate,
                                "decoded": n, "decode_tok_s_over_peak_tokens": track.rate(peak_tokens)[0],
                                "tiers": counts_delta(was, counts)})
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
