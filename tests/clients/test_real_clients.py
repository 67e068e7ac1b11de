"""The real agent CLIs (Claude Code, Codex; versions in tests/clients/clients.json, installed into .clients/ by
tests/clients/install.sh) against `glm53 serve` on the demo, set up exactly as docs/clients.md says, through a
recording proxy: each completes a turn with its default prompt and tools, the server log has no refused request,
and Claude Code's second turn is served mostly from the prefix cache; a pasted screenshot (Claude Code) and
an attached image (Codex `--image`) reach the server and their turns complete.

Each test takes a minute or two on a 2-core machine (the agents' first prompts are ~20,000 tokens). Without the
CLIs they skip, except in CI, where they must run.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from recording_proxy import serve as serve_proxy

pytestmark = pytest.mark.slow  # end to end and long: make test runs it after the unit suite

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / ".clients" / "node_modules" / ".bin"
DOCS = ROOT / "docs" / "clients.md"
REFUSAL = re.compile(r" -> [45]\d\d: ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{path} is missing: tests/clients/install.sh installs the real clients (needs npm)")
        pytest.skip(f"{name} is not installed: run bash tests/clients/install.sh")
    return path


class Served:
    def __init__(self, url: str, log: Path, capture: Path) -> None:
        self.url, self.log, self.capture = url, log, capture

    def refusals(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if REFUSAL.search(line)]

    def records(self) -> list[dict]:
        if not self.capture.exists():
            return []
        return [json.loads(line) for line in self.capture.read_text().splitlines()]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`glm53 serve` on the demo (a fresh cache directory) behind the recording proxy."""
    work = tmp_path_factory.mktemp("clients")
    port, proxy_port = _free_port(), _free_port()
    env = {**os.environ, "GLM53_CACHE_DIR": str(work / "cache"), "GLM53_PORT": str(port),
           "GLM53_MODEL_DIR": "", "GLM53_API_KEY": ""}
    log = work / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "glm53", "serve"], cwd=ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
    proxy = serve_proxy(proxy_port, f"http://127.0.0.1:{port}", str(work / "capture.jsonl"))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert server.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the demo server did not become ready:\n" + log.read_text())
        yield Served(f"http://127.0.0.1:{proxy_port}", log, work / "capture.jsonl")
    finally:
        proxy.shutdown()
        server.terminate()
        server.wait(30)


def _doc_block(language: str, marker: str) -> str:
    """The fenced `language` block of docs/clients.md that contains `marker`."""
    for block in re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), re.S):
        if marker in block:
            return block
    raise AssertionError(f"docs/clients.md has no {language} block with {marker!r}")


def claude_env(base_url: str, home: Path) -> dict[str, str]:
    """The variables docs/clients.md exports for Claude Code, pointed at `base_url`, evaluated by bash."""
    exports = [line for line in _doc_block("bash", "ANTHROPIC_BASE_URL").splitlines() if line.startswith("export ")]
    script = "\n".join(exports).replace("http://127.0.0.1:30000", base_url) + "\nenv -0"
    env = {"PATH": os.environ["PATH"], "HOME": str(home)}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)


def codex_home(base_url: str, home: Path) -> Path:
    config = _doc_block("toml", "model_providers").replace("http://127.0.0.1:30000/v1", f"{base_url}/v1")
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(config)
    return home


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "README.md").write_text("# demo\n")
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    return project


def _run(cmd: list[str], cwd: Path, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, input=stdin,
                          stdin=subprocess.DEVNULL if stdin is None else None)


