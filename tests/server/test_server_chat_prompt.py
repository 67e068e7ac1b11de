"""Unit tests of the chat prompt decisions: thinking resolution, the reasoning memory, the tool-call grammar."""

from __future__ import annotations

import pytest

from glm53.server.chat_grammar import tool_call_grammar
from glm53.server.chat_prompt import ReasoningMemory, close_think, history_keys, reattach, resolve_thinking, turn_key
from glm53.server.errors import APIError


@pytest.mark.parametrize("kwargs,effort,budget_req,default,server_budget,want", [
    ({}, None, None, "high", 4096, (True, "high", 4096)),
    ({}, None, None, "none", 4096, (False, "none", 4096)),
    ({}, "low", None, "high", 0, (True, "low", None)),
    ({}, "medium", None, "low", 0, (True, "high", None)),
    ({}, "minimal", None, "max", 0, (False, "none", None)),
    ({"reasoning_effort": "max"}, "low", None, "high", 0, (True, "max", None)),  # the template's kwarg wins
    ({"enable_thinking": False}, "high", None, "high", 0, (False, "high", None)),
    ({"enable_thinking": True}, None, None, "none", 0, (True, "high", None)),
    ({"thinking": False}, None, None, "high", 0, (False, "high", None)),
    ({}, None, 100, "high", 4096, (True, "high", 100)),  # a request lowers the budget ...
    ({}, None, 9000, "high", 4096, (True, "high", 4096)),  # ... never raises it
    ({}, None, 0, "high", 4096, (False, "high", 0)),  # 0 = off
])
def test_resolve_thinking(kwargs, effort, budget_req, default, server_budget, want):
    t = resolve_thinking(kwargs, effort, budget_req, default, server_budget)
    assert (t.on, t.effort, t.budget) == want


@pytest.mark.parametrize("kwargs", [{"reasoning_effort": "extreme"}, {"enable_thinking": "no"}])
def test_resolve_thinking_refuses_bad_kwargs(kwargs):
    with pytest.raises(APIError) as exc:
        resolve_thinking(kwargs, None, None, "high", 0)
    assert exc.value.status == 400 and exc.value.param.startswith("chat_template_kwargs.")


def test_close_think():
    assert close_think("<|assistant|><think>") == "<|assistant|><think></think>"
    assert close_think("<|assistant|>\n<think></think>\n") == "<|assistant|>\n<think></think>\n"


def call(name: str, args: str, id_: str = "call_1") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}


def test_turn_key_ignores_call_ids_whitespace_and_key_order():
    a = turn_key("  hi ", [call("f", '{"a": 1, "b": "x"}', "call_1")])
    assert a == turn_key("hi", [call("f", '{"b":"x","a":1}', "call_9")])
    assert a != turn_key("hi", [call("f", '{"a": 2, "b": "x"}')])
    assert turn_key(None, None) == turn_key("", [])


def test_reasoning_memory_is_bounded_and_least_recently_used_first_out():
    mem = ReasoningMemory(max_chars=100, max_turns=3)
    for i in range(3):
        mem.remember(f"answer {i}", None, f"r{i}" * 5)
    assert mem.recall("answer 0", None) == "r0" * 5  # touched: now the most recent
    mem.remember("answer 3", None, "r3" * 5)
    assert len(mem) == 3 and mem.recall("answer 1", None) is None and mem.recall("answer 0", None)
    mem.remember("big", None, "x" * 90)  # the character bound drops the oldest until it fits
    assert mem.chars <= 100 and mem.recall("big", None) == "x" * 90
    mem.remember("huge", None, "y" * 101)  # larger than the whole memory: not kept
    assert mem.recall("huge", None) is None and mem.chars <= 100
    mem.remember("empty", None, "")
    assert mem.recall("empty", None) is None


def test_turns_alike_in_themselves_get_their_own_reasoning_back():
    # Two replies cut off inside their thinking (no content, no calls) and the same call made twice: each is known
    # by the conversation before it, so re-attachment gives every turn its own reasoning, and the history renders
    # as the model saw it.
    mem = ReasoningMemory()
    convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "go"}]
    replies = [({"role": "assistant", "content": ""}, "first thoughts"),
               ({"role": "assistant", "content": ""}, "second thoughts"),
               ({"role": "assistant", "content": None, "tool_calls": [call("f", "{}")]}, "call once"),
               ({"role": "assistant", "content": None, "tool_calls": [call("f", "{}", "call_2")]}, "call again")]
    for reply, reasoning in replies:
        mem.remember(reply.get("content"), reply.get("tool_calls"), reasoning, history_keys(convo)[-1])
        convo = convo + [reply, {"role": "user", "content": "more"}]
    back = reattach(convo, mem)
    assert [m.get("reasoning_content") for m in back if m["role"] == "assistant"] == [r for _, r in replies]
    # A client that changed an earlier message has another conversation: nothing is attached after the change.
    edited = [convo[0], {"role": "user", "content": "go!"}, *convo[2:]]
    assert all("reasoning_content" not in m for m in reattach(edited, mem))



