"""POST /v1/responses: OpenAI's Responses API (what Codex-style CLIs send), non-stateful: translated into the
chat route's request and run through the same path (chat_api.prepare_chat and run_choice).

The server keeps no responses: `store: true` and `previous_response_id` are refused, so a client sends the
whole conversation as input items each turn (reasoning items included, or the server re-attaches the
reasoning it generated, as for chat).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, StrictBool, StrictInt

from glm53.server.blocks import Block, BlockEvent, BlockSequence
from glm53.server.chat_api import ORIGIN, PreparedChat, chat_request, prepare_chat, run_choice
from glm53.server.common import LiveRequest, ServerState, error_frame_body, respond
from glm53.server.errors import bad_request
from glm53.server.protocol import SEED_MAX, SEED_MIN, ReasoningEffort, _Model
from glm53.server.sse import PING, PING_FRAME, event_frame, with_keepalive

log = logging.getLogger("glm53.server")

# A tool inside a `namespace` tool is shown to the model as "namespace.tool"; its calls go back to the client as
# the bare name with the namespace beside it, as OpenAI's function_call items carry them.
NAMESPACE_SEP = "."
# History items of tools that run on OpenAI's side (or that this server never offers): nothing to replay.
_SKIPPED_ITEMS = frozenset({"web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call",
                            "computer_call", "computer_call_output", "mcp_list_tools", "mcp_approval_request",
                            "mcp_approval_response", "mcp_call", "item_reference", "compaction"})


class Part(_Model):
    type: str
    text: str | None = None
    image_url: str | None = None  # input_image: a data URL, or http(s) where the server fetches
    file_id: str | None = None  # input_image from OpenAI's files API, which this server does not have
    detail: str | None = None


class InputItem(_Model):
    type: str | None = None  # "message" when only a role is given
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None
    summary: list[Part] | None = None
    namespace: str | None = None


class FunctionTool(_Model):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[FunctionTool] | None = None  # a namespace's own tools


class NamedFunction(_Model):
    type: Literal["function"]
    name: str


class Reasoning(_Model):
    effort: ReasoningEffort | Literal["xhigh"] | None = None
    summary: str | None = None


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class TextConfig(_Model):
    format: TextFormat | None = None


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None  # an extension: reproducible sampling


_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    out = []
    for j, p in enumerate(content):
        if p.type not in _TEXT_PARTS or p.text is None:
            raise bad_request(f"{where}.{j}: only text parts are supported (got {p.type!r}).", param=f"{where}.{j}")
        out.append(p.text)
    return "".join(out)


def _image_part(p: Part, where: str) -> dict[str, Any]:
    if not p.image_url:
        why = " (file_id names a file of OpenAI's files API, which this server does not have)" if p.file_id else ""
        raise bad_request(f"{where}: an input_image needs image_url{why}: send the image as a data URL "
                          "(data:image/png;base64,...).", param=where)
    return {"type": "image_url", "image_url": {"url": p.image_url}, ORIGIN: where}


def _content(content: str | list[Part] | None, where: str) -> str | list[dict[str, Any]]:
    """A user, system or tool item's content: its text, or chat parts where it holds images."""
    if content is None or isinstance(content, str) or all(p.type != "input_image" for p in content):
        return _text(content, where)
    parts = []
    for j, p in enumerate(content):
        if p.type == "input_image":
            parts.append(_image_part(p, f"{where}.{j}"))
        elif p.type in _TEXT_PARTS and p.text is not None:
            parts.append({"type": "text", "text": p.text})
        else:
            raise bad_request(f"{where}.{j}: only text and input_image parts are supported (got {p.type!r}).",
                              param=f"{where}.{j}")
    return parts


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    reasoning: str | None = None  # a reasoning item belongs to the assistant turn that follows it

    def assistant_turn(content: str) -> dict[str, Any]:
        nonlocal reasoning
        turn: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            turn["reasoning_content"], reasoning = reasoning, None
        messages.append(turn)
        return turn

    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.type or "message"
        if kind == "message":
            if item.role is None:
                raise bad_request(f"{where}: a message item needs role.", param=f"{where}.role")
            if item.role == "assistant":
                assistant_turn(_text(item.content, f"{where}.content"))
            else:
                messages.append({"role": "system" if item.role == "developer" else item.role,
                                 "content": _content(item.content, f"{where}.content")})
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise bad_request(f"{where}: a function_call item needs call_id and name.", param=where)
            last = messages[-1] if messages and messages[-1]["role"] == "assistant" else assistant_turn("")
            last.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": qualified(item.namespace, item.name),
                                                                      "arguments": item.arguments or "{}"}})
        elif kind == "function_call_output":
            if not item.call_id:
                raise bad_request(f"{where}: a function_call_output item needs call_id.", param=f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _content(item.output, f"{where}.output")})
        elif kind == "reasoning":
            reasoning = _text(item.summary, f"{where}.summary") or _text(item.content, f"{where}.content")
        elif kind in _SKIPPED_ITEMS:
            log.debug("responses: %s item at %s left out", kind, where)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output and reasoning are).", param=f"{where}.type")
    return messages


