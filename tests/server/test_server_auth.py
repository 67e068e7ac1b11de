"""GLM53_API_KEY over real HTTP: which routes stay open, and that the key is checked before the body is read."""

from __future__ import annotations

import httpx
import pytest
from server_support import FakeEngine, ServerThread

from glm53.planning import settings as S
from glm53.server import create_app
from glm53.server.app import OPEN_ROUTES

KEY = "sekrit"


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(lambda prompt, params: "hello")
    engine.load()
    settings = S.load(environ={"GLM53_API_KEY": KEY}, dotenv=None)
    with ServerThread(create_app(engine, settings)) as srv:
        yield srv


@pytest.mark.parametrize("path", ["/stats", "/docs", "/openapi.json", "/redoc", "/v1/models", "/nowhere"])
def test_everything_but_the_probes_needs_the_key(server, path):
    r = httpx.get(server.url + path)
    assert r.status_code == 401, (path, r.text)
    assert r.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.get(server.url + path, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == (404 if path == "/nowhere" else 200), (path, ok.text)


def test_the_probes_answer_without_it(server):
    assert OPEN_ROUTES == {"/health", "/ready", "/metrics", "/", "/api/hello"}
    for path in sorted(OPEN_ROUTES):
        assert httpx.get(server.url + path).status_code == 200, path


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_a_malformed_body_without_the_key_gets_401(server, route):
    r = httpx.post(server.url + route, content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 401, r.text
    r = httpx.post(server.url + route, content=b"{not json",
                   headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_the_refusals_are_counted(server):
    httpx.get(server.url + "/stats")
    text = httpx.get(server.url + "/metrics").text
    assert any('status="401"' in line and "/stats" in line for line in text.splitlines()), text[:2000]


def test_a_wrong_key_leaves_a_log_line_naming_the_client(server, caplog):
    """Claude Code retries a 401 quietly for minutes: the server's log is where a user learns why."""
    caplog.set_level("WARNING", logger="glm53.server")
    r = httpx.post(server.url + "/v1/messages", json={}, headers={"x-api-key": "wrong", "user-agent": "claude-cli/x"})
    assert r.status_code == 401
    lines = [rec.getMessage() for rec in caplog.records if "-> 401" in rec.getMessage()]
    assert len(lines) == 1 and "POST /v1/messages" in lines[0] and "API key" in lines[0] and "claude-cli/x" in lines[0]
