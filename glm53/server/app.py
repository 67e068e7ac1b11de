"""The FastAPI app: API key, request metrics, and loading the engine in the background; the routes are
glm53.server.routes.

The HTTP server comes up first so /health answers and /ready (and /v1/models) say 503 while the weights
load; "Application startup complete" and the ready line are logged once the model can actually answer,
which is what launchers that parse the log wait for.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glm53.engine.interface import Engine
from glm53.server import errors, routes
from glm53.server.asgi import drain, send_error
from glm53.server.browser import BrowserGuard, policy_for
from glm53.server.common import ServerState
from glm53.server.errors import APIError
from glm53.server.images import inline_image_bytes
from glm53.server.jsontext import JSONBody
from glm53.server.metrics import Metrics
from glm53.server.urls import http_url

log = logging.getLogger("glm53.server")

# A request body may pause this long between two of its chunks (a client on a LAN never does); then 408.
BODY_IDLE_S = 30.0

ROUTES = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
          "/v1/responses", "/health", "/ready", "/metrics", "/stats", "/tokenize", "/detokenize", "/api/hello")


class RequestMetrics:
    """Pure ASGI middleware counting requests by route and status and logging every refusal (BaseHTTPMiddleware
    would wrap `receive` and break disconnect detection of streams). Outermost, so the refusals of the other
    middlewares (Host, Origin, Content-Type, body size, API key) are counted and logged too."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path.startswith("/v1/models/"):
            path = "/v1/models/{model}"
        route = path if path in ROUTES or path == "/v1/models/{model}" else "other"
        status = 500
        refused = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, refused
            if message["type"] == "http.response.start":
                status = message["status"]
                refused = status >= 400 and not (status == 503 and path in OPEN_ROUTES)
            elif message["type"] == "http.response.body" and refused:
                refused = False  # an error body is one JSON document, sent whole
                log_refusal(scope, status, message.get("body", b""))
            await send(message)

        counts = self.state.metrics.counts
        counts["in_flight"] += 1
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            counts["in_flight"] -= 1
            self.state.metrics.observe_request(route, status)


class BodyLimit:
    """Refuse a POST body larger than any prompt the context can hold before it is read (by its content-length)
    or as soon as it grows past the limit (chunked): 413, in well under a second, whatever it carries. A body that
    stops arriving for BODY_IDLE_S gets 408: the app reads the whole body before it starts, so a client that
    stalls mid-body would otherwise hold its connection and task forever (glm53.serve.http bounds the headers)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            receive = await self._bounded_body(scope, receive, send)
            if receive is None:
                return
        await self.app(scope, receive, send)

    async def _bounded_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """The receive to hand on (the body replayed), or None once the 413 or 408 was sent."""
        limit, text_limit = self.state.max_body_bytes(), self.state.max_body_bytes(images=False)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await send_error(scope, send, self._too_large(int(length), text_limit))
            await drain(receive)
            return None
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), BODY_IDLE_S)
            except TimeoutError:
                # The rest of the body may still come: closing the connection keeps it from being read as a request.
                await send_error(scope, send, self._stalled(len(body), length), [(b"connection", b"close")])
                return None
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > limit:
                await send_error(scope, send, self._too_large(len(body), text_limit))
                if message.get("more_body", False):
                    await drain(receive)
                return None
            if not message.get("more_body", False):
                break
        # A body may pass the text's room only by the inline image data it carries: the rest must fit that room.
        if len(body) > text_limit and len(body) - inline_image_bytes(bytes(body)) > text_limit:
            await send_error(scope, send, self._too_large(len(body), text_limit))
            return None
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return replay

    @staticmethod
    def _stalled(got: int, length: bytes | None) -> APIError:
        of = f" of the {int(length)} its content-length announced" if length and length.isdigit() else ""
        return APIError(408, f"The request body stopped arriving: no bytes for {BODY_IDLE_S:.0f} s after {got} "
                             f"bytes{of}. Send the whole body without pauses.", code="request_timeout")

    def _too_large(self, size: int, limit: int) -> APIError:
        return APIError(413, f"The request body has {size} bytes, more than the {limit} bytes any prompt that fits "
                             f"this server's context ({self.state.engine.context_length} tokens) can take. Send a "
                             "shorter conversation.", code="request_too_large")


def log_refusal(scope: Scope, status: int, body: bytes) -> None:
    """One line for every request answered with a 4xx or 5xx: the route, the status, the reason the client was
    told, and who the client is (a user whose agent fails reads why here). A 503 from the probes of OPEN_ROUTES
    is not logged: it is the answer a health check polls for while the model loads."""
    try:
        reason = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        reason = body[:200].decode("utf-8", "replace")
    agent = dict(scope.get("headers", [])).get(b"user-agent", b"-").decode("latin-1")
    log.warning("%s %s -> %d: %s [client: %s]", scope.get("method", ""), scope.get("path", ""), status, reason, agent)


# What answers without the key: liveness and readiness probes, and the Prometheus scrape (docs/configuration.md).
OPEN_ROUTES = frozenset({"/health", "/ready", "/metrics", "/", "/api/hello"})


class ApiKeyGate:
    """With GLM53_API_KEY set, every route but OPEN_ROUTES needs 'Authorization: Bearer <key>' (the docs and
    /stats included). Pure ASGI, so the key is checked before the body is read: a client without the key
    learns nothing about what it sent."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    def allowed(self, scope: Scope) -> bool:
        if not self.key or scope.get("path", "") in OPEN_ROUTES:
            return True
        headers = dict(scope.get("headers", []))
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            token = headers.get(b"x-api-key", b"").decode("latin-1")
        return hmac.compare_digest(token.strip().encode("latin-1"), self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <GLM53_API_KEY>' (or 'x-api-key: "
                            "<GLM53_API_KEY>').", code="invalid_api_key")
        await send_error(scope, send, err, [(b"www-authenticate", b"Bearer")])


