"""The `glm53` front door as a user meets it: through a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    env.update(extra)
    return env


def test_a_closed_stdout_ends_quietly(tmp_path):
    # `glm53 plan --json | head -1`: the reader is gone before the plan is printed.
    p = subprocess.Popen([sys.executable, "-m", "glm53", "plan", "--json"], cwd=ROOT, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    p.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert p.returncode == 141


def test_help_says_that_bare_glm53_serves():
    p = subprocess.run([sys.executable, "-m", "glm53", "--help"], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0
    assert "with no command runs `glm53 serve`" in " ".join(p.stdout.split())


def test_a_bad_bool_lists_the_accepted_words():
    p = subprocess.run([sys.executable, "-m", "glm53", "plan"], cwd=ROOT, env=_env(GLM53_EXACT="maybe"),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "GLM53_EXACT='maybe' is invalid" in p.stderr and "1/0, true/false, yes/no, on/off" in p.stderr


def test_the_demo_plan_reports_the_context_the_demo_serves(tmp_path):
    from glm53.planning import settings as S
    from glm53.serve.choice import choose_engine

    env = _env(GLM53_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "glm53", "plan", "--json"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    out = json.loads(p.stdout)
    assert out["mode"] == "demo" and "demo checkpoint" in out["reasons"]["kv_tokens"]
    settings = S.load(environ={k: v for k, v in env.items() if k.startswith("GLM53_")}, dotenv=None)
    choice = choose_engine(settings)
    assert choice.demo and choice.engine.kind == "reference-cpu"  # this machine has no GPU
    assert out["kv_tokens"] == choice.engine.context_length == 131072  # room for an agent's first request


def test_fixture_help_gives_the_real_expert_size():
    p = subprocess.run([sys.executable, "-m", "glm53", "fixture", "--help"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    text = " ".join(p.stdout.split())
    assert "288 experts of 9.04 MiB per layer" in text and "3K MiB" not in text
