"""Protocol tests against a scripted fake engine (real uvicorn, real HTTP): shapes, errors, streaming,
tools, reasoning budget, disconnects. The conformance suite (test_server_conformance.py) repeats the
important ones against the real ReferenceEngine."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_support import FakeEngine, ServerThread, wait_until

from glm53.planning import settings as S
from glm53.server import create_app

THOUGHT_AND_ANSWER = "Let me think.</think>\nThe answer is 42."
TOOL_REPLY = ("Weather needed.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                                          "required": ["city"]}}}]


def script(prompt: str, params) -> str:
    """Replies chosen by the last user message, so each test steers the fake model."""
    last = prompt.rsplit("<|user|>\n", 1)[-1]
    thinking = prompt.rstrip().endswith("<think>")
    if "<tool_response>" in prompt.rsplit("<|assistant|>", 1)[0].rsplit("<|observation|>", 1)[-1]:
        return ("Checking result.</think>\n" if thinking else "") + "It is sunny in Paris."
    if "forced" in last:
        return "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"
    if "weather" in last:
        return TOOL_REPLY if thinking else TOOL_REPLY.split("</think>\n", 1)[1]
    if "long thought" in last:
        return "x" * 500 + "</think>\nDone."
    if "stopword" in last:
        return "alpha beta STOP gamma"
    return THOUGHT_AND_ANSWER if thinking else "The answer is 42."


def make_settings(**env: str):
    return S.load(environ={f"GLM53_{k.upper()}": v for k, v in env.items()}, dotenv=None)


@pytest.fixture(scope="module")
def engine():
    e = FakeEngine(script, context_length=2048)
    e.load()
    return e


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(create_app(engine, make_settings(reasoning_budget="100"), ping_interval=0.2)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def sse_lines(server, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines() if line]


def err(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and "detail" not in body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


# -- happy paths -------------------------------------------------------------------------------------------


def test_chat_reasoning_split_and_usage(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"))
    msg = r.choices[0].message
    assert msg.content == "The answer is 42."
    assert msg.reasoning_content == "Let me think."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == len(THOUGHT_AND_ANSWER) - len("</think>") + 1 + 1  # + end token
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_equals_non_streamed(client):
    whole = client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"), temperature=0)
    stream = client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"), temperature=0, stream=True)
    content, reasoning, reasons = "", "", []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert content == whole.choices[0].message.content
    assert reasoning == whole.choices[0].message.reasoning_content
    assert reasons[-1] == "stop" and all(r is None for r in reasons[:-1])


def test_thinking_disabled(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"),
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "The answer is 42."
    assert r.choices[0].message.reasoning_content is None


def test_stream_usage_chunk_and_done(server):
    lines = sse_lines(server, "/v1/chat/completions",
                      {"messages": user("hi"), "stream": True, "stream_options": {"include_usage": True}})
    assert lines[-1] == "data: [DONE]"
    frames = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert frames[0]["choices"][0]["delta"]["role"] == "assistant"
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] > 0
    assert all(f["usage"] is None for f in frames[:-1])
    assert all(f["object"] == "chat.completion.chunk" for f in frames)


def test_max_tokens_and_max_completion_tokens(client, engine):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"), max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"), max_completion_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"))
    assert engine.last_params.max_tokens == engine.context_length - r.usage.prompt_tokens  # default: the rest


def test_sampling_params_reach_the_engine(client, engine):
    client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"), temperature=0.3, top_p=0.9, seed=7,
                                   extra_body={"top_k": 20, "min_p": 0.05})
    p = engine.last_params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.3, 0.9, 20, 0.05, 7)
    assert p.stop_token_ids == engine.eos_token_ids


def test_stop_strings_excluded(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("stopword"), stop=["STOP"],
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "alpha beta " and r.choices[0].finish_reason == "stop"
    s = client.completions.create(model="glm-5.3-flash", prompt="stopword", stop=["TOP", "zzz"], stream=True)
    assert "".join(c.choices[0].text for c in s) == "alpha beta S"


def test_n_choices(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"), n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == "The answer is 42." for c in r.choices)
    s = client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"), n=2, stream=True)
    texts = {0: "", 1: ""}
    for chunk in s:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: "The answer is 42.", 1: "The answer is 42."}


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("hi"), logprobs=True, top_logprobs=2,
                                       max_tokens=5)
    items = r.choices[0].logprobs.content
    assert len(items) == 5 and all(len(i.top_logprobs) == 2 for i in items)
    assert items[0].bytes == list(items[0].token.encode())


def test_completions_routes(client):
    r = client.completions.create(model="glm-5.3-flash", prompt="hello", max_tokens=4, logprobs=1)
    assert r.choices[0].text == "The " and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs.tokens == ["T", "h", "e", " "]
    r = client.completions.create(model="glm-5.3-flash", prompt=["a", "b"], max_tokens=2, n=2)
    assert len(r.choices) == 4 and r.usage.prompt_tokens == 2
    r = client.completions.create(model="glm-5.3-flash", prompt=[104, 105], max_tokens=2, echo=True)
    assert r.choices[0].text == "hiTh"


def test_tool_call_non_streamed_and_follow_up(client):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("weather in Paris?"), tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert choice.message.reasoning_content == "Weather needed."
    follow = [*user("weather in Paris?"),
              {"role": "assistant", "content": None, "reasoning_content": choice.message.reasoning_content,
               "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    r2 = client.chat.completions.create(model="glm-5.3-flash", messages=follow, tools=TOOLS)
    assert r2.choices[0].finish_reason == "stop" and "sunny" in r2.choices[0].message.content


def test_tool_call_streamed_deltas(client):
    s = client.chat.completions.create(model="glm-5.3-flash", messages=user("weather?"), tools=TOOLS, stream=True)
    name, args, ids, finish = None, "", set(), None
    for chunk in s:
        c = chunk.choices[0]
        for tc in c.delta.tool_calls or []:
            if tc.id:
                ids.add(tc.id)
                assert tc.type == "function" and tc.function.name == "get_weather"
                name = tc.function.name
            args += tc.function.arguments or ""
        finish = c.finish_reason or finish
    assert name == "get_weather" and len(ids) == 1 and finish == "tool_calls"
    assert json.loads(args) == {"city": "Paris", "days": 2}


def test_tool_choice_none_and_named(client, engine):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("weather?"), tools=TOOLS,
                                       tool_choice="none")
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("forced"), tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert r.choices[0].finish_reason == "tool_calls"


def test_reasoning_budget_forces_end_of_thinking(client, engine):
    r = client.chat.completions.create(model="glm-5.3-flash", messages=user("long thought"))
    assert engine.last_params.reasoning_budget == 100
    # The close the template itself writes after reasoning: GLM-5.3's puts the answer right after `</think>`.
    assert engine.last_params.reasoning_end_ids == engine.tokenize("</think>")
    assert r.choices[0].message.reasoning_content == "x" * 100
    assert r.choices[0].message.content == "Done."


def test_models_tokenize_health_ready_metrics_stats(server, client):
    assert client.models.list().data[0].id == "glm-5.3-flash"
    assert httpx.get(server.url + "/v1/models/glm-5.3-flash").json()["id"] == "glm-5.3-flash"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    t = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).json()
    assert t["tokens"] == [104, 105] and t["count"] == 2
    t = httpx.post(server.url + "/tokenize", json={"messages": user("hi")}).json()
    assert t["count"] > 2
    assert httpx.post(server.url + "/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("glm53_requests_total", "glm53_prompt_tokens_total", "glm53_generation_tokens_total",
                 "glm53_time_to_first_token_seconds_bucket", "glm53_time_per_output_token_seconds_bucket",
                 "glm53_num_requests_running", "glm53_num_requests_waiting", "glm53_engine_tier"):
        assert name in metrics, name
    assert 'route="/v1/chat/completions",status="200"' in metrics
    stats = httpx.get(server.url + "/stats").json()
    assert stats["running"] == 0 and stats["server"]["requests"] > 0 and stats["tiers"] == {"vram": {"hits": 3}}


# -- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, None),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": 2**70}, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 1.0}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_requests_are_400_openai_shaped(server, body, param):
    e = err(httpx.post(server.url + "/v1/chat/completions", json=body), 400)
    assert e["type"] == "invalid_request_error"
    if param:
        assert (e["param"] or "").startswith(param), e


def test_malformed_json_and_non_object(server):
    e = err(httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                       headers={"content-type": "application/json"}), 400)
    assert "JSON" in e["message"]
    json_type = {"content-type": "application/json"}
    err(httpx.post(server.url + "/v1/completions", content=b"[1, 2]", headers=json_type), 400)
    err(httpx.post(server.url + "/v1/completions", content=b"", headers=json_type), 400)
    # curl -d without -H: form encoding, which a web page may also send anywhere (tests/server/test_server_browser.py)
    assert "application/json" in err(httpx.post(server.url + "/v1/chat/completions", content=b"{not json"), 415,
                                     "unsupported_media_type")["message"]


def test_unknown_model_404(server):
    e = err(httpx.post(server.url + "/v1/chat/completions", json={"model": "gpt-4", "messages": user("x")}), 404,
            "model_not_found")
    assert "gpt-4" in e["message"]
    err(httpx.get(server.url + "/v1/models/gpt-4"), 404, "model_not_found")
    err(httpx.get(server.url + "/nope"), 404)
    err(httpx.get(server.url + "/v1/chat/completions"), 405)


def test_context_length_exceeded(server, engine):
    long = "y" * engine.context_length
    e = err(httpx.post(server.url + "/v1/chat/completions", json={"messages": user(long)}), 400,
            "context_length_exceeded")
    assert str(engine.context_length) in e["message"]
    err(httpx.post(server.url + "/v1/completions", json={"prompt": long, "stream": True}), 400,
        "context_length_exceeded")
    # Near the window is fine: a few tokens left.
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "y" * (engine.context_length - 3)})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_response_format_refused_without_grammar(server):
    for fmt in ({"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}):
        e = err(httpx.post(server.url + "/v1/chat/completions",
                           json={"messages": user("x"), "response_format": fmt}), 400, "unsupported_parameter")
        assert "constrained decoding" in e["message"] and "fake engine" in e["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": user("x"), "response_format": {"type": "text"}})
    assert r.status_code == 200


def test_unsupported_completions_options(server):
    err(httpx.post(server.url + "/v1/completions", json={"prompt": "x", "suffix": "y"}), 400, "unsupported_parameter")
    err(httpx.post(server.url + "/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 1}), 400)
    err(httpx.post(server.url + "/v1/completions", json={"prompt": [[]]}), 400)
    e = err(httpx.post(server.url + "/v1/completions", json={"prompt": [10**9]}), 400)
    assert "not a token id" in e["message"] and e["param"] == "prompt.0"
    e = err(httpx.post(server.url + "/v1/completions", json={"prompt": [10**9], "stream": True}), 400)


def test_api_key(engine):
    app = create_app(engine, make_settings(api_key="sekrit"))
    with ServerThread(app) as srv:
        e = err(httpx.get(srv.url + "/v1/models"), 401, "invalid_api_key")
        assert e["type"] == "authentication_error"
        err(httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.models.list().data[0].id == "glm-5.3-flash"
        assert httpx.get(srv.url + "/health").status_code == 200  # liveness stays open
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_not_ready_until_loaded():
    gate = threading.Event()

    class SlowEngine(FakeEngine):
        def load(self) -> None:
            gate.wait(10)
            super().load()

    eng = SlowEngine(script)
    with ServerThread(create_app(eng, make_settings())) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        err(httpx.get(srv.url + "/ready"), 503, "model_not_ready")
        err(httpx.get(srv.url + "/v1/models"), 503, "model_not_ready")
        err(httpx.post(srv.url + "/v1/chat/completions", json={"messages": user("x")}), 503)
        gate.set()
        assert wait_until(lambda: httpx.get(srv.url + "/ready").status_code == 200)
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "glm-5.3-flash"
    assert not eng.ready  # the app loaded it, so the app closed it


def test_ready_reports_a_store_fault_and_serving_goes_on(server, client, engine):
    engine.fault_state = {"state": "fault", "store": "/store/experts.glm53", "faults": [{"layer": 3, "expert": 17}]}
    try:
        r = httpx.get(server.url + "/ready")
        err(r, 503, "store_fault")
        assert "/store/experts.glm53" in r.text and "verify-store" in r.text
        assert client.chat.completions.create(model="glm-5.3-flash", messages=user("hi")).choices[0].message.content
    finally:
        engine.fault_state = None
    assert httpx.get(server.url + "/ready").status_code == 200


def test_mid_stream_error_is_an_error_frame(engine):
    class Failing(FakeEngine):
        async def generate(self, prompt_ids, params, request_id, images=()):
            async for ev in super().generate(prompt_ids, params, request_id, images):
                yield ev
                if ev.token_id == ord("a"):
                    from glm53.engine.interface import EngineError

                    raise EngineError("device fell over")

    eng = Failing(lambda p, s: "banana")
    eng.load()
    with ServerThread(create_app(eng, make_settings())) as srv:
        lines = sse_lines(srv, "/v1/completions", {"prompt": "x", "stream": True})
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])
        assert "device fell over" in error["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and "device fell over" in r.json()["error"]["message"]


# -- disconnects and keep-alive ----------------------------------------------------------------------------


def test_keepalive_pings_during_prefill():
    eng = FakeEngine(script, prefill_delay=0.7)
    eng.load()
    with ServerThread(create_app(eng, make_settings(), ping_interval=0.2)) as srv:
        with httpx.stream("POST", srv.url + "/v1/chat/completions",
                          json={"messages": user("hi"), "stream": True}, timeout=10) as r:
            raw = b"".join(r.iter_raw()).decode()
    assert raw.count(": ping") >= 2
    assert raw.index(": ping") < raw.index("reasoning_content")
    assert raw.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_generation(stream):
    eng = FakeEngine(lambda p, s: "z" * 10_000, token_delay=0.002)
    eng.load()
    with ServerThread(create_app(eng, make_settings())) as srv:
        body = {"prompt": "x", "stream": stream}
        with httpx.Client(timeout=10) as c:
            if stream:
                with c.stream("POST", srv.url + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            break
            else:
                with pytest.raises(httpx.ReadTimeout):
                    c.post(srv.url + "/v1/completions", json=body, timeout=0.3)
        assert wait_until(lambda: not eng.running, timeout=5)
        assert eng.generated < 10_000
        metrics = httpx.get(srv.url + "/metrics").text
        assert "glm53_client_disconnects_total 1.0" in metrics


def test_disconnect_during_prefill_cancels():
    eng = FakeEngine(script, prefill_delay=5.0)
    eng.load()
    with ServerThread(create_app(eng, make_settings(), ping_interval=0.1)) as srv:
        with httpx.Client(timeout=10) as c, c.stream("POST", srv.url + "/v1/completions",
                                                     json={"prompt": "x", "stream": True}) as r:
            chunks = r.iter_raw()  # keep a reference: a dropped iterator closes the response
            assert next(chunks) == b": ping\n\n"
            assert eng.running
        t0 = time.time()
        assert wait_until(lambda: not eng.running, timeout=3)
        assert time.time() - t0 < 3


def test_a_load_that_cannot_pin_is_refused_with_the_fix():
    """Start-up proves pinning by pinning the RAM tier: when that fails, /ready, /v1 and /health (no waiting mends
    it) answer 503 with the error, which names the fix (`glm53 serve` then exits: tests/robustness)."""

    class CannotPin(FakeEngine):
        def load(self) -> None:
            raise MemoryError("could not pin 50.8 GiB for the RAM tier (CUDA error 2): raise RLIMIT_MEMLOCK (docker "
                              "run --ulimit memlock=-1) or lower the memory the plan may use")

    with ServerThread(create_app(CannotPin(), make_settings())) as srv, httpx.Client(base_url=srv.url) as c:
        assert wait_until(lambda: c.get("/ready").json()["error"]["code"] == "model_load_failed")
        for path in ("/ready", "/v1/models", "/health"):
            e = err(c.get(path), 503, "model_load_failed")
            assert "--ulimit memlock=-1" in e["message"] and "could not be loaded" in e["message"]
        e = err(c.post("/v1/chat/completions", json={"model": "glm-5.3-flash", "messages": user("hi")}), 503,
                "model_load_failed")
        assert "MemoryError" in e["message"]


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/v1/models", "/v1/models/glm-5.3-flash", "/stats"])
def test_head_answers_like_get_without_a_body(server, path):
    get, head = httpx.get(server.url + path), httpx.head(server.url + path)
    assert get.status_code == 200 and head.status_code == 200, head.text
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


def test_the_head_twins_stay_out_of_the_schema(engine):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a repeated operation id
        schema = create_app(engine, make_settings()).openapi()
    assert not any("head" in ops for ops in schema["paths"].values())


def test_head_on_ready_says_503_while_the_model_loads():
    eng = FakeEngine(script)  # never loaded
    app = create_app(eng, make_settings())
    eng.load = lambda: time.sleep(30)  # the load never ends while the test runs
    with ServerThread(app) as srv:
        assert httpx.head(srv.url + "/ready").status_code == 503
        assert httpx.head(srv.url + "/v1/models").status_code == 503
        assert httpx.head(srv.url + "/health").status_code == 200
