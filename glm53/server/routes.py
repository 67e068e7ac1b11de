"""The HTTP routes, one APIRouter per API, in the order the app serves and documents them (ROUTERS). Each handler
reaches the server's state (engine, settings, metrics) through the `State` dependency, which reads it from the app
(`app.state.glm53`, set by create_app): the routes hold no state of their own, so one module serves every app."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from glm53.server import anthropic_api, chat_api, completions_api, responses_api
from glm53.server.common import ServerState, check_model, check_ready, check_token_ids, tokenize_prompt
from glm53.server.errors import APIError, bad_request
from glm53.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest


async def server_state(request: Request) -> ServerState:
    # async: FastAPI runs a plain def dependency in its thread pool, a hop per request for an attribute read.
    return request.app.state.glm53


State = Annotated[ServerState, Depends(server_state)]
GET_HEAD = ["GET", "HEAD"]  # the start-up probes, out of the schema


def get_and_head(router: APIRouter, path: str, **kw: Any) -> Any:
    """A GET route that answers HEAD as well (the status and headers alone: monitors and launchers probe with
    it). The HEAD twin stays out of the schema, where it would repeat the GET's operation id."""

    def register(fn: Any) -> Any:
        router.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False)
        return router.get(path, **kw)(fn)

    return register


# ------------------------------------------------------------------------------------------------ probes

probes = APIRouter()


@probes.api_route("/", methods=GET_HEAD, include_in_schema=False)
@probes.api_route("/api/hello", methods=GET_HEAD, include_in_schema=False)
async def hello() -> dict[str, str]:
    """What clients probe before their first request (Claude Code: HEAD /api/hello): the server answers."""
    return {"status": "ok", "api": "/v1"}


@get_and_head(probes, "/health", tags=["ops"])
async def health(state: State) -> dict[str, str]:
    """Liveness: the process answers (the model may still be loading); 503 once the load failed, which no
    waiting mends."""
    if state.load_error:
        check_ready(state)
    return {"status": "ok"}


@get_and_head(probes, "/ready", tags=["ops"])
async def ready(state: State) -> dict[str, str]:
    """Readiness: 200 once the model is loaded, 503 before, and 503 while a tier reports a fault (a store
    record that cannot be read: requests that need it fail with the record named, the rest are served)."""
    check_ready(state)
    fault = state.engine.fault()
    if fault is not None:
        raise APIError(503, f"The expert store reports a fault: {json.dumps(fault)}. Check the disk, then run "
                            "`glm53 verify-store` on it (pack-store rebuilds a damaged store).", code="store_fault")
    return {"status": "ready", "model": state.model_id}


# ------------------------------------------------------------------------------------------------ OpenAI

openai = APIRouter(tags=["openai"])


def model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": int(state.metrics.started), "owned_by": "glm53",
            "max_model_len": state.engine.context_length}


@get_and_head(openai, "/v1/models")
async def list_models(state: State) -> dict[str, Any]:
    # Launchers treat a 200 here as "ready": answer 503 until the model can generate.
    check_ready(state)
    return {"object": "list", "data": [model_card(state)]}


@get_and_head(openai, "/v1/models/{model}")
async def get_model(model: str, state: State) -> dict[str, Any]:
    check_model(state, model)
    return model_card(state)


@openai.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest, state: State) -> Response:
    return await chat_api.chat_completions(state, request, body)


@openai.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest, state: State) -> Response:
    return await completions_api.completions(state, request, body)


# ------------------------------------------------------------------------------------------------ Anthropic

anthropic = APIRouter(tags=["anthropic"])


@anthropic.post("/v1/messages")
async def messages(request: Request, body: anthropic_api.MessagesRequest, state: State) -> Response:
    """Anthropic's Messages API (Claude Code, the anthropic SDK): see docs/clients.md."""
    return await anthropic_api.messages(state, request, body)


@anthropic.post("/v1/messages/count_tokens")
async def count_tokens(body: anthropic_api.CountTokensRequest, state: State) -> dict[str, int]:
    return await anthropic_api.count_tokens(state, body)


# ------------------------------------------------------------------------------------------------ OpenAI Responses

openai_responses = APIRouter(tags=["openai"])


@openai_responses.post("/v1/responses")
async def responses(request: Request, body: responses_api.ResponsesRequest, state: State) -> Response:
    """OpenAI's Responses API, without stored state (store and previous_response_id are refused)."""
    return await responses_api.responses(state, request, body)


# ------------------------------------------------------------------------------------------------ extras

extras = APIRouter(tags=["extras"])


@extras.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: State) -> dict[str, Any]:
    """Token ids of a raw `prompt`, or of `messages` rendered with the chat template."""
    check_model(state, body.model)
    check_ready(state)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Give exactly one of prompt or messages.", param="prompt")
    if body.prompt is not None:
        ids = await asyncio.to_thread(tokenize_prompt, state, body.prompt, body.add_special_tokens, "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.context_length}
    # The prompt the chat route would run for the same fields, every server change included (a closed
    # think block, re-attached reasoning, an opened forced call).
    chat = await asyncio.to_thread(chat_api.build_chat_prompt, state, body,
                                   add_generation_prompt=body.add_generation_prompt)
    out = {"tokens": chat.ids, "count": len(chat.ids), "max_model_len": state.engine.context_length,
           "prompt": chat.prompt.text}
    if chat.images:  # counted in `count`; per image, in the order sent
        out["image_tokens_per_image"] = [im.tokens for im in chat.images]
    return out


@extras.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> dict[str, Any]:
    check_model(state, body.model)
    check_ready(state)
    check_token_ids(state, body.tokens, "tokens")
    return {"prompt": state.engine.detokenize(body.tokens)}


# ------------------------------------------------------------------------------------------------ monitoring

monitoring = APIRouter(tags=["ops"])


@get_and_head(monitoring, "/metrics")
async def prometheus(state: State) -> Response:
    data, content_type = state.metrics.render()
    return Response(data, media_type=content_type)


@get_and_head(monitoring, "/stats")
async def stats(state: State) -> dict[str, Any]:
    """engine.stats() plus the server's own counters under "server"."""
    engine = state.engine
    try:
        engine_stats = engine.stats()
    except Exception as exc:  # noqa: BLE001 - stats must answer while the engine is mid-load
        engine_stats = {"error": str(exc)}
    return {**engine_stats, "ready": engine.ready, "model": state.model_id, "engine": engine.kind,
            "server": state.metrics.server_stats()}


ROUTERS = (probes, openai, anthropic, openai_responses, extras, monitoring)
