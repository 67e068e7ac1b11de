"""Checkpoint identity: `glm53 model verify | lock | fetch`.

A checkpoint is identified by a lock file: the upstream repo, the pinned revision, and the size and sha256 of
every file at that revision. `verify` checks a directory against it (hashing with a progress bar) and, since
exllamav3 reads tensors from the safetensors headers on disk while other loaders trust
model.safetensors.index.json, it also reads every header and reports tensors the index omits. The published
3.05 bpw branch omits the 22 DSA k-pool tensors kept in kpool_aux.safetensors; `--repair-index` adds such
entries to the index (atomic rewrite; the upstream index is kept beside it as `<index>.upstream` so the lock
can still be checked; no weight file is ever opened for writing).

Where a lock does not know a file's size or hash (the shipped lock for the real checkpoint only knows a few
file names: nobody here could download it), verify checks what it can, says exactly what it could not, and
fails only with --strict.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from store import safetensors_header as st

LOCK_FORMAT = 1
DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_LOCK = DATA_DIR / "glm-5.3-flash-exl3-3.05bpw.lock.json"
INDEX = "model.safetensors.index.json"
UPSTREAM_SUFFIX = ".upstream"
# Not part of a checkpoint: huggingface_hub's download bookkeeping inside a local_dir
IGNORED_DIRS = (".cache",)
_HASH_CHUNK = 8 << 20


class CheckpointError(Exception):
    """A problem the user must fix; the message names it and the fix."""


# --------------------------------------------------------------------------------------------------------------
# Lock files


@dataclass(frozen=True)
class LockEntry:
    size: int | None = None      # None: not known to whoever wrote the lock
    sha256: str | None = None


@dataclass
class Lock:
    repo: str
    revision: str
    files: dict[str, LockEntry]
    complete: bool = True        # False: the lock does not list every file of the revision
    notes: list[str] = field(default_factory=list)
    source: Path | None = None

    @property
    def pinned(self) -> str:
        return f"{self.repo}@{self.revision}"

    def fully_known(self, name: str) -> bool:
        e = self.files[name]
        return e.size is not None and e.sha256 is not None


def load_lock(path: Path) -> Lock:
    """Read a lock: {"repo", "revision", "files": {name: {"size", "sha256"}}} (a list of {"path"|"name", ...}
    is accepted too). size / sha256 may be null where unknown."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        files_raw = data["files"]
        if isinstance(files_raw, list):
            files_raw = {f.get("path") or f["name"]: f for f in files_raw}
        files = {}
        for name, e in files_raw.items():
            size = e.get("size")
            sha = e.get("sha256")
            if size is not None and (not isinstance(size, int) or size < 0):
                raise ValueError(f"{name}: size {size!r} is not a byte count")
            if sha is not None:
                sha = str(sha).lower()
                if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
                    raise ValueError(f"{name}: sha256 {e.get('sha256')!r} is not 64 hex digits")
            files[str(name)] = LockEntry(size, sha)
        return Lock(str(data["repo"]), str(data["revision"]), files, bool(data.get("complete", True)),
                    list(data.get("notes", [])), path)
    except FileNotFoundError:
        raise CheckpointError(f"lock file {path} does not exist") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"lock file {path} cannot be read: {exc}") from None


def checkpoint_files(root: Path) -> list[str]:
    """Relative paths of the files that make up a checkpoint directory (download bookkeeping and our own
    `.upstream` / `.partial` side files excluded)."""
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] in IGNORED_DIRS or not p.is_file():
            continue
        if p.name.endswith((UPSTREAM_SUFFIX, ".partial")):
            continue
        out.append(rel.as_posix())
    return out


def make_lock(root: Path, repo: str, revision: str, progress: bool = True) -> dict:
    root = Path(root)
    names = checkpoint_files(root)
    if not names:
        raise CheckpointError(f"{root} holds no files to lock")
    hashes = hash_files(root, names, progress)
    return {"format": LOCK_FORMAT, "repo": repo, "revision": revision, "complete": True,
            "files": {n: {"size": (root / n).stat().st_size, "sha256": hashes[n]} for n in names}}


# --------------------------------------------------------------------------------------------------------------
# Hashing


