"""Bad input over real HTTP (issue 41's probe): each is a 400 naming what is wrong, never a 5xx or a silent 200,
and the connection stays usable."""

from __future__ import annotations

import httpx
import pytest
from server_support import ServerThread, server_settings

from glm53.server import create_app

MODEL = "glm-5.3-flash"
JSON_TYPE = {"Content-Type": "application/json"}
OUTSIDE = [10**6, 2**31 - 1]  # no tokenizer of this model has that many entries


@pytest.fixture(scope="module")
def server(reference_engine):
    with ServerThread(create_app(reference_engine, server_settings())) as srv:
        yield srv


@pytest.mark.parametrize("bad", OUTSIDE)
def test_detokenize_refuses_ids_outside_the_vocabulary_as_completions_does(server, bad):
    ok = httpx.post(server.url + "/detokenize", json={"tokens": [1, 2]})
    assert ok.status_code == 200 and ok.json()["prompt"], ok.text
    r = httpx.post(server.url + "/detokenize", json={"tokens": [1, bad]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tokens.1" and str(bad) in err["message"] and "token id" in err["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, bad], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1", r.text


def test_the_schema_says_a_tool_message_needs_its_call_id(server):
    import jsonschema

    doc = httpx.get(server.url + "/openapi.json").json()
    message = {"$ref": "#/components/schemas/ChatMessage", "components": doc["components"]}
    check = jsonschema.Draft202012Validator(message)
    assert check.is_valid({"role": "tool", "content": "21 C", "tool_call_id": "call_1"})
    assert check.is_valid({"role": "user", "content": "hi"})
    assert not check.is_valid({"role": "tool", "content": "21 C"})
    assert not check.is_valid({"role": "tool", "content": "21 C", "tool_call_id": ""})
    # ... and the server refuses what the schema refuses.
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "21 C"}]})
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"], r.text


LONE = "a\\ud800b"  # a JSON escape of half a surrogate pair: valid JSON, not text
SURROGATE_IN_MODEL = [
    ("/v1/chat/completions", f'{{"model": "{LONE}", "messages": [{{"role": "user", "content": "x"}}]}}'),
    ("/v1/completions", f'{{"model": "{LONE}", "prompt": "x"}}'),
    ("/tokenize", f'{{"model": "{LONE}", "prompt": "x"}}'),
    ("/detokenize", f'{{"model": "{LONE}", "tokens": [1]}}'),
]


@pytest.mark.parametrize("path,body", SURROGATE_IN_MODEL)
def test_a_lone_surrogate_in_model_is_a_400_and_the_connection_stays(server, path, body):
    with httpx.Client(base_url=server.url) as client:
        r = client.post(path, content=body.encode(), headers=JSON_TYPE)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "model" and "lone surrogate" in err["message"], err
        assert client.get("/health").status_code == 200  # the same keep-alive connection


@pytest.mark.parametrize("path,body", [
    ("/v1/responses", f'{{"input": "x", "metadata": {{"k": "{LONE}"}}, "max_output_tokens": 2}}'),
    ("/v1/responses", f'{{"input": "x", "metadata": {{"k": "{LONE}"}}, "max_output_tokens": 2, "stream": true}}'),
    ("/v1/messages", f'{{"model": "{LONE}", "max_tokens": 2, "messages": [{{"role": "user", "content": "x"}}]}}'),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "x"}}], "stop": ["{LONE}"], '
                             f'"max_tokens": 2}}'),
])
def test_a_lone_surrogate_echoed_back_comes_back_as_sent(server, path, body):
    """Fields a route echoes (the Responses API's metadata) or ignores: never a 5xx."""
    r = httpx.post(server.url + path, content=body.encode(), headers=JSON_TYPE, timeout=60)
    assert r.status_code == 200, r.text
    if "metadata" in body and "stream" not in body:
        assert r.json()["metadata"] == {"k": "a\ud800b"}
    if "stream" in body:
        last = r.text.strip().split("\n\n")[-1]  # max_output_tokens ends it: response.incomplete
        assert last.startswith("event: response.incomplete") and "\\ud800" in last, last


@pytest.fixture(scope="module")
def two_slots(hf_model_dir):
    """GLM53_MAX_CONCURRENCY=2, GLM53_MAX_QUEUE=2 on the reference engine: four generations at once, at most."""
    from glm53.engine.reference import ReferenceEngine

    engine = ReferenceEngine(hf_model_dir, max_running=2)
    engine.max_waiting = 2
    engine.load()
    with ServerThread(create_app(engine, server_settings(max_concurrency=2, max_queue=2))) as srv:
        yield srv
    engine.close()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5, "max_tokens": 2}, "n"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2}, "prompt"),
])
def test_more_choices_than_slots_and_queue_is_a_400_saying_why(two_slots, path, body, param):
    """It was a 429 "retry shortly", on an idle server, forever."""
    r = httpx.post(two_slots.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "too_many_choices", err
    assert "at most 4" in err["message"] and "GLM53_MAX_CONCURRENCY" in err["message"]
    assert "GLM53_MAX_QUEUE" in err["message"]


def test_as_many_choices_as_slots_and_queue_are_served(two_slots):
    body = {"messages": [{"role": "user", "content": "x"}], "n": 4, "max_tokens": 2}
    r = httpx.post(two_slots.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
