"""The engines' shared request path (glm53.engine.worker), on a scripted engine: no model, no tokenizer files.

The script engine emits token 10, 11, 12, ... for every request, one per worker pass, and can be held between
passes, which makes queueing, cancellation and shutdown observable without timing luck.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field

import pytest

from glm53.engine.detok import IncrementalDetokenizer
from glm53.engine.interface import (
    ContextLengthExceeded,
    Engine,
    EngineNotReady,
    GrammarUnsupported,
    QueueFull,
    SamplingParams,
    TokenEvent,
)
from glm53.engine.worker import END, Request, WorkerEngine

THINK_OPEN, THINK_CLOSE = 3, 4


class ScriptTokenizer:
    """Token i decodes to chr(ord('a') + i % 26); enough of tokenizers.Tokenizer for the worker."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False):
        return type("Encoding", (), {"ids": [ord(c) - ord("a") for c in text]})()

    def token_to_id(self, token: str) -> int | None:
        return None


@dataclass(eq=False, kw_only=True)
class ScriptRequest(Request):
    released: bool = False
    log: list = field(default_factory=list)


class ScriptEngine(WorkerEngine):
    kind = "script"
    supports_grammar = False
    no_grammar_reason = "no grammar here"

    def __init__(self, max_running: int = 2, context_length: int = 64) -> None:
        super().__init__("/nonexistent", model_id="script", context_length=context_length, max_running=max_running)
        self._tok = ScriptTokenizer()
        self._n_vocab = 100
        self._think_open, self._think_close = THINK_OPEN, THINK_CLOSE
        self.gate = threading.Event()  # cleared: the worker waits before each pass
        self.gate.set()
        self.steps: threading.Semaphore | None = None  # set: one pass per release()
        self.loaded = False

    @property
    def ready(self) -> bool:
        return self.loaded and self._worker_alive()

    def load(self) -> None:
        self.loaded = True
        self._start_worker("script-engine")

    def close(self) -> None:
        self.gate.set()
        steps, self.steps = self.steps, None
        if steps is not None:
            steps.release()
        self._stop_worker(timeout=5)

    def _new_request(self, **fields) -> ScriptRequest:
        return ScriptRequest(**fields)

    def _worker(self) -> None:
        while (batch := self._admit()) is not None:
            self.gate.wait()
            if self.steps is not None:
                self.steps.acquire()
            for req in batch.new:
                self._count_prompt(len(req.prompt))
            for req in batch.running:
                if req.cancelled:
                    self._retire(req, "requests_cancelled", END)
                    continue
                event = self._token_event(req, 10 + len(req.generated), None)
                if event.finish_reason is not None:
                    self._retire(req, "requests_finished", event)
                else:
                    req.emit(event)

    def _release(self, req: ScriptRequest) -> None:
        req.released = True


@pytest.fixture
def engine():
    eng = ScriptEngine()
    eng.load()
    yield eng
    eng.close()


async def collect(eng, prompt, params, request_id="r") -> list:
    return [ev async for ev in eng.generate(prompt, params, request_id)]


def wait_for(cond, timeout: float = 5.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.005)):
        if cond():
            return
        done.wait(0.005)
    raise AssertionError("condition not reached")


def test_a_generation_streams_counts_and_finishes_by_length(engine) -> None:
    assert isinstance(engine, Engine)
    events = asyncio.run(collect(engine, [1, 2], SamplingParams(max_tokens=3)))
    assert all(isinstance(e, TokenEvent) for e in events) and [e.token_id for e in events] == [10, 11, 12]
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert "".join(e.text for e in events) == "klm" and [e.token_text for e in events] == ["k", "l", "m"]
    wait_for(lambda: engine.stats()["running"] == 0)
    stats = engine.stats()
    assert stats["requests_total"] == stats["requests_finished"] == 1
    assert stats["prompt_tokens"] == 2 and stats["generated_tokens"] == 3 and stats["tokens_per_s"] > 0
    assert list(stats)[:5] == ["kind", "model_id", "context_length", "waiting", "running"] and stats["tiers"] == {}


def test_the_context_caps_max_tokens(engine) -> None:
    events = asyncio.run(collect(engine, list(range(60)), SamplingParams()))
    assert len(events) == 4 and events[-1].finish_reason == "length"  # 64 - 60


def test_a_stop_token_ends_with_the_held_text_and_adds_none_itself(engine) -> None:
    events = asyncio.run(collect(engine, [1], SamplingParams(max_tokens=10, stop_token_ids=[12])))
    assert [e.token_id for e in events] == [10, 11, 12]
    assert events[-1].finish_reason == "stop" and events[-1].text == ""


