"""POST /v1/chat/completions: messages -> GLM prompt -> choices with reasoning, content and tool calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from glm53.engine.interface import EngineEvent, SamplingParams
from glm53.engine.vision import PromptImage
from glm53.server import images
from glm53.server.chat import (
    THINK_CLOSE,
    ChatStreamParser,
    Delta,
    merge_tool_calls,
    tool_param_types,
)
from glm53.server.chat_grammar import check_tool_schemas, tool_call_grammar
from glm53.server.chat_prompt import (
    Prompt,
    Thinking,
    finish_prompt,
    history_keys,
    image_digests,
    reattach,
    resolve_thinking,
)
from glm53.server.common import (
    LiveRequest,
    ServerState,
    check_capacity,
    check_model,
    check_ready,
    check_unsupported,
    error_frame_body,
    grammar_for,
    open_runs,
    resolve_max_tokens,
    respond,
    sampling_params,
    stream_usage_requested,
    tokenize_prompt,
)
from glm53.server.errors import bad_request
from glm53.server.generation import Tally, TokenLogprob, choice_emissions
from glm53.server.images import MARKER, ImageRef
from glm53.server.protocol import ChatCompletionRequest, ChatFields, ChatMessage, ContentPart, ImageURL, NamedToolChoice
from glm53.server.sse import DONE_FRAME, PING, PING_FRAME, frame, merge, with_keepalive


def _part_text(part: ContentPart, where: str, role: str, images: list[ImageRef], message: int) -> str:
    """A content part's text in the prompt; an image part stands as its marker, its reference kept in `images`."""
    if part.type in ("text", "input_text") and part.text is not None:
        return part.text
    if part.type in ("image_url", "input_image"):
        url = part.image_url.url if isinstance(part.image_url, ImageURL) else part.image_url
        if not url:
            raise bad_request(f"{where}: an image_url part needs image_url.url.", param=where)
        if role == "assistant":
            raise bad_request(f"{where}: images go in user, system or tool turns, not the assistant's.", param=where)
        images.append(ImageRef(url, part._origin or where, message))
        return MARKER
    raise bad_request(f"{where}: only text and image_url parts are supported (got {part.type!r}).", param=where)


def template_messages(messages: list[ChatMessage], images: list[ImageRef] | None = None) -> list[dict[str, Any]]:
    """OpenAI messages -> the dicts the GLM chat template reads. Prior reasoning (either field name) and tool
    calls are kept so multi-turn agent loops render as the model saw them. Image parts are appended to `images`
    in prompt order."""
    found: list[ImageRef] = [] if images is None else images
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            content = "".join(_part_text(part, f"messages.{i}.content.{j}", m.role, found, i)
                              for j, part in enumerate(m.content))
        else:
            content = m.content or ""
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                d["reasoning_content"] = reasoning
            if m.tool_calls:
                d["tool_calls"] = [{"id": tc.id, "type": "function",
                                    "function": {"name": tc.function.name,
                                                 "arguments": _arguments(tc.function.arguments)}}
                                   for tc in m.tool_calls]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name:
                d["name"] = m.name
        out.append(d)
    return out


def _arguments(args: str | dict) -> dict | str:
    # The template renders a mapping as arg_key/arg_value pairs; unparseable JSON is rendered verbatim.
    if isinstance(args, dict):
        return args
    try:
        parsed = json.loads(args) if args.strip() else {}
    except ValueError:
        return args
    return parsed if isinstance(parsed, dict) else args


@dataclass
class ChatPrompt:
    """Everything the chat route decides before generating; /tokenize returns the same prompt."""

    prompt: Prompt
    ids: list[int]
    tools: list[dict]
    parse_tools: bool
    named: str | None  # a named tool_choice
    grammar: str | None
    history: str = ""  # the identity of the conversation before the reply (chat_prompt.history_keys)
    images: list[PromptImage] = field(default_factory=list)  # the prompt's images, in order


