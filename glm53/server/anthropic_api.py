"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API (what Claude Code and the anthropic
SDK send), translated into the chat route's request and run through the same path (chat_api.prepare_chat and
run_choice: one prompt builder, thinking control, reasoning re-attachment, tool grammar, usage).

Any `model` is accepted (Claude Code names its own tiers) and the reply names the served model. Errors on these
routes are in Anthropic's shape (errors.body_for picks it by path).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import jiter
from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, StrictBool, StrictInt

from glm53.server.blocks import Block, BlockEvent, BlockSequence
from glm53.server.chat_api import ORIGIN, PreparedChat, build_chat_prompt, chat_request, prepare_chat, run_choice
from glm53.server.common import LiveRequest, ServerState, check_ready, respond
from glm53.server.errors import APIError, anthropic_body, bad_request, from_engine_error
from glm53.server.protocol import SEED_MAX, SEED_MIN, TOOL_NAME, ChatCompletionRequest, _Model
from glm53.server.sse import PING, event_frame, with_keepalive

log = logging.getLogger("glm53.server")

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Claude Code's first system block: billing metadata for Anthropic's servers that changes between requests
# (its cc_version carries a per-request suffix). It says nothing to the model and, left at the top of the prompt,
# would cost every turn its cached prefix, so it is left out.
BILLING_HEADER = "x-anthropic-billing-header:"
# Blocks that carry no content for this model: replayed server-side work of Anthropic's own tools.
_SKIPPED_BLOCKS = frozenset({"redacted_thinking", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                             "code_execution_tool_result", "bash_code_execution_tool_result",
                             "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
                             "container_upload", "tool_search_tool_result"})
_MEDIA_BLOCKS = frozenset({"document"})


class ImageSource(_Model):
    type: str  # "base64" | "url" (others, e.g. "file", are refused by name)
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ContentBlock(_Model):
    """Any content block; which fields a type needs is checked when it is translated (naming the block)."""

    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    source: ImageSource | None = None  # an image block's


class Message(_Model):
    # "system" mid-conversation: Claude Code's beta mid-conversation-system-2026-04-07.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolDef(_Model):
    type: str | None = None  # client tools only: absent or "custom"
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class ThinkingConfig(_Model):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(_Model):
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[ContentBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None
    stream: StrictBool = False
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None  # an extension: reproducible sampling


def _refuse_media(b: ContentBlock, where: str) -> None:
    if b.type in _MEDIA_BLOCKS:
        raise bad_request(f"{where}: {b.type} blocks are not supported by this server (text only): send the "
                          f"{b.type}'s content as text.", param=where)


def _skipped(b: ContentBlock, where: str) -> bool:
    """Whether block `b` is one that changes nothing for this model (logged at debug); media are refused."""
    _refuse_media(b, where)
    if b.type in _SKIPPED_BLOCKS:
        log.debug("messages: %s block at %s left out", b.type, where)
        return True
    return False


def _image_part(b: ContentBlock, where: str) -> dict[str, Any]:
    """An image block as the chat route's image_url part (a data URL for a base64 source)."""
    src = b.source
    if src is None:
        raise bad_request(f"{where}: an image block needs source.", param=f"{where}.source")
    if src.type == "base64":
        if not src.media_type or not src.data:
            raise bad_request(f"{where}.source: a base64 image source needs media_type and data.",
                              param=f"{where}.source")
        url = f"data:{src.media_type};base64,{src.data}"
    elif src.type == "url" and src.url:
        url = src.url
    else:
        raise bad_request(f"{where}.source: image sources of type {src.type!r} are not supported here (base64, "
                          "and url where the server fetches, are): send the image's bytes as a base64 source.",
                          param=f"{where}.source.type")
    return {"type": "image_url", "image_url": {"url": url}, ORIGIN: where}


def _joined(items: list[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Blocks' texts joined by newlines; with images, chat parts in the same order (an image where it stood)."""
    if all(isinstance(x, str) for x in items):
        return "\n".join(items)  # type: ignore[arg-type]
    parts: list[dict[str, Any]] = []
    for k, x in enumerate(items):
        if k:
            parts.append({"type": "text", "text": "\n"})
        parts.append({"type": "text", "text": x} if isinstance(x, str) else x)
    return parts


def _tool_result(blocks: list[ContentBlock], where: str) -> str | list[dict[str, Any]]:
    """A tool_result's content: text blocks and images (what an agent's Read tool returns for a screenshot)."""
    items: list[str | dict[str, Any]] = []
    for j, b in enumerate(blocks):
        if b.type == "image":
            items.append(_image_part(b, f"{where}.{j}"))
        elif not _skipped(b, f"{where}.{j}"):
            if b.type != "text" or b.text is None:
                raise bad_request(f"{where}.{j}: only text and image blocks are supported here (got {b.type!r}).",
                                  param=f"{where}.{j}")
            items.append(b.text)
    return _joined(items)


def _texts(blocks: list[ContentBlock], where: str) -> str:
    out = []
    for j, b in enumerate(blocks):
        if _skipped(b, f"{where}.{j}"):
            continue
        if b.type != "text" or b.text is None:
            raise bad_request(f"{where}.{j}: only text blocks are supported here (got {b.type!r}).",
                              param=f"{where}.{j}")
        out.append(b.text)
    return "\n".join(out)


def _system(system: str | list[ContentBlock]) -> str:
    if isinstance(system, str):
        return system
    kept = [b for b in system if not (b.type == "text" and (b.text or "").startswith(BILLING_HEADER))]
    return _texts(kept, "system")


def _assistant(blocks: list[ContentBlock], where: str) -> dict[str, Any]:
    reasoning, text, calls = [], [], []
    for j, b in enumerate(blocks):
        if b.type == "thinking":  # replayed thinking is the turn's reasoning
            reasoning.append(b.thinking or "")
        elif _skipped(b, f"{where}.{j}"):  # redacted thinking: encrypted by another server
            continue
        elif b.type == "text":
            text.append(b.text or "")
        elif b.type == "tool_use":
            if not b.id or not b.name:
                raise bad_request(f"{where}.{j}: a tool_use block needs id and name.", param=f"{where}.{j}")
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input or {}}})
        else:
            raise bad_request(f"{where}.{j}: an assistant turn may hold text, thinking and tool_use blocks "
                              f"(got {b.type!r}).", param=f"{where}.{j}")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list[ContentBlock], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str | dict[str, Any]] = []
    for j, b in enumerate(blocks):
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "image":
            texts.append(_image_part(b, f"{where}.{j}"))
        elif _skipped(b, f"{where}.{j}"):
            continue
        elif b.type == "tool_result":
            if texts:
                out.append({"role": "user", "content": _joined(texts)})
                texts = []
            if not b.tool_use_id:
                raise bad_request(f"{where}.{j}: a tool_result block needs tool_use_id.", param=f"{where}.{j}")
            result = b.content if isinstance(b.content, str) else _tool_result(b.content or [], f"{where}.{j}.content")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _error_marked(result, b.is_error)})
        else:
            raise bad_request(f"{where}.{j}: only text, image and tool_result blocks are supported in a user turn "
                              f"(got {b.type!r}).", param=f"{where}.{j}")
    if texts:
        out.append({"role": "user", "content": _joined(texts)})
    return out


