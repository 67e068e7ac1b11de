"""Prometheus metrics (`glm53_*`, named after the vllm:* series dashboards already chart) and the server
counters that /stats reports next to engine.stats().

Each app gets its own CollectorRegistry, so several apps (tests) can live in one process. Engine-side
numbers (running/waiting requests, tier counters) are read from engine.stats() at scrape time rather than
mirrored, so they cannot drift from what the engine reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from glm53.engine.interface import Engine

# The *_created series double the scrape size and no dashboard reads them.
disable_created_metrics()

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
E2E_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 2400)


def _flatten(prefix: tuple[str, ...], value: Any, out: list[tuple[tuple[str, ...], float]]) -> None:
    if isinstance(value, bool):
        out.append((prefix, float(value)))
    elif isinstance(value, int | float):
        out.append((prefix, float(value)))
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(prefix + (str(k),), v, out)


# (engine.stats() key, metric name after glm53_, help). Counters since start are exposed as gauges too: they are
# read from the engine at scrape time (a Counter would have to mirror them).
ENGINE_GAUGES = (
    ("running", "num_requests_running", "Requests being decoded."),
    ("waiting", "num_requests_waiting", "Requests waiting: queued for a decode slot, or admitted and waiting for KV "
                                        "cache pages."),
    ("waiting_for_kv", "num_requests_waiting_for_kv", "Of the waiting requests, those waiting for KV cache pages."),
    ("max_waiting", "max_requests_waiting", "Waiting requests allowed before 429 (GLM53_MAX_QUEUE; 0: no limit)."),
    ("requests_refused_queue_full", "requests_refused_queue_full",
     "Requests answered 429 because the waiting queue was full."),
    ("requests_preempted", "requests_preempted",
     "Times a request gave its KV pages to an older one and went back to waiting."),
    ("requests_failed_out_of_memory", "requests_failed_out_of_memory", "Requests that failed: the device ran out."),
    ("prompt_tokens", "engine_prompt_tokens", "Prompt tokens of the requests the engine started."),
    ("prompt_tokens_cached", "prefix_cache_tokens", "Of those, prompt tokens served from the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hit_requests", "Requests that reused more than 0 prompt tokens."),
    ("tokens_per_s", "engine_tokens_per_second", "Recent engine decode rate."),
)
KV_GAUGES = (
    ("pages", "kv_cache_pages", "KV cache size in pages (engine.stats()['kv_cache']['page_tokens'] tokens each)."),
    ("pages_used", "kv_cache_pages_used", "KV cache pages held by requests."),
    ("pages_evicted", "kv_cache_pages_evicted", "Cached (reusable) KV pages given up for room since start."),
    ("recurrent_checkpoints_evicted", "recurrent_checkpoints_evicted",
     "Recurrent-state checkpoints dropped from the RAM cache since start (exllamav3's prefix reuse of KDA layers)."),
)

DECODE_GAUGES = (
    ("tok_s_per_stream", "decode_tokens_per_second_per_stream",
     "Measured decode rate of one stream (recent gaps between a request's sampled tokens)."),
    ("forecast_tok_s", "decode_forecast_tokens_per_second", "The plan's forecast decode rate for the engine's mode."),
)


class EngineCollector:
    """Gauges read from engine.stats() on each scrape."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is mid-load
            stats = {}
        for key, name, help_ in ENGINE_GAUGES:
            yield GaugeMetricFamily(f"glm53_{name}", help_, value=float(stats.get(key) or 0))
        kv = stats.get("kv_cache") or {}
        for key, name, help_ in KV_GAUGES:
            if key in kv:
                yield GaugeMetricFamily(f"glm53_{name}", help_, value=float(kv[key] or 0))
        yield GaugeMetricFamily("glm53_engine_ready", "1 once the model is loaded.", value=float(self.engine.ready))
        decode = stats.get("decode") or {}
        for key, name, help_ in DECODE_GAUGES:
            if decode.get(key) is not None:
                yield GaugeMetricFamily(f"glm53_{name}", help_, value=float(decode[key]))
        flat: list[tuple[tuple[str, ...], float]] = []
        _flatten((), stats.get("tiers") or {}, flat)
        fam = GaugeMetricFamily("glm53_engine_tier", "Engine tier counters from engine.stats()['tiers'].",
                                labels=["tier", "stat"])
        for path, value in flat:
            tier = path[0] if len(path) > 1 else ""
            stat = "_".join(path[1:]) if len(path) > 1 else path[0]
            fam.add_metric([tier, stat], value)
        yield fam


class Metrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("glm53_requests", "HTTP requests by route and status.", ["route", "status"],
                                registry=r)
        self.prompt_tokens = Counter("glm53_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("glm53_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("glm53_time_to_first_token_seconds", "Request arrival to first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("glm53_time_per_output_token_seconds",
                              "Mean time between generated tokens, per request.", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("glm53_e2e_request_latency_seconds", "Request arrival to last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.disconnects = Counter("glm53_client_disconnects", "Generations cancelled because the client left.",
                                   registry=r)
        r.register(EngineCollector(engine))
        self.started = time.time()
        # Plain numbers for /stats (reading them back out of prometheus objects is clumsy).
        self.counts = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0, "client_disconnects": 0,
                       "in_flight": 0, "errors": 0}

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()
        self.counts["requests"] += 1
        if status >= 400:
            self.counts["errors"] += 1

    def observe_generation(self, *, arrived: float, prompt_tokens: int, completion_tokens: int,
                           first_token_at: float | None, last_token_at: float | None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.counts["prompt_tokens"] += prompt_tokens
        self.counts["generation_tokens"] += completion_tokens
        if first_token_at is not None:
            self.ttft.observe(max(0.0, first_token_at - arrived))
        if last_token_at is not None:
            self.e2e.observe(max(0.0, last_token_at - arrived))
            if first_token_at is not None and completion_tokens > 1:
                self.tpot.observe((last_token_at - first_token_at) / (completion_tokens - 1))

    def observe_disconnect(self) -> None:
        self.disconnects.inc()
        self.counts["client_disconnects"] += 1

    def server_stats(self) -> dict[str, Any]:
        return {**self.counts, "uptime_s": round(time.time() - self.started, 1)}

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
