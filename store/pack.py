"""pack-store: stream the routed experts of a checkpoint into a store file.

Streaming: each worker thread assembles one record at a time from byte ranges of the shards (pread) into its
own aligned buffer, hashes it and writes it at its final offset, so memory stays at threads x 9 MiB whatever
the model size. Another thread computes every shard's sha256 for the identity block at the same time.

Crash safety: everything goes to PATH.partial; PATH.partial.journal lists finished records (JSON lines,
appended only after the data was fdatasync'ed). A rerun with the same checkpoint and options re-reads the
journaled records, keeps those whose bytes still hash right, and packs the rest. The header is written last,
then fsync and an atomic rename publish PATH; a full verify follows.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from store.directio import alloc_aligned, dir_supports_direct, open_for_read, pread_into, pwrite_from
from store.errors import (
    CheckpointError,
    DirectIOUnsupported,
    DiskFullError,
    PackInterrupted,
    StoreError,
    StoreFormatError,
)
from store.format import (
    FORMAT_NAME,
    PROJECTIONS,
    VERSION,
    RecordEntry,
    canonical_json,
    data_offset_for,
    header_region,
    read_header,
    record_digests,
)
from store.progress import ProgressMeter, gb
from store.source import Checkpoint, ExpertSet, SourceReader, find_experts, fingerprint, scan_checkpoint
from store.verify import VerifyReport, full_verify, identity_problems, pack_command

JOURNAL_MAGIC = "glm53-store-journal"
SHA_PLACEHOLDER = "0" * 64          # same length as a real digest, so the header size is known up front
FLUSH_EVERY_S = 0.5
HASH_CHUNK = 8 << 20
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass
class PackPlan:
    ck: Checkpoint
    es: ExpertSet
    identity: dict                  # shard sha256s are placeholders until the end of the pack
    keys: list[tuple[int, int]]
    offsets: dict[tuple[int, int], int]
    data_offset: int
    file_size: int
    digest: str                     # binds a journal to this exact plan

    def identity_bytes(self) -> bytes:
        return canonical_json(self.identity)


@dataclass
class PackResult:
    path: Path
    reused: bool                    # an existing sound store was kept
    records: int
    bytes_written: int = 0
    seconds: float = 0.0
    resumed_records: int = 0
    verify: VerifyReport | None = None

    @property
    def rate(self) -> float:
        return self.bytes_written / self.seconds if self.seconds > 0 else 0.0


def load_lock(path: Path) -> dict:
    """A checkpoint lock as glm53.checkpoint writes it: {"repo", "revision", "files": {name: {"size", "sha256"}}}
    (a list of {"path"|"name", ...} is accepted too). A null size or sha256 means the lock does not know it:
    that fact is not checked."""
    try:
        raw = Path(path).read_bytes()
        data = json.loads(raw)
        files = data.get("files", {})
        if isinstance(files, list):
            files = {f.get("path") or f["name"]: f for f in files}
        files = {str(k): {"size": None if v.get("size") is None else int(v["size"]),
                          "sha256": None if v.get("sha256") is None else str(v["sha256"]).lower()}
                 for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"lock file {path} cannot be read ({exc})",
                              "pass the lock file written by glm53 (see glm53 model verify --help)") from None
    return {"repo": data.get("repo"), "revision": data.get("revision"), "files": files,
            "sha256": hashlib.sha256(raw).hexdigest(), "file": Path(path).name}


def make_plan(model_dir: Path, lock: dict | None = None, include_mtp: bool = False) -> PackPlan:
    ck = scan_checkpoint(model_dir)
    es = find_experts(ck, include_mtp=include_mtp)
    if lock is not None:
        _check_lock_sizes(ck, lock)
    layouts, layers = [], []
    for layer in sorted(es.layers):
        lj = es.layers[layer].to_json()
        if lj not in layouts:
            layouts.append(lj)
        layers.append({"layer": layer, "layout": layouts.index(lj)})
    cfg = ck.config
    identity = {
        "format": FORMAT_NAME, "version": VERSION,
        "architecture": (cfg.get("architectures") or [None])[0],
        "config_sha256": ck.config_sha256,
        "tensor_prefix": es.prefix,
        "num_hidden_layers": es.num_hidden_layers, "mtp_layers": es.mtp_layers, "include_mtp": include_mtp,
        "hidden_size": es.hidden, "moe_intermediate_size": es.intermediate, "n_routed_experts": es.n_experts,
        "quantization": {"method": "exl3", "codebook": es.codebook,
                         "k_bits": {p: sorted({lay["k_bits"][p] for lay in layouts}) for p in PROJECTIONS}},
        "layouts": layouts, "layers": layers, "record_count": len(es.parts),
        "shards": [{"name": s.name, "size": s.size, "mtime_ns": s.mtime_ns,
                    "fingerprint": fingerprint(ck.root / s.name, s.size), "sha256": SHA_PLACEHOLDER}
                   for s in ck.shards],
        "lock": None if lock is None else {k: lock[k] for k in ("file", "sha256", "repo", "revision")},
        "source_hint": str(ck.root.absolute()),
    }
    keys = es.keys()
    pos = data_offset_for(len(canonical_json(identity)), len(keys))
    data_offset, offsets = pos, {}
    for k in keys:
        offsets[k] = pos
        pos += es.layers[k[0]].extent
    digest = hashlib.sha256(canonical_json(identity)).hexdigest()
    return PackPlan(ck, es, identity, keys, offsets, data_offset, pos, digest)


def _check_lock_sizes(ck: Checkpoint, lock: dict) -> None:
    """Names, sizes and config.json's sha256 against the lock, before any work (shard sha256s come later)."""
    on_disk = {s.name: s.size for s in ck.shards}
    fix = f"restore it: glm53 model fetch, then glm53 model verify {ck.root} --lock LOCK"
    cfg = lock["files"].get("config.json", {}).get("sha256")
    if cfg is not None and cfg != ck.config_sha256:
        raise CheckpointError(f"{ck.root}/config.json does not match the lock ({lock['repo']}@{lock['revision']})",
                              fix)
    for name, f in lock["files"].items():
        if not name.endswith(".safetensors") or "/" in name:
            continue
        if name not in on_disk:
            raise CheckpointError(f"shard {name} of the lock ({lock['repo']}@{lock['revision']}) is missing from "
                                  f"{ck.root}", fix)
        if f["size"] is not None and on_disk[name] != f["size"]:
            raise CheckpointError(f"shard {name} is {on_disk[name]} bytes in {ck.root}, the lock says {f['size']}",
                                  fix)


