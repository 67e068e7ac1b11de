"""The server under an HTTP benchmark (`glm53 bench agent`, `glm53 bench serve`): one already running (--url), or a
`glm53 serve` this process starts, waits for and stops; and one streamed request timed as a client sees it.

A self-started server is a real subprocess on a free loopback port, with the bench's --model / --mode / --store
passed as the GLM53_* settings `glm53 serve` reads, so the numbers are those of the command users run.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


class BenchError(RuntimeError):
    """What stops an HTTP benchmark, worded for its user (the server's log tail included where it helps)."""


@dataclass
class Server:
    url: str  # http://host:port, no trailing slash, no /v1
    api_key: str
    model_id: str
    context_length: int
    log_path: Path | None = None  # a self-started server's log

    def client(self, timeout: float) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=timeout)

    def stats(self) -> dict[str, Any] | None:
        """/stats where the server has one (glm53's), else None."""
        try:
            r = httpx.get(self.url + "/stats", headers=self.headers(), timeout=30)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def count_tokens(self, text: str) -> int | None:
        """Tokens of raw `text` by the server's own tokenizer (glm53's /tokenize), else None."""
        ids = self.tokenize({"prompt": text, "add_special_tokens": False})
        return None if ids is None else len(ids)

    def tokenize(self, body: dict[str, Any]) -> list[int] | None:
        try:
            r = httpx.post(self.url + "/tokenize", json=body, headers=self.headers(), timeout=120)
        except httpx.HTTPError:
            return None
        return r.json()["tokens"] if r.status_code == 200 else None

    def headers(self) -> dict[str, str]:
        """The request headers its API key needs (none without one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join("  | " + x for x in text)


def _describe(url: str, api_key: str) -> tuple[str, int]:
    """The served model's id and context window, from /v1/models (max_model_len: vLLM's and glm53's field)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    if r.status_code == 401:
        raise BenchError(f"{url} wants an API key: pass --api-key (or set GLM53_API_KEY)")
    r.raise_for_status()
    card = r.json()["data"][0]
    return str(card["id"]), int(card.get("max_model_len") or 0)


def _wait_ready(url: str, proc: subprocess.Popen | None, log_path: Path | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"`glm53 serve` exited with status {proc.returncode} before it was ready:\n"
                             f"{_tail(log_path)}")
        try:
            r = httpx.get(url + "/ready", timeout=5)
            if r.status_code == 200:
                return
            last = r.text[:200]
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.25)
    raise BenchError(f"{url} was not ready after {timeout_s:.0f} s (last answer: {last}); a large checkpoint "
                     f"may need a longer --ready-timeout\n{_tail(log_path)}")


@dataclass
class ServeOptions:
    url: str | None = None
    api_key: str = ""
    model: str | None = None  # checkpoint dir for a self-started server; None: the settings' (else the demo)
    mode: str | None = None
    store: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # further GLM53_* settings for a self-started server
    emulation: dict[str, Any] | None = None  # glm53.bench.emulate.to_json: the self-started server's emulated host
    ready_timeout_s: float = 900.0
    log_dir: Path | None = None


