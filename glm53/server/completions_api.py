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
    LiveRequest,
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
from glm53.server.generation import Emission, Tally, TokenLogprob, choice_emissions
from glm53.server.protocol import CompletionRequest
from glm53.server.sse import DONE_FRAME, PING, PING_FRAME, frame, merge, with_keepalive


@dataclass
class CompletionPrompt:
    ids: list[int]
    text: str  # for echo


@dataclass
class PreparedCompletion:
    """A completion request checked, tokenized and started: every choice's sampling and its engine run, before any
    reply is written."""

    req: CompletionRequest
    prompts: list[CompletionPrompt]
    params: list[SamplingParams]  # one per choice: prompt-major, n per prompt
    runs: list[tuple[str, Tally, AsyncIterator[EngineEvent]]] = field(default_factory=list)


def _prompts(state: ServerState, req: CompletionRequest) -> list[CompletionPrompt]:
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
            out.append(CompletionPrompt(tokenize_prompt(state, item, True, "prompt"), item))
            continue
        if not item:
            raise bad_request("A token-id prompt must not be empty.", param="prompt")
        check_token_ids(state, list(item), "prompt")
        out.append(CompletionPrompt(list(item), engine.detokenize(list(item))))
    return out


async def prepare_completion(state: ServerState, req: CompletionRequest, live: LiveRequest) -> PreparedCompletion:
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
    live.prompt_tokens = sum(len(p.ids) for p in prompts)
    params = []
    for p in prompts:
        max_tokens = resolve_max_tokens(req.max_tokens, len(p.ids), engine.context_length, "prompt")
        for i in range(req.n):
            params.append(sampling_params(req, engine, max_tokens=max_tokens, index=i, logprobs=req.logprobs,
                                          grammar=grammar))
    prep = PreparedCompletion(req, prompts, params)
    per_choice = [prompts[i // req.n].ids for i in range(len(params))]
    prep.runs = await open_runs(engine, per_choice, params, live)
    return prep


async def _run(state: ServerState, prep: PreparedCompletion, live: LiveRequest,
               index: int) -> AsyncIterator[tuple[int, Emission]]:
    rid, tally, events = prep.runs[index]
    prompt = prep.prompts[index // prep.req.n]
    emissions = choice_emissions(state.engine, events, rid, frozenset(prep.params[index].stop_token_ids),
                                 prep.req.stop, tally, state.stop_error)
    try:
        if prep.req.echo:
            yield index, Emission(prompt.text)
        async for em in emissions:
            yield index, em
    finally:
        await emissions.aclose()


def _events(state: ServerState, prep: PreparedCompletion, live: LiveRequest) -> AsyncIterator[tuple[int, Emission]]:
    if len(prep.params) == 1:
        return _run(state, prep, live, 0)
    return merge([_run(state, prep, live, i) for i in range(len(prep.params))])


def _logprobs_json(items: list[TokenLogprob], offset: int) -> dict[str, Any]:
    tokens, lps, tops, offsets = [], [], [], []
    for lp in items:
        tokens.append(lp.token)
        lps.append(lp.logprob)
        tops.append(dict(lp.top))
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


async def stream_frames(state: ServerState, prep: PreparedCompletion, live: LiveRequest) -> AsyncIterator[bytes]:
    include_usage = stream_usage_requested(prep.req)
    head = {"id": live.id, "object": "text_completion", "created": live.created, "model": state.model_id}
    if include_usage:
        head["usage"] = None
    offsets = [0] * len(prep.params)
    events = with_keepalive(_events(state, prep, live), state.ping_interval)
    try:
        async for ev in events:
            if ev is PING:
                yield PING_FRAME
                continue
            index, em = ev
            lp = None
            if prep.req.logprobs is not None:
                lp = _logprobs_json(em.logprobs, offsets[index])
            offsets[index] += len(em.text)
            yield frame({**head, "choices": [{"index": index, "text": em.text, "logprobs": lp,
                                              "finish_reason": em.finish_reason}]})
        if include_usage:
            yield frame({**head, "choices": [], "usage": live.usage()})
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band, then [DONE]
        yield frame(error_frame_body(exc))
    finally:
        await events.aclose()
        live.finish()
    yield DONE_FRAME


async def _collect(state: ServerState, prep: PreparedCompletion, live: LiveRequest) -> dict[str, Any]:
    count = len(prep.params)
    texts = [""] * count
    lps: list[list[TokenLogprob]] = [[] for _ in range(count)]
    reasons: list[str | None] = [None] * count
    events = _events(state, prep, live)
    try:
        async for index, em in events:
            texts[index] += em.text
            lps[index].extend(em.logprobs)
            if em.finish_reason:
                reasons[index] = em.finish_reason
    finally:
        await events.aclose()
        live.finish()
    choices = [{"index": i, "text": texts[i],
                "logprobs": _logprobs_json(lps[i], 0) if prep.req.logprobs is not None else None,
                "finish_reason": reasons[i]} for i in range(count)]
    return {"id": live.id, "object": "text_completion", "created": live.created, "model": state.model_id,
            "choices": choices, "usage": live.usage()}


async def completions(state: ServerState, request: Request, req: CompletionRequest) -> Response:
    live = LiveRequest(state, "cmpl")
    prep = await prepare_completion(state, req, live)
    return await respond(request, live, bool(req.stream), lambda: stream_frames(state, prep, live),
                         lambda: _collect(state, prep, live))
