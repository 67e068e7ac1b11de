"""Test helpers for the server: a scripted fake engine (for protocol unit tests only) and a real uvicorn
server on a free loopback port in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import jinja2
import uvicorn

from glm53.engine.interface import ContextLengthExceeded, EngineNotReady, SamplingParams, TokenEvent
from glm53.fixture import tokenizer as gtok
from glm53.serve.http import protocol
from glm53.server import create_app

_SPECIALS = list(gtok.ADDED_TOKENS)
_BASE = 0x110000  # above every code point: specials get ids that no character has


class FakeEngine:
    """Implements the Engine protocol with a character-level tokenizer and scripted replies.

    `script(prompt_text, params) -> str` gives the full reply text (markup included). Each character (or
    markup tag) is one token. An end-of-turn token follows unless max_tokens cuts the reply first."""

    kind = "fake"
    supports_grammar = False

    def __init__(self, script: Callable[[str, SamplingParams], str] | None = None, *, context_length: int = 4096,
                 token_delay: float = 0.0, prefill_delay: float = 0.0, model_id: str = "fake-model") -> None:
        self.script = script or (lambda prompt, params: "Hello there!")
        self.context_length = context_length
        self.token_delay = token_delay
        self.prefill_delay = prefill_delay
        self.model_id = model_id
        self._ready = False
        self._cancelled: set[str] = set()
        self.running: set[str] = set()
        self.generated = 0
        self.prompt_tokens = 0
        self.last_params: SamplingParams | None = None
        self.vocab_size = _BASE + len(_SPECIALS)
        self.capacity: int | None = None  # no queue limit
        env = jinja2.Environment()
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        self._template = env.from_string(gtok.CHAT_TEMPLATE)

    # -- lifecycle --
    @property
    def ready(self) -> bool:
        return self._ready

    def load(self) -> None:
        self._ready = True

    def close(self) -> None:
        self._ready = False

    def fault(self) -> dict | None:
        return getattr(self, "fault_state", None)

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.token_id(t) for t in gtok.EOS_TOKENS]

    # -- text --
    def token_id(self, token: str) -> int | None:
        if token in _SPECIALS:
            return _BASE + _SPECIALS.index(token)
        return ord(token) if len(token) == 1 else None

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for s in _SPECIALS:
                if text.startswith(s, i):
                    ids.append(_BASE + _SPECIALS.index(s))
                    i += len(s)
                    break
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def detokenize(self, ids: list[int]) -> str:
        # Like tokenizers: ids outside the vocabulary decode to nothing.
        return "".join(_SPECIALS[i - _BASE] if i >= _BASE else chr(i) for i in ids if 0 <= i < self.vocab_size)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, enable_thinking: bool = True,
                            add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
        return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     **{**(template_kwargs or {}), "enable_thinking": enable_thinking})

    # -- generation --
    def cancel(self, request_id: str) -> None:
        if request_id in self.running:
            self._cancelled.add(request_id)

    def stats(self) -> dict:
        return {"waiting": 0, "running": len(self.running), "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated, "tokens_per_s": 0.0, "tiers": {"vram": {"hits": 3}}}

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       images: tuple = ()) -> AsyncIterator[TokenEvent]:
        if not self._ready:
            raise EngineNotReady("not loaded")
        if len(prompt_ids) >= self.context_length:
            raise ContextLengthExceeded(len(prompt_ids), self.context_length)
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        self.last_params = params
        self.running.add(request_id)
        self.prompt_tokens += len(prompt_ids)
        try:
            if self.prefill_delay:
                await asyncio.sleep(self.prefill_delay)
            prompt = self.detokenize(prompt_ids)
            reply = self.script(prompt, params)
            ids = self.tokenize(reply) + [self.eos_token_ids[0]]
            limit = min(params.max_tokens or 1 << 30, self.context_length - len(prompt_ids))
            in_think = prompt.rstrip().endswith(gtok.THINK_OPEN)
            think_tokens = 0
            forced: list[int] = []
            out = 0
            while ids or forced:
                if request_id in self._cancelled:
                    return
                is_forced = bool(forced)
                tid = forced.pop(0) if forced else ids.pop(0)
                if in_think and not is_forced:
                    if tid == self.token_id(gtok.THINK_CLOSE):
                        in_think = False
                    elif params.reasoning_budget is not None and think_tokens >= params.reasoning_budget:
                        # Budget spent: inject the end of thinking, drop the rest of the scripted thought.
                        forced = list(params.reasoning_end_ids)
                        close = self.token_id(gtok.THINK_CLOSE)
                        ids = ids[ids.index(close) + 1:] if close in ids else ids
                        if ids and ids[0] == ord("\n"):
                            ids.pop(0)
                        in_think = False
                        tid = forced.pop(0)
                        is_forced = True
                    else:
                        think_tokens += 1
                out += 1
                self.generated += 1
                finish = None
                if tid in params.stop_token_ids and not is_forced:
                    finish = "stop"
                elif out >= limit:
                    finish = "length"
                text = self.detokenize([tid])
                lp, top = (None, None)
                if params.logprobs is not None:
                    lp = -0.5
                    top = [(text, -0.5), ("x", -1.5), ("y", -2.5)][: params.logprobs]
                yield TokenEvent(tid, text, text, lp, top, finish, is_forced)
                if finish:
                    return
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                else:
                    await asyncio.sleep(0)
        finally:
            self.running.discard(request_id)
            self._cancelled.discard(request_id)


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread, through the HTTP protocol `glm53 serve`
    uses (glm53.serve.http.protocol(), or `http`: one with another deadline or base)."""

    def __init__(self, app, log_level: str = "warning", http: type | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=2,
                                http=http or protocol())
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self.sock.close()


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def server_settings(**env: str):
    """Server settings from GLM53_* values (no environment, no .env file)."""
    from glm53.planning import settings as S

    return S.load(environ={f"GLM53_{k.upper()}": str(v) for k, v in env.items()}, dotenv=None)