@contextlib.contextmanager
def served(opts: ServeOptions, log: Any = print) -> Iterator[Server]:
    """The server the benchmark talks to, ready; a self-started one is stopped on the way out."""
    if opts.url:
        url = opts.url.rstrip("/").removesuffix("/v1")
        _wait_ready(url, None, None, opts.ready_timeout_s)
        model_id, context = _describe(url, opts.api_key)
        yield Server(url, opts.api_key, model_id, context)
        return
    port = _free_port()
    env = {**os.environ, **opts.env, "GLM53_HOST": "127.0.0.1", "GLM53_PORT": str(port)}
    for key, value in (("GLM53_MODEL_DIR", opts.model), ("GLM53_MODE", opts.mode), ("GLM53_STORE", opts.store)):
        if value:
            env[key] = value
    env["GLM53_API_KEY"] = ""  # loopback: the bench's own server needs none (a key in .env is overridden)
    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="glm53-bench-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "serve.log"
    url = f"http://127.0.0.1:{port}"
    log(f"starting `glm53 serve` on {url} ({'model ' + opts.model if opts.model else 'settings model or demo'}"
        f"{', mode ' + opts.mode if opts.mode else ''}); log: {log_path}")
    t0 = time.perf_counter()
    with open(log_path, "w") as out:
        command = [sys.executable, "-m", "glm53", "serve"] if not opts.emulation else [
            sys.executable, "-m", "glm53.bench.emulated_serve", json.dumps(opts.emulation)]
        proc = subprocess.Popen(command, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_ready(url, proc, log_path, opts.ready_timeout_s)
        log(f"server ready in {time.perf_counter() - t0:.1f} s")
        model_id, context = _describe(url, "")
        yield Server(url, "", model_id, context, log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@dataclass
class Streamed:
    """One streamed request as its client saw it."""

    ttft_s: float  # request sent -> first generated text (reasoning, content or a tool-call delta)
    last_s: float  # request sent -> the frame that carried the finish reason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens; None where the server omits it
    finish_reason: str | None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def decode_tps(self) -> float:
        """Tokens after the first over the time after the first (the first token's time is the TTFT's)."""
        span = self.last_s - self.ttft_s
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 else 0.0


def _usage(streamed: Streamed, usage: Any) -> None:
    streamed.prompt_tokens = int(usage.prompt_tokens)
    streamed.completion_tokens = int(usage.completion_tokens)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    streamed.cached_tokens = None if cached is None else int(cached)


@contextlib.contextmanager
def _refusals(route: str) -> Iterator[None]:
    """The server's refusals (a 400 naming the problem, a connection lost) as the bench's own error."""
    import openai

    try:
        yield
    except openai.APIStatusError as exc:
        raise BenchError(f"{route} answered {exc.status_code}: {exc.message}") from None
    except openai.APIError as exc:
        raise BenchError(f"{route} failed: {exc}") from None


def stream_chat(client: Any, **request: Any) -> Streamed:
    """POST /v1/chat/completions streamed, timing the first generated delta and the finish."""
    with _refusals("/v1/chat/completions"):
        return _stream_chat(client, **request)


def _stream_chat(client: Any, **request: Any) -> Streamed:
    got = Streamed(0.0, 0.0, 0, 0, None, None)
    calls: dict[int, dict[str, Any]] = {}
    t0 = time.perf_counter()
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request)
    for chunk in stream:
        now = time.perf_counter() - t0
        if chunk.usage is not None:
            _usage(got, chunk.usage)
        for choice in chunk.choices:
            d = choice.delta
            reasoning = getattr(d, "reasoning_content", None) or ""
            if d.content or reasoning or d.tool_calls:
                got.ttft_s = got.ttft_s or now
                got.content += d.content or ""
                got.reasoning += reasoning
                for tc in d.tool_calls or []:
                    call = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                       "function": {"name": "", "arguments": ""}})
                    call["id"] = tc.id or call["id"]
                    if tc.function is not None:
                        call["function"]["name"] += tc.function.name or ""
                        call["function"]["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                got.finish_reason = choice.finish_reason
                got.last_s = now
                got.ttft_s = got.ttft_s or now  # a reply with no text at all (an immediate end of turn)
    got.tool_calls = [calls[i] for i in sorted(calls)]
    if got.finish_reason is None:
        raise BenchError("the stream ended without a finish reason")
    return got


def stream_completion(client: Any, **request: Any) -> Streamed:
    """POST /v1/completions streamed, timed like stream_chat."""
    with _refusals("/v1/completions"):
        return _stream_completion(client, **request)


def _stream_completion(client: Any, **request: Any) -> Streamed:
    got = Streamed(0.0, 0.0, 0, 0, None, None)
    t0 = time.perf_counter()
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **request):
        now = time.perf_counter() - t0
        if chunk.usage is not None:
            _usage(got, chunk.usage)
        for choice in chunk.choices:
            if choice.text:
                got.ttft_s = got.ttft_s or now
                got.content += choice.text
            if choice.finish_reason:
                got.finish_reason = choice.finish_reason
                got.last_s = now
                got.ttft_s = got.ttft_s or now
    if got.finish_reason is None:
        raise BenchError("the stream ended without a finish reason")
    return got
