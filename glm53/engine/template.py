"""Render OpenAI-style messages with a checkpoint's chat template (shared by every engine).

Chat templates index tool-call arguments as a mapping (GLM's emits one arg_key/arg_value pair per key), but
OpenAI clients send `arguments` as a JSON *string*. Parse it here, once, so every engine renders the same
prompt; a string that is not a JSON object is passed through and the template prints it verbatim.
"""

from __future__ import annotations

import json
from typing import Any

# apply_chat_template's own arguments: a client's chat_template_kwargs must not override them.
_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt",
                       "continue_final_message", "return_dict", "return_tensors", "padding", "truncation",
                       "max_length", "chat_template", "tokenizer_kwargs", "return_assistant_tokens_mask"})


class TemplateError(ValueError):
    """The messages could not be rendered (bad roles, template raise_exception): a 400 for the client."""


def parse_arguments(value: Any) -> Any:
    """A tool call's arguments as a dict where they are a JSON object (string or not), else as given."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Copy of `messages` with every tool call's arguments as a dict where they parse as a JSON object."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        fixed = []
        for call in calls:
            call = dict(call)
            if isinstance(call.get("function"), dict):
                fn = dict(call["function"])
                fn["arguments"] = parse_arguments(fn.get("arguments", {}))
                call["function"] = fn
            elif "arguments" in call:
                call["arguments"] = parse_arguments(call["arguments"])
            fixed.append(call)
        out.append({**m, "tool_calls": fixed})
    return out


def render_chat(
    hf_tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None,
    enable_thinking: bool,
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt text for `messages` through transformers' apply_chat_template (its sandboxed Jinja).
    `template_kwargs` are extra template variables (reasoning_effort, clear_thinking...); a template ignores
    the ones it does not read."""
    from jinja2.exceptions import TemplateError as JinjaError

    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED}
    try:
        return hf_tokenizer.apply_chat_template(
            normalize_messages(messages),
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **{**extra, "enable_thinking": enable_thinking},
        )
    except (JinjaError, TypeError, KeyError, AttributeError, ValueError) as exc:
        raise TemplateError(f"cannot render the chat template: {exc}") from exc
