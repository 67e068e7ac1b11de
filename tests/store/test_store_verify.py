"""End to end on a generated EXL3 checkpoint (glm53.fixture): pack, verify, read back bit for bit, then damage
the store or the checkpoint each way and see the right refusal with its fix."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import store.verify as V
from glm53.fixture.exl3 import write_exl3_checkpoint
from store.directio import alloc_aligned, alloc_slots, dir_supports_direct
from store.errors import DirectIOUnsupported, StoreCorruptError, StoreFormatError
from store.format import read_header
from store.pack import PackOptions, pack_store
from store.reader import StoreReader
from store.verify import full_verify, quick_verify


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    a = write_exl3_checkpoint(root / "a", seed=0, shards=2)
    b = write_exl3_checkpoint(root / "b", seed=1, shards=2)          # same shapes, other weights
    store = root / "a.glm53"
    pack_store(PackOptions(a, store, threads=2, progress=False), log=lambda m: None)
    return {"a": a, "b": b, "store": store}


@pytest.fixture
def copy(world, tmp_path):
    p = tmp_path / "copy.glm53"
    shutil.copyfile(world["store"], p)
    return p


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_sound_store_passes_quick_and_full(world):
    q = quick_verify(world["store"], world["a"])
    assert q.ok, q.render()
    assert q.records_checked == 8 and "SOUND" in q.render()
    f = full_verify(world["store"], world["a"], threads=3)
    assert f.ok and f.records_checked == f.records_total == 3 * 16 and f.direct
    assert "GB/s" in f.render()


def test_records_are_bit_identical_to_the_checkpoint_tensors(world):
    tensors = {}
    for p in world["a"].glob("*.safetensors"):
        with safe_open(str(p), framework="np") as f:            # experts only: numpy has no bfloat16
            tensors.update({k: f.get_tensor(k) for k in f.keys() if ".mlp.experts." in k})
    with StoreReader(world["store"], threads=3, verify=True) as r:
        keys = r.keys()
        assert {k[0] for k in keys} == {1, 2, 3} and len(keys) == 48       # layer 4 is the MTP head
        arena = alloc_slots(len(keys), r.max_extent)
        futures = r.read_many([(layer, e, arena[i]) for i, (layer, e) in enumerate(keys)])
        for (layer, e), fut in zip(keys, futures, strict=True):
            v = r.views(layer, fut.result().data)
            for proj in ("gate", "up", "down"):
                for part in ("trellis", "suh", "svh"):
                    want = tensors[f"model.language_model.layers.{layer}.mlp.experts.{e}.{proj}_proj.{part}"]
                    got = getattr(getattr(v, proj), part)
                    assert got.shape == want.shape and got.dtype == want.dtype
                    assert got.tobytes() == want.tobytes()
            pad = fut.result().data[r.layout(layer).length:]
            assert not pad.any()


def test_store_of_another_checkpoint_with_the_same_shapes_is_refused(world):
    rep = quick_verify(world["store"], world["b"])
    assert not rep.ok
    text = rep.render()
    assert "packed from a different checkpoint with the same shapes" in text
    assert f"glm53 pack-store --model {world['b']} --out {world['store']}" in text
    assert not full_verify(world["store"], world["b"]).ok


def test_cross_check_catches_what_the_fingerprint_misses(world, monkeypatch):
    recorded = {s["name"]: s["fingerprint"] for s in read_header(world["store"]).identity["shards"]}
    monkeypatch.setattr(V, "fingerprint", lambda path, size: recorded[Path(path).name])
    rep = quick_verify(world["store"], world["b"])
    assert not rep.ok
    assert "differs from the checkpoint's tensors" in rep.render()


@pytest.mark.parametrize("cut", [4096, "header"])
def test_truncated_store(world, copy, cut):
    head = read_header(copy)
    with open(copy, "r+b") as f:
        f.truncate(head.file_size - 4096 if cut == 4096 else 100)
    for rep in (quick_verify(copy, world["a"]), full_verify(copy, world["a"])):
        assert not rep.ok
        assert "truncated" in rep.problems[0].what or "too short" in rep.problems[0].what
        assert f"glm53 pack-store --model {world['a']} --out {copy}" in rep.problems[0].fix
    with pytest.raises(StoreFormatError, match="truncated|too short"):
        StoreReader(copy)


def test_one_flipped_byte_in_a_record(world, copy):
    head = read_header(copy)
    victim = head.entry(2, 5)
    flip(copy, victim.offset + 1234)
    full = full_verify(copy, world["a"])
    assert not full.ok
    assert "(layer 2, expert 5)" in full.problems[0].what and "xxh3" in full.problems[0].what
    assert f"glm53 pack-store --model {world['a']} --out {copy}" in full.problems[0].fix
    assert not quick_verify(copy, world["a"], sample=len(head.entries)).ok
    with StoreReader(copy, verify=True, retries=1) as r:
        buf = alloc_aligned(r.max_extent)
        with pytest.raises(StoreCorruptError) as ei:
            r.read(2, 5, buf).result()
        assert str(copy) in ei.value.problem and "(layer 2, expert 5)" in ei.value.problem
        assert "glm53 verify-store" in ei.value.fix and "glm53 pack-store" in ei.value.fix
        assert r.read(2, 4, buf).result().attempts == 1                  # its neighbours are fine


def test_one_flipped_byte_in_the_padding_is_caught(world, copy):
    head = read_header(copy)
    e = head.entry(1, 0)
    if e.extent == e.length:
        pytest.skip("no padding at this width")
    flip(copy, e.offset + e.extent - 1)
    assert "(layer 1, expert 0)" in full_verify(copy).problems[0].what


def test_one_flipped_byte_in_the_table(world, copy):
    flip(copy, read_header(copy).table_offset + 64 * 7 + 40)
    rep = quick_verify(copy, world["a"])
    assert not rep.ok and "fails its sha256 check" in rep.problems[0].what


def test_wrong_magic_and_version(world, copy):
    with open(copy, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 2))
    rep = full_verify(copy, world["a"])
    assert "format version 2" in rep.problems[0].what and "pack-store" in rep.problems[0].fix
    with open(copy, "r+b") as f:
        f.write(b"NOTASTOR")
    rep = quick_verify(copy, world["a"])
    assert "not a glm53 expert store" in rep.problems[0].what


def clone_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_shard_in_the_mounted_checkpoint(world, tmp_path):
    ck = clone_checkpoint(world["a"], tmp_path / "ck")
    (ck / "model-00002-of-00002.safetensors").unlink()
    rep = quick_verify(world["store"], ck)
    assert not rep.ok
    p = rep.problems[0]
    assert "shard model-00002-of-00002.safetensors" in p.what and "is missing from" in p.what
    assert "restore it" in p.fix


def test_changed_config_is_refused(world, tmp_path):
    ck = clone_checkpoint(world["a"], tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"]["routed_scaling_factor"] = 3.0
    (ck / "config.json").write_text(json.dumps(cfg))
    rep = quick_verify(world["store"], ck)
    assert "config.json differs" in rep.render()


def test_copied_checkpoint_with_new_mtimes_is_still_accepted(world, tmp_path):
    ck = clone_checkpoint(world["a"], tmp_path / "ck")
    for p in ck.iterdir():
        os.utime(p, ns=(1, 1))
    assert quick_verify(world["store"], ck).ok


def no_o_direct(monkeypatch):
    """Simulate a filesystem that refuses O_DIRECT (tmpfs before Linux 6.6, overlayfs on some hosts)."""
    real = os.open

    def fake(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", fake)


def test_filesystem_without_o_direct(world, monkeypatch):
    no_o_direct(monkeypatch)
    rep = quick_verify(world["store"], world["a"])
    assert not rep.ok
    assert "does not support O_DIRECT" in rep.problems[0].what
    assert "ext4 or xfs" in rep.problems[0].fix and "GLM53_ALLOW_BUFFERED_READS=1" in rep.problems[0].fix
    with pytest.raises(DirectIOUnsupported):
        StoreReader(world["store"])
    warnings = []
    rep = full_verify(world["store"], world["a"], allow_buffered=True, warn=warnings.append)
    assert rep.ok and not rep.direct and "buffered" in rep.render()
    assert "GLM53_ALLOW_BUFFERED_READS" in warnings[0]


def test_real_tmpfs_if_it_refuses_o_direct(world):
    shm = Path("/dev/shm")
    if not shm.is_dir() or dir_supports_direct(shm):
        pytest.skip("no /dev/shm, or its tmpfs supports O_DIRECT (Linux >= 6.6); the simulated case covers it")
    p = shm / f"glm53-test-{os.getpid()}.glm53"
    try:
        shutil.copyfile(world["store"], p)
        rep = quick_verify(p, world["a"])
        assert "does not support O_DIRECT" in rep.problems[0].what
    finally:
        p.unlink(missing_ok=True)


def test_quick_verify_without_a_checkpoint_notes_it(world):
    rep = quick_verify(world["store"])
    assert rep.ok and "not compared with a checkpoint" in rep.render()


def test_sampled_records_use_the_source_hint_in_the_fix(world, copy):
    e = read_header(copy).entries[-1]
    flip(copy, e.offset)
    rep = quick_verify(copy)                           # the last record is always in the sample
    assert not rep.ok
    assert f"--model {world['a'].absolute()}" in rep.problems[0].fix


def test_verify_reads_with_the_fixture_index_omission(tmp_path):
    ck = write_exl3_checkpoint(tmp_path / "ck", seed=2, omit_from_index=True, layers=3, experts=8)
    out = tmp_path / "s.glm53"
    res = pack_store(PackOptions(ck, out, threads=2, progress=False), log=lambda m: None)
    assert res.verify.ok and quick_verify(out, ck).ok
    assert np.array_equal(sorted({e.layer for e in read_header(out).entries}), [1, 2])


def test_quick_says_what_it_did_not_read(world, copy):
    """A damaged record outside the sample: --quick cannot see it, and says so instead of a bare SOUND."""
    head = read_header(copy)
    victim = head.entry(2, 5)
    flip(copy, victim.offset + 1234)
    total = len(head.entries)
    rep = next(r for r in (quick_verify(copy, world["a"], seed=s) for s in range(50)) if r.ok)  # victim unsampled
    assert rep.records_checked == 8 and rep.unread == total - 8
    text = rep.render()
    assert f"SOUND as far as checked ({total - 8} records not read)" in text and not text.endswith(": SOUND")
    assert f"{total - 8} of {total} records were not read" in text
    assert f"glm53 verify-store {copy}` without --quick" in text
    assert not full_verify(copy, world["a"]).ok
    sound = full_verify(world["store"], world["a"])
    assert sound.render().endswith(": SOUND") and not sound.notes
