"""SIGTERM (and Ctrl-C) while replies stream: after a short drain every stream ends with its API's final event
(OpenAI chat: an error chunk then [DONE]; Anthropic: `error` then `message_stop`; Responses: `error` then
`response.failed`), a non-streamed reply is a JSON 503, nothing logs a traceback, and the process exits within
10 s (docker stop's grace period). Through a subprocess and real HTTP, as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
LONG = 3000  # tokens: the test model never ends a reply by itself, so each runs until the signal


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requests(url: str) -> dict[str, tuple[str, dict]]:
    user = [{"role": "user", "content": "hi"}]
    return {
        "chat": (url + "/v1/chat/completions", {"messages": user, "stream": True, "max_tokens": LONG}),
        "messages": (url + "/v1/messages", {"model": "x", "messages": user, "stream": True, "max_tokens": LONG}),
        "responses": (url + "/v1/responses", {"input": "hi", "stream": True, "max_output_tokens": LONG}),
        "plain": (url + "/v1/chat/completions", {"messages": user, "max_tokens": LONG}),
    }


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])  # one in the unit suite
def test_a_signal_ends_every_reply_with_its_final_event_and_exits(hf_model_dir: Path, tmp_path: Path, sig):
    port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM53_")}
    env.update(GLM53_CACHE_DIR=str(tmp_path / "cache"), GLM53_PORT=str(port), GLM53_MODEL_DIR=str(hf_model_dir))
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGINT, "
                              "signal.default_int_handler); from glm53.cli import main; sys.exit(main(['serve']))"],
                             cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        got: dict[str, tuple[int, str]] = {}

        def run(name: str, target: str, body: dict) -> None:
            r = httpx.post(target, json=body, timeout=60)
            got[name] = (r.status_code, r.text)

        threads = [threading.Thread(target=run, args=(n, *req)) for n, req in _requests(url).items()]
        for t in threads:
            t.start()
        time.sleep(2.5)  # every reply is generating
        t0 = time.monotonic()
        p.send_signal(sig)
        p.wait(timeout=10)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(10)
    finally:
        if p.poll() is None:
            p.kill()
    output = log.read_text()
    assert elapsed < 10, output
    assert "Traceback" not in output, output
    # A random model ends a reply now and then by itself: such a reply ended normally, the rest were cut.
    cut = {name: ending(name, *got[name]) for name in got}
    assert set(cut) == set(_requests(url)) and any(cut.values()), cut


def _events(text: str) -> list[str]:
    return [line[7:] for line in text.splitlines() if line.startswith("event: ")]


def ending(name: str, status: int, text: str) -> bool:
    """Whether the reply was cut by the shutdown (its API's error ending); asserts it ended one way or the other."""
    if name == "plain":
        assert status in (200, 503), text
        assert status == 200 or json.loads(text)["error"]["code"] == "server_shutting_down", text
        return status == 503
    assert status == 200, text
    if name == "chat":
        assert text.rstrip().endswith("data: [DONE]"), text[-500:]
        return "server_shutting_down" in text.rsplit("data: [DONE]", 1)[0].rstrip().rsplit("\n", 1)[-1]
    events = _events(text)
    if name == "messages":
        assert events[-2:] in (["error", "message_stop"], ["message_delta", "message_stop"]), events[-5:]
        return events[-2] == "error"
    assert events[-1] in ("response.failed", "response.completed", "response.incomplete"), events[-5:]
    if events[-1] != "response.failed":
        return False
    last = json.loads([line for line in text.splitlines() if line.startswith("data: ")][-1][6:])
    assert events[-2] == "error" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "server_shutting_down"
    return True