def _error_marked(result: str | list[dict[str, Any]], is_error: bool | None) -> str | list[dict[str, Any]]:
    # The chat template has no error flag for a tool response: the text says it.
    if not is_error:
        return result
    if isinstance(result, str):
        return f"Error: {result}"
    return [{"type": "text", "text": "Error: "}, *result]


def _tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None or choice.type == "auto":
        return None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type 'tool' needs name.", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"any": "required", "none": "none"}[choice.type]


def to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request this Messages request means (model left out: any name is served)."""
    if req.messages[-1].role == "assistant":
        raise bad_request("The last message is an assistant turn (a prefill), which this server does not continue: "
                          "end the conversation with a user turn.", param=f"messages.{len(req.messages) - 1}.role")
    messages: list[dict[str, Any]] = []
    system = _system(req.system) if req.system else ""
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "system":  # rendered where it stands: the turns before it keep their cached prefix
            messages.append({"role": "system", "content": _texts(m.content, where)})
        elif m.role == "assistant":
            messages.append(_assistant(m.content, where))
        else:
            messages.extend(_user(m.content, where))
    tools, left_out = [], []
    for t in req.tools or []:
        if t.type not in (None, "custom"):  # Anthropic's server tools (web_search_...) and its schema-less ones
            left_out.append(f"{t.name} ({t.type})")
            continue
        tools.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                       "parameters": t.input_schema}})
    if left_out:
        log.info("messages: tools this server cannot run left out of the prompt: %s", ", ".join(left_out))
    fields: dict[str, Any] = {"messages": messages, "tools": tools or None, "tool_choice": _tool_choice(req.tool_choice)}
    thinking = req.thinking
    if thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": thinking.type != "disabled"}
        if thinking.type == "enabled" and thinking.budget_tokens is not None:
            fields["max_reasoning_tokens"] = thinking.budget_tokens
    config = req.output_config
    if config is not None and config.effort is not None:
        fields["reasoning_effort"] = "max" if config.effort == "xhigh" else config.effort
    if config is not None and config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": config.format.schema_}}
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if isinstance(req, MessagesRequest):
        fields.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      stop=req.stop_sequences, seed=req.seed)
    return chat_request(fields)


# -- replies ---------------------------------------------------------------------------------------------------


def usage(live: LiveRequest) -> dict[str, Any]:
    # Anthropic counts prompt tokens read from the cache apart from input_tokens; their sum is the prompt.
    u = live.usage()
    cached = u["prompt_tokens_details"]["cached_tokens"]
    out: dict[str, Any] = {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
                           "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
    details = u["prompt_tokens_details"]
    if "image_tokens" in details:  # an extension (Anthropic's usage has no such field): the prompt's images
        out["input_tokens_details"] = {k: details[k] for k in ("image_tokens", "image_tokens_per_image")}
    return out


def _tool_input(arguments: str) -> Any:
    # A call cut off by max_tokens has incomplete JSON: the part generated, parsed as the SDK parses a stream.
    return jiter.from_json(arguments.encode(), partial_mode="trailing-strings") if arguments else {}


def _block_json(block: Block, whole: bool) -> dict[str, Any]:
    if block.kind == "thinking":
        return {"type": "thinking", "thinking": block.text if whole else "", "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text if whole else ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": _tool_input(block.text) if whole else {}}


def _stop(reason: str | None, stop_sequence: str | None) -> tuple[str | None, str | None]:
    if stop_sequence is not None:
        return "stop_sequence", stop_sequence
    return STOP_REASONS.get(reason or "", reason), None


def _message(state: ServerState, live: LiveRequest, content: list[dict], reason: str | None,
             stop_sequence: str | None) -> dict[str, Any]:
    return {"id": live.id, "type": "message", "role": "assistant", "model": state.model_id, "content": content,
            "stop_reason": reason, "stop_sequence": stop_sequence, "usage": usage(live)}


async def _collect(state: ServerState, prep: PreparedChat, live: LiveRequest) -> dict[str, Any]:
    seq = BlockSequence()
    reason = stop_sequence = None
    events = run_choice(state, prep, live, 0)
    try:
        async for ev in events:
            seq.feed(ev.delta)
            if ev.finish_reason:
                reason, stop_sequence = _stop(ev.finish_reason, ev.stop_sequence)
    finally:
        await events.aclose()
        live.finish()
    seq.finish()
    return _message(state, live, [_block_json(b, True) for b in seq.blocks], reason, stop_sequence)


_DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
           "tool": ("input_json_delta", "partial_json")}


def _block_frames(ev: BlockEvent) -> list[bytes]:
    index = ev.block.index
    if ev.type == "start":
        return [event_frame("content_block_start", {"type": "content_block_start", "index": index,
                                                    "content_block": _block_json(ev.block, False)})]
    if ev.type == "delta":
        kind, key = _DELTAS[ev.block.kind]
        return [event_frame("content_block_delta", {"type": "content_block_delta", "index": index,
                                                    "delta": {"type": kind, key: ev.piece}})]
    out = []
    if ev.block.kind == "thinking":  # no signature is made (the field exists for clients that read it)
        out.append(event_frame("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "signature_delta", "signature": ""}}))
    out.append(event_frame("content_block_stop", {"type": "content_block_stop", "index": index}))
    return out


PING_EVENT = event_frame("ping", {"type": "ping"})


async def _stream(state: ServerState, prep: PreparedChat, live: LiveRequest) -> AsyncIterator[bytes]:
    seq = BlockSequence()
    reason = stop_sequence = None
    events = with_keepalive(run_choice(state, prep, live, 0), state.ping_interval)
    try:
        yield event_frame("message_start", {"type": "message_start", "message": _message(state, live, [], None, None)})
        async for ev in events:
            if ev is PING:  # a long prefill (or a wait for a slot): keep the client's read timeout at bay
                yield PING_EVENT
                continue
            for be in seq.feed(ev.delta):
                for chunk in _block_frames(be):
                    yield chunk
            if ev.finish_reason:
                reason, stop_sequence = _stop(ev.finish_reason, ev.stop_sequence)
        for be in seq.finish():
            for chunk in _block_frames(be):
                yield chunk
        yield event_frame("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                                            "usage": usage(live)})
        yield event_frame("message_stop", {"type": "message_stop"})
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band
        err = exc if isinstance(exc, APIError) else from_engine_error(exc)
        yield event_frame("error", anthropic_body(err))
        yield event_frame("message_stop", {"type": "message_stop"})  # the stream's end, as clients wait for it
    finally:
        await events.aclose()
        live.finish()


async def messages(state: ServerState, request: Request, req: MessagesRequest) -> Response:
    live = LiveRequest(state, "msg")
    prep = await prepare_chat(state, to_chat(req), live)
    return await respond(request, live, req.stream, lambda: _stream(state, prep, live),
                         lambda: _collect(state, prep, live))


async def count_tokens(state: ServerState, req: CountTokensRequest) -> dict[str, int]:
    """The prompt the same /v1/messages request would run, counted (input_tokens + cache_read_input_tokens of
    its usage)."""
    check_ready(state)
    chat = to_chat(req)
    prompt = await asyncio.to_thread(build_chat_prompt, state, chat, parallel=chat.parallel_tool_calls is not False)
    return {"input_tokens": len(prompt.ids)}
