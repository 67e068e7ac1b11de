"""verify-store: is this store sound, and is it the store of the checkpoint that is mounted?

quick (every start): superblock, identity and table sha256; file size; identity against the checkpoint
(config.json sha256, shard names and sizes, a sampled content fingerprint per shard; mtimes are NOT
compared because copies and image layers change them); a random sample of records read with O_DIRECT and
checked (xxh3 and sha256); two sampled records rebuilt from the checkpoint and compared byte for byte.
full (on demand): all of the above, then every record read back with O_DIRECT and checked.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from store.directio import alloc_aligned, open_for_read, pread_into
from store.errors import CheckpointError, DirectIOUnsupported, StoreError
from store.format import RecordEntry, StoreHeader, read_header, record_digests
from store.progress import ProgressMeter
from store.source import Checkpoint, SourceReader, find_experts, fingerprint, scan_checkpoint

CROSS_CHECKS = 2


@dataclass
class Problem:
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}\n  fix: {self.fix}"


@dataclass
class VerifyReport:
    path: Path
    mode: str                                    # "quick" | "full"
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    records_checked: int = 0
    records_total: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    direct: bool = True

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def rate(self) -> float:
        """Bytes per second of record reads (and checks)."""
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    def render(self) -> str:
        lines = [f"{p}" for p in self.problems] + [f"note: {n}" for n in self.notes]
        how = "O_DIRECT" if self.direct else "buffered"
        lines.append(f"{self.mode} verify of {self.path}: {self.records_checked} of {self.records_total} records "
                     f"read ({how}) and checked, {self.bytes_read / 1e9:.2f} GB in {self.seconds:.2f} s "
                     f"({self.rate / 1e9:.2f} GB/s): " + self.verdict())
        return "\n".join(lines)

    @property
    def unread(self) -> int:
        return max(0, self.records_total - self.records_checked)

    def verdict(self) -> str:
        """SOUND only for what was read: a sample says nothing of the records it skipped."""
        if not self.ok:
            return f"{len(self.problems)} problem(s)"
        return f"SOUND as far as checked ({self.unread} records not read)" if self.unread else "SOUND"


def pack_command(path: Path | str, model_dir: Path | str | None) -> str:
    return f"glm53 pack-store --model {model_dir or 'MODEL_DIR'} --out {path}"


def identity_problems(head: StoreHeader, ck: Checkpoint, path: Path) -> list[Problem]:
    """Compare the store's recorded checkpoint identity with the checkpoint on disk (cheap: ~1 MiB per shard)."""
    ident, root = head.identity, ck.root
    repack = f"if {root} is the checkpoint you want to serve, repack: {pack_command(path, root)}"
    restore = (f"restore it from the original download (glm53 model verify {root} --lock LOCK), or, if {root} "
               f"is meant to be another checkpoint, repack: {pack_command(path, root)}")
    out = []
    if ident["config_sha256"] != ck.config_sha256:
        out.append(Problem(f"{root}/config.json differs from the config the store {path} was packed from "
                           f"(sha256 {ck.config_sha256[:12]}… vs {ident['config_sha256'][:12]}…): "
                           "the store belongs to another model or revision", repack))
    on_disk = {s.name: s for s in ck.shards}
    recorded = {s["name"]: s for s in ident["shards"]}
    for name in sorted(set(recorded) - set(on_disk)):
        out.append(Problem(f"shard {name} ({recorded[name]['size']} bytes), recorded in the store {path}, "
                           f"is missing from {root}", restore))
    for name in sorted(set(on_disk) - set(recorded)):
        out.append(Problem(f"{root} has shard {name}, which the store {path} was not packed from: "
                           "the store belongs to another checkpoint", repack))
    for name in sorted(set(recorded) & set(on_disk)):
        want, have = recorded[name], on_disk[name]
        if want["size"] != have.size:
            out.append(Problem(f"shard {name} is {have.size} bytes in {root}, {want['size']} when the store "
                               f"{path} was packed: a different or damaged file", restore))
        elif fingerprint(root / name, have.size) != want["fingerprint"]:
            out.append(Problem(f"shard {name} in {root} has other contents than when the store {path} was packed "
                               "(sampled fingerprint differs): the store was packed from a different checkpoint "
                               "with the same shapes", repack))
    return out


def _check_record(fd: int, buf: np.ndarray, e: RecordEntry) -> tuple[int, str | None]:
    """Read one record into buf; return (bytes read, problem or None)."""
    view = buf[:e.extent]
    got = pread_into(fd, memoryview(view), e.offset)
    if got < e.extent:
        return got, f"{e.where()}: short read ({got} bytes)"
    x, s = record_digests(view)
    if x != e.xxh3:
        return got, f"{e.where()} fails its xxh3 check"
    if s != e.sha256:
        return got, f"{e.where()} fails its sha256 check"
    return got, None


def _record_problems(bad: list[str], path: Path, model_hint: str) -> list[Problem]:
    if not bad:
        return []
    shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
    return [Problem(f"{path}: {len(bad)} damaged record(s): {shown}",
                    f"the file is damaged (disk or copy error): {pack_command(path, model_hint)}")]


