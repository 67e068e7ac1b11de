"""`glm53 preflight` on a store the user named: unsound means a non-zero exit with the fix (issue 27, item 8/9)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from glm53 import plan_cli
from glm53.fixture.exl3 import write_exl3_checkpoint
from glm53.planning import host as H
from glm53.planning import settings as S
from store.pack import PackOptions, pack_store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("preflight")
    ck = write_exl3_checkpoint(d / "ck", seed=0, layers=3, experts=8)
    store = d / "experts.glm53"
    pack_store(PackOptions(ck, store, verify=False), log=lambda m: None)
    return ck, store


def preflight(**env: str) -> tuple[int, dict, str]:
    full = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env}
    p = subprocess.run([sys.executable, "-m", "glm53", "preflight", "--json"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, env=full)
    return p.returncode, json.loads(p.stdout), p.stderr


def test_a_truncated_store_fails_preflight_with_the_fix(packed, tmp_path):
    ck, store = packed
    cut = tmp_path / "cut.glm53"
    data = store.read_bytes()
    cut.write_bytes(data[: len(data) // 2 // 4096 * 4096])
    rc, out, err = preflight(GLM53_MODEL_DIR=str(ck), GLM53_STORE=str(cut))
    checks = {c["name"]: c for c in out["checks"]}
    assert rc == 2 and out["blocked"]
    assert checks["store"]["status"] == "fail" and checks["store"]["blocks"], checks["store"]
    assert "preflight: store: " in err and "pack-store" in checks["store"]["detail"]
    # the sound store passes the same checks (the plan itself may refuse here: this machine has no GPU)
    rc, out, err = preflight(GLM53_MODEL_DIR=str(ck), GLM53_STORE=str(store))
    checks = {c["name"]: c for c in out["checks"]}
    assert checks["store"]["status"] == "ok" and checks["o_direct"]["status"] == "ok", checks
    assert "preflight: store" not in err


def test_a_store_without_a_model_fails_preflight(packed):
    _, store = packed
    rc, out, err = preflight(GLM53_STORE=str(store))
    assert out["mode"] == "demo" and rc == 2
    assert "GLM53_STORE=" in err and "GLM53_MODEL_DIR is empty" in err


def _facts_with(store_path: Path, **store_fields) -> H.HostFacts:
    facts = H.read_host("/", store=str(store_path))
    return replace(facts, store=replace(facts.store, **store_fields))


def test_no_o_direct_blocks_unless_buffered_reads_are_allowed(packed):
    _, store = packed
    facts = _facts_with(store, odirect=False, fstype="fuse.sshfs", odirect_how="probe: O_DIRECT refused (EINVAL)")
    strict = plan_cli.check_odirect(None, facts, S.load(environ={}, dotenv=None))
    assert strict.status == "fail" and strict.blocks and "GLM53_ALLOW_BUFFERED_READS=1" in strict.detail
    loose = plan_cli.check_odirect(None, facts, S.load(environ={"GLM53_ALLOW_BUFFERED_READS": "1"}, dotenv=None))
    assert loose.status == "fail" and not loose.blocks and "buffered" in loose.detail


def test_a_store_on_tmpfs_is_told_its_cost(packed, tmp_path):
    ck, store = packed
    shm = Path("/dev/shm")
    facts = H.read_host("/", store=str(shm / "x.glm53"))
    if facts.store.fstype != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    target = shm / f"glm53-preflight-{os.getpid()}.glm53"
    target.write_bytes(store.read_bytes())
    try:
        facts = H.read_host("/", store=str(target))
        settings = S.load(environ={"GLM53_MODEL_DIR": str(ck), "GLM53_STORE": str(target)}, dotenv=None)
        check = plan_cli.check_store_place(facts, settings)
    finally:
        target.unlink()
    assert check.status == "fail" and not check.blocks
    assert "on tmpfs" in check.detail and "which is RAM" in check.detail and "counting against the memory" in check.detail
    # a store on a disk: nothing to say
    facts = H.read_host("/", store=str(store))
    settings = S.load(environ={"GLM53_MODEL_DIR": str(ck), "GLM53_STORE": str(store)}, dotenv=None)
    assert plan_cli.check_store_place(facts, settings).status == "ok" or facts.store.fstype == "tmpfs"