def _function(t: FunctionTool, where: str, namespace: str | None = None) -> dict[str, Any]:
    if not t.name:
        raise bad_request(f"{where}: a function tool needs a name.", param=f"{where}.name")
    return {"type": "function", "function": {"name": qualified(namespace, t.name), "description": t.description,
                                             "parameters": t.parameters, "strict": t.strict}}


def namespaces(req: ResponsesRequest) -> frozenset[str]:
    return frozenset(t.name for t in req.tools or [] if t.type == "namespace" and t.name)


def qualified(namespace: str | None, name: str) -> str:
    """The name the model sees for a client's tool (split_name undoes it)."""
    return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name


def split_name(name: str, spaces: frozenset[str]) -> tuple[str | None, str]:
    """(namespace, tool) of a called name: the client's own names back."""
    head, sep, tail = name.partition(NAMESPACE_SEP)
    return (head, tail) if sep and head in spaces else (None, name)


def to_chat(req: ResponsesRequest) -> Any:
    if req.store:
        raise bad_request("store: true is not supported: this server keeps no responses. Send store: false (or "
                          "leave it out) and the whole conversation as input.", param="store",
                          code="unsupported_parameter")
    if req.previous_response_id is not None:
        raise bad_request("previous_response_id is not supported: this server keeps no responses. Send the "
                          "conversation so far as input items instead.", param="previous_response_id",
                          code="unsupported_parameter")
    tools, left_out = [], []
    for i, t in enumerate(req.tools or []):
        if t.type == "function":
            tools.append(_function(t, f"tools.{i}"))
        elif t.type == "namespace":
            if not t.name or not t.tools:
                raise bad_request(f"tools.{i}: a namespace tool needs name and tools.", param=f"tools.{i}")
            for j, inner in enumerate(t.tools):
                if inner.type != "function":
                    left_out.append(f"{qualified(t.name, inner.name or '')} ({inner.type})")
                    continue
                tools.append(_function(inner, f"tools.{i}.tools.{j}", namespace=t.name))
        else:  # hosted tools (web_search, file_search, computer use...) and freeform ones run elsewhere
            left_out.append(t.name or t.type)
    if left_out:
        log.info("responses: tools this server cannot run left out of the prompt: %s", ", ".join(left_out))
    choice: Any = req.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    effort = req.reasoning.effort if req.reasoning else None
    fmt = req.text.format if req.text else None
    response_format = None if fmt is None else {"type": fmt.type, "json_schema": {"name": fmt.name or "response",
                                                                                  "schema": fmt.schema_}}
    return chat_request({"response_format": response_format,"messages": _messages(req), "tools": tools or None, "tool_choice": choice,
                         "parallel_tool_calls": req.parallel_tool_calls, "max_tokens": req.max_output_tokens,
                         "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
                         "reasoning_effort": "max" if effort == "xhigh" else effort})


# -- replies ---------------------------------------------------------------------------------------------------


def usage(live: LiveRequest) -> dict[str, Any]:
    u = live.usage()
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"], "output_tokens_details": u["completion_tokens_details"],
            "total_tokens": u["total_tokens"]}


