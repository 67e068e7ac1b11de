"""A chat request -> the exact prompt the engine runs (shared by /v1/chat/completions and /tokenize).

Thinking control must work whatever template the checkpoint ships: the real GLM-5.3-Flash template has no
`enable_thinking` variable and always opens `<think>`, while GLM-4.5-shaped ones read `enable_thinking`. So
every control reaches the template as a variable (enable_thinking, reasoning_effort, clear_thinking), and
when thinking is off and the rendered prompt still ends inside an open `<think>`, the server closes it: the
model then sees the empty `<think></think>` block it was trained on for "no reasoning".

Reasoning re-attachment: most clients drop `reasoning_content` from earlier assistant turns. The server keeps
(bounded) the reasoning of every turn it returned, keyed by that turn's content and tool calls, and puts it
back when the turn comes back without it: the model sees its own chain again and the history renders as it
was generated.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from glm53.engine.template import parse_arguments
from glm53.markup import THINK_CLOSE, THINK_OPEN, TOOL_CALL_OPEN
from glm53.server.errors import bad_request

# OpenAI's reasoning_effort -> the template's effort ("none" = thinking off).
EFFORTS = {"none": "none", "minimal": "none", "low": "low", "medium": "high", "high": "high", "max": "max"}
TEMPLATE_EFFORTS = ("none", "low", "high", "max")


@dataclass(frozen=True)
class Thinking:
    on: bool
    effort: str  # "low" | "high" | "max" (what the template is told; meaningless when off)
    budget: int | None  # reasoning tokens allowed; None = unlimited


def resolve_thinking(kwargs: dict[str, Any], reasoning_effort: str | None, max_reasoning_tokens: int | None,
                     default_effort: str, server_budget: int) -> Thinking:
    """Pure: what the request asks for. Precedence: the template's own kwargs (chat_template_kwargs), then the
    OpenAI fields, then the server's default effort (GLM53_REASONING_EFFORT)."""
    effort = kwargs.get("reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request(f"chat_template_kwargs.reasoning_effort must be one of {', '.join(TEMPLATE_EFFORTS)} "
                              f"(got {effort!r}).", param="chat_template_kwargs.reasoning_effort")
        effort = EFFORTS[effort]
    elif reasoning_effort is not None:
        effort = EFFORTS[reasoning_effort]
    else:
        effort = default_effort
    flag = kwargs.get("enable_thinking", kwargs.get("thinking"))
    if flag is not None and not isinstance(flag, bool):
        raise bad_request(f"chat_template_kwargs.enable_thinking must be true or false (got {flag!r}).",
                          param="chat_template_kwargs.enable_thinking")
    on = effort != "none" if flag is None else flag
    if on and effort == "none":  # thinking asked for explicitly over an effort of none: the middle one
        effort = "high"
    budgets = [b for b in (server_budget or None, max_reasoning_tokens) if b is not None]
    budget = min(budgets) if budgets else None
    if budget == 0:
        on = False
    return Thinking(on, effort, budget)


@dataclass(frozen=True)
class TurnLayout:
    """How the checkpoint's template writes an assistant turn, read by rendering one (any template)."""

    after_think: str  # what follows `</think>` before the answer ("" in GLM-5.3's, "\n" in GLM-4.5's)


def probe_layout(engine: Any) -> TurnLayout:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ANSWER", "reasoning_content": "r"}]
    try:
        text = engine.apply_chat_template(msgs, None, True, False, {"clear_thinking": False})
    except Exception:  # noqa: BLE001 - a template that cannot render this has no layout to learn
        return TurnLayout("\n")
    head, sep, tail = text.rpartition(THINK_CLOSE)
    return TurnLayout(tail.split("ANSWER")[0] if sep and "ANSWER" in tail else "\n")


def _canonical_args(args: Any) -> str:
    parsed = parse_arguments(args)
    return parsed if isinstance(parsed, str) else json.dumps(parsed, sort_keys=True, ensure_ascii=False)


def turn_key(content: str | None, tool_calls: list[dict] | None) -> str:
    """The identity of an assistant turn as a client sends it back: its text and its calls (ids excluded:
    some clients renumber them)."""
    calls = [(c["function"]["name"], _canonical_args(c["function"].get("arguments", ""))) for c in tool_calls or []]
    doc = json.dumps([(content or "").strip(), calls], ensure_ascii=False)
    return hashlib.sha256(doc.encode("utf-8", "surrogatepass")).hexdigest()


