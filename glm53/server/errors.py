"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the handlers that make every
failure look like that (never FastAPI's 422 `{"detail": ...}`, never a 5xx for bad input: openai-python
retries 5xx, so a client error reported as one is retried for nothing)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from glm53.engine.interface import (
    ContextLengthExceeded,
    EngineError,
    EngineNotReady,
    EngineOutOfMemory,
    GrammarUnsupported,
    QueueFull,
)
from glm53.server.jsontext import JSONBody

log = logging.getLogger("glm53.server")

QUEUE_RETRY_AFTER_S = 2

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable",
          500: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.prompt_limit: tuple[int, int] | None = None  # (prompt tokens, the most a prompt may have): overflow

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's Messages routes answer in Anthropic's error shape (its SDK and Claude Code read error.type); every
# other route in OpenAI's.
ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_body(err: APIError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    message = err.message
    if err.prompt_limit is not None:  # Anthropic's wording, which Claude Code reads to compact the conversation
        tokens, most = err.prompt_limit
        message = f"prompt is too long: {tokens} tokens > {most} maximum"
    return {"type": "error", "error": {"type": kind, "message": message}}


def body_for(path: str, err: APIError) -> dict[str, Any]:
    """The error body in the shape the route's clients read."""
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return anthropic_body(err)
    return err.body()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def context_exceeded(prompt_tokens: int, context: int, param: str = "messages", at_least: bool = False) -> APIError:
    has = f"at least {prompt_tokens}" if at_least else f"{prompt_tokens}"
    err = APIError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                        f"{has} tokens (at least one token must be left for the reply).",
                   param=param, code="context_length_exceeded")
    err.prompt_limit = (prompt_tokens, context - 1)
    return err


def from_engine_error(exc: Exception) -> APIError:
    if isinstance(exc, ContextLengthExceeded):
        return context_exceeded(exc.prompt_tokens, exc.context_length)
    if isinstance(exc, EngineNotReady):
        return APIError(503, f"The model is not loaded: {exc}", code="model_not_ready")
    if isinstance(exc, QueueFull):
        # A slot frees when a running request ends: a few seconds at decode speed, so a short wait is honest.
        return APIError(429, f"The server is busy: {exc}.", code="rate_limit_exceeded",
                        headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)})
    if isinstance(exc, EngineOutOfMemory):
        # The request did nothing wrong and the server goes on: 503 (a retry may fit once others are done).
        return APIError(503, f"Out of memory: {exc}.", code="out_of_memory")
    if isinstance(exc, GrammarUnsupported):
        return bad_request(str(exc), param="response_format", code="unsupported_parameter")
    return APIError(500, f"Generation failed: {exc}", code="engine_error")


def json_error(err: APIError, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    return JSONBody(body_for(path, err), status_code=err.status, headers={**(err.headers or {}), **(headers or {})})


def _loc_param(loc: tuple) -> str | None:
    # loc is ("body", "messages", 0, "content") etc.; OpenAI's `param` is the dotted field path.
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}.", None
    param = _loc_param(tuple(first.get("loc", ())))
    if param is None and first.get("type") == "missing":
        return "The request body is empty: send a JSON object.", None
    if param is None:
        return "The request body must be a JSON object.", None
    msgs = []
    for e in errors[:5]:
        where = _loc_param(tuple(e.get("loc", ()))) or "body"
        msgs.append(f"{where}: {e.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "Invalid request: " + "; ".join(msgs) + more, param


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return json_error(exc, path=request.url.path)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        err = from_engine_error(exc)
        if err.status >= 500:
            log.error("engine error: %s", exc)
        return json_error(err, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return json_error(bad_request(message, param=param), path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            detail = "Unknown route. The API lives under /v1 (see /docs)."
        err = APIError(exc.status_code, detail, code=None)
        return json_error(err, headers=getattr(exc, "headers", None), path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not bad input: log it with the traceback and answer in the same shape.
        log.exception("unhandled error")
        return json_error(APIError(500, f"Internal server error: {type(exc).__name__}", code="internal_error"),
                          path=request.url.path)
