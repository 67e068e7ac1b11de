"""POST /v1/completions: raw prompt(s) -> text choices (the legacy OpenAI completions API)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from glm53.engine.interface import EngineEvent, SamplingParams
from glm53.server.common import (
    Job,
    ServerState,
    check_capacity,
    check_model,
    check_ready,
    check_token_ids,
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
from glm53.server.generation import Step, Tally, TokenLogprob, choice_steps
from glm53.server.protocol import CompletionRequest
from glm53.server.sse import DONE_FRAME, PING, PING_FRAME, frame, merge, with_keepalive


@dataclass
class Prompt:
    ids: list[int]
    text: str  # for echo


@dataclass
class CompletionPlan:
    req: CompletionRequest
    prompts: list[Prompt]
    params: list[SamplingParams]  # one per choice: prompt-major, n per prompt
    runs: list[tuple[str, Tally, AsyncIterator[EngineEvent]]] = field(default_factory=list)


def _prompts(state: ServerState, req: CompletionRequest) -> list[Prompt]:
    engine = state.engine
    p = req.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        raw = [p]  # type: ignore[list-item]
    else:
        raw = list(p)  # type: ignore[arg-type]
    if not raw:
        raise bad_request("prompt must not be empty.", param="prompt")
    out = []
    for item in raw:
        if isinstance(item, str):
            out.append(Prompt(tokenize_prompt(state, item, True, "prompt"), item))
            continue
        if not item:
            raise bad_request("A token-id prompt must not be empty.", param="prompt")
        check_token_ids(state, list(item), "prompt")
        out.append(Prompt(list(item), engine.detokenize(list(item))))
    return out


async def plan_completion(state: ServerState, req: CompletionRequest, job: Job) -> CompletionPlan:
    check_model(state, req.model)
    check_unsupported(req)
    check_ready(state)
    if req.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported by this model.", param="suffix",
                          code="unsupported_parameter")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of other than n is not supported.", param="best_of", code="unsupported_parameter")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which this server does not compute.",
                          param="echo", code="unsupported_parameter")
    engine = state.engine
    grammar = grammar_for(engine, req.response_format)
    prompts = await asyncio.to_thread(_prompts, state, req)
    if len(prompts) * req.n > 64:
        raise bad_request("At most 64 choices (prompts x n) per request.", param="n")
    check_capacity(state, len(prompts) * req.n, "prompt" if len(prompts) > 1 else "n")
    job.prompt_tokens = sum(len(p.ids) for p in prompts)
    params = []
    for p in prompts:
        max_tokens = resolve_max_tokens(req.max_tokens, len(p.ids), engine.context_length, "prompt")
        for i in range(req.n):
            params.append(sampling_params(req, engine, max_tokens=max_tokens, index=i, logprobs=req.logprobs,
                                          grammar=grammar))
    plan = CompletionPlan(req, prompts, params)
    per_choice = [prompts[i // req.n].ids for i in range(len(params))]
    plan.runs = await open_runs(engine, per_choice, params, job)
    return plan


async def _run(state: ServerState, plan: CompletionPlan, job: Job, index: int) -> AsyncIterator[tuple[int, Step]]:
    rid, tally, events = plan.runs[index]
    prompt = plan.prompts[index // plan.req.n]
    steps = choice_steps(state.engine, events, rid, frozenset(plan.params[index].stop_token_ids), plan.req.stop,
                         tally, state.stop_error)
    try:
        if plan.req.echo:
            yield index, Step(prompt.text)
        async for step in steps:
            yield index, step
    finally:
        await steps.aclose()


def _events(state: ServerState, plan: CompletionPlan, job: Job) -> AsyncIterator[tuple[int, Step]]:
    if len(plan.params) == 1:
        return _run(state, plan, job, 0)
    return merge([_run(state, plan, job, i) for i in range(len(plan.params))])


def _logprobs_json(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    tokens, lps, tops, offsets = [], [], [], []
    for lp in items:
        tokens.append(lp.token)
        lps.append(lp.logprob)
        tops.append(dict(lp.top))
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def stream_frames(state: ServerState, plan: CompletionPlan, job: Job) -> AsyncIterator[bytes]:
    include_usage = stream_usage_requested(plan.req)
    head = {"id": job.id, "object": "text_completion", "created": job.created, "model": state.model_id}
    if include_usage:
        head["usage"] = None
    offsets = [0] * len(plan.params)
    events = with_keepalive(_events(state, plan, job), state.ping_interval)
    try:
        async for ev in events:
            if ev is PING:
                yield PING_FRAME
                continue
            index, step = ev
            lp = None
            if plan.req.logprobs is not None:
                lp = _logprobs_json(step.logprobs, offsets[index])
            offsets[index] += len(step.text)
            yield frame({**head, "choices": [{"index": index, "text": step.text, "logprobs": lp,
                                              "finish_reason": step.finish_reason}]})
        if include_usage:
            yield frame({**head, "choices": [], "usage": job.usage()})
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band, then [DONE]
        yield frame(error_frame_body(exc))
    finally:
        await events.aclose()
        job.finish()
    yield DONE_FRAME


async def _collect(state: ServerState, plan: CompletionPlan, job: Job) -> dict[str, Any]:
    count = len(plan.params)
    texts = [""] * count
    lps: list[list[TokenLogprob]] = [[] for _ in range(count)]
    reasons: list[str | None] = [None] * count
    events = _events(state, plan, job)
    try:
        async for index, step in events:
            texts[index] += step.text
            lps[index].extend(step.logprobs)
            if step.finish_reason:
                reasons[index] = step.finish_reason
    finally:
        await events.aclose()
        job.finish()
    choices = [{"index": i, "text": texts[i],
                "logprobs": _logprobs_json(lps[i], 0) if plan.req.logprobs is not None else None,
                "finish_reason": reasons[i]} for i in range(count)]
    return {"id": job.id, "object": "text_completion", "created": job.created, "model": state.model_id,
            "choices": choices, "usage": job.usage()}


async def completions(state: ServerState, request: Request, req: CompletionRequest) -> Response:
    job = Job(state, "cmpl")
    plan = await plan_completion(state, req, job)
    return await respond(request, job, bool(req.stream), lambda: stream_frames(state, plan, job),
                         lambda: _collect(state, plan, job))