def _cross_check(head: StoreHeader, ck: Checkpoint, path: Path, keys: list[tuple[int, int]]) -> list[Problem]:
    """Rebuild sampled records from the checkpoint: the store must hold exactly those bytes."""
    try:
        es = find_experts(ck, include_mtp=bool(head.identity.get("include_mtp")))
    except CheckpointError as exc:
        return [Problem(exc.problem, exc.fix)]
    buf = alloc_aligned(head.max_extent)
    out = []
    with SourceReader(ck, es) as src:
        for layer, expert in keys:
            e = head.entry(layer, expert)
            if (layer, expert) not in es.parts or es.layers[layer].length != e.length:
                out.append(Problem(f"{ck.root} has no expert (layer {layer}, expert {expert}) shaped like the "
                                   f"store {path} records", f"repack: {pack_command(path, ck.root)}"))
                continue
            src.fill(layer, expert, buf)
            if xxhash.xxh3_64_intdigest(memoryview(buf[:e.extent])) != e.xxh3:
                out.append(Problem(f"{e.where()} of {path} differs from the checkpoint's tensors in {ck.root}: "
                                   "the store was packed from another checkpoint",
                                   f"repack: {pack_command(path, ck.root)}"))
    return out


def _begin(path: Path, mode: str, model_dir: Path | None) -> tuple[VerifyReport, StoreHeader | None, Checkpoint | None]:
    rep = VerifyReport(path, mode)
    try:
        head = read_header(path)
    except StoreError as exc:
        rep.problems.append(Problem(exc.problem, exc.fix.replace("MODEL_DIR", str(model_dir or "MODEL_DIR"))))
        return rep, None, None
    rep.records_total = len(head.entries)
    ck = None
    if model_dir is None:
        rep.notes.append("no --model given: the store was not compared with a checkpoint")
    else:
        try:
            ck = scan_checkpoint(model_dir)
        except CheckpointError as exc:
            rep.problems.append(Problem(exc.problem, exc.fix))
            return rep, head, None
        rep.problems += identity_problems(head, ck, path)
    return rep, head, ck


def _open(rep: VerifyReport, path: Path, allow_buffered: bool, warn) -> int | None:
    try:
        fd, rep.direct = open_for_read(path, allow_buffered, warn)
        return fd
    except DirectIOUnsupported as exc:
        rep.problems.append(Problem(exc.problem, exc.fix))
        return None


def quick_verify(path: Path | str, model_dir: Path | str | None = None, *, sample: int = 8,
                 allow_buffered: bool = False, warn=None, seed: int | None = None) -> VerifyReport:
    path = Path(path)
    model_dir = Path(model_dir) if model_dir else None
    rep, head, ck = _begin(path, "quick", model_dir)
    if head is None:
        return rep
    fd = _open(rep, path, allow_buffered, warn)
    if fd is None:
        return rep
    rng = random.Random(seed)
    picks = rng.sample(head.entries, min(sample, len(head.entries)))
    if head.entries and head.entries[-1] not in picks:
        picks[-1:] = [head.entries[-1]]         # the tail is where an interrupted copy shows first
    buf = alloc_aligned(head.max_extent)
    bad = []
    t0 = time.perf_counter()
    try:
        for e in picks:
            got, problem = _check_record(fd, buf, e)
            rep.bytes_read += got
            rep.records_checked += 1
            if problem:
                bad.append(problem)
    finally:
        os.close(fd)
    rep.seconds = time.perf_counter() - t0
    rep.problems += _record_problems(bad, path, str(model_dir or head.source_hint))
    if ck is not None and rep.ok:
        rep.problems += _cross_check(head, ck, path, [(e.layer, e.expert) for e in picks[:CROSS_CHECKS]])
    if rep.unread:
        rep.notes.append(f"--quick read a sample: {rep.unread} of {rep.records_total} records were not read, so damage "
                         f"in one of them would not show here; `glm53 verify-store {path}` without --quick reads "
                         f"every record")
    return rep


def full_verify(path: Path | str, model_dir: Path | str | None = None, *, threads: int = 4,
                allow_buffered: bool = False, warn=None, progress: bool = False) -> VerifyReport:
    path = Path(path)
    model_dir = Path(model_dir) if model_dir else None
    rep, head, ck = _begin(path, "full", model_dir)
    if head is None:
        return rep
    fd = _open(rep, path, allow_buffered, warn)
    if fd is None:
        return rep
    bar = ProgressMeter("verify", sum(e.extent for e in head.entries), enabled=progress)
    local = threading.local()
    lock = threading.Lock()
    bad: list[tuple[int, str]] = []

    def check(e: RecordEntry) -> None:
        if not hasattr(local, "buf"):
            local.buf = alloc_aligned(head.max_extent)
        got, problem = _check_record(fd, local.buf, e)
        with lock:
            rep.bytes_read += got
            rep.records_checked += 1
            if problem:
                bad.append((e.offset, problem))
        bar.update(got)

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="glm53-verify") as pool:
            for f in [pool.submit(check, e) for e in head.entries]:
                f.result()
    finally:
        bar.close()
        os.close(fd)
    rep.seconds = time.perf_counter() - t0
    rep.problems += _record_problems([p for _, p in sorted(bad)], path, str(model_dir or head.source_hint))
    if ck is not None and rep.ok:
        keys = random.sample(sorted(head.index), min(CROSS_CHECKS, len(head.index)))
        rep.problems += _cross_check(head, ck, path, keys)
    return rep
