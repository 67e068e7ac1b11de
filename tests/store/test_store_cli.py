"""`glm53 pack-store`, `glm53 verify-store`, `glm53 bench store` through the front door: exit codes and messages."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from glm53.cli import main
from glm53.fixture.exl3 import write_exl3_checkpoint
from store.format import read_header


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for k in ("GLM53_STORE", "GLM53_MODEL_DIR", "GLM53_ALLOW_BUFFERED_READS", "GLM53_CACHE_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)                 # no stray .env


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    return write_exl3_checkpoint(tmp_path_factory.mktemp("cli") / "ck", seed=0, layers=3, experts=8)


def test_pack_then_verify(ck, tmp_path, capsys):
    out = tmp_path / "experts.glm53"
    assert main(["pack-store", "--model", str(ck), "--out", str(out), "--threads", "2"]) == 0
    o = capsys.readouterr()
    assert "packed 16 records" in o.out and "SOUND" in o.out and "published" in o.err
    assert main(["verify-store", str(out), "--model", str(ck)]) == 0
    assert "full verify" in capsys.readouterr().out
    assert main(["verify-store", str(out), "--model", str(ck), "--quick"]) == 0
    assert "quick verify" in capsys.readouterr().out
    assert main(["pack-store", "--model", str(ck), "--out", str(out)]) == 0
    assert "verifying it instead of repacking" in capsys.readouterr().err


def test_verify_store_exit_1_with_the_fix(ck, tmp_path, capsys):
    out = tmp_path / "experts.glm53"
    assert main(["pack-store", "--model", str(ck), "--out", str(out), "--no-verify"]) == 0
    e = read_header(out).entries[3]
    with open(out, "r+b") as f:
        f.seek(e.offset + 10)
        f.write(b"\x00\x01\x02")
    capsys.readouterr()
    assert main(["verify-store", str(out)]) == 1
    o = capsys.readouterr().out
    assert "damaged record" in o and f"fix: the file is damaged (disk or copy error): glm53 pack-store --model " \
        f"{ck.absolute()} --out {out}" in o


def test_verify_store_takes_the_settings(ck, tmp_path, capsys, monkeypatch):
    out = tmp_path / "experts.glm53"
    assert main(["pack-store", "--model", str(ck), "--out", str(out), "--no-verify"]) == 0
    assert main(["verify-store"]) == 2
    assert "set GLM53_STORE" in capsys.readouterr().err
    monkeypatch.setenv("GLM53_STORE", str(out))
    monkeypatch.setenv("GLM53_MODEL_DIR", str(ck))
    assert main(["verify-store", "--quick"]) == 0
    assert "SOUND" in capsys.readouterr().out


def test_missing_store_and_missing_model(tmp_path, capsys):
    assert main(["verify-store", str(tmp_path / "none.glm53")]) == 1
    o = capsys.readouterr()
    assert "does not exist: nothing was checked" in o.err and "glm53 pack-store" in o.err
    assert "0 of 0 records" not in o.out + o.err
    assert main(["pack-store", "--model", str(tmp_path / "nomodel"), "--out", str(tmp_path / "s")]) == 1
    e = capsys.readouterr().err
    assert "error: model directory" in e and "fix:" in e


def test_bench_store_prints_ratios(tmp_path, capsys):
    assert main(["bench", "store", "--workdir", str(tmp_path / "w"), "--gb", "0.02", "--rounds", "1",
                 "--threads", "2"]) == 0
    o = capsys.readouterr().out
    for what in ("raw  sequential read", "raw  random-record read", "pack-store", "verify-store full",
                 "reader random records"):
        assert what in o
    assert o.count("x raw") == 4 and "4 native parts each, as the engine reads" in o
    assert "the main thread's step-like work" in o and "whole records" in o and "4 parts in native code" in o
    assert not any((tmp_path / "w").iterdir())       # synthetic files removed


def test_bench_store_on_a_store_smaller_than_two_default_windows(ck, tmp_path, capsys):
    # 16 records, 8 threads: the default window (4 x threads) would leave no pair of disjoint windows
    store = tmp_path / "s.glm53"
    assert main(["pack-store", "--model", str(ck), "--out", str(store), "--threads", "2"]) == 0
    capsys.readouterr()
    assert main(["bench", "store", "--path", str(store), "--workdir", str(tmp_path / "w"), "--rounds", "1",
                 "--threads", "8"]) == 0
    o = capsys.readouterr().out
    assert "reader random records (8 threads)" in o and "paired windows of 8 records" in o


def test_bench_store_refuses_a_one_record_store(tmp_path, capsys):
    ck1 = write_exl3_checkpoint(tmp_path / "ck1", seed=0, layers=2, experts=1, top_k=1)
    store = tmp_path / "one.glm53"
    assert main(["pack-store", "--model", str(ck1), "--out", str(store)]) == 0
    capsys.readouterr()
    assert main(["bench", "store", "--path", str(store), "--workdir", str(tmp_path / "w"), "--rounds", "1"]) == 1
    e = capsys.readouterr().err
    assert "holds 1 record(s)" in e and "fix:" in e and "--gb" in e


def test_the_store_never_imports_torch():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    code = ("import sys, store.native, glm53.store_cli, store.pack, store.verify, store.reader, store.synth; "
            "store.native.library(); sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=repo).returncode == 0
    for p in (repo / "store").glob("*.py"):
        assert "import torch" not in p.read_text(), p


def _dev_shm_dir(tmp_path):
    from glm53.store_cli import ram_fs

    shm = Path("/dev/shm")
    if not shm.is_dir() or ram_fs(shm) != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm here")
    d = shm / f"glm53-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    return d


def test_a_store_in_ram_backed_storage_is_told_what_it_costs(ck, tmp_path, capsys, monkeypatch):
    d = _dev_shm_dir(tmp_path)
    monkeypatch.setenv("GLM53_ALLOW_BUFFERED_READS", "1")  # kernels before 6.6: tmpfs has no O_DIRECT
    try:
        out = d / "experts.glm53"
        assert main(["pack-store", "--model", str(ck), "--out", str(out), "--no-verify"]) == 0
        err = capsys.readouterr().err
        assert f"{out} is on tmpfs, which is RAM" in err and "counting against the memory" in err
        assert main(["verify-store", str(out), "--model", str(ck), "--quick"]) == 0
        err = capsys.readouterr().err
        assert "is on tmpfs, which is RAM: its" in err and "GiB stay in RAM" in err
    finally:
        shutil.rmtree(d, ignore_errors=True)
    # ... and a store on a disk is not (tmp_path is not tmpfs here, or the test above proves nothing)
    from glm53.store_cli import ram_fs

    assert ram_fs(tmp_path) is None or pytest.skip("tmp_path is on tmpfs here")
    assert main(["pack-store", "--model", str(ck), "--out", str(tmp_path / "s.glm53"), "--no-verify"]) == 0
    assert "which is RAM" not in capsys.readouterr().err

