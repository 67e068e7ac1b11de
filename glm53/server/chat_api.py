"""POST /v1/chat/completions: messages -> GLM prompt -> choices with reasoning, content and tool calls."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from glm53.engine.interface import EngineEvent, SamplingParams
from glm53.server.chat import (
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_OPEN,
    ChatStreamParser,
    Delta,
    merge_tool_calls,
    tool_param_types,
)
from glm53.server.common import (
    Job,
    ServerState,
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
)
from glm53.server.errors import bad_request
from glm53.server.generation import Tally, TokenLogprob, choice_steps
from glm53.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from glm53.server.sse import DONE_FRAME, PING, PING_FRAME, frame, merge, with_keepalive


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> the dicts the GLM chat template reads. Prior reasoning (either field name) and tool
    calls are kept so multi-turn agent loops render as the model saw them."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            texts = []
            for part in m.content:
                if part.type not in ("text", "input_text") or part.text is None:
                    raise bad_request(f"messages[{i}].content: only text parts are supported (got {part.type!r}).",
                                      param=f"messages.{i}.content")
                texts.append(part.text)
            content = "".join(texts)
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
class ChatPlan:
    req: ChatCompletionRequest
    prompt_ids: list[int]
    start_in_reasoning: bool
    parse_tools: bool
    forced_tool: str | None  # a named tool_choice
    force_any_tool: bool  # tool_choice "required"
    param_types: dict[str, dict[str, str]]
    params: list[SamplingParams]
    logprobs: bool
    runs: list[tuple[str, Tally, AsyncIterator[EngineEvent]]] = field(default_factory=list)


def _build_prompt(state: ServerState, req: ChatCompletionRequest) -> tuple[str, bool, str | None, bool]:
    engine = state.engine
    kwargs = req.chat_template_kwargs or {}
    enable_thinking = bool(kwargs.get("enable_thinking", kwargs.get("thinking", True)))
    choice = req.tool_choice
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    if choice is not None and choice != "none" and choice != "auto" and not tools:
        raise bad_request("tool_choice needs tools.", param="tool_choice")
    named = None
    if isinstance(choice, NamedToolChoice):
        named = choice.function.name
        if named not in {t["function"]["name"] for t in tools}:
            raise bad_request(f"tool_choice names {named!r}, which is not in tools.", param="tool_choice")
    forced = named is not None or choice == "required"
    if forced:
        # Forcing a call by ending the prompt inside one: thinking would have to come first, so it is off.
        enable_thinking = False
    shown_tools = tools if tools and choice != "none" else None
    messages = template_messages(req.messages)
    try:
        text = engine.apply_chat_template(messages, shown_tools, enable_thinking)
    except Exception as exc:  # jinja2 errors: a message sequence the template cannot render
        raise bad_request(f"The messages could not be rendered with the chat template: {exc}",
                          param="messages") from None
    if forced:
        text += TOOL_CALL_OPEN + (f"{named}\n" if named else "")
    return text, bool(shown_tools), named, choice == "required"


async def plan_chat(state: ServerState, req: ChatCompletionRequest, job: Job) -> ChatPlan:
    check_model(state, req.model)
    check_unsupported(req)
    check_ready(state)
    engine = state.engine
    if req.n > 1 and req.tool_choice not in (None, "auto", "none"):
        raise bad_request("n > 1 is not supported together with a forced tool_choice.", param="n")
    grammar = grammar_for(engine, req.response_format)
    # Rendering and tokenizing a long prompt takes a while; keep the event loop free for running streams.
    text, parse_tools, named, required = await asyncio.to_thread(_build_prompt, state, req)
    prompt_ids = await asyncio.to_thread(engine.tokenize, text, False)
    job.prompt_tokens = len(prompt_ids)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), engine.context_length)
    start_in_reasoning = text.rstrip().endswith(THINK_OPEN)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = []
    for i in range(req.n):
        p = sampling_params(req, engine, max_tokens=max_tokens, index=i, logprobs=logprobs, grammar=grammar)
        if start_in_reasoning and state.reasoning_budget > 0:
            p.reasoning_budget = state.reasoning_budget
            p.reasoning_end_ids = engine.tokenize(THINK_CLOSE + "\n", False)
        params.append(p)
    plan = ChatPlan(req, prompt_ids, start_in_reasoning, parse_tools, named, required,
                    tool_param_types([t.model_dump() for t in req.tools or []]), params, req.logprobs)
    plan.runs = await open_runs(engine, prompt_ids, params, job)
    return plan


@dataclass
class ChoiceEvent:
    index: int
    delta: Delta
    logprobs: list[TokenLogprob]
    finish_reason: str | None


async def run_choice(state: ServerState, plan: ChatPlan, job: Job, index: int) -> AsyncIterator[ChoiceEvent]:
    rid, tally, events = plan.runs[index]
    parser = ChatStreamParser(start_in_reasoning=plan.start_in_reasoning, parse_tools=plan.parse_tools,
                              param_types=plan.param_types)
    if plan.forced_tool or plan.force_any_tool:
        first = parser.begin_tool_call(plan.forced_tool)
        if first:
            yield ChoiceEvent(index, first, [], None)
    steps = choice_steps(state.engine, events, rid, frozenset(plan.params[index].stop_token_ids), plan.req.stop, tally)
    try:
        async for step in steps:
            delta = parser.feed(step.text) if step.text else Delta()
            reason = step.finish_reason
            if reason:
                delta.extend(parser.finish())
                if reason == "stop" and parser.tool_calls_seen:
                    reason = "tool_calls"
            if delta or step.logprobs or reason:
                yield ChoiceEvent(index, delta, step.logprobs, reason)
    finally:
        await steps.aclose()


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


def _events(state: ServerState, plan: ChatPlan, job: Job) -> AsyncIterator[ChoiceEvent]:
    if plan.req.n == 1:
        return run_choice(state, plan, job, 0)
    return merge([run_choice(state, plan, job, i) for i in range(plan.req.n)])


async def stream_frames(state: ServerState, plan: ChatPlan, job: Job) -> AsyncIterator[bytes]:
    include_usage = stream_usage_requested(plan.req)
    head = {"id": job.id, "object": "chat.completion.chunk", "created": job.created, "model": state.model_id}
    if include_usage:
        head["usage"] = None
    events = with_keepalive(_events(state, plan, job), state.ping_interval)
    try:
        for i in range(plan.req.n):
            yield frame({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}]})
        async for ev in events:
            if ev is PING:
                yield PING_FRAME
                continue
            choice = {"index": ev.index, "delta": _delta_json(ev.delta),
                      "logprobs": {"content": _logprobs_json(ev.logprobs)} if plan.logprobs and ev.logprobs else None,
                      "finish_reason": ev.finish_reason}
            yield frame({**head, "choices": [choice]})
        if include_usage:
            yield frame({**head, "choices": [], "usage": job.usage()})
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band, then [DONE]
        yield frame(error_frame_body(exc))
    finally:
        await events.aclose()
        job.finish()
    yield DONE_FRAME


async def _collect(state: ServerState, plan: ChatPlan, job: Job) -> dict[str, Any]:
    n = plan.req.n
    acc = [Delta() for _ in range(n)]
    lps: list[list[TokenLogprob]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    events = _events(state, plan, job)
    try:
        async for ev in events:
            acc[ev.index].extend(ev.delta)
            lps[ev.index].extend(ev.logprobs)
            if ev.finish_reason:
                reasons[ev.index] = ev.finish_reason
    finally:
        await events.aclose()
        job.finish()
    choices = []
    for i in range(n):
        calls = merge_tool_calls(acc[i].tool_calls)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": acc[i].content if acc[i].content or not calls else None,
                                   "reasoning_content": acc[i].reasoning or None}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": _logprobs_json(lps[i])} if plan.logprobs else None,
                        "finish_reason": reasons[i]})
    return {"id": job.id, "object": "chat.completion", "created": job.created, "model": state.model_id,
            "choices": choices, "usage": job.usage()}


async def chat_completions(state: ServerState, request: Request, req: ChatCompletionRequest) -> Response:
    job = Job(state, "chatcmpl")
    plan = await plan_chat(state, req, job)
    return await respond(request, job, bool(req.stream), lambda: stream_frames(state, plan, job),
                         lambda: _collect(state, plan, job))