@contextlib.contextmanager
def loaded_and_served(engine, **env: str) -> Iterator[ServerThread]:
    """`engine` loaded and served over real HTTP (as `.engine`) with the given settings; closed afterwards."""
    engine.load()
    try:
        with ServerThread(create_app(engine, server_settings(**env))) as srv:
            srv.engine = engine
            yield srv
    finally:
        engine.close()


def variant_engine(request, tmp_path_factory) -> Iterator:
    """For a fixture parametrized over the two chat-template variants: the session's loaded engine on the
    GLM-5.3-shaped template, or a loaded one on the GLM-4.5-shaped template (closed afterwards)."""
    if request.param == "glm53":
        yield request.getfixturevalue("reference_engine")
        return
    from conftest import make_test_engine

    engine = make_test_engine(request.getfixturevalue("hf_model_dir_glm45"), tmp_path_factory, "glm45")
    engine.load()
    yield engine
    engine.close()


# Tool argument schemas for the agent-format suites. Bounded values: the grammar keeps a random-weight model's
# arguments to what the schema allows, so a call completes within a few dozen tokens.
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"type": "string", "enum": ["c", "f"]}},
                  "required": ["city"]}
RUN_TESTS_PARAMS = {"type": "object", "additionalProperties": False,
                    "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 10},
                                   "verbose": {"type": "boolean"},
                                   "repeat": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["path", "repeat"]}
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}


def serve_variant(request, tmp_path_factory, **env: str) -> Iterator[ServerThread]:
    """For a module fixture parametrized over the two template variants: a server on variant_engine's engine
    (as `.engine`), with the given settings."""
    for engine in variant_engine(request, tmp_path_factory):
        with ServerThread(create_app(engine, server_settings(**env))) as srv:
            srv.engine = engine
            yield srv
