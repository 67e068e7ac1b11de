"""pack-store: streaming pack, resume after a crash or Ctrl-C, full disk, locks, reuse of a sound store."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import store.pack as P
from store.errors import CheckpointError, DirectIOUnsupported, DiskFullError, PackInterrupted, StoreFormatError
from store.format import read_header
from store.pack import PackOptions, pack_store
from store.synth import write_expert_checkpoint
from store.verify import full_verify, quick_verify

REPO = Path(__file__).resolve().parents[2]


def opts(model, out, **kw):
    kw.setdefault("threads", 2)
    kw.setdefault("progress", False)
    return PackOptions(model, out, **kw)


class Log(list):
    def __call__(self, msg):
        self.append(msg)

    def text(self):
        return "\n".join(self)


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    """An expert-only checkpoint: 2 MoE layers x 8 experts + an MTP layer, over 2 shards."""
    return write_expert_checkpoint(tmp_path_factory.mktemp("ck") / "model", layers=3, dense_layers=1, experts=8,
                                   shards=2, mtp_layers=1)


@pytest.fixture(scope="module")
def clean(ck, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "experts.glm53"
    pack_store(opts(ck, out), log=Log())
    return out


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name))


def test_pack_publishes_a_verified_store_and_skips_mtp(ck, clean):
    head = read_header(clean)
    assert sorted({e.layer for e in head.entries}) == [1, 2]          # layer 3 is the MTP head
    assert len(head.entries) == 16 and head.identity["mtp_layers"] == [3]
    assert head.identity["quantization"]["codebook"]["kind"] == "mul1"
    assert head.identity["quantization"]["k_bits"] == {"gate": [3], "up": [3], "down": [3]}
    assert [s["name"] for s in head.identity["shards"]] == ["model-00001-of-00002.safetensors",
                                                           "model-00002-of-00002.safetensors"]
    for s in head.identity["shards"]:
        assert s["sha256"] == hashlib.sha256((ck / s["name"]).read_bytes()).hexdigest()
    assert leftovers(clean) == ["experts.glm53"]                      # no partial, no journal
    assert full_verify(clean, ck).ok


def test_include_mtp(ck, tmp_path):
    out = tmp_path / "s.glm53"
    pack_store(opts(ck, out, include_mtp=True, verify=False), log=Log())
    assert sorted({e.layer for e in read_header(out).entries}) == [1, 2, 3]


def test_pack_is_deterministic(ck, clean, tmp_path):
    out = tmp_path / "again.glm53"
    pack_store(opts(ck, out, threads=3, verify=False), log=Log())
    assert out.read_bytes() == clean.read_bytes()


def inject(monkeypatch, after: int, exc: BaseException):
    real, calls = P.pwrite_from, [0]

    def fake(fd, view, offset):
        calls[0] += 1
        if calls[0] > after:
            raise exc
        return real(fd, view, offset)

    monkeypatch.setattr(P, "pwrite_from", fake)


def test_resume_after_a_crash_gives_the_same_bytes(ck, clean, tmp_path, monkeypatch):
    out = tmp_path / "s.glm53"
    inject(monkeypatch, 5, RuntimeError("power cut"))
    with pytest.raises(PackInterrupted, match="after [0-9]+ of 16 records") as ei:
        pack_store(opts(ck, out), log=Log())
    assert "rerun the same command" in ei.value.fix
    assert leftovers(out) == ["s.glm53.partial", "s.glm53.partial.journal"]        # nothing published
    monkeypatch.undo()
    log = Log()
    res = pack_store(opts(ck, out), log=log)
    assert "resuming" in log.text() and 1 <= res.resumed_records <= 5
    assert out.read_bytes() == clean.read_bytes()
    assert leftovers(out) == ["s.glm53"]


def test_resume_redoes_a_journaled_record_whose_bytes_went_bad(ck, clean, tmp_path, monkeypatch):
    out = tmp_path / "s.glm53"
    inject(monkeypatch, 6, RuntimeError("crash"))
    with pytest.raises(PackInterrupted):
        pack_store(opts(ck, out, threads=1), log=Log())
    monkeypatch.undo()
    journal = [json.loads(x) for x in (tmp_path / "s.glm53.partial.journal").read_text().splitlines()[1:]]
    layer, expert = next(d["r"] for d in journal if "r" in d)[:2]
    plan = P.make_plan(ck)
    with open(tmp_path / "s.glm53.partial", "r+b") as f:           # a write the crash lost
        f.seek(plan.offsets[(layer, expert)] + 100)
        f.write(b"\xff\xfe")
    log = Log()
    pack_store(opts(ck, out), log=log)
    assert "1 failed the re-check and will be redone" in log.text()
    assert out.read_bytes() == clean.read_bytes()


def test_ctrl_c_in_the_main_thread_keeps_the_work(ck, clean, tmp_path, monkeypatch):
    out = tmp_path / "s.glm53"
    real, calls = P._drain, [0]

    def drain(*a, **kw):  # the main thread's wait for finished records: Ctrl-C arrives during the second
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(P, "_drain", drain)
    with pytest.raises(PackInterrupted, match="interrupted") as ei:
        pack_store(opts(ck, out, threads=1), log=Log())
    assert isinstance(ei.value.__cause__, KeyboardInterrupt)
    assert not out.exists() and (tmp_path / "s.glm53.partial.journal").exists()
    monkeypatch.undo()
    pack_store(opts(ck, out), log=Log())
    assert out.read_bytes() == clean.read_bytes()


def test_a_changed_checkpoint_does_not_resume_a_stale_partial(ck, tmp_path, monkeypatch):
    model = write_expert_checkpoint(tmp_path / "m", layers=3, experts=8, shards=2)
    out = tmp_path / "s.glm53"
    inject(monkeypatch, 4, RuntimeError("crash"))
    with pytest.raises(PackInterrupted):
        pack_store(opts(model, out), log=Log())
    monkeypatch.undo()
    write_expert_checkpoint(model, layers=3, experts=8, shards=2, seed=5)       # new weights, same shapes
    log = Log()
    res = pack_store(opts(model, out), log=log)
    assert "resuming" not in log.text() and res.resumed_records == 0
    assert quick_verify(out, model, sample=16).ok


def test_disk_full_mid_pack_is_resumable_and_publishes_nothing(ck, clean, tmp_path, monkeypatch):
    out = tmp_path / "s.glm53"
    inject(monkeypatch, 3, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    with pytest.raises(DiskFullError) as ei:
        pack_store(opts(ck, out), log=Log())
    msg = str(ei.value)
    assert "full disk" in msg and "free on the filesystem holding" in msg and "of 16 records" in msg
    assert "rerun the same command" in ei.value.fix and "--out on a disk with room" in ei.value.fix
    assert not out.exists()
    monkeypatch.undo()
    pack_store(opts(ck, out), log=Log())
    assert out.read_bytes() == clean.read_bytes()


def test_free_space_is_checked_before_writing_anything(ck, tmp_path, monkeypatch):
    out = tmp_path / "s.glm53"
    monkeypatch.setattr(P, "_free_bytes", lambda d: 4096)
    with pytest.raises(DiskFullError, match=r"not enough free space .* needs 0\.00 GB more, 0\.00 GB is free") as ei:
        pack_store(opts(ck, out), log=Log())
    assert "--out on a disk with room" in ei.value.fix
    assert leftovers(out) == []


def test_file_size_limit_in_a_subprocess(ck, tmp_path):
    """A real kernel refusal (RLIMIT_FSIZE -> EFBIG), not a monkeypatch."""
    out = tmp_path / "s.glm53"
    code = f"""
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
from store.errors import DiskFullError
from store.pack import PackOptions, pack_store
try:
    pack_store(PackOptions({str(ck)!r}, {str(out)!r}, threads=2, progress=False), log=lambda m: None)