def _tool_choice(req: ChatFields, tools: list[dict]) -> tuple[str, str | None]:
    choice = req.tool_choice
    if choice is not None and choice not in ("none", "auto") and not tools:
        raise bad_request("tool_choice needs tools.", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names {named!r}, which is not in tools.", param="tool_choice")
        return "named", named
    return (choice or "auto"), None


def build_chat_prompt(state: ServerState, req: ChatFields, *, add_generation_prompt: bool = True,
                      response_format: Any = None, parallel: bool = True) -> ChatPrompt:
    """Render and tokenize (blocking: call it in a worker thread, never on the event loop)."""
    engine = state.engine
    kwargs = req.chat_template_kwargs or {}
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    check_tool_schemas(tools)
    choice, named = _tool_choice(req, tools)
    forced = choice in ("named", "required")
    thinking = resolve_thinking(kwargs, req.reasoning_effort, req.max_reasoning_tokens, state.reasoning_effort,
                                state.reasoning_budget)
    if forced:
        # A forced call comes first: reasoning before it could end the turn (an end-of-turn token sampled inside
        # the think block, where no grammar applies) without the call the client demanded.
        thinking = Thinking(False, thinking.effort, thinking.budget)
    shown_tools = tools if tools and choice != "none" else None
    refs: list[ImageRef] = []
    sent = template_messages(req.messages or [], refs)
    decoded = load_images(state, refs)
    shown = image_digests(refs)
    messages = reattach(sent, state.reasoning_memory, shown)
    template_kwargs = {**kwargs, "enable_thinking": thinking.on}
    if thinking.on or "reasoning_effort" not in kwargs:
        template_kwargs["reasoning_effort"] = thinking.effort
    try:
        text = engine.apply_chat_template(messages, shown_tools, thinking.on, add_generation_prompt, template_kwargs)
    except Exception as exc:  # jinja2 errors: a message sequence the template cannot render
        raise bad_request(f"The messages could not be rendered with the chat template: {exc}",
                          param="messages") from None
    answer = grammar_for(engine, response_format)
    grammar = answer
    use_grammar = getattr(engine, "supports_grammar", False) and tools and add_generation_prompt
    if use_grammar:
        grammar = tool_call_grammar(tools, engine.token_id, choice=choice, named=named, parallel=parallel,
                                    answer=answer)
    prompt = finish_prompt(text, thinking, force_call=forced and not use_grammar and add_generation_prompt,
                           named=named)
    ids = tokenize_prompt(state, prompt.text)
    placed: list[PromptImage] = []
    if decoded:
        ids, placed = images.expand(ids, decoded, engine.vision, "messages")
    return ChatPrompt(prompt, ids, tools, bool(shown_tools), named, grammar, history_keys(sent, shown)[-1], placed)


def load_images(state: ServerState, refs: list[ImageRef]) -> list[images.DecodedImage]:
    """The request's images read and decoded, each checked; none needs the engine's vision tower."""
    if not refs:
        return []
    if getattr(state.engine, "vision", None) is None:
        raise images.unavailable(state.engine, refs[0].param)
    limits = images.ImageLimits.of(state.settings)
    images.check_count(refs, limits)
    return [images.load(ref, limits) for ref in refs]


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another wire format (Anthropic Messages, Responses) translates into: every format
    runs the chat route's one path from here on. What the chat model refuses is a 400 naming the field."""
    try:
        req = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise bad_request(f"Invalid request: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    _keep_origins(req, fields)
    return req


ORIGIN = "origin"  # a translated part's key naming its field in the request as sent (chat's model ignores it)


def _keep_origins(req: ChatCompletionRequest, fields: dict[str, Any]) -> None:
    """Each translated part's origin onto its validated part, so its errors name the client's own field."""
    for msg, sent in zip(req.messages or [], fields.get("messages") or [], strict=False):
        parts = sent.get("content") if isinstance(sent, dict) else None
        if isinstance(msg.content, list) and isinstance(parts, list):
            for part, raw in zip(msg.content, parts, strict=False):
                if isinstance(raw, dict) and isinstance(raw.get(ORIGIN), str):
                    part._origin = raw[ORIGIN]


@dataclass
class PreparedChat:
    """A chat request checked, rendered and started: every choice's sampling and its engine run, before any reply
    is written (so a refusal is still an HTTP error, not a broken stream)."""

    req: ChatCompletionRequest
    chat: ChatPrompt
    param_types: dict[str, dict[str, str]]
    params: list[SamplingParams]
    logprobs: bool
    runs: list[tuple[str, Tally, AsyncIterator[EngineEvent]]] = field(default_factory=list)


async def prepare_chat(state: ServerState, req: ChatCompletionRequest, live: LiveRequest) -> PreparedChat:
    check_model(state, req.model)
    check_unsupported(req)
    check_ready(state)
    engine = state.engine
    if req.n > 1 and req.tool_choice not in (None, "auto", "none"):
        raise bad_request("n > 1 is not supported together with a forced tool_choice.", param="n")
    check_capacity(state, req.n, "n")
    # Rendering and tokenizing a long prompt takes a while; keep the event loop free for running streams.
    chat = await asyncio.to_thread(build_chat_prompt, state, req, response_format=req.response_format,
                                   parallel=req.parallel_tool_calls is not False)
    prompt_ids = chat.ids
    live.prompt_tokens = len(prompt_ids)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), engine.context_length)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    budget = chat.prompt.thinking.budget
    end_ids = None
    if chat.prompt.start_in_reasoning and budget is not None:
        end_ids = await asyncio.to_thread(engine.tokenize, THINK_CLOSE + state.layout().after_think, False)
    params = []
    for i in range(req.n):
        p = sampling_params(req, engine, max_tokens=max_tokens, index=i, logprobs=logprobs, grammar=chat.grammar)
        if end_ids is not None:
            p.reasoning_budget = budget
            p.reasoning_end_ids = list(end_ids)
        params.append(p)
    prep = PreparedChat(req, chat, tool_param_types(chat.tools), params, req.logprobs)
    live.image_tokens = [im.tokens for im in chat.images]
    prep.runs = await open_runs(engine, prompt_ids, params, live, chat.images)
    return prep


