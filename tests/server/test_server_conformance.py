"""Conformance: the real ReferenceEngine on the tiny random-weight model, behind real uvicorn on a loopback
port, driven with the official openai client (and raw HTTP where the client hides the wire format).

The model's text is random, so these tests check protocol and shape, not answer content. The registry's
six gates are adapted accordingly (see the `test_gate_*` tests)."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from server_support import ServerThread, wait_until

from glm53.engine.reference import ReferenceEngine
from glm53.planning import settings as S
from glm53.server import create_app

MODEL = "glm-5.3-flash"
JSON_TYPE = {"Content-Type": "application/json"}
BUDGET = 8  # reasoning budget of the main server: thinking is closed after 8 tokens
SMALL_CONTEXT = 256  # the gate server's window: requests without max_tokens end within seconds on a CPU
# Bounded values: the grammar keeps a random-weight model's arguments to what the schema allows, so a call
# completes within a few dozen tokens instead of running to max_tokens.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}]
AGENT_TOOLS = [*TOOLS, {"type": "function", "function": {
    "name": "run_tests", "description": "Run a test file",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 10},
                                  "verbose": {"type": "boolean"},
                                  "repeat": {"type": "integer", "minimum": 1, "maximum": 9},
                                  "tags": {"type": "array", "items": {"enum": ["fast", "slow"]}, "maxItems": 2}},
                   "required": ["path", "repeat"]}}}]


def settings(**env: str):
    return S.load(environ={f"GLM53_{k.upper()}": str(v) for k, v in env.items()}, dotenv=None)


@pytest.fixture(scope="module", params=["glm53", "glm45"])
def variant(request) -> str:
    """The chat template the checkpoint carries: like the real GLM-5.3-Flash one, or GLM-4.5-shaped. Every
    test that talks to a server runs against both."""
    return request.param


@pytest.fixture(scope="module")
def variant_dir(variant, request):
    return request.getfixturevalue("hf_model_dir" if variant == "glm53" else "hf_model_dir_glm45")


@pytest.fixture(scope="module")
def engine(variant, variant_dir, request, tmp_path_factory):
    if variant == "glm53":
        yield request.getfixturevalue("reference_engine")
        return
    from conftest import make_test_engine

    engine = make_test_engine(variant_dir, tmp_path_factory, variant)
    engine.load()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, settings(reasoning_budget=BUDGET))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def small(variant_dir):
    """A second server on its own engine with a 256-token window (loaded and closed by the app)."""
    engine = ReferenceEngine(variant_dir, context_length=SMALL_CONTEXT, max_running=8)
    with ServerThread(create_app(engine, settings(reasoning_budget=BUDGET))) as srv:
        assert wait_until(lambda: httpx.get(srv.url + "/ready").status_code == 200, timeout=60)
        srv.engine = engine
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield srv


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def no_think() -> dict:
    return {"chat_template_kwargs": {"enable_thinking": False}}


def idle(engine, timeout: float = 10.0) -> bool:
    return wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0, timeout=timeout)


# -- the six registry gates, adapted to a random-weight model ------------------------------------------------


def test_gate_load(server, client):
    models = client.models.list()
    assert models.data[0].id == MODEL
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_gate_chat_without_max_tokens(small):
    # The gates never set max_tokens: the default is the rest of the window, so the reply ends by itself.
    r = small.client.chat.completions.create(model=MODEL, messages=user("What is 2+2?"), extra_body=no_think())
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == r.usage.total_tokens
    if choice.finish_reason == "length":
        assert r.usage.total_tokens == SMALL_CONTEXT
    # A stop sequence the random text is sure to contain gives the "stop" the gate looks for.
    r = small.client.chat.completions.create(model=MODEL, messages=user("What is 2+2?"), stop=["e", "a", " "],
                                             extra_body=no_think())
    assert r.choices[0].finish_reason == "stop"


def test_gate_reasoning(client):
    # The plugin's readiness request: max_tokens 200, then content or reasoning must be non-empty.
    r = client.chat.completions.create(model=MODEL, messages=user("What is 17*3?"), max_tokens=200, temperature=0,
                                       logprobs=True)
    msg = r.choices[0].message
    assert msg.reasoning_content, "thinking is on by default: reasoning_content must be filled"
    assert "<think>" not in (msg.content or "") and "</think>" not in (msg.content or "")
    assert "<think>" not in msg.reasoning_content and "</think>" not in msg.reasoning_content
    # The budget closed thinking after at most BUDGET tokens, so the answer got the rest of the 200.
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert "</think>" in tokens and tokens.index("</think>") <= BUDGET
    assert msg.content


def test_gate_tools_round_trip(client):
    messages = user("What is the weather in Paris?")
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # A random model will not choose to call a tool; a named tool_choice makes it (the call is parsed from
    # what the model writes after the forced `<tool_call>get_weather`).
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    follow = [*messages,
              {"role": "assistant", "content": msg.content, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "clear"})}]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=20)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The follow-up prompt really carries the call and its result.
    prompt = httpx.post(str(client.base_url.join("/tokenize")), json={"messages": follow, "tools": TOOLS}).json()
    text = client_detok(client, prompt["tokens"])
    assert "<tool_call>get_weather" in text and '"temp_c": 21' in text and "<tool_response>" in text


def client_detok(client, ids: list[int]) -> str:
    return httpx.post(str(client.base_url.join("/detokenize")), json={"tokens": ids}).json()["prompt"]


def test_gate_context(small):
    window = SMALL_CONTEXT
    def count(text: str) -> int:
        body = {"messages": user(text), "chat_template_kwargs": {"enable_thinking": False}}
        return len(httpx.post(small.url + "/tokenize", json=body).json()["tokens"])

    base = count("")
    # Plant a code near the end of a prompt of ~85% of the window (by token count, measured by the server).
    def text_of(k: int) -> str:
        return "river " * k + "The code is 4711."

    per_word = (count(text_of(20)) - count(text_of(10))) / 10
    k = int((0.85 * window - count(text_of(0))) / per_word)
    while count(text_of(k)) < 0.85 * window:
        k += 1
    text = text_of(k)
    n = count(text)
    assert n > base
    r = small.client.chat.completions.create(model=MODEL, messages=user(text), extra_body=no_think())
    assert r.usage.prompt_tokens == n and r.usage.prompt_tokens >= 0.6 * window
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens <= window
    over = user("river " * window)
    with pytest.raises(openai.BadRequestError) as exc:
        small.client.chat.completions.create(model=MODEL, messages=over)
    assert exc.value.code == "context_length_exceeded"
    body = exc.value.body
    assert body["code"] == "context_length_exceeded" and str(window) in body["message"]


def test_gate_speed_tokens_stream(client):
    arrivals = []
    # Seeded: an unseeded random-weight model sometimes samples an end of turn within a few tokens.
    stream = client.chat.completions.create(model=MODEL, messages=user("Count to fifty."), max_tokens=48,
                                            stream=True, seed=7, extra_body=no_think())
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.model_dump(exclude_none=True, exclude={"role"}):
            arrivals.append(time.perf_counter())
    # The registry's speed gate (>= 15 tok/s on the real model) adapted to the tiny one: what is checked is that
    # tokens stream one by one as they are made; the rate bound only catches a stream stuck in a buffer (a shared
    # 2-core CI host under load is no place to measure speed: `glm53 bench stream` does that).
    assert len(arrivals) >= 16, "tokens must arrive one by one, not in one burst"
    spread = arrivals[-1] - arrivals[0]
    assert spread > 0 and (len(arrivals) - 1) / spread > 1


# -- options --------------------------------------------------------------------------------------------------


def _stream_chat(client, **kw) -> tuple[str, str, str | None, list]:
    content, reasoning, finish, chunks = "", "", None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        chunks.append(chunk)
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, reasoning, finish, chunks


def test_streamed_equals_non_streamed_at_temperature_0(client):
    kw = dict(model=MODEL, messages=user("Tell me a story."), max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kw)
    content, reasoning, finish, _ = _stream_chat(client, **kw)
    assert content == (whole.choices[0].message.content or "")
    assert reasoning == (whole.choices[0].message.reasoning_content or "")
    assert finish == whole.choices[0].finish_reason
    c1 = client.completions.create(model=MODEL, prompt="The river", max_tokens=30, temperature=0)
    c2 = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt="The river",
                                                                       max_tokens=30, temperature=0, stream=True))
    assert c1.choices[0].text == c2 and len(c2) > 0


def test_stream_usage_chunk_and_done_frame(server):
    # Seeded: unseeded, the random-weight model sometimes samples an end of turn within a few tokens.
    body = {"model": MODEL, "messages": user("hi"), "max_tokens": 6, "stream": True, "seed": 3,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 6


def test_max_tokens_and_max_completion_tokens(client):
    # Seeded: unseeded, the random-weight model sometimes samples an end of turn within a few tokens (seen in CI).
    r = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=5, seed=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(model=MODEL, messages=user("hi"), max_completion_tokens=7, seed=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt="A garden", max_tokens=16, temperature=0.9, top_p=0.95,
              extra_body={"top_k": 50, "min_p": 0.01})
    a = client.completions.create(seed=11, **kw).choices[0].text
    b = client.completions.create(seed=11, **kw).choices[0].text
    c = client.completions.create(seed=12, **kw).choices[0].text
    assert a == b and a != c


def test_stop_string_across_tokens_is_excluded(client):
    base = client.completions.create(model=MODEL, prompt="The river", max_tokens=30, temperature=0).choices[0].text
    ids = httpx.post(str(client.base_url.join("/tokenize")), json={"prompt": base, "add_special_tokens": False})
    assert len(ids.json()["tokens"]) > 8
    # A stop string that straddles token boundaries, from the middle of the text.
    start = len(base) // 2
    stop = base[start:start + 5]
    expected = base[:base.index(stop)]
    r = client.completions.create(model=MODEL, prompt="The river", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt="The river", max_tokens=30, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_n_and_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=user("hi"), n=2, max_tokens=6, logprobs=True,
                                       top_logprobs=3, seed=5, temperature=1.0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    for c in r.choices:
        items = c.logprobs.content
        assert len(items) == 6
        for it in items:
            assert it.logprob <= 0 and len(it.top_logprobs) == 3
            tops = [t.logprob for t in it.top_logprobs]
            assert tops == sorted(tops, reverse=True)
    # The random-weight model may sample a stop token (a CI run did), so a choice that stopped is shorter; every
    # token drawn, the stop token included, has its logprob, and usage counts them.
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=2, n=2)
    assert len(r.choices) == 2
    for c in r.choices:
        assert len(c.logprobs.tokens) == 4 if c.finish_reason == "length" else 1 <= len(c.logprobs.tokens) <= 4
        # The legacy format keys alternatives by text, so two tokens that decode alike (two halves of a
        # character, each '\ufffd') share one entry.
        assert len(c.logprobs.top_logprobs) == len(c.logprobs.tokens)
        assert all(1 <= len(top) <= 2 for top in c.logprobs.top_logprobs)
    assert sum(len(c.logprobs.tokens) for c in r.choices) == r.usage.completion_tokens


def test_thinking_toggle_and_prior_reasoning(client, server):
    # Seeded: unseeded, the random-weight model sometimes samples "<think>" itself, and what follows it is
    # reasoning whatever the prompt asked (a CI run failed on it).
    r = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=8, seed=3,
                                       extra_body=no_think())
    assert r.choices[0].message.reasoning_content is None and r.choices[0].message.content
    # Prior reasoning is accepted under either name and rendered for the turn in progress.
    for field in ("reasoning_content", "reasoning"):
        msgs = [*user("Weather?"),
                {"role": "assistant", "content": "", field: "I should call the tool.",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
        ids = httpx.post(server.url + "/tokenize", json={"messages": msgs, "tools": TOOLS}).json()["tokens"]
        text = client_detok(client, ids)
        assert "<think>I should call the tool.</think>" in text
        assert re.search(r"<arg_key>city</arg_key>\n?<arg_value>Oslo</arg_value>", text)
        r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=5)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_call_deltas(client):
    # Room for the whole call: the grammar bounds it (a 12-character city, one enum), but a random-weight model may
    # spend a token per character and escape some; 30 tokens sometimes cut the call short (finish "length").
    _, _, finish, chunks = _stream_chat(client, model=MODEL, messages=user("Weather in Rome?"), tools=TOOLS,
                                        max_tokens=200, seed=3,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert finish == "tool_calls"
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)),
                        TOOLS[0]["function"]["parameters"])


def test_tool_choice_required_and_none(client):
    r = client.chat.completions.create(model=MODEL, messages=user("Weather?"), tools=TOOLS, max_tokens=12,
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" not in (r.choices[0].message.content or "")
    r = client.chat.completions.create(model=MODEL, messages=user("Weather?"), tools=TOOLS, max_tokens=60,
                                       tool_choice="required", parallel_tool_calls=False, seed=1)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    assert msg.tool_calls[0].function.name == "get_weather"


def _valid_call(call, tools) -> None:
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.function.name in declared, call
    jsonschema.validate(json.loads(call.function.arguments), declared[call.function.name])


@pytest.mark.slow
def test_forced_tool_calls_validate_50_seeds(client):
    """The issue's test: forced calls on the random-weight model always name a declared tool, with arguments that
    validate against its schema (required keys present, types, bounds, enums, no extra keys)."""
    for seed in range(50):
        named = seed % 3 == 0
        choice = {"type": "function", "function": {"name": "run_tests"}} if named else "required"
        # One call each (parallel_tool_calls false): the grammar completes with it, so the reply ends there.
        r = client.chat.completions.create(model=MODEL, messages=user(f"Task {seed}: check the build."),
                                           tools=AGENT_TOOLS, tool_choice=choice, max_tokens=100, seed=seed,
                                           parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (seed, c)
        assert len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            _valid_call(call, AGENT_TOOLS)
            assert not named or call.function.name == "run_tests"


def test_cut_off_call_keeps_its_partial_arguments(client):
    free = [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]
    kw = dict(model=MODEL, messages=user("Write a note."), tools=free, max_tokens=14, seed=2,
              tool_choice={"type": "function", "function": {"name": "note"}})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "length"
    args = c.message.tool_calls[0].function.arguments
    # `<tool_call>note<arg_key>text</arg_key><arg_value>` then text: as generated, never a substituted "{}".
    assert args.startswith('{"text": "') and not args.endswith('"}'), args
    _, _, finish, chunks = _stream_chat(client, **kw)
    streamed = "".join(tc.function.arguments or "" for ch in chunks if ch.choices
                       for tc in ch.choices[0].delta.tool_calls or [])
    assert finish == "length" and streamed == args


def test_tokenize_metrics_stats(server, client, engine):
    t = httpx.post(server.url + "/tokenize", json={"prompt": "hello world"}).json()
    assert t["tokens"] == engine.tokenize("hello world", True) and t["max_model_len"] == 4096
    client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=3)
    metrics = httpx.get(server.url + "/metrics").text
    for needle in ('glm53_requests_total{route="/v1/chat/completions",status="200"}', "glm53_prompt_tokens_total",
                   "glm53_generation_tokens_total", "glm53_time_to_first_token_seconds_count",
                   "glm53_time_per_output_token_seconds_count", "glm53_num_requests_running",
                   "glm53_num_requests_waiting"):
        assert needle in metrics, needle
    stats = httpx.get(server.url + "/stats").json()
    assert stats["kind"] == engine.kind and stats["server"]["generation_tokens"] > 0 and "tiers" in stats


# -- errors ---------------------------------------------------------------------------------------------------


def test_errors_are_openai_shaped(server, client):
    def check(r: httpx.Response, status: int, code: str | None = None) -> None:
        assert r.status_code == status, r.text
        assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
        if code:
            assert r.json()["error"]["code"] == code

    url = server.url
    check(httpx.post(url + "/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}),
          400)
    check(httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]}), 400)
    check(httpx.post(url + "/v1/chat/completions", json={"messages": user("x"), "temperature": -1}), 400)
    check(httpx.post(url + "/v1/chat/completions", json={"model": "nope", "messages": user("x")}), 404,
          "model_not_found")
    check(httpx.post(url + "/v1/completions", json={"prompt": [99999]}), 400)
    check(httpx.post(url + "/v1/completions", json={"prompt": [99999], "stream": True}), 400)
    check(httpx.post(url + "/v1/completions", json={"prompt": "x " * 5000}), 400, "context_length_exceeded")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=user("x"))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=user("x"), top_p=3)


# n is bounded: a random-weight model under an unbounded integer may write digits until max_tokens runs out.
BOOL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                "n": {"type": "integer", "minimum": 0, "maximum": 999}},
               "required": ["ok", "n"], "additionalProperties": False}


@pytest.mark.parametrize("thinking", [True, False])
def test_response_format(client, engine, thinking):
    fmt = {"type": "json_schema", "json_schema": {"name": "check", "schema": BOOL_SCHEMA}}
    kw = dict(model=MODEL, messages=user("Reply in JSON."), max_tokens=60, seed=0, response_format=fmt,
              extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    if not engine.supports_grammar:  # llguidance not installed: refused, never faked
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(**kw)
        assert exc.value.code == "unsupported_parameter" and "constrained decoding" in exc.value.message
        return
    r = client.chat.completions.create(**kw)
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and isinstance(value["n"], int)
    assert 0 <= value["n"] <= 999
    assert r.choices[0].finish_reason == "stop"
    assert bool(r.choices[0].message.reasoning_content) == thinking  # reasoning stays free text
    content, _, finish, _ = _stream_chat(client, **kw)
    assert json.loads(content) == value and finish == "stop"  # seeded: the same as non-streamed
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match="invalid grammar"):
        client.chat.completions.create(model=MODEL, messages=user("x"), response_format=bad, stream=True)


# -- concurrency and disconnects ------------------------------------------------------------------------------


def test_16_concurrent_streams_with_random_disconnects(server, engine):
    before = engine.stats()
    rng = random.Random(1234)
    plans = [(i, rng.random() < 0.5, rng.randint(1, 6)) for i in range(16)]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i: int, leave: bool, after: int) -> None:
        # Greedy: a sampled end-of-turn token could end a stream before the client meant to leave it.
        body = {"model": MODEL, "messages": user(f"stream {i}"), "max_tokens": 24, "stream": True, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False}}
        try:
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                frames = 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        frames += 1
                        if leave and frames >= after:
                            results[i] = "left"
                            return  # closing the response drops the connection mid-stream
                    if line == "data: [DONE]":
                        results[i] = "done"
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=p) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == 16
    # A stream meant to be left may end on an end-of-turn token first; one meant to finish must finish.
    assert all(results[i] == "done" for i, leave, _ in plans if not leave)
    assert idle(engine), engine.stats()
    after = engine.stats()
    left = sum(1 for r in results.values() if r == "left")
    assert left >= 4
    assert after["requests_total"] - before["requests_total"] == 16
    assert after["requests_cancelled"] - before["requests_cancelled"] >= left - 1  # one may just have finished
    assert after["running"] == 0 and after["waiting"] == 0


def test_non_streamed_disconnect_cancels(server, engine):
    before = engine.stats()["requests_cancelled"]
    # Four sampled choices of up to 3000 tokens: that at least one is still running after 0.5 s does not
    # depend on where this random model happens to sample an end-of-turn token.
    body = {"prompt": "x", "max_tokens": 3000, "n": 4, "seed": 1}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    assert idle(engine, timeout=5)
    assert engine.stats()["requests_cancelled"] > before


def test_stream_rate_ratio(reference_engine):
    from glm53.bench.stream import run_stream_bench

    runs = run_stream_bench(reference_engine, settings(), max_tokens=48, runs=1)
    # The benchmark measures; its target (0.98) is judged where it runs, not here: CI's 2 shared cores set no speed.
    r = runs[0]
    assert r.tokens == 48 and r.engine_tps > 0 and r.client_tps > 0, runs
    assert r.ratio == pytest.approx(r.client_tps / r.engine_tps)


# -- the GLM-5.3-Flash chat contract (issue 24): thinking, effort, re-attachment, usage, bad input -----------


def tokenize_chat(server, **body) -> dict:
    r = httpx.post(server.url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


OFF_WAYS = [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"},
            {"reasoning_effort": "minimal"}, {"max_reasoning_tokens": 0}]


@pytest.mark.parametrize("off", OFF_WAYS, ids=["enable_thinking", "none", "minimal", "budget0"])
def test_thinking_off_gives_no_reasoning(client, server, off):
    # The real template opens <think> whatever it is told: the server closes the block (the trained empty one).
    prompt = tokenize_chat(server, messages=user("hi"), **off)["prompt"]
    assert prompt.rstrip("\n").endswith("<think></think>")
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=12, seed=seed,
                                           extra_body=off)
        msg = r.choices[0].message
        assert msg.reasoning_content is None and "</think>" not in (msg.content or "")
        assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_reasoning_effort_reaches_the_prompt(server, variant):
    def effort_line(**kw) -> str:
        prompt = tokenize_chat(server, messages=user("hi"), **kw)["prompt"]
        assert prompt.endswith("<think>")  # thinking stays on
        return prompt

    if variant == "glm53":
        assert "<|system|>Reasoning Effort: High<|user|>" in effort_line()  # the server's default
        assert "Reasoning Effort: Low<" in effort_line(reasoning_effort="low")
        assert "Reasoning Effort: High<" in effort_line(reasoning_effort="medium")
        assert "Reasoning Effort: High<" in effort_line(reasoning_effort="high")
        assert "Reasoning Effort: Max<" in effort_line(reasoning_effort="max")
        assert "Reasoning Effort: Max<" in effort_line(chat_template_kwargs={"reasoning_effort": "max"})
    else:  # a template without the variable renders the same prompt: the effort cannot reach it, thinking still can
        assert effort_line(reasoning_effort="low") == effort_line(reasoning_effort="high")
    r = httpx.post(server.url + "/tokenize", json={"messages": user("hi"),
                                                   "chat_template_kwargs": {"reasoning_effort": "extreme"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.reasoning_effort"


def test_default_effort_setting(variant_dir, variant):
    engine = ReferenceEngine(variant_dir, max_running=2)
    with ServerThread(create_app(engine, settings(reasoning_effort="none"))) as srv:
        assert wait_until(lambda: httpx.get(srv.url + "/ready").status_code == 200, timeout=60)
        assert tokenize_chat(srv, messages=user("hi"))["prompt"].rstrip("\n").endswith("<think></think>")
        on = tokenize_chat(srv, messages=user("hi"), reasoning_effort="low")["prompt"]
        assert on.endswith("<think>") and (variant != "glm53" or "Reasoning Effort: Low" in on)


def test_max_reasoning_tokens_lowers_the_budget(client):
    r = client.chat.completions.create(model=MODEL, messages=user("Think."), max_tokens=30, temperature=0,
                                       logprobs=True, extra_body={"max_reasoning_tokens": 3})
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert "</think>" in tokens and tokens.index("</think>") <= 3
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens <= 4
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # the reference engine has no prefix cache


def test_reasoning_reattached_over_agent_turns(client, server):
    """A client that drops reasoning_content: the server puts its own reasoning back (seen through /tokenize)."""
    msgs = user("Plan the fix.")
    first = client.chat.completions.create(model=MODEL, messages=msgs, tools=AGENT_TOOLS, max_tokens=24, seed=4)
    m1 = first.choices[0].message
    assert m1.reasoning_content
    msgs = [*msgs, {"role": "assistant", "content": m1.content,
                    **({"tool_calls": [c.model_dump() for c in m1.tool_calls]} if m1.tool_calls else {})},
            *user("Now run the tests.")]
    call = client.chat.completions.create(model=MODEL, messages=msgs, tools=AGENT_TOOLS, max_tokens=100, seed=5,
                                          tool_choice="required", parallel_tool_calls=False)
    c2 = call.choices[0].message.tool_calls[0]
    msgs = [*msgs, {"role": "assistant", "content": None, "tool_calls": [c2.model_dump()]},
            {"role": "tool", "tool_call_id": c2.id, "content": "3 passed"}]
    third = client.chat.completions.create(model=MODEL, messages=msgs, tools=AGENT_TOOLS, max_tokens=24, seed=6)
    m3 = third.choices[0].message
    assert m3.reasoning_content
    msgs = [*msgs, {"role": "assistant", "content": m3.content,
                    **({"tool_calls": [c.model_dump() for c in m3.tool_calls]} if m3.tool_calls else {})},
            *user("Thanks.")]
    # Every assistant turn above comes back without its reasoning; the prompt has it again.
    prompt = tokenize_chat(server, messages=msgs, tools=AGENT_TOOLS, chat_template_kwargs={"clear_thinking": False})
    text = prompt["prompt"]
    assert f"<think>{m1.reasoning_content.strip()}</think>" in text
    assert f"<think>{m3.reasoning_content.strip()}</think>" in text
    assert "<tool_call>" + c2.function.name in text and "3 passed" in text
    assert client_detok(client, prompt["tokens"]) == text
    # A turn the server never produced gets nothing.
    stranger = [*user("q"), {"role": "assistant", "content": "an answer from elsewhere"}, *user("more")]
    assert "<think></think>an answer" in tokenize_chat(server, messages=stranger)["prompt"].replace("\n", "")


def test_tokenize_mirrors_the_chat_request(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    t = tokenize_chat(server, messages=user("Weather?"), tools=TOOLS, tool_choice=named)
    # A forced call runs without thinking: the prompt the route runs has the closed block.
    assert t["prompt"].rstrip("\n").endswith("<think></think>") and t["count"] == len(t["tokens"])
    hidden = tokenize_chat(server, messages=user("Weather?"), tools=TOOLS, tool_choice="none")["prompt"]
    assert "get_weather" not in hidden
    r = httpx.post(server.url + "/tokenize", json={"messages": user("x"), "tools": TOOLS,
                                                   "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


BAD_CHAT = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense",
                                                                             "properties": 5}}}]},
     "tools.0.function.parameters.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}]},
     "tools.0.function.parameters.properties"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}, "required": ["x"]}}}]}, "tools.0.function.parameters.required"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 129}}]}, "tools.0.function.name"),
    ({"stream": "yes"}, "stream"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"messages": [*user("x"), {"role": "tool", "content": "r"}]}, "messages.1"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
]


@pytest.mark.parametrize("extra,param", BAD_CHAT)
def test_bad_chat_input_is_a_400_naming_the_field(server, extra, param):
    body = {"model": MODEL, "messages": user("x"), "max_tokens": 2, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "").startswith(param), r.json()


def test_lone_surrogate_is_a_400(server):
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    for route in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(server.url + route, content=raw, headers=JSON_TYPE)
        assert r.status_code == 400, r.text
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a\\udfff", "max_tokens": 2}',
                   headers=JSON_TYPE)
    assert r.status_code == 400, r.text


def test_huge_body_is_refused_fast_and_never_stalls_a_stream(server):
    gaps: list[float] = []
    done, decoding = threading.Event(), threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "messages": user("stream on"), "max_tokens": 200, "stream": True, "seed": 7,
                "chat_template_kwargs": {"enable_thinking": False}}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            last, chunks = None, 0
            for line in r.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: {"):
                    chunks += 1
                    # From the first token on (the role chunk comes before the prefill): gaps of a running decode.
                    if last is not None and chunks > 2:
                        gaps.append(now - last)
                    last = now
                    if chunks == 2:
                        decoding.set()
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    assert decoding.wait(60), "the stream never produced a token"
    big = json.dumps({"model": MODEL, "messages": user("river " * 1_750_000)}).encode()  # ~10.5 MB
    started = time.perf_counter()
    r = httpx.post(server.url + "/v1/chat/completions", content=big, timeout=60, headers=JSON_TYPE)
    took = time.perf_counter() - started
    t.join(timeout=120)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert took < 3.0, took  # refused from the header: reading and tokenizing 10 MB takes far longer
    assert done.is_set() and len(gaps) > 10 and max(gaps) < 0.5, max(gaps)
    # Under the body limit but over what the context can hold: refused before the tokenizer runs.
    long = user("x" * 1_000_000)
    started = time.perf_counter()
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": long}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert time.perf_counter() - started < 3.0  # refused before the tokenizer: tokenizing 1 MB takes far longer