except DiskFullError as e:
    print(e)
    sys.exit(3)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "file-size limit" in proc.stdout and "rerun the same command" in proc.stdout
    assert not out.exists()


def test_a_sound_store_of_the_same_checkpoint_is_reverified_not_repacked(ck, clean, tmp_path):
    out = tmp_path / "s.glm53"
    out.write_bytes(clean.read_bytes())
    before = out.stat().st_mtime_ns
    log = Log()
    res = pack_store(opts(ck, out), log=log)
    assert res.reused and res.verify.ok
    assert "already a store for this checkpoint; verifying it instead of repacking" in log.text()
    assert out.stat().st_mtime_ns == before


def test_a_store_of_another_checkpoint_is_replaced(ck, clean, tmp_path):
    other = write_expert_checkpoint(tmp_path / "other", layers=3, experts=8, shards=2, seed=9)
    out = tmp_path / "s.glm53"
    out.write_bytes(clean.read_bytes())
    log = Log()
    res = pack_store(opts(other, out), log=log)
    assert not res.reused and "exists but" in log.text() and "repacking" in log.text()
    assert quick_verify(out, other, sample=16).ok


def test_a_damaged_existing_file_is_replaced(ck, clean, tmp_path):
    out = tmp_path / "s.glm53"
    out.write_bytes(b"not a store" * 100)
    log = Log()
    pack_store(opts(ck, out), log=log)
    assert "not a glm53 expert store" in log.text()
    assert out.read_bytes() == clean.read_bytes()


