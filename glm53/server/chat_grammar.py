"""Tool calls constrained by an llguidance (lark) grammar, so an agent can rely on what it gets back.

Once the model opens `<tool_call>`, the name must be one of the declared tools and the arguments follow that
tool's JSON schema in GLM's arg_key/arg_value form: declared keys only, in declared order, the required ones
present, string values raw (the template writes them so) and every other value JSON of its schema. The GLM
markup tags are referenced by token id (`<[id]>`): in the vocabulary they are single added tokens, and free
text can never spell them, so the model cannot wander into an unconstrained call.

Between structural tags a newline is optional: the real template writes none, GLM-4.5-shaped templates one.
The grammar is engine-neutral text (SamplingParams.grammar): the reference engine applies it with
llguidance directly, the exllamav3 engine through its LLGuidanceFilter; both apply it only after an open
think block closes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from glm53.markup import (
    ARG_KEY_CLOSE,
    ARG_KEY_OPEN,
    ARG_VALUE_CLOSE,
    ARG_VALUE_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
)
from glm53.server.errors import bad_request

_TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, ARG_KEY_OPEN, ARG_KEY_CLOSE, ARG_VALUE_OPEN, ARG_VALUE_CLOSE)
# Compact JSON for non-string values: with flexible whitespace a weak model can spend its budget on spaces.
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def check_tool_schemas(tools: list[dict]) -> None:
    """A 400 naming the field for a `parameters` that is not an object schema (before anything renders it)."""
    for i, tool in enumerate(tools):
        where = f"tools.{i}.function.parameters"
        params = tool["function"].get("parameters")
        if params is None:
            continue
        kind = params.get("type", "object")
        if kind != "object":
            raise bad_request(f"{where}.type must be \"object\" (got {kind!r}): a function takes named arguments.",
                              param=f"{where}.type")
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise bad_request(f"{where}.properties must be an object mapping each argument name to its JSON "
                              f"schema (got {json.dumps(props)[:80]}).", param=f"{where}.properties")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise bad_request(f"{where}.required must be a list of argument names.", param=f"{where}.required")
        missing = [k for k in required if k not in props]
        if missing:
            raise bad_request(f"{where}.required names {missing} that properties does not declare.",
                              param=f"{where}.required")


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _value(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    enum = schema.get("enum")
    if schema.get("type") == "string" or (isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum)):
        if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
            return "(" + " | ".join(_lit(e) for e in enum) + ")"
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        if isinstance(lo, int) or isinstance(hi, int):  # bounded: a length the schema allows, in characters
            return f"/(.|\\n){{{max(lo or 0, 0)},{'' if hi is None else max(hi, 0)}}}/"
        return "STR"  # raw text, as the template writes string values
    # A property's `$ref`s point into the parameters' own definitions: they travel with it.
    return "%json " + json.dumps({**_COMPACT, **defs, **schema}, separators=(",", ":"), ensure_ascii=False)


def tool_call_grammar(tools: list[dict], token_id: Callable[[str], int | None], *, choice: str,
                      named: str | None, parallel: bool, answer: str | None = None) -> str:
    """The lark grammar of a reply under `choice` ("auto" | "required" | "named" | "none").

    answer: a grammar for the non-tool reply (response_format's, a `start:` rule), else free text."""
    tag = {}
    for t in _TAGS:
        i = token_id(t)
        tag[t] = f"<[{i}]>" if i is not None else _lit(t)
    rules: list[str] = []
    alts = []
    for n, tool in enumerate(tools):
        fn = tool["function"]
        if named is not None and fn["name"] != named:
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        pairs = []
        for k, (key, schema) in enumerate(props.items()):
            rule = f"a{n}_{k}"
            rules.append(f"{rule}: {tag[ARG_KEY_OPEN]} {_lit(key)} {tag[ARG_KEY_CLOSE]} NL? "
                         f"{tag[ARG_VALUE_OPEN]} {_value(schema, defs)} {tag[ARG_VALUE_CLOSE]} NL?")
            pairs.append(rule if key in required else rule + "?")
        alts.append(f"{_lit(fn['name'])} NL? {' '.join(pairs)}")
    rules.append(f"call: {tag[TOOL_CALL_OPEN]} ({' | '.join(alts)}) {tag[TOOL_CALL_CLOSE]}")
    rules.append("calls: call (NL? call)*" if parallel else "calls: call")
    if answer is not None:
        rules.append(answer.replace("start:", "answer:", 1))
    else:
        rules.append("TEXT: /(.|\\n)+/")
    if answer is None:
        start = {"auto": "start: TEXT? calls?", "none": "start: TEXT?"}.get(choice, "start: calls")
    else:
        start = {"auto": "start: answer | calls", "none": "start: answer"}.get(choice, "start: calls")
    if choice == "named":
        start = "start: call"
    rules += ["STR: /(.|\\n)*/", 'NL: "\\n"']
    return "\n".join([start, *rules]) + "\n"
