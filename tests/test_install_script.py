"""docker/install.sh decides the torch index once, with one short probe, and says which it used."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A python that has no torch and whose pip only records its arguments; everything else is the real interpreter.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-c" ] && [ "$2" = "import torch" ]; then exit 1; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip $*" >> "$PIP_LOG"; exit 0; fi
exec {real} "$@"
"""


def run_install(tmp_path: Path, index: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "pip.log"
    env = {"PATH": "/usr/bin:/bin", "PIP_LOG": str(log), "TORCH_INDEX": index, "HOME": str(tmp_path)}
    p = subprocess.run(["bash", str(ROOT / "docker" / "install.sh"), str(fake)], env=env, capture_output=True,
                       text=True, timeout=60)
    return p, log.read_text().splitlines() if log.exists() else []


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def index_server(tmp_path):
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<html></html>")
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(root), **kw)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.RequestHandlerClass.log_message = lambda *a: None
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.mark.skipif(os.path.exists("/usr/bin/nvidia-smi"), reason="a GPU host installs the CUDA build from PyPI")
def test_an_unreachable_index_is_decided_once(tmp_path):
    index = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    p, pip = run_install(tmp_path, index)
    assert p.returncode == 0, p.stderr
    torch_installs = [x for x in pip if "torch" in x and "-e" not in x.split()]
    assert len(torch_installs) == 1 and "--index-url" not in torch_installs[0], pip
    assert f"from the configured index (pip.conf or PyPI), as {index} is not reachable from here" in p.stdout
    assert "Retrying" not in p.stdout + p.stderr


@pytest.mark.skipif(os.path.exists("/usr/bin/nvidia-smi"), reason="a GPU host installs the CUDA build from PyPI")
def test_a_reachable_index_is_used_and_named(tmp_path, index_server):
    p, pip = run_install(tmp_path, index_server)
    torch_installs = [x for x in pip if "torch" in x and "-e" not in x.split()]
    assert len(torch_installs) == 1 and f"--index-url {index_server}" in torch_installs[0], pip
    assert f"from {index_server}\n" in p.stdout
