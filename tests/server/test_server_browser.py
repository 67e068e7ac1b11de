"""Browser safety over real HTTP (issue 41): a web page the user opens cannot use the key-less loopback server, by
DNS rebinding (Host), by a cross-site request (Origin) or by a POST that needs no preflight (Content-Type); what is
allowed is one setting, GLM53_ALLOWED_ORIGINS. Real clients (the SDKs, Claude Code, Codex) send Host 127.0.0.1:port
and no Origin, so nothing changes for them."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from server_support import FakeEngine, ServerThread, server_settings

from glm53.server import create_app

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
MESSAGES = {"model": "glm-5.3-flash", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}


def serve(**env: str) -> ServerThread:
    engine = FakeEngine(lambda prompt, params: "hello")
    engine.load()
    return ServerThread(create_app(engine, server_settings(**env)))


@pytest.fixture(scope="module")
def server():
    with serve() as srv:
        yield srv


@pytest.fixture(scope="module")
def allowing():
    with serve(allowed_origins="https://app.example, http://gpubox.lan:30000", host="box.internal") as srv:
        yield srv


def refused(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == code, err
    return err["message"]


@pytest.mark.parametrize("method,path", [("GET", "/stats"), ("GET", "/v1/models"), ("GET", "/health"),
                                         ("POST", "/v1/chat/completions")])
def test_a_foreign_host_name_is_refused_saying_how_to_allow_it(server, method, path, caplog):
    caplog.set_level("WARNING", logger="glm53.server")
    r = httpx.request(method, server.url + path, json=CHAT if method == "POST" else None,
                      headers={"Host": f"attacker.example:{server.port}"})
    message = refused(r, 421, "host_not_allowed")
    assert "attacker.example" in message and "DNS rebinding" in message
    assert f"GLM53_ALLOWED_ORIGINS=http://attacker.example:{server.port}" in message
    assert any("-> 421" in rec.getMessage() and path in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "[::1]:{port}",
                                  "app.localhost:{port}", "192.168.1.20:{port}", "[fe80::1]", "localhost."])
def test_loopback_names_and_addresses_are_served(server, host):
    r = httpx.get(server.url + "/stats", headers={"Host": host.format(port=server.port)})
    assert r.status_code == 200, r.text


def test_docker_binds_every_interface_and_is_reached_at_localhost():
    """The image binds 0.0.0.0 and `docker run -p 8000:30000` is reached at localhost:8000; a LAN name needs the
    setting, its IP address does not."""
    with serve(host="0.0.0.0", allow_no_api_key="1") as srv:
        for host in ("localhost:8000", "127.0.0.1:8000", "192.168.1.20:30000"):
            assert httpx.get(srv.url + "/v1/models", headers={"Host": host}).status_code == 200, host
        assert httpx.get(srv.url + "/v1/models", headers={"Host": "gpubox.lan:30000"}).status_code == 421


def test_a_page_of_another_site_is_refused(server, caplog):
    caplog.set_level("WARNING", logger="glm53.server")
    evil = {"Origin": "https://evil.example"}
    message = refused(httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=evil), 403,
                      "origin_not_allowed")
    assert "https://evil.example" in message and "GLM53_ALLOWED_ORIGINS=https://evil.example" in message
    refused(httpx.get(server.url + "/stats", headers=evil), 403, "origin_not_allowed")
    # Anthropic's route answers in Anthropic's shape.
    assert httpx.get(server.url + "/stats", headers=evil).json()["error"]["type"] == "permission_error"
    r = httpx.post(server.url + "/v1/messages", json=MESSAGES, headers=evil)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    # A sandboxed frame or a file:// page says "null".
    assert httpx.get(server.url + "/stats", headers={"Origin": "null"}).status_code == 403
    assert sum("-> 403" in rec.getMessage() for rec in caplog.records) == 5


def test_the_servers_own_pages_are_its_own_site(server):
    # /docs ("Try it out") posts with the Origin of the page it came from.
    own = {"Origin": server.url}
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=own).status_code == 200
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                   headers={"Origin": f"http://localhost:{server.port}", "Host": f"localhost:{server.port}"})
    assert r.status_code == 200
    # The same page under a rebound name fails the Host check first.
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                   headers={"Origin": f"http://attacker.example:{server.port}",
                            "Host": f"attacker.example:{server.port}"})
    assert r.status_code == 421


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_post_that_is_not_declared_json_is_refused(server, content_type, caplog):
    """What a page may send anywhere without a preflight: text/plain, a form, a Blob without a type."""
    caplog.set_level("WARNING", logger="glm53.server")
    headers = {"Content-Type": content_type} if content_type else {}
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}'
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=headers)
    message = refused(r, 415, "unsupported_media_type")
    assert "Content-Type: application/json" in message and "--json" in message
    assert (content_type or "no Content-Type") in message
    r = httpx.post(server.url + "/v1/messages", content=body, headers=headers)
    assert r.status_code == 415 and r.json()["type"] == "error", r.text
    assert any("-> 415" in rec.getMessage() for rec in caplog.records)


def test_json_with_a_charset_is_json(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}]}',
                   headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_a_refused_large_body_is_answered_not_reset(server):
    body = b"x" * (2 << 20)
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"Content-Type": "text/plain"})
    assert r.status_code == 415


def test_the_real_clients_send_what_is_allowed(server):
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    reply = oa.chat.completions.create(model="glm-5.3-flash", messages=CHAT["messages"], max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    assert an.messages.create(**MESSAGES).stop_reason == "max_tokens"


def test_allowed_origins_get_cors_and_their_hosts_are_served(allowing):
    url = allowing.url + "/v1/chat/completions"
    pre = httpx.options(url, headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = httpx.post(url, json=CHAT, headers={"Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    # Another site still gets nothing, preflight included.
    assert httpx.options(url, headers={"Origin": "https://evil.example",
                                       "Access-Control-Request-Method": "POST"}).status_code == 403
    # The names the origins and GLM53_HOST give are served; others are not.
    for host in ("gpubox.lan:30000", "gpubox.lan", "app.example", "box.internal:8000"):
        assert httpx.get(allowing.url + "/stats", headers={"Host": host}).status_code == 200, host
    assert httpx.get(allowing.url + "/stats", headers={"Host": "other.lan"}).status_code == 421


def test_a_star_lets_every_site_and_name_through():
    with serve(allowed_origins="*") as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT,
                       headers={"Origin": "https://any.example", "Host": "any.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        # Still JSON only.
        assert httpx.post(srv.url + "/v1/chat/completions", content=b"{}",
                          headers={"Content-Type": "text/plain"}).status_code == 415
