"""`glm53 bench stream`: tokens/s generated inside the engine vs tokens/s delivered to a streaming HTTP
client, measured in the same run.

The engine side is sampled from engine.stats()["generated_tokens"] by a thread polling every millisecond,
so it times tokens when the engine produced them, not when the server got round to reading them (a slow
server would otherwise slow both clocks and hide itself). The client side times SSE chunks as an OpenAI
streaming client receives them over a real loopback socket. Both rates are (N - 1) / (time of token N -
time of token 1).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

TARGET_RATIO = 0.98


class StatsSampler:
    """Timestamps of the engine's generated-token counter, sampled in a background thread."""

    def __init__(self, engine: Any, period_s: float = 0.001) -> None:
        self.engine = engine
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="glm53-bench-sampler", daemon=True)

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            count = int(self.engine.stats().get("generated_tokens", 0))
            if count != last:
                self.samples.append((time.perf_counter(), count))
                last = count
            time.sleep(self.period_s)

    def __enter__(self) -> StatsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def time_of(self, count: int) -> float:
        """When the counter first reached `count`."""
        counts = [c for _, c in self.samples]
        i = bisect.bisect_left(counts, count)
        if i == len(counts):
            raise ValueError(f"the engine counter never reached {count}")
        return self.samples[i][0]


@dataclass
class StreamRun:
    tokens: int
    engine_tps: float
    client_tps: float

    @property
    def ratio(self) -> float:
        return self.client_tps / self.engine_tps if self.engine_tps else 0.0


class BackgroundServer:
    """uvicorn on 127.0.0.1:<free port> in a thread (the benchmark's server is the real one)."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the benchmark server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        with contextlib.suppress(OSError):
            self.sock.close()


def stream_once(url: str, engine: Any, model_id: str, max_tokens: int) -> StreamRun:
    body = {"model": model_id, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    tokens = 0
    base = int(engine.stats().get("generated_tokens", 0))
    with StatsSampler(engine) as sampler, httpx.Client(timeout=600) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                frame = json.loads(line[6:])
                if "error" in frame:
                    raise RuntimeError(frame["error"]["message"])
                if frame["choices"]:
                    arrivals.append(now)
                elif frame.get("usage"):
                    tokens = frame["usage"]["completion_tokens"]
        time.sleep(0.01)  # let the sampler see the final count
    if tokens < 3 or len(arrivals) < 3:
        raise RuntimeError(f"too few tokens streamed ({tokens}) to measure a rate")
    engine_span = sampler.time_of(base + tokens) - sampler.time_of(base + 1)
    client_span = arrivals[-1] - arrivals[0]
    return StreamRun(tokens, (tokens - 1) / engine_span, (tokens - 1) / client_span)


def run_stream_bench(engine: Any, settings: Any, *, max_tokens: int, runs: int) -> list[StreamRun]:
    from glm53.server.app import create_app

    app = create_app(engine, settings)
    results = []
    with BackgroundServer(app) as srv:
        stream_once(srv.url, engine, settings.model_id, 8)  # warm-up: first-request costs are not streaming
        for _ in range(runs):
            results.append(stream_once(srv.url, engine, settings.model_id, max_tokens))
    return results


def report(results: list[StreamRun]) -> tuple[str, bool]:
    lines = []
    for i, r in enumerate(results, 1):
        lines.append(f"run {i}: {r.tokens} tokens: engine {r.engine_tps:.1f} tok/s generated, client "
                     f"{r.client_tps:.1f} tok/s delivered, ratio {r.ratio:.3f}")
    ratio = statistics.median(r.ratio for r in results)
    ok = ratio >= TARGET_RATIO
    lines.append(f"stream ratio (median of {len(results)}): {ratio:.3f} (target >= {TARGET_RATIO}) "
                 f"{'PASS' if ok else 'FAIL'}")
    return "\n".join(lines), ok