def hash_files(root: Path, names: list[str], progress: bool = True, workers: int | None = None) -> dict[str, str]:
    """sha256 of each file, several files at a time (hashlib releases the GIL on large updates), with one
    progress bar over all bytes."""
    from tqdm import tqdm

    total = sum((root / n).stat().st_size for n in names)
    lock = threading.Lock()
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="sha256", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)

    def one(name: str) -> str:
        h = hashlib.sha256()
        with open(root / name, "rb", buffering=0) as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
                with lock:
                    bar.update(len(chunk))
        return h.hexdigest()

    try:
        with ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1)) as pool:
            return dict(zip(names, pool.map(one, names), strict=True))
    finally:
        bar.close()


# --------------------------------------------------------------------------------------------------------------
# Safetensors headers and the index


def read_safetensors_header(path: Path) -> dict[str, st.TensorInfo]:
    """Tensor name -> its dtype, shape and data offsets from a file's header (store.safetensors_header), after
    checking that the data it describes is exactly what the file holds (catches truncation and appends)."""
    try:
        head = st.read_safetensors_header(path)
    except st.SafetensorsHeaderError as exc:
        raise CheckpointError(str(exc)) from None
    if head.data_start + head.data_end != head.file_size:
        want, size = head.data_start + head.data_end, head.file_size
        raise CheckpointError(f"{path.name}: the header describes {want} bytes, the file has {size} "
                              f"({'truncated' if size < want else 'extra bytes at the end'})")
    return head.tensors


@dataclass
class IndexReport:
    present: bool
    missing: dict[str, str] = field(default_factory=dict)      # tensor -> file holding it, absent from the index
    dangling: dict[str, str] = field(default_factory=dict)     # index entry -> file it names that lacks it
    duplicates: dict[str, list[str]] = field(default_factory=dict)  # tensor -> files that all hold it


def tensors_on_disk(root: Path, problems: list[str]) -> dict[str, list[str]]:
    """Tensor name -> files holding it, over every *.safetensors file in root (what exllamav3 globs)."""
    where: dict[str, list[str]] = {}
    for p in sorted(root.glob("*.safetensors")):
        try:
            names = read_safetensors_header(p)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        for name in names:
            where.setdefault(name, []).append(p.name)
    return where