def _message_doc(m: dict) -> list:
    # What identifies a message of the history as clients resend it: reasoning left out (a client may drop it).
    if m.get("role") == "assistant":
        return ["assistant", turn_key(m.get("content"), m.get("tool_calls"))]
    content = m.get("content")
    return [m.get("role"), content if isinstance(content, str) else json.dumps(content, sort_keys=True, default=str),
            m.get("tool_call_id")]


def image_digests(refs: Sequence[Any]) -> dict[int, list[str]]:
    """Per message index, the sha256 of each image it carries (images.ImageRef): a message's text holds only a
    marker where an image stands, so two conversations that differ by a picture differ here."""
    out: dict[int, list[str]] = {}
    for ref in refs:
        out.setdefault(ref.message, []).append(hashlib.sha256(ref.url.encode("utf-8", "surrogatepass")).hexdigest())
    return out


def history_keys(messages: list[dict], images: dict[int, list[str]] | None = None) -> list[str]:
    """keys[i]: the identity of messages[:i], the conversation before message i, images included (one running
    hash, so a long history costs one pass)."""
    running = hashlib.sha256()
    keys = []
    for i, m in enumerate(messages):
        keys.append(running.hexdigest())
        doc = _message_doc(m) + (images or {}).get(i, [])
        running.update(json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    keys.append(running.hexdigest())
    return keys


class ReasoningMemory:
    """The reasoning of recent assistant turns, least recently used dropped first, bounded in characters. A turn
    is known by what came before it (`history`, from history_keys) and its own text and calls: turns alike in
    themselves (empty replies cut off in their thinking, the same call twice) stay apart."""

    def __init__(self, max_chars: int = 8 << 20, max_turns: int = 4096) -> None:
        self.max_chars = max_chars
        self.max_turns = max_turns
        self._items: OrderedDict[str, str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # remembered on the event loop, recalled in prompt-building threads

    def remember(self, content: str | None, tool_calls: list[dict] | None, reasoning: str, history: str = "") -> None:
        if not reasoning or len(reasoning) > self.max_chars:
            return
        key = history + turn_key(content, tool_calls)
        with self._lock:
            old = self._items.pop(key, None)
            self._chars -= len(old or "")
            self._items[key] = reasoning
            self._chars += len(reasoning)
            while self._chars > self.max_chars or len(self._items) > self.max_turns:
                _, dropped = self._items.popitem(last=False)
                self._chars -= len(dropped)

    def recall(self, content: str | None, tool_calls: list[dict] | None, history: str = "") -> str | None:
        key = history + turn_key(content, tool_calls)
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def __len__(self) -> int:
        return len(self._items)

    @property
    def chars(self) -> int:
        return self._chars


def reattach(messages: list[dict], memory: ReasoningMemory, images: dict[int, list[str]] | None = None) -> list[dict]:
    """Assistant turns without reasoning get back the reasoning the server generated for them (`images`: as
    history_keys takes them)."""
    out = []
    keys = history_keys(messages, images)
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and "reasoning_content" not in m and THINK_CLOSE not in (m.get("content") or ""):
            found = memory.recall(m.get("content"), m.get("tool_calls"), keys[i])
            if found is not None:
                m = {**m, "reasoning_content": found}
        out.append(m)
    return out


@dataclass
class Prompt:
    text: str
    thinking: Thinking
    start_in_reasoning: bool
    stuffed_tool: bool  # the prompt ends inside a forced tool call (engines without grammar support)


def close_think(text: str) -> str:
    """A prompt rendered for no thinking that still ends inside an open `<think>` (the real template opens it
    unconditionally): closed, so the model sees the empty block it was trained on for "no reasoning"."""
    return text + THINK_CLOSE if text.rstrip().endswith(THINK_OPEN) else text


def finish_prompt(text: str, thinking: Thinking, *, force_call: bool, named: str | None) -> Prompt:
    """The server's own changes to a rendered prompt: the think block closed when thinking is off; a forced
    call opened where no grammar can force it."""
    if not thinking.on:
        text = close_think(text)
    stuffed = False
    if force_call:
        text += TOOL_CALL_OPEN + (f"{named}\n" if named else "")
        stuffed = True
    return Prompt(text, thinking, text.rstrip().endswith(THINK_OPEN), stuffed)