def _shard_count(engine: Engine) -> int:
    model_dir = getattr(engine, "model_dir", None)
    return len(list(Path(model_dir).glob("*.safetensors"))) if model_dir else 0


async def _in_daemon_thread(fn: Any) -> None:
    """Run fn in a daemon thread and await it. Not asyncio.to_thread: the interpreter joins those at exit, so a
    server stopped mid-load would wait for the whole load and then log the engine's "ready" after shutdown.
    A load abandoned this way dies with the process (nothing it holds outlives it)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(exc: BaseException | None) -> None:
        if not done.done():
            done.set_exception(exc) if exc is not None else done.set_result(None)

    def run() -> None:
        try:
            fn()
            result = None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            result = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server stopped meanwhile
            loop.call_soon_threadsafe(settle, result)

    threading.Thread(target=run, name="glm53-load", daemon=True).start()
    await done


async def _load_in_background(state: ServerState, on_ready: Any) -> None:
    engine = state.engine
    started = time.perf_counter()
    # The launcher-parsed phrasing. The engine loads all shards in one call, so only the ends are reported.
    shards = _shard_count(engine)
    if shards:
        log.info("Loading safetensors checkpoint shards: 0%% Completed | 0/%d", shards)
    try:
        await _in_daemon_thread(engine.load)
    except Exception as exc:  # noqa: BLE001 - reported: every route says 503 with it, and the owner is told
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("model load failed: %s", state.load_error, exc_info=exc)
        if state.on_load_failure is not None:
            state.on_load_failure()
        return
    if shards:
        log.info("Loading safetensors checkpoint shards: 100%% Completed | %d/%d", shards, shards)
    log.info("Loading weights took %.2f s", time.perf_counter() - started)
    on_ready()


def _announce_ready(state: ServerState) -> None:
    s = state.settings
    log.info("Application startup complete")
    url = http_url(getattr(s, "host", "127.0.0.1"), getattr(s, "port", 30000))
    log.info("glm53 ready: serving %s (%s engine, context %d) at %s/v1", state.model_id,
             state.engine.kind, state.engine.context_length, url)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Load an engine that is not ready yet in the background (and close it at shutdown); an engine handed over
    ready is announced at once and left to its owner."""
    state: ServerState = app.state.glm53
    engine = state.engine
    owns = not engine.ready
    loader = None
    if owns:
        loader = asyncio.ensure_future(_load_in_background(state, lambda: _announce_ready(state)))
    else:
        _announce_ready(state)
    try:
        yield
    finally:
        loading = loader is not None and not loader.done()
        if loading:
            # Closing an engine mid-load races the load; the process is about to end, which frees it all.
            loader.cancel()
            log.info("stopped while the model was loading: the load is abandoned")
        elif owns:
            await asyncio.to_thread(engine.close)


def create_app(engine: Engine, settings: Any, *, ping_interval: float | None = None) -> FastAPI:
    """An app serving `engine`. If the engine is not loaded yet, the app loads it at startup (in a worker
    thread) and closes it at shutdown; an engine handed over ready is left to its owner."""
    state = ServerState(engine=engine, settings=settings, metrics=Metrics(engine),
                        model_id=getattr(settings, "model_id", "") or engine.model_id,
                        reasoning_budget=int(getattr(settings, "reasoning_budget", 0) or 0),
                        reasoning_effort=getattr(settings, "reasoning_effort", "high"))
    if ping_interval is not None:
        state.ping_interval = ping_interval
    app = FastAPI(title="glm53", version="0.1.0", lifespan=lifespan, default_response_class=JSONBody,
                  description="OpenAI-compatible API serving GLM-5.3-Flash.")
    app.state.glm53 = state  # what the routes reach through glm53.server.routes.State
    errors.install(app)
    # Each add_middleware wraps what was added before: from the outside in, metrics (every refusal counted and
    # logged), the browser checks (before any body is read), CORS for the allowed origins (preflights carry no
    # key), the body limit, the key.
    app.add_middleware(ApiKeyGate, key=getattr(settings, "api_key", "") or "")
    app.add_middleware(BodyLimit, state=state)
    origins = tuple(getattr(settings, "allowed_origins", ()) or ())
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "HEAD", "POST"],
                           allow_headers=["*"], expose_headers=["Retry-After"], max_age=600)
    app.add_middleware(BrowserGuard, policy=policy_for(origins, getattr(settings, "host", "127.0.0.1")))
    app.add_middleware(RequestMetrics, state=state)
    for router in routes.ROUTERS:
        app.include_router(router)
    return app