def check_index(root: Path, where: dict[str, list[str]]) -> IndexReport:
    path = root / INDEX
    if not path.exists():
        return IndexReport(present=False)
    try:
        weight_map: dict[str, str] = json.loads(path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{INDEX} cannot be read ({exc})") from None
    rep = IndexReport(present=True)
    for name, files in where.items():
        if len(files) > 1:
            rep.duplicates[name] = files
        if name not in weight_map:
            rep.missing[name] = files[0]
    for name, fname in weight_map.items():
        if fname not in where.get(name, []):
            rep.dangling[name] = fname
    return rep


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def repair_index(root: Path, missing: dict[str, str]) -> Path:
    """Add the missing entries to the index. The upstream index is first copied to `<index>.upstream` (once),
    then the new index replaces the old atomically. Only these two JSON files are written."""
    path = root / INDEX
    raw = path.read_bytes()
    upstream = root / (INDEX + UPSTREAM_SUFFIX)
    if not upstream.exists():
        _atomic_write(upstream, raw)
    index = json.loads(raw)
    wm = index["weight_map"]
    added = 0
    for name, fname in missing.items():
        wm[name] = fname
        added += _tensor_nbytes(root / fname, name)
    index["weight_map"] = dict(sorted(wm.items()))
    meta = index.setdefault("metadata", {})
    if isinstance(meta.get("total_size"), int):
        meta["total_size"] += added
    _atomic_write(path, (json.dumps(index, indent=2) + "\n").encode())
    return path


def _tensor_nbytes(path: Path, name: str) -> int:
    return read_safetensors_header(path)[name].nbytes


def _repaired_index_ok(root: Path, where: dict[str, list[str]]) -> str | None:
    """None if the current index is the upstream one plus entries for tensors that are on disk, else why not."""
    try:
        up = json.loads((root / (INDEX + UPSTREAM_SUFFIX)).read_text())["weight_map"]
        cur = json.loads((root / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"cannot compare {INDEX} with {INDEX}{UPSTREAM_SUFFIX} ({exc})"
    changed = [n for n, f in up.items() if cur.get(n) != f]
    if changed:
        return f"{len(changed)} upstream entries were changed or removed (first: {changed[0]})"
    extra = [n for n in cur if n not in up and cur[n] not in where.get(n, [])]
    if extra:
        return f"{len(extra)} added entries name tensors that are not on disk (first: {extra[0]})"
    return None


# --------------------------------------------------------------------------------------------------------------
# Verify


@dataclass
class VerifyResult:
    problems: list[str] = field(default_factory=list)   # each one makes the checkpoint unusable as pinned
    warnings: list[str] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)  # lock entries whose size or hash the lock does not know
    hashed: list[str] = field(default_factory=list)
    unhashed: list[str] = field(default_factory=list)  # size matched; the lock's sha256 not checked (quick check)
    repaired: int = 0
    tensors: int = 0

    def ok(self, strict: bool = False) -> bool:
        return not self.problems and not (strict and self.unverified)


def verify(root: Path, lock: Lock, *, repair: bool = False, progress: bool = True, hash_limit: int | None = None,
           missing_index_entries_are_problems: bool = True) -> VerifyResult:
    """Check `root` against `lock`. hash_limit: files larger than this are checked by size only (the quick
    check at start-up). missing_index_entries_are_problems=False reports them as a warning (exllamav3 reads
    the headers, so serving does not need the index repaired)."""
    root = Path(root)
    r = VerifyResult()
    if not root.is_dir():
        r.problems.append(f"{root} is not a directory: fetch the checkpoint first (glm53 model fetch --out {root})")
        return r
    on_disk = set(checkpoint_files(root))
    upstream_index = (root / (INDEX + UPSTREAM_SUFFIX)).exists()

    # 1. Names and sizes from the lock
    to_hash: dict[str, str] = {}  # lock name -> file whose bytes must match it
    for name, e in sorted(lock.files.items()):
        target = INDEX + UPSTREAM_SUFFIX if name == INDEX and upstream_index else name
        p = root / target
        if not p.is_file():
            r.problems.append(f"{name}: missing (the lock for {lock.pinned} lists it)")
            continue
        if e.size is not None and p.stat().st_size != e.size:
            r.problems.append(f"{name}: {p.stat().st_size} bytes, the lock says {e.size} "
                              f"({'truncated' if p.stat().st_size < e.size else 'too long'})")
            continue
        if e.sha256 is not None and (hash_limit is None or p.stat().st_size <= hash_limit):
            to_hash[name] = target
        elif e.sha256 is not None:
            r.unhashed.append(name)
        if not lock.fully_known(name):
            r.unverified.append(name)
    extra = sorted(on_disk - set(lock.files))
    if lock.complete:
        for name in extra:
            if name.endswith(".safetensors"):
                # exllamav3 loads every *.safetensors in the directory, so a stray one changes the model
                r.problems.append(f"{name}: on disk but not in the lock (exllamav3 would load its tensors: remove it)")
            else:
                r.warnings.append(f"{name}: on disk but not in the lock")
    elif extra:
        r.warnings.append(f"{len(extra)} files on disk are not named by the (incomplete) lock and were not checked "
                          f"against it: {', '.join(extra[:6])}{', …' if len(extra) > 6 else ''}")

    # 2. Hashes
    if to_hash:
        got = hash_files(root, list(to_hash.values()), progress)
        for name, target in to_hash.items():
            want = lock.files[name].sha256
            if got[target] != want:
                r.problems.append(f"{name}: sha256 {got[target][:16]}… does not match the lock ({want[:16]}…): "
                                  "the file is damaged or from another revision")
            else:
                r.hashed.append(name)

    # 3. Headers on disk and the index
    where = tensors_on_disk(root, r.problems)
    r.tensors = len(where)
    try:
        rep = check_index(root, where)
    except CheckpointError as exc:
        r.problems.append(str(exc))
        return r
    for name, files in sorted(rep.duplicates.items()):
        r.problems.append(f"tensor {name} is in several files ({', '.join(files)}): loaders disagree on which wins")
    for name, fname in sorted(rep.dangling.items()):
        r.problems.append(f"{INDEX} maps {name} to {fname}, which does not hold it")
    if rep.missing:
        files = sorted(set(rep.missing.values()))
        known = " (the known omission of the published 3.05 bpw branch)" if files == ["kpool_aux.safetensors"] else ""
        msg = (f"{len(rep.missing)} tensors in {', '.join(files)} are missing from {INDEX}{known}: loaders that "
               f"read the index lose them")
        if repair:
            repair_index(root, rep.missing)
            r.repaired = len(rep.missing)
            r.warnings.append(msg + f"; added them to the index ({INDEX}{UPSTREAM_SUFFIX} keeps the upstream one)")
        elif missing_index_entries_are_problems:
            r.problems.append(msg + "; fix: glm53 model verify DIR --repair-index")
        else:
            r.warnings.append(msg + f"; fix: glm53 model verify {root} --repair-index")
    if upstream_index and (why := _repaired_index_ok(root, where)) is not None:
        r.problems.append(f"{INDEX} differs from the upstream index in ways a repair does not explain: {why}")
    if not rep.present and len(list(root.glob("*.safetensors"))) > 1:
        r.warnings.append(f"no {INDEX}: exllamav3 does not need it, but loaders that read it will fail")
    return r


# --------------------------------------------------------------------------------------------------------------
# Which lock applies, and the quick check at start-up

QUICK_HASH_LIMIT = 16 << 20   # at start-up only the small files (config, index, tokenizer) are hashed


def claims_pinned(config: dict) -> bool:
    """Does config.json describe GLM-5.3-Flash (its layer count, width and experts)? Generated test checkpoints,
    narrower or shallower, do not, so no lock applies to them."""
    from glm53.planning.shape import DEFAULT_SHAPE as real

    text = config.get("text_config") or config
    try:
        dims = (int(text["num_hidden_layers"]), int(text["hidden_size"]),
                int(text.get("n_routed_experts") or text["num_experts"]))
    except (KeyError, TypeError, ValueError):
        return False
    return dims == (real.layers, real.hidden, real.experts_per_layer)


def lock_for(root: Path, config: dict, locks: Path = DATA_DIR) -> Lock | None:
    """The shipped lock this checkpoint claims to match: one whose config.json sha256 is the checkpoint's, or,
    where a lock does not know that hash, any lock when the config has the pinned model's shape."""
    config_path = Path(root) / "config.json"
    digest = hashlib.sha256(config_path.read_bytes()).hexdigest() if config_path.is_file() else None
    claims = claims_pinned(config)
    for path in sorted(Path(locks).glob("*.lock.json")):
        lock = load_lock(path)
        known = lock.files.get("config.json")
        if (known and known.sha256 and known.sha256 == digest) or claims:
            return lock
    return None


def quick_check(root: Path, lock: Lock) -> VerifyResult:
    """What start-up can afford: names and sizes against the lock, the small files' sha256, the headers against
    the index. Weights are not hashed (glm53 model verify does that)."""
    return verify(root, lock, progress=False, hash_limit=QUICK_HASH_LIMIT, missing_index_entries_are_problems=False)


def quick_check_lines(r: VerifyResult, lock: Lock, root: Path) -> list[str]:
    """The start-up log lines of a quick check that found no problem: never "verified" for what was not."""
    lines = [f"checkpoint identity: {root} has the names and sizes of {lock.pinned} that its lock knows"
             f"{f', and the sha256 of {len(r.hashed)} small files' if r.hashed else ''}"]
    if r.unverified:
        lines.append(f"checkpoint identity NOT VERIFIED: the lock knows neither size nor sha256 of "
                     f"{len(r.unverified)} file(s) ({', '.join(r.unverified[:4])}{', …' if len(r.unverified) > 4 else ''})"
                     f": only their presence was checked")
    if r.unhashed:
        lines.append(f"checkpoint identity: sha256 of {len(r.unhashed)} weight file(s) not checked at start-up: "
                     f"run `glm53 model verify {root}` for that")
    if not lock.complete:
        lines.append("checkpoint identity NOT VERIFIED for files the lock does not name (its file list is incomplete)")
    lines += [f"checkpoint warning: {w}" for w in r.warnings]
    return lines


def report(r: VerifyResult, lock: Lock, root: Path, strict: bool) -> str:
    lines = []
    for w in r.warnings:
        lines.append(f"  warning: {w}")
    for p in r.problems:
        lines.append(f"  PROBLEM: {p}")
    lines.append(f"  {len(r.hashed)} files match the lock's size and sha256; {r.tensors} tensors read from the "
                 f"safetensors headers on disk" + (f"; {r.repaired} index entries added" if r.repaired else ""))
    if r.unverified:
        lines.append(f"  NOT VERIFIED: the lock ({lock.source.name if lock.source else 'lock'}) does not know the "
                     f"size and sha256 of {len(r.unverified)} file(s) ({', '.join(r.unverified[:5])}"
                     f"{', …' if len(r.unverified) > 5 else ''}): only their presence was checked")
    if not lock.complete:
        lines.append(f"  NOT VERIFIED: the lock does not list every file of {lock.pinned}, so files it does not "
                     f"name were checked only for readable safetensors headers")
    if not r.ok(strict):
        verdict = "FAILED"
    elif r.unverified or not lock.complete:
        verdict = "no problems found, but identity NOT fully verified"
    else:
        verdict = "verified"
    lines.insert(0, f"{root}: {verdict} against {lock.pinned}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------
# Fetch


def fetch(out: Path, lock: Lock, progress: bool = True) -> tuple[bool, str]:
    """Download the pinned revision with huggingface_hub (resumes partial downloads), then verify it, repairing
    the known index omission. Returns (ok, message)."""
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id=lock.repo, revision=lock.revision, local_dir=str(out))
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        return False, "\n".join([
            f"glm53 model fetch: could not download {lock.pinned} into {out}: {type(exc).__name__}: {reason}",
            "  (HF_HUB_OFFLINE is set: downloads are disabled)" if offline else
            "  (no network, or the repo / revision is not reachable from here)",
            "  To place the files by hand: on a machine with network access run",
            f"    hf download {lock.repo} --revision {lock.revision} --local-dir {out.name}",
            f"  (or: huggingface-cli download ... with the same arguments), copy that directory to {out},",
            f"  then check it: glm53 model verify {out} --repair-index",
        ])
    r = verify(out, lock, repair=True, progress=progress)
    return r.ok(), report(r, lock, out, strict=False)


# --------------------------------------------------------------------------------------------------------------
# CLI


def register(sub) -> None:
    p = sub.add_parser("model", help="checkpoint identity: verify, lock, fetch the pinned GLM-5.3-Flash EXL3")
    msub = p.add_subparsers(dest="model_cmd", metavar="ACTION", required=True)

    v = msub.add_parser("verify", help="check a checkpoint against a lock (size + sha256) and its index vs disk")
    v.add_argument("dir", type=Path)
    v.add_argument("--lock", type=Path, default=DEFAULT_LOCK,
                   help=f"lock file (default: the shipped {DEFAULT_LOCK.name})")
    v.add_argument("--repair-index", action="store_true",
                   help=f"add tensors found on disk but missing from {INDEX} to it (atomic; weights untouched)")
    v.add_argument("--strict", action="store_true", help="fail when the lock cannot vouch for every file")
    v.add_argument("--no-progress", action="store_true")
    v.set_defaults(func=_run_verify)

    lk = msub.add_parser("lock", help="write a lock (size + sha256 of every file) for a checkpoint directory")
    lk.add_argument("dir", type=Path)
    lk.add_argument("--repo", required=True)
    lk.add_argument("--revision", required=True)
    lk.add_argument("--out", type=Path, help="lock file to write (default: DIR.lock.json beside DIR)")
    lk.add_argument("--no-progress", action="store_true")
    lk.set_defaults(func=_run_lock)

    f = msub.add_parser("fetch", help="download the pinned revision (resumable) and verify it")
    f.add_argument("--out", type=Path, default=Path(os.environ.get("GLM53_MODEL_DIR") or "models/GLM-5.3-Flash-exl3"),
                   help="download directory (default: $GLM53_MODEL_DIR, else models/GLM-5.3-Flash-exl3)")
    f.add_argument("--lock", type=Path, default=DEFAULT_LOCK)
    f.add_argument("--no-progress", action="store_true")
    f.set_defaults(func=_run_fetch)


def _run_verify(args) -> int:
    try:
        lock = load_lock(args.lock)
        r = verify(args.dir, lock, repair=args.repair_index, progress=not args.no_progress)
    except CheckpointError as exc:
        print(f"glm53 model verify: {exc}", file=sys.stderr)
        return 2
    print(report(r, lock, args.dir, args.strict))
    return 0 if r.ok(args.strict) else 1


def _run_lock(args) -> int:
    out = args.out or args.dir.with_name(args.dir.name + ".lock.json")
    try:
        data = make_lock(args.dir, args.repo, args.revision, progress=not args.no_progress)
    except CheckpointError as exc:
        print(f"glm53 model lock: {exc}", file=sys.stderr)
        return 2
    _atomic_write(out, (json.dumps(data, indent=2) + "\n").encode())
    print(f"wrote {out}: {len(data['files'])} files of {args.repo}@{args.revision}")
    return 0


def _run_fetch(args) -> int:
    try:
        lock = load_lock(args.lock)
    except CheckpointError as exc:
        print(f"glm53 model fetch: {exc}", file=sys.stderr)
        return 2
    ok, msg = fetch(args.out, lock, progress=not args.no_progress)
    print(msg, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1
