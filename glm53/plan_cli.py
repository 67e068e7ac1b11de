"""`glm53 plan` and `glm53 preflight`: show the plan for this host; preflight also proves it with live checks.

`plan` only reads files (host facts, config.json, safetensors headers) and is safe to run anywhere, also on a
fake host tree (--host-root). `preflight` runs on the real host and does what start-up will do first: pin a
buffer through CUDA, read the store with O_DIRECT, decode its header and sample records.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import textwrap
import time
from dataclasses import dataclass

from glm53.planning import host as H
from glm53.planning import plan as P
from glm53.planning import settings as S
from glm53.planning import units as U
from glm53.planning.inputs import SHAPES, Inputs, inputs, make_plan
from store.files import not_regular

EXIT_BLOCKED = 2


def register(sub) -> None:
    p = sub.add_parser("plan", help="the mode and tier sizes this host gets, each with its reason (reads only)")
    p.add_argument("--host-root", default="/", metavar="DIR",
                   help="read host facts under DIR (a fake /proc, /sys tree and DIR/nvidia-smi.csv); default /")
    p.add_argument("--table", action="store_true", help="print the mode decision table (markdown) and exit")
    p.add_argument("--shape", choices=sorted(SHAPES), help="plan for this model's shape (glm53: GLM-5.3-Flash 3.05 "
                   "bpw) with no checkpoint: the tiers and the speed forecast before the download")
    _common(p)
    p.set_defaults(func=run_plan)
    q = sub.add_parser("preflight", help="the plan plus live checks: pin memory, O_DIRECT and header of the store")
    _common(q)
    q.set_defaults(func=run_preflight)


def _common(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON (keys: mode, vram_slots, ram_slots, "
                   "cpu_threads, nvme_threads, kv_tokens, warnings, reasons, error, ...)")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (overrides GLM53_MODEL_DIR)")
    p.add_argument("--store", metavar="PATH", help="expert store file (overrides GLM53_STORE)")


def gather(args, root: str) -> Inputs:
    """Settings (with the command line's overrides), host facts under `root`, and the model's shape."""
    settings = S.load_or_exit()
    overrides = {k: v for k, v in (("model_dir", args.model), ("store", args.store)) if v is not None}
    return inputs(settings.with_overrides(**overrides), root, getattr(args, "shape", None))


# ---------------------------------------------------------------- text rendering


def _host_lines(f: H.HostFacts) -> list[str]:
    gib = U.gib
    gpus = "; ".join(f"GPU {g.index} {g.name}, {gib(g.free_mib * U.MIB)} free of {gib(g.total_mib * U.MIB)}, "
                     f"PCIe {g.pcie_gen or '?'} x{g.pcie_width or '?'}" for g in f.gpus) or "no NVIDIA GPU"
    c, m = f.cpu, f.memory
    isa = ", ".join(x.upper() for x in ("avx2", "fma", "f16c") if c.has(x)) or "no AVX2/FMA/F16C"
    if c.avx512:
        isa += ", AVX-512"
    cpu = (f"{c.model}: {c.physical_cores} cores / {c.logical} threads, {c.sockets} socket(s), "
           f"{f.numa_nodes} NUMA node(s), {isa}" + (f", quota {c.quota_cpus:g} CPUs" if c.quota_cpus else ""))
    cap = "none" if m.limit is None else gib(m.limit)
    swap = "unlimited" if m.swap_limit is None else gib(m.swap_limit)
    ram = (f"MemTotal {gib(m.total or 0)}, MemAvailable {gib(m.available or 0)}; cgroup {m.cgroup or 'none'} cap "
           f"{cap}, swap cap {swap}; memlock {'unlimited' if m.memlock is None else U.human(m.memlock)}; "
           f"THP {m.thp or '?'}")
    lines = [f"  gpu     {gpus}", f"  cpu     {cpu}", f"  ram     {ram}"]
    if f.store:
        s = f.store
        lines.append(f"  store   {s.path}: " + (f"{gib(s.size or 0)} on {s.fstype} ({s.mount_point}); {s.odirect_how}"
                                                 if s.exists else "not found"))
    lines += [f"  note    {n}" for n in f.notes]
    return lines


def _value(key: str, out: dict) -> str:
    gib = U.gib
    return {
        "mode": str(out["mode"]),
        "gpu": str(out["device"]),
        "vram_slots": f"{out['vram_slots']} ({out['vram_slots_per_layer']}/layer)",
        "ram_slots": f"{out['ram_slots']} ({gib(out['ram_tier_bytes'] or 0)} pinned)",
        "cpu_threads": str(out["cpu_threads"]),
        "nvme_threads": str(out["nvme_threads"]),
        "kv_tokens": str(out["kv_tokens"]),
        "recurrent_cache": gib((out.get("engine") or {}).get("recurrent_cache_bytes") or 0),
        "sequences": str((out.get("engine") or {}).get("cache_sequences") or ""),
        "prefill_chunk": str((out.get("engine") or {}).get("prefill_chunk") or ""),
        "reserve": gib((out.get("vram_accounting") or {}).get("reserve") or 0),
        "vision": _vision_value((out.get("vram_accounting") or {}).get("vision_tower")),
        "store": str(out["store"]),
        "engine": _engine_value(out.get("engine")),
        "model": "",  # filled by render from the shape
        "real_model": str((out.get("real_model") or {}).get("mode") or "refused"),
    }.get(key, "")


def _vision_value(tower: int | None) -> str:
    """The tower's row: resident and its VRAM, or off (GLM53_MAX_IMAGES=0: the plan counts none)."""
    return f"resident {U.gib(tower)}" if tower else "off"


def _engine_value(spec: dict | None) -> str:
    """What loads: the engine and its VRAM slots per MoE layer, run-length encoded (128 x42 or 130 x2, 127 x40)."""
    if not spec:
        return ""
    runs: list[list[int]] = []
    for s in spec["vram_slots"]:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    slots = ", ".join(f"{s} x{n}" for s, n in runs) or "all"
    rows = spec.get("staging_rows")
    own = f" ({rows} rows of its own)" if rows is not None and rows < spec["staging_slots"] else ""
    return f"{spec['engine']}: VRAM slots per MoE layer {slots}; staging {spec['staging_slots']}{own}"


def render(out: dict, facts: H.HostFacts) -> str:
    """The plan as a readable table: host facts, then each decision with its value and reason, then warnings."""
    lines = [f"glm53 plan (host {facts.root})", *_host_lines(facts), ""]
    if out["error"]:
        lines.append("REFUSED: " + out["error"])
        lines.append("")
    width = 100
    for key, reason in out["reasons"].items():
        value = "" if out["error"] else _value(key, out)
        if key == "model":
            value = f"{out['shape']['experts']} experts x {U.human(out['shape']['expert_bytes'])}"
        lines.append(f"{key:<13} {value}".rstrip())
        lines += textwrap.wrap(reason, width, initial_indent=" " * 14, subsequent_indent=" " * 16)
    for name, key, total in (("VRAM", "vram_accounting", out.get("vram_budget_bytes")), ("RAM", "ram_accounting", None)):
        terms = out.get(key) or {}
        if terms:
            of = f" of the {U.gib(total)} budget" if total else ""
            text = f"{U.human(sum(terms.values()))}{of}: " + ", ".join(
                f"{k.replace('_', ' ')} {U.human(v)}" for k, v in terms.items())
            lines += textwrap.wrap(text, width, initial_indent=f"{name.lower():<14}", subsequent_indent=" " * 16)
    if out.get("forecast"):
        lines += ["", *_forecast_lines(out["forecast"], width)]
    if out["warnings"]:
        lines.append("")
        lines.append("warnings:")
        for w in out["warnings"]:
            lines += textwrap.wrap(w, width, initial_indent="  ! ", subsequent_indent="    ")
    return "\n".join(lines)


TERM_NAMES = {"hit_rate": "hit rate", "gpu_step_ms": "gpu step", "host_ms": "host", "link_GBps": "link",
              "lane_ms": "lane", "lane_offer_ms": "lane offer", "lane_decode": "lane in decode",
              "ram_rate": "RAM hit rate", "store_GBps": "store", "store_extra": "store extra",
              "write_backs": "write-backs"}


def _forecast_lines(fc: dict, width: int) -> list[str]:
    """The forecast section: each mode's decode tok/s and where its time goes, then each term with its source."""
    head = ("decode tok/s per mode on this host (glm53.planning.forecast): a token = gpu step + MoE layers x (host "
            "+ store + experts + write back), each term below with its source")
    lines = textwrap.wrap(head, width, initial_indent=f"{'forecast':<14}", subsequent_indent=" " * 16)
    only = len(fc["modes"]) == 1
    for mode, m in fc["modes"].items():
        parts = " + ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in m["parts_ms"].items() if v)
        planned = " (planned)" if only or mode == fc.get("planned_mode") else ""
        text = (f"{m['tok_s']:.1f} tok/s{planned} = 1000 / {m['ms_per_token']:.1f} ms a token ({parts} ms)"
                + (f"; {m['misses_per_token']:.0f} misses a token" if mode != "stock" else "")
                + (f", {m['store_reads_per_token']:.0f} read from the store" if m["store_reads_per_token"] else "")
                + (f"; {m['lane']}" if m["lane"] else ""))
        lines += textwrap.wrap(text, width, initial_indent=f"  {mode:<12}", subsequent_indent=" " * 16)
    for name, t in fc["terms"].items():
        text = f"{TERM_NAMES.get(name, name)} {t['value']:.3g} {t['unit']}: {t['source']}"
        lines += textwrap.wrap(text, width, initial_indent="  term        ", subsequent_indent=" " * 16)
    for note in fc.get("notes", []):
        lines += textwrap.wrap(note, width, initial_indent="  note        ", subsequent_indent=" " * 16)
    return lines


def run_plan(args) -> int:
    if args.table:
        print(P.render_decision_table(), end="")
        return 0
    inp = gather(args, args.host_root)
    _, out = make_plan(inp)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(render(out, inp.facts))
    if out["error"]:
        print(f"glm53: plan refused: {out['error']}", file=sys.stderr)
        return EXIT_BLOCKED
    return 0


# ---------------------------------------------------------------- preflight: live checks


@dataclass
class Check:
    name: str
    status: str      # ok | fail | skip
    detail: str
    blocks: bool = False  # a failure here stops serving

    def to_json(self) -> dict:
        return {"name": self.name, "status": self.status, "detail": self.detail, "blocks": self.blocks}


def check_pinning(plan: P.Plan | None, facts: H.HostFacts) -> Check:
    """Pin a host buffer through CUDA and copy it to the GPU: proves pinning works and measures PCIe."""
    if not facts.gpus:
        # Importing torch costs seconds; without a GPU nvidia-smi can see, CUDA cannot pin anything anyway.
        return Check("pin", "skip", "no NVIDIA GPU visible (nvidia-smi lists none)")
    try:
        import torch
    except ImportError:
        return Check("pin", "skip", "torch is not installed")
    if not torch.cuda.is_available():
        return Check("pin", "skip", "no CUDA device visible to torch (CPU-only build, or no --gpus)")
    memlock = facts.memory.memlock
    # Cross the memlock limit on purpose when it is low: pinning only below it would prove nothing.
    size = 256 * U.MIB if memlock is None else min(U.GIB, max(256 * U.MIB, memlock + 64 * U.MIB))
    device = plan.device if plan and plan.device.startswith("cuda") else "cuda:0"
    needs_pin = plan is not None and plan.mode != "demo"
    try:
        t0 = time.perf_counter()
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        buf.fill_(1)  # touch every page so the pinning is real, not lazy
        pinned = time.perf_counter() - t0
        dst = torch.empty(size, dtype=torch.uint8, device=device)
        dst.copy_(buf, non_blocking=True)  # warm-up: first copy pays for mapping
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(buf, non_blocking=True)
        torch.cuda.synchronize(device)
        rate = 4 * size / (time.perf_counter() - t0) / 1e9
        free, total = torch.cuda.mem_get_info(device)
        del buf, dst
    except RuntimeError as exc:
        fix = "add --ulimit memlock=-1" if memlock is not None else "check the NVIDIA driver and container toolkit"
        return Check("pin", "fail", f"pinning {U.human(size)} failed: {str(exc).splitlines()[0]}: {fix}", needs_pin)
    note = (f" (works despite RLIMIT_MEMLOCK {U.human(memlock)}: the driver pins without it)"
            if memlock is not None and memlock < size else "")
    return Check("pin", "ok", f"pinned {U.human(size)} in {pinned:.2f} s{note}; host->{device} {rate:.1f} GB/s; "
                              f"{U.gib(free)} free of {U.gib(total)} VRAM")


RAM_FS = ("tmpfs", "ramfs")


def check_odirect(plan: P.Plan | None, facts: H.HostFacts, settings: S.Settings) -> Check:
    """O_DIRECT-read up to 256 MiB of the store with a page-aligned buffer, and time it. A store the user named
    that cannot be read this way blocks (serving would refuse it), unless buffered reads are allowed."""
    st = facts.store
    if st is None:
        return Check("o_direct", "skip", "no store configured (GLM53_STORE is empty)")
    kind = not_regular(st.path)
    if kind is not None:
        return Check("o_direct", "fail", f"store {st.path} is {kind}, not a store file: point GLM53_STORE at the "
                                         f"file pack-store wrote ({P.pack_store_command(st.path)})", True)
    if not st.exists:
        return Check("o_direct", "fail", f"store {st.path} not found: run the pack-store container first: "
                                         f"{P.pack_store_command(st.path)}", True)
    if not st.odirect:
        if settings.allow_buffered_reads:
            return Check("o_direct", "fail", f"{st.path} on {st.fstype}: {st.odirect_how}: served with buffered "
                                             f"reads (GLM53_ALLOW_BUFFERED_READS=1), slower; ext4 or xfs is faster")
        return Check("o_direct", "fail", f"{st.path} on {st.fstype}: {st.odirect_how}: put the store on ext4 or xfs "
                                         f"(or set GLM53_ALLOW_BUFFERED_READS=1 to serve it slower, buffered)", True)
    chunk, total = 8 * U.MIB, min(256 * U.MIB, (st.size or 0) // H.ODIRECT_BLOCK * H.ODIRECT_BLOCK)
    fd = os.open(st.path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, chunk)
    try:
        t0, done = time.perf_counter(), 0
        while done < total:
            got = os.preadv(fd, [memoryview(buf)[:min(chunk, total - done)]], done)
            if got <= 0:
                break
            done += got
        secs = time.perf_counter() - t0
    except OSError as exc:
        return Check("o_direct", "fail", f"O_DIRECT read of {st.path} failed: {exc.strerror}", True)
    finally:
        buf.close()
        os.close(fd)
    rate = (f"; read {U.human(done)} at {done / secs / 1e9:.2f} GB/s (page cache bypassed)"
            if done and secs > 0 else "")
    return Check("o_direct", "ok", f"{st.odirect_how}{rate}")


def check_store_place(facts: H.HostFacts, settings: S.Settings) -> Check:
    """Where the store lives: a store without a model is unused, and one in RAM-backed storage costs its size
    in RAM (the mount table's fs type says which)."""
    st = facts.store
    if st is None:
        return Check("store_fs", "skip", "no store configured")
    if not settings.model_dir:
        return Check("store_fs", "fail", f"GLM53_STORE={settings.store} is set but GLM53_MODEL_DIR is empty: the "
                                         "demo model does not use a store; set GLM53_MODEL_DIR to the checkpoint "
                                         "the store was packed from (or unset GLM53_STORE)", True)
    if st.fstype in RAM_FS:
        held = U.gib(st.size) if st.size else "the whole store"
        return Check("store_fs", "fail", f"{st.path} is on {st.fstype} ({st.mount_point}), which is RAM: {held} "
                                         "stay in RAM, counting against the memory an nvme mode is meant to save; "
                                         "put the store on an NVMe drive (ext4 or xfs)")
    return Check("store_fs", "ok", f"{st.path} on {st.fstype or 'an unknown filesystem'}")


def check_store_header(plan: P.Plan | None, settings: S.Settings, model_dir: str | None) -> Check:
    """Decode the store's header and sample records (store.verify's quick check, as start-up runs it)."""
    path = settings.store
    if not path:
        return Check("store", "skip", "no store configured")
    blocks = True  # the user named this store: a damaged one is never "fine for now"
    try:
        from store import format as store_format
    except ImportError as exc:
        return Check("store", "skip", f"store package not importable ({exc}); header not checked")
    try:
        head = store_format.read_header(path)
    except Exception as exc:  # StoreFormatError and I/O errors alike: report them, do not crash preflight
        return Check("store", "fail", f"{exc}", blocks)
    summary = f"format v{head.version}, {len(head.entries)} records, {U.gib(head.file_size)}"
    try:
        from store.verify import quick_verify
    except ImportError:
        return Check("store", "ok", summary + " (store.verify not importable: records not sampled)")
    try:
        report = quick_verify(path, model_dir, allow_buffered=settings.allow_buffered_reads)
    except Exception as exc:  # a crash in the check is itself a finding; preflight must still print the rest
        return Check("store", "fail", f"{summary}; quick verify crashed: {exc!r}", blocks)
    if not report.ok:
        return Check("store", "fail", summary + "\n" + report.render(), blocks)
    return Check("store", "ok", summary + "; " + report.render().splitlines()[-1])


def run_preflight(args) -> int:
    inp = gather(args, "/")
    plan, out = make_plan(inp)
    checks = [check_pinning(plan, inp.facts), check_store_place(inp.facts, inp.settings),
              check_odirect(plan, inp.facts, inp.settings),
              check_store_header(plan, inp.settings, inp.settings.model_dir if inp.model_mounted else None)]
    blocked = [c for c in checks if c.status == "fail" and c.blocks]
    out["checks"] = [c.to_json() for c in checks]
    out["blocked"] = bool(out["error"] or blocked)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(render(out, inp.facts))
        print("\nlive checks:")
        for c in checks:
            mark = {"ok": "ok  ", "skip": "skip", "fail": "FAIL" if c.blocks else "warn"}[c.status]
            first, *rest = c.detail.splitlines() or [""]
            print(f"  {mark} {c.name:<9} {first}")
            for line in rest:
                print(f"                 {line}")
    if out["error"]:
        print(f"glm53: preflight: plan refused: {out['error']}", file=sys.stderr)
    for c in blocked:
        print(f"glm53: preflight: {c.name}: {c.detail.splitlines()[0]}", file=sys.stderr)
    return EXIT_BLOCKED if out["blocked"] else 0