def _screenshot(path: Path) -> Path:
    """A screenshot-like PNG: a window with a title bar and a few lines of "text"."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (640, 400), (245, 245, 245))
    draw = ImageDraw.Draw(img)
    draw.rectangle((0, 0, 640, 28), fill=(40, 44, 52))
    for i in range(8):
        draw.rectangle((24, 48 + 36 * i, 24 + 60 * (i % 5 + 3), 64 + 36 * i), fill=(30, 90 + 15 * i, 200))
    img.save(path)
    return path


def _image_parts(body: object) -> list[dict]:
    """Every image part of a recorded request body, whatever the API calls it."""
    if isinstance(body, list):
        return [p for item in body for p in _image_parts(item)]
    if not isinstance(body, dict):
        return []
    own = [body] if body.get("type") in ("image", "input_image", "image_url") else []
    return own + [p for v in body.values() for p in _image_parts(v)]


def _turns(records: list[dict], path: str) -> list[dict]:
    return [r for r in records if r["path"].startswith(path) and r["method"] == "POST"]


def test_claude_code_completes_two_turns_and_the_second_is_cached(served: Served, tmp_path: Path) -> None:
    claude = _cli("claude")
    project = _project(tmp_path)
    env = claude_env(served.url, tmp_path / "home")
    before = len(_turns(served.records(), "/v1/messages"))
    first = _run([str(claude), "-p", "List the files here.", "--output-format", "json"], project, env)
    assert first.returncode == 0, first.stdout + first.stderr
    result = json.loads(first.stdout)
    assert result["is_error"] is False and result["subtype"] == "success", result
    turn1 = _turns(served.records(), "/v1/messages")[before:]
    assert turn1 and all(r["status"] == 200 for r in turn1), [r["status"] for r in turn1]

    second = _run([str(claude), "-p", "Thanks. Anything else?", "--continue", "--output-format", "json"], project, env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert json.loads(second.stdout)["is_error"] is False
    turn2 = _turns(served.records(), "/v1/messages")[before + len(turn1):]
    assert turn2 and all(r["status"] == 200 for r in turn2)
    usage = turn2[0]["usage"]
    cached, prompt = usage["cache_read_input_tokens"], usage["cache_read_input_tokens"] + usage["input_tokens"]
    assert cached / prompt >= 0.9, usage
    assert not served.refusals(), served.refusals()


def test_claude_code_takes_a_pasted_image(served: Served, tmp_path: Path) -> None:
    """A pasted screenshot reaches the server as Claude Code sends it (an image block of base64 PNG, through its
    streaming input, which is what its paste produces) and the turn completes."""
    import base64

    claude = _cli("claude")
    project = _project(tmp_path)
    env = claude_env(served.url, tmp_path / "home")
    data = base64.b64encode(_screenshot(tmp_path / "shot.png").read_bytes()).decode()
    message = {"type": "user", "message": {"role": "user", "content": [
        {"type": "text", "text": "What does this screenshot show?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}}
    before = len(_turns(served.records(), "/v1/messages"))
    done = _run([str(claude), "-p", "--input-format", "stream-json", "--output-format", "stream-json", "--verbose"],
                project, env, stdin=json.dumps(message) + "\n")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["type"] == "result" and result["is_error"] is False, result
    turn = _turns(served.records(), "/v1/messages")[before:]
    assert turn and all(r["status"] == 200 for r in turn), [r["status"] for r in turn]
    sent = [p for r in turn for p in _image_parts(r["body"])]
    assert sent and sent[0]["source"]["data"] == data, [list(p) for p in sent]
    assert not served.refusals(), served.refusals()


def test_codex_takes_an_attached_image(served: Served, tmp_path: Path) -> None:
    codex = _cli("codex")
    project = _project(tmp_path)
    env = {"PATH": os.environ["PATH"], "HOME": str(codex_home(served.url, tmp_path / "home")), "GLM53_API_KEY": "none"}
    shot = _screenshot(tmp_path / "shot.png")
    before = len(_turns(served.records(), "/v1/responses"))
    # --image takes several files, so the prompt comes first
    done = _run([str(codex), "exec", "What does this screenshot show?", "--image", str(shot)], project, env)
    assert done.returncode == 0, done.stdout + done.stderr
    turn = _turns(served.records(), "/v1/responses")[before:]
    assert turn and all(r["status"] == 200 for r in turn), [r["status"] for r in turn]
    assert any(p["type"] == "input_image" for r in turn for p in _image_parts(r["body"])), turn[0]["body"]
    assert "ERROR" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert not served.refusals(), served.refusals()


def test_codex_completes_a_turn(served: Served, tmp_path: Path) -> None:
    codex = _cli("codex")
    project = _project(tmp_path)
    env = {"PATH": os.environ["PATH"], "HOME": str(codex_home(served.url, tmp_path / "home")), "GLM53_API_KEY": "none"}
    before = len(_turns(served.records(), "/v1/responses"))
    done = _run([str(codex), "exec", "List the files here."], project, env)
    assert done.returncode == 0, done.stdout + done.stderr
    turn = _turns(served.records(), "/v1/responses")[before:]
    assert turn and all(r["status"] == 200 for r in turn), [r["status"] for r in turn]
    assert "ERROR" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert turn[-1]["usage"]["output_tokens"] > 0
    assert not served.refusals(), served.refusals()
