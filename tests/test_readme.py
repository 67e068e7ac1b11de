"""README tells the truth: its first requests get answers, its routes are the app's, its make lines run."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from server_support import FakeEngine, ServerThread

from glm53.planning import settings as S
from glm53.server import create_app
from glm53.server.app import ROUTES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
THOUGHT = " ".join(["Let me think about what to say back to a greeting."] * 6)


def curl_bodies() -> list[dict]:
    """The JSON bodies of the curl examples in README's first request block (the one after `make serve`)."""
    blocks = README.split("```")[1::2]
    block = next(b for b in blocks if "curl" in b)
    return [json.loads(m) for m in re.findall(r"-d '(\{.*?\})'", block)]


def script(prompt: str, params) -> str:
    # A model that thinks for ~300 tokens when the template opened a thought, and answers in either case.
    thinking = prompt.rstrip().endswith("<think>")
    return (THOUGHT + "</think>\n" if thinking else "") + "Hello! How can I help?"


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(script)
    engine.load()
    with ServerThread(create_app(engine, S.load(environ={}, dotenv=None))) as srv:
        yield srv


def test_the_first_examples_get_an_answer(server):
    bodies = curl_bodies()
    assert len(bodies) == 2
    off, on = bodies
    assert off["chat_template_kwargs"] == {"enable_thinking": False} and "chat_template_kwargs" not in on
    for body in bodies:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        msg = r.json()["choices"][0]["message"]
        assert r.status_code == 200 and msg["content"] == "Hello! How can I help?", (body, r.json())
    assert msg["reasoning_content"].startswith("Let me think")
    # ... and why the old example answered nothing: 20 tokens, all of them thinking
    r = httpx.post(server.url + "/v1/chat/completions", json={**on, "max_tokens": 20}, timeout=30).json()
    assert not r["choices"][0]["message"]["content"] and r["choices"][0]["finish_reason"] == "length"
    assert "reasoning_content" in README and '"enable_thinking": false' in README


def test_the_route_list_is_the_apps():
    line = next(x for x in README.splitlines() if x.startswith("| `glm53 serve`"))
    listed = set(re.findall(r"`(/[a-z0-9/_]+)`", line))
    assert listed == set(ROUTES), (listed ^ set(ROUTES))


def test_readme_says_how_to_run_the_commands():
    assert ".venv/bin/glm53" in README and "source .venv/bin/activate" in README
    assert "`glm53` with no\ncommand runs `glm53 serve`" in README or "no command runs `glm53 serve`" in " ".join(
        README.split())


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_build_image_is_readmes_docker_build_line():
    line = next(x for x in README.splitlines() if x.startswith("docker build "))
    out = subprocess.run(["make", "-n", "-s", "build-image"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == line
    other = subprocess.run(["make", "-n", "-s", "build-image", "TORCH_CUDA_ARCH_LIST=8.9"], cwd=ROOT,
                           capture_output=True, text=True, timeout=30)
    assert other.stdout.strip() == line.replace("=8.6", "=8.9")
