"""glm53 model verify / lock / fetch on generated checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm53 import checkpoint as C
from glm53.cli import main
from glm53.fixture.exl3 import KPOOL_AUX_FILE, write_exl3_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_exl3_checkpoint(tmp_path_factory.mktemp("src") / "ck", layers=4, experts=4, top_k=2, shards=2,
                                 omit_from_index=True, mtp_layers=0)


@pytest.fixture
def ck(source, tmp_path) -> Path:
    """A private copy of the generated checkpoint (tests modify it)."""
    dst = tmp_path / "ck"
    dst.mkdir()
    for p in source.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


@pytest.fixture
def lock(ck, tmp_path) -> Path:
    path = tmp_path / "ck.lock.json"
    assert main(["model", "lock", str(ck), "--repo", "test/ck", "--revision", "r1", "--out", str(path),
                 "--no-progress"]) == 0
    return path


def verify(ck: Path, lock: Path, *extra: str) -> int:
    return main(["model", "verify", str(ck), "--lock", str(lock), "--no-progress", *extra])


def weights(ck: Path) -> dict[str, tuple[str, int]]:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in ck.glob("*.safetensors")}


def test_lock_lists_every_file_with_size_and_hash(ck, lock):
    data = json.loads(lock.read_text())
    assert data["repo"] == "test/ck" and data["revision"] == "r1" and data["complete"] is True
    assert set(data["files"]) == set(C.checkpoint_files(ck))
    e = data["files"]["config.json"]
    assert e["size"] == (ck / "config.json").stat().st_size
    assert e["sha256"] == hashlib.sha256((ck / "config.json").read_bytes()).hexdigest()


def test_verify_ok_after_index_repair(ck, lock, capsys):
    # the generated checkpoint reproduces the published omission, so a plain verify reports it
    assert verify(ck, lock) == 1
    out = capsys.readouterr().out
    assert "missing from model.safetensors.index.json" in out and "known omission" in out
    assert verify(ck, lock, "--repair-index") == 0
    assert verify(ck, lock) == 0
    assert "verified against test/ck@r1" in capsys.readouterr().out


def test_flipped_byte_fails_naming_the_file(ck, lock, capsys):
    shard = ck / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1000] ^= 0x01                      # inside the tensor data: the header still parses
    shard.write_bytes(bytes(data))
    assert verify(ck, lock, "--repair-index") == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "model-00002-of-00002.safetensors: sha256" in out and "does not match" in out
    assert "model-00001-of-00002.safetensors: sha256" not in out


def test_missing_shard(ck, lock, capsys):
    (ck / "model-00001-of-00002.safetensors").unlink()
    assert verify(ck, lock) == 1
    out = capsys.readouterr().out
    assert "model-00001-of-00002.safetensors: missing" in out
    # the index now points at tensors no file holds
    assert "which does not hold it" in out


def test_truncated_shard_is_caught_by_size_and_header(ck, lock, capsys):
    shard = ck / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4096])
    assert verify(ck, lock) == 1
    out = capsys.readouterr().out
    assert "model-00001-of-00002.safetensors" in out and "truncated" in out


def test_index_omission_repaired_without_touching_weights(ck, lock):
    before = weights(ck)
    index_before = json.loads((ck / C.INDEX).read_text())
    aux = C.read_safetensors_header(ck / KPOOL_AUX_FILE)
    assert aux and not set(aux) & set(index_before["weight_map"])
    r = C.verify(ck, C.load_lock(lock), repair=True, progress=False)
    assert r.ok() and r.repaired == len(aux)
    index_after = json.loads((ck / C.INDEX).read_text())
    assert all(index_after["weight_map"][n] == KPOOL_AUX_FILE for n in aux)
    assert {k: v for k, v in index_after["weight_map"].items() if k not in aux} == index_before["weight_map"]
    assert index_after["metadata"]["total_size"] > index_before["metadata"]["total_size"]
    assert weights(ck) == before                                  # same bytes, never rewritten
    assert (ck / (C.INDEX + C.UPSTREAM_SUFFIX)).read_text() == json.dumps(index_before, indent=2) + "\n"
    assert not list(ck.glob("*.partial"))
    # a second repair has nothing to do, and the lock still checks the upstream index
    r2 = C.verify(ck, C.load_lock(lock), repair=True, progress=False)
    assert r2.ok() and r2.repaired == 0 and C.INDEX in r2.hashed


def test_tampered_repaired_index_is_a_problem(ck, lock):
    C.verify(ck, C.load_lock(lock), repair=True, progress=False)
    index = json.loads((ck / C.INDEX).read_text())
    index["weight_map"]["not.a.tensor"] = "model-00001-of-00002.safetensors"
    (ck / C.INDEX).write_text(json.dumps(index))
    r = C.verify(ck, C.load_lock(lock), progress=False)
    assert not r.ok() and any("not.a.tensor" in p for p in r.problems)


def test_stray_safetensors_file_is_refused(ck, lock, source):
    (ck / "extra.safetensors").write_bytes((source / KPOOL_AUX_FILE).read_bytes())
    r = C.verify(ck, C.load_lock(lock), progress=False)
    assert any("extra.safetensors: on disk but not in the lock" in p for p in r.problems)
    assert any("in several files" in p for p in r.problems)      # the same tensors twice


def test_shipped_lock_is_honest_about_what_it_knows(ck, capsys):
    lock = C.load_lock(C.DEFAULT_LOCK)
    assert lock.revision == "332ab457b709b7ba30dd9a448be5de03b80a7ac9"
    assert lock.repo.startswith("turboderp/") and not lock.complete
    assert "kpool_aux.safetensors" in lock.files
    assert all(e.size is None and e.sha256 is None for e in lock.files.values())   # nothing invented
    # on a checkpoint that has those names: no problems after the repair, but NOT VERIFIED, and --strict fails
    assert main(["model", "verify", str(ck), "--repair-index", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "identity NOT fully verified" in out and "NOT VERIFIED" in out
    assert main(["model", "verify", str(ck), "--strict", "--no-progress"]) == 1


def test_bad_lock_file(tmp_path, ck, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"repo": "a", "revision": "b", "files": {"x": {"size": 1, "sha256": "zz"}}}))
    assert verify(ck, bad) == 2
    assert "not 64 hex digits" in capsys.readouterr().err


def test_fetch_offline_says_what_failed_and_how_to_place_files(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "model"
    p = subprocess.run([sys.executable, "-m", "glm53", "model", "fetch", "--out", str(out), "--no-progress"],
                       capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert p.returncode == 1
    assert "could not download turboderp/GLM-5.3-Flash-exl3@332ab457b709b7ba30dd9a448be5de03b80a7ac9" in p.stderr
    assert "HF_HUB_OFFLINE is set" in p.stderr
    assert "hf download turboderp/GLM-5.3-Flash-exl3 --revision 332ab457" in p.stderr
    assert f"glm53 model verify {out}" in p.stderr
