"""Split GLM's generated text into OpenAI's reasoning_content / content / tool_calls, incrementally.

GLM writes thinking as `<think>...</think>` and a tool call as

    <tool_call>NAME
    <arg_key>K</arg_key>
    <arg_value>V</arg_value>
    </tool_call>

with V JSON-encoded unless it is a string. Text arrives in arbitrary pieces (a tag may be split across
tokens), so the parser holds back any tail that could still become a tag and releases it once it cannot.
The non-streamed reply is built from the same deltas, so streamed and non-streamed output agree by
construction.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from glm53.markup import (
    ARG_KEY_CLOSE,
    ARG_KEY_OPEN,
    ARG_VALUE_CLOSE,
    ARG_VALUE_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
)


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: Delta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


def split_at_tag(buf: str, tags: tuple[str, ...]) -> tuple[str, str | None, str]:
    """Return (text before the first tag, the tag, text after it); with no complete tag, the text that is
    safe to release and the held-back tail that may still grow into a tag (as the third element)."""
    best, best_tag = -1, None
    for tag in tags:
        i = buf.find(tag)
        if i != -1 and (best == -1 or i < best):
            best, best_tag = i, tag
    if best_tag is not None:
        return buf[:best], best_tag, buf[best + len(best_tag):]
    hold = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), 0, -1):
            if buf.endswith(tag[:n]):
                hold = max(hold, n)
                break
    cut = len(buf) - hold
    return buf[:cut], None, buf[cut:]


def convert_arg_value(raw: str, declared_type: str | None) -> Any:
    """GLM writes strings raw and everything else as JSON; the tool schema settles the ambiguous cases
    (a string parameter whose value happens to look like a number stays a string)."""
    text = raw.strip("\n")
    if declared_type == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def tool_param_types(tools: list[dict] | None) -> dict[str, dict[str, str]]:
    """{function name: {parameter: JSON-schema type}} from OpenAI `tools`."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        if not isinstance(props, dict):
            props = {}
        types = {}
        for key, schema in props.items():
            if isinstance(schema, dict) and isinstance(schema.get("type"), str):
                types[key] = schema["type"]
        out[str(fn.get("name", ""))] = types
    return out


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ChatStreamParser:
    """Feed generated text with feed(); each call returns what became certain. finish() flushes."""

    # REASONING: inside <think>. CONTENT: plain answer text. TOOL_NAME: after <tool_call>, reading the name.
    # TOOL_BODY: between argument pairs. ARG_KEY: inside <arg_key>. AFTER_KEY: waiting for <arg_value>.
    # ARG_VALUE: inside <arg_value>.
    REASONING, CONTENT, TOOL_NAME, TOOL_BODY, ARG_KEY, AFTER_KEY, ARG_VALUE = range(7)

    def __init__(self, *, start_in_reasoning: bool, parse_tools: bool,
                 param_types: dict[str, dict[str, str]] | None = None) -> None:
        self.state = self.REASONING if start_in_reasoning else self.CONTENT
        self.parse_tools = parse_tools
        self.param_types = param_types or {}
        self.buf = ""
        # Leading newlines after `<think>` / `</think>` / `</tool_call>` are template formatting, not output.
        self.at_segment_start = True
        self.tool_index = -1
        self.tool_name = ""
        self.args_emitted = 0
        self.arg_key = ""

    @property
    def in_reasoning(self) -> bool:
        return self.state == self.REASONING

    @property
    def tool_calls_seen(self) -> int:
        return self.tool_index + 1

    def begin_tool_call(self, name: str | None) -> Delta:
        """The prompt was made to end with `<tool_call>` (tool_choice "required") or `<tool_call>NAME\n`
        (a named tool_choice): continue from inside the call, announcing a named call right away."""
        out = Delta()
        if name is None:
            self.state = self.TOOL_NAME
            return out
        self.tool_index += 1
        self.tool_name = name
        self.args_emitted = 0
        out.tool_calls.append(ToolCallDelta(self.tool_index, id=new_call_id(), name=name))
        self.state = self.TOOL_BODY
        return out

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while self._step(out):
            pass
        return out

    def finish(self, truncated: bool = False) -> Delta:
        """End of generation: release held text. An unfinished tool call is closed so its arguments stay JSON,
        unless the generation was `truncated` (max_tokens): then its arguments stay as generated, cut off
        where the model was, as OpenAI's do (finish_reason "length" says they are incomplete)."""
        out = Delta()
        if truncated and self.state in (self.TOOL_BODY, self.ARG_KEY, self.AFTER_KEY, self.ARG_VALUE):
            if self.state == self.ARG_VALUE:
                self._emit_arg(out, self.buf, partial=True)
            self.buf, self.state = "", self.CONTENT
            return out
        rest, self.buf = self.buf, ""
        if self.state == self.REASONING:
            self._emit(out, rest, reasoning=True)
        elif self.state == self.CONTENT:
            if not (self.tool_calls_seen and not rest.strip()):
                self._emit(out, rest, reasoning=False)
        elif self.state == self.TOOL_NAME:
            # The name never completed: what we held is not a usable call, so it is content.
            self._emit(out, TOOL_CALL_OPEN + rest, reasoning=False)
        else:
            if self.state == self.ARG_VALUE:
                self._emit_arg(out, rest)
            elif self.state == self.AFTER_KEY:
                self._emit_arg(out, None)
            self._close_call(out)
        self.state = self.CONTENT
        return out

    # -- internals -------------------------------------------------------------------------------------

    def _emit(self, out: Delta, text: str, *, reasoning: bool) -> None:
        if self.at_segment_start:
            text = text.lstrip("\n")
            if not text:
                return
            self.at_segment_start = False
        if reasoning:
            out.reasoning += text
        else:
            out.content += text

    def _step(self, out: Delta) -> bool:
        """Consume from self.buf up to and including the next tag; False when nothing more is certain."""
        state = self.state
        if state == self.REASONING:
            before, tag, self.buf = split_at_tag(self.buf, (THINK_CLOSE,))
            self._emit(out, before, reasoning=True)
            if tag is None:
                return False
            self.state, self.at_segment_start = self.CONTENT, True
            return True
        if state == self.CONTENT:
            tags = (THINK_OPEN, THINK_CLOSE) + ((TOOL_CALL_OPEN,) if self.parse_tools else ())
            before, tag, rest = split_at_tag(self.buf, tags)
            if self.tool_calls_seen and not before.strip():
                # After a tool call only whitespace is expected before the next one: never make it content.
                self.buf = rest if tag is not None else before + rest
                if tag is None:
                    return False
            else:
                self.buf = rest
                self._emit(out, before, reasoning=False)
                if tag is None:
                    return False
            if tag == THINK_OPEN:
                self.state, self.at_segment_start = self.REASONING, True
            elif tag == TOOL_CALL_OPEN:
                self.state = self.TOOL_NAME
            # A stray `</think>` (the empty `<think></think>` of a non-thinking turn) is dropped.
            return True
        if state == self.TOOL_NAME:
            before, tag, rest = split_at_tag(self.buf, ("\n", ARG_KEY_OPEN, TOOL_CALL_CLOSE))
            if tag is None:
                return False
            self.buf = rest
            self.tool_index += 1
            self.tool_name = before.strip()
            self.args_emitted = 0
            out.tool_calls.append(ToolCallDelta(self.tool_index, id=new_call_id(), name=self.tool_name))
            if tag == ARG_KEY_OPEN:
                self.state = self.ARG_KEY
            elif tag == TOOL_CALL_CLOSE:
                self._close_call(out)
            else:
                self.state = self.TOOL_BODY
            return True
        if state in (self.TOOL_BODY, self.AFTER_KEY):
            expected = ARG_KEY_OPEN if state == self.TOOL_BODY else ARG_VALUE_OPEN
            tags = (expected, TOOL_CALL_CLOSE) if state == self.TOOL_BODY else (expected, ARG_KEY_OPEN, TOOL_CALL_CLOSE)
            _, tag, self.buf = split_at_tag(self.buf, tags)
            # Text between the structural tags is formatting whitespace; it is dropped.
            if tag is None:
                return False
            if state == self.AFTER_KEY and tag != ARG_VALUE_OPEN:
                self._emit_arg(out, None)  # a key without a value: keep it as null rather than lose it
            if tag == ARG_KEY_OPEN:
                self.state = self.ARG_KEY
            elif tag == ARG_VALUE_OPEN:
                self.state = self.ARG_VALUE
            else:
                self._close_call(out)
            return True
        if state in (self.ARG_KEY, self.ARG_VALUE):
            closer = ARG_KEY_CLOSE if state == self.ARG_KEY else ARG_VALUE_CLOSE
            before, tag, rest = split_at_tag(self.buf, (closer,))
            if tag is None:
                return False
            self.buf = rest
            if state == self.ARG_KEY:
                self.arg_key = before.strip()
                self.state = self.AFTER_KEY
            else:
                self._emit_arg(out, before)
                self.state = self.TOOL_BODY
            return True
        raise AssertionError(f"parser state {state}")

    def _emit_arg(self, out: Delta, raw: str | None, partial: bool = False) -> None:
        declared = self.param_types.get(self.tool_name, {}).get(self.arg_key)
        if partial:  # the value as far as it was generated: a string left open, anything else verbatim
            text = (raw or "").lstrip("\n")
            value_json = json.dumps(text, ensure_ascii=False)[:-1] if declared == "string" else text
        else:
            value_json = json.dumps(None if raw is None else convert_arg_value(raw, declared), ensure_ascii=False)
        piece = json.dumps(self.arg_key, ensure_ascii=False) + ": " + value_json
        out.tool_calls.append(ToolCallDelta(self.tool_index, arguments=("{" if not self.args_emitted else ", ") + piece))
        self.args_emitted += 1
        self.arg_key = ""

    def _close_call(self, out: Delta) -> None:
        out.tool_calls.append(ToolCallDelta(self.tool_index, arguments="}" if self.args_emitted else "{}"))
        self.args_emitted = 0
        self.tool_name = ""
        self.state = self.CONTENT
        self.at_segment_start = True


def merge_tool_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """Fold streamed tool-call deltas into complete OpenAI tool_calls (the non-streamed reply)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if d.id:
            call["id"] = d.id
        if d.name is not None:
            call["function"]["name"] = d.name
        call["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]