def write_lock(ck: Path, path: Path, tamper: str | None = None) -> Path:
    files = []
    for p in sorted(ck.glob("*.safetensors")):
        sha = hashlib.sha256(p.read_bytes()).hexdigest()
        size = p.stat().st_size
        if tamper == "sha" and not files:
            sha = "0" * 64
        if tamper == "size" and not files:
            size += 1
        files.append({"path": p.name, "size": size, "sha256": sha})
    path.write_text(json.dumps({"repo": "turboderp/GLM-5.3-Flash-exl3", "revision": "abc123", "files": files}))
    return path


def test_lock_is_recorded(ck, tmp_path):
    out = tmp_path / "s.glm53"
    pack_store(opts(ck, out, lock=write_lock(ck, tmp_path / "lock.json"), verify=False), log=Log())
    lock = read_header(out).identity["lock"]
    assert lock["repo"] == "turboderp/GLM-5.3-Flash-exl3" and lock["revision"] == "abc123"


def test_lock_in_glm53_checkpoint_form_with_unknown_facts(ck, tmp_path):
    """The shipped lock of the real checkpoint knows only some sizes and hashes: nulls are not checked."""
    lock = {"format": 1, "repo": "turboderp/GLM-5.3-Flash-exl3", "revision": "332ab45", "complete": False,
            "files": {"config.json": {"size": None, "sha256": None},
                      **{p.name: {"size": p.stat().st_size, "sha256": None} for p in ck.glob("*.safetensors")}}}
    (tmp_path / "lock.json").write_text(json.dumps(lock))
    out = tmp_path / "s.glm53"
    pack_store(opts(ck, out, lock=tmp_path / "lock.json", verify=False), log=Log())
    assert read_header(out).identity["lock"]["revision"] == "332ab45"
    lock["files"]["config.json"]["sha256"] = "1" * 64
    (tmp_path / "lock.json").write_text(json.dumps(lock))
    with pytest.raises(CheckpointError, match="config.json does not match the lock"):
        pack_store(opts(ck, tmp_path / "t.glm53", lock=tmp_path / "lock.json"), log=Log())
    (tmp_path / "lock.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read"):
        pack_store(opts(ck, tmp_path / "t.glm53", lock=tmp_path / "lock.json"), log=Log())


def test_lock_sha256_mismatch_publishes_nothing(ck, tmp_path):
    out = tmp_path / "s.glm53"
    with pytest.raises(CheckpointError, match="does not match the lock") as ei:
        pack_store(opts(ck, out, lock=write_lock(ck, tmp_path / "lock.json", "sha")), log=Log())
    assert "glm53 model" in ei.value.fix
    assert leftovers(out) == []


def test_lock_size_mismatch_is_refused_before_packing(ck, tmp_path):
    out = tmp_path / "s.glm53"
    with pytest.raises(CheckpointError, match="the lock says"):
        pack_store(opts(ck, out, lock=write_lock(ck, tmp_path / "lock.json", "size")), log=Log())
    assert leftovers(out) == []