class Journal:
    """Append-only JSON lines: a binding line, then {"r": [layer, expert, xxh3, sha256]} / {"s": [name, sha]}."""

    def __init__(self, path: Path, digest: str):
        self.path, self.digest = path, digest
        self.records: dict[tuple[int, int], tuple[int, bytes]] = {}
        self.shards: dict[str, str] = {}
        self._f = None

    def load(self) -> bool:
        """Read an existing journal; False when there is none or it belongs to another plan."""
        try:
            lines = self.path.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            return False
        try:
            first = json.loads(lines[0])
            if first != {"journal": JOURNAL_MAGIC, "plan": self.digest}:
                return False
        except (ValueError, IndexError):
            return False
        for line in lines[1:]:
            try:
                d = json.loads(line)
            except ValueError:
                break               # a torn last line from a crash: everything before it stands
            if "r" in d:
                layer, expert, x, s = d["r"]
                self.records[(int(layer), int(expert))] = (int(x, 16), bytes.fromhex(s))
            elif "s" in d:
                self.shards[d["s"][0]] = d["s"][1]
        return True

    def start(self, fresh: bool) -> None:
        if fresh:
            self.records, self.shards = {}, {}
            with open(self.path, "w") as f:
                f.write(json.dumps({"journal": JOURNAL_MAGIC, "plan": self.digest}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        else:
            # Rewrite without a possibly torn tail, so new lines never follow half a line.
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w") as f:
                f.write(json.dumps({"journal": JOURNAL_MAGIC, "plan": self.digest}) + "\n")
                f.writelines(self._line_r(k, *v) for k, v in sorted(self.records.items()))
                f.writelines(json.dumps({"s": [n, s]}) + "\n" for n, s in sorted(self.shards.items()))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        self._f = open(self.path, "a")

    @staticmethod
    def _line_r(key: tuple[int, int], x: int, s: bytes) -> str:
        return json.dumps({"r": [key[0], key[1], f"{x:016x}", s.hex()]}) + "\n"

    def append(self, records: list[tuple[tuple[int, int], int, bytes]], shards: list[tuple[str, str]]) -> None:
        for key, x, s in records:
            self.records[key] = (x, s)
            self._f.write(self._line_r(key, x, s))
        for name, sha in shards:
            self.shards[name] = sha
            self._f.write(json.dumps({"s": [name, sha]}) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _full_error(exc: OSError, where: Path, done: int, total: int, needed: int) -> DiskFullError:
    free = _free_bytes(where.parent)
    why = "a file-size limit (ulimit -f)" if exc.errno == errno.EFBIG else "a full disk"
    return DiskFullError(f"writing {where} stopped by {why} ({os.strerror(exc.errno)}) after {done} of {total} "
                         f"records; {gb(free)} free on the filesystem holding {where.parent}, the store needs "
                         f"{gb(needed)} in all", "free space there (or lift the limit) and rerun the same "
                         "command: it resumes where it stopped; or pass --out on a disk with room")


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class Packer:
    def __init__(self, plan: PackPlan, out: Path, threads: int, direct: bool, progress: bool, log,
                 lock_files: dict | None = None):
        self.plan, self.out, self.threads, self.direct, self.progress, self.log = \
            plan, out, max(1, threads), direct, progress, log
        self.lock_files = lock_files or {}
        self.partial = out.with_name(out.name + ".partial")
        self.journal = Journal(out.with_name(out.name + ".partial.journal"), plan.digest)
        self.stop = threading.Event()
        self.hashed = 0
        self._lock = threading.Lock()
        self.resumed = 0

    # -- resume ---------------------------------------------------------------------------------------------
    def _resume_state(self) -> bool:
        """True when a partial from this same plan exists; its journaled records are re-checked."""
        if not (self.partial.exists() and self.journal.load()):
            return False
        if os.stat(self.partial).st_size != self.plan.file_size:
            return False
        keep = {}
        if self.journal.records:
            fd, _ = open_for_read(self.partial, allow_buffered=True)
            buf = alloc_aligned(max(lay.extent for lay in self.plan.es.layers.values()))
            try:
                for key, (x, s) in self.journal.records.items():
                    ext = self.plan.es.layers[key[0]].extent if key in self.plan.offsets else 0
                    if ext and pread_into(fd, memoryview(buf[:ext]), self.plan.offsets[key]) == ext \
                            and record_digests(buf[:ext]) == (x, s):
                        keep[key] = (x, s)
            finally:
                os.close(fd)
        dropped = len(self.journal.records) - len(keep)
        self.journal.records = keep
        self.resumed = len(keep)
        self.log(f"pack-store: resuming {self.partial}: {len(keep)} of {len(self.plan.keys)} records already "
                 f"done and re-checked" + (f" ({dropped} failed the re-check and will be redone)" if dropped else ""))
        return True

    def _check_space(self) -> None:
        allocated = os.stat(self.partial).st_blocks * 512 if self.partial.exists() else 0
        needed = max(0, self.plan.file_size - allocated)
        free = _free_bytes(self.out.parent)
        if needed > free:
            both = (f" (the existing {self.out.name} is only removed once the new store is complete: delete it "
                    "first if the disk cannot hold both)") if self.out.exists() else ""
            raise DiskFullError(f"not enough free space for {self.out}: the store needs {gb(needed)} more, "
                                f"{gb(free)} is free on the filesystem holding {self.out.parent}",
                                f"free at least {gb(needed - free)} there, or pass --out on a disk with room{both}")

    # -- the work ---------------------------------------------------------------------------------------------
    def run(self) -> PackResult:
        resume = self._resume_state()
        if not resume:
            for p in (self.partial, self.journal.path):
                p.unlink(missing_ok=True)
        self._check_space()
        self.journal.start(fresh=not resume)
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if self.direct else 0)
        fd = os.open(self.partial, flags, 0o644)
        todo = [k for k in self.plan.keys if k not in self.journal.records]
        total_bytes = sum(self.plan.es.layers[k[0]].extent for k in self.plan.keys)
        try:
            try:
                os.posix_fallocate(fd, 0, self.plan.file_size)    # claim the space now: ENOSPC at 0%, not 90%
            except OSError as exc:
                if exc.errno in FULL_ERRNOS:
                    raise _full_error(exc, self.partial, self.resumed, len(self.plan.keys), self.plan.file_size) \
                        from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                    raise
            t0 = time.perf_counter()
            written = self._write_records(fd, todo, total_bytes)
            shard_sha = dict(self.journal.shards)
            self._finish(fd, shard_sha)
            seconds = time.perf_counter() - t0
        finally:
            os.close(fd)
            self.journal.close()
        self._publish()
        return PackResult(self.out, False, len(self.plan.keys), written, seconds, self.resumed)

    def _write_records(self, fd: int, todo: list[tuple[int, int]], total_bytes: int) -> int:
        plan = self.plan
        done_bytes = sum(plan.es.layers[k[0]].extent for k in self.journal.records)
        bar = ProgressMeter("pack-store", total_bytes, initial=done_bytes, enabled=self.progress)
        local = threading.local()
        max_extent = max(lay.extent for lay in plan.es.layers.values())
        src = SourceReader(plan.ck, plan.es)
        shard_todo = [s for s in plan.ck.shards if s.name not in self.journal.shards]
        total_hash = sum(s.size for s in shard_todo) or 1

        def pack_one(key: tuple[int, int]):
            if self.stop.is_set():
                return None
            if not hasattr(local, "buf"):
                local.buf = alloc_aligned(max_extent)
            ext = plan.es.layers[key[0]].extent
            view = local.buf[:ext]
            src.fill(key[0], key[1], view)
            x, s = record_digests(view)
            pwrite_from(fd, memoryview(view), plan.offsets[key])
            bar.update(ext)
            return "r", key, x, s

        def hash_shard(name: str):
            h = hashlib.sha256()
            with open(plan.ck.root / name, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while not self.stop.is_set():
                    chunk = f.read(HASH_CHUNK)
                    if not chunk:
                        return "s", name, h.hexdigest()
                    h.update(chunk)
                    with self._lock:
                        self.hashed += len(chunk)
            return None

        rec_pool = ThreadPoolExecutor(self.threads, thread_name_prefix="glm53-pack")
        hash_pool = ThreadPoolExecutor(max(1, self.threads // 4), thread_name_prefix="glm53-hash")
        pending: set[Future] = {rec_pool.submit(pack_one, k) for k in todo}
        pending |= {hash_pool.submit(hash_shard, s.name) for s in shard_todo}
        # Each future reports itself done on a queue: `wait(pending, FIRST_COMPLETED)` would walk every pending
        # future on each wake-up, quadratic in the record count (12,096 for the real model).
        landed: queue.SimpleQueue[Future] = queue.SimpleQueue()
        for f in pending:
            f.add_done_callback(landed.put)
        done_recs, done_shards, written, error = [], [], 0, None
        last_flush = time.perf_counter()
        try:
            while pending:
                finished = _drain(landed, FLUSH_EVERY_S)
                pending.difference_update(finished)
                for f in finished:
                    try:
                        res = f.result()
                    except BaseException as exc:          # keep draining: finished records still get journaled
                        error = error or exc
                        self.stop.set()
                        continue
                    if res is None:
                        continue
                    if res[0] == "r":
                        done_recs.append(res[1:])
                        written += plan.es.layers[res[1][0]].extent
                    else:
                        done_shards.append(res[1:])
                bar.note(f"checkpoint sha256 {100 * self.hashed // total_hash}%")
                if time.perf_counter() - last_flush >= FLUSH_EVERY_S or not pending:
                    self._flush(fd, done_recs, done_shards)
                    done_recs, done_shards = [], []
                    last_flush = time.perf_counter()
        except BaseException as exc:                        # Ctrl-C lands here, in the main thread
            error = error or exc
            self.stop.set()
            rec_pool.shutdown(wait=True, cancel_futures=True)
            hash_pool.shutdown(wait=True, cancel_futures=True)
            for f in pending:
                if f.done() and not f.cancelled() and f.exception() is None and f.result() is not None:
                    res = f.result()
                    (done_recs if res[0] == "r" else done_shards).append(res[1:])
        finally:
            rec_pool.shutdown(wait=True, cancel_futures=True)
            hash_pool.shutdown(wait=True, cancel_futures=True)
            try:
                self._flush(fd, done_recs, done_shards)
            except OSError as exc:          # e.g. the disk filled up under the journal: those records are redone
                error = error or exc
            src.close()
            bar.close()
        if error is not None:
            raise self._stopped(error)
        self.log(f"pack-store: {len(todo)} records, {gb(written)} written at {bar.rate() / 1e9:.2f} GB/s")
        return written

    def _flush(self, fd: int, recs: list, shards: list) -> None:
        """Data first (fdatasync), then the journal lines that vouch for it."""
        if recs:
            os.fdatasync(fd)
        if recs or shards:
            self.journal.append(recs, shards)

    def _stopped(self, exc: BaseException) -> BaseException:
        done, total = len(self.journal.records), len(self.plan.keys)
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return _full_error(exc, self.partial, done, total, self.plan.file_size)
        if isinstance(exc, StoreError):
            return exc
        how = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"stopped by an error ({exc!r})"
        err = PackInterrupted(f"pack-store {how} after {done} of {total} records; the work so far is kept in "
                              f"{self.partial}", "rerun the same command: it resumes where it stopped")
        err.__cause__ = exc
        return err

    def _finish(self, fd: int, shard_sha: dict[str, str]) -> None:
        plan = self.plan
        lock = plan.identity["lock"]
        ident = json.loads(plan.identity_bytes())
        for s in ident["shards"]:
            s["sha256"] = shard_sha[s["name"]]
        if lock is not None:
            self._check_lock_hashes(ident["shards"])
        identity = canonical_json(ident)
        if len(identity) != len(plan.identity_bytes()):
            raise StoreFormatError("internal: the identity block changed length while packing",
                                   "report this as a bug")
        entries = [RecordEntry(k[0], k[1], plan.offsets[k], plan.es.layers[k[0]].length, *self.journal.records[k])
                   for k in plan.keys]
        head = header_region(identity, entries, plan.file_size)
        assert len(head) == plan.data_offset
        buf = alloc_aligned(len(head))
        buf[:] = memoryview(head)
        pwrite_from(fd, memoryview(buf), 0)
        os.fsync(fd)

    def _check_lock_hashes(self, shards: list[dict]) -> None:
        want = self.lock_files
        for s in shards:
            f = want.get(s["name"])
            if f is not None and f["sha256"] is not None and f["sha256"] != s["sha256"]:
                for p in (self.partial, self.journal.path):
                    p.unlink(missing_ok=True)
                raise CheckpointError(f"shard {s['name']} in {self.plan.ck.root} does not match the lock "
                                      f"(sha256 {s['sha256'][:12]}…, the lock says {f['sha256'][:12]}…): "
                                      "the checkpoint is not the pinned revision",
                                      f"re-download it (glm53 model fetch) and check it with glm53 model verify "
                                      f"{self.plan.ck.root} --lock LOCK")

    def _publish(self) -> None:
        os.replace(self.partial, self.out)
        dfd = os.open(self.out.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
            self.journal.path.unlink(missing_ok=True)
            os.fsync(dfd)
        finally:
            os.close(dfd)


@dataclass
class PackOptions:
    model_dir: Path
    out: Path
    threads: int = 4
    lock: Path | None = None
    include_mtp: bool = False
    progress: bool = True
    verify: bool = True
    allow_buffered: bool = False
    verify_threads: int = 4


def _same_checkpoint(head_ident: dict, plan: PackPlan, lock: dict | None) -> str | None:
    """None when an existing store's identity matches the plan; else the reason it does not."""
    def strip(d: dict) -> dict:
        d = json.loads(canonical_json(d))
        d.pop("source_hint", None)
        d.pop("lock", None)
        for s in d["shards"]:
            s.pop("sha256", None)
            s.pop("mtime_ns", None)      # a copied checkpoint has new mtimes; the fingerprint covers content
        return d

    if strip(head_ident) != strip(plan.identity):
        return "it was packed from a different checkpoint or with other options"
    if lock is not None:
        for s in head_ident["shards"]:
            f = lock["files"].get(s["name"])
            if f is not None and f["sha256"] is not None and f["sha256"] != s["sha256"]:
                return f"its shard {s['name']} does not match the lock's sha256"
    return None


def _unwritable(out: Path, exc: OSError) -> StoreError:
    return StoreError(f"cannot write the store {out}: {exc.strerror or exc} ({exc.filename or out.parent})",
                      "pass --out in a writable directory (in docker: mount the store's volume read-write)")


def pack_store(opts: PackOptions, log=print, warn=None) -> PackResult:
    """Pack (or re-verify an existing sound store). Raises StoreError subclasses with a fix."""
    out = Path(opts.out).absolute()
    model_dir = Path(opts.model_dir)
    if out.is_dir():
        raise StoreError(f"--out {out} is a directory", f"name the store file, e.g. --out {out / 'experts.glm53'}")
    if not out.parent.is_dir():
        raise StoreError(f"the directory for {out} does not exist", f"create it first: mkdir -p {out.parent}")
    lock = load_lock(opts.lock) if opts.lock else None
    plan = make_plan(model_dir, lock, opts.include_mtp)
    warn = warn or log
    if out.exists():
        try:
            head = read_header(out)
            reason = _same_checkpoint(head.identity, plan, lock)
            if reason is None:
                problems = identity_problems(head, plan.ck, out)
                reason = problems[0].what if problems else None
        except StoreFormatError as exc:
            reason = exc.problem
        if reason is None:
            log(f"pack-store: {out} is already a store for this checkpoint; verifying it instead of repacking")
            rep = full_verify(out, model_dir, threads=opts.verify_threads, allow_buffered=opts.allow_buffered,
                              warn=warn, progress=opts.progress)
            if rep.ok:
                return PackResult(out, True, len(plan.keys), verify=rep)
            reason = rep.problems[0].what
        log(f"pack-store: {out} exists but {reason}; repacking (it is replaced only when the new store is complete)")
    try:
        direct = dir_supports_direct(out.parent)
    except OSError as exc:
        raise _unwritable(out, exc) from None
    if not direct and not opts.allow_buffered:
        raise DirectIOUnsupported(f"the filesystem holding {out.parent} does not support O_DIRECT, so the engine "
                                  "could not read the store there", "pass --out on an ext4 or xfs filesystem, or "
                                  "set GLM53_ALLOW_BUFFERED_READS=1 to accept slower buffered reads")
    log(f"pack-store: {len(plan.keys)} records ({len(plan.es.layers)} layers x {plan.es.n_experts} experts, "
        f"{plan.es.layers[plan.keys[0][0]].extent / 2**20:.2f} MiB each) from {len(plan.ck.shards)} shard(s) of "
        f"{model_dir} -> {out} ({gb(plan.file_size)})")
    packer = Packer(plan, out, opts.threads, direct, opts.progress, log, lock["files"] if lock else None)
    try:
        result = packer.run()
    except (PermissionError, IsADirectoryError) as exc:
        raise _unwritable(out, exc) from None
    except OSError as exc:
        if exc.errno != errno.EROFS:
            raise
        raise _unwritable(out, exc) from None
    log(f"pack-store: published {out}")
    if opts.verify:
        rep = full_verify(out, model_dir, threads=opts.verify_threads, allow_buffered=opts.allow_buffered, warn=warn,
                          progress=opts.progress)
        result.verify = rep
        if not rep.ok:
            raise StoreError(f"the freshly packed {out} failed its verify: {rep.problems[0].what}",
                             f"check the disk (dmesg, smartctl), then {pack_command(out, model_dir)}")
    return result


def _drain(landed: queue.SimpleQueue, timeout: float) -> list[Future]:
    """The futures done so far: at least one, or none after `timeout` seconds."""
    try:
        out = [landed.get(timeout=timeout)]
    except queue.Empty:
        return []
    while True:
        try:
            out.append(landed.get_nowait())
        except queue.Empty:
            return out