@dataclass
class ChoiceEvent:
    index: int
    delta: Delta
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    stop_sequence: str | None = None


async def run_choice(state: ServerState, prep: PreparedChat, live: LiveRequest,
                     index: int) -> AsyncIterator[ChoiceEvent]:
    rid, tally, events = prep.runs[index]
    chat = prep.chat
    parser = ChatStreamParser(start_in_reasoning=chat.prompt.start_in_reasoning, parse_tools=chat.parse_tools,
                              param_types=prep.param_types)
    whole = Delta()  # the turn as the client gets it, remembered with its reasoning
    if chat.prompt.stuffed_tool:
        first = parser.begin_tool_call(chat.named)
        if first:
            whole.extend(first)
            yield ChoiceEvent(index, first, [], None)
    emissions = choice_emissions(state.engine, events, rid, frozenset(prep.params[index].stop_token_ids),
                                 prep.req.stop, tally, state.stop_error)
    try:
        async for em in emissions:
            if parser.in_reasoning:
                tally.reasoning_tokens += em.tokens
            delta = parser.feed(em.text) if em.text else Delta()
            reason = em.finish_reason
            if reason:
                # Cut off by max_tokens: a call keeps the arguments as generated (no invented closing).
                delta.extend(parser.finish(truncated=reason == "length"))
                if reason == "stop" and parser.tool_calls_seen:
                    reason = "tool_calls"
            whole.extend(delta)
            if reason:
                calls = merge_tool_calls(whole.tool_calls)
                state.reasoning_memory.remember(whole.content if whole.content or not calls else None, calls,
                                                whole.reasoning, chat.history)
            if delta or em.logprobs or reason:
                yield ChoiceEvent(index, delta, em.logprobs, reason, em.stop_sequence)
    finally:
        await emissions.aclose()


def _logprobs_json(items: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
             "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top]}
            for lp in items]


def _delta_json(delta: Delta) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if delta.reasoning:
        d["reasoning_content"] = delta.reasoning
    if delta.content:
        d["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for tc in delta.tool_calls:
            c: dict[str, Any] = {"index": tc.index}
            if tc.id:
                c["id"] = tc.id
                c["type"] = "function"
            fn: dict[str, Any] = {}
            if tc.name is not None:
                fn["name"] = tc.name
            fn["arguments"] = tc.arguments
            c["function"] = fn
            calls.append(c)
        d["tool_calls"] = calls
    return d


def _events(state: ServerState, prep: PreparedChat, live: LiveRequest) -> AsyncIterator[ChoiceEvent]:
    if prep.req.n == 1:
        return run_choice(state, prep, live, 0)
    return merge([run_choice(state, prep, live, i) for i in range(prep.req.n)])


async def stream_frames(state: ServerState, prep: PreparedChat, live: LiveRequest) -> AsyncIterator[bytes]:
    include_usage = stream_usage_requested(prep.req)
    head = {"id": live.id, "object": "chat.completion.chunk", "created": live.created, "model": state.model_id}
    if include_usage:
        head["usage"] = None
    events = with_keepalive(_events(state, prep, live), state.ping_interval)
    try:
        for i in range(prep.req.n):
            yield frame({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]})
        async for ev in events:
            if ev is PING:
                yield PING_FRAME
                continue
            choice = {"index": ev.index, "delta": _delta_json(ev.delta),
                      "logprobs": {"content": _logprobs_json(ev.logprobs)} if prep.logprobs and ev.logprobs else None,
                      "finish_reason": ev.finish_reason}
            yield frame({**head, "choices": [choice]})
        if include_usage:
            yield frame({**head, "choices": [], "usage": live.usage()})
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band, then [DONE]
        yield frame(error_frame_body(exc))
    finally:
        await events.aclose()
        live.finish()
    yield DONE_FRAME


async def _collect(state: ServerState, prep: PreparedChat, live: LiveRequest) -> dict[str, Any]:
    n = prep.req.n
    acc = [Delta() for _ in range(n)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    events = _events(state, prep, live)
    try:
        async for ev in events:
            acc[ev.index].extend(ev.delta)
            lps[ev.index].extend(ev.logprobs)
            if ev.finish_reason:
                reasons[ev.index] = ev.finish_reason
    finally:
        await events.aclose()
        live.finish()
    choices = []
    for i in range(n):
        calls = merge_tool_calls(acc[i].tool_calls)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": acc[i].content if acc[i].content or not calls else None,
                                   "reasoning_content": acc[i].reasoning or None}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": _logprobs_json(lps[i])} if prep.logprobs else None,
                        "finish_reason": reasons[i]})
    return {"id": live.id, "object": "chat.completion", "created": live.created, "model": state.model_id,
            "choices": choices, "usage": live.usage()}


async def chat_completions(state: ServerState, request: Request, req: ChatCompletionRequest) -> Response:
    live = LiveRequest(state, "chatcmpl")
    prep = await prepare_chat(state, req, live)
    return await respond(request, live, bool(req.stream), lambda: stream_frames(state, prep, live),
                         lambda: _collect(state, prep, live))
