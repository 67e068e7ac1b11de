"""What the real agent CLIs send (captured by tests/clients' recording proxy, kept in tests/data/clients) and what
the server makes of it: accepted, translated as docs/clients.md says, and a second turn whose prompt starts with
the first's. Bad inputs of the same shapes are still refused."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from server_support import ServerThread, server_settings

from glm53.server import create_app
from glm53.server.anthropic_api import BILLING_HEADER, MessagesRequest
from glm53.server.anthropic_api import to_chat as messages_to_chat
from glm53.server.blocks import Block
from glm53.server.responses_api import Reply, ResponsesRequest, split_name
from glm53.server.responses_api import to_chat as responses_to_chat

DATA = Path(__file__).resolve().parents[1] / "data" / "clients"


def captured(name: str) -> dict:
    return json.loads((DATA / name).read_text())["body"]


CLAUDE_1 = "claude-code-2.1.332-turn1.json"
CLAUDE_2 = "claude-code-2.1.332-turn2.json"
CODEX_1 = "codex-0.171.0-turn1.json"


@pytest.fixture(scope="module")
def server(reference_engine):
    with ServerThread(create_app(reference_engine, server_settings())) as srv:
        yield srv


def test_claude_code_request_translates():
    body = captured(CLAUDE_1)
    assert body["messages"][1]["role"] == "system" and body["system"][0]["text"].startswith(BILLING_HEADER)
    chat = messages_to_chat(MessagesRequest.model_validate(body))
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "system", "user"] or roles[:3] == ["system", "user", "system"], roles
    assert BILLING_HEADER not in chat.messages[0].content  # left out: it changes per request
    assert "Claude agent" in chat.messages[0].content
    assert [t.function.name for t in chat.tools] == [t["name"] for t in body["tools"]]
    assert chat.chat_template_kwargs == {"enable_thinking": True}  # adaptive: on, the server's budget
    assert chat.reasoning_effort == body["output_config"]["effort"]
    assert chat.max_tokens == body["max_tokens"]


def test_claude_code_turns_render_one_prefix(server):
    """The second turn's prompt starts with the whole first prompt, billing block and system message included."""
    prompts = []
    for name in (CLAUDE_1, CLAUDE_2):
        chat = messages_to_chat(MessagesRequest.model_validate(captured(name)))
        fields = chat.model_dump(exclude_none=True, exclude={"stop", "n", "stream", "max_tokens"})
        r = httpx.post(server.url + "/tokenize", json=fields, timeout=60)
        assert r.status_code == 200, r.text
        prompts.append(r.json())
    first, second = prompts
    assert second["tokens"][: first["count"]] == first["tokens"]
    assert first["count"] / second["count"] > 0.9


def test_claude_code_billing_block_does_not_change_the_prompt():
    body = captured(CLAUDE_1)
    other = json.loads(json.dumps(body))
    other["system"][0]["text"] = "x-anthropic-billing-header: cc_version=9.9.9.abc; cc_entrypoint=cli;"
    a, b = (messages_to_chat(MessagesRequest.model_validate(x)) for x in (body, other))
    assert a.messages == b.messages


def test_codex_request_translates():
    body = captured(CODEX_1)
    req = ResponsesRequest.model_validate(body)
    chat = responses_to_chat(req)
    names = [t.function.name for t in chat.tools]
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    inner = [f"{namespace['name']}.{t['name']}" for t in namespace["tools"]]
    assert set(inner) <= set(names)
    assert "web_search" not in names and all(t["type"] != "web_search" for t in chat.model_dump()["tools"])
    assert [m.role for m in chat.messages][:2] == ["system", "system"]  # the two developer messages
    assert chat.parallel_tool_calls is True


def test_a_namespaced_call_goes_back_as_name_and_namespace():
    body = captured(CODEX_1)
    req = ResponsesRequest.model_validate(body)
    reply = Reply.__new__(Reply)
    reply.id, reply.spaces = "resp_0123", frozenset({"multi_agent_v1"})
    block = Block(index=0, kind="tool", text='{"message": "hi"}', name="multi_agent_v1.spawn_agent", call_id="call_1")
    item = reply.item(block, True)
    assert item["name"] == "spawn_agent" and item["namespace"] == "multi_agent_v1"
    assert split_name("exec_command", frozenset({"multi_agent_v1"})) == (None, "exec_command")
    assert split_name("other.tool", frozenset({"multi_agent_v1"})) == (None, "other.tool")
    # ... and comes back in the history as the same name the model saw
    history = {**body, "input": [*body["input"],
                                 {"type": "function_call", "call_id": "call_1", "name": "spawn_agent",
                                  "namespace": "multi_agent_v1", "arguments": "{}"},
                                 {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]}
    chat = responses_to_chat(ResponsesRequest.model_validate(history))
    call = next(m for m in chat.messages if m.tool_calls)
    assert call.tool_calls[0].function.name == "multi_agent_v1.spawn_agent"
    assert req.tools


@pytest.mark.parametrize("tools, where", [
    ([{"type": "namespace", "name": "ns"}], "tools.0"),
    ([{"type": "namespace", "name": "ns", "tools": [{"type": "function", "description": "no name"}]}],
     "tools.0.tools.0"),
    ([{"type": "function", "parameters": {"type": "object"}}], "tools.0"),
])
def test_malformed_responses_tools_are_refused(server, tools, where):
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "tools": tools, "max_output_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(where), r.text


def test_hosted_and_server_tools_are_left_out_with_a_log_line(server, caplog):
    caplog.set_level("INFO", logger="glm53.server")
    r = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                       "tools": [{"type": "web_search"}, {"type": "file_search"}]})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/messages", json={"model": "x", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if "left out of the prompt" in rec.getMessage()]
    assert any("web_search, file_search" in line for line in lines), lines
    assert any("web_search (web_search_20250305)" in line for line in lines), lines


def test_mid_conversation_system_message_is_rendered_in_place(server):
    body = {"model": "x", "max_tokens": 2, "system": "top", "messages": [
        {"role": "user", "content": "first"}, {"role": "system", "content": [{"type": "text", "text": "MIDDLE"}]},
        {"role": "user", "content": "second"}]}
    chat = messages_to_chat(MessagesRequest.model_validate(body))
    assert [m.role for m in chat.messages] == ["system", "user", "system", "user"]
    r = httpx.post(server.url + "/v1/messages", json=body)
    assert r.status_code == 200, r.text
    bad = {**body, "messages": [{"role": "moderator", "content": "x"}]}
    r = httpx.post(server.url + "/v1/messages", json=bad)
    assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"], r.text


def test_every_refusal_leaves_one_log_line(server, caplog):
    caplog.set_level("WARNING", logger="glm53.server")
    r = httpx.post(server.url + "/v1/messages", json={"model": "x", "messages": []},
                   headers={"user-agent": "claude-cli/test"})
    assert r.status_code == 400
    lines = [rec.getMessage() for rec in caplog.records if "-> 400" in rec.getMessage()]
    assert len(lines) == 1 and "POST /v1/messages" in lines[0] and "claude-cli/test" in lines[0], lines
    assert "messages" in lines[0]


def test_probes_answer(server):
    for method in ("HEAD", "GET"):
        for path in ("/", "/api/hello"):
            assert httpx.request(method, server.url + path).status_code == 200
