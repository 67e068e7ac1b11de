"""Slow clients over real sockets (issue 41's probe: incomplete requests stayed open forever): headers must be
complete within the protocol's deadline (glm53.serve.http) and a body may not stall (BodyLimit's 408); a client
that keeps to both is never cut off, however long its request then runs. Each uvicorn protocol glm53 may run on is
tested: httptools (uvicorn's choice where it is installed) and h11."""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest
from server_support import FakeEngine, ServerThread, server_settings
from uvicorn.protocols.http.h11_impl import H11Protocol

from glm53.serve.http import protocol
from glm53.server import app as server_app
from glm53.server import create_app

DEADLINE_S = 0.5
BASES = [pytest.param(H11Protocol, id="h11")]
try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    BASES.append(pytest.param(HttpToolsProtocol, id="httptools"))
except ImportError:  # uvicorn[standard] brings it; without it uvicorn runs h11 only
    pass


@pytest.fixture(params=BASES)
def server(request, monkeypatch):
    monkeypatch.setattr(server_app, "BODY_IDLE_S", DEADLINE_S)
    engine = FakeEngine(lambda prompt, params: "A thought.</think>\nAn answer.")
    engine.load()
    with ServerThread(create_app(engine, server_settings()), http=protocol(DEADLINE_S, base=request.param)) as srv:
        yield srv


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def post_head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def body(path: str) -> bytes:
    """A request both chat and Messages accept."""
    return json.dumps({"model": "glm-5.3-flash", "max_tokens": 64,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_half_sent_headers_are_cut_off_and_others_are_served(server, caplog):
    with caplog.at_level(logging.WARNING, logger="glm53.server"), connect(server) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the blank line
        assert httpx.get(server.url + "/health").status_code == 200  # others get in meanwhile
        assert read_until_closed(slow) == b""
    assert any("no complete request headers within" in r.getMessage() and "its opening" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_an_idle_keep_alive_connection_is_cut_after_its_answer(server, caplog):
    with caplog.at_level(logging.WARNING, logger="glm53.server"), connect(server) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /health HTTP/1.1\r\nHost: 1")
        answer = read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1 ") == 1, answer[:200]
    assert any("the previous response" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_stalled_body_gets_408_in_the_routes_shape(server, path, caplog):
    payload = body(path)
    with caplog.at_level(logging.WARNING, logger="glm53.server"), connect(server) as s:
        s.sendall(post_head(path, len(payload)) + payload[:10])
        answer = read_until_closed(s)
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"connection: close" in head.lower(), head  # the body's rest is never read as a next request
    doc = json.loads(text)
    message = doc["error"]["message"]
    assert "stopped arriving" in message and f"after 10 bytes of the {len(payload)}" in message, doc
    if path == "/v1/messages":
        assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"
    else:
        assert doc["error"]["code"] == "request_timeout"
    assert any("408" in r.getMessage() and "stopped arriving" in r.getMessage() for r in caplog.records)


def test_a_client_that_keeps_sending_is_never_cut_off(server):
    """Headers in time, then a body dripped for three deadlines in all, each pause inside the body's deadline: the
    header deadline is over once the headers are in, and the answer comes whole."""
    payload = body("/v1/chat/completions")
    with connect(server) as s:
        s.sendall(post_head("/v1/chat/completions", len(payload)))
        pieces = 8
        step = -(-len(payload) // pieces)
        for i in range(0, len(payload), step):
            time.sleep(3 * DEADLINE_S / pieces)
            s.sendall(payload[i:i + step])
        s.settimeout(10)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, answer
            answer += chunk
    head, _, text = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer[:300]
    assert json.loads(text)["choices"][0]["message"]["content"] == "An answer."
