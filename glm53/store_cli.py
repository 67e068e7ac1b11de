"""`glm53 pack-store` and `glm53 verify-store`: the store package's tools behind glm53's front door, with glm53's
settings (GLM53_STORE, GLM53_MODEL_DIR, GLM53_ALLOW_BUFFERED_READS, GLM53_CACHE_DIR) passed to them as arguments
(store/ itself imports nothing of glm53; `glm53 bench store` lives in glm53.bench).

Imports stay inside the commands: the front door imports this module at every start of every command.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
from pathlib import Path

EXIT_OK, EXIT_UNSOUND, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
# statfs(2) f_type of the RAM-backed filesystems
RAM_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `docker stop` sends), taken like Ctrl-C: the work so far is kept and the resume hint said."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_as_interrupt():
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: leave the signal alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def ram_fs(path: Path) -> str | None:
    """"tmpfs" / "ramfs" when `path` (or, while it does not exist yet, its directory) is on a RAM-backed
    filesystem, from statfs(2)'s f_type (what the kernel says, whatever the path or mount table look like)."""
    target = path if path.exists() else path.parent
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if libc.statfs(os.fsencode(target), buf) != 0:
        return None
    return RAM_FS.get(ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF)


def ram_fs_cost(path: Path, fs: str, size: int | None) -> str:
    held = f"its {size / 2**30:.1f} GiB" if size else "the whole store"
    return (f"{path} is on {fs}, which is RAM: {held} stay in RAM, counting against the memory an nvme mode "
            f"is meant to save (the page cache it bypasses is replaced by the file itself); put the store on an "
            f"NVMe drive (ext4 or xfs)")


def register(sub) -> None:
    p = sub.add_parser("pack-store", help="pack the routed experts of a checkpoint into an O_DIRECT record store",
                       description="Stream every routed expert of an EXL3 checkpoint into one file of 4 KiB-aligned "
                       "records (resumable; published atomically), then verify it in full. If --out already is a "
                       "sound store of the same checkpoint, it is re-verified instead of repacked.")
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, type=Path, help="store file to write (on ext4/xfs, ideally NVMe)")
    p.add_argument("--threads", type=int, default=4, help="record writer threads (default 4)")
    p.add_argument("--lock", type=Path, help="checkpoint lock file: record its repo/revision and check every "
                   "shard's size and sha256 against it")
    p.add_argument("--include-mtp", action="store_true", help="also pack the MTP head's experts (unused for serving)")
    p.add_argument("--no-verify", action="store_true", help="skip the full verify after publishing")
    p.set_defaults(func=cmd_pack)

    v = sub.add_parser("verify-store", help="check a store: quick (header, identity, sample) or full (every record)",
                       description="Full (default): read back every record with O_DIRECT and check xxh3 and sha256. "
                       "--quick: header and table checksum, identity against the checkpoint and a random sample "
                       "of records; fast enough for every start. Exit status 0 only when the store is sound.")
    v.add_argument("path", nargs="?", type=Path, help="store file (default: GLM53_STORE)")
    v.add_argument("--model", type=Path, help="checkpoint to compare with (default: GLM53_MODEL_DIR, if set)")
    v.add_argument("--quick", action="store_true", help="header + identity + a sample of records")
    v.add_argument("--sample", type=int, default=8, help="records checked by --quick (default 8)")
    v.add_argument("--threads", type=int, default=4, help="reader threads of the full verify (default 4)")
    v.set_defaults(func=cmd_verify)


def _settings():
    from glm53.planning.settings import load_or_exit

    return load_or_exit()


def _err(cmd: str, exc) -> None:
    print(f"glm53 {cmd}: error: {exc.problem}", file=sys.stderr)
    if exc.fix:
        print(f"  fix: {exc.fix}", file=sys.stderr)


def cmd_pack(args: argparse.Namespace) -> int:
    from store.errors import PackInterrupted, StoreError
    from store.pack import PackOptions, pack_store

    settings = _settings()
    opts = PackOptions(args.model, args.out, threads=args.threads, lock=args.lock, include_mtp=args.include_mtp,
                       verify=not args.no_verify, allow_buffered=settings.allow_buffered_reads,
                       verify_threads=args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    fs = ram_fs(args.out)
    if fs:
        log(f"warning: {ram_fs_cost(args.out, fs, None)}")
    try:
        with _sigterm_as_interrupt():
            result = pack_store(opts, log=log, warn=lambda m: log(f"warning: {m}"))
    except PackInterrupted as exc:
        _err("pack-store", exc)
        if isinstance(exc.__cause__, Terminated):
            return EXIT_TERMINATED
        return EXIT_INTERRUPTED if isinstance(exc.__cause__, KeyboardInterrupt) else EXIT_UNSOUND
    except StoreError as exc:
        _err("pack-store", exc)
        return EXIT_UNSOUND
    if not result.reused:
        print(f"packed {result.records} records into {result.path}: {result.bytes_written / 1e9:.2f} GB in "
              f"{result.seconds:.1f} s ({result.rate / 1e9:.2f} GB/s)" +
              (f", {result.resumed_records} resumed" if result.resumed_records else ""))
    if result.verify is not None:
        print(result.verify.render())
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from store.files import not_regular
    from store.verify import full_verify, pack_command, quick_verify

    settings = _settings()
    path = args.path or (Path(settings.store) if settings.store else None)
    if path is None:
        print("glm53 verify-store: error: no store given\n  fix: pass the store file, or set GLM53_STORE",
              file=sys.stderr)
        return EXIT_USAGE
    model = args.model or (Path(settings.model_dir) if settings.model_dir else None)

    def warn(msg: str) -> None:
        print(f"glm53 verify-store: warning: {msg}", file=sys.stderr)

    if not path.is_file():
        kind = not_regular(path)
        what = f"is {kind}, not a store file" if kind else "does not exist"
        print(f"glm53 verify-store: error: {path} {what}: nothing was checked\n"
              f"  fix: pass the store file pack-store wrote, or make it: {pack_command(path, model)}", file=sys.stderr)
        return EXIT_UNSOUND
    fs = ram_fs(path)
    if fs:
        warn(ram_fs_cost(path, fs, path.stat().st_size))

    if args.quick:
        rep = quick_verify(path, model, sample=args.sample, allow_buffered=settings.allow_buffered_reads, warn=warn)
    else:
        rep = full_verify(path, model, threads=args.threads, allow_buffered=settings.allow_buffered_reads,
                          warn=warn, progress=True)
    print(rep.render())
    return EXIT_OK if rep.ok else EXIT_UNSOUND