def test_missing_shard_is_named(tmp_path):
    model = write_expert_checkpoint(tmp_path / "m", layers=4, experts=4, shards=3, mtp_layers=0)
    (model / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors") as ei:
        pack_store(opts(model, tmp_path / "s.glm53"), log=Log())
    assert "restore the missing shard" in ei.value.fix
    assert not (tmp_path / "s.glm53.partial").exists()


def test_no_index_is_needed_and_a_lying_index_is_ignored(ck, clean, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    for p in ck.iterdir():
        (model / p.name).write_bytes(p.read_bytes())
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    out = tmp_path / "s.glm53"
    pack_store(opts(model, out, verify=False), log=Log())
    assert len(read_header(out).entries) == 16


def hand_made(out: Path, k_down: int = 3, bad_expert: int | None = None) -> Path:
    """config.json + expert tensors written with the safetensors library (an independent writer)."""
    out.mkdir(parents=True)
    hidden, inter, n = 64, 32, 3
    cfg = {"architectures": ["Glm5NextForConditionalGeneration"], "num_hidden_layers": 2, "hidden_size": hidden,
           "moe_intermediate_size": inter, "n_routed_experts": n, "first_k_dense_replace": 1}
    (out / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(3)
    tensors = {}
    for e in range(n):
        for proj, (i, o) in {"gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}.items():
            k = k_down if proj == "down" and e == bad_expert else 3
            base = f"model.language_model.layers.1.mlp.experts.{e}.{proj}_proj"
            tensors[f"{base}.trellis"] = rng.integers(-2**15, 2**15, (i // 16, o // 16, 16 * k), dtype=np.int16)
            tensors[f"{base}.suh"] = rng.standard_normal(i).astype(np.float16)
            tensors[f"{base}.svh"] = rng.standard_normal(o).astype(np.float16)
            tensors[f"{base}.mul1"] = np.array(-2082680531, dtype=np.int32)
    tensors["model.language_model.layers.1.mlp.gate.weight"] = rng.standard_normal((n, hidden)).astype(np.float32)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_hand_made_checkpoint_records_hold_the_tensors_bit_for_bit(tmp_path):
    from safetensors.numpy import load_file

    from store.directio import alloc_aligned
    from store.reader import StoreReader

    model = hand_made(tmp_path / "m")
    out = tmp_path / "s.glm53"
    pack_store(opts(model, out), log=Log())
    assert read_header(out).identity["quantization"]["codebook"] == {"kind": "mul1", "value": -2082680531}
    tensors = load_file(str(model / "model.safetensors"))
    with StoreReader(out, verify=True) as r:
        buf = alloc_aligned(r.max_extent)
        for e in range(3):
            v = r.views(1, r.read(1, e, buf).result().data)
            for proj in ("gate", "up", "down"):
                lin = getattr(v, proj)
                for part in ("trellis", "suh", "svh"):
                    want = tensors[f"model.language_model.layers.1.mlp.experts.{e}.{proj}_proj.{part}"]
                    assert np.array_equal(getattr(lin, part).view(np.uint8), want.view(np.uint8))


def test_an_expert_quantized_differently_is_refused(tmp_path):
    model = hand_made(tmp_path / "m", k_down=4, bad_expert=2)
    with pytest.raises(CheckpointError, match=r"experts\.2\.down_proj\.trellis is I16\[2, 4, 64\], expected"):
        pack_store(opts(model, tmp_path / "s.glm53"), log=Log())


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        pack_store(opts(tmp_path, tmp_path / "s.glm53"), log=Log())
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no .*safetensors"):
        pack_store(opts(tmp_path, tmp_path / "s.glm53"), log=Log())


def test_a_filesystem_without_o_direct_is_refused_unless_buffered_reads_are_allowed(ck, tmp_path, monkeypatch):
    monkeypatch.setattr(P, "dir_supports_direct", lambda d: False)
    out = tmp_path / "s.glm53"
    with pytest.raises(DirectIOUnsupported) as ei:
        pack_store(opts(ck, out), log=Log())
    assert "ext4 or xfs" in ei.value.fix and "GLM53_ALLOW_BUFFERED_READS=1" in ei.value.fix
    assert leftovers(out) == []
    res = pack_store(opts(ck, out, allow_buffered=True), log=Log())     # buffered writes
    assert res.verify.ok


def test_out_directory_must_exist(ck, tmp_path):
    with pytest.raises(Exception, match="mkdir -p"):
        pack_store(opts(ck, tmp_path / "no" / "s.glm53"), log=Log())


def test_store_format_error_type_for_garbage(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"\0" * 10)
    with pytest.raises(StoreFormatError):
        read_header(p)


def test_an_unwritable_destination_is_explained(ck, tmp_path, monkeypatch):
    def refuse(*a, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path))

    monkeypatch.setattr(P, "dir_supports_direct", refuse)
    with pytest.raises(Exception, match="cannot write the store") as ei:
        pack_store(opts(ck, tmp_path / "s.glm53"), log=Log())
    assert "writable directory" in ei.value.fix


def test_disk_full_under_the_journal(ck, clean, tmp_path, monkeypatch):
    out = tmp_path / "s.glm53"
    real, calls = P.Journal.append, [0]

    def append(self, recs, shards):
        calls[0] += 1
        if calls[0] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, recs, shards)

    monkeypatch.setattr(P.Journal, "append", append)
    monkeypatch.setattr(P, "FLUSH_EVERY_S", 0.0)
    with pytest.raises(DiskFullError, match="full disk"):
        pack_store(opts(ck, out, threads=1), log=Log())
    monkeypatch.undo()
    pack_store(opts(ck, out), log=Log())
    assert out.read_bytes() == clean.read_bytes()


SLOW_PACK = """
import signal, sys, time
# A shell's background job starts with SIGINT ignored, and Python then installs no Ctrl-C handler: the child
# would never see the test's signal. Ctrl-C's own behaviour is what is under test.
signal.signal(signal.SIGINT, signal.default_int_handler)
import store.pack as P
real = P.pwrite_from
def slow(*a):
    time.sleep(0.1)
    return real(*a)
P.pwrite_from = slow
from glm53.cli import main
sys.exit(main(["pack-store", "--model", sys.argv[1], "--out", sys.argv[2], "--threads", "1"]))
"""


def journaled(out: Path) -> int:
    try:
        return (out.parent / (out.name + ".partial.journal")).read_text().count('{"r"')
    except OSError:
        return 0


def start_slow_pack(ck: Path, out: Path) -> subprocess.Popen:
    """A real pack in a child process, slowed down so that it can be hit mid-way; returns once 3 records
    are journaled."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PACK, str(ck), str(out)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while journaled(out) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert journaled(out) >= 3 and proc.poll() is None, proc.communicate()
    return proc


def test_sigkill_mid_pack_then_resume(ck, clean, tmp_path):
    out = tmp_path / "s.glm53"
    proc = start_slow_pack(ck, out)
    proc.kill()                                    # no finally blocks, no flush: a real crash
    proc.communicate(timeout=30)
    assert not out.exists()
    log = Log()
    res = pack_store(opts(ck, out), log=log)
    assert res.resumed_records >= 3 and "resuming" in log.text()
    assert out.read_bytes() == clean.read_bytes()


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])  # Ctrl-C; docker stop
def test_ctrl_c_or_sigterm_mid_pack_exits_with_the_hint_and_resumes(ck, clean, tmp_path, sig, status):
    out = tmp_path / "s.glm53"
    proc = start_slow_pack(ck, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == status, err
    assert "interrupted after" in err and "rerun the same command" in err
    assert not out.exists() and journaled(out) >= 3
    res = pack_store(opts(ck, out), log=Log())
    assert res.resumed_records >= 3
    assert out.read_bytes() == clean.read_bytes()


def test_out_is_a_directory(ck, tmp_path):
    with pytest.raises(Exception, match="is a directory") as ei:
        pack_store(opts(ck, tmp_path), log=Log())
    assert "experts.glm53" in ei.value.fix
    with pytest.raises(StoreFormatError, match="is a directory"):
        read_header(tmp_path)
