"""`glm53 bench depth`: the full-depth proof run. One full-depth checkpoint, the plan for a 24 GB budget at 131,072
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
(One mode's measurement is glm53.bench.depth_measure; the pure parts both use (prompts, layer types, bytes per
token, the token comparison) are glm53.bench.depth_parts; this module holds the parent, the plan per mode, the
comparisons, ratios and the report.)

Stock is plain exllamav3 with every routed expert in VRAM (on a card that holds them all) on the exact plan's KV, context,
sequences and prefill chunk: the reference for tokens and for the ratios. A call measures any subset of modes and
writes its JSON as each mode finishes; --reference merges an earlier call's stock so a later call still prints
ratios (marked as from another call). The checkpoint (generated with `glm53 fixture --kind exl3 FIXTURE-ARGS`) and
the nvme modes' store stay under --work with --keep and are reused by the next call with the same arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from glm53.bench.decode import _made_once
from glm53.bench.depth_parts import (
    EXACT_LIKE,
    REFERENCE_SLOTS,
    SHORT_PROMPT,
    TYPE_NAMES,
    TYPES,
    first_difference,
    parse_modes,
    parse_prompts,
)
from glm53.tiers.stats import describe_counts

# ------------------------------------------------------------------------------------------------ comparisons, report


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
    emu = s.get("emulation") or {}
    if emu.get("name", "none") != "none":
        from glm53.bench.emulate import from_json

        lines.append(f"  emulated host (tiered modes): {from_json(emu).describe()}; not emulated: this host's Python "
                     "speed, its DRAM channels, cores it does not have")
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
            t = run.get("tiers") or {}
            lines.append(f"    {what} decode {_f(run.get('decode_tok_s'))} tok/s over {run.get('decoded', 0)} tokens"
                         + (f"; {describe_counts(t)}" if t.get("picks_total") else ""))
        mem = r.get("memory", {})
        if mem:
            peak = mem.get("peak_long_bytes")
            budget = s["vram_budget_gb"] * 2**30
            verdict = "" if peak is None else (" (within the budget)" if peak <= budget else " OVER THE BUDGET")
            lines.append(f"    device memory (driver): {_gib(mem.get('after_load_bytes'))} after load, peak "
                         f"{_gib(peak)} through the longest prompt + {mem.get('peak_after_tokens')} tokens{verdict}, "
                         f"{_gib(mem.get('peak_bytes'))} over the whole run; torch max allocated "
                         f"{_gib(mem.get('max_allocated_long_bytes'))}; CUDA context {_gib(mem.get('context_bytes'))}")
            # The tiers pin ordinary pages in place (cudaHostRegister), so their arena is inside anonymous RSS.
            host = (f"    host: peak anonymous RSS {_gib(mem.get('rss_peak_bytes'))}, the tiers' pinned arena "
                    f"{_gib(mem.get('pinned_bytes'))} inside it")
            cap = s.get("memory_gib") if mode.startswith("nvme") else None
            if cap and mem.get("rss_peak_bytes") is not None:
                host += (f"; against the {cap:g} GiB cap: "
                         + ("within" if mem["rss_peak_bytes"] <= cap * 2**30 else "OVER"))
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


def mode_spec(job: dict) -> tuple[Any, dict]:
    """The EngineSpec a mode runs with and the plan it came from: the plan of this host for the job's budget,
    context and mode (stock: the exact plan's KV, context, sequences and chunk with every expert in VRAM). Raises
    ValueError naming why a mode cannot be measured."""
    from glm53.planning import inputs as planning_inputs
    from glm53.planning import settings as S
    from glm53.planning.units import GIB

    mode = job["mode"]
    env = {"GLM53_MODEL_DIR": job["model"], "GLM53_VRAM_BUDGET_GB": str(job["vram_budget_gb"]),
           "GLM53_CONTEXT": str(job["context"]), "GLM53_MODE": "exact" if mode == "stock" else mode,
           "GLM53_MAX_CONCURRENCY": str(job.get("concurrency", 0)), "GLM53_CACHE_DIR": job["cache_dir"], "GLM53_STORE": job.get("store") or "",
           "GLM53_ALLOW_BUFFERED_READS": "1" if job.get("buffered") else "0"}
    inp = planning_inputs.inputs(S.load(environ=env, dotenv=None), job.get("host_root", "/"))
    if mode.startswith("nvme") and job.get("memory_gib"):  # the cap the nvme modes are planned for
        mem = replace(inp.facts.memory, limit=int(job["memory_gib"] * GIB), current=0)
        inp = replace(inp, facts=replace(inp.facts, memory=mem))
    plan, doc = planning_inputs.make_plan(inp)
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


def emulated(job: dict, spec: Any) -> tuple[Any, Any]:
    """The mode's spec and the engine's on_tiers on the host the job emulates (glm53.bench.emulate); stock runs
    as it is (no expert crosses the link)."""
    from glm53.bench import emulate

    emu = emulate.from_json(job.get("emulation"))
    if emu.name == "none" or not spec.tiered:
        return spec, None
    from glm53.planning.shape import from_checkpoint

    spec = emulate.emulated_spec(spec, emu, from_checkpoint(Path(job["model"])).experts_per_layer)
    pacer = emulate.link_pacer(emu, from_checkpoint(Path(job["model"])).expert_bytes) if spec.device.startswith(
        "cuda") else None
    print(f"emulating {emu.describe()}: VRAM slots per MoE layer {list(spec.vram_slots)}", flush=True)
    return spec, emulate.tiers_hook(emu, pacer)


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
            from glm53.planning.spec import EngineSpec

            spec, plan_doc = EngineSpec(**{**job["spec"], "vram_slots": tuple(job["spec"]["vram_slots"])}), None
        else:
            spec, plan_doc = mode_spec(job)
        spec, on_tiers = emulated(job, spec)
        from glm53.bench.depth_measure import measure

        measure(job, spec, plan_doc, save, on_tiers)
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
        from glm53.bench.emulate import checked, to_json

        emulation = to_json(checked(args))
    except ValueError as exc:
        print(f"glm53 bench depth: {exc}", file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="glm53-depth-"))
    work.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"bench": "depth", "date": time.strftime("%Y-%m-%d %H:%M"), "modes": {},
                           "settings": {"vram_budget_gb": args.budget_gb, "context": args.context,
                                        "concurrency": args.concurrency, "memory_gib": args.memory_gib, "prompts": prompts, "tokens": args.tokens,
                                        "profile_tokens": args.profile_tokens, "emulation": emulation}}
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
                   "concurrency": args.concurrency, "memory_gib": args.memory_gib, "store": str(store) if store else None, "buffered": buffered,
                   "cache_dir": str(work / f"cache-{mode}"), "prompts": prompts, "tokens": args.tokens,
                   "profile_tokens": args.profile_tokens, "checks": args.checks, "out": str(out),
                   "emulation": emulation}
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