class Reply:
    """One response's state: its id, its items' ids and the envelope every lifecycle event carries."""

    def __init__(self, state: ServerState, req: ResponsesRequest, live: LiveRequest) -> None:
        self.state, self.req, self.live = state, req, live
        self.id = "resp_" + uuid.uuid4().hex
        self.seq = 0
        self.reason: str | None = None
        self.spaces = namespaces(req)

    def item_id(self, block: Block) -> str:
        prefix = {"thinking": "rs", "text": "msg", "tool": "fc"}[block.kind]
        return f"{prefix}_{self.id[5:]}_{block.index}"

    def item(self, block: Block, done: bool) -> dict[str, Any]:
        status = "completed" if done else "in_progress"
        if block.kind == "thinking":
            return {"type": "reasoning", "id": self.item_id(block), "status": status,
                    "summary": [{"type": "summary_text", "text": block.text}] if done else []}
        if block.kind == "text":
            return {"type": "message", "id": self.item_id(block), "status": status, "role": "assistant",
                    "content": [_output_text(block.text)] if done else []}
        namespace, name = split_name(block.name or "", self.spaces)
        item = {"type": "function_call", "id": self.item_id(block), "status": status, "call_id": block.call_id,
                "name": name, "arguments": block.text if done else ""}
        if namespace is not None:
            item["namespace"] = namespace
        return item

    def body(self, output: list[dict], status: str) -> dict[str, Any]:
        req = self.req
        incomplete = status == "completed" and self.reason == "length"
        if incomplete:
            status = "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.live.created, "status": status,
                "model": self.state.model_id, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
                "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
                "store": False, "temperature": req.temperature, "top_p": req.top_p,
                "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                else req.tool_choice.model_dump(),
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
                "text": req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {"format": {"type": "text"}},
                "truncation": "disabled", "metadata": req.metadata or {},
                "usage": usage(self.live) if status != "in_progress" else None}

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return event_frame(kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def block_frames(self, ev: BlockEvent) -> list[bytes]:
        b = ev.block
        at = {"item_id": self.item_id(b), "output_index": b.index}
        if ev.type == "start":
            out = [self.event("response.output_item.added", output_index=b.index, item=self.item(b, False))]
            if b.kind == "thinking":
                out.append(self.event("response.reasoning_summary_part.added", **at, summary_index=0,
                                      part={"type": "summary_text", "text": ""}))
            elif b.kind == "text":
                out.append(self.event("response.content_part.added", **at, content_index=0, part=_output_text("")))
            return out
        if ev.type == "delta":
            if b.kind == "thinking":
                return [self.event("response.reasoning_summary_text.delta", **at, summary_index=0, delta=ev.piece)]
            if b.kind == "text":
                return [self.event("response.output_text.delta", **at, content_index=0, delta=ev.piece, logprobs=[])]
            return [self.event("response.function_call_arguments.delta", **at, delta=ev.piece)]
        if b.kind == "thinking":
            out = [self.event("response.reasoning_summary_text.done", **at, summary_index=0, text=b.text),
                   self.event("response.reasoning_summary_part.done", **at, summary_index=0,
                              part={"type": "summary_text", "text": b.text})]
        elif b.kind == "text":
            out = [self.event("response.output_text.done", **at, content_index=0, text=b.text, logprobs=[]),
                   self.event("response.content_part.done", **at, content_index=0, part=_output_text(b.text))]
        else:
            out = [self.event("response.function_call_arguments.done", **at, name=split_name(b.name or "", self.spaces)[1],
                              arguments=b.text)]
        out.append(self.event("response.output_item.done", output_index=b.index, item=self.item(b, True)))
        return out


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def _collect(reply: Reply, prep: PreparedChat) -> dict[str, Any]:
    seq = BlockSequence()
    events = run_choice(reply.state, prep, reply.live, 0)
    try:
        async for ev in events:
            seq.feed(ev.delta)
            reply.reason = ev.finish_reason or reply.reason
    finally:
        await events.aclose()
        reply.live.finish()
    seq.finish()
    return reply.body([reply.item(b, True) for b in seq.blocks], "completed")


async def _stream(reply: Reply, prep: PreparedChat) -> AsyncIterator[bytes]:
    seq = BlockSequence()
    events = with_keepalive(run_choice(reply.state, prep, reply.live, 0), reply.state.ping_interval)
    try:
        yield reply.event("response.created", response=reply.body([], "in_progress"))
        yield reply.event("response.in_progress", response=reply.body([], "in_progress"))
        async for ev in events:
            if ev is PING:
                yield PING_FRAME
                continue
            for be in seq.feed(ev.delta):
                for chunk in reply.block_frames(be):
                    yield chunk
            reply.reason = ev.finish_reason or reply.reason
        for be in seq.finish():
            for chunk in reply.block_frames(be):
                yield chunk
        body = reply.body([reply.item(b, True) for b in seq.blocks], "completed")
        yield reply.event(f"response.{body['status']}", response=body)
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band
        err = error_frame_body(exc)["error"]
        yield reply.event("error", code=err["code"], message=err["message"], param=err["param"])
        failed = reply.body([reply.item(b, True) for b in seq.blocks], "failed")
        failed["error"] = {"code": err["code"] or "server_error", "message": err["message"]}
        yield reply.event("response.failed", response=failed)
    finally:
        await events.aclose()
        reply.live.finish()


async def responses(state: ServerState, request: Request, req: ResponsesRequest) -> Response:
    live = LiveRequest(state, "resp")
    prep = await prepare_chat(state, to_chat(req), live)
    reply = Reply(state, req, live)
    return await respond(request, live, req.stream, lambda: _stream(reply, prep), lambda: _collect(reply, prep))