def test_requests_are_refused_before_they_queue() -> None:
    eng = ScriptEngine(context_length=8)
    with pytest.raises(EngineNotReady):
        asyncio.run(collect(eng, [1], SamplingParams()))
    eng.load()
    try:
        for prompt, params, exc in [
            ([1], SamplingParams(grammar='start: "x"'), GrammarUnsupported),
            ([1], SamplingParams(top_p=2.0), ValueError),
            ([], SamplingParams(), ValueError),
            (list(range(8)), SamplingParams(), ContextLengthExceeded),
            ([100], SamplingParams(), ValueError),
        ]:
            with pytest.raises(exc):
                asyncio.run(collect(eng, prompt, params))
        assert eng.stats()["requests_total"] == 0
    finally:
        eng.close()


def test_budget_spent_and_reasoning_accounting() -> None:
    eng = ScriptEngine()
    req = ScriptRequest(request_id="x", prompt=[THINK_OPEN], params=SamplingParams(reasoning_budget=2), max_new=9,
                        stop_ids=frozenset(), emit=lambda item: None,
                        detok=IncrementalDetokenizer(ScriptTokenizer().decode), in_reasoning=True,
                        reasoning_end=THINK_CLOSE)
    assert not req.budget_spent
    eng._token_event(req, 20, None)
    eng._token_event(req, 21, None, forced=True)  # forced tokens are not reasoning
    assert req.reasoning_tokens == 1 and not req.budget_spent
    eng._token_event(req, 22, None)
    assert req.budget_spent
    eng._token_event(req, THINK_CLOSE, None)  # sampling the close token leaves reasoning by itself
    assert not req.in_reasoning and not req.budget_spent and req.reasoning_tokens == 2
    assert req.generated == [20, 21, 22, THINK_CLOSE]
    unlimited = ScriptRequest(**{**req.__dict__, "params": SamplingParams(), "in_reasoning": True})
    assert not unlimited.budget_spent


def test_cancelling_a_waiting_request_drops_it_at_once(engine) -> None:
    async def run() -> tuple[list, list]:
        engine.gate.clear()
        first = asyncio.ensure_future(collect(engine, [1], SamplingParams(max_tokens=2), "a"))
        second = asyncio.ensure_future(collect(engine, [1], SamplingParams(max_tokens=2), "b"))
        third = asyncio.ensure_future(collect(engine, [1], SamplingParams(max_tokens=2), "c"))
        await asyncio.sleep(0.05)
        assert engine.stats()["waiting"] == 1 and engine.stats()["running"] == 2  # max_running 2
        engine.cancel("c")
        engine.cancel("unknown")  # ignored
        dropped = await third
        assert engine.stats()["requests_cancelled"] == 1
        engine.gate.set()
        return dropped, [await first, await second]

    dropped, done = asyncio.run(run())
    assert dropped == [] and [len(d) for d in done] == [2, 2]


def test_closing_the_iterator_cancels_and_releases_a_running_request(engine) -> None:
    async def run() -> ScriptRequest:
        engine.steps = threading.Semaphore(1)  # one pass, one token, then the worker holds
        agen = engine.generate([1], SamplingParams(max_tokens=50), "r")
        await agen.__anext__()
        req = engine._by_id["r"]
        await agen.aclose()
        assert req.cancelled and not req.done
        engine.steps.release()
        return req

    req = asyncio.run(run())
    wait_for(lambda: req.done)
    assert req.released and engine.stats()["requests_cancelled"] == 1 and "r" not in engine._by_id


def test_a_request_id_in_flight_is_refused(engine) -> None:
    async def run() -> None:
        engine.gate.clear()
        first = asyncio.ensure_future(collect(engine, [1], SamplingParams(max_tokens=1), "same"))
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="already in flight"):
            await collect(engine, [1], SamplingParams(max_tokens=1), "same")
        engine.gate.set()
        assert len(await first) == 1
        assert len(await collect(engine, [1], SamplingParams(max_tokens=1), "same")) == 1  # free again

    asyncio.run(run())


