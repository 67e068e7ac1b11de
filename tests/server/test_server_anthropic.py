"""Anthropic Messages API conformance: the real engine (the CPU reference engine in CI) behind real uvicorn,
driven with the official anthropic SDK (and raw HTTP where the SDK hides the wire format), against both chat
template variants. The model's text is random: these tests check protocol and shape, not answer content."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import jsonschema
import pytest
from server_support import (
    OK_SCHEMA,
    RUN_TESTS_PARAMS,
    WEATHER_PARAMS,
    FakeEngine,
    ServerThread,
    serve_variant,
    server_settings,
    wait_until,
)

from glm53.server import create_app
from glm53.server.anthropic_api import MessagesRequest, to_chat

MODEL = "glm-5.3-flash"
JSON_TYPE = {"Content-Type": "application/json"}
BUDGET = 8  # the server's reasoning budget: thinking closes after at most 8 tokens
WEATHER = {"name": "get_weather", "description": "Current weather for a city", "input_schema": WEATHER_PARAMS}
RUN_TESTS = {"name": "run_tests", "description": "Run a test file", "input_schema": RUN_TESTS_PARAMS}
TOOLS = [WEATHER, RUN_TESTS]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
OFF = {"type": "disabled"}


@pytest.fixture(scope="module", params=["glm53", "glm45"])
def server(request, tmp_path_factory):
    yield from serve_variant(request, tmp_path_factory, reasoning_budget=BUDGET)


@pytest.fixture(scope="module")
def engine(server):
    return server.engine


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def prompt_of(server, body: dict) -> str:
    """The prompt the server runs for a Messages request (its chat translation, through /tokenize)."""
    chat = to_chat(MessagesRequest.model_validate(body)).model_dump(exclude_none=True, exclude={"stop", "n", "stream"})
    return httpx.post(server.url + "/tokenize", json=chat).json()["prompt"]


def test_any_model_name_is_served_and_named(client, engine):
    kw = dict(max_tokens=6, messages=user("hi"), thinking=OFF, extra_body={"seed": 3})
    r = client.messages.create(model="claude-sonnet-4-5", **kw)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.usage.output_tokens <= 6 and r.usage.input_tokens > 0
    again = client.messages.create(model="claude-opus-4-1", **kw)
    # The prompt's tokens are either computed or read from the prefix cache (the exllamav3 engine's page cache,
    # whole pages only; the CPU reference engine has none).
    total = r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    if engine.kind == "reference-cpu":
        assert again.usage.cache_read_input_tokens == 0


def test_max_tokens_and_stop_sequence(client):
    r = client.messages.create(model=MODEL, max_tokens=3, messages=user("hi"), thinking=OFF, extra_body={"seed": 3})
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3 and r.stop_sequence is None
    # Stops the random text is sure to contain: the reply ends at the first, which is named and never sent.
    stops = ["e", "a", " ", "o", "i"]
    r = client.messages.create(model=MODEL, max_tokens=60, messages=user("hi"), thinking=OFF, stop_sequences=stops,
                               extra_body={"seed": 3})
    assert r.stop_reason == "stop_sequence" and r.stop_sequence in stops
    assert not any(s in (r.content[0].text if r.content else "") for s in stops)


def check_sequence(events: list) -> None:
    """message_start, then per block start/deltas/stop with consecutive indices, message_delta, message_stop."""
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    open_index, next_index = None, 0
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_index is None and e.index == next_index
            open_index, next_index = e.index, next_index + 1
        elif e.type == "content_block_delta":
            assert e.index == open_index
        else:
            assert e.type == "content_block_stop" and e.index == open_index, e
            open_index = None
    assert open_index is None


def test_streamed_equals_non_streamed_with_thinking(client):
    kw = dict(model=MODEL, max_tokens=24, messages=user("What is 17*3?"), extra_body={"seed": 5},
              thinking={"type": "enabled", "budget_tokens": 4})
    whole = client.messages.create(**kw)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking and whole.content[0].signature == ""
    assert "<think>" not in whole.content[0].thinking and "</think>" not in whole.content[0].thinking
    events = list(client.messages.create(stream=True, **kw))
    check_sequence(events)
    start = events[0].message
    assert start.model == MODEL and start.content == [] and start.usage.input_tokens == whole.usage.input_tokens
    kinds = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert kinds == [b.type for b in whole.content]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert {"thinking_delta", "signature_delta"} <= deltas
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_thinking_budget_and_off(client, server):
    r = client.messages.create(model=MODEL, max_tokens=30, messages=user("hi"), extra_body={"seed": 2},
                               thinking={"type": "enabled", "budget_tokens": 3})
    assert r.content[0].type == "thinking"
    # The request's budget (3) is under the server's (8): at most 3 tokens of thinking, then the close tag.
    tokens = len(httpx.post(server.url + "/tokenize", json={"prompt": r.content[0].thinking,
                                                            "add_special_tokens": False}).json()["tokens"])
    assert tokens <= 3
    for seed in range(3):
        r = client.messages.create(model=MODEL, max_tokens=12, messages=user("hi"), thinking=OFF,
                                   extra_body={"seed": seed})
        assert all(b.type != "thinking" for b in r.content)
    assert prompt_of(server, {"model": "x", "max_tokens": 5, "messages": user("hi"), "thinking": OFF}).rstrip() \
        .endswith("</think>")


@pytest.mark.slow
def test_forced_tool_use_validates_on_20_seeds(client):
    for seed in range(20):
        choice = {"type": "tool", "name": "run_tests"} if seed % 3 == 0 else {"type": "any"}
        kw = dict(model=MODEL, max_tokens=100, messages=user(f"Task {seed}: check the build."), tools=TOOLS,
                  tool_choice=choice, extra_body={"seed": seed})
        if seed % 2:
            with client.messages.stream(**kw) as s:
                events = list(s)
                r = s.get_final_message()
            check_sequence([e for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                            "content_block_stop", "message_delta", "message_stop")])
            assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
        else:
            r = client.messages.create(**kw)
        assert r.stop_reason == "tool_use", (seed, r)
        calls = [b for b in r.content if b.type == "tool_use"]
        assert calls and all(b.type != "thinking" for b in r.content)  # a forced call comes without thinking
        for call in calls:
            jsonschema.validate(call.input, SCHEMAS[call.name])
            assert call.id
        if choice["type"] == "tool":
            assert {c.name for c in calls} == {"run_tests"}


def test_tool_round_trip(client, server):
    messages = user("What is the weather in Paris?")
    r = client.messages.create(model=MODEL, max_tokens=40, messages=messages, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                               extra_body={"seed": 1})
    assert r.stop_reason == "tool_use"
    [call] = [b for b in r.content if b.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER["input_schema"])
    follow = [*messages, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                            "content": [{"type": "text", "text": '{"temp_c": 21}'}]},
                                           {"type": "text", "text": "And tomorrow?"}]}]
    r2 = client.messages.create(model=MODEL, max_tokens=20, messages=follow, tools=[WEATHER], thinking=OFF,
                                extra_body={"seed": 1})
    assert r2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    prompt = prompt_of(server, {"model": "x", "max_tokens": 20, "messages": follow, "tools": [WEATHER]})
    assert "get_weather" in prompt and '{"temp_c": 21}' in prompt and "<tool_response>" in prompt
    assert prompt.index("<tool_response>") < prompt.index("And tomorrow?")
    # An error result says so; replayed thinking is the turn's reasoning.
    failed = [*messages, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up first.",
                                                             "signature": ""},
                                                            call.model_dump(exclude_none=True)]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                            "content": "service down"}]}]
    prompt = prompt_of(server, {"model": "x", "max_tokens": 20, "messages": failed, "tools": [WEATHER]})
    assert "Error: service down" in prompt and "Look it up first." in prompt


def test_count_tokens_equals_usage(client):
    body = dict(model="claude-haiku-4-5", messages=user("What is the weather in Oslo?"), tools=TOOLS,
                system=[{"type": "text", "text": "You are terse."}], thinking={"type": "enabled", "budget_tokens": 4})
    counted = client.messages.count_tokens(**body).input_tokens
    r = client.messages.create(max_tokens=4, extra_body={"seed": 0}, **body)
    assert counted == r.usage.input_tokens + r.usage.cache_read_input_tokens
    with client.messages.stream(max_tokens=4, extra_body={"seed": 0}, **body) as s:
        assert s.get_final_message().usage.input_tokens == r.usage.input_tokens
    forced = {**body, "tool_choice": {"type": "any"}}  # forcing a call changes the prompt (thinking closed)
    counted_forced = client.messages.count_tokens(**forced).input_tokens
    r = client.messages.create(max_tokens=4, extra_body={"seed": 0}, **forced)
    assert counted_forced == r.usage.input_tokens + r.usage.cache_read_input_tokens != counted


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_errors_are_anthropic_shaped(server, client):
    url = server.url + "/v1/messages"
    assert "max_tokens" in anthropic_error(httpx.post(url, json={"model": "x", "messages": user("hi")}), 400,
                                           "invalid_request_error")
    anthropic_error(httpx.post(url, content=b"{oops", headers=JSON_TYPE), 400, "invalid_request_error")
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]
    assert "messages.0.content.0" in anthropic_error(
        httpx.post(url, json={"model": "x", "max_tokens": 5, "messages": image}), 400, "invalid_request_error")
    prefill = [*user("hi"), {"role": "assistant", "content": "Sure,"}]
    assert "prefill" in anthropic_error(httpx.post(url, json={"model": "x", "max_tokens": 5, "messages": prefill}),
                                        400, "invalid_request_error")
    # Claude Code compacts the conversation when the message says this, in Anthropic's words.
    overflow = anthropic_error(httpx.post(url, json={"model": "x", "max_tokens": 5, "messages": user("x " * 20000)}),
                               400, "invalid_request_error")
    tokens, most = map(int, re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", overflow).groups())
    assert tokens > most == server.engine.context_length - 1
    anthropic_error(httpx.post(server.url + "/v1/messages/batches", json={}), 404, "not_found_error")
    big = json.dumps({"model": "x", "max_tokens": 5, "messages": user("river " * 1_750_000)}).encode()
    anthropic_error(httpx.post(url, content=big, timeout=60, headers=JSON_TYPE), 413, "request_too_large")
    with pytest.raises(anthropic.BadRequestError) as exc:
        # temperature is Anthropic's 0..1 (the SDK sends it as an extra field)
        client.messages.create(model=MODEL, max_tokens=5, messages=user("x"), extra_body={"temperature": 1.5})
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    # The OpenAI routes on the same server keep OpenAI's shape.
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": user("x"), "temperature": -1})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_api_key_by_x_api_key_or_bearer(engine):
    with ServerThread(create_app(engine, server_settings(api_key="sekrit"))) as srv:
        kw = dict(model=MODEL, max_tokens=2, messages=user("hi"), thinking=OFF)
        with pytest.raises(anthropic.AuthenticationError) as exc:
            anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(**kw)
        assert exc.value.body["error"]["type"] == "authentication_error"
        anthropic_error(httpx.post(srv.url + "/v1/messages/count_tokens", json={"messages": user("x")}), 401,
                        "authentication_error")
        assert anthropic.Anthropic(base_url=srv.url, api_key="sekrit", max_retries=0).messages.create(**kw).content
        bearer = anthropic.Anthropic(base_url=srv.url, auth_token="sekrit", max_retries=0)
        assert bearer.messages.count_tokens(model="x", messages=user("hi")).input_tokens > 0


def test_ping_events_during_a_long_prefill():
    engine = FakeEngine(prefill_delay=0.4)
    with ServerThread(create_app(engine, server_settings(), ping_interval=0.05)) as srv:
        assert wait_until(lambda: httpx.get(srv.url + "/ready").status_code == 200)
        body = {"model": "x", "max_tokens": 20, "messages": user("hi"), "stream": True, "thinking": OFF}
        with httpx.stream("POST", srv.url + "/v1/messages", json=body) as r:
            names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[1:4] == ["ping"] * 3, names
    first_block = names.index("content_block_start")
    assert "ping" not in names[first_block:] and names[-2:] == ["message_delta", "message_stop"]


def test_output_config_effort_and_json_format(client, server, engine):
    low = prompt_of(server, {"model": "x", "max_tokens": 5, "messages": user("hi"), "output_config": {"effort": "low"}})
    high = prompt_of(server, {"model": "x", "max_tokens": 5, "messages": user("hi"),
                              "output_config": {"effort": "max"}})
    if "Reasoning Effort" in low:  # the GLM-5.3 template has an effort variable; GLM-4.5-shaped ones do not
        assert "Reasoning Effort: Low" in low and "Reasoning Effort: Max" in high
    schema = OK_SCHEMA
    kw = dict(model=MODEL, max_tokens=40, messages=user("JSON please"), thinking=OFF, extra_body={"seed": 0},
              output_config={"format": {"type": "json_schema", "schema": schema}})
    if not engine.supports_grammar:
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(**kw)
        return
    r = client.messages.create(**kw)
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)
