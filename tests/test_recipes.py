"""The desktop-plugin recipes, the compose file and the README one-liners: in agreement, and proven end to end.

The end-to-end test does what the plugin does, without a Docker engine: run the recipe's prepare step through
entrypoint.sh on the host (container paths mapped to temporary directories), run it again (it must re-verify,
not repack), start the recipe's serve command through entrypoint.sh, then perform the plugin's readiness check.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from glm53 import recipe as R

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def recipes():
    return R.load()


def by_id(doc, rid):
    return next(r for r in doc["recipes"] if r["id"] == rid)


def test_recipes_are_valid_and_cover_the_mode_families(recipes):
    ids = {r["id"] for r in recipes["recipes"]}
    assert ids == {"glm53-ram", "glm53-nvme-55g", "glm53-nvme-16g"}
    for r in recipes["recipes"]:
        assert r["weights"]["revision"] == "332ab457b709b7ba30dd9a448be5de03b80a7ac9"
        assert r["ulimits"]["memlock"] == -1
        if r["memory"]:
            assert r["prepare"] and r["env"]["GLM53_STORE"].startswith("/store/")


def test_entrypoint_dispatches_exactly_the_commands_recipes_may_use():
    assert R.entrypoint_commands() == set(R.ENTRYPOINT_COMMANDS)


@pytest.mark.parametrize("breakage", ["unknown-command", "unknown-setting", "unknown-prepare-command"])
def test_a_recipe_naming_something_unknown_is_refused(recipes, breakage):
    doc = copy.deepcopy(recipes)
    r = by_id(doc, "glm53-nvme-55g")
    if breakage == "unknown-command":
        r["args"] = ["server"]
    elif breakage == "unknown-setting":
        r["env"]["GLM53_STOER"] = "/store/x"
    else:
        r["prepare"]["args"] = ["packstore", "--model", "/model"]
    with pytest.raises(R.RecipeError):
        R.check(doc)


def test_readme_one_liners_are_the_recipes(recipes):
    readme = (ROOT / "README.md").read_text()
    for r in recipes["recipes"]:
        assert R.docker_run(r) in readme, f"README's docker run line for {r['id']} drifted from docker/recipes.json"
        if r["prepare"]:
            assert R.prepare_run(r) in readme


def test_compose_matches_the_nvme_55g_recipe(recipes):
    r = by_id(recipes, "glm53-nvme-55g")
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    serve = compose["services"]["glm53"]
    assert serve["command"] == r["args"]
    assert serve["environment"] == r["env"]
    assert serve["mem_limit"] == r["memory"] and serve["memswap_limit"] == r["memory"]
    assert serve["shm_size"] == r["shmSize"]
    assert serve["ulimits"]["memlock"] == r["ulimits"]["memlock"]
    assert serve["ports"] == [f"127.0.0.1:{r['port']}:{r['port']}"]
    targets = {next(part for part in v.split(":") if part.startswith("/")) for v in serve["volumes"]}
    assert {r["weights"]["mount"], *r["volumes"].values()} == targets
    pack = compose["services"]["pack-store"]
    assert pack["command"] == r["prepare"]["args"] and pack["network_mode"] == "none"


# --- end to end, as the plugin does it -------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mapped(values, paths):
    """Replace container paths (/model, /store, /cache) by host directories, in args or env values."""
    def one(v: str) -> str:
        for container, host in paths.items():
            if v == container or v.startswith(container + "/"):
                return str(host) + v[len(container):]
        return v
    return [one(v) for v in values]


def entrypoint(args, env, **kw):
    return subprocess.run(["bash", str(ROOT / "entrypoint.sh"), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def exl3_model(tmp_path_factory):
    from glm53.fixture.exl3 import write_exl3_checkpoint

    return write_exl3_checkpoint(tmp_path_factory.mktemp("recipe") / "exl3", seed=3)


def base_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    env.update(GLM53_PYTHON=sys.executable, PYTHONPATH=str(ROOT), GLM53_CACHE_DIR=str(tmp_path / "cache"))
    return env


@pytest.mark.parametrize("rid", [pytest.param("glm53-nvme-55g", marks=pytest.mark.slow), "glm53-ram"])  # one in the unit suite
def test_recipe_prepare_and_serve_pass_the_plugin_readiness_check(recipes, rid, exl3_model, hf_model_dir, tmp_path):
    r = by_id(recipes, rid)
    env = base_env(tmp_path)
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    if r["prepare"]:
        paths = {"/model": exl3_model, "/store": store_dir}
        first = entrypoint(mapped(r["prepare"]["args"], paths), env)
        assert first.returncode == 0, first.stderr[-2000:]
        store_file = Path(mapped([r["env"]["GLM53_STORE"]], paths)[0])
        assert store_file.is_file()
        verify = entrypoint(mapped(r["prepare"]["verifyArgs"], paths), env)
        assert verify.returncode == 0, verify.stderr[-2000:]
        mtime = store_file.stat().st_mtime_ns
        again = entrypoint(mapped(r["prepare"]["args"], paths), env)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "verifying it instead of repacking" in again.stdout + again.stderr
        assert store_file.stat().st_mtime_ns == mtime, "a prepared store was rewritten"

    # Serve: no GPU here, so /model is the tiny bf16 checkpoint on the CPU reference backend.
    port = free_port()
    paths = {"/model": hf_model_dir, "/store": store_dir, "/cache": tmp_path / "cache"}
    senv = dict(env, GLM53_PORT=str(port))
    senv.update({k: mapped([v], paths)[0] for k, v in r["env"].items()})
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(["bash", str(ROOT / "entrypoint.sh"), *r["args"]], env=senv, cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        model_id = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                resp = httpx.get(f"{base}/v1/models", timeout=2)
                if resp.status_code == 200 and resp.json()["data"][0]["id"]:
                    model_id = resp.json()["data"][0]["id"]
                    break
            except (httpx.HTTPError, KeyError, IndexError, json.JSONDecodeError):
                pass
            time.sleep(0.3)
        assert model_id, f"server never became ready:\n{(tmp_path / 'serve.log').read_text()[-3000:]}"
        resp = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": model_id, "max_tokens": 200, "messages": [{"role": "user", "content": "Say hello."}]})
        assert resp.status_code == 200, resp.text
        msg = resp.json()["choices"][0]["message"]
        assert (msg.get("content") or msg.get("reasoning") or msg.get("reasoning_content")), msg
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
