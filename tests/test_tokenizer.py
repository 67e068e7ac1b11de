"""The generated GLM tokenizer: special tokens, determinism, and the chat template's GLM layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glm53.engine.template import TemplateError, normalize_messages, render_chat
from glm53.fixture import tokenizer as gtok

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    gtok.write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def hf_tok(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


@pytest.fixture(scope="module")
def hf_tok45(tmp_path_factory: pytest.TempPathFactory):
    """The GLM-4.5-shaped variant (newlines after role markers, enable_thinking)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok45")
    gtok.write_tokenizer(out, template="glm45")
    assert (out / "chat_template.jinja").read_text() == gtok.CHAT_TEMPLATE_GLM45
    return AutoTokenizer.from_pretrained(out)


def render(hf_tok, messages, tools=None, enable_thinking=True, add_generation_prompt=True, **kw) -> str:
    return hf_tok.apply_chat_template(
        normalize_messages(messages), tools=tools, tokenize=False,
        add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, **kw,
    )  # fmt: skip


def test_files_and_vocab(tok_dir: Path, hf_tok) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (tok_dir / name).is_file()
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (tok_dir / "chat_template.jinja").read_text() == gtok.CHAT_TEMPLATE
    assert 2000 <= len(hf_tok) <= 4200
    assert hf_tok.eos_token == gtok.ENDOFTEXT


def test_special_tokens_are_single_ids(hf_tok) -> None:
    ids = gtok.token_ids(Path(hf_tok.name_or_path) / "tokenizer.json")
    assert len(set(ids.values())) == len(gtok.ADDED_TOKENS)
    for token in gtok.ADDED_TOKENS:
        assert hf_tok.encode(token, add_special_tokens=False) == [ids[token]]
        # ... also inside running text, with no space around it.
        enc = hf_tok.encode(f"a{token}b", add_special_tokens=False)
        assert ids[token] in enc
        assert hf_tok.decode(enc) == f"a{token}b"
    # Markup tokens survive skip_special_tokens (a reasoning/tool parser needs them); control tokens do not.
    enc = hf_tok.encode(f"{gtok.USER}x{gtok.THINK_OPEN}y{gtok.THINK_CLOSE}", add_special_tokens=False)
    assert hf_tok.decode(enc, skip_special_tokens=True) == f"x{gtok.THINK_OPEN}y{gtok.THINK_CLOSE}"


def test_byte_level_round_trip(hf_tok) -> None:
    text = "Hello, wörld! 東京 👋 def f(x):\n\treturn {'a': [1, 2]}  \r\n"
    assert hf_tok.decode(hf_tok.encode(text, add_special_tokens=False)) == text


def test_deterministic(tmp_path: Path, tok_dir: Path) -> None:
    gtok.write_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes()


def test_generation_prompt_thinking_on_and_off(hf_tok45) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]
    on = render(hf_tok45, msgs)
    assert on == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nName three colors.<|assistant|>\n<think>"
    assert render(hf_tok45, msgs, enable_thinking=True) == on
    off = render(hf_tok45, msgs, enable_thinking=False)
    assert off == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nName three colors.<|assistant|>\n<think></think>\n"
    assert render(hf_tok45, msgs, add_generation_prompt=False).endswith("Name three colors.")


def test_tools_block(hf_tok45) -> None:
    text = render(hf_tok45, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools\n")
    assert json.dumps(WEATHER["function"], ensure_ascii=False) in text
    assert "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>" in text
    assert text.endswith("</tool_call><|user|>\nWeather in Paris?<|assistant|>\n<think>")


def test_multi_turn_tool_calls_and_reasoning(hf_tok45) -> None:
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "old thoughts"},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and Rome?"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should call the tool.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome", "units": {"t": "C"}}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 25}'},
    ]  # fmt: skip
    text = render(hf_tok45, msgs, tools=[WEATHER])
    tail = text[text.index("<|user|>\nhi") :]
    assert tail == (
        "<|user|>\nhi<|assistant|>\n<think></think>\nhello"  # reasoning before the last user turn: dropped
        "<|user|>\nWeather in Paris and Rome?"
        "<|assistant|>\n<think>I should call the tool.</think>"  # the turn in progress keeps it
        "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"
        "\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
        '\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>'
        '\n<arg_key>units</arg_key>\n<arg_value>{"t": "C"}</arg_value>\n</tool_call>'
        '<|observation|>\n<tool_response>\n{"temp": 21}\n</tool_response>'
        '\n<tool_response>\n{"temp": 25}\n</tool_response>'
        "<|assistant|>\n<think>"
    )
    # clear_thinking=False keeps every turn's reasoning; reasoning inline in content is split out.
    kept = render(hf_tok45, msgs[:3], clear_thinking=False)
    assert "<|assistant|>\n<think>old thoughts</think>\nhello" in kept
    inline = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>why</think>\nbecause"}]
    assert render(hf_tok45, inline, add_generation_prompt=False, clear_thinking=False).endswith(
        "<|assistant|>\n<think>why</think>\nbecause"
    )


def test_unparseable_arguments_are_rendered_verbatim(hf_tok45) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert render(hf_tok45, msgs, add_generation_prompt=False).endswith("<tool_call>f\nnot json\n</tool_call>")


def test_render_chat_errors_are_value_errors(hf_tok) -> None:
    with pytest.raises(TemplateError):
        render_chat(hf_tok, [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}], None, True)


# -- the GLM-5.3-Flash variant (the default): the facts of the real template ----------------------------------


def test_glm53_layout_and_effort(hf_tok) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]
    text = render(hf_tok, msgs)
    assert text == ("[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>Be brief.<|user|>Name three colors."
                    "<|assistant|><think>")
    # No enable_thinking variable: the generation prompt opens <think> whatever the caller says.
    assert render(hf_tok, msgs, enable_thinking=False) == text
    for effort, shown in (("low", "Low"), ("high", "High"), ("max", "Max"), ("medium", "Max"), ("none", "Max")):
        assert render(hf_tok, msgs, reasoning_effort=effort).startswith(
            f"[gMASK]<sop><|system|>Reasoning Effort: {shown}<|system|>")


def test_glm53_tools_and_history(hf_tok) -> None:
    tool = {"type": "function", "function": {**WEATHER["function"], "strict": True, "defer_loading": False}}
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "old thoughts"},
        {"role": "assistant", "content": "plain"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Call it.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    ]
    text = render(hf_tok, msgs, tools=[tool])
    assert "<|system|># Tools\n" in text and "<tools>\n" in text and "</tools>" in text
    assert '"strict"' not in text and '"defer_loading"' not in text and '"name": "get_weather"' in text
    assert "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>" in text
    tail = text[text.index("<|user|>hi"):]
    assert tail == (
        "<|user|>hi<|assistant|><think>old thoughts</think>hello"  # clear_thinking false (default): kept
        "<|assistant|><think></think>plain"
        "<|user|>Weather in Paris?<|assistant|><think>Call it.</think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
        '<|observation|><tool_response>{"temp": 21}</tool_response><|assistant|><think>'
    )
    cleared = render(hf_tok, msgs, tools=[tool], clear_thinking=True)
    assert "<think></think>hello" in cleared and "<think>Call it.</think>" in cleared  # after the last user turn
    inline = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>why</think>because"}]
    assert render(hf_tok, inline, add_generation_prompt=False).endswith("<|assistant|><think>why</think>because")
