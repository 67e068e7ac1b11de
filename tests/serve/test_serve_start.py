"""`glm53 serve` start-up as a user meets it, through a subprocess: the port, the address, stopping mid-load."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    full_env.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "glm53", *args], cwd=ROOT, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _free_port(host: str = "127.0.0.1", family: int = socket.AF_INET) -> int:
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _lines_until(p: subprocess.Popen, phrase: str, timeout: float = 90) -> list[str]:
    lines: list[str] = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if phrase in line:
            return lines
    raise AssertionError(f"no {phrase!r} in:\n" + "\n".join(lines))


def test_a_port_in_use_is_one_line_before_anything_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        p = _run(["serve", "--port", str(port)], {"GLM53_CACHE_DIR": str(tmp_path)})
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 2, out
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1, out
    assert f"port {port}" in lines[0] and "GLM53_PORT" in lines[0] and "Errno" not in lines[0]
    assert not list(tmp_path.iterdir())  # the demo model was not even generated


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_host_is_refused_by_name(value):
    p = _run(["serve"], {"GLM53_HOST": value})
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2
    assert "GLM53_HOST=" in out and "every interface" in out and "listen on  " not in out


def test_an_ipv6_address_is_logged_with_brackets(hf_model_dir, tmp_path):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        port = _free_port("::1", socket.AF_INET6)
    except OSError:
        pytest.skip("::1 is not configured here")
    p = _run(["serve", "--model", str(hf_model_dir), "--host", "::1", "--port", str(port)],
             {"GLM53_CACHE_DIR": str(tmp_path)})
    try:
        lines = _lines_until(p, "glm53 ready")
        log = "\n".join(lines)
        assert f"HTTP on http://[::1]:{port}" in log and f"Uvicorn running on http://[::1]:{port}" in log
        assert f"at http://[::1]:{port}/v1" in lines[-1], log
        assert httpx.get(f"http://[::1]:{port}/health").status_code == 200
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_stopped_while_loading_says_so_and_never_ready(hf_model_dir, tmp_path):
    port = _free_port()
    p = _run(["serve", "--model", str(hf_model_dir), "--port", str(port)], {"GLM53_CACHE_DIR": str(tmp_path)})
    _lines_until(p, "checkpoint shards: 0%")  # uvicorn runs (its signal handlers are in) and the load began
    p.send_signal(signal.SIGTERM)  # torch and transformers are still importing: the load has not finished
    out, _ = p.communicate(timeout=60)
    assert "Application shutdown complete" in out, out
    after = out.split("Application shutdown complete", 1)[1]
    assert "ready" not in after, out
    assert "the load is abandoned" in out


def test_a_store_without_a_model_is_warned_about(tmp_path):
    p = _run(["serve", "--port", str(_free_port())], {"GLM53_CACHE_DIR": str(tmp_path),
                                                     "GLM53_STORE": str(tmp_path / "experts.glm53")})
    try:
        lines = _lines_until(p, "GLM53_STORE=")
    finally:
        p.terminate()
        p.wait(timeout=30)
    assert lines[-1].startswith("WARNING") and "GLM53_MODEL_DIR is empty" in lines[-1]
