"""vLLM's ignore_eos and min_tokens on the OpenAI routes (benchmark clients send them), over HTTP against the demo
model, whose replies end after a few dozen tokens: min_tokens holds the end-of-turn tokens back until that many
were generated, ignore_eos until max_tokens."""

from __future__ import annotations

import json

import httpx
import pytest
from server_support import ServerThread, server_settings

from glm53.server import create_app

HI = {"messages": [{"role": "user", "content": "hi"}], "seed": 1, "max_tokens": 120}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from glm53.engine.reference import ReferenceEngine
    from glm53.serve.demo import ensure_demo_model

    engine = ReferenceEngine(ensure_demo_model(tmp_path_factory.mktemp("demo")), context_length=4096)
    engine.load()
    with ServerThread(create_app(engine, server_settings())) as srv:
        yield srv
    engine.close()


def chat(server, **extra) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", json={**HI, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_demo_ends_its_reply_early(server):
    body = chat(server)
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] < 80, body["usage"]


def test_min_tokens_generates_at_least_that_many(server):
    body = chat(server, min_tokens=80)
    assert body["usage"]["completion_tokens"] >= 80, body["usage"]


def test_ignore_eos_runs_to_max_tokens(server):
    body = chat(server, ignore_eos=True)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 120
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 30, "ignore_eos": True,
                                                          "stream": True, "stream_options": {"include_usage": True},
                                                          "seed": 2}, timeout=120)
    frames = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert frames[-1]["usage"]["completion_tokens"] == 30
    assert [c["finish_reason"] for f in frames for c in f["choices"] if c["finish_reason"]] == ["length"]


@pytest.mark.parametrize("extra", [{"min_tokens": -1}, {"min_tokens": "5"}, {"ignore_eos": "yes"}])
def test_bad_values_are_400s(server, extra):
    r = httpx.post(server.url + "/v1/chat/completions", json={**HI, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text