def test_a_turn_after_another_picture_is_another_conversation():
    # Images stand as one marker in the template's text: the history key holds each image's digest, so a reply
    # given about one picture never lends its reasoning to the same words about another.
    from glm53.server.chat_api import template_messages
    from glm53.server.chat_prompt import image_digests
    from glm53.server.protocol import ChatMessage

    def turn(url: str) -> tuple[list[dict], dict]:
        refs: list = []
        sent = template_messages([
            ChatMessage(role="user", content=[{"type": "text", "text": "What is this?"},
                                              {"type": "image_url", "image_url": {"url": url}}]),
            ChatMessage(role="assistant", content="A cat.")], refs)
        return sent, image_digests(refs)

    mem = ReasoningMemory()
    sent, shown = turn("data:image/png;base64,AAAA")
    assert list(shown) == [0]
    mem.remember("A cat.", None, "about picture A", history_keys(sent[:1], shown)[-1])
    assert reattach(sent, mem, shown)[1]["reasoning_content"] == "about picture A"
    other, other_shown = turn("data:image/png;base64,BBBB")
    assert other == sent  # the same text, markers and all
    assert "reasoning_content" not in reattach(other, mem, other_shown)[1]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "ping"}},
]


@pytest.fixture(scope="module")
def ll(hf_model_dir):
    llguidance = pytest.importorskip("llguidance")
    from transformers import AutoTokenizer

    from glm53.engine import constrain

    tok = AutoTokenizer.from_pretrained(hf_model_dir)
    return llguidance, tok, constrain.make_tokenizer(tok, len(tok), [tok.convert_tokens_to_ids("<|endoftext|>")])


def accepts(ll, grammar: str, text: str) -> bool:
    llguidance, tok, lltok = ll
    assert not llguidance.LLMatcher.validate_grammar(grammar, lltok)
    m = llguidance.LLMatcher(lltok, grammar)
    for t in tok.encode(text, add_special_tokens=False):
        if not m.consume_token(t):
            return False
    return m.is_accepting()


W = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"


@pytest.mark.parametrize("text,ok", [
    (W + "</tool_call>", True),
    (W + "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>", True),
    (W + "<arg_key>unit</arg_key><arg_value>f</arg_value></tool_call>", True),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>", True),  # GLM-4.5
    ("<tool_call>ping</tool_call>", True),
    ("<tool_call>get_weather</tool_call>", False),  # the required city is missing
    (W + "<arg_key>days</arg_key><arg_value>\"3\"</arg_value></tool_call>", False),  # days is an integer
    (W + "<arg_key>unit</arg_key><arg_value>k</arg_value></tool_call>", False),  # not in the enum
    (W + "<arg_key>zip</arg_key><arg_value>1</arg_value></tool_call>", False),  # undeclared key
    ("<tool_call>rm_rf<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>", False),  # undeclared tool
    ("Sure.", False),  # "required": a call must come
])
def test_required_grammar(ll, text, ok):
    g = tool_call_grammar(TOOLS, ll[1].convert_tokens_to_ids, choice="required", named=None, parallel=True)
    assert accepts(ll, g, text) is ok


def test_auto_none_named_and_parallel(ll):
    ids = ll[1].convert_tokens_to_ids
    auto = tool_call_grammar(TOOLS, ids, choice="auto", named=None, parallel=True)
    assert accepts(ll, auto, "Let me check.") and accepts(ll, auto, "Let me check." + W + "</tool_call>")
    assert accepts(ll, auto, W + "</tool_call>\n<tool_call>ping</tool_call>")
    single = tool_call_grammar(TOOLS, ids, choice="auto", named=None, parallel=False)
    assert not accepts(ll, single, W + "</tool_call><tool_call>ping</tool_call>")
    none = tool_call_grammar(TOOLS, ids, choice="none", named=None, parallel=True)
    assert accepts(ll, none, "Just text.") and not accepts(ll, none, W + "</tool_call>")
    named = tool_call_grammar(TOOLS, ids, choice="named", named="ping", parallel=True)
    assert accepts(ll, named, "<tool_call>ping</tool_call>") and not accepts(ll, named, W + "</tool_call>")


def test_refs_into_the_parameters_definitions(ll):
    tools = [{"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}},
                                           "required": ["x"], "additionalProperties": False}},
        "properties": {"to": {"$ref": "#/$defs/pt"}}, "required": ["to"]}}}]
    g = tool_call_grammar(tools, ll[1].convert_tokens_to_ids, choice="required", named=None, parallel=True)
    ok = '<tool_call>move<arg_key>to</arg_key><arg_value>{"x":3}</arg_value></tool_call>'
    assert accepts(ll, g, ok) and not accepts(ll, g, ok.replace('{"x":3}', '{"y":3}'))
