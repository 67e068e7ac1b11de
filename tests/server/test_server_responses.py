"""OpenAI Responses API conformance (the non-stateful subset): the real engine (the CPU reference engine in CI)
behind real uvicorn, driven with the official openai SDK's responses.create / responses.stream, against both
chat template variants. The model's text is random: these tests check protocol and shape, not content."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_support import OK_SCHEMA, RUN_TESTS_PARAMS, WEATHER_PARAMS, serve_variant

MODEL = "glm-5.3-flash"
BUDGET = 8
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": WEATHER_PARAMS}
RUN_TESTS = {"type": "function", "name": "run_tests", "description": "Run a test file", "parameters": RUN_TESTS_PARAMS}
TOOLS = [WEATHER, RUN_TESTS]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
OFF = {"effort": "none"}


@pytest.fixture(scope="module", params=["glm53", "glm45"])
def server(request, tmp_path_factory):
    yield from serve_variant(request, tmp_path_factory, reasoning_budget=BUDGET)


@pytest.fixture(scope="module")
def engine(server):
    return server.engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_string_input(client):
    r = client.responses.create(model="gpt-5-codex", input="hi", max_output_tokens=6, reasoning=OFF,
                                extra_body={"seed": 3})
    assert r.object == "response" and r.model == MODEL and r.id.startswith("resp_")
    assert [i.type for i in r.output] == ["message"] and r.output_text and r.output[0].role == "assistant"
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 6
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert 0 <= r.usage.input_tokens_details.cached_tokens <= r.usage.input_tokens  # the prefix cache's share


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, reasoning=OFF, extra_body={"seed": 3})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_streamed_equals_non_streamed_with_reasoning(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": "What is 17*3?"}], instructions="Be brief.",
              max_output_tokens=24, reasoning={"effort": "high"}, extra_body={"seed": 5})
    whole = client.responses.create(**kw)
    assert whole.output[0].type == "reasoning" and whole.output[0].summary[0].text
    assert whole.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.reasoning_summary_text.delta" in types and "response.output_text.delta" in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [i.model_dump(exclude={"id"}) for i in whole.output]
    with client.responses.stream(**kw) as s:  # the SDK's accumulator takes the same events
        streamed = list(s)
        if whole.status == "completed":  # (its get_final_response wants response.completed, as OpenAI's does)
            assert s.get_final_response().output_text == whole.output_text
    assert [e.type for e in streamed] == types
    for seed in range(3):
        r = client.responses.create(model=MODEL, input="hi", max_output_tokens=12, reasoning=OFF,
                                    extra_body={"seed": seed})
        assert all(i.type != "reasoning" for i in r.output)


@pytest.mark.slow
def test_forced_function_calls_validate_on_20_seeds(client):
    for seed in range(20):
        choice = {"type": "function", "name": "run_tests"} if seed % 3 == 0 else "required"
        kw = dict(model=MODEL, input=f"Task {seed}: check the build.", tools=TOOLS, tool_choice=choice,
                  max_output_tokens=100, extra_body={"seed": seed})
        if seed % 2:
            events = list(client.responses.create(stream=True, **kw))
            assert any(e.type == "response.function_call_arguments.delta" for e in events)
            r = events[-1].response
        else:
            r = client.responses.create(**kw)
        assert r.status == "completed", (seed, r)
        calls = [i for i in r.output if i.type == "function_call"]
        assert calls and all(i.type != "reasoning" for i in r.output)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert call.call_id.startswith("call_")
        if isinstance(choice, dict):
            assert {c.name for c in calls} == {"run_tests"}


def test_function_call_round_trip(client, server):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    r = client.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                                extra_body={"seed": 1})
    [call] = [i for i in r.output if i.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = [*items, *[i.model_dump(exclude_none=True) for i in r.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}]
    r2 = client.responses.create(model=MODEL, input=follow, tools=[WEATHER], max_output_tokens=20, reasoning=OFF,
                                 extra_body={"seed": 1})
    assert r2.status in ("completed", "incomplete") and r2.output
    # The follow-up's prompt carries the call and its output (seen through the chat translation).
    from glm53.server.responses_api import ResponsesRequest, to_chat

    chat = to_chat(ResponsesRequest.model_validate({"input": follow, "tools": [WEATHER]}))
    prompt = httpx.post(server.url + "/tokenize",
                        json=chat.model_dump(exclude_none=True, exclude={"stop", "n", "stream"})).json()["prompt"]
    assert "<tool_call>get_weather" in prompt and '{"temp_c": 21}' in prompt and "<tool_response>" in prompt
    # A replayed reasoning item is the following assistant turn's reasoning.
    replay = [*items, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Look it up."}]},
              {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
              {"role": "user", "content": "Thanks"}]
    chat = to_chat(ResponsesRequest.model_validate({"input": replay}))
    assert chat.messages[1].reasoning_content == "Look it up."


def openai_error(r: httpx.Response, status: int, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
    if param:
        assert r.json()["error"]["param"] == param, r.json()


def test_stateless_and_errors(server, client):
    url = server.url + "/v1/responses"
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="hi", store=True)
    assert exc.value.param == "store" and "keeps no responses" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert exc.value.param == "previous_response_id"
    openai_error(httpx.post(url, json={"input": "hi", "tools": [{"type": "namespace", "name": "ns"}]}), 400, "tools.0")
    openai_error(httpx.post(url, json={"input": [{"role": "user", "content": [{"type": "input_image"}]}]}), 400,
                 "input.0.content.0")
    openai_error(httpx.post(url, json={"input": "hi", "max_output_tokens": 0}), 400)
    openai_error(httpx.post(url, json={"input": "x" * 20000}), 400)
    r = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2, reasoning=OFF)
    assert r.store is False


def test_text_format_json_schema(client, engine):
    schema = OK_SCHEMA
    kw = dict(model=MODEL, input="JSON please", max_output_tokens=40, reasoning=OFF, extra_body={"seed": 0},
              text={"format": {"type": "json_schema", "name": "check", "schema": schema}})
    if not engine.supports_grammar:
        with pytest.raises(openai.BadRequestError):
            client.responses.create(**kw)
        return
    r = client.responses.create(**kw)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
