"""Unit tests of the streaming reasoning / tool-call parser and the stop-string matcher."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from glm53.fixture import tokenizer as gtok
from glm53.server import chat
from glm53.server.chat import ChatStreamParser, Delta, merge_tool_calls, split_at_tag
from glm53.server.generation import StopMatcher

WEATHER = {"get_weather": {"city": "string", "days": "integer", "zip": "string"}}

TOOL_TEXT = ("Need the weather.</think>\nLet me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
             "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
             "<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n</tool_call>\n"
             "<tool_call>ping\n</tool_call>\n")


def run(text: str, pieces: list[int] | None = None, **kw) -> tuple[Delta, list[dict]]:
    kw.setdefault("start_in_reasoning", True)
    kw.setdefault("parse_tools", True)
    kw.setdefault("param_types", WEATHER)
    parser = ChatStreamParser(**kw)
    out = Delta()
    cuts = sorted(set(pieces or [])) + [len(text)]
    prev = 0
    for cut in cuts:
        out.extend(parser.feed(text[prev:cut]))
        prev = cut
    out.extend(parser.finish())
    return out, merge_tool_calls(out.tool_calls)


def test_markup_strings_are_the_fixture_tokenizers():
    for name in ("THINK_OPEN", "THINK_CLOSE", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE", "ARG_KEY_OPEN", "ARG_KEY_CLOSE",
                 "ARG_VALUE_OPEN", "ARG_VALUE_CLOSE"):
        assert getattr(chat, name) == getattr(gtok, name)


def test_reasoning_content_and_tool_calls_whole():
    out, calls = run(TOOL_TEXT)
    assert out.reasoning == "Need the weather."
    assert out.content == "Let me check.\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3, "zip": "75001"}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TOOL_TEXT)), max_size=40))
def test_any_split_gives_the_same_result(cuts):
    out, calls = run(TOOL_TEXT, cuts)
    whole, whole_calls = run(TOOL_TEXT)
    assert (out.reasoning, out.content) == (whole.reasoning, whole.content)
    strip = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert strip == [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]


def test_character_by_character_streaming_order():
    parser = ChatStreamParser(start_in_reasoning=True, parse_tools=True, param_types=WEATHER)
    kinds = []
    for ch in TOOL_TEXT:
        d = parser.feed(ch)
        if d.reasoning:
            kinds.append("r")
        if d.content:
            kinds.append("c")
        for tc in d.tool_calls:
            kinds.append("name" if tc.name else "args")
    parser.finish()
    # reasoning first, then content, then for each call its name before any arguments
    first_c, first_name = kinds.index("c"), kinds.index("name")
    assert max(i for i, k in enumerate(kinds) if k == "r") < first_c < first_name
    assert kinds[first_name + 1] == "args"


def test_no_markup_leaks_into_content_when_tags_are_split():
    text = "ab</thi" + "nk>\n\nanswer <" + "tool_c" + "all>f\n</tool_call>"
    out, calls = run(text, [3, 7, 12, 16, 20])
    assert out.reasoning == "ab" and out.content == "answer "
    assert calls[0]["function"]["name"] == "f"
    assert "<" not in out.content


def test_thinking_disabled_and_stray_close_tag():
    out, _ = run("</think>plain answer", start_in_reasoning=False)
    assert out.reasoning == "" and out.content == "plain answer"


def test_model_opened_thinking_itself():
    out, _ = run("<think>hmm</think>\nyes", start_in_reasoning=False)
    assert out.reasoning == "hmm" and out.content == "yes"


def test_tools_not_parsed_when_not_requested():
    out, calls = run("<tool_call>x\n</tool_call>", start_in_reasoning=False, parse_tools=False)
    assert calls == [] and out.content == "<tool_call>x\n</tool_call>"


def test_literal_angle_brackets_in_content_are_kept():
    out, _ = run("a < b and c <d> e <", start_in_reasoning=False)
    assert out.content == "a < b and c <d> e <"


def test_unfinished_tool_call_arguments_stay_json():
    _, calls = run("</think><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Ber")
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Ber"}
    _, calls = run("</think><tool_call>get_weather\n<arg_key>days</arg_key>")
    assert json.loads(calls[0]["function"]["arguments"]) == {"days": None}


def test_unfinished_tool_name_becomes_content():
    out, calls = run("</think><tool_call>get_wea")
    assert calls == [] and out.content == "<tool_call>get_wea"


def test_values_typed_by_schema_and_json():
    text = ("</think><tool_call>get_weather\n<arg_key>zip</arg_key>\n<arg_value>007</arg_value>\n"
            "<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1, 2]}</arg_value>\n"
            "<arg_key>note</arg_key>\n<arg_value>not json</arg_value>\n</tool_call>")
    _, calls = run(text)
    assert json.loads(calls[0]["function"]["arguments"]) == {"zip": "007", "opts": {"a": [1, 2]}, "note": "not json"}


def test_forced_named_call():
    parser = ChatStreamParser(start_in_reasoning=False, parse_tools=True, param_types=WEATHER)
    out = parser.begin_tool_call("get_weather")
    out.extend(parser.feed("<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"))
    out.extend(parser.finish())
    calls = merge_tool_calls(out.tool_calls)
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_forced_any_call():
    parser = ChatStreamParser(start_in_reasoning=False, parse_tools=True)
    out = parser.begin_tool_call(None)
    out.extend(parser.feed("lookup\n<arg_key>q</arg_key>\n<arg_value>x</arg_value>\n</tool_call>"))
    calls = merge_tool_calls(out.tool_calls)
    assert calls[0]["function"]["name"] == "lookup" and json.loads(calls[0]["function"]["arguments"]) == {"q": "x"}


def test_split_at_tag_holds_only_possible_prefixes():
    assert split_at_tag("hello <th", ("<think>",)) == ("hello ", None, "<th")
    assert split_at_tag("hello <x", ("<think>",)) == ("hello <x", None, "")
    assert split_at_tag("a<think>b", ("<think>", "</think>")) == ("a", "<think>", "b")


def test_stop_matcher_across_boundaries_and_excluded():
    m = StopMatcher(["END", "\n\n"])
    out = []
    for piece in ["Hel", "lo E", "N", "D more"]:
        text, _, matched = m.feed(piece)
        out.append(text)
        if matched:
            break
    assert "".join(out) == "Hello " and matched


def test_stop_matcher_releases_non_matching_text():
    m = StopMatcher(["STOP"])
    text, _, matched = m.feed("abc S")
    assert text == "abc " and not matched
    text, _, matched = m.feed("x")
    assert text == "Sx" and not matched
    assert m.flush() == ("", [])


def test_stop_matcher_keeps_logprob_items_with_their_text():
    m = StopMatcher(["XY"])
    released = []
    for i, piece in enumerate(["a", "X", "b", "X", "Y", "c"]):
        text, items, matched = m.feed(piece, i)
        released += items
        if matched:
            break
    assert released == [0, 1, 2]


def test_forced_token_without_a_score_still_gets_a_logprobs_entry():
    # The exllamav3 engine inserts the reasoning budget's `</think>` without logits for it; clients expect one
    # logprobs entry per token all the same.
    from glm53.engine.interface import TokenEvent
    from glm53.server.generation import _logprob

    forced = _logprob(TokenEvent(token_id=5, text="", token_text="</think>", forced=True))
    assert forced is not None and forced.token == "</think>" and forced.logprob == 0.0
    assert _logprob(TokenEvent(token_id=5, text="", token_text="x")) is None
    scored = _logprob(TokenEvent(token_id=5, text="", token_text="x", logprob=-1.5, forced=True))
    assert scored.logprob == -1.5