def test_close_fails_what_is_in_flight_with_engine_not_ready() -> None:
    eng = ScriptEngine(max_running=1)
    eng.load()

    async def run() -> list:
        eng.gate.clear()
        tasks = [asyncio.ensure_future(collect(eng, [1], SamplingParams(max_tokens=5), f"r{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        await asyncio.to_thread(eng.close)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(run())
    assert all(isinstance(r, EngineNotReady) for r in results)
    assert not eng.ready and eng._by_id == {}


def test_an_emit_after_the_consumers_loop_closed_marks_the_request_cancelled(engine) -> None:
    async def start() -> ScriptRequest:
        engine.gate.clear()
        agen = engine.generate([1], SamplingParams(max_tokens=5), "orphan")
        task = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0.01)
        req = engine._by_id["orphan"]
        task.cancel()
        return req

    loop = asyncio.new_event_loop()
    req = loop.run_until_complete(start())
    loop.close()
    req.cancelled = False  # as if the consumer never got to cancel it: only the closed loop tells
    req.emit("anything")
    assert req.cancelled
    engine.gate.set()


def test_a_full_waiting_queue_refuses_at_once_and_frees_as_slots_do(engine) -> None:
    """max_waiting (GLM53_MAX_QUEUE): with every slot taken and the queue full, a request is refused at once
    (QueueFull: the server's 429) rather than waiting unseen; once the queue drains, requests are taken again."""
    engine.max_waiting = 1

    async def run() -> list:
        engine.gate.clear()
        held = [asyncio.ensure_future(collect(engine, [1], SamplingParams(max_tokens=2), r)) for r in "abc"]
        await asyncio.sleep(0.05)
        assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 1
        with pytest.raises(QueueFull, match="GLM53_MAX_QUEUE"):
            await collect(engine, [1], SamplingParams(max_tokens=2), "d")
        assert engine.stats()["requests_refused_queue_full"] == 1 and engine.stats()["max_waiting"] == 1
        engine.gate.set()
        done = [await h for h in held]
        done.append(await collect(engine, [1], SamplingParams(max_tokens=2), "e"))  # room again
        return done

    assert [len(d) for d in asyncio.run(run())] == [2, 2, 2, 2]


def test_a_full_queue_is_a_429_with_retry_after_over_http_in_each_apis_shape() -> None:
    """Through a real server: the refused request gets OpenAI's 429 (Anthropic's rate_limit_error on its route)
    with Retry-After, at once, and /metrics shows the queue and the refusals."""
    import httpx
    from server_support import ServerThread, server_settings

    from glm53.engine.interface import QueueFull as QF
    from glm53.server.app import create_app
    from glm53.server.errors import body_for, from_engine_error

    eng = ScriptEngine(max_running=1)
    eng.load()
    eng.max_waiting = 1
    eng.gate.clear()  # nothing decodes: the first request holds the slot, the second waits
    try:
        with ServerThread(create_app(eng, server_settings(model_id="script"))) as srv:
            body = {"model": "script", "prompt": "ab", "max_tokens": 2}
            held = [threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",),
                                     kwargs={"json": body, "timeout": 30}) for _ in range(2)]
            for t in held:
                t.start()
            wait_for(lambda: eng.stats()["running"] + eng.stats()["waiting"] == 2)
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=10)
            assert r.status_code == 429 and r.headers["retry-after"] == "2", r.text
            err = r.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
            assert "GLM53_MAX_QUEUE" in err["message"]
            metrics = httpx.get(srv.url + "/metrics").text
            assert "glm53_max_requests_waiting 1.0" in metrics and "glm53_requests_refused_queue_full 1.0" in metrics
            eng.gate.set()
            for t in held:
                t.join(30)
    finally:
        eng.gate.set()
        eng.close()
    shaped = body_for("/v1/messages", from_engine_error(QF(1, 1)))
    assert shaped["type"] == "error" and shaped["error"]["type"] == "rate_limit_error"


def test_a_client_that_leaves_the_full_queue_frees_its_place_at_once() -> None:
    """With the slot taken and the one waiting place held, a third request is refused; once the waiting client
    disconnects its place is free again (not when the running request ends), so the next request is queued."""
    import httpx
    from server_support import ServerThread, server_settings

    from glm53.server.app import create_app

    eng = ScriptEngine(max_running=1)
    eng.load()
    eng.max_waiting = 1
    eng.gate.clear()  # nothing decodes: the first request holds the slot for the whole test
    body = {"model": "script", "prompt": "ab", "max_tokens": 2}
    try:
        with ServerThread(create_app(eng, server_settings(model_id="script"))) as srv:
            running = threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",),
                                       kwargs={"json": body, "timeout": 30})
            running.start()
            wait_for(lambda: eng.stats()["running"] == 1)

            def leaves() -> None:
                with contextlib.suppress(httpx.ReadTimeout):
                    httpx.post(srv.url + "/v1/completions", json=body, timeout=1.0)

            waiter = threading.Thread(target=leaves)
            waiter.start()
            wait_for(lambda: eng.stats()["waiting"] == 1)
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=10).status_code == 429
            waiter.join(10)  # its client gave up: the server drops it from the queue
            wait_for(lambda: eng.stats()["waiting"] == 0, timeout=5)
            assert eng.stats()["running"] == 1 and eng.stats()["requests_cancelled"] == 1
            queued = threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",),
                                      kwargs={"json": body, "timeout": 30})
            queued.start()
            wait_for(lambda: eng.stats()["waiting"] == 1)  # taken, not refused
            eng.gate.set()
            running.join(30)
            queued.join(30)
    finally:
        eng.gate.set()
        eng.close()
